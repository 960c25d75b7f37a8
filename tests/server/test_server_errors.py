"""Bad input, auth, capacity and disconnects against a real server: each API's error format, and the server
keeps serving."""
import threading
import time

import httpx
import pytest
from server_fixtures import Pause, long_system, main_server, metrics, nocache_server, until

ACME = {"Authorization": "Bearer sk-acme"}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MESSAGES = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
TOO_LONG = "word " * 9000


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    return main_server(tmp_path_factory)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def anthropic_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]


def post(srv, path: str, body, headers=ACME) -> httpx.Response:
    kw = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    return httpx.post(f"{srv.url}{path}", headers={**headers, "content-type": "application/json"}, timeout=60, **kw)


OPENAI_BAD = [
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "default", "max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "Hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "Hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "model"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "prompt_cache_retention": "forever"}, 400, "prompt_cache_retention"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"model": "default", "prompt": [], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": [-1, 5], "max_tokens": 4}, 400, None),
    ("/v1/completions", {"model": "default", "prompt": ["a", "b"], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": {"text": "a"}, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"model": "default", "max_tokens": 4}, 400, "prompt"),
]

ANTHROPIC_BAD = [
    ("{not json", 400, "invalid_request_error"),
    ({"model": "default", "messages": MESSAGES["messages"]}, 400, "invalid_request_error"),  # no max_tokens
    ({**MESSAGES, "max_tokens": 0}, 400, "invalid_request_error"),
    ({**MESSAGES, "max_tokens": 10**9}, 400, "invalid_request_error"),
    ({**MESSAGES, "messages": []}, 400, "invalid_request_error"),
    ({**MESSAGES, "messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error"),
    ({**MESSAGES, "messages": [{"role": "user", "content": []}]}, 400, "invalid_request_error"),
    ({**MESSAGES, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({**MESSAGES, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "invalid_request_error"),
    ({**MESSAGES, "system": 42}, 400, "invalid_request_error"),
    ({**MESSAGES, "temperature": 1.5}, 400, "invalid_request_error"),
    ({**MESSAGES, "cache_control": {"type": "persistent"}}, 400, "invalid_request_error"),
    ({**MESSAGES, "messages": [{"role": "user", "content": TOO_LONG}]}, 400, "invalid_request_error"),
    ({**MESSAGES, "model": "claude-9"}, 404, "not_found_error"),
]


def test_bad_inputs_get_4xx_in_each_format_and_do_not_disturb_a_running_request(srv, figures):
    result = {}

    def good():
        result["r"] = post(srv, "/v1/chat/completions", {**CHAT, "max_tokens": 16, "temperature": 0})

    t = threading.Thread(target=good)
    t.start()
    for path, body, status, param in OPENAI_BAD:
        err = openai_error(post(srv, path, body), status)
        assert err["param"] == param, (body, err)
    for body, status, kind in ANTHROPIC_BAD:
        anthropic_error(post(srv, "/v1/messages", body), status, kind)
    t.join()
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["message"]["content"]
    assert httpx.get(f"{srv.url}/health").status_code == 200
    figures["bad inputs"] = {"tried": len(OPENAI_BAD) + len(ANTHROPIC_BAD), "answered_4xx_in_format": True}


def test_auth(srv):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}):
        err = openai_error(post(srv, "/v1/chat/completions", CHAT, headers), 401)
        assert err["type"] == "authentication_error"
        anthropic_error(post(srv, "/v1/messages", MESSAGES, headers), 401, "authentication_error")
    assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    assert httpx.delete(f"{srv.url}/v1/cache", headers={"x-api-key": "sk-wrong"}).status_code == 401
    assert post(srv, "/v1/chat/completions", CHAT, {"x-api-key": "sk-globex"}).status_code == 200
    assert post(srv, "/v1/messages", MESSAGES, {"Authorization": "Bearer sk-globex"}).status_code == 200


def wait_for(url: str, name: str, value: float, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m[(name, ())] == value:
            return m
        assert time.monotonic() < deadline, f"{name} stayed at {m[(name, ())]}, expected {value}"
        time.sleep(0.1)


def test_over_capacity_gets_429_or_529_and_the_queue_drains():
    srv = nocache_server()  # one running request and one waiting, at most
    worker = srv.server.worker
    long_chat = {**CHAT, "messages": [{"role": "user", "content": long_system("capacity", 4)}], "max_tokens": 200}
    waiting = {}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={**long_chat, "stream": True}) as running:
            assert running.status_code == 200
            pause = Pause(srv).held()  # `running` cannot finish while the engine is held
            t = threading.Thread(target=lambda: waiting.update(r=c.post("/v1/chat/completions", json=CHAT)))
            t.start()
            until(lambda: worker.in_flight == 2)
            over = c.post("/v1/chat/completions", json=CHAT)
            assert openai_error(over, 429)["type"] == "rate_limit_error" and over.headers["retry-after"] == "1"
            over = c.post("/v1/messages", json=MESSAGES)
            anthropic_error(over, 529, "overloaded_error")
            assert over.headers["retry-after"] == "1"
            pause.release()
        t.join()  # closing the stream aborted the first request, so the waiting one ran
    assert waiting["r"].status_code == 200
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200


def test_stream_disconnect_aborts_and_frees_blocks():
    srv = nocache_server()
    pool = srv.server.engine.pool
    before = metrics(srv.url)
    body = {**CHAT, "messages": [{"role": "user", "content": long_system("disconnect", 4)}], "max_tokens": 400,
            "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            pause = Pause(srv).held()
            assert pool.num_free < pool.usable_blocks  # the request holds its blocks, and cannot finish now
        until(lambda: srv.server.worker.in_flight == 0)  # the server saw the disconnect and queued the abort
        pause.release()
    after = wait_for(srv.url, "vllm:kv_cache_usage_perc", 0)
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before.get(key, 0) == 1
    assert after[("vllm:num_requests_running", ())] == 0


def test_a_client_that_hangs_up_while_queued_is_dropped():
    srv = nocache_server()
    worker, scheduler = srv.server.worker, srv.server.engine.scheduler
    body = {**CHAT, "messages": [{"role": "user", "content": long_system("queued", 4)}], "max_tokens": 400,
            "stream": True}
    before = metrics(srv.url)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as running:
            assert running.status_code == 200
            first = Pause(srv).held()
            with pytest.raises(httpx.ReadTimeout):  # the engine is held: no first token, so no headers
                httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=1.5)
            until(lambda: worker.in_flight == 1)  # the server saw the hang-up and queued the abort
            second = Pause(srv)  # behind the queued request's add and abort in the engine's inbox
            first.release()
            second.held()
            assert not scheduler.waiting and len(scheduler.running) == 1
            second.release()
    after = wait_for(srv.url, "vllm:num_requests_running", 0)
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before.get(key, 0) == 2


def test_a_body_over_the_limit_gets_413_before_it_is_parsed(srv):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    openai_error(httpx.post(f"{srv.url}/v1/chat/completions", json=big, headers=ACME, timeout=60), 413)
    anthropic_error(httpx.post(f"{srv.url}/v1/messages", json={**MESSAGES, "messages": big["messages"]}, headers=ACME,
                               timeout=60), 413, "request_too_large")
    openai_error(httpx.post(f"{srv.url}/v1/chat/completions", json=big, timeout=60), 401)  # no key: before the body

    def chunked():  # no Content-Length: the limit holds while reading
        yield b'{"model": "default", "messages": [{"role": "user", "content": "'
        for _ in range(6):
            yield b"x" * (1 << 20)
        yield b'"}]}'
    openai_error(httpx.post(f"{srv.url}/v1/chat/completions", content=chunked(), timeout=60,
                            headers={"content-type": "application/json", **ACME}), 413)
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, headers=ACME, timeout=60).status_code == 200


def test_a_failing_engine_step_fails_only_its_requests_and_frees_their_blocks(figures):
    """An exception injected into the steps that run one request: that request gets a 500 in each API's format,
    its blocks return to the pool, and the request queued behind it (not in the failing step) is served."""
    srv = nocache_server()  # one running request: the other waits outside the step
    engine, worker = srv.server.engine, srv.server.worker
    poison = "poison " * 20
    run = engine.runner.run

    def failing(plan, *args):
        if any(engine.tokenizer.decode(seq.tokens).count("poison") >= 20 for seq, _ in plan):
            raise RuntimeError("injected fault")
        return run(plan, *args)

    until(lambda: worker.in_flight == 0)
    free = engine.pool.num_free
    engine.runner.run = failing
    bad = {**CHAT, "messages": [{"role": "user", "content": poison}]}
    results = {}
    try:
        pause = Pause(srv).held()
        first = threading.Thread(target=lambda: results.update(bad=httpx.post(
            f"{srv.url}/v1/chat/completions", json=bad, timeout=60)))
        first.start()
        until(lambda: worker.in_flight == 1)
        second = threading.Thread(target=lambda: results.update(good=httpx.post(
            f"{srv.url}/v1/chat/completions", json=CHAT, timeout=60)))
        second.start()
        until(lambda: worker.in_flight == 2)
        pause.release()
        first.join()
        second.join()
        assert openai_error(results["bad"], 500)["type"] == "server_error"
        assert results["good"].status_code == 200
        anthropic_error(httpx.post(f"{srv.url}/v1/messages", json={**MESSAGES, "messages": bad["messages"]},
                                   timeout=60), 500, "api_error")
        until(lambda: worker.in_flight == 0)
        assert engine.pool.num_free == free
        figures["faults"] = {"injected_step_failures": 2, "survived": True, "blocks_leaked": 0,
                             "queued_request_served": True}
    finally:
        engine.runner.run = run


def test_a_tenant_over_its_rate_limit_gets_429_with_retry_after_and_others_are_served(srv):
    """sk-metered: 3 requests and 400 prompt tokens a minute. The 4th request in a row, or a prompt that the token
    bucket cannot hold now, gets 429 in each API's format with the seconds to wait; other tenants are unaffected."""
    metered = {"Authorization": "Bearer sk-metered"}
    with httpx.Client(base_url=srv.url, timeout=60, headers=metered) as c:
        for _ in range(3):
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        r = c.post("/v1/chat/completions", json=CHAT)
        assert openai_error(r, 429)["code"] == "rate_limit_exceeded" and 1 <= int(r.headers["retry-after"]) <= 20
        r = c.post("/v1/messages", json=MESSAGES)
        anthropic_error(r, 429, "rate_limit_error")
        assert int(r.headers["retry-after"]) >= 1
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, headers=ACME, timeout=60).status_code == 200


def test_token_rate_limit_waits_for_what_is_missing_and_lets_a_big_prompt_into_debt():
    from prefixcache.server.limits import RateLimits

    limits = RateLimits()
    assert limits.take("t", "tokens", 100, 60) == 0
    assert limits.take("t", "tokens", 100, 60) == 12  # 20 tokens missing at 100 a minute; nothing taken
    assert limits.take("u", "tokens", 100, 500) == 0  # over a minute's worth: admitted on a full bucket, in debt
    assert limits.take("u", "tokens", 100, 1) >= 240


def test_a_changed_limit_keeps_the_bucket_level_and_never_refills_it():
    """Two keys of one tenant with different limits (or a reloaded keys file) used to reset the bucket to full on
    every change: alternating them gave unlimited requests."""
    from prefixcache.server.limits import RateLimits

    limits = RateLimits()
    taken = sum(limits.take("t", "requests", rpm, 1) == 0 for rpm in [3, 4] * 10)
    assert taken == 3  # the first limit's minute, never refilled by a change
    assert limits.take("t", "requests", 2, 1) > 0  # lowered: capped, still empty
