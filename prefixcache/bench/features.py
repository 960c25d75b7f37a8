"""API-feature benchmark: what structured output costs per decode step, how long another request's decode stalls
while a new schema compiles, and what n samples cost to their first tokens, through the offline engine, side by
side in one process. Writes bench/results/features.{json,md}.
Run: `make bench` or `python -m prefixcache.bench.features`."""
import argparse
import json
import os
import statistics
import time

from prefixcache import LLM, SamplingParams
from prefixcache.bench.engine import _tokens
from prefixcache.engine.guide import Guide
from prefixcache.models.cpu import cpu_info

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                                                "required": ["name", "count"],
                                                                "properties": {"name": {"type": "string"},
                                                                               "count": {"type": "integer"}}}}}}
BATCH, DECODE_TOKENS, PROMPT, SAMPLES, REPEATS = 8, 48, 2048, 4, 3


def wide_schema(tag: str, fields: int = 300) -> dict:
    """A JSON schema that takes xgrammar about a second to compile here; `tag` makes it a new one."""
    item = {"type": "object", "properties": {"mail": {"type": "string", "pattern": "[a-z]{3,9}@[a-z]+\\.com"},
                                             "scores": {"type": "array", "items": {"type": "number"}, "minItems": 2},
                                             "kind": {"enum": ["x", "y", tag]}}, "required": ["mail", "scores"]}
    return {"type": "object", "properties": {f"{tag}_{i}": item for i in range(fields)},
            "required": [f"{tag}_{i}" for i in range(fields)]}


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


def compile_stall_s(llm: LLM) -> tuple[float, float, float]:
    """While a request decodes, another arrives with a new wide schema: the decoding request's longest gap between
    two tokens until the schema's first token, its median gap, and the seconds to that first token."""
    plain = llm.engine.add_request(_tokens(64, 7), SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
    while not plain.output_ids:
        llm.engine.step()
    start = last = time.perf_counter()
    guided = llm.engine.add_request(_tokens(32, 8), SamplingParams(temperature=0.0, max_tokens=1, guide=Guide(
        "json_schema", json.dumps(wide_schema(f"stall{time.time_ns()}")))))
    gaps, seen = [], len(plain.output_ids)
    while not guided.output_ids and plain.finish_reason is None:
        llm.engine.step()
        if len(plain.output_ids) > seen:
            now = time.perf_counter()
            gaps.append(now - last)
            last, seen = now, len(plain.output_ids)
    compiled = time.perf_counter() - start
    llm.engine.abort(plain)
    return max(gaps), statistics.median(gaps), compiled


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
    stall, step, compiled = compile_stall_s(llm)
    one, many = first_tokens_s(llm, 1), first_tokens_s(llm, SAMPLES)
    cpu = cpu_info()
    r = {"cpu": cpu.model, "simd": cpu.simd, "threads": cpu.threads, "itl_b8_plain_ms": plain,
         "itl_b8_json_schema_ms": guided, "structured_overhead": guided / plain - 1,
         "compile_stall_max_gap_s": stall, "compile_stall_median_gap_s": step, "compile_first_token_s": compiled,
         "first_tokens_n1_s": one, f"first_tokens_n{SAMPLES}_s": many, "n_ratio": many / one}
    md = "\n".join([
        "# API features", "", f"{cpu.model} ({' '.join(cpu.simd)}), {cpu.threads} threads; SmolLM2-135M-Instruct fp32, "
        f"median of {REPEATS} runs in one process.", "", "| figure | value | target |", "|---|---|---|",
        f"| inter-token latency, b={BATCH}, plain (ms) | {plain:.1f} | |",
        f"| inter-token latency, b={BATCH}, json_schema guide (ms) | {guided:.1f} | |",
        f"| structured-output overhead | {100 * r['structured_overhead']:+.1f}% | <= +15% |",
        f"| a new 300-field schema's first token (s) | {compiled:.2f} | |",
        f"| meanwhile, another request's longest gap between tokens (s) | {stall:.3f} | |",
        f"| its median gap (s) | {step:.3f} | |",
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
