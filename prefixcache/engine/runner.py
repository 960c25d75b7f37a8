"""Turns a scheduled step into one model forward: flat token batch, KV slots, attention groups, logits."""
import math

import torch

from prefixcache.cache.pool import KVPool
from prefixcache.engine.sequence import Sequence
from prefixcache.models.llama import AttnGroup, Batch, Llama


class ModelRunner:
    def __init__(self, model: Llama, pool: KVPool):
        self.model = model
        self.pool = pool
        self.bs = pool.block_size

    def run(self, plan: list[tuple[Sequence, int]]) -> tuple[dict[int, torch.Tensor], dict[int, tuple[int, torch.Tensor]]]:
        """Compute the planned tokens. Returns next-token logits for sequences that reached their last token, and
        for sequences that want prompt logprobs, (first position, hidden states) of the computed positions that
        predict a prompt token."""
        decode = [seq for seq, n in plan if n == 1]
        parts = ([(decode, 1)] if decode else []) + [([seq], n) for seq, n in plan if n > 1]
        ids, pos, slots, groups, rows, owners, prompt_rows = [], [], [], [], [], [], {}
        for members, m in parts:
            groups.append(self._group(len(ids), members, m))
            for seq in members:
                first = len(ids)
                for p in range(seq.num_computed, seq.num_computed + m):
                    ids.append(seq.tokens[p])
                    pos.append(p)
                    slots.append(seq.block_table[p // self.bs] * self.bs + p % self.bs)
                if seq.num_computed + m == len(seq.tokens):
                    rows.append(len(ids) - 1)
                    owners.append(seq.id)
                n_prompt = min(seq.num_computed + m, seq.num_prompt - 1) - seq.num_computed
                if seq.prompt_logprobs is not None and n_prompt > 0:
                    prompt_rows[seq.id] = (seq.num_computed, first, first + n_prompt)
        hidden = self.model.forward(Batch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), groups), self.pool)
        logits = self.model.logits(hidden[rows]) if rows else None
        prompt = {sid: (p, hidden[a:b]) for sid, (p, a, b) in prompt_rows.items()}
        return {sid: logits[i] for i, sid in enumerate(owners)}, prompt

    def _group(self, start: int, members: list[Sequence], m: int) -> AttnGroup:
        tile = self.model.tile
        ctx = max(seq.num_computed + m for seq in members)
        n_blocks = math.ceil(ctx / tile) * (tile // self.bs)
        tables = torch.zeros((len(members), n_blocks), dtype=torch.long)
        q_pos = torch.empty((len(members), m), dtype=torch.long)
        for i, seq in enumerate(members):
            bt = seq.block_table[:n_blocks]
            tables[i, :len(bt)] = torch.tensor(bt)
            q_pos[i] = torch.arange(seq.num_computed, seq.num_computed + m)
        return AttnGroup(start, len(members), m, tables, q_pos)
