"""Structured output through the official openai client: the output always parses and follows the schema."""
import json
import re

import jsonschema
import openai
import pytest
from server_fixtures import main_server

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    srv = main_server(tmp_path_factory)
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-acme", max_retries=0)


def ask(client, seed: int, **kw) -> str:
    r = client.chat.completions.create(model="default", max_tokens=96, temperature=1.0, seed=seed,
                                       messages=[{"role": "user", "content": "Describe a person as JSON."}], **kw)
    assert r.choices[0].finish_reason == "stop"
    return r.choices[0].message.content


@pytest.mark.parametrize("seed", range(8))
def test_json_schema_output_validates(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    jsonschema.validate(json.loads(ask(client, seed, response_format=fmt)), PERSON)


def test_json_object_choice_and_regex(client):
    assert isinstance(json.loads(ask(client, 0, response_format={"type": "json_object"})), dict)
    assert ask(client, 1, extra_body={"guided_choice": ["yes", "no", "maybe later"]}) in ("yes", "no", "maybe later")
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}",
                        ask(client, 2, extra_body={"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}))


def test_bad_guides_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        ask(client, 0, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})
    with pytest.raises(openai.BadRequestError, match="at most one"):
        ask(client, 0, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    with pytest.raises(openai.BadRequestError, match="json_schema is required"):
        ask(client, 0, response_format={"type": "json_schema"})
