"""Several replicas behind the router: cache-aware routing against round-robin and against one replica.

Side by side in one run, on the multi-tenant workload (each tenant its own long system prompt and API key):
- one replica (2 threads);
- 3 replicas (1 thread each, on this 2-core machine) behind `prefixcache route`, cache-aware;
- the same 3 behind round-robin routing;
- the same 3 behind round-robin with the shared L3 tier on, which lets a replica load what another computed;
- the same 3 behind vllm-router (an existing gateway, PyPI), cache-aware by a radix tree of the text it routed.
The first three keep Redis for KV events only, so their hit rates show the routing alone. Replicas' caches are
emptied (L1, L2 and L3) before each run. Prefill tokens computed (prompt minus cached tokens, summed) do not
depend on the machine. Writes bench/results/cluster.{json,md}. Run: `make bench` or
`python -m prefixcache.bench.cluster`.
"""
import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.bench.driver import Load, Target, run
from prefixcache.bench.report import Prices, summarize, table
from prefixcache.bench.runs import WARMUP
from prefixcache.bench.server import ADMIN_KEY, LocalServer, RedisProcess, ServerOptions, free_port
from prefixcache.bench.workloads import Size, multi_tenant
from prefixcache.cache.credentials import ROUTER_ADMIN_KEY_ENV, TIER_SECRET_ENV
from prefixcache.models.cpu import cpu_info

KV_BYTES = 1 << 30


@contextmanager
def vllm_router(urls: list[str], log: str):
    """vllm-router (the test extra installs it) in front of the replicas, cache-aware; yields its URL."""
    exe = shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    assert exe, "vllm-router is not installed (pip install -e '.[test]')"
    port = free_port()
    with open(log, "a") as out:
        proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                                 "--worker-urls", *urls], stdout=out, stderr=subprocess.STDOUT)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        try:
            while not _up(f"{url}/health"):
                assert proc.poll() is None and time.monotonic() < deadline, f"vllm-router did not start: {log}"
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def drive(workload, target: Target, users: int) -> dict:
    async def go():
        await run(WARMUP, target, Load(users=1))
        return await run(workload, target, Load(users=users))

    results, wall = asyncio.run(go())
    s = summarize(results, wall, Prices())
    s["prefill_tokens_computed"] = sum(r.prompt_tokens - (r.cached_tokens or 0) for r in results if r.ok)
    return s


def decisions(url: str) -> dict:
    """The router's choices by reason (cache, balance, load, round-robin) and its retries."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "prefixcache_router:decisions_total":
                out[f"routed_{s.labels['reason']}"] = s.value
            elif s.name == "prefixcache_router:retries_total":
                out["retries"] = out.get("retries", 0) + s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--users", type=int, default=8)
    args = ap.parse_args()
    size = Size(requests=args.requests, tenants=args.tenants)
    workload = multi_tenant(0, size)
    log = os.path.join(args.out, "cluster.log")
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault(TIER_SECRET_ENV, secrets.token_hex(32))  # every replica's: each reads the others' L3
    os.environ[ROUTER_ADMIN_KEY_ENV] = ADMIN_KEY  # the router's health checks read the replicas' ids and load with it
    redis = RedisProcess().start()
    columns = {}
    try:
        def replica(i: int, kv: bool) -> ServerOptions:
            flags = ("--redis-url", redis.url, "--replica-id", f"r{i}", "--num-threads", "1") + \
                (() if kv else ("--no-redis-kv",))
            return ServerOptions(kv_cache_bytes=KV_BYTES, extra=flags)

        with LocalServer(ServerOptions(kv_cache_bytes=KV_BYTES), workload.tenants, log) as one:
            columns["1 replica"] = drive(workload, Target("one", one.url, one.keys), args.users)
        for kv in (False, True):
            replicas = [LocalServer(replica(i, kv), workload.tenants, log).__enter__() for i in range(3)]
            try:
                urls = [flag for r in replicas for flag in ("--replica", r.url)]
                policies = ("cache-aware", "round-robin") if not kv else ("round-robin",)
                for policy in policies:
                    for r in replicas:
                        r.empty_cache()
                    name = f"3 replicas, {policy}" + (", L3 on" if kv else "")
                    opts = ServerOptions(kind="router", extra=(*urls, "--redis-url", redis.url, "--policy", policy))
                    with LocalServer(opts, [], log) as router:
                        columns[name] = drive(workload, Target(name, router.url, replicas[0].keys), args.users)
                        columns[name] |= decisions(router.url)
                if not kv:
                    for r in replicas:
                        r.empty_cache()
                    with vllm_router([r.url for r in replicas], log) as url:
                        name = "3 replicas, vllm-router cache-aware"
                        columns[name] = drive(workload, Target(name, url, replicas[0].keys), args.users)
            finally:
                for r in replicas:
                    r.__exit__()
    finally:
        redis.stop()
    aware, rr, single = columns["3 replicas, cache-aware"], columns["3 replicas, round-robin"], columns["1 replica"]
    ratios = {"aware_over_single": aware["hit_rate_tokens"] / single["hit_rate_tokens"],
              "aware_over_round_robin": aware["hit_rate_tokens"] / rr["hit_rate_tokens"]}
    cpu = cpu_info()
    with open(os.path.join(args.out, "cluster.json"), "w") as f:
        json.dump({"cpu": str(cpu), "columns": columns, **ratios}, f, indent=1)
    rows = [("hit rate, tokens", "hit_rate_tokens", 3), ("prefill tokens computed", "prefill_tokens_computed", 0),
            ("TTFT p50 (s)", "ttft_p50_s", 3), ("TTFT p90 (s)", "ttft_p90_s", 3),
            ("throughput (req/s)", "req_per_s", 3), ("requests ok / errors", "ok", 0),
            ("routed to the longest cached prefix", "routed_cache", 0), ("routed for balance", "routed_balance", 0),
            ("routed to the least loaded", "routed_load", 0), ("routed round-robin", "routed_round-robin", 0),
            ("retries", "retries", 0)]
    md = "\n".join([
        "# Replicas behind the router", "",
        f"{cpu.model} ({' '.join(cpu.simd)}), {cpu.threads} threads. {workload.notes}: {args.requests} requests,"
        f" {args.tenants} tenants, ~{size.prefix_tokens}-token system prompts, {args.users} concurrent users, greedy. "
        "SmolLM2-135M-Instruct; replicas with 1 thread each (3 processes on 2 cores), the single replica with 2. "
        "Redis 7 on loopback for KV events (and L3 where said).", "",
        table(columns, rows=rows), "",
        f"Cache-aware hit rate / 1 replica: {ratios['aware_over_single']:.2f}x (target >= 0.95x); "
        f"/ round-robin: {ratios['aware_over_round_robin']:.2f}x (target >= 1.5x).", ""])
    with open(os.path.join(args.out, "cluster.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
