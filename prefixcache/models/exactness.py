"""Batch invariance by construction, verified at startup on the CPU at hand (DESIGN.md, invariant 1).

BLAS and torch's CPU kernels choose their code path by call shape, so the last bits of a row can depend on how
many rows share its call and where it sits in it. On an AMD EPYC (Zen 4, 2 threads), MKL 2024.2's fp32 sgemm
gives a row one result at M = 1, others in the tail rows of M = 2..3, 5..7 and 9..11, and the same at every other
M; oneDNN's, which the model uses, differs at M = 1 only; with 5 threads, F.silu gives a row other bits by where
a thread's range ends. So the engine never calls a row-wise op with just any row count. The probe runs the
model's own row-wise ops (every GEMM shape on the real weights, RMSNorm, SwiGLU) and its attention on random
rows, compares each row with a reference call, and picks a plan:
  pad    every row count from m0 on gives the reference's bits, and so do some below it: a call with fewer
         rows is padded with zero rows up to the next such count;
  fixed  no such m0: a chunk size C at which a row's bits do not depend on its place in the call; every
         row-wise op then runs in calls of exactly C rows, the last one padded;
  rows   neither: one row per call, the same shape every time (guaranteed, slow).
Attention runs in calls of exactly q query rows per (tile, kv head), with q from the sizes that agree (fixed: C;
rows: 1), and of the keys of a whole tile or of a shorter length found to give the same bits (on the Zen 4: up to
192 and from 384 keys of a 512-key tile, not between). RoPE, the residual adds and the embedding need no plan: each output element is one
IEEE operation (or a copy) of its own row's values, which no vector width or thread split changes.
On our kernels (models/rowwise.py KernelOps, models/paged.py) none of that is needed: every output's arithmetic
is fixed by the problem's own sizes. The probe then confirms it (mode "kernel"): every row count of every row-wise
op gives the reference's bits, attention rows equal whatever their batch, items and block placement, and each op
agrees with a float64 reference. A kernel that fails any of this is dropped for the torch path, which is probed.
Results are cached per CPU, flags, library versions, threads, shapes and the source of the ops, kernels and probe,
under $PREFIXCACHE_HOME/exactness.
"""
import hashlib
import inspect
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from prefixcache import kernels
from prefixcache.models import attention, kernel_check, paged
from prefixcache.models.attention import Queries
from prefixcache.models.rowwise import TorchOps

log = logging.getLogger(__name__)

MODES = ("auto", "pad", "fixed", "rows")  # the probe may also choose "kernel", when the model runs on our kernels
PAD_LIMIT = 64  # pad only below this many rows: probed densely, and padding further costs too much
CHUNKS = (16, 8, 4, 2)  # fixed-mode chunk sizes, tried in order
ATTN_SIZES = (*range(1, 17), 24, 32, 48, 64, 128, 256)  # query rows per attention call; the last is the reference
KEY_STEP = 16  # probed key lengths are multiples of this, which every SIMD width divides
PRIMES = (67, 97, 131, 251, 311, 509, 1021, 2039, 4093, 8191)
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass
class CPU:
    model: str
    flags: list[str]  # every flag; `simd` picks the relevant ones
    threads: int
    torch: str
    blas: str

    @property
    def simd(self) -> list[str]:
        return [f for f in SIMD_FLAGS if f in self.flags]

    @property
    def has_bf16(self) -> bool:
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def __str__(self) -> str:
        return f"{self.model} ({' '.join(self.simd)}; {self.threads} threads; torch {self.torch}, {self.blas})"


