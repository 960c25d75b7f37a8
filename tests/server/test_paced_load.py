"""The schedule against latency objectives on a live server under open-loop load (Poisson arrivals, the bench's
driver), on the shipped model: against the same arrivals sized by max_batch_tokens alone, do more requests meet
both objectives? (`make test-long`: how many meet them depends on the machine; which schedule meets more should not.)

Two kinds of requests, one cold in three: warm ones (16 tokens past a cached 400-token prefix) and cold ones (a
prompt of their own, long enough that its prefill alone takes about COLD times the TTFT objective: they can never
meet it). The prompt length and the rates are set from a cold prefill measured on the server first, so the test
does not depend on the machine's speed: at the lower rate the engine spends about a sixth of its time in cold
prefills, at the higher one about half. Sized by max_batch_tokens alone (--no-slo-schedule), a warm request that
arrives during a cold prefill waits for it, so its TTFT attainment falls with the rate; scheduled by the objectives,
it runs in a lane step inside the cold step, or before the cold prompt's next chunk."""
import asyncio
import random
import time
from dataclasses import dataclass

import httpx
import pytest

from prefixcache.bench.driver import Load, Target, run
from prefixcache.bench.report import goodput
from prefixcache.bench.server import LocalServer, ServerOptions
from prefixcache.bench.workloads import Session, Turn, Workload
from prefixcache.slo import Objectives

TTFT, TPOT = 0.4, 0.1  # seconds: the objectives
COLD = 1.6  # a cold prompt's prefill, in TTFT objectives
BUSY = 0.5  # the share of the engine's time in cold prefills at the higher rate; the lower rate is a third of it
PREFIX, SUFFIX, OUT = 400, 16, 24  # tokens: the warm requests' cached prefix and their own part; every answer
REQUESTS = 42  # a rate


@dataclass
class Point:
    rate: float
    ttft: float  # attainment: the share of the requests that met the objective
    tpot: float
    both: float  # the share that met both: goodput's


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def complete(srv: LocalServer, prompt: list[int], max_tokens: int = 1) -> float:
    """One request's seconds, to its whole answer."""
    start = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/completions", timeout=120, headers={"Authorization": f"Bearer {srv.keys['default']}"},
                   json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


@dataclass
class Plan:
    """The arrivals both servers get: set from a cold prefill measured on the first."""
    per_token: float  # seconds of a cold prefill per token
    cold: int  # tokens of a cold prompt


def measure(extra: tuple[str, ...], plan: Plan | None = None) -> tuple[list[Point], Plan]:
    """Both rates on one fresh server started with the objectives (and `extra` flags): the same prompts and
    arrivals for the same plan."""
    rng = random.Random(0)
    flags = ("--slo-ttft-ms", f"{TTFT * 1000:g}", "--slo-tpot-ms", f"{TPOT * 1000:g}", *extra)
    with LocalServer(ServerOptions(max_num_seqs=64, extra=flags), []) as srv:
        per_token = min(complete(srv, ids(rng, 512)) for _ in range(3)) / 512
        plan = plan or Plan(per_token, max(64, min(2000, round(COLD * TTFT / per_token))))
        prefix = ids(rng, PREFIX)
        for _ in range(3):  # cached from now on; and steps of both kinds for the engine to learn their cost from
            complete(srv, prefix + ids(rng, SUFFIX), OUT)
        high = 3 * BUSY / (plan.cold * plan.per_token)  # a cold request in three
        points = []
        for rate in (high / 3, high):
            sessions = [Session([Turn([], OUT, prompt_ids=ids(rng, plan.cold) if i % 3 == 2
                                      else prefix + ids(rng, SUFFIX))]) for i in range(REQUESTS)]
            results, wall = asyncio.run(run(Workload("warm and cold", sessions), Target("ours", srv.url, srv.keys),
                                            Load(rate=rate, seed=len(points), temperature=0.0)))
            assert all(r.ok and r.output_tokens == OUT for r in results), [r.error for r in results if not r.ok]
            g = goodput(results, wall, Objectives(ttft=TTFT, tpot=TPOT))
            points.append(Point(rate, g["slo_attainment_ttft"], g["slo_attainment_tpot"], g["slo_attainment"]))
    return points, plan


@pytest.mark.long
def test_the_schedule_meets_both_objectives_for_more_requests_than_batch_sizing():
    """The same arrivals, scheduled by the objectives and sized by max_batch_tokens alone: at the higher rate the
    schedule meets both objectives (goodput's count) for more requests, and at the lower rate for no fewer. (A cold
    request, one in three, can meet neither schedule's TTFT: attainment is at most 2/3.)"""
    (low, high), plan = measure(())
    (unpaced_low, unpaced_high), _ = measure(("--no-slo-schedule",), plan)
    assert high.both > unpaced_high.both and low.both >= unpaced_low.both, (low, high, unpaced_low, unpaced_high)
