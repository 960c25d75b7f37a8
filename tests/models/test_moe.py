"""Qwen3-MoE's mixture of experts (models/moe.py): the router's top k with its fixed tie-break; the block against HF
transformers' on the same weights (the same experts chosen); a row's bits alone and beside rows that chose the same
experts or others; warm = cold, chunked = whole and batched = alone through the engine on both paths; a GGUF's
stacked experts read per expert as views of one copy, giving the safetensors' logits bit for bit; and a file whose
experts disagree with its metadata refused, naming it. (The whole model against HF, from safetensors and from a GGUF
of mixed types: test_families.py; the probe's cover of the block's calls: test_kernels.py.)"""
import json
import os

import pytest
import torch
from conftest import generate_with_logits, warm_and_cold
from gguf_fixtures import write_gguf
from lora_adapters import write_adapter
from safetensors.torch import load_file, save_file

from prefixcache import LLM, SamplingParams, kernels
from prefixcache.models import gguf_file, loader, moe
from prefixcache.models.rowwise import KernelOps, TorchOps

AVAILABLE = kernels.choose("auto").isa
OPS = [TorchOps()] + ([KernelOps(AVAILABLE)] if AVAILABLE else [])
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
HIDDEN, EXPERTS, SIZE, K = 64, 8, 32, 2


def test_equal_scores_pick_the_lower_expert():
    """Of experts with equal scores, the lower index first, in every row (torch.topk picks 84, 87, 86, ... of 128
    equal scores); the weights of the chosen, normalized or not."""
    w, chosen = moe.route(torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0], [1.0, 0.0, 1.0, 5.0]]), 2, True)
    assert chosen.tolist() == [[1, 3], [0, 1], [3, 0]]
    assert torch.equal(w[:2], torch.full((2, 2), 0.5)) and torch.equal(w.sum(1), torch.ones(3))
    w, chosen = moe.route(torch.zeros(3, 128), 8, False)
    assert chosen.tolist() == [list(range(8))] * 3 and torch.equal(w, torch.full((3, 8), 1 / 128))


def _hf_block(norm: bool, seed: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=K, moe_intermediate_size=SIZE,
                            norm_topk_prob=norm)
    block = Qwen3MoeSparseMoeBlock(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a router whose scores differ by more than rounding
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block


def _experts(block, ops) -> moe.Experts:
    e = block.experts  # HF's gate_up_proj: each expert's gate and up stacked by rows, as ours
    return moe.Experts(ops.prepare(block.gate.weight.detach()), [ops.prepare(w) for w in e.gate_up_proj.detach()],
                       [ops.prepare(w) for w in e.down_proj.detach()])


def _forward(ops, h: torch.Tensor, experts: moe.Experts, norm: bool = True) -> torch.Tensor:
    return moe.forward(ops, lambda fn, x, *args: fn(x, *args), h, experts, K, norm)


@pytest.mark.parametrize("norm", [True, False])
def test_the_block_chooses_hfs_experts_and_gives_its_output(norm):
    block = _hf_block(norm, seed=1)
    h = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, ref_w, ref_chosen = block.gate(h)
        ref = block(h[None])[0]
    w, chosen = moe.route(torch.nn.functional.linear(h, block.gate.weight.detach()), K, norm)
    assert torch.equal(chosen, ref_chosen) and (w - ref_w).abs().max().item() < 1e-6
    for ops in OPS:
        out = _forward(ops, h, _experts(block, ops), norm)
        assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), ops.name


@pytest.mark.skipif(not AVAILABLE, reason=f"kernels: {kernels.choose('auto').status}")
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """On our kernels (the torch path's plan is the engine's: the test below): 16 rows that all chose expert 3 first,
    and 16 of routes of their own, each alone gives the bits it gets among them."""
    block, ops = _hf_block(True, seed=3), KernelOps(AVAILABLE)
    experts = _experts(block, ops)
    g = torch.Generator().manual_seed(4)
    alike = 3 * block.gate.weight.detach()[3] + 0.3 * torch.randn(16, HIDDEN, generator=g)
    h = torch.cat([alike, torch.randn(16, HIDDEN, generator=g)])
    _, chosen = moe.route(torch.nn.functional.linear(h, block.gate.weight.detach()), K, True)
    assert chosen[:16, 0].tolist() == [3] * 16 and len(set(chosen[16:].flatten().tolist())) > 4
    together = _forward(ops, h, experts)
    assert all(torch.equal(_forward(ops, h[i:i + 1], experts), together[i:i + 1]) for i in range(len(h)))


