"""The KV tiers and events through a live server: Redis killed and restarted mid-run, Redis with a password, the
tier in usage, headers, /health and /metrics, the KV event stream, and the keys a router asks for."""
import asyncio
import json
import threading

import anthropic
import httpx
import openai
import pytest
from server_fixtures import _start, long_system, metrics, prefix_header, until

from prefixcache.bench.server import RedisProcess
from prefixcache.cache.credentials import REDIS_PASSWORD_ENV, TIER_SECRET_ENV
from prefixcache.cache.events import STREAM
from prefixcache.cache.remote import PREFIX
from prefixcache.config import Config
from prefixcache.router.index import PrefixIndex
from prefixcache.server.config import ServeConfig

KEYS = {"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"}, "sk-admin": {"tenant": "ops", "admin": True}}
ADMIN = {"Authorization": "Bearer sk-admin"}  # /health's tiers and replica id need an admin key
SECRET = "server-test-tier-secret-0123456789"  # every replica's: each reads the L3 blocks of the others


def tiered_server(name: str, model: str, redis_url: str, tmp_path, replica: str):
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    with pytest.MonkeyPatch.context() as env:  # read when the engine is built
        env.setenv(TIER_SECRET_ENV, SECRET)
        return _start(name, ServeConfig(Config(model=model, kv_cache_bytes=2**22, redis_url=redis_url,
                                               replica_id=replica), api_keys=str(tmp_path / "keys.json")))


def chat(url: str, key: str, tag: str, **kw):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model="default", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": long_system(tag)}, {"role": "user", "content": "Hi"}], **kw)


def test_a_replica_serves_another_replicas_prefix_from_redis_and_says_so(tiny_model, redis_proc, tmp_path):
    one = tiered_server("tiers-one", tiny_model, redis_proc.url, tmp_path, "one")
    two = tiered_server("tiers-two", tiny_model, redis_proc.url, tmp_path, "two")
    first = chat(one.url, "sk-a", "warm")
    one.server.engine.blocks.tiering.tiers.drain()
    raw = chat(two.url, "sk-a", "warm")
    body, header = raw.parse(), prefix_header(raw.headers)
    cached = body.usage.prompt_tokens_details.cached_tokens
    assert cached > 100 and body.usage.prompt_tokens_details.cached_tokens_by_tier == {"L1": 0, "L3": cached}
    assert header["tiers"] == f"L1:0,L3:{cached}"
    assert body.choices[0].message.content == first.parse().choices[0].message.content
    m = metrics(two.url)
    assert m[("prefixcache:kv_tier_lookups_total", (("result", "hit"), ("tier", "L3")))] == cached // 16
    assert m[("prefixcache:kv_tier_bytes_total", (("direction", "read"), ("tier", "L3")))] > 0
    # vLLM's external prefix cache series count the same lookups, in tokens
    assert m[("vllm:external_prefix_cache_hits_total", ())] == cached <= \
        m[("vllm:external_prefix_cache_queries_total", ())]
    # another tenant's same request loads nothing: its keys are other keys
    other = chat(two.url, "sk-b", "warm").parse()
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # and Anthropic's usage names the tier too
    client = anthropic.Anthropic(base_url=one.url, api_key="sk-a", max_retries=0)
    msg = client.messages.create(model="default", max_tokens=4, system=long_system("warm"),
                                 messages=[{"role": "user", "content": "Hi"}])
    assert msg.usage.cache_read_input_tokens_by_tier["L1"] == msg.usage.cache_read_input_tokens > 0


def test_redis_killed_mid_run_fails_no_request_and_recovers(tiny_model, redis_proc, tmp_path):
    srv = tiered_server("tiers-kill", tiny_model, redis_proc.url, tmp_path, "kill")
    health = lambda: httpx.get(f"{srv.url}/health", headers=ADMIN).json()  # noqa: E731
    assert health()["status"] == "ok" and health()["tiers"]["L3"]["status"] == "ok"
    errors, done = [], []

    def client(i: int):
        for j in range(6):
            try:
                done.append(chat(srv.url, "sk-a", f"kill-{i}-{j}").parse())
            except Exception as e:  # noqa: BLE001 -- any failure counts
                errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    until(lambda: len(done) >= 4, 60)
    redis_proc.stop()
    for t in threads:
        t.join()
    assert not errors and len(done) == 24
    chat(srv.url, "sk-a", "after-kill")  # its write-through fails: enough failures in a row open the breaker
    until(lambda: health()["status"] == "degraded", 30)
    assert health()["tiers"]["L3"]["errors"] >= 3
    redis_proc.start()
    written = metrics(srv.url)[("prefixcache:kv_tier_writes_total", (("result", "ok"), ("tier", "L3")))]

    tags = iter(range(10**6))

    def recovered():
        chat(srv.url, "sk-a", f"recover-{next(tags)}")  # new blocks, so new write-throughs
        return (health()["status"] == "ok" and metrics(srv.url)[
            ("prefixcache:kv_tier_writes_total", (("result", "ok"), ("tier", "L3")))] > written)

    until(recovered, 30)


