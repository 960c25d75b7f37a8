"""How fast request bodies are read: at most `rate` bytes a second over all tenants (a bucket of `burst` bytes),
and while chunks wait for that, they are read in turns by tenant weight (cache/fair.py FairQueue).

Why: the event loop parses and validates every body while holding the GIL, about 12 ms a MiB here, and each kernel
call of the engine thread lets go of the GIL and must wait to get it back. A tenant sending large bodies as fast as
it can, refused or not, would keep the loop parsing and slow every engine step for every tenant. The rate bounds
the share of the machine that reading bodies can take; the default, 4 MiB a second, is about a million prompt
tokens, far more than the engine can prefill, so no workload the engine can serve waits on it.
"""
import asyncio
import time
from collections import Counter

from prefixcache.cache.fair import FairQueue


class Intake:
    def __init__(self, rate: float, burst: int, bound: int):
        assert rate >= 0 and burst > 0
        self.rate, self.burst = rate, burst  # rate 0: bodies are read as fast as they come
        self.bound = bound  # bodies one tenant may have being read at once
        self.reading: Counter[str] = Counter()
        self.level, self.stamp = float(burst), time.monotonic()
        self.waiting: FairQueue[tuple[asyncio.Future, int]] = FairQueue(bound)  # a body waits a chunk at a time
        self.pump: asyncio.Task | None = None

    def begin(self, tenant: str) -> bool:
        """A body of the tenant's is to be read; False, and nothing begun, if it has `bound` being read."""
        if self.reading[tenant] >= self.bound:
            return False
        self.reading[tenant] += 1
        return True

    def end(self, tenant: str) -> None:
        """A body begun is read, or its request has gone."""
        self.reading[tenant] -= 1
        if not self.reading[tenant]:
            del self.reading[tenant]

    def set_shares(self, shares: dict[str, float]) -> None:
        self.waiting.set_shares(shares)

    async def take(self, tenant: str, size: int) -> None:
        """Return once `size` bytes of a body of the tenant's (begun) may be read."""
        if not self.rate:
            return
        self._refill()
        if not self.waiting.queues and self.level > 0:
            self.level -= size
            return
        turn = asyncio.get_running_loop().create_future()
        assert self.waiting.put(tenant, (turn, size)), "a body begun waits for one chunk at a time"
        if self.pump is None or self.pump.done():
            self.pump = asyncio.create_task(self._serve())
        await turn

    async def _serve(self) -> None:
        """Hand out turns as the bucket refills, the fair queue's next first; a chunk whose request has gone is
        skipped unpaid."""
        while self.waiting.queues:
            turn, size = self.waiting.get()  # there is one: get() does not block
            if turn.done():
                continue
            self._refill()
            if self.level <= 0:
                await asyncio.sleep(-self.level / self.rate + 1e-3)
                self._refill()
            if not turn.done():
                self.level -= size
                turn.set_result(None)

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
