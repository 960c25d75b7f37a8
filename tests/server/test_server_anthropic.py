"""Anthropic Messages API against a real server: cache_control breakpoints, usage accounting, streams, errors."""
import anthropic
import pytest
from server_fixtures import MIN_CACHE_TOKENS, long_system, main_server, prefix_header


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    return main_server(tmp_path_factory)


def client(srv, key="sk-acme") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0)


def create(srv, key: str = "sk-acme", **kw):
    """A greedy message; returns (message, prompt length from the x-prefix-cache header)."""
    kw = {"model": "default", "max_tokens": 8, "extra_body": {"temperature": 0},  # this client has no temperature
          "messages": [{"role": "user", "content": "What should I do?"}], **kw}
    raw = client(srv, key).messages.with_raw_response.create(**kw)
    msg = raw.parse()
    u = msg.usage
    prompt = int(prefix_header(raw.headers)["prompt"])
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == prompt
    assert u.cache_creation_input_tokens == \
        u.cache_creation.ephemeral_5m_input_tokens + u.cache_creation.ephemeral_1h_input_tokens
    return msg, prompt


def cached(text: str, ttl: str = "5m") -> dict:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": ttl}}


def test_breakpoint_writes_then_reads(srv):
    system = [cached(long_system("anthropic-write"))]
    first, prompt = create(srv, system=system)
    second, _ = create(srv, system=system, messages=[{"role": "user", "content": "Something else entirely."}])
    u1, u2 = first.usage, second.usage
    assert u1.cache_creation_input_tokens > MIN_CACHE_TOKENS
    assert u1.cache_creation.ephemeral_5m_input_tokens == u1.cache_creation_input_tokens
    # the breakpoint ends the system block: the messages after it are neither written nor read
    assert u1.input_tokens > 0 and u1.cache_creation_input_tokens < prompt
    assert u2.cache_read_input_tokens == u1.cache_read_input_tokens + u1.cache_creation_input_tokens
    assert u2.cache_creation_input_tokens == 0
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"


TOOLS = [{"name": "lookup", "description": long_system("anthropic-tools", 12),
          "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
          "cache_control": {"type": "ephemeral", "ttl": "1h"}}]


def test_the_api_key_decides_the_scope_whatever_salt_the_client_sends(srv):
    """x-api-key names the tenant; cache_salt and prompt_cache_key only narrow it, so copying another tenant's
    salt and key reads nothing of theirs."""
    system = [cached(long_system("anthropic-isolation"))]
    salt = {"temperature": 0, "cache_salt": "team", "prompt_cache_key": "conversation-1"}
    owner, _ = create(srv, system=system, extra_body=salt)
    written = owner.usage.cache_creation_input_tokens
    assert owner.usage.cache_read_input_tokens == 0 and written > MIN_CACHE_TOKENS
    other, _ = create(srv, key="sk-globex", system=system, extra_body=salt)
    assert other.usage.cache_read_input_tokens == 0 and other.usage.cache_creation_input_tokens == written
    narrower, _ = create(srv, system=system, extra_body={**salt, "prompt_cache_key": "conversation-2"})
    assert narrower.usage.cache_read_input_tokens == 0
    again, _ = create(srv, system=system, extra_body=salt)
    assert again.usage.cache_read_input_tokens == written and again.usage.cache_creation_input_tokens == 0


def test_tools_1h_before_system_5m(srv):
    system = [cached(long_system("anthropic-tools-system", 6))]
    first, _ = create(srv, tools=TOOLS, system=system)
    c = first.usage.cache_creation
    assert c.ephemeral_1h_input_tokens > MIN_CACHE_TOKENS and c.ephemeral_5m_input_tokens > 0
    second, _ = create(srv, tools=TOOLS, system=system)
    assert second.usage.cache_read_input_tokens > c.ephemeral_1h_input_tokens
    assert second.usage.cache_creation_input_tokens == 0


def test_two_breakpoints_count_each_written_token_once(srv):
    system = [cached(long_system("anthropic-count", 6))]
    salted = {"extra_body": {"temperature": 0, "cache_salt": "count"}}
    first, _ = create(srv, tools=TOOLS, system=system, **salted)
    second, _ = create(srv, tools=TOOLS, system=system, **salted)
    assert second.usage.cache_read_input_tokens == first.usage.cache_read_input_tokens + \
        first.usage.cache_creation_input_tokens


def test_top_level_cache_control_caches_up_to_the_last_block(srv):
    system = long_system("anthropic-auto")
    kw = {"system": system, "cache_control": {"type": "ephemeral"}}
    first, prompt = create(srv, **kw)
    assert first.usage.cache_creation_input_tokens > MIN_CACHE_TOKENS
    # everything up to the end of the last user block is written; only the assistant header is left over
    assert first.usage.input_tokens < 8
    second, _ = create(srv, **kw)
    assert second.usage.cache_read_input_tokens == first.usage.cache_read_input_tokens + \
        first.usage.cache_creation_input_tokens


def test_below_the_minimum_nothing_is_cached(srv):
    msg, prompt = create(srv, system=[cached("You are brief.")])
    assert prompt < MIN_CACHE_TOKENS and msg.usage.cache_creation_input_tokens == 0


def test_stream_events_and_usage(srv):
    system = [cached(long_system("anthropic-stream"))]
    create(srv, system=system)
    with client(srv).messages.stream(model="default", max_tokens=8, extra_body={"temperature": 0}, system=system,
                                     messages=[{"role": "user", "content": "What should I do?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                   "message_delta", "message_stop")]
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    start = events[0].message.usage
    assert start.cache_read_input_tokens > 0 and start.cache_creation_input_tokens == 0
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(e.delta.type == "text_delta" for e in deltas)
    blocking, _ = create(srv, system=system)
    assert final.content[0].text == blocking.content[0].text
    assert final.usage.output_tokens == blocking.usage.output_tokens
    assert final.usage.cache_read_input_tokens == start.cache_read_input_tokens


def test_stop_sequence(srv):
    system = long_system("anthropic-stop", 3)
    full, _ = create(srv, system=system)
    text = full.content[0].text
    cut, _ = create(srv, system=system, stop_sequences=[text[2:4]])
    assert cut.content[0].text == text[:2] and cut.stop_reason == "stop_sequence" and cut.stop_sequence == text[2:4]


@pytest.mark.parametrize("kw, message", [
    ({"system": [cached(f"block {i}") for i in range(5)]}, "maximum of 4"),
    ({"system": [cached("five minutes", "5m"), cached("one hour", "1h")]}, "1h"),
    ({"system": [cached("x", "2h")]}, "ttl"),
])
def test_breakpoint_validation(srv, kw, message):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(srv, **kw)
    body = e.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert message in body["error"]["message"]
