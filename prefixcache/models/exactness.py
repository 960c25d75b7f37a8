"""Batch invariance by construction (DESIGN.md, invariant 1): the plan of row counts the engine calls ops with, and
how it is chosen from what the probe (models/probe.py) measured on the CPU at hand.

BLAS and torch's CPU kernels choose their code path by call shape, so the last bits of a row can depend on how
many rows share its call and where it sits in it. On an AMD EPYC (Zen 4, 2 threads), MKL 2024.2's fp32 sgemm
gives a row one result at M = 1, others in the tail rows of M = 2..3, 5..7 and 9..11, and the same at every other
M; oneDNN's, which the model uses, differs at M = 1 only; with 5 threads, F.silu gives a row other bits by where
a thread's range ends. So the engine never calls a row-wise op with just any row count. Each row of the model's
own row-wise ops and of its attention is compared with a reference call, and a plan is picked:
  pad    every row count from m0 on gives the reference's bits, and so do some below it: a call with fewer
         rows is padded with zero rows up to the next such count;
  fixed  no such m0: a chunk size C at which a row's bits do not depend on its place in the call; every
         row-wise op then runs in calls of exactly C rows, the last one padded;
  rows   neither: one row per call, the same shape every time (guaranteed, slow).
Attention runs in calls of exactly q query rows per (tile, kv head), with q from the sizes that agree (fixed: C;
rows: 1), and of the keys of a whole tile or of a shorter length found to give the same bits (on the Zen 4: up to
192 and from 384 keys of a 512-key tile, not between). RoPE, the residual adds and the embedding need no plan:
each output element is one IEEE operation (or a copy) of its own row's values, which no vector width or thread
split changes. On our kernels (models/rowwise.py KernelOps, models/paged.py) none of that is needed: every output's
arithmetic is fixed by the problem's own sizes, and the plan is "kernel": any row count, unpadded.
"""
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

PAD_LIMIT = 64  # pad only below this many rows: probed densely, and padding further costs too much
CHUNKS = (16, 8, 4, 2)  # fixed-mode chunk sizes, tried in order
ATTN_SIZES = (*range(1, 17), 24, 32, 48, 64, 128, 256)  # query rows per attention call; the last is the reference
KEY_STEP = 16  # probed key lengths are multiples of this, which every SIMD width divides
PRIMES = (67, 97, 131, 251, 311, 509, 1021, 2039, 4093, 8191)


@dataclass
class RowOp:
    """A row-wise op as the engine calls it, fn(x, *args): row i of the result should depend on row i of x only."""
    name: str
    fn: Callable[..., torch.Tensor]
    args: tuple
    width: int  # columns of x
    head: bool = False  # the LM head: called with the rows that need logits only
    residual: int = 0  # columns of a residual the call adds to its result (fused, on our kernels); 0: none

    @property
    def shape(self) -> str:
        tensors = [a for a in self.args if hasattr(a, "shape")]  # a weight read as shipped names its kind
        return " ".join("x".join(map(str, t.shape)) + (f" {t.kind}" if getattr(t, "kind", "") else "")
                        for t in tensors) or str(self.width)


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


# A probe target: g(lo, hi, size) computes rows lo..hi of the probe input in calls of `size` rows, rows first.
Target = Callable[[int, int, int], torch.Tensor]


def choose(ops: list[RowOp], attention: Target, mode: str, max_rows: int, max_head_rows: int, dtype: torch.dtype,
           cpu: str) -> Exactness:
    """The plan for `mode` ("auto" or "pad": pad if it can, else fixed, else rows; "fixed": fixed, else rows), from
    the row-wise ops' and attention's calls compared with their reference calls."""
    gen = torch.Generator().manual_seed(0)
    targets = [row_target(op, max_rows + 1, dtype, gen) for op in ops]
    classes, row_sizes, attn_sizes, note = [], None, None, "forced"
    if mode != "fixed":
        classes = [classify(op.name, op.shape, t, row_counts(max_rows)) for op, t in zip(ops, targets) if not op.head]
        m0 = max(map(_m0, classes))
        # the head sees at most max_head_rows rows, padded to at most m0: probe it densely up to there only
        head_rows = max(max_head_rows, m0 if m0 <= PAD_LIMIT else 0)
        classes += [classify(op.name, op.shape, t, list(range(1, head_rows + 1)))
                    for op, t in zip(ops, targets) if op.head]
        m0 = max(map(_m0, classes))
        if m0 <= min(PAD_LIMIT, head_rows):
            row_sizes = [s for s in range(1, m0) if all(s in c.agree for c in classes)] + [m0]
            note = f"calls of {m0}+ rows agree with the reference"
            note += f", and of {row_sizes[:-1]} rows" if len(row_sizes) > 1 else ""
        else:
            note = f"calls agree only from {m0} rows on"
        attn = classify("attention", "query rows", attention, list(ATTN_SIZES), ATTN_SIZES[-1])
        if any(s <= PAD_LIMIT for s in attn.agree):
            attn_sizes = attn.agree
        classes.append(attn)
    need = (targets if row_sizes is None else []) + ([attention] if attn_sizes is None else [])
    chunk = next((c for c in CHUNKS if all(_position_invariant(t, c) for t in need)), 1) if need else 0
    if row_sizes is not None:
        return Exactness("pad", m0, row_sizes, attn_sizes or [chunk], cpu, note, classes)
    note += f"; chunks of {chunk} rows are position-invariant" if chunk > 1 else f"; no chunk of {CHUNKS} rows is"
    return Exactness("fixed" if chunk > 1 else "rows", chunk, [chunk], attn_sizes or [chunk], cpu, note, classes)


def row_target(op: RowOp, n_rows: int, dtype: torch.dtype, gen: torch.Generator) -> Target:
    x = torch.randn(n_rows, op.width, generator=gen).to(dtype)
    r = torch.randn(n_rows, op.residual, generator=gen).to(dtype) if op.residual else None
    return lambda lo, hi, size: in_calls(op.fn, x[lo:hi], size, *op.args, residual=None if r is None else r[lo:hi])


def row_counts(limit: int) -> list[int]:
    """Every row count up to PAD_LIMIT, then power-of-two +-1, 3 * power-of-two and prime counts up to the limit."""
    spread = {b for k in range(6, limit.bit_length() + 1) for b in (2 ** k - 1, 2 ** k, 2 ** k + 1, 3 << (k - 1))}
    return sorted({*range(1, min(limit, PAD_LIMIT) + 1), *(s for s in (*spread, *PRIMES) if s <= limit), limit})


def classify(name: str, shape: str, g: Target, sizes: list[int], ref_size: int = 0) -> OpClasses:
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
