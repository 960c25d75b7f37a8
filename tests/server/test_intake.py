"""The intake (server/intake.py): each tenant's request bodies are read at most at its rate, whatever other tenants
send, so one tenant's flood makes its own bodies wait and never another's."""
import asyncio
import time

from prefixcache.server.intake import Intake

KIB = 1024


async def _read(intake: Intake, tenant: str, size: int, log: list) -> None:
    assert intake.begin(tenant)
    try:
        await intake.take(tenant, size)
        log.append((tenant, time.monotonic(), size))
    finally:
        intake.end(tenant)


def test_a_tenants_flood_does_not_make_anothers_body_wait():
    async def run() -> tuple[int, list]:
        # a's second body may be read 2 s after its first: 40 times the 0.05 s b waits before it asks
        intake, log = Intake(rate=32 * KIB, burst=64 * KIB, bound=100), []
        flood = [asyncio.create_task(_read(intake, "a", 64 * KIB, log)) for _ in range(8)]
        await asyncio.sleep(0.05)  # a's first chunk emptied its bucket: the rest wait
        read_before = len(log)
        await _read(intake, "b", 64 * KIB, log)
        order = [tenant for tenant, _, _ in log]
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        return read_before, order

    read_before, order = asyncio.run(run())
    assert read_before < 8 and order == ["a"] * read_before + ["b"], (read_before, order)


def test_each_tenants_bodies_are_read_no_faster_than_its_bucket_and_the_rate():
    rate, burst, chunk = 256 * KIB, 32 * KIB, 16 * KIB

    async def run() -> tuple[float, list]:
        intake, log = Intake(rate=rate, burst=burst, bound=100), []
        t0 = time.monotonic()
        await asyncio.gather(*[_read(intake, t, chunk, log) for t in ("a", "b") for _ in range(10)])
        return t0, log

    t0, log = asyncio.run(run())
    read = {"a": 0, "b": 0}
    for tenant, t, size in log:
        read[tenant] += size
        # what its bucket held at the start, what the rate gave since, and the chunk that emptied it
        assert read[tenant] <= burst + rate * (t - t0) + chunk, (tenant, read, t - t0)
    assert read == {"a": 10 * chunk, "b": 10 * chunk}


def test_without_a_rate_nothing_waits():
    async def run() -> int:
        free, log = Intake(rate=0, burst=KIB, bound=100), []
        await asyncio.gather(*[_read(free, "a", 64 * KIB, log) for _ in range(50)])
        return len(log)

    assert asyncio.run(run()) == 50


def test_a_tenant_reads_at_most_bound_bodies_at_once_and_a_gone_chunk_is_not_paid():
    intake = Intake(rate=KIB, burst=KIB, bound=2)
    assert intake.begin("a") and intake.begin("a") and not intake.begin("a") and intake.begin("b")
    intake.end("a")
    assert intake.begin("a") and not intake.begin("a")

    async def gone() -> float:
        await intake.take("a", 8 * KIB)  # a's bucket is empty for 7 s: its next chunk waits
        waiting = asyncio.create_task(intake.take("a", 64 * KIB))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return intake.buckets["a"].level

    assert asyncio.run(gone()) > -8 * KIB  # only the first chunk was paid
