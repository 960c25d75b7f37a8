"""The KV tiers below host memory (L2 disk, L3 Redis) as the engine sees them, and the KV events.

The engine thread never waits here on a disk or the network: it hands copies of blocks to a writer thread through
a queue taken by owner in turn (fair.py), bounded per owner (a full one drops its own writes and counts them, so one
tenant's flood of unique prompts drops its writes, not others'), and lookups run on a reader thread and come back as
futures, which the scheduler polls. The reader takes lookups by tenant, by weight (fair.py), so a tenant replaying
many spilled prompts queues behind its own lookups only; past LOOKUPS waiting, a tenant's lookup is skipped (its
request recomputes those blocks: a miss, counted as lookup_skipped).

- A full block published to L1 is written through to L3 (so other replicas can load it) and announced.
- A full block evicted from L1 for room spills to L2.
- A lookup continues a request's chain past its L1 match: L2 block by block, then L3 in windows of MGETs, stopping
  at the first miss. Every block is decoded and authenticated with the tier secret (record.py); a bad one is deleted
  from its tier, counted, and ends the lookup, so it is recomputed and never served.

A block is filed under its owner (tenant and labels, hashed) and its chain key, which already holds the whole
scope; so a purge reaches a tenant's blocks in every tier, and a request can only ever ask for keys of its scope.
"""
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import xxhash

from prefixcache.cache.disk import DiskTier
from prefixcache.cache.events import KVEvents
from prefixcache.cache.fair import FairQueue, FairThread
from prefixcache.cache.record import BadRecord, Record, decode, encode
from prefixcache.cache.remote import RedisTier

log = logging.getLogger("prefixcache.tiers")

WINDOW = 8  # blocks per L3 round trip (MGET): 8 read at ~960 MB/s here, 32 at ~790
QUEUE = 256  # writes waiting for the writer thread, each a copy of a block
OWNER_QUEUE = 64  # of them one owner's: a flood keeps three quarters free for the others
# lookups one tenant may have waiting (each holds its chain's keys and tokens): over 3x the requests the server lets
# in at all by default (max_num_seqs + max_queue, 80), so only an offline batch reaches it
LOOKUPS = 256


Copy = Callable[[], Record]  # copies a block out of the pool, called on the engine thread only when a tier keeps it


@dataclass(frozen=True)
class Wanted:
    owner: str
    key: str
    tokens: tuple[int, ...]


@dataclass
class Found:
    tier: str  # "L2" | "L3"
    record: Record | None  # None from a tier that keeps no bytes (the capacity planner's)


def owner_id(owner) -> str:
    """A stable file and key name for an owner (tenant, labels): a hash, so no tenant name reaches a path."""
    return xxhash.xxh3_64_hexdigest(repr(owner).encode())


