"""The intake (server/intake.py): request bodies are read at most at its rate over all tenants, each tenant at its
part of it, so one tenant's flood makes its own bodies wait and never another's."""
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
        intake, log = Intake(rate=256 * KIB, burst=64 * KIB, bound=100), []
        flood = [asyncio.create_task(_read(intake, "a", 64 * KIB, log)) for _ in range(8)]
        await asyncio.sleep(0.05)  # a's first chunk emptied its bucket: the rest wait
        read_before = len(log)
        await _read(intake, "b", 64 * KIB, log)
        order = [tenant for tenant, _, _ in log]
        await asyncio.gather(*flood)
        return read_before, order

    read_before, order = asyncio.run(run())
    assert read_before < 8 and order == ["a"] * read_before + ["b"], (read_before, order)


def test_bodies_are_read_no_faster_than_the_buckets_and_the_rate():
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
        # what the two buckets held at the start, what the rate gave since, and a chunk each that emptied a bucket
        assert read <= 2 * burst + rate * (t - t0) + 2 * chunk, (read, t - t0)
    assert read == 20 * chunk


def test_the_rate_is_split_by_cache_share_among_the_tenants_reading():
    intake = Intake(rate=100 * KIB, burst=KIB, bound=10)
    intake.set_shares({"a": 0.6, "b": 0.2})
    assert intake.begin("a") and intake._rate("a") == 100 * KIB  # alone, all of it
    assert intake.begin("b") and intake.begin("c")
    rates = {t: intake._rate(t) for t in "abc"}  # c has no share: it splits what the shares leave
    assert rates["a"] == 3 * rates["b"] and abs(rates["b"] - rates["c"]) < 1e-6
    assert abs(sum(rates.values()) - 100 * KIB) < 1e-6


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
