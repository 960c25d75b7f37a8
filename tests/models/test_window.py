"""Sliding-window attention (a local layer reads its last `window` keys, its own included), on our kernel and on the
torch path: against float64 with windows that start inside a key block, across blocks of 16, key blocks of 64 and
spans of 256; and each row's bits whatever its batch, its chunking, the threads and where its blocks lie."""
import dataclasses
from collections import Counter

import pytest
import torch
from conftest import GREEDY, generate_with_logits, warm_and_cold

from prefixcache import LLM, CacheScope, SamplingParams, kernels
from prefixcache.engine.memory_shares import heaviest
from prefixcache.models import attention, paged
from prefixcache.models.attention import Queries
from prefixcache.models.exactness import rows_plan
from prefixcache.models.kernel_check import attention64
from prefixcache.models.rowwise import KernelOps

AVAILABLE = kernels.choose("auto").isa
BUILDS = [KernelOps(isa) for isa in kernels.ISAS if isa in kernels.supported()]
needs_kernels = pytest.mark.skipif(not AVAILABLE, reason=f"kernels: {kernels.choose('auto').status}")
HEADS, KV_HEADS, D, KEYS = 4, 2, 32, 700


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-KEYS // 16)
    k, v = (torch.randn((blocks + 1) * 16, KV_HEADS, D, generator=g) for _ in range(2))
    table = (1 + torch.randperm(blocks, generator=g)).tolist()
    pos = [0, 5, 63, 64, 100, 255, 256, 300, 511, 512, 600, KEYS - 1]
    return g, k, v, table, pos, torch.randn(len(pos), HEADS, D, generator=g)


