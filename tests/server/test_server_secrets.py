"""Secrets: API keys and tenants' prompts never reach the logs, and the keys file reloads on SIGHUP."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_fixtures import KEYS, _start, main_server, until

from prefixcache.bench.server import free_port
from prefixcache.config import Config
from prefixcache.server.auth import Keys
from prefixcache.server.config import ServeConfig

SECRET_PROMPT = "The merger code name is BLUE HERON; tell no one."


def test_keys_and_prompts_never_reach_the_logs(tmp_path_factory, caplog):
    srv = main_server(tmp_path_factory)
    with caplog.at_level(logging.DEBUG):
        for key in ("sk-acme", "sk-not-a-key"):
            httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": "default", "max_tokens": 2,
                             "messages": [{"role": "user", "content": SECRET_PROMPT}]})
        httpx.get(f"{srv.url}/metrics", headers={"x-api-key": "sk-globex"})
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert '"status": 200' in text and '"status": 401' in text and '"status": 403' in text  # the lines exist
    for secret in (*KEYS, "sk-not-a-key", "BLUE HERON"):
        assert secret not in text


def test_lookup(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": {"tenant": "a", "labels": ["y", "x"]}, "sk-b": {"tenant": "b", "admin": True}}))
    keys = Keys(str(path))
    assert keys.lookup("sk-a").labels == ("x", "y") and keys.lookup("sk-b").admin
    assert keys.lookup("sk-c") is None and keys.lookup("") is None and keys.lookup("sk-a ") is None


@pytest.mark.parametrize("tenant", ["local", "*shared*"])
def test_reserved_tenant_names_are_refused(tmp_path, tenant):
    """'local' is the keyless server's tenant and '*shared*' the shared scope: a keys-file tenant by either name
    would read, or publish as public, entries that are not its own."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": {"tenant": "a"}, "sk-b": {"tenant": tenant}}))
    with pytest.raises(ValueError, match="reserved"):
        Keys(str(path))


def _serve(keys, *args: str) -> tuple[str, subprocess.Popen]:
    """`prefixcache serve` as its own process (signals go to its main thread), once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(port),
                             "--api-keys", str(keys), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, "server exited"
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    until(up, timeout=120)
    return url, proc


def test_the_metrics_port_serves_metrics_alone_without_a_key(tiny_model, tmp_path):
    """--metrics-port: scrapers that send no key (the Inference Extension's endpoint picker) read /metrics there;
    the API port still wants an admin key, and the metrics port serves nothing else."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk": {"tenant": "a"}}))
    metrics_port = free_port()
    url, proc = _serve(keys, "--model", tiny_model, "--metrics-port", str(metrics_port))
    try:
        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert scrape.status_code == 200 and "vllm:num_requests_waiting" in scrape.text
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk"}).status_code == 403
        for r in (httpx.get(f"http://127.0.0.1:{metrics_port}/v1/models", headers={"Authorization": "Bearer sk"}),
                  httpx.post(f"http://127.0.0.1:{metrics_port}/v1/completions",
                             json={"model": "default", "prompt": "a"},
                             headers={"Authorization": "Bearer sk"}),
                  httpx.get(f"http://127.0.0.1:{metrics_port}/health")):
            assert r.status_code == 404 and r.json()["error"]["message"] == "the metrics port serves GET /metrics only"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0  # both listeners close together


