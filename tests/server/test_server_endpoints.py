"""The small endpoints vLLM users rely on: /v1/models with the context length, /tokenize, /detokenize, /version,
and the renderer's /v1/completions/render and /v1/chat/completions/render (gateways tokenize through them)."""
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


def test_tokenize_takes_vllms_chat_fields(srv):
    """vLLM's tokenize request for chats: continue_final_message, chat_template_kwargs, return_token_strs (what
    vllm-router sends when it prepares a request's tokens)."""
    partial = [*MESSAGES, {"role": "assistant", "content": "Bl"}]
    r = post(srv, "/tokenize", {"model": "default", "messages": partial, "add_generation_prompt": False,
                                "continue_final_message": True, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert srv.server.tokenizer.decode(ids).endswith("assistant\nBl")  # the reply is left open
    assert r.json()["token_strs"] == srv.server.tokenizer.convert_ids_to_tokens(ids)
    bad = post(srv, "/tokenize", {"model": "default", "messages": partial, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_render_gives_what_the_route_would_prefill(srv):
    """The renderer's answer is vLLM's GenerateRequest: the prompt's token ids, equal to the count the generation
    route then reports, and the sampling parameters the route would run."""
    chat = {"model": "default", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "top_k": 5,
            "cache_salt": "render"}
    r = post(srv, "/v1/chat/completions/render", chat)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == srv.server.model_name and out["request_id"].startswith("chatcmpl-")
    assert out["sampling_params"]["max_tokens"] == 3 and out["sampling_params"]["top_k"] == 5
    assert out["cache_salt"] == "render"
    done = post(srv, "/v1/chat/completions", chat).json()
    assert len(out["token_ids"]) == done["usage"]["prompt_tokens"]

    prompt = {"model": "default", "prompt": "Once upon a time", "max_tokens": 2, "truncate_prompt_tokens": 3}
    [one] = post(srv, "/v1/completions/render", prompt).json()  # a list: vLLM's, one per prompt
    assert one["token_ids"] == srv.server.tokenizer.encode("Once upon a time")[-3:]
    assert post(srv, "/v1/completions", prompt).json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions/render", {"model": "default", "messages": []}, "messages"),
    ("/v1/chat/completions/render", {"model": "default", "messages": MESSAGES, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions/render", {"model": "default", "prompt": ""}, "prompt"),
    ("/v1/completions/render", {"model": "gpt-9", "prompt": "a"}, "model"),
])
def test_bad_render_requests_are_4xx(srv, path, body, param):
    r = post(srv, path, body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert post(srv, path, body, headers={}).status_code == 401


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