def _reference(q, k, v, table, pos, window):
    out = []
    for i, p in enumerate(pos):
        keys = range(max(0, p - window + 1), p + 1)
        slots = torch.tensor([table[j // 16] * 16 + j % 16 for j in keys])
        out.append(attention64(q[i], k[slots], v[slots]))
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("window", [1, 16, 100, 256, 300, 512])
def test_the_kernel_reads_only_the_window_and_matches_float64(window):
    _, k, v, table, pos, q = _case(window)
    ref = _reference(q, k, v, table, pos, window)
    plan = paged.plan([Queries(0, pos, KEYS, table)], len(pos), 16, window)
    for ops in BUILDS:
        out = paged.attend(q, *paged.laid_out(k, v), plan, ops.isa)
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, ops.name


@needs_kernels
@pytest.mark.parametrize("window", [100, 300])
def test_a_windowed_row_does_not_depend_on_batch_chunking_threads_placement_or_build(window):
    g, k, v, table, pos, q = _case(window + 1)
    kp, vp = paged.laid_out(k, v)
    whole = paged.attend(q, kp, vp, paged.plan([Queries(0, pos, KEYS, table)], len(pos), 16, window), BUILDS[0].isa)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for ops in BUILDS:
                alone = torch.cat([paged.attend(q[i:i + 1], kp, vp, paged.plan(
                    [Queries(0, [p], p + 1, table)], 1, 16, window), ops.isa) for i, p in enumerate(pos)])
                assert torch.equal(alone, whole), (t, ops.name)
    finally:
        torch.set_num_threads(threads)
    k2, v2, moved = paged.moved(k, v, table, g)
    chunks = [Queries(0, pos[:5], pos[4] + 1, moved), Queries(5, pos[5:], KEYS, moved)]
    out = paged.attend(q, *paged.laid_out(k2, v2), paged.plan(chunks, len(pos), 16, window), BUILDS[-1].isa)
    assert torch.equal(out, whole)


@pytest.mark.parametrize("window", [16, 100, 600])
def test_the_torch_path_reads_only_the_window(window):
    """In tiles of 256 keys: a query whose window starts past a tile leaves that tile out."""
    _, k, v, table, pos, q = _case(window + 2)
    ref = _reference(q, k, v, table, pos, window)
    exact = rows_plan("", "test")
    p = attention.plan([Queries(0, pos, KEYS, table)], len(pos), 256, 16, len(k), exact, KV_HEADS,
                       HEADS // KV_HEADS, q.dtype, window)
    out = attention.attend(q, k, v, p, *attention.empty_results(p, len(pos), HEADS, D, q.dtype))
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_warm_chunked_batched_equal_cold_across_windows(tiny_gemma):
    """A Gemma 3 whose local layers read 128 keys, on both paths: prompts of two and three windows, cache hits
    ending at a window's edge and inside one (the later tokens' windows reach into the cached blocks), prefill in
    chunks of 96 that cross the windows' edges, all batched: each request's logits equal its cold run's alone."""
    prompts = [list(range(3000, 3350)), list(range(3000, 3208)) + [5, 6], list(range(3000, 3128)) + [7], [9, 10]]
    for kernels_choice in ("auto", "off"):
        outs, singles, together, paged = warm_and_cold(tiny_gemma, prompts, kernels_choice)
        assert paged == (kernels_choice == "auto" and bool(BUILDS))
        assert [o.cached_tokens for o in outs[1:3]] == [208, 128]
        assert all(torch.equal(a, b) for a, b in zip(singles, together)), kernels_choice


def test_a_sequence_keeps_only_the_local_parts_its_window_reads(tiny_gemma):
    """The local layers' pages of a block go back to the pool once no later token's window reaches it: through a
    chunked prefill of 350 tokens and a decode, the sequence holds the local parts of the blocks from its window's
    first to its last computed one, and the pool's free pages are exactly what it holds."""
    llm = LLM(model=tiny_gemma, enable_prefix_cache=False, max_batch_tokens=96)
    e, pool = llm.engine, llm.engine.pool
    assert (pool.page_layers, pool.local_pages, pool.window) == (1, 2, 128)  # a global layer a page, two local ones
    seq = e.add_request(list(range(3000, 3350)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    held = []
    while e.has_unfinished():
        e.step()
        if seq.block_table:
            assert seq.local.start == max(0, seq.num_computed - 127) // 16
            assert seq.local.stop == -(-seq.num_computed // 16)  # blocks not computed yet get theirs when they are
            assert pool.num_free == pool.usable_blocks - len(seq.block_table) - 2 * len(seq.local)
            held.append((len(seq.local), len(seq.block_table)))
    assert max(h for h, _ in held[-30:]) <= 10 < held[-1][1] == 25  # decoding: 8 blocks of window and the one written
    assert pool.num_free == pool.usable_blocks


def test_a_hit_is_cut_back_to_where_its_windows_local_parts_are_cached(tiny_gemma):
    """The cache keeps a finished request's local parts until it needs the room; evicting them (oldest first)
    leaves the blocks' global pages. A later hit whose window would read an evicted local part is cut back until
    it reads none (here to nothing); a hit whose window lies past them is whole. Both give the cold run's logits."""
    a = list(range(3000, 3350))
    cold = LLM(model=tiny_gemma, enable_prefix_cache=False)
    warm = LLM(model=tiny_gemma, max_batch_tokens=96)
    warm.generate([a], GREEDY)
    cache, pool = warm.engine.blocks.cache, warm.engine.pool
    nodes = sorted((n for n in cache.nodes.values() if len(n.tokens) == 16), key=lambda n: n.last_access)
    assert all(n.local for n in nodes)
    free = pool.num_free
    assert cache.evict(2 * 13) == 26 and pool.num_free == free + 26
    assert [n.local for n in nodes[:14]] == [False] * 13 + [True] and len(cache.nodes) > 21  # nodes all kept
    prompts = [a[:208] + [5, 6], a + [7]]  # windows from blocks 5 and 13 on
    outs, warm_logits = generate_with_logits(warm, prompts, GREEDY)
    assert outs[0].cached_tokens == 0 and outs[1].cached_tokens >= 336
    assert outs[0].miss_cause == "evicted"  # its blocks are cached; their local parts were evicted
    for p, got in zip(prompts, warm_logits):
        assert torch.equal(generate_with_logits(cold, [p], GREEDY)[1][0], got)


def test_a_prompt_runs_in_a_pool_too_small_for_every_layer_of_it(tiny_gemma):
    """1,000 tokens take 63 blocks: 189 pages with every layer's keys, 95 at most with the local parts of a step's
    chunk (96 tokens and drafts) and the window before it. A pool of 120 pages runs it (the roomy pool's logits);
    2,000 tokens it refuses, saying what they need."""
    prompt = list(range(3000, 4000))
    roomy = LLM(model=tiny_gemma, enable_prefix_cache=False, max_batch_tokens=96)
    small = LLM(model=tiny_gemma, enable_prefix_cache=False, max_batch_tokens=96,
                kv_cache_bytes=121 * roomy.engine.pool.block_bytes)
    assert small.engine.pool.usable_blocks == 120 and small.engine.blocks.pages_for(1008) == 95
    assert torch.equal(generate_with_logits(small, [prompt], GREEDY)[1][0],
                       generate_with_logits(roomy, [prompt], GREEDY)[1][0])
    with pytest.raises(ValueError, match="need 158 KV blocks; the cache holds 120"):
        small.generate([prompt * 2], GREEDY)


@pytest.mark.parametrize("cache", [False, True])
def test_samples_forked_from_a_long_prompt_share_its_local_parts_and_give_them_all_back(tiny_gemma, cache):
    """n = 3 greedy samples of a 350-token prompt fork from its computed prompt: they share its blocks and its
    window's local parts, and each decodes 40 tokens past it with the logits of one request run alone; once they
    finish, the pool holds nothing but what the cache keeps."""
    prompt, params = list(range(3000, 3350)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = generate_with_logits(LLM(model=tiny_gemma, enable_prefix_cache=False), [prompt], params)[1][0]
    llm = LLM(model=tiny_gemma, enable_prefix_cache=cache, max_batch_tokens=96)
    outs, logits = generate_with_logits(llm, [prompt], dataclasses.replace(params, n=3))
    assert len(outs) == 3 and all(torch.equal(got, alone) for got in logits)
    pool, nodes = llm.engine.pool, list(llm.engine.blocks.cache.nodes.values()) if cache else []
    assert pool.num_free == pool.usable_blocks - sum(1 + 2 * n.local for n in nodes)
    assert sum(pool.local_refs) == sum(n.local for n in nodes)


def test_requests_preempted_for_room_give_their_cold_logits(tiny_gemma):
    """Three 200-token prompts decoding 300 tokens each in a pool of 100 pages (one ends holding about 52): the
    scheduler evicts cached local parts and blocks, then preempts, and readmits from whatever hits are left. Every
    request still gets the logits it gets alone, and the pool ends with what the cache keeps."""
    prompts = [list(range(3000 + 1000 * i, 3200 + 1000 * i)) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    roomy = LLM(model=tiny_gemma, enable_prefix_cache=False)
    alone = [generate_with_logits(roomy, [p], params)[1][0] for p in prompts]
    small = LLM(model=tiny_gemma, max_batch_tokens=96, kv_cache_bytes=101 * roomy.engine.pool.block_bytes)
    _, together = generate_with_logits(small, prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    pool, nodes = small.engine.pool, small.engine.blocks.cache.nodes.values()
    assert pool.num_free == pool.usable_blocks - sum(1 + 2 * n.local for n in nodes)


def test_eviction_weighs_a_tenants_cached_pages_not_its_blocks(tiny_gemma):
    """A cached block holding its local part is three pages here, one without. Tenant a caches 23 blocks and then
    loses 22 of their local parts (25 pages left), b caches 13 blocks with theirs (39 pages). Both have an equal part
    of the pool, so b is the one over it, though it has fewer blocks: the next eviction takes b's local parts, and a
    keeps every page it has."""
    llm = LLM(model=tiny_gemma, kv_cache_bytes=151 * LLM(model=tiny_gemma).engine.pool.block_bytes)
    cache = llm.engine.blocks.cache
    llm.generate([list(range(3000, 3350))], GREEDY, scope=CacheScope(tenant="a"))
    assert cache.evict(2 * 22) == 44
    llm.generate([list(range(5000, 5200))], GREEDY, scope=CacheScope(tenant="b"))
    blocks = Counter(cache.owner(n)[0] for n in cache.nodes.values())
    assert blocks == {"a": 23, "b": 13} and {o[0]: n for o, n in cache.pages_by_owner().items()} == {"a": 25, "b": 39}
    assert cache.evict(6) == 6
    assert {o[0]: n for o, n in cache.pages_by_owner().items()} == {"a": 25, "b": 33}


def test_memory_pressure_preempts_from_the_tenant_holding_the_most_pages(tiny_gemma):
    """Running, a holds three short sequences whose every block keeps its local part (15 blocks, 45 pages), b one
    long one whose early blocks have left its window (25 blocks, 43 pages). Counted in pages, a is the one over its
    part of the pool, though b holds more blocks: the scheduler's memory victim is a's newest sequence."""
    llm = LLM(model=tiny_gemma, enable_prefix_cache=False, max_batch_tokens=96)
    e, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    b = e.add_request(list(range(3000, 3390)), params, CacheScope(tenant="b"))
    a = [e.add_request(list(range(5000 + 100 * i, 5070 + 100 * i)), params, CacheScope(tenant="a")) for i in range(3)]
    while any(s.num_uncomputed > 1 for s in [b, *a]):
        e.step()
    pages = {s.id: len(s.block_table) + 2 * len(s.local) for s in [b, *a]}
    assert [len(s.block_table) for s in a] == [5] * 3 and len(b.block_table) == 25
    assert sum(pages[s.id] for s in a) == 45 and pages[b.id] == 43
    assert heaviest(e.scheduler.running, e.scheduler.blocks, e.scheduler.shares) is a[-1]
