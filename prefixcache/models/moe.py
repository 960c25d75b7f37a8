"""A mixture of experts' feed-forward block (Qwen3-MoE's, gpt-oss's), exact by construction: a row's result is a
function of its own hidden state alone, whatever rows share its batch or its experts.

The router is a row-wise GEMM. Its softmax is elementwise arithmetic and a sum over the experts (gpt-oss: over the
chosen k) in a fixed pairwise order; the top k are a stable sort's first (of equal scores, the lower expert first).
Each expert, in index order, runs the rows that chose it through the row-wise GEMMs the dense MLP uses (a row's bits
do not depend on the rows in its call: models/rowwise.py, models/exactness.py), and a row's k outputs are weighted
and summed in its slots' order.
A step runs only the experts its rows chose (a decode step of one sequence reads k experts' weights).
"""
from dataclasses import dataclass, field
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
    bias: dict[str, torch.Tensor] = field(default_factory=dict)  # by gemms()' name, where a GEMM has one (gpt-oss)
    glu: tuple[float, ...] = ()  # gpt-oss's clamped SwiGLU's (alpha, limit) (TorchOps.clamp_glu); (): SwiGLU
    topk_softmax: bool = False  # the weights are the softmax of the chosen k's logits (gpt-oss's), not of all

    def gemms(self) -> dict[str, Weight]:
        """Each GEMM's weight, by a name for people ("down of expert 3")."""
        return {"router": self.router, **{f"gate_up of expert {e}": w for e, w in enumerate(self.gate_up)},
                **{f"down of expert {e}": w for e, w in enumerate(self.down)}}

    def map(self, fn: Callable[[str, Weight], Weight]) -> "Experts":
        """The same experts with each weight w of gemms()' name n as fn(n, w)."""
        return Experts(fn("router", self.router), [fn(f"gate_up of expert {e}", w) for e, w in enumerate(self.gate_up)],
                       [fn(f"down of expert {e}", w) for e, w in enumerate(self.down)], self.bias, self.glu,
                       self.topk_softmax)


def load(prefix: str, count: int, linear: Callable[..., Weight], tensors: dict, glu: tuple[float, ...] = (),
         topk_softmax: bool = False) -> Experts:
    """A layer's experts from HF's names under `prefix` ("model.layers.3.mlp."; gpt-oss's as unfuse() names them),
    each GEMM's weight as linear(*its tensors' names, stacked by rows) makes it, its bias from `tensors`."""
    x = [f"{prefix}experts.{e}." for e in range(count)]
    bias = {"router": tensors.get(prefix + "gate.bias")} | {
        f"gate_up of expert {e}": torch.cat([tensors[p + "gate_proj.bias"], tensors[p + "up_proj.bias"]])
        for e, p in enumerate(x) if p + "gate_proj.bias" in tensors} | {
        f"down of expert {e}": tensors.get(p + "down_proj.bias") for e, p in enumerate(x)}
    return Experts(linear(prefix + "gate.weight"), [linear(p + "gate_proj.weight", p + "up_proj.weight") for p in x],
                   [linear(p + "down_proj.weight") for p in x], {n: b for n, b in bias.items() if b is not None}, glu,
                   topk_softmax)


def unfuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's HF tensors under the names load() reads: a layer's router (mlp.router) as mlp.gate, and its experts'
    gate_up_proj [experts, hidden, 2 size] (gate and up interleaved by columns, x @ w), down_proj [experts, size,
    hidden] and their biases as each expert's gate, up and down projections [rows, k], as llama.cpp's converter
    splits them. Other tensors as they are."""
    out = {}
    for name, t in tensors.items():
        layer, _, rest = name.partition(".mlp.")
        if rest.startswith("router."):
            out[f"{layer}.mlp.gate.{rest.removeprefix('router.')}"] = t
        elif rest.endswith("_blocks") or rest.endswith("_scales"):
            raise ValueError(f"{name}: gpt-oss's experts in MXFP4 safetensors are not read yet (its GGUF is)")
        elif rest.startswith("experts."):
            kind = rest.removeprefix("experts.")
            w = t.transpose(-1, -2) if kind in ("gate_up_proj", "down_proj") else t
            parts = {"gate_proj": w[:, ::2], "up_proj": w[:, 1::2]} if kind.startswith("gate_up") else {"down_proj": w}
            suffix = "bias" if kind.endswith("_bias") else "weight"
            out.update({f"{layer}.mlp.experts.{e}.{p}.{suffix}": one.contiguous()
                        for p, each in parts.items() for e, one in enumerate(each)})
        else:
            out[name] = t
    return out


def forward(ops, rows: Callable[..., torch.Tensor], h: torch.Tensor, experts: Experts, k: int,
            norm: bool) -> torch.Tensor:
    """The block's output [n, hidden] for hidden states h [n, hidden] after the block's norm, on ops (TorchOps or
    KernelOps); rows(fn, x, *args) calls a row-wise op as the exactness plan says."""
    weights, chosen = route(rows(ops.linear, h, experts.router, experts.bias.get("router")), k, norm,
                            experts.topk_softmax)
    flat = chosen.flatten()  # (row, slot) i is row i // k's slot i % k
    order = torch.sort(flat, stable=True).indices  # grouped by expert, in index order
    counts = torch.bincount(flat, minlength=len(experts.down)).tolist()
    outs = []
    for e, x in enumerate(h[order // k].split(counts)):
        if len(x):
            gate_up = rows(ops.linear, x, experts.gate_up[e], experts.bias.get(f"gate_up of expert {e}"))
            if experts.glu:  # gpt-oss's activation, then the GEMM with its bias
                glu = rows(ops.clamp_glu, gate_up, *experts.glu)
                outs.append(rows(ops.linear, glu, experts.down[e], experts.bias.get(f"down of expert {e}")))
            else:
                outs.append(rows(ops.swiglu_linear, gate_up, experts.down[e]))
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
    act = RowOp("expert clamp_glu", ops.clamp_glu, experts.glu, 2 * size) if experts.glu else RowOp(
        "expert swiglu", ops.swiglu, (), 2 * size)
    return [*_gemms(ops, experts, hidden), RowOp("expert down", ops.linear, _args(experts, "down"), size), act]


def kernel_row_ops(ops, experts: Experts, hidden: int, size: int) -> list[RowOp]:
    """The block's calls on our kernels, as forward() makes them (the norm before it is the model's rms_norm)."""
    if experts.glu:
        return row_ops(ops, experts, hidden, size)
    return [*_gemms(ops, experts, hidden), RowOp("swiglu+expert down", ops.swiglu_linear, (experts.down[0],), 2 * size)]


def _gemms(ops, experts: Experts, hidden: int) -> list[RowOp]:
    return [RowOp("router", ops.linear, (experts.router, experts.bias.get("router")), hidden),
            RowOp("expert gate_up", ops.linear, _args(experts, "gate_up"), hidden)]


def _args(experts: Experts, gemm: str) -> tuple:
    """The first expert's GEMM's weight and bias."""
    return getattr(experts, gemm)[0], experts.bias.get(f"{gemm} of expert 0")


def route(logits: torch.Tensor, k: int, norm: bool, topk_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top k experts [n, k] by the softmax of its router logits [n, experts] (in fp32), highest first, and
    their weights [n, k] (divided by their sum with `norm`); with `topk_softmax`, the k highest logits' softmax."""
    logits = logits.float()
    if topk_softmax:
        top, chosen = torch.sort(logits, dim=-1, descending=True, stable=True)
        e = torch.exp(top[:, :k] - top[:, :1])
        return e / _sum(e), chosen[:, :k]
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
