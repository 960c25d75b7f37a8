"""Benchmark arithmetic (percentiles, hit rates, cost) and the JSON / Markdown it ends up in."""
import math
from dataclasses import dataclass

from prefixcache.bench.driver import Result
from prefixcache.slo import Objectives


@dataclass
class Prices:
    """USD per million tokens. Defaults: a typical frontier-API price list (Claude Sonnet 4.x list prices:
    $3 input, $0.30 cache read, $15 output); cache writes are billed as plain input here."""

    input: float = 3.0
    cached: float = 0.30
    output: float = 15.0


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def request_cost(r: Result, prices: Prices) -> float:
    cached = r.cached_tokens or 0
    return ((r.prompt_tokens - cached) * prices.input + cached * prices.cached + r.output_tokens * prices.output) / 1e6


def summarize(results: list[Result], wall: float, prices: Prices, server: dict | None = None) -> dict:
    """One run's figures. Hit rates: cached / prompt tokens summed over requests (token-weighted), and the mean of
    each request's own cached / prompt ratio (per request, so short and long prompts count alike)."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    reported = all(r.cached_tokens is not None for r in ok)
    itl = [g for r in ok for g in r.itl]
    s = {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
         "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": sum(r.output_tokens for r in ok),
         "hit_rate_tokens": cached / prompt if prompt and reported else None,
         "hit_rate_requests": sum((r.cached_tokens or 0) / r.prompt_tokens for r in ok if r.prompt_tokens) / len(ok)
         if ok and reported else None,
         "saved_input_tokens": cached, "wall_s": wall,
         "req_per_s": len(ok) / wall if wall else None,
         "output_tok_per_s": sum(r.output_tokens for r in ok) / wall if wall else None,
         "cost_usd": sum(request_cost(r, prices) for r in ok)}
    s["cost_per_task_usd"] = s["cost_usd"] / len(ok) if ok else None
    for name, values in (("ttft", [r.ttft for r in ok]), ("e2e", [r.e2e for r in ok]), ("itl", itl)):
        for p in (50, 90, 99):
            s[f"{name}_p{p}_s"] = percentile(values, p)
    s.update(server or {})
    return s


def goodput(results: list[Result], wall: float, objectives: Objectives) -> dict:
    """vLLM's goodput: the requests that meet every objective, per second of the run; and the attainment of all
    of them together and of each, over every request sent (a failed request meets none)."""
    checks = [objectives.met(r.ttft, r.e2e, r.output_tokens) if r.ok else dict.fromkeys(objectives.given(), False)
              for r in results]
    n, good = len(results), sum(all(c.values()) for c in checks)
    out = {"goodput_req_per_s": good / wall if wall else None, "slo_attainment": good / n if n else None}
    for name in objectives.given():
        out[f"slo_attainment_{name}"] = sum(c[name] for c in checks) / n if n else None
    return out


ROWS = [("TTFT p50 (s)", "ttft_p50_s", 3), ("TTFT p90 (s)", "ttft_p90_s", 3), ("TTFT p99 (s)", "ttft_p99_s", 3),
        ("e2e p50 (s)", "e2e_p50_s", 3), ("e2e p90 (s)", "e2e_p90_s", 3), ("e2e p99 (s)", "e2e_p99_s", 3),
        ("inter-token p50 (ms)", "itl_p50_s", -1), ("inter-token p99 (ms)", "itl_p99_s", -1),
        ("throughput (req/s)", "req_per_s", 3), ("output (tok/s)", "output_tok_per_s", 1),
        ("goodput (req/s)", "goodput_req_per_s", 3), ("SLO attainment, all objectives", "slo_attainment", 3),
        ("TTFT objective met", "slo_attainment_ttft", 3), ("TPOT objective met", "slo_attainment_tpot", 3),
        ("e2e objective met", "slo_attainment_e2el", 3),
        ("hit rate, tokens", "hit_rate_tokens", 3), ("hit rate, mean per request", "hit_rate_requests", 3),
        ("saved input tokens", "saved_input_tokens", 0), ("prompt tokens", "prompt_tokens", 0),
        ("cost per successful task ($)", "cost_per_task_usd", 6), ("requests ok / errors", "ok", 0),
        ("peak KV usage (%)", "peak_kv_usage_perc", 1), ("evictions (blocks)", "evictions", 0),
        ("server RSS after the run (MB)", "rss_mb", 0), ("server peak RSS since its start (MB)", "peak_rss_mb", 0)]


def fmt(v, digits: int) -> str:
    if v is None:
        return "n/a"
    if digits < 0:  # seconds shown as milliseconds, with -digits decimals
        return f"{v * 1000:.{-digits}f}"
    return f"{v:.{digits}f}" if digits else f"{v:,.0f}"


def table(columns: dict[str, dict], ratio_to: str | None = None, rows: list[tuple[str, str, int]] = ROWS) -> str:
    """A Markdown table of `rows` (label, key, digits), one column per run; with ratio_to, a `<col> / <ratio_to>`
    column for each other run."""
    names = list(columns)
    others = [n for n in names if ratio_to and n != ratio_to]
    head = ["figure"] + names + [f"{n} / {ratio_to}" for n in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, digits in rows:
        vals = [columns[n].get(key) for n in names]
        if all(v is None for v in vals):
            continue
        cells = [fmt(v, digits) for v in vals]
        if key == "ok":
            cells = [f"{c['ok']} / {c['errors']}" for c in columns.values()]
        for n in others:
            a, b = columns[n].get(key), columns[ratio_to].get(key)
            cells.append(f"{a / b:.2f}x" if a is not None and b and key != "ok" else "")
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


def prices_note(prices: Prices) -> str:
    return (f"Cost uses ${prices.input:g} per million input tokens, ${prices.cached:g} per million cached input "
            f"tokens and ${prices.output:g} per million output tokens (set with --price-input, --price-cached, "
            f"--price-output).")

