"""Causal attention over the block KV pool, in tiles of keys aligned to absolute positions.

Tile t holds keys [t * tile, (t + 1) * tile). A query row attends each tile of its sequence in one call of torch's
fused CPU flash kernel, and the tiles' results are merged by their log-sum-exp in tile order, the same order for
every row. So a row's bits depend on its own query and keys only, provided every call has a number of query rows
and a number of keys that the exactness probe verified on this CPU (Exactness.attn_sizes, Exactness.key_lengths).

- Where a tile lies: a tile whose blocks are consecutive in the pool is read where it lies, as a strided view;
  any other is gathered, its real blocks only, padded with the zero block to the next verified key length.
- Cascade: sequences whose tile holds the same blocks (a shared cached prefix, n samples of one prompt) attend it
  in one call, all their query rows together, so its keys are read once per step.
- The plan of tiles, query rows and masks is built once per step (`plan`); each layer then runs `attend`.
- Sinks (gpt-oss): a learned logit per head joins each row's softmax denominator, once, after the tiles' merge.
"""
import math
from dataclasses import dataclass

import torch

MASKED = -1e30  # finite: a row that sees no key of a tile gets weight exp(-1e30) == 0 there, never NaN
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns the log-sum-exp per row too


@dataclass
class Queries:
    """A sequence's query tokens in a step: flat batch rows first..first+len(positions), keys 0..ctx-1."""
    first: int
    positions: list[int]
    ctx: int
    block_table: list[int]


@dataclass
class Tile:
    index: int  # keys [index * tile, index * tile + length)
    length: int  # keys in the call: the real ones, padded to a verified length
    first_slot: int  # pool slot of the first key when the tile's blocks are consecutive, else -1
    slots: torch.Tensor | None  # [length] pool slots to gather otherwise
    calls: int  # batch entries of the kernel call
    size: int  # query rows per entry and kv head
    q_start: int  # the entries' rows in AttnPlan.q_index
    mask: torch.Tensor  # [calls, 1, size, length] additive causal mask


@dataclass
class AttnPlan:
    tiles: list[Tile]
    num_tiles: int  # tile indices 0..num_tiles-1 are merged, in order
    q_index: torch.Tensor  # the flat (token, head) query row of each call row; padding: the zero row
    out_index: torch.Tensor  # (tile index, token, head) result slot of each call row; padding: a spare slot


