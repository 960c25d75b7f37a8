"""Weights read as a GGUF ships them (models/quant.py): the kernels over Q4_1 and Q8_0 blocks give the bits of the
fp32 weights they dequantize to, at every row count and build; the loader's blocks are the model's weights; and
blocks that are not fall back to the fp32 panels, and say so."""
import gguf
import numpy as np
import pytest
import torch
from conftest import GREEDY

from prefixcache import LLM, kernels
from prefixcache.config import default_model_path
from prefixcache.models import loader
from prefixcache.models.quant import LAID_OUT, SHIPPED, Blocks, join, lay_out
from prefixcache.models.rowwise import QUANT_ROWS, KernelOps, Packed

AVAILABLE = kernels.choose("auto").isa
BUILDS = [KernelOps(isa) for isa in kernels.ISAS if AVAILABLE and isa in torch.ops.prefixcache.supported()]
needs_kernels = pytest.mark.skipif(not AVAILABLE, reason=f"kernels: {kernels.choose('auto').status}")


def _shipped(n: int, k: int, kind: str, seed: int) -> tuple[Blocks, torch.Tensor]:
    """Random weights [n, k] quantized by the gguf package, and their fp32 values as it dequantizes them."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    return Blocks(kind, torch.from_numpy(raw)), torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))


@needs_kernels
@pytest.mark.parametrize("kind", list(SHIPPED))
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (37, 64), (1, 32), (17, 96), (100, 512)])
def test_blocks_as_shipped_give_the_bits_of_their_fp32_values(kind, n, k):
    """Every row count up to past QUANT_ROWS, with bias and residual, and RMSNorm or SwiGLU fused before: the same
    bits as the fp32 panels alone, on every build."""
    blocks, w = _shipped(n, k, kind, n * k)
    g = torch.Generator().manual_seed(n + k)
    x, b, norm = torch.randn(17, k, generator=g), torch.randn(n, generator=g), torch.randn(k, generator=g)
    res, gu = torch.randn(17, n, generator=g), torch.randn(17, 2 * k, generator=g)
    for ops in BUILDS:
        packed = ops.prepare(w, blocks)
        fp32 = Packed(packed.panels, packed.n)
        assert packed.kind == kind and packed.quant.shape == (-(-n // 16), k // 32, LAID_OUT[kind])
        for m in range(1, 18):
            assert torch.equal(ops.linear(x[:m], packed, b, res[:m]), ops.linear(x[:m], fp32, b, res[:m])), (ops, m)
            assert torch.equal(ops.norm_linear(x[:m], norm, 1e-5, packed), ops.norm_linear(x[:m], norm, 1e-5, fp32))
            assert torch.equal(ops.swiglu_linear(gu[:m], packed), ops.swiglu_linear(gu[:m], fp32))
        assert torch.equal(ops.linear(x, packed), BUILDS[0].linear(x, BUILDS[0].prepare(w, blocks)))


@needs_kernels
def test_the_quantized_path_is_taken_up_to_quant_rows_and_refuses_bad_blocks():
    """A packing whose fp32 panels are zero shows which path a call takes: blocks up to QUANT_ROWS rows, panels
    past it; and the op refuses blocks of the wrong size."""
    blocks, w = _shipped(64, 64, "Q4_1", 0)
    for ops in BUILDS:
        packed = ops.prepare(w, blocks)
        zeroed = Packed(torch.zeros_like(packed.panels), packed.n, packed.quant, packed.kind)
        limit = QUANT_ROWS[ops.name]
        x = torch.randn(limit + 1, 64)
        assert torch.equal(ops.linear(x[:limit], zeroed), ops.linear(x[:limit], packed))
        assert not ops.linear(x, zeroed).any()
        with pytest.raises(RuntimeError, match="quant must be"):
            torch.ops.prefixcache.linear(x[:1], packed.panels, None, 64, ops.isa, quant=packed.quant[:, :1])


def test_join_stacks_rows_of_one_kind_only():
    a, _ = _shipped(16, 64, "Q4_1", 1)
    b, _ = _shipped(8, 64, "Q4_1", 2)
    c, _ = _shipped(8, 64, "Q8_0", 3)
    assert join([a, b]).shape == (24, 64) and torch.equal(join([a, b]).rows[16:], b.rows)
    assert join([a, c]) is None and join([a, None]) is None


def test_lay_out_puts_each_rows_scales_and_quants_where_the_kernel_reads_them():
    """Q4_1: block (panel 0, block 1): d of row 3 at bytes 6-7, m of row 3 at 38-39, q(k = 2g, 2g + 1) of row j in
    byte 64 + 16 g + j; Q8_0: d at 2 j, q(k) of row j at 32 + 16 k + j."""
    blocks, _ = _shipped(20, 64, "Q4_1", 4)
    out, raw = lay_out(blocks), blocks.rows.view(20, 2, 20)
    assert out.shape == (2, 2, 320)
    assert torch.equal(out[0, 1, 6:8], raw[3, 1, 0:2]) and torch.equal(out[0, 1, 38:40], raw[3, 1, 2:4])
    q = torch.cat([raw[5, 1, 4:] & 15, raw[5, 1, 4:] >> 4])  # row 5's 32 quants of block 1
    assert all(out[0, 1, 64 + 16 * g + 5] == q[2 * g] | (q[2 * g + 1] << 4) for g in range(16))
    assert not out[1, :, :32].view(2, 16, 2)[:, 4:].any()  # rows 20-31: padding, zero scales
    blocks, _ = _shipped(16, 32, "Q8_0", 5)
    out, raw = lay_out(blocks), blocks.rows.view(16, 1, 34)
    assert torch.equal(out[0, 0, 2 * 7:2 * 7 + 2], raw[7, 0, :2])
    assert all(out[0, 0, 32 + 16 * k + 7] == raw[7, 0, 2 + k] for k in range(32))


def test_the_default_models_blocks_are_its_weights():
    """Every Q4_1 and Q8_0 tensor of the default GGUF, read as shipped (rows in HF order), dequantizes to the
    loaded fp32 weight, bit for bit; the norms (F32) are not among them."""
    weights = loader.load(default_model_path())
    assert len(weights.shipped) == 30 * 7 + 1 and not any("norm" in name for name in weights.shipped)
    for name, blocks in weights.shipped.items():
        qtype = gguf.GGMLQuantizationType[blocks.kind]
        values = gguf.quants.dequantize(blocks.rows.numpy(), qtype).astype(np.float32)
        assert torch.equal(torch.from_numpy(values), weights.tensors[name]), name
    assert not loader.load(default_model_path(), shipped=False).shipped
    assert not loader.load(default_model_path(), torch.bfloat16).shipped


@needs_kernels
def test_blocks_that_are_not_the_weights_are_not_read(monkeypatch, caplog):
    """One byte changed in layer 17's down_proj blocks: the start-up check finds it, every call reads the fp32
    panels, the status says so, and the output equals the output read without blocks."""
    real = loader._shipped

    def corrupt(path, folder):
        blocks = real(path, folder)
        rows = blocks["model.layers.17.mlp.down_proj.weight"].rows.clone()
        rows[3, 25] ^= 1
        blocks["model.layers.17.mlp.down_proj.weight"] = Blocks("Q4_1", rows)
        return blocks
    monkeypatch.setattr(loader, "_shipped", corrupt)
    llm = LLM(enable_prefix_cache=False)
    assert "weights as shipped not read: down of layer 17 differ" in llm.exactness.kernels
    assert "not read" in caplog.text
    assert all(w.quant is None for w in llm.engine.runner.model.gemm_weights().values())
    plain = LLM(enable_prefix_cache=False, quantized_reads=False)
    assert "as shipped" not in plain.exactness.kernels
    prompt = [[1, 2, 3, 4]]
    assert llm.generate(prompt, GREEDY)[0].token_ids == plain.generate(prompt, GREEDY)[0].token_ids
