"""Structured output: a request's Guide (a JSON schema, any JSON object, a regex or a choice of strings) becomes an
xgrammar matcher that masks, row by row, the tokens the grammar does not allow next.

Compiled grammars outlive their request, so they are kept per scope (DESIGN.md, invariant 7): a tenant's request is
fast only with a guide its own scope compiled before; a shared cache would tell it which schemas others use. Each
scope has an xgrammar compiler of its own, whose cache holds at most MAX_GRAMMAR_BYTES (xgrammar's cache also speeds
up a single compile, 8x on a schema that repeats a sub-schema, so it stays on); a tenant keeps TENANT_SCOPES of them
over all its label sets and salts (identity tokens bring as many label sets as their groups make), least recently
used out first, and the server MAX_SCOPES in all: past that, the tenant holding the most gives up its least recently
used one, so the memory is bounded and no tenant evicts another's below an equal part. Compiling runs on a thread of
its own at a low priority (xgrammar releases the GIL), while the engine serves everyone else; the request waits for
it the way it waits for a tier lookup. The thread takes the tenants' guides by weight (cache/fair.py), so one
tenant's many new schemas delay its own requests only; a tenant with COMPILES guides waiting has its next guided
request refused (a ValueError: a 400). A guide new to its scope is compiled first in a worker process, under
limits of CPU time and memory that stop it (engine/grammar_trial.py): a guide past them is refused too. Masking
changes only which token is sampled, never a logit the model computed, so warm == cold holds for guided requests
too.
"""
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch
import xgrammar as xgr
import xxhash

from prefixcache.cache.fair import FairThread
from prefixcache.cache.scope import CacheScope
from prefixcache.cache.tenant_lru import TenantLru
from prefixcache.engine.grammar_trial import Trial
from prefixcache.engine.guide import Guide

TENANT_SCOPES = 4  # scopes (label sets, salts) of one tenant with compiled grammars kept
MAX_SCOPES = 16  # ... of all tenants (at most 1 GiB of compiled grammars)
MAX_GRAMMAR_BYTES = 64 << 20  # compiled grammars kept per scope (a 300-field schema compiles to about 22 MB)
TRIED = 4096  # guides that passed the trial remembered per scope (past that, forgotten and tried again)
COMPILES = 64  # guides one tenant may have waiting to compile (a new 300-field schema takes 2-12 s)


class Busy(ValueError):
    """The tenant has as much work waiting in a shared queue as it may: the request is refused now, to be retried
    (the server's 429), not because it is wrong."""
# The grammar thread's niceness. Measured (bench/features.py, SmolLM2 decoding on 2 threads of an AMD EPYC, AVX2,
# 2 cores, while a new 300-field schema compiles): at 0 the decode's median gap rose from about 0.08 s to 0.27 s
# and the schema took 2 s; at 5, 0.11 s and 5 s; at 10, 0.08 s and 10-12 s (a second with the engine idle).
NICE = 10


class Grammars:
    """Compiles guides for one tokenizer and vocabulary, on its own thread, into a cache per scope. Called from
    the engine thread only."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.thread = FairThread("grammar", COMPILES, initializer=_low_priority)
        # the tokenizer's tables take a moment: built at once (tenant "": the engine's), before any request waits
        self.info = self.thread.submit("", xgr.TokenizerInfo.from_huggingface, tokenizer, vocab_size=vocab_size,
                                       stop_token_ids=list(stop_token_ids))
        self.scopes: TenantLru[_Compiler] = TenantLru(TENANT_SCOPES, MAX_SCOPES)
        self.trial: Trial | None = None  # made on the first guide a scope has not tried

    def compile(self, scope: CacheScope, guide: Guide) -> Future:
        """The compiled grammar of a guide for a request of this scope, as a future (soon done if the scope
        compiled it before), which raises ValueError if the schema or regex does not compile. Raises ValueError if
        the scope's tenant has COMPILES guides waiting already."""
        compiler = self.scopes.setdefault(scope, _Compiler)
        future = self.thread.submit(scope.tenant, self._compile, compiler, guide)
        if future is None:
            raise Busy(f"{COMPILES} guides of this tenant are waiting to compile; retry when they are done")
        return future

    def hand(self, waiting: Iterable["Guided"]) -> list[tuple["Guided", BaseException]]:
        """Give the waiting requests whose grammar has compiled their matchers (a sample each); returns those whose
        guide did not compile, with why (a ValueError: the request's fault, a 400)."""
        failed = []
        for seq in list(waiting):
            if not (seq.grammar and seq.grammar.done()):
                continue
            if e := seq.grammar.exception():
                failed.append((seq, e))
                continue
            grammar = seq.grammar.result()
            for s in [seq, *seq.forks]:
                s.matcher, s.grammar = self.matcher(grammar), None
        return failed

    def set_shares(self, shares: dict[str, float]) -> None:
        """The tenants' weights on the grammar thread: their cache shares."""
        self.thread.set_shares(shares)

    def matcher(self, grammar: xgr.CompiledGrammar) -> "Matcher":
        return Matcher(xgr.GrammarMatcher(grammar), self.vocab_size)

    def purge_tenant(self, tenant: str, labels: tuple[str, ...]) -> None:
        self.scopes.purge((tenant, labels))

    def clear(self) -> None:
        self.scopes.clear()

    def close(self) -> None:
        """Stop the trial's worker process."""
        if self.trial:
            self.thread.submit("", self.trial.close).result()

    def _compile(self, slot: "_Compiler", guide: Guide) -> xgr.CompiledGrammar:
        if slot.compiler is None:  # made here: the tokenizer info is this thread's to wait for
            slot.compiler = xgr.GrammarCompiler(self.info.result(), max_threads=1, cache_limit_bytes=MAX_GRAMMAR_BYTES)
        key = xxhash.xxh3_128_digest(f"{guide.kind}:{guide.spec}".encode())
        if key not in slot.tried:
            self.trial = self.trial or Trial(self.info.result())
            self.trial.check(guide)
            slot.tried = slot.tried if len(slot.tried) < TRIED else set()
            slot.tried.add(key)
        return guide.compile(slot.compiler)


@dataclass
class _Compiler:
    """A scope's compiler, made on the grammar thread on its first guide."""

    compiler: xgr.GrammarCompiler | None = None
    tried: set[bytes] = field(default_factory=set)  # the guides that passed the trial (engine/grammar_trial.py)


class Guided(Protocol):
    """A request as Grammars.hand sees it (engine/sequence.py's Sequence)."""

    grammar: Future | None  # its guide's compile, until handed
    matcher: "Matcher | None"
    forks: list["Guided"]  # its other samples, each given a matcher of its own


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


def _low_priority() -> None:
    """Run this thread at nice NICE (Linux: niceness is per thread), so compiling takes mostly the cycles the engine
    leaves instead of slowing every tenant's steps: torch's threads wait on each other, so one busy core slows them
    all."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the engine's priority
        pass

