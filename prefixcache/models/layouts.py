"""How the kernels read a weight: by panels of 16 rows, each a run of blocks along k (csrc/kernels.inc).

F32: fp32 panels [ceil(n / 16), k, 16], row k of a panel its 16 rows' weights. A GGUF kind (models/quant.py): its
blocks as shipped, [ceil(n / 16), k / K, bytes], where a panel's block holds K weights along k of its 16 rows as
fields, one after the other. A field is, for each of its E values in k order, the 16 rows' values side by side: fp16
scales as fp16 (E x 16 x 2 bytes), quants packed as in the file, 8 / bits a byte (the value of k = i at bits
bits * (i % (8 / bits)) of byte i / (8 / bits)), but 3-, 5- and 6-bit quants (their high bits joined to the low
ones) eight in `bits` bytes: of k = 8e.. 8e + 7, byte bits * e + j holds k = 8e + j in its top bits and, in its
low 8 - bits, bits (8 - bits) * j.. of k = 8e + bits.., one after the other, so that most weights are a mask away
from a byte; 6-bit K-quant scales and MXFP4's E8M0 ones as a byte each. The last panel is padded with zero rows.
Laid out, a weight is the file's size (1.0x) but for Q3_K (1.036x), Q4_K (1.028x), Q5_K (1.023x) and IQ4_XS
(1.015x), whose unpacked scales take 2 or 4 bytes more a row and super-block; tests/models/test_quant.py holds each
to it.
"""
import torch
import torch.nn.functional as F

from prefixcache.models.quant import Blocks

_HALF = 16  # a field of fp16 (or bf16) values, kept as their bits

