"""Work that tenants queue for one shared thread (KV tier lookups, grammar compiles), served by weight, not by
arrival (DESIGN.md, invariant 8): a tenant with a backlog delays its own work, not everyone's.

FairQueue orders it by start-time fair queueing: a tenant's next item starts at the tenant's virtual time, which
each of its items served moves on by 1 / weight, and the earliest start goes first (ties: the tenant that began
waiting first); FIFO within a tenant. A tenant that was idle starts at the current virtual time, so it banks no
turns while idle and waits behind no one's backlog: after tenant a queues 100 items and then b one, b's is served
second. A tenant's weight is its cache share (shares.py `guarantees`; tenants without one split what the shares
leave, equally), so while two tenants have work, the one with twice the share gets twice the turns. One tenant may
have `bound` items waiting; past it, put() refuses and its caller says what that means.

A tenant may also be held (hold()): its items wait until then while others' are served. FairThread holds a tenant
after each of its jobs in proportion to the job's time when given a `duty` below 1, so no tenant keeps the thread,
and the core it runs on, busier than that: the preparing thread's tokenizing runs beside the engine's threads.
FairThread may run several threads (`workers`), each tenant's jobs one at a time (get(claim=True), release()), so a
tenant's job never waits for another tenant's job under way, only for its turn.
"""
import atexit
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from prefixcache.cache.shares import guarantees

T = TypeVar("T")
MIN_WEIGHT = 0.01  # a tenant the shares leave nothing still gets a turn in a hundred, never none


class FairQueue(Generic[T]):
    def __init__(self, bound: int):
        assert bound > 0
        self.bound = bound  # items one tenant may have waiting
        self.queues: dict[str, deque[T]] = {}  # the tenants with items waiting, in the order they began waiting
        self.start: dict[str, float] = {}  # a tenant's virtual time: when its next item starts
        self.now = 0.0  # the start of the item served last
        self.shares: dict[str, float] = {}
        self.held: dict[str, float] = {}  # a tenant's items start no earlier than this (time.monotonic())
        self.claimed: set[str] = set()  # tenants with an item being served, whose next waits for release()
        self.closed = False
        self.cond = threading.Condition()

    def put(self, tenant: str, item: T) -> bool:
        """Queue an item of a tenant's; False, and nothing queued, if the tenant has `bound` waiting."""
        with self.cond:
            q = self.queues.setdefault(tenant, deque())
            if len(q) >= self.bound:
                return False
            if not q:
                self.start[tenant] = max(self.start.get(tenant, self.now), self.now)
            q.append(item)
            self.cond.notify()
            return True

    def get(self, claim: bool = False) -> T | None:
        """The next item of a tenant not held (nor claimed), waiting for one; None once closed and empty (once closed,
        holds end). `claim`: the tenant's next items wait until release(tenant)."""
        with self.cond:
            while not (ready := self._ready()) and not (self.closed and not self.queues):
                until = [self.held[t] for t in self.queues if t in self.held]
                self.cond.wait(min(until) - time.monotonic() if until else None)
            if not ready:
                return None
            tenant = min(ready, key=self.start.__getitem__)
            weight = guarantees(Counter(self.queues), self.shares, 1)[tenant]
            self.now = self.start[tenant]
            self.start[tenant] += 1 / max(weight, MIN_WEIGHT)
            q = self.queues[tenant]
            item = q.popleft()
            if claim:
                self.claimed.add(tenant)
            if not q:
                del self.queues[tenant]
            # an idle tenant the virtual time has caught up with would start at `now` anyway: forget it
            self.start = {t: s for t, s in self.start.items() if t in self.queues or s > self.now}
            return item

    def waiting(self) -> list[str]:
        """The tenants with items waiting."""
        with self.cond:
            return list(self.queues)

    def set_shares(self, shares: dict[str, float]) -> None:
        """The tenants' weights: fractions summing to at most 1, as CacheAdmin.set_shares takes them."""
        with self.cond:
            self.shares = dict(shares)

    def release(self, tenant: str) -> None:
        """The tenant's item claimed by get() is done: its next may be served."""
        with self.cond:
            self.claimed.discard(tenant)
            self.cond.notify_all()

    def hold(self, tenant: str, seconds: float) -> None:
        """The tenant's items wait `seconds` from now while others' are served."""
        with self.cond:
            now = time.monotonic()
            self.held = {t: until for t, until in self.held.items() if until > now}
            self.held[tenant] = now + seconds
            self.cond.notify()

    def _ready(self) -> list[str]:
        """The tenants with items waiting that are not held."""
        now = time.monotonic()
        return [t for t in self.queues if t not in self.claimed and (self.closed or self.held.get(t, 0.0) <= now)]

    def close(self) -> None:
        """get() gives what is queued, then None."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class FairThread:
    """Threads (`workers`) running the jobs tenants submit, in a FairQueue's order, a tenant's one at a time; a job's
    result comes back as a Future."""

    def __init__(self, name: str, bound: int, initializer: Callable[[], None] | None = None, duty: float = 1.0,
                 workers: int = 1):
        assert 0 < duty <= 1 and workers >= 1
        self.duty = duty  # the most of a thread's time one tenant's jobs take while others' wait or not
        self.jobs: FairQueue[tuple[str, Future, Callable[[], object]]] = FairQueue(bound)
        self.threads = [threading.Thread(target=self._run, args=(initializer,), name=f"{name}-{i}", daemon=True)
                        for i in range(workers)]
        for thread in self.threads:
            thread.start()
        # at exit, let the job under way finish: a daemon thread stopped inside native code (xgrammar's tokenizer
        # tables, built at start) aborts the process
        ref = weakref.ref(self)
        atexit.register(lambda: (thread := ref()) and thread.shutdown())

    def submit(self, tenant: str, fn: Callable[..., T], *args, **kwargs) -> Future | None:
        """fn(*args, **kwargs) on the thread, as a Future; None if the tenant has `bound` jobs waiting."""
        future: Future = Future()
        return future if self.jobs.put(tenant, (tenant, future, lambda: fn(*args, **kwargs))) else None

    def set_shares(self, shares: dict[str, float]) -> None:
        self.jobs.set_shares(shares)

    def shutdown(self) -> None:
        """Run the jobs queued, then stop."""
        self.jobs.close()
        for thread in self.threads:
            thread.join()

    def _run(self, initializer: Callable[[], None] | None) -> None:
        if initializer:
            initializer()
        while (job := self.jobs.get(claim=True)) is not None:
            tenant, future, work = job
            if future.set_running_or_notify_cancel():
                start = time.monotonic()
                try:
                    future.set_result(work())
                except Exception as e:  # the job's caller gets it from the future
                    future.set_exception(e)
                if self.duty < 1:
                    self.jobs.hold(tenant, (time.monotonic() - start) * (1 / self.duty - 1))
            self.jobs.release(tenant)
