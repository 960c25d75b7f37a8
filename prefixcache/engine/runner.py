"""Turns a scheduled step into one model forward: flat token batch, KV slots, each sequence's queries, logits."""
from typing import Callable

import numpy as np
import torch
import xxhash

from prefixcache import kernels
from prefixcache.cache.pool import KVPool
from prefixcache.config import Config
from prefixcache.engine.sampler import ranked_logprobs
from prefixcache.engine.sequence import Plan, Sequence
from prefixcache.models.attention import Queries
from prefixcache.models.llama import Batch, Llama
from prefixcache.models.loader import Weights
from prefixcache.models.lora import Adapter
from prefixcache.models.probe import probe
from prefixcache.models.rowwise import KernelOps, TorchOps


class ModelRunner:
    def __init__(self, model: Llama, pool: KVPool, head_rows: int, adapters: dict[str, Adapter]):
        self.model = model
        self.pool = pool
        self.bs = pool.block_size
        self.head_rows = head_rows  # the LM head's calls have at most this many rows: the counts the probe verified
        self.adapters = adapters  # LoRA adapters by fingerprint: a sequence's is its scope's `adapter`

    def run(self, plan: Plan, verify: set[int] = frozenset(),
            between: Callable[[], None] | None = None) -> dict[int, torch.Tensor]:
        """Compute the planned tokens. Returns next-token logits [rows, vocab] for sequences that reached their last
        token (one row; a row per computed token for the sequences in `verify`, whose drafts they check); the
        sequences that want prompt logprobs get those of the prompt tokens their computed positions predict.
        `between` is called before each layer (Llama.forward)."""
        ids, pos, rows, owners, spans = [], [], [], [], []
        parts = 1 + self.pool.local_pages  # a block table, slots and queries for each part of a block (KVPool.place)
        slots: list[list[np.ndarray]] = [[] for _ in range(parts)]
        queries: list[list[Queries]] = [[] for _ in range(parts)]
        adapter_rows: dict[str, list[int]] = {}
        for seq, m in plan:
            first, start = len(ids), seq.num_computed
            if seq.scope.adapter:
                adapter_rows.setdefault(seq.scope.adapter, []).extend(range(first, first + m))
            at = np.arange(start, start + m)
            positions = at.tolist()
            for part, table in enumerate(self.pool.tables(seq.block_table)):
                queries[part].append(Queries(first, positions, start + m, table))
                pages = np.asarray(table, dtype=np.int64)[at // self.bs]
                assert pages.all(), "a token's K/V written to a block without its part"
                slots[part].append(pages * self.bs + at % self.bs)
            ids += seq.tokens[start:start + m]
            pos += positions
            if start + m == len(seq.tokens):
                owners.append((seq.id, len(rows)))
                rows += range(first if seq.id in verify else len(ids) - 1, len(ids))
            n_prompt = min(start + m, seq.num_prompt - 1) - start
            if seq.prompt_logprobs is not None and n_prompt > 0:
                spans.append((seq, start, range(first, first + n_prompt)))
        batch = Batch(torch.tensor(ids), torch.tensor(pos), [torch.from_numpy(np.concatenate(s)) for s in slots],
                      queries, [(self.adapters[a], torch.tensor(r)) for a, r in adapter_rows.items()])
        hidden = self.model.forward(batch, self.pool, between)
        logits = self._logits(hidden, rows, spans)
        ends = [i for _, i in owners[1:]] + [len(rows)]
        return {sid: logits[i:end] for (sid, i), end in zip(owners, ends)}

    def _logits(self, hidden: torch.Tensor, rows: list[int], spans: list[tuple[Sequence, int, range]]) -> \
            torch.Tensor | None:
        """The next-token logits of `rows`, and each span's prompt logprobs (a sequence's rows after position
        `start`), in the same LM head calls of at most head_rows rows (the counts the exactness probe verified): a
        call reads the whole head, so calls of the prompt rows' own cost 3-4 ms each on SmolLM2, more than the rows in
        them. A call's prompt rows are made logprobs at once, so a chunk's logits are never held whole (Gemma 3's,
        for 512 tokens: 0.5 GB)."""
        order, at, places = list(rows), len(rows), []
        for seq, start, span in spans:
            places.append((seq, start, at, at + len(span)))
            order += span
            at += len(span)
        nexts = []
        for i in range(0, len(order), self.head_rows):
            piece = self.model.logits(hidden[order[i:i + self.head_rows]])
            if i < len(rows):
                nexts.append(piece[:len(rows) - i])
            for seq, start, lo, hi in places:
                a, b = max(lo, i), min(hi, i + len(piece))
                if a < b:
                    p = start + a - lo + 1  # the first prompt position these rows predict
                    seq.prompt_logprobs[p:p + b - a] = ranked_logprobs(self.model.ops, piece[a - i:b - i].float(),
                                                                       seq.tokens[p:p + b - a],
                                                                       seq.params.prompt_logprobs)
        return (nexts[0] if len(nexts) == 1 else torch.cat(nexts)) if nexts else None  # one: not copied again


def build_model(config: Config, weights: Weights, max_model_len: int) -> tuple[Llama, str]:
    """The model on the ops that can run it, probed for exactness (model.exact), and its fingerprint: cached KV is
    reused only by the same weights under the same arithmetic, stored in the same dtype (a disk or Redis tier may hold
    KV of other replicas: on the torch path, on kernels built from other sources, or kept in bfloat16, its bits are
    not ours; with the same keys, replicas would take each other's records as bad)."""
    ops, status = choose_ops(config, weights.config.head_dim)
    model = Llama(weights, config.attn_tile, ops, max_model_len)
    model.exact = probe(model, config.exactness, config.max_batch_tokens, config.max_num_seqs, status)
    arithmetic = model.ops.arithmetic(model.exact.cpu)
    return model, xxhash.xxh3_128_hexdigest(f"{weights.fingerprint} {arithmetic} kv:{config.kv_storage_dtype}".encode())


def choose_ops(config: Config, head_dim: int) -> tuple[KernelOps | TorchOps, str]:
    """Our kernels where they can run, else torch's; and what runs, or why the kernels do not."""
    unfit = [why for why, bad in (("float32 only", config.dtype != "float32" or config.kv_storage_dtype != "float32"),
                                  (f"exactness={config.exactness!r} forces the torch path", config.exactness != "auto"),
                                  ("block size and head size must be multiples of 16",
                                   config.block_size % 16 or head_dim % 16)) if bad]
    if config.kernels == "off" or unfit:
        return TorchOps(), f"off: {'; '.join(unfit) or 'kernels=off'}"
    choice = kernels.choose(config.kernels)
    return (KernelOps(choice.isa) if choice.isa else TorchOps()), choice.status
