"""Replicas behind an existing gateway: vllm-router (PyPI, the fork of SGLang's gateway that vLLM ships) with its
cache-aware policy, in front of two real servers. It adds SGLang's fields to every request (no_stop_trim,
return_hidden_states, ...), lists the replicas' model, and sends a prompt where its radix tree of routed text says
the prefix went: so each prefix is prefilled once, on one replica, and hits there after."""
import pytest
from openai import OpenAI
from server_fixtures import _start, prompt_tokens_computed

from prefixcache.bench.cluster import vllm_router
from prefixcache.config import Config
from prefixcache.server.config import ServeConfig


@pytest.fixture(scope="module")
def gateway(tiny_model, tmp_path_factory):
    replicas = [_start(f"gateway-{i}", ServeConfig(Config(model=tiny_model, kv_cache_bytes=4 * 2**20,
                                                          min_cache_tokens=0))) for i in range(2)]
    log = str(tmp_path_factory.mktemp("gateway") / "vllm-router.log")
    with vllm_router([r.url for r in replicas], log) as url:
        yield url, replicas


def test_the_gateway_lists_the_replicas_model(gateway):
    url, replicas = gateway
    assert [m.id for m in OpenAI(base_url=f"{url}/v1", api_key="none").models.list()] == \
        [replicas[0].server.model_name]


def test_a_cache_aware_gateway_sends_each_prefix_where_it_is_cached(gateway):
    """In the order A A B B A B, round robin would send each prefix's second request to the other replica; the
    gateway's radix tree sends it back to the first, where all but the question hits."""
    url, replicas = gateway
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    prefixes = {name: f"Shared context {name}: " + " ".join(f"{name}{i}" for i in range(120)) for name in "AB"}
    before = [prompt_tokens_computed(r) for r in replicas]
    prompts = cached = 0
    for turn, name in enumerate("AABBAB"):
        chat = client.chat.completions.create(model="default", max_tokens=2, temperature=0, messages=[
            {"role": "user", "content": f"{prefixes[name]} question {turn}?"}])
        hit = chat.usage.prompt_tokens_details.cached_tokens
        first = turn in (0, 2)  # at most the chat template's start and "Shared context " are cached then
        assert hit < chat.usage.prompt_tokens / 4 if first else hit >= chat.usage.prompt_tokens - 32, (turn, hit)
        prompts, cached = prompts + chat.usage.prompt_tokens, cached + hit
    # every prompt token was computed once, or came from the cache
    assert sum(prompt_tokens_computed(r) - b for r, b in zip(replicas, before)) == prompts - cached
