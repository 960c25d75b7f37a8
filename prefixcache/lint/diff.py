"""Where two prompts diverge, mapped back to the request: a pure function the server's miss explainer can call."""
from collections.abc import Sequence
from dataclasses import dataclass
from os.path import commonprefix

from prefixcache.options import default
from prefixcache.prompt import Prompt


@dataclass
class Location:
    field: str  # "system", "tools[1]", "messages[2].content", or "<template>" for chat-template markup
    message_index: int | None
    role: str
    char_offset: int  # within the field's text (within the rendered prompt for "<template>")


@dataclass
class Divergence:
    token_index: int  # first token of b that differs from a (== common_tokens)
    common_tokens: int
    reusable_tokens: int  # what an exact block cache reuses for b: whole blocks, the last prompt token recomputed
    reusable_blocks: int
    char: int  # in b's rendered prompt
    location: Location | None  # in b; None when b is entirely a prefix of a
    a_char: int | None = None  # in a's rendered prompt, when a is a rendered request
    a_location: Location | None = None


def explain(a: Prompt | Sequence[int], b: Prompt, block_size: int = default("block_size")) -> Divergence:
    """First divergence of request `b` from `a`: a rendered request, or token ids (e.g. the closest cached entry)."""
    a_ids = a.token_ids if isinstance(a, Prompt) else list(a)
    common = len(commonprefix([a_ids, b.token_ids]))
    blocks = min(common, len(b.token_ids) - 1) // block_size
    if isinstance(a, Prompt):  # the first differing character: more precise than the diverging token's start
        char = len(commonprefix([a.text, b.text]))
    else:
        char = b.offsets[common][0] if common < len(b.token_ids) else len(b.text)
    loc = locate(b, char) if common < len(b.token_ids) else None
    a_char = char if isinstance(a, Prompt) else None
    a_loc = locate(a, char) if isinstance(a, Prompt) and common < len(a.token_ids) else None
    return Divergence(common, common, blocks * block_size, blocks, char, loc, a_char, a_loc)


def locate(r: Prompt, char: int) -> Location:
    span = r.span_at(char)
    if span is None:
        return Location("<template>", None, "", char)
    return Location(span.field.name, span.field.message_index, span.field.role, char - span.start)


def context(text: str, char: int, width: int = 40) -> str:
    """The text around `char`, with the divergence marked by »«."""
    before, after = text[max(0, char - width):char], text[char:char + width]
    return f"…{before!r}»«{after!r}…".replace("'", "")