class Tiers:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, disk: DiskTier | None = None,
                 remote: RedisTier | None = None, events: KVEvents | None = None, *, secret: bytes):
        self.shape, self.dtype, self.secret = shape, dtype, secret  # the secret keys every record's MAC
        self.disk, self.remote, self.events = disk, remote, events
        self.disk_lock = threading.Lock()  # the writer and the reader both use the disk
        self.counts: Counter[str] = Counter()  # "<tier>_<what>": hits, misses, bad, bytes_read, read_seconds...
        self.counts_lock = threading.Lock()  # three threads count
        self.jobs: FairQueue[tuple] = FairQueue(OWNER_QUEUE)  # by owner: writes, pins and purges, each owner's in order
        self.pending = 0  # jobs queued and not done (drain)
        self.done = threading.Condition()
        self.reader = FairThread("kv-tier-read", LOOKUPS)
        self.writer = threading.Thread(target=self._write_loop, name="kv-tier-write", daemon=True)
        self.writer.start()
        if events and disk:
            events.add("stored", "L2", disk.keys())

    @property
    def enabled(self) -> bool:
        return bool(self.disk or self.remote)

    # ---- engine thread ------------------------------------------------------------------------------------
    def stored(self, owner: str, key: str, copy: Copy | None, ttl: float | None) -> None:
        """A full block entered L1; `copy` copies it for L3 (None: L3 has it already)."""
        if self.events:
            self.events.add("stored", "L1", [key])
        if copy is not None and self.remote:
            self._queue(("L3", owner, key, copy(), ttl))

    def removed(self, owner: str, key: str, spill: Copy | None, ttl: float | None) -> None:
        """A full block left L1; `spill` copies it for L2 if it was evicted for room."""
        if self.events:
            self.events.add("removed", "L1", [key])
        if spill is not None:
            self.spill(owner, key, spill, ttl)

    def spill(self, owner: str, key: str, copy: Copy, ttl: float | None) -> None:
        """Write a block that is losing part of its K/V in L1 to L2."""
        if self.disk:
            self._queue(("L2", owner, key, copy(), ttl))

    def fetch(self, wanted: list[Wanted], tenant: str) -> Future:
        """Look up the blocks of a chain for a tenant's request, in order; the future gives the Found ones up to the
        first miss (or the first failure: a tier's fault is a miss; a lookup over the tenant's LOOKUPS finds none)."""
        future = self.reader.submit(tenant, self._fetch, wanted)
        if future is None:
            self._count("lookup", "skipped")
            future = Future()
            future.set_result([])
        return future

    def set_shares(self, shares: dict[str, float]) -> None:
        """The tenants' weights in the lookup queue: their cache shares."""
        self.reader.set_shares(shares)

    def purge(self, owner: str | None) -> None:
        """Drop one owner's blocks from every tier (None: everyone's), after the writes queued before it."""
        if owner is None:  # each owner's writes queued so far are purged after them, the rest now
            for waiting in self.jobs.waiting():
                if waiting:  # "": an earlier purge of everyone's
                    self._queue(("purge", waiting), always=True)
        self._queue(("purge", owner), always=True)

    def pin(self, owner: str, keys: list[str], pinned: bool) -> None:
        if self.remote:
            self._queue(("pin", owner, keys, pinned), always=True)

    # ---- state --------------------------------------------------------------------------------------------
    def health(self) -> dict:
        out = {}
        if self.disk:
            i = self.disk.index
            out["L2"] = {"status": "ok", "blocks": len(i.entries), "bytes": i.bytes, "budget_bytes": i.budget,
                         "disk_full": self.disk.full}
        if self.remote:
            b = self.remote.breaker
            out["L3"] = {"status": "degraded" if b.is_open else "ok", "errors": b.errors, "skipped": b.skipped}
        return out

    def stats(self) -> dict:
        s = {"counts": dict(self.counts), "health": self.health()}
        if self.events:
            s["events"] = {"sent": self.events.sent, "dropped": self.events.dropped}
        return s

    def drain(self) -> None:
        """Wait until every write and purge queued so far is done."""
        with self.done:
            self.done.wait_for(lambda: not self.pending)

    def close(self) -> None:
        self.jobs.close()
        self.writer.join()
        self.reader.shutdown()
        if self.events:
            self.events.close()

    # ---- reader thread ------------------------------------------------------------------------------------
    def _fetch(self, wanted: list[Wanted]) -> list[Found]:
        found: list[Found] = []
        try:
            self._lookup(wanted, found)
        except Exception:
            log.exception("KV tier lookup failed")
            self._count("lookup", "errors")
        self._count("lookup", "blocks", len(wanted))
        self._count("lookup", "found", len(found))
        return found

    def _lookup(self, wanted: list[Wanted], found: list[Found]) -> None:
        """Append to `found` the blocks found, in order, up to the first miss."""
        if self.disk:
            for w in wanted:
                with self.disk_lock:
                    t = time.perf_counter()
                    data = self.disk.get(w.owner, w.key)
                record = self._check("L2", w, data, t)
                if record is None:
                    break
                found.append(Found("L2", record))
        if self.remote:
            rest = wanted[len(found):]
            for i in range(0, len(rest), WINDOW):
                window = rest[i:i + WINDOW]
                t = time.perf_counter()
                values = self.remote.get_many([(w.owner, w.key) for w in window])
                for w, data in zip(window, values):
                    record = self._check("L3", w, data, t)
                    t = None  # the round trip is timed once
                    if record is None:
                        return
                    found.append(Found("L3", record))

    def _check(self, tier: str, w: Wanted, data: bytes | None, started: float | None) -> Record | None:
        if started is not None:
            self._count(tier, "read_seconds", time.perf_counter() - started)
        if data is None:
            self._count(tier, "misses")
            return None
        self._count(tier, "bytes_read", len(data))
        try:
            record = decode(data, self.secret, w.key, w.owner, w.tokens, self.shape, self.dtype)
        except BadRecord:
            self._count(tier, "bad")
            if tier == "L2":
                with self.disk_lock:
                    self.disk.delete(w.key)
                self._announce("removed", "L2", [w.key])
            else:
                self.remote.delete(w.owner, [w.key])
            return None
        self._count(tier, "hits")
        return record

    # ---- writer thread ------------------------------------------------------------------------------------
    def _queue(self, job: tuple, always: bool = False) -> None:
        """Queue a job under its owner (job[1]; "" for everyone's purge); a write past the owner's OWNER_QUEUE or
        the QUEUE in all is dropped, a purge or pin (`always`) waits for room."""
        with self.done:
            full = self.pending >= QUEUE
            self.pending += 1
        while (full and not always) or not self.jobs.put(job[1] or "", job):
            if not always:
                self._count(job[0], "writes_dropped")
                self._done()
                return
            time.sleep(0.01)

    def _done(self) -> None:
        with self.done:
            self.pending -= 1
            self.done.notify_all()

    def _write_loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            kind, *args = job
            try:
                if kind == "purge":
                    self._purge(*args)
                elif kind == "pin":
                    self.remote.persist(*args)
                else:
                    self._write(kind, *args)
            except Exception:  # a tier's fault must not stop the writer: the block is only not kept there
                log.exception("KV tier job %s failed", kind)
                self._count(kind, "job_errors")
            finally:
                self._done()

    def _write(self, tier: str, owner: str, key: str, record: Record, ttl: float | None) -> None:
        data = encode(record, self.secret, key, owner)
        if tier == "L3":
            ok = self.remote.put(owner, key, data, ttl)
        else:
            with self.disk_lock:
                full = self.disk.full
                evicted = self.disk.put(owner, key, data, ttl)
                ok = self.disk.full == full
            self._announce("removed", "L2", evicted)
            if ok:
                self._announce("stored", "L2", [key])
        self._count(tier, "writes" if ok else "write_errors")
        if ok:
            self._count(tier, "bytes_written", len(data))

    def _purge(self, owner: str | None) -> None:
        if self.disk:
            with self.disk_lock:
                gone = self.disk.clear() if owner is None else self.disk.purge(owner)
            self._announce("removed", "L2", gone)
        if self.remote:
            self.remote.purge(owner)

    def _count(self, tier: str, what: str, n: float = 1) -> None:
        with self.counts_lock:
            self.counts[f"{tier}_{what}"] += n

    def _announce(self, kind: str, tier: str, keys: list[str]) -> None:
        if self.events and keys:
            self.events.add(kind, tier, keys)
