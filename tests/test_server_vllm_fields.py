"""vLLM's request extensions through the server, with the official openai client (`extra_body`): each honoured field
gives what the offline engine gives with the same sampling parameters or prompt, and the ones we cannot honour
exactly are a 400 naming them."""
import json
import re

import openai
import pytest
import torch
from openai import OpenAI
from server_fixtures import tiny_server

from prefixcache import LLM, SamplingParams
from prefixcache.prompt import Field, render

STORY = "Once upon a time, in a land far away, there lived"
PROMPT = [5000 + 37 * i % 9000 for i in range(30)]


@pytest.fixture(scope="module")
def srv(tiny_model):
    return tiny_server(tiny_model)


@pytest.fixture(scope="module")
def client(srv):
    return OpenAI(base_url=f"{srv.url}/v1", api_key="none")


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(model=tiny_model, enable_prefix_cache=False)


def complete(client, **kw):
    body = {k: kw.pop(k) for k in list(kw) if k not in ("prompt", "max_tokens", "temperature", "seed", "stop",
                                                        "logprobs", "stream", "logit_bias")}
    return client.completions.create(model="default", **{"prompt": STORY, "max_tokens": 6, "temperature": 0, **kw},
                                     extra_body=body)


@pytest.mark.parametrize("fields", [{"top_k": 1}, {"min_p": 1.0}], ids=lambda f: "+".join(f))
def test_top_k_and_min_p_cut_the_sampled_distribution(client, offline, fields):
    """At temperature 2 a seeded draw differs from greedy; keeping only the likeliest token makes it greedy."""
    greedy = offline.generate([STORY], SamplingParams(temperature=0, max_tokens=6)).pop()
    hot = dict(temperature=2.0, seed=3, max_tokens=6)
    assert complete(client, **hot).choices[0].text != greedy.text
    assert complete(client, **hot, **fields).choices[0].text == greedy.text
    for off in ({"top_k": -1}, {"top_k": 0}, {"min_p": 0.0}):
        assert complete(client, **hot, **off).choices[0].text == \
            offline.generate([STORY], SamplingParams(**hot)).pop().text


def test_min_p_keeps_the_tokens_above_its_share_of_the_likeliest(offline):
    params = SamplingParams(temperature=1.0, min_p=0.2)
    probs = offline.engine.sampler._probs(torch.tensor([0.0, -1.0, -2.0, -3.0]), params)
    assert (probs > 0).tolist() == [True, True, False, False]  # e^-1 >= 0.2 > e^-2


def test_ignore_eos_generates_past_eos(client, srv):
    eos = srv.server.tokenizer.eos_token_id
    stopped = complete(client, logit_bias={eos: 100})
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", 1)
    ignored = complete(client, logit_bias={eos: 100}, ignore_eos=True)
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 6)


def test_allowed_token_ids_are_the_only_tokens_generated(client, offline):
    allowed = [262, 284, 3000]
    r = complete(client, max_tokens=8, logprobs=0, allowed_token_ids=allowed, return_tokens_as_token_ids=True)
    ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert len(ids) == 8 and set(ids) <= set(allowed)
    expected = offline.generate([STORY], SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed)).pop()
    assert ids == expected.token_ids
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, allowed_token_ids=[10 ** 6])
    assert e.value.body["message"].startswith("allowed_token_ids")


def test_return_tokens_as_token_ids_in_both_logprob_formats(client, srv):
    tok = srv.server.tokenizer
    r = complete(client, logprobs=2, return_tokens_as_token_ids=True)
    lp = r.choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens + [k for top in lp.top_logprobs for k in top])
    assert tok.decode([int(t[9:]) for t in lp.tokens]) == r.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert all(re.fullmatch(r"token_id:\d+", c.token) and bytes(c.bytes).decode() == c.token for c in content)


