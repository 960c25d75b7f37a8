"""What one tenant can spend of what all share (issue 33): bounded work per request, checked before any is done;
the admission gate shared by tenant; rate limits per tenant that count refused requests; and tenant b's stream
unchanged while tenant a attacks. A real server on the default model; the engine is held between steps where the
order of events matters (Pause), so nothing depends on timing."""
import json
import socket
import threading
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from server_fixtures import Pause, _start, until

from prefixcache.config import Config
from prefixcache.server import caps
from prefixcache.server.config import ServeConfig

KEYS = {"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"}, "sk-m1": {"tenant": "m", "rpm": 2},
        "sk-m2": {"tenant": "m", "rpm": 5}, "sk-r": {"tenant": "r", "rpm": 2}, "sk-h": {"tenant": "h", "rpm": 1},
        "sk-p": {"tenant": "p", "rpm": 3}}
A, B = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
PROMPT = {"model": "default", "prompt": "hi", "max_tokens": 4}
MESSAGES = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MAX_NUM_SEQS, MAX_QUEUE = 2, 2


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared")
    (d / "keys.json").write_text(json.dumps(KEYS))
    return _start("shared", ServeConfig(Config(kv_cache_bytes=2**28, max_num_seqs=MAX_NUM_SEQS),
                                        api_keys=str(d / "keys.json"), max_queue=MAX_QUEUE))


def post(srv, path: str, body, headers=A) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=120)


def refused(r: httpx.Response, param: str, cap) -> None:
    """A 400 in the API's own format that names the field and its cap."""
    assert r.status_code == 400, r.text
    body = r.json()
    err = body["error"]
    assert str(cap) in err["message"], err
    if body.get("type") != "error":  # OpenAI's body names the field in `param`; Anthropic's only in the message
        assert err["param"].split(".")[0] == param, err
    else:
        assert param.split(".")[0] in err["message"], err


def test_n_and_best_of_over_the_slots_are_refused_before_any_work(srv):
    for path, body in (("/v1/completions", PROMPT), ("/v1/completions/render", PROMPT),
                       ("/v1/chat/completions", CHAT)):
        refused(post(srv, path, {**body, "n": 100_000_000}), "n", MAX_NUM_SEQS)
    refused(post(srv, "/v1/completions", {**PROMPT, "best_of": 10**9}), "best_of", MAX_NUM_SEQS)
    until(lambda: srv.server.worker.in_flight == 0)  # nothing entered; no slot leaked


OVER = [  # (path, field, value one past its cap, the cap)
    ("/v1/completions", "bad_words", ["x"] * (caps.MAX_BAD_WORDS + 1), caps.MAX_BAD_WORDS),
    ("/v1/completions/render", "bad_words", ["x"] * (caps.MAX_BAD_WORDS + 1), caps.MAX_BAD_WORDS),
    ("/v1/completions", "bad_words", ["x" * (caps.MAX_WORD + 1)], caps.MAX_WORD),
    ("/v1/completions", "stop_token_ids", [1] * (caps.MAX_STOP_TOKEN_IDS + 1), caps.MAX_STOP_TOKEN_IDS),
    ("/v1/completions", "allowed_token_ids", [1] * (caps.MAX_TOKEN_IDS + 1), caps.MAX_TOKEN_IDS),
    ("/v1/completions", "logit_bias", {str(i): 1 for i in range(caps.MAX_LOGIT_BIAS + 1)}, caps.MAX_LOGIT_BIAS),
    ("/v1/completions", "stop", ["x"] * (caps.MAX_STOP + 1), caps.MAX_STOP),
    ("/v1/completions", "stop", "x" * (caps.MAX_WORD + 1), caps.MAX_WORD),
    ("/v1/completions", "guided_choice", ["x"] * (caps.MAX_CHOICES + 1), caps.MAX_CHOICES),
    ("/v1/completions", "prompt", "x" * (caps.MAX_STRING + 1), caps.MAX_STRING),
    ("/v1/chat/completions", "messages", [{"role": "user", "content": "x"}] * (caps.MAX_MESSAGES + 1),
     caps.MAX_MESSAGES),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}] * (caps.MAX_TOOLS + 1),
     caps.MAX_TOOLS),
    ("/v1/chat/completions", "metadata", {str(i): "x" for i in range(caps.MAX_METADATA + 1)}, caps.MAX_METADATA),
    ("/v1/messages", "stop_sequences", ["x"] * (caps.MAX_STOP_SEQUENCES + 1), caps.MAX_STOP_SEQUENCES),
    ("/v1/messages", "tools", [{"name": "f"}] * (caps.MAX_TOOLS + 1), caps.MAX_TOOLS),
    ("/v1/messages", "messages", [{"role": "user", "content": "x"}] * (caps.MAX_MESSAGES + 1), caps.MAX_MESSAGES),
    ("/v1/messages", "system", [{"type": "text", "text": "x"}] * (caps.MAX_PARTS + 1), caps.MAX_PARTS),
]


