"""`prefixcache plan`: what a KV memory budget buys, before traffic arrives.

A request log (a JSONL of OpenAI or Anthropic requests, a Mooncake-style trace, or a built-in workload's name) is
replayed, one request after another in arrival order, through the real cache code alone: the engine's block
manager over a KV pool of the real model's geometry and the budget's blocks (mapped lazily, so it takes no memory),
whose prefix cache decides every match, write, TTL expiry (on the log's clock) and eviction, by scope. No model
runs: a request is admitted, its prompt counted as computed and published, its output (as many new tokens as it
asked for, of its own) grown and published, and it is released, as the engine does for one sequence alone. Per
budget: the hit rate (cached prompt tokens over prompt tokens), saved prefill tokens, evicted blocks, and the TTFT
the misses imply on this machine, from the engine benchmark's prefill times (bench/results/engine.json): t(u, c) =
a u + b (u^2 + 2 u c) for u computed and c cached tokens, a and b fitted to its 1,024- and 4,096-token prefills.
With tiers below L1 (`--tiers disk:SIZE,redis:SIZE`, plan_tiers.py), blocks evicted from L1 spill to L2, every block
is written through to L3, and a request loads what they hold past its L1 match; the cached tokens then count those
too (as a live server's do), each tier's are shown apart, and the TTFT adds their read time per block, measured by
the tiers benchmark (bench/results/tiers.json).

Replayed alone, the requests never overlap, as under a live load of one user; with many users concurrent requests
share blocks being written, so a live hit rate can differ from the plan's by the requests that overlap.
"""
import json
import math
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace

from prefixcache.bench.driver import Load, arrivals
from prefixcache.bench.plan_tiers import LedgerTiers, block_sizes
from prefixcache.bench.trace import load_trace
from prefixcache.bench.workloads import GENERATORS, Size, Workload, build
from prefixcache.cache.scope import CacheScope
from prefixcache.config import Config
from prefixcache.engine.sequence import SamplingParams

POLICIES = ("lru", "fair", "ttl")
TOKENS_FOR_OUTPUT = (10**9, 2 * 10**9)  # output token ids: each request's its own, never in any prompt
ENGINE_BENCH = "bench/results/engine.json"
TIERS_BENCH = "bench/results/tiers.json"
DRAWS = 5


@dataclass
class Request:
    tenant: str
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds from the log's start


@dataclass
class Point:
    budget_bytes: int
    blocks: int
    hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    saved_prefill_tokens: int
    evicted_blocks: int
    refused_requests: int  # longer than the context, or prompt and output than the budget (a live server: 400)
    tier_tokens: dict[str, int]  # cached tokens loaded from L2 and L3 (in cached_tokens too)
    hit_rate_range: tuple[float, float] | None  # over DRAWS of Redis's sampled eviction, when a full L3 evicted
    ttft_mean_s: float | None
    ttft_p90_s: float | None
    l3_evicted: bool
    replay_s: float


def load(log: str, seed: int = 0, size: Size | None = None, errors: str = "refuse") -> Workload:
    """The log as a workload: a built-in workload's name, a Mooncake-style trace, or a JSONL of API requests."""
    if log not in GENERATORS and _is_trace(log):
        workload, problems = load_trace(log, errors=errors)
        for p in problems:
            print(f"prefixcache plan: {log}: skipped {p}")
        return workload
    return build(log, seed, size or Size())


