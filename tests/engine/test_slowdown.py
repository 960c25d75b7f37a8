"""The bound on how much one tenant's rows slow another's tokens (engine/slowdown.py): its decisions with a step cost
set by hand (14 ms a step, 2 ms a row, nothing per key), so no test depends on the machine's speed, on sequences of
the tiny model's size, and through the tiny model's engine, where the rows held back change no one's tokens."""
import math

import numpy as np

from prefixcache import LLM, CacheScope, SamplingParams
from prefixcache.engine.sequence import Sequence
from prefixcache.engine.slowdown import HELD, bounded
from prefixcache.engine.step_cost import StepCost, Work
from prefixcache.engine.usage import Usage

COEF = (0.014, 0.002, 0.0, 0.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def cost(coef=COEF) -> StepCost:
    c = StepCost()
    c.coef = np.array(coef)
    return c


def decodes(tenant: str, k: int) -> list[tuple[Sequence, int]]:
    """k sequences of a tenant's, each with 20 tokens computed and one to decode."""
    plan = []
    for _ in range(k):
        seq = Sequence(list(range(100, 121)), GREEDY, CacheScope(tenant=tenant))
        seq.num_computed = 20
        plan.append((seq, 1))
    return plan


def bound(plan, coef=COEF, shares=None, slowdown=1.5, others=(), usage=None, finished=(), held=()) -> list:
    """bounded() for the plan's tenants and `others` with work but no row in it; `usage`: their engine time lately
    (none by default), `finished`: those of them that have just finished a request, `held`: those whose prompt
    chunks were held back HELD steps already."""
    lately = Usage()
    lately.tokens = usage or {}
    lately.finished = dict.fromkeys(finished, 0.0)
    lately.held = dict.fromkeys(held, HELD)
    return bounded(plan, cost(coef), shares or {}, slowdown, set(tenants(plan)) | set(others), lately)


def tenants(plan) -> dict[str, int]:
    rows: dict[str, int] = {}
    for seq, n in plan:
        rows[seq.scope.tenant] = rows.get(seq.scope.tenant, 0) + n
    return rows


def test_one_stream_beside_fifteen_is_slowed_by_at_most_the_bound():
    plan = decodes("a", 15) + decodes("b", 1)
    kept = bound(plan)
    # b alone: 16 ms; the bound 24 ms is five rows: b's and four of a's (a fifth would make 26 ms)
    assert tenants(kept) == {"a": 4, "b": 1}
    assert cost().seconds(Work(len(kept), 0)) <= 1.5 * cost().seconds(Work(1, 0)) < cost().seconds(Work(6, 0))


def test_a_prompt_waits_for_its_first_token_as_a_decode_row_waits_for_its_next():
    """b's prompt of 6 tokens is computed in this step, beside a's fifteen decode rows."""
    first = Sequence(list(range(200, 206)), GREEDY, CacheScope(tenant="b"))
    plan = decodes("a", 15) + [(first, 6)]
    # the prompt alone: 26 ms; the bound 39 ms is the prompt and 6 of a's rows (a seventh would make 40 ms)
    assert tenants(bound(plan)) == {"a": 6, "b": 6}


def test_a_tenant_with_work_but_no_row_in_the_step_counts_with_none():
    """b has a request waiting, or has just finished one: the step delays its next first token."""
    alone = decodes("a", 16)
    assert bound(alone) == alone
    # with none of b's rows: 14 ms; the bound 21 ms is three of a's rows (a fourth would make 22 ms)
    assert tenants(bound(alone, others={"b"})) == {"a": 3}


def test_equal_parts_one_tenant_alone_and_no_bound_keep_every_row():
    equal = decodes("a", 8) + decodes("b", 8)  # 30 ms against 46 ms: sharing equally costs what it costs
    assert bound(equal) == equal
    alone = decodes("a", 16)
    assert bound(alone) == alone
    hog = decodes("a", 15) + decodes("b", 1)
    assert bound(hog, slowdown=math.inf) == hog


def test_an_equal_part_is_by_weight_and_a_tenant_keeps_a_row():
    rows_cost = (0.001, 0.01, 0.0, 0.0)  # rows cost nearly all of a step: the bound alone would leave b's row only
    plan = decodes("a", 15) + decodes("b", 1)
    assert tenants(bound(plan, rows_cost)) == {"a": 1, "b": 1}
    assert tenants(bound(plan, rows_cost, {"a": 0.75})) == {"a": 3, "b": 1}  # b's weight is 0.25


def prompt(tenant: str, n: int) -> tuple[Sequence, int]:
    """A tenant's prompt of n + 88 tokens, its first n in this step's chunk."""
    return Sequence(list(range(100, 188 + n)), GREEDY, CacheScope(tenant=tenant)), n


HEAVY_A = {"a": 5000.0, "b": 30.0}  # a has had far more engine time lately than b


def test_a_heavy_tenants_long_prompt_beside_another_tenants_stream_waits_then_runs_in_the_slack_it_left():
    """a's 512-token chunk beside b's one stream: 16 ms for b alone, so 24 ms in all (4 of a's tokens); the whole
    chunk would have made b's step 1,040 ms. It is held back HELD steps, then takes what those steps left, 8 ms each,
    and its own: 56 ms in all, 20 tokens."""
    plan = decodes("b", 1) + [prompt("a", 512)]
    assert tenants(bound(plan, usage=HEAVY_A)) == {"b": 1}
    assert tenants(bound(plan, usage=HEAVY_A, held={"a"})) == {"a": 20, "b": 1}
    two = decodes("b", 2) + [prompt("a", 512)]  # b alone 18 ms, so 27 in all and 9 left a step: 63 ms, 22 tokens
    assert tenants(bound(two, usage=HEAVY_A, held={"a"})) == {"a": 22, "b": 2}
    three = decodes("b", 3) + [prompt("a", 512)]
    rows_cost = (0.001, 0.01, 0.0, 0.0)  # b's 3 rows alone: 31 ms, so 46.5 ms and 15.5 left: 108.5 ms, 7 tokens
    assert tenants(bound(three, rows_cost, usage=HEAVY_A, held={"a"})) == {"a": 7, "b": 3}
    logits = Sequence(list(range(100, 700)), SamplingParams(prompt_logprobs=0), CacheScope(tenant="a"))
    heads_cost = (0.014, 0.002, 0.0, 0.0025)  # a prompt token's logits cost more than its row: 56 ms, 8 tokens
    assert tenants(bound(decodes("b", 1) + [(logits, 512)], heads_cost, usage=HEAVY_A, held={"a"})) == \
        {"a": 8, "b": 1}
    small = decodes("b", 1) + [prompt("a", 4)]  # a chunk within the bound is not held back
    assert tenants(bound(small, usage=HEAVY_A)) == {"a": 4, "b": 1}


KEYS_COST = (0.014, 0.002, 3e-6, 0.0)  # a token at a context of 3,000 costs 11 ms, most of it for the keys it reads


def steps(plan, slowdown: float, count: int) -> tuple[list[int], list[float]]:
    """`count` steps of b's one stream beside a's prompts at a context of 3,000 (cut by bounded()): the tokens a's
    chunks ran in each, and each step's cost."""
    usage, step_cost, ran, seconds = Usage(), cost(KEYS_COST), [], []
    usage.tokens = dict(HEAVY_A)
    for _ in range(count):
        kept = bounded(plan, step_cost, {}, slowdown, {"a", "b"}, usage)
        ran.append(sum(n for seq, n in kept if seq.scope.tenant == "a"))
        seconds.append(step_cost.seconds(sum((Work.chunk(seq.num_computed, n) for seq, n in kept), Work())))
    return ran, seconds


def long_prompt(tenant: str) -> tuple[Sequence, int]:
    seq = Sequence(list(range(4000)), GREEDY, CacheScope(tenant=tenant))
    seq.num_computed = 3000
    return seq, 512


def test_a_heavy_tenants_chunk_that_fits_no_step_waits_and_runs_in_the_slack_of_the_steps_it_waited():
    """b alone: 16 ms, so a step may take 24 ms; one token of a's at a context of 3,000 would make it 27 ms. a's
    chunk is held back HELD steps, then runs in their slack and its own (40 ms: 3 tokens), and b's steps take 24 ms
    or less on average, where a token of a's in each would have made them 27."""
    ran, seconds = steps(decodes("b", 1) + [long_prompt("a")], 1.5, 2 * (HELD + 1))
    assert ran == ([0] * HELD + [3]) * 2
    assert sum(seconds) / len(seconds) <= 1.5 * cost(KEYS_COST).seconds(Work.chunk(20, 1))


def test_a_heavy_tenants_chunks_held_back_run_their_equal_part_in_all_after_held_steps():
    """With no slack at all (slowdown 1), a's three chunks wait HELD steps, then take one token in all, as many as b
    has rows, not one each."""
    ran, _ = steps(decodes("b", 1) + [long_prompt("a") for _ in range(3)], 1.0, 2 * (HELD + 1))
    assert ran == ([0] * HELD + [1]) * 2


def test_a_heavy_tenants_prompt_is_cut_while_another_is_between_two_requests():
    """b has just finished a request and has nothing in the step: its next runs in a lane step inside it, and gets
    its second token only after it. The bound is 21 ms (b's nothing: 14 ms), so a's chunk is held back, then takes
    49 ms, 17 tokens; a tenant that is only waiting cuts no chunk (its request could not be admitted into a step so
    cut)."""
    plan = [prompt("a", 512)]
    assert tenants(bound(plan, others={"b"}, usage=HEAVY_A, finished={"b"})) == {}
    assert tenants(bound(plan, others={"b"}, usage=HEAVY_A, finished={"b"}, held={"a"})) == {"a": 17}
    assert bound(plan, others={"b"}, usage=HEAVY_A) == plan


def test_a_prompt_is_not_cut_beside_its_own_tenants_stream_nor_if_its_tenant_has_had_less():
    own = decodes("b", 1) + [prompt("b", 512)]
    assert bound(own, others={"a"}, usage=HEAVY_A) == own
    light = decodes("b", 1) + [prompt("c", 512)]  # c's first request: its first token waits for no one's stream
    assert bound(light, usage=HEAVY_A) == light
    assert tenants(bound(decodes("b", 1) + [prompt("a", 512)], slowdown=math.inf, usage=HEAVY_A))["a"] == 512


def test_held_rows_take_turns_and_change_no_tokens(tiny_model):
    """Through the engine: tenant a's fifteen answers decode four a step while b's one decodes (b every step), all
    of a's move on in turn, and every answer is the one it gets alone."""
    llm = LLM(model=tiny_model, max_num_seqs=16, tenant_slowdown=1.5)
    engine = llm.engine
    prompts = [[100 + i] + list(range(3000, 3019)) for i in range(16)]
    a = [engine.add_request(p, GREEDY, CacheScope(tenant="a")) for p in prompts[:15]]
    while any(not s.output_ids for s in a):
        engine.step()
    b = engine.add_request(prompts[15], GREEDY, CacheScope(tenant="b"))
    while not b.output_ids:
        engine.step()
    turns = {s.id: 0 for s in a}
    engine.cost.coef, engine.cost.record = np.array(COEF), lambda work, seconds: None  # set by hand, not learned
    while b.finish_reason is None:
        before = len(b.output_ids)
        touched = {s.id for s in engine.step()}
        assert len(b.output_ids) == before + 1
        assert len(touched & set(turns)) == 4
        for i in touched & set(turns):
            turns[i] += 1
    assert min(turns.values()) >= 2  # 11 steps of four rows among fifteen answers: each had two turns or three
    while engine.has_unfinished():
        engine.step()
    alone = LLM(model=tiny_model, enable_prefix_cache=False)
    for seq, p in zip(a + [b], prompts):
        assert seq.output_ids == alone.generate([p], GREEDY)[0].token_ids


def test_a_tenant_with_nothing_in_the_step_runs_inside_it_on_a_held_back_slot(tiny_model):
    """a holds four of five slots and c one; rows cost nearly all of a step, so the step decodes c's row and one of
    a's. b's request (a cached prefix and 8 new tokens) arrives during it: it runs before the step's next layer, on
    the slot of one of a's held-back sequences (preempted, its blocks kept cached), and every answer is the one it
    gets alone."""
    llm = LLM(model=tiny_model, max_num_seqs=5)
    engine = llm.engine
    prefix = list(range(5000, 5064))
    llm.generate([prefix + [1]], GREEDY, CacheScope(tenant="b"))  # b caches its prefix
    prompts = [[100 + i] + list(range(3000, 3019)) for i in range(5)]
    seqs = [engine.add_request(p, GREEDY, CacheScope(tenant="a" if i < 4 else "c")) for i, p in enumerate(prompts)]
    while any(not s.output_ids for s in seqs):
        engine.step()
    lanes, b = [], []

    def between() -> None:  # what the server's worker does before each layer
        if not b:
            b.append(engine.add_request(prefix + list(range(7000, 7008)), GREEDY, CacheScope(tenant="b")))
            lanes.append([s.id for s in engine.lane_step()])

    engine.cost.coef, engine.cost.record = np.array((0.001, 0.01, 0.0, 0.0)), lambda work, seconds: None
    preemptions = engine.scheduler.num_preemptions
    engine.step(between)
    assert lanes == [[b[0].id]] and b[0].output_ids and b[0].cache.num_cached == len(prefix)
    assert engine.scheduler.num_preemptions == preemptions + 1
    while engine.has_unfinished():
        engine.step()
    alone = LLM(model=tiny_model, enable_prefix_cache=False)
    for seq in seqs + b:
        assert seq.output_ids == alone.generate([seq.tokens[:seq.num_prompt]], GREEDY)[0].token_ids
