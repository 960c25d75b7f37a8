"""Rotary position embeddings: each pair of a head's dimensions turns by position x its inverse frequency. Llama
3.x ("llama3"), "linear" and YaRN ("yarn", gpt-oss's) scaling change the frequencies, and YaRN scales cos and sin by
its attention factor; a GGUF carries Llama 3.x's as a tensor of factors (`rope_freqs`), which divide them. The tables
are computed as HF transformers computes them (fp32, then cast)."""
import math
from dataclasses import dataclass

import torch

KINDS = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Rope:
    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn: the rotations bounding the frequencies kept and the ones interpolated
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: those bounds rounded out to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it
    factors: tuple[float, ...] = ()  # a GGUF's rope_freqs: one divisor per inverse frequency


def from_hf(hf: dict, layer_type: str = "full_attention") -> Rope:
    """From an HF config: transformers 5's `rope_parameters` (by layer type where layers differ) or the older
    `rope_theta` and `rope_scaling` (and Gemma 3's `rope_local_base_freq` for its sliding layers)."""
    params = dict(hf.get("rope_scaling") or {})
    by_type = hf.get("rope_parameters") or {}
    params.update(by_type.get(layer_type, {}) if layer_type in by_type else by_type)
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
        params = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in KINDS:
        raise ValueError(f"rope scaling {kind!r} is not supported yet; supported: {', '.join(KINDS)}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return Rope(theta)
    if kind == "linear":
        return Rope(theta, kind, float(params["factor"]))
    if kind == "yarn":
        return _yarn(theta, params)
    return Rope(theta, kind, float(params["factor"]), float(params["low_freq_factor"]),
                float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))


def _yarn(theta: float, params: dict) -> Rope:
    """As transformers' _compute_yarn_parameters reads its parameters (a config's factor, not the context's ratio)."""
    factor, mscale, all_dim = float(params["factor"]), params.get("mscale"), params.get("mscale_all_dim")
    attention = params.get("attention_factor")
    if attention is None:
        attention = _mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim else _mscale(factor)
    return Rope(theta, "yarn", factor, original_max_position=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                truncate=bool(params.get("truncate", True)), attention_factor=float(attention))


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


class Table:
    """cos and sin rows by position, up to `limit`, computed as sequences reach them: memory follows the longest
    sequence so far, not the context (Gemma 3's two tables over its 32k positions held 134 MB). A row's bits do not
    depend on how many rows were computed with it (tests/models/test_model.py), so growing the tables changes none."""
    FIRST = 1024  # rows computed at first; the tables then double

    def __init__(self, rope: Rope, head_dim: int, limit: int, dtype: torch.dtype):
        self.rope, self.head_dim, self.limit, self.dtype = rope, head_dim, limit, dtype
        self.cos, self.sin = tables(rope, head_dim, min(limit, self.FIRST), dtype)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [len(positions), head_dim]."""
        top = int(positions.max()) + 1 if positions.numel() else 0
        assert top <= self.limit, f"position {top - 1} past the RoPE tables' {self.limit}"
        if top > len(self.cos):
            self.cos, self.sin = tables(self.rope, self.head_dim, min(self.limit, max(top, 2 * len(self.cos))),
                                        self.dtype)
        return self.cos[positions], self.sin[positions]

    @property
    def nbytes(self) -> int:
        return self.cos.nbytes + self.sin.nbytes


def tables(rope: Rope, head_dim: int, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim], the second half of each row a copy of the first."""
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq(rope, head_dim))
    emb = torch.cat([freqs, freqs], dim=-1)
    if rope.kind == "yarn":
        return (emb.cos() * rope.attention_factor).to(dtype), (emb.sin() * rope.attention_factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.factors:
        assert len(rope.factors) == len(inv), "one rope factor per frequency"
        return inv / torch.tensor(rope.factors, dtype=torch.float32)
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope.kind == "yarn":  # kept below the fast bound's dimension, interpolated past the slow one's, ramped between
        low, high = (head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta)) for rotations in (rope.beta_fast, rope.beta_slow))
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if high == low else high
        kept = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        interpolated = 1.0 / (rope.factor * rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        return interpolated * (1 - kept) + inv * kept
    return inv


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, d] turned by each row's cos and sin [rows, d]: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
