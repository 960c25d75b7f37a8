"""Gemma 3's KV memory with its local layers' pages given back once their window has passed (issue 34 item 3).

For one request of 1k, 4k and 8k random prompt token ids and 64 greedy output tokens (prefix cache off, chunks of
512), in process on Gemma 3 270M: the most KV the pool held at once (its pages in use after each step), against what
keeping every layer's keys and values for every token takes (the pool before the local parts). Then the same with
the prefix cache on (emptied before each request): the finished request's blocks stay cached with their local parts
until the room is wanted.
Last, what that buys a pool: 8 requests of 4,096 tokens (and 64 output tokens) at once in a pool of 256 MiB, which
holds one of them with every layer kept: the most that ran at once, preemptions, and the wall time.
Writes bench/results/window_kv.{json,md}. Run: `python -m prefixcache.bench.window_kv` (about two minutes).
"""
import argparse
import json
import os
import random
import time

from prefixcache import LLM, SamplingParams
from prefixcache.models.cpu import cpu_info

PROMPTS = (1024, 4096, 8192)
OUTPUT = 64
MIB = 2**20


def measure(llm: LLM, tokens: int, rng: random.Random) -> dict:
    e, pool = llm.engine, llm.engine.pool
    e.blocks.clear()  # the earlier requests' entries
    prompt = [rng.randrange(1000, 200_000) for _ in range(tokens)]
    e.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True))
    peak = 0
    while e.has_unfinished():
        e.step()
        peak = max(peak, pool.usable_blocks - pool.num_free)
    every_layer = -(-(tokens + OUTPUT) // pool.block_size) * pool.block_size * pool.bytes_per_token
    return {"prompt": tokens, "peak_mib": peak * pool.block_bytes / MIB, "every_layer_mib": every_layer / MIB,
            "after_mib": (pool.usable_blocks - pool.num_free) * pool.block_bytes / MIB}


def crowd(model: str, rng: random.Random) -> dict:
    """8 requests of 4,096 random token ids in a 256 MiB pool, all at once, cache off."""
    llm = LLM(model=model, enable_prefix_cache=False, kv_cache_bytes=256 * MIB, max_model_len=8192)
    e = llm.engine
    for _ in range(8):
        e.add_request([rng.randrange(1000, 200_000) for _ in range(4096)],
                      SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True))
    started, most = time.perf_counter(), 0
    while e.has_unfinished():
        e.step()
        most = max(most, len(e.scheduler.running))
    return {"seconds": time.perf_counter() - started, "most_running": most,
            "preemptions": e.scheduler.num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rng = random.Random(0)
    report = {"cpu": str(cpu_info()), "model": args.model, "output_tokens": OUTPUT}
    for cache in (False, True):
        llm = LLM(model=args.model, enable_prefix_cache=cache, max_batch_tokens=512, max_model_len=16384)
        pool = llm.engine.pool
        report["pool"] = {"page_layers": pool.page_layers, "local_pages": pool.local_pages, "window": pool.window,
                          "bytes_per_token": pool.bytes_per_token}
        report["cache_on" if cache else "cache_off"] = [measure(llm, n, rng) for n in PROMPTS]
        print(json.dumps(report), flush=True)
    report["crowd"] = crowd(args.model, rng)
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/window_kv.json", "w") as f:
        json.dump(report, f, indent=1)
    p = report["pool"]
    lines = ["# Gemma 3's KV with the local layers' pages given back", "",
             f"{report['cpu']}. {args.model}: a page holds {p['page_layers']} global layers, a block's local part "
             f"{p['local_pages']} pages (the local layers, window {p['window']}); {p['bytes_per_token']} bytes a "
             f"token in every layer (fp32). One request at a time, {OUTPUT} output tokens, chunks of 512.", "",
             "| prompt tokens | peak KV, cache off (MiB) | every layer, every token (MiB) | ratio | "
             "held after it finished, cache on (MiB) |", "|---|---|---|---|---|"]
    for off, on in zip(report["cache_off"], report["cache_on"]):
        lines.append(f"| {off['prompt']} | {off['peak_mib']:.1f} | {off['every_layer_mib']:.1f} | "
                     f"{off['every_layer_mib'] / off['peak_mib']:.2f}x | {on['after_mib']:.1f} |")
    c = report["crowd"]
    lines += ["", f"8 requests of 4,096 tokens at once in a 256 MiB pool (one fits with every layer kept): at most "
              f"{c['most_running']} ran at once, {c['preemptions']} preemptions, {c['seconds']:.1f} s."]
    with open(f"{args.out}/window_kv.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
