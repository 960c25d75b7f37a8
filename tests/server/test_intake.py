"""The intake (server/intake.py): request bodies are read at most at its rate over all tenants, and a tenant's
backlog of chunks delays its own, not a newcomer's."""
import asyncio
import time

from prefixcache.server.intake import Intake

KIB = 1024


async def _read(intake: Intake, tenant: str, size: int, log: list) -> None:
    await intake.take(tenant, size)
    log.append((tenant, time.monotonic(), size))


def test_a_newcomers_chunk_waits_for_one_chunk_of_a_backlog_at_most():
    async def run() -> tuple[int, list]:
        intake, log = Intake(rate=256 * KIB, burst=64 * KIB, bound=100), []
        backlog = [asyncio.create_task(_read(intake, "a", 64 * KIB, log)) for _ in range(8)]
        await asyncio.sleep(0.05)  # a's chunks wait for the bucket, one of them served next
        read_before = len(log)
        await asyncio.gather(*backlog, _read(intake, "b", 64 * KIB, log))
        return read_before, [tenant for tenant, _, _ in log]

    read_before, order = asyncio.run(run())
    assert len(order) == 9 and read_before < 8 and order.index("b") <= read_before + 1, (read_before, order)


def test_bodies_are_read_no_faster_than_the_bucket_and_the_rate():
    rate, burst, chunk = 256 * KIB, 32 * KIB, 16 * KIB

    async def run() -> tuple[float, list]:
        intake, log = Intake(rate=rate, burst=burst, bound=100), []
        t0 = time.monotonic()
        await asyncio.gather(*[_read(intake, t, chunk, log) for t in ("a", "b") for _ in range(10)])
        return t0, log

    t0, log = asyncio.run(run())
    read = 0
    for _, t, size in log:
        read += size
        # what the bucket held at the start, what it gained since, and the chunk that took it below empty
        assert read <= burst + rate * (t - t0) + chunk, (read, t - t0)
    assert read == 20 * chunk


def test_without_a_rate_nothing_waits():
    async def run() -> int:
        free, log = Intake(rate=0, burst=KIB, bound=1), []
        await asyncio.gather(*[_read(free, "a", 64 * KIB, log) for _ in range(50)])
        return len(log)

    assert asyncio.run(run()) == 50


def test_a_tenant_reads_at_most_bound_bodies_at_once_and_a_gone_chunk_is_not_paid():
    intake = Intake(rate=KIB, burst=KIB, bound=2)
    assert intake.begin("a") and intake.begin("a") and not intake.begin("a") and intake.begin("b")
    intake.end("a")
    assert intake.begin("a") and not intake.begin("a")

    async def gone() -> float:
        await intake.take("a", 8 * KIB)  # the bucket is empty for 7 s: the next chunk waits
        waiting = asyncio.create_task(intake.take("a", 64 * KIB))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await asyncio.sleep(0.05)
        return intake.level

    assert asyncio.run(gone()) > -8 * KIB  # only the first chunk was paid
