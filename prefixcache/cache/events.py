"""KV events: which block keys a replica stores and removes, in L1 (host memory) and L2 (its disk).

Why a Redis Stream rather than NATS JetStream: the shared tier is Redis already, so a deployment runs one service,
not two; a stream is an ordered, trimmed log that a consumer reads from the start (XREAD from 0) to rebuild a
replica's cache index after its own restart; and the `redis` package is all either side needs.

Stream `prefixcache:events`, one entry per batch: fields replica, kind ("stored" | "removed" | "reset"), tier
("L1" | "L2") and keys (comma-joined hex; none for reset). A replica sends "reset" when it starts (its L1 is empty),
then "stored"/L2 for the blocks its disk kept. Batches are flushed every `interval` seconds by a thread, so the
engine thread only appends to a list; when Redis is down, batches are dropped and counted.
"""
import threading

import redis

STREAM = "prefixcache:events"
MAX_LEN = 1_000_000  # entries kept (approximately); older ones are trimmed


class KVEvents:
    def __init__(self, url: str, replica: str, interval: float = 0.05, timeout: float = 0.5,
                 password: str | None = None):
        self.replica, self.interval = replica, interval
        self.client = redis.Redis.from_url(url, password=password, socket_timeout=timeout,
                                           socket_connect_timeout=timeout)
        self.pending: list[tuple[str, str, list[str]]] = []  # (kind, tier, keys); appended on the engine thread
        self.lock = threading.Lock()
        self.sent = self.dropped = 0  # batches
        self.stopped = threading.Event()
        self.add("reset", "L1", [])
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()

    def add(self, kind: str, tier: str, keys: list[str]) -> None:
        with self.lock:
            if self.pending and self.pending[-1][:2] == (kind, tier) and kind != "reset":
                self.pending[-1][2].extend(keys)
            else:
                self.pending.append((kind, tier, list(keys)))

    def flush(self) -> None:
        with self.lock:
            batches, self.pending = self.pending, []
        if not batches:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for kind, tier, keys in batches:
                pipe.xadd(STREAM, {"replica": self.replica, "kind": kind, "tier": tier, "keys": ",".join(keys)},
                          maxlen=MAX_LEN, approximate=True)
            pipe.execute()
            self.sent += len(batches)
        except (redis.RedisError, OSError):
            self.dropped += len(batches)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.flush()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.flush()
