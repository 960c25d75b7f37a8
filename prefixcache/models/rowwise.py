"""The forward's row-wise ops (GEMMs, RMSNorm, SwiGLU) and the sampler's (a row of logits' max, argmax and
log-sum-exp), on torch or on our kernels: one object of either class.
A GEMM may take its input through RMSNorm or SwiGLU first, and add a residual to its result: on our kernels that is
one op, with the bits of the separate ones.

TorchOps: torch's CPU kernels, whose results can depend on a call's row count, so the exactness probe finds the
row counts to call them with (models/exactness.py). KernelOps: ours (prefixcache/kernels), where every output's
arithmetic is fixed by K alone, so any row count gives the same bits; the probe confirms it.
A weight is stored as its ops want it (`prepare`): torch's fp32 [n, k]; ours as the file ships it (GGUF blocks, laid
out by models/layouts.py and dequantized in registers to the fp32 values' bits) or fp32 panels of 16 rows.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from prefixcache.config import ISAS
from prefixcache.kernels import source_hash
from prefixcache.models import layouts, quant
from prefixcache.models.quant import Blocks

_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # in every x86-64 build of torch

Weight = torch.Tensor | Blocks  # an fp32 weight [n, k], or one as a GGUF ships it


@dataclass
class Part:
    """Rows of a weight as the kernels read them (models/layouts.py): "F32" panels, or a GGUF kind's blocks."""
    kind: str
    data: torch.Tensor
    n: int

    @property
    def values(self) -> torch.Tensor:
        """Its fp32 weights [n, k]; for blocks, as gguf dequantizes them."""
        if self.kind == "F32":
            return layouts.unpanel(self.data, self.n)
        return quant.dequantize(layouts.blocks(self.kind, self.data, self.n))


