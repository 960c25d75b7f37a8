"""Real servers for the server tests: uvicorn in a background thread on a free loopback port, one per config.

Servers are started on first use and shared by every test module of the session (model loads are slow).
"""
import atexit
import json
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.config import Config
from prefixcache.server.app import create_app
from prefixcache.server.config import ServeConfig

KEYS = {"sk-acme": {"tenant": "acme", "labels": ["finance"]}, "sk-globex": {"tenant": "globex"},
        "sk-admin": {"tenant": "ops", "admin": True}, "sk-metered": {"tenant": "metered", "rpm": 3, "tpm": 400}}
SHARED_SYSTEM = ("You are the support assistant of the Example Corporation. Answer briefly, cite the handbook "
                 "section you used, never invent policies, and escalate billing disputes to a human agent.")
MIN_CACHE_TOKENS = 128


@dataclass
class Running:
    url: str
    server: object  # prefixcache.server.app.Server: its tokenizer and engine limits, read-only


_running: dict[str, Running] = {}


def _start(name: str, cfg: ServeConfig) -> Running:
    if name in _running:
        return _running[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, f"server {name} did not start"
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(10)

    atexit.register(stop)
    _running[name] = Running(f"http://127.0.0.1:{port}", app.state.server)
    return _running[name]


def main_server(tmp_path_factory) -> Running:
    """Tenants from API keys, one declared shared prefix, prefix cache on."""
    d = tmp_path_factory.mktemp("server")
    (d / "keys.json").write_text(json.dumps(KEYS))
    (d / "shared.json").write_text(json.dumps([SHARED_SYSTEM]))
    return _start("main", ServeConfig(Config(kv_cache_bytes=2**28, min_cache_tokens=MIN_CACHE_TOKENS),
                                      api_keys=str(d / "keys.json"), shared_prefixes=str(d / "shared.json")))


def tenants_server(tmp_path_factory, name: str, **engine) -> Running:
    """Two tenants (sk-a, sk-b) and an admin, nothing shared: for cross-tenant observation tests. `engine`: more
    Config fields."""
    d = tmp_path_factory.mktemp(name)
    (d / "keys.json").write_text(json.dumps({"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"},
                                             "sk-admin": {"tenant": "ops", "admin": True}}))
    return _start(name, ServeConfig(Config(**{"kv_cache_bytes": 2**28, "min_cache_tokens": MIN_CACHE_TOKENS, **engine}),
                                    api_keys=str(d / "keys.json")))


def spec_server() -> Running:
    """The default model with speculative decoding from prompts and answers, no auth."""
    return _start("spec", ServeConfig(Config(kv_cache_bytes=2**28, speculative="both")))


def tiny_tenants_server(tmp_path_factory, model: str, name: str = "tiny-tenants", kv_cache_bytes: int = 2**28,
                        shared_chunk: int = 0) -> Running:
    """The tiny model (fast prefill, so timing tests can run many requests), tenants a and b and an admin."""
    d = tmp_path_factory.mktemp(name)
    (d / "keys.json").write_text(json.dumps({"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"},
                                             "sk-admin": {"tenant": "ops", "admin": True}}))
    return _start(name, ServeConfig(Config(model=model, kv_cache_bytes=kv_cache_bytes, min_cache_tokens=0,
                                           shared_chunk=shared_chunk), api_keys=str(d / "keys.json")))


def tiny_server(model: str) -> Running:
    """A random-weight model (fast), no auth, everything cacheable, a budget of a few hundred KV blocks."""
    return _start("tiny", ServeConfig(Config(model=model, kv_cache_bytes=2 * 2**20, min_cache_tokens=0)))


def fuzz_server(model: str) -> Running:
    """A random-weight model with a short context (so fuzzed max_tokens stay cheap), no auth."""
    return _start("fuzz", ServeConfig(Config(model=model, kv_cache_bytes=8 * 2**20, max_model_len=256)))


def nocache_server() -> Running:
    """Prefix cache off, no auth, one running request and one waiting: easy to fill up."""
    return _start("nocache", ServeConfig(Config(enable_prefix_cache=False, kv_cache_bytes=100 * 2**20, max_num_seqs=1),
                                         max_queue=1))


class Pause:
    """Holds the server's engine thread between two steps (a closure in its inbox), so a test decides when
    requests progress instead of racing them. Reading engine state from the test thread is safe while held."""

    def __init__(self, running: Running):
        self.entered, self.go = threading.Event(), threading.Event()
        running.server.worker.inbox.put(lambda: (self.entered.set(), self.go.wait()))

    def held(self) -> "Pause":
        """Wait until the engine thread has reached this pause."""
        assert self.entered.wait(60), "the engine thread did not reach the pause"
        return self

    def release(self) -> None:
        self.go.set()


def prompt_tokens_computed(running: Running) -> int:
    """The engine's count of prompt tokens it computed (not served from a cache), read between its steps."""
    pause = Pause(running).held()
    try:
        return running.server.engine.stats()["prompt_tokens_computed"]
    finally:
        pause.release()


def until(condition, timeout: float = 30) -> None:
    """Poll a condition that the server is bound to reach; fail if it does not within the timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def long_system(tag: str, n: int = 10) -> str:
    """A system prompt of ~21 tokens per rule that starts with `tag`, so no earlier test shares its first block."""
    return f"[{tag}] " + " ".join(f"Rule {i}: when asked about {tag}, answer in plain words and stay on topic."
                                  for i in range(n))


def metrics(url: str, key: str = "sk-admin") -> dict[tuple, float]:
    """Samples of /metrics (read with an admin key: tenants may not) keyed by (name, sorted label items but
    model_name and engine)."""
    import httpx

    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    text = r.text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


def prefix_header(headers) -> dict[str, str]:
    """x-prefix-cache: cached=<n>; prompt=<n>; scope=<kind> as a dict."""
    return dict(part.strip().split("=") for part in headers["x-prefix-cache"].split(";"))
