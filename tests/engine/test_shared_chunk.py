"""--shared-chunk: how a tenant's long prompts make way for another tenant's short request. While two tenants have
work, each one's prefill is capped per step except the one with the least engine time lately (a deficit round
robin); a step that gives a request its first token carries no unfinished prefill chunk (every other step at
most); and a short request that arrives during a step runs inside it, before one of its layers (once a step, then
only for the tenants it ran), with its next tokens in lanes too. Outputs are those of a run without any of this."""
import time

import numpy as np

from prefixcache import LLM, CacheScope, SamplingParams
from prefixcache.engine.engine import StepFailed
from prefixcache.engine.sequence import Sequence, Status
from prefixcache.engine.usage import NEXT_REQUEST

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
A = [list(range(100 + 400 * i, 400 + 400 * i)) for i in range(2)]  # tenant a's long prompts
B = list(range(9000, 9020))  # tenant b's short one


def _finish(llm: LLM, seqs: list[Sequence]) -> list[tuple[list[int], float]]:
    while llm.engine.has_unfinished():
        llm.engine.step()
    return [(o.token_ids, o.cumulative_logprob) for o in (s.output() for s in seqs)]


def test_the_cap_follows_engine_time_and_the_first_token_step(tiny_model):
    """With shared_chunk 32: step 1 ties (no engine time yet), so both are capped and b's request gets the step to
    itself; step 2 is a's in full (b has had engine time, a none); step 3 caps a again (a has had more, and b still
    decodes): a's first prompt decodes, its second gets 32 tokens. a alone takes the whole step budget, and
    outputs equal those without a cap. (No slowdown bound: by the step costs measured, it would cut a's chunks beside
    b's decode row, engine/slowdown.py.)"""
    def run(shared_chunk: int, with_b: bool) -> tuple[list[int], list]:
        llm = LLM(model=tiny_model, shared_chunk=shared_chunk, enable_prefix_cache=False, tenant_slowdown=0)
        seqs = [llm.engine.add_request(p, PARAMS, CacheScope(tenant="a")) for p in A]
        if with_b:
            seqs.append(llm.engine.add_request(B, PARAMS, CacheScope(tenant="b")))
        computed = []  # a's prefill tokens after each of the first three steps
        for _ in range(3):
            llm.engine.step()
            computed.append(sum(s.num_computed for s in seqs[:2]))
        assert not with_b or seqs[2].output_ids  # b's whole prompt ran in the first step
        return computed, _finish(llm, seqs)

    capped, capped_out = run(32, True)
    alone, alone_out = run(32, False)
    free, free_out = run(0, True)
    assert capped == [0, 511, 544] and alone[0] == 512 and free[0] > 400
    assert capped_out[:2] == alone_out == free_out[:2] and capped_out[2] == free_out[2]


def test_a_tenant_that_sent_a_request_lately_caps_no_one_once_it_is_done(tiny_model):
    """The trickle: a's long prompts run; b's small request caps a while it is in the engine (and for the
    NEXT_REQUEST gap a client's next request takes), and once b is done a runs uncapped again, where a cap by recent
    activity held a to 32 tokens a step for seconds."""
    llm = LLM(model=tiny_model, shared_chunk=32, enable_prefix_cache=False, max_batch_tokens=64)
    a = llm.engine.add_request(A[0] + A[1], PARAMS, CacheScope(tenant="a"))
    llm.engine.step()
    b = llm.engine.add_request(B, PARAMS, CacheScope(tenant="b"))
    while b.finish_reason is None:
        before = a.num_computed
        llm.engine.step()
        assert a.num_computed - before <= 32
    time.sleep(NEXT_REQUEST)
    before = a.num_computed
    llm.engine.step()
    assert a.num_computed - before == 64


def test_first_token_steps_alternate_with_the_others(tiny_model):
    """Two tenants' short requests arriving one step apart: the first gets a step of its own, the second shares
    the next step with a's chunk (a long prompt is never held back two steps in a row)."""
    llm = LLM(model=tiny_model, shared_chunk=32, enable_prefix_cache=False)
    a = llm.engine.add_request(A[0], PARAMS, CacheScope(tenant="a"))
    llm.engine.add_request(B, PARAMS, CacheScope(tenant="b"))
    llm.engine.step()
    assert a.num_computed == 0
    c = llm.engine.add_request(list(range(7000, 7010)), PARAMS, CacheScope(tenant="c"))
    llm.engine.step()
    assert a.num_computed > 0 and c.output_ids


