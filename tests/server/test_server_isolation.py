"""No channel a tenant can read tells it what another tenant has cached.

Tenant a sends the same requests to two identical servers; on one of them tenant b has first cached every
prompt a will send. In the loaded setup the servers also draft speculatively, spill to a disk tier, and b has
first filled the whole KV pool, so a's drafts and blocks need room that b's entries hold. Everything a can observe
must be byte-identical on both (apart from ids, timestamps and timing): status, every header (x-prefix-cache
included), bodies and usage, every stream event, the cache purge answer, /metrics and /health.
The primed server logs cross-scope misses for its operator, which must stay in its log.
/health tells tenants and probes only its status word; its details need an admin key.
"""
import json
import logging
import re
import time

import httpx
import pytest
from server_fixtures import long_system, tenants_server, tiny_server

VOLATILE = re.compile(r'"(id|created)": ?("[^"]*"|\d+)')
QUESTION = [{"role": "user", "content": "Which rule covers refunds?"}]


def _requests() -> list[tuple[str, dict]]:
    """(path, body) for each API and streaming mode, each with a prompt and a salt (so a scope) of its own."""
    def chat(tag: str, stream: bool) -> dict:
        return {"model": "default", "max_tokens": 4, "temperature": 0, "stream": stream, "cache_salt": tag,
                "stream_options": {"include_usage": True} if stream else None,
                "messages": [{"role": "system", "content": long_system(tag)}, *QUESTION]}

    def messages(tag: str, stream: bool) -> dict:
        return {"model": "default", "max_tokens": 4, "temperature": 0, "stream": stream, "cache_salt": tag,
                "messages": QUESTION,
                "system": [{"type": "text", "text": long_system(tag), "cache_control": {"type": "ephemeral"}}]}

    trip = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "ok": {"type": "boolean"}},
            "required": ["city", "ok"], "additionalProperties": False}  # short: it completes within max_tokens
    items = ", ".join(f"item {j} of the iso list" for j in range(40))
    return [("/v1/chat/completions", {**chat("iso-json", False), "max_tokens": 24, "response_format": {
                "type": "json_schema", "json_schema": {"name": "trip", "schema": trip}}}),
            ("/v1/completions", {"model": "default", "max_tokens": 48, "temperature": 0, "cache_salt": "iso-spec",
                                 "prompt": f"{long_system('iso-spec')}\nA list: {items}.\nThe list again: item 0"}),
            ("/v1/chat/completions", chat("iso-chat", False)),
            ("/v1/chat/completions", chat("iso-chat-stream", True)),
            ("/v1/completions", {"model": "default", "max_tokens": 4, "temperature": 0, "cache_salt": "iso-completion",
                                 "prompt": long_system("iso-completion")}),
            ("/v1/messages", messages("iso-messages", False)),
            ("/v1/messages", messages("iso-messages-stream", True))]


def _send(url: str, key: str, path: str, body: dict) -> tuple:
    """What the caller can observe of one request, with ids and timestamps masked."""
    r = httpx.post(url + path, json=body, timeout=120, headers={"Authorization": f"Bearer {key}"})
    headers = sorted((k, v) for k, v in r.headers.items() if k != "date")
    return r.status_code, headers, VOLATILE.sub(r'"\1": "*"', r.text)