def plan(workload: Workload, budgets: list[int], policy: str = "lru", ttl: float | None = None, model: str = "",
         min_cache_tokens: int = 0, tiers: dict[str, int] | None = None) -> list[Point]:
    """One Point per budget (bytes of KV for the real model); `tiers` as plan_tiers.parse gives them."""
    if policy not in POLICIES:
        raise ValueError(f"--policy: one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "ttl" and not ttl:
        raise ValueError("--policy ttl needs --ttl SECONDS (the entries' lifetime)")
    real = _real_folder(model)
    geometry = _geometry(real)
    for b in budgets:
        if b // geometry["block_bytes"] < 2:
            raise ValueError(f"--budgets: {b} bytes is less than two KV blocks of this model "
                             f"({geometry['block_bytes']} bytes each)")
    for name, b in (tiers or {}).items():
        if b < geometry["tier_bytes"][name]:
            raise ValueError(f"--tiers: {name}'s {b} bytes hold no block ({geometry['tier_bytes'][name]} bytes each)")
    requests = _requests(workload, real)
    return [_draws(geometry, b, requests, policy, ttl, min_cache_tokens, tiers or {}, _costs()) for b in budgets]


def knee(points: list[Point], within: float = 0.95) -> Point:
    """The smallest budget whose hit rate is at least `within` of the best: past it, memory buys little."""
    best = max(p.hit_rate for p in points)
    return min((p for p in points if p.hit_rate >= within * best), key=lambda p: p.budget_bytes)


def markdown(points: list[Point]) -> str:
    k = knee(points)
    tiers = sorted({t for p in points for t in p.tier_tokens})
    lines = ["| budget | blocks | hit rate | saved prefill tokens | " + "".join(f"from {t} | " for t in tiers) +
             "evicted blocks | refused | TTFT mean (s) | TTFT p90 (s) |", "|---" * (8 + len(tiers)) + "|"]
    for p in points:
        mark = " (knee)" if p is k else ""
        ttft = [f"{t:.3f}" if t is not None else "n/a" for t in (p.ttft_mean_s, p.ttft_p90_s)]
        lines.append(f"| {mib(p.budget_bytes)}{mark} | {p.blocks} | {rate(p)} | {p.saved_prefill_tokens:,} |"
                     + "".join(f" {p.tier_tokens.get(t, 0):,} |" for t in tiers) +
                     f" {p.evicted_blocks:,} | {p.refused_requests} | {ttft[0]} | {ttft[1]} |")
    return "\n".join(lines)


def plot(points: list[Point], title: str, path: str) -> str:
    from prefixcache.bench.plots import _save, plt

    k = knee(points)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([p.budget_bytes / 2**20 for p in points], [p.hit_rate for p in points], "o-", color="tab:green")
    ax.plot([k.budget_bytes / 2**20], [k.hit_rate], "o", markersize=12, markerfacecolor="none", color="black",
            label=f"knee: {mib(k.budget_bytes)}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1)
    ax.set_xlabel("KV cache budget (MiB)")
    ax.set_ylabel("hit rate (cached / prompt tokens)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def as_json(p: Point, **extra) -> str:
    return json.dumps({**asdict(p), **extra})


# ---- helpers ------------------------------------------------------------------------------------------------
def rate(p: Point) -> str:
    """The hit rate, and its range over Redis's random draws where it has one."""
    return f"{p.hit_rate:.3f}" + (f" ({p.hit_rate_range[0]:.3f}-{p.hit_rate_range[1]:.3f})" if p.hit_rate_range else "")


def mib(b: int) -> str:
    return f"{b / 2**30:g} GiB" if b >= 2**30 else f"{b / 2**20:g} MiB"


def _real_folder(model: str) -> str:
    from prefixcache.models.catalog import model_path
    from prefixcache.models.loader import converted_folder

    path = model_path(model)
    return path if os.path.isdir(path) else converted_folder(path)


def _geometry(folder: str) -> dict:
    """The real model's KV block: its layers, KV heads and head size (as the engine reads them), float32 as served."""
    import torch

    from prefixcache.cache.pool import KVPool
    from prefixcache.models.loader import read_config

    m = read_config(folder)
    g = {"layers": m.num_layers, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "block_size": Config.block_size,
         "context": m.max_position, "local_layers": list(m.local_layers), "window": m.sliding_window}
    shape = (g["layers"], g["block_size"], g["kv_heads"], g["head_dim"])
    return {**g, "block_bytes": KVPool.bytes_per_block(*(g[k] for k in ("layers", "kv_heads", "head_dim",
                                                                          "block_size")), torch.float32),
            "tier_bytes": block_sizes(shape, torch.float32, TIERS_BENCH)}


def _requests(workload: Workload, folder: str) -> list[Request]:
    from transformers import AutoTokenizer

    from prefixcache.prompt import fields, render

    tokenizer = AutoTokenizer.from_pretrained(folder)
    starts = arrivals(workload, Load()) if _timed(workload) else [0.0] * len(workload.sessions)
    out = []
    for session, start in zip(workload.sessions, starts):
        for turn, messages in session.logged():
            prompt = turn.prompt_ids or render(tokenizer, fields({"messages": messages, "tools": session.tools})
                                                ).token_ids
            out.append(Request(session.tenant, prompt, turn.max_tokens, turn.arrival or start))
    return sorted(out, key=lambda r: r.arrival)  # stable: a log without times replays in its order


def _is_trace(path: str) -> bool:
    with open(path) as f:
        first = next((line for line in f if line.strip()), "{}")
    try:
        return "hash_ids" in json.loads(first)
    except json.JSONDecodeError:
        return False


def _timed(workload: Workload) -> bool:
    return all(t.arrival is not None for s in workload.sessions for t in s.turns[:1])


def _draws(geometry: dict, budget: int, requests: list[Request], policy: str, ttl: float | None,
           min_cache_tokens: int, tiers: dict[str, int], costs: dict | None) -> Point:
    """The replay; where a full L3 evicted, which blocks it kept is a random draw (bench/redis_lru.py): then the
    median of DRAWS seeded replays, with their range."""
    first = _replay(geometry, budget, requests, policy, ttl, min_cache_tokens, tiers, costs, 0)
    if not first.l3_evicted:
        return first
    points = [first, *(_replay(geometry, budget, requests, policy, ttl, min_cache_tokens, tiers, costs, seed)
                       for seed in range(1, DRAWS))]
    points.sort(key=lambda p: p.hit_rate)
    return replace(points[len(points) // 2], hit_rate_range=(points[0].hit_rate, points[-1].hit_rate))


def _replay(geometry: dict, budget: int, requests: list[Request], policy: str, ttl: float | None,
            min_cache_tokens: int, tiers: dict[str, int], costs: dict | None, seed: int) -> Point:
    import torch

    from prefixcache.cache.pool import KVPool
    from prefixcache.engine.blocks import BlockManager
    from prefixcache.engine.sequence import Sequence

    g = geometry
    pool = KVPool(g["layers"], g["kv_heads"], g["head_dim"], g["block_size"], budget, torch.float32,
                  local_layers=tuple(g["local_layers"]), window=g["window"])
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731  the log's time, so that TTLs expire as they would have
    blocks = BlockManager(pool, True, min_cache_tokens, ttl if policy == "ttl" else None, [], clock=clock)
    if tiers:
        below = LedgerTiers(tiers, g["tier_bytes"], Config.redis_ttl, clock, seed)
        blocks.attach(below)
    if policy == "fair":
        tenants = sorted({r.tenant for r in requests})
        blocks.set_shares({t: 1 / len(tenants) for t in tenants})
    started, prompt, cached, ttfts, refused, tier_tokens = time.perf_counter(), 0, 0, [], 0, Counter()
    output = iter(range(TOKENS_FOR_OUTPUT[0], TOKENS_FOR_OUTPUT[1]))
    for r in requests:
        now[0] = r.arrival
        out = min(r.max_tokens, g["context"] - len(r.prompt))  # the output stops at the context window
        if out < 1 or not blocks.fits(len(r.prompt) + out):
            refused += 1  # longer than the context, or than the whole budget: a live server answers it 400
            continue
        seq = Sequence(r.prompt, SamplingParams(max_tokens=out, ignore_eos=True), CacheScope(r.tenant))
        blocks.prepare(seq)
        blocks.prefetch(seq)
        while not blocks.ready(seq):  # the planner's tiers answer at once; the loads take a call a piece
            pass
        # as the scheduler admits it with nothing running (engine/memory_shares.py): room from its tenant's entries
        # and those of tenants over their part first, then from anyone's
        assert blocks.admit(seq) or blocks.admit(seq, protect=False), "a sequence that fits the pool alone is admitted"
        seq.num_computed = len(seq.tokens)  # the prefill
        blocks.publish(seq)
        if blocks.grow(seq, out):  # the decode: every output token but the last is computed
            seq.tokens += [next(output) for _ in range(out)]
            seq.num_computed = len(seq.tokens) - 1
        blocks.release(seq, finished=True)
        c, loaded = seq.cache.num_cached, seq.cache.tier_tokens
        prompt, cached = prompt + len(r.prompt), cached + c
        for tier, n in loaded.items():
            tier_tokens[tier] += n
        if costs and any(f"{t}_block_s" not in costs for t in loaded):
            costs = None  # a tier's read time was not measured here: no TTFT is predicted
        if costs:
            a, b = costs["a"], costs["b"]
            u = len(r.prompt) - c
            reads = sum(n // g["block_size"] * costs[f"{t}_block_s"] for t, n in loaded.items())
            ttfts.append(a * u + b * (u * u + 2 * u * c) + reads)
    evicted = sum(blocks.stats()["evictions"].values())
    ttfts = ttfts if costs else []
    return Point(budget, pool.usable_blocks, cached / prompt if prompt else 0.0, prompt, cached, cached, evicted,
                 refused, dict(tier_tokens), None, statistics.fmean(ttfts) if ttfts else None,
                 sorted(ttfts)[math.ceil(0.9 * len(ttfts)) - 1] if ttfts else None,
                 bool(tiers) and below.l3_evicted(), time.perf_counter() - started)


def _costs(engine: str = ENGINE_BENCH, tiers: str = TIERS_BENCH) -> dict | None:
    """a, b of t(u, c) = a u + b (u^2 + 2 u c), from the engine benchmark's 1,024- and 4,096-token prefills, and
    the seconds to read one block from L2 and L3 (`L2_block_s`, `L3_block_s`), where the tiers benchmark ran."""
    if not os.path.exists(engine):
        return None
    with open(engine) as f:
        e = json.load(f)["prefixcache"]
    t1, t4 = e["prefill_1024_s"], e["prefill_4096_s"]
    b = (t4 - 4 * t1) / (4096**2 - 4 * 1024**2)
    out = {"a": (t1 - b * 1024**2) / 1024, "b": b}
    if os.path.exists(tiers):
        with open(tiers) as f:
            t = json.load(f)
        out.update({f"{tier}_block_s": t[f"{tier.lower()}_read_s_per_block"] for tier in ("L2", "L3")
                    if f"{tier.lower()}_read_s_per_block" in t})
    return out