def test_short_requests_run_inside_the_step_under_way(tiny_model):
    """b's and c's requests (a cached prefix and 8 new tokens each) arrive while a's step runs: they are computed
    before the step's next layer, in one lane step, and get their first tokens before it ends. e's arrives next,
    of the same tenant, and runs in a lane too (one lane a step admits requests, but a tenant whose requests ran in
    one may have its next ones in others). d's, with 100 tokens (more than shared_chunk), is never a lane's. Every
    output equals a run without lanes, and a's step computes what it planned."""
    prefix = list(range(5000, 5064))
    prompts = {"b": prefix + B[:8], "c": prefix + B[8:16], "e": prefix + list(range(7000, 7008)),
               "d": prefix + list(range(6000, 6100))}
    llm = LLM(model=tiny_model, shared_chunk=32, tenant_slowdown=0)  # b's and c's next tokens wait for the step
    _finish(llm, [llm.engine.add_request(prefix + [1], PARAMS, CacheScope(tenant="b"))])  # b caches its prefix
    a = llm.engine.add_request(A[0], PARAMS, CacheScope(tenant="a"))
    arrivals, seqs, lanes = [["b", "c"], ["e"], ["d"]], {}, []

    def between() -> None:  # what the server's worker does before each layer
        if arrivals:
            for name in arrivals.pop(0):
                seqs[name] = llm.engine.add_request(prompts[name], PARAMS, CacheScope(tenant="b"))
            lanes.append(sorted(s.id for s in llm.engine.lane_step()))

    llm.engine.step(between)  # a's whole prompt (b has no work when it is planned); the tiny model has two layers
    assert lanes == [sorted([seqs["b"].id, seqs["c"].id]), [seqs["e"].id]] and a.num_computed == len(A[0])
    assert seqs["b"].output_ids and seqs["c"].output_ids and seqs["e"].output_ids
    assert seqs["b"].cache.num_cached == len(prefix)
    llm.engine.step(between)  # d arrives: 100 tokens are more than a lane takes
    assert lanes[-1] == [] and not seqs["d"].output_ids
    out = _finish(llm, [a, *(seqs[k] for k in "bced")])

    cold = LLM(model=tiny_model, enable_prefix_cache=False)
    expected = [cold.generate([p], PARAMS)[0] for p in (A[0], *(prompts[k] for k in "bced"))]
    assert out == [(o.token_ids, o.cumulative_logprob) for o in expected]


def test_a_short_request_a_running_prompts_chunk_left_waiting_runs_in_a_lane_before_the_steps_first_layer(tiny_model):
    """a's 300-token prompt runs in chunks of the whole step budget (64 tokens), so b's request (a cached prefix and
    8 new tokens), which came before the step, is not in it: the worker lets the engine try what a step left waiting
    before its first layer, as it does what arrives during it, and b gets its first token now, not after a's prompt
    (it waited for every one of a's chunks)."""
    prefix = list(range(5000, 5064))
    llm = LLM(model=tiny_model, max_batch_tokens=64, tenant_slowdown=0)  # b's next tokens wait for the step
    _finish(llm, [llm.engine.add_request(prefix + [1], PARAMS, CacheScope(tenant="b"))])  # b caches its prefix
    a = llm.engine.add_request(A[0], PARAMS, CacheScope(tenant="a"))
    llm.engine.step()
    b = llm.engine.add_request(prefix + B[:8], PARAMS, CacheScope(tenant="b"))
    lanes = []

    def between() -> None:  # what the server's worker does before each layer, with nothing arriving
        if llm.engine.scheduler.lane_due:
            lanes.append([s.id for s in llm.engine.lane_step()])

    llm.engine.step(between)
    assert lanes == [[b.id], []] and b.output_ids and a.num_computed == 128  # its next token waits for the step
    out = _finish(llm, [a, b])
    cold = LLM(model=tiny_model, enable_prefix_cache=False)
    expected = [cold.generate([p], PARAMS)[0] for p in (A[0], prefix + B[:8])]
    assert out == [(o.token_ids, o.cumulative_logprob) for o in expected]


