"""Speculative decoding (engine/drafter.py, engine/speculation.py, Sampler.pick): greedy output and every logit are
those of speculation off, and so is seeded sampled output; drafts never cross a scope."""
import pytest
import torch
from conftest import generate_with_logits

from prefixcache import LLM, Config, SamplingParams
from prefixcache.cache.scope import CacheScope
from prefixcache.engine.drafter import MAX_DRAFT, Drafter
from prefixcache.engine.drafting import DRAFT_MISSES, MAX_PAUSE, Drafting
from prefixcache.engine.sampler import Sampler
from prefixcache.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # the real model's, 8 at once: 16 s at 40


def _repetitive(tokenizer, i: int) -> list[int]:
    """A prompt whose continuation copies from it: a list, then the request to repeat it."""
    items = ", ".join(f"item {j * (i + 3)} of set {i}" for j in range(30))
    return tokenizer(f"Here is a list: {items}.\nThe same list again: {items[:40]}").input_ids


@pytest.mark.parametrize("fixture", ["tiny_model", "default"])
def test_greedy_output_and_logits_equal_speculation_off(fixture, request):
    """1 and 8 concurrent requests, with the prefix cache on: every output token and the logits it was chosen
    from are bit-identical to speculation off, and drafts were accepted (so the verify path ran)."""
    model = request.getfixturevalue(fixture) if fixture != "default" else ""
    off = LLM(model=model, speculative="off")
    on = LLM(model=model, speculative="both", num_speculative_tokens=6)
    prompts = [_repetitive(off.engine.tokenizer, i) for i in range(8)]
    for batch in (prompts[:1], prompts):
        a_out, a = generate_with_logits(off, batch, SHORT)
        b_out, b = generate_with_logits(on, batch, SHORT)
        assert [o.token_ids for o in a_out] == [o.token_ids for o in b_out]
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    if fixture == "default":  # the tiny model's random weights do not copy, the real one does
        assert on.engine.speculation.counts["accepted_tokens"] > 0 and sum(o.accepted_draft_tokens for o in b_out) > 0
    assert on.engine.speculation.counts["drafts"] > 0


def test_a_draw_follows_p_and_depends_only_on_seed_and_position():
    """Sampler.pick over many seeds: chi-square against p itself (df 4, p = 0.001), and the control that a biased
    sampler fails it. The same seed and position give the same token, whatever was drawn before."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0] + [-1e9] * 11)
    p = Sampler._probs(logits, SamplingParams(temperature=1.0, top_k=5))[:5]
    sampler = Sampler([2])
    counts = torch.zeros(5)
    for seed in range(6000):
        counts[sampler.pick(logits, Sequence([1], SamplingParams(temperature=1.0, top_k=5, seed=seed),
                                             CacheScope()))] += 1

    def chi2(c: torch.Tensor) -> float:
        expected = p * c.sum()
        return float(((c - expected) ** 2 / expected).sum())

    assert chi2(counts) < 18.47, (counts.tolist(), (p * counts.sum()).tolist())
    biased = counts.clone()
    biased[0], biased[1] = biased[0] - 120, biased[1] + 120  # 2% of the draws moved from token 0 to 1
    assert chi2(biased) > 18.47
    a, b = (Sequence([1, 2, 3], SamplingParams(temperature=1.0, seed=5), CacheScope()) for _ in range(2))
    first = sampler.pick(logits, a)
    sampler.pick(logits, b)  # another draw between: the same position still gives the same token
    assert sampler.pick(logits, a) == first == sampler.pick(logits, b)


def test_seeded_sampled_output_is_the_same_with_and_without_drafts(tiny_model):
    """End to end on the tiny model over 30 seeds, top_k 4 (a distribution over 4 tokens, not one): the output
    with speculation on is speculation off's, token for token, drafts were made and some accepted, and the seeds
    gave different outputs (so the comparison can fail)."""
    prompt = list(range(100, 120)) * 3
    params = [SamplingParams(temperature=1.0, top_k=4, seed=s, max_tokens=12, ignore_eos=True) for s in range(30)]
    outputs = {}
    for mode in ("off", "prompt"):
        llm = LLM(model=tiny_model, speculative=mode, num_speculative_tokens=4, enable_prefix_cache=False)
        outputs[mode] = [llm.generate([prompt], p)[0].token_ids for p in params]
    counts = llm.engine.speculation.counts
    assert counts["drafts"] > 0 and counts["accepted_tokens"] > 0, counts
    assert outputs["off"] == outputs["prompt"]
    assert len({tuple(o) for o in outputs["off"]}) > 2


def test_a_request_whose_drafts_fail_pauses_drafting_longer_each_time_and_never_for_good():
    d = Drafting(8)
    steps = []  # per decode step: drafted or paused
    for _ in range(40):
        if d.ready():
            steps.append("d")
            d.verified(d.length, 0, 8)
        else:
            steps.append(".")
    # three misses, then pauses of 1, 2, 4, 8, 16 steps; a miss leaves a one-token draft
    assert "".join(steps) == "ddd.ddd..ddd....ddd........ddd................d"[:40]
    assert d.length == 1
    d = Drafting(8, backoff=MAX_PAUSE)
    for _ in range(3):
        d.verified(1, 0, 8)
    assert d.pause == MAX_PAUSE and d.backoff == MAX_PAUSE
    d.pause = 0
    d.verified(1, 1, 8)  # accepted in full: the longest draft next, and the next pause is one step again
    assert (d.length, d.misses, d.backoff) == (8, 0, 1)
    d.verified(8, 3, 8)
    assert d.length == 4


def test_a_request_whose_drafts_fail_keeps_speculation_offs_output(tiny_model):
    """The tiny model's random weights do not continue the pattern its prompt repeats: drafts fail, pause, resume,
    and the output is speculation off's."""
    prompt = list(range(100, 110)) * 6
    on = LLM(model=tiny_model, speculative="prompt", enable_prefix_cache=False)
    off = LLM(model=tiny_model, enable_prefix_cache=False)
    seq = on.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while on.engine.has_unfinished():
        on.engine.step()
    assert seq.output_ids == off.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                                   ignore_eos=True))[0].token_ids
    drafts = on.engine.speculation.counts["drafts"]
    assert DRAFT_MISSES < drafts < len(seq.output_ids) - 1, drafts  # drafted past the first misses, with pauses


