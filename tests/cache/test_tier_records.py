"""A tier's record is only ever served as the block it was written for: its MAC (keyed by the tier secret) covers
the key, the owner, the tokens and the K/V; a damaged, copied or forged one is deleted and recomputed, with the cold
run's logits; a record holds no token ids; replicas with another secret load nothing."""
import json
import logging
import shutil
import struct

import pytest
import torch
from conftest import GREEDY, generate_with_logits
from tier_fixtures import ECHO, PROMPT, SECRET, assert_cold, flood, llm, settle

from prefixcache.cache.credentials import SECRET_FILE, TIER_SECRET_ENV, tier_secret
from prefixcache.cache.record import BadRecord, Record, decode, encode
from prefixcache.cache.remote import PREFIX
from prefixcache.cache.scope import CacheScope
from prefixcache.cache.tiers import owner_id


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