def cpu_info() -> CPU:
    """From /proc/cpuinfo (elsewhere: no flags, so bfloat16 weights are refused) and torch's build."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    model, flags = (re.search(rf"^{key}\s*:\s*(.*)$", text, re.M) for key in ("model name", "flags"))
    config = torch.__config__.show()
    mkl, blas, onednn = (re.search(p, config) for p in (r"Math Kernel Library Version (\S+)", r"BLAS_INFO=(\w+)",
                                                        r"MKL-DNN (v\S+)"))
    libs = f"MKL {mkl.group(1)}" if mkl else f"BLAS {blas.group(1) if blas else 'unknown'}"
    libs += f", oneDNN {onednn.group(1)}" if onednn else ""
    return CPU(model.group(1) if model else platform.processor() or platform.machine(),
               flags.group(1).split() if flags else [], torch.get_num_threads(), torch.__version__, libs)


@dataclass
class RowOp:
    """A row-wise op as the engine calls it, fn(x, *args): row i of the result should depend on row i of x only."""
    name: str
    fn: Callable[..., torch.Tensor]
    args: tuple
    width: int  # columns of x
    head: bool = False  # the LM head: called with the rows that need logits only

    @property
    def shape(self) -> str:
        tensors = [a for a in self.args if hasattr(a, "shape")]
        return " ".join("x".join(map(str, t.shape)) for t in tensors) or str(self.width)


@dataclass
class OpClasses:
    """One op's probe: the call sizes whose every row equals the reference call's, and those that differ."""
    name: str
    shape: str
    agree: list[int]
    differ: list[int]


@dataclass
class Exactness:
    mode: str  # "kernel", "pad", "fixed" or "rows"
    m0: int  # pad: calls of at least m0 rows are row-invariant; fixed, rows: the rows of every call
    row_sizes: list[int]  # rows a row-wise call may have below m0 (pad, ending with m0), or always (fixed, rows)
    attn_sizes: list[int]  # query rows per (tile, kv head) an attention call may have
    cpu: str
    note: str  # how the plan was chosen
    ops: list[OpClasses] = field(default_factory=list)
    key_lengths: list[int] = field(default_factory=list)  # keys an attention call may have below a whole tile
    probe_seconds: float = 0.0
    cached: bool = False
    kernels: str = ""  # which kernel build runs, or why none does

    def call_rows(self, m: int) -> int:
        """Rows per call when a row-wise op computes m rows: m itself, or the size to pad to, or the chunk."""
        if self.mode in ("kernel", "pad") and m >= self.m0:
            return m
        return next((s for s in self.row_sizes if s >= m), self.row_sizes[-1])

    def padded_rows(self, m: int) -> int:
        """m rows padded so that calls of call_rows(m) rows cover them exactly."""
        size = self.call_rows(m)
        return -(-m // size) * size

    def attn_rows(self, r: int) -> int:
        """Query rows per attention call for r rows: the verified size that computes least (a call costs ~16 rows)."""
        return min(self.attn_sizes, key=lambda s: (-(-r // s) * (s + 16), -s))

    def key_length(self, real: int, tile: int) -> int:
        """Keys in the call for a tile with `real` keys: the next verified length, or the whole tile."""
        return next((n for n in self.key_lengths if n >= real), tile)

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "ops"}


def in_calls(fn: Callable[..., torch.Tensor], x: torch.Tensor, size: int, *args,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """fn(x, *args) (+ residual, rows as x's) for a row-wise fn, in calls of exactly `size` rows; the last call is
    padded with zero rows. One call adds the residual itself (fused, on our kernels)."""
    m = x.shape[0]
    if m == size:
        return fn(x, *args) if residual is None else fn(x, *args, residual=residual)
    x = torch.cat([x, x.new_zeros(-m % size, *x.shape[1:])])
    y = torch.cat([fn(c, *args) for c in x.split(size)])[:m]
    return y if residual is None else residual + y


def rows_plan(cpu: str, note: str) -> Exactness:
    return Exactness("rows", 1, [1], [1], cpu, note)


def probe(model, mode: str, max_rows: int, max_head_rows: int, kernel_status: str = "") -> Exactness:
    """The plan for `model` (a Llama: row_ops(), attn_plan(), config, tile, embed, paged, use()) on this CPU, from
    the cache or a probe. On our kernels it confirms them, or moves the model to the torch path and probes that.
    Never raises: a failed probe gives the rows plan, and says so."""
    assert mode in MODES, mode
    if model.paged:
        plan = _cached(model, "kernel", max_rows, max_head_rows, _confirm)
        if plan.mode == "kernel":
            plan.kernels = kernel_status
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


def _cached(model, mode: str, max_rows: int, max_head_rows: int, find: Callable[..., Exactness]) -> Exactness:
    """find(model, mode, max_rows, max_head_rows, cpu), or its result cached for the same CPU, code and shapes."""
    cpu = cpu_info()
    ops, dtype = model.row_ops(), model.embed.dtype
    max_rows = max(max_rows, PAD_LIMIT)  # probe the pad regime whatever the batch limit
    env = {k: v for k, v in os.environ.items() if k.startswith(("MKL_", "OMP_", "KMP_", "ONEDNN_", "DNNL_", "ATEN_"))}
    code = "".join(inspect.getsource(sys.modules[m]) for m in (__name__, type(model).__module__, attention.__name__,
                                                                paged.__name__, kernel_check.__name__,
                                                                type(model.ops).__module__))
    code += kernels.source_hash() if model.paged else ""
    key = json.dumps([code, mode, model.ops.name, asdict(cpu), env, str(dtype), max_rows, max_head_rows,
                      [(o.name, o.shape) for o in ops], [model.config.num_kv_heads, model.config.head_dim, model.tile]])
    home = os.environ.get("PREFIXCACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache", "prefixcache"))
    path = os.path.join(home, "exactness", hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
    try:
        with open(path) as f:
            d = json.load(f)
        return Exactness(**{**d, "ops": [OpClasses(**o) for o in d["ops"]], "cached": True})
    except (OSError, ValueError, TypeError):
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
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp{os.getpid()}", "w") as f:
            json.dump(asdict(plan), f)
        os.replace(f"{path}.tmp{os.getpid()}", path)
    except OSError as e:
        log.info("exactness: could not cache the probe at %s: %s", path, e)
    return plan


# A probe target: g(lo, hi, size) computes rows lo..hi of the probe input in calls of `size` rows, rows first.
Target = Callable[[int, int, int], torch.Tensor]


def _search(model, mode: str, max_rows: int, max_head_rows: int, cpu: str) -> Exactness:
    dtype = model.embed.dtype
    plan = _choose(model.row_ops(), _attention(model, dtype), mode, max_rows, max_head_rows, dtype, cpu)
    plan.key_lengths = _key_lengths(model, dtype, plan.attn_sizes)
    return plan


def _confirm(model, mode: str, max_rows: int, max_head_rows: int, cpu: str) -> Exactness:
    """Mode "kernel" if every row count of every row-wise op gives the reference's bits, paged attention gives each
    row the bits it gets alone, and each agrees with float64; else mode "failed", the note saying what broke."""
    gen = torch.Generator().manual_seed(0)
    ops = model.row_ops()
    classes = [_classes(op.name, op.shape, _row_target(op, max_rows + 1, model.embed.dtype, gen),
                        list(range(1, max_head_rows + 1)) if op.head else _sizes(max_rows)) for op in ops]
    broken = [f"{c.name} differs at {c.differ[:4]} rows" for c in classes if c.differ]
    broken += kernel_check.problems(model, gen)
    if broken:
        return Exactness("failed", 1, [1], [1], cpu, "; ".join(broken), classes)
    return Exactness("kernel", 1, [1], [], cpu, f"{model.ops.name} kernels: every row count from 1 to {max_rows} "
                     "agrees, and attention rows equal alone, batched and with moved blocks", classes)


def _choose(ops: list[RowOp], attention: Target, mode: str, max_rows: int, max_head_rows: int, dtype: torch.dtype,
            cpu: str) -> Exactness:
    gen = torch.Generator().manual_seed(0)
    targets = [_row_target(op, max_rows + 1, dtype, gen) for op in ops]
    classes, row_sizes, attn_sizes, note = [], None, None, "forced"
    if mode != "fixed":
        classes = [_classes(op.name, op.shape, t, _sizes(max_rows)) for op, t in zip(ops, targets) if not op.head]
        m0 = max(map(_m0, classes))
        # the head sees at most max_head_rows rows, padded to at most m0: probe it densely up to there only
        head_rows = max(max_head_rows, m0 if m0 <= PAD_LIMIT else 0)
        classes += [_classes(op.name, op.shape, t, list(range(1, head_rows + 1)))
                    for op, t in zip(ops, targets) if op.head]
        m0 = max(map(_m0, classes))
        if m0 <= min(PAD_LIMIT, head_rows):
            row_sizes = [s for s in range(1, m0) if all(s in c.agree for c in classes)] + [m0]
            note = f"calls of {m0}+ rows agree with the reference"
            note += f", and of {row_sizes[:-1]} rows" if len(row_sizes) > 1 else ""
        else:
            note = f"calls agree only from {m0} rows on"
        attn = _classes("attention", "query rows", attention, list(ATTN_SIZES), ATTN_SIZES[-1])
        if any(s <= PAD_LIMIT for s in attn.agree):
            attn_sizes = attn.agree
        classes.append(attn)
    need = (targets if row_sizes is None else []) + ([attention] if attn_sizes is None else [])
    chunk = next((c for c in CHUNKS if all(_position_invariant(t, c) for t in need)), 1) if need else 0
    if row_sizes is not None:
        return Exactness("pad", m0, row_sizes, attn_sizes or [chunk], cpu, note, classes)
    note += f"; chunks of {chunk} rows are position-invariant" if chunk > 1 else f"; no chunk of {CHUNKS} rows is"
    return Exactness("fixed" if chunk > 1 else "rows", chunk, [chunk], attn_sizes or [chunk], cpu, note, classes)


def _row_target(op: RowOp, n_rows: int, dtype: torch.dtype, gen: torch.Generator) -> Target:
    x = torch.randn(n_rows, op.width, generator=gen).to(dtype)
    return lambda lo, hi, size: in_calls(op.fn, x[lo:hi], size, *op.args)


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
    return attention.attend(q, k, v, plan, *attention.empty_results(plan, *q.shape, q.dtype))


def _sizes(limit: int) -> list[int]:
    """Every row count up to PAD_LIMIT, then power-of-two +-1, 3 * power-of-two and prime counts up to the limit."""
    spread = {b for k in range(6, limit.bit_length() + 1) for b in (2 ** k - 1, 2 ** k, 2 ** k + 1, 3 << (k - 1))}
    return sorted({*range(1, min(limit, PAD_LIMIT) + 1), *(s for s in (*spread, *PRIMES) if s <= limit), limit})


def _classes(name: str, shape: str, g: Target, sizes: list[int], ref_size: int = 0) -> OpClasses:
    """Each size's call (rows 1..1+size, so every row sits one place earlier than in the reference) against the
    reference: rows 0..max(sizes) in one call, or in calls of ref_size rows."""
    n = sizes[-1] + 1
    ref = g(0, n, ref_size or n)
    agree = [s for s in sizes if torch.equal(g(1, 1 + s, s), ref[1:1 + s])]
    return OpClasses(name, shape, agree, [s for s in sizes if s not in agree])


def _m0(c: OpClasses) -> int:
    """The smallest probed size from which every probed size agrees (past the last size if the last differs)."""
    sizes = sorted(c.agree + c.differ)
    return next((s for s in sizes if s > max(c.differ)), sizes[-1] + 1) if c.differ else sizes[0]


def _position_invariant(g: Target, chunk: int) -> bool:
    """In calls of exactly `chunk` rows, a row's bits do not depend on its place in the call."""
    n = 2 * chunk + 1
    return torch.equal(g(1, n, chunk), g(0, n, chunk)[1:])


def step_ms(model, rows: int, plan: Exactness | None = None, repeats: int = 5) -> float:
    """Median time of one engine step's row-wise ops (every layer's, then the head) on `rows` rows: as the plan
    runs them, or unpadded without one."""
    layers = [model.row_ops(i) for i in range(model.config.num_layers)]
    ops = [op for i, layer in enumerate(layers) for op in layer if i == 0 or not op.head]
    size = plan.call_rows(rows) if plan else rows
    xs = {op.name: torch.randn(rows, op.width).to(model.embed.dtype) for op in layers[0]}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for op in ops:
            in_calls(op.fn, xs[op.name], size, *op.args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
