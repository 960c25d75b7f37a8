"""A noisy neighbour on a live server: tenant a floods the server with unique long prompts from several clients while
tenant b sends requests on its hot prefix. b's prefix stays cached through the flood (fair eviction), every b
request is served (fair admission), and b's time to first token under the flood is measured against its
unloaded value (the report's noisy-neighbour ratio)."""
import random
import threading
import time

import httpx
import pytest
from conftest import LONG
from server_fixtures import tiny_tenants_server, until

N = 60 if LONG else 20  # b's requests per phase
FLOODERS = 4
HOT = 1024  # tokens of b's prefix
CHUNK = 32  # --shared-chunk: a's prefill tokens per step while b is active
p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]  # noqa: E731


def _request(client: httpx.Client, key: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached tokens) of a one-token completion."""
    t = time.perf_counter()
    r = client.post("/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 1,
                                             "temperature": 0}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("shared_chunk", [0, CHUNK])
def test_a_flooding_tenant_neither_evicts_nor_starves_another(tmp_path_factory, tiny_model, figures, shared_chunk):
    srv = tiny_tenants_server(tmp_path_factory, tiny_model, f"noisy-{shared_chunk}", kv_cache_bytes=8 * 2**20,
                              shared_chunk=shared_chunk)  # 1,023 blocks
    rng = random.Random(5)
    hot = [rng.randrange(1000, 40000) for _ in range(HOT)]
    b_prompt = lambda: hot + [rng.randrange(1000, 40000) for _ in range(16)]  # noqa: E731
    stop, flooded = threading.Event(), []

    def flood(seed: int) -> None:
        r = random.Random(seed)
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            while not stop.is_set():
                flooded.append(_request(c, "sk-a", [r.randrange(1000, 40000) for _ in range(1500)]))

    with httpx.Client(base_url=srv.url, timeout=120) as c:
        _request(c, "sk-b", b_prompt())  # b caches its prefix
        quiet = [_request(c, "sk-b", b_prompt()) for _ in range(N)]
        threads = [threading.Thread(target=flood, args=(i,)) for i in range(FLOODERS)]
        for t in threads:
            t.start()
        evictions = srv.server.engine.blocks.cache.evictions
        until(lambda: evictions["capacity"] > 1000, 120)  # the flood has turned the cache over
        before = evictions["capacity"]
        loaded = [_request(c, "sk-b", b_prompt()) for _ in range(N)]
        during = evictions["capacity"] - before
        stop.set()
        for t in threads:
            t.join()
    assert all(cached >= HOT for _, cached in quiet + loaded)  # b's prefix survived every write of the flood
    assert during > 0  # the flood went on evicting while b's requests ran
    ratio = p90([t for t, _ in loaded]) / p90([t for t, _ in quiet])
    check = f"noisy neighbour, shared chunk {shared_chunk}" if shared_chunk else "noisy neighbour"
    figures[check] = {"flooders": FLOODERS, "flood_requests": len(flooded), "n": N, "evicted": during,
                      "quiet_p90_s": p90([t for t, _ in quiet]), "loaded_p90_s": p90([t for t, _ in loaded]),
                      "ratio": ratio}
