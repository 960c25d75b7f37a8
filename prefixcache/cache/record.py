"""A KV block as stored below host memory (disk and Redis): safetensors bytes with a small header.

The tensors are the block's K and V, [layers, block_size, kv_heads, head_dim] each; safetensors' own header gives
their dtype and shape. Its metadata holds the format version and an HMAC-SHA256, keyed by the server's tier secret,
over the version, the block's chain key, the owner it is filed under, its tokens and the K/V bytes. The tokens
themselves are not stored: the reader, which knows them, recomputes the MAC. So a record is used only as the block
it was written for: a flipped byte, a truncated value, a copy to another key, position or owner, or a record
written with another secret is a BadRecord, which the reader deletes and recomputes.
"""
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load, save

VERSION = "2"


class BadRecord(Exception):
    """A stored block that must not be used: corrupt, truncated, forged, or not the block asked for."""


@dataclass
class Record:
    tokens: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor


def encode(record: Record, secret: bytes, key: str, owner: str) -> bytes:
    """The bytes to file under (owner, key)."""
    k, v = record.k.contiguous(), record.v.contiguous()
    meta = {"version": VERSION, "mac": _mac(secret, key, owner, record.tokens, k, v)}
    return save({"k": k, "v": v}, metadata=meta)


def decode(data: bytes, secret: bytes, key: str, owner: str, tokens: tuple[int, ...], shape: tuple[int, ...],
           dtype: torch.dtype) -> Record:
    """The record in `data`, if it was written for this key, owner and tokens with this secret, in this shape and
    dtype."""
    try:
        meta = _metadata(data)
        tensors = load(data)
    except Exception as e:  # safetensors and json raise several types for a damaged value
        raise BadRecord(f"unreadable: {e}") from e
    if meta.get("version") != VERSION:
        raise BadRecord(f"format version {meta.get('version')!r}")
    k, v = tensors.get("k"), tensors.get("v")
    for t in (k, v):
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise BadRecord("tensor shape or dtype differs from the pool's")
    if not hmac.compare_digest(str(meta.get("mac")).encode(), _mac(secret, key, owner, tokens, k, v).encode()):
        raise BadRecord("MAC mismatch: damaged, or not written for this block by a holder of this secret")
    return Record(tuple(tokens), k, v)


def _mac(secret: bytes, key: str, owner: str, tokens: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> str:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    parts = (VERSION.encode(), key.encode(), owner.encode(), struct.pack(f"<{len(tokens)}q", *tokens),
             k.reshape(-1).view(torch.uint8).numpy(), v.reshape(-1).view(torch.uint8).numpy())
    for part in parts:  # each one length-prefixed, so that no two messages run together into the same bytes
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _metadata(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise BadRecord("header past the end of the value")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}
