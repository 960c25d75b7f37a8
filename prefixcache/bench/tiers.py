"""Warm start from the shared tier: a new replica (empty L1) on a prefix another replica computed.

Side by side in one process, with a Redis of its own: replica A computes a 4k-token prompt cold (and writes it
through to L3), A then serves it again from L1, and a fresh replica B serves it from L3. Each request's time to
first token comes from the engine; each figure is the median over `--prompts` distinct prompts. Also: the L3 bytes
per cached token and the Redis round trip per block; and L2, on a replica C with a disk tier and room in L1 for
one prompt: a prompt, a second that evicts it to disk, then the first again, from L2 (its blocks were just written,
so the page cache likely holds them). The capacity planner prices tier hits with the read times per block.
Writes bench/results/tiers.{json,md}.
Run: `make bench` or `python -m prefixcache.bench.tiers`.
"""
import argparse
import json
import os
import random
import secrets
import statistics
import tempfile
import time

from prefixcache import LLM, SamplingParams
from prefixcache.bench.server import RedisProcess
from prefixcache.bench.workloads import text
from prefixcache.cache.credentials import TIER_SECRET_ENV
from prefixcache.models.cpu import cpu_info

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, list[int], dict]:
    out = llm.generate([prompt], GREEDY)[0]
    return out.ttft, out.token_ids, out.cached_by_tier


def spill_and_reload(rng: random.Random, a: LLM, folder: str, tokens: int) -> dict:
    """Replica C, with room in L1 for 1.25 prompts: prompt 1, prompt 2 (which evicts most of 1 to L2), and prompt 1
    again, from L2."""
    prompts = [a.encode(f"Spill {i}. " + text(rng, tokens + 200))[:tokens] for i in range(2)]
    blocks = int(1.25 * tokens / a.engine.config.block_size)
    c = LLM(disk_cache=folder, kv_cache_bytes=blocks * a.engine.pool.block_bytes)
    cold, cold_ids, _ = ttft(c, prompts[0])
    ttft(c, prompts[1])
    c.engine.blocks.tiering.tiers.drain()
    warm, warm_ids, by_tier = ttft(c, prompts[0])
    assert warm_ids == cold_ids, "output differs between cold and L2"
    assert by_tier.get("L2", 0) >= tokens // 2, f"L2 served only {by_tier}"
    counts = c.engine.stats()["tiers"]["counts"]
    return {"l2_tokens": tokens, "l2_cold_s": cold, "l2_ttft_s": warm, "l2_tiers": by_tier,
            "l2_read_s_per_block": counts["L2_read_seconds"] / counts["L2_hits"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault(TIER_SECRET_ENV, secrets.token_hex(32))  # A's and B's one secret: B reads A's blocks
    redis = RedisProcess().start()
    disk = tempfile.TemporaryDirectory(prefix="bench-l2-")
    try:
        a = LLM(redis_url=redis.url, replica_id="a", kv_cache_bytes=2 << 30)
        b = LLM(redis_url=redis.url, replica_id="b", kv_cache_bytes=2 << 30)
        rng = random.Random(3)
        rows = []
        for i in range(args.prompts):
            prompt = a.encode(f"Document {i}. " + text(rng, args.tokens + 200))[:args.tokens]
            cold, cold_ids, _ = ttft(a, prompt)
            a.engine.blocks.tiering.tiers.drain()
            l1, l1_ids, l1_tiers = ttft(a, prompt)
            l3, l3_ids, l3_tiers = ttft(b, prompt)
            assert l1_ids == cold_ids == l3_ids, "output differs between cold, L1 and L3"
            assert l3_tiers.get("L3", 0) >= args.tokens - 16, f"L3 served only {l3_tiers}"
            rows.append({"cold": cold, "l1": l1, "l3": l3, "l1_tiers": l1_tiers, "l3_tiers": l3_tiers})
        counts = b.engine.stats()["tiers"]["counts"]
        written = a.engine.stats()["tiers"]["counts"]
        l2 = spill_and_reload(rng, a, disk.name, args.tokens // 2)
        client = redis.client()
        key = next(client.scan_iter(match="prefixcache:kv:*", count=100))
        memory, record = client.memory_usage(key, samples=0), client.strlen(key)
        pings = []
        for _ in range(200):
            t = time.perf_counter()
            client.ping()
            pings.append(time.perf_counter() - t)
    finally:
        redis.stop()
        disk.cleanup()
    med = {k: statistics.median(r[k] for r in rows) for k in ("cold", "l1", "l3")}
    blocks = counts["L3_hits"]
    result = {
        "cpu": str(cpu_info()), "tokens": args.tokens, "prompts": args.prompts, "runs": rows, "median_s": med,
        "l3_over_l1": med["l3"] / med["l1"], "cold_over_l3": med["cold"] / med["l3"],
        "l3_bytes_per_token": written["L3_bytes_written"] / (written["L3_writes"] * a.engine.config.block_size),
        "kv_bytes_per_token": a.engine.pool.block_bytes / a.engine.config.block_size,
        "l3_read_s_per_block": counts["L3_read_seconds"] / blocks, "l3_mb_per_s":
            counts["L3_bytes_read"] / counts["L3_read_seconds"] / 1e6,
        "redis_ping_ms_p50": 1e3 * statistics.median(pings),
        "l3_record_bytes": record, "l3_memory_per_block": memory, **l2,
    }
    cpu = cpu_info()
    md = "\n".join([
        "# Warm start from L3 (Redis) and L2 (disk)", "",
        f"{cpu.model} ({' '.join(cpu.simd)}), {cpu.threads} threads; SmolLM2-135M-Instruct fp32 (fp32 KV), "
        f"{args.tokens}-token prompts, median of {args.prompts}; Redis 7 on loopback, started by the benchmark. "
        "TTFT from the engine (arrival to first token). Every output equals the cold one (checked).", "",
        "| figure | value | target |", "|---|---|---|",
        f"| TTFT cold (recompute) | {med['cold']:.3f} s | |",
        f"| TTFT, L1 hit on the replica that computed it | {med['l1']:.3f} s | |",
        f"| TTFT, L3 hit on a new replica (empty L1) | {med['l3']:.3f} s | |",
        f"| L3 / L1 | {result['l3_over_l1']:.2f}x | <= 2x |",
        f"| cold / L3 | {result['cold_over_l3']:.1f}x | >= 10x |",
        f"| L3 bytes per cached token (record: fp32 K and V, header) | {result['l3_bytes_per_token']:.0f} B "
        f"(KV in memory: {result['kv_bytes_per_token']:.0f} B) | |",
        f"| L3 read time per block (MGET round trips, windows of 8 blocks) | "
        f"{1e3 * result['l3_read_s_per_block']:.2f} ms ({result['l3_mb_per_s']:.0f} MB/s) | |",
        f"| Redis round trip (PING, p50) | {result['redis_ping_ms_p50']:.3f} ms | |",
        f"| Redis memory per block (MEMORY USAGE: its allocator's size class and the key) | {memory:,} B "
        f"(record: {record:,} B) | |",
        f"| TTFT, L2 hit ({l2['l2_tokens']} tokens; cold: {l2['l2_cold_s']:.3f} s) | {l2['l2_ttft_s']:.3f} s | |",
        f"| L2 read time per block (one file each) | {1e3 * l2['l2_read_s_per_block']:.2f} ms | |", ""])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tiers.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "tiers.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
