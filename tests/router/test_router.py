"""The cache-aware router (prefixcache/router) with real parts only: a real Redis, `prefixcache serve` replicas as
subprocesses on the tiny random-weight model, the router's own app under uvicorn, and the official clients."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
import uvicorn
from server_fixtures import long_system, metrics, until

from prefixcache.bench.server import RedisProcess, free_port
from prefixcache.cache.credentials import TIER_SECRET_ENV
from prefixcache.router.app import create_app
from prefixcache.router.balance import Candidate, Policy, choose
from prefixcache.router.config import RouterConfig
from prefixcache.router.index import STREAM, PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.proxy import Router
from prefixcache.router.replicas import Replica

KEYS = {"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"}, "sk-admin": {"tenant": "ops", "admin": True}}
SECRET = "router-test-tier-secret-0123456789"  # every replica's: each reads the L3 blocks of the others


# --- the policy ---------------------------------------------------------------------------------------------------

def test_balance_policy():
    policy = Policy(min_match_fraction=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)

    def pick(*loads_and_matches, n_keys=10):
        d = choose([Candidate(f"r{i}", load, match) for i, (load, match) in enumerate(loads_and_matches)], n_keys,
                   policy)
        return d.replica.url, d.reason

    assert pick((2, 0), (3, 8), (1, 5)) == ("r1", "cache")  # balanced: the longest match
    assert pick((2, 6), (1, 6)) == ("r1", "cache")  # equal matches: the less loaded
    assert pick((2, 4), (1, 0)) == ("r1", "load")  # best match under min_match_fraction (4 < 0.5 * 10)
    assert pick((2, 5), (1, 0)) == ("r0", "cache")  # exactly at the fraction
    assert pick((9, 10), (2, 0)) == ("r1", "balance")  # uneven: 9 - 2 > 4 and 9 > 1.5 * 2
    assert pick((20, 10), (15, 0)) == ("r0", "cache")  # 20 - 15 > 4, but 20 < 1.5 * 15: not uneven
    assert pick((3, 10), (0, 0)) == ("r0", "cache")  # 3 > 1.5 * 0, but 3 - 0 <= 4: not uneven
    assert pick((5, 10), (0, 0)) == ("r1", "balance")
    assert pick((1, 0), (1, 0), n_keys=0) == ("r0", "load")  # no keys (no index, or the lookup failed); ties: first
    assert pick((4, 0), (1, 0), (1, 0)) == ("r1", "load")


def test_a_routed_request_counts_as_cached_until_its_events_come():
    """The next request with the same prefix follows the first before any event says its blocks exist; the
    expectation lapses after expect_seconds, and a reset of the replica drops it."""
    index = PrefixIndex("redis://unused", expect_seconds=0.2)
    index.expect("r0", ["k0", "k1", "k2"])
    assert index.match("r0", ["k0", "k1", "k9"]) == 2 and index.match("r1", ["k0"]) == 0
    time.sleep(0.25)
    assert index.match("r0", ["k0"]) == 0
    index.expect("r0", ["k0"])
    index.apply({"replica": "r0", "kind": "reset", "tier": "L1", "keys": ""})
    assert index.match("r0", ["k0"]) == 0


def test_round_robin_takes_every_replica_in_turn_whatever_is_cached():
    replicas = [Replica(f"http://r{i}", healthy=True, replica_id=f"r{i}") for i in range(3)]
    index = PrefixIndex("redis://unused")
    index.apply({"replica": "r0", "kind": "stored", "tier": "L1", "keys": "k0,k1"})
    rr = Router(replicas, index, Policy(kind="round-robin"), 0, RouterMetrics(replicas, index))
    aware = Router(replicas, index, Policy(), 0, RouterMetrics(replicas, index))
    assert [rr.pick(["k0", "k1"], set())[0].url for _ in range(6)] == [f"http://r{i % 3}" for i in range(1, 7)]
    assert {aware.pick(["k0", "k1"], set())[0].url for _ in range(6)} == {"http://r0"}


# --- the index ----------------------------------------------------------------------------------------------------

def test_index_rebuilds_from_the_stream(redis_proc):
    """One index follows the stream, is stopped (a router restart), events go on; a new index read from the start
    holds exactly what a never-stopped one would. Then Redis restarts empty: the index keeps what it had and follows
    the new stream."""
    r = redis_proc.client()
    k = [f"{i:032x}" for i in range(10)]

    def event(replica, kind, tier="L1", keys=()):
        return r.xadd(STREAM, {"replica": replica, "kind": kind, "tier": tier, "keys": ",".join(keys)}).decode()

    async def caught_up(index, last):
        deadline = time.monotonic() + 10
        while index.last_id != last:
            assert time.monotonic() < deadline, "the index did not reach the stream's last entry"
            await asyncio.sleep(0.01)

    async def run():
        first = PrefixIndex(redis_proc.url, block_ms=50)
        task = asyncio.create_task(first.follow())
        event("r1", "stored", "L1", k[:4])
        event("r1", "stored", "L2", k[:1])
        event("r1", "removed", "L1", k[1:2])  # r1: k0 (L1, L2), k2, k3
        event("r2", "stored", "L1", k[:3])
        event("r2", "stored", "L2", k[:2])
        r.xadd(STREAM, {"replica": "r2", "kind": "stored"})  # malformed (no tier): skipped, the index goes on
        event("r2", "reset")  # r2 restarted: its L1 is gone, k0 and k1 survive on its disk
        await caught_up(first, event("r2", "removed", "L2", k[1:2]))
        assert first.match("r1", k[:4]) == 1 and first.match("r1", [k[0], k[2], k[3]]) == 3
        assert first.match("r2", k[:3]) == 1 and first.blocks("r2") == 1
        assert first.match("r9", k[:3]) == 0 and first.match("r1", []) == 0
        task.cancel()

        event("r1", "reset")  # while no router runs: r1 restarts with its disk's k0 only
        last = event("r3", "stored", "L1", k[5:8])
        second = PrefixIndex(redis_proc.url, block_ms=50)
        task = asyncio.create_task(second.follow())
        await caught_up(second, last)
        assert second.match("r1", k[:4]) == 1 and second.blocks("r1") == 1
        assert second.match("r2", k[:3]) == 1 and second.match("r3", k[5:8]) == 3
        assert {rep: {t: sorted(s) for t, s in tiers.items()} for rep, tiers in second.tiers.items()} == {
            "r1": {"L1": [], "L2": [k[0]]}, "r2": {"L1": [], "L2": [k[0]]}, "r3": {"L1": k[5:8], "L2": []}}

        redis_proc.stop()
        await asyncio.sleep(0.3)  # the index retries meanwhile
        redis_proc.start()
        await caught_up(second, event("r3", "removed", "L1", k[5:6]))
        assert second.match("r3", k[5:8]) == 0 and second.match("r3", k[6:8]) == 2 and second.match("r1", k[:1]) == 1
        task.cancel()

    asyncio.run(run())


# --- a router over real replicas ----------------------------------------------------------------------------------

class ReplicaProcess:
    """`prefixcache serve` on the tiny model, publishing KV events to Redis; kill() and start() again on its port."""

    def __init__(self, model: str, keys: str, redis_url: str, replica_id: str, log_path: str):
        self.port, self.replica_id, self.proc = free_port(), replica_id, None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "prefixcache.cli", "serve", "--model", model, "--port", str(self.port),
                     "--api-keys", keys, "--redis-url", redis_url, "--replica-id", replica_id,
                     "--min-cache-tokens", "0", "--kv-cache-bytes", "16M", "--max-model-len", "1024"]

    def start(self) -> "ReplicaProcess":
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, TIER_SECRET_ENV: SECRET})
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, f"replica {self.replica_id} exited; see {self.log_path}"
            assert time.monotonic() < deadline, f"replica {self.replica_id} did not start; see {self.log_path}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class RouterServer:
    """The router app under uvicorn in a thread of the test process (its state readable by the test)."""

    def __init__(self, cfg: RouterConfig):
        self.app = create_app(cfg)
        self.router = self.app.state.router
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=cfg.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        until(lambda: self.server.started or not self.thread.is_alive(), 30)
        assert self.server.started, "the router did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def state(self, replica: ReplicaProcess):
        return next(r for r in self.router.replicas if r.url == replica.url)


@dataclass
class Cluster:
    replicas: list[ReplicaProcess]
    router: RouterServer

    def openai(self, key: str = "sk-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.router.url}/v1", api_key=key, max_retries=0)

    def anthropic(self, key: str = "sk-a") -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.router.url, api_key=key, max_retries=0)

    def requests_by_replica(self) -> dict[str, float]:
        m = metrics(self.router.url)
        return {r.url: m.get(("prefixcache_router:requests_total", (("replica", r.url),)), 0) for r in self.replicas}

    def counter(self, name: str, **labels) -> float:
        return metrics(self.router.url).get((name, tuple(sorted(labels.items()))), 0)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("router")
    (d / "keys.json").write_text(json.dumps(KEYS))
    redis = RedisProcess().start()
    replicas = [ReplicaProcess(tiny_model, str(d / "keys.json"), redis.url, f"replica-{i}", str(d / f"replica-{i}.log"))
                for i in (1, 2)]
    for r in replicas:
        r.start()
    router = None
    try:
        for r in replicas:
            r.wait_ready()
        router = RouterServer(RouterConfig([r.url for r in replicas], port=free_port(), redis_url=redis.url,
                                           health_interval=0.2, admin_key="sk-admin"))
        yield Cluster(replicas, router)
    finally:
        if router:
            router.stop()
        for r in replicas:
            r.kill()
        redis.stop()


def indexed(cluster: Cluster, key: str, path: str, body: dict) -> tuple[ReplicaProcess, list[str]]:
    """Wait until the router's index holds every full block of this request on one replica (its KV events have
    arrived); that replica, and the request's keys."""
    keys = httpx.post(f"{cluster.replicas[0].url}/v1/cache/keys", json={"path": path, "body": body},
                      headers={"Authorization": f"Bearer {key}"}).json()["keys"]
    index, deadline = cluster.router.router.index, time.monotonic() + 10
    while True:
        holders = [r for r in cluster.replicas if index.match(r.replica_id, keys) == len(keys)]
        if keys and holders:
            return holders[0], keys
        assert time.monotonic() < deadline, "the request's blocks never reached the router's index"
        time.sleep(0.02)


