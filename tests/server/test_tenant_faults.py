"""One tenant's request can never fail, cut or change another's (DESIGN.md, invariant 7).

Tenant b's request runs alone, then again in one batch with tenant a's poisonous requests: b's output is the same,
token for token, and a's requests end with a 400 (or a normal answer), never by failing the step.
"""
import json
import threading

import httpx
import openai
import pytest
from server_fixtures import Pause, metrics, tiny_tenants_server, until

from prefixcache import LLM, CacheScope, SamplingParams
from prefixcache.engine.guide import Guide

B_PROMPT = [5000 + 37 * i % 9000 for i in range(40)]
B_PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)


def _poisons(tokenizer) -> list[SamplingParams]:
    """Requests of tenant a that reach the engine; the first becomes the reported bug once added (see below)."""
    emoji = tokenizer("\U0001F600\U0001F680 caf\u00e9").input_ids
    return [
        SamplingParams(temperature=1.0, max_tokens=16, guide=Guide("choice", json.dumps(["a"]))),
        SamplingParams(temperature=1e-30, max_tokens=8),  # dividing by it overflowed to NaN
        SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=1, guide=Guide("regex", "[a-z]{2,6}")),
        SamplingParams(temperature=0.8, max_tokens=8, stop=["\ufffd", "\ud83d", "\u00e9"],
                       logit_bias={t: 100 for t in emoji}),
        SamplingParams(temperature=1.0, max_tokens=8, logit_bias={t: -100 for t in range(0, 49152, 7)},
                       min_tokens=8, stop_token_ids=[2, 3], repetition_penalty=3.0, presence_penalty=-2),
        SamplingParams(temperature=0.0, max_tokens=8, guide=Guide("regex", "(unclosed")),
    ]


def _scope(tenant: str) -> CacheScope:
    return CacheScope(tenant=tenant)


@pytest.mark.parametrize("speculative", ["off", "both"])
def test_poisoned_sequences_fail_alone_and_the_other_tenant_is_unchanged(tiny_model, speculative):
    llm = LLM(model=tiny_model, speculative=speculative)
    alone = llm.generate([B_PROMPT], B_PARAMS, scope=_scope("b"))[0]
    llm.engine.cache.clear()
    e = llm.engine
    b = e.add_request(B_PROMPT, B_PARAMS, _scope("b"))
    poisoned = [e.add_request(B_PROMPT[:12] + [i], p, _scope("a")) for i, p in enumerate(_poisons(e.tokenizer))]
    # the reported bug: a finished grammar allows only EOS, and min_tokens bans it. SamplingParams now refuses
    # that combination up front; the engine must still contain it
    poisoned[0].params.min_tokens = 8
    broken = e.add_request(B_PROMPT[:20], SamplingParams(temperature=0.0, max_tokens=8), _scope("a"))

    def fault(_token):  # a detokenizer bug that hits one sequence only
        raise RuntimeError("injected")
    broken.detok.add = fault
    while e.has_unfinished():
        e.step()
    out = b.output()
    assert (out.token_ids, out.cumulative_logprob, out.logprobs) == \
        (alone.token_ids, alone.cumulative_logprob, alone.logprobs)
    assert out.finish_reason == "length" and out.error is None
    masked, tiny_t, n3, stops, biased, bad_regex = poisoned
    assert masked.fault and not masked.fault.internal and "no token is allowed" in masked.fault.message
    assert bad_regex.fault and not bad_regex.fault.internal and "regex" in bad_regex.fault.message
    assert broken.fault and broken.fault.internal and broken.output().error == "internal engine error"
    for seq in (tiny_t, *n3.samples, stops, biased):
        assert seq.fault is None and seq.finish_reason in ("stop", "length"), (seq.params, seq.fault)
    assert not e.scheduler.running and not e.scheduler.waiting and e.pool.num_free == e.pool.usable_blocks - \
        e.blocks.cache.num_blocks  # every block of the failed requests went back


@pytest.mark.parametrize("guide", [Guide("choice", '["a"]'), Guide("regex", "ab"), Guide("json_object")])
def test_min_tokens_with_a_guide_is_refused_up_front(guide):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(temperature=0.8, min_tokens=8, max_tokens=16, guide=guide)


