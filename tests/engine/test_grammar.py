"""Guides compile with xgrammar and mask exactly the tokens their grammar forbids; the grammar thread takes the
tenants' guides by weight, and a tenant's waiting guides are bounded."""
import json
import threading

import pytest
import torch

from prefixcache import LLM, SamplingParams
from prefixcache.cache.scope import CacheScope
from prefixcache.engine.engine import Engine
from prefixcache.engine.grammar import MAX_SCOPES, TENANT_SCOPES, Busy, Grammars
from prefixcache.engine.guide import Guide
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import tokenizer as load_tokenizer
from prefixcache.prompt import call_schema, tool_calls

VOCAB, EOS = 49152, (2,)


@pytest.fixture(scope="module")
def grammars():
    tok = load_tokenizer(default_model_path())
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


def test_compiled_grammars_are_bounded_per_tenant_and_in_all(grammars):
    """Each label set of a tenant (an identity token's groups make as many as they like) and each salt is a scope of
    its own: a tenant keeps TENANT_SCOPES compilers, the server MAX_SCOPES, and a tenant flooding label sets never
    takes another's below its part."""
    _, g = grammars
    g.clear()
    obj = Guide("json_object")
    for salt in ("1", "2"):
        g.compile(CacheScope(tenant="b", salt=salt), obj).result()
    for i in range(3 * TENANT_SCOPES):
        g.compile(CacheScope(tenant="a", labels=(f"group-{i}",)), obj).result()

    assert g.scopes.held() == {"a": TENANT_SCOPES, "b": 2}
    for t in range(MAX_SCOPES // TENANT_SCOPES):
        for i in range(TENANT_SCOPES):
            g.compile(CacheScope(tenant=f"t{t}", salt=str(i)), obj).result()
    assert len(g.scopes.items) == MAX_SCOPES and g.scopes.held()["b"] == 2 and min(g.scopes.held().values()) >= 2
    g.purge_tenant("b", ())
    assert "b" not in g.scopes.held()


def test_a_finished_grammar_finishes_the_request_even_with_ignore_eos(tiny_model):
    llm = LLM(model=tiny_model)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, ignore_eos=True,
                            guide=Guide("choice", json.dumps(["yes", "no"])))
    outs = llm.generate([[5, 6, 7], [8, 9]], params)  # batched with each other
    assert [(o.text in ("yes", "no"), o.finish_reason) for o in outs] == [(True, "stop")] * 2


def held_compiles(engine: Engine, monkeypatch) -> tuple[threading.Event, threading.Event, list[str]]:
    """Hold the grammar thread in the first guide it takes until released; the guides compiled, in order."""
    g = engine.grammars
    entered, release, order = threading.Event(), threading.Event(), []
    compile_ = g._compile

    def held(slot, guide: Guide):
        order.append(guide.spec)
        entered.set()
        release.wait()
        return compile_(slot, guide)

    monkeypatch.setattr(g, "_compile", held)
    return entered, release, order


def guided(engine: Engine, tenant: str, spec: str):
    """A request of the tenant whose output must be the text `spec` (a regex of letters and digits)."""
    return engine.add_request([5, 6, 7], SamplingParams(max_tokens=16, guide=Guide("regex", spec)),
                              CacheScope(tenant=tenant))


def finish(engine: Engine, seqs: list) -> None:
    while engine.has_unfinished():
        engine.step()
    assert all(s.fault is None and s.finish_reason == "stop" for s in seqs)


def test_a_tenants_guide_is_not_compiled_behind_another_tenants_backlog(tiny_model, monkeypatch):
    """Tenant a has eight new guides waiting when b's one arrives: b's compiles right after the one under way."""
    e = LLM(model=tiny_model).engine
    entered, release, order = held_compiles(e, monkeypatch)
    seqs = [guided(e, "a", "a0")]
    assert entered.wait(30)
    seqs += [guided(e, "a", f"a{i}") for i in range(1, 8)] + [guided(e, "b", "b0")]
    release.set()
    finish(e, seqs)
    assert order == ["a0", "b0"] + [f"a{i}" for i in range(1, 8)]


def test_guides_take_turns_by_cache_share(tiny_model, monkeypatch):
    """With 90% of the shares, b's three guides all compile before a's second; without shares they alternate."""
    for shares, expected in (({"b": 0.9}, ["a0", "b1", "b2", "b3", "a1"]), ({}, ["a0", "b1", "a1", "b2", "a2"])):
        e = LLM(model=tiny_model).engine
        e.cache.set_shares(shares)
        entered, release, order = held_compiles(e, monkeypatch)
        seqs = [guided(e, "a", "a0")]
        assert entered.wait(30)
        seqs += [guided(e, "a", f"a{i}") for i in range(1, 4)] + [guided(e, "b", f"b{i}") for i in range(1, 4)]
        release.set()
        finish(e, seqs)
        assert order[:5] == expected


def test_a_tenant_with_too_many_guides_waiting_is_refused_and_others_are_not(tiny_model, monkeypatch):
    monkeypatch.setattr("prefixcache.engine.grammar.COMPILES", 2)
    e = LLM(model=tiny_model).engine
    entered, release, order = held_compiles(e, monkeypatch)
    seqs = [guided(e, "a", "a0")]
    assert entered.wait(30)
    seqs += [guided(e, "a", "a1"), guided(e, "a", "a2")]
    with pytest.raises(Busy, match="2 guides of this tenant are waiting to compile"):  # the server's 429
        guided(e, "a", "a3")
    seqs.append(guided(e, "b", "b0"))
    release.set()
    finish(e, seqs)
    assert order == ["a0", "b0", "a1", "a2"]
    assert [s.output().text for s in seqs] == ["a0", "a1", "a2", "b0"]
