"""Load, short form: 64 concurrent clients, streaming and not, against a live server. No errors, and every output
equals the same request computed alone and cold (greedy)."""
import asyncio
import json
import random
import statistics
import time

import httpx
from conftest import LONG
from server_fixtures import tiny_server

from prefixcache import LLM, SamplingParams

CLIENTS, PER_CLIENT = 64, 32 if LONG else 3  # long form (make reliability): 2,048 requests


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def _request(c: httpx.AsyncClient, prompt: list[int], stream: bool) -> str:
    body = {"model": "default", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
    if not stream:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_64_concurrent_clients_get_the_outputs_of_a_sequential_run(tiny_model, figures):
    srv = tiny_server(tiny_model)
    rng = random.Random(0)
    common = [rng.randrange(1000, 40000) for _ in range(64)]  # some shared prefixes, so hits happen under load
    prompts = [(common[:rng.randrange(65)] if rng.random() < 0.5 else [])
               + [rng.randrange(1000, 40000) for _ in range(rng.randrange(5, 150))]
               for _ in range(CLIENTS * PER_CLIENT)]

    latencies, rss = [], []

    async def client(i: int, c: httpx.AsyncClient) -> list[str]:
        texts = []
        for j in range(PER_CLIENT):
            t = time.perf_counter()
            texts.append(await _request(c, prompts[i * PER_CLIENT + j], stream=(i + j) % 2 == 0))
            latencies.append(time.perf_counter() - t)
            if i == 0:  # this process's resident memory (the server runs in it) after each of client 0's requests
                rss.append(_rss_mb())
        return texts

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                     limits=httpx.Limits(max_connections=CLIENTS)) as c:
            per_client = await asyncio.gather(*[client(i, c) for i in range(CLIENTS)])
        return [t for texts in per_client for t in texts]

    texts = asyncio.run(run())
    cold = LLM(model=tiny_model, enable_prefix_cache=False)
    expected = [o.text for o in cold.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
    assert texts == expected
    if LONG:  # it levels off: oneDNN keeps a GEMM primitive per row count seen, up to its cache's capacity, while
        # a leak would grow at a steady rate: the last quarter must grow at most half as much as the first
        n = len(rss) - 1
        assert rss[-1] - rss[3 * n // 4] < 0.5 * (rss[n // 4] - rss[0]), rss
    q = statistics.quantiles(latencies, n=100)
    figures["load"] = {"clients": CLIENTS, "requests": len(prompts), "errors": 0, "outputs_equal_cold": True,
                       "latency_p50_s": q[49], "latency_p90_s": q[89], "latency_p99_s": q[98],
                       "rss_mb": [round(r) for r in rss]}
