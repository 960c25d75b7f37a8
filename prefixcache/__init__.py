"""prefixcache: an LLM serving engine built around exact cross-request prefix caching.

The names below load on first use, so that a process that needs no engine (the router, the linter) never
imports torch."""
import importlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that wait for work sleep rather than spin (read when torch loads, so only if it has not yet): a
# spinning worker holds its core from the server's other threads and from a client on the same machine, and a step
# then waits for a worker that is not running. On 2 cores, a server at 3 req/s met its objectives for 2% of requests
# with spinning workers and 75% with sleeping ones; a lone decode loop with nothing else running loses 10-30%.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

EXPORTS = {"LLM": "prefixcache.engine.llm", "SamplingParams": "prefixcache.engine.sequence",
           "RequestOutput": "prefixcache.engine.sequence", "CacheScope": "prefixcache.cache.scope",
           "Breakpoint": "prefixcache.cache.policy", "Config": "prefixcache.config"}
__all__ = list(EXPORTS)


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
    return getattr(importlib.import_module(EXPORTS[name]), name)
