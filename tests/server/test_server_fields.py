"""Every request field is supported, accepted and ignored, or refused with a 400 naming it: the request models,
the table in server/fields.py and the README agree, and nothing is silently ignored."""
from pathlib import Path

import httpx
import pytest
from server_fixtures import main_server

from prefixcache.server.anthropic import MessagesRequest
from prefixcache.server.fields import IGNORED, REFUSED, SUPPORTED, TABLE, markdown
from prefixcache.server.openai_requests import ChatRequest, CompletionRequest

ACME = {"Authorization": "Bearer sk-acme"}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
MESSAGES = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
INFORMATIONAL = {"openai": {"user": "u-1", "safety_identifier": "s-1", "metadata": {"k": "v"},
                            "service_tier": "auto", "store": False, "session_id": "s-2", "include_reasoning": False,
                            "priority": 0, "use_beam_search": False, "length_penalty": 1.0, "watermarking": False,
                            "spaces_between_special_tokens": True, "return_hidden_states": False,
                            "separate_reasoning": True, "stream_reasoning": True},
                 "anthropic": {"metadata": {"user_id": "u-1"}, "service_tier": "auto"}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    return main_server(tmp_path_factory)


def post(srv, api: str, body: dict) -> httpx.Response:
    path = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
    return httpx.post(srv.url + path, json=body, headers=ACME, timeout=60)


def message(r: httpx.Response, api: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def test_the_table_is_the_request_models():
    declared = {"openai": set(ChatRequest.model_fields) | set(CompletionRequest.model_fields),
                "anthropic": set(MessagesRequest.model_fields)}
    for api, names in declared.items():
        rows = [r for r in TABLE if r.api == api]
        assert {r.field for r in rows if r.status in (SUPPORTED, IGNORED)} == names
        assert {r.field for r in rows if r.status == REFUSED}.isdisjoint(names)
        assert {r.field for r in rows if r.status == IGNORED} == set(INFORMATIONAL[api])
    assert markdown() in Path(__file__).parents[2].joinpath("README.md").read_text()


@pytest.mark.parametrize("row", [r for r in TABLE if r.status == REFUSED], ids=lambda r: f"{r.api}.{r.field}")
def test_a_refused_field_is_a_400_naming_it(srv, row):
    body = {**(MESSAGES if row.api == "anthropic" else CHAT), row.field: row.example}
    assert message(post(srv, row.api, body), row.api).startswith(f"{row.field}: ")


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_informational_fields_change_nothing(srv, api):
    base = MESSAGES if api == "anthropic" else CHAT
    plain, informed = post(srv, api, base), post(srv, api, {**base, **INFORMATIONAL[api]})
    assert plain.status_code == informed.status_code == 200
    text = (lambda r: r.json()["content"][0]["text"]) if api == "anthropic" else \
        (lambda r: r.json()["choices"][0]["message"]["content"])
    assert text(plain) == text(informed)


def test_validation_like_the_reference_apis(srv):
    assert message(post(srv, "openai", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}), "openai").startswith("stop")
    assert post(srv, "openai", {**CHAT, "stop": ["a", "b", "c", "d"]}).status_code == 200
    null_user = {**CHAT, "messages": [{"role": "user", "content": None}]}
    assert "content is required in a user message" in message(post(srv, "openai", null_user), "openai")
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    tool_turn = {**CHAT, "messages": [{"role": "user", "content": "Hi"}, call,
                                      {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    assert post(srv, "openai", tool_turn).status_code == 200
    assert message(post(srv, "openai", {**CHAT, "n": 0}), "openai").startswith("n: ")
    failed = {**MESSAGES, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom",
                                      "is_error": True}]}]}
    assert message(post(srv, "anthropic", failed), "anthropic").startswith("messages.2.content.0.is_error")
    failed["messages"][2]["content"][0]["is_error"] = False
    assert post(srv, "anthropic", failed).status_code == 200
