"""The forward pass: logits match HF transformers, and are bit-identical however a prompt is chunked."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import GREEDY, generate_with_logits
from prefixcache import LLM, SamplingParams
from prefixcache.config import default_model_path
from prefixcache.models.loader import converted_folder

REAL_PROMPTS = [
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the boiling point of water at sea level?\nA:",
]


def _hf_logits(folder: str, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _our_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position: each prefix of ids is one request (the prefix cache is off)."""
    _, logits = generate_with_logits(llm, [ids[:n] for n in range(1, len(ids) + 1)],
                                     SamplingParams(temperature=0.0, max_tokens=1))
    return torch.stack([lg[0] for lg in logits])


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_qwen"])
def test_tiny_logits_match_hf(fixture, request):
    folder = request.getfixturevalue(fixture)
    llm = LLM(model=folder, enable_prefix_cache=False, kv_dtype="float32")
    ids = llm.encode("Prefix caching keeps the keys and values of shared beginnings.")
    diff = (_our_logits(llm, ids) - _hf_logits(folder, ids)).abs().max().item()
    assert diff <= 1e-4, diff


def test_real_model_logits_and_greedy_tokens_match_hf():
    folder = converted_folder(default_model_path())
    llm = LLM(enable_prefix_cache=False, kv_dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for text in REAL_PROMPTS:
        ids = llm.encode(text)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
            hf_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        outs, logits = generate_with_logits(llm, [ids], SamplingParams(temperature=0.0, max_tokens=12,
                                                                       ignore_eos=True))
        assert (logits[0][0] - ref).abs().max().item() <= 1e-4
        assert outs[0].token_ids == hf_tokens


@pytest.mark.parametrize("chunk", [1, 7, 16, 33, 512])
def test_chunked_prefill_is_bit_identical(tiny_model, chunk):
    ids = list(range(500, 800))
    whole = LLM(model=tiny_model, enable_prefix_cache=False, max_batch_tokens=512)
    chunked = LLM(model=tiny_model, enable_prefix_cache=False, max_batch_tokens=chunk)
    a_out, a = generate_with_logits(whole, [ids])
    b_out, b = generate_with_logits(chunked, [ids])
    assert a_out[0].token_ids == b_out[0].token_ids
    assert torch.equal(a[0], b[0])


def test_suffix_on_prefix_equals_full_prefill_real_model():
    """The cache-hit primitive: prefill 40 tokens on top of 200 computed ones == one 240-token prefill."""
    ids = list(range(2000, 2240))
    cold = LLM(enable_prefix_cache=False)
    warm = LLM()
    warm.generate([ids[:200] + [1, 2, 3]], GREEDY)
    a_out, a = generate_with_logits(cold, [ids])
    b_out, b = generate_with_logits(warm, [ids])
    assert b_out[0].cached_tokens == 200  # 12 full blocks, then 8 tokens copied from the 13th
    assert a_out[0].token_ids == b_out[0].token_ids
    assert torch.equal(a[0], b[0])
