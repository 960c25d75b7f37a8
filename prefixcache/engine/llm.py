"""LLM: the offline, vLLM-style API over the engine."""
from prefixcache.cache.policy import Breakpoint
from prefixcache.cache.scope import CacheScope
from prefixcache.config import Config
from prefixcache.engine.engine import Engine
from prefixcache.engine.sequence import RequestOutput, SamplingParams, best
from prefixcache.prompt import fields, render


class LLM:
    def __init__(self, model: str = "", enable_prefix_cache: bool = True, **config):
        self.engine = Engine(Config(model=model, enable_prefix_cache=enable_prefix_cache, **config))
        self.tokenizer = self.engine.tokenizer
        self.exactness = self.engine.exactness  # how this CPU keeps a token's logits batch-invariant

    def generate(self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | None = None,
                 scope: CacheScope | None = None, breakpoints: list[Breakpoint] = (),
                 priority: int = 0, adapter: str = "") -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids) concurrently; outputs in prompt order, params.n per prompt
        (the best of params.best_of). Cache entries written with a higher priority are evicted later. `adapter`
        names a LoRA adapter of the engine's lora_modules."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        token_lists = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        requests = [self.engine.add_request(t, params, scope, breakpoints, priority, adapter).samples
                    for t in token_lists]
        while any(s.finish_reason is None for samples in requests for s in samples):
            self.engine.step()
        return [o for samples in requests for o in best([s.output() for s in samples], params.n)]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             scope: CacheScope | None = None, tools: list[dict] | None = None) -> RequestOutput | list[RequestOutput]:
        """One conversation gives one output (n > 1: a list of n); a list of conversations gives a list. OpenAI-style
        messages and tools, rendered as the server renders them."""
        single = bool(messages) and isinstance(messages[0], dict)
        prompts = [self.encode_chat(m, tools) for m in ([messages] if single else messages)]
        outs = self.generate(prompts, params, scope)
        return outs[0] if single and len(outs) == 1 else outs

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not messages:
            raise ValueError("messages is empty")
        return render(self.tokenizer, fields({"messages": messages, "tools": tools})).token_ids

    def pin(self, prompt: str | list[int], scope: CacheScope | None = None, pinned: bool = True) -> int:
        return self.engine.cache.pin(self.encode(prompt) if isinstance(prompt, str) else list(prompt), scope, pinned)

    def cache_stats(self) -> dict:
        return self.engine.stats()
