"""What the cache served each request at its first admission: prompt and hit tokens, whose entries it read, and
why its match stopped where it did. The counts are the engine's hit rate; the answers go to the request's usage,
its log line and /metrics."""
from prefixcache.cache.base import Cache
from prefixcache.cache.node import Match
from prefixcache.engine.sequence import Sequence


class Hits:
    def __init__(self, cache: Cache, block_size: int, log_cross_scope_misses: bool = False):
        self.cache, self.bs = cache, block_size
        self.log_cross_scope_misses = log_cross_scope_misses  # operator-only: see _holds_elsewhere
        self.query_tokens = 0
        self.hit_tokens = 0

    def account(self, seq: Sequence, m: Match, reads: bool) -> None:
        """Once per request: its match `m` (made with the cache read, or not: `reads`)."""
        c = seq.cache
        c.num_cached = seq.num_computed
        self.query_tokens += seq.num_prompt
        self.hit_tokens += c.num_cached
        if len(m):
            c.scope_kind = "shared" if any(n.scope != seq.scope.key for n in m.nodes + [m.partial] if n) else "own"
        c.miss_cause = self._miss_cause(seq, m) if reads else "disabled"
        if self.log_cross_scope_misses and c.miss_cause not in ("hit", "disabled"):
            c.cross_scope_miss = self._holds_elsewhere(seq, m)

    def stats(self) -> dict:
        q, h = self.query_tokens, self.hit_tokens
        return {"query_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else 0.0}

    def _miss_cause(self, seq: Sequence, m: Match) -> str:
        """Why the cached match stopped where it did (at token len(m)). The tenant sees this answer, so it may
        depend only on the scopes the request can read (its own and the shared one): every key looked up here
        is chained from one of those scopes, never from another tenant's."""
        if len(m) == len(seq.tokens) - 1:
            return "hit"
        j = len(m.nodes)
        gone = self.cache.explain(seq.cache.keys[j]) if j < len(seq.cache.keys) else None
        if gone:
            return gone
        if j < len(seq.cache.keys) and self.cache.get(seq.cache.keys[j]) is not None:
            return "evicted"  # cached, but a local part its window reads was evicted (cache/pool.py)
        if seq.cache.policy.limit(len(seq.tokens)) == 0:
            return "below_min_length"
        return "diverged" if len(m) else "cold"

    def _holds_elsewhere(self, seq: Sequence, m: Match) -> bool:
        """True if some scope (any tenant's) holds the block where this request's match stopped. For the
        operator's log only: telling the tenant would reveal what another tenant has cached."""
        end = (len(m.nodes) + 1) * self.bs
        return end <= len(seq.tokens) and self.cache.holds(seq.tokens[:end])
