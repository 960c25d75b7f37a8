"""prefixcache: an LLM serving engine built around exact cross-request prefix caching.

The names below load on first use, so that a process that needs no engine (the router, the linter) never
imports torch."""
import importlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EXPORTS = {"LLM": "prefixcache.engine.llm", "SamplingParams": "prefixcache.engine.sequence",
           "RequestOutput": "prefixcache.engine.sequence", "CacheScope": "prefixcache.cache.scope",
           "Breakpoint": "prefixcache.cache.policy", "Config": "prefixcache.config"}
__all__ = list(EXPORTS)


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
    return getattr(importlib.import_module(EXPORTS[name]), name)