BAD_UP_FRONT = [  # 400 before any work, each naming the fields that contradict
    ({"guided_choice": ["a"], "min_tokens": 8, "temperature": 1.0}, "min_tokens"),
    ({"guided_regex": "ab", "min_tokens": 8, "temperature": 0.8}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
]
REACH_THE_ENGINE = [  # each ends with a 400 or an answer, never a 500 or another tenant's failure
    ({"guided_regex": "(unclosed"}, 400),
    ({"temperature": 1e-30}, 200),
    ({"guided_regex": "[a-z]{2,6}", "n": 3, "temperature": 1.0, "seed": 3}, 200),
    ({"stop": ["\ufffd", "\u00e9"], "temperature": 0.9, "seed": 4}, 200),
    ({"logit_bias": {str(t): -100 for t in range(0, 1500, 5)}, "min_tokens": 4, "stop_token_ids": [2]}, 200),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, 400),
]


def test_over_http_a_tenant_cannot_fail_or_cut_another_tenants_stream(tmp_path_factory, tiny_model):
    """The reported bug, end to end: tenant b streams while tenant a sends each poisonous combination, all in
    one batch (the engine is held until every request is queued). b's stream is the same as alone."""
    srv = tiny_tenants_server(tmp_path_factory, tiny_model, name="tiny-faults")
    b = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-b", max_retries=0)
    ask = dict(model="default", prompt=B_PROMPT, max_tokens=64, temperature=0, stream=True)

    def stream() -> str:
        return "".join(c.choices[0].text for c in b.completions.create(**ask) if c.choices)

    alone = stream()
    for body, field in BAD_UP_FRONT:
        r = _post(srv.url, body)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    pause = Pause(srv).held()
    before = srv.server.worker.in_flight
    seen: dict[str, object] = {}
    threads = [threading.Thread(target=lambda: seen.__setitem__("b", stream()))]
    threads += [threading.Thread(target=lambda i=i, body=body: seen.__setitem__(i, _post(srv.url, body)))
                for i, (body, _) in enumerate(REACH_THE_ENGINE)]
    for t in threads:
        t.start()
    until(lambda: srv.server.worker.in_flight == before + len(threads))
    pause.release()
    for t in threads:
        t.join(120)
    assert seen["b"] == alone
    for i, (body, status) in enumerate(REACH_THE_ENGINE):
        r = seen[i]
        assert r.status_code == status, (body, r.status_code, r.text)
        assert "error" in r.json() if status == 400 else r.json()["choices"], r.text


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-a"}, timeout=120,
                      json={"model": "default", "prompt": B_PROMPT[:10], "max_tokens": 8, **body})



def test_a_fault_after_the_stream_began_ends_that_stream_with_an_error_event(tmp_path_factory, tiny_model):
    """A fault injected into one request's sampling after its third token: its OpenAI stream ends with an error
    event (the official client raises it), its Anthropic stream with an `error` event, and b's concurrent stream is
    the same as alone."""
    srv = tiny_tenants_server(tmp_path_factory, tiny_model, name="tiny-faults")
    sampler, sample = srv.server.engine.sampler, srv.server.engine.sampler.sample

    def faulty(row, seq):
        if seq.scope.tenant == "a" and len(seq.output_ids) == 3:
            raise RuntimeError("injected")
        return sample(row, seq)

    b = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-b", max_retries=0)
    ask = dict(model="default", prompt=B_PROMPT, max_tokens=48, temperature=0, stream=True)
    alone = "".join(c.choices[0].text for c in b.completions.create(**ask) if c.choices)
    a = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-a", max_retries=0)
    sampler.sample = faulty
    try:
        stream = b.completions.create(**ask)
        failed = []
        with pytest.raises(openai.APIError, match="internal engine error"):
            for chunk in a.completions.create(model="default", prompt=B_PROMPT[:20], max_tokens=20, temperature=0,
                                              stream=True):
                failed += [c.text for c in chunk.choices]
        got = [c.choices[0].text for c in stream if c.choices]
        with httpx.stream("POST", f"{srv.url}/v1/messages", headers={"x-api-key": "sk-a"}, timeout=60, json={
                "model": "default", "max_tokens": 20, "stream": True,
                "messages": [{"role": "user", "content": "Tell me a story."}]}) as r:
            events = [line for line in r.iter_lines() if line.startswith("event:")]
    finally:
        sampler.sample = sample
    assert "".join(got) == alone and len(failed) >= 1
    assert events[0] == "event: message_start" and events[-1] == "event: error"
    after = metrics(srv.url)
    assert [after.get(("prefixcache:requests_total", (("api", api), ("status", "500"))), 0) for api in
            ("openai", "anthropic")] == [1, 1]
