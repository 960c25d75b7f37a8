"""LoRA adapters per request: PEFT's files for a random-weight Llama, against HF transformers running the same
model with each adapter merged into its weights; a request's tokens and logits alone, batched beside the base
model's and another adapter's, and with a cached prefix, bit for bit; an adapter's prefixes never read by the base
model or another adapter; and an adapter we cannot apply refused at load, naming why."""
import json
import os

import pytest
import torch
from conftest import generate_with_logits
from family_models import family_model
from lora_adapters import ALPHA, RANK, write_adapter
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from prefixcache import LLM, SamplingParams
from prefixcache.models.lora import TARGETS

PROMPT = list(range(1000, 1300))
STEPS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


def merged_hf(base: str, adapter: str, scale: float):
    """HF's model with W + scale * B A in every targeted weight (what PEFT's merge computes)."""
    from safetensors.torch import load_file

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    params = dict(hf.named_parameters())
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." in key:
                b = tensors[key.replace("lora_A", "lora_B")]
                name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                params[name] += scale * (b.double() @ a.double()).float()
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str, str]:
    """A Llama, an adapter of every module, and one of q, v, o, gate and down only (k and up stay the base's)."""
    root = tmp_path_factory.mktemp("lora")
    base = family_model(str(root / "base"), "llama", seed=3)
    every = write_adapter(str(root / "every"), base, list(TARGETS), seed=1)
    some = write_adapter(str(root / "some"), base, ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], seed=2,
                         use_rslora=True)
    return base, every, some


@pytest.fixture(scope="module")
def llm(models) -> LLM:
    base, every, some = models
    return LLM(model=base, lora_modules=f"every={every},some={some}")


@pytest.mark.parametrize("name, scale", [("every", ALPHA / RANK), ("some", ALPHA / RANK ** 0.5)])
def test_an_adapter_gives_what_hf_gives_with_it_merged(models, llm, name, scale):
    """Within 1e-4 of the logits' scale at every step (fp32: HF's merged weight and our two GEMMs round otherwise),
    the same greedy tokens, and not what the base model gives."""
    _check_against_hf(llm, models[0], models[1 if name == "every" else 2], name, scale)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_an_adapter_of_another_family_gives_what_hf_gives_with_it_merged(family, tmp_path):
    """Q, k, v biases (Qwen 2.5); QK-norm after the adapted q and k (Qwen 3); sandwich norms after the adapted o and
    down, GeGLU before down (Gemma 3)."""
    base = family_model(str(tmp_path / "base"), family, seed=5)
    every = write_adapter(str(tmp_path / "every"), base, list(TARGETS), seed=6)
    _check_against_hf(LLM(model=base, lora_modules=f"every={every}"), base, every, "every", ALPHA / RANK)