def plan(groups: list[Queries], num_tokens: int, tile: int, block_size: int, pool_slots: int, exact,
         num_kv_heads: int, group_size: int, dtype: torch.dtype, window: int = 0) -> AttnPlan:
    """The step's kernel calls: one per distinct tile (its blocks and length), holding every query that reads it.
    With a window, a query reads only its last `window` keys (its own included): tiles before every query's
    window are left out (a row that reaches no key of a tile merges as if it were left out too)."""
    shared: dict[tuple, list[tuple[int, int]]] = {}  # (index, length, blocks) -> (token row, position) pairs
    for g in groups:
        first = max(0, min(g.positions) - window + 1) // tile if window else 0
        for t in range(first, math.ceil(g.ctx / tile)):
            real = min(tile, g.ctx - t * tile)
            blocks = tuple(g.block_table[t * tile // block_size: (t * tile + real - 1) // block_size + 1])
            rows = shared.setdefault((t, exact.key_length(real, tile), blocks), [])
            rows += [(g.first + i, p) for i, p in enumerate(g.positions)]
    num_tiles = max(key[0] for key in shared) + 1
    heads = num_kv_heads * group_size
    spare_q, spare_out = num_tokens * heads, num_tiles * num_tokens * heads
    tiles, q_index, out_index, start = [], [], [], 0
    for (t, length, blocks), rows in shared.items():
        token, pos = (torch.tensor(c).repeat_interleave(group_size) for c in zip(*rows))
        member = torch.arange(len(token)) % group_size
        size = exact.attn_rows(len(token))
        calls = -(-len(token) // size)
        pad = calls * size - len(token)
        row = torch.cat([token * heads + member, torch.full((pad,), -1)]).view(calls, 1, size)
        row = row + torch.arange(num_kv_heads).view(1, -1, 1) * group_size * (row >= 0)
        q_index.append(row.where(row >= 0, spare_q).flatten())
        out_index.append((row + t * num_tokens * heads).where(row >= 0, spare_out).flatten())
        keys = torch.arange(t * tile, t * tile + length)
        pos = torch.cat([pos, pos.new_zeros(pad)]).view(calls, 1, size, 1)
        outside = (keys > pos) | (keys <= pos - window) if window else keys > pos
        mask = torch.where(outside, MASKED, 0.0).to(dtype)
        first = blocks[0] * block_size
        consecutive = all(b == blocks[0] + i for i, b in enumerate(blocks)) and first + length <= pool_slots
        slots = None if consecutive else _slots(blocks, block_size, length)
        tiles.append(Tile(t, length, first if consecutive else -1, slots, calls, size, start, mask))
        start += calls * num_kv_heads * size
    return AttnPlan(tiles, num_tiles, torch.cat(q_index), torch.cat(out_index))


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, p: AttnPlan, out: torch.Tensor,
           lse: torch.Tensor, scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, heads, d] -> [N, heads, d], over one layer's pool k, v [slots, kv heads, d], with each head's sink
    logit [heads] if given. out [num_tiles * N * heads + 1, d] and lse [num_tiles * N * heads + 1] hold each tile's
    results: filled with `empty_results` once per step, since every layer writes the same slots."""
    n, heads, d = q.shape
    kvh = k_pool.shape[1]
    rows = torch.cat([q.reshape(-1, d), q.new_zeros(1, d)]).index_select(0, p.q_index)
    outs, lses = [], []
    for t in p.tiles:
        qt = rows[t.q_start: t.q_start + t.calls * kvh * t.size].view(t.calls, kvh, t.size, d)
        k, v = (_keys(pool, t, q.dtype) for pool in (k_pool, v_pool))
        # with one row per entry, the kernel splits the keys by how many entries share the call: one call each
        for e in [slice(i, i + 1) for i in range(t.calls)] if t.size == 1 else [slice(None)]:
            o, m = _flash(qt[e], k[e], v[e], 0.0, False, attn_mask=t.mask[e], scale=scale or d ** -0.5)[:2]
            outs.append(o.reshape(-1, d))
            lses.append(m.reshape(-1))
    out.index_copy_(0, p.out_index, torch.cat(outs))
    lse.index_copy_(0, p.out_index, torch.cat(lses))
    o = merge(out[:-1].view(p.num_tiles, n * heads, d), lse[:-1].view(p.num_tiles, n * heads, 1),
              None if sinks is None else sinks.float().repeat(n).view(-1, 1))
    return o.view(n, heads, d).to(q.dtype)


def empty_results(p: AttnPlan, num_tokens: int, heads: int, d: int, dtype: torch.dtype):
    """Per-tile results that leave a row unchanged in the merge: rows that do not reach a tile keep these. The
    kernel gives the log-sum-exp in fp32 whatever the dtype, so the merge runs in fp32."""
    n = p.num_tiles * num_tokens * heads + 1
    return torch.zeros(n, d, dtype=dtype), torch.full((n,), MASKED)


def merge(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Tiles' results [tiles, rows, d] by their log-sum-exp [tiles, rows, 1], in tile order, then each row's sink
    logit [rows, 1] (if any) added to the denominator as exp(sink - m). A tile a row does not reach (lse MASKED,
    out 0) leaves its bits unchanged: its weight is exp(MASKED - m) == 0 and the old one 1."""
    acc, m_i, l_i = out[0], lse[0], torch.ones_like(lse[0])
    for t in range(1, out.shape[0]):
        m_new = torch.maximum(m_i, lse[t])
        old, new = torch.exp(m_i - m_new), torch.exp(lse[t] - m_new)
        acc = acc * old + out[t] * new
        l_i = l_i * old + new
        m_i = m_new
    if sinks is not None:
        l_i = l_i + torch.exp(sinks - m_i)
    return acc / l_i


def _keys(pool: torch.Tensor, t: Tile, dtype: torch.dtype) -> torch.Tensor:
    """The tile's keys (or values) as [calls, kv heads, length, d]: a view of the pool, or a gather."""
    if t.slots is None and pool.dtype == dtype:
        offset = pool.storage_offset() + t.first_slot * pool.stride(0)
    else:
        pool = pool[t.first_slot: t.first_slot + t.length] if t.slots is None else pool.index_select(0, t.slots)
        pool = pool.to(dtype)
        offset = pool.storage_offset()
    return pool.as_strided((t.calls, pool.shape[1], t.length, pool.shape[2]), (0, pool.stride(1), pool.stride(0), 1),
                           offset)


def _slots(blocks: tuple[int, ...], block_size: int, length: int) -> torch.Tensor:
    """The blocks' slots, then slots of block 0 (all zeros) up to length."""
    slots = (torch.tensor(blocks).view(-1, 1) * block_size + torch.arange(block_size)).flatten()
    return torch.cat([slots, slots.new_zeros(max(0, length - len(slots)))])[:length]
