"""Incremental detokenization: each new token decodes a short window of ids, so a reply of n tokens costs O(n).

The window runs from `prefix_offset` (a few tokens already shown, for context: byte-level BPE and sentencepiece
decode a token differently after a space or inside a multi-byte character) to the end. Text that ends in an
incomplete character is held back until the next token completes it, as vLLM does.
"""
from dataclasses import dataclass, field

CONTEXT = 5  # tokens of already-shown text decoded with each new token


@dataclass
class Detokenizer:
    tokenizer: object
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0  # ids[prefix_offset:read_offset] decode to the end of `text`
    read_offset: int = 0

    def add(self, token: int) -> str:
        """Append a token; returns the text it completes (possibly empty)."""
        self.ids.append(token)
        shown = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(shown) or full.endswith("\ufffd"):
            return ""
        new = full[len(shown):]
        self.text += new
        self.prefix_offset = max(self.read_offset, len(self.ids) - CONTEXT)
        self.read_offset = len(self.ids)
        return new

    def flush(self) -> str:
        """The held-back text (an incomplete character), when no token will follow."""
        shown = self._decode(self.ids[self.prefix_offset:self.read_offset])
        rest = self._decode(self.ids[self.prefix_offset:])[len(shown):]
        self.text += rest
        return rest

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
