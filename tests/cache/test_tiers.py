"""KV tiers below host memory: L2 (disk) and L3 (a real Redis, started per test). Blocks loaded from a tier give
bit-identical logits to a cold run; isolation holds through every tier; purges reach every tier; a full disk loses
nothing. (Damaged, copied or forged records: test_tier_records.py; tenants' shares: test_tier_shares.py.)"""
import itertools
import os
import subprocess

import pytest
from conftest import GREEDY, generate_with_logits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_fixtures import PROMPT, assert_cold, flood, llm, settle

from prefixcache import LLM
from prefixcache.cache.policy import Breakpoint
from prefixcache.cache.remote import INDEX, PREFIX
from prefixcache.cache.scope import CacheScope
from prefixcache.cache.tiers import owner_id
from prefixcache.engine.sequence import Sequence


def test_a_new_replica_loads_another_replicas_prefix_from_redis(tiny_model, redis_proc, cold, shared_secret):
    a = llm(tiny_model, redis_url=redis_proc.url, replica_id="a")
    a.generate([PROMPT], GREEDY)
    settle(a.engine)
    b = llm(tiny_model, redis_url=redis_proc.url, replica_id="b")
    result = generate_with_logits(b, [PROMPT])
    out = result[0][0]
    assert out.cached_tokens == 288 and out.cached_by_tier == {"L1": 0, "L3": 288}
    assert_cold(result, cold)
    assert b.engine.stats()["tiers"]["counts"]["L3_hits"] == 18


def test_evicted_blocks_spill_to_disk_and_survive_a_restart(tiny_model, tmp_path, cold):
    a = llm(tiny_model, disk_cache=str(tmp_path))
    a.generate([PROMPT], GREEDY)
    flood(a)
    settle(a.engine)
    result = generate_with_logits(a, [PROMPT])
    assert result[0][0].cached_by_tier.get("L2", 0) > 0
    assert_cold(result, cold)
    a.engine.close()
    restarted = llm(tiny_model, disk_cache=str(tmp_path))  # an empty L1 over the same folder
    result = generate_with_logits(restarted, [PROMPT])
    assert result[0][0].cached_by_tier["L2"] == 288
    assert_cold(result, cold)


def test_found_blocks_load_a_piece_a_step_and_give_the_cold_output(tiny_model, tmp_path, cold, monkeypatch):
    """A long prompt's blocks found below L1 are loaded LOAD_BLOCKS a step (4 here: 18 blocks in 5 steps), not all in
    one step that every other request waits for."""
    a = llm(tiny_model, disk_cache=str(tmp_path))
    a.generate([PROMPT], GREEDY)
    flood(a)  # spilled to disk
    a.engine.close()
    monkeypatch.setattr("prefixcache.engine.tiering.LOAD_BLOCKS", 4)
    restarted = llm(tiny_model, disk_cache=str(tmp_path))
    pieces, load = [], restarted.engine.blocks.tiering._load
    restarted.engine.blocks.tiering._load = lambda seq, first, found: pieces.append(len(found)) or load(seq, first,
                                                                                                      found)
    result = generate_with_logits(restarted, [PROMPT])
    assert pieces == [4, 4, 4, 4, 2]
    assert result[0][0].cached_by_tier["L2"] == 288
    assert_cold(result, cold)


