"""What the startup probe (models/probe.py) checks of our kernels beside the row-wise ops' row counts (mode
"kernel"): RoPE with the KV store, paged attention with each window the model uses, and a plain layer in one op
with each, at every row count; the one op equals its ops one by one; paged attention rows equal whatever their
batch, items and block placement; every op agrees with float64 (the sampler's logit_stats too, on the model's
vocabulary); and, for every file and library, that each weight read as shipped (models/quant.py) gives the bits of
its dequantized values."""
import dataclasses
from itertools import accumulate

import torch
import torch.nn.functional as F

from prefixcache.config import ISAS
from prefixcache.models import paged
from prefixcache.models.attention import Queries
from prefixcache.models.exactness import RowOp, Target
from prefixcache.models.rowwise import KernelOps, Packed, Part, TorchOps

BLOCK = 16  # the probe pool's block size
PIECE = 4096  # rows of a weight a check dequantizes at once: its memory stays that of a piece, whatever the weight
SWEEP_KEYS = 320  # keys past a window in the row counts' check of attention: beyond one span of 256 (paged.py)


def problems(model, gen: torch.Generator) -> list[str]:
    """What is wrong with `model`'s kernels (a Llama on KernelOps), or nothing."""
    return [p for window in model.windows.values() for p in _paged(model, gen, window)] + _accuracy(model, gen) + \
        _logit_stats(model, gen) + _layer(model, gen)