def test_streaming_and_auth_pass_through(cluster):
    """Streams of both APIs come through whole (equal to the non-streamed answer), replica headers too; a wrong key
    gets the replica's own 401 in each API's format (the router never decides the tenant)."""
    before = sum(cluster.requests_by_replica().values())
    cached_before = sum(cluster.counter("prefixcache_router:cached_tokens_total", replica=r.url)
                        for r in cluster.replicas)
    oa = cluster.openai()
    served = httpx.get(f"{cluster.replicas[0].url}/v1/models", headers={"Authorization": "Bearer sk-a"}).json()
    assert [m.id for m in oa.models.list()] == [m["id"] for m in served["data"]]  # /v1/models passes through
    messages = [{"role": "user", "content": "Stream a short answer through the router, please."}]
    body = {"model": "default", "max_tokens": 8, "temperature": 0, "messages": messages}
    raw = oa.chat.completions.with_raw_response.create(**body)
    assert "cached=" in raw.headers["x-prefix-cache"]
    whole = raw.parse()
    indexed(cluster, "sk-a", "/v1/chat/completions", body)  # so the stream goes where the prompt is cached
    chunks = list(oa.chat.completions.create(model="default", max_tokens=8, temperature=0, messages=messages,
                                             stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    an = cluster.anthropic()
    msg = an.messages.create(model="default", max_tokens=8, messages=messages)
    indexed(cluster, "sk-a", "/v1/messages", {"model": "default", "max_tokens": 8, "messages": messages})
    with an.messages.stream(model="default", max_tokens=8, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.usage.output_tokens == msg.usage.output_tokens
    assert sum(cluster.requests_by_replica().values()) - before == 4
    # the router read the cached tokens each answer reported, from JSON bodies and from SSE data lines alike
    reported = [whole.usage.prompt_tokens_details.cached_tokens, chunks[-1].usage.prompt_tokens_details.cached_tokens,
                msg.usage.cache_read_input_tokens, final.usage.cache_read_input_tokens]
    cached = sum(cluster.counter("prefixcache_router:cached_tokens_total", replica=r.url) for r in cluster.replicas)
    assert cached - cached_before == sum(reported) and reported[1] > 0 and reported[3] > 0

    with pytest.raises(openai.AuthenticationError) as e:
        cluster.openai("sk-wrong").chat.completions.create(model="default", max_tokens=4, messages=messages)
    assert e.value.response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        with cluster.anthropic("sk-wrong").messages.stream(model="default", max_tokens=4, messages=messages) as s:
            list(s.text_stream)
    body = e.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    until(lambda: all(r.in_flight == 0 for r in cluster.router.router.replicas), 5)  # streams released their replica


def test_router_health_tells_probes_and_tenants_only_its_status_and_an_admin_its_details(cluster):
    """The router shows its replicas only to a key that a replica's own /health answers in detail."""
    url = f"{cluster.router.url}/health"
    for headers in (None, {"Authorization": "Bearer sk-a"}, {"x-api-key": "sk-b"}, {"x-api-key": "sk-nope"}):
        r = httpx.get(url, headers=headers)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
    r = httpx.get(url, headers={"Authorization": "Bearer sk-admin"})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok" and body["healthy"] == 2
    assert sorted(d["replica_id"] for d in body["replicas"]) == ["replica-1", "replica-2"]


def test_a_router_without_an_admin_key_routes_by_status_and_its_own_load(cluster):
    """Without an admin key a keyed replica's /health tells the router only its status: the replica is in rotation,
    with no replica id (so no cached prefix is known there) and this router's requests as its load."""
    router = RouterServer(RouterConfig([r.url for r in cluster.replicas], port=free_port(), health_interval=0.2))
    try:
        until(lambda: all(r.healthy for r in router.router.replicas), 10)
        assert [(r.status, r.replica_id) for r in router.router.replicas] == [("ok", None)] * 2
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-a", max_retries=0)
        assert client.chat.completions.create(model="default", max_tokens=2, messages=[
            {"role": "user", "content": "Who routes me?"}]).choices
        admin = httpx.get(f"{router.url}/health", headers={"Authorization": "Bearer sk-admin"}).json()
        assert admin["healthy"] == 2 and httpx.get(f"{router.url}/health").json() == {"status": "ok"}
    finally:
        router.stop()


def test_router_follows_cached_prefixes(cluster):
    """Requests with the same long tenant prefix go where that prefix is cached, and hit it there; each tenant's
    prefix on whichever replica served it first. Routing blind to the index would split them between replicas."""
    cache_decisions = cluster.counter("prefixcache_router:decisions_total", reason="cache")
    predicted = {r.url: cluster.counter("prefixcache_router:predicted_cached_tokens_total", replica=r.url)
                 for r in cluster.replicas}
    cached = {r.url: cluster.counter("prefixcache_router:cached_tokens_total", replica=r.url) for r in cluster.replicas}
    for key, topic in (("sk-a", "refund policy"), ("sk-b", "warehouse safety")):
        client = cluster.openai(key)
        system = {"role": "system", "content": long_system(topic, 12)}
        first = {"model": "default", "max_tokens": 2, "temperature": 0,
                 "messages": [system, {"role": "user", "content": "The first question."}]}
        counts = cluster.requests_by_replica()
        client.chat.completions.create(**first)
        home = next(r for r in cluster.replicas if cluster.requests_by_replica()[r.url] > counts[r.url])
        holder, keys = indexed(cluster, key, "/v1/chat/completions", first)
        assert holder is home and len(keys) >= 10

        counts = cluster.requests_by_replica()
        for i in range(4):
            r = client.chat.completions.create(model="default", max_tokens=2, temperature=0,
                                               messages=[system, {"role": "user", "content": f"Question {i}?"}])
            assert r.usage.prompt_tokens_details.cached_tokens >= 10 * 16
        after = cluster.requests_by_replica()
        assert after[home.url] - counts[home.url] == 4, (topic, home.url, counts, after)

    assert cluster.counter("prefixcache_router:decisions_total", reason="cache") - cache_decisions >= 8
    for r in cluster.replicas:
        p = cluster.counter("prefixcache_router:predicted_cached_tokens_total", replica=r.url) - predicted[r.url]
        c = cluster.counter("prefixcache_router:cached_tokens_total", replica=r.url) - cached[r.url]
        # the index predicts full blocks; the replica also reuses the matching head of a partial block
        assert p <= c < p + 5 * 16, (r.url, p, c)


def test_replica_killed_under_load(cluster):
    """A replica killed while it serves: every non-streamed request still succeeds (retried elsewhere before any
    byte reached the client), health takes the replica out, and puts it back after its restart, whose reset event
    empties its part of the index."""
    router = cluster.router.router
    done, failed, killed = [], [], threading.Event()

    def client(i: int) -> None:  # at least 6 requests, and on until the victim is killed
        c = cluster.openai()
        j = 0
        while j < 6 or not killed.is_set():
            j += 1
            try:
                done.append(c.chat.completions.create(model="default", max_tokens=12, messages=[
                    {"role": "user", "content": f"Client {i}, request {j}: a short answer."}]))
            except openai.OpenAIError as e:
                failed.append(e)

    def busy():
        """A replica serving requests, with blocks in the index (the prompts share the template's first blocks,
        so the router sends them where those are cached)."""
        return next((r for r in cluster.replicas if cluster.router.state(r).in_flight > 0
                     and router.index.blocks(r.replica_id) > 0), None)

    retries = {r.url: cluster.counter("prefixcache_router:retries_total", replica=r.url) for r in cluster.replicas}
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    threading.Timer(60, killed.set).start()  # the clients stop even if the kill below never comes
    while True:  # freeze the victim while it holds requests, so they are surely cut by the kill
        until(lambda: busy() is not None, 30)
        victim = busy()
        state = cluster.router.state(victim)
        victim.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)  # answers already under way arrive
        if state.in_flight > 0:
            break
        victim.proc.send_signal(signal.SIGCONT)
    victim.kill()
    killed.set()
    for t in threads:
        t.join(60)
    assert not failed and len(done) >= 18
    assert cluster.counter("prefixcache_router:retries_total", replica=victim.url) > retries[victim.url]
    health = httpx.get(f"{cluster.router.url}/health", headers={"Authorization": "Bearer sk-admin"}).json()
    assert [r["healthy"] for r in health["replicas"] if r["url"] == victim.url] == [False]

    victim.start().wait_ready()
    until(lambda: state.healthy, 10)
    until(lambda: router.index.blocks(victim.replica_id) == 0, 10)
    assert cluster.openai().chat.completions.create(model="default", max_tokens=2, messages=[
        {"role": "user", "content": "Back again?"}]).choices


def test_no_healthy_replica_is_503_in_each_format():
    router = RouterServer(RouterConfig([f"http://127.0.0.1:{free_port()}"], port=free_port(), health_interval=0.2))
    try:
        r = httpx.get(f"{router.url}/health", headers={"Authorization": "Bearer sk-admin"})
        assert (r.status_code, r.json()) == (503, {"status": "degraded"})  # no replica to judge the key by
        messages = [{"role": "user", "content": "anyone there?"}]
        with pytest.raises(openai.InternalServerError) as e:
            openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-a", max_retries=0).chat.completions.create(
                model="default", max_tokens=4, messages=messages)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.response.json()["error"]["type"] == "server_error"
        with pytest.raises(anthropic.InternalServerError) as e:
            anthropic.Anthropic(base_url=router.url, api_key="sk-a", max_retries=0).messages.create(
                model="default", max_tokens=4, messages=messages)
        assert e.value.status_code == 503 and e.value.response.json()["type"] == "error"
    finally:
        router.stop()
