"""BlockManager: the one writer of a sequence's blocks and cache state (match, lock, allocate, publish, release).

It sits between the engine and the cache: the cache knows scope keys, tokens and block ids; this knows requests.
"""
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import FIRST_COMPLETED, wait

from prefixcache.cache.base import Cache
from prefixcache.cache.keys import chain_keys
from prefixcache.cache.node import Listener, Match, Node
from prefixcache.cache.null import NullCache
from prefixcache.cache.policy import WritePolicy
from prefixcache.cache.pool import KVPool
from prefixcache.cache.radix import PrefixCache
from prefixcache.cache.scope import CacheScope
from prefixcache.engine.hits import Hits
from prefixcache.engine.publish import Publisher
from prefixcache.engine.sequence import Sequence
from prefixcache.engine.tiering import Below, Tiering


class BlockManager:
    def __init__(self, pool: KVPool, enabled: bool, min_cache_tokens: int, default_ttl: float | None,
                 shared_prefixes: list[list[int]], log_cross_scope_misses: bool = False,
                 clock: Callable[[], float] = time.monotonic, max_chunk: int | None = None):
        """`clock`: the time TTLs are counted in (the capacity planner replays a log on the log's). `max_chunk`: the
        most tokens a step computes for a sequence (None: any), which bounds the local parts it holds at once."""
        self.pool = pool
        self.max_chunk = max_chunk
        self.bs = pool.block_size
        self.cache: Cache = PrefixCache(pool, clock) if enabled else NullCache()
        self.min_cache_tokens = min_cache_tokens
        self.default_ttl = default_ttl
        self.shared_prefixes = sorted((tuple(p) for p in shared_prefixes if p), key=len, reverse=True)
        self.hits = Hits(self.cache, self.bs, log_cross_scope_misses)
        self.publisher = Publisher(pool, self.cache, self.reserve)
        self.tiering: Tiering | None = None  # KV tiers below host memory, if any (attach)
        self.using: Callable[[], Counter] = Counter  # pages of running sequences outside the cache, by owner
        # (the scheduler's: engine/memory_shares.py)

    # ---- admission ----------------------------------------------------------------------------------------
    def prepare(self, seq: Sequence) -> None:
        """Compute the sequence's static cache keys (on first admission and after preemption)."""
        seq.block_table, seq.num_computed, seq.local = [], 0, range(0)
        c = seq.cache
        c.nodes = []
        c.shared_len = next((len(p) for p in self.shared_prefixes if tuple(seq.tokens[:len(p)]) == p), 0)
        c.policy = WritePolicy(tuple(seq.breakpoints), seq.num_prompt, c.shared_len, self.min_cache_tokens,
                               self.default_ttl)
        n_full = len(seq.tokens) // self.bs
        c.keys = chain_keys(seq.tokens, [seq.scope_at((j + 1) * self.bs).key for j in range(n_full)], self.bs)

    def attach(self, tiers: Below) -> None:
        self.tiering = Tiering(self, tiers)

    def owner(self, node: Node) -> Hashable:
        """Whose a cached block is: its scope's tenant and labels."""
        return self.cache.owner(node)

    def adapter(self, node: Node) -> str:
        """The fingerprint of the LoRA adapter a cached block was computed with ("" for none)."""
        return self.cache.adapter(node)

    def listen(self, listener: Listener) -> None:
        """Tell `listener` of every full block that enters or leaves the cache (KV events)."""
        assert self.cache.enabled, "KV events need the prefix cache"
        self.cache.listeners.append(listener)

    def prefetch(self, seq: Sequence) -> None:
        """Start looking up the blocks past the request's L1 match in the tiers below (if any)."""
        if self.tiering:
            self.tiering.prefetch(seq)

    def ready(self, seq: Sequence) -> bool:
        """False while a lookup in the tiers below runs for this request (it waits; others go on)."""
        return self.tiering.ready(seq) if self.tiering else True

    def wait_for_lookups(self, seqs, timeout: float = 0.002) -> None:
        """Block until one of these requests' tier lookups is done, or the timeout."""
        if self.tiering:
            wait([s.cache.fetch for s in seqs if s.cache.fetch], timeout, FIRST_COMPLETED)

    def reads_cache(self, seq: Sequence) -> bool:
        """A request that wants prompt logprobs computes its whole prompt: cached positions have no logits."""
        return self.cache.enabled and seq.prompt_logprobs is None

    def match(self, seq: Sequence, limit: int | None = None) -> Match:
        """The cached prefix of the sequence, by default leaving its last token to compute."""
        if not self.reads_cache(seq):
            limit = 0
        c = seq.cache
        scopes = [seq.scope_at((j + 1) * self.bs).key for j in range(len(c.keys))]
        partial_scopes = (seq.scope.key, seq.scope.shared.key) if c.shared_len else (seq.scope.key,)
        return self.cache.match(seq.tokens, c.keys, scopes, partial_scopes,
                                len(seq.tokens) - 1 if limit is None else limit)

    def admit(self, seq: Sequence, m: Match | None = None, first: int | None = None, protect: bool = True) -> bool:
        """Lock the cached prefix (m, or a fresh match) and allocate blocks for the rest of the known tokens, with the
        local parts the first step's `first` tokens past it need (None: all); False if it doesn't fit (`protect`:
        see reserve)."""
        used = (m.nodes + [m.partial] if m.partial else m.nodes) if m else []
        if m is None or not all(n.alive for n in used) or not self.cache.restores(m):
            m = self.match(seq)  # an admission earlier in this step may have evicted part of the old match
            used = m.nodes + [m.partial] if m.partial else m.nodes
        # the blocks of the hit whose local parts its next tokens read
        read = self.pool.window_start(len(m)) if self.pool.local_pages else len(used)
        for n in used:  # locked first, so making room below cannot evict them
            self.pool.ref(n.block)
        for n in used[read:]:
            self.pool.ref_local(n.block)
        needed = math.ceil(len(seq.tokens) / self.bs) - len(m.nodes)
        end = len(seq.tokens) if first is None else min(len(seq.tokens), len(m) + max(first, 1))
        local = self.blocks_for(end) - len(m.nodes) if self.pool.local_pages else 0
        if not self.reserve(needed + local * self.pool.local_pages, seq if protect else None):
            for n in used[read:]:
                self.pool.unref_local(n.block)
            for n in used:
                self.pool.unref(n.block)
            return False
        fresh = self.pool.allocate(needed, m.nodes[-1].block if m.nodes else None)
        self.cache.reuse(used)
        seq.block_table = [n.block for n in m.nodes] + fresh
        seq.local = range(min(read, len(m.nodes)), len(m.nodes))
        self._add_local(seq, len(m.nodes) + local)
        if m.partial:
            self.pool.copy(m.partial.block, fresh[0])
            if self.pool.local_pages:
                self.pool.unref_local(m.partial.block)
            self.pool.unref(m.partial.block)  # the copy is ours; the source was only held for the copy
        seq.num_computed = len(m)
        c = seq.cache
        c.nodes = list(m.nodes)
        if c.num_cached is None:  # accounting belongs to the first admission only
            self.hits.account(seq, m, self.reads_cache(seq))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Start child (the same prompt) from parent's computed tokens: share its full blocks, copy the partial last
        one. The child reads nothing from the cache and writes no prompt token; False if the copy does not fit."""
        n_full, part = divmod(parent.num_computed, self.bs)
        if part and not self.reserve(1 + self.pool.local_pages, parent):
            return False
        child.block_table = parent.block_table[:n_full] + (self.pool.allocate(1) if part else [])
        for b in child.block_table[:n_full]:
            self.pool.ref(b)
        child.local = range(parent.local.start, min(parent.local.stop, n_full))
        for b in child.block_table[child.local.start:child.local.stop]:
            self.pool.ref_local(b)
        if part:
            self._add_local(child, n_full + 1)
            self.pool.copy(parent.block_table[n_full], child.block_table[n_full])
        child.num_computed = parent.num_computed
        p = parent.cache
        child.cache = dataclasses.replace(p, keys=list(p.keys), nodes=list(p.nodes), partials_done=set(p.partials_done),
                                          write={}, write_counted=child.num_prompt)
        return True

    def grow(self, seq: Sequence, n_tokens: int, evict: bool = True, protect: bool = True) -> bool:
        """Make room for the next n_tokens of the sequence; False if the pool is exhausted (or, with evict False,
        has too few free blocks; `protect`: see reserve)."""
        end = self.blocks_for(seq.num_computed + n_tokens)
        needed = max(0, end - len(seq.block_table))
        pages = needed + (max(0, end - seq.local.stop) * self.pool.local_pages)
        if pages == 0:
            return True
        if not (self.reserve(pages, seq if protect else None) if evict else pages <= self.pool.num_free):
            return False
        seq.block_table += self.pool.allocate(needed, seq.block_table[-1] if seq.block_table else None)
        self._add_local(seq, end)
        return True

    # ---- publishing ---------------------------------------------------------------------------------------
    def publish(self, seq: Sequence, final: bool = False) -> None:
        """Make the sequence's completed blocks matchable (only once their K/V are computed); then give back the
        local parts of the blocks its local layers will not read again (the cache may keep them)."""
        self.publisher.publish(seq, final)
        self._trim(seq)

    def release(self, seq: Sequence, finished: bool) -> None:
        self.publisher.publish(seq, final=finished)
        for b in seq.block_table[seq.local.start:seq.local.stop]:
            self.pool.unref_local(b)
        for b in seq.block_table:
            self.pool.unref(b)
        seq.block_table, seq.cache.nodes, seq.local = [], [], range(0)

    def purge_tenant(self, tenant: str, labels: tuple[str, ...]) -> int:
        """Purge every scope of a tenant and label set, whatever its salt or other fields."""
        owner = CacheScope(tenant=tenant, labels=labels).owner
        if self.tiering:
            self.tiering.purge(owner)
        return self.cache.purge_owner(owner)

    def clear(self) -> int:
        """Drop every unreferenced entry, in every tier; returns blocks freed in L1."""
        if self.tiering:
            self.tiering.purge(None)
        return self.cache.clear()

    def purge(self, scope: CacheScope) -> int:
        """Drop a scope's unreferenced entries (L1 only); returns blocks freed."""
        return self.cache.purge(scope.key)

    def pin(self, seq: Sequence, pinned: bool) -> int:
        """Pin (or unpin) the cached full blocks of a prepared sequence's prompt; returns tokens pinned."""
        nodes = self.match(seq, limit=seq.num_prompt).nodes
        self.cache.pin(nodes, pinned)
        if self.tiering:
            self.tiering.pin(nodes, pinned)
        return len(nodes) * self.bs

    def set_shares(self, shares: dict[str, float]) -> None:
        """Guaranteed fractions of the pool by tenant: eviction takes from the tenant furthest over its share; they
        weigh the tenants' tier lookups too."""
        self.cache.set_shares(shares, group=lambda owner: owner[0])  # owners are (tenant, labels)
        if self.tiering:
            self.tiering.set_shares(shares)

    def close(self) -> None:
        """Finish the tiers' queued writes and stop their threads."""
        if self.tiering:
            self.tiering.close()

    # ---- state --------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        pool, cache = self.pool, self.cache
        used = pool.usable_blocks - pool.num_free
        return {
            "block_size": self.bs, "block_bytes": pool.block_bytes, "bytes_per_token": pool.bytes_per_token,
            "blocks_total": pool.usable_blocks, "blocks_free": pool.num_free, "blocks_used": used,
            "blocks_cached": cache.num_blocks, "blocks_cached_evictable": cache.evictable_blocks(),
            "bytes_cached": (cache.num_blocks + cache.num_local * pool.local_pages) * pool.block_bytes,
            "bytes_used": used * pool.block_bytes,
            "occupancy_perc": 100.0 * used / pool.usable_blocks, "scopes_cached": cache.num_scopes,
            **self.hits.stats(), "evictions": dict(cache.evictions),
            "tiers": self.tiering.stats() if self.tiering else None,
        }

    def tiers_health(self) -> dict:
        return self.tiering.health() if self.tiering else {}

    def usage(self, top: int) -> tuple[dict, list]:
        """Cached pages by owner, and the `top` cached prefixes that saved the most prefill."""
        return self.cache.pages_by_owner(), self.cache.top(top)

    # ---- helpers ------------------------------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.bs)

    def room(self) -> int:
        """Blocks a sequence could have with the pool to itself: all but the pinned entries'."""
        return self.pool.usable_blocks - self.cache.num_pinned

    def pages_for(self, n_tokens: int) -> int:
        """The most pages a sequence of n_tokens holds: a page a block, and the local parts (cache/pool.py) of the
        blocks a step's chunk and the window before it cover."""
        blocks = local = self.blocks_for(n_tokens)
        if self.max_chunk is not None:
            local = min(blocks, self.blocks_for(self.pool.window + self.max_chunk) + 1)
        return blocks + local * self.pool.local_pages

    def fits(self, n_tokens: int) -> bool:
        """Whether a sequence of n_tokens could ever run: alone, with every other entry evicted."""
        return self.pages_for(n_tokens) <= self.room()

    def reserve(self, n: int, seq: Sequence | None) -> bool:
        """n free pages, made by eviction if needed: for a sequence, of its tenant's own entries and those of tenants
        over their part of the pool (engine/memory_shares.py); for None, of anyone's."""
        if n > self.pool.num_free:
            self.cache.evict(n - self.pool.num_free, self.using(), seq and seq.scope.owner)
        return n <= self.pool.num_free

    def _add_local(self, seq: Sequence, end: int) -> None:
        """Give the sequence's blocks up to `end` (not computed yet) their local parts (the pages are reserved)."""
        if not self.pool.local_pages:
            return
        table = seq.block_table
        for j in range(seq.local.stop, end):
            self.pool.add_local(table[j], like=table[j - 1] if j else None)
        seq.local = range(seq.local.start, max(seq.local.stop, end))

    def _trim(self, seq: Sequence) -> None:
        if not self.pool.local_pages:
            return
        start = min(self.pool.window_start(seq.num_computed), seq.local.stop)
        for b in seq.block_table[seq.local.start:start]:
            self.pool.unref_local(b)
        seq.local = range(max(seq.local.start, start), seq.local.stop)