def test_answer_tables_are_per_scope_and_purged_with_the_tenant():
    drafter = Drafter("answers", 8)
    a, b = CacheScope(tenant="a"), CacheScope(tenant="b")
    drafter.record(a, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 6)  # prompt 1-4, output 5-10
    assert drafter.propose([1, 2, 6, 7], a, 8) == [8, 9, 10]
    assert drafter.propose([0, 3, 4], a, 8) == [5, 6, 7, 8, 9, 10]  # from the first output token on
    assert drafter.propose([1, 2, 6, 7], b, 8) == []  # b never sees a's answers
    assert drafter.propose([1, 2, 6, 7], CacheScope(tenant="a", salt="x"), 8) == []  # nor another salt of a
    drafter.purge_tenant("a", ())
    assert drafter.propose([1, 2, 6, 7], a, 8) == []


def test_answers_speed_up_a_repeated_answer_in_the_same_scope(tiny_model):
    """The second identical request of a scope drafts from the first one's answer; another tenant's does not."""
    llm = LLM(model=tiny_model, speculative="answers", enable_prefix_cache=False)
    prompt = list(range(300, 340))
    first = llm.generate([prompt], GREEDY, scope=CacheScope(tenant="a"))[0]
    again = llm.generate([prompt], GREEDY, scope=CacheScope(tenant="a"))[0]
    other = llm.generate([prompt], GREEDY, scope=CacheScope(tenant="b"))[0]
    assert first.token_ids == again.token_ids == other.token_ids
    assert again.accepted_draft_tokens > 20 and other.accepted_draft_tokens == first.accepted_draft_tokens


@pytest.mark.parametrize("kwargs, match", [({"speculative": "ngram"}, "speculative"),
                                           ({"num_speculative_tokens": MAX_DRAFT + 1}, "num_speculative_tokens"),
                                           ({"num_speculative_tokens": -1}, "num_speculative_tokens")])
def test_bad_speculation_options_name_the_choices(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=tiny_model, **kwargs)


def test_unsupported_features_run_without_speculation(tiny_model):
    llm = LLM(model=tiny_model, speculative="both", enable_prefix_cache=False)
    prompt = list(range(100, 110)) * 6
    for params in (SamplingParams(temperature=0.0, max_tokens=8, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.2),
                   SamplingParams(temperature=0.0, max_tokens=8, speculative=False)):
        out = llm.generate([prompt], params)[0]
        assert len(out.token_ids) == 8 and out.accepted_draft_tokens == 0
    assert llm.engine.speculation.counts["drafts"] == 0
    assert Config(model=tiny_model).speculative == "off"


def test_the_server_reports_accepted_drafts_and_honours_the_opt_out():
    """Over HTTP with the official clients: usage.completion_tokens_details.accepted_prediction_tokens, the
    /metrics counters, `speculative: false`, and a 400 for a malformed value."""
    import anthropic
    import httpx
    import openai
    from server_fixtures import metrics, spec_server

    srv = spec_server()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
    text = srv.server.tokenizer.decode(_repetitive(srv.server.tokenizer, 1))
    before = metrics(srv.url)
    ask = dict(model="default", messages=[{"role": "user", "content": text}], max_tokens=40, temperature=0)
    on = client.chat.completions.create(**ask)
    off = client.chat.completions.create(**ask, extra_body={"speculative": False})
    assert on.choices[0].message.content == off.choices[0].message.content
    accepted = on.usage.completion_tokens_details.accepted_prediction_tokens
    assert accepted > 0 and off.usage.completion_tokens_details.accepted_prediction_tokens == 0
    after = metrics(srv.url)
    key = ("vllm:spec_decode_num_accepted_tokens_total", ())
    assert after[key] - before.get(key, 0) == accepted
    msg = anthropic.Anthropic(base_url=srv.url, api_key="x").messages.create(
        model="default", max_tokens=40, messages=[{"role": "user", "content": text}],
        extra_body={"speculative": False, "temperature": 0})
    assert msg.content[0].text == on.choices[0].message.content
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={**ask, "speculative": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
