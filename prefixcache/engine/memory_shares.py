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

from prefixcache.cache.shares import guarantees
from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.sequence import Sequence


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
