"""KV storage: fixed-size pages in one preallocated tensor pair, with reference counts and a byte budget."""
import math
import mmap

import numpy as np
import torch


class KVPool:
    """A page holds the keys and values of `page_layers` layers for block_size tokens. Page 0 is a permanent all-zero
    page: block tables are padded with it, so padded keys are finite.

    A block is one page, holding every layer, unless the model has local layers (which read only their last
    `window` keys) beside global ones: then a page holds the global layers, and a block is its page (its id) and,
    while a sequence's window or the cache wants it, a local part of `local_pages` pages holding the local layers
    (`page_layers` to a page, the last padded). The local part has its own reference count, so a block the windows
    have passed costs the global layers only. `place(layer)` says where a layer lies.

    Pages are handed out in consecutive runs where possible, since attention reads a tile of consecutive blocks
    where it lies instead of gathering it: a sequence's new blocks continue its last one if free, else start a run
    at a multiple of `run` blocks (an attention tile), where no other sequence's run is about to grow."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, budget_bytes: int,
                 dtype: torch.dtype, run: int = 1, local_layers: tuple[int, ...] = (), window: int = 0):
        local = sorted(local_layers) if 0 < len(local_layers) < num_layers else []  # hybrid only
        full = [i for i in range(num_layers) if i not in local]
        self.window = window if local else 0
        self.page_layers = len(full)
        self.local_pages = -(-len(local) // self.page_layers)
        self.places = {layer: (row, 0) for row, layer in enumerate(full)}
        self.places.update({layer: (a % self.page_layers, 1 + a // self.page_layers) for a, layer in enumerate(local)})
        self.block_size = block_size
        self.block_bytes = self.bytes_per_block(self.page_layers, num_kv_heads, head_dim, block_size, dtype)
        self.num_blocks = budget_bytes // self.block_bytes
        assert self.num_blocks >= 2 + self.local_pages, f"KV budget {budget_bytes} B holds too few pages"
        shape = (self.page_layers, self.num_blocks * block_size, num_kv_heads, head_dim)
        self.k = _lazy_zeros(shape, dtype)
        self.v = _lazy_zeros(shape, dtype)
        self.run = run
        self.refs = [0] * self.num_blocks
        self.refs[0] = 1
        self.is_free = np.ones(self.num_blocks, dtype=bool)
        self.is_free[0] = False
        self.num_free = self.num_blocks - 1
        self.local = np.zeros((self.num_blocks, self.local_pages), dtype=np.int32)  # a block's local part; 0: none
        self.local_refs = [0] * self.num_blocks

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        """Keys and values of block_size tokens in every layer (of a page)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token in every layer (with a local part, as computed)."""
        return self.block_bytes * (1 + self.local_pages) // self.block_size

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def place(self, layer: int) -> tuple[int, int]:
        """Where a layer's keys and values lie: (its row of k and v, its part of a block: 0 the block's own page,
        p > 0 local page p - 1)."""
        return self.places[layer]

    def window_start(self, n_computed: int) -> int:
        """The first block a local layer reads once n_computed tokens are in the pool."""
        return max(0, n_computed - self.window + 1) // self.block_size

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n pages: those right after page `after` if free, else the first run-aligned free run of n, else the
        lowest free ones."""
        assert n <= self.num_free, "allocate beyond the budget"
        if n == 0:
            return []
        free = self.is_free
        if after is not None and after + 1 + n <= self.num_blocks and free[after + 1: after + 1 + n].all():
            ids = list(range(after + 1, after + 1 + n))
        else:
            counts = np.concatenate([[0], np.cumsum(free)])
            starts = np.arange(0, self.num_blocks - n + 1, self.run)
            runs = starts[counts[starts + n] - counts[starts] == n]
            ids = list(range(runs[0], runs[0] + n)) if len(runs) else np.flatnonzero(free)[:n].tolist()
        free[ids] = False
        self.num_free -= n
        for b in ids:
            self.refs[b] = 1
        return ids

    def ref(self, block: int) -> None:
        assert self.refs[block] > 0, "ref on a free block"
        self.refs[block] += 1

    def unref(self, block: int) -> None:
        assert block != 0 and self.refs[block] > 0, "unref on a free block"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            assert not self.local_refs[block], "a block freed before its local part"
            self.is_free[block] = True
            self.num_free += 1

    def has_local(self, block: int) -> bool:
        return self.local_refs[block] > 0

    def add_local(self, block: int, like: int | None = None) -> None:
        """Give a block a local part (one reference), its pages after those of block `like` where free."""
        assert not self.local_refs[block], "a second local part"
        for p in range(self.local_pages):
            after = int(self.local[like, p]) if like is not None and self.local_refs[like] else None
            self.local[block, p] = self.allocate(1, after)[0]
        self.local_refs[block] = 1

    def ref_local(self, block: int) -> None:
        assert self.local_refs[block] > 0, "ref on a missing local part"
        self.local_refs[block] += 1

    def unref_local(self, block: int) -> None:
        assert self.local_refs[block] > 0, "unref on a missing local part"
        self.local_refs[block] -= 1
        if self.local_refs[block] == 0:
            for page in self.local[block].tolist():
                self.unref(page)
            self.local[block] = 0

    def tables(self, blocks: list[int]) -> list[list[int]]:
        """A block table for each part of a block (see place): the blocks, then each local page (0: none)."""
        if not self.local_pages:
            return [blocks]
        return [blocks, *self.local[np.asarray(blocks, dtype=np.int64)].T.tolist()]

    def copy(self, src: int, dst: int) -> None:
        """Copy-on-write: block src into block dst, in every layer, its local part into dst's if both have one. The
        whole block, as the kernels lay keys out in 16 slots at a time (models/paged.py); the slots past the tokens
        that count are written before they are read."""
        pairs = [(src, dst)]
        if self.has_local(src) and self.has_local(dst):
            pairs += zip(self.local[src].tolist(), self.local[dst].tolist())
        for a, b in pairs:
            self._copy_page(a, b)

    def read(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a block's keys and values [layers, block_size, kv heads, d], every layer in the model's order
        (it must have its local part)."""
        assert not self.local_pages or self.has_local(block), "read of a block without its local part"
        k, v = [], []
        for layer in range(len(self.places)):
            span = self._span(block, layer)
            k.append(self.k[span])
            v.append(self.v[span])
        return torch.stack(k), torch.stack(v)

    def write(self, block: int, k: torch.Tensor, v: torch.Tensor, local: bool = False) -> None:
        """Fill a block (with its local part; only that, if `local`) from keys and values as `read` gives them."""
        for layer in range(len(k)):
            if local and not self.place(layer)[1]:
                continue
            span = self._span(block, layer)
            self.k[span] = k[layer]
            self.v[span] = v[layer]

    def _span(self, block: int, layer: int) -> tuple[int, slice]:
        row, part = self.place(layer)
        page = int(self.local[block, part - 1]) if part else block
        return row, slice(page * self.block_size, (page + 1) * self.block_size)

    def _copy_page(self, src: int, dst: int) -> None:
        bs = self.block_size
        for cache in (self.k, self.v):
            cache[:, dst * bs: (dst + 1) * bs] = cache[:, src * bs: (src + 1) * bs]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros the OS commits only when first written (an anonymous mapping), so RSS follows the KV in use. Zeros, not
    garbage: attention multiplies masked keys by exactly 0, which a NaN bit pattern would poison. Not in huge pages:
    two threads writing a fresh 2 MiB page at once took 6 ms a fault on a KVM guest (a 512-token prefill's KV
    writes: 140-205 ms, against 9 on one thread or 8-30 in 4 KiB pages), and since attention prefetches its next
    block they no longer make it faster."""
    buf = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
