"""Greedy and temperature / top-k / top-p sampling, one seeded generator per request."""
import torch

from prefixcache.engine.sequence import SamplingParams


class Sampler:
    def __init__(self):
        self.generators: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seq_id: int, params: SamplingParams) -> int:
        if params.temperature == 0:
            return int(torch.argmax(logits))
        gen = self.generators.get(seq_id)
        if gen is None:
            gen = self.generators[seq_id] = torch.Generator()
            if params.seed is not None:
                gen.manual_seed(params.seed)
            else:
                gen.seed()
        logits = logits / params.temperature
        if params.top_k:
            kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    def forget(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
