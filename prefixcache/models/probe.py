"""The startup probe: the exactness plan (models/exactness.py) for a model on the CPU at hand, and its disk cache.

On the torch path it runs the model's own row-wise ops (every GEMM shape on the real weights, RMSNorm, SwiGLU) and
its attention on random rows and compares each row with a reference call. On our kernels it confirms them (mode
"kernel"): every call the forward makes there (the fused GEMMs, the norms, RoPE with the KV store, attention with
each window) gives the reference's bits at every row count the kernels tell apart (exactness.row_counts: each up to
PAD_LIMIT, so every tile's remainder and both sides of each register limit, then a spread to the batch limit; the
LM head's each up to the sequences a step holds), attention rows equal whatever
their batch, items and block placement, and each op agrees with a float64 reference (models/kernel_check.py). A
kernel that fails any of this is dropped for the torch path, which is probed, and the status names the op. Results
are cached per CPU, flags, library versions (our kernels' by the built library's bytes), threads, shapes and the
source of the ops and probe, under $PREFIXCACHE_HOME/exactness. The check of each weight read as shipped is kept
under the bytes the kernels read and the library reading them, under $PREFIXCACHE_HOME/shipped.
"""
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Callable

import numpy as np
import torch
import xxhash

from prefixcache import kernels
from prefixcache.config import MODES
from prefixcache.files import cache_home
from prefixcache.models import attention, exactness, kernel_check, layouts, paged, quant, rowwise
from prefixcache.models.attention import Queries
from prefixcache.models.cpu import cpu_info
from prefixcache.models.exactness import (
    ATTN_SIZES,
    KEY_STEP,
    PAD_LIMIT,
    Exactness,
    OpClasses,
    Target,
    choose,
    classify,
    row_counts,
    row_target,
    rows_plan,
)
from prefixcache.models.rowwise import TorchOps

log = logging.getLogger(__name__)


def probe(model, mode: str, max_rows: int, max_head_rows: int, kernel_status: str = "") -> Exactness:
    """The plan for `model` (a Llama: row_ops(), attn_plan(), config, tile, norm, paged, use()) on this CPU, from
    the cache or a probe. On our kernels it confirms them, or moves the model to the torch path and probes that.
    Never raises: a failed probe gives the rows plan, and says so."""
    assert mode in MODES, mode
    if model.paged:
        plan = _cached(model, "kernel", max_rows, max_head_rows, _confirm)
        if plan.mode == "kernel":
            plan.kernels = kernel_status + _shipped_reads(model)
            return plan
        kernel_status = f"off: failed the startup check ({plan.note})"
        log.warning("prefixcache kernels: %s; running the torch path", kernel_status)
        model.use(TorchOps())
    if mode == "rows":
        plan = rows_plan(str(cpu_info()), "forced")
    else:
        plan = _cached(model, mode, max_rows, max_head_rows, _search)
    plan.kernels = kernel_status
    return plan


def _shipped_reads(model) -> str:
    """What the kernels read of weights as shipped, once each weight's blocks are found to give its dequantized
    values' bits; a weight whose blocks do not is read as fp32 panels from then on, and the log says so."""
    if not any(w.kinds for w in model.gemm_weights().values()):
        return ""
    bad = _shipped_verdict(model)
    if bad:
        model.drop_shipped(bad)
        log.warning("prefixcache kernels: weights as shipped differ from their dequantized values (%s): read as fp32",
                    ", ".join(bad))
    weights = model.gemm_weights().values()
    kinds = sorted({kind for w in weights for kind in w.kinds})
    shipped = sum(p.data.numel() for w in weights for p in w.parts if p.kind != "F32") / 1e6
    fp32 = sum(p.data.numel() * 4 for w in weights for p in w.parts if p.kind == "F32") / 1e6
    return (f"; weights read as shipped ({'/'.join(kinds)}, {shipped:.0f} MB)"
            + (f"; fp32 panels hold {fp32:.0f} MB" if fp32 else "")
            + (f"; as fp32, for their blocks differ from their values: {', '.join(bad[:3])}" if bad else ""))


