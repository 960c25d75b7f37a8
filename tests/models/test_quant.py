"""Weights read as a GGUF ships them (models/quant.py, models/layouts.py): for every kind, the kernels over its blocks
give the bits of the same GEMM over the fp32 weights gguf dequantizes them to, at every row count, fused op and build;
weights stack by rows in parts of mixed kinds; laid out, blocks stay about the file's size; the token embedding
dequantizes the rows asked for. The start-up check of the weights read as shipped: test_shipped_check.py."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from prefixcache import kernels
from prefixcache.models import layouts
from prefixcache.models.layouts import LAID_OUT, lay_out
from prefixcache.models.quant import KINDS, Blocks, dequantize, embedding
from prefixcache.models.rowwise import KernelOps, TorchOps

AVAILABLE = kernels.choose("auto").isa
BUILDS = [KernelOps(isa) for isa in kernels.ISAS if isa in kernels.supported()]
needs_kernels = pytest.mark.skipif(not AVAILABLE, reason=f"kernels: {kernels.choose('auto').status}")
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82], "Q3_K": [108],
          "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": []}  # each block's
# fp16 scales. MXFP4's is a byte e first, 2^(e - 128): random below this, the subnormals of e = 0 and 1 included,
# keep a GEMM's sums finite (every e: test_every_e8m0_scale_gives_ggufs_values)
E8M0_FINITE = 135
# laid-out bytes over the file's, n a multiple of 16: the K-quants' 6-bit scales unpacked to a byte each
RATIO = {kind: 1.0 for kind in KINDS} | {"Q3_K": 1824 / 1760, "Q4_K": 2368 / 2304, "Q5_K": 2880 / 2816,
                                         "IQ4_XS": 2208 / 2176}


def _blocks(kind: str, n: int, k: int, seed: int, quantized: bool = False) -> Blocks:
    """Random weights [n, k] of `kind`: gguf's quantization of normal values (quantized, the legacy kinds: gguf
    quantizes no K-quant), else random bytes (every bit pattern of the quants and scales) with finite fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("F16", "BF16"):
        return Blocks(kind, torch.randn(n, k, generator=g).to(torch.float16 if kind == "F16" else torch.bfloat16))
    if quantized:
        w = torch.randn(n, k, generator=g).numpy()
        return Blocks(kind, torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])))
    block, size = KINDS[kind]
    raw = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, generator=g)
    for at in HALVES[kind]:
        scale = torch.randn(n, k // block, 1, generator=g) * 0.01
        raw[..., at:at + 2] = scale.half().view(torch.uint8)
    if kind == "MXFP4":
        raw[..., 0] = torch.randint(0, E8M0_FINITE, (n, k // block), dtype=torch.uint8, generator=g)
    return Blocks(kind, raw.view(n, -1))


def _shapes(kind: str) -> list[tuple[int, int]]:
    """n off the panels' 16 and k of several blocks (super-blocks for the K-quants)."""
    K = LAID_OUT[kind][0]
    return [(37, 3 * 256), (100, 512)] if K == 256 else [(37, 96), (100, 576), (17, 98 if K == 2 else 64)]


def _same_gemms(ops: KernelOps, blocks: list[Blocks | torch.Tensor], seed: int) -> None:
    """The weight as shipped against the same weight's fp32 values as panels: every row count from 1 to 17 and 64
    (both sides of ops.quant_rows), with bias and residual, RMSNorm or SwiGLU fused."""
    packed = ops.prepare(blocks)
    fp32 = ops.prepare(TorchOps().prepare(blocks))
    assert all(p.kind == "F32" for p in fp32.parts) and packed.shape == fp32.shape
    n, k = packed.shape
    g = torch.Generator().manual_seed(seed)
    x, b, norm = torch.randn(64, k, generator=g), torch.randn(n, generator=g), torch.randn(k, generator=g)
    res, gu = torch.randn(64, n, generator=g), torch.randn(64, 2 * k, generator=g)
    for m in [*range(1, 18), 64]:
        assert torch.equal(ops.linear(x[:m], packed, b, res[:m]), ops.linear(x[:m], fp32, b, res[:m])), m
        assert torch.equal(ops.norm_linear(x[:m], norm, 1e-5, packed), ops.norm_linear(x[:m], norm, 1e-5, fp32)), m
        assert torch.equal(ops.swiglu_linear(gu[:m], packed), ops.swiglu_linear(gu[:m], fp32)), m


@needs_kernels
@pytest.mark.parametrize("kind", list(KINDS))
def test_blocks_as_shipped_give_the_bits_of_their_dequantized_values(kind):
    """On every build, and the builds agree; legacy kinds both as gguf quantizes and as random bytes."""
    assert all(ops.quant_rows < 17 for ops in BUILDS), "the row counts below cover both ways of dequantizing"
    for n, k in _shapes(kind):
        sources = [_blocks(kind, n, k, n * k)] + ([_blocks(kind, n, k, n + k, True)] if kind in LEGACY else [])
        for blocks in sources:
            for ops in BUILDS:
                _same_gemms(ops, [blocks], n + k)
                assert ops.prepare(blocks).kinds == [kind]
            x = torch.randn(9, k)
            assert torch.equal(BUILDS[-1].linear(x, BUILDS[-1].prepare(blocks)),
                               BUILDS[0].linear(x, BUILDS[0].prepare(blocks)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns, every NaN's as one (a NaN's payload is not the arithmetic's)."""
    return torch.where(t.isnan(), 0x7FC00000, t.view(torch.int32))


@needs_kernels
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_every_e8m0_scale_gives_ggufs_values():
    """MXFP4: a block's E8M0 byte e scales its E2M1 codes by 2^(e - 128), in halves, as gguf and llama.cpp decode
    them. For every e (0 and 1 subnormal; 254 and 255 overflow to inf at the larger codes) and every code in either
    nibble, on every build, the kernels' weights are gguf's bits, and their GEMMs at every row count give those over
    gguf's values (NaN where those give NaN)."""
    e, codes = torch.arange(256, dtype=torch.uint8)[:, None], torch.arange(16, dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)
    every = (codes | codes.flip(0) << 4).expand(256, 16)  # each code in a low nibble and in a high one
    rand = torch.randint(0, 256, (256, 16), dtype=torch.uint8, generator=g)
    blocks = Blocks("MXFP4", torch.cat([e, every, e, rand], 1))  # a row's two blocks of one e
    values = dequantize(blocks)
    assert values.isinf().any() and (values.abs() == 2.0 ** -128).any()
    x = torch.randn(64, 64, generator=g)
    for ops in BUILDS:
        packed, fp32 = ops.prepare(blocks), ops.prepare(values)
        assert torch.equal(_bits(packed.take(torch.arange(256), ops.isa)), _bits(values))
        for m in [*range(1, 18), 64]:
            assert torch.equal(_bits(ops.linear(x[:m], packed)), _bits(ops.linear(x[:m], fp32))), m


@needs_kernels
def test_weights_stacked_by_rows_in_parts_of_mixed_kinds():
    """q/k/v of a Q4_K_M file (v as Q6_K), a fp32 weight and a Q8_0 one with rows off 16, stacked: neighbours of one
    kind merge into one part, each part reads its own kind, one call writes every part's columns."""
    k = 512
    ws = [_blocks("Q4_K", 64, k, 1), _blocks("Q4_K", 32, k, 2), _blocks("Q6_K", 32, k, 3), torch.randn(16, k),
          _blocks("Q8_0", 37, k, 4)]
    for ops in BUILDS:
        packed = ops.prepare(ws)
        assert [(p.kind, p.n) for p in packed.parts] == [("Q4_K", 96), ("Q6_K", 32), ("F32", 16), ("Q8_0", 37)]
        _same_gemms(ops, ws, 5)
        assert torch.equal(packed.unpack(), torch.cat([TorchOps().prepare(w) for w in ws]))
        fp32 = ops.dequantized(packed)
        assert not fp32.kinds and torch.equal(fp32.unpack(), packed.unpack())
        with pytest.raises(AssertionError, match="multiple of 16"):
            ops.prepare([_blocks("Q4_K", 40, k, 6), _blocks("Q6_K", 16, k, 7)])
        pieces = packed.pieces(32)  # what the start-up checks dequantize at once: views of one part's panels
        assert [(p.parts[0].kind, p.n) for p in pieces] == [("Q4_K", 32), ("Q4_K", 32), ("Q4_K", 32), ("Q6_K", 32),
                                                             ("F32", 16), ("Q8_0", 32), ("Q8_0", 5)]
        assert torch.equal(torch.cat([p.unpack() for p in pieces]), packed.unpack())
        assert all(p.data[0].untyped_storage().data_ptr() in {d.untyped_storage().data_ptr() for d in packed.data}
                   for p in pieces)


@needs_kernels
def test_the_op_refuses_parts_it_cannot_read():
    """A block of the wrong size, a part of another k, an unknown kind, rows off 16 before the last part: errors."""
    ops = BUILDS[0]
    packed = ops.prepare([_blocks("Q4_K", 32, 512, 1), _blocks("Q8_0", 20, 512, 2)])
    x, (q4k, q80), ids, rows = torch.randn(2, 512), packed.data, packed.ids, packed.rows
    linear = torch.ops.prefixcache.linear
    with pytest.raises(RuntimeError, match="part must be"):
        linear(x, [q4k[..., :-1].contiguous(), q80], ids, rows, None, ops.isa)
    with pytest.raises(RuntimeError, match="part must be"):
        linear(x, [q4k, q80[:, :-1].contiguous()], ids, rows, None, ops.isa)
    with pytest.raises(RuntimeError, match="part must be"):
        linear(torch.randn(2, 256), [q4k, q80], ids, rows, None, ops.isa)
    with pytest.raises(RuntimeError, match="unknown weight kind"):
        linear(x, [q4k, q80], [ids[0], 99], rows, None, ops.isa)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        linear(x, [q4k, q80], ids, [31, 20], None, ops.isa)
    with pytest.raises(RuntimeError, match="one kind and one row count per part"):
        linear(x, [q4k, q80], ids[:1], rows, None, ops.isa)


@needs_kernels
def test_the_kernels_number_the_kinds_as_layouts_lays_them_out():
    assert torch.ops.prefixcache.kinds() == list(LAID_OUT)
    assert set(LAID_OUT) == {"F32", *KINDS}


@needs_kernels
@pytest.mark.parametrize("kind", list(KINDS))
def test_laid_out_blocks_are_the_files_bytes_rearranged(kind):
    """Laid out and back, the file's bytes, bit for bit (every bit pattern), at about the file's size: RATIO, at most
    1.1x, for whole panels (the last panel's zero rows add to a small weight)."""
    n, k = 64, 2 * max(256, LAID_OUT[kind][0])
    b = _blocks(kind, n, k, 11)
    laid = lay_out(b)
    assert laid.dtype == torch.uint8 and laid.shape == (n // 16, k // LAID_OUT[kind][0], LAID_OUT[kind][1])
    assert torch.equal(layouts.blocks(kind, laid, n).rows, b.rows)
    assert laid.numel() / b.rows.numel() == pytest.approx(RATIO[kind]) and RATIO[kind] <= 1.1
    b = _blocks(kind, 21, k, 12)
    assert torch.equal(layouts.blocks(kind, lay_out(b), 21).rows, b.rows)


@needs_kernels
def test_lay_out_puts_each_rows_scales_and_quants_where_the_kernel_reads_them():
    """Q4_1, block (panel 0, block 1): d of row 3 at bytes 6-7, m of row 3 at 38-39, q(k = 2g, 2g + 1) of row j in
    byte 64 + 16 g + j. Q8_0: d at 2 j, q(k) of row j at 32 + 16 k + j. Q4_K: row j's 6-bit scale and min of
    sub-block s (gguf's get_scale_min) at 64 + 16 s + j and 192 + 16 s + j."""
    blocks = _blocks("Q4_1", 20, 64, 4, quantized=True)
    out, raw = lay_out(blocks), blocks.rows.view(20, 2, 20)
    assert out.shape == (2, 2, 320)
    assert torch.equal(out[0, 1, 6:8], raw[3, 1, 0:2]) and torch.equal(out[0, 1, 38:40], raw[3, 1, 2:4])
    q = torch.cat([raw[5, 1, 4:] & 15, raw[5, 1, 4:] >> 4])  # row 5's 32 quants of block 1
    assert all(out[0, 1, 64 + 16 * g + 5] == q[2 * g] | (q[2 * g + 1] << 4) for g in range(16))
    assert not out[1, :, :32].view(2, 16, 2)[:, 4:].any()  # rows 20-31: padding, zero scales
    blocks = _blocks("Q8_0", 16, 32, 5, quantized=True)
    out, raw = lay_out(blocks), blocks.rows.view(16, 1, 34)
    assert torch.equal(out[0, 0, 2 * 7:2 * 7 + 2], raw[7, 0, :2])
    assert all(out[0, 0, 32 + 16 * k + 7] == raw[7, 0, 2 + k] for k in range(32))
    blocks = _blocks("Q4_K", 16, 512, 6)
    out = lay_out(blocks)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks.rows.view(16, 2, 144)[:, 1, 4:16].numpy())
    assert np.array_equal(out[0, 1, 64:192].view(8, 16).T.numpy(), sc)
    assert np.array_equal(out[0, 1, 192:320].view(8, 16).T.numpy(), m)


@needs_kernels
def test_lay_out_refuses_what_is_not_whole_blocks_of_a_gguf_kind():
    rows = _blocks("Q4_K", 16, 256, 8).rows
    for bad, kind, match in ((rows, 0, "not a GGUF kind"), (rows, len(LAID_OUT), "not a GGUF kind"),
                             (rows[:, :100], 10, "blocks"), (rows.view(torch.int8), 10, "uint8"),
                             (rows[:, ::2], 10, "contiguous")):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.prefixcache.lay_out(bad, kind)


@pytest.mark.parametrize("kind", list(KINDS))
def test_embedding_dequantizes_the_rows_asked_for(kind):
    """F.embedding over the dequantized table, bit for bit, for repeated ids and ids of any shape; ids out of the
    table refused."""
    table = _blocks(kind, 50, 256, 7)
    for ids in (torch.tensor([3, 49, 0, 3]), torch.tensor([[1, 2], [2, 48]]), torch.tensor([], dtype=torch.long)):
        assert torch.equal(embedding(table, ids), F.embedding(ids, dequantize(table)))
    fp32 = torch.randn(50, 8)
    assert torch.equal(embedding(fp32, torch.tensor([4, 4])), fp32[[4, 4]])
    with pytest.raises((IndexError, RuntimeError)):
        embedding(table, torch.tensor([50]))


@needs_kernels
@pytest.mark.parametrize("kind", ["F32", *KINDS])
def test_a_tied_embedding_takes_its_rows_from_the_lm_heads_panels(kind):
    """The embedding of a tied table, dequantized by the kernels from the panels the LM head keeps (so the table is
    held once): the bits of the weight's own rows, on every build, for ids in any panel, the padded last one
    included, repeated, unordered and in a 2-D batch; an id past the table is refused."""
    table = torch.randn(50, 256) if kind == "F32" else _blocks(kind, 50, 256, 9)
    values = table if kind == "F32" else dequantize(table)
    for ops in BUILDS:
        packed = ops.prepare(table)
        ids = torch.tensor([49, 3, 0, 3, 17, 48, 16])
        assert torch.equal(packed.take(ids, ops.isa), values[ids])
        assert torch.equal(packed.take(ids.view(1, 7), ops.isa), values[ids].view(1, 7, 256))
        with pytest.raises(RuntimeError, match="id 50 is outside the weight's 50 rows"):
            packed.take(torch.tensor([50]), ops.isa)


def test_dequantize_is_ggufs():
    b = _blocks("Q5_K", 3, 512, 8)
    ref = gguf.quants.dequantize(b.rows.numpy(), gguf.GGMLQuantizationType.Q5_K)
    assert dequantize(b).dtype == torch.float32 and np.array_equal(dequantize(b).numpy(), ref)
    assert b.shape == (3, 512) and Blocks("F16", torch.zeros(2, 6, dtype=torch.float16)).shape == (2, 6)
