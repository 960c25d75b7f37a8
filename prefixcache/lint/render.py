"""A lint input rendered by the one renderer (prefixcache/prompt.py): its token ids are the ones the server caches."""
from dataclasses import dataclass
from functools import lru_cache

from prefixcache import prompt
from prefixcache.lint.requests import Request


@lru_cache(maxsize=4)
def load_tokenizer(model: str = ""):
    from prefixcache.models.catalog import model_path
    from prefixcache.models.loader import tokenizer

    return tokenizer(model_path(model))


@dataclass
class Rendered(prompt.Prompt):
    request: Request

    def reusable_end(self, prefix_tokens: int = 0) -> int:
        """Char offset where the reusable part ends: the last breakpoint if any; otherwise the start of the final
        message (the new turn); a template is reusable up to its end. `prefix_tokens` caps it."""
        marks = [s.end for s in self.spans if s.field.breakpoint]
        if marks:
            end = max(marks)
        elif self.request.template:
            end = len(self.text)
        else:
            last = self.spans[-1].field.message_index
            end = next(s.start for s in self.spans if s.field.message_index == last)
        if prefix_tokens and prefix_tokens < len(self.token_ids):
            end = min(end, self.offsets[prefix_tokens][0])
        return end


def render(req: Request, tokenizer) -> Rendered:
    """A template is the start of a conversation: no generation prompt after it."""
    p = prompt.render(tokenizer, req.fields, generation_prompt=not req.template)
    return Rendered(**vars(p), request=req)
