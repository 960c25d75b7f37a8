"""Sweeps: TTFT against shared-prefix length, hit rate and TTFT against arrival rate, hit rate against memory, and
SLO attainment and goodput against arrival rate (the highest rate at which 90% of requests meet the objectives)."""
import json
import os
import random
import statistics

import httpx

from prefixcache.bench.driver import Load, Target
from prefixcache.bench.runs import Bench, local, measure, target
from prefixcache.bench.server import ADMIN_KEY
from prefixcache.bench.workloads import (
    Session,
    Size,
    Turn,
    Workload,
    multi_tenant,
    shared_system_prompt,
    system_prompt,
    text,
)

SUFFIX_TOKENS = 64


def prefix_length(lengths: list[int], hits: int, bench: Bench) -> list[dict]:
    """Per length L: one cold request (miss), then `hits` requests with the same L-token system prompt and a new
    64-token question. Also the 64-token question alone, a measured floor that pays no attention over a prefix."""
    sessions, kinds = [], []
    for i, n in enumerate(lengths):
        rng = random.Random(1000 + i)
        system = {"role": "system", "content": system_prompt(rng, n)}
        for k in range(hits + 1):
            sessions.append(Session([Turn([system, {"role": "user", "content": text(rng, SUFFIX_TOKENS)}], 1)]))
            kinds.append((n, "miss" if k == 0 else "hit"))
    rng = random.Random(999)
    for _ in range(3):
        sessions.append(Session([Turn([{"role": "user", "content": text(rng, SUFFIX_TOKENS)}], 1)]))
        kinds.append((0, "alone"))
    workload = Workload("prefix-length sweep", sessions)
    srv = local(bench, prefix_cache=True)
    _, results = measure(workload, Target("sweep", srv.url, srv.keys), bench, "cache on", srv, Load(users=1))
    floor = statistics.median(r.ttft for r, (_, kind) in zip(results, kinds) if kind == "alone" and r.ok)
    points = []
    for n in lengths:
        rs = [(r, kind) for r, (m, kind) in zip(results, kinds) if m == n and r.ok]
        miss = [r for r, kind in rs if kind == "miss"]
        hit = [r for r, kind in rs if kind == "hit"]
        if not miss or not hit:
            continue
        points.append({"target_tokens": n, "prompt_tokens": miss[0].prompt_tokens,
                       "cached_tokens": statistics.median(r.cached_tokens or 0 for r in hit),
                       "miss_ttft_s": miss[0].ttft, "hit_ttft_s": statistics.median(r.ttft for r in hit),
                       "alone_64_ttft_s": floor})
    return points


def engine_floor(path: str = "bench/results/engine.json") -> float | None:
    """The runner-only floor from the engine benchmark: 64 tokens prefilled over 4096 cached ones."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["prefixcache"].get("suffix_floor_64_on_4096_s")


def arrival_rate(rates: list[float], size: Size, seed: int, bench: Bench) -> list[dict]:
    """Open-loop Poisson runs of the shared-system-prompt workload, cache on and off."""
    points = [{"rate": r} for r in rates]
    workload = shared_system_prompt(seed, size)
    for cache, label in ((True, "on"), (False, "off")):
        srv = local(bench, prefix_cache=cache)
        for p in points:
            s, _ = measure(workload, Target(label, srv.url, srv.keys), bench, f"{p['rate']} req/s, cache {label}", srv,
                           Load(rate=p["rate"], seed=seed))
            p[f"ttft_p50_{label}_s"], p[f"ttft_p99_{label}_s"] = s["ttft_p50_s"], s["ttft_p99_s"]
            if cache:
                p["hit_rate_tokens"] = s["hit_rate_tokens"]
    return points


def memory_budget(fractions: list[float], size: Size, seed: int, bench: Bench) -> list[dict]:
    """The multi-tenant workload, 2 users, the KV budget a fraction of its working set: every tenant's prefix
    once, plus each user's question and reply (live requests share the cached prefix blocks). Few users and
    several requests per tenant, so that a tenant's prefix must survive the other tenants' requests to hit."""
    workload, users = multi_tenant(seed, size), 2
    working_set = size.tenants * size.prefix_tokens + users * (size.question_tokens + size.max_tokens + 32)
    per_token = httpx.get(f"{local(bench, prefix_cache=True).url}/health",
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["kv_bytes_per_token"]
    points = []
    for f in fractions:
        gb = f * working_set * per_token / 2**30
        srv = local(bench, prefix_cache=True, kv_cache_bytes=int(gb * 2**30))
        s, _ = measure(workload, Target("mem", srv.url, srv.keys), bench, f"{gb * 1024:.0f} MB", srv, Load(users=users))
        points.append({"fraction_of_working_set": f, "budget_mb": gb * 1024, "hit_rate_tokens": s["hit_rate_tokens"],
                       "ttft_p50_s": s["ttft_p50_s"], "evictions": s.get("evictions"), "errors": s["errors"]})
    return points


ATTAINMENT_GOAL = 0.9  # DistServe's: the share of requests that must meet every objective


def goodput_rates(runs: list[tuple[float, Workload]], targets: list[tuple[str, str]], bench: Bench) -> dict:
    """Per target, an open-loop run at each (rate, workload): attainment of the objectives and goodput. Each rate
    has a workload of its own (its own seed), so that no target starts a rate warm from the one before; a server
    started here is emptied before each run as well."""
    out = {}
    for name, url in targets:
        t, srv = target(name, url, bench)
        points = []
        for rate, workload in runs:
            s, _ = measure(workload, t, bench, f"{name}, {rate:g} req/s", srv, Load(rate=rate, seed=bench.load.seed))
            points.append({"rate": rate, **{k: v for k, v in s.items() if k.startswith(("slo_", "goodput"))},
                           "req_per_s": s["req_per_s"], "ttft_p90_s": s["ttft_p90_s"], "errors": s["errors"]})
        out[name] = {"points": points, "max_rate": max_rate(points)}
    return out


def max_rate(points: list[dict], goal: float = ATTAINMENT_GOAL) -> float | None:
    """The highest arrival rate at which `goal` of the requests meet every objective: between the last tested rate
    that does (as every lower one does) and the next, which does not, by linear interpolation of attainment; the
    highest tested rate when all do (a lower bound); None when even the lowest does not."""
    ok = None
    for i, p in enumerate(points):
        if p["slo_attainment"] < goal:
            if ok is None:
                return None
            a, b = points[i - 1], p
            return a["rate"] + (b["rate"] - a["rate"]) * (a["slo_attainment"] - goal) / (a["slo_attainment"] -
                                                                                         b["slo_attainment"])
        ok = p["rate"]
    return ok
