"""Structured output: a request's Guide (a JSON schema, any JSON object, a regex or a choice of strings) becomes an
xgrammar matcher that masks, row by row, the tokens the grammar does not allow next.

xgrammar's compiler caches compiled grammars by their source (schema text, regex), so a schema is compiled once
however many requests use it. Masking changes only which token is sampled, never a logit the model computed, so
warm == cold holds for guided requests too.
"""
import json
from dataclasses import dataclass
from typing import Literal

import torch
import xgrammar as xgr

KINDS = ("json_object", "json_schema", "regex", "choice")


@dataclass(frozen=True)
class Guide:
    kind: Literal["json_object", "json_schema", "regex", "choice"]
    spec: str = ""  # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON list of strings

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"guide kind must be one of {KINDS}, got {self.kind!r}")


class Grammars:
    """Compiles guides for one tokenizer and vocabulary; compiled grammars are cached by xgrammar."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)

    def matcher(self, guide: Guide) -> "Matcher":
        """A fresh matcher for one request; ValueError if the schema or regex does not compile."""
        try:
            if guide.kind in ("json_object", "json_schema"):
                schema = guide.spec if guide.kind == "json_schema" else '{"type": "object"}'
                grammar = self.compiler.compile_json_schema(schema, any_whitespace=False)
            elif guide.kind == "regex":
                grammar = self.compiler.compile_regex(guide.spec)
            else:
                grammar = self.compiler.compile_regex("|".join(_escape(c) for c in json.loads(guide.spec)))
        except RuntimeError as e:  # xgrammar's error for a schema or pattern it cannot compile
            raise ValueError(f"cannot compile the {guide.kind} guide: {e}") from None
        return Matcher(xgr.GrammarMatcher(grammar), self.info.vocab_size)


class Matcher:
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids next to -inf, in place (one row)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(logits.view(1, -1), self.bitmask, vocab_size=self.vocab_size)

    def accept(self, token: int) -> None:
        assert self.matcher.accept_token(token), "the sampler chose a token the mask forbids"

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()


def _escape(text: str) -> str:
    """A literal string as a regex (xgrammar's dialect: escape every metacharacter)."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)
