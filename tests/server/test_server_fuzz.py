"""A property-based fuzz of the HTTP API over its own OpenAPI spec (schemathesis): any input, valid or not, gives
a 2xx or a 4xx in the API's own error format, never a 5xx, and the server keeps serving."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_fixtures import fuzz_server

OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/messages"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"), ("DELETE", "/v1/cache")]


@pytest.fixture(scope="module")
def api(tiny_model):
    return fuzz_server(tiny_model)


@pytest.fixture(scope="module")
def api_schema(api):
    return schemathesis.openapi.from_url(f"{api.url}/openapi.json")


def _well_formed(path: str, body: dict) -> bool:
    if path == "/v1/messages":
        return body.get("type") == "error" and {"type", "message"} <= set(body["error"])
    return {"message", "type", "param", "code"} == set(body["error"])


def test_the_spec_lists_every_operation(api_schema):
    assert {(m.upper(), p) for p, ops in api_schema.items() for m in ops} >= set(OPERATIONS)


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_any_input_gets_a_2xx_or_a_well_formed_4xx(api, api_schema, method, path):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE)
           | operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE))
    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        response = case.call(base_url=api.url, timeout=120)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert _well_formed(path, response.json()), (case.body, response.text)

    run()


def test_the_server_is_still_up_after_the_fuzz(api):
    assert httpx.get(f"{api.url}/health").json()["status"] == "ok"
    assert httpx.post(f"{api.url}/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 2},
                      timeout=60).status_code == 200