def test_a_port_in_use_fails_startup_with_its_address(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(free_port()),
                               "--metrics-port", str(port)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


@pytest.fixture
def served(tiny_model, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-old": {"tenant": "a"}}))
    url, proc = _serve(keys, "--model", tiny_model)
    yield url, keys, proc
    proc.terminate()
    assert proc.wait(30) == 0  # SIGTERM: a clean exit


@pytest.mark.parametrize("grace, finished, tokens", [("30", True, 150), ("0.5", False, 4000)])
def test_sigterm_drains_running_requests_within_the_grace_period(tmp_path, grace, finished, tokens):
    """SIGTERM mid-stream: /health turns 503 "draining" and a new request gets a 503 with Retry-After in its API's
    format (a router retries it elsewhere), while the running stream ends normally within --grace-seconds, or is cut
    when that is shorter; either way the server exits 0. (The default model: 150 tokens take a second or more, and
    4,000 take far longer than half a second even on the compiled kernels.)"""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk": {"tenant": "a"}}))
    url, proc = _serve(keys, "--grace-seconds", grace)
    body = {"model": "default", "prompt": "Once upon a time, in a city by the sea,", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    events, refused = [], []
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": "Bearer sk"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            try:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 1:
                            proc.terminate()
                        if len(events) == 1 and finished:  # a drain long enough to probe
                            until(lambda: httpx.get(f"{url}/health").status_code == 503)
                            assert httpx.get(f"{url}/health").json()["status"] == "draining"
                            refused += [httpx.post(f"{url}/v1/completions", json={**body, "stream": False},
                                                   headers={"Authorization": "Bearer sk"}),
                                        httpx.post(f"{url}/v1/messages", headers={"x-api-key": "sk"}, json={
                                            "model": "default", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "Hi"}]})]
            except httpx.HTTPError:
                pass  # cut at the end of the grace period
    assert proc.wait(30) == 0
    assert (events[-1]["choices"][0]["finish_reason"] is not None) == finished, (len(events), events[-1])
    assert bool(refused) == finished
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    if refused:
        assert refused[0].json()["error"]["type"] == "server_error"
        assert refused[1].json()["error"]["type"] == "api_error"
    assert _refused(url)  # the process is gone


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


def test_sighup_reloads_the_keys_file(served):
    url, keys, proc = served

    def status(key: str) -> int:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

    assert (status("sk-old"), status("sk-new")) == (200, 401)
    keys.write_text(json.dumps({"sk-new": {"tenant": "a"}}))
    os.kill(proc.pid, signal.SIGHUP)
    until(lambda: status("sk-new") == 200)
    assert status("sk-old") == 401
    keys.write_text("{broken")  # a bad file keeps the keys in force
    os.kill(proc.pid, signal.SIGHUP)
    until(lambda: proc.poll() is None and status("sk-new") == 200)


def test_cache_shares_come_from_the_keys_file_and_reload_with_it(tiny_model, tmp_path):
    """cache_share in a tenant's key entry reaches the engine at start and again on SIGHUP (reload_keys); shares
    adding up to more than the whole cache are refused, and a refused file keeps the shares in force."""

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-a": {"tenant": "a", "cache_share": 0.5}, "sk-b": {"tenant": "b"}}))
    running = _start("shares", ServeConfig(Config(model=tiny_model, kv_cache_bytes=2**22), api_keys=str(keys)))
    cache = running.server.engine.blocks.cache
    until(lambda: cache.shares == {"a": 0.5})
    keys.write_text(json.dumps({"sk-a": {"tenant": "a", "cache_share": 0.25}, "sk-b": {"tenant": "b",
                                                                                       "cache_share": 0.5}}))
    running.server.reload_keys()
    until(lambda: cache.shares == {"a": 0.25, "b": 0.5})
    keys.write_text(json.dumps({"sk-a": {"tenant": "a", "cache_share": 0.75}, "sk-b": {"tenant": "b",
                                                                                       "cache_share": 0.5}}))
    with pytest.raises(ValueError, match="cache_share"):
        Keys(str(keys))
    running.server.reload_keys()
    time.sleep(0.2)
    assert cache.shares == {"a": 0.25, "b": 0.5}


def test_a_request_larger_than_the_whole_cache_is_refused_and_others_run(tiny_model):
    """A prompt that fits but, with its max_tokens, outgrows the whole KV pool would be preempted and restarted
    forever, spinning the engine for every tenant; it gets a 400 naming the sizes, and the next request runs."""
    block = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model's KV block: 2 layers, 2 KV heads of 16, 16 tokens, fp32
    srv = _start("small-pool", ServeConfig(Config(model=tiny_model, kv_cache_bytes=12 * block)))
    body = {"model": "default", "prompt": list(range(1000, 1150)), "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 100}, timeout=30)
    assert r.status_code == 400 and "need 16 KV blocks; the cache holds 11" in r.json()["error"]["message"]
    ok = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 20}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 20
