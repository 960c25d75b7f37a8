"""Penalties, biases and logprobs in the sampler (each against a hand computation on a small logits vector), and
through the engine: stop tokens, bit-identical logprobs warm and cold, prompt logprobs, n samples on one prefill."""
import math
from dataclasses import replace

import pytest
import torch

from prefixcache import LLM, CacheScope, SamplingParams
from prefixcache.engine.sampler import Sampler
from prefixcache.engine.sequence import Sequence

LOGITS = [-2.0, 2.0, 3.0, -1.0, 0.5, 6.0]
EOS = 0
PROMPT = [5000 + 37 * i % 9000 for i in range(30)]  # the tiny model is unsure after it: samples differ by seed


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence(prompt, SamplingParams(**params), CacheScope())
    s.tokens += output
    return s


def penalize(s: Sequence, logits=LOGITS) -> list[float]:
    return Sampler([EOS]).penalize(torch.tensor(logits), s).tolist()


def test_frequency_and_presence_penalties_count_output_tokens_only():
    # token 1 twice and token 3 once in the output; token 5 only in the prompt
    s = seq([5], [1, 1, 3], frequency_penalty=0.5, presence_penalty=0.25)
    assert penalize(s) == [-2.0, 2.0 - 2 * 0.5 - 0.25, 3.0, -1.0 - 0.5 - 0.25, 0.5, 6.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_over_prompt_and_output():
    s = seq([0, 1], [3], repetition_penalty=2.0)
    assert penalize(s) == [-4.0, 1.0, 3.0, -2.0, 0.5, 6.0]


def test_logit_bias_adds_to_the_named_tokens():
    s = seq([5], [], logit_bias={2: 10, 4: -100})
    assert penalize(s) == [-2.0, 2.0, 13.0, -1.0, -99.5, 6.0]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    inf = float("-inf")
    assert penalize(seq([5], [1], min_tokens=2, stop_token_ids=[4])) == [inf, 2.0, 3.0, -1.0, inf, 6.0]
    assert penalize(seq([5], [1, 2], min_tokens=2, stop_token_ids=[4])) == LOGITS


def test_a_row_without_penalties_is_returned_untouched():
    logits = torch.tensor(LOGITS)
    assert Sampler([EOS]).penalize(logits, seq([0, 1], [3])) is logits


def test_draws_follow_the_distribution_and_never_take_a_token_of_probability_zero():
    logits = torch.tensor([1.0, float("-inf"), 0.0, 2.0, float("-inf"), -1.0])
    p = torch.softmax(logits, dim=-1).tolist()
    draws = 20_000
    counts = [0] * len(p)
    for seed in range(draws):
        counts[Sampler([EOS]).pick(logits, seq([5], [], temperature=1.0, seed=seed))] += 1
    assert counts[1] == counts[4] == 0
    for k in (0, 2, 3, 5):  # within 5 standard deviations of the binomial count
        assert abs(counts[k] - draws * p[k]) < 5 * math.sqrt(draws * p[k] * (1 - p[k])), (k, counts, p)


def test_logprobs_are_of_the_raw_logits_before_biases_and_penalties():
    s = seq([5], [], temperature=0.0, logit_bias={4: 100}, logprobs=2)
    token, lp = Sampler([EOS]).sample(torch.tensor(LOGITS), s)
    raw = torch.log_softmax(torch.tensor(LOGITS), dim=-1)
    assert token == 4 and math.isclose(lp.logprob, raw[4].item(), abs_tol=1e-6)  # with the bias it would be about 0
    assert [t for t, _ in lp.top] == [5, 2]
    assert all(math.isclose(x, raw[t].item(), abs_tol=1e-6) for t, x in lp.top)
    assert math.isclose(sum(math.exp(x) for x in raw.tolist()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("bad, message", [
    ({"logit_bias": {1: 101}}, "logit_bias values must be in [-100, 100]"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ({"max_tokens": 64, "min_tokens": 65}, "min_tokens must be in [0, max_tokens=64]"),
    ({"logprobs": 21}, "logprobs must be in [0, 20]"),
    ({"n": 2, "best_of": 1}, "best_of must be >= n (2)"),
])
def test_sampling_params_validation(bad, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**bad)
    assert str(e.value).startswith(message)


# ---- through the engine (tiny random-weight model) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=tiny_model, max_batch_tokens=64)


@pytest.fixture(scope="module")
def cold(tiny_model):
    return LLM(model=tiny_model, enable_prefix_cache=False)


def test_stop_token_ids_finish_without_their_text_and_min_tokens_defers_them(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6)).pop()
    a, b = greedy.token_ids[:2]
    assert a != b  # the tiny model's greedy reply starts a, b, ...
    stop = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[b])
    out = llm.generate([PROMPT], stop).pop()
    assert out.token_ids == [a, b] and out.finish_reason == "stop" and out.text == llm.tokenizer.decode([a])
    for n in (2, 3):  # b is masked until n tokens exist; greedy then falls back to a, and takes b as soon as it may
        out = llm.generate([PROMPT], replace(stop, min_tokens=n)).pop()
        assert out.token_ids == [a] * n + [b] and out.finish_reason == "stop"


def test_logprobs_are_bit_identical_warm_cold_and_batched(llm, cold):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5)
    others = [list(range(2000, 2000 + n)) for n in (17, 40)]
    ref = cold.generate([PROMPT], params)[0]
    llm.engine.cache.clear()
    first = llm.generate([PROMPT], params)[0]
    warm = llm.generate([PROMPT, *others], params)[0]  # hits the cache, batched with two other prompts
    assert first.cached_tokens == 0 and warm.cached_tokens == len(PROMPT) - 1
    assert ref.logprobs == first.logprobs == warm.logprobs
    assert ref.cumulative_logprob == warm.cumulative_logprob == sum(lp.logprob for lp in ref.logprobs)
    assert all(len(lp.top) == 5 and lp.top[0][1] >= lp.logprob for lp in ref.logprobs)


def test_prompt_logprobs_recompute_cached_positions_with_the_samplers_logits(llm, cold):
    gen = cold.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0]
    continued = PROMPT + gen.token_ids  # the prompt logprobs of its last 6 tokens are the sampled ones
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    llm.generate([continued], SamplingParams(temperature=0, max_tokens=1))  # now cached
    warm = llm.generate([continued], params)[0]
    ref = cold.generate([continued], params)[0]
    assert warm.cached_tokens == 0 and warm.miss_cause == "disabled"
    assert warm.prompt_logprobs == ref.prompt_logprobs
    assert warm.prompt_logprobs[0] is None and [lp.token for lp in warm.prompt_logprobs[1:]] == continued[1:]
    # the sampled ones, and each of these greedy tokens is the likeliest: rank 1
    assert [replace(e, rank=None) for e in warm.prompt_logprobs[-6:]] == gen.logprobs
    assert [e.rank for e in warm.prompt_logprobs[-6:]] == [1] * 6


