"""Tiering: the prefix cache's link to the KV tiers below host memory (cache/tiers.py), on the engine thread.

It listens to the cache (a full block stored: announce it and write it through to L3; evicted for room: spill it to
L2), starts a lookup of the blocks past a waiting request's L1 match, and once that lookup is done loads the blocks
it found into the pool and the cache, where the request's admission then matches them like any other entry. Loaded
blocks are the bytes another step computed for exactly these tokens under exactly this scope (their MAC, keyed by
the tier secret, covers the block's key, owner and tokens; their shape and dtype are checked), so a request served
from a tier gets the output of the request computed cold.
"""
from concurrent.futures import Future
from typing import Protocol

import torch

from prefixcache.cache.base import Cache
from prefixcache.cache.credentials import redis_password, tier_secret
from prefixcache.cache.disk import DiskTier
from prefixcache.cache.events import KVEvents
from prefixcache.cache.node import Match, Node
from prefixcache.cache.pool import KVPool
from prefixcache.cache.record import Record
from prefixcache.cache.remote import RedisTier
from prefixcache.cache.tiers import Copy, Tiers, Wanted, owner_id
from prefixcache.config import Config
from prefixcache.engine.sequence import Sequence
from prefixcache.models.loader import ModelConfig

LOAD_BLOCKS = 32  # found blocks loaded into the pool a step (SmolLM2: 24 MB, a few ms)


def open_tiers(cfg: Config, model: ModelConfig, replica_id: str) -> Tiers:
    """The tiers the config names (disk_cache, redis_url), with their secret and the Redis password."""
    l3 = bool(cfg.redis_url and cfg.redis_kv)
    disk = DiskTier(cfg.disk_cache, int(cfg.disk_cache_gb * 2**30)) if cfg.disk_cache else None
    secret = tier_secret(cfg.tier_secret_file, cfg.disk_cache, l3)  # after DiskTier, which makes the folder
    password = redis_password(cfg.redis_password_file) if cfg.redis_url else None
    remote = RedisTier(cfg.redis_url, cfg.redis_ttl, password=password, owner_blocks=cfg.redis_owner_blocks) \
        if l3 else None
    events = KVEvents(cfg.redis_url, replica_id, password=password) if cfg.redis_url else None
    shape = (model.num_layers, cfg.block_size, model.num_kv_heads, model.head_dim)
    return Tiers(shape, getattr(torch, cfg.kv_storage_dtype), disk, remote, events, secret=secret)


class Blocks(Protocol):
    """What Tiering uses of the BlockManager (engine/blocks.py) that owns it."""

    pool: KVPool
    cache: Cache
    bs: int

    def match(self, seq: Sequence, limit: int | None = None) -> Match: ...

    def reads_cache(self, seq: Sequence) -> bool: ...

    def reserve(self, n: int) -> bool: ...


class Below(Protocol):
    """The tiers below L1 as Tiering uses them: cache/tiers.py, or the capacity planner's (bench/plan_tiers.py)."""

    def stored(self, owner: str, key: str, copy: Copy | None, ttl: float | None) -> None: ...

    def removed(self, owner: str, key: str, spill: Copy | None, ttl: float | None) -> None: ...

    def spill(self, owner: str, key: str, copy: Copy, ttl: float | None) -> None: ...

    def fetch(self, wanted: list[Wanted], tenant: str) -> Future: ...

    def set_shares(self, shares: dict[str, float]) -> None: ...

    def purge(self, owner: str | None) -> None: ...

    def pin(self, owner: str, keys: list[str], pinned: bool) -> None: ...

    def health(self) -> dict: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


