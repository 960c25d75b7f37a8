"""Publishing: a sequence's computed blocks made matchable in the prefix cache (only once their K/V are computed),
shared with whoever published the same block first, and the partial blocks its write policy asks for copied into
blocks of their own. Prompt tokens written count as the request's cache writes, by TTL label.
"""
from collections.abc import Callable

import numpy as np

from prefixcache.cache.base import Cache
from prefixcache.cache.keys import block_key, chain_keys
from prefixcache.cache.pool import KVPool
from prefixcache.engine.sequence import Sequence


class Publisher:
    def __init__(self, pool: KVPool, cache: Cache, reserve: Callable[[int, Sequence], bool]):
        self.pool, self.cache, self.reserve = pool, cache, reserve  # reserve: BlockManager's, by memory shares
        self.bs = pool.block_size

    def publish(self, seq: Sequence, final: bool) -> None:
        """Insert the sequence's computed full blocks (up to its write policy's limit) and its due partial blocks."""
        if not self.cache.enabled:
            return
        c = seq.cache
        limit = c.policy.limit(len(seq.tokens))
        n_full = min(seq.num_computed, limit) // self.bs
        self._extend_keys(seq, n_full)
        for j in range(len(c.nodes), n_full):
            end = (j + 1) * self.bs
            ttl, label = c.policy.ttl(end)
            scope = seq.scope_at(end)
            node, created = self.cache.insert(c.nodes[-1] if j else None, c.keys[j], scope.key,
                                              tuple(seq.tokens[j * self.bs:end]), seq.block_table[j], ttl,
                                              seq.priority, scope.owner, scope.adapter, output=end > seq.num_prompt)
            if node is None:
                return
            if node.block != seq.block_table[j] and (j not in seq.local or self.pool.has_local(node.block)):
                self.pool.ref(node.block)  # someone published the same block first: share theirs
                if j in seq.local:
                    self.pool.ref_local(node.block)
                    self.pool.unref_local(seq.block_table[j])
                self.pool.unref(seq.block_table[j])
                seq.block_table[j] = node.block
            c.nodes.append(node)
            if created:
                self._count_write(seq, j * self.bs, end, label)
        for p in c.policy.partial_points(limit, seq.num_computed, final, self.bs):
            if p not in c.partials_done and p <= seq.num_computed and p // self.bs <= len(c.nodes):
                c.partials_done.add(p)
                self._partial(seq, p)

    def _partial(self, seq: Sequence, p: int) -> None:
        c = seq.cache
        j = p // self.bs
        tokens = tuple(seq.tokens[j * self.bs:p])
        scope = seq.scope_at(p)
        parent = c.nodes[j - 1] if j else None
        key = block_key(parent.key if parent else b"", scope.key, np.asarray(tokens, dtype=np.int32).tobytes())
        existing = self.cache.get(key)
        ttl, label = c.policy.ttl(p)
        if existing is None:
            source, local = seq.block_table[j], self.pool.local_pages
            if local and not self.pool.has_local(source):
                return  # its local layers' keys are gone: a hit on it could not be served
            if local:
                self.pool.ref_local(source)  # held for the copy: making room may not evict it
            block = self.pool.allocate(1)[0] if self.reserve(1 + local, seq) else None
            if block is not None:
                if local:
                    self.pool.add_local(block)
                self.pool.copy(source, block)
            if local:
                self.pool.unref_local(source)
            if block is None:
                return
            node, created = self.cache.insert(parent, key, scope.key, tokens, block, ttl, seq.priority, scope.owner,
                                              scope.adapter)
            if local:
                self.pool.unref_local(block)
            self.pool.unref(block)  # the cache now holds the only reference
            if created:
                self._count_write(seq, j * self.bs, p, label)
        else:
            self.cache.insert(parent, key, scope.key, tokens, existing.block, ttl, seq.priority, scope.owner,
                              scope.adapter)

    def _extend_keys(self, seq: Sequence, n_full: int) -> None:
        keys = seq.cache.keys
        if len(keys) >= n_full:
            return
        start = len(keys)
        scopes = [seq.scope_at((j + 1) * self.bs).key for j in range(start, n_full)]
        keys += chain_keys(seq.tokens[start * self.bs:n_full * self.bs], scopes, self.bs, keys[-1] if keys else b"")

    def _count_write(self, seq: Sequence, start: int, end: int, label: str) -> None:
        """Prompt tokens in [start, end) that this request wrote (not read) count as cache writes, once each:
        a full block published over an earlier partial one counts only the tokens past it."""
        c = seq.cache
        begin = max(start, c.num_cached, c.write_counted)
        n = min(end, seq.num_prompt) - begin
        if n > 0:
            c.write[label] = c.write.get(label, 0) + n
            c.write_counted = begin + n

