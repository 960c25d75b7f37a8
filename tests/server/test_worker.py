"""The engine thread: it builds the engine it runs (torch's OpenMP threads serve the thread that used them first),
and a failed build is the constructor's error."""
import threading

import pytest

from prefixcache.config import Config
from prefixcache.engine.engine import Engine
from prefixcache.server.worker import EngineWorker


def test_the_engine_is_built_on_the_thread_that_runs_it(tiny_model):
    built_on = []

    def build() -> Engine:
        built_on.append(threading.current_thread())
        return Engine(Config(model=tiny_model))

    worker = EngineWorker(build)
    try:
        assert built_on == [worker.thread] and worker.thread is not threading.current_thread()
        assert isinstance(worker.engine, Engine)
    finally:
        worker.stop()


def test_a_failed_build_raises_in_the_constructor(tiny_model):
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineWorker(lambda: Engine(Config(model=tiny_model, kv_dtype="float8")))
