"""The small endpoints vLLM users rely on: /v1/models with the context length, /tokenize, /detokenize, /version."""
import importlib.metadata

import httpx
import pytest
from openai import OpenAI
from server_fixtures import main_server

ACME = {"Authorization": "Bearer sk-acme"}
MESSAGES = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    return main_server(tmp_path_factory)


def post(srv, path: str, body: dict, headers=ACME) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def test_models_report_the_context_length(srv):
    [model] = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-acme").models.list().data
    assert model.id == srv.server.model_name and model.max_model_len == srv.server.engine.max_model_len


def test_tokenize_counts_what_the_chat_route_prefills(srv):
    r = post(srv, "/tokenize", {"model": "default", "messages": MESSAGES})
    assert r.status_code == 200
    chat = post(srv, "/v1/chat/completions", {"model": "default", "messages": MESSAGES, "max_tokens": 1,
                                               "cache_salt": "tokenize"}).json()
    assert r.json()["count"] == len(r.json()["tokens"]) == chat["usage"]["prompt_tokens"]
    assert r.json()["max_model_len"] == srv.server.engine.max_model_len


def test_tokenize_and_detokenize_round_trip(srv):
    text = "Prefix caching: naïve café, 日本語 🙂."
    ids = post(srv, "/tokenize", {"model": "default", "prompt": text}).json()["tokens"]
    assert ids == srv.server.tokenizer.encode(text)
    assert post(srv, "/detokenize", {"model": "default", "tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "default", "prompt": "a", "messages": MESSAGES}, None),
    ("/tokenize", {"model": "default"}, None),
    ("/tokenize", {"model": "gpt-9", "prompt": "a"}, "model"),
    ("/detokenize", {"model": "default", "tokens": [-1]}, "tokens"),
    ("/detokenize", {"model": "default", "tokens": [10**9]}, "tokens"),
    ("/detokenize", {"model": "default", "tokens": []}, "tokens"),
])
def test_bad_token_requests_are_4xx(srv, path, body, param):
    r = post(srv, path, body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert post(srv, path, body, headers={}).status_code == 401


def test_version(srv):
    assert httpx.get(f"{srv.url}/version").json() == {"version": importlib.metadata.version("prefixcache")}
