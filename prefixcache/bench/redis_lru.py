"""L3 as Redis keeps it under `--maxmemory` with `--maxmemory-policy volatile-lru`, for the capacity planner.

Redis does not evict the least recently used key: for each key it must evict it samples `maxmemory-samples` (5)
keys that have an expiry, files them in a pool of the 16 idlest seen so far, and evicts the idlest of the pool;
a key's idle time is counted in whole seconds. So the blocks a request wrote in one second are evicted in random
order, and a chain that loses one early block is lost from there on: with L3 full, the exact LRU of cache/ledger.py
predicted 0.33 where a live server measured 0.23, and this model 0.23-0.24 (README). Redis also deletes expired keys
in the background, which this does before it evicts. One seeded draw of the sampling: the same log gives the
same answer.
"""
import heapq
import random

from prefixcache.cache.ledger import Entry, Ledger

SAMPLES = 5  # maxmemory-samples, Redis's default
POOL = 16  # EVPOOL_SIZE in Redis's evict.c


class RedisLedger(Ledger):
    def __init__(self, budget_bytes: int, now, seed: int = 0):
        super().__init__(budget_bytes)
        self.now, self.rng = now, random.Random(seed)
        self.keys: list[str] = []  # for sampling in O(1): a key's place is slot[key]
        self.slot: dict[str, int] = {}
        self.used: dict[str, int] = {}  # key -> the second it was last read or written
        self.expiry: list[tuple[float, str]] = []  # a heap
        self.pool: list[tuple[int, str]] = []  # (idle seconds when sampled, key), idlest last
        self.evicted = 0

    def get(self, owner: str, key: str, now: float) -> Entry | None:
        e = super().get(owner, key, now)
        if e is not None:
            self.used[key] = int(now)
        return e

    def add(self, owner: str, key: str, size: int, ttl: float | None, now: float) -> None:
        super().add(owner, key, size, ttl, now)
        self.slot[key] = len(self.keys)
        self.keys.append(key)
        self.used[key] = int(now)
        heapq.heappush(self.expiry, (self.entries[key].expires_at, key))

    def forget(self, key: str) -> Entry:
        i, last = self.slot.pop(key), self.keys.pop()
        if last != key:
            self.keys[i], self.slot[last] = last, i
        del self.used[key]
        return super().forget(key)

    def room(self, size: int, owner: str) -> list[tuple[str, Entry]]:  # Redis's policy knows no owner
        now = self.now()
        while self.expiry and self.expiry[0][0] <= now:
            at, key = heapq.heappop(self.expiry)
            if key in self.entries and self.entries[key].expires_at == at:
                self.forget(key)
        out = []
        while self.entries and self.bytes + size > self.budget:
            for key in self.rng.choices(self.keys, k=SAMPLES):
                if all(k != key for _, k in self.pool):
                    self.pool.append((int(now) - self.used[key], key))
            self.pool.sort(key=lambda p: p[0])
            del self.pool[:-POOL]
            while self.pool:
                _, key = self.pool.pop()
                if key in self.entries:
                    out.append((key, self.forget(key)))
                    self.evicted += 1
                    break
        return out
