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
    enc = tokenizer("".join(pieces), add_special_tokens=False, return_offsets_mapping=True)
    token_ends = [end for _, end in enc["offset_mapping"]]
    marks = [sum(1 for e in token_ends if e <= c) for c in ends]
    return Prompt(enc["input_ids"], marks)


def encode_system(tokenizer, text: str) -> list[int]:
    """A system prompt rendered and tokenized exactly as it starts a chat request (for shared prefixes)."""
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
