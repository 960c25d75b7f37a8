"""Latency objectives (prefixcache/slo.py): vLLM's `--goodput` items, the bench's goodput and attainment, the
highest arrival rate at 90% attainment, and the server's met / missed counters on /metrics."""
import subprocess
import sys

import httpx
import pytest
from server_fixtures import _start, metrics

from prefixcache.bench.driver import Result
from prefixcache.bench.report import goodput
from prefixcache.bench.sweeps import max_rate
from prefixcache.config import Config
from prefixcache.server.config import ServeConfig
from prefixcache.slo import Objectives


def test_objectives_read_as_vllms_goodput_items():
    o = Objectives.parse(["ttft:500", "tpot:50"])
    assert o == Objectives(ttft=0.5, tpot=0.05) and o.given() == {"ttft": 0.5, "tpot": 0.05}
    # TPOT after the first token: (1.0 - 0.4) / 10 = 60 ms; a single token has none
    assert o.met(ttft=0.4, e2el=1.0, output_tokens=11) == {"ttft": True, "tpot": False}
    assert o.met(ttft=0.6, e2el=0.6, output_tokens=1) == {"ttft": False, "tpot": True}


@pytest.mark.parametrize("items, message", [
    (["ttft"], "give NAME:MS"), (["latency:100"], "the name one of ttft, tpot, e2el"),
    (["ttft:-5"], "must be a positive number"), (["ttft:0"], "must be a positive number"),
    (["ttft:nan"], "must be a positive number"), (["e2el:soon"], "is not a number"),
    (["ttft:1", "ttft:2"], "given twice"), ([], "at least one"),
])
def test_a_bad_objective_is_a_clear_error(items, message):
    with pytest.raises(ValueError, match=message):
        Objectives.parse(items)


def test_goodput_counts_requests_that_meet_every_objective():
    def r(ttft, e2e, n, ok=True):
        return Result(0, 0, "t", 0.0, ok=ok, ttft=ttft, e2e=e2e, output_tokens=n)

    results = [r(0.1, 0.5, 5), r(0.1, 2.0, 5), r(0.9, 1.0, 5), r(None, None, 0, ok=False)]
    g = goodput(results, wall=2.0, objectives=Objectives(ttft=0.5, tpot=0.2))
    # tpot: 0.1, 0.475, 0.025; so only the first meets both; the failed one meets none
    assert g == {"goodput_req_per_s": 0.5, "slo_attainment": 0.25, "slo_attainment_ttft": 0.5,
                 "slo_attainment_tpot": 0.5}


def test_the_highest_rate_at_90_percent():
    def points(*attainment):
        return [{"rate": float(i + 1), "slo_attainment": a} for i, a in enumerate(attainment)]

    assert max_rate(points(1.0, 0.95, 0.7)) == pytest.approx(2 + (0.95 - 0.9) / (0.95 - 0.7))
    assert max_rate(points(1.0, 0.95)) == 2.0  # every tested rate meets the goal: the highest, a lower bound
    assert max_rate(points(0.5, 0.95)) is None  # the lowest does not
    assert max_rate(points(0.9, 0.2)) == 1.0


def test_the_server_counts_requests_against_its_objectives(tiny_model):
    """--slo-ttft-ms and --slo-tpot-ms: one objective every request meets, one none can; both series exist
    before the first request."""
    srv = _start("slo", ServeConfig(Config(model=tiny_model, slo_ttft_ms=600_000, slo_tpot_ms=0.0001)))
    before = metrics(srv.url)
    assert before[("prefixcache:slo_requests_total", (("objective", "ttft"), ("result", "met")))] == 0
    for _ in range(2):
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "model": "default", "prompt": "Count on", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200
    after = metrics(srv.url)
    count = {(dict(k[1])["objective"], dict(k[1])["result"]): v for k, v in after.items()
             if k[0] == "prefixcache:slo_requests_total"}
    assert count == {("ttft", "met"): 2, ("ttft", "missed"): 0, ("tpot", "met"): 0, ("tpot", "missed"): 2}


@pytest.mark.parametrize("flag", ["--slo-ttft-ms", "--slo-tpot-ms"])
def test_a_bad_server_objective_fails_startup_naming_it(flag):
    done = subprocess.run([sys.executable, "-m", "prefixcache.cli", "serve", "--port", "0", flag, "-3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and flag in done.stderr and "positive" in done.stderr
