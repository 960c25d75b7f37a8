"""Load, short form: 64 concurrent clients, streaming and not, against a live server. No errors, and every output
equals the same request computed alone and cold (greedy)."""
import asyncio
import json
import random

import httpx
from server_fixtures import tiny_server

from prefixcache import LLM, SamplingParams

CLIENTS, PER_CLIENT = 64, 3


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


def test_64_concurrent_clients_get_the_outputs_of_a_sequential_run(tiny_model):
    srv = tiny_server(tiny_model)
    rng = random.Random(0)
    common = [rng.randrange(1000, 40000) for _ in range(64)]  # some shared prefixes, so hits happen under load
    prompts = [(common[:rng.randrange(65)] if rng.random() < 0.5 else [])
               + [rng.randrange(1000, 40000) for _ in range(rng.randrange(5, 150))] for _ in range(CLIENTS * PER_CLIENT)]

    async def client(i: int, c: httpx.AsyncClient) -> list[str]:
        return [await _request(c, prompts[i * PER_CLIENT + j], stream=(i + j) % 2 == 0) for j in range(PER_CLIENT)]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                     limits=httpx.Limits(max_connections=CLIENTS)) as c:
            per_client = await asyncio.gather(*[client(i, c) for i in range(CLIENTS)])
        return [t for texts in per_client for t in texts]

    texts = asyncio.run(run())
    cold = LLM(model=tiny_model, enable_prefix_cache=False)
    expected = [o.text for o in cold.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
    assert texts == expected
