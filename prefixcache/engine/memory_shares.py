"""Memory shares: the KV pool is shared by tenant weight (their `cache_share`s, equal by default; cache/shares.py),
counting a tenant's running sequences' pages and its cached entries alike, so that one tenant's running work never
evicts another's cached prefixes while that one holds no more than its part.

Room for a tenant is made from its own entries and those of tenants over their part alone (BlockManager.reserve,
with the pages of running sequences from `running_pages`); when that is not enough, the newest running sequence of
the tenant furthest over its part is preempted (`over`, `newest`), its computed blocks kept cached, where that
eviction may then take them; when no tenant is, the tenant whose running sequences hold the most pages over its part
(`heaviest`). Room comes from anyone's entries only for a tenant's one running sequence, so that any request can
run. A request is admitted the same way: it may preempt another tenant over its part, and otherwise waits, unless
its tenant has nothing running.
"""
from collections import Counter
from typing import Callable

from prefixcache.cache.shares import guarantees
from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.sequence import Sequence

Preempt = Callable[[Sequence], None]


def grow(seq: Sequence, n: int, running: list[Sequence], blocks: BlockManager, shares: dict[str, float],
         preempt: Preempt) -> None:
    """Room for n more tokens of a running sequence, from its tenant's entries and those of tenants over their part,
    else by preempting (the sequence itself, possibly: it is then no longer running)."""
    while not blocks.grow(seq, n):
        victim = newest(running, over(running, blocks, shares))
        if victim in (None, seq):
            if alone(seq, running) and blocks.grow(seq, n, protect=False):
                return  # a tenant's one sequence runs, whatever it needs: room from anyone's entries
            victim = victim or heaviest(running, blocks, shares)
        preempt(victim)
        if victim is seq:
            return


def admit(seq: Sequence, m, first: int | None, keep: frozenset[int], running: list[Sequence], blocks: BlockManager,
          shares: dict[str, float], preempt: Preempt) -> bool:
    """Admit a request (BlockManager.admit): room from its tenant's entries and those of tenants over their part,
    else by preempting (outside `keep`) the sequences of other tenants over their part; from anyone's entries only
    for a tenant with nothing running. False: it waits."""
    while not blocks.admit(seq, m, first):
        tenants = over(running, blocks, shares)
        victim = newest(running, tenants, keep)
        if seq.scope.tenant not in tenants and victim is not None:
            preempt(victim)
        elif alone(seq, running):  # a tenant's one sequence runs, whatever it needs: room from anyone's entries
            return blocks.admit(seq, m, first, protect=False)
        else:  # its tenant is over its part, or those over run only in this step: it waits
            return False
    return True


def alone(seq: Sequence, running: list[Sequence]) -> bool:
    """No other sequence of its tenant runs."""
    return all(s is seq or s.scope.tenant != seq.scope.tenant for s in running)


def running_pages(running: list[Sequence], local_pages: int) -> Counter:
    """Pages of running sequences that are not cache entries (yet), by owner (tenant and labels): a block a page, a
    local part `local_pages`."""
    held = Counter()
    for seq in running:
        held[seq.scope.owner] += len(seq.block_table) - len(seq.cache.nodes) + len(seq.local) * local_pages
    return held


def over(running: list[Sequence], blocks: BlockManager, shares: dict[str, float]) -> list[str]:
    """The tenants with running sequences that hold more than their part of the pool, by their running pages and
    cached entries, furthest over first."""
    held = Counter()
    for owner, pages in [*running_pages(running, blocks.pool.local_pages).items(),
                         *blocks.cache.pages_by_owner().items()]:
        held[owner[0]] += pages  # owners are (tenant, labels)
    fair = guarantees(held, shares, blocks.pool.usable_blocks)
    return sorted({s.scope.tenant for s in running if held[s.scope.tenant] > fair[s.scope.tenant]},
                  key=lambda t: fair[t] - held[t])


def newest(running: list[Sequence], tenants: list[str], keep: frozenset[int] = frozenset()) -> Sequence | None:
    """The newest running sequence (not in `keep`) of the first of `tenants` that has one."""
    for tenant in tenants:
        if seq := next((s for s in reversed(running) if s.scope.tenant == tenant and s.id not in keep), None):
            return seq
    return None


def heaviest(running: list[Sequence], blocks: BlockManager, shares: dict[str, float]) -> Sequence:
    """The newest running sequence of the tenant whose running sequences hold the most pages over its part."""
    held = Counter()
    for seq in running:
        held[seq.scope.tenant] += len(seq.block_table) + len(seq.local) * blocks.pool.local_pages
    fair = guarantees(held, shares, blocks.pool.usable_blocks)
    tenant = max(held, key=lambda t: held[t] - fair[t])
    return next(s for s in reversed(running) if s.scope.tenant == tenant)