def _shipped_verdict(model) -> list[str]:
    """kernel_check.shipped(model), or its verdict kept for the same weights' bytes read by the same library on the
    same CPU, under $PREFIXCACHE_HOME/shipped: a new file, layout or library is checked again."""
    path = os.path.join(cache_home(), "shipped", _shipped_key(model) + ".json")
    bad = _read(path)
    if bad is None:
        bad = kernel_check.shipped(model, torch.Generator().manual_seed(3))
        _keep(path, bad)
    return bad


def _shipped_key(model) -> str:
    """What decides the shipped check's verdict: every GEMM weight's bytes as the kernels read them, the library's
    bytes and ISA, the CPU, gguf's reference and the code that checks."""
    code = _sources(__name__, kernel_check.__name__, layouts.__name__, quant.__name__, rowwise.__name__)
    what = [kernels.loaded().sha256, model.ops.name, asdict(cpu_info()), importlib.metadata.version("gguf"),
            np.__version__, code]
    h = xxhash.xxh3_128(json.dumps(what).encode())
    for name, w in model.gemm_weights().items():
        h.update(json.dumps([name, w.ids, w.rows, w.k]).encode())
        for data in w.data:
            h.update(data.contiguous().numpy())
    return h.hexdigest()


def _cached(model, mode: str, max_rows: int, max_head_rows: int, find: Callable[..., Exactness]) -> Exactness:
    """find(model, mode, max_rows, max_head_rows, cpu), or its result cached for the same CPU, code and shapes."""
    cpu = cpu_info()
    ops, dtype = model.row_ops(), model.norm.dtype
    max_rows = max(max_rows, PAD_LIMIT)  # probe the pad regime whatever the batch limit
    env = {k: v for k, v in os.environ.items() if k.startswith(("MKL_", "OMP_", "KMP_", "ONEDNN_", "DNNL_", "ATEN_"))}
    code = _sources(__name__, exactness.__name__, type(model).__module__, attention.__name__, paged.__name__,
                    kernel_check.__name__, type(model.ops).__module__)
    code += kernels.loaded().sha256 if model.paged else ""  # the library's own bytes, not only its sources
    key = json.dumps([code, mode, model.ops.name, asdict(cpu), env, str(dtype), max_rows, max_head_rows,
                      [(o.name, o.shape) for o in ops], [model.config.num_kv_heads, model.config.head_dim, model.tile]])
    path = os.path.join(cache_home(), "exactness", hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
    try:
        if (d := _read(path)) is not None:
            return Exactness(**{**d, "ops": [OpClasses(**o) for o in d["ops"]], "cached": True})
    except (ValueError, TypeError):
        pass
    t0 = time.perf_counter()
    try:
        plan = find(model, mode, max_rows, max_head_rows, str(cpu))
    except Exception as e:  # noqa: BLE001 -- a probe must never stop the engine
        log.warning("exactness probe failed (%r): computing one row per call", e)
        return rows_plan(str(cpu), f"probe failed: {e!r}")
    plan.probe_seconds = round(time.perf_counter() - t0, 3)
    if mode != plan.mode and not (mode == "auto" and plan.mode == "pad"):
        log.warning("exactness: %s asked, %s chosen: %s", mode, plan.mode, plan.note)
    _keep(path, asdict(plan))
    return plan


def _sources(*modules: str) -> str:
    return "".join(inspect.getsource(sys.modules[m]) for m in modules)


def _read(path: str):
    """The value kept at `path`, or None."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _keep(path: str, value) -> None:
    """`value` as JSON at `path`, whole or not at all (a start that cannot write it runs the check again)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp{os.getpid()}", "w") as f:
            json.dump(value, f)
        os.replace(f"{path}.tmp{os.getpid()}", path)
    except OSError as e:
        log.info("could not keep %s: %s", path, e)


def _search(model, mode: str, max_rows: int, max_head_rows: int, cpu: str) -> Exactness:
    dtype = model.norm.dtype
    plan = choose(model.row_ops(), _attention(model, dtype), mode, max_rows, max_head_rows, dtype, cpu)
    plan.key_lengths = _key_lengths(model, dtype, plan.attn_sizes)
    return plan


def _confirm(model, mode: str, max_rows: int, max_head_rows: int, cpu: str) -> Exactness:
    """Mode "kernel" if every call the forward makes on our kernels gives the reference's bits at row_counts(max_rows)
    (the LM head's: each up to max_head_rows), paged attention gives each row the bits it gets alone, and each agrees
    with float64; else mode "failed", the note saying what broke."""
    gen = torch.Generator().manual_seed(0)
    targets = [(op.name, op.shape, row_target(op, max_rows + 1, model.norm.dtype, gen), op.head)
               for op in model.kernel_row_ops()]
    targets += [(*t, False) for t in kernel_check.paged_targets(model, max_rows + 1, gen)]
    classes = [classify(name, shape, g, list(range(1, max_head_rows + 1)) if head else row_counts(max_rows))
               for name, shape, g, head in targets]
    broken = [f"{c.name} differs at {c.differ[:4]} rows" for c in classes if c.differ]
    broken += kernel_check.problems(model, gen)
    if broken:
        return Exactness("failed", 1, [1], [1], cpu, "; ".join(broken), classes)
    return Exactness("kernel", 1, [1], [], cpu, f"{model.ops.name} kernels: every call of the forward agrees at "
                     f"every row count to {PAD_LIMIT} and a spread to {max_rows}, and attention rows equal alone, "
                     "batched and with moved blocks", classes)


def _attention(model, dtype: torch.dtype) -> Target:
    """Attention as the engine runs it, over two tiles of keys (so the merge is exercised; the first read in place,
    the second gathered). The rows are query tokens of one sequence at random positions; a call from row 0 also
    carries a second sequence reading the same blocks (the cascade), so each comparison also varies who shares it."""
    c, tile, n = model.config, model.tile, ATTN_SIZES[-1] + 1
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2 * n, c.num_heads, c.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(2 * tile, c.num_kv_heads, c.head_dim, generator=gen).to(dtype) for _ in range(2))
    pos = torch.randint(0, 2 * tile, (2 * n,), generator=gen).tolist()
    table = _table(tile, gen)

    def g(lo: int, hi: int, size: int) -> torch.Tensor:
        m = hi - lo
        queries = [Queries(0, pos[lo:hi], 2 * tile, table)]
        rows = q[lo:hi]
        if lo == 0:
            queries.append(Queries(m, pos[n:n + m], 2 * tile, table))
            rows = torch.cat([rows, q[n:n + m]])
        return _attend(model, rows, k, v, queries, [size], [])[:m]
    return g