def _observe(url: str, key: str) -> list:
    seen = [_send(url, key, path, body) for path, body in _requests()]
    for method, path in (("GET", "/metrics"), ("GET", "/health"), ("GET", "/v1/models"), ("DELETE", "/v1/cache")):
        r = httpx.request(method, url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        seen.append((method, path, r.status_code, r.text))
    return seen


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[dict] = []

    def emit(self, record):
        line = json.loads(record.getMessage())
        if line.get("tenant") == "a":
            self.lines.append({k: v for k, v in line.items() if k not in ("ttft", "latency")})


def _observe_with_log(url: str, key: str) -> tuple[list, list[dict]]:
    handler = Lines()
    logger = logging.getLogger("prefixcache.request")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        seen = _observe(url, key)
        deadline = time.monotonic() + 30  # a stream's line is written when its generator closes
        while len(handler.lines) < len(_requests()) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        logger.removeHandler(handler)
    return seen, handler.lines


def _server(tmp_path_factory, model: str, name: str, **extra):
    """Tenants a and b on the tiny model (what a channel tells does not depend on the weights; its prefills are
    fast), with a pool of 16k tokens."""
    return tenants_server(tmp_path_factory, name, model=model, kv_cache_bytes=2**23, **extra)


@pytest.fixture(scope="module", params=["plain", "loaded"])
def observations(tmp_path_factory, request, tiny_model):
    if request.param == "plain":
        clean = _server(tmp_path_factory, tiny_model, "iso-clean")
        primed = _server(tmp_path_factory, tiny_model, "iso-primed", log_cross_scope_misses=True)
    else:
        def loaded(name: str, **extra) -> object:
            return _server(tmp_path_factory, tiny_model, name, speculative="both", **extra,
                           disk_cache=str(tmp_path_factory.mktemp(f"{name}-l2")))
        clean, primed = loaded("iso-loaded-clean"), loaded("iso-loaded-primed", log_cross_scope_misses=True)
        pool = primed.server.engine.pool
        for i in range(pool.usable_blocks * pool.block_size // 900 + 1):  # b fills the whole pool
            filler = {"model": "default", "max_tokens": 1, "prompt": f"[filler {i}] " + "word " * 900}
            assert _send(primed.url, "sk-b", "/v1/completions", filler)[0] == 200
        assert pool.num_free < 8
    for path, body in _requests():
        assert _send(primed.url, "sk-b", path, body)[0] == 200
    return (_observe_with_log(clean.url, "sk-a"), _observe_with_log(primed.url, "sk-a"),
            request.param)


def test_tenant_sees_the_same_whether_or_not_another_tenant_cached_its_prompts(observations):
    (clean, _), (primed, _), _ = observations
    for a, b in zip(clean, primed):
        assert a == b
    assert len(clean) == len(primed) == len(_requests()) + 4


def test_the_observations_are_the_cold_ones(observations):
    (clean, _), _, setup = observations
    for status, headers, _ in clean[:len(_requests())]:
        assert status == 200
        assert "miss=cold" in dict(headers)["x-prefix-cache"]
    structured, spec = (json.loads(body) for _, _, body in clean[:2])
    assert json.loads(structured["choices"][0]["message"]["content"]).keys() == {"city", "ok"}
    accepted = spec["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
    assert accepted > 0 if setup == "loaded" else accepted == 0  # drafts ran, so the comparison can fail
    metrics, health, models, purge = clean[len(_requests()):]
    assert metrics[2] == 403 and models[2] == 200 and purge[2] == 200
    assert health[2:] == (200, '{"status":"ok"}')


def test_cross_scope_misses_reach_only_the_operator_log(observations):
    (_, clean_log), (_, primed_log), _ = observations
    assert len(clean_log) == len(primed_log) == len(_requests())
    assert all("cross_scope_miss" not in line for line in clean_log)
    assert [line.pop("cross_scope_miss") for line in primed_log] == [True] * len(_requests())
    assert clean_log == primed_log


DETAILS = {"model", "replica_id", "running", "waiting", "tiers", "kv_bytes_per_token", "exactness"}


def _health(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    r = httpx.get(f"{url}/health", headers=headers)
    return r.status_code, r.json()


def test_health_tells_probes_and_tenants_only_its_status_and_an_admin_its_details(tmp_path_factory, tiny_model):
    srv = _server(tmp_path_factory, tiny_model, "iso-clean")
    for headers in (None, {"Authorization": "Bearer sk-a"}, {"x-api-key": "sk-b"}, {"Authorization": "Bearer sk-nope"}):
        assert _health(srv.url, headers) == (200, {"status": "ok"})
    for headers in ({"Authorization": "Bearer sk-admin"}, {"x-api-key": "sk-admin"}):
        status, body = _health(srv.url, headers)
        assert status == 200 and body.keys() == DETAILS | {"status"} and body["status"] == "ok"
        assert body["replica_id"] == srv.server.engine.replica_id and body["waiting"] == 0
    srv.server.draining = True  # what SIGTERM sets (server/serve.py); test_server_secrets.py drains a real process
    try:
        assert _health(srv.url, {"Authorization": "Bearer sk-a"}) == (503, {"status": "draining"})
        status, body = _health(srv.url, {"Authorization": "Bearer sk-admin"})
        assert status == 503 and body["status"] == "draining" and DETAILS <= body.keys()
    finally:
        srv.server.draining = False


def test_health_without_api_keys_shows_its_one_tenant_the_details(tiny_model):
    status, body = _health(tiny_server(tiny_model).url)
    assert status == 200 and body["status"] == "ok" and DETAILS <= body.keys()
