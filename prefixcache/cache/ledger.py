"""Which blocks a tier holds: an index under a byte budget, each entry with an expiry. Room is made from the owner
holding the most bytes, least recently used first: an owner flooding the tier with unique prompts turns over its own
entries, never another's below an equal part of the budget.

L2 (disk.py) keeps its files' index here, and the capacity planner (bench/plan_tiers.py) models L2 and L3 with it
alone, no bytes stored. Times are passed in, so that the planner runs on its log's clock.
"""
from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass
class Entry:
    owner: str
    size: int
    expires_at: float


class Ledger:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # key hex -> entry, least recently used first
        self.bytes = 0
        self.held: Counter[str] = Counter()  # bytes by owner
        self.owned: dict[str, OrderedDict[str, None]] = {}  # owner -> its keys, least recently used first

    def get(self, owner: str, key: str, now: float) -> Entry | None:
        """The live entry of this owner (now most recently used), or None; an expired one is forgotten first."""
        e = self.entries.get(key)
        if e is None or e.owner != owner:
            return None
        if e.expires_at <= now:
            self.forget(key)
            return None
        self.entries.move_to_end(key)
        self.owned[owner].move_to_end(key)
        return e

    def room(self, size: int, owner: str) -> list[tuple[str, Entry]]:
        """Forget entries until `size` more bytes of `owner` fit: the least recently used of whoever holds the most
        (the incoming bytes counted as the owner's); returns them."""
        out = []
        while self.entries and self.bytes + size > self.budget:
            heaviest = max(self.held, key=lambda o: self.held[o] + (size if o == owner else 0))
            key = next(iter(self.owned[heaviest]))
            out.append((key, self.forget(key)))
        return out

    def add(self, owner: str, key: str, size: int, ttl: float | None, now: float) -> None:
        assert key not in self.entries and size <= self.budget
        self.entries[key] = Entry(owner, size, now + ttl if ttl is not None else float("inf"))
        self.owned.setdefault(owner, OrderedDict())[key] = None
        self.held[owner] += size
        self.bytes += size

    def forget(self, key: str) -> Entry:
        e = self.entries.pop(key)
        del self.owned[e.owner][key]
        self.held[e.owner] -= e.size
        if not self.owned[e.owner]:
            del self.owned[e.owner], self.held[e.owner]
        self.bytes -= e.size
        return e

    def forget_owner(self, owner: str | None) -> list[str]:
        """Forget every entry of one owner (None: everyone's); returns their keys."""
        gone = [k for k, e in self.entries.items() if owner is None or e.owner == owner]
        for k in gone:
            self.forget(k)
        return gone
