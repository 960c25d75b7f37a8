"""OpenAI API against a real server: chat and completions, streaming, cached_tokens, tenants, purge, metrics."""
import json
import logging

import httpx
import openai
import pytest
from openai import OpenAI
from server_fixtures import SHARED_SYSTEM, long_system, main_server, metrics, nocache_server, prefix_header

from prefixcache.prompt import encode_system

MIN_PROMPT = 200  # long_system() prompts are longer than this, and than the server's minimum cacheable length


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    return main_server(tmp_path_factory)


def client(srv, key="sk-acme") -> OpenAI:
    return OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)


def chat(srv, system: str, user: str = "What should I do?", key="sk-acme", **kw):
    """One greedy chat request; returns (completion, x-prefix-cache header as a dict)."""
    raw = client(srv, key).chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=8, temperature=0, **kw)
    return raw.parse(), prefix_header(raw.headers)


def test_chat_reports_cached_tokens_on_the_second_request(srv):
    system = long_system("chat-cache")
    salt = {"cache_salt": "chat-cache"}  # a scope no other test touches: the first request must miss entirely
    first, h1 = chat(srv, system, extra_body=salt)
    second, h2 = chat(srv, system, extra_body=salt)
    assert first.usage.prompt_tokens > MIN_PROMPT
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and h1["scope"] == "none"
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16 and cached < second.usage.prompt_tokens
    assert h2 == {"cached": str(cached), "prompt": str(second.usage.prompt_tokens), "scope": "own",
                  "tiers": f"L1:{cached}", "miss": "hit"}
    assert second.usage.prompt_tokens_details.cached_tokens_by_tier == {"L1": cached}
    assert h1["miss"] == "cold"
    assert second.choices[0].message.content == first.choices[0].message.content  # warm == cold
    assert second.choices[0].finish_reason == first.choices[0].finish_reason
    assert second.usage.completion_tokens == first.usage.completion_tokens


def test_warm_output_equals_output_with_the_cache_off(srv):
    system = long_system("exactness")
    chat(srv, system)
    warm, h = chat(srv, system)
    assert int(h["cached"]) > 0
    cold, h_off = chat(nocache_server(), system)
    assert h_off["cached"] == "0" and cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_no_prefix_cache_reports_zero():
    srv = nocache_server()
    system = long_system("nocache")
    chat(srv, system)
    second, _ = chat(srv, system)
    assert second.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_chat_with_usage(srv):
    system = long_system("stream")
    chat(srv, system)
    stream = client(srv).chat.completions.create(
        model="default", messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    blocking, _ = chat(srv, system, "Hi")
    assert chunks[-2].choices[0].finish_reason == blocking.choices[0].finish_reason
    assert text == blocking.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == blocking.usage.completion_tokens


def test_completions_streaming_and_not(srv):
    prompt = long_system("completions")
    prompt_ids = srv.server.tokenizer.encode(prompt)
    c = client(srv)
    first = c.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0,
                                 extra_body={"cache_salt": "completions"})
    with pytest.raises(openai.BadRequestError, match="some_unknown_field: this server does not support this field"):
        c.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0,
                             extra_body={"cache_salt": "completions", "some_unknown_field": {"x": 1}})
    second = c.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"cache_salt": "completions"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].text == first.choices[0].text and first.choices[0].text
    chunks = list(c.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       extra_body={"cache_salt": "completions"}))
    assert "".join(ch.choices[0].text for ch in chunks) == first.choices[0].text
    ids = c.completions.create(model=srv.server.model_name, prompt=prompt_ids[:40], max_tokens=2, temperature=0,
                               extra_body={"cache_salt": "completions"})
    # token ids hit the text prompt's blocks: all of its 40 tokens but the last, which is always recomputed
    assert ids.usage.prompt_tokens == 40 and ids.usage.prompt_tokens_details.cached_tokens == 39


def test_stop_strings_cut_the_output(srv):
    system = long_system("stop")
    full, _ = chat(srv, system)
    text = full.choices[0].message.content
    assert len(text) > 3
    cut, _ = chat(srv, system, stop=[text[2:4]])
    assert cut.choices[0].message.content == text[:2] and cut.choices[0].finish_reason == "stop"


def test_tenants_never_hit_each_other(srv):
    system = long_system("tenants")
    salt = {"cache_salt": "tenants"}  # the same salt for both: only the tenant differs
    chat(srv, system, key="sk-acme", extra_body=salt)
    _, globex = chat(srv, system, key="sk-globex", extra_body=salt)
    _, acme = chat(srv, system, key="sk-acme", extra_body=salt)
    assert globex["cached"] == "0"
    assert int(acme["cached"]) > 0 and acme["scope"] == "own"


def test_salt_and_prompt_cache_key_narrow_the_scope(srv):
    system = long_system("salt")
    chat(srv, system)
    _, plain = chat(srv, system)
    _, salted = chat(srv, system, extra_body={"cache_salt": "s1"})
    _, salted_again = chat(srv, system, extra_body={"cache_salt": "s1"})
    _, keyed = chat(srv, system, extra_body={"cache_salt": "s1", "prompt_cache_key": "k",
                                             "prompt_cache_retention": "24h", "user": "u1"})
    assert int(plain["cached"]) > 0 and salted["cached"] == "0" and int(salted_again["cached"]) > 0 and \
        keyed["cached"] == "0"


