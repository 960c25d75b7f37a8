"""The running slots and preemption shared by tenant (engine/scheduler.py): a waiting tenant gets its part of the
slots from the one over its part, a request that does not fit does not block the ones behind it, and memory
pressure preempts the tenant holding the most over its part. Steps are driven by hand: no timing."""
from collections import Counter

from prefixcache import LLM, CacheScope, SamplingParams
from prefixcache.engine.memory_shares import heaviest
from prefixcache.engine.sequence import Status

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def prompt(i: int) -> list[int]:
    """Prompts that differ from their first token: none waits for another's prefill of a shared prefix."""
    return [100 + i] + list(range(3000, 3100))


def running(llm: LLM) -> Counter:
    return Counter(s.scope.tenant for s in llm.engine.scheduler.running)


def test_a_waiting_tenant_takes_its_share_of_the_slots_from_the_one_holding_them(tiny_model):
    llm = LLM(model=tiny_model, max_num_seqs=4)
    e = llm.engine
    for i in range(4):
        e.add_request(prompt(i), LONG, CacheScope("a"))
    e.step()
    assert running(llm) == {"a": 4}
    e.add_request(prompt(50), LONG, CacheScope("b"))
    e.step()
    assert running(llm) == {"a": 3, "b": 1}  # the newcomer runs now, not when a long answer ends
    e.add_request(prompt(51), LONG, CacheScope("b"))
    e.add_request(prompt(52), LONG, CacheScope("b"))
    for _ in range(3):
        e.step()
    assert running(llm) == {"a": 2, "b": 2}  # b waits with a third request, and a holds no more than its half
    assert e.scheduler.num_preemptions == 2


def test_the_weights_are_the_cache_shares(tiny_model):
    llm = LLM(model=tiny_model, max_num_seqs=4)
    e = llm.engine
    e.cache.set_shares({"b": 0.75})
    for i in range(4):
        e.add_request(prompt(i), LONG, CacheScope("a"))
    e.step()
    for i in range(4):
        e.add_request(prompt(50 + i), LONG, CacheScope("b"))
    for _ in range(4):
        e.step()
    assert running(llm) == {"a": 1, "b": 3}


def test_a_request_that_does_not_fit_the_free_slots_is_passed_over_until_it_has_waited_enough(tiny_model):
    llm = LLM(model=tiny_model, max_num_seqs=4, fairness_steps=3)
    e = llm.engine
    for i in range(2):
        e.add_request(prompt(i), LONG, CacheScope("a"))
    e.step()
    wide = e.add_request(prompt(10), SamplingParams(temperature=1.0, max_tokens=200, n=3, seed=1), CacheScope("a"))
    narrow = e.add_request(prompt(11), LONG, CacheScope("a"))
    e.step()
    assert narrow.status is Status.RUNNING and wide.status is Status.WAITING  # not blocked behind it
    for _ in range(3):
        e.step()
    late = e.add_request(prompt(12), LONG, CacheScope("a"))
    e.step()
    assert late.status is Status.WAITING and running(llm) == {"a": 3}  # now wide goes first: nothing overtakes it


def test_memory_pressure_preempts_the_tenant_holding_the_most_blocks(tiny_model):
    llm = LLM(model=tiny_model, max_num_seqs=4)
    e = llm.engine
    e.add_request(list(range(3000, 3600)), LONG, CacheScope("a"))  # 38 blocks
    e.step()
    e.step()
    e.add_request(prompt(60)[:20], LONG, CacheScope("b"))  # 2 blocks, and the newest sequence
    e.step()
    assert running(llm) == {"a": 1, "b": 1}
    assert heaviest(e.scheduler.running, e.scheduler.blocks, e.scheduler.shares).scope.tenant == "a"


def test_a_tenants_long_queue_does_not_go_ahead_of_a_newcomer_below_its_part(tiny_model):
    """a's queued requests have been passed over fairness_steps times long before b arrives: being due must not let
    them take the slot freed for b (b would then wait until it had been passed over as often)."""
    llm = LLM(model=tiny_model, max_num_seqs=2, fairness_steps=2)
    e = llm.engine
    for i in range(6):
        e.add_request(prompt(i), LONG, CacheScope("a"))
    for _ in range(4):
        e.step()
    assert running(llm) == {"a": 2} and all(s.skipped >= 2 for s in e.scheduler.waiting)
    b = e.add_request(prompt(50), LONG, CacheScope("b"))
    e.step()
    assert b.status is Status.RUNNING and running(llm) == {"a": 1, "b": 1}


def test_a_tenants_running_work_does_not_evict_another_tenants_prefix_under_its_part(tiny_model):
    """b caches a prefix of 40 blocks (of 128: under its half); a then runs 8 fresh prompts at once whose blocks,
    200 and more, overflow the pool. a's running sequences pinned its own blocks, so eviction used to take b's
    prefix (b's next request found none of it cached); now a's newest sequences are preempted instead (a is the one
    over its part) and b's prefix stays whole. Every request still finishes, with the tokens it has alone."""
    block_bytes = LLM(model=tiny_model, enable_prefix_cache=False).engine.pool.block_bytes
    llm = LLM(model=tiny_model, kv_cache_bytes=129 * block_bytes, max_num_seqs=8, min_cache_tokens=0)
    e = llm.engine
    b_prompt = list(range(7000, 7000 + 40 * 16))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([b_prompt], one, scope=CacheScope("b"))
    runs = [e.add_request([200 + i] + list(range(4000 + 400 * i, 4000 + 400 * i + 300)), LONG, CacheScope("a"))
            for i in range(8)]
    while any(s.finish_reason is None for s in runs):
        e.step()
    assert e.scheduler.num_preemptions > 0  # a's streams overflowed the pool
    assert llm.generate([b_prompt + [5]], one, scope=CacheScope("b"))[0].cached_tokens == len(b_prompt)
    alone = LLM(model=tiny_model, enable_prefix_cache=False)
    assert [s.output().token_ids for s in runs[:2]] == [o.token_ids for o in alone.generate(
        [s.tokens[:s.num_prompt] for s in runs[:2]], LONG)]
