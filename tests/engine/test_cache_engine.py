"""Prefix-cache behaviour through the engine: warm == cold, isolation, staleness, lifecycle, bounds."""
import pytest
import torch
from conftest import GREEDY, generate_with_logits

from prefixcache import LLM, Breakpoint, CacheScope, SamplingParams

BASE = list(range(3000, 3400))
# Prompts sharing long prefixes; once BASE[:300] is cached their hits end mid-block, on a block
# boundary, and at the full prompt length (the last token is then recomputed for its logits).
PROMPTS = [BASE[:n] + [11, 12, 13] for n in (37, 64, 150, 257)] + [BASE[:300], BASE[:128], BASE[:299]]


def _compare(cold_llm, warm_llm, prompts, concurrent: bool):
    if concurrent:
        c_out, c_log = generate_with_logits(cold_llm, prompts)
        w_out, w_log = generate_with_logits(warm_llm, prompts)
    else:
        pairs = [generate_with_logits(cold_llm, [p]) for p in prompts]
        c_out, c_log = [p[0][0] for p in pairs], [p[1][0] for p in pairs]
        pairs = [generate_with_logits(warm_llm, [p]) for p in prompts]
        w_out, w_log = [p[0][0] for p in pairs], [p[1][0] for p in pairs]
    for c, w, cl, wl in zip(c_out, w_out, c_log, w_log):
        assert c.token_ids == w.token_ids
        assert (cl - wl).abs().max().item() == 0.0
    return w_out


@pytest.mark.parametrize("concurrent, exactness", [(False, "pad"), (True, "pad"), (False, "fixed"), (True, "fixed"),
                                                 (True, "rows")])
def test_warm_equals_cold_tiny(tiny_model, concurrent, exactness):
    cold = LLM(model=tiny_model, enable_prefix_cache=False, exactness=exactness)
    warm = LLM(model=tiny_model, max_batch_tokens=96, exactness=exactness)
    warm.generate([BASE[:300]], GREEDY)
    outs = _compare(cold, warm, PROMPTS, concurrent)
    hits = [o.cached_tokens for o in outs]
    # hits[5]: a full hit on a block boundary (128 tokens) still recomputes the last token
    assert hits[:4] == [37, 64, 150, 257] and hits[4] == 299 and hits[5] == 127 and hits[6] == 298


def test_warm_equals_cold_real_model_8_concurrent():
    cold = LLM(enable_prefix_cache=False)
    warm = LLM()
    system = [{"role": "system", "content": "You are a terse assistant for a hardware store. " * 12}]
    prompts = [warm.encode_chat(system + [{"role": "user", "content": q}]) for q in
               ["Do you sell hammers?", "What time do you open?", "Where is the paint?", "Any drills?",
                "Price of nails?", "Do you deliver?", "Is there parking?", "Can I return a saw?"]]
    warm.generate([prompts[0]], GREEDY)
    outs = _compare(cold, warm, prompts, concurrent=True)
    assert all(o.cached_tokens >= len(warm.encode_chat(system + [{"role": "user", "content": ""}])) - 16
               for o in outs)