def test_events_and_router_keys_agree_and_stay_per_tenant(tiny_model, redis_proc, tmp_path):
    srv = tiered_server("tiers-events", tiny_model, redis_proc.url, tmp_path, "events")
    body = {"model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": long_system("events")}, {"role": "user", "content": "Hi"}]}

    def keys(key: str, path: str = "/v1/chat/completions", payload: dict = body) -> httpx.Response:
        return httpx.post(f"{srv.url}/v1/cache/keys", headers={"Authorization": f"Bearer {key}"},
                          json={"path": path, "body": payload})

    mine, theirs = keys("sk-a").json(), keys("sk-b").json()
    assert mine["block_size"] == 16 and len(mine["keys"]) > 5
    assert not set(mine["keys"]) & set(theirs["keys"])  # the tenant is in every key
    assert keys("sk-nope").status_code == 401
    bad = keys("sk-a", payload={"model": "default"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    chat(srv.url, "sk-a", "events")
    srv.server.engine.blocks.tiering.tiers.events.flush()
    entries = redis_proc.client().xrange(STREAM)
    fields = [{k.decode(): v.decode() for k, v in e.items()} for _, e in entries]
    assert fields[0] == {"replica": "events", "kind": "reset", "tier": "L1", "keys": ""}
    stored = {k for f in fields if f["kind"] == "stored" and f["tier"] == "L1" for k in f["keys"].split(",")}
    assert set(mine["keys"]) <= stored  # the keys the router will ask about are the ones announced
    assert not set(theirs["keys"]) & stored
    assert httpx.get(f"{srv.url}/health", headers=ADMIN).json()["replica_id"] == "events"
    # a completion's keys: its prompt's blocks, the prefix of the same text with one more block
    text = long_system("events")
    short, longer = (keys("sk-a", "/v1/completions", {"model": "default", "prompt": text[:n]}).json()["keys"]
                     for n in (len(text) // 2, len(text)))
    assert short and longer[:len(short)] == short and len(longer) > len(short)


def test_redis_with_a_password_serves_the_replicas_that_have_it(tiny_model, tmp_path, monkeypatch):
    """Redis started with --requirepass: a replica given PREFIXCACHE_REDIS_PASSWORD writes its blocks and events
    there, and a router's index reads them; one without the password gets L3 errors (health degraded) and still
    answers every request."""
    redis = RedisProcess(password="test-redis-password-0123456789").start()
    try:
        monkeypatch.setenv(REDIS_PASSWORD_ENV, redis.password)
        given = tiered_server("tiers-auth", tiny_model, redis.url, tmp_path, "auth")
        monkeypatch.delenv(REDIS_PASSWORD_ENV)
        denied = tiered_server("tiers-no-auth", tiny_model, redis.url, tmp_path, "no-auth")
        assert chat(given.url, "sk-a", "auth").parse().choices
        given.server.engine.blocks.tiering.tiers.drain()
        written = metrics(given.url)[("prefixcache:kv_tier_writes_total", (("result", "ok"), ("tier", "L3")))]
        assert written > 5 and len(redis.client().keys(f"{PREFIX}*")) == written
        assert httpx.get(f"{given.url}/health", headers=ADMIN).json()["tiers"]["L3"] == {
            "status": "ok", "errors": 0, "skipped": 0}

        async def follow() -> PrefixIndex:  # the router's event reader, with the password
            index = PrefixIndex(redis.url, password=redis.password, block_ms=50)
            task = asyncio.create_task(index.follow())
            while index.blocks("auth") < written:
                await asyncio.sleep(0.05)
            task.cancel()
            return index

        assert asyncio.run(asyncio.wait_for(follow(), 10)).blocks("no-auth") == 0

        for i in range(3):
            assert chat(denied.url, "sk-a", f"no-auth-{i}").parse().choices
        until(lambda: httpx.get(f"{denied.url}/health").json()["status"] == "degraded", 30)
        assert httpx.get(f"{denied.url}/health", headers=ADMIN).json()["tiers"]["L3"]["errors"] >= 3
    finally:
        redis.stop()
