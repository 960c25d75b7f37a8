"""A noisy neighbour on a live server (prefixcache.bench.noisy, on the tiny model): tenant a floods the server with
unique long prompts from several clients while tenant b sends requests on its hot prefix. b's prefix stays cached
through the flood (fair eviction), every request of both is served (fair admission), and b's time to first token
under the flood is measured against its unloaded value (the report's noisy-neighbour ratio).

With --shared-chunk, the engine runs on one thread, leaving the second core to the server's HTTP side and to the
clients: with both cores, its idle OpenMP thread spins, and every request's parsing and answering waits for CPU
(the figure with 2 engine threads is reported beside)."""
import pytest
from conftest import LONG

from prefixcache.bench.noisy import Setup, measure, p90

CHUNK = 32


@pytest.mark.parametrize("shared_chunk,threads", [(0, 1), (CHUNK, 1), pytest.param(CHUNK, 2, marks=pytest.mark.skipif(
    not LONG, reason="a figure for the long form's report, beside the one thread's"))])
def test_a_flooding_tenant_neither_evicts_nor_starves_another(tiny_model, figures, shared_chunk, threads):
    r = measure(Setup(tiny_model, shared_chunk, threads, kv_cache_bytes=8 * 2**20,  # 1,023 blocks
                      rounds=4 if LONG else 1, n=15 if LONG else 10))
    assert all(cached >= r.setup.hot for cached in r.cached)  # b's prefix survived every write of the flood
    assert r.evicted > 0 and r.flood_requests > 0  # the flood went on while b's requests ran
    check = ", ".join(["noisy neighbour"] + [f"shared chunk {shared_chunk}"] * bool(shared_chunk) +
                      [f"{threads} engine threads"] * (threads > 1))
    figures[check] = {"flooders": r.setup.flooders, "flood_requests": r.flood_requests, "n": len(r.loaded),
                      "rounds": r.setup.rounds, "shared_chunk": shared_chunk, "engine_threads": threads,
                      "evicted": r.evicted, "quiet_p90_s": p90(r.quiet), "loaded_p90_s": p90(r.loaded),
                      "ratio": r.ratio}