@dataclass
class Packed:
    """A weight [n, k] for our kernels: parts stacked by rows (each but the last a multiple of 16 rows), each read as
    it is kept. The kernel reads row k of a panel, 16 outputs' weights, as one vector."""
    parts: list[Part]
    k: int
    # the linear op's arguments: each part's kind (as the op numbers them), data and rows
    ids: list[int] = field(init=False)
    data: list[torch.Tensor] = field(init=False)
    rows: list[int] = field(init=False)

    def __post_init__(self):
        assert all(p.n % 16 == 0 for p in self.parts[:-1]), "every part but the last a multiple of 16 rows"
        names = torch.ops.prefixcache.kinds()
        self.ids = [names.index(p.kind) for p in self.parts]
        self.data, self.rows = [p.data for p in self.parts], [p.n for p in self.parts]

    @property
    def n(self) -> int:
        return sum(self.rows)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def kinds(self) -> list[str]:
        """The GGUF kinds read as shipped, in part order (not F32)."""
        return [p.kind for p in self.parts if p.kind != "F32"]

    @property
    def nbytes(self) -> int:
        return sum(d.numel() * d.element_size() for d in self.data)

    def unpack(self) -> torch.Tensor:
        return torch.cat([p.values for p in self.parts])

    def pieces(self, rows: int) -> list["Packed"]:
        """The weight by pieces of at most `rows` rows (a multiple of 16), each of one part, as views of its panels:
        what a check dequantizes a piece at a time (the LM head of a 150k-token vocabulary is 1.2 GB in fp32)."""
        assert rows % 16 == 0, "whole panels"
        return [Packed([Part(p.kind, p.data[at // 16:(at + rows) // 16], min(rows, p.n - at))], self.k)
                for p in self.parts for at in range(0, p.n, rows)]

    def take(self, ids: torch.Tensor, isa: int) -> torch.Tensor:
        """The fp32 values of rows `ids` [len(ids), k] (a tied embedding's), dequantized by the kernels from their
        panels alone: the bits of unpack()[ids], since a row's values depend on its own blocks alone."""
        assert len(self.parts) == 1, "the rows of one part"
        return torch.ops.prefixcache.rows(self.data[0], self.ids[0], self.rows[0], ids.reshape(-1), isa).view(
            *ids.shape, self.k)


class TorchOps:
    name = "torch"

    def arithmetic(self, cpu: str) -> str:
        """What decides the bits of this path's results: torch's build and the CPU its kernels dispatch on."""
        return f"torch {torch.__version__} on {cpu}"

    def prepare(self, w: Weight | list[Weight] | Packed) -> torch.Tensor:
        """The fp32 weight [n, k] (weights as shipped dequantized, a list stacked by rows)."""
        if isinstance(w, list):
            return torch.cat([self.prepare(p) for p in w]) if len(w) > 1 else self.prepare(w[0])
        if isinstance(w, Blocks):
            return quant.dequantize(w)
        return w.unpack() if isinstance(w, Packed) else w

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + x @ weight.T + bias on oneDNN rather than MKL's sgemm (F.linear): on an AMD EPYC (Zen 4) only
        its 1-row calls differ from the rest (sgemm's differ up to 11 rows), so decode pads to 2 rows instead of 4,
        and over every layer's weights it ran 1.1-2x faster than sgemm at each row count from 1 to 512."""
        y = F.linear(x, weight, bias) if _onednn_linear is None else _onednn_linear(x, weight, bias, "none", [], "")
        return y if residual is None else residual + y

    def norm_linear(self, x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(self.rms_norm(x, norm, eps), weight, bias)

    def swiglu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(self.swiglu(gate_up), weight, None, residual)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        # not F.silu: its scalar tail loop rounds differently from its vector loop, and where a thread's range
        # ends decides which of the two a row gets; torch.exp and the arithmetic give the same bits in both
        gate, up = gate_up.chunk(2, dim=-1)
        return gate / (1 + torch.exp(-gate)) * up

    def geglu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(self.geglu(gate_up), weight, None, residual)

    def clamp_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's SwiGLU: the gate clamped above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha
        gate), the sigmoid as 1 / (1 + exp(-y)) for swiglu's reason."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate / (1 + torch.exp(-(alpha * gate))))

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU (tanh form) of the gate times up. tanh(y) as 1 - 2 / (exp(2y) + 1), for swiglu's reason."""
        gate, up = gate_up.chunk(2, dim=-1)
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        return 0.5 * gate * (2 - 2 / (torch.exp(2 * y) + 1)) * up

    def logit_stats(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row of logits [rows, vocab]: its max and log(sum(e^(x - max))) [rows, 2], and the first index of its
        max [rows]; a row holding NaN gets NaN and -1, a row of -inf only -inf and 0. A sum's order may depend on the
        rows in the call: the sampler calls it a row at a time."""
        m = logits.max(dim=1).values
        stats = torch.stack([m, torch.log(torch.exp(logits - m[:, None]).sum(dim=1))], dim=1)
        argmax = logits.argmax(dim=1)
        masked, nan = m == float("-inf"), torch.isnan(logits).any(dim=1)
        stats[masked], argmax[masked] = float("-inf"), 0
        stats[nan], argmax[nan] = float("nan"), -1
        return stats, argmax


class KernelOps:
    def __init__(self, isa: str):
        self.name, self.isa = isa, ISAS.index(isa)  # the ops take the build as an index into ISAS
        self.quant_rows = torch.ops.prefixcache.quant_rows(self.isa)  # from here on, blocks dequantize into scratch

    def arithmetic(self, cpu: str) -> str:
        """The kernels' sources alone: every build on every CPU gives the same bits."""
        return f"prefixcache kernels {source_hash()}"

    def prepare(self, w: Weight | list[Weight] | Packed) -> Packed:
        """w (a list: stacked by rows, as torch.cat) as the kernels read it: fp32 as panels, blocks as shipped (laid
        out, not dequantized). Neighbours of one kind become one part."""
        if isinstance(w, Packed):
            return w
        ws = w if isinstance(w, list) else [w]
        runs: list[list[Weight]] = []
        for x in ws:
            x = x if isinstance(x, torch.Tensor) or layouts.fits(x) else quant.dequantize(x)
            if runs and _kind(runs[-1][0]) == _kind(x):
                runs[-1].append(x)
            else:
                runs.append([x])
        parts = []
        for run in runs:
            if isinstance(run[0], torch.Tensor):
                t = torch.cat(run) if len(run) > 1 else run[0]
                parts.append(Part("F32", layouts.panels(t), t.shape[0]))
            else:
                b = Blocks(run[0].kind, torch.cat([r.rows for r in run])) if len(run) > 1 else run[0]
                parts.append(Part(b.kind, layouts.lay_out(b), b.shape[0]))
        assert len({_width(x) for x in ws}) == 1, "weights stacked by rows have one k"
        return Packed(parts, _width(ws[0]))

    def dequantized(self, w: Packed) -> Packed:
        """The same weight as fp32 panels alone (for weights whose blocks the start-up check found wrong)."""
        return self.prepare(w.unpack())

    def linear(self, x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(x.contiguous(), weight.data, weight.ids, weight.rows, bias, self.isa,
                                            residual=residual)

    def norm_linear(self, x: torch.Tensor, norm: torch.Tensor, eps: float, weight: Packed,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(x.contiguous(), weight.data, weight.ids, weight.rows, bias, self.isa, norm,
                                            eps)

    def swiglu_linear(self, gate_up: torch.Tensor, weight: Packed,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(gate_up.contiguous(), weight.data, weight.ids, weight.rows, None, self.isa,
                                            swiglu=True, residual=residual)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.prefixcache.rms_norm(x.contiguous(), weight, eps, self.isa)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.prefixcache.silu_mul(gate_up.contiguous(), self.isa)

    def geglu_linear(self, gate_up: torch.Tensor, weight: Packed,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(self.geglu(gate_up), weight, residual=residual)

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.prefixcache.gelu_mul(gate_up.contiguous(), self.isa)

    def clamp_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return torch.ops.prefixcache.clamp_glu(gate_up.contiguous(), alpha, limit, self.isa)

    def logit_stats(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As TorchOps.logit_stats, each row in one pass of its own whatever the call's rows (kernels.inc)."""
        return torch.ops.prefixcache.logit_stats(logits.contiguous(), self.isa)


def _kind(w: Weight) -> str:
    return "F32" if isinstance(w, torch.Tensor) else w.kind


def _width(w: Weight) -> int:
    return w.shape[1]
