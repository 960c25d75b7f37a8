"""Sampling, one row at a time: the raw logprobs, then biases and penalties, then greedy or temperature / min-p /
top-k / top-p. A row's result depends on nothing but its row and its sequence (DESIGN.md, invariants 1 and 7), and
a sequence whose row has no allowed token or holds NaN fails alone (RowFault). A row's max, argmax and log-sum-exp
come from the model's ops in one pass (`logit_stats`; on our kernels 35 us a row of 49k against 200 for torch's
passes), the logprobs from them, as the prompt's logprobs do (engine/runner.py).

A sampled token's random draw is seeded by the sequence's seed and the token's position only. So a seeded
request gives the same text whether or not a speculative draft ran (or how long it was): verifying a draft token
is drawing that position's token and comparing, which accepts the draft with probability p(draft), as speculative
sampling with a one-point draft does, and leaves the output distribution exactly p.
"""
import math

import torch
import xxhash

from prefixcache.engine.sequence import Fault, Sequence, TokenLogprob
from prefixcache.models.rowwise import KernelOps, TorchOps

GREEDY_BELOW = 1e-5  # a temperature this small samples the argmax (dividing by it would overflow)


class RowFault(Exception):
    """A sequence's row that cannot be sampled."""

    def __init__(self, fault: Fault):
        super().__init__(fault.message)
        self.fault = fault


class Sampler:
    def __init__(self, eos_token_ids: list[int], ops: TorchOps | KernelOps | None = None):
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator()
        self.ops = ops or TorchOps()  # the model's: its logit_stats

    def sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, TokenLogprob]:
        """The sequence's next token from its row of logits [vocab] (already masked by its guide, if any), and the
        token's raw logprob (and the top ones asked for): log_softmax of the row, before penalties."""
        logits = logits.float()
        stats = row_stats(self.ops, logits)
        row = self.penalize(logits, seq)
        token = self.pick(row, seq, stats if row is logits else None)
        return token, logprob(logits, stats, token, seq.params.logprobs or 0)

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

    def pick(self, logits: torch.Tensor, seq: Sequence, stats: tuple[float, float, int] | None = None) -> int:
        """The token at the sequence's next position: the argmax, or a draw seeded by (seed, position). `stats`:
        the row's row_stats, if known."""
        best, _, argmax = stats or row_stats(self.ops, logits)
        if math.isnan(best):
            raise RowFault(Fault("the model produced NaN logits", internal=True))
        if best == float("-inf"):
            raise RowFault(Fault("no token is allowed next: the request's constraints (guide, min_tokens, "
                                 "stop_token_ids, logit_bias, allowed_token_ids) exclude every token",
                                 internal=False))
        if seq.params.temperature < GREEDY_BELOW:
            return argmax
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


def row_stats(ops: TorchOps | KernelOps, row: torch.Tensor) -> tuple[float, float, int]:
    """A row of logits' max (NaN if it holds NaN), log(sum(e^(x - max))) and the first index of its max."""
    stats, argmax = ops.logit_stats(row.float()[None])
    best, logsum = stats[0].tolist()
    return best, logsum, int(argmax[0])


def logprob(row: torch.Tensor, stats: tuple[float, float, int], token: int, k: int) -> TokenLogprob:
    """A token's raw logprob (log_softmax of its row of logits, whose row_stats these are) and the k likeliest
    tokens'."""
    top = torch.topk(row, k) if k else None
    return _entry(stats, token, float(row[token]), top.indices.tolist() if k else [], top.values.tolist() if k else [])


def ranked_logprobs(ops: TorchOps | KernelOps, rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logprob() of each row of logits [rows, vocab] and its token, with the token's rank: the top k and the ranks of
    all the rows at once (a row's are its own), each row's stats a row at a time (TorchOps' sums depend on the call's
    rows)."""
    own = rows.gather(1, torch.tensor(tokens)[:, None])
    ranks = ((rows > own).sum(1) + 1).tolist()
    top = torch.topk(rows, k, dim=1) if k else None
    ids, values = (top.indices.tolist(), top.values.tolist()) if k else ([[]] * len(tokens), [[]] * len(tokens))
    return [_entry(row_stats(ops, row), t, x, i, v, r)
            for row, t, x, i, v, r in zip(rows, tokens, own[:, 0].tolist(), ids, values, ranks)]


def _entry(stats: tuple[float, float, int], token: int, value: float, top_ids: list[int], top_values: list[float],
           rank: int | None = None) -> TokenLogprob:
    best, logsum, _ = stats
    top = tuple((t, x - best - logsum) for t, x in zip(top_ids, top_values))
    return TokenLogprob(token, value - best - logsum, top, rank)
