"""Each model family against HF transformers: random-weight models of each family's real config shape (fewer
layers) built and saved by transformers itself, our logits within a stated bound of HF's on a 1k-token prompt and
the same greedy tokens; and a family or feature we lack is refused at load, naming what is missing."""
import json
import os

import pytest
import torch
from conftest import generate_with_logits
from family_models import FAMILIES, family_model
from gguf_fixtures import dequantized_folder, write_gguf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from prefixcache import LLM, SamplingParams, kernels
from prefixcache.models import loader

PROMPT = list(range(1000, 2100))  # 1,100 token ids: three attention tiles
STEPS = 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp(request.param))
    return request.param, family_model(folder, request.param, seed=len(request.param))


def test_logits_and_greedy_tokens_match_hf(family):
    """Within 1e-4 of the logits' scale at every decode step (fp32 rounding: HF's GEMMs and ours sum in other
    orders), and the same greedy tokens, on a prompt three attention tiles long."""
    name, folder = family
    llm = LLM(model=folder, enable_prefix_cache=False)
    assert llm.engine.model_config.family == name.split("-")[0]
    outs, logits = generate_with_logits(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                                      ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    ref_logits = torch.cat(ref.logits)
    assert (logits[0] - ref_logits).abs().max().item() <= 1e-4 * ref_logits.abs().max().item()
    assert outs[0].token_ids == ref.sequences[0, len(PROMPT):].tolist()


def _edited(src: str, dst: str, config: dict | None = None, tensors=None) -> str:
    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith((".safetensors", "config.json")) or f.startswith("tokenizer"):
            os.link(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**hf, **(config or {})}, f)
    t = load_file(os.path.join(src, "model.safetensors"))
    save_file(tensors(t) if tensors else t, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return family_model(str(tmp_path_factory.mktemp("llama")), "llama", seed=0)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gemma3"}, "'gemma3' is not supported yet: it needs a vision tower"),
    ({"model_type": "mixtral"}, "mixture-of-experts"),
    ({"model_type": "gpt2"},
     "unsupported model_type 'gpt2'; supported: llama, mistral, qwen2, qwen3, qwen3_moe, gpt_oss, gemma3_text"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
     "rope scaling 'dynamic' is not supported yet"),
])
def test_what_we_lack_is_refused_at_load_naming_it(llama, tmp_path, config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        loader.load(_edited(llama, str(tmp_path / "m"), config))


def test_a_tensor_of_the_wrong_shape_or_a_missing_one_is_named(llama, tmp_path):
    def narrow(t):
        t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:-1]
        return t

    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(255, 128\), but the "
                                         r"config makes it \(256, 128\)"):
        loader.load(_edited(llama, str(tmp_path / "narrow"), tensors=narrow))

    def drop(t):
        del t["model.layers.2.self_attn.k_proj.weight"]
        return t

    with pytest.raises(ValueError, match="no tensor 'model.layers.2.self_attn.k_proj.weight'"):
        loader.load(_edited(llama, str(tmp_path / "drop"), tensors=drop))


def _kinds(name: str) -> str:
    """A mixed file, as llama-quantize makes them: v, o, up and down in other types than q, k and gate (o and down in
    the non-linear IQ4 kinds, random blocks: the gguf package does not quantize them); up and the experts in MXFP4,
    as gpt-oss ships its experts."""
    part = name.split(".")[-2]
    if part in ("ffn_up", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        return "MXFP4"
    return {"attn_v": "Q4_1", "attn_output": "IQ4_NL", "ffn_down": "IQ4_XS"}.get(part, "Q8_0")


KINDS_WRITTEN = {"Q8_0", "Q4_1", "IQ4_NL", "IQ4_XS", "MXFP4"}  # _kinds'


@pytest.fixture(scope="module")
def gemma3_gguf_shape(tmp_path_factory) -> str:
    """A Gemma 3 as its GGUF can describe it: six layers, every sixth global (the file says only the window; the
    pattern is llama.cpp's knowledge, families.py's gguf_window_pattern), the attention scaled by the head's width."""
    return family_model(str(tmp_path_factory.mktemp("gemma3-gguf")), "gemma3", seed=6, num_hidden_layers=6,
                        layer_types=None, query_pre_attn_scalar=64)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "qwen2-window"])
def test_a_gguf_of_each_family_gives_the_bits_of_its_dequantized_weights(name, request, tmp_path):
    """The same model as a GGUF of mixed types (read as shipped) and as a GGUF of the fp32 weights the gguf package
    dequantizes them to (the same metadata, Llama 3.x's RoPE factors included): the same greedy tokens and logits,
    bit for bit; every weight read in the type the file ships it in (none fell back to fp32 panels at the startup
    check); and within the bound of HF's on the dequantized weights. (A Qwen 2 GGUF cannot say which layers slide:
    qwen2-window has no GGUF.)"""
    folder = (request.getfixturevalue("gemma3_gguf_shape") if name == "gemma3"
              else family_model(str(tmp_path / "hf"), name, seed=len(name)))
    factors = name == "llama"  # written with Llama 3.x's RoPE factors, as llama.cpp does
    path = write_gguf(folder, str(tmp_path / "m.gguf"), _kinds, rope_factors=factors)
    dequantized = dequantized_folder(path, folder, str(tmp_path / "dequantized"))
    reference = write_gguf(dequantized, str(tmp_path / "f32.gguf"), lambda _: "F32", rope_factors=factors)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    shipped = LLM(model=path, enable_prefix_cache=False)
    outs, logits = generate_with_logits(shipped, [PROMPT], params)
    ref_outs, ref_logits = generate_with_logits(LLM(model=reference, enable_prefix_cache=False), [PROMPT], params)
    assert torch.equal(logits[0], ref_logits[0])
    assert outs[0].token_ids == ref_outs[0].token_ids
    if kernels.choose("auto").isa:  # the torch path holds fp32 weights
        weights = shipped.engine.runner.model.gemm_weights().values()
        no_dense = {"IQ4_XS"} if name == "gpt_oss" else set()  # gpt-oss's layers are all sparse: no ffn_down
        assert {p.kind for w in weights for p in w.parts} == KINDS_WRITTEN - no_dense
        assert "as fp32" not in shipped.engine.exactness.kernels, shipped.engine.exactness.kernels
    hf = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + outs[0].token_ids[:-1]])).logits[0, len(PROMPT) - 1:]
    assert (logits[0] - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_a_bad_gguf_is_refused_at_load_naming_what_is_wrong(llama, tmp_path):
    """An architecture we do not know, a tensor of a type the kernels do not read, a file cut short: a clear error
    at load, never a model."""
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        loader.load(write_gguf(llama, str(tmp_path / "arch.gguf"), _kinds, arch="gpt2"))
    odd = write_gguf(llama, str(tmp_path / "iq.gguf"), lambda n: "IQ2_XXS" if "ffn_down" in n else _kinds(n))
    with pytest.raises(ValueError, match="'blk.0.ffn_down.weight' is of type IQ2_XXS, which we cannot read yet"):
        loader.load(odd)
    whole = write_gguf(llama, str(tmp_path / "whole.gguf"), _kinds)
    with open(whole, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) * 3 // 4])
    with pytest.raises(ValueError, match="corrupt or unreadable GGUF|truncated"):
        loader.load(str(cut))
