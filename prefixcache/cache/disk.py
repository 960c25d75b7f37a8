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
import stat
import time

from prefixcache.cache.ledger import Ledger
from prefixcache.files import private_dir


class DiskTier:
    name = "L2"

    def __init__(self, root: str, budget_bytes: int):
        self.root = private_dir(root)  # its records give the text away, and a forged one would be served
        self.index = Ledger(budget_bytes)
        self.full = 0  # writes refused by a full disk (ENOSPC): the block is simply not kept
        found = []
        for owner in os.listdir(root):
            folder = os.path.join(root, owner)
            if not stat.S_ISDIR(os.lstat(folder).st_mode):  # the secret, or a link that is not ours to follow
                continue
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                st = os.lstat(path)
                if name.endswith(".kv") and stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime, name[:-3], owner, st.st_size))
                else:  # a temporary file from a write that never finished (a link: the link alone goes)
                    os.unlink(path)
        for _, key, owner, size in sorted(found):
            if size > budget_bytes:
                os.unlink(self._path(owner, key))
                continue
            self._evict(size, owner)
            self.index.add(owner, key, size, None, 0.0)  # expiry times are lost on restart

    def keys(self) -> list[str]:
        """Every stored key, oldest first (announced as L2 events on start)."""
        return list(self.index.entries)

    def get(self, owner: str, key: str) -> bytes | None:
        e = self.index.entries.get(key)
        if e is None or e.owner != owner:
            return None
        if self.index.get(owner, key, time.time()) is None:  # expired, and forgotten
            self._unlink([(owner, key)])
            return None
        try:
            with open(self._path(owner, key), "rb") as f:
                data = f.read()
        except FileNotFoundError:  # removed behind our back
            self.index.forget(key)
            return None
        os.utime(self._path(owner, key))
        return data

    def put(self, owner: str, key: str, data: bytes, ttl: float | None) -> list[str]:
        """Store a block (not if the disk is full); returns the keys evicted to make room."""
        if len(data) > self.index.budget:
            return []
        if key in self.index.entries:
            self.delete(key)
        evicted = self._evict(len(data), owner)
        path = self._path(owner, key)
        tmp = path + ".tmp"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            if os.path.lexists(tmp):
                os.unlink(tmp)
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            self.full += 1
            if os.path.exists(tmp):
                os.unlink(tmp)
            return evicted
        self.index.add(owner, key, len(data), ttl, time.time())
        return evicted

    def delete(self, key: str) -> None:
        if key in self.index.entries:
            self._unlink([(self.index.forget(key).owner, key)])

    def purge(self, owner: str) -> list[str]:
        """Drop every block of one owner; returns their keys."""
        gone = self.index.forget_owner(owner)
        shutil.rmtree(os.path.join(self.root, owner), ignore_errors=True)
        return gone

    def clear(self) -> list[str]:
        owners = {e.owner for e in self.index.entries.values()}
        gone = self.index.forget_owner(None)
        for owner in owners:
            shutil.rmtree(os.path.join(self.root, owner), ignore_errors=True)
        return gone

    def _evict(self, incoming: int, owner: str) -> list[str]:
        evicted = self.index.room(incoming, owner)
        self._unlink([(e.owner, k) for k, e in evicted])
        return [k for k, _ in evicted]

    def _unlink(self, blocks: list[tuple[str, str]]) -> None:
        for owner, key in blocks:
            try:
                os.unlink(self._path(owner, key))
            except FileNotFoundError:
                pass

    def _path(self, owner: str, key: str) -> str:
        return os.path.join(self.root, owner, key + ".kv")