def test_shared_prefix_hits_across_tenants_on_exactly_that_prefix(srv):
    shared_len = len(encode_system(srv.server.tokenizer, SHARED_SYSTEM))
    chat(srv, SHARED_SYSTEM, "Where is my invoice? " * 20, key="sk-acme")
    _, h = chat(srv, SHARED_SYSTEM, "How do I reset my password? " * 20, key="sk-globex")
    # the shared system prompt ends; the template's end-of-message tokens follow
    assert h == {"cached": str(shared_len), "prompt": h["prompt"], "scope": "shared", "tiers": f"L1:{shared_len}",
                 "miss": "diverged", "at": "template"}
    _, h = chat(srv, SHARED_SYSTEM, "How do I reset my password? " * 20, key="sk-globex")
    assert int(h["cached"]) > shared_len and h["scope"] == "shared"  # the rest is globex's own


def test_purge_own_scope_and_admin_clear(srv):
    acme_system, globex_system = long_system("purge-acme"), long_system("purge-globex")
    for system, key in ((acme_system, "sk-acme"), (globex_system, "sk-globex")):
        chat(srv, system, key=key)
        chat(srv, system, key=key, extra_body={"cache_salt": "other"})
    before = metrics(srv.url)
    r = httpx.delete(f"{srv.url}/v1/cache", headers={"Authorization": "Bearer sk-acme"})
    assert r.status_code == 200 and r.json()["purged_blocks"] > 0 and r.json()["tenant"] == "acme"
    key = ("prefixcache:cache_evictions_total", (("reason", "purge"),))
    assert metrics(srv.url)[key] - before.get(key, 0) == r.json()["purged_blocks"]
    _, acme = chat(srv, acme_system, key="sk-acme")
    _, acme_salted = chat(srv, acme_system, key="sk-acme", extra_body={"cache_salt": "other"})
    _, globex = chat(srv, globex_system, key="sk-globex")
    assert acme["cached"] == "0" and acme_salted["cached"] == "0" and int(globex["cached"]) > 0
    r = httpx.delete(f"{srv.url}/v1/cache", headers={"x-api-key": "sk-admin"})
    assert r.status_code == 200 and r.json()["scope"] == "all" and r.json()["purged_blocks"] > 0
    _, globex = chat(srv, globex_system, key="sk-globex")
    assert globex["cached"] == "0"


def test_metrics_move(srv):
    system = long_system("metrics")
    before = metrics(srv.url)
    first, _ = chat(srv, system)
    second, _ = chat(srv, system)
    client(srv).models.list()
    with pytest.raises(Exception):
        client(srv).chat.completions.create(model="default", messages=[], max_tokens=4)
    after = metrics(srv.url)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("vllm:prefix_cache_queries_total") == 2 * first.usage.prompt_tokens
    assert moved("vllm:prefix_cache_hits_total") == second.usage.prompt_tokens_details.cached_tokens > 0
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:time_to_first_token_seconds_count") == 2 == moved("vllm:request_queue_time_seconds_count")
    assert moved("prefixcache:step_tokens_total", kind="prefill") == \
        2 * first.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    assert moved("prefixcache:step_tokens_total", kind="decode") == \
        first.usage.completion_tokens + second.usage.completion_tokens - 2  # each first token ends a prefill
    assert moved("vllm:inter_token_latency_seconds_count") == \
        first.usage.completion_tokens + second.usage.completion_tokens - 2
    finished = sum(moved("vllm:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == 2
    assert moved("prefixcache:requests_total", api="openai", status="200") == 2
    assert moved("prefixcache:requests_total", api="openai", status="400") == 1
    assert 0 < after[("vllm:kv_cache_usage_perc", ())] <= 1
    assert after[("vllm:num_requests_waiting", ())] == 0
    prompts, outputs = 2 * first.usage.prompt_tokens, first.usage.completion_tokens + second.usage.completion_tokens
    assert moved("vllm:prompt_tokens_total") == prompts == moved("vllm:request_prompt_tokens_sum")
    assert moved("vllm:prompt_tokens_cached_total") == second.usage.prompt_tokens_details.cached_tokens
    assert moved("vllm:generation_tokens_total") == outputs == moved("vllm:request_generation_tokens_sum")
    config = [labels for name, labels in after if name == "vllm:cache_config_info"]
    assert after[("vllm:cache_config_info", (("block_size", "16"), ("cache_dtype", "float32"),
                                             ("enable_prefix_caching", "True"),
                                             ("num_gpu_blocks",
                                              str(srv.server.engine.pool.usable_blocks))))] == 1, config


def test_models_and_health(srv):
    assert [m.id for m in client(srv).models.list()] == [srv.server.model_name]
    health = httpx.get(f"{srv.url}/health", headers={"Authorization": "Bearer sk-admin"}).json()
    assert health["status"] == "ok" and health["exactness"] == srv.server.engine.exactness.summary()
    assert health["exactness"]["mode"] in ("kernel", "pad", "fixed", "rows")
    assert health["exactness"]["kernels"]  # which kernel build runs, or why none does
    assert (health["exactness"]["mode"] == "kernel") != health["exactness"]["kernels"].startswith("off")


def test_one_json_log_line_per_request(srv, caplog):
    with caplog.at_level(logging.INFO, logger="prefixcache.request"):
        chat(srv, "Be brief.", extra_body={"cache_salt": "log-line"})  # a fresh scope: nothing cached
        with pytest.raises(openai.BadRequestError):
            client(srv).chat.completions.create(model="default", messages=[], max_tokens=4)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefixcache.request"]
    assert [line["status"] for line in lines] == [200, 400]
    assert lines[0]["tenant"] == "acme" and lines[0]["prompt_tokens"] > 0 and lines[0]["completion_tokens"] > 0
    assert lines[0]["miss"] == "below_min_length" and lines[0]["cached_tokens"] == 0
    assert lines[0]["miss_at"] == "at=template"  # nothing matched: the match stopped in the chat template
