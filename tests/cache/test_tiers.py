"""KV tiers below host memory: L2 (disk) and L3 (a real Redis, started per test). Blocks loaded from a tier give
bit-identical logits to a cold run; damaged, copied or forged entries are detected, deleted and recomputed;
isolation holds through every tier; purges reach every tier; a full disk loses nothing."""
import itertools
import json
import logging
import os
import shutil
import struct
import subprocess
import threading

import pytest
import torch
from conftest import GREEDY, generate_with_logits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import LLM
from prefixcache.cache.credentials import SECRET_FILE, TIER_SECRET_ENV, tier_secret
from prefixcache.cache.disk import DiskTier
from prefixcache.cache.policy import Breakpoint
from prefixcache.cache.record import BadRecord, Record, decode, encode
from prefixcache.cache.remote import INDEX, PREFIX, RedisTier
from prefixcache.cache.scope import CacheScope
from prefixcache.cache.tiers import OWNER_QUEUE, QUEUE, Tiers, owner_id
from prefixcache.engine.engine import Engine
from prefixcache.engine.sequence import Sequence

PROMPT = list(range(1000, 1300))  # 18 full blocks and a partial one
SMALL_POOL = 2**20  # 128 blocks of the tiny model: a few prompts evict each other
SECRET = "test-tier-secret-0123456789abcdef"
REPEAT = list(range(1000, 1016))
ECHO = REPEAT + list(range(1016, 1032)) + REPEAT + list(range(1032, 1100))  # blocks 0 and 2 hold the same tokens


def llm(model, **kw) -> LLM:
    return LLM(model, kv_cache_bytes=kw.pop("kv_cache_bytes", SMALL_POOL), **kw)


def settle(engine) -> None:
    """Wait until the tiers' queued writes are done (they run off the engine thread)."""
    engine.blocks.tiering.tiers.drain()


def flood(llm: LLM, scope: CacheScope | None = None) -> None:
    """Prompts of 300 tokens enough to push every earlier entry out of a 128-block pool."""
    llm.generate([list(range(5000 + 400 * i, 5300 + 400 * i)) for i in range(8)], GREEDY, scope=scope)


@pytest.fixture
def shared_secret(monkeypatch):
    """The one tier secret of replicas that read each other's blocks, as a deployment gives it."""
    monkeypatch.setenv(TIER_SECRET_ENV, SECRET)


@pytest.fixture(scope="module")
def cold(tiny_model):
    return generate_with_logits(LLM(tiny_model, enable_prefix_cache=False), [PROMPT])


@pytest.fixture(scope="module")
def cold_echo(tiny_model):
    return generate_with_logits(LLM(tiny_model, enable_prefix_cache=False), [ECHO])


def assert_cold(result, cold):
    (outs, logits), (cold_outs, cold_logits) = result, cold
    assert outs[0].token_ids == cold_outs[0].token_ids
    assert torch.equal(logits[0], cold_logits[0])


def test_a_record_is_only_ever_the_block_it_was_written_for():
    """The MAC, keyed by the secret, covers the key, the owner, the tokens and the K/V bytes: a damaged record, one
    asked for under another key, owner or tokens, and one written with another secret are all refused."""
    k, v = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    tokens, shape, secret = tuple(range(16)), (2, 16, 2, 8), SECRET.encode()
    data = encode(Record(tokens, k, v), secret, "k0", "o0")
    r = decode(data, secret, "k0", "o0", tokens, shape, torch.float32)
    assert torch.equal(r.k, k) and torch.equal(r.v, v) and r.tokens == tokens
    flipped = bytearray(data)
    flipped[-5] ^= 1
    for bad in (bytes(flipped), data[:-100], data[:4]):  # a flipped byte, truncated, no header
        with pytest.raises(BadRecord):
            decode(bad, secret, "k0", "o0", tokens, shape, torch.float32)
    for asked in (("k1", "o0", tokens), ("k0", "o1", tokens), ("k0", "o0", tuple(range(1, 17)))):
        with pytest.raises(BadRecord, match="MAC"):
            decode(data, secret, *asked, shape, torch.float32)
    with pytest.raises(BadRecord, match="MAC"):
        decode(encode(Record(tokens, k, v), b"another secret, 32 bytes long...", "k0", "o0"), secret, "k0", "o0",
               tokens, shape, torch.float32)
    with pytest.raises(BadRecord, match="shape"):
        decode(data, secret, "k0", "o0", tokens, (2, 16, 4, 4), torch.float32)


