"""No timing signal across scopes (CVE-2025-46570's class of leak): on a live server, tenant b's time to first
token on a prefix tenant a has cached is distributed like its time on a fresh prefix (two-sample KS test), while
the same test tells a's own hits from misses, so it has the power to fail. Likewise for compiled grammars."""
import random
import statistics
import time

import httpx
from conftest import LONG
from scipy.stats import ks_2samp
from server_fixtures import tiny_tenants_server

from prefixcache.bench.features import wide_schema

N = 120 if LONG else 40  # requests per sample
PROMPT = 1500  # tokens: the prefill a hit skips
# Both KS checks at this level: b's check fails 1 run in 10,000 by chance (not 1 in 100), while a's own hits and
# misses, whose times do not overlap, give p < 1e-15 at N = 40, so the control still has the power to fail.
ALPHA = 1e-4


def _ttft(client: httpx.Client, key: str, prompt: list[int]) -> float:
    """Seconds for a one-token completion: the prefill (or the hit) plus one step."""
    t = time.perf_counter()
    r = client.post("/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 1,
                                             "temperature": 0}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def test_another_tenants_cached_prefix_is_as_slow_as_a_fresh_one(tmp_path_factory, tiny_model, figures):
    srv = tiny_tenants_server(tmp_path_factory, tiny_model)
    rng = random.Random(0)
    fresh = lambda: [rng.randrange(1000, 40000) for _ in range(PROMPT)]  # noqa: E731
    cached = fresh()
    times = {"b on a's prefix": [], "b fresh": [], "a hit": [], "a fresh": []}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for _ in range(3):  # a caches the prefix; the rest warms the server up
            _ttft(c, "sk-a", cached), _ttft(c, "sk-b", fresh())
        kinds = [k for k in times for _ in range(N)]
        rng.shuffle(kinds)  # interleaved, so drift on this machine hits every sample alike
        for kind in kinds:
            key = "sk-b" if kind.startswith("b") else "sk-a"
            times[kind].append(_ttft(c, key, cached if kind in ("b on a's prefix", "a hit") else fresh()))
            if key == "sk-b":  # b's own copy must not make its next request a hit
                assert c.delete("/v1/cache", headers={"Authorization": "Bearer sk-b"}).status_code == 200
    across = ks_2samp(times["b on a's prefix"], times["b fresh"]).pvalue
    control = ks_2samp(times["a hit"], times["a fresh"]).pvalue
    figures["timing across tenants"] = {"n_per_sample": N, "ks_p_across_tenants": across, "ks_p_own_hit_vs_miss":
                                        control}
    assert control < ALPHA, f"the test cannot see a real hit here (p = {control:.3g})"
    assert across > ALPHA, f"b's timing tells a's cache apart (p = {across:.3g})"


def test_a_grammar_another_tenant_compiled_is_compiled_again(tmp_path_factory, tiny_model):
    """The grammar timing probe: tenant a asking with a schema tenant b used is as slow as with a fresh schema
    (a compiles its own), while b's own repeat is fast, the control that shows the probe can tell."""
    srv = tiny_tenants_server(tmp_path_factory, tiny_model)

    def seconds(c: httpx.Client, key: str, schema: dict) -> float:
        t = time.perf_counter()
        r = c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "default", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
        assert r.status_code == 200, r.text
        return time.perf_counter() - t

    ratios, controls = [], []
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        seconds(c, "sk-a", wide_schema("warm"))
        for trial in range(3):
            used, fresh = wide_schema(f"used{trial}"), wide_schema(f"fresh{trial}")
            first = seconds(c, "sk-b", used)
            controls.append(statistics.median(seconds(c, "sk-b", used) for _ in range(3)) / first)
            ratios.append(seconds(c, "sk-a", used) / seconds(c, "sk-a", fresh))
    assert statistics.median(controls) < 0.3, f"b's own compiled grammar is not faster: {controls}"
    assert statistics.median(ratios) > 0.6, f"a's request is faster on b's schema: {ratios}"


def test_in_flight_deduplication_waits_only_within_the_scope(tiny_model):
    """While a's long prefix is being prefilled, a's second request for it waits (then hits), and b's is admitted
    at once: waiting would tell b that someone is computing that prefix."""
    from prefixcache import LLM, SamplingParams
    from prefixcache.cache.scope import CacheScope

    llm = LLM(model=tiny_model, max_batch_tokens=512, max_num_seqs=8)
    engine, prefix = llm.engine, list(range(2000, 3200))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request(prefix + [1], one, CacheScope(tenant="a"))
    engine.step(), engine.step()  # 1,024 of a's 1,201 tokens: its last chunk leaves room in the next step
    again = engine.add_request(prefix + [2], one, CacheScope(tenant="a"))
    other = engine.add_request(prefix + [3], one, CacheScope(tenant="b"))
    engine.step()
    running = engine.scheduler.running
    assert other in running and again not in running
    while engine.has_unfinished():
        engine.step()
    assert again.output().cached_tokens >= 1024 and other.output().cached_tokens == 0


def test_another_tenants_entries_do_not_change_the_admission_order(tiny_model):
    """Admission prefers the longest cached prefix, counted only in scopes the request may read: with tenant a
    holding c's prompt in a's own scope, b's and c's queued requests are admitted in the order they would be with
    nothing cached (arrival), not c first. The control: c's own copy does put c first."""
    from prefixcache import LLM, SamplingParams
    from prefixcache.cache.scope import CacheScope

    one = SamplingParams(temperature=0.0, max_tokens=1)
    b_prompt, c_prompt = list(range(2000, 2400)), list(range(3000, 3400))

    def first_admitted(cached_by: str | None) -> str:
        llm = LLM(model=tiny_model, max_num_seqs=1)
        if cached_by:
            llm.generate([c_prompt], one, scope=CacheScope(tenant=cached_by))
        b = llm.engine.add_request(b_prompt, one, CacheScope(tenant="b"))
        llm.engine.add_request(c_prompt, one, CacheScope(tenant="c"))
        llm.engine.step()  # room for one: whoever computed tokens in it was admitted first
        return "b" if b.num_computed else "c"

    assert first_admitted(None) == first_admitted("a") == "b"
    assert first_admitted("c") == "c"
