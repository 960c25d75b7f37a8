"""KV storage: fixed-size blocks in one preallocated tensor pair, with reference counts and a byte budget."""
import math

import numpy as np
import torch


class KVPool:
    """Block 0 is a permanent all-zero block: block tables are padded with it, so padded keys are finite."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, budget_bytes: int,
                 dtype: torch.dtype):
        self.block_size = block_size
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        self.num_blocks = budget_bytes // self.block_bytes
        assert self.num_blocks >= 2, f"KV budget {budget_bytes} B holds fewer than 2 blocks"
        shape = (num_layers, self.num_blocks * block_size, num_kv_heads, head_dim)
        self.k = _lazy_zeros(shape, dtype)
        self.v = _lazy_zeros(shape, dtype)
        self.refs = [0] * self.num_blocks
        self.refs[0] = 1
        self.free: list[int] = list(range(self.num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free), "allocate beyond the budget"
        ids = [self.free.pop() for _ in range(n)]
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
            self.free.append(block)

    def copy(self, src: int, dst: int, n_tokens: int) -> None:
        """Copy-on-write: the first n_tokens of block src into block dst, in every layer."""
        bs = self.block_size
        for cache in (self.k, self.v):
            cache[:, dst * bs: dst * bs + n_tokens] = cache[:, src * bs: src * bs + n_tokens]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros the OS commits only when first written (numpy's calloc), so RSS follows the KV in use. Zeros, not
    garbage: attention multiplies masked keys by exactly 0, which a NaN bit pattern would poison."""
    return torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)
