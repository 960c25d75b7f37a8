"""Logprobs, n > 1 / best_of and penalties through the server, with the official openai client: OpenAI's formats,
bit-identical logprobs warm and cold, echo's recomputed prompt logprobs, one prefill for n samples, and each
sampling field reaching the sampler (the offline engine on the same weights gives the expected output)."""
import asyncio
import json
import uuid
from itertools import accumulate

import openai
import pytest
from server_fixtures import prompt_tokens_computed

from prefixcache import SamplingParams
from prefixcache.engine.sequence import TokenLogprob
from prefixcache.server.body import json_body
from prefixcache.server.logprobs import FLOOR, CompletionLogprobs, TokenText, chat_logprobs

PROMPT = [5000 + 37 * i % 9000 for i in range(30)]  # the tiny model is unsure after it: samples differ by seed
STORY = "Once upon a time, in a land far away, there lived"  # each penalty changes the tiny model's greedy reply


def fresh() -> dict:
    """A cache salt no earlier request used: the prompt starts cold."""
    return {"cache_salt": uuid.uuid4().hex}


def test_chat_logprobs_follow_openai_and_are_bit_identical_warm_and_cold(tiny_client):
    kw = dict(model="default", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=3, extra_body=fresh())
    cold, warm = tiny_client.chat.completions.create(**kw), tiny_client.chat.completions.create(**kw)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1
    [choice] = cold.choices
    content = choice.logprobs.content
    assert choice.finish_reason == "length" and len(content) == cold.usage.completion_tokens == 8
    assert b"".join(bytes(c.bytes) for c in content).decode() == choice.message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    assert [c.model_dump() for c in warm.choices[0].logprobs.content] == [c.model_dump() for c in content]

    stream = tiny_client.chat.completions.create(**kw, stream=True)
    chunks = [c for c in stream if c.choices and c.choices[0].logprobs]
    assert [e.model_dump() for c in chunks for e in c.choices[0].logprobs.content] == [c.model_dump() for c in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_completion_echo_reports_the_prompts_logprobs_recomputed_from_the_cache(tiny_client, tiny_srv):
    kw = dict(model="default", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, extra_body=fresh())
    plain = tiny_client.completions.create(**kw)  # caches the prompt
    echo = tiny_client.completions.create(**kw, echo=True)
    assert echo.usage.prompt_tokens_details.cached_tokens == 0  # recomputed: cached positions have no logits
    lp, gen = echo.choices[0].logprobs, plain.choices[0].logprobs
    assert echo.choices[0].text == tiny_srv.server.tokenizer.decode(PROMPT) + plain.choices[0].text
    assert len(lp.tokens) == len(PROMPT) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert (lp.tokens[len(PROMPT):], lp.token_logprobs[len(PROMPT):]) == (gen.tokens, gen.token_logprobs)
    assert lp.text_offset == [0, *accumulate(len(t) for t in lp.tokens[:-1])]
    assert all(top[t] == x and len(top) <= 3
               for t, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))

    chunks = list(tiny_client.completions.create(**kw, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echo.choices[0].text
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_n_samples_share_one_prefill_with_seed_plus_i(tiny_client, tiny_srv):
    kw = dict(model="default", prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body=fresh())
    before = prompt_tokens_computed(tiny_srv)
    many = tiny_client.completions.create(**kw, n=4, seed=5)
    assert prompt_tokens_computed(tiny_srv) - before == len(PROMPT)
    singles = [tiny_client.completions.create(**kw, seed=5 + i) for i in range(4)]
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.prompt_tokens == len(PROMPT) and many.usage.prompt_tokens_details.cached_tokens == 0
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_streamed_chat_samples_carry_their_index(tiny_client, tiny_srv):
    kw = dict(model="default", messages=[{"role": "user", "content": "Say something."}], max_tokens=6,
              temperature=1.0, seed=3, n=3, extra_body=fresh())
    before = prompt_tokens_computed(tiny_srv)
    whole = tiny_client.chat.completions.create(**kw)
    prompt = whole.usage.prompt_tokens
    assert prompt_tokens_computed(tiny_srv) - before == prompt
    texts = ["", "", ""]
    chunks = list(tiny_client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for c in chunks[:-1]:
        [choice] = c.choices
        texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.prompt_tokens == prompt and \
        chunks[-1].usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_returns_the_highest_cumulative_logprob(tiny_client):
    kw = dict(model="default", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=9, logprobs=0, extra_body=fresh())
    every = tiny_client.completions.create(**kw, n=3)
    best = tiny_client.completions.create(**kw, best_of=3)
    top = max(every.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [top.text]
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all three were generated
    with pytest.raises(openai.BadRequestError, match="best_of > n cannot be streamed"):
        tiny_client.completions.create(**kw, best_of=3, stream=True)


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 4.0}, {"logit_bias": {500: 100}},
    {"stop_token_ids": "second"}, {"stop_token_ids": "second", "min_tokens": 2},
], ids=lambda f: "+".join(f))
def test_each_sampling_field_reaches_the_sampler(tiny_client, tiny_offline, fields):
    greedy = tiny_offline.generate([STORY], SamplingParams(temperature=0, max_tokens=6)).pop()
    if fields.get("stop_token_ids") == "second":
        fields = {**fields, "stop_token_ids": [greedy.token_ids[1]]}
    expected = tiny_offline.generate([STORY], SamplingParams(temperature=0, max_tokens=6, **fields)).pop()
    assert expected.token_ids != greedy.token_ids  # the field changes the output
    r = tiny_client.completions.create(model="default", prompt=STORY, max_tokens=6, temperature=0,
                                  extra_body={k: v for k, v in fields.items() if k in ("repetition_penalty",
                                                                                      "min_tokens", "stop_token_ids")},
                                  **{k: v for k, v in fields.items() if k in ("presence_penalty", "frequency_penalty",
                                                                              "logit_bias")})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected.text, expected.finish_reason)
    assert r.usage.completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"49152": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 9}, "min_tokens"), ({"n": 17}, "n"),
])
def test_invalid_sampling_fields_are_a_400_naming_them(tiny_client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        tiny_client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       extra_body=fields)
    assert e.value.body["message"].startswith(param)


def test_a_logprob_of_minus_infinity_is_floored_so_the_json_is_valid(tiny_srv):
    """A structured-output guide masks tokens to -inf before logprobs are taken; JSON has no -inf."""
    tt = TokenText(tiny_srv.server.tokenizer)
    entry = TokenLogprob(5, -0.5, ((5, -0.5), (6, float("-inf"))))
    body = asyncio.run(json_body([chat_logprobs(tt, [entry]), CompletionLogprobs(tt)([5], [entry])]))
    chat, completion = json.loads(body)  # and the JSON is valid: json_body allows no NaN or infinity
    assert chat["content"][0]["top_logprobs"][1]["logprob"] == FLOOR == completion["top_logprobs"][0][tt.text(6)]
