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

Replayed alone, the requests never overlap, as under a live load of one user; with many users concurrent requests
share blocks being written, so a live hit rate can differ from the plan's by the requests that overlap.
"""
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

from prefixcache.bench.driver import Load, arrivals
from prefixcache.bench.trace import load_trace
from prefixcache.bench.workloads import GENERATORS, Size, Workload, build
from prefixcache.cache.scope import CacheScope
from prefixcache.engine.sequence import SamplingParams

POLICIES = ("lru", "fair", "ttl")
TOKENS_FOR_OUTPUT = (10**9, 2 * 10**9)  # output token ids: each request's its own, never in any prompt
ENGINE_BENCH = "bench/results/engine.json"


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
    ttft_mean_s: float | None
    ttft_p90_s: float | None
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
         min_cache_tokens: int = 0) -> list[Point]:
    """One Point per budget (bytes of KV for the real model)."""
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
    requests = _requests(workload, real)
    return [_replay(geometry, b, requests, policy, ttl, min_cache_tokens, _costs()) for b in budgets]


def knee(points: list[Point], within: float = 0.95) -> Point:
    """The smallest budget whose hit rate is at least `within` of the best: past it, memory buys little."""
    best = max(p.hit_rate for p in points)
    return min((p for p in points if p.hit_rate >= within * best), key=lambda p: p.budget_bytes)


def markdown(points: list[Point]) -> str:
    k = knee(points)
    lines = ["| budget | blocks | hit rate | saved prefill tokens | evicted blocks | refused | TTFT mean (s) | "
             "TTFT p90 (s) |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        mark = " (knee)" if p is k else ""
        ttft = [f"{t:.3f}" if t is not None else "n/a" for t in (p.ttft_mean_s, p.ttft_p90_s)]
        lines.append(f"| {mib(p.budget_bytes)}{mark} | {p.blocks} | {p.hit_rate:.3f} | {p.saved_prefill_tokens:,} |"
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
def mib(b: int) -> str:
    return f"{b / 2**30:g} GiB" if b >= 2**30 else f"{b / 2**20:g} MiB"


def _real_folder(model: str) -> str:
    from prefixcache.config import default_model_path
    from prefixcache.models.loader import converted_folder

    path = model or default_model_path()
    return path if os.path.isdir(path) else converted_folder(path)


def _geometry(folder: str) -> dict:
    """The real model's KV block: its layers, KV heads and head size (as the engine reads them), float32 as served."""
    import torch

    from prefixcache.cache.pool import KVPool
    from prefixcache.config import Config
    from prefixcache.models.loader import read_config

    m = read_config(folder)
    g = {"layers": m.num_layers, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "block_size": Config.block_size,
         "context": m.max_position}
    return {**g, "block_bytes": KVPool.bytes_per_block(*(g[k] for k in ("layers", "kv_heads", "head_dim",
                                                                          "block_size")), torch.float32)}


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


def _replay(geometry: dict, budget: int, requests: list[Request], policy: str, ttl: float | None,
            min_cache_tokens: int, costs: tuple[float, float] | None) -> Point:
    import torch

    from prefixcache.cache.pool import KVPool
    from prefixcache.engine.blocks import BlockManager
    from prefixcache.engine.sequence import Sequence

    g = geometry
    pool = KVPool(g["layers"], g["kv_heads"], g["head_dim"], g["block_size"], budget, torch.float32)
    blocks = BlockManager(pool, True, min_cache_tokens, ttl if policy == "ttl" else None, [])
    now = [0.0]
    blocks.cache.clock = lambda: now[0]  # the log's time, so that TTLs expire as they would have
    if policy == "fair":
        tenants = sorted({r.tenant for r in requests})
        blocks.cache.set_shares({t: 1 / len(tenants) for t in tenants}, group=lambda owner: owner[0])
    started, prompt, cached, ttfts, refused = time.perf_counter(), 0, 0, [], 0
    output = iter(range(TOKENS_FOR_OUTPUT[0], TOKENS_FOR_OUTPUT[1]))
    for r in requests:
        now[0] = r.arrival
        out = min(r.max_tokens, g["context"] - len(r.prompt))  # the output stops at the context window
        if out < 1 or not blocks.fits(len(r.prompt) + out):
            refused += 1  # longer than the context, or than the whole budget: a live server answers it 400
            continue
        seq = Sequence(r.prompt, SamplingParams(max_tokens=out, ignore_eos=True), CacheScope(r.tenant))
        blocks.prepare(seq)
        assert blocks.admit(seq), "a sequence that fits the pool alone is admitted"
        seq.num_computed = len(seq.tokens)  # the prefill
        blocks.publish(seq)
        if blocks.grow(seq, out):  # the decode: every output token but the last is computed
            seq.tokens += [next(output) for _ in range(out)]
            seq.num_computed = len(seq.tokens) - 1
        blocks.release(seq, finished=True)
        c = seq.cache.num_cached
        prompt, cached = prompt + len(r.prompt), cached + c
        if costs:
            a, b = costs
            u = len(r.prompt) - c
            ttfts.append(a * u + b * (u * u + 2 * u * c))
    evicted = sum(blocks.cache.evictions.values())
    return Point(budget, pool.usable_blocks, cached / prompt if prompt else 0.0, prompt, cached, cached, evicted,
                 refused, statistics.fmean(ttfts) if ttfts else None,
                 sorted(ttfts)[math.ceil(0.9 * len(ttfts)) - 1] if ttfts else None, time.perf_counter() - started)


def _costs(path: str = ENGINE_BENCH) -> tuple[float, float] | None:
    """a, b of t(u, c) = a u + b (u^2 + 2 u c), from the engine benchmark's 1,024- and 4,096-token prefills."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        e = json.load(f)["prefixcache"]
    t1, t4 = e["prefill_1024_s"], e["prefill_4096_s"]
    b = (t4 - 4 * t1) / (4096**2 - 4 * 1024**2)
    return (t1 - b * 1024**2) / 1024, b


def validate(workload: Workload, budgets: list[int], min_cache_tokens: int = 0, seed: int = 0,
             server_log: str | None = None) -> list[float | None]:
    """The hit rate a live server of ours (the real model) measures at each budget, driven by one user in the
    log's order (or its arrival times), its cache emptied before each run: what the plan predicts."""
    from prefixcache.bench.driver import Target
    from prefixcache.bench.report import Prices
    from prefixcache.bench.runs import Bench, local, measure
    from prefixcache.bench.server import ServerOptions, Servers

    servers = Servers(workload.tenants, server_log)
    try:
        bench = Bench(Load(users=1, seed=seed), Prices(), ServerOptions(min_cache_tokens=min_cache_tokens), servers)
        out = []
        for budget in budgets:
            srv = local(bench, kv_cache_bytes=budget)
            s, _ = measure(workload, Target("live", srv.url, srv.keys), bench, f"live, {mib(budget)}", srv)
            out.append(s["hit_rate_tokens"])
        return out
    finally:
        servers.close()
