"""prefixcache: an LLM serving engine built around exact cross-request prefix caching."""
import os

# MKL's strict reproducibility mode makes every sgemm row independent of how many rows share the call
# (measured: same speed for prefill, ~0.15 ms slower per decode GEMV). Prefix-cache hits depend on it:
# a token's KV must not change with the chunk it was computed in. It must be set before torch loads MKL.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from prefixcache.cache.policy import Breakpoint  # noqa: E402
from prefixcache.cache.scope import CacheScope  # noqa: E402
from prefixcache.config import Config  # noqa: E402
from prefixcache.engine.llm import LLM  # noqa: E402
from prefixcache.engine.sequence import RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CacheScope", "Breakpoint", "Config"]
