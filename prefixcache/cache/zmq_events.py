"""KV events in vLLM's format, so that routers built for vLLM (llm-d's precise prefix scorer, NVIDIA Dynamo's KV
router) can follow this replica's cache: a ZMQ PUB socket sends frames [topic, 8-byte big-endian sequence number,
msgpack KVEventBatch], and an optional ROUTER socket replays the batches it still holds from a sequence number on.

The structs below are vLLM 0.32's (vllm/distributed/kv_events.py): a batch is a positional array [ts, events,
data_parallel_rank]; each event is a map tagged with "type" (BlockStored, BlockRemoved, AllBlocksCleared). Block
hashes are our block keys (16 bytes: opaque to consumers, chained from the cache scope); `extra_keys` carries each
block's scope key. Routers hash a block's token ids themselves (vllm-router, llm-d's kv-cache indexer) and seed that
hash with `lora_name` alone; they do not read `extra_keys`. So a block that not every request may read (another
tenant's, other labels' or a salted scope's) gets an opaque `lora_name` of its scope, "scope:<hex>", that no
request names: such routers then never predict, for one tenant's request, a hit on another's entries (the engine
would refuse it, and the routing choice would tell of them). Only public blocks (the declared shared scope, or the
one tenant of a server without keys) route by their tokens, a LoRA adapter's with its `lora_id` and `lora_name` as
vLLM sends them (its place in --lora-modules from 1, and its name), so that a router takes an adapter's blocks only
for requests that name it. Token ids ride only with `include_token_ids` true, and then only a public block's
that holds no output token: by default `token_ids` is an empty list (vLLM's schema decodes it; routers that hash
tokens cannot index such blocks), so the bus carries no tenant's prompts unless the operator opts in for a router
that needs them, and never a private prompt (no router could use it) or an answer. `event_encoding` "array"
sends events as older vLLM did, for consumers built on it: positional arrays [tag, fields...], and block
hashes as the unsigned 64-bit integer of the key's first 8 bytes (a router's guess may then collide, which costs a
routing choice, never KV: the engine matches full keys and tokens).

Events arrive from the prefix cache on the engine thread (a cache listener) and are sent by a thread of their own
every INTERVAL seconds, one batch per flush; a replica starts with AllBlocksCleared (its cache is empty).
"""
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields

import msgspec
import zmq

from prefixcache.cache.node import Node
from prefixcache.cache.scope import PUBLIC_OWNERS

