"""The KV tiers below L1 as the capacity planner models them: the engine's own Tiering (engine/tiering.py) over
ledgers (cache/ledger.py) in place of files and Redis. Which blocks spill, which are written through, which ones a
request looks up, finds and loads into L1, in what order and up to which miss, is decided by the serving code; only
the bytes are not kept.

- L2 (`disk:SIZE`) keeps the blocks evicted from L1 for room, the least recently used out first, as disk.py does.
- L3 (`redis:SIZE`) keeps every block written to L1 for its TTL (else `redis_ttl`), evicting when full as Redis
  does when run with `--maxmemory SIZE --maxmemory-policy volatile-lru`: by sampling (redis_lru.py).
A block's size is its record's real size (record.py: the K and V bytes and a header), in Redis as its allocator
keeps it (block_sizes).
"""
import json
import os
from concurrent.futures import Future

import torch

from prefixcache.bench.redis_lru import RedisLedger
from prefixcache.cache.ledger import Ledger
from prefixcache.cache.record import Record, encode
from prefixcache.cache.tiers import Copy, Found, Wanted

NAMES = {"disk": "L2", "redis": "L3"}


def parse(text: str) -> dict[str, int]:
    """`disk:8GiB,redis:64GiB` as {"L2": bytes, "L3": bytes}."""
    from prefixcache.options import size

    out = {}
    for part in filter(None, text.split(",")):
        name, _, amount = part.partition(":")
        if name not in NAMES or not amount:
            raise ValueError(f"--tiers: parts are disk:SIZE and redis:SIZE, got {part!r}")
        if NAMES[name] in out:
            raise ValueError(f"--tiers: {name} given twice")
        out[NAMES[name]] = size(amount)
        if out[NAMES[name]] <= 0:
            raise ValueError(f"--tiers: {part!r} is not a positive size")
    return out


def block_sizes(shape: tuple[int, ...], dtype: torch.dtype, bench: str) -> dict[str, int]:
    """The bytes one block takes in each tier: on disk, its record; in Redis, its record as Redis keeps it (in its
    allocator's size class, with the key), as the tiers benchmark (`bench`: its JSON) measured it with MEMORY USAGE
    for records of this size (the record's size alone where it has not)."""
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    record = len(encode(Record((0,) * shape[1], k, v), b"0" * 32, "0" * 16, "0" * 16))
    measured = {}
    if os.path.exists(bench):
        with open(bench) as f:
            measured = json.load(f)
    in_redis = measured.get("l3_memory_per_block", record) if measured.get("l3_record_bytes") == record else record
    return {"L2": record, "L3": in_redis}


class LedgerTiers:
    """Tiers that keep which blocks they hold, on the planner's clock (`now()`), and no bytes."""

    def __init__(self, budgets: dict[str, int], sizes: dict[str, int], redis_ttl: float, now, seed: int = 0):
        self.l2 = Ledger(budgets["L2"]) if "L2" in budgets else None
        self.l3 = RedisLedger(budgets["L3"], now, seed) if "L3" in budgets else None
        self.sizes, self.redis_ttl, self.now = sizes, redis_ttl, now

    def l3_evicted(self) -> bool:
        return self.l3 is not None and self.l3.evicted > 0

    def stored(self, owner: str, key: str, copy: Copy | None, ttl: float | None) -> None:
        if copy is not None and self.l3:
            self._put(self.l3, owner, key, self.sizes["L3"], ttl if ttl is not None else self.redis_ttl)

    def removed(self, owner: str, key: str, spill: Copy | None, ttl: float | None) -> None:
        if spill is not None:
            self.spill(owner, key, spill, ttl)

    def spill(self, owner: str, key: str, copy: Copy, ttl: float | None) -> None:
        if self.l2:
            self._put(self.l2, owner, key, self.sizes["L2"], ttl)

    def fetch(self, wanted: list[Wanted], tenant: str) -> Future:
        found: list[Found] = []
        for tier, ledger in (("L2", self.l2), ("L3", self.l3)):
            if ledger is None:
                continue
            for w in wanted[len(found):]:
                if ledger.get(w.owner, w.key, self.now()) is None:
                    break
                found.append(Found(tier, None))
        done: Future = Future()
        done.set_result(found)
        return done

    def set_shares(self, shares: dict[str, float]) -> None:
        pass  # lookups are answered at once: no queue to share

    def purge(self, owner: str | None) -> None:
        pass  # purges and pins come from the admin API, which a replayed log does not call

    def pin(self, owner: str, keys: list[str], pinned: bool) -> None:
        pass

    def health(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {name: {"blocks": len(t.entries), "bytes": t.bytes} for name, t in (("L2", self.l2), ("L3", self.l3))
                if t is not None}

    def close(self) -> None:
        pass

    def _put(self, ledger: Ledger, owner: str, key: str, size: int, ttl: float | None) -> None:
        if key in ledger.entries:
            ledger.forget(key)
        ledger.room(size, owner)
        ledger.add(owner, key, size, ttl, self.now())
