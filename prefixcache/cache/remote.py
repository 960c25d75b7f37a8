"""L3: KV blocks in Redis, shared by every replica, behind a circuit breaker.

Key: prefixcache:kv:<owner hex>:<block key hex>. Each owner's keys are also listed in a sorted set of its own,
prefixcache:keys:<owner hex>, scored by when they expire (pinned: never), trimmed of the expired at every write: a
tenant's purge reads its own set, never the keyspace every replica and tenant shares. Every entry expires (its TTL,
else `ttl` seconds) unless pinned; run Redis with `--maxmemory-policy volatile-lru` so that it evicts the least
recently used expiring entries and never a pinned one (the set, which never expires, neither). That LRU is over every
tenant: with `owner_blocks`, an owner keeps at most that many blocks, its soonest to expire out first at its own
write (pinned ones last), so with the caps inside Redis's maxmemory one tenant's flood turns over its own.

Every call has a socket timeout. After `failures` errors in a row the breaker opens: calls are skipped (a miss,
a dropped write) for `cooldown` seconds, then one call tries again. Callers see misses, never exceptions.
"""
import time
from dataclasses import dataclass, field

import redis

PREFIX = "prefixcache:kv:"
INDEX = "prefixcache:keys:"
# KEYS: the entry, its owner's set; ARGV: the data, seconds, now, the owner's cap (0: none), the block key, the owner's
# prefix. One round trip, and no other write between the set's count and its trim.
PUT = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]) + tonumber(ARGV[2]), ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[3])
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if tonumber(ARGV[4]) > 0 and over > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #popped, 2 do redis.call('UNLINK', ARGV[6] .. popped[i]) end
end
return 1
"""


@dataclass
class Breaker:
    failures: int = 3  # errors in a row that open it
    cooldown: float = 5.0  # seconds before one call tries again
    errors: int = 0  # since start
    in_a_row: int = 0
    open_until: float = 0.0
    skipped: int = 0  # calls not made while open

    def allow(self) -> bool:
        if time.monotonic() < self.open_until:
            self.skipped += 1
            return False
        return True

    def success(self) -> None:
        self.in_a_row, self.open_until = 0, 0.0

    def failure(self) -> None:
        self.errors += 1
        self.in_a_row += 1
        if self.in_a_row >= self.failures:
            self.open_until = time.monotonic() + self.cooldown

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self.open_until


@dataclass
class RedisTier:
    url: str
    ttl: float = 3600.0  # expiry of entries that have no TTL of their own
    timeout: float = 0.5  # seconds, per call
    breaker: Breaker = field(default_factory=Breaker)
    password: str | None = field(default=None, repr=False)  # AUTH; a password in the URL wins, as redis-py does
    owner_blocks: int = 0  # blocks one owner may keep (0: no cap)
    name = "L3"

    def __post_init__(self):
        self.client = redis.Redis.from_url(self.url, password=self.password, socket_timeout=self.timeout,
                                           socket_connect_timeout=self.timeout)
        self.put_script = self.client.register_script(PUT)

    def get_many(self, blocks: list[tuple[str, str]]) -> list[bytes | None]:
        """One round trip (MGET) for a run of (owner, key) blocks; all misses if Redis is unreachable."""
        if not blocks:
            return []
        return self._call(lambda c: c.mget([_name(o, k) for o, k in blocks])) or [None] * len(blocks)

    def put(self, owner: str, key: str, data: bytes, ttl: float | None) -> bool:
        seconds = max(1, round(ttl if ttl is not None else self.ttl))
        return self._call(lambda c: self.put_script(keys=[_name(owner, key), INDEX + owner], args=[
            data, seconds, time.time(), self.owner_blocks, key, f"{PREFIX}{owner}:"], client=c)) is not None

    def persist(self, owner: str, keys: list[str], pinned: bool) -> None:
        """Pinned entries never expire; unpinned ones expire again after `ttl`."""
        def run(c):
            pipe = c.pipeline(transaction=False)
            for k in keys:
                if pinned:
                    pipe.persist(_name(owner, k))
                else:
                    pipe.expire(_name(owner, k), round(self.ttl))
            pipe.zadd(INDEX + owner, dict.fromkeys(keys, float("inf") if pinned else time.time() + round(self.ttl)),
                      xx=True)
            return pipe.execute()
        self._call(run)

    def delete(self, owner: str, keys: list[str]) -> None:
        if keys:
            self._call(lambda c: (c.unlink(*[_name(owner, k) for k in keys]), c.zrem(INDEX + owner, *keys)))

    def purge(self, owner: str | None) -> int:
        """Delete one owner's entries, listed in its set (None: every entry, by a SCAN of ours); returns how many."""
        def run(c):
            n = 0
            if owner is None:
                for batch in _batches(c.scan_iter(match="prefixcache:*", count=1000), 1000):
                    c.unlink(*batch)
                    n += sum(k.startswith(PREFIX.encode()) for k in batch)
                return n
            for batch in _batches(c.zscan_iter(INDEX + owner, count=1000), 1000):
                n += c.unlink(*[_name(owner, k.decode()) for k, _ in batch])
            c.unlink(INDEX + owner)
            return n
        return self._call(run) or 0

    def _call(self, fn):
        if not self.breaker.allow():
            return None
        try:
            result = fn(self.client)
        except (redis.RedisError, OSError):
            self.breaker.failure()
            return None
        self.breaker.success()
        return result


def _name(owner: str, key: str) -> str:
    return f"{PREFIX}{owner}:{key}"


def _batches(items, n: int):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
