"""How fast request bodies are read: each tenant's at most `rate` bytes a second, from a bucket of `burst` bytes. The
rate is the tenant's own, whatever other tenants send, so one tenant's flood empties its own bucket, never another's,
and no tenant can tell from its own bodies' pace whether others are sending any.

Why: the event loop parses and validates every body while holding the GIL, about 12 ms a MiB here, and each kernel
call of the engine thread lets go of the GIL and must wait to get it back. A tenant sending large bodies as fast as
it can, refused or not, would keep the loop parsing and slow every engine step for every tenant. The rate bounds
the share of the machine that one tenant's bodies can take; the default, 4 MiB a second, is about a million prompt
tokens, far more than the engine can prefill, so no workload the engine can serve waits on it.
"""
import asyncio
import time
from collections import Counter
from dataclasses import dataclass


@dataclass
class Bucket:
    level: float  # bytes that may be read now; below 0 after a chunk larger than what was left
    stamp: float  # time.monotonic() of the last refill


class Intake:
    def __init__(self, rate: float, burst: int, bound: int):
        assert rate >= 0 and burst > 0
        self.rate, self.burst = rate, burst  # rate 0: bodies are read as fast as they come
        self.bound = bound  # bodies one tenant may have being read at once
        self.reading: Counter[str] = Counter()
        self.buckets: dict[str, Bucket] = {}  # the tenants reading bodies, and those whose bucket is not yet full

    def begin(self, tenant: str) -> bool:
        """A body of the tenant's is to be read; False, and nothing begun, if it has `bound` being read."""
        if self.reading[tenant] >= self.bound:
            return False
        self.reading[tenant] += 1
        self.buckets.setdefault(tenant, Bucket(float(self.burst), time.monotonic()))
        return True

    def end(self, tenant: str) -> None:
        """A body begun is read, or its request has gone."""
        self.reading[tenant] -= 1
        if not self.reading[tenant]:
            del self.reading[tenant]
        # a bucket refilled to full is a new one: forget it
        self.buckets = {t: b for t, b in self.buckets.items() if t in self.reading or self._refill(t) < self.burst}

    async def take(self, tenant: str, size: int) -> None:
        """Return once `size` bytes of a body of the tenant's (begun) may be read, and take them from its bucket."""
        if not self.rate:
            return
        while (level := self._refill(tenant)) <= 0:
            await asyncio.sleep(-level / self.rate + 1e-3)
        self.buckets[tenant].level -= size

    def _refill(self, tenant: str) -> float:
        """The tenant's bucket's level, refilled at the rate since the last refill."""
        b, now = self.buckets[tenant], time.monotonic()
        b.level, b.stamp = min(self.burst, b.level + (now - b.stamp) * self.rate), now
        return b.level
