"""Weights as a GGUF file ships them (Q4_1, Q8_0), laid out for our kernels.

The engine computes in fp32, on weights the loader dequantized the GGUF way: d * q + m (Q4_1) or d * q (Q8_0),
each product and sum rounded to fp32. The kernels can read the blocks themselves and dequantize in registers with
the same rounding, so a GEMM over the blocks gives the fp32 panels' bits while reading 5 or 8.5 bits a weight
instead of 32. The engine confirms the equality for every weight at start-up (models/kernel_check.py).
"""
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per GGUF block, along k
SHIPPED = {"Q4_1": 20, "Q8_0": 34}  # a block's bytes in the file: fp16 d (and m for Q4_1), then the q's
LAID_OUT = {"Q4_1": 320, "Q8_0": 544}  # bytes of 16 rows' block as the kernels read it (csrc/kernels.inc)


@dataclass
class Blocks:
    """One weight [n, k] as the file stores it: n rows of k / 32 blocks, in the model's row order."""
    kind: str  # a key of SHIPPED
    rows: torch.Tensor  # [n, k / 32 * SHIPPED[kind]] uint8

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.rows.shape[1] // SHIPPED[self.kind] * BLOCK


def join(parts: list["Blocks | None"]) -> "Blocks | None":
    """Weights stacked by rows (as torch.cat of theirs), if each ships in one and the same kind; else None."""
    if any(p is None or p.kind != parts[0].kind for p in parts):
        return None
    return Blocks(parts[0].kind, torch.cat([p.rows for p in parts]))


def lay_out(b: Blocks) -> torch.Tensor:
    """[ceil(n / 16), k / 32, LAID_OUT[kind]] uint8: for each panel of 16 rows (the last padded with zero weights)
    and each block, the 16 rows' scales as fp16 (d[16], then m[16] for Q4_1), then their q's k by k. Q4_1 puts
    k = 2g in the low nibble and 2g + 1 in the high one of 16 bytes (one per row); Q8_0 has 16 int8 per k."""
    n, k = b.shape
    panels, nb, size = -(-n // 16), k // BLOCK, SHIPPED[b.kind]
    raw = torch.cat([b.rows, b.rows.new_zeros(panels * 16 - n, b.rows.shape[1])]).view(panels, 16, nb, size)
    by_row = raw.permute(0, 2, 1, 3)  # [panels, blocks, row, bytes of the row's block]
    scales = [by_row[..., :2]] if b.kind == "Q8_0" else [by_row[..., :2], by_row[..., 2:4]]
    scales = [s.reshape(panels, nb, 32) for s in scales]  # each row's fp16, row after row
    if b.kind == "Q8_0":
        qs = by_row[..., 2:].transpose(2, 3)  # [panels, blocks, k, row]
    else:
        nibbles = by_row[..., 4:]  # byte j: q(j) low, q(j + 16) high
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).view(panels, nb, 16, 16, 2)  # [.., row, g, k parity]
        qs = (q[..., 0] | (q[..., 1] << 4)).transpose(2, 3)  # [panels, blocks, g, row]
    out = torch.cat([*scales, qs.reshape(panels, nb, -1)], dim=-1).contiguous()
    assert out.shape[-1] == LAID_OUT[b.kind], "the kernels read blocks of LAID_OUT bytes"
    return out