def test_a_request_run_in_a_lane_gets_its_next_tokens_in_lanes_as_they_come_due(tiny_model):
    """b's request runs in a lane step before the first layer of a's step (it came just before it); its next token
    comes due at once (every step costs nothing, by hand), so a lane step before the second layer gives it, not the
    step's end (a's 512-token steps kept b's second token 1.3 s), and b's next request, arriving then, runs in it too
    (its client's next question need not wait for the step either), c's not: one lane a step admits requests of
    others. b's prompt ends a block: the token's KV needs a new one. Every answer is the one it gets alone."""
    prefix = list(range(5000, 5064))
    llm = LLM(model=tiny_model, max_batch_tokens=64)
    _finish(llm, [llm.engine.add_request(prefix + [1], PARAMS, CacheScope(tenant=t)) for t in "bc"])  # cached
    a = llm.engine.add_request(A[0], PARAMS, CacheScope(tenant="a"))
    llm.engine.step()
    b = llm.engine.add_request(prefix + B[:16], PARAMS, CacheScope(tenant="b"))
    llm.engine.cost.coef, llm.engine.cost.record = np.zeros(4), lambda work, seconds: None  # set, not learned
    lanes, later = [], []

    def between() -> None:
        if lanes:  # before the second layer: b's next request, and c's
            later.extend(llm.engine.add_request(prefix + B[:8], PARAMS, CacheScope(tenant=t)) for t in "bc")
        if llm.engine.scheduler.lane_due:
            lanes.append(sorted((s.id, len(s.output_ids)) for s in llm.engine.lane_step()))

    llm.engine.step(between)  # the tiny model has two layers
    assert lanes == [[(b.id, 1)], sorted([(b.id, 2), (later[0].id, 1)])] and a.num_computed == 128
    assert not later[1].output_ids
    out = _finish(llm, [a, b, *later])
    cold = LLM(model=tiny_model, enable_prefix_cache=False)
    expected = [cold.generate([p], PARAMS)[0] for p in (A[0], prefix + B[:16], prefix + B[:8], prefix + B[:8])]
    assert out == [(o.token_ids, o.cumulative_logprob) for o in expected]


def test_no_lane_without_shared_chunk(tiny_model):
    llm = LLM(model=tiny_model)
    llm.engine.add_request(A[0], PARAMS, CacheScope(tenant="a"))
    b = llm.engine.add_request(B, PARAMS, CacheScope(tenant="b"))
    lanes = []
    llm.engine.step(lambda: lanes.append(llm.engine.lane_step()))
    assert lanes == [[], []] and b.output_ids  # b ran in the step's own batch


def test_a_failing_lane_step_fails_its_requests_only(tiny_model):
    """A fault injected into the lane's forward: StepFailed names b alone, b's blocks are freed, and a's step goes on
    to the output it has without the fault."""
    llm = LLM(model=tiny_model, shared_chunk=32, enable_prefix_cache=False)
    engine, run = llm.engine, llm.engine.runner.run
    free = engine.pool.num_free
    a = engine.add_request(A[0], PARAMS, CacheScope(tenant="a"))
    failed = []

    def failing(plan, *args):
        if any(seq.tokens[:len(B)] == B for seq, _ in plan):
            raise RuntimeError("injected fault")
        return run(plan, *args)

    def between() -> None:
        if failed:
            return
        b = engine.add_request(B, PARAMS, CacheScope(tenant="b"))
        try:
            engine.lane_step()
        except StepFailed as e:
            failed.extend(e.seqs)
        assert failed == [b] and b.status is Status.FINISHED

    engine.runner.run = failing
    engine.step(between)
    assert failed and a.num_computed > 0
    out = _finish(llm, [a])
    assert engine.pool.num_free == free
    cold = LLM(model=tiny_model, enable_prefix_cache=False).generate([A[0]], PARAMS)[0]
    assert out == [(cold.token_ids, cold.cumulative_logprob)]
