"""Tool calls through the official clients: tool_choice forces valid calls, replies are read back as calls, and
streams carry them in each API's format."""
import json

import anthropic
import jsonschema
import openai
import pytest
from server_fixtures import main_server

from prefixcache.server.tools import Holdback

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    return main_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-acme", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model="default", max_tokens=64, temperature=0,
                                          messages=ASK, tools=TOOLS, **kw)


def valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.parametrize("seed", range(3))
def test_required_gives_a_valid_call(client, seed):
    r = client.chat.completions.create(model="default", max_tokens=64, temperature=1.0, seed=seed, messages=ASK,
                                       tools=TOOLS, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    valid(call.function.name, call.function.arguments)


def test_named_choice_streamed_equals_not_streamed(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    [call] = chat(client, tool_choice=named).choices[0].message.tool_calls
    assert call.function.name == "get_time" and valid("get_time", call.function.arguments)
    chunks = list(chat(client, tool_choice=named, stream=True))
    streamed = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("get_time", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not ch.choices[0].delta.content for ch in chunks)


def test_the_call_and_its_result_go_back_to_the_model(client):
    [call] = chat(client, tool_choice="required").choices[0].message.tool_calls
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "12 C and rain"}]
    r = client.chat.completions.create(model="default", max_tokens=16, temperature=0, messages=turn, tools=TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_bad_tool_choices_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="default", max_tokens=4, messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        chat(client, tool_choice={"type": "function", "function": {"name": "rm"}})
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        chat(client, tool_choice="required", response_format={"type": "json_object"})


def test_holdback_releases_text_that_cannot_be_a_call():
    h = Holdback()
    assert [h.feed(d) for d in (" ", '{"tool', '_use": "get_time"')] == ["", "", ""]
    assert h.held == ' {"tool_use": "get_time"'
    text = Holdback()
    assert [text.feed(d) for d in ("{", "Hello", " world")] == ["", "{Hello", " world"]


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def message(srv, stream: bool = False, **kw):
    client = anthropic.Anthropic(base_url=srv.url, api_key="sk-acme", max_retries=0)
    kw = {"model": "default", "max_tokens": 64, "messages": ASK, "tools": ANTHROPIC_TOOLS,
          "extra_body": {"temperature": 0}, **kw}
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        return s.get_final_message()


def test_anthropic_any_and_named_tool_calls_streamed_or_not(srv):
    m = message(srv, tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in SCHEMAS
    jsonschema.validate(block.input, SCHEMAS[block.name])
    named = message(srv, tool_choice={"type": "tool", "name": "get_time"})
    streamed = message(srv, stream=True, tool_choice={"type": "tool", "name": "get_time"})
    assert [(b.type, b.name, b.input) for b in streamed.content] == [(b.type, b.name, b.input) for b in named.content]
    assert named.content[0].name == "get_time" and streamed.stop_reason == "tool_use"
    result = [*ASK, {"role": "assistant", "content": [block.model_dump()]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "12 C"}]}]
    reply = message(srv, messages=result, tool_choice={"type": "none"}, max_tokens=16)
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].type == "text"
    with pytest.raises(anthropic.BadRequestError, match="not in tools"):
        message(srv, tool_choice={"type": "tool", "name": "rm"})
