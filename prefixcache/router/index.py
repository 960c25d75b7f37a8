"""PrefixIndex: which prefix-cache block keys each replica holds, rebuilt from the replicas' KV event stream.

The stream `prefixcache:events` has one entry per event, with fields `replica`, `kind` ("stored", "removed" or
"reset"), `tier` ("L1" or "L2") and `keys` (comma-joined hex keys). A block counts as cached on a replica when it
is there in either tier. "reset" means the replica restarted: its L1 keys are gone (the L2 keys that survived on
disk are announced again as stored right after). The index reads the stream from its start, so a new router has
the same view as one that has run all along, then follows new entries. Between a request's routing and the
events of its blocks, `expect` counts its keys as held where it was sent: at most `max_pending` keys over all
replicas, in the order they lapse (each lasts `expect_seconds`), so the lapsed and, past the cap, the oldest go from
the front in O(1) each.
"""
import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from prefixcache.cache.events import STREAM

TIERS = ("L1", "L2")

log = logging.getLogger("prefixcache.router")


@dataclass
class PrefixIndex:
    redis_url: str
    password: str | None = field(default=None, repr=False)  # AUTH; a password in the URL wins, as redis-py does
    batch: int = 1000  # entries per XREAD
    block_ms: int = 1000  # how long one XREAD waits for new entries
    last_id: str = "0"  # the last entry applied; "0": the start of the stream
    # replica id -> tier -> keys
    tiers: dict[str, dict[str, set[str]]] = field(
        default_factory=lambda: defaultdict(lambda: {tier: set() for tier in TIERS}))
    expect_seconds: float = 30.0  # how long a routed request's keys count as held before events confirm them
    max_pending: int = 100_000  # keys counted as held that way, over all replicas (~260 bytes each)
    # (replica id, key) -> until (monotonic), soonest first
    pending: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict)

    def apply(self, entry: dict[str, str]) -> None:
        """One stream entry's fields. A malformed entry is logged and skipped: it must not stop the index."""
        kind, replica, tier = entry.get("kind"), entry.get("replica"), entry.get("tier")
        keys = [k for k in entry.get("keys", "").split(",") if k]
        if replica and kind == "reset":
            self.tiers[replica]["L1"].clear()
            self.pending = OrderedDict((k, t) for k, t in self.pending.items() if k[0] != replica)  # rare: O(N)
        elif replica and kind == "stored" and tier in TIERS:
            self.tiers[replica][tier].update(keys)
        elif replica and kind == "removed" and tier in TIERS:
            self.tiers[replica][tier].difference_update(keys)
        else:
            log.warning("malformed KV event skipped: replica=%r kind=%r tier=%r", replica, kind, tier)

    def retain(self, replica_ids: set[str]) -> None:
        """Forget every replica but these (the replicas' ids now): a replica that restarted under a new id (the
        default is hostname-pid) left its old id's keys behind, which no request could match, for good."""
        gone = set(self.tiers) - replica_ids
        for replica in gone:
            del self.tiers[replica]
        if gone and any(k[0] in gone for k in self.pending):
            self.pending = OrderedDict((k, t) for k, t in self.pending.items() if k[0] not in gone)

    def expect(self, replica_id: str | None, keys: list[str]) -> None:
        """A request with these keys was just sent to the replica: count them as held there for `expect_seconds`,
        so that the next requests with the same prefix follow it before its KV events arrive (a prefill of long
        prompts takes seconds). Soft state: a restarted router just lacks it for that long, and past `max_pending`
        the oldest expectations lapse early."""
        if replica_id is None or not keys:
            return
        now, pending = time.monotonic(), self.pending
        for key in keys:
            pending[replica_id, key] = now + self.expect_seconds
            pending.move_to_end((replica_id, key))
        while pending and (len(pending) > self.max_pending or next(iter(pending.values())) <= now):
            pending.popitem(last=False)

    def match(self, replica_id: str | None, keys: list[str]) -> int:
        """How many leading `keys` of a request the replica holds (in L1 or L2) or is computing (`expect`)."""
        tiers, pending, now, n = self.tiers.get(replica_id), self.pending, time.monotonic(), 0
        for key in keys:
            if not (tiers and (key in tiers["L1"] or key in tiers["L2"]) or pending.get((replica_id, key), 0) > now):
                break
            n += 1
        return n

    def blocks(self, replica_id: str | None) -> int:
        """Distinct blocks the replica holds."""
        tiers = self.tiers.get(replica_id)
        return len(tiers["L1"] | tiers["L2"]) if tiers else 0

    async def follow(self) -> None:
        """Read the stream from `last_id` on, forever (run it as a task; cancel it to stop). While Redis cannot be
        reached, the index keeps what it has and the reads are retried."""
        client = aioredis.Redis.from_url(self.redis_url, password=self.password, decode_responses=True)
        delay = 0.1
        try:
            while True:
                try:
                    reply = await client.xread({STREAM: self.last_id}, count=self.batch, block=self.block_ms)
                except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as e:
                    log.warning("KV event stream unreachable (%s); retrying in %.1f s", type(e).__name__, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                delay = 0.1
                for _, entries in reply:
                    for entry_id, entry in entries:
                        self.apply(entry)
                        self.last_id = entry_id
        finally:
            await client.aclose()