@pytest.mark.parametrize("path, field, value, cap", OVER, ids=[f"{p}:{f}:{c}" for p, f, _, c in OVER])
def test_every_list_and_string_over_its_cap_is_a_400_naming_it(srv, path, field, value, cap):
    base = MESSAGES if path == "/v1/messages" else CHAT if "chat" in path else PROMPT
    refused(post(srv, path, {**base, field: value}), field, cap)


def test_a_response_of_too_many_logprob_entries_is_a_400_before_any_work(srv):
    """n = 2 and prompt_logprobs = 20 on a long prompt: the prompt's entries in both choices would pass the cap, and
    the request is refused before its prompt is checked against the context. (An 8k-token prompt at n = 16 asked for
    2.7 million entries, 160 MB of JSON.)"""
    prompt = "word " * (caps.MAX_LOGPROB_ENTRIES // 21 // 2 + 200)
    over = post(srv, "/v1/completions", {**PROMPT, "prompt": prompt, "n": 2, "prompt_logprobs": 20})
    refused(over, "prompt_logprobs", f"{caps.MAX_LOGPROB_ENTRIES:,}")
    assert post(srv, "/v1/completions", {**PROMPT, "n": 2, "prompt_logprobs": 20, "logprobs": 5}).status_code == 200


def test_a_tenant_holding_every_slot_gets_the_429_and_a_newcomer_enters(srv):
    """Capacity is max_num_seqs + max_queue = 4. Tenant a fills it while the engine is held; a's next request is
    refused, b's is admitted (b holds less than its half), and every admitted request completes."""
    worker = srv.server.worker
    until(lambda: worker.in_flight == 0)
    results: dict[str, list[int]] = {"a": [], "b": []}
    pause = Pause(srv).held()
    threads = []
    try:
        for who, headers in (("a", A),) * 4:
            threads.append(threading.Thread(target=lambda w=who, h=headers: results[w].append(
                post(srv, "/v1/chat/completions", CHAT, h).status_code)))
            threads[-1].start()
        until(lambda: worker.in_flight == 4)
        assert post(srv, "/v1/chat/completions", CHAT, A).status_code == 429
        assert post(srv, "/v1/messages", MESSAGES, A).status_code == 529
        # from its headers alone: a tenant over its part costs no parsing or tokenizing
        assert headers_only(srv, "/v1/completions", "sk-a") == b"HTTP/1.1 429 Too Many Requests"
        threads.append(threading.Thread(target=lambda: results["b"].append(
            post(srv, "/v1/chat/completions", CHAT, B).status_code)))
        threads[-1].start()
        until(lambda: worker.in_flight == 5)
    finally:
        pause.release()
    for t in threads:
        t.join()
    assert results == {"a": [200] * 4, "b": [200]}
    until(lambda: worker.in_flight == 0)


def test_rendering_and_tokenizing_run_off_the_event_loop_in_turns_by_tenant(srv):
    """A preparing thread held by a job of tenant a's, with its bound (the capacity, 4) more of a's waiting (a's jobs
    run one at a time, each of these holding its thread until released): a's next request gets the 429, and b's
    request is not refused and is served at once on the other thread, before a's backlog."""
    preparer, held, fillers_go, ran = srv.server.preparer, threading.Event(), threading.Event(), []
    preparer.submit("a", held.wait)
    until(lambda: "a" not in preparer.jobs.queues)  # a thread holds it
    bound = preparer.jobs.bound
    assert bound == MAX_NUM_SEQS + MAX_QUEUE
    assert all(preparer.submit("a", lambda i=i: (fillers_go.wait(), ran.append(i))) for i in range(bound))
    try:
        assert post(srv, "/v1/chat/completions", CHAT, A).status_code == 429
        assert post(srv, "/tokenize", {"model": "default", "prompt": "hi"}, B).status_code == 200
        assert ran == []  # served while a's job held a thread and a's backlog waited
    finally:
        held.set()
        fillers_go.set()
    until(lambda: len(ran) == bound)


def test_rate_limits_are_the_tenants_and_refused_requests_count(srv):
    """Two keys of tenant m with rpm 2 and 5: alternating them used to reset the bucket each time. And tenant r's
    requests refused for their body take from its limit too."""
    codes = [post(srv, "/v1/chat/completions", CHAT, {"Authorization": f"Bearer sk-m{1 + i % 2}"}).status_code
             for i in range(4)]
    assert codes == [200, 200, 429, 429]
    r = {"Authorization": "Bearer sk-r"}
    assert [post(srv, "/v1/chat/completions", {**CHAT, "n": 0}, r).status_code for _ in range(2)] == [400, 400]
    assert post(srv, "/v1/chat/completions", CHAT, r).status_code == 429


def test_purges_count_against_the_rate_limit(srv):
    """Each purge walks the cache on the engine thread and every tier: tenant p (3 a minute) gets its fourth
    refused (200 purges of a tenant with rpm 30 were all served)."""
    codes = [httpx.delete(f"{srv.url}/v1/cache", headers={"Authorization": "Bearer sk-p"}, timeout=30).status_code
             for _ in range(4)]
    assert codes == [200, 200, 200, 429]


def test_a_tenant_over_its_limit_gets_the_429_before_its_body_is_read(srv):
    """Tenant h (1 request a minute) declares a 900 kB body and sends none of it: the 429 comes from its headers
    alone, so a flood over the limit costs the server no parsing (the body used to be read and parsed first)."""
    assert post(srv, "/v1/chat/completions", CHAT, {"Authorization": "Bearer sk-h"}).status_code == 200
    assert headers_only(srv, "/v1/chat/completions", "sk-h") == b"HTTP/1.1 429 Too Many Requests"


def headers_only(srv, path: str, key: str) -> bytes:
    """The status line of the answer to a request that declares a 900 kB body and sends one byte of it."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n".encode() +
                  b"Content-Type: application/json\r\nContent-Length: 900000\r\n\r\n{")
        return s.recv(4096).split(b"\r\n")[0]


def rss_high_water() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def test_b_streams_unchanged_while_a_attacks(srv):
    """Tenant b streams a greedy answer, quiet and then while tenant a sends every attack of issue 33: its text is
    the same, it never gets a 429, and the server's memory high-water mark grows by less than 512 MiB."""
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-b", max_retries=0)
    ask = {"model": "default", "messages": [{"role": "user", "content": "Count from one to thirty in words."}],
           "max_tokens": 48, "temperature": 0, "stream": True}

    def stream() -> str:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask) if c.choices)

    quiet = stream()
    high = rss_high_water()
    attacks = [("/v1/completions", {**PROMPT, "n": 100_000_000}),
               ("/v1/completions", {**PROMPT, "bad_words": ["word"] * 100_000}),
               ("/v1/completions/render", {**PROMPT, "bad_words": ["word"] * 100_000}),
               ("/v1/messages", {**MESSAGES, "stop_sequences": ["s"] * 100_000}),
               ("/v1/completions", {**PROMPT, "allowed_token_ids": list(range(100_000))}),
               ("/v1/completions", {**PROMPT, "prompt": list(range(100, 400_000))}),
               ("/v1/completions", {**PROMPT, "prompt": "tenant " * (caps.MAX_STRING // 7)})]
    statuses = []
    stop = threading.Event()

    def attack():
        while not stop.is_set():
            for path, body in attacks:
                statuses.append(post(srv, path, body).status_code)
            flood = [threading.Thread(target=lambda: statuses.append(post(
                srv, "/v1/chat/completions", {**CHAT, "max_tokens": 64, "ignore_eos": True}).status_code))
                for _ in range(8)]
            for t in flood:
                t.start()
            for t in flood:
                t.join()

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        until(lambda: len(statuses) >= len(attacks))
        flooded = [stream() for _ in range(3)]  # a 429 would raise here
    finally:
        stop.set()
        attacker.join()
    assert flooded == [quiet] * 3
    assert all(s in (400, 413) for s in statuses[:len(attacks)]), statuses[:len(attacks)]
    assert rss_high_water() - high < 512 << 20


def test_the_readme_states_the_caps():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert caps.markdown(Config().max_num_seqs, ServeConfig.max_body_bytes) in readme
