"""The report's arithmetic against a tiny run computed by hand."""
import pytest

from prefixcache.bench.driver import Result
from prefixcache.bench.report import Prices, percentile, summarize, table


def _run():
    return [Result(0, 0, "t", 0.0, ok=True, ttft=1.0, e2e=2.0, itl=[0.1, 0.3], prompt_tokens=1000, cached_tokens=0,
                   output_tokens=10),
            Result(1, 0, "t", 0.1, ok=True, ttft=0.2, e2e=1.2, itl=[0.2], prompt_tokens=1000, cached_tokens=800,
                   output_tokens=20),
            Result(2, 0, "t", 0.2, ok=True, ttft=0.4, e2e=1.4, prompt_tokens=2000, cached_tokens=1600,
                   output_tokens=30),
            Result(3, 0, "t", 0.3, ok=False, error="HTTP 429")]


def test_percentiles_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_summary_by_hand():
    s = summarize(_run(), wall=4.0, prices=Prices(input=3.0, cached=0.3, output=15.0), server={"evictions": 2})
    assert (s["requests"], s["ok"], s["errors"]) == (4, 3, 1)
    assert s["hit_rate_tokens"] == pytest.approx(2400 / 4000)
    assert s["hit_rate_requests"] == pytest.approx((0 + 800 / 1000 + 1600 / 2000) / 3)
    assert s["saved_input_tokens"] == 2400
    # TTFTs sorted 0.2, 0.4, 1.0: p50 is the middle one; p90 sits at rank 1.8, p99 at rank 1.98
    assert s["ttft_p50_s"] == pytest.approx(0.4)
    assert s["ttft_p90_s"] == pytest.approx(0.4 + 0.8 * 0.6)
    assert s["ttft_p99_s"] == pytest.approx(0.4 + 0.98 * 0.6)
    assert s["e2e_p50_s"] == pytest.approx(1.4)
    assert s["itl_p50_s"] == pytest.approx(0.2)  # all gaps pooled: 0.1, 0.2, 0.3
    assert s["req_per_s"] == pytest.approx(3 / 4)
    assert s["output_tok_per_s"] == pytest.approx(60 / 4)
    # $: (1000*3 + 10*15) + (200*3 + 800*0.3 + 20*15) + (400*3 + 1600*0.3 + 30*15), per million tokens
    total = (3150 + 1140 + 2130) / 1e6
    assert s["cost_usd"] == pytest.approx(total)
    assert s["cost_per_task_usd"] == pytest.approx(total / 3)
    assert s["evictions"] == 2


def test_unreported_cached_tokens_give_no_hit_rate():
    rs = [Result(0, 0, "t", 0.0, ok=True, ttft=0.1, e2e=0.2, prompt_tokens=10, output_tokens=1)]
    s = summarize(rs, 1.0, Prices())
    assert s["hit_rate_tokens"] is None and s["hit_rate_requests"] is None
    assert s["cost_usd"] == pytest.approx((10 * 3.0 + 1 * 15.0) / 1e6)


def test_table_ratio_column():
    on = summarize(_run(), 4.0, Prices())
    off = {**on, "ttft_p50_s": 1.2}
    md = table({"cache on": on, "cache off": off}, ratio_to="cache on")
    assert "| figure | cache on | cache off | cache off / cache on |" in md
    assert "| TTFT p50 (s) | 0.400 | 1.200 | 3.00x |" in md
    assert "| requests ok / errors | 3 / 1 | 3 / 1 |  |" in md
