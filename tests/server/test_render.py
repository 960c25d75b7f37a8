"""One renderer: the same request gives the same token ids through the server (both APIs), LLM.chat, lint, diff and
the bench's JSONL loader, for requests with tools, a tool call and its result, content parts, a developer message,
and Anthropic system blocks with cache_control."""
import json

import httpx
import pytest
from server_fixtures import long_system, main_server, prefix_header

from prefixcache import LLM, SamplingParams, prompt
from prefixcache.bench.workloads import load_jsonl
from prefixcache.lint.render import render as lint_render
from prefixcache.lint.requests import load
from prefixcache.lint.run import diff
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import tokenizer as load_tokenizer
from prefixcache.prompt import fields, render

SYSTEM = long_system("render", 8)
OPENAI = {
    "model": "default", "max_tokens": 1, "temperature": 0,
    "tools": [{"type": "function", "function": {
        "name": "get_invoice", "description": "Fetch an invoice.",
        "parameters": {"type": "object",  # properties out of order: the renderer sorts them
                       "properties": {"year": {"type": "integer"}, "invoice_number": {"type": "string"}}}}}],
    "messages": [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "What is on INV-2291?"},
                                     {"type": "text", "text": "Be brief."}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_invoice", "arguments": '{"invoice_number": "INV-2291", "year": 2024}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Pro plan, charged twice."},
        {"role": "user", "content": "Why twice?"}]}
ANTHROPIC = {
    "model": "default", "max_tokens": 1, "temperature": 0,
    "tools": [{"name": "get_invoice", "description": "Fetch an invoice.",
               "input_schema": {"type": "object", "properties": {"invoice_number": {"type": "string"}}},
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
    "system": [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Answer in English.",
                                                  "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": "What is on INV-2291?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, {
            "type": "tool_use", "id": "toolu_1", "name": "get_invoice", "input": {"invoice_number": "INV-2291"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "Pro plan, charged twice."}]},
                                     {"type": "text", "text": "Why twice?"}]}]}
ROUTES = {"openai": ("/v1/chat/completions", OPENAI), "anthropic": ("/v1/messages", ANTHROPIC)}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def ids(tok) -> dict[str, list[int]]:
    return {api: render(tok, fields(body)).token_ids for api, (_, body) in ROUTES.items()}


def test_the_map_points_at_each_field(tok):
    for body in (OPENAI, ANTHROPIC):
        p = render(tok, fields(body))
        assert all(p.text[s.start:s.end] == s.field.text for s in p.spans)
        assert p.text.count("# Tools\n") == 1 and "<|im_start|>developer" not in p.text
    names = [s.field.name for s in render(tok, fields(OPENAI)).spans]
    assert names == ["tools[0]", "messages[0].content", "messages[1].content[0].text", "messages[1].content[1].text",
                     "messages[2].tool_calls[0]", "messages[3].content", "messages[4].content"]
    p = render(tok, fields(ANTHROPIC))
    assert [(p.span_at(p.offsets[t - 1][0]).field.name, ttl) for t, ttl in p.breakpoints] == \
        [("tools[0]", "1h"), ("system[1].text", "5m")]


@pytest.mark.parametrize("api", ROUTES)
def test_server(tmp_path_factory, ids, api):
    """The server caches exactly these ids: once they are cached (sent as token ids to /v1/completions), the chat
    request reads all of its prompt from the cache but the last token, which is always recomputed."""
    srv = main_server(tmp_path_factory)
    headers, salt = {"Authorization": "Bearer sk-acme"}, {"cache_salt": f"render-{api}"}
    warm = {"model": "default", "prompt": ids[api], "max_tokens": 1, **salt}
    assert httpx.post(f"{srv.url}/v1/completions", headers=headers, json=warm, timeout=120).status_code == 200
    path, body = ROUTES[api]
    r = httpx.post(f"{srv.url}{path}", headers=headers, json={**body, **salt}, timeout=120)
    assert r.status_code == 200, r.text
    h = prefix_header(r.headers)
    assert (int(h["prompt"]), int(h["cached"])) == (len(ids[api]), len(ids[api]) - 1)


def test_llm_chat(tiny_model, tok, ids):
    """LLM.chat takes OpenAI messages and tools (the tiny model has the default model's tokenizer)."""
    out = LLM(model=tiny_model).chat(OPENAI["messages"], SamplingParams(max_tokens=1), tools=OPENAI["tools"])
    assert out.prompt_token_ids == ids["openai"]


def test_lint_and_diff(tmp_path, tok, ids):
    paths = {}
    for api, (_, body) in ROUTES.items():
        paths[api] = tmp_path / f"{api}.json"
        paths[api].write_text(json.dumps(body, indent=2))
        assert lint_render(load(str(paths[api]))[0], tok).token_ids == ids[api]
    d = diff(str(paths["openai"]), str(paths["anthropic"]))
    assert (d.a.token_ids, d.b.token_ids) == (ids["openai"], ids["anthropic"])


def test_bench_jsonl(tmp_path, tok, ids):
    """The bench sends every request through the OpenAI API: an Anthropic one as the messages it renders into."""
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(body) + "\n" for _, body in ROUTES.values()))
    sent = [render(tok, fields({"messages": s.turns[0].messages, "tools": s.tools})).token_ids
            for s in load_jsonl(str(path), 1).sessions]
    assert sent == [ids["openai"], ids["anthropic"]]


def test_tool_calls_are_read_back_as_written():
    names = {"get_weather", "get_time"}
    call = '{"tool_use": "get_weather", "input": {"city": "Oslo"}}'  # as the renderer writes a call
    assert render_call("get_weather", {"city": "Oslo"}) == call
    assert prompt.tool_calls(call, names) == [("get_weather", {"city": "Oslo"})]
    two = call + "\n" + render_call("get_time", {})
    assert prompt.tool_calls(two, names) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for not_a_call in ("It is sunny.", call + " and more", render_call("rm_rf", {}), '{"tool_use": "get_time"}', ""):
        assert prompt.tool_calls(not_a_call, names) is None


def render_call(name: str, arguments) -> str:
    """The text the renderer gives an assistant turn that is one tool call."""
    [f] = fields({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": name,
                                                                   "input": arguments}]}]})
    return f.text
