"""What the startup probe (models/probe.py) checks of our kernels beyond the row counts (mode "kernel"): paged
attention rows equal whatever their batch, items and block placement, and every op agrees with float64; and, at
every start, that each weight read as shipped (models/quant.py) gives the bits of its dequantized values."""
import torch
import torch.nn.functional as F

from prefixcache.models import paged
from prefixcache.models.attention import Queries
from prefixcache.models.rowwise import TorchOps

BLOCK = 16  # the probe pool's block size


def problems(model, gen: torch.Generator) -> list[str]:
    """What is wrong with `model`'s kernels (a Llama on KernelOps), or nothing."""
    return _paged(model, gen) + _accuracy(model, gen)


def shipped(model, gen: torch.Generator) -> list[str]:
    """The weights whose blocks as shipped do not give their dequantized values' bits: random rows through each
    weight read as shipped, in every layer, at 1 row (dequantized in registers) and past ops.quant_rows (into
    scratch), against the same weight dequantized (gguf's reference) into fp32 panels, one weight at a time (the row
    counts' check is of the first layer; this is of each weight's own data, so it is never cached)."""
    bad, ops = [], model.ops
    for name, w in model.gemm_weights().items():
        if w.kinds:
            x = torch.randn(ops.quant_rows + 1, w.shape[1], generator=gen)
            fp32 = ops.dequantized(w)
            if not all(torch.equal(ops.linear(r, w), ops.linear(r, fp32)) for r in (x[:1], x)):
                bad.append(name)
            del fp32
    return bad


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [heads, d] over k, v [keys, kv heads, d], in float64."""
    group = q.shape[0] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    w = torch.softmax((k @ q.double().unsqueeze(-1)).squeeze(-1) * q.shape[-1] ** -0.5, dim=-1)
    return (w.unsqueeze(1) @ v).squeeze(1)


def _paged(model, gen: torch.Generator) -> list[str]:
    """Paged attention on 40 tokens of one sequence (2 tiles of keys in shuffled blocks): as one query, as 40
    one-token queries (grouped as decode), one by one, and with every block moved, each row's bits must match."""
    c, keys, bs = model.config, 2 * model.tile, BLOCK
    q = torch.randn(40, c.num_heads, c.head_dim, generator=gen)
    k, v = (torch.randn(keys + bs, c.num_kv_heads, c.head_dim, generator=gen) for _ in range(2))
    pos = sorted(torch.randint(0, keys, (len(q),), generator=gen).tolist())
    table = (1 + torch.randperm(keys // bs, generator=gen)).tolist()
    k2, v2, moved = paged.moved(k, v, table, gen, bs)
    pool, moved_pool = paged.laid_out(k, v), paged.laid_out(k2, v2)

    def run(queries, rows, kv=pool):
        return paged.attend(rows, *kv, paged.plan(queries, len(rows), bs), model.ops.isa)
    whole = run([Queries(0, pos, keys, table)], q)
    ways = {"one-token queries": run([Queries(i, [p], keys, table) for i, p in enumerate(pos)], q),
            "one by one": torch.cat([run([Queries(0, [p], keys, table)], q[i:i + 1]) for i, p in enumerate(pos)]),
            "moved blocks": run([Queries(0, pos, keys, moved)], q, moved_pool)}
    problems = [f"attention differs {how}" for how, out in ways.items() if not torch.equal(out, whole)]
    ref = torch.stack([attention64(q[i], k[_slots(table, p, bs)], v[_slots(table, p, bs)]) for i, p in enumerate(pos)])
    err = ((whole.double() - ref).abs().max() / ref.abs().max()).item()
    return problems + ([f"attention off float64 by {err:.1e}"] if err > 1e-5 else [])


def _accuracy(model, gen: torch.Generator) -> list[str]:
    """Each row-wise op on 17 random rows against the same op in float64 on torch."""
    ref_ops, problems = TorchOps(), []
    for op in model.row_ops():
        x = torch.randn(17, op.width, generator=gen)
        args64 = [ref_ops.prepare(a).double() if hasattr(a, "shape") else a for a in op.args]
        fn64 = F.linear if op.fn.__name__ == "linear" else getattr(ref_ops, op.fn.__name__)
        ref = fn64(x.double(), *args64)
        err = ((op.fn(x, *op.args).double() - ref).abs().max() / ref.abs().max()).item()
        if err > 1e-5:
            problems.append(f"{op.name} off float64 by {err:.1e}")
    return problems


def _slots(table: list[int], pos: int, bs: int) -> torch.Tensor:
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(pos + 1)])
