"""Engine benchmark: our engine and HF transformers side by side on the same weights, plus cache figures.

Each side runs in its own subprocess (so peak RSS is its own); the parent writes
bench/results/engine.json and bench/results/engine.md. Run: `make bench` or `python -m prefixcache.bench.engine`.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PREFILL_LENS = (1024, 4096)
DECODE_CTX, DECODE_TOKENS = 512, 32
REPEATS = 3


def _tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def _median(f, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def side_ours(exactness: str = "auto") -> dict:
    t0 = time.perf_counter()
    from prefixcache import LLM, SamplingParams

    cold = LLM(enable_prefix_cache=False, exactness=exactness)
    r = {"load_s": time.perf_counter() - t0, "exactness": cold.exactness.summary()}
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for n in PREFILL_LENS:
        ids = _tokens(n, n)
        r[f"prefill_{n}_tok_s"] = n / _median(lambda: cold.generate([ids], one), 2 if n > 2000 else REPEATS)
    many = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
    for b in (1, 8):
        prompts = [_tokens(DECODE_CTX, 100 + i) for i in range(b)]
        prefill = _median(lambda: cold.generate(prompts, one), 1)
        total = _median(lambda: cold.generate(prompts, many), 2)
        r[f"decode_b{b}_tok_s"] = b * DECODE_TOKENS / (total - prefill)
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # one engine, before the cache runs
    r.update(_cache_figures(cold))
    return r


def _cache_figures(cold) -> dict:
    """TTFT of a 4096+64 hit vs miss vs the suffix-only floor, and KV bytes per token."""
    from prefixcache import LLM, SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1)
    prefix = _tokens(4096, 7)
    suffixes = [_tokens(64, 1000 + i) for i in range(5)]
    warm = LLM()
    warm.generate([prefix + [5]], one)
    hits = []
    for s in suffixes:
        out = warm.generate([prefix + s], one)[0]
        assert out.cached_tokens == 4096
        hits.append(out.ttft)
    miss = _median(lambda: cold.generate([prefix + suffixes[0]], one), 2)
    floor = _suffix_floor(warm, prefix, [_tokens(64, 2000 + i) for i in range(5)])  # suffixes not cached yet
    hit = statistics.median(hits)
    return {"hit_4096_64_ttft_s": hit, "miss_4096_64_ttft_s": miss, "suffix_floor_64_on_4096_s": floor,
            "hit_over_floor": hit / floor, "miss_over_hit": miss / hit,
            "kv_bytes_per_token": warm.engine.pool.block_bytes // warm.engine.pool.block_size,
            "kv_dtype": warm.engine.config.kv_dtype, "match_lock": _match_lock_times()}


def _suffix_floor(warm, prefix: list[int], suffixes: list[list[int]]) -> float:
    """The one engine step that prefills 64 tokens over the cached prefix: what a hit cannot avoid."""
    from prefixcache import SamplingParams

    times = []
    for s in suffixes:
        seq = warm.engine.add_request(prefix + s, SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        warm.engine.step()
        times.append(time.perf_counter() - t)
        assert seq.finish_reason is not None and seq.cache.num_cached == len(prefix)
    return statistics.median(times)


def _match_lock_times() -> dict:
    """Hash + match + lock for an 8k-token prompt as the cache holds more and more tokens (synthetic KV)."""
    import torch

    from prefixcache.cache.pool import KVPool
    from prefixcache.cache.scope import CacheScope
    from prefixcache.engine.blocks import BlockManager
    from prefixcache.engine.sequence import SamplingParams, Sequence
    from prefixcache.options import default

    bs = default("block_size")
    pool = KVPool(1, 1, 1, bs, budget_bytes=(420_000 // bs + 2) * 2 * bs * 2, dtype=torch.bfloat16)
    manager = BlockManager(pool, True, 0, None, [])
    scope = CacheScope(tenant="bench", fingerprint="x")
    prompt = _tokens(8192, 99)
    out, cached, i = {}, 0, 0
    for target in (50_000, 100_000, 200_000, 400_000):
        while cached < target:
            seq = Sequence(prompt if i == 0 else _tokens(8192, 10_000 + i), SamplingParams(), scope)
            manager.prepare(seq)
            manager.admit(seq)
            seq.num_computed = len(seq.tokens)
            manager.release(seq, finished=False)
            cached, i = manager.cache.num_blocks * bs, i + 1
        times = []
        for _ in range(20):
            seq = Sequence(prompt, SamplingParams(), scope)
            t = time.perf_counter()
            manager.prepare(seq)
            manager.admit(seq)
            times.append(time.perf_counter() - t)
            assert seq.cache.num_cached == 8191
            manager.release(seq, finished=False)
        out[str(cached)] = statistics.median(times) * 1000
    return {"cached_tokens_to_ms": out}


def side_hf() -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from prefixcache.config import default_model_path
    from prefixcache.models.loader import converted_folder

    folder = converted_folder(default_model_path())
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    r = {"load_s": time.perf_counter() - t0}
    with torch.inference_mode():
        for n in PREFILL_LENS:
            ids = torch.tensor([_tokens(n, n)])
            r[f"prefill_{n}_tok_s"] = n / _median(lambda: model(ids, logits_to_keep=1), 2 if n > 2000 else REPEATS)
        for b in (1, 8):
            ids = torch.tensor([_tokens(DECODE_CTX, 100 + i) for i in range(b)])
            kw = dict(do_sample=False, pad_token_id=0, min_new_tokens=DECODE_TOKENS + 1)
            prefill = _median(lambda: model.generate(ids, max_new_tokens=1, **{**kw, "min_new_tokens": 1}), 1)
            total = _median(lambda: model.generate(ids, max_new_tokens=DECODE_TOKENS + 1, **kw), 2)
            r[f"decode_b{b}_tok_s"] = b * DECODE_TOKENS / (total - prefill)
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return r


def _run_side(name: str, exactness: str = "auto") -> dict:
    out = subprocess.run([sys.executable, "-m", "prefixcache.bench.engine", "--side", name, "--exactness", exactness],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(ours: dict, hf: dict, fixed: dict) -> str:
    rows = [("load time (s)", "load_s", False), ("prefill 1k (tok/s)", "prefill_1024_tok_s", True),
            ("prefill 4k (tok/s)", "prefill_4096_tok_s", True), ("decode b=1, ctx 512 (tok/s)", "decode_b1_tok_s", True),
            ("decode b=8, ctx 512 (tok/s)", "decode_b8_tok_s", True), ("peak RSS (MB)", "peak_rss_mb", False)]
    lines = ["# Engine benchmark", "", f"SmolLM2-135M-Instruct, fp32 weights, {os.cpu_count()} CPU cores. "
             "Ratio: ours / HF for speeds, HF / ours for time and memory (higher is better for us).", "",
             "| figure | prefixcache | HF transformers | ratio | prefixcache (fixed) |", "|---|---|---|---|---|"]
    for label, key, higher in rows:
        ratio = ours[key] / hf[key] if higher else hf[key] / ours[key]
        lines.append(f"| {label} | {ours[key]:.2f} | {hf[key]:.2f} | {ratio:.2f}x | {fixed.get(key, 0):.2f} |")
    lines += ["", "## Prefix cache", "", "| figure | value |", "|---|---|"]
    for key in ("hit_4096_64_ttft_s", "miss_4096_64_ttft_s", "suffix_floor_64_on_4096_s", "hit_over_floor",
                "miss_over_hit", "kv_bytes_per_token", "kv_dtype"):
        v = ours[key]
        lines.append(f"| {key} | {v:.3f} |" if isinstance(v, float) else f"| {key} | {v} |")
    lines += ["", "Match + lock (hash the prompt, walk the tree, take references) for an 8192-token prompt:", "",
              "| tokens cached | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in ours["match_lock"]["cached_tokens_to_ms"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["ours", "hf"])
    ap.add_argument("--exactness", default="auto", help="ours: the exactness mode (Config.exactness)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side_ours(args.exactness) if args.side == "ours" else side_hf()))
        return
    ours, hf = _run_side("ours"), _run_side("hf")
    fixed = _run_side("ours", "fixed")  # the cost of the guaranteed fallback
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine.json"), "w") as f:
        json.dump({"prefixcache": ours, "hf_transformers": hf, "prefixcache_fixed": fixed}, f, indent=1)
    md = report(ours, hf, fixed)
    with open(os.path.join(args.out, "engine.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