def test_a_record_holds_no_token_ids(tiny_model, redis_proc):
    """What Redis (or a disk) holds of a block: its K/V and a MAC, never its tokens, as text or as integers."""
    a = llm(tiny_model, redis_url=redis_proc.url)
    a.generate([PROMPT], GREEDY)
    settle(a.engine)
    data = redis_proc.client().get(f"{PREFIX}{owner_id(CacheScope().owner)}:{a.engine.cache.prefix_keys(PROMPT)[0]}")
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert set(header["__metadata__"]) == {"version", "mac"}
    tokens = PROMPT[:16]
    assert json.dumps(tokens)[1:-1].encode() not in data and ", ".join(map(str, tokens[:4])).encode() not in data
    for fmt in ("<16q", "<16i", "<16H"):
        assert struct.pack(fmt, *tokens) not in data


def test_the_tier_secret_is_given_or_the_replicas_own(tmp_path, monkeypatch, caplog):
    """A file's first, else the environment's; else a disk's kept one, else this process's own (with Redis: a
    warning)."""
    monkeypatch.delenv(TIER_SECRET_ENV, raising=False)
    (tmp_path / "secret").write_text(SECRET + "\n")
    monkeypatch.setenv(TIER_SECRET_ENV, "from the environment, 32 bytes")
    assert tier_secret(str(tmp_path / "secret"), "", True) == SECRET.encode()  # the file first
    assert tier_secret("", "", True) == b"from the environment, 32 bytes"
    monkeypatch.setenv(TIER_SECRET_ENV, "short")
    with pytest.raises(ValueError, match="openssl rand"):
        tier_secret("", "", False)
    monkeypatch.delenv(TIER_SECRET_ENV)
    disk = tmp_path / "l2"
    disk.mkdir()
    with caplog.at_level(logging.WARNING, "prefixcache.tiers"):
        kept = tier_secret("", str(disk), False)  # a disk alone: kept in its folder, for the next start
        assert not caplog.records
        assert tier_secret("", str(disk), False) == kept and len(kept) == 64
        assert (disk / SECRET_FILE).stat().st_mode & 0o777 == 0o600
        own = tier_secret("", "", True)  # Redis alone: this process's own, and a warning
        assert own != tier_secret("", "", True) and len(own) == 64
    assert "cannot be read by other replicas, nor after a restart" in caplog.text


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