def _key_lengths(model, dtype: torch.dtype, sizes: list[int]) -> list[int]:
    """Key counts below a whole tile (multiples of KEY_STEP) whose call gives each row the bits of the whole
    tile's call with the extra keys masked, for every query size in `sizes`."""
    c, tile = model.config, model.tile
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(8, c.num_heads, c.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(2 * tile, c.num_kv_heads, c.head_dim, generator=gen).to(dtype) for _ in range(2))
    table, good = _table(tile, gen), []
    for length in range(KEY_STEP, tile, KEY_STEP):
        pos = torch.randint(0, tile + length, (len(q),), generator=gen).tolist()
        queries = [Queries(0, pos[:-1] + [tile + length - 1], tile + length, table)]
        if all(torch.equal(_attend(model, q, k, v, queries, [s], [length]), _attend(model, q, k, v, queries, [s], []))
               for s in sizes):
            good.append(length)
    return good


def _table(tile: int, gen: torch.Generator) -> list[int]:
    """Blocks of KEY_STEP keys for two tiles: the first tile's consecutive, the second's shuffled."""
    per_tile = tile // KEY_STEP
    return list(range(per_tile)) + (per_tile + torch.randperm(per_tile, generator=gen)).tolist()


def _attend(model, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: list[Queries], attn_sizes: list[int],
            key_lengths: list[int]) -> torch.Tensor:
    """The model's attention over pool k, v in blocks of KEY_STEP keys, under the given sizes and lengths."""
    exact = Exactness("pad", 1, [1], attn_sizes, "", "", key_lengths=key_lengths)
    plan = model.attn_plan(queries, len(q), KEY_STEP, len(k), exact)
    return attention.attend(q, k, v, plan, *attention.empty_results(plan, *q.shape, q.dtype),
                            sinks=kernel_check.sinks(model))
