"""A noisy neighbour on a live server: tenant a floods the server with unique long prompts from several clients while
tenant b sends requests on its hot prefix. b's prefix stays cached through the flood (fair eviction), every b
request is served (fair admission), and b's time to first token under the flood is measured against its
unloaded value (the report's noisy-neighbour ratio).

The server and the flood each run in a process of their own, as they would in use: in one process, the clients'
Python threads would slow the server's through the GIL. The engine runs on one thread, leaving the second core to
the server's HTTP side and to the clients: with both cores, its idle OpenMP thread spins, and every request's
parsing and answering waits for CPU (the figure with 2 engine threads is reported beside)."""
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import LONG
from server_fixtures import metrics, until

from prefixcache.bench.server import ADMIN_KEY, LocalServer, ServerOptions

ROUNDS = 4 if LONG else 2  # quiet and flooded phases alternate, so that the machine's drift hits both alike
N = 15 if LONG else 10  # b's requests per phase
FLOODERS = 4
HOT = 1024  # tokens of b's prefix
CHUNK = 32  # --shared-chunk: a's prefill tokens per step while b is active
p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]  # noqa: E731


def _request(client: httpx.Client, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached tokens) of a one-token completion."""
    t = time.perf_counter()
    r = client.post("/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("shared_chunk,threads", [(0, 1), (CHUNK, 1), (CHUNK, 2)])
def test_a_flooding_tenant_neither_evicts_nor_starves_another(tiny_model, figures, shared_chunk, threads):
    opts = ServerOptions(kv_cache_bytes=8 * 2**20, min_cache_tokens=0,  # 1,023 blocks
                         extra=("--model", tiny_model, "--shared-chunk", str(shared_chunk), "--num-threads",
                                str(threads)))
    with LocalServer(opts, ["a", "b"]) as srv:
        evictions = lambda: metrics(srv.url, ADMIN_KEY).get(("prefixcache:cache_evictions_total",  # noqa: E731
                                                            (("reason", "capacity"),)), 0)
        rng = random.Random(5)
        hot = [rng.randrange(1000, 40000) for _ in range(HOT)]
        b_prompt = lambda: hot + [rng.randrange(1000, 40000) for _ in range(16)]  # noqa: E731
        quiet, loaded, served, during = [], [], 0, 0
        with httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {srv.keys['b']}"}) as c:
            _request(c, b_prompt())  # b caches its prefix
            for _ in range(ROUNDS):
                quiet += [_request(c, b_prompt()) for _ in range(N)]
                flood = subprocess.Popen([sys.executable, str(Path(__file__).with_name("flood.py")), srv.url,
                                          srv.keys["a"], str(FLOODERS), "1500", str(len(loaded))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                try:
                    start = evictions()
                    until(lambda: evictions() > start + 1000, 120)  # the flood has turned the cache over
                    before = evictions()
                    loaded += [_request(c, b_prompt()) for _ in range(N)]
                    during += int(evictions() - before)
                    out, _ = flood.communicate("")
                finally:
                    flood.kill()
                assert flood.returncode == 0  # every flood request was served too
                served += int(out)
    assert all(cached >= HOT for _, cached in quiet + loaded)  # b's prefix survived every write of the flood
    assert during > 0  # the flood went on evicting while b's requests ran
    ratio = p90([t for t, _ in loaded]) / p90([t for t, _ in quiet])
    check = ", ".join(["noisy neighbour"] + [f"shared chunk {shared_chunk}"] * bool(shared_chunk) +
                      [f"{threads} engine threads"] * (threads > 1))
    figures[check] = {"flooders": FLOODERS, "flood_requests": served, "n": len(loaded), "rounds": ROUNDS,
                      "shared_chunk": shared_chunk, "engine_threads": threads, "evicted": during,
                      "quiet_p90_s": p90([t for t, _ in quiet]), "loaded_p90_s": p90([t for t, _ in loaded]),
                      "ratio": ratio}
