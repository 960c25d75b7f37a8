"""A mixture of experts' feed-forward block (Qwen3-MoE's), exact by construction: a row's result is a function of its
own hidden state alone, whatever rows share its batch or its experts.

The router is a row-wise GEMM. Its softmax is elementwise arithmetic and a sum over the experts in a fixed pairwise
order; the top k are a stable sort's first (of equal weights, the lower expert first). Each expert, in index order,
runs the rows that chose it through the row-wise GEMMs the dense MLP uses (a row's bits do not depend on the rows in
its call: models/rowwise.py, models/exactness.py), and a row's k outputs are weighted and summed in its slots' order.
A step runs only the experts its rows chose (a decode step of one sequence reads k experts' weights).
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from prefixcache.models.exactness import RowOp
from prefixcache.models.rowwise import Packed

Weight = torch.Tensor | Packed  # as the model's ops hold it


@dataclass
class Experts:
    router: Weight  # [experts, hidden]
    gate_up: list[Weight]  # each expert's gate and up projections stacked by rows [2 size, hidden]
    down: list[Weight]  # each expert's [hidden, size]

    def gemms(self) -> dict[str, Weight]:
        """Each GEMM's weight, by a name for people ("down of expert 3")."""
        return {"router": self.router, **{f"gate_up of expert {e}": w for e, w in enumerate(self.gate_up)},
                **{f"down of expert {e}": w for e, w in enumerate(self.down)}}

    def map(self, fn: Callable[[str, Weight], Weight]) -> "Experts":
        """The same experts with each weight w of gemms()' name n as fn(n, w)."""
        return Experts(fn("router", self.router), [fn(f"gate_up of expert {e}", w) for e, w in enumerate(self.gate_up)],
                       [fn(f"down of expert {e}", w) for e, w in enumerate(self.down)])


def load(prefix: str, count: int, linear: Callable[..., Weight]) -> Experts:
    """A layer's experts from HF's names under `prefix` ("model.layers.3.mlp."), each GEMM's weight as
    linear(*its tensors' names, stacked by rows) makes it."""
    return Experts(linear(prefix + "gate.weight"),
                   [linear(f"{prefix}experts.{e}.gate_proj.weight", f"{prefix}experts.{e}.up_proj.weight")
                    for e in range(count)],
                   [linear(f"{prefix}experts.{e}.down_proj.weight") for e in range(count)])


def forward(ops, rows: Callable[..., torch.Tensor], h: torch.Tensor, experts: Experts, k: int,
            norm: bool) -> torch.Tensor:
    """The block's output [n, hidden] for hidden states h [n, hidden] after the block's norm, on ops (TorchOps or
    KernelOps); rows(fn, x, *args) calls a row-wise op as the exactness plan says."""
    weights, chosen = route(rows(ops.linear, h, experts.router), k, norm)
    flat = chosen.flatten()  # (row, slot) i is row i // k's slot i % k
    order = torch.sort(flat, stable=True).indices  # grouped by expert, in index order
    counts = torch.bincount(flat, minlength=len(experts.down)).tolist()
    outs = []
    for e, x in enumerate(h[order // k].split(counts)):
        if len(x):
            outs.append(rows(ops.swiglu_linear, rows(ops.linear, x, experts.gate_up[e]), experts.down[e]))
    out = torch.empty(len(flat), h.shape[1], dtype=h.dtype)
    out[order] = torch.cat(outs)
    out = out.view(len(h), k, -1)
    weights = weights.to(h.dtype).unsqueeze(-1)
    y = weights[:, 0] * out[:, 0]
    for slot in range(1, k):
        y = y + weights[:, slot] * out[:, slot]
    return y


def row_ops(ops, experts: Experts, hidden: int, size: int) -> list[RowOp]:
    """The block's GEMMs for the exactness probe (the first expert's: every expert's weights have its shapes), then
    its activation."""
    return [RowOp("router", ops.linear, (experts.router,), hidden),
            RowOp("expert gate_up", ops.linear, (experts.gate_up[0],), hidden),
            RowOp("expert down", ops.linear, (experts.down[0],), size),
            RowOp("expert swiglu", ops.swiglu, (), 2 * size)]


def kernel_row_ops(ops, experts: Experts, hidden: int, size: int) -> list[RowOp]:
    """The block's calls on our kernels, as forward() makes them (the norm before it is the model's rms_norm)."""
    return [RowOp("router", ops.linear, (experts.router,), hidden),
            RowOp("expert gate_up", ops.linear, (experts.gate_up[0],), hidden),
            RowOp("swiglu+expert down", ops.swiglu_linear, (experts.down[0],), 2 * size)]


def route(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top k experts [n, k] by the softmax of its router logits [n, experts] (in fp32), highest first, and
    their weights [n, k] (divided by their sum with `norm`)."""
    logits = logits.float()
    e = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    top, chosen = torch.sort(e / _sum(e), dim=-1, descending=True, stable=True)
    top = top[:, :k]
    return (top / _sum(top) if norm else top), chosen[:, :k]


def _sum(t: torch.Tensor) -> torch.Tensor:
    """Each row's sum [n, 1] of t [n, m], in halves added pairwise: the same additions, in the same order, whatever
    the rows (a reduction op's order may depend on its shape and threads)."""
    while t.shape[1] > 1:
        t = F.pad(t, (0, t.shape[1] % 2))
        t = t[:, :t.shape[1] // 2] + t[:, t.shape[1] // 2:]
    return t
