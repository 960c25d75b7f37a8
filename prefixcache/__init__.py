"""prefixcache: an LLM serving engine built around exact cross-request prefix caching.

The names below load on first use, so that a process that needs no engine (the router, the linter) never
imports torch."""
import importlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that wait for work spin briefly, then sleep (read when torch loads, so only if it has not yet).
# libgomp's default spin (300,000 pauses, milliseconds) holds a core from the server's other threads and from a
# client on the same machine, and a step then waits for a worker that is not running: on 2 cores, a server at 3 req/s
# met its objectives for 2% of requests, against 75% with workers that sleep at once (PASSIVE). But waking a
# sleeping worker costs tens of microseconds on a KVM guest, and a decode step starts a parallel region per GEMM:
# SmolLM2's b = 1 step took 23 ms sleeping at once and 8.5-9 ms spinning 5,000-30,000 pauses (0.3-1.5 ms) first, and
# the server at 12 req/s (shared-system-prompt) met its objectives for 78% of requests against 34% (Intel Xeon).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

EXPORTS = {"LLM": "prefixcache.engine.llm", "SamplingParams": "prefixcache.engine.sequence",
           "RequestOutput": "prefixcache.engine.sequence", "CacheScope": "prefixcache.cache.scope",
           "Breakpoint": "prefixcache.cache.policy", "Config": "prefixcache.config"}
__all__ = list(EXPORTS)


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
    return getattr(importlib.import_module(EXPORTS[name]), name)
