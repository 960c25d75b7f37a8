"""What a request can make the router hold is bounded (DESIGN.md invariant 8): a replica makes no keys for a prompt
longer than its context, the router holds at most the context's blocks of one request, and its expectations of
routed requests stay under `max_pending_keys` over all requests, the lapsed and the oldest going first at O(1) per
key. Real parts: Redis, a `prefixcache serve` replica on the tiny model (context 1024), the router under uvicorn."""
import asyncio
import json
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from server_fixtures import until
from test_router import KEYS, ReplicaProcess, RouterServer

from prefixcache.bench.server import RedisProcess, free_port
from prefixcache.router.config import RouterConfig
from prefixcache.router.index import PrefixIndex
from prefixcache.router.replicas import HealthChecker, Replica

CONTEXT = 1024  # the replica's --max-model-len


@pytest.fixture(scope="module")
def replica(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("router-bounds")
    (d / "keys.json").write_text(json.dumps(KEYS))
    redis = RedisProcess().start()
    rep = ReplicaProcess(tiny_model, str(d / "keys.json"), redis.url, "replica-bounds", str(d / "replica.log"))
    try:
        rep.start().wait_ready()
        yield rep, redis
    finally:
        rep.kill()
        redis.stop()


def keys_of(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/cache/keys", json={"path": path, "body": body},
                      headers={"Authorization": "Bearer sk-a"}, timeout=30)


def test_cache_keys_of_a_prompt_over_the_context_is_a_400(replica):
    rep, _ = replica
    for path, body in (("/v1/completions", {"model": "default", "prompt": list(range(1000, 1000 + 4 * CONTEXT))}),
                       ("/v1/chat/completions", {"model": "default", "messages": [
                           {"role": "user", "content": "the ledger, line by line. " * CONTEXT}]})):
        r = keys_of(rep.url, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
        assert f"the context window is {CONTEXT}" in error["message"]
    r = keys_of(rep.url, "/v1/completions", {"model": "default", "prompt": list(range(1000, 1000 + CONTEXT - 1))})
    assert r.status_code == 200 and len(r.json()["keys"]) == (CONTEXT - 1) // 16


def test_the_router_holds_a_requests_keys_up_to_its_context_in_blocks(replica):
    rep, redis = replica
    router = RouterServer(RouterConfig([rep.url], port=free_port(), redis_url=redis.url, health_interval=0.2,
                                       admin_key="sk-admin", max_model_len=64))
    try:
        until(lambda: router.state(rep).replica_id == rep.replica_id)
        body = {"model": "default", "prompt": list(range(2000, 2300)), "max_tokens": 1, "temperature": 0}
        assert httpx.post(f"{router.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-a"},
                          timeout=60).status_code == 200
        keys = keys_of(rep.url, "/v1/completions", body).json()["keys"]
        assert len(keys) == 300 // 16
        assert list(router.router.index.pending) == [(rep.replica_id, k) for k in keys[:64 // 16]]
    finally:
        router.stop()


def test_expectations_are_bounded_over_all_requests_and_the_oldest_go_first():
    index = PrefixIndex("redis://unused", max_pending=10)
    index.expect("r0", [f"a{i}" for i in range(6)])
    index.expect("r1", [f"b{i}" for i in range(6)])
    assert len(index.pending) == 10
    assert index.match("r0", ["a0"]) == 0 and index.match("r0", [f"a{i}" for i in range(2, 6)]) == 4
    index.expect("r0", ["a2"])  # expected again: it is the newest now
    index.expect("r1", ["b9"])
    assert index.match("r0", ["a2"]) == 1 and index.match("r0", ["a3"]) == 0


def test_lapsed_expectations_are_forgotten_as_new_ones_come():
    index = PrefixIndex("redis://unused", expect_seconds=0.05)
    index.expect("r0", [f"k{i}" for i in range(500)])
    time.sleep(0.1)
    index.expect("r1", ["k0"])
    assert list(index.pending) == [("r1", "k0")]


class CountingDict(OrderedDict):
    """An OrderedDict that counts the entries its iterators yield: the work a walk over it does."""

    walked = 0

    def _count(self, it):
        for x in it:
            self.walked += 1
            yield x

    def __iter__(self):
        return self._count(super().__iter__())

    def keys(self):
        return self._count(super().keys())

    def values(self):
        return self._count(super().values())

    def items(self):
        return self._count(super().items())


def test_expecting_a_request_costs_its_own_keys_not_everything_held():
    """50,000 keys held (none lapsed): each next request's expectation must not walk them all (the old cleanup
    rebuilt every replica's map per request past 10,000 keys). Counted in entries walked, not timed."""
    index = PrefixIndex("redis://unused")
    index.expect("r0", [f"{i:032x}" for i in range(50_000)])
    index.pending = held = CountingDict(index.pending)
    for i in range(2000):
        index.expect("r0", [f"new-{i}"])
    assert index.pending is held and len(held) == 52_000
    assert held.walked <= 2 * 2000, held.walked  # the oldest entry looked at once a request, not all 50,000


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "replica_id": "r-new", "running": 0, "waiting": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_index_forgets_the_id_a_restarted_replica_left_behind():
    """A replica restarted under a new id (hostname-pid by default): once the health checks know every replica's
    id, the old id's keys and expectations go (they were kept for good, and no request could match them)."""
    http = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    index = PrefixIndex("redis://unused")
    for replica in ("r-old", "r-new"):
        index.apply({"replica": replica, "kind": "stored", "tier": "L1", "keys": "k1,k2"})
    index.expect("r-old", ["k3"])
    replica = Replica(f"http://127.0.0.1:{http.server_port}", replica_id="r-old")

    async def check():
        async with httpx.AsyncClient() as client:
            await HealthChecker([replica], client, 1.0, None, index).check_all()

    try:
        asyncio.run(check())
    finally:
        http.shutdown()
    assert replica.replica_id == "r-new" and set(index.tiers) == {"r-new"} and not index.pending
    assert index.match("r-new", ["k1", "k2"]) == 2
