"""A KV block as stored below host memory (disk and Redis): safetensors bytes with a small header.

The tensors are the block's K and V, [layers, block_size, kv_heads, head_dim] each; safetensors' own header gives
their dtype and shape. Its metadata holds the format version, the block's tokens and an xxh3-64 checksum of the
tensor payload. A record is used only if all of these match what the reader expects; anything else (a flipped
byte, a truncated value, another block's tokens) is a BadRecord, which the reader deletes and recomputes.
"""
import json
from dataclasses import dataclass

import torch
import xxhash
from safetensors.torch import load, save

VERSION = "1"


class BadRecord(Exception):
    """A stored block that must not be used: corrupt, truncated, or not the block asked for."""


@dataclass
class Record:
    tokens: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor


def encode(record: Record) -> bytes:
    k, v = record.k.contiguous(), record.v.contiguous()
    meta = {"version": VERSION, "tokens": json.dumps(list(record.tokens)), "xxh3": _checksum(k, v)}
    return save({"k": k, "v": v}, metadata=meta)


def decode(data: bytes, tokens: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> Record:
    """The record in `data`, if it holds these tokens' K/V in this shape and dtype and its checksum holds."""
    try:
        meta = _metadata(data)
        tensors = load(data)
    except Exception as e:  # safetensors and json raise several types for a damaged value
        raise BadRecord(f"unreadable: {e}") from e
    if meta.get("version") != VERSION:
        raise BadRecord(f"format version {meta.get('version')!r}")
    if tuple(json.loads(meta.get("tokens", "[]"))) != tuple(tokens):
        raise BadRecord("tokens differ from the block asked for")
    k, v = tensors.get("k"), tensors.get("v")
    for t in (k, v):
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise BadRecord("tensor shape or dtype differs from the pool's")
    if meta.get("xxh3") != _checksum(k, v):
        raise BadRecord("checksum mismatch")
    return Record(tuple(tokens), k, v)


def _checksum(k: torch.Tensor, v: torch.Tensor) -> str:
    h = xxhash.xxh3_64()
    for t in (k, v):
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def _metadata(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise BadRecord("header past the end of the value")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}
