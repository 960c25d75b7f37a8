"""The model families we run, each a small description: what its files are called and the few ways its forward
differs from Llama's. Everything else (the engine, the kernels, the cache) is the same for all of them.

A family we know of but cannot run yet is refused at load with what it needs that we lack.
"""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    name: str
    hf_type: str  # HF's model_type
    hf_class: str  # HF's architectures[0], for the folder `prefixcache convert` writes
    gguf_arch: str  # general.architecture in a GGUF file
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: bool = False  # the token embedding times sqrt(hidden)
    norm_offset: bool = False  # HF's norms scale by (1 + w); a GGUF stores 1 + w
    sandwich_norms: bool = False  # RMSNorms after attention and after the MLP too, before their residual adds
    # llama.cpp's converter interleaves each head's rotary pairs of q and k for these; we read them back
    gguf_permuted_qk: bool = False
    gguf_names: dict[str, str] = field(default_factory=dict)  # a GGUF's layer tensors where they differ
    # what a GGUF does not say and llama.cpp knows: every n-th layer global, the others sliding; their RoPE base (0:
    # the global layers' RoPE); whether YaRN's bounds are rounded out to whole dimensions (gpt-oss's are not)
    gguf_window_pattern: int = 0
    gguf_local_theta: float = 0.0
    gguf_yarn_truncate: bool = True
    # mixture-of-experts layers (models/moe.py): a router's softmax picks each token's top k experts, their weights
    # divided by their sum where the config's norm_topk_prob says so; a GGUF does not say it, llama.cpp knows it
    moe: bool = False
    gguf_norm_topk: bool = False
    topk_softmax: bool = False  # the weights are the softmax of the chosen k's logits (gpt-oss), not of all
    # the experts' clamped SwiGLU (gpt-oss's): its defaults of (alpha, limit), as the HF config's swiglu_alpha and
    # swiglu_limit (a GGUF does not say them; llama.cpp knows them); (): SwiGLU
    expert_glu: tuple[float, ...] = ()
    # HF's experts fused as gpt-oss ships them (moe.unfuse)
    fused_experts: bool = False
    biases: bool = False  # the o projection, the router and the experts have biases (beside q, k, v's)
    sinks: bool = False  # a learned logit per head joins each attention softmax's denominator
    # a GGUF's tokenizer read by AutoTokenizer, which reads the file's config for its class; transformers 5 fails on
    # gpt-oss's (it reads each rope.scaling field's key length as its value): a PreTrainedTokenizerFast, as its HF
    # folder's is
    gguf_auto_tokenizer: bool = True
    chat_template: str = ""  # for a GGUF that carries none (a base model), as llama.cpp falls back to a known one


# Gemma's turns; a system message opens the first user turn, as Gemma's own template puts it there. Content is
# written verbatim (prompt.render finds each message's text in the rendered prompt)
GEMMA_TURNS = (
    "{{ bos_token }}{% set ns = namespace(open=false) %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<start_of_turn>user\n' + message['content'] + '\n\n' }}"
    "{% set ns.open = true %}{% else %}{% if not ns.open %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}{% endif %}"
    "{{ message['content'] + '<end_of_turn>\n' }}{% set ns.open = false %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


FAMILIES = (
    Family("llama", "llama", "LlamaForCausalLM", "llama", gguf_permuted_qk=True),
    Family("mistral", "mistral", "MistralForCausalLM", "llama", gguf_permuted_qk=True),
    Family("qwen2", "qwen2", "Qwen2ForCausalLM", "qwen2"),
    Family("qwen3", "qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True),
    Family("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", qk_norm=True, moe=True, gguf_norm_topk=True),
    # attention sinks, biases, a window on every other layer, YaRN; experts of clamped SwiGLU, weighted by the
    # softmax of the chosen k's logits
    Family("gpt_oss", "gpt_oss", "GptOssForCausalLM", "gpt-oss", moe=True, topk_softmax=True, expert_glu=(1.702, 7.0),
           fused_experts=True, biases=True, sinks=True, gguf_window_pattern=2, gguf_yarn_truncate=False,
           gguf_auto_tokenizer=False,
           gguf_names={"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}),
    Family("gemma3", "gemma3_text", "Gemma3ForCausalLM", "gemma3", qk_norm=True, activation="gelu_tanh",
           embed_scale=True, norm_offset=True, sandwich_norms=True, gguf_window_pattern=6, gguf_local_theta=10000.0,
           chat_template=GEMMA_TURNS,
           gguf_names={"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}),
)
MISSING = {  # families people run that need what we lack
    "gemma3": "a vision tower (the text-only Gemma 3, model_type gemma3_text, runs)",
    "gemma2": "logit soft-capping",
    "gemma": "GeGLU with exact GELU",
    "phi3": "fused qkv and gate_up tensors and LongRoPE scaling",
    "qwen2_moe": "a shared expert beside its mixture of experts",
    "mixtral": "mixture-of-experts layers",
}


def by_hf_type(model_type: str | None) -> Family:
    for f in FAMILIES:
        if f.hf_type == model_type:
            return f
    raise ValueError(_refusal(model_type, "model_type"))


def by_gguf_arch(arch: str | None) -> Family:
    """A GGUF's family: Mistral's files say "llama", and are read as Llama (the same forward)."""
    for f in FAMILIES:
        if f.gguf_arch == arch:
            return f
    raise ValueError(_refusal(arch, "GGUF architecture"))


def _refusal(name: str | None, what: str) -> str:
    supported = ", ".join(f.hf_type for f in FAMILIES)
    if name in MISSING:
        return f"{what} {name!r} is not supported yet: it needs {MISSING[name]}; supported: {supported}"
    return f"unsupported {what} {name!r}; supported: {supported}"
