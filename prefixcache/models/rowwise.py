"""The forward's row-wise ops (GEMMs, RMSNorm, SwiGLU), on torch or on our kernels: one object of either class.
A GEMM may take its input through RMSNorm or SwiGLU first, and add a residual to its result: on our kernels that is
one op, with the bits of the separate ones.

TorchOps: torch's CPU kernels, whose results can depend on a call's row count, so the exactness probe finds the
row counts to call them with (models/exactness.py). KernelOps: ours (prefixcache/kernels), where every output's
arithmetic is fixed by K alone, so any row count gives the same bits; the probe confirms it.
A weight is stored as its ops want it (`prepare`): torch's [n, k], or ours packed in panels of 16 rows.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixcache.config import ISAS
from prefixcache.kernels import source_hash

_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # in every x86-64 build of torch


@dataclass
class Packed:
    """A weight [n, k] as panels of 16 rows, [ceil(n / 16), k, 16] (the last zero-padded): the kernel reads row k of
    a panel, 16 outputs' weights, as one vector."""
    panels: torch.Tensor
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.panels.shape[1]

    def unpack(self) -> torch.Tensor:
        return self.panels.transpose(1, 2).reshape(-1, self.panels.shape[1])[:self.n].contiguous()


class TorchOps:
    name = "torch"

    def arithmetic(self, cpu: str) -> str:
        """What decides the bits of this path's results: torch's build and the CPU its kernels dispatch on."""
        return f"torch {torch.__version__} on {cpu}"

    def prepare(self, w: torch.Tensor | Packed) -> torch.Tensor:
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


class KernelOps:
    def __init__(self, isa: str):
        self.name, self.isa = isa, ISAS.index(isa)  # the ops take the build as an index into ISAS

    def arithmetic(self, cpu: str) -> str:
        """The kernels' sources alone: every build on every CPU gives the same bits."""
        return f"prefixcache kernels {source_hash()}"

    def prepare(self, w: torch.Tensor | Packed) -> Packed:
        if isinstance(w, Packed):
            return w
        n, k = w.shape
        panels = -(-n // 16)
        return Packed(F.pad(w, (0, 0, 0, panels * 16 - n)).view(panels, 16, k).transpose(1, 2).contiguous(), n)

    def linear(self, x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(x.contiguous(), weight.panels, bias, weight.n, self.isa,
                                            residual=residual)

    def norm_linear(self, x: torch.Tensor, norm: torch.Tensor, eps: float, weight: Packed,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(x.contiguous(), weight.panels, bias, weight.n, self.isa, norm, eps)

    def swiglu_linear(self, gate_up: torch.Tensor, weight: Packed,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(gate_up.contiguous(), weight.panels, None, weight.n, self.isa,
                                            swiglu=True, residual=residual)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.prefixcache.rms_norm(x.contiguous(), weight, eps, self.isa)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.prefixcache.silu_mul(gate_up.contiguous(), self.isa)