def test_prompt_logprobs_are_the_same_in_chunks_beside_others_as_alone(tiny_model, cold):
    """Two prompts' logprobs computed in chunks of 40 tokens, in the LM head calls of 16 rows the steps share with
    their next-token rows, equal each prompt's computed alone in one step."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    prompts = [list(range(300, 390)), list(range(500, 561))]
    together = LLM(tiny_model, enable_prefix_cache=False, max_batch_tokens=40).generate(prompts, params)
    assert [o.prompt_logprobs for o in together] == [cold.generate([p], params)[0].prompt_logprobs for p in prompts]


@pytest.mark.parametrize("cache", [True, False])
def test_n_samples_share_one_prefill_and_seed_plus_i(llm, cold, cache):
    engine = llm if cache else cold
    engine.engine.cache.clear()
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=11, logprobs=1)
    before = engine.cache_stats()["prompt_tokens_computed"]
    outs = engine.generate([PROMPT], replace(params, n=4))
    assert engine.cache_stats()["prompt_tokens_computed"] - before == len(PROMPT)
    assert [o.index for o in outs] == [0, 1, 2, 3] and {o.cached_tokens for o in outs} == {0}
    singles = [cold.generate([PROMPT], replace(params, seed=11 + i))[0] for i in range(4)]
    assert [o.token_ids for o in outs] == [s.token_ids for s in singles]
    assert [o.logprobs for o in outs] == [s.logprobs for s in singles]
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(cold):
    params = dict(temperature=1.0, max_tokens=6, seed=3)
    every = cold.generate([PROMPT], SamplingParams(**params, n=4))
    best = cold.generate([PROMPT], SamplingParams(**params, n=2, best_of=4))
    ranked = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert [(o.index, o.token_ids) for o in best] == [(o.index, o.token_ids) for o in ranked]
