import json
import os

import pytest
import torch
from family_models import family_model
from safetensors.torch import save_file

import prefixcache  # noqa: F401  (sets its environment defaults, HF_HUB_OFFLINE among them, first)
from prefixcache import LLM
from prefixcache.engine.sequence import SamplingParams
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import tokenizer

pytest_plugins = ["tier_fixtures"]  # the tier tests' fixtures (tests/cache/test_tier*.py)


def _tiny_model(folder: str, model_type: str, bias: bool, seed: int) -> str:
    """A random-weight Llama/Qwen2 with the default model's tokenizer: fast, but real code paths."""
    tokenizer(default_model_path()).save_pretrained(folder)
    vocab, hidden, inter, layers, heads, kv_heads = 49152, 64, 128, 2, 4, 2
    config = {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
              "tie_word_embeddings": True, "attention_bias": bias, "eos_token_id": 2, "bos_token_id": 1,
              "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)
    d = hidden // heads
    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
         "model.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (heads * d, hidden), "self_attn.k_proj": (kv_heads * d, hidden),
                  "self_attn.v_proj": (kv_heads * d, hidden), "self_attn.o_proj": (hidden, heads * d),
                  "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
        for name, shape in shapes.items():
            t[p + name + ".weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        if bias:
            for n in "qkv":
                t[p + f"self_attn.{n}_proj.bias"] = 0.1 * torch.randn(shapes[f"self_attn.{n}_proj"][0], generator=g)
        t[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    save_file(t, os.path.join(folder, "model.safetensors"))
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return _tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), "llama", False, 0)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> str:
    return _tiny_model(str(tmp_path_factory.mktemp("tiny_qwen")), "qwen2", True, 1)


@pytest.fixture(scope="session")
def tiny_model_v2(tmp_path_factory) -> str:
    """Same architecture as tiny_model, different weights: a model update."""
    return _tiny_model(str(tmp_path_factory.mktemp("tiny_llama_v2")), "llama", False, 2)


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory) -> str:
    """A Gemma 3: local layers of a 128-key window beside a global one (tests/family_models.py)."""
    return family_model(str(tmp_path_factory.mktemp("tiny_gemma")), "gemma3", seed=3)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> str:
    """A Qwen3-MoE: 8 experts, 2 a token, a dense layer between two sparse ones (tests/family_models.py)."""
    return family_model(str(tmp_path_factory.mktemp("tiny_moe")), "qwen3_moe", seed=5)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> str:
    """A gpt-oss: sinks, biases, a 128-key window on every other layer, YaRN, 4 experts of clamped SwiGLU, 2 a token
    (tests/family_models.py)."""
    return family_model(str(tmp_path_factory.mktemp("tiny_gpt_oss")), "gpt_oss", seed=6)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def generate_with_logits(llm, prompts, params=GREEDY, **kwargs):
    """Generate, and keep every next-token logits vector an output token was chosen from, sampled or (with
    speculative decoding) verified against a draft (per request, stacked)."""
    seen: dict[int, list[torch.Tensor]] = {}
    sampler = llm.engine.sampler
    sample = sampler.sample

    def recording_sample(row, seq):
        seen.setdefault(seq.id, []).append(row.clone())
        return sample(row, seq)

    sampler.sample = recording_sample
    try:
        outs = llm.generate(prompts, params, **kwargs)
    finally:
        sampler.sample = sample
    return outs, [torch.stack(seen[o.request_id]) for o in outs]


def warm_and_cold(model: str, prompts: list[list[int]], kernels: str):
    """The prompts' greedy logits each run cold alone, and all run warm (the first one cached before) in chunks of 96
    tokens, batched: (the warm outputs, the cold logits, the warm logits, whether the warm engine runs our kernels)."""
    cold = LLM(model=model, enable_prefix_cache=False, kernels=kernels)
    warm = LLM(model=model, max_batch_tokens=96, kernels=kernels)
    warm.generate(prompts[:1], GREEDY)
    singles = [generate_with_logits(cold, [p], GREEDY)[1][0] for p in prompts]
    outs, together = generate_with_logits(warm, prompts, GREEDY)
    return outs, singles, together, warm.engine.runner.model.paged


# `make reliability` runs the reliability checks in their long form and collects each one's figures (issue 14).
LONG = os.environ.get("PREFIXCACHE_LONG") == "1"
_FIGURES: dict[str, dict] = {}


@pytest.fixture
def figures() -> dict[str, dict]:
    """A test's figures for the reliability report, by check name."""
    return _FIGURES


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("PREFIXCACHE_REPORT")
    if path and _FIGURES:
        with open(path, "w") as f:
            json.dump({"long": LONG, "passed": exitstatus == 0, "checks": _FIGURES}, f, indent=1)


@pytest.fixture
def redis_proc():
    """A redis-server of this test's own, on a free port."""
    from prefixcache.bench.server import RedisProcess

    proc = RedisProcess().start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tiny_srv(tiny_model):
    """A real server on the tiny model, no auth (server_fixtures.tiny_server)."""
    from server_fixtures import tiny_server
    return tiny_server(tiny_model)


@pytest.fixture(scope="module")
def tiny_client(tiny_srv):
    from openai import OpenAI
    return OpenAI(base_url=f"{tiny_srv.url}/v1", api_key="none")


@pytest.fixture(scope="module")
def tiny_offline(tiny_model):
    """The offline engine on the same weights, cache off: what the server's output should be."""
    return LLM(model=tiny_model, enable_prefix_cache=False)
