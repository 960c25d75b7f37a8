"""Paged attention on our kernel: every query token of a step in one call per layer, over the block table.

A (token, head) row runs its own online softmax over each span of 256 keys, in key blocks of 64 (aligned to
absolute positions), and folds the spans' states in order; each block is found through its sequence's block table
where it lies: no gather, no padding, no tiles. Its bits depend on its query and its keys only, whatever the batch,
the chunking, the threads or the blocks' places in the pool. A step with fewer units than two a thread (one or two
sequences decoding) runs each span apart, then folds them: the same arithmetic, on every thread.
Items group tokens that read the same blocks (one sequence's tokens; decode tokens of sequences whose first block read
is the same, as n samples of one prompt or a shared cached prefix), so those blocks are loaded once per item.
"""
from dataclasses import dataclass

import torch

from prefixcache.models.attention import Queries
from prefixcache.models.rowwise import Packed

ITEM_TOKENS = 16  # as csrc/kernels.h


@dataclass
class PagedPlan:
    pos: torch.Tensor  # [tokens] int64
    tables: torch.Tensor  # [sequences, max blocks] int32
    row_seq: torch.Tensor  # [tokens] int32: the token's row in tables
    order: torch.Tensor  # [tokens] int32: tokens, item after item
    items: torch.Tensor  # [items + 1] int32: offsets into order
    block_size: int
    window: int = 0  # a token reads its last `window` keys, its own included; 0: all


def plan(groups: list[Queries], num_tokens: int, block_size: int, window: int = 0) -> PagedPlan:
    pos = torch.zeros(num_tokens, dtype=torch.int64)
    row_seq = torch.zeros(num_tokens, dtype=torch.int32)
    width = max(len(g.block_table) for g in groups)
    tables = torch.full((len(groups), width), -1, dtype=torch.int32)  # past a table: refused if read
    decode: dict[int, list[int]] = {}  # the first block read (a window's: the blocks before may be gone) -> tokens
    order, items = [], [0]
    for s, g in enumerate(groups):
        rows = range(g.first, g.first + len(g.positions))
        pos[rows.start:rows.stop] = torch.tensor(g.positions)
        row_seq[rows.start:rows.stop] = s
        tables[s, :len(g.block_table)] = torch.tensor(g.block_table, dtype=torch.int32)
        if len(rows) == 1:
            first = max(0, g.positions[0] - window + 1) // block_size if window else 0
            decode.setdefault(g.block_table[first], []).append(rows.start)
            continue
        for i in range(0, len(rows), ITEM_TOKENS):
            order += rows[i:i + ITEM_TOKENS]
            items.append(len(order))
    for tokens in decode.values():
        for i in range(0, len(tokens), ITEM_TOKENS):
            order += tokens[i:i + ITEM_TOKENS]
            items.append(len(order))
    assert len(order) == num_tokens, "every token belongs to one sequence's queries"
    return PagedPlan(pos, tables, row_seq, torch.tensor(order, dtype=torch.int32),
                     torch.tensor(items, dtype=torch.int32), block_size, window)


def store(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write tokens' keys and values [n, kv heads, d] at their slots of one layer's pool [slots, kv heads, d], as
    the kernel reads them: each 16 slots' keys as [kv heads, d, 16] (a row's scores over 16 keys are then one
    vector per dimension, with no transpose) and values as [kv heads, 16, d] (a head's in one run of memory)."""
    s, h, d = k_pool.shape
    k_pool.view(s // 16, h, d, 16)[slots // 16, :, :, slots % 16] = k
    v_pool.view(s // 16, h, 16, d)[slots // 16, :, slots % 16] = v



def laid_out(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool holding keys and values [slots, kv heads, d] at slots 0, 1, ... (for checks and tests)."""
    kp, vp = torch.zeros_like(k), torch.zeros_like(v)
    store(kp, vp, k, v, torch.arange(len(k)))
    return kp, vp


def moved(k: torch.Tensor, v: torch.Tensor, table: list[int], gen: torch.Generator,
          block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The same keys and values with each block of `table` moved to another, at random (for checks and tests): the
    new k, v and table."""
    new = (1 + torch.randperm(len(table), generator=gen)).tolist()
    k2, v2 = k.clone(), v.clone()
    for a, b in zip(table, new):
        src, dst = slice(a * block_size, (a + 1) * block_size), slice(b * block_size, (b + 1) * block_size)
        k2[dst], v2[dst] = k[src], v[src]
    return k2, v2, new


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               slots: torch.Tensor, heads: int, kv_heads: int, isa: int) -> torch.Tensor:
    """qkv [rows, (heads + 2 kv heads) * d] -> the queries after RoPE [rows, heads, d], with the keys (after RoPE)
    and values of the first len(slots) rows stored as `store` lays them out: one op for what RoPE and `store` do,
    bit for bit (each product rounded, then the sum, as torch computes x * cos + rotate_half(x) * sin)."""
    return torch.ops.prefixcache.rope_store(qkv.contiguous(), cos.contiguous(), sin.contiguous(), k_pool, v_pool,
                                            slots, heads, kv_heads, isa)


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, p: PagedPlan, isa: int,
           scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [tokens, heads, d] over one layer's pool k, v (written by `store`) -> [tokens, heads, d], q.k scaled by
    `scale` (head_dim ** -0.5 by default), with each head's sink logit [heads] in its softmax's denominator if
    given (added once a row, after its spans are folded)."""
    return torch.ops.prefixcache.attend(q.contiguous(), k_pool, v_pool, p.pos, p.tables, p.row_seq, p.order, p.items,
                                        p.block_size, scale or q.shape[-1] ** -0.5, isa, p.window, sinks)


def layers(x: torch.Tensor, Ls: list[dict], eps: float, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, pool_rows: list[int], slots: torch.Tensor, heads: int, p: PagedPlan, scale: float,
           isa: int) -> torch.Tensor:
    """Decoder layers of the plain form (RMSNorm, attention, RMSNorm, SwiGLU, each added to x), each on its weights
    Ls[i] (models/llama.py) and its keys and values at row pool_rows[i] of the pool's k, v, all under one plan, in one
    op: the ops Llama.forward calls for each in turn, with the same bits."""
    weights: list[Packed] = [L[name] for L in Ls for name in ("qkv", "o", "gate_up", "down")]
    return torch.ops.prefixcache.layers(
        x.contiguous(), [L["ln1"] for L in Ls], [L["ln2"] for L in Ls], eps, [t for w in weights for t in w.data],
        [i for w in weights for i in w.ids], [r for w in weights for r in w.rows], [len(w.data) for w in weights],
        [L["qkv_bias"] for L in Ls], cos.contiguous(), sin.contiguous(), k, v, pool_rows, slots, heads, p.pos,
        p.tables, p.row_seq, p.order, p.items, p.block_size, scale, p.window, isa)


def runs(kinds: list, alone: bool) -> list[list[int]]:
    """The layers in runs of consecutive layers of one kind (each layer a run of its own when `alone`)."""
    runs: list[list[int]] = []
    for i, kind in enumerate(kinds):
        if runs and not alone and kinds[runs[-1][0]] == kind:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
