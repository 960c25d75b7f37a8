"""Sampling, one row at a time: the raw logprobs, then biases and penalties, then greedy or temperature / min-p /
top-k / top-p. A row's result depends on nothing but its row and its sequence (DESIGN.md, invariants 1 and 7), and a
sequence whose row has no allowed token or holds NaN fails alone (RowFault).

A sampled token's random draw is seeded by the sequence's seed and the token's position only. So a seeded
request gives the same text whether or not a speculative draft ran (or how long it was): verifying a draft token
is drawing that position's token and comparing, which accepts the draft with probability p(draft), as speculative
sampling with a one-point draft does, and leaves the output distribution exactly p.
"""
import math

import torch
import xxhash

from prefixcache.engine.sequence import Fault, Sequence, TokenLogprob

GREEDY_BELOW = 1e-5  # a temperature this small samples the argmax (dividing by it would overflow)


class RowFault(Exception):
    """A sequence's row that cannot be sampled."""

    def __init__(self, fault: Fault):
        super().__init__(fault.message)
        self.fault = fault


class Sampler:
    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator()

    def sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, TokenLogprob]:
        """The sequence's next token from its row of logits [vocab] (already masked by its guide, if any), and the
        token's raw logprob."""
        raw = torch.log_softmax(logits.float()[None], dim=-1)
        token = self.pick(self.penalize(logits, seq), seq)
        return token, logprobs(raw, [token], [seq.params.logprobs or 0])[0]

    def penalize(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """allowed_token_ids, logit_bias, the min_tokens mask, bad_words, then repetition, frequency and presence
        penalties (vLLM's order); the row itself if the sequence asks for none."""
        p = seq.params
        if not p.penalized:
            return logits
        row = logits.float().clone()
        if p.allowed_token_ids is not None:
            allowed = torch.zeros(len(row), dtype=torch.bool)
            allowed[p.allowed_token_ids] = True
            row = row.masked_fill(~allowed, float("-inf"))
        if p.logit_bias:
            bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
            row.index_put_((torch.tensor(list(p.logit_bias)),), bias, accumulate=True)
        if len(seq.output_ids) < p.min_tokens:
            row[self.eos_token_ids + p.stop_token_ids] = float("-inf")
        out = seq.output_ids
        for word in p.bad_words:  # its last token is banned where the output ends with the rest of it
            if len(word) <= len(out) + 1 and out[len(out) - len(word) + 1:] == word[:-1]:
                row[word[-1]] = float("-inf")
        if p.repetition_penalty != 1:
            seen = torch.zeros(len(row), dtype=torch.bool)
            seen[seq.tokens] = True
            row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=len(row))[:len(row)]
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        return row

    def pick(self, logits: torch.Tensor, seq: Sequence) -> int:
        """The token at the sequence's next position: the argmax, or a draw seeded by (seed, position)."""
        if torch.isnan(logits).any():
            raise RowFault(Fault("the model produced NaN logits", internal=True))
        if logits.max() == float("-inf"):
            raise RowFault(Fault("no token is allowed next: the request's constraints (guide, min_tokens, "
                                 "stop_token_ids, logit_bias, allowed_token_ids) exclude every token",
                                 internal=False))
        if seq.params.temperature < GREEDY_BELOW:
            return int(torch.argmax(logits))
        self.generator.manual_seed(xxhash.xxh3_64_intdigest(f"{seq.seed}:{len(seq.tokens)}".encode()) >> 1)
        # inverse CDF: one uniform draw against the running sum, in float64 so that a vocabulary's worth of small
        # probabilities adds up exactly enough; a token of probability 0 adds no width and is never drawn.
        # (torch.multinomial draws an exponential per token: 30x the time, per row and step)
        cdf = torch.cumsum(self._probs(logits, seq.params), 0, dtype=torch.float64)
        u = torch.rand(1, generator=self.generator, dtype=torch.float64)
        token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        return token if token < len(cdf) else int(torch.searchsorted(cdf, cdf[-1]))  # u * sum rounded up to sum

    @staticmethod
    def _probs(logits: torch.Tensor, params) -> torch.Tensor:
        """The distribution a token is sampled from: temperature, then min-p, top-k and top-p (vLLM's order)."""
        logits = (logits.float() - logits.max()) / params.temperature  # the best token at 0: nothing overflows
        if params.min_p:  # p < min_p * p_max, with the likeliest token's logit at 0
            logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
        if params.top_k:
            kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return probs


def logprobs(raw: torch.Tensor, tokens: list[int], ks: list[int], ranks: bool = False) -> list[TokenLogprob]:
    """Row i of raw [B, vocab] log-probabilities: tokens[i]'s logprob and the ks[i] most likely tokens (and its
    rank, if asked)."""
    chosen_t = raw.gather(1, torch.tensor(tokens)[:, None])
    chosen = chosen_t[:, 0].tolist()
    rank = ((raw > chosen_t).sum(1) + 1).tolist() if ranks else [None] * len(tokens)
    k = max(ks)
    top = torch.topk(raw, k) if k else None
    return [TokenLogprob(t, lp, tuple(zip(top.indices[i, :ki].tolist(), top.values[i, :ki].tolist())) if ki else (),
                         r) for i, (t, lp, ki, r) in enumerate(zip(tokens, chosen, ks, rank))]
