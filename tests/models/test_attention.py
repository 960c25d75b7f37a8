"""Attention over the pool: tiles read in place or gathered, shared tiles attended once (the cascade), and the pool
handing out consecutive runs. Each path must give the bits of the plain one."""
import math

import pytest
import torch
from conftest import generate_with_logits

from prefixcache import LLM, SamplingParams
from prefixcache.cache.pool import KVPool
from prefixcache.models import attention
from prefixcache.models.attention import Queries

PREFIX = list(range(3000, 3300))  # five 64-key tiles of the tiny model's engines below
DECODE = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _recording_plans(llm: LLM) -> list[tuple[list[Queries], attention.AttnPlan]]:
    """Every step's queries and attention plan, as the model builds them."""
    model, seen = llm.engine.runner.model, []
    build = model.attn_plan

    def recording(queries, *args, **kwargs):
        p = build(queries, *args, **kwargs)
        seen.append((queries, p))
        return p
    model.attn_plan = recording
    return seen


def test_shared_prefix_tiles_are_one_call_and_bit_identical_to_unshared(tiny_model):
    """Four requests on one cached 300-token prefix decode together: each step attends the prefix's full tiles
    once for all four, and every logit equals that of the request run alone with the cache off."""
    warm = LLM(model=tiny_model, attn_tile=64, kernels="off")
    cold = LLM(model=tiny_model, attn_tile=64, enable_prefix_cache=False, kernels="off")
    warm.generate([PREFIX], SamplingParams(temperature=0.0, max_tokens=1))
    prompts = [PREFIX + [7 + i, 8, 9 + i] for i in range(4)]
    plans = _recording_plans(warm)
    w_out, w = generate_with_logits(warm, prompts, DECODE)
    assert [o.cached_tokens for o in w_out] == [300] * 4
    decode = [(q, p) for q, p in plans if len(q) == 4 and all(len(x.positions) == 1 for x in q)]
    assert decode, "the four never decoded in one step"
    for queries, p in decode:
        pairs = sum(math.ceil(x.ctx / 64) for x in queries)
        assert len(p.tiles) == pairs - 3 * 4, "the four prefix tiles (0-3) should be one call each"
    singles = [generate_with_logits(cold, [prompt], DECODE)[1][0] for prompt in prompts]
    assert all(torch.equal(a, b) for a, b in zip(singles, w))


def test_tiles_read_in_place_equal_gathered_tiles(tiny):
    """The same keys in consecutive blocks (read as a view of the pool) and in scattered blocks (gathered)."""
    model, bs = tiny.engine.runner.model, 16
    c, gen = model.config, torch.Generator().manual_seed(0)
    n_blocks = 2 * model.tile // bs
    keys = [torch.randn(n_blocks * bs, c.num_kv_heads, c.head_dim, generator=gen) for _ in range(2)]
    scattered = torch.randperm(n_blocks, generator=gen) + n_blocks  # blocks n..2n-1, in random order
    pool = [torch.zeros(2 * n_blocks * bs, c.num_kv_heads, c.head_dim) for _ in range(2)]
    for p, k in zip(pool, keys):
        p[:n_blocks * bs] = k
        p.view(-1, bs, *k.shape[1:])[scattered] = k.view(-1, bs, *k.shape[1:])
    q = torch.randn(5, c.num_heads, c.head_dim, generator=gen)
    positions = [3, 100, model.tile, model.tile + 40, 2 * model.tile - 1]
    outs = []
    for table in (list(range(n_blocks)), scattered.tolist()):
        p = model.attn_plan([Queries(0, positions, 2 * model.tile, table)], len(q), bs, len(pool[0]))
        assert all((t.slots is None) == (table[0] == 0) for t in p.tiles)  # in place iff consecutive
        outs.append(attention.attend(q, *pool, p, *attention.empty_results(p, *q.shape, q.dtype)))
    assert torch.equal(*outs)


def test_the_pool_hands_out_consecutive_runs():
    pool = KVPool(1, 1, 1, 4, budget_bytes=64 * 2 * 4 * 4, dtype=torch.float32, run=8)  # 64 blocks, runs of 8
    a = pool.allocate(10)
    assert a == list(range(8, 18))  # block 0 is the zero block, so the first aligned free run starts at 8
    assert pool.allocate(2, after=a[-1]) == [18, 19]  # growth continues the run
    b = pool.allocate(3)
    assert b == [24, 25, 26]  # a new run starts on a boundary, leaving room for the first one to grow
    assert pool.allocate(1, after=b[-1]) == [27]
    for block in range(8, 20):
        pool.unref(block)
    assert pool.allocate(12) == list(range(8, 20))
    rest = pool.allocate(pool.num_free - 4)  # no aligned run of 4 is left: the lowest free blocks
    assert len(set(rest)) == len(rest) and pool.allocate(4) == sorted(set(range(1, 64)) - set(rest) - {
        *range(8, 20), 24, 25, 26, 27})


@pytest.fixture(scope="module")
def tiny(tiny_model) -> LLM:
    return LLM(model=tiny_model, enable_prefix_cache=False, kernels="off")
