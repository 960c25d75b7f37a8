"""The tiers below L1 shared by tenants (cache/tiers.py, disk.py, remote.py): lookups taken by tenant weight and
bounded per tenant, writes taken by owner in turn, and room on disk and in Redis made from the flooding owner's own
blocks, never from another's below its part."""
import threading

import torch
from conftest import GREEDY
from tier_fixtures import SECRET, llm

from prefixcache.cache.disk import DiskTier
from prefixcache.cache.record import Record
from prefixcache.cache.remote import INDEX, PREFIX, RedisTier
from prefixcache.cache.scope import CacheScope
from prefixcache.cache.tiers import OWNER_QUEUE, QUEUE, Tiers, owner_id
from prefixcache.engine.engine import Engine


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
