"""The scheduler against latency objectives (engine/pace.py): its decisions on a clock passed in and a step cost set
by hand (10 ms a step, 1 ms a row, nothing per key), so no test depends on the machine's speed. Sequences are real,
on the tiny model; the decodes get their first token from real steps, then their times are set."""
import time

import numpy as np
import pytest

from prefixcache import LLM, CacheScope, SamplingParams
from prefixcache.engine.sequence import Status
from prefixcache.engine.step_cost import StepCost, Work

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
NOW = 1000.0  # the clock passed in


def prompt(i: int, n: int) -> list[int]:
    """n tokens that share nothing with another i's."""
    return [100 + i] + list(range(3000, 3000 + n - 1))


def decoding(tiny_model, slack: float = 0.05, schedule: bool = True, **objectives) -> LLM:
    """An engine with two sequences decoding whose next tokens are due `slack` after NOW under a TPOT objective of
    100 ms, and the step cost set by hand."""
    llm = LLM(model=tiny_model, slo_schedule=schedule, **objectives)
    for i in range(2):
        llm.engine.add_request(prompt(i, 20), LONG)
    llm.engine.step()
    due_at(llm, NOW + slack)
    return llm


def due_at(llm: LLM, t: float, per_row: float = 0.001) -> None:
    """The step cost set by hand (10 ms a step, `per_row` a row), and the running sequences' first tokens set so
    that, if every step after the next took what a decode step takes, the next may end by t and each still meet the
    TPOT the schedule aims at (pace.AIM of the objective) over its answer."""
    e = llm.engine
    e.cost.coef, e.cost.record = np.array([0.01, per_row, 0.0, 0.0]), lambda work, seconds: None  # not learned
    decode = e.cost.seconds(Work(len(e.scheduler.running), 0))
    for seq in [s for s in e.scheduler.running if s.output_ids]:  # a prompt under way has no first token yet
        left = seq.params.max_tokens - len(seq.output_ids)
        tpot = e.scheduler.pace.tpot if e.scheduler.pace else 0.1  # unscheduled: the objective itself
        seq.first_token_time = t - tpot * (seq.params.max_tokens - 1) + decode * (left - 1)


def waiting(llm: LLM, i: int, n: int, arrival: float, tokens: list[int] | None = None,
            params: SamplingParams = LONG):
    seq = llm.engine.add_request(tokens or prompt(i, n), params)
    seq.arrival = arrival
    return seq


def test_a_step_takes_the_prefill_that_fits_its_decodes_tpot_slack(tiny_model):
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)
    fits = waiting(llm, 10, 30, NOW)  # 12 ms of decodes + 30 ms: within the 50 ms left
    big = waiting(llm, 11, 60, NOW)  # another 60 ms would not be; its first token is not due for a second
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))
    assert plan[fits.id] == 30 and fits.status is Status.RUNNING
    assert big.id not in plan and big.status is Status.WAITING


def test_no_step_outlasts_the_tpot_aimed_at_while_answers_decode(tiny_model):
    llm = decoding(tiny_model, 10.0, slo_tpot_ms=100, slo_ttft_ms=1000)  # next tokens due in 10 s: slack for anything
    long = waiting(llm, 10, 200, NOW)  # 200 ms of prefill, its first token not due for 900 ms
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))
    assert plan[long.id] == 78  # 12 ms of decodes + 78 ms: the 90 ms aimed at (0.9 of the 100 ms objective)


def test_a_waiting_request_goes_once_waiting_longer_would_miss_its_first_token(tiny_model):
    llm = decoding(tiny_model, 0.02, slo_tpot_ms=100, slo_ttft_ms=1000)  # 8 ms left past the decodes: no chunk
    big = waiting(llm, 11, 60, NOW - 0.75)  # aimed at NOW + 0.15 (0.9 of 1 s): a step of 12 ms, its own 70 ms fit
    assert big.id not in dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW + 0.07))  # now they do not
    assert plan[big.id] == 60  # though the decodes' next token is late: a first token missed is not made up


