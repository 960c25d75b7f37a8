"""Servers under test: start one as a subprocess on a free loopback port, read its RSS, poll its /metrics; and
the Redis that replicas share (also the tests' own).

`LocalServer` runs `prefixcache serve` (or the HF transformers peer) so the benchmark owns the process: its
memory is read from /proc/<pid>/status (VmHWM: peak resident set, VmRSS: current). A model load takes ~10 s,
so `Servers` keeps the last two started servers running for reuse, and each run first empties the cache.
"""
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.options import default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A redis-server subprocess on a free port that keeps nothing on disk, with a password if given. stop() and
    start() again on the same port: a test kills Redis mid-run and brings it back."""

    def __init__(self, password: str | None = None, maxmemory: int = 0):
        binary = shutil.which("redis-server")
        assert binary, "redis-server not found: `apt-get install redis-server` (the README's setup section)"
        self.binary, self.port, self.proc, self.password = binary, free_port(), None, password
        self.maxmemory = maxmemory  # bytes; 0: no limit
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory", str(self.maxmemory),
                                      "--maxmemory-policy", "volatile-lru", *auth],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, password=self.password)


@dataclass(frozen=True)
class ServerOptions:
    prefix_cache: bool = True
    kv_cache_bytes: int = default("kv_cache_bytes")
    min_cache_tokens: int = default("min_cache_tokens")
    max_num_seqs: int = default("max_num_seqs")
    speculative: str = default("speculative")
    kind: str = "prefixcache"  # or "hf": the HF transformers generate() peer; "router": `prefixcache route`;
    # "command": any OpenAI-compatible server with a /health (llama.cpp's llama-server), `extra` its whole command
    extra: tuple[str, ...] = ()  # further command-line flags


ADMIN_KEY = "sk-bench-admin"


class LocalServer:
    def __init__(self, opts: ServerOptions, tenants: list[str], log_path: str | None = None):
        self.opts = opts
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = {t: f"sk-bench-{t}" for t in ["default", *tenants]}  # tenant -> API key
        self.log_path = log_path or os.devnull
        self.proc: subprocess.Popen | None = None
        self._keyfile: str | None = None

    def command(self) -> list[str]:
        o = self.opts
        if o.kind == "hf":
            return [sys.executable, "-m", "prefixcache.bench.hf_server", "--port", str(self.port)]
        if o.kind == "command":
            return [*o.extra, "--host", "127.0.0.1", "--port", str(self.port)]
        if o.kind == "router":
            return [sys.executable, "-m", "prefixcache.cli", "route", "--port", str(self.port), *o.extra]
        cmd = [sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(self.port),
               "--kv-cache-bytes", str(o.kv_cache_bytes), "--min-cache-tokens", str(o.min_cache_tokens),
               "--max-num-seqs", str(o.max_num_seqs), "--speculative", o.speculative, *o.extra]
        if not o.prefix_cache:
            cmd.append("--no-enable-prefix-cache")
        fd, self._keyfile = tempfile.mkstemp(suffix=".json", prefix="bench-keys-")
        with os.fdopen(fd, "w") as f:
            json.dump({ADMIN_KEY: {"tenant": "bench-admin", "admin": True},
                       **{k: {"tenant": t} for t, k in self.keys.items()}}, f)
        return cmd + ["--api-keys", self._keyfile]

    def empty_cache(self) -> None:
        if self.opts.kind == "prefixcache":
            httpx.delete(f"{self.url}/v1/cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=60).raise_for_status()

    def __enter__(self) -> "LocalServer":
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"server did not become healthy in 300 s; log: {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._keyfile:
            os.unlink(self._keyfile)
            self._keyfile = None

    def rss_mb(self) -> dict:
        """Peak (VmHWM) and current (VmRSS) resident memory of the server process, in MB."""
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    out[key] = int(value.split()[0]) / 1024
        return {"peak_rss_mb": out.get("VmHWM"), "rss_mb": out.get("VmRSS")}


class Servers:
    """Local servers by options, started on first use; the oldest is stopped when a third one is needed."""

    def __init__(self, tenants: list[str], log_path: str | None = None, keep: int = 2):
        self.tenants, self.log_path, self.keep = tenants, log_path, keep
        self.running: dict[ServerOptions, LocalServer] = {}

    def get(self, opts: ServerOptions) -> LocalServer:
        if opts not in self.running:
            while len(self.running) >= self.keep:
                self.running.pop(next(iter(self.running))).__exit__()
            self.running[opts] = LocalServer(opts, self.tenants, self.log_path).__enter__()
        return self.running[opts]

    def close(self) -> None:
        for srv in self.running.values():
            srv.__exit__()
        self.running.clear()


def scrape(text: str) -> dict | None:
    """The figures the report uses, from a Prometheus text exposition under vLLM's names (ours and vLLM's), plus our
    evictions (None where a server has no such series; None for all: a server with none of them)."""
    s: dict[str, float | None] = {"hits": None, "queries": None, "evictions": None, "usage": None}
    names = {"vllm:prefix_cache_hits": "hits", "vllm:prefix_cache_queries": "queries",
             "prefixcache:cache_evictions": "evictions", "vllm:kv_cache_usage_perc": "usage"}
    for fam in text_string_to_metric_families(text):
        key = names.get(fam.name)
        if key:
            s[key] = (s[key] or 0.0) + sum(sample.value for sample in fam.samples
                                           if not sample.name.endswith("_created"))
    return s if any(v is not None for v in s.values()) else None


class MetricsPoller:
    """Polls /metrics during a run: peak KV usage, and evictions / cache hits as differences from the start."""

    def __init__(self, url: str, headers: dict[str, str], interval: float = 0.5):
        self.url, self.headers, self.interval = url, headers, interval
        self.first: dict | None = None
        self.last: dict | None = None
        self.peak_usage = 0.0
        self._task: asyncio.Task | None = None

    async def _poll(self, client: httpx.AsyncClient) -> None:
        try:
            r = await client.get(f"{self.url}/metrics", headers=self.headers, timeout=5)
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        s = scrape(r.text)
        if s is None:
            return
        self.first = self.first or s
        self.last = s
        self.peak_usage = max(self.peak_usage, s["usage"] or 0.0)

    async def __aenter__(self) -> "MetricsPoller":
        self._client = httpx.AsyncClient()
        await self._poll(self._client)

        async def loop():
            while True:
                await asyncio.sleep(self.interval)
                await self._poll(self._client)

        self._task = asyncio.create_task(loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await self._poll(self._client)
        await self._client.aclose()

    def summary(self) -> dict | None:
        if not self.first:
            return None  # no /metrics we can read

        def moved(key: str) -> float | None:
            return None if self.last[key] is None else self.last[key] - (self.first[key] or 0.0)

        return {"peak_kv_usage_perc": 100 * self.peak_usage, "evictions": moved("evictions"),
                "server_hit_tokens": moved("hits"), "server_query_tokens": moved("queries")}