@pytest.mark.parametrize("damage", ["flipped_byte", "wrong_mac", "truncated"])
def test_a_damaged_entry_is_deleted_and_recomputed(tiny_model, redis_proc, cold, shared_secret, damage):
    a = llm(tiny_model, redis_url=redis_proc.url)
    a.generate([PROMPT], GREEDY)
    settle(a.engine)
    r = redis_proc.client()
    key = a.engine.cache.prefix_keys(PROMPT)[5]  # the sixth block: blocks 0-4 still load
    name = f"{PREFIX}{owner_id(CacheScope().owner)}:{key}"
    data = bytearray(r.get(name))
    if damage == "flipped_byte":
        data[-7] ^= 0x10
    elif damage == "wrong_mac":  # still valid JSON and safetensors
        at = data.index(b'"mac":"') + 7
        data[at] = ord("0" if data[at] != ord("0") else "1")
    else:
        data = data[:len(data) // 2]
    r.set(name, bytes(data))
    b = llm(tiny_model, redis_url=redis_proc.url)
    result = generate_with_logits(b, [PROMPT])
    assert result[0][0].cached_by_tier == {"L1": 0, "L3": 80}  # blocks 0-4; the damaged one and the rest computed
    assert_cold(result, cold)
    assert b.engine.stats()["tiers"]["counts"]["L3_bad"] == 1
    assert r.get(name) != bytes(data)  # deleted (then written again, whole, by b's own computation)


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


def test_a_damaged_disk_block_is_deleted_and_recomputed(tiny_model, tmp_path, cold):
    a = llm(tiny_model, disk_cache=str(tmp_path))
    a.generate([PROMPT], GREEDY)
    flood(a)
    settle(a.engine)
    path = tmp_path / owner_id(CacheScope().owner) / f"{a.engine.cache.prefix_keys(PROMPT)[3]}.kv"
    data = bytearray(path.read_bytes())
    data[-11] ^= 0x01
    path.write_bytes(bytes(data))
    result = generate_with_logits(a, [PROMPT])
    assert result[0][0].cached_by_tier.get("L2", 0) == 48  # blocks 0-2; the damaged one and the rest computed
    assert_cold(result, cold)
    assert a.engine.stats()["tiers"]["counts"]["L2_bad"] == 1 and not path.exists()


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


@pytest.mark.parametrize("to", ["another_position", "another_tenant"])
def test_a_record_copied_to_another_block_in_redis_is_refused(tiny_model, redis_proc, cold_echo, shared_secret, to):
    """Block 0's record, copied in Redis to block 2's key (the same tokens at another position, whose KV differs)
    or to the same block of another tenant (another owner and scope), is refused there, deleted and recomputed: the
    output equals a cold run."""
    a = llm(tiny_model, redis_url=redis_proc.url)
    acme = CacheScope(tenant="acme")
    a.generate([ECHO], GREEDY, scope=acme)
    settle(a.engine)
    scope, block = (acme, 2) if to == "another_position" else (CacheScope(tenant="globex"), 0)
    r = redis_proc.client()
    copy = r.get(f"{PREFIX}{owner_id(acme.owner)}:{a.engine.cache.prefix_keys(ECHO, acme)[0]}")
    name = f"{PREFIX}{owner_id(scope.owner)}:{a.engine.cache.prefix_keys(ECHO, scope)[block]}"
    r.set(name, copy)
    b = llm(tiny_model, redis_url=redis_proc.url)
    result = generate_with_logits(b, [ECHO], scope=scope)
    assert result[0][0].cached_tokens == result[0][0].cached_by_tier.get("L3", 0) == 16 * block
    assert_cold(result, cold_echo)
    assert b.engine.stats()["tiers"]["counts"]["L3_bad"] == 1
    assert r.get(name) != copy  # deleted (then written again, for its own key, by b's computation)


def test_a_record_copied_to_another_block_on_disk_is_refused(tiny_model, tmp_path, cold_echo):
    """On disk too: block 0's file copied over block 2's is refused after a restart, while blocks 0 and 1 load (the
    secret kept in the disk cache's folder outlives the restart)."""
    a = llm(tiny_model, disk_cache=str(tmp_path))
    a.generate([ECHO], GREEDY)
    flood(a)
    settle(a.engine)
    a.engine.close()
    folder, keys = tmp_path / owner_id(CacheScope().owner), a.engine.cache.prefix_keys(ECHO)
    shutil.copy(folder / f"{keys[0]}.kv", folder / f"{keys[2]}.kv")
    restarted = llm(tiny_model, disk_cache=str(tmp_path))
    result = generate_with_logits(restarted, [ECHO])
    assert result[0][0].cached_tokens == result[0][0].cached_by_tier.get("L2", 0) == 32
    assert_cold(result, cold_echo)
    assert restarted.engine.stats()["tiers"]["counts"]["L2_bad"] == 1


def test_a_replica_with_another_secret_loads_nothing(tiny_model, redis_proc, cold, monkeypatch):
    """Records in Redis written with one secret are refused by a replica that holds another: a forger without the
    secret can file nothing that a replica serves."""
    monkeypatch.setenv(TIER_SECRET_ENV, SECRET)
    a = llm(tiny_model, redis_url=redis_proc.url)
    a.generate([PROMPT], GREEDY)
    settle(a.engine)
    monkeypatch.setenv(TIER_SECRET_ENV, "another-tier-secret-0123456789ab")
    b = llm(tiny_model, redis_url=redis_proc.url)
    result = generate_with_logits(b, [PROMPT])
    assert result[0][0].cached_tokens == 0
    assert_cold(result, cold)
    assert b.engine.stats()["tiers"]["counts"]["L3_bad"] == 1


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


def held_lookups(engine: Engine, monkeypatch) -> tuple[threading.Event, threading.Event, list[str]]:
    """Hold the tier reader in the first lookup it takes until released; the tenants of the lookups run, in order."""
    tiers, names = engine.blocks.tiering.tiers, {owner_id((t, ())): t for t in "ab"}
    entered, release, order = threading.Event(), threading.Event(), []
    fetch = tiers._fetch

    def held(wanted):
        order.append(names[wanted[0].owner])
        entered.set()
        release.wait()
        return fetch(wanted)

    monkeypatch.setattr(tiers, "_fetch", held)
    return entered, release, order


def queue_lookups(engine: Engine, entered: threading.Event, tenants: str) -> list:
    """A request of tenant a, whose lookup the held reader takes; then one request each of `tenants`, queued."""
    prompts = iter([list(range(2000 + 100 * i, 2064 + 100 * i)) for i in range(len(tenants) + 1)])
    seqs = [engine.add_request(next(prompts), GREEDY, CacheScope(tenant="a"))]
    assert entered.wait(10)
    return seqs + [engine.add_request(next(prompts), GREEDY, CacheScope(tenant=t)) for t in tenants]


def finish(engine: Engine, seqs: list) -> None:
    while engine.has_unfinished():
        engine.step()
    assert all(s.fault is None and len(s.output_ids) == GREEDY.max_tokens for s in seqs)


def test_a_tenants_lookup_is_not_queued_behind_another_tenants_backlog(tiny_model, redis_proc, monkeypatch):
    """Tenant a has eight lookups in L3 queued when b's one arrives: b's runs right after the one under way."""
    e = llm(tiny_model, redis_url=redis_proc.url).engine
    entered, release, order = held_lookups(e, monkeypatch)
    seqs = queue_lookups(e, entered, "a" * 7 + "b")
    release.set()
    finish(e, seqs)
    assert order == ["a", "b"] + ["a"] * 7


def test_tier_lookups_take_turns_by_cache_share(tiny_model, redis_proc, monkeypatch):
    """With 90% of the shares, b's three lookups all run before a's second; without shares they alternate."""
    for shares, expected in (({"b": 0.9}, "abbbaaa"), ({}, "ababab")):
        e = llm(tiny_model, redis_url=redis_proc.url).engine
        e.cache.set_shares(shares)
        entered, release, order = held_lookups(e, monkeypatch)
        seqs = queue_lookups(e, entered, "aaabbb")
        release.set()
        finish(e, seqs)
        assert "".join(order).startswith(expected)


def test_a_lookup_over_the_tenants_bound_is_skipped_and_its_request_recomputes(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr("prefixcache.cache.tiers.LOOKUPS", 2)
    e = llm(tiny_model, disk_cache=str(tmp_path)).engine
    entered, release, order = held_lookups(e, monkeypatch)
    seqs = queue_lookups(e, entered, "aaab")  # a's third queued lookup is one over its bound; b has room
    assert seqs[3].cache.fetch.done() and e.stats()["tiers"]["counts"]["lookup_skipped"] == 1
    release.set()
    finish(e, seqs)
    assert order == ["a", "b", "a", "a"]


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


def test_a_tenants_flood_of_unique_prompts_turns_over_its_own_disk_blocks(tmp_path):
    """L2 of 10 blocks: b keeps 3 there, then a writes 20 unique ones. a, the largest holder, gives up its own least
    recently used blocks: b's stay (one LRU over everyone used to turn them over after a's first 7)."""
    disk = DiskTier(str(tmp_path), 10 * 1000)
    for i in range(3):
        disk.put("b", f"b{i}", b"x" * 1000, None)
    evicted = [k for i in range(20) for k in disk.put("a", f"a{i}", b"x" * 1000, None)]
    assert all(disk.get("b", f"b{i}") == b"x" * 1000 for i in range(3))
    assert evicted == [f"a{i}" for i in range(13)] and disk.index.held == {"a": 7000, "b": 3000}
    for i in range(8):  # b may grow to its equal part, taking from a, the one over its part
        disk.put("b", f"b{3 + i}", b"x" * 1000, None)
    assert disk.index.held == {"a": 5000, "b": 5000}


def test_one_owners_flood_of_writes_drops_its_own_not_anothers(tmp_path):
    """The writer takes owners in turn, each with at most OWNER_QUEUE writes waiting: while it is held up, a's flood
    of QUEUE + 50 spilled blocks drops a's writes past its bound, and b's few still land on disk (one FIFO of QUEUE
    dropped them all)."""
    shape = (2, 16, 2, 8)
    tiers = Tiers(shape, torch.float32, DiskTier(str(tmp_path / "l2"), 2**30), secret=SECRET.encode())
    record = Record(tuple(range(16)), torch.randn(shape), torch.randn(shape))
    with tiers.disk_lock:  # the writer waits on the disk
        for i in range(QUEUE + 50):
            tiers.spill("a", f"a{i}", lambda: record, None)
        for i in range(5):
            tiers.spill("b", f"b{i}", lambda: record, None)
    tiers.drain()
    on_disk = set(tiers.disk.keys())
    assert {f"b{i}" for i in range(5)} <= on_disk
    assert OWNER_QUEUE <= len({k for k in on_disk if k.startswith("a")}) <= OWNER_QUEUE + 1  # and the one under way
    assert tiers.stats()["counts"]["L2_writes_dropped"] == QUEUE + 50 - len(on_disk) + 5
    tiers.close()


def test_an_owner_over_its_redis_cap_turns_over_its_own_blocks(redis_proc):
    """With --redis-owner-blocks 5, a's 20 writes leave a's 5 latest (the soonest to expire go first), and b's 3,
    written before them, all stay: Redis's own LRU, over everyone, never has to choose."""
    tier = RedisTier(redis_proc.url, owner_blocks=5)
    for i in range(3):
        assert tier.put("owner-b", f"b{i}", b"x" * 100, 100.0)
    for i in range(20):
        assert tier.put("owner-a", f"a{i}", b"x" * 100, 100.0 + i)
    r = redis_proc.client()

    def kept(owner: str) -> list[str]:
        return sorted(k.decode().rsplit(":", 1)[1] for k in r.scan_iter(f"{PREFIX}{owner}:*"))

    assert kept("owner-a") == [f"a{i}" for i in range(15, 20)] and kept("owner-b") == ["b0", "b1", "b2"]
    assert r.zcard(f"{INDEX}owner-a") == 5
    assert tier.get_many([("owner-a", "a19"), ("owner-a", "a0"), ("owner-b", "b0")]) == [b"x" * 100, None, b"x" * 100]
