"""Speculation: speculative decoding inside the engine. Which requests draft, their drafts for a step (from the
drafter, engine/drafter.py) and the check of the forward's rows against them (Sampler.verify)."""
import logging
from collections.abc import Callable

import torch

from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.drafter import Drafter
from prefixcache.engine.sampler import Sampler
from prefixcache.engine.sequence import Plan, SamplingParams, Sequence, TokenLogprob

log = logging.getLogger("prefixcache.engine")


class Speculation:
    def __init__(self, drafter: Drafter, sampler: Sampler, blocks: BlockManager, num_tokens: int,
                 max_batch_tokens: int, max_model_len: int):
        self.drafter, self.sampler, self.blocks = drafter, sampler, blocks
        self.num_tokens, self.max_batch_tokens, self.max_model_len = num_tokens, max_batch_tokens, max_model_len
        self.counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}  # since start

    def applies(self, p: SamplingParams) -> bool:
        """Whether to draft for a request: never with features verified one token at a time elsewhere."""
        return self.drafter.enabled and p.speculative and not (p.penalized or p.logprobs is not None or p.guide)

    def drafts(self, plan: Plan) -> dict[int, list[int]]:
        """Draft tokens for the decoding sequences of the plan, within the step's token budget; each is appended to
        its sequence's tokens. A draft's blocks are made room for as any decode's are (evicting if need be), so
        acceptance never depends on how much of the pool other tenants' entries hold."""
        budget = self.max_batch_tokens - sum(n for _, n in plan)
        drafts = {}
        for seq, n in plan:
            if n != 1 or seq.num_uncomputed != 1 or not seq.output_ids or budget <= 0 or not seq.drafting.ready():
                continue
            k = min(seq.drafting.length, budget, seq.params.max_tokens - len(seq.output_ids) - 1,
                    self.max_model_len - len(seq.tokens) - 1)
            try:
                draft = self.drafter.propose(seq.tokens, seq.scope, k) if k > 0 else []
            except Exception:  # a fault in one sequence's drafting: it decodes on without speculation
                log.exception("drafting failed; the sequence stops drafting")
                seq.drafting.length, draft = 0, []
            if draft and self.blocks.grow(seq, 1 + len(draft)):
                seq.tokens += draft
                drafts[seq.id] = draft
                budget -= len(draft)
        return drafts

    def verify(self, seq: Sequence, logits: torch.Tensor, draft: list[int],
               append: Callable[[Sequence, int, TokenLogprob], None]) -> None:
        """Keep the longest prefix of the draft that the model itself produces, then the model's next token (each
        given to `append`). Row i of logits follows the sequence's last token and draft[:i]: computed in one
        forward, the same bits as one step at a time, and a sampled token's draw depends only on its position
        (Sampler.pick), so the output is the one without speculation, greedy or seeded."""
        accepted = 0
        for i in range(len(draft) + 1):
            proposal = draft[i] if i < len(draft) else None
            token, logprob = self.sampler.sample(logits[i], seq)
            append(seq, token, logprob)
            if token != proposal or seq.finish_reason is not None:
                break
            seq.num_computed += 1  # the accepted draft token's K/V, computed in this forward, stand
            accepted += 1
        seq.accepted_draft_tokens += accepted
        seq.drafting.verified(len(draft), accepted, self.num_tokens)
        for key, value in (("drafts", 1), ("draft_tokens", len(draft)), ("accepted_tokens", accepted)):
            self.counts[key] += value