def _check_against_hf(llm: LLM, base: str, adapter: str, name: str, scale: float) -> None:
    outs, logits = generate_with_logits(llm, [PROMPT], GREEDY, adapter=name)
    hf = merged_hf(base, adapter, scale)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + outs[0].token_ids[:-1]])).logits[0, len(PROMPT) - 1:]
    assert (logits[0] - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert outs[0].token_ids == ref.argmax(-1).tolist()
    _, base_logits = generate_with_logits(llm, [PROMPT], GREEDY)
    assert (base_logits[0][0] - ref[0]).abs().max().item() > 100 * 1e-4 * ref.abs().max().item()


def test_a_request_alone_batched_beside_others_and_warm_gives_the_same_bits(llm):
    """Two adapters' requests and the base model's, in one batch and chunked by other prompts' lengths, give each
    the tokens and logits it gives alone with the cache off; a second run reads its prefix from the cache."""
    prompts = [PROMPT, PROMPT[:250], PROMPT[:120] + [7, 8, 9]]
    alone = {}
    for name in ("every", "some", ""):
        for p in prompts:
            llm.engine.cache.clear()
            alone[name, len(p)] = generate_with_logits(llm, [p], GREEDY, adapter=name)
    llm.engine.cache.clear()
    for round in ("cold", "warm"):
        seqs = [(name, p) for p in prompts for name in ("every", "some", "")]
        requests = [llm.engine.add_request(p, GREEDY, adapter=name) for name, p in seqs]
        rows: dict[int, list[torch.Tensor]] = {}
        sample = llm.engine.sampler.sample
        llm.engine.sampler.sample = lambda row, seq: rows.setdefault(seq.id, []).append(row.clone()) or sample(row, seq)
        try:
            while any(r.finish_reason is None for r in requests):
                llm.engine.step()
        finally:
            llm.engine.sampler.sample = sample
        for (name, p), r in zip(seqs, requests):
            outs, logits = alone[name, len(p)]
            assert r.output().token_ids == outs[0].token_ids, (round, name, len(p))
            assert torch.equal(torch.stack(rows[r.id]), logits[0]), (round, name, len(p))
            if round == "warm":
                assert r.output().cached_tokens > 0


def test_an_adapters_prefixes_are_its_own(llm):
    """The same prompt under the base model, then each adapter, reads nothing another wrote; again under the same
    one, it reads its prefix."""
    llm.engine.cache.clear()
    prompt = PROMPT[:200]
    cached = {}
    for name in ("", "every", "some", "every"):
        out = llm.generate([prompt], GREEDY, adapter=name)[0]
        cached.setdefault(name, []).append(out.cached_tokens)
    assert cached == {"": [0], "every": [0, len(prompt) - 1], "some": [0]}


def test_an_unknown_adapter_is_refused(llm):
    with pytest.raises(ValueError, match="no LoRA adapter 'other'; loaded: every, some"):
        llm.generate([PROMPT[:10]], GREEDY, adapter="other")


@pytest.mark.parametrize("config, tensors, message", [
    ({"use_dora": True}, None, "not supported: DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, r"not supported: modules_to_save \['lm_head'\]"),
    ({"r": 8}, None, r"layer 0 q_proj: lora_A \(4, 128\) and lora_B \(128, 4\), expected \(8, 128\) and \(128, 8\)"),
    ({}, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 128)}, "is not a LoRA A or B of a layer's module"),
    ({}, {"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(4, 128)},
     "we apply LoRA to q_proj"),
    ({}, {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 128),
          "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(128, 4)},
     "layer 9 of q_proj, but the model has 3 layers"),
])
def test_an_adapter_we_cannot_apply_is_refused_at_load_naming_why(models, tmp_path, config, tensors, message):
    from safetensors.torch import load_file

    base, every, _ = models
    folder = write_adapter(str(tmp_path / "bad"), base, ["q_proj"], seed=0)
    if config:
        path = os.path.join(folder, "adapter_config.json")
        json.dump({**json.load(open(path)), **config}, open(path, "w"))
    if tensors:
        path = os.path.join(folder, "adapter_model.safetensors")
        save_file({**load_file(path), **tensors}, path)
    with pytest.raises(ValueError, match=message):
        LLM(model=base, lora_modules=f"bad={folder}")


@pytest.mark.parametrize("modules, message", [
    ("a", "NAME=PATH pairs"), ("a=/x,a=/y", "a name given twice"), ("=/x", "NAME=PATH pairs")])
def test_a_malformed_list_of_adapters_is_refused(modules, message):
    from prefixcache import Config

    with pytest.raises(ValueError, match=message):
        Config(lora_modules=modules)


def test_a_missing_folder_is_named(models, tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json, adapter_model.safetensors not found"):
        LLM(model=models[0], lora_modules=f"gone={tmp_path / 'gone'}")


def test_an_adapter_on_a_gguf_gives_the_bits_it_gives_on_the_dequantized_weights(models, tmp_path):
    """A GGUF stores q and k with each head's rotary pairs interleaved (llama.cpp's converter): the adapter, in HF's
    order, must meet them as HF orders them. The same bits as on the gguf package's dequantized folder."""
    from gguf_fixtures import dequantized_folder, write_gguf

    # linear RoPE scaling: a GGUF writes Llama 3's as factors that round otherwise than HF's frequencies
    base = family_model(str(tmp_path / "base"), "llama-linear", seed=4)
    every = write_adapter(str(tmp_path / "every"), base, list(TARGETS), seed=1)
    path = write_gguf(base, str(tmp_path / "m.gguf"), lambda name: "Q8_0")
    reference = dequantized_folder(path, base, str(tmp_path / "dequantized"))
    runs = [generate_with_logits(LLM(model=m, enable_prefix_cache=False, lora_modules=f"every={every}"), [PROMPT],
                                 GREEDY, adapter="every") for m in (path, reference)]
    assert runs[0][0][0].token_ids == runs[1][0][0].token_ids
    assert torch.equal(runs[0][1][0], runs[1][1][0])