# per kind: (K, the fields of a block of K weights in their order in a panel's block, as (name, bits, values))
FIELDS = {
    "F16": (2, [("w", _HALF, 2)]),
    "BF16": (2, [("w", _HALF, 2)]),
    "Q4_0": (32, [("d", _HALF, 1), ("q", 4, 32)]),
    "Q4_1": (32, [("d", _HALF, 1), ("m", _HALF, 1), ("q", 4, 32)]),
    "Q5_0": (32, [("d", _HALF, 1), ("q", 5, 32)]),
    "Q5_1": (32, [("d", _HALF, 1), ("m", _HALF, 1), ("q", 5, 32)]),
    "Q8_0": (32, [("d", _HALF, 1), ("q", 8, 32)]),
    "Q2_K": (256, [("d", _HALF, 1), ("dmin", _HALF, 1), ("scales", 8, 16), ("q", 2, 256)]),
    "Q3_K": (256, [("d", _HALF, 1), ("scales", 8, 16), ("q", 3, 256)]),
    "Q4_K": (256, [("d", _HALF, 1), ("dmin", _HALF, 1), ("sc", 8, 8), ("m", 8, 8), ("q", 4, 256)]),
    "Q5_K": (256, [("d", _HALF, 1), ("dmin", _HALF, 1), ("sc", 8, 8), ("m", 8, 8), ("q", 5, 256)]),
    "Q6_K": (256, [("d", _HALF, 1), ("scales", 8, 16), ("q", 6, 256)]),
    "IQ4_NL": (32, [("d", _HALF, 1), ("q", 4, 32)]),
    "IQ4_XS": (256, [("d", _HALF, 1), ("scales", 8, 8), ("q", 4, 256)]),
    "MXFP4": (32, [("e", 8, 1), ("q", 4, 32)]),
}
# weights along k in one block of a panel, and its bytes (csrc/kernels.h KINDS)
LAID_OUT = {"F32": (1, 64)} | {kind: (k, 16 * sum(bits * n // 8 for _, bits, n in fields))
                               for kind, (k, fields) in FIELDS.items()}


def panels(w: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [n, k] as panels [ceil(n / 16), k, 16]."""
    n, k = w.shape
    count = -(-n // 16)
    return F.pad(w, (0, 0, 0, count * 16 - n)).view(count, 16, k).transpose(1, 2).contiguous()


def unpanel(p: torch.Tensor, n: int) -> torch.Tensor:
    return p.transpose(1, 2).reshape(-1, p.shape[1])[:n].contiguous()


def fits(b: Blocks) -> bool:
    """Whether the kernels read b's kind at its k (a block of a panel spans LAID_OUT k's)."""
    return b.kind in FIELDS and b.shape[1] % FIELDS[b.kind][0] == 0


def lay_out(b: Blocks) -> torch.Tensor:
    """b's blocks as the kernels read them: [ceil(n / 16), k / K, LAID_OUT bytes] uint8 (by the kernels' lay_out op,
    csrc/layout.cpp: one pass over the file's bytes; blocks() is its inverse)."""
    assert fits(b), f"the kernels do not read {b.kind} at k = {b.shape[1]}"
    return torch.ops.prefixcache.lay_out(b.rows.contiguous(), list(LAID_OUT).index(b.kind))


def blocks(kind: str, laid: torch.Tensor, n: int) -> Blocks:
    """The Blocks lay_out laid out as `laid`: the weight as the file stores it, bit for bit."""
    _, spec = FIELDS[kind]
    count, nb = laid.shape[:2]
    values, at = {}, 0
    for name, bits, e in spec:
        size = 16 * (2 * e if bits == _HALF else e * bits // 8)
        field = laid[..., at:at + size].contiguous()
        at += size
        field = field.view(torch.int16) if bits == _HALF else field
        field = field.view(count, nb, -1, 16).permute(0, 3, 1, 2).reshape(count * 16, nb, -1)  # [rows, blocks, E]
        if bits == _HALF:
            values[name] = field.reshape(-1).view(torch.uint8).view(count * 16, nb, -1)
        elif bits in (3, 5, 6):
            values[name] = _wide(field, bits)
        else:
            values[name] = _planes(field, 1, bits)
    return Blocks(kind, _join(kind, values)[:n].reshape(n, -1))


def _planes(b: torch.Tensor, run: int, bits: int) -> torch.Tensor:
    """Values packed `bits` wide in bytes [..., A * run]: value (a, t, l) of [..., A, 8 / bits, run] is bits t * bits
    of byte (a, l), as gguf unpacks them (x.reshape(..., -1, 1, run) >> shifts)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).view(-1, 1)
    v = (b.reshape(*b.shape[:-1], -1, 1, run) >> shifts) & ((1 << bits) - 1)
    return v.reshape(*b.shape[:-1], -1)


def _wide(b: torch.Tensor, bits: int) -> torch.Tensor:
    """3-, 5- or 6-bit values eight in `bits` bytes [..., bits * E / 8] (the module's docstring) -> [..., E]."""
    spare = 8 - bits
    b = b.reshape(*b.shape[:-1], -1, bits).int()
    rest = sum((b[..., j] & ((1 << spare) - 1)) << (spare * j) for j in range(bits))
    others = [(rest >> (bits * i)) & ((1 << bits) - 1) for i in range(spare)]
    return torch.cat([b >> spare, torch.stack(others, dim=-1)], dim=-1).reshape(*b.shape[:-2], -1).to(torch.uint8)


def _unplanes(v: torch.Tensor, run: int, bits: int) -> torch.Tensor:
    per = 8 // bits
    v = v.reshape(*v.shape[:-1], -1, per, run)
    out = v[..., 0, :].clone()
    for t in range(1, per):
        out |= v[..., t, :] << (t * bits)
    return out.reshape(*v.shape[:-3], -1)


def _join(kind: str, v: dict[str, torch.Tensor]) -> torch.Tensor:
    """The blocks [rows, blocks, bytes] as the file has them, from their fields in k order (as gguf.quants unpacks
    them to dequantize: fp16 fields as their 2 bytes, quants a byte each)."""
    if kind in ("F16", "BF16"):
        return v["w"]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"):
        parts = [v["d"]] + ([v["m"]] if kind in ("Q4_1", "Q5_1") else [])
        q = v["q"]
        parts += [_unplanes(q >> 4, 1, 1)] if kind.startswith("Q5") else []
        return torch.cat(parts + [q if kind == "Q8_0" else _unplanes(q & 15, 16, 4)], dim=-1)
    if kind == "MXFP4":
        return torch.cat([v["e"], _unplanes(v["q"], 16, 4)], dim=-1)
    if kind == "Q2_K":
        return torch.cat([v["scales"], _unplanes(v["q"], 32, 2), v["d"], v["dmin"]], dim=-1)
    if kind == "IQ4_XS":
        sc = v["scales"] + 32
        return torch.cat([v["d"], _unplanes(sc >> 4, 1, 2), _unplanes(sc & 15, 1, 4), _unplanes(v["q"], 16, 4)], dim=-1)
    if kind == "Q3_K":
        sc = v["scales"] + 32
        scales = torch.cat([_unplanes(sc & 15, 8, 4), _unplanes(sc >> 4, 4, 2)], dim=-1)
        q = v["q"]
        return torch.cat([_unplanes(q >> 2, 32, 1), _unplanes(q & 3, 32, 2), scales, v["d"]], dim=-1)
    if kind in ("Q4_K", "Q5_K"):
        sc, m = v["sc"], v["m"]
        scales = torch.cat([sc[..., :4] | ((sc[..., 4:] & 48) << 2), m[..., :4] | ((m[..., 4:] & 48) << 2),
                            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], dim=-1)
        q = v["q"]
        qh = [_unplanes(q >> 4, 32, 1)] if kind == "Q5_K" else []
        return torch.cat([v["d"], v["dmin"], scales, *qh, _unplanes(q & 15, 32, 4)], dim=-1)
    q = v["q"]
    return torch.cat([_unplanes(q & 15, 64, 4), _unplanes(q >> 4, 32, 2), v["scales"], v["d"]], dim=-1)
