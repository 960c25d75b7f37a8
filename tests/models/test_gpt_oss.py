"""gpt-oss's own pieces against HF transformers': YaRN's tables bit for bit, truncated or not; the mixture of experts
(router biases, the softmax of the chosen k's logits, clamped SwiGLU, expert biases) choosing HF's experts and giving
its output, a row's bits alone as among others; the torch path's attention sinks against float64 and a row's bits
whatever its batch; warm = cold, chunked = whole and batched = alone through the engine on both paths; what we do not
read refused. (The whole model against HF, and its GGUF with the experts in MXFP4: test_families.py; sinks on our
kernels and the probe's cover of them: test_kernels.py.)"""
import os

import pytest
import torch
from conftest import generate_with_logits
from safetensors.torch import load_file, save_file

from prefixcache import LLM, SamplingParams, kernels
from prefixcache.models import attention, loader, moe, rope
from prefixcache.models.attention import Queries
from prefixcache.models.exactness import Exactness
from prefixcache.models.kernel_check import attention64
from prefixcache.models.rowwise import KernelOps, TorchOps

AVAILABLE = kernels.choose("auto").isa
OPS = [TorchOps()] + ([KernelOps(AVAILABLE)] if AVAILABLE else [])
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096}  # gpt-oss-20b's


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_yarn_tables_are_transformers_bits(truncate, head_dim):
    """The inverse frequencies, the attention factor and cos and sin (times it) as GptOssRotaryEmbedding computes
    them, bit for bit; gpt-oss's own bounds are not truncated."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    params = {**YARN, "truncate": truncate}
    config = GptOssConfig(head_dim=head_dim, num_attention_heads=4, hidden_size=64, max_position_embeddings=131072,
                          rope_parameters=params)
    ref = GptOssRotaryEmbedding(config)
    r = rope.from_hf({"rope_parameters": params})
    assert r.kind == "yarn" and r.truncate == truncate and r.attention_factor == ref.attention_scaling
    assert torch.equal(rope.inv_freq(r, head_dim), ref.inv_freq)
    positions = torch.tensor([[0, 1, 127, 128, 4095, 4096, 100000]])
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions)
    ours = rope.tables(r, head_dim, 100001, torch.float32)
    assert all(torch.equal(t[positions[0], :head_dim // 2], h[0]) for t, h in zip(ours, (cos, sin)))


def _hf_mlp(seed: int):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    block = GptOssMLP(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights that make routes differ by more than rounding, and reach the clamp
        for p in block.parameters():
            p.copy_(4 * torch.randn(p.shape, generator=g) / p.shape[-2 if p.dim() == 3 else -1] ** 0.5)
    return block


def _experts(block, ops) -> moe.Experts:
    prefix = "model.layers.0.mlp."
    hf = {prefix + name: t.detach() for name, t in block.named_parameters()}
    tensors = moe.unfuse(hf)
    return moe.load(prefix, 8, lambda *names: ops.prepare([tensors[n] for n in names]), tensors, (1.702, 7.0), True)


def _forward(ops, h: torch.Tensor, experts: moe.Experts) -> torch.Tensor:
    return moe.forward(ops, lambda fn, x, *args: fn(x, *args), h, experts, 2, False)


def test_the_experts_choose_hfs_and_give_its_output():
    block = _hf_mlp(seed=1)
    h = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, ref_w = block(h[None])
        _, _, ref_chosen = block.router(h)
        gate_up = h @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()  # the clamp counts
    logits = torch.nn.functional.linear(h, block.router.weight.detach(), block.router.bias.detach())
    w, chosen = moe.route(logits, 2, False, topk_softmax=True)
    assert torch.equal(chosen, ref_chosen) and (w - ref_w).abs().max().item() < 1e-6
    for ops in OPS:
        out = _forward(ops, h, _experts(block, ops))
        assert (out - ref[0]).abs().max().item() <= 1e-5 * ref.abs().max().item(), ops.name


@pytest.mark.skipif(not AVAILABLE, reason=f"kernels: {kernels.choose('auto').status}")
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    block, ops = _hf_mlp(seed=3), KernelOps(AVAILABLE)
    experts = _experts(block, ops)
    h = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    together = _forward(ops, h, experts)
    assert all(torch.equal(_forward(ops, h[i:i + 1], experts), together[i:i + 1]) for i in range(len(h)))


def test_the_torch_paths_sinks_match_float64_and_a_rows_bits_do_not_depend_on_its_batch():
    """Tiles of 64 keys merged by their log-sum-exp, then each head's sink in the denominator: float64's within
    rounding; a query row's bits alone as among the others, whatever tiles the others make the call merge."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d = 4, 2, 32
    k, v = (torch.randn(208, kv_heads, d, generator=g) for _ in range(2))  # 13 blocks of 16
    q, sinks = torch.randn(6, heads, d, generator=g), 2 * torch.randn(heads, generator=g)
    pos = [3, 63, 64, 130, 198, 199]
    exact = Exactness("pad", 1, [1], [1], "", "", key_lengths=[64])

    def attend(rows: list[int]) -> torch.Tensor:
        queries = [Queries(i, [pos[r]], pos[r] + 1, list(range(13))) for i, r in enumerate(rows)]
        p = attention.plan(queries, len(rows), 64, 16, len(k), exact, kv_heads, heads // kv_heads, torch.float32)
        return attention.attend(q[rows], k, v, p, *attention.empty_results(p, len(rows), heads, d, torch.float32),
                                sinks=sinks)
    together = attend(list(range(6)))
    for i, n in enumerate(pos):
        ref = attention64(q[i], k[:n + 1], v[:n + 1], sinks)
        assert ((together[i].double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
        assert torch.equal(attend([i])[0], together[i])


def test_warm_chunked_batched_equal_cold_on_both_paths(tiny_gpt_oss):
    """Past the 128-key window of its local layers: a cached prefix, chunks of 96 tokens and three requests in one
    batch give each request's cold logits alone, with the kernels and on the torch path."""
    prompts = [list(range(4000, 4300)), list(range(4000, 4200)) + [5, 6], [7, 8, 9]]
    for choice in ("auto", "off"):
        cold = LLM(model=tiny_gpt_oss, enable_prefix_cache=False, kernels=choice)
        warm = LLM(model=tiny_gpt_oss, max_batch_tokens=96, kernels=choice)
        assert warm.engine.runner.model.paged == (choice == "auto" and bool(AVAILABLE))
        warm.generate(prompts[:1], GREEDY)
        singles = [generate_with_logits(cold, [p], GREEDY)[1][0] for p in prompts]
        outs, together = generate_with_logits(warm, prompts, GREEDY)
        assert outs[1].cached_tokens == 200 and all(torch.equal(a, b) for a, b in zip(singles, together)), choice


def test_experts_in_mxfp4_safetensors_are_refused_naming_them(tiny_gpt_oss, tmp_path):
    """gpt-oss's own HF folder ships its experts as MXFP4 blocks and scales: not read yet (its GGUF is)."""
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    for f in os.listdir(tiny_gpt_oss):
        if f != "model.safetensors":
            os.link(os.path.join(tiny_gpt_oss, f), folder / f)
    t = load_file(os.path.join(tiny_gpt_oss, "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    t[name + "_blocks"], t[name + "_scales"] = torch.zeros(4, 128, 2, 16, dtype=torch.uint8), torch.zeros(
        4, 128, 2, dtype=torch.uint8)
    del t[name]
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name}_blocks: gpt-oss's experts in MXFP4 safetensors are not read yet"):
        loader.load(str(folder))
