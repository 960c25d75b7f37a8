"""What the tier tests share (tests/cache/test_tier*.py): engines on a small pool, a flood that evicts, waiting for
the tiers' writes, one tier secret, prompts and their cold runs. A plugin of the root conftest, so its fixtures need no
import."""
import pytest
import torch
from conftest import GREEDY, generate_with_logits

from prefixcache import LLM
from prefixcache.cache.credentials import TIER_SECRET_ENV
from prefixcache.cache.scope import CacheScope

SMALL_POOL = 2**20  # 128 blocks of the tiny model: a few prompts evict each other
SECRET = "test-tier-secret-0123456789abcdef"
PROMPT = list(range(1000, 1300))  # 18 full blocks and a partial one
REPEAT = list(range(1000, 1016))
ECHO = REPEAT + list(range(1016, 1032)) + REPEAT + list(range(1032, 1100))  # blocks 0 and 2 hold the same tokens


def llm(model, **kw) -> LLM:
    return LLM(model, kv_cache_bytes=kw.pop("kv_cache_bytes", SMALL_POOL), **kw)


def settle(engine) -> None:
    """Wait until the tiers' queued writes are done (they run off the engine thread)."""
    engine.blocks.tiering.tiers.drain()


@pytest.fixture
def shared_secret(monkeypatch):
    """The one tier secret of replicas that read each other's blocks, as a deployment gives it."""
    monkeypatch.setenv(TIER_SECRET_ENV, SECRET)


@pytest.fixture(scope="module")
def cold(tiny_model):
    return generate_with_logits(LLM(tiny_model, enable_prefix_cache=False), [PROMPT])


@pytest.fixture(scope="module")
def cold_echo(tiny_model):
    return generate_with_logits(LLM(tiny_model, enable_prefix_cache=False), [ECHO])


def assert_cold(result, cold):
    (outs, logits), (cold_outs, cold_logits) = result, cold
    assert outs[0].token_ids == cold_outs[0].token_ids
    assert torch.equal(logits[0], cold_logits[0])


def flood(llm: LLM, scope: CacheScope | None = None) -> None:
    """Prompts of 300 tokens enough to push every earlier entry out of a 128-block pool."""
    llm.generate([list(range(5000 + 400 * i, 5300 + 400 * i)) for i in range(8)], GREEDY, scope=scope)
