"""LoRA adapters over HTTP, as vLLM serves them: each adapter a model of /v1/models whose parent is the base, a
request names one as its model (OpenAI's and Anthropic's APIs, their official clients) and gets what the engine
gives with it; a model the server does not serve is a 404 in each API's error format."""
import anthropic
import openai
import pytest
from family_models import family_model
from lora_adapters import write_adapter
from server_fixtures import _start

from prefixcache import LLM, SamplingParams
from prefixcache.config import Config
from prefixcache.server.config import ServeConfig


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = family_model(str(root / "base"), "llama", seed=3)
    adapter = write_adapter(str(root / "tuned"), base, ["q_proj", "v_proj", "down_proj"], seed=5)
    config = Config(model=base, kv_cache_bytes=2**26, lora_modules=f"tuned={adapter}")
    return _start("lora", ServeConfig(config)), base, adapter


def test_adapters_are_models_whose_parent_is_the_base(served):
    running, *_ = served
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    base = running.server.model_name
    assert set(models) == {base, "tuned"}
    assert models["tuned"].model_extra["parent"] == base


def test_a_request_naming_an_adapter_gets_what_the_engine_gives_with_it(served):
    running, base, adapter = served
    llm = LLM(model=base, lora_modules=f"tuned={adapter}")
    prompt = "The history of the printing press"
    want = {name: llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                               adapter=name)[0].token_ids for name in ("tuned", "")}
    assert want["tuned"] != want[""]
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="none")
    for model, name in (("tuned", "tuned"), (running.server.model_name, "")):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.model == model
        assert running.server.tokenizer.encode(r.choices[0].text, add_special_tokens=False) == want[name]
    message = anthropic.Anthropic(base_url=running.url, api_key="none").messages.create(
        model="tuned", max_tokens=8, messages=[{"role": "user", "content": "Hello"}])
    assert message.model == "tuned" and message.content[0].text


def test_a_model_not_served_is_a_404_in_each_apis_format(served):
    running, *_ = served
    with pytest.raises(openai.NotFoundError) as e:
        openai.OpenAI(base_url=running.url + "/v1", api_key="none").completions.create(
            model="other", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and "'tuned'" in e.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic.Anthropic(base_url=running.url, api_key="none").messages.create(
            model="other", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
