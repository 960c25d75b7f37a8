"""The Llama forward pass over the engine's block KV pool (RMSNorm, RoPE, GQA attention, SwiGLU).

A token's result is a function of its own inputs and its keys only, so chunking, batching and cache hits give
bit-identical results: every row-wise op (the GEMMs, RMSNorm, SwiGLU) runs in calls whose row counts the startup
probe verified on this CPU (models/exactness.py), and attention in calls whose query rows and keys it verified
(models/attention.py).
"""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from prefixcache.cache.pool import KVPool
from prefixcache.models import attention
from prefixcache.models.attention import Queries
from prefixcache.models.exactness import Exactness, RowOp, in_calls, rows_plan
from prefixcache.models.loader import Weights

_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # in every x86-64 build of torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] flat pool slot each token's K/V is written to
    queries: list[Queries]  # each sequence's tokens in the batch


class Llama:
    def __init__(self, weights: Weights, tile: int):
        c = self.config = weights.config
        w = weights.tensors
        self.tile = tile
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if c.tie_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
            bias = torch.cat([w[a + n + "_proj.bias"] for n in "qkv"]) if c.attention_bias else None
            self.layers.append(dict(
                ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                qkv=qkv, qkv_bias=bias, o=w[a + "o_proj.weight"],
                gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                down=w[p + "mlp.down_proj.weight"],
            ))
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
        freqs = torch.outer(torch.arange(c.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(self.embed.dtype), emb.sin().to(self.embed.dtype)  # as HF: fp32, then cast
        self.exact: Exactness = rows_plan("", "until the engine sets the probed plan")

    @torch.inference_mode()
    def forward(self, batch: Batch, pool: KVPool, between: Callable[[], None] | None = None) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm; writes every token's K/V into the pool. `between` is
        called before each layer: it may run another forward (on other KV slots) before this one goes on."""
        c, eps = self.config, self.config.rms_norm_eps
        # padded once to the plan's row count: every row-wise call below then runs unpadded
        n, pad = len(batch.input_ids), self.exact.padded_rows(len(batch.input_ids)) - len(batch.input_ids)
        x = F.embedding(F.pad(batch.input_ids, (0, pad)), self.embed)
        positions = F.pad(batch.positions, (0, pad))
        cos, sin = self.cos[positions], self.sin[positions]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        plan = self.attn_plan(batch.queries, n + pad, pool.block_size, pool.k.shape[1])  # padding rows attend nothing
        results = attention.empty_results(plan, n + pad, c.num_heads, c.head_dim, x.dtype)
        for i, L in enumerate(self.layers):
            if between:
                with torch.inference_mode(False):  # as outside any forward: it may create requests' own tensors
                    between()
            qkv = self._rows(_norm_linear, x, L["ln1"], eps, L["qkv"], L["qkv_bias"])
            q = qkv[:, :nq].view(-1, c.num_heads, c.head_dim)
            k = qkv[:, nq:nq + nkv].view(-1, c.num_kv_heads, c.head_dim)
            v = qkv[:, nq + nkv:].view(-1, c.num_kv_heads, c.head_dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            pool.k[i].index_copy_(0, batch.slots, k[:n].to(pool.k.dtype))
            pool.v[i].index_copy_(0, batch.slots, v[:n].to(pool.v.dtype))
            o = attention.attend(q, pool.k[i], pool.v[i], plan, *results)
            x = x + self._rows(_linear, o.view(-1, nq), L["o"])
            x = x + self._rows(_mlp, x, L["ln2"], eps, L["gate_up"], L["down"])
        return self._rows(_rms_norm, x, self.norm, eps)[:n]

    def attn_plan(self, queries: list[Queries], num_tokens: int, block_size: int, pool_slots: int,
                  exact: Exactness | None = None) -> attention.AttnPlan:
        """The step's attention calls, under this model's exactness plan (or another, for the probe)."""
        c = self.config
        return attention.plan(queries, num_tokens, self.tile, block_size, pool_slots, exact or self.exact,
                              c.num_kv_heads, c.num_heads // c.num_kv_heads, self.embed.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._rows(_linear, hidden, self.lm_head)

    def row_ops(self, layer: int = 0) -> list[RowOp]:
        """What the exactness probe checks: every GEMM shape (on the real weights), RMSNorm and SwiGLU."""
        c, L = self.config, self.layers[layer]
        return [RowOp("qkv", _linear, (L["qkv"], L["qkv_bias"]), c.hidden_size),
                RowOp("o", _linear, (L["o"],), c.num_heads * c.head_dim),
                RowOp("gate_up", _linear, (L["gate_up"],), c.hidden_size),
                RowOp("down", _linear, (L["down"],), c.intermediate_size),
                RowOp("lm_head", _linear, (self.lm_head,), c.hidden_size, head=True),
                RowOp("rms_norm", _rms_norm, (L["ln1"], c.rms_norm_eps), c.hidden_size),
                RowOp("swiglu", _swiglu, (), 2 * c.intermediate_size)]

    def _rows(self, fn, x: torch.Tensor, *args) -> torch.Tensor:
        """A row-wise fn(x, *args), in calls of the row counts the exactness plan verified."""
        return in_calls(fn, x, self.exact.call_rows(x.shape[0]), *args)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias on oneDNN rather than MKL's sgemm (F.linear): on an AMD EPYC (Zen 4) only its 1-row calls
    differ from the rest (sgemm's differ up to 11 rows), so decode pads to 2 rows instead of 4, and over every
    layer's weights it ran 1.1-2x faster than sgemm at each row count from 1 to 512."""
    if _onednn_linear is None:
        return F.linear(x, weight, bias)
    return _onednn_linear(x, weight, bias, "none", [], "")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    # not F.silu: its scalar tail loop rounds differently from its vector loop, and where a thread's range
    # ends decides which of the two a row gets; torch.exp and the arithmetic give the same bits in both
    gate, up = gate_up.chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


def _norm_linear(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    return _linear(_rms_norm(x, norm, eps), weight, bias)


def _mlp(x: torch.Tensor, norm: torch.Tensor, eps: float, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return _linear(_swiglu(_norm_linear(x, norm, eps, gate_up, None)), down)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
