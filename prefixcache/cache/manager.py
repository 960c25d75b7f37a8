"""Ties sequences to KV blocks: admission (match, lock, allocate), growth, publishing and release."""
import math

import numpy as np

from prefixcache.cache.pool import KVPool
from prefixcache.cache.radix import PrefixCache, block_key, chain_keys
from prefixcache.engine.sequence import TTL_SECONDS, Sequence


class CacheManager:
    def __init__(self, pool: KVPool, enabled: bool, min_cache_tokens: int, default_ttl: float | None,
                 shared_prefixes: list[list[int]], log_cross_scope_misses: bool = False):
        self.pool = pool
        self.bs = pool.block_size
        self.cache = PrefixCache(pool) if enabled else None
        self.min_cache_tokens = min_cache_tokens
        self.default_ttl = default_ttl
        self.shared_prefixes = sorted((tuple(p) for p in shared_prefixes if p), key=len, reverse=True)
        self.scopes: dict = {}  # scope key -> CacheScope, for scopes that published (tenant purges)
        self.log_cross_scope_misses = log_cross_scope_misses  # operator-only: see _holds_elsewhere
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- admission ----------------------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> None:
        """Compute the sequence's static cache keys (on first admission and after preemption)."""
        seq.nodes, seq.num_computed = [], 0
        if self.cache is None:
            return
        seq.shared_len = next((len(p) for p in self.shared_prefixes if tuple(seq.tokens[:len(p)]) == p), 0)
        n_full = len(seq.tokens) // self.bs
        seq.keys = chain_keys(seq.tokens, [self._scope(seq, (j + 1) * self.bs) for j in range(n_full)], self.bs)

    def match(self, seq: Sequence, limit: int | None = None):
        """The cached prefix of the sequence, by default leaving its last token to compute."""
        if self.cache is None:
            return None
        scopes = [self._scope(seq, (j + 1) * self.bs) for j in range(len(seq.keys))]
        partial_scopes = (seq.scope.key, seq.scope.shared.key) if seq.shared_len else (seq.scope.key,)
        return self.cache.match(seq.tokens, seq.keys, scopes, partial_scopes,
                                len(seq.tokens) - 1 if limit is None else limit)

    def admit(self, seq: Sequence, m=None) -> bool:
        """Lock the cached prefix (m, or a fresh match) and allocate blocks for the rest of the known tokens;
        False if it doesn't fit."""
        if m is None or not all(n.alive for n in m.nodes + ([m.partial] if m.partial else [])):
            m = self.match(seq)  # an admission earlier in this step may have evicted part of the old match
        nodes = m.nodes if m else []
        used = nodes + ([m.partial] if m and m.partial else [])
        for n in used:  # locked first, so making room below cannot evict them
            self.pool.ref(n.block)
        needed = math.ceil(len(seq.tokens) / self.bs) - len(nodes)
        if not self._reserve(needed):
            for n in used:
                self.pool.unref(n.block)
            return False
        fresh = self.pool.allocate(needed)
        if m:
            self.cache.touch(used)
        if m and m.partial:
            self.pool.copy(m.partial.block, fresh[0], m.partial_len)
            self.pool.unref(m.partial.block)  # the copy is ours; the source was only held for the copy
        seq.block_table = [n.block for n in nodes] + fresh
        seq.nodes = list(nodes)
        seq.num_computed = len(m) if m else 0
        if seq.num_cached is None:  # accounting belongs to the first admission only
            seq.num_cached = seq.num_computed
            self.query_tokens += seq.num_prompt
            self.hit_tokens += seq.num_cached
            if m and len(m):
                shared = self.cache and any(n.scope != seq.scope.key for n in nodes + [m.partial] if n)
                seq.scope_kind = "shared" if shared else "own"
            seq.miss_cause = self._miss_cause(seq, m)
            if self.log_cross_scope_misses and seq.miss_cause not in ("hit", "disabled"):
                seq.cross_scope_miss = self._holds_elsewhere(seq, m)
        return True

    def grow(self, seq: Sequence, n_tokens: int) -> bool:
        """Make room for the next n_tokens of the sequence; False if the pool is exhausted."""
        needed = math.ceil((seq.num_computed + n_tokens) / self.bs) - len(seq.block_table)
        if needed <= 0:
            return True
        if not self._reserve(needed):
            return False
        seq.block_table += self.pool.allocate(needed)
        return True

    # ---- publishing ---------------------------------------------------------------------------------------
    def publish(self, seq: Sequence, final: bool = False) -> None:
        """Make the sequence's completed blocks matchable (only once their K/V are computed)."""
        if self.cache is None:
            return
        self.scopes[seq.scope.key] = seq.scope
        limit = self._publish_limit(seq)
        n_full = min(seq.num_computed, limit) // self.bs
        self._extend_keys(seq, n_full)
        for j in range(len(seq.nodes), n_full):
            end = (j + 1) * self.bs
            ttl, label = self._ttl(seq, end)
            node, created = self.cache.insert(seq.nodes[-1] if j else None, seq.keys[j], self._scope(seq, end),
                                              tuple(seq.tokens[j * self.bs:end]), seq.block_table[j], ttl,
                                              seq.priority)
            if node is None:
                return
            if node.block != seq.block_table[j]:  # someone published the same block first: share theirs
                self.pool.ref(node.block)
                self.pool.unref(seq.block_table[j])
                seq.block_table[j] = node.block
            seq.nodes.append(node)
            if created:
                self._count_write(seq, j * self.bs, end, label)
        points = self._partial_points(seq, limit, final)
        for p in points:
            if p not in seq.partials_done and p <= seq.num_computed and p // self.bs <= len(seq.nodes):
                seq.partials_done.add(p)
                self._publish_partial(seq, p)

    def release(self, seq: Sequence, finished: bool) -> None:
        self.publish(seq, final=finished)
        for b in seq.block_table:
            self.pool.unref(b)
        seq.block_table, seq.nodes = [], []

    def purge_tenant(self, tenant: str, labels: tuple[str, ...]) -> int:
        """Purge every scope of a tenant and label set, whatever its salt or other fields."""
        freed = 0
        for key, scope in list(self.scopes.items()):
            if scope.tenant == tenant and scope.labels == tuple(sorted(set(labels))):
                freed += self.cache.purge(key)
            if key not in self.cache.roots:
                del self.scopes[key]
        return freed

    # ---- state --------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        pool, cache = self.pool, self.cache
        cached = cache.num_blocks if cache else 0
        used = pool.usable_blocks - pool.num_free
        return {
            "block_size": self.bs, "block_bytes": pool.block_bytes, "bytes_per_token": pool.block_bytes // self.bs,
            "blocks_total": pool.usable_blocks, "blocks_free": pool.num_free, "blocks_used": used,
            "blocks_cached": cached, "blocks_cached_evictable": cache.evictable_blocks() if cache else 0,
            "bytes_cached": cached * pool.block_bytes, "bytes_used": used * pool.block_bytes,
            "occupancy_perc": 100.0 * used / pool.usable_blocks,
            "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "evictions": dict(cache.evictions) if cache else {},
        }

    # ---- helpers ------------------------------------------------------------------------------------------
    def _miss_cause(self, seq: Sequence, m) -> str:
        """Why the cached match stopped where it did (at token len(m)). The tenant sees this answer, so it may
        depend only on the scopes the request can read (its own and the shared one): every key looked up here
        is chained from one of those scopes, never from another tenant's."""
        if self.cache is None:
            return "disabled"
        if len(m) == len(seq.tokens) - 1:
            return "hit"
        j = len(m.nodes)
        if j < len(seq.keys):
            node = self.cache.nodes.get(seq.keys[j])
            if node is not None and node.expires_at <= self.cache.clock():
                return "expired"
            if seq.keys[j] in self.cache.gone:
                return {"ttl": "expired"}.get(self.cache.gone[seq.keys[j]], "evicted")
        if self._publish_limit(seq) == 0:
            return "below_min_length"
        return "diverged" if len(m) else "cold"

    def _holds_elsewhere(self, seq: Sequence, m) -> bool:
        """True if some scope (any tenant's) holds the block where this request's match stopped. For the
        operator's log only: telling the tenant would reveal what another tenant has cached."""
        j = len(m.nodes)
        if j >= len(seq.keys):
            return False
        content = chain_keys(seq.tokens[:(j + 1) * self.bs], [b""] * (j + 1), self.bs)[j]
        return content in self.cache.contents

    def _reserve(self, n: int) -> bool:
        if n > self.pool.num_free and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        return n <= self.pool.num_free

    def _scope(self, seq: Sequence, end: int) -> bytes:
        """A block or partial ending at token `end` is shared only if it lies inside a declared shared prefix."""
        return seq.scope.shared.key if end <= seq.shared_len else seq.scope.key

    def _publish_limit(self, seq: Sequence) -> int:
        if seq.breakpoints:
            ok = [b.position for b in seq.breakpoints if b.position >= self.min_cache_tokens]
            return max(ok, default=seq.shared_len)
        return len(seq.tokens) if seq.num_prompt >= self.min_cache_tokens else seq.shared_len

    def _partial_points(self, seq: Sequence, limit: int, final: bool) -> list[int]:
        points = [b.position for b in seq.breakpoints if b.position <= limit]
        if seq.shared_len:
            points.append(seq.shared_len)
        if final and not seq.breakpoints and limit >= seq.num_computed:
            points.append(seq.num_computed)
        return [p for p in points if p % self.bs and p <= limit]

    def _publish_partial(self, seq: Sequence, p: int) -> None:
        j = p // self.bs
        tokens = tuple(seq.tokens[j * self.bs:p])
        scope = self._scope(seq, p)
        parent = seq.nodes[j - 1] if j else None
        key = block_key(parent.key if parent else b"", scope, np.asarray(tokens, dtype=np.int32).tobytes())
        existing = self.cache.nodes.get(key)
        ttl, label = self._ttl(seq, p)
        if existing is None:
            if not self._reserve(1):
                return
            block = self.pool.allocate(1)[0]
            self.pool.copy(seq.block_table[j], block, len(tokens))
            node, created = self.cache.insert(parent, key, scope, tokens, block, ttl, seq.priority)
            self.pool.unref(block)  # the cache now holds the only reference
            if created:
                self._count_write(seq, j * self.bs, p, label)
        else:
            self.cache.insert(parent, key, scope, tokens, existing.block, ttl, seq.priority)

    def _ttl(self, seq: Sequence, end: int) -> tuple[float | None, str]:
        for b in seq.breakpoints:
            if b.position >= end:
                return TTL_SECONDS[b.ttl], b.ttl
        return self.default_ttl, "auto"

    def _extend_keys(self, seq: Sequence, n_full: int) -> None:
        if len(seq.keys) >= n_full:
            return
        start = len(seq.keys)
        scopes = [self._scope(seq, (j + 1) * self.bs) for j in range(start, n_full)]
        seq.keys += chain_keys(seq.tokens[start * self.bs:n_full * self.bs], scopes, self.bs,
                               seq.keys[-1] if seq.keys else b"")

    def _count_write(self, seq: Sequence, start: int, end: int, label: str) -> None:
        """Prompt tokens in [start, end) that this request wrote (not read) count as cache writes, once each:
        a full block published over an earlier partial one counts only the tokens past it."""
        begin = max(start, seq.num_cached, seq.write_counted)
        n = min(end, seq.num_prompt) - begin
        if n > 0:
            seq.cache_write[label] = seq.cache_write.get(label, 0) + n
            seq.write_counted = begin + n