def test_an_urgent_request_goes_past_the_slack_only_as_far_as_the_answers_decoding_are_ahead_of_the_objective(
        tiny_model):
    # the decodes' next token against one every 90 ms (0.9 of the objective) from their first: ahead by less than
    # the urgent request's step would take (142 ms), behind (though decode steps of 12 ms could catch up), ahead by more
    for ahead, whole in ((0.08, False), (-0.05, False), (0.2, True)):
        llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)  # decodes 12 ms; any step may take 90
        s = llm.engine.scheduler
        for seq in s.running:
            seq.first_token_time = NOW + ahead - s.pace.tpot * len(seq.output_ids)
        urgent = waiting(llm, 11, 130, NOW - 0.75)  # due by NOW + 0.15: its own step of 140 ms fits, not after another
        n = dict((q.id, n) for q, n in s.schedule(NOW)).get(urgent.id, 0)
        assert (n == 130) == whole, (ahead, n)  # else at most a chunk within the slack


def test_a_step_does_not_grow_past_the_deadline_of_a_first_token_it_gives(tiny_model):
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)
    s = llm.engine.scheduler
    for seq in list(s.running):
        s.finish(seq)
    soon = waiting(llm, 10, 20, NOW - 0.85)  # due by NOW + 0.05: a step of its own takes 30 ms
    later = waiting(llm, 11, 100, NOW)  # due by NOW + 0.9; nothing decodes, so no TPOT slack bounds the step
    plan = dict((q.id, n) for q, n in s.schedule(NOW))
    assert plan[soon.id] == 20 and plan.get(later.id, 0) <= 20  # at most the chunk that still ends by NOW + 0.05


def test_a_request_runs_in_the_lane_only_if_its_answer_can_absorb_the_rest_of_the_step_under_way(tiny_model):
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)
    s = llm.engine.scheduler
    for seq in list(s.running):
        s.finish(seq)
    waiting(llm, 10, 300, NOW)
    s.schedule(NOW)  # nothing decodes: a step of 310 ms computes the 300-token prompt
    short = waiting(llm, 11, 20, NOW - 0.01, params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    long = waiting(llm, 12, 20, NOW)  # 200 tokens: a second token 310 ms late is made up over the answer
    assert [(seq.id, n) for seq, n in s.lane(NOW)] == [(long.id, 20)]  # 3 gaps of 90 ms cannot absorb 310 ms
    assert short.status is Status.WAITING


def test_objectives_not_scheduled_by_only_count_every_waiting_request_goes_as_before(tiny_model):
    llm = decoding(tiny_model, schedule=False, slo_tpot_ms=100, slo_ttft_ms=1000)
    big = waiting(llm, 11, 60, NOW)
    assert dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))[big.id] == 60


def test_a_request_with_its_prefix_cached_goes_ahead_of_a_cold_one_when_only_it_fits(tiny_model):
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)
    shared = list(range(3000, 3064))
    due_at(llm, time.monotonic() + 10)  # the decodes leave this request room on the engine's own clock
    llm.generate([shared + [7]], SamplingParams(temperature=0.0, max_tokens=1))  # 64 tokens cached
    due_at(llm, NOW + 0.05)
    cold = waiting(llm, 12, 74, NOW - 0.1, tokens=[5] + shared[:73])  # first: 74 tokens to compute
    warm = waiting(llm, 13, 74, NOW, tokens=shared + list(range(200, 210)))  # 10 past the cached 64
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))
    assert plan[warm.id] == 10 and warm.cache.num_cached == 64
    assert cold.id not in plan or plan[cold.id] <= 28  # at most the slack left over, as a chunk