def test_generated_tokens_are_cached_for_the_next_turn(tiny_model):
    llm = LLM(model=tiny_model)
    first = llm.generate([BASE[:100]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    second = llm.generate([BASE[:100] + first.token_ids + [7, 8]], GREEDY)[0]
    assert second.cached_tokens >= 100 + 40 - 16


def test_tenants_are_isolated_and_shared_prefix_is_shared(tiny_model):
    shared = BASE[:70]
    llm = LLM(model=tiny_model, shared_prefixes=[shared])
    a, b = CacheScope(tenant="acme"), CacheScope(tenant="globex")
    private = BASE[100:200]
    llm.generate([private], GREEDY, scope=a)
    assert llm.generate([private], GREEDY, scope=b)[0].cached_tokens == 0
    assert llm.generate([private], GREEDY, scope=a)[0].cached_tokens == 99
    assert llm.generate([private], GREEDY, scope=CacheScope(tenant="acme", labels=("finance",)))[0].cached_tokens == 0
    assert llm.generate([private], GREEDY, scope=CacheScope(tenant="acme", salt="s1"))[0].cached_tokens == 0
    llm.generate([shared + [1, 2, 3, 4, 5]], GREEDY, scope=a)
    out = llm.generate([shared + [9, 9, 9]], GREEDY, scope=b)[0]
    assert out.cached_tokens == len(shared) and out.scope_kind == "shared"  # exactly the declared prefix


def test_weights_fingerprint_change_means_no_hits(tiny_model, tiny_model_v2):
    v1, v2 = LLM(model=tiny_model), LLM(model=tiny_model_v2)
    assert v1.engine.fingerprint != v2.engine.fingerprint
    scope_v1 = v1.engine.scope(CacheScope(tenant="t"))
    scope_v2 = v2.engine.scope(CacheScope(tenant="t"))
    assert scope_v1.key != scope_v2.key
    assert LLM(model=tiny_model).engine.fingerprint == v1.engine.fingerprint  # stable across loads


def test_ttl_expiry_pin_and_purge(tiny_model):
    llm = LLM(model=tiny_model)
    now = [1000.0]
    cache = llm.engine.blocks.cache
    cache.clock = lambda: now[0]
    p = BASE[:96]
    bp = [Breakpoint(80, "5m")]
    out = llm.generate([p], GREEDY, breakpoints=bp)[0]
    assert out.cache_write_tokens == {"5m": 80}
    now[0] += 200
    assert llm.generate([p], GREEDY, breakpoints=bp)[0].cached_tokens == 80  # a hit refreshes the TTL
    now[0] += 200
    assert llm.generate([p], GREEDY, breakpoints=bp)[0].cached_tokens == 80
    now[0] += 301
    again = llm.generate([p], GREEDY, breakpoints=bp)[0]
    assert again.cached_tokens == 0 and again.cache_write_tokens == {"5m": 80}  # expired, so written again
    now[0] += 301
    assert cache.evict(10**6) == 5 and cache.evictions["ttl"] == 5  # the 80 tokens are 5 full blocks
    # pin: survives clear(); purge removes a tenant's entries only
    llm.generate([BASE[:64]], GREEDY, scope=CacheScope(tenant="a"))
    llm.generate([BASE[:64]], GREEDY, scope=CacheScope(tenant="b"))
    llm.engine.cache.purge(CacheScope(tenant="a"))
    assert llm.generate([BASE[:64]], GREEDY, scope=CacheScope(tenant="a"))[0].cached_tokens == 0
    assert llm.generate([BASE[:64]], GREEDY, scope=CacheScope(tenant="b"))[0].cached_tokens == 63
    assert llm.pin(BASE[:64], CacheScope(tenant="b")) == 64
    assert cache.evict(10**6) > 0  # the unpinned rest goes
    assert llm.generate([BASE[:64]], GREEDY, scope=CacheScope(tenant="b"))[0].cached_tokens == 63
    cache.pin(list(cache.nodes.values()))
    assert cache.evict(10**6) == 0  # eviction never takes pinned entries; an explicit clear does
    assert cache.clear() == cache.evictions["clear"] and cache.num_blocks == 0


def test_eviction_order_expired_then_priority_then_lru(tiny_model):
    llm = LLM(model=tiny_model)
    now = [0.0]
    cache = llm.engine.blocks.cache
    cache.clock = lambda: now[0]
    outs = []
    for span, kwargs in (((0, 32), {}), ((100, 132), {}), ((200, 232), dict(priority=5)),
                         ((300, 340), dict(breakpoints=[Breakpoint(32, "5m")]))):
        now[0] += 1
        outs.append(llm.generate([BASE[span[0]:span[1]]], GREEDY, **kwargs)[0])
    old_low, recent_low, high, expiring = outs
    assert all(o.cache_write_tokens for o in (old_low, recent_low, high, expiring))
    now[0] += 400  # the 5m entry expires; the others have no TTL

    def cached(span):
        return llm.engine.cache.pin(BASE[span[0]:span[1]], pinned=False)  # full blocks still matchable; changes nothing
    cache.evict(2)
    assert dict(cache.evictions) == {"ttl": 2}  # the expired entry's two blocks go first
    order = []
    while cache.num_blocks:
        before = {p: cached(p) for p in ((0, 32), (100, 132), (200, 232))}
        cache.evict(1)
        after = {p: cached(p) for p in before}
        order += [p for p in before if before[p] > after[p]]
    assert order.index((0, 32)) < order.index((100, 132)) < order.index((200, 232))


def test_a_tenant_flooding_the_cache_evicts_its_own_entries_first(tiny_model):
    """Tenant b's prefix (20 blocks, the oldest entry) survives tenant a writing 10 times the budget of unique
    prefixes: the owner holding the most blocks gives up its own first. LRU alone would evict b's first."""
    block_bytes = LLM(model=tiny_model, enable_prefix_cache=False).engine.pool.block_bytes
    llm = LLM(model=tiny_model, kv_cache_bytes=130 * block_bytes, max_num_seqs=4)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    hot = BASE[:320]
    llm.generate([hot], one, scope=CacheScope(tenant="b"))
    for i in range(80):
        llm.generate([list(range(5000 + 200 * i, 5160 + 200 * i))], one, scope=CacheScope(tenant="a"))
    assert llm.engine.blocks.cache.evictions["capacity"] > 100
    assert llm.generate([hot + [5]], one, scope=CacheScope(tenant="b"))[0].cached_tokens == 320


def test_a_tenants_cache_share_holds_while_another_is_over_its_own(tiny_model):
    """Tenant b holds 80 of 129 blocks, then a writes 100 blocks of unique prefixes. With b's share at 0.7 (90
    blocks guaranteed), a is the one over its share (the 0.3 left) and evicts its own entries: b keeps all of its
    prefixes. With equal shares b, the bigger holder, gives up blocks (the control)."""
    block_bytes = LLM(model=tiny_model, enable_prefix_cache=False).engine.pool.block_bytes
    one = SamplingParams(temperature=0.0, max_tokens=1)
    b_prompts = [BASE[:1] + [7000 + 400 * i + t for t in range(319)] for i in range(4)]

    def kept(shares: dict[str, float]) -> list[int]:
        llm = LLM(model=tiny_model, kv_cache_bytes=130 * block_bytes, max_num_seqs=4)
        llm.engine.cache.set_shares(shares)
        for p in b_prompts:
            llm.generate([p], one, scope=CacheScope(tenant="b"))
        for i in range(10):
            llm.generate([list(range(5000 + 200 * i, 5160 + 200 * i))], one, scope=CacheScope(tenant="a"))
        assert llm.engine.blocks.cache.evictions["capacity"] >= 40
        return [llm.generate([p + [5]], one, scope=CacheScope(tenant="b"))[0].cached_tokens for p in b_prompts]

    assert kept({"b": 0.7}) == [320] * 4
    assert min(kept({})) < 320


def test_a_tenants_flood_of_requests_does_not_starve_another(tiny_model):
    """Tenant a queues 6 requests, then b one, with room for 2 at a time: b gets one of the first free slots, ahead
    of a's other queued requests (arrival order alone would make it wait for all of them)."""
    llm = LLM(model=tiny_model, max_num_seqs=2, enable_prefix_cache=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    flood = [llm.engine.add_request(list(range(100 + 10 * i, 110 + 10 * i)), params, CacheScope(tenant="a"))
             for i in range(6)]
    llm.engine.step()
    b = llm.engine.add_request(list(range(900, 910)), params, CacheScope(tenant="b"))
    admitted = []
    while llm.engine.has_unfinished():
        before = set(map(id, llm.engine.scheduler.running))
        llm.engine.step()
        admitted += [s for s in llm.engine.scheduler.running if id(s) not in before]
    assert admitted.index(b) <= 1 and all(s.finish_reason == "length" for s in flood + [b])


def test_tiny_budget_evicts_and_stays_correct(tiny_model):
    cold = LLM(model=tiny_model, enable_prefix_cache=False)
    block_bytes = cold.engine.pool.block_bytes
    tight = LLM(model=tiny_model, kv_cache_bytes=60 * block_bytes, max_num_seqs=4)
    prompts = [[i] + BASE[i * 7:i * 7 + 150] for i in range(10)]
    prompts += [BASE[:90 + 13 * i] + [i] for i in range(6)]  # partial-block hits while eviction runs
    c_out = cold.generate(prompts, GREEDY)
    for _ in range(2):
        t_out = tight.generate(prompts, GREEDY)
        assert [o.token_ids for o in t_out] == [o.token_ids for o in c_out]
        stats = tight.cache_stats()
        assert stats["blocks_used"] <= stats["blocks_total"] == 59
    assert sum(stats["evictions"].values()) > 0


def test_a_request_pinned_entries_leave_no_room_for_is_refused(tiny_model):
    block_bytes = LLM(model=tiny_model).engine.pool.block_bytes
    llm = LLM(model=tiny_model, kv_cache_bytes=21 * block_bytes)  # 20 usable blocks
    llm.generate([BASE[:112]], GREEDY)
    assert llm.pin(BASE[:112]) == 112  # 7 blocks that eviction may never take
    with pytest.raises(ValueError, match="pinned"):  # it could never be admitted: refused, not left waiting
        llm.generate([BASE[:250]], GREEDY)
    llm.pin(BASE[:112], pinned=False)
    out = llm.generate([BASE[:250]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert (out.finish_reason, len(out.token_ids)) == ("length", 8)


def test_cache_off_never_hits(tiny_model):
    llm = LLM(model=tiny_model, enable_prefix_cache=False)
    llm.generate([BASE[:100]], GREEDY)
    assert llm.generate([BASE[:100]], GREEDY)[0].cached_tokens == 0


def test_identical_inflight_prefixes_are_computed_once(tiny_model):
    llm = LLM(model=tiny_model, max_batch_tokens=64)
    prompts = [BASE[:300] + [i] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert sorted(o.cached_tokens for o in outs)[1:] == [288, 288, 288]  # 18 full blocks, waited for and hit
    assert llm.cache_stats()["hit_tokens"] == 3 * 288


@pytest.mark.parametrize("bad, match", [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[list(range(2048))]), "context window"),
    (dict(prompts=[[10**6]]), "vocabulary"),
])
def test_bad_requests_raise_clear_errors(tiny_model, bad, match):
    llm = LLM(model=tiny_model)
    with pytest.raises(ValueError, match=match):
        llm.generate(bad["prompts"], GREEDY)
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids  # the engine still works


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_model_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(model=str(tmp_path / "missing.gguf"))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=str(corrupt))


def test_sampling_is_seeded(tiny_model):
    llm = LLM(model=tiny_model)
    params = dict(temperature=5.0, top_p=0.95, top_k=1000, max_tokens=16, ignore_eos=True)
    a = llm.generate([BASE[:20]], SamplingParams(seed=7, **params))[0].token_ids
    b = llm.generate([BASE[:20]], SamplingParams(seed=7, **params))[0].token_ids
    c = llm.generate([BASE[:20]], SamplingParams(seed=8, **params))[0].token_ids
    assert a == b and a != c


def test_stop_strings_and_max_tokens(tiny_model):
    llm = LLM(model=tiny_model)
    free = llm.generate([BASE[:20]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    stop = free.text[5:9]
    out = llm.generate([BASE[:20]], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop],
                                                   ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == free.text[:free.text.find(stop)]


def test_miss_causes(tiny_model):
    llm = LLM(model=tiny_model, min_cache_tokens=40)
    now = [0.0]
    llm.engine.blocks.cache.clock = lambda: now[0]
    doc = BASE[:120]
    assert llm.generate([doc], GREEDY)[0].miss_cause == "cold"
    assert llm.generate([doc], GREEDY)[0].miss_cause == "hit"
    assert llm.generate([doc[:100] + [1, 2, 3]], GREEDY)[0].miss_cause == "diverged"
    assert llm.generate([doc], GREEDY, scope=CacheScope(tenant="other"))[0].miss_cause == "cold"  # not "scope"
    assert llm.generate([BASE[200:230]], GREEDY)[0].miss_cause == "below_min_length"
    llm.generate([BASE[300:380]], GREEDY, breakpoints=[Breakpoint(64, "5m")])
    now[0] += 301
    assert llm.generate([BASE[300:380]], GREEDY)[0].miss_cause == "expired"
    llm.engine.cache.clear()
    assert llm.generate([doc], GREEDY)[0].miss_cause == "evicted"


def test_cross_scope_misses_are_flagged_for_the_operator_only(tiny_model):
    llm = LLM(model=tiny_model, log_cross_scope_misses=True)
    doc = BASE[:120]
    llm.generate([doc], GREEDY, scope=CacheScope(tenant="owner"))

    def run(prompt: list[int]):
        seq = llm.engine.add_request(prompt, GREEDY, CacheScope(tenant="prober"))
        while seq.finish_reason is None:
            llm.engine.step()
        return seq

    held, fresh = run(doc), run(BASE[200:320])
    assert (held.cache.miss_cause, held.cache.cross_scope_miss) == ("cold", True)
    assert (fresh.cache.miss_cause, fresh.cache.cross_scope_miss) == ("cold", False)
    assert run(doc).cache.miss_cause == "hit"  # the prober's own copy now


@pytest.mark.parametrize("cache", [False, True])
def test_preemption_under_a_tight_budget_keeps_logits_bit_identical(tiny_model, cache):
    """Five long prompts decoding together outgrow a 40-block budget: the newest are preempted, give their
    blocks back and are recomputed later (from their cached blocks when the cache is on)."""
    prompts = [BASE[i * 10:i * 10 + 200] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model=tiny_model, enable_prefix_cache=cache)
    tight = LLM(model=tiny_model, enable_prefix_cache=cache, kv_cache_bytes=41 * roomy.engine.pool.block_bytes)
    ref_out, ref = generate_with_logits(roomy, prompts, params)
    out, logits = generate_with_logits(tight, prompts, params)
    assert roomy.cache_stats()["preemptions"] == 0 and tight.cache_stats()["preemptions"] > 0
    for a, b, la, lb in zip(ref_out, out, ref, logits):
        assert a.token_ids == b.token_ids
        assert torch.equal(la, lb)


def test_purge_while_the_tenant_runs_keeps_its_output_and_the_shared_prefix(tiny_model):
    shared = BASE[:64]
    prompt = shared + BASE[100:180]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = LLM(model=tiny_model, shared_prefixes=[shared]).generate([prompt], params)[0]
    llm = LLM(model=tiny_model, shared_prefixes=[shared])
    llm.generate([shared + BASE[200:240]], params, scope=CacheScope(tenant="acme"))  # acme's own blocks exist
    engine = llm.engine
    seq = engine.add_request(prompt, params, CacheScope(tenant="acme"))
    for _ in range(5):  # prefilled, and a few tokens decoded
        engine.step()
    assert 0 < len(seq.output_ids) < 24
    assert engine.cache.purge_tenant("acme") > 0  # the finished request's own blocks go; the running one's stay
    while seq.finish_reason is None:
        engine.step()
    assert seq.output().token_ids == reference.token_ids
    other = llm.generate([shared + BASE[300:340]], params, scope=CacheScope(tenant="globex"))[0]
    assert other.cached_tokens == len(shared) and other.scope_kind == "shared"
    assert llm.generate([prompt], params, scope=CacheScope(tenant="acme"))[0].cached_tokens == len(prompt) - 1


def test_fingerprint_covers_the_arithmetic(tiny_model):
    """KV computed on the torch path is not reused on our kernels, nor the other way (a shared tier holds both)."""
    on, off = LLM(model=tiny_model, kernels="auto"), LLM(model=tiny_model, kernels="off")
    assert on.exactness.kernels and not on.exactness.kernels.startswith("off"), on.exactness.kernels
    assert on.engine.fingerprint != off.engine.fingerprint
    assert LLM(model=tiny_model, kernels="off").engine.fingerprint == off.engine.fingerprint



def test_fingerprint_covers_the_kv_dtype(tiny_model):
    """KV kept in bfloat16 is another cache than KV kept in fp32, on the same weights and arithmetic (replicas that
    differ in it share a tier, and took each other's records for bad ones)."""
    try:
        bf16 = LLM(model=tiny_model, dtype="bfloat16")
    except ValueError as e:  # bfloat16 activations need avx512_bf16 or AMX (models/cpu.py)
        pytest.skip(str(e))
    fp32_kv = LLM(model=tiny_model, dtype="bfloat16", kv_dtype="float32")
    assert bf16.engine.runner.model.ops.arithmetic(bf16.exactness.cpu) == \
        fp32_kv.engine.runner.model.ops.arithmetic(fp32_kv.exactness.cpu)
    assert bf16.engine.fingerprint != fp32_kv.engine.fingerprint
    assert LLM(model=tiny_model, dtype="bfloat16", kv_dtype="bfloat16").engine.fingerprint == bf16.engine.fingerprint
