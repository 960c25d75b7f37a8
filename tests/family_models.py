"""Random-weight models of each family we run, built and saved by HF transformers itself from the family's real
config shape (fewer layers, a narrower width), with the default model's tokenizer: for parity and exactness tests."""
import torch

from prefixcache.models import loader
from prefixcache.models.catalog import default_model_path

SHAPE = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # Llama 3.2's
FAMILIES = {  # each family's own features, at the sizes of its real configs' ratios
    "llama": dict(rope_theta=500000.0, rope_scaling=LLAMA3),
    "llama-linear": dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=False),  # q, k, v biases
    "qwen3": dict(rope_theta=1000000.0, head_dim=48),  # QK-norm, and heads wider than hidden / heads
    # Qwen3's attention; 8 experts of 256, 2 a token, their weights normalized; a dense layer between sparse ones
    "qwen3_moe": dict(rope_theta=1000000.0, head_dim=48, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[1]),
    "mistral": dict(rope_theta=1000000.0, sliding_window=128, head_dim=32),  # every layer reads a 128-key window
    # plain layers (our kernels run them in one op a run) whose local layers of a 128-key window alternate with a
    # global one: a run of each
    "qwen2-window": dict(rope_theta=1000000.0, use_sliding_window=True, sliding_window=128,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # GeGLU, sandwich norms, QK-norm, a scaled embedding; local layers of a 128-key window (the prompt is 8 of
    # them) with their own RoPE base beside a global one
    "gemma3": dict(model_type="gemma3_text", head_dim=64, query_pre_attn_scalar=48, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # attention sinks, q/k/v/o biases, a 128-key window on every other layer, YaRN (gpt-oss-20b's, untruncated); 4
    # experts of clamped SwiGLU with biases, 2 a token, weighted by the softmax of their router logits
    "gpt_oss": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, head_dim=32, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=128, tie_word_embeddings=False,
                    max_position_embeddings=131072,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
}


def family_model(folder: str, family: str, seed: int, **overrides) -> str:
    """`overrides`: config fields over the family's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    features = {**FAMILIES[family], **overrides}
    config = AutoConfig.for_model(features.pop("model_type", family.split("-")[0]), **{**SHAPE, **features})
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initializes norms to 1 and biases (gpt-oss's sinks) to 0: make them count
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", ".bias", "_bias")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("gate_up_proj"):  # gpt-oss's experts: gates and ups reach the activation's clamp
                p.mul_(30)
    hf.save_pretrained(folder)
    loader.tokenizer(default_model_path()).save_pretrained(folder)
    return folder
