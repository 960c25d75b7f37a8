"""prefixcache: an LLM serving engine built around exact cross-request prefix caching."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from prefixcache.cache.policy import Breakpoint  # noqa: E402
from prefixcache.cache.scope import CacheScope  # noqa: E402
from prefixcache.config import Config  # noqa: E402
from prefixcache.engine.llm import LLM  # noqa: E402
from prefixcache.engine.sequence import RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CacheScope", "Breakpoint", "Config"]
