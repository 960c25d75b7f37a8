"""Sampling for a batch of rows: logprobs of the raw logits, then biases and penalties (batched over the rows that
have any), then greedy or temperature / top-k / top-p with one seeded generator per sequence.

Every step here works on each row alone, so a row's result does not depend on its batch (DESIGN.md, invariant 1).
"""
import torch

from prefixcache.engine.sequence import Sequence, TokenLogprob


class Sampler:
    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)
        self.generators: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob]]:
        """Row i of logits [B, vocab] is seqs[i]'s next-token logits: each row's token and its raw logprob."""
        raw = torch.log_softmax(logits.float(), dim=-1)
        logits = self.penalize(logits, seqs)
        tokens = [self._pick(row, seq) for row, seq in zip(logits, seqs)]
        return list(zip(tokens, logprobs(raw, tokens, [seq.params.logprobs or 0 for seq in seqs])))

    def penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logit_bias, the min_tokens mask, then repetition, frequency and presence penalties (vLLM's order), on the
        rows whose sequences ask for any; the other rows are returned untouched."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.penalized]
        if not rows:
            return logits
        sub = logits[rows].float()
        group = [seqs[i] for i in rows]
        bias = [(r, t, b) for r, seq in enumerate(group) for t, b in seq.params.logit_bias.items()]
        if bias:
            r, t, b = zip(*bias)
            sub.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b, dtype=sub.dtype), accumulate=True)
        banned = [(r, t) for r, seq in enumerate(group) if len(seq.output_ids) < seq.params.min_tokens
                  for t in self.eos_token_ids + seq.params.stop_token_ids]
        if banned:
            r, t = zip(*banned)
            sub[torch.tensor(r), torch.tensor(t)] = float("-inf")
        seen = _occurrences(sub.shape, [seq.tokens for seq in group]) > 0
        rep = torch.tensor([seq.params.repetition_penalty for seq in group])[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        counts = _occurrences(sub.shape, [seq.output_ids for seq in group])
        freq = torch.tensor([seq.params.frequency_penalty for seq in group])[:, None]
        presence = torch.tensor([seq.params.presence_penalty for seq in group])[:, None]
        sub = sub - freq * counts - presence * (counts > 0)
        out = logits.float().clone()
        out[rows] = sub
        return out

    def verify(self, logits: torch.Tensor, seq: Sequence, draft: int | None) -> int:
        """The token at a position whose proposal is `draft` (a deterministic draft token, or None): greedy, the
        argmax; sampled, the draft with probability p(draft), else a sample of p without the draft, which leaves
        the distribution of the output exactly p (speculative sampling with a one-point draft)."""
        if seq.params.temperature == 0 or draft is None:
            return self._pick(logits, seq)
        probs, gen = self._probs(logits, seq.params), self._generator(seq)
        if torch.rand((), generator=gen) < probs[draft]:
            return draft
        probs[draft] = 0
        return int(torch.multinomial(probs, 1, generator=gen))

    def _pick(self, logits: torch.Tensor, seq: Sequence) -> int:
        if seq.params.temperature == 0:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self._probs(logits, seq.params), 1, generator=self._generator(seq)))

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self.generators.get(seq.id)
        if gen is None:
            gen = self.generators[seq.id] = torch.Generator()
            if seq.params.seed is not None:
                gen.manual_seed(seq.params.seed)
            else:
                gen.seed()
        return gen

    @staticmethod
    def _probs(logits: torch.Tensor, params) -> torch.Tensor:
        """The distribution a token is sampled from: temperature, then top-k, then top-p."""
        logits = logits / params.temperature
        if params.top_k:
            kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return probs

    def forget(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)


def logprobs(raw: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row i of raw [B, vocab] log-probabilities: tokens[i]'s logprob and the ks[i] most likely tokens."""
    chosen = raw.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    k = max(ks)
    top = torch.topk(raw, k) if k else None
    return [TokenLogprob(t, lp, tuple(zip(top.indices[i, :ki].tolist(), top.values[i, :ki].tolist())) if ki else ())
            for i, (t, lp, ki) in enumerate(zip(tokens, chosen, ks))]


def _occurrences(shape: torch.Size, token_lists: list[list[int]]) -> torch.Tensor:
    """[rows, vocab] counts of each token in each row's list."""
    counts = torch.zeros(shape)
    pairs = [(r, t) for r, tokens in enumerate(token_lists) for t in tokens]
    if pairs:
        r, t = zip(*pairs)
        counts.index_put_((torch.tensor(r), torch.tensor(t)), torch.ones(len(pairs)), accumulate=True)
    return counts