def test_warm_chunked_batched_equal_cold_on_both_paths(tiny_moe):
    """A cached prefix, chunks of 96 tokens and three requests in one batch: each request's logits are those of its
    cold run alone, with the kernels and on the torch path (its calls padded to the row counts the probe verified)."""
    prompts = [list(range(4000, 4300)), list(range(4000, 4200)) + [5, 6], [7, 8, 9]]
    for choice in ("auto", "off"):
        outs, singles, together, paged = warm_and_cold(tiny_moe, prompts, choice)
        assert paged == (choice == "auto" and bool(AVAILABLE))
        assert outs[1].cached_tokens == 200 and all(torch.equal(a, b) for a, b in zip(singles, together)), choice


def test_a_ggufs_experts_are_views_of_one_copy_and_give_the_safetensors_bits(tiny_moe, tmp_path):
    """llama.cpp's stacked ffn_*_exps: each expert a view of the tensor read (blocks as shipped, for a quantized
    file); an fp32 file gives the safetensors folder's logits, bit for bit."""
    _, tensors, *_ = gguf_file.read(write_gguf(tiny_moe, str(tmp_path / "q8.gguf"), lambda _: "Q8_0"))
    views = [tensors[f"model.layers.2.mlp.experts.{e}.down_proj.weight"] for e in range(EXPERTS)]
    assert {v.kind for v in views} == {"Q8_0"} and len({v.rows.untyped_storage().data_ptr() for v in views}) == 1
    path = write_gguf(tiny_moe, str(tmp_path / "f32.gguf"), lambda _: "F32")
    prompt = list(range(2000, 2300))
    ours = generate_with_logits(LLM(model=path, enable_prefix_cache=False), [prompt], GREEDY)[1][0]
    assert torch.equal(ours, generate_with_logits(LLM(model=tiny_moe, enable_prefix_cache=False), [prompt],
                                                  GREEDY)[1][0])


def _edited(src: str, dst: str, narrow: str = "", **config) -> str:
    """The model in `src` with `config` over its config, and tensor `narrow` a row short."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f not in ("config.json", "model.safetensors"):
            os.link(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**hf, **config}, f)
    t = load_file(os.path.join(src, "model.safetensors"))
    save_file(t | ({narrow: t[narrow][:-1]} if narrow else {}), os.path.join(dst, "model.safetensors"))
    return dst


def test_experts_that_disagree_with_the_metadata_are_refused_naming_it(tiny_moe, tmp_path):
    six = _edited(tiny_moe, str(tmp_path / "six"), num_experts=6, num_local_experts=6)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate.weight' has shape \(8, 128\), but the config "
                                         r"makes it \(6, 128\)"):
        loader.load(six)
    with pytest.raises(ValueError, match="'blk.0.ffn_down_exps.weight' holds 8 experts, but qwen3moe.expert_count "
                                         "says 6"):
        loader.load(write_gguf(six, str(tmp_path / "six.gguf"), lambda _: "F32"))
    with pytest.raises(ValueError, match="num_experts_per_tok 9 is not a count of the model's 8 experts"):
        loader.load(_edited(tiny_moe, str(tmp_path / "nine"), num_experts_per_tok=9))
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(127, 256\), but the config makes it \(128, 256\)"):
        loader.load(_edited(tiny_moe, str(tmp_path / "short"), narrow=name))


def test_lora_on_the_experts_is_refused_and_on_attention_runs(tiny_moe, tmp_path):
    down = write_adapter(str(tmp_path / "down"), tiny_moe, ["down_proj"], seed=1)
    with pytest.raises(ValueError, match="layer 0 down_proj: the layer's MLP is a mixture of experts"):
        LLM(model=tiny_moe, lora_modules=f"down={down}")
    qv = write_adapter(str(tmp_path / "qv"), tiny_moe, ["q_proj", "v_proj"], seed=2)
    llm = LLM(model=tiny_moe, lora_modules=f"qv={qv}", enable_prefix_cache=False)
    prompt = list(range(2000, 2100))
    _, adapted = generate_with_logits(llm, [prompt], GREEDY, adapter="qv")
    _, base = generate_with_logits(llm, [prompt], GREEDY)
    assert not torch.equal(adapted[0], base[0])
