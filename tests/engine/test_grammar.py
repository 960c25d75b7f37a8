"""Guides compile with xgrammar and mask exactly the tokens their grammar forbids."""
import json

import pytest
import torch
from transformers import AutoTokenizer

from prefixcache.cache.scope import CacheScope
from prefixcache.config import default_model_path
from prefixcache.engine.grammar import Grammars, Guide
from prefixcache.models.loader import converted_folder
from prefixcache.prompt import call_schema, tool_calls

VOCAB, EOS = 49152, (2,)


@pytest.fixture(scope="module")
def grammars():
    tok = AutoTokenizer.from_pretrained(converted_folder(default_model_path()))
    return tok, Grammars(tok, VOCAB, EOS)


def _matcher(g: Grammars, guide: Guide):
    return g.matcher(g.compile(CacheScope(), guide).result())


def _greedy_walk(tok, grammars, guide: Guide, scores: torch.Tensor, limit: int = 64) -> str:
    """Follow the highest-scoring allowed token until the grammar ends: what greedy decoding would emit."""
    m, ids = _matcher(grammars, guide), []
    for _ in range(limit):
        logits = scores.clone()
        m.mask(logits)
        token = int(logits.argmax())
        m.accept(token)
        if m.done:
            return tok.decode(ids)
        ids.append(token)
    raise AssertionError(f"grammar did not finish in {limit} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(5))
def test_walks_end_in_text_the_guide_accepts(grammars, seed):
    tok, g = grammars
    scores = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    out = json.loads(_greedy_walk(tok, g, Guide("json_schema", json.dumps(schema)), scores))
    assert set(out) == {"ok", "n"} and isinstance(out["ok"], bool) and out["n"] in (1, 2, 3)
    assert _greedy_walk(tok, g, Guide("choice", json.dumps(["red", "green (dark)", "blue?"])), scores) in \
        ("red", "green (dark)", "blue?")
    assert _greedy_walk(tok, g, Guide("regex", r"[0-9]{3}-[a-z]{2}"), scores)[3] == "-"


def test_the_mask_forbids_and_allows(grammars):
    tok, g = grammars
    m = _matcher(g, Guide("choice", json.dumps(["yes", "no"])))
    logits = torch.zeros(VOCAB)
    m.mask(logits)
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    assert allowed and all(any(c.startswith(tok.decode([t])) for c in ("yes", "no")) for t in allowed)
    assert EOS[0] not in allowed  # nothing chosen yet: the grammar cannot end


def test_bad_guides_are_value_errors(grammars):
    _, g = grammars
    with pytest.raises(ValueError, match="json_schema"):
        _matcher(g, Guide("json_schema", "{not json"))
    with pytest.raises(ValueError, match="regex"):
        _matcher(g, Guide("regex", "(unclosed"))
    with pytest.raises(ValueError, match="guide kind"):
        Guide("yaml")


def test_a_forced_tool_call_is_one_the_renderer_reads_back(grammars):
    tok, g = grammars
    tools = {"get_weather": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                             "required": ["city"], "additionalProperties": False},
             "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
    for seed in range(4):
        scores = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
        text = _greedy_walk(tok, g, Guide("json_schema", json.dumps(call_schema(tools))), scores)
        [(name, arguments)] = tool_calls(text, set(tools))
        assert name in tools and (arguments in ({"city": "Oslo"}, {"city": "Lima"}) if name == "get_weather"
                                  else arguments == {})


def test_a_finished_grammar_finishes_the_request_even_with_ignore_eos(tiny_model):
    from prefixcache import LLM, SamplingParams

    llm = LLM(model=tiny_model)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, ignore_eos=True,
                            guide=Guide("choice", json.dumps(["yes", "no"])))
    outs = llm.generate([[5, 6, 7], [8, 9]], params)  # batched with each other
    assert [(o.text in ("yes", "no"), o.finish_reason) for o in outs] == [(True, "stop")] * 2
