"""KV storage: fixed-size blocks in one preallocated tensor pair, with reference counts and a byte budget."""
import math
import mmap

import numpy as np
import torch


class KVPool:
    """Block 0 is a permanent all-zero block: block tables are padded with it, so padded keys are finite.

    Blocks are handed out in consecutive runs where possible, since attention reads a tile of consecutive blocks
    where it lies instead of gathering it: a sequence's new blocks continue its last one if free, else start a run
    at a multiple of `run` blocks (an attention tile), where no other sequence's run is about to grow."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, budget_bytes: int,
                 dtype: torch.dtype, run: int = 1):
        self.block_size = block_size
        self.block_bytes = self.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        self.num_blocks = budget_bytes // self.block_bytes
        assert self.num_blocks >= 2, f"KV budget {budget_bytes} B holds fewer than 2 blocks"
        shape = (num_layers, self.num_blocks * block_size, num_kv_heads, head_dim)
        self.k = _lazy_zeros(shape, dtype)
        self.v = _lazy_zeros(shape, dtype)
        self.run = run
        self.refs = [0] * self.num_blocks
        self.refs[0] = 1
        self.is_free = np.ones(self.num_blocks, dtype=bool)
        self.is_free[0] = False
        self.num_free = self.num_blocks - 1

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        """Keys and values of block_size tokens in every layer."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n blocks: those right after block `after` if free, else the first run-aligned free run of n, else the
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
            self.is_free[block] = True
            self.num_free += 1

    def copy(self, src: int, dst: int) -> None:
        """Copy-on-write: block src into block dst, in every layer. The whole block, as the kernels lay keys out
        in 16 slots at a time (models/paged.py); the slots past the tokens that count are written before they
        are read."""
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