def test_what_slack_is_left_goes_to_a_chunk_of_a_prompt_too_long_to_fit(tiny_model):
    llm = decoding(tiny_model, slo_tpot_ms=100)
    long = waiting(llm, 11, 300, NOW)  # no TTFT objective: never urgent
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW + 0.0005))
    assert plan[long.id] == 37  # 10 ms + 2 decode rows + 37 rows = 49 ms, within the 49.5 ms left
    assert long.status is Status.RUNNING
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW + 0.2))  # the decodes are late already
    assert plan[long.id] == llm.engine.blocks.bs  # a running prompt still moves on, a block a step


def test_a_request_that_can_no_longer_meet_its_first_token_queues_behind_its_tenants_others(tiny_model):
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)
    late = waiting(llm, 11, 30, NOW - 2.0)  # its first token was due a second ago
    fresh = waiting(llm, 12, 30, NOW)
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))
    assert plan[fresh.id] == 30 and late.id not in plan  # the slack held one of them


def test_a_due_request_goes_first_but_within_the_slack(tiny_model):
    """Past capacity the backlog becomes due: a due request that went past the slack made every answer under way
    late. It takes the chunk that fits, before any other request."""
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)  # 50 ms left: 10 ms, 2 decode rows, 37 more
    late = waiting(llm, 11, 100, NOW - 2.0)
    late.skipped = llm.engine.scheduler.fairness_steps  # passed over long enough
    fresh = llm.engine.add_request(prompt(12, 20), LONG, CacheScope("b"))  # another tenant's; it would fit whole
    fresh.arrival = NOW
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))
    assert plan[late.id] == 37 and fresh.id not in plan


def test_a_late_request_is_not_due_while_one_of_its_tenant_can_still_meet_its_first_token(tiny_model):
    """Past capacity the late requests, due in turn, went first and made every request after them late too."""
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)  # the slack holds one of the two
    late = waiting(llm, 11, 30, NOW - 2.0)
    late.skipped = llm.engine.scheduler.fairness_steps
    fresh = waiting(llm, 12, 30, NOW)
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))
    assert plan[fresh.id] == 30 and late.id not in plan
    llm.engine.scheduler.abort(fresh)
    plan = dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))  # none of its tenant can now: it goes
    assert plan[late.id] == 30


def test_objectives_are_the_tenants_fair_turns_too(tiny_model):
    """Fairness decides whose request goes next; the objectives only how much a step takes."""
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)
    e = llm.engine
    a = [e.add_request(prompt(20 + i, 15), LONG, CacheScope("a")) for i in range(2)]
    b = e.add_request(prompt(30, 15), LONG, CacheScope("b"))
    for seq, at in zip((*a, b), (NOW - 0.02, NOW - 0.01, NOW)):
        seq.arrival = at
    plan = dict((s.id, n) for s, n in e.scheduler.schedule(NOW))  # the slack holds two of 15 tokens, not three
    assert a[0].id in plan and b.id in plan and a[1].id not in plan  # b's turn comes before a's second


def test_the_step_cost_is_learned_from_the_steps_seen():
    cost = StepCost()
    rng = np.random.default_rng(0)
    for i in range(64):
        rows = int(rng.integers(1, 200))
        work = Work(rows, int(rng.integers(0, 10**6)), int(rng.integers(0, rows)) if i % 2 else 0)  # prompt logprobs
        cost.record(work, 0.004 + 0.002 * work.rows + 3e-8 * work.keys + 3e-4 * work.heads)
    assert cost.coef == pytest.approx([0.004, 0.002, 3e-8, 3e-4], rel=0.05)
    assert cost.seconds(Work(10, 1000)) == pytest.approx(0.004 + 0.02 + 3e-5, rel=0.05)


