"""Render a request through the model's chat template and tokenize it, keeping a map from characters back to fields.

Prefix order is tools -> system -> messages. Tools go at the top of the system message, one JSON text each as sent
(SmolLM2's chat template has no tools section), so tool order and serialization show up in the prefix."""
import bisect
import os
from dataclasses import dataclass
from functools import lru_cache

from prefixcache.lint.requests import BLOCK_SEP, Field, Request


@lru_cache(maxsize=4)
def load_tokenizer(model: str = ""):
    from transformers import AutoTokenizer

    from prefixcache.config import default_model_path
    from prefixcache.models.loader import converted_folder

    path = model or default_model_path()
    return AutoTokenizer.from_pretrained(path if os.path.isdir(path) else converted_folder(path))


@dataclass
class Span:
    field: Field
    start: int  # char range of the field's text inside the rendered prompt
    end: int


@dataclass
class Rendered:
    request: Request
    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    spans: list[Span]

    def token_at(self, char: int) -> int:
        """Index of the token that contains (or first follows) character `char`."""
        return bisect.bisect_right([end for _, end in self.offsets], char)

    def span_at(self, char: int) -> Span | None:
        return next((s for s in self.spans if s.start <= char < s.end or s.start == char == s.end), None)

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
        if prefix_tokens and prefix_tokens < len(self.ids):
            end = min(end, self.offsets[prefix_tokens][0])
        return end


def render(req: Request, tokenizer) -> Rendered:
    chat: list[tuple[tuple[str, int | None], list[Field]]] = []  # ((role, message index), fields joined by BLOCK_SEP)
    tools = [f for f in req.fields if f.name.startswith("tools[")]
    for f in req.fields:
        if f.name.startswith("tools["):
            continue
        key = ("system", None) if f.message_index is None else (f.role, f.message_index)
        if chat and chat[-1][0] == key:
            chat[-1][1].append(f)
        else:
            chat.append((key, [f]))
    if tools:
        if chat and chat[0][0][0] == "system":
            chat[0][1][:0] = tools
        else:
            chat.insert(0, (("system", None), tools))
    messages = [{"role": key[0], "content": BLOCK_SEP.join(f.text for f in fs)} for key, fs in chat]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=not req.template, tokenize=False)
    spans, cursor = [], 0
    for (key, fs), m in zip(chat, messages):
        base = text.find(m["content"], cursor)
        assert base >= 0, "the chat template must embed message content verbatim"
        for f in fs:
            spans.append(Span(f, base, base + len(f.text)))
            base += len(f.text) + len(BLOCK_SEP)
        cursor = spans[-1].end
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return Rendered(req, text, list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]], spans)
