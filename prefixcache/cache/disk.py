"""L2: KV blocks in files on local disk, one safetensors file per block, under a byte budget with LRU.

Why files, not an embedded database such as LMDB: a block is a fixed-size value of hundreds of KB (SmolLM2-135M:
720 KiB in fp32), written once and read whole, which is what a file system does well; a file is written to a
temporary name and renamed, so a crash never leaves half a block under a real name; and a tenant's blocks live in
their own folder, so a purge is one rmtree. The LRU order lives in memory and is rebuilt from modification times
on start, so the blocks survive a restart.

Layout: DIR/<owner hex>/<key hex>.kv, and DIR/tier-secret when no secret was given (credentials.py). Expiry times
are kept beside the LRU order (lost on restart: the blocks then live until evicted). Not thread-safe: one thread (the
tiers' worker) uses it.
"""
import errno
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Entry:
    owner: str
    size: int
    expires_at: float


class DiskTier:
    name = "L2"

    def __init__(self, root: str, budget_bytes: int):
        self.root, self.budget = root, budget_bytes
        os.makedirs(root, exist_ok=True)
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # key hex -> entry, least recently used first
        self.bytes = 0
        self.full = 0  # writes refused by a full disk (ENOSPC): the block is simply not kept
        found = []
        for owner in os.listdir(root):
            folder = os.path.join(root, owner)
            for name in os.listdir(folder) if os.path.isdir(folder) else ():
                path = os.path.join(folder, name)
                if name.endswith(".kv"):
                    st = os.stat(path)
                    found.append((st.st_mtime, name[:-3], owner, st.st_size))
                else:  # a temporary file from a write that never finished
                    os.unlink(path)
        for _, key, owner, size in sorted(found):
            self.entries[key] = Entry(owner, size, float("inf"))
            self.bytes += size
        self._shrink(0)

    def keys(self) -> list[str]:
        """Every stored key, oldest first (announced as L2 events on start)."""
        return list(self.entries)

    def get(self, owner: str, key: str) -> bytes | None:
        e = self.entries.get(key)
        if e is None or e.owner != owner:
            return None
        if e.expires_at <= time.time():
            self.delete(key)
            return None
        try:
            with open(self._path(owner, key), "rb") as f:
                data = f.read()
        except FileNotFoundError:  # removed behind our back
            self._forget(key)
            return None
        self.entries.move_to_end(key)
        os.utime(self._path(owner, key))
        return data

    def put(self, owner: str, key: str, data: bytes, ttl: float | None) -> list[str]:
        """Store a block (not if the disk is full); returns the keys evicted to make room."""
        if len(data) > self.budget:
            return []
        if key in self.entries:
            self.delete(key)
        evicted = self._shrink(len(data))
        path = self._path(owner, key)
        tmp = path + ".tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            self.full += 1
            if os.path.exists(tmp):
                os.unlink(tmp)
            return evicted
        self.entries[key] = Entry(owner, len(data), time.time() + ttl if ttl is not None else float("inf"))
        self.bytes += len(data)
        return evicted

    def delete(self, key: str) -> None:
        e = self.entries.get(key)
        if e is None:
            return
        try:
            os.unlink(self._path(e.owner, key))
        except FileNotFoundError:
            pass
        self._forget(key)

    def purge(self, owner: str) -> list[str]:
        """Drop every block of one owner; returns their keys."""
        gone = [k for k, e in self.entries.items() if e.owner == owner]
        for k in gone:
            self._forget(k)
        shutil.rmtree(os.path.join(self.root, owner), ignore_errors=True)
        return gone

    def clear(self) -> list[str]:
        gone = list(self.entries)
        for owner in {e.owner for e in self.entries.values()}:
            shutil.rmtree(os.path.join(self.root, owner), ignore_errors=True)
        self.entries.clear()
        self.bytes = 0
        return gone

    def _shrink(self, incoming: int) -> list[str]:
        evicted = []
        while self.entries and self.bytes + incoming > self.budget:
            key = next(iter(self.entries))
            self.delete(key)
            evicted.append(key)
        return evicted

    def _forget(self, key: str) -> None:
        self.bytes -= self.entries.pop(key).size

    def _path(self, owner: str, key: str) -> str:
        return os.path.join(self.root, owner, key + ".kv")
