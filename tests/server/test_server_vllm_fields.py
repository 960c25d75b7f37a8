"""vLLM's request extensions through the server, with the official openai client (`extra_body`): each honoured field
gives what the offline engine gives with the same sampling parameters or prompt, and the ones we cannot honour
exactly are a 400 naming them."""
import json
import re

import openai
import pytest
import torch

from prefixcache import SamplingParams
from prefixcache.prompt import Field, render

STORY = "Once upon a time, in a land far away, there lived"
PROMPT = [5000 + 37 * i % 9000 for i in range(30)]


def complete(tiny_client, **kw):
    body = {k: kw.pop(k) for k in list(kw) if k not in ("prompt", "max_tokens", "temperature", "seed", "stop",
                                                        "logprobs", "stream", "logit_bias")}
    return tiny_client.completions.create(model="default", **{"prompt": STORY, "max_tokens": 6, "temperature": 0, **kw},
                                     extra_body=body)


@pytest.mark.parametrize("fields", [{"top_k": 1}, {"min_p": 1.0}], ids=lambda f: "+".join(f))
def test_top_k_and_min_p_cut_the_sampled_distribution(tiny_client, tiny_offline, fields):
    """At temperature 2 a seeded draw differs from greedy; keeping only the likeliest token makes it greedy."""
    greedy = tiny_offline.generate([STORY], SamplingParams(temperature=0, max_tokens=6)).pop()
    hot = dict(temperature=2.0, seed=3, max_tokens=6)
    assert complete(tiny_client, **hot).choices[0].text != greedy.text
    assert complete(tiny_client, **hot, **fields).choices[0].text == greedy.text
    for off in ({"top_k": -1}, {"top_k": 0}, {"min_p": 0.0}):
        assert complete(tiny_client, **hot, **off).choices[0].text == \
            tiny_offline.generate([STORY], SamplingParams(**hot)).pop().text


def test_min_p_keeps_the_tokens_above_its_share_of_the_likeliest(tiny_offline):
    params = SamplingParams(temperature=1.0, min_p=0.2)
    probs = tiny_offline.engine.sampler._probs(torch.tensor([0.0, -1.0, -2.0, -3.0]), params)
    assert (probs > 0).tolist() == [True, True, False, False]  # e^-1 >= 0.2 > e^-2


def test_ignore_eos_generates_past_eos(tiny_client, tiny_srv):
    eos = tiny_srv.server.tokenizer.eos_token_id
    stopped = complete(tiny_client, logit_bias={eos: 100})
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", 1)
    ignored = complete(tiny_client, logit_bias={eos: 100}, ignore_eos=True)
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 6)


def test_allowed_token_ids_are_the_only_tokens_generated(tiny_client, tiny_offline):
    allowed = [262, 284, 3000]
    r = complete(tiny_client, max_tokens=8, logprobs=0, allowed_token_ids=allowed, return_tokens_as_token_ids=True)
    ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert len(ids) == 8 and set(ids) <= set(allowed)
    greedy = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed)
    expected = tiny_offline.generate([STORY], greedy).pop()
    assert ids == expected.token_ids
    with pytest.raises(openai.BadRequestError) as e:
        complete(tiny_client, allowed_token_ids=[10 ** 6])
    assert e.value.body["message"].startswith("allowed_token_ids")


def test_return_tokens_as_token_ids_in_both_logprob_formats(tiny_client, tiny_srv):
    tok = tiny_srv.server.tokenizer
    r = complete(tiny_client, logprobs=2, return_tokens_as_token_ids=True)
    lp = r.choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens + [k for top in lp.top_logprobs for k in top])
    assert tok.decode([int(t[9:]) for t in lp.tokens]) == r.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chat = tiny_client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
                                               extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert all(re.fullmatch(r"token_id:\d+", c.token) and bytes(c.bytes).decode() == c.token for c in content)


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_client, tiny_offline):
    text = tiny_offline.generate([STORY], SamplingParams(temperature=0, max_tokens=12)).pop().text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut, kept = complete(tiny_client, max_tokens=12, stop=[stop]), complete(tiny_client, max_tokens=12, stop=[stop],
                                                                       include_stop_str_in_output=True)
    assert cut.choices[0].text == text[:text.index(stop)]
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]
    assert complete(tiny_client, max_tokens=12, stop=[stop], no_stop_trim=True).choices[0].text == kept.choices[0].text
    streamed = complete(tiny_client, max_tokens=12, stop=[stop], include_stop_str_in_output=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.choices[0].text


def test_skip_special_tokens_false_shows_their_text(tiny_client, tiny_srv):
    special = tiny_srv.server.tokenizer.convert_tokens_to_ids("<|im_start|>")
    shown = complete(tiny_client, max_tokens=2, logit_bias={special: 100}, skip_special_tokens=False)
    hidden = complete(tiny_client, max_tokens=2, logit_bias={special: 100})
    assert shown.choices[0].text == "<|im_start|><|im_start|>" and hidden.choices[0].text == ""


def test_truncate_prompt_tokens_keeps_either_end(tiny_client, tiny_offline):
    for side, kept in (("left", PROMPT[-10:]), ("right", PROMPT[:10])):
        r = complete(tiny_client, prompt=PROMPT, truncate_prompt_tokens=10, truncation_side=side)
        assert r.usage.prompt_tokens == 10
        expected = tiny_offline.generate([kept], SamplingParams(temperature=0, max_tokens=6)).pop()
        assert r.choices[0].text == expected.text
    assert complete(tiny_client, prompt=PROMPT, truncate_prompt_tokens=-1).usage.prompt_tokens == len(PROMPT)


def test_a_final_assistant_message_continued_and_echoed(tiny_client, tiny_srv, tiny_offline):
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": STORY}]
    fields = [Field("m0", 0, "user", "Tell me a story."), Field("m1", 1, "assistant", STORY)]
    ids = render(tiny_srv.server.tokenizer, fields, generation_prompt=False, continue_final=True).token_ids
    assert tiny_srv.server.tokenizer.decode(ids).endswith(STORY)  # left open: no end-of-turn after it
    expected = tiny_offline.generate([ids], SamplingParams(temperature=0, max_tokens=6)).pop().text
    kw = dict(model="default", messages=messages, max_tokens=6, temperature=0)
    r = tiny_client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False,
                                                         "continue_final_message": True, "echo": True})
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == STORY + expected
    streamed = tiny_client.chat.completions.create(**kw, stream=True, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == STORY + expected
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        tiny_client.chat.completions.create(**kw, extra_body={"continue_final_message": True})


def test_chat_template_kwargs_reach_the_template_but_not_its_call(tiny_client):
    kw = dict(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    plain = tiny_client.chat.completions.create(**kw)
    assert tiny_client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) \
        .choices[0].message.content == plain.choices[0].message.content
    for clash in ("tokenize", "chat_template", "add_generation_prompt", "not an identifier"):
        with pytest.raises(openai.BadRequestError) as e:
            tiny_client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {clash: True}})
        assert e.value.body["message"].startswith("chat_template_kwargs")


