"""Chat rendering shared by both APIs: messages -> token ids, plus the token positions of marked block ends.

A caller ends a block that carries a cache breakpoint with MARK. We render the whole conversation with the
model's chat template, note where each MARK sits, strip the marks, and map those character offsets to token
positions through the fast tokenizer's offset mapping. Rendering then tokenizing the text ourselves (rather
than apply_chat_template(tokenize=True)) keeps the token ids and the positions consistent by construction.
Tools have no slot in the SmolLM2 template, so they are rendered as text at the start of the system message:
the prefix order is tools -> system -> messages.
"""
import json
from dataclasses import dataclass

MARK = "\ue000"  # a private-use character; stripped from client text before rendering


@dataclass
class Prompt:
    token_ids: list[int]
    marks: list[int]  # token position where each marked block ends, in order
    token_starts: list[int]  # character where each token starts in the rendered text
    message_spans: list[tuple[int, int]]  # character range of each message's content in the rendered text

    def where(self, token: int) -> str:
        """Where token `token` sits: 'message=k; offset=c' (k counts rendered messages, tools merged into the
        system one), or 'at=template' for the chat template's own tokens."""
        if token >= len(self.token_starts):
            return "at=end"
        char = self.token_starts[token]
        for k, (start, end) in enumerate(self.message_spans):
            if start <= char < end:
                return f"message={k}; offset={char - start}"
        return "at=template"


def clean(text: str) -> str:
    return text.replace(MARK, "")


def system_text(tools: list[str], system: str | None) -> str | None:
    """Tools (already serialized, possibly ending with MARK) before the system prompt, in one system message."""
    if not tools:
        return system
    parts = ["# Tools\n" + "\n".join(tools)] + ([system] if system else [])
    return "\n\n".join(parts)


def tool_json(tool: dict) -> str:
    return clean(json.dumps(tool, sort_keys=True, ensure_ascii=False))


def render(tokenizer, messages: list[dict]) -> Prompt:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = text.split(MARK)
    ends, offset = [], 0
    for piece in pieces[:-1]:
        offset += len(piece)
        ends.append(offset)
    plain = "".join(pieces)
    enc = tokenizer(plain, add_special_tokens=False, return_offsets_mapping=True)
    token_ends = [end for _, end in enc["offset_mapping"]]
    marks = [sum(1 for e in token_ends if e <= c) for c in ends]
    spans, cursor = [], 0
    for m in messages:
        content = clean(m["content"] or "")
        start = plain.find(content, cursor)
        spans.append((start, start + len(content)) if start >= 0 else (cursor, cursor))
        cursor = max(cursor, spans[-1][1])
    return Prompt(enc["input_ids"], marks, [start for start, _ in enc["offset_mapping"]], spans)


def encode_system(tokenizer, text: str) -> list[int]:
    """A system prompt rendered and tokenized exactly as it starts a chat request (for shared prefixes)."""
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
