"""A guide is compiled first in a worker process under limits of CPU time and memory (engine/grammar_trial.py): one
past them is stopped with its process and refused, and the next guide compiles in a new one. The guide past them is
a choice of 100,000 strings (1 MB): about 10 CPU seconds and 250 MB to compile, many times either limit set here."""
import json
import os
import signal

import pytest
import xgrammar as xgr

from prefixcache.cache.scope import CacheScope
from prefixcache.engine.grammar import Grammars
from prefixcache.engine.grammar_trial import Trial
from prefixcache.engine.guide import Guide
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import tokenizer as load_tokenizer

VOCAB, EOS = 49152, (2,)
HUGE = Guide("choice", json.dumps([f"w{i:07d}" for i in range(100_000)]))
SMALL = Guide("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def info(tok):
    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=list(EOS))


@pytest.mark.parametrize("limits", [{"seconds": 0.25}, {"memory": 16 << 20}], ids=["cpu time", "memory"])
def test_a_compile_past_a_limit_is_stopped_and_refused_and_the_next_compiles(info, limits):
    trial = Trial(info, **limits)
    try:
        trial.check(SMALL)
        first = trial.worker
        with pytest.raises(ValueError, match="takes more than"):
            trial.check(HUGE)
        assert first.poll() is not None  # stopped, not left running
        trial.check(SMALL)  # in a new worker
    finally:
        trial.close()


def test_a_trial_that_does_not_answer_in_its_wall_time_is_stopped_and_refused(info):
    """A worker that gets no CPU (stopped here; a busy machine at its niceness, in life) holds the grammar thread no
    longer than the wall limit: its guide is refused, the worker killed, and the next guide compiles in a new one."""
    trial = Trial(info, wall=0.5)
    try:
        trial.check(SMALL)
        stopped = trial.worker
        os.kill(stopped.pid, signal.SIGSTOP)
        with pytest.raises(ValueError, match="0.5 seconds"):
            trial.check(SMALL)
        assert stopped.poll() is not None
        trial.check(SMALL)
    finally:
        trial.close()


def test_a_guide_that_does_not_compile_is_refused_with_xgrammars_reason(info):
    trial = Trial(info)
    try:
        with pytest.raises(ValueError, match="cannot compile the regex guide"):
            trial.check(Guide("regex", "(unclosed"))
    finally:
        trial.close()


def test_a_guide_past_the_limits_fails_its_request_alone(tok, monkeypatch):
    monkeypatch.setattr("prefixcache.engine.grammar.Trial", lambda info: Trial(info, seconds=0.25))
    grammars = Grammars(tok, VOCAB, EOS)
    try:
        with pytest.raises(ValueError, match="takes more than 0.25 CPU seconds"):
            grammars.compile(CacheScope(tenant="a"), HUGE).result()
        assert isinstance(grammars.compile(CacheScope(tenant="b"), SMALL).result(), xgr.CompiledGrammar)
        tried, check = [], grammars.trial.check
        grammars.trial.check = lambda guide: (tried.append(guide), check(guide))
        grammars.compile(CacheScope(tenant="b"), SMALL).result()  # tried in b's scope already
        grammars.compile(CacheScope(tenant="c"), SMALL).result()
        assert tried == [SMALL]
    finally:
        grammars.close()
