"""The operator's controls over what the engine keeps for later requests: the prefix cache (and its tiers), the
drafter's tables of earlier answers and the compiled grammars. Engine.cache; the engine thread calls it."""
from collections.abc import Callable

from prefixcache.cache.scope import CacheScope
from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.drafter import Drafter
from prefixcache.engine.grammar import Grammars
from prefixcache.engine.scheduler import Scheduler
from prefixcache.engine.sequence import SamplingParams, Sequence


class CacheAdmin:
    def __init__(self, blocks: BlockManager, scheduler: Scheduler, drafter: Drafter, grammars: Grammars,
                 scope: Callable[[CacheScope | None], CacheScope]):
        """`scope`: a request's scope with the engine's fingerprint filled in (Engine.scope)."""
        self.blocks, self.scheduler, self.drafter, self.grammars = blocks, scheduler, drafter, grammars
        self.scope = scope

    def purge(self, scope: CacheScope) -> int:
        """Drop a scope's unreferenced cache entries; returns blocks freed."""
        return self.blocks.purge(self.scope(scope))

    def purge_tenant(self, tenant: str, labels: tuple[str, ...] = ()) -> int:
        """Drop the unreferenced entries of a tenant and label set under every salt; returns blocks freed."""
        self.drafter.purge_tenant(tenant, labels)
        self.grammars.purge_tenant(tenant, labels)
        return self.blocks.purge_tenant(tenant, labels)

    def pin(self, prompt: list[int], scope: CacheScope | None = None, pinned: bool = True) -> int:
        """Pin (or unpin) the cached full blocks of a prompt so eviction never takes them; returns tokens pinned."""
        seq = Sequence(prompt, SamplingParams(), self.scope(scope))
        self.blocks.prepare(seq)
        return self.blocks.pin(seq, pinned)

    def prefix_keys(self, prompt: list[int], scope: CacheScope | None = None) -> list[str]:
        """The cache keys (hex) of a prompt's full blocks under a scope, as its request would look them up (for a
        router). It reads no mutable state, so any thread may call it."""
        seq = Sequence(prompt, SamplingParams(), self.scope(scope))
        self.blocks.prepare(seq)
        return [k.hex() for k in seq.cache.keys]

    def set_shares(self, shares: dict[str, float]) -> None:
        """Guaranteed fractions of the KV pool by tenant (summing to at most 1): eviction takes from the tenant
        furthest over its share first; tenants without one split the rest equally. They weigh the tenants' parts
        of the running slots too."""
        self.blocks.set_shares(shares)
        self.grammars.set_shares(shares)
        self.scheduler.shares = dict(shares)

    def usage(self, top: int = 10) -> dict:
        """For the operator: each tenant's cached pages (cache/pool.py) and recent engine use (tokens computed, fading
        over USAGE_HALF_LIFE, engine/usage.py), and the cached prefixes that saved the most prefill (no token text:
        key, size, reuse)."""
        (held, top), recent = self.blocks.usage(top), self.scheduler.usage.tokens
        tenants = sorted({t for t, _ in held} | set(recent))
        return {"tenants": [{"tenant": t, "pages": sum(n for (owner, _), n in held.items() if owner == t),
                             "recent_tokens": round(recent.get(t, 0.0), 1)} for t in tenants],
                "prefixes": [{"tenant": owner[0], "labels": list(owner[1]), "key": node.key.hex()[:16],
                              "tokens": tokens, "hits": node.hits, "saved_tokens": node.hits * tokens}
                             for owner, node, tokens in top]}

    def clear(self) -> int:
        self.drafter.tables.clear()
        self.grammars.clear()
        return self.blocks.clear()
