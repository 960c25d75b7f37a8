"""Per-tenant shares of the prefix cache and the eviction order they give: whose entry goes next.

A share is a guaranteed fraction of the pool for an owner group (the engine's groups being tenants); groups without
one split what the shares leave, equally. Expired entries go first; then the group furthest over its guarantee gives
up its own (without shares: the group holding the most), so a tenant flooding the cache evicts its own entries, not
others' below their share.
"""
import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Iterable


def guarantees(held: Counter, shares: dict[Hashable, float], capacity: int) -> dict[Hashable, float]:
    """Guaranteed units of `capacity` (pages, slots) of each group holding any: its share, or an equal part of the
    rest."""
    free = [g for g in held if g not in shares]
    rest = capacity * (1 - sum(shares.values())) / max(len(free), 1)
    return {g: capacity * shares[g] if g in shares else rest for g in held}


class Victims:
    """Evictable entries by owner, each owner's as a heap of ranks: tuples whose first item is 0 for an expired
    entry, which goes before any share is weighed. pop() takes from the owner furthest over its group's guarantee;
    `using` adds the pages each owner holds outside the cache (its running sequences'), and for an owner `asking`
    for room, no unexpired entry of another group at or under its guarantee goes (pop() returns None)."""

    def __init__(self, held: Counter, shares: dict[Hashable, float], group: Callable[[Hashable], Hashable],
                 capacity: int, ranks: Iterable[tuple[Hashable, tuple]], using: Counter | None = None,
                 asking: Hashable | None = None):
        self.group, self.asking = group, None if asking is None else group(asking)
        self.held: Counter = Counter()  # pages by group
        for owner, n in [*held.items(), *(using or {}).items()]:
            self.held[group(owner)] += n
        self.guaranteed = guarantees(self.held, shares, capacity)
        self.heaps: dict[Hashable, list] = {}
        for owner, rank in ranks:
            self.heaps.setdefault(owner, []).append(rank)
        for heap in self.heaps.values():
            heapq.heapify(heap)

    def __bool__(self) -> bool:
        return bool(self.heaps)

    def push(self, owner: Hashable, rank: tuple) -> None:
        heapq.heappush(self.heaps.setdefault(owner, []), rank)

    def pop(self) -> tuple[Hashable, tuple] | None:
        """The next victim's owner and rank (the caller checks that it may still go, then calls took)."""
        heaps, group = self.heaps, self.group
        may = [o for o in heaps if self.asking is None or heaps[o][0][0] == 0 or group(o) == self.asking or
               self.held[group(o)] > self.guaranteed[group(o)]]
        if not may:
            return None
        owner = min(may, key=lambda o: (heaps[o][0][0], self.guaranteed[group(o)] - self.held[group(o)]))
        rank = heapq.heappop(heaps[owner])
        if not heaps[owner]:
            del heaps[owner]
        return owner, rank

    def took(self, owner: Hashable, pages: int) -> None:
        self.held[self.group(owner)] -= pages