def paged_targets(model, n_rows: int, gen: torch.Generator) -> list[tuple[str, str, Target]]:
    """RoPE with the KV store, and attention with each window the model uses, as the probe's targets (name, shape,
    g(lo, hi, size)): tokens lo..hi of n_rows random ones in one call, their outputs (for rope_store, also the keys
    and values it stored) a row each. In an attention call, the first half of the tokens decode (a query each) and
    the rest are one sequence's, all over the same keys in shuffled blocks."""
    c, isa = model.config, model.ops.isa
    heads, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
    slots = -(-n_rows // BLOCK) * BLOCK
    qkv = torch.randn(n_rows, (heads + 2 * kv) * d, generator=gen)
    at = torch.randint(0, len(model.rope[False].cos), (n_rows,), generator=gen)  # rows already computed

    def rope_store(lo: int, hi: int, size: int) -> torch.Tensor:
        k_pool, v_pool = torch.zeros(slots, kv, d), torch.zeros(slots, kv, d)
        s = torch.arange(lo, hi)
        q = paged.rope_store(qkv[lo:hi], *model.rope[False].rows(at[lo:hi]), k_pool, v_pool, s, heads, kv, isa)
        k = k_pool.view(-1, kv, d, BLOCK)[s // BLOCK, :, :, s % BLOCK]
        v = v_pool.view(-1, kv, BLOCK, d)[s // BLOCK, :, s % BLOCK]
        return torch.cat([t.reshape(hi - lo, -1) for t in (q, k, v)], dim=1)
    return [("rope_store", f"{heads}+{kv}+{kv} heads", rope_store)] + [
        _attend_target(model, window, n_rows, gen) for window in model.windows.values()] + (
        [("layers", f"layer {i}", layer_target(model, i, n_rows, gen)) for i in _first_of_each_kind(model)])


def _attend_target(model, window: int, n_rows: int, gen: torch.Generator) -> tuple[str, str, Target]:
    c = model.config
    keys = -(-(window + SWEEP_KEYS) // BLOCK) * BLOCK
    q = torch.randn(n_rows, c.num_heads, c.head_dim, generator=gen)
    pool = paged.laid_out(*(torch.randn(keys + BLOCK, c.num_kv_heads, c.head_dim, generator=gen) for _ in range(2)))
    pos = torch.randint(0, keys, (n_rows,), generator=gen).tolist()
    table = (1 + torch.randperm(keys // BLOCK, generator=gen)).tolist()

    def attend(lo: int, hi: int, size: int) -> torch.Tensor:
        mid = (lo + hi) // 2
        queries = [Queries(i - lo, [pos[i]], keys, table) for i in range(lo, mid)]
        queries.append(Queries(mid - lo, pos[mid:hi], keys, table))
        return paged.attend(q[lo:hi], *pool, paged.plan(queries, hi - lo, BLOCK, window), model.ops.isa,
                            model.attn_scale, sinks(model))
    return "attend" + (f" window {window}" if window else ""), f"{keys} keys", attend


PREFIX = 2  # blocks of earlier keys the tokens of a layer's check share


def layer_target(model, layer: int, n_rows: int, gen: torch.Generator) -> Target:
    """A plain layer in one op (paged.layers) on the weights and window of `layer`, as the probe's target: n_rows
    decode tokens, each its own sequence at the same position, reading the same earlier keys and storing its key and
    value in a block of its own; rows lo..hi in one call, their outputs a row each."""
    tokens = _layer_tokens(model, n_rows, gen)
    return lambda lo, hi, size: _layer_call(model, layer, paged.layers, tokens, lo, hi)


def _first_of_each_kind(model) -> list[int]:
    """The first plain layer of each window (global, local) the model's layers use: those the probe runs in one op."""
    firsts: dict[bool, int] = {}
    for i in range(len(model.layers) if model.one_op else 0):
        firsts.setdefault(i in model.local_layers, i)
    return sorted(firsts.values())


def _layer_tokens(model, n_rows: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Inputs x, cos, sin and pools k, v for n_rows tokens of layer_target."""
    c = model.config
    x = torch.randn(n_rows, c.hidden_size, generator=gen)
    k, v = (torch.randn((PREFIX + n_rows) * BLOCK, c.num_kv_heads, c.head_dim, generator=gen) for _ in range(2))
    return x, *model.rope[False].rows(torch.full((n_rows,), PREFIX * BLOCK)), *paged.laid_out(k, v)


def _layer_call(model, layer: int, fn, tokens: tuple[torch.Tensor, ...], lo: int, hi: int) -> torch.Tensor:
    """fn (paged.layers or _separate) on `layer` alone, on rows lo..hi of layer_target's tokens, over copies of the
    pools."""
    c, pos = model.config, PREFIX * BLOCK
    x, cos, sin, k, v = tokens
    queries = [Queries(i, [pos], pos + 1, list(range(PREFIX)) + [PREFIX + lo + i]) for i in range(hi - lo)]
    plan = paged.plan(queries, hi - lo, BLOCK, model.windows[layer in model.local_layers])
    return fn(x[lo:hi], model.layers[layer:layer + 1], c.rms_norm_eps, cos[lo:hi], sin[lo:hi], k.clone()[None],
              v.clone()[None], [0], (PREFIX + torch.arange(lo, hi)) * BLOCK, c.num_heads, plan, model.attn_scale,
              model.ops.isa)


def _separate(x: torch.Tensor, Ls: list[dict], eps: float, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, pool_rows: list[int], slots: torch.Tensor, heads: int, p: paged.PagedPlan, scale: float,
              isa: int) -> torch.Tensor:
    """What paged.layers computes, as the ops the forward calls one by one for a layer that is not plain."""
    ops = KernelOps(ISAS[isa])
    for L, row in zip(Ls, pool_rows):
        qkv = ops.norm_linear(x, L["ln1"], eps, L["qkv"], L["qkv_bias"])
        q = paged.rope_store(qkv, cos, sin, k[row], v[row], slots, heads, k.shape[2], isa)
        h = ops.linear(paged.attend(q, k[row], v[row], p, isa, scale).view(len(x), -1), L["o"], residual=x)
        x = ops.swiglu_linear(ops.norm_linear(h, L["ln2"], eps, L["gate_up"]), L["down"], residual=h)
    return x


def _layer(model, gen: torch.Generator) -> list[str]:
    """A plain layer in one op gives the bits of its ops one by one, on 9 tokens, for each window."""
    tokens = _layer_tokens(model, 9, gen)
    return [f"layer {i} differs from its ops one by one" for i in _first_of_each_kind(model)
            if not torch.equal(*(_layer_call(model, i, fn, tokens, 0, 9) for fn in (paged.layers, _separate)))]


def shipped(model, gen: torch.Generator) -> list[str]:
    """The weights whose blocks as shipped do not give their dequantized values' bits: random rows through each
    weight read as shipped, in every layer, at 1 and 8 rows (dequantized in registers: in whole panels, and on AVX2
    in half panels) and past ops.quant_rows (into scratch), against the same weight dequantized (gguf's reference)
    into fp32 panels, a piece of PIECE rows at a time (the row counts' check is of the first layer; this is of each
    weight's own data, so its verdict is kept under those bytes: models/probe.py). A tied embedding's rows, which the
    kernels dequantize from the LM head's panels, are its."""
    bad, ops = [], model.ops
    for name, w in model.gemm_weights().items():
        if w.kinds:
            x = torch.randn(ops.quant_rows + 1, w.shape[1], generator=gen)
            ok = all(torch.equal(ops.linear(r, piece), ops.linear(r, ops.dequantized(piece)))
                     for piece in w.pieces(PIECE) for r in (x[:1], x[:8], x))
            if w is model.embed:  # 64 rows against gguf's values of them, a piece at a time
                ids, at = torch.randint(0, w.shape[0], (64,), generator=gen), 0
                got = w.take(ids, ops.isa)
                for piece in w.pieces(PIECE):
                    mine = (ids >= at) & (ids < at + piece.n)
                    ok = ok and torch.equal(got[mine], piece.unpack()[ids[mine] - at])
                    at += piece.n
            if not ok:
                bad.append(name)
    return bad


def sinks(model) -> torch.Tensor | None:
    """The first layer's attention sinks [heads] (the probe's attention checks run with them), or None."""
    return model.layers[0].get("sinks")


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [heads, d] over k, v [keys, kv heads, d], with each head's sink logit [heads] if given, in float64."""
    group = q.shape[0] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    scores = (k @ q.double().unsqueeze(-1)).squeeze(-1) * q.shape[-1] ** -0.5
    if sinks is not None:  # a column of the softmax that weighs no value
        return (torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=-1), dim=-1)[:, None, :-1] @ v)[:, 0]
    return (torch.softmax(scores, dim=-1).unsqueeze(1) @ v).squeeze(1)


def _paged(model, gen: torch.Generator, window: int) -> list[str]:
    """Paged attention, reading a token's last `window` keys (0: all), on 40 tokens of one sequence (2 tiles of keys
    in shuffled blocks): as one query, as 40 one-token queries (grouped as decode), one by one, and with every block
    moved, each row's bits must match; and float64's within rounding."""
    c, keys, bs = model.config, 2 * model.tile, BLOCK
    q = torch.randn(40, c.num_heads, c.head_dim, generator=gen)
    k, v = (torch.randn(keys + bs, c.num_kv_heads, c.head_dim, generator=gen) for _ in range(2))
    pos = sorted(torch.randint(0, keys, (len(q),), generator=gen).tolist())
    table = (1 + torch.randperm(keys // bs, generator=gen)).tolist()
    k2, v2, moved = paged.moved(k, v, table, gen, bs)
    pool, moved_pool = paged.laid_out(k, v), paged.laid_out(k2, v2)

    def run(queries, rows, kv=pool):
        return paged.attend(rows, *kv, paged.plan(queries, len(rows), bs, window), model.ops.isa, None, sinks(model))
    whole = run([Queries(0, pos, keys, table)], q)
    ways = {"one-token queries": run([Queries(i, [p], keys, table) for i, p in enumerate(pos)], q),
            "one by one": torch.cat([run([Queries(0, [p], keys, table)], q[i:i + 1]) for i, p in enumerate(pos)]),
            "moved blocks": run([Queries(0, pos, keys, moved)], q, moved_pool)}
    name = "attention" + (f" window {window}" if window else "")
    problems = [f"{name} differs {how}" for how, out in ways.items() if not torch.equal(out, whole)]
    slots = [_slots(table, p, bs, window) for p in pos]
    ref = torch.stack([attention64(q[i], k[s], v[s], sinks(model)) for i, s in enumerate(slots)])
    err = ((whole.double() - ref).abs().max() / ref.abs().max()).item()
    return problems + ([f"{name} off float64 by {err:.1e}"] if err > 1e-5 else [])


class _Float64(TorchOps):
    """The torch path's ops in float64, the GEMM as F.linear (oneDNN's takes no float64)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        return y if residual is None else residual + y


def _accuracy(model, gen: torch.Generator) -> list[str]:
    """Each row-wise call of the forward on 17 random rows against the same call in float64 on torch (on a piece of
    each part of its weight: the reference holds it in float64)."""
    ref_ops, problems = _Float64(), []
    for op in map(_sampled, model.kernel_row_ops()):
        x = torch.randn(17, op.width, generator=gen)
        r = {"residual": torch.randn(17, op.residual, generator=gen)} if op.residual else {}
        args64 = [ref_ops.prepare(a).double() if hasattr(a, "shape") else a for a in op.args]
        ref = getattr(ref_ops, op.fn.__name__)(x.double(), *args64, **{k: t.double() for k, t in r.items()})
        err = ((op.fn(x, *op.args, **r).double() - ref).abs().max() / ref.abs().max()).item()
        if err > 1e-5:
            problems.append(f"{op.name} off float64 by {err:.1e}")
    return problems


def _sampled(op: RowOp) -> RowOp:
    """The op on the first PIECE rows of each part of its weight (and of its bias), its residual as wide."""
    w = next((a for a in op.args if isinstance(a, Packed)), None)
    if w is None or max(w.rows) <= PIECE:
        return op
    starts = [0, *accumulate(w.rows)][:-1]
    rows = torch.cat([torch.arange(at, at + min(n, PIECE)) for at, n in zip(starts, w.rows)])
    sample = Packed([Part(p.kind, p.data[:PIECE // 16], min(p.n, PIECE)) for p in w.parts], w.k)
    args = tuple(sample if a is w else a[rows] if isinstance(a, torch.Tensor) and a.shape == (w.n,) else a
                 for a in op.args)
    return dataclasses.replace(op, args=args, residual=sample.n if op.residual else 0)


def _logit_stats(model, gen: torch.Generator) -> list[str]:
    """The sampler's op on 3 random rows of the model's vocabulary: the max and its first index exact, the
    log-sum-exp within rounding of float64's, and each row's bits alone as in the batch."""
    x = 8 * torch.randn(3, model.config.vocab_size, generator=gen)
    stats, argmax = model.ops.logit_stats(x)
    alone = [model.ops.logit_stats(x[i:i + 1]) for i in range(len(x))]
    ref = torch.logsumexp(x.double() - x.double().max(1, keepdim=True).values, 1)
    ok = torch.equal(stats[:, 0], x.max(1).values) and torch.equal(argmax, x.argmax(1)) and \
        ((stats[:, 1].double() - ref).abs() / (ref + 1)).max().item() < 1e-5  # logprobs within 1e-5
    same = all(torch.equal(s, stats[i:i + 1]) and torch.equal(a, argmax[i:i + 1]) for i, (s, a) in enumerate(alone))
    return ([] if ok else ["logit_stats off float64"]) + ([] if same else ["logit_stats differs by batch"])


def _slots(table: list[int], pos: int, bs: int, window: int) -> torch.Tensor:
    """The pool slots of the keys position `pos` reads."""
    first = max(0, pos + 1 - window) if window else 0
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(first, pos + 1)])