def test_a_step_followed_at_once_by_the_next_costs_until_the_next_starts(monkeypatch):
    """What a step's tokens wait for includes their handing out after the forward: a step the next follows at once is
    counted until that one starts; one the engine idles after, until it ends."""
    clock = iter([1.0, 2.0, 3.0, 3.2])
    monkeypatch.setattr("prefixcache.engine.step_cost.time.monotonic", lambda: next(clock))
    cost, seen = StepCost(), []
    cost.record = lambda work, seconds: seen.append((work.rows, seconds))
    began = cost.starting()  # 1.0
    cost.ran(Work(3), began, follows=True)  # the forward ends (at 1.5, say): not counted yet
    assert not seen
    began = cost.starting()  # 2.0: the step before cost 1.0
    cost.ran(Work(5), began, follows=False)  # ends at 3.0, and the engine idles
    assert seen == [(3, 1.0), (5, 1.0)]
    cost.starting()  # 3.2: nothing more to count
    assert len(seen) == 2


def test_a_new_servers_first_step_corrects_the_prior():
    cost = StepCost()  # its prior: 3 ms a row, three times SmolLM2's 1 ms on a 2-core Xeon
    first = Work.chunk(0, 512)
    cost.record(first, 0.55)  # one step of a cold prompt's first 512 tokens
    assert cost.seconds(first) == pytest.approx(0.55, rel=0.05)
    assert cost.seconds(Work.chunk(512, 64)) < 0.1  # the next chunk is sized by it, not by the prior


def test_no_request_joins_while_one_more_decode_would_make_every_step_miss_tpot(tiny_model):
    llm = decoding(tiny_model, 0.5, slo_tpot_ms=100, slo_ttft_ms=1000)
    due_at(llm, NOW + 10, per_row=0.04)  # 40 ms a row: two decodes take 90 ms, three 130; slack for anything
    small = waiting(llm, 11, 5, NOW)  # its prefill fits the 500 ms of slack: 10 ms + 7 rows
    assert small.id not in dict((s.id, n) for s, n in llm.engine.scheduler.schedule(NOW))


def test_inside_a_step_a_request_runs_in_the_lane_if_its_step_fits_what_the_step_leaves_of_the_slack(tiny_model):
    """Scheduler.lane with objectives: any tenant's request (here the decodes' own tenant), if it can still meet its
    first token and its own step fits in the slack the step under way leaves; with nothing decoding, lane steps that
    take in all no longer than the step under way."""
    llm = decoding(tiny_model, slo_tpot_ms=100, slo_ttft_ms=1000)
    s = llm.engine.scheduler
    s.schedule(NOW)  # the two decodes: 12 ms of the 50 ms their next tokens allow
    fits = waiting(llm, 10, 20, NOW)  # 10 ms + 20 rows: 30 ms of the 38 left
    late = waiting(llm, 11, 5, NOW - 2.0)  # its first token was due a second ago
    over = waiting(llm, 12, 20, NOW)  # another 30 ms would not fit the 8 ms then left
    assert [(seq.id, n) for seq, n in s.lane(NOW)] == [(fits.id, 20)]
    assert late.status is Status.WAITING and over.status is Status.WAITING
    for seq in list(s.running):
        s.finish(seq)
    s.schedule(NOW)  # nothing decodes; the waiting two join in this step of 35 ms (10 ms + 25 rows)
    short = waiting(llm, 13, 20, NOW)  # 30 ms: no TPOT slack to keep, but lane steps take no longer than the step
    more = waiting(llm, 14, 20, NOW)  # another 30 ms would
    assert [(seq.id, n) for seq, n in s.lane(NOW)] == [(short.id, 20)] and more.status is Status.WAITING


def test_a_request_that_fits_whole_goes_before_the_next_chunk_of_a_prompt_under_way(tiny_model):
    llm = decoding(tiny_model, slo_tpot_ms=100)
    s = llm.engine.scheduler
    long = waiting(llm, 11, 300, NOW)
    s.schedule(NOW)  # a chunk of it: the slack's worth
    due_at(llm, NOW + 0.0505)
    short = waiting(llm, 12, 15, NOW)
    plan = dict((seq.id, n) for seq, n in s.schedule(NOW))
    assert plan[short.id] == 15 and plan[long.id] == 23  # 10 ms + 2 decode rows + 15 + 23 rows: 50 of 50.5 ms
