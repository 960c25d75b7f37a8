"""The Llama forward pass over the engine's block KV pool (RMSNorm, RoPE, GQA attention, SwiGLU).

A token's result is a function of its own inputs and its keys only, so chunking, batching and cache hits give
bit-identical results: every row-wise op (the GEMMs, RMSNorm, SwiGLU) runs in calls whose row counts the startup
probe verified on this CPU (models/exactness.py); attention runs torch's fused CPU flash kernel on fixed tiles of
keys aligned to absolute positions, in calls of verified query-row counts, and merges the tiles by their
log-sum-exp in order.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixcache.cache.pool import KVPool
from prefixcache.models.exactness import Exactness, RowOp, in_calls, rows_plan
from prefixcache.models.loader import Weights

MASKED = -1e30
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns the log-sum-exp per row too
_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # in every x86-64 build of torch


@dataclass
class AttnGroup:
    """Queries of b sequences, m rows each, laid out sequence-major in the flat batch from `start`."""

    start: int
    b: int
    m: int
    block_tables: torch.Tensor  # [b, n_blocks] long, padded with block 0 to a multiple of the tile
    q_pos: torch.Tensor  # [b, m] long, absolute positions


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] flat pool slot each token's K/V is written to
    groups: list[AttnGroup]


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
    def forward(self, batch: Batch, pool: KVPool) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm; writes every token's K/V into the pool."""
        c, eps = self.config, self.config.rms_norm_eps
        x = F.embedding(batch.input_ids, self.embed)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, L in enumerate(self.layers):
            qkv = self._rows(_norm_linear, x, L["ln1"], eps, L["qkv"], L["qkv_bias"])
            q = qkv[:, :nq].view(-1, c.num_heads, c.head_dim)
            k = qkv[:, nq:nq + nkv].view(-1, c.num_kv_heads, c.head_dim)
            v = qkv[:, nq + nkv:].view(-1, c.num_kv_heads, c.head_dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            pool.k[i].index_copy_(0, batch.slots, k.to(pool.k.dtype))
            pool.v[i].index_copy_(0, batch.slots, v.to(pool.v.dtype))
            o = torch.empty_like(q)
            for g in batch.groups:
                rows = slice(g.start, g.start + g.b * g.m)
                o[rows] = self._attend_group(q[rows], pool, i, g)
            x = x + self._rows(_linear, o.view(-1, nq), L["o"])
            x = x + self._rows(_mlp, x, L["ln2"], eps, L["gate_up"], L["down"])
        return self._rows(_rms_norm, x, self.norm, eps)

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

    def _attend_group(self, q: torch.Tensor, pool: KVPool, layer: int, g: AttnGroup) -> torch.Tensor:
        c = self.config
        kvh, grp, d, bs = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim, pool.block_size
        # rows of one kv head: (group member, query) pairs, so GQA needs no repeated keys
        q = q.view(g.b, g.m, kvh, grp, d).permute(0, 2, 3, 1, 4).reshape(g.b, kvh, grp * g.m, d)
        k = _gather(pool.k[layer], g.block_tables, bs, q.dtype)  # [b, kvh, n_keys, d]
        v = _gather(pool.v[layer], g.block_tables, bs, q.dtype)
        q_pos = g.q_pos.unsqueeze(1).expand(g.b, grp, g.m).reshape(g.b, grp * g.m)
        out = self.attend(q, k, v, q_pos, self.exact.attn_rows(grp * g.m))
        return out.view(g.b, kvh, grp, g.m, d).permute(0, 3, 1, 2, 4).reshape(g.b * g.m, c.num_heads, d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, size: int) -> torch.Tensor:
        """Causal attention of q [b, kvh, r, d] at absolute positions q_pos [b, r] over k, v [b, kvh, n_keys, d].
        Each kernel call sees exactly `size` query rows per batch entry and kv head: the rows are padded to a
        multiple of `size`, and their blocks become batch entries of the call. With size 1, each entry is a call
        of its own: for a lone query row the kernel splits the keys by how many entries share the call."""
        b, kvh, r, d = q.shape
        n = -(-r // size)
        pad = n * size - r
        q = F.pad(q, (0, 0, 0, pad)).view(b, kvh, n, size, d).transpose(1, 2).reshape(b * n, kvh, size, d)
        q_pos = F.pad(q_pos, (0, pad)).view(b * n, 1, size, 1)
        # the same keys for each block of rows: a view when b or n is 1, else a copy
        k, v = (t.unsqueeze(1).expand(b, n, *t.shape[1:]).reshape(b * n, *t.shape[1:]) for t in (k, v))
        entries = zip(q.split(1), k.split(1), v.split(1), q_pos.split(1)) if size == 1 else [(q, k, v, q_pos)]
        out = torch.cat([_tiles(*e, self.tile) for e in entries])  # [b*n, kvh, size, d]
        return out.view(b, n, kvh, size, d).transpose(1, 2).reshape(b, kvh, n * size, d)[:, :, :r]


def _tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, tile: int) -> torch.Tensor:
    """The flash kernel on each tile of keys, the tiles merged by their log-sum-exp in order."""
    n_tiles = min(k.shape[2], int(q_pos.max()) + tile) // tile
    for t in range(n_tiles):
        ks = slice(t * tile, (t + 1) * tile)
        # a finite mask: a row that sees no key of this tile gets weight exp(-1e30) == 0, never NaN
        mask = torch.zeros(1, dtype=q.dtype).masked_fill(torch.arange(ks.start, ks.stop) > q_pos, MASKED)
        out, lse = _flash(q, k[:, :, ks], v[:, :, ks], 0.0, False, attn_mask=mask, scale=q.shape[-1] ** -0.5)
        lse = lse.unsqueeze(-1)
        if t == 0:
            acc, m_i, l_i = out, lse, torch.ones_like(lse)
            continue
        m_new = torch.maximum(m_i, lse)
        old, new = torch.exp(m_i - m_new), torch.exp(lse - m_new)
        acc = acc * old + out * new
        l_i = l_i * old + new
        m_i = m_new
    return acc / l_i


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, bs: int, dtype: torch.dtype) -> torch.Tensor:
    b, nb = block_tables.shape
    blocks = torch.index_select(cache.view(-1, bs, *cache.shape[1:]), 0, block_tables.flatten())  # [b*nb, bs, kvh, d]
    blocks = blocks.view(b, nb * bs, *cache.shape[1:]).transpose(1, 2)
    return torch.empty(blocks.shape, dtype=dtype).copy_(blocks)


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
