"""The Llama forward pass over the engine's block KV pool (RMSNorm, RoPE, GQA attention, SwiGLU).

Every reduction has a fixed length, so a token's result is a function of its own inputs and its keys only:
linears rely on MKL strict mode (row results independent of row count); attention runs torch's fused CPU
flash kernel on fixed tiles of keys aligned to absolute positions, and merges the tiles by their log-sum-exp
in order. Chunking, batching and cache hits therefore give bit-identical results.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixcache.cache.pool import KVPool
from prefixcache.models.loader import Weights

MASKED = -1e30
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns the log-sum-exp per row too


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
        self.cos, self.sin = emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, batch: Batch, pool: KVPool) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm; writes every token's K/V into the pool."""
        c = self.config
        x = F.embedding(batch.input_ids, self.embed)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, L in enumerate(self.layers):
            h = _rms_norm(x, L["ln1"], c.rms_norm_eps)
            qkv = F.linear(h, L["qkv"], L["qkv_bias"])
            q = qkv[:, :nq].view(-1, c.num_heads, c.head_dim)
            k = qkv[:, nq:nq + nkv].view(-1, c.num_kv_heads, c.head_dim)
            v = qkv[:, nq + nkv:].view(-1, c.num_kv_heads, c.head_dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            pool.k[i].index_copy_(0, batch.slots, k.to(pool.k.dtype))
            pool.v[i].index_copy_(0, batch.slots, v.to(pool.v.dtype))
            o = torch.empty_like(q)
            for g in batch.groups:
                rows = slice(g.start, g.start + g.b * g.m)
                o[rows] = self._attend(q[rows], pool, i, g)
            x = x + F.linear(o.view(-1, nq), L["o"])
            h = _rms_norm(x, L["ln2"], c.rms_norm_eps)
            gate, up = F.linear(h, L["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, L["down"])
        return _rms_norm(x, self.norm, c.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    def _attend(self, q: torch.Tensor, pool: KVPool, layer: int, g: AttnGroup) -> torch.Tensor:
        c = self.config
        kvh, grp, d, bs, tile = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim, pool.block_size, self.tile
        # rows of one kv head: (group member, query) pairs, so GQA needs no repeated keys
        q = q.view(g.b, g.m, kvh, grp, d).permute(0, 2, 3, 1, 4).reshape(g.b, kvh, grp * g.m, d)
        k = _gather(pool.k[layer], g.block_tables, bs)  # [b, kvh, n_keys, d] fp32
        v = _gather(pool.v[layer], g.block_tables, bs)
        qpos = g.q_pos.unsqueeze(1).expand(g.b, grp, g.m).reshape(g.b, 1, grp * g.m, 1)
        n_tiles = min(k.shape[2], int(g.q_pos.max()) + tile) // tile
        for t in range(n_tiles):
            ks = slice(t * tile, (t + 1) * tile)
            # a finite mask: a row that sees no key of this tile gets weight exp(-1e30) == 0, never NaN
            mask = torch.zeros(1).masked_fill(torch.arange(ks.start, ks.stop) > qpos, MASKED)
            out, lse = _flash(q, k[:, :, ks], v[:, :, ks], 0.0, False, attn_mask=mask, scale=d ** -0.5)
            lse = lse.unsqueeze(-1)
            if t == 0:
                acc, m_i, l_i = out, lse, torch.ones_like(lse)
                continue
            m_new = torch.maximum(m_i, lse)
            old, new = torch.exp(m_i - m_new), torch.exp(lse - m_new)
            acc = acc * old + out * new
            l_i = l_i * old + new
            m_i = m_new
        out = acc / l_i  # [b, kvh, grp*m, d]
        return out.view(g.b, kvh, grp, g.m, d).permute(0, 3, 1, 2, 4).reshape(g.b * g.m, c.num_heads, d)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, bs: int) -> torch.Tensor:
    b, nb = block_tables.shape
    blocks = torch.index_select(cache.view(-1, bs, *cache.shape[1:]), 0, block_tables.flatten())  # [b*nb, bs, kvh, d]
    blocks = blocks.view(b, nb * bs, *cache.shape[1:]).transpose(1, 2)
    return torch.empty(blocks.shape, dtype=torch.float32).copy_(blocks)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