def test_request_id_names_the_response(tiny_client):
    assert complete(tiny_client, request_id="bench-7.a:b").id == "cmpl-bench-7.a:b"
    with pytest.raises(openai.BadRequestError) as e:
        complete(tiny_client, request_id="a b")
    assert e.value.body["message"].startswith("request_id")


@pytest.mark.parametrize("fields", [{"priority": 1}, {"use_beam_search": True}, {"length_penalty": 0.5},
                                    {"watermarking": True}, {"spaces_between_special_tokens": False}],
                         ids=lambda f: "+".join(f))
def test_vllm_fields_beyond_their_one_value_are_a_400_saying_why(tiny_client, fields):
    with pytest.raises(openai.BadRequestError) as e:
        complete(tiny_client, **fields)
    assert re.match(rf"{next(iter(fields))}: .*only .* is supported: ", e.value.body["message"])


def test_vllms_structured_outputs_and_guided_json_are_guides(tiny_client):
    kw = dict(model="default", prompt=STORY, max_tokens=40, temperature=0)
    for body, check in (({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
                        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
                        ({"guided_json": {"enum": ["left", "right"]}}, lambda t: json.loads(t) in ("left", "right")),
                        ({"structured_outputs": {"json": '{"type": "boolean"}'}},
                         lambda t: isinstance(json.loads(t), bool))):
        text = tiny_client.completions.create(**kw, extra_body=body).choices[0].text
        assert check(text), (body, text)
    for body, param in (({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs.grammar"),
                        ({"guided_json": "{not json"}, "guided_json"),
                        ({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, "structured_outputs.choice")):
        with pytest.raises(openai.BadRequestError) as e:
            tiny_client.completions.create(**kw, extra_body=body)
        assert e.value.body["message"].startswith(param) or e.value.body["param"] == param, e.value.body


def test_return_token_ids_in_vllms_places(tiny_client, tiny_srv):
    tok = tiny_srv.server.tokenizer
    r = complete(tiny_client, return_token_ids=True).model_dump()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == tok.encode(STORY) and tok.decode(choice["token_ids"]) == choice["text"]
    chat = tiny_client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0,
                                               extra_body={"return_token_ids": True}).model_dump()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    with pytest.raises(openai.BadRequestError, match="not with stream"):
        complete(tiny_client, return_token_ids=True, stream=True)


def test_bad_words_are_never_completed(tiny_client, tiny_srv, tiny_offline):
    tok = tiny_srv.server.tokenizer
    greedy = tiny_offline.generate([STORY], SamplingParams(temperature=0, max_tokens=8)).pop()
    word = tok.decode(greedy.token_ids[:2]).strip()  # the reply's first two tokens, as a word to ban
    banned = [tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)]
    r = complete(tiny_client, max_tokens=8, logprobs=0, return_tokens_as_token_ids=True, bad_words=[word])
    ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert ids != greedy.token_ids
    assert not any(ids[i:i + len(b)] == b for b in banned for i in range(len(ids)))
    expected = tiny_offline.generate([STORY], SamplingParams(temperature=0, max_tokens=8, bad_words=[
        b for b in banned if len(b) == len(banned[0])])).pop()
    assert ids == expected.token_ids
    with pytest.raises(openai.BadRequestError) as e:
        complete(tiny_client, bad_words=[" "])
    assert e.value.body["message"].startswith("bad_words")


def test_prompt_logprobs_in_vllms_format_agree_with_echo(tiny_client):
    r = complete(tiny_client, prompt=PROMPT, max_tokens=1, prompt_logprobs=2).model_dump()
    got = r["choices"][0]["prompt_logprobs"]
    echo = complete(tiny_client, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2).choices[0].logprobs
    assert len(got) == len(PROMPT) and got[0] is None
    for i, entry in enumerate(got[1:], 1):
        own = entry[str(PROMPT[i])]
        assert own["logprob"] == pytest.approx(echo.token_logprobs[i], abs=1e-6)
        better = [v for k, v in entry.items() if v["logprob"] > own["logprob"]]
        assert own["rank"] == 1 + len(better) if len(better) < 2 else own["rank"] > 2  # the top 2 are all shown
        assert {1, 2} <= {v["rank"] for v in entry.values()}
    chat = tiny_client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=1, extra_body={"prompt_logprobs": 0}).model_dump()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    for body in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 1, "echo": True, "logprobs": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            complete(tiny_client, **body)
        assert e.value.body["message"].startswith("prompt_logprobs")
