"""Weights as a GGUF file ships them: one weight's blocks, the kinds our kernels read, and their reference values.

A GGUF weight [n, k] of a kind below is n rows of k / block weights' blocks, each `bytes` bytes. Its fp32 values are
what gguf.quants.dequantize gives, each product and sum rounded to fp32 in its own order. The kernels read the blocks
as shipped (laid out by models/layouts.py) and dequantize in registers with the same roundings, so a GEMM over them
has the bits of the same GEMM over the fp32 values; the engine confirms it for every weight at start-up
(models/kernel_check.py).
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# weights in one block along k, and the block's bytes in the file (gguf's GGML_QUANT_SIZES)
KINDS = {"F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
         "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
         "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17)}


@dataclass
class Blocks:
    """One weight [n, k] as the file stores it: n rows of k / block blocks, in the model's row order."""
    kind: str  # a key of KINDS
    rows: torch.Tensor  # [n, k / block * bytes] uint8 (a float16 or bfloat16 weight's values are viewed as bytes)

    def __post_init__(self):
        assert self.kind in KINDS, f"{self.kind} is not a kind we read"
        if self.rows.dtype != torch.uint8:
            self.rows = self.rows.contiguous().view(torch.uint8)
        assert self.rows.dim() == 2 and self.rows.shape[1] % KINDS[self.kind][1] == 0, "rows of whole blocks"

    @property
    def shape(self) -> tuple[int, int]:
        block, size = KINDS[self.kind]
        return self.rows.shape[0], self.rows.shape[1] // size * block


def dequantize(b: Blocks) -> torch.Tensor:
    """The weight's fp32 values [n, k], as gguf dequantizes them (the reference the kernels match)."""
    import gguf

    if b.rows.shape[0] == 0:
        return torch.empty(b.shape)
    values = gguf.quants.dequantize(b.rows.numpy(), gguf.GGMLQuantizationType[b.kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(b.shape)


def embedding(table: torch.Tensor | Blocks, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of a table [vocab, k] as fp32 [len(ids), k]: F.embedding(ids, dequantize(table)), bit for bit,
    dequantizing only those rows."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    rows = table.rows.index_select(0, ids.reshape(-1))
    return dequantize(Blocks(table.kind, rows)).view(*ids.shape, table.shape[1])
