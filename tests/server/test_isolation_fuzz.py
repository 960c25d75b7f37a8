"""Isolation fuzz on a live server: 1,000 random requests over tenants, labels, salts, prompt_cache_keys and a
declared shared prefix. The oracle is a model of who may reuse what: a request may read what its own scope (tenant,
labels, salt) sent before, and the shared prefix. `cached_tokens` never exceeds what the oracle allows, and every
output equals the output computed cold."""
import json
import random

import httpx
from conftest import LONG
from server_fixtures import _start

from prefixcache import LLM, SamplingParams
from prefixcache.config import Config
from prefixcache.server.config import ServeConfig

REQUESTS = 4000 if LONG else 1000
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
KEYS = {"sk-a": {"tenant": "a"}, "sk-a-fin": {"tenant": "a", "labels": ["finance"]}, "sk-b": {"tenant": "b"}}


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_cached_tokens_never_exceed_what_the_scope_may_read(tmp_path, tiny_model, figures):
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    (tmp_path / "shared.json").write_text(json.dumps(["You are the shared assistant of every tenant here."]))
    srv = _start("fuzz-isolation", ServeConfig(Config(model=tiny_model, kv_cache_bytes=2**26, min_cache_tokens=0),
                                               api_keys=str(tmp_path / "keys.json"),
                                               shared_prefixes=str(tmp_path / "shared.json")))
    shared = srv.server.engine.config.shared_prefixes[0]
    cold = LLM(model=tiny_model, enable_prefix_cache=False)
    rng = random.Random(0)
    docs = [[rng.randrange(1000, 40000) for _ in range(120)] for _ in range(6)]
    seen: dict[tuple, list[list[int]]] = {}  # scope -> prompt + output token ids of its earlier requests
    checked = 0
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for _ in range(REQUESTS):
            key = rng.choice(list(KEYS))
            salt, cache_key = rng.choice([None, "s1", "s2"]), rng.choice([None, None, "k1"])
            prompt = (list(shared) if rng.random() < 0.5 else []) + rng.choice(docs)[:rng.randrange(8, 121)]
            prompt += [rng.randrange(1000, 40000) for _ in range(rng.randrange(1, 6))]
            body = {"model": "default", "prompt": prompt, "max_tokens": 3, "temperature": 0}
            body.update({k: v for k, v in (("cache_salt", salt), ("prompt_cache_key", cache_key)) if v})
            r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            scope = (KEYS[key]["tenant"], tuple(KEYS[key].get("labels", [])), salt, cache_key)
            own = max((_lcp(prompt, old) for old in seen.get(scope, [])), default=0)
            readable = max(own, len(shared) if prompt[:len(shared)] == list(shared) else 0)
            assert cached <= min(readable, len(prompt) - 1), (scope, cached, readable)
            out = cold.generate([prompt], GREEDY)[0]
            assert r.json()["choices"][0]["text"] == out.text
            seen.setdefault(scope, []).append(prompt + out.token_ids)
            checked += cached > 0
    assert checked > REQUESTS // 4  # enough hits that the bound was tested, not trivially met
    figures["isolation fuzz"] = {"requests": REQUESTS, "hits_checked": checked, "cross_scope_hits": 0,
                                 "outputs_equal_cold": True}
