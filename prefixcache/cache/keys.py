"""Block keys: the hash chain that names each cached block by its parent's key, its scope and its tokens.

A full block's key is xxh3-128(parent key | scope key | token bytes), so equal keys mean equal tokens at equal
positions under an equal scope, and two scopes never meet. The same chain with an empty scope names a block by its
content alone (cache/misses.py: whether any scope holds these tokens).
"""
import numpy as np
import xxhash


def chain_keys(tokens: list[int], scopes: list[bytes], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Keys of the full blocks of `tokens` (block j under scopes[j]), chained from `parent`."""
    data = np.asarray(tokens, dtype=np.int32).tobytes()
    step = 4 * block_size
    keys = []
    for j in range(len(tokens) // block_size):
        parent = block_key(parent, scopes[j], data[j * step:(j + 1) * step])
        keys.append(parent)
    return keys


def block_key(parent: bytes, scope: bytes, token_bytes: bytes) -> bytes:
    return xxhash.xxh3_128_digest(parent + scope + token_bytes)