class Tiering:
    def __init__(self, blocks: Blocks, tiers: Below):
        assert blocks.cache.enabled, "KV tiers need the prefix cache"
        self.blocks, self.tiers = blocks, tiers
        self.pool, self.cache, self.bs = blocks.pool, blocks.cache, blocks.bs
        self.loading = False  # blocks being loaded are in L3 already: no write-through
        self.cache.listeners.append(self)

    # ---- cache listener -----------------------------------------------------------------------------------
    def stored(self, node: Node) -> None:
        if not self._whole(node):  # published after its local layers' window passed: no tier can serve it
            return
        copy = None if self.loading else lambda: self._copy(node)
        self.tiers.stored(self._owner(node), node.key.hex(), copy, node.ttl)

    def removed(self, node: Node, reason: str) -> None:
        spill = (lambda: self._copy(node)) if reason == "capacity" and self._whole(node) else None
        self.tiers.removed(self._owner(node), node.key.hex(), spill, node.ttl)

    def thinned(self, node: Node) -> None:
        """Its local part goes: L2 keeps the whole block, from which a lookup can give the node a new one."""
        self.tiers.spill(self._owner(node), node.key.hex(), lambda: self._copy(node), node.ttl)

    # ---- requests -----------------------------------------------------------------------------------------
    def prefetch(self, seq: Sequence) -> None:
        """Look up, below L1, the full blocks past the request's L1 match (not its last token's block)."""
        c = seq.cache
        c.fetch, c.fetch_from, c.found = None, 0, []
        if not self.blocks.reads_cache(seq):
            return
        first = len(self.blocks.match(seq).nodes)
        wanted = [Wanted(self._owner_of(seq, j), c.keys[j].hex(), tuple(seq.tokens[j * self.bs:(j + 1) * self.bs]))
                  for j in range(first, (len(seq.tokens) - 1) // self.bs)]
        if wanted:
            c.fetch, c.fetch_from = self.tiers.fetch(wanted, seq.scope.tenant), first

    def ready(self, seq: Sequence) -> bool:
        """False while the request's lookup runs, and while what it found is loaded, LOAD_BLOCKS blocks a call (a
        call a step: a long prompt's blocks do not hold up one step for everyone); True once all are in the cache."""
        c = seq.cache
        if c.fetch is not None:
            if not c.fetch.done():
                return False
            c.found, c.fetch = c.fetch.result(), None
        if not c.found:
            return True
        piece, c.found = c.found[:LOAD_BLOCKS], c.found[LOAD_BLOCKS:]
        loaded = self._load(seq, c.fetch_from, piece)
        c.fetch_from += loaded
        if loaded < len(piece):  # stopped (no room, or the chain was evicted): the rest is computed
            c.found = []
        return not c.found

    def set_shares(self, shares: dict[str, float]) -> None:
        self.tiers.set_shares(shares)

    def purge(self, owner) -> None:
        self.tiers.purge(owner_id(owner) if owner is not None else None)

    def pin(self, nodes: list[Node], pinned: bool) -> None:
        for node in nodes:
            self.tiers.pin(self._owner(node), [node.key.hex()], pinned)

    def health(self) -> dict:
        return self.tiers.health()

    def stats(self) -> dict:
        return self.tiers.stats()

    def close(self) -> None:
        self.tiers.close()

    # ---- helpers ------------------------------------------------------------------------------------------
    def _load(self, seq: Sequence, first: int, found: list) -> int:
        """Put found blocks first.. into the pool and the cache, under the request's L1 match; returns how many
        went in. Every node of the chain is held while later blocks are allocated, so making room cannot evict the
        chain being built."""
        c, held, loaded = seq.cache, [], 0
        parent = self.cache.get(c.keys[first - 1]) if first else None
        if first and parent is None:  # the L1 match shrank since the lookup (or the last piece was evicted)
            return 0
        if parent is not None:
            self.pool.ref(parent.block)
            held.append(parent)
        for j, f in enumerate(found, start=first):
            node = self.cache.get(c.keys[j])
            if node is None:
                if not self.blocks.reserve(1 + self.pool.local_pages, seq):
                    break
                block = self.pool.allocate(1)[0]
                if self.pool.local_pages:
                    self.pool.add_local(block)
                if f.record is not None:
                    self.pool.write(block, f.record.k, f.record.v)
                scope = seq.scope_at((j + 1) * self.bs)
                tokens = tuple(seq.tokens[j * self.bs:(j + 1) * self.bs])  # what the record's MAC was checked on
                self.loading = True
                node, _ = self.cache.insert(parent, c.keys[j], scope.key, tokens, block,
                                            c.policy.ttl((j + 1) * self.bs)[0], seq.priority, scope.owner,
                                            scope.adapter)
                self.loading = False
                if self.pool.local_pages:
                    self.pool.unref_local(block)  # the cache's now, as the block is
                self.pool.unref(block)
                if node is None:
                    break
                if c.num_cached is None:  # a reload after preemption is not what the request was served from
                    c.tier_tokens[f.tier] = c.tier_tokens.get(f.tier, 0) + self.bs
            self.pool.ref(node.block)
            held.append(node)
            parent = node
            if not self._whole(node) and f.record is not None:  # L1 kept the block, not its local layers
                if not self.blocks.reserve(self.pool.local_pages, seq):
                    break
                self.cache.attach_local(node)
                self.pool.write(node.block, f.record.k, f.record.v, local=True)
                if c.num_cached is None:
                    c.tier_tokens[f.tier] = c.tier_tokens.get(f.tier, 0) + self.bs
            loaded += 1
        for node in held:
            self.pool.unref(node.block)
        return loaded

    def _owner(self, node: Node) -> str:
        return owner_id(self.cache.owner(node))

    def _owner_of(self, seq: Sequence, j: int) -> str:
        return owner_id(seq.scope_at((j + 1) * self.bs).owner)

    def _copy(self, node: Node) -> Record:
        return Record(node.tokens, *self.pool.read(node.block))

    def _whole(self, node: Node) -> bool:
        """Whether the pool holds every layer of a cached block (its local part, if the model has one)."""
        return not self.pool.local_pages or self.pool.has_local(node.block)