@pytest.fixture
def small_disk(tmp_path):
    """A file system of 32 KiB (a tmpfs of its own): the disk tier's writes soon meet the kernel's ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system takes root")
    folder = tmp_path / "small"
    folder.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k,mode=0700", "tmpfs", str(folder)], check=True)
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_loses_nothing(tiny_model, small_disk, cold):
    a = llm(tiny_model, disk_cache=str(small_disk))
    a.generate([PROMPT], GREEDY)
    flood(a)
    settle(a.engine)
    assert a.engine.blocks.tiering.tiers.health()["L2"]["disk_full"] >= 1
    result = generate_with_logits(a, [PROMPT])
    assert result[0][0].cached_by_tier.get("L2", 0) == 0
    assert_cold(result, cold)


def test_a_tenant_purge_reaches_every_tier(tiny_model, redis_proc, tmp_path):
    a = llm(tiny_model, redis_url=redis_proc.url, disk_cache=str(tmp_path))
    for tenant in ("acme", "globex"):
        a.generate([PROMPT], GREEDY, scope=CacheScope(tenant=tenant))
        flood(a, CacheScope(tenant=tenant))
    settle(a.engine)
    r = redis_proc.client()

    def held(tenant):
        owner = owner_id(CacheScope(tenant=tenant).owner)
        folder = tmp_path / owner
        return len(list(r.scan_iter(f"{PREFIX}{owner}:*"))), len(os.listdir(folder)) if folder.exists() else 0

    assert all(n > 0 for n in held("acme") + held("globex"))
    scans = r.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
    a.engine.cache.purge_tenant("acme")
    settle(a.engine)
    # the purge read acme's own list of keys, not the keyspace every tenant and replica shares; globex's list is whole
    assert r.info("commandstats").get("cmdstat_scan", {}).get("calls", 0) == scans
    assert held("acme") == (0, 0)
    assert all(n > 0 for n in held("globex"))
    globex = owner_id(CacheScope(tenant="globex").owner)
    assert {k.decode() for k in r.zrange(f"{INDEX}{globex}", 0, -1)} == \
        {k.decode().rsplit(":", 1)[1] for k in r.scan_iter(f"{PREFIX}{globex}:*")}
    assert not r.exists(f"{INDEX}{owner_id(CacheScope(tenant='acme').owner)}")


UNIQUE = itertools.count(100)
SCOPES = st.builds(CacheScope, tenant=st.sampled_from(["a", "b"]), labels=st.sampled_from([(), ("hr",), ("x", "y")]),
                   salt=st.sampled_from(["", "s1"]))


@pytest.fixture(scope="module")
def tiered(tiny_model, tmp_path_factory):
    from prefixcache.bench.server import RedisProcess

    proc = RedisProcess().start()
    yield llm(tiny_model, redis_url=proc.url, disk_cache=str(tmp_path_factory.mktemp("l2")), kv_cache_bytes=2**22)
    proc.stop()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(written=SCOPES, asked=SCOPES, n=st.integers(40, 120))
def test_no_scope_ever_loads_another_scopes_entry(tiered, written, asked, n):
    """A prefix written under one scope, to L3 (write-through) and to L2 (its eviction from L1), is loaded by a
    request of another scope only if the scopes are equal: tenant, labels and salt all count."""
    prompt = [7, next(UNIQUE)] + list(range(2000 + n, 2000 + 2 * n))  # never written by an earlier example
    tiered.generate([prompt], GREEDY, scope=written)
    settle(tiered.engine)
    tiered.engine.blocks.cache.evict(10**6)  # all of L1 spills to L2
    settle(tiered.engine)
    out = tiered.generate([prompt], GREEDY, scope=asked)[0]
    assert out.cached_by_tier["L1"] == 0
    loaded = out.cached_by_tier.get("L2", 0) + out.cached_by_tier.get("L3", 0)
    assert loaded == ((len(prompt) - 1) // 16 * 16 if written == asked else 0)


def test_ttls_and_pins_carry_over_to_redis(tiny_model, redis_proc):
    """An entry's TTL becomes its Redis expiry (a 5m breakpoint: 300 s; none: --redis-ttl); a pinned entry never
    expires there, and unpinning gives it the default expiry back."""
    a = llm(tiny_model, redis_url=redis_proc.url, redis_ttl=1800)
    other = list(range(3000, 3300))
    a.generate([PROMPT], GREEDY, breakpoints=[Breakpoint(288, "5m")])
    a.generate([other], GREEDY)
    settle(a.engine)
    r = redis_proc.client()
    owner = owner_id(CacheScope().owner)

    def ttls(prompt):
        return [r.ttl(f"{PREFIX}{owner}:{k}") for k in a.engine.cache.prefix_keys(prompt)]

    assert all(290 <= t <= 300 for t in ttls(PROMPT)) and all(1790 <= t <= 1800 for t in ttls(other))
    assert a.pin(other) == 288
    settle(a.engine)
    assert ttls(other) == [-1] * 18  # no expiry
    a.pin(other, pinned=False)
    settle(a.engine)
    assert all(1790 <= t <= 1800 for t in ttls(other))


def test_a_tier_that_fails_oddly_loses_nothing_else(tiny_model, tmp_path, cold):
    """A disk fault other than a full disk (the tenant's folder is a file) fails every spill of that tenant and
    every lookup that reads it: the writer and reader threads go on, and requests are served, equal to cold."""
    a = llm(tiny_model, disk_cache=str(tmp_path))
    a.generate([PROMPT], GREEDY)
    (tmp_path / owner_id(CacheScope().owner)).write_text("not a folder")
    flood(a)
    settle(a.engine)  # returns: the writer survived its failed jobs
    assert a.engine.stats()["tiers"]["counts"]["L2_job_errors"] > 0
    result = generate_with_logits(a, [PROMPT])
    assert result[0][0].cached_by_tier.get("L2", 0) == 0
    assert_cold(result, cold)


def test_a_preempted_requests_tier_counts_stay_those_of_its_first_admission(tiny_model, tmp_path, cold):
    """A request served from L1 is preempted, and memory pressure (any tenant's) spills its blocks to L2 before it
    is admitted again from there: its per-tier counts (`tiers=` in the header) stay those of its first admission,
    so they never tell of pressure; and its output is still the cold one."""
    a = llm(tiny_model, disk_cache=str(tmp_path))
    a.generate([PROMPT], GREEDY)
    e = a.engine
    seq = e.add_request(PROMPT, GREEDY)
    e.step()
    first = seq.cache.by_tier()
    assert first == {"L1": len(PROMPT) - 1} and seq.output_ids
    e.scheduler.preempt(seq)
    e.blocks.cache.evict(10**6)  # all of L1 spills to L2
    settle(e)
    e.blocks.prefetch(seq)  # the lookup its readmission makes, had the pressure come first
    while e.has_unfinished():
        e.step()
    assert sum(seq.cache.tier_tokens.values()) == 0 and seq.output().cached_by_tier == first
    assert seq.output().token_ids == cold[0][0].token_ids
    assert e.stats()["tiers"]["counts"]["L2_hits"] > 0  # it did come back from L2


def test_a_blocks_evicted_local_part_is_kept_on_disk_and_given_back_from_it(tiny_gemma, tmp_path):
    """A Gemma 3 (local layers of a 128-key window): evicting the local parts of a prompt's first 13 blocks writes
    those blocks whole to L2; a hit whose window needs them gets them back from L2 (and after a restart, the
    blocks too), with the cold run's logits."""
    a_prompt, b_prompt = list(range(3000, 3350)), list(range(3000, 3208)) + [5, 6]
    cold = generate_with_logits(LLM(tiny_gemma, enable_prefix_cache=False), [b_prompt])
    a = LLM(tiny_gemma, disk_cache=str(tmp_path), max_batch_tokens=96)
    a.generate([a_prompt], GREEDY)
    assert a.engine.blocks.cache.evict(2 * 13) == 26
    settle(a.engine)
    assert a.engine.blocks.match(_prepared(a.engine, b_prompt)).nodes == []  # its window's local parts are gone
    result = generate_with_logits(a, [b_prompt])
    assert result[0][0].cached_tokens == 208 and result[0][0].cached_by_tier == {"L1": 0, "L2": 208}
    assert_cold(result, cold)
    a.engine.close()
    restarted = LLM(tiny_gemma, disk_cache=str(tmp_path))
    result = generate_with_logits(restarted, [b_prompt])
    assert result[0][0].cached_by_tier == {"L1": 0, "L2": 208}
    assert_cold(result, cold)


def _prepared(engine, prompt):
    seq = Sequence(prompt, GREEDY, engine.scope())
    engine.blocks.prepare(seq)
    return seq