INTERVAL = 0.01  # seconds between batches
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay
MEDIUM = "GPU"  # vLLM's medium for the engine's own KV cache (its CPU backend sends it too): our L1
KINDS = {bool: "true or false", int: "an integer", str: "a string"}  # the config's values


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class EventsConfig:
    """vLLM's --kv-events-config, plus include_token_ids."""
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"  # a bind address (with * or an ipc:// or inproc:// path) or one to connect to
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000  # events waiting for the next batch; beyond it they are dropped and counted
    topic: str = ""
    include_token_ids: bool = False  # every tenant's prompts on the bus: opt-in
    event_encoding: str = "map"  # "map" (vLLM 0.32's) or "array" (older vLLM's)

    @classmethod
    def parse(cls, text: str) -> "EventsConfig":
        """The config from its JSON text; a ValueError names a bad key or value."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"--kv-events-config: unknown key {key!r} (known: {', '.join(known)})")
            default = known[key].default
            kind = str if default is None else type(default)  # the optional endpoint: a string or null
            if type(value) is not kind and not (value is None and default is None):  # exact: true is no integer
                raise ValueError(f"--kv-events-config: {key} must be {KINDS[kind]}, got {value!r}")
        cfg = cls(**raw)
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if cfg.event_encoding not in ("map", "array"):
            raise ValueError(f"--kv-events-config: event_encoding must be 'map' or 'array', got {cfg.event_encoding!r}")
        if cfg.buffer_steps < 0 or cfg.hwm < 0 or cfg.max_queue_size < 1:
            raise ValueError("--kv-events-config: buffer_steps and hwm must be >= 0, max_queue_size >= 1")
        return cfg


class ZmqEvents:
    """The cache listener and its publisher thread. Sockets are bound here, so a bad endpoint fails startup."""

    def __init__(self, cfg: EventsConfig, block_size: int, owner: Callable[[Node], Hashable],
                 lora: Callable[[Node], tuple[int, str] | None]):
        self.cfg, self.block_size, self.owner, self.lora = cfg, block_size, owner, lora
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(cfg.hwm)
        self.replay = None
        try:
            _attach(self.pub, cfg.endpoint)
            if cfg.replay_endpoint:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {e.strerror}: endpoint {cfg.endpoint}, "
                             f"replay_endpoint {cfg.replay_endpoint}") from None
        self.topic = cfg.topic.encode()
        self.pending: list = [AllBlocksCleared()]  # appended on the engine thread
        self.lock = threading.Lock()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.sent = self.dropped = 0  # batches sent, events dropped
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self.thread.start()

    # ---- cache listener (engine thread) ------------------------------------------------------------------
    def stored(self, node: Node) -> None:
        parent = node.parent.key if node.parent.tokens else None  # a first block's parent is its scope's root
        public = self.owner(node) in PUBLIC_OWNERS
        tokens = list(node.tokens) if self.cfg.include_token_ids and public and not node.output else []
        lora_id, lora_name = (self.lora(node) or (None, None)) if public else (None, f"scope:{node.scope.hex()}")
        self._add(BlockStored([node.key], parent, tokens, self.block_size, lora_id, MEDIUM, lora_name,
                              [(node.scope.hex(),)]))

    def removed(self, node: Node, reason: str) -> None:
        self._add(BlockRemoved([node.key], MEDIUM))

    def thinned(self, node: Node) -> None:
        pass  # the block stays: a hit ending within a window past it is cut, which no event tells

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self._close_sockets()

    # ---- publisher thread ---------------------------------------------------------------------------------
    def _add(self, event) -> None:
        with self.lock:
            if len(self.pending) < self.cfg.max_queue_size:
                self.pending.append(event)
            else:
                self.dropped += 1

    def _run(self) -> None:
        seq = 0
        encoder = msgspec.msgpack.Encoder()
        while True:
            stopping = self.stopped.wait(INTERVAL)
            with self.lock:
                events, self.pending = self.pending, []
            if events:
                payload = encoder.encode(self._batch(events))
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self.buffer.append((seq, payload))
                seq, self.sent = seq + 1, self.sent + 1
            while self.replay is not None and self.replay.poll(0):
                self._serve_replay()
            if stopping:
                return

    def _batch(self, events: list):
        if self.cfg.event_encoding == "map":
            return KVEventBatch(time.time(), events)
        return [time.time(), [[type(e).__name__, *(_int_hashes(v) for v in msgspec.structs.astuple(e))]
                              for e in events]]

    def _serve_replay(self) -> None:
        """A DEALER or REQ client sent [start sequence number]: every buffered batch from it, then END_SEQ."""
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self.buffer:
            if seq >= start:
                self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)


def open_events(config_text: str, block_size: int, owner: Callable[[Node], Hashable],
                lora: Callable[[Node], tuple[int, str] | None]) -> ZmqEvents | None:
    """The publisher a --kv-events-config asks for (None: none, or publisher null); `owner` tells whose a cached
    block is, `lora` the (id, name) of the LoRA adapter it was computed with, if any. A ValueError says what is wrong
    with the config, or that its endpoint cannot be opened."""
    cfg = EventsConfig.parse(config_text)
    return ZmqEvents(cfg, block_size, owner, lora) if cfg.enable_kv_cache_events and cfg.publisher == "zmq" else None


def _int_hashes(value):
    """A block hash (or a list of them) as older vLLM's consumers read it: a 64-bit integer."""
    if isinstance(value, bytes):
        return int.from_bytes(value[:8], "big")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [int.from_bytes(h[:8], "big") for h in value]
    return value


def _attach(sock: zmq.Socket, endpoint: str) -> None:
    """Bind to a wildcard or local endpoint, else connect (as vLLM does)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
