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
from prefixcache.models.quant import Blocks, lay_out

_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # in every x86-64 build of torch
# calls of at most this many rows read weights as shipped, where they have them: fewer bytes, more arithmetic. On
# a Zen 4 over every layer's weights, 1 row took 6.4-8.5 ms against the fp32 panels' 18.4-23; 8 rows 16.4-18.9
# against 18.8-25 (avx512); the avx2 build there, 10-14 against 22-30 at 1 row, no gain at 8
QUANT_ROWS = {"avx512": 8, "avx2": 4}


@dataclass
class Packed:
    """A weight [n, k] as panels of 16 rows, [ceil(n / 16), k, 16] (the last zero-padded): the kernel reads row k of
    a panel, 16 outputs' weights, as one vector. With `quant`, the same weights as a GGUF ships them (`kind`), laid
    out by models/quant.py: calls of few rows read those bytes instead, for the same bits."""
    panels: torch.Tensor
    n: int
    quant: torch.Tensor | None = None
    kind: str = ""

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

    def prepare(self, w: torch.Tensor | Packed, shipped: Blocks | None = None) -> torch.Tensor:
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

    def prepare(self, w: torch.Tensor | Packed, shipped: Blocks | None = None) -> Packed:
        """w packed in panels; with `shipped` (w's values as a GGUF stores them), those blocks laid out beside."""
        if isinstance(w, Packed):
            return w
        n, k = w.shape
        panels = -(-n // 16)
        packed = Packed(F.pad(w, (0, 0, 0, panels * 16 - n)).view(panels, 16, k).transpose(1, 2).contiguous(), n)
        if shipped is not None:
            assert shipped.shape == (n, k), "shipped blocks of another shape"
            packed.quant, packed.kind = lay_out(shipped), shipped.kind
        return packed

    def linear(self, x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(x.contiguous(), weight.panels, bias, weight.n, self.isa,
                                            residual=residual, quant=self._quant(x, weight))

    def norm_linear(self, x: torch.Tensor, norm: torch.Tensor, eps: float, weight: Packed,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(x.contiguous(), weight.panels, bias, weight.n, self.isa, norm, eps,
                                            quant=self._quant(x, weight))

    def swiglu_linear(self, gate_up: torch.Tensor, weight: Packed,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.prefixcache.linear(gate_up.contiguous(), weight.panels, None, weight.n, self.isa,
                                            swiglu=True, residual=residual, quant=self._quant(gate_up, weight))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.prefixcache.rms_norm(x.contiguous(), weight, eps, self.isa)

    def _quant(self, x: torch.Tensor, weight: Packed) -> torch.Tensor | None:
        return weight.quant if x.shape[0] <= QUANT_ROWS[self.name] else None

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.prefixcache.silu_mul(gate_up.contiguous(), self.isa)
