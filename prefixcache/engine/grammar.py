"""Structured output: a request's Guide (a JSON schema, any JSON object, a regex or a choice of strings) becomes an
xgrammar matcher that masks, row by row, the tokens the grammar does not allow next.

Compiled grammars outlive their request, so they are kept per scope (DESIGN.md, invariant 7): a tenant's request
is fast only with a guide its own scope compiled before; a shared cache would tell it which schemas others use.
Each owner (tenant and labels) keeps at most MAX_GRAMMARS of them in MAX_GRAMMAR_BYTES, least recently used out
first, so no tenant can evict another's. Compiling runs on a thread of its own (xgrammar releases the GIL), while
the engine serves everyone else; the request waits for it the way it waits for a tier lookup. Masking changes
only which token is sampled, never a logit the model computed, so warm == cold holds for guided requests too.
"""
import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch
import xgrammar as xgr

from prefixcache.cache.scope import CacheScope

KINDS = ("json_object", "json_schema", "regex", "choice")
MAX_GRAMMARS = 64  # compiled grammars kept per owner
MAX_GRAMMAR_BYTES = 64 << 20  # and their memory, per owner


@dataclass(frozen=True)
class Guide:
    kind: Literal["json_object", "json_schema", "regex", "choice"]
    spec: str = ""  # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON list of strings

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"guide kind must be one of {KINDS}, got {self.kind!r}")


class Grammars:
    """Compiles guides for one tokenizer and vocabulary, on its own thread, into a cache per scope. Called from
    the engine thread only."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # the tokenizer's tables take a moment: built at once, before any request can wait for them
        self.compiler = self.thread.submit(_compiler, tokenizer, vocab_size, list(stop_token_ids))
        self.cache: dict[tuple, OrderedDict[tuple[bytes, Guide], Future]] = {}  # owner -> (scope, guide) -> grammar

    def compile(self, scope: CacheScope, guide: Guide) -> Future:
        """The compiled grammar of a guide for a request of this scope: a future, done at once if the scope compiled
        it before. It raises ValueError if the schema or regex does not compile."""
        entries = self.cache.setdefault(scope.owner, OrderedDict())
        key = (scope.key, guide)
        if key not in entries:
            entries[key] = self.thread.submit(self._compile, guide)
        entries.move_to_end(key)
        self._bound(entries)
        return entries[key]

    def matcher(self, grammar: xgr.CompiledGrammar) -> "Matcher":
        return Matcher(xgr.GrammarMatcher(grammar), self.vocab_size)

    def purge_tenant(self, tenant: str, labels: tuple[str, ...]) -> None:
        self.cache.pop((tenant, labels), None)

    def clear(self) -> None:
        self.cache.clear()

    def _compile(self, guide: Guide) -> xgr.CompiledGrammar:
        compiler = self.compiler.result()
        try:
            if guide.kind in ("json_object", "json_schema"):
                schema = guide.spec if guide.kind == "json_schema" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if guide.kind == "regex":
                return compiler.compile_regex(guide.spec)
            return compiler.compile_regex("|".join(_escape(c) for c in json.loads(guide.spec)))
        except RuntimeError as e:  # xgrammar's error for a schema or pattern it cannot compile
            raise ValueError(f"cannot compile the {guide.kind} guide: {e}") from None

    @staticmethod
    def _bound(entries: OrderedDict) -> None:
        """Drop the owner's least recently used grammars past its count and byte bounds (the newest stays)."""
        def size(f: Future) -> int:
            return f.result().memory_size_bytes if f.done() and not f.exception() else 0
        while len(entries) > 1 and (len(entries) > MAX_GRAMMARS
                                    or sum(size(f) for f in entries.values()) > MAX_GRAMMAR_BYTES):
            entries.popitem(last=False)


def _compiler(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the cache is ours, per scope


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
        if not self.matcher.accept_token(token):  # an engine bug, but it fails this sequence alone
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()


def _escape(text: str) -> str:
    """A literal string as a regex (xgrammar's dialect: escape every metacharacter)."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)
