"""KV events in vLLM's format over ZMQ (cache/zmq_events.py), read as a consumer built for vLLM reads them: a SUB
socket for the live stream and a DEALER for replay, decoding with a msgspec model of vLLM 0.32's schema written here,
apart from the publisher's structs. The sockets are ipc:// paths in the test's own folder."""
import json
import time

import msgspec
import pytest
import zmq
from lora_adapters import write_adapter

from prefixcache import LLM, SamplingParams
from prefixcache.cache.scope import CacheScope

ONE = SamplingParams(temperature=0.0, max_tokens=1)
PROMPT = list(range(3000, 3040))  # two full blocks of 16 and a partial one


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def config(tmp_path, **more) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/pub",
                       "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kv", **more})


def replay(tmp_path, start: int, decoder=DECODE) -> list[tuple[int, KVEventBatch]]:
    """Every batch the publisher still holds from sequence number `start` on, as vLLM's replay protocol gives them."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"ipc://{tmp_path}/replay")
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert sock.poll(5000), "no replay answer"
            _, topic, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            assert topic == b"kv"
            out.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    finally:
        sock.close(linger=0)


def events(batches) -> list:
    return [e for _, b in batches for e in b.events]


def until_sent(llm, n: int) -> None:
    deadline = time.monotonic() + 5
    while llm.engine.events.sent < n:
        assert time.monotonic() < deadline, "the publisher sent nothing"
        time.sleep(0.01)


def replayed(tmp_path, start: int, kind: type, n: int) -> list:
    """The events of `kind` replayed from `start`, once there are n of them (events flush every 10 ms)."""
    deadline = time.monotonic() + 5
    while len(found := [e for e in events(replay(tmp_path, start)) if isinstance(e, kind)]) < n:
        assert time.monotonic() < deadline, f"{len(found)} {kind.__name__} events, not {n}"
        time.sleep(0.01)
    return found


def test_the_cache_in_vllms_kv_events_live_and_replayed(tiny_model, tmp_path):
    llm = LLM(model=tiny_model, kv_events_config=config(tmp_path, include_token_ids=True))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    connected = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
    sub.connect(f"ipc://{tmp_path}/pub")
    try:
        assert connected.poll(5000)  # a subscriber hears only what is sent after it joined; replay has the rest
        until_sent(llm, 1)
        [(seq0, first)] = replay(tmp_path, 0)
        assert seq0 == 0 and first.events == [AllBlocksCleared()]  # it starts empty

        llm.generate([PROMPT], ONE)
        stored = replayed(tmp_path, 1, BlockStored, 2)
        nodes = {n.key: n for n in llm.engine.blocks.cache.nodes.values() if len(n.tokens) == 16}
        assert [e.token_ids for e in stored] == [PROMPT[:16], PROMPT[16:32]]
        assert [e.block_hashes[0] for e in stored] == [k for k, n in nodes.items() if n.tokens[0] in (3000, 3016)]
        assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == stored[0].block_hashes[0]
        scope = nodes[stored[0].block_hashes[0]].scope.hex()
        assert all(e.block_size == 16 and e.medium == "GPU" and e.extra_keys == [(scope,)] for e in stored)
        assert all(e.lora_name is None for e in stored)  # the keyless server's one tenant: any request may read them

        assert sub.poll(5000)  # the live stream carries the same batches
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and DECODE.decode(payload).events

        # another tenant's same tokens: other block hashes, another scope in extra_keys, and an opaque lora_name
        # (routers seed their token hashes with it), so a router never takes their blocks for anyone else's
        sent = llm.engine.events.sent
        globex = CacheScope(tenant="globex")
        llm.generate([PROMPT], ONE, scope=globex)
        theirs = replayed(tmp_path, sent, BlockStored, 2)
        assert [e.token_ids for e in theirs] == [[], []]  # a private block's tokens never ride the bus
        assert not {e.block_hashes[0] for e in theirs} & set(nodes) and theirs[0].extra_keys != stored[0].extra_keys
        tag = theirs[0].extra_keys[0][0]
        assert tag != scope and all(e.lora_name == f"scope:{tag}" for e in theirs)
        sent = llm.engine.events.sent  # the declared shared scope is public again
        llm.generate([PROMPT[::-1]], ONE, scope=globex.shared)
        shared = replayed(tmp_path, sent, BlockStored, 2)
        assert all(e.lora_name is None for e in shared) and shared[0].token_ids == PROMPT[::-1][:16]

        sent = llm.engine.events.sent
        freed = llm.engine.cache.clear()
        removed = [e.block_hashes[0] for e in replayed(tmp_path, sent, BlockRemoved, 6)]  # three prompts' two blocks
        assert len(removed) == 6 <= freed and set(nodes) <= set(removed)
    finally:
        llm.engine.close()
        sub.disable_monitor()
        connected.close(linger=0)
        sub.close(linger=0)


def test_an_adapters_public_blocks_carry_its_id_and_name_as_vllms_do(tiny_model, tmp_path):
    """Routers seed their token hashes with lora_name: an adapter's blocks carry its id (its place in --lora-modules,
    from 1) and name, so they are predicted only for requests that name it; the base model's carry none, and another
    tenant's stay opaque whatever their adapter."""
    support = write_adapter(str(tmp_path / "support"), tiny_model, ["q_proj", "v_proj"], seed=1)
    legal = write_adapter(str(tmp_path / "legal"), tiny_model, ["q_proj"], seed=2)
    llm = LLM(model=tiny_model, lora_modules=f"support={support},legal={legal}", kv_events_config=config(tmp_path))
    try:
        until_sent(llm, 1)
        for adapter, lora in [("", (None, None)), ("legal", (2, "legal")), ("support", (1, "support"))]:
            sent = llm.engine.events.sent
            llm.generate([PROMPT], ONE, adapter=adapter)
            assert [(e.lora_id, e.lora_name) for e in replayed(tmp_path, sent, BlockStored, 2)] == [lora] * 2
        sent = llm.engine.events.sent
        llm.generate([PROMPT], ONE, scope=CacheScope(tenant="globex"), adapter="support")
        theirs = replayed(tmp_path, sent, BlockStored, 2)
        assert all(e.lora_id is None and e.lora_name == f"scope:{e.extra_keys[0][0]}" for e in theirs)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("setting", [{}, {"include_token_ids": False}])
