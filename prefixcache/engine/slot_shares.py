"""Slot shares: the running slots (`max_num_seqs`) are shared by tenant weight (their `cache_share`s, equal by
default; cache/shares.py `guarantees`). A tenant with a request waiting and fewer slots than its part takes them from
the tenant furthest over its own part, whose newest sequences are preempted (their computed blocks stay cached); a
tenant at its part claims nothing. A running prompt's samples count: they will start from it.
"""
from collections import Counter
from typing import Callable

from prefixcache.cache.shares import guarantees
from prefixcache.engine.sequence import Sequence

Preempt = Callable[[Sequence], None]


def held(running: list[Sequence]) -> Counter:
    """Running slots by tenant."""
    slots = Counter()
    for seq in running:
        slots[seq.scope.tenant] += 1 + len(seq.forks)
    return slots


def rebalance(running: list[Sequence], ready: list[Sequence], shares: dict[str, float], slots: int,
              preempt: Preempt) -> None:
    """Give each of the `ready` waiting requests whose tenant holds less than its part of the slots a slot: a free one,
    or one preempted from the tenant running furthest over its part."""
    runs = held(running)
    claimed = Counter(runs)  # and the slots claimed below
    free = slots - sum(runs.values())
    for seq in ready:
        tenant, need = seq.scope.tenant, 1 + len(seq.forks)
        claimed[tenant] += 0  # counted among the tenants sharing the slots
        fair = guarantees(claimed, shares, slots)
        if claimed[tenant] + need > fair[tenant]:
            continue
        while free < need and (victim := _over(running, runs, fair, set())):
            preempt(victim)
            runs[victim.scope.tenant] -= 1 + len(victim.forks)
            claimed[victim.scope.tenant] -= 1 + len(victim.forks)
            free += 1 + len(victim.forks)
        if free >= need:
            claimed[tenant] += need
            free -= need


def claim(seq: Sequence, running: list[Sequence], shares: dict[str, float], slots: int, keep: set[int],
          preempt: Preempt) -> bool:
    """Whether the request has running slots now: free ones, or, if its tenant holds less than its part, ones of
    sequences outside `keep`, preempted from the tenants furthest over theirs."""
    need, runs = 1 + len(seq.forks), held(running)
    runs[seq.scope.tenant] += 0
    fair = guarantees(runs, shares, slots)
    if runs[seq.scope.tenant] + need <= fair[seq.scope.tenant]:
        while sum(runs.values()) + need > slots and (victim := _over(running, runs, fair, keep)):
            preempt(victim)
            runs[victim.scope.tenant] -= 1 + len(victim.forks)
    return sum(held(running).values()) + need <= slots


def _over(running: list[Sequence], runs: Counter, fair: dict[str, float], keep: set[int]) -> Sequence | None:
    """The newest running sequence, not in `keep`, of the tenant running furthest over its part of the slots; None if
    no tenant is over its part (or has such a sequence)."""
    over = max(runs, key=lambda t: runs[t] - fair[t], default=None)
    if over is None or runs[over] <= fair[over]:
        return None
    return next((s for s in reversed(running) if s.scope.tenant == over and s.id not in keep), None)