def test_include_stop_str_in_output_keeps_the_stop_string(client, offline):
    text = offline.generate([STORY], SamplingParams(temperature=0, max_tokens=12)).pop().text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut, kept = complete(client, max_tokens=12, stop=[stop]), complete(client, max_tokens=12, stop=[stop],
                                                                       include_stop_str_in_output=True)
    assert cut.choices[0].text == text[:text.index(stop)]
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]
    assert complete(client, max_tokens=12, stop=[stop], no_stop_trim=True).choices[0].text == kept.choices[0].text
    streamed = complete(client, max_tokens=12, stop=[stop], include_stop_str_in_output=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.choices[0].text


def test_skip_special_tokens_false_shows_their_text(client, srv):
    special = srv.server.tokenizer.convert_tokens_to_ids("<|im_start|>")
    shown = complete(client, max_tokens=2, logit_bias={special: 100}, skip_special_tokens=False)
    hidden = complete(client, max_tokens=2, logit_bias={special: 100})
    assert shown.choices[0].text == "<|im_start|><|im_start|>" and hidden.choices[0].text == ""


def test_truncate_prompt_tokens_keeps_either_end(client, offline):
    for side, kept in (("left", PROMPT[-10:]), ("right", PROMPT[:10])):
        r = complete(client, prompt=PROMPT, truncate_prompt_tokens=10, truncation_side=side)
        assert r.usage.prompt_tokens == 10
        assert r.choices[0].text == offline.generate([kept], SamplingParams(temperature=0, max_tokens=6)).pop().text
    assert complete(client, prompt=PROMPT, truncate_prompt_tokens=-1).usage.prompt_tokens == len(PROMPT)


def test_a_final_assistant_message_continued_and_echoed(client, srv, offline):
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": STORY}]
    ids = render(srv.server.tokenizer, [Field("m0", 0, "user", "Tell me a story."), Field("m1", 1, "assistant", STORY)],
                 generation_prompt=False, continue_final=True).token_ids
    assert srv.server.tokenizer.decode(ids).endswith(STORY)  # left open: no end-of-turn after it
    expected = offline.generate([ids], SamplingParams(temperature=0, max_tokens=6)).pop().text
    kw = dict(model="default", messages=messages, max_tokens=6, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False,
                                                         "continue_final_message": True, "echo": True})
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == STORY + expected
    streamed = client.chat.completions.create(**kw, stream=True, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == STORY + expected
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(**kw, extra_body={"continue_final_message": True})


def test_chat_template_kwargs_reach_the_template_but_not_its_call(client):
    kw = dict(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**kw)
    assert client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) \
        .choices[0].message.content == plain.choices[0].message.content
    for clash in ("tokenize", "chat_template", "add_generation_prompt", "not an identifier"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {clash: True}})
        assert e.value.body["message"].startswith("chat_template_kwargs")


def test_request_id_names_the_response(client):
    assert complete(client, request_id="bench-7.a:b").id == "cmpl-bench-7.a:b"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, request_id="a b")
    assert e.value.body["message"].startswith("request_id")


@pytest.mark.parametrize("fields", [{"priority": 1}, {"use_beam_search": True}, {"length_penalty": 0.5},
                                    {"watermarking": True}, {"spaces_between_special_tokens": False}],
                         ids=lambda f: "+".join(f))
def test_vllm_fields_beyond_their_one_value_are_a_400_saying_why(client, fields):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, **fields)
    assert re.match(rf"{next(iter(fields))}: .*only .* is supported: ", e.value.body["message"])


def test_vllms_structured_outputs_and_guided_json_are_guides(client):
    kw = dict(model="default", prompt=STORY, max_tokens=40, temperature=0)
    for body, check in (({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
                        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
                        ({"guided_json": {"enum": ["left", "right"]}}, lambda t: json.loads(t) in ("left", "right")),
                        ({"structured_outputs": {"json": '{"type": "boolean"}'}},
                         lambda t: isinstance(json.loads(t), bool))):
        text = client.completions.create(**kw, extra_body=body).choices[0].text
        assert check(text), (body, text)
    for body, param in (({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs.grammar"),
                        ({"guided_json": "{not json"}, "guided_json"),
                        ({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, "structured_outputs.choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw, extra_body=body)
        assert e.value.body["message"].startswith(param) or e.value.body["param"] == param, e.value.body


def test_return_token_ids_in_vllms_places(client, srv):
    tok = srv.server.tokenizer
    r = complete(client, return_token_ids=True).model_dump()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == tok.encode(STORY) and tok.decode(choice["token_ids"]) == choice["text"]
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, extra_body={"return_token_ids": True}).model_dump()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    with pytest.raises(openai.BadRequestError, match="not with stream"):
        complete(client, return_token_ids=True, stream=True)
