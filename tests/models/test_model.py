"""The forward pass: logits match HF transformers, and are bit-identical however a prompt is chunked or cached,
also across attention tiles (prompts longer than one 512-key tile) and in every exactness mode."""
import dataclasses
import random

import pytest
import torch
from conftest import GREEDY, generate_with_logits
from transformers import AutoModelForCausalLM

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import system_prompt
from prefixcache.models import rope
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import converted_folder

REAL_PROMPTS = [
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the boiling point of water at sea level?\nA:",
]
LONG = list(range(5000, 6100))  # token ids: prompts of up to 1,100 tokens span three attention tiles
DECODE = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def real() -> LLM:
    """The default model with the default config (so fp32 KV), prefix cache off."""
    return LLM(enable_prefix_cache=False)


@pytest.fixture(scope="module")
def real_hf():
    return AutoModelForCausalLM.from_pretrained(converted_folder(default_model_path()), dtype=torch.float32)


def _hf_logits(folder: str, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _our_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position: each prefix of ids is one request (the prefix cache is off)."""
    _, logits = generate_with_logits(llm, [ids[:n] for n in range(1, len(ids) + 1)],
                                     SamplingParams(temperature=0.0, max_tokens=1))
    return torch.stack([lg[0] for lg in logits])


def _assert_greedy_matches_hf(llm: LLM, hf, prompts: list[list[int]], max_tokens: int) -> None:
    """Our greedy tokens equal HF generate's, and the logits of every step are within 1e-4 of HF's."""
    outs, logits = generate_with_logits(llm, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for ids, out, ours in zip(prompts, outs, logits):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=list(llm.engine.model_config.eos_token_ids))
        assert out.token_ids == ref.sequences[0, len(ids):].tolist()
        assert (ours - torch.cat(ref.logits)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_qwen"])
def test_tiny_logits_match_hf(fixture, request):
    folder = request.getfixturevalue(fixture)
    llm = LLM(model=folder, enable_prefix_cache=False)
    ids = llm.encode("Prefix caching keeps the keys and values of shared beginnings.")
    diff = (_our_logits(llm, ids) - _hf_logits(folder, ids)).abs().max().item()
    assert diff <= 1e-4, diff


def test_real_model_logits_and_greedy_tokens_match_hf(real, real_hf):
    for text in REAL_PROMPTS:
        ids = real.encode(text)
        with torch.no_grad():
            ref = real_hf(torch.tensor([ids])).logits[0, -1]
            hf_tokens = real_hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        outs, logits = generate_with_logits(real, [ids], SamplingParams(temperature=0.0, max_tokens=12,
                                                                        ignore_eos=True))
        # float32 rounding, relative to the logits' scale: HF's own GEMMs round differently by CPU (an Intel Xeon
        # with AMX put them 1.01e-4 from ours on logits up to 34)
        assert (logits[0][0] - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        assert outs[0].token_ids == hf_tokens


def test_tiny_long_prompts_match_hf(tiny_model):
    _assert_greedy_matches_hf(LLM(model=tiny_model, enable_prefix_cache=False),
                              AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                              [LONG[:650], LONG[:1100]], 8)


def test_real_model_long_chats_match_hf_with_the_default_kv_dtype(real, real_hf):
    """Issue 9: with bf16 KV, one of three ~1,000-token chats left HF's greedy path at its second token."""
    assert real.engine.config.kv_storage_dtype == "float32"  # "auto": the activation dtype
    rng = random.Random(9)
    prompts = [real.encode_chat([{"role": "system", "content": system_prompt(rng, n)},
                                 {"role": "user", "content": "Summarize the rules above in one sentence."}])
               for n in (615, 965, 1060)]
    assert [len(p) for p in prompts] == [646, 1007, 1088]
    _assert_greedy_matches_hf(real, real_hf, prompts, 12)


@pytest.mark.parametrize("exactness", ["pad", "fixed"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 33, 512])
def test_chunked_prefill_is_bit_identical(tiny_model, chunk, exactness):
    ids = list(range(500, 800))
    whole = LLM(model=tiny_model, enable_prefix_cache=False, max_batch_tokens=512, exactness=exactness)
    chunked = LLM(model=tiny_model, enable_prefix_cache=False, max_batch_tokens=chunk, exactness=exactness)
    a_out, a = generate_with_logits(whole, [ids])
    b_out, b = generate_with_logits(chunked, [ids])
    assert a_out[0].token_ids == b_out[0].token_ids
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("exactness", ["pad", "fixed"])
def test_long_prompts_chunked_and_batched_are_bit_identical_across_tiles(tiny_model, exactness):
    """One 1,100-token prefill, against 100-token chunks (two of them straddle a tile boundary) batched with
    other prompts, whose decode rows share calls while sitting in different tiles."""
    whole = LLM(model=tiny_model, enable_prefix_cache=False, max_batch_tokens=1100, exactness=exactness)
    chunked = LLM(model=tiny_model, enable_prefix_cache=False, max_batch_tokens=100, exactness=exactness)
    prompts = [LONG[:1100], LONG[100:1120], LONG[:513], [1, 2, 3]]  # the second one's decode crosses key 1024
    _, a = generate_with_logits(whole, prompts[:1], DECODE)
    _, b = generate_with_logits(chunked, prompts, DECODE)
    assert torch.equal(a[0], b[0])
    singles = [generate_with_logits(whole, [p], DECODE)[1][0] for p in prompts[1:]]
    assert all(torch.equal(x, y) for x, y in zip(singles, b[1:]))


@pytest.mark.parametrize("exactness", ["pad", "fixed"])
def test_long_prompts_warm_equals_cold_across_tiles(tiny_model, exactness):
    cold = LLM(model=tiny_model, enable_prefix_cache=False, exactness=exactness)
    warm = LLM(model=tiny_model, max_batch_tokens=200, exactness=exactness)
    warm.generate([LONG[:700]], GREEDY)
    prompts = [LONG[:1020], LONG[:600] + [7, 8, 9], LONG[:1100], LONG[:513]]  # hits end in tile 1
    c_out, c = generate_with_logits(cold, prompts, DECODE)
    w_out, w = generate_with_logits(warm, prompts, DECODE)
    hits = [o.cached_tokens for o in w_out]
    assert hits[1] == 600 and hits[2] >= 700 and hits[3] == 512  # the third may wait for the first's prefix
    assert [o.token_ids for o in c_out] == [o.token_ids for o in w_out]
    assert all(torch.equal(x, y) for x, y in zip(c, w))


def test_suffix_on_prefix_equals_full_prefill_real_model(real):
    """The cache-hit primitive: prefill 40 tokens on top of 200 computed ones == one 240-token prefill."""
    ids = list(range(2000, 2240))
    warm = LLM()
    warm.generate([ids[:200] + [1, 2, 3]], GREEDY)
    a_out, a = generate_with_logits(real, [ids])
    b_out, b = generate_with_logits(warm, [ids])
    assert b_out[0].cached_tokens == 200  # 12 full blocks, then 8 tokens copied from the 13th
    assert a_out[0].token_ids == b_out[0].token_ids
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("threads", [1, 3])
def test_rope_rows_do_not_depend_on_the_tables_length(threads):
    """The engine's RoPE tables end at its max_model_len: each row has the bits of the model's full table's."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r in (rope.Rope(1e6), rope.Rope(5e5, "llama3", 32.0, 1.0, 4.0, 8192), rope.Rope(1e4, "linear", 8.0),
                  rope.from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0,
                                                    "original_max_position_embeddings": 4096, "truncate": False}})):
            for head_dim in (64, 80, 256):
                full = rope.tables(r, head_dim, 32768, torch.float32)
                for n in (1, 7, 100, 2049, 8192):
                    part = rope.tables(r, head_dim, n, torch.float32)
                    assert all(torch.equal(p, f[:n]) for p, f in zip(part, full)), (r, head_dim, n)
    finally:
        torch.set_num_threads(old)


def test_rope_tables_grow_as_positions_are_reached_with_the_full_tables_bits():
    """The engine's tables hold the rows sequences have reached (a doubling at a time), not the whole context."""
    r = rope.Rope(1e6, "llama3", 32.0, 1.0, 4.0, 8192)
    full = rope.tables(r, 256, 32768, torch.float32)
    table = rope.Table(r, 256, 32768, torch.float32)
    assert len(table.cos) == rope.Table.FIRST
    for positions, held in (([0, 5, 1023], 1024), ([1024], 2048), ([3000, 7], 4096), ([32767], 32768)):
        at = torch.tensor(positions)
        cos, sin = table.rows(at)
        assert len(table.cos) == held
        assert torch.equal(cos, full[0][at]) and torch.equal(sin, full[1][at])
    with pytest.raises(AssertionError, match="past the RoPE tables"):
        table.rows(torch.tensor([32768]))


def test_sequences_run_to_the_end_of_a_short_window_as_under_the_models_context(tiny_model):
    """With max_model_len 64 the tables hold 64 positions; prompts and drafts (prompt lookup on a repetitive prompt)
    run to the window's end with the tokens and logits of an engine holding the model's 2,048."""
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    short = LLM(model=tiny_model, max_model_len=64, speculative="prompt")
    assert short.engine.runner.model.rope[False].limit == 64
    full = LLM(model=tiny_model, speculative="prompt")
    prompts = [[5, 6, 7, 8] * 10, list(range(100, 163)), [9] * 20]
    s_out, s = generate_with_logits(short, prompts, params)
    assert [len(p) + len(o.token_ids) for p, o in zip(prompts, s_out)] == [64] * 3
    for prompt, out, logits in zip(prompts, s_out, s):
        f_out, f = generate_with_logits(full, [prompt], dataclasses.replace(params, max_tokens=len(out.token_ids)))
        assert f_out[0].token_ids == out.token_ids and torch.equal(f[0], logits)