def test_token_ids_stay_off_the_bus_unless_asked_for(tiny_model, tmp_path, setting):
    """Every tenant's prompts would ride the bus: the token lists are empty (vLLM's schema still decodes them) unless
    the config sets include_token_ids."""
    llm = LLM(model=tiny_model, kv_events_config=config(tmp_path, **setting))
    try:
        llm.generate([PROMPT], ONE, scope=CacheScope(tenant="globex"))
        stored = replayed(tmp_path, 0, BlockStored, 2)
        assert len(stored) == 2 and all(e.token_ids == [] and e.block_size == 16 for e in stored)
    finally:
        llm.engine.close()


def test_opted_in_token_ids_are_public_prompts_alone(tiny_model, tmp_path):
    """With include_token_ids, a public block the client sent carries its tokens; a block holding output tokens
    (an answer) carries none (a private block's carry none either: test_the_cache_in_vllms_kv_events...)."""
    llm = LLM(model=tiny_model, kv_events_config=config(tmp_path, include_token_ids=True))
    try:
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True))
        stored = replayed(tmp_path, 0, BlockStored, 4)  # 64 tokens computed: two full blocks of prompt, two with output
        assert [e.token_ids for e in stored] == [PROMPT[:16], PROMPT[16:32], [], []]
    finally:
        llm.engine.close()


class OldBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    """Older vLLM's positional events with integer hashes (its kv_events_subscriber.py example's model)."""
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


def test_the_array_encoding_is_older_vllms(tiny_model, tmp_path):
    llm = LLM(model=tiny_model, kv_events_config=config(tmp_path, event_encoding="array", include_token_ids=True))
    try:
        llm.generate([PROMPT], ONE)
        old = events(replay(tmp_path, 0, msgspec.msgpack.Decoder(OldBatch)))
        deadline = time.monotonic() + 5
        while len(stored := [e for e in old if isinstance(e, OldBlockStored)]) < 2:
            assert time.monotonic() < deadline
            old = events(replay(tmp_path, 0, msgspec.msgpack.Decoder(OldBatch)))
        keys = {int.from_bytes(n.key[:8], "big"): n for n in llm.engine.blocks.cache.nodes.values()}
        assert isinstance(old[0], OldAllBlocksCleared) and [e.token_ids for e in stored] == [PROMPT[:16], PROMPT[16:32]]
        assert all(e.block_hashes[0] in keys for e in stored)
        assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("change, message", [
    ({"endpont": "tcp://*:1"}, "unknown key 'endpont'"),
    ({"publisher": "kafka"}, "publisher must be 'zmq' or 'null'"),
    ({"buffer_steps": "many"}, "buffer_steps must be an integer"),
    ({"include_token_ids": 1}, "include_token_ids must be true or false"),
    ({"event_encoding": "json"}, "event_encoding must be 'map' or 'array'"),
])
def test_a_bad_kv_events_config_fails_startup_naming_the_key(tiny_model, tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_model, kv_events_config=config(tmp_path, **change))


def test_an_endpoint_that_cannot_bind_fails_startup(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="cannot open"):
        LLM(model=tiny_model, kv_events_config=config(tmp_path / "missing" / "dir"))
