"""API-feature benchmark: what structured output costs per decode step, and what n samples cost to their first
tokens, through the offline engine, side by side in one process. Writes bench/results/features.{json,md}.
Run: `make bench` or `python -m prefixcache.bench.features`."""
import argparse
import json
import os
import statistics
import time

from prefixcache import LLM, SamplingParams
from prefixcache.bench.engine import _tokens
from prefixcache.engine.grammar import Guide
from prefixcache.models.exactness import cpu_info

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                                                "required": ["name", "count"],
                                                                "properties": {"name": {"type": "string"},
                                                                               "count": {"type": "integer"}}}}}}
BATCH, DECODE_TOKENS, PROMPT, SAMPLES, REPEATS = 8, 48, 2048, 4, 3


def inter_token_ms(llm: LLM, guide: Guide | None) -> float:
    """Median decode step of 8 concurrent requests, over the steps in which all 8 ran (a guided request ends when
    its grammar does)."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=DECODE_TOKENS, ignore_eos=True, guide=guide)
    gaps = []
    for r in range(REPEATS):
        seqs = [llm.engine.add_request(_tokens(64, 1000 * r + i), params) for i in range(BATCH)]
        llm.engine.step()  # the prefill
        while all(s.finish_reason is None for s in seqs):
            t = time.perf_counter()
            llm.engine.step()
            if all(s.finish_reason is None for s in seqs):
                gaps.append(time.perf_counter() - t)
        while any(s.finish_reason is None for s in seqs):
            llm.engine.step()
    return 1000 * statistics.median(gaps)


def first_tokens_s(llm: LLM, n: int) -> float:
    """Time until every one of n samples of a fresh 2k-token prompt has its first token."""
    times = []
    for r in range(REPEATS):
        seq = llm.engine.add_request(_tokens(PROMPT, 50 + 10 * n + r), SamplingParams(temperature=1.0, seed=r,
                                                                                      max_tokens=2, n=n))
        t = time.perf_counter()
        while any(not s.output_ids for s in seq.samples):
            llm.engine.step()
        times.append(time.perf_counter() - t)
        while any(s.finish_reason is None for s in seq.samples):
            llm.engine.step()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    llm = LLM(enable_prefix_cache=False)
    llm.generate(_tokens(16, 1), SamplingParams(max_tokens=2, guide=Guide("json_object")))  # builds xgrammar's tables
    plain, guided = inter_token_ms(llm, None), inter_token_ms(llm, Guide("json_schema", json.dumps(SCHEMA)))
    one, many = first_tokens_s(llm, 1), first_tokens_s(llm, SAMPLES)
    cpu = cpu_info()
    r = {"cpu": cpu.model, "simd": cpu.simd, "threads": cpu.threads, "itl_b8_plain_ms": plain,
         "itl_b8_json_schema_ms": guided, "structured_overhead": guided / plain - 1,
         "first_tokens_n1_s": one, f"first_tokens_n{SAMPLES}_s": many, "n_ratio": many / one}
    md = "\n".join([
        "# API features", "", f"{cpu.model} ({' '.join(cpu.simd)}), {cpu.threads} threads; SmolLM2-135M-Instruct fp32, "
        f"median of {REPEATS} runs in one process.", "", "| figure | value | target |", "|---|---|---|",
        f"| inter-token latency, b={BATCH}, plain (ms) | {plain:.1f} | |",
        f"| inter-token latency, b={BATCH}, json_schema guide (ms) | {guided:.1f} | |",
        f"| structured-output overhead | {100 * r['structured_overhead']:+.1f}% | <= +15% |",
        f"| first tokens of n=1 on a {PROMPT}-token prompt (s) | {one:.2f} | |",
        f"| first tokens of n={SAMPLES} (s) | {many:.2f} | |",
        f"| n={SAMPLES} / n=1 | {r['n_ratio']:.2f}x | <= 1.3x |", ""])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "features.json"), "w") as f:
        json.dump(r, f, indent=1)
    with open(os.path.join(args.out, "features.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
