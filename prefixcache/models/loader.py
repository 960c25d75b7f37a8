"""Load a model as it ships (a GGUF file, or an HF safetensors folder) into HF-named weights, its tokenizer and its
fingerprint. A GGUF's quantized tensors stay the blocks the file stores (models/quant.py); nothing is converted."""
import dataclasses
import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import xxhash

from prefixcache.files import cache_home
from prefixcache.models import families, gguf_file, moe, quant, rope
from prefixcache.models.quant import Blocks

Tensor = torch.Tensor | Blocks  # a weight: a tensor, or blocks as a GGUF ships them


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: rope.Rope
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    activation: str = "silu"  # of the gated MLP (families.Family.activation)
    embed_scale: float = 1.0  # the token embedding is multiplied by it
    sandwich_norms: bool = False  # norms after attention and the MLP too (Gemma)
    attn_scale: float = 0.0  # of q.k; 0: head_dim ** -0.5
    sliding_window: int = 0  # keys a local layer reads, its own included; 0: none
    local_layers: tuple[int, ...] = ()  # the layers that read only their window
    local_rope: rope.Rope | None = None  # the local layers' RoPE, where it differs
    sparse_layers: tuple[int, ...] = ()  # the layers whose feed-forward block is a mixture of experts (models/moe.py)
    experts: int = 0  # in each of them
    experts_used: int = 0  # a token's top k
    expert_size: int = 0  # an expert's gated MLP width
    norm_topk: bool = False  # the top k's weights divided by their sum (HF's norm_topk_prob)
    topk_softmax: bool = False  # the weights are the softmax of the chosen k's logits (families.Family)
    expert_glu: tuple[float, ...] = ()  # the experts' clamped SwiGLU's (alpha, limit); (): SwiGLU
    biases: bool = False  # the o projection, the router and the experts have biases
    sinks: bool = False  # attention sinks, a logit per head


@dataclass
class Weights:
    config: ModelConfig
    tensors: dict[str, Tensor]  # HF names
    tokenizer: object  # transformers PreTrainedTokenizerFast
    fingerprint: str
    name: str
    release: Callable[[], None] = lambda: None  # drop the file's pages read so far from memory (gguf_file.read)


def load(path: str, dtype: torch.dtype = torch.float32, quantized: bool = True) -> Weights:
    """Load a GGUF file or an HF safetensors folder. With `quantized` (and float32 activations), a GGUF's quantized
    weights stay as shipped; otherwise every weight is dequantized to `dtype`."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    release = Weights.release
    if os.path.isdir(path):
        hf, tensors, tokenizer = _hf_config(path), _safetensors(path), _folder_tokenizer(path)
        if families.by_hf_type(hf.get("model_type")).fused_experts:
            tensors = moe.unfuse(tensors)
        digest = _digest(os.path.join(path, f) for f in _safetensor_files(path))
    elif path.endswith(".gguf"):
        hf, tensors, tokenizer, digest, release = gguf_file.read(path)
    else:
        raise ValueError(f"unsupported model path {path!r}: expected a .gguf file or an HF safetensors folder")
    config = _with_eos(_config(hf, tensors), tokenizer)
    if families.by_hf_type(hf["model_type"]).norm_offset:  # (1 + w), once, in fp32 as HF computes it
        tensors = {k: 1.0 + v.float() if k.endswith("norm.weight") else v for k, v in tensors.items()}
    if (factors := tensors.pop(gguf_file.ROPE_FACTORS, None)) is not None:
        config = dataclasses.replace(config, rope=dataclasses.replace(config.rope, factors=tuple(factors.tolist())))
    _check_shapes(config, tensors)
    if quantized and dtype == torch.float32:  # as shipped: blocks, and 16-bit matrices as 16 bits
        tensors = {k: _as_shipped(v) for k, v in tensors.items()}
    else:
        tensors = {k: _dense(v).to(dtype).contiguous() for k, v in tensors.items()}
    name = os.path.basename(path.rstrip("/")).removesuffix(".gguf")
    return Weights(config, tensors, tokenizer, fingerprint(config, dtype, digest), name, release)


def tokenizer(path: str):
    """The tokenizer of a GGUF file or an HF folder, without reading a weight."""
    if os.path.isdir(path):
        return _folder_tokenizer(path)
    return gguf_file.read_tokenizer(path)


def fingerprint(config: ModelConfig, dtype: torch.dtype, digest: str) -> str:
    """Stable across processes and runs: xxh3-128 over the config, the dtype and the weight files' bytes."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(asdict(config), sort_keys=True).encode())
    h.update(str(dtype).encode())
    h.update(digest.encode())
    return h.hexdigest()


def converted_folder(gguf_path: str) -> str:
    """An HF folder of a GGUF's weights dequantized to fp32, written once in the user cache: for peers and for
    HF transformers as a reference, never for our engine."""
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    folder = os.path.join(cache_home(), f"{name}-{gguf_file.file_digest(gguf_path)}")
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        convert_gguf(gguf_path, folder)
    return folder


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write an HF folder (config.json, model.safetensors, tokenizer) with the GGUF's weights dequantized to fp32."""
    from safetensors.torch import save_file

    hf, tensors, tok, *_ = gguf_file.read(gguf_path)
    if gguf_file.ROPE_FACTORS in tensors:
        raise ValueError(f"{gguf_path}: its RoPE factors ({gguf_file.ROPE_FACTORS}) have no HF config form")
    tmp = f"{out_dir}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    tok.save_pretrained(tmp)
    save_file({k: _dense(v) for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def read_config(path: str) -> ModelConfig:
    """An HF folder's model config, from config.json and its tensors' names: no weight is read."""
    from safetensors import safe_open

    names = set()
    for f in _safetensor_files(path):
        with safe_open(os.path.join(path, f), "pt") as st:
            names.update(st.keys())
    return _config(_hf_config(path), names)


def _as_shipped(t: Tensor) -> Tensor:
    if isinstance(t, Blocks):
        return t
    if t.dim() == 2 and t.dtype in (torch.float16, torch.bfloat16):
        return Blocks("F16" if t.dtype == torch.float16 else "BF16", t)
    return t.float().contiguous()


def _dense(t: Tensor) -> torch.Tensor:
    return quant.dequantize(t) if isinstance(t, Blocks) else t.float()


def _hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cfg_path) as f:
        return json.load(f)


def _safetensor_files(path: str) -> list[str]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in _safetensor_files(path):
        tensors.update(load_file(os.path.join(path, f)))
    return tensors


def _folder_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _digest(files) -> str:
    h = xxhash.xxh3_128()
    for f in files:
        h.update(gguf_file.file_digest(f).encode())
    return h.hexdigest()


def _config(hf: dict, tensor_names) -> ModelConfig:
    family = families.by_hf_type(hf.get("model_type"))
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    window = hf.get("use_sliding_window", True) and hf.get("sliding_window") or 0
    # a window without layer types (Mistral, Qwen 2 with use_sliding_window) is every layer's
    types = hf.get("layer_types") or ["sliding_attention" if window else "full_attention"] * layers
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported yet")
    global_rope, local_rope = rope.from_hf(hf), rope.from_hf(hf, "sliding_attention")
    experts = (hf.get("num_experts") or hf.get("num_local_experts") or 0) if family.moe else 0
    glu = family.expert_glu and (float(hf.get("swiglu_alpha", family.expert_glu[0])),
                                 float(hf.get("swiglu_limit", family.expert_glu[1])))
    used = hf.get("num_experts_per_tok", 0) if experts else 0
    if experts and not 0 < used <= experts:
        raise ValueError(f"num_experts_per_tok {used} is not a count of the model's {experts} experts")
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0)
    return ModelConfig(
        family=family.name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope=global_rope, rms_norm_eps=float(hf["rms_norm_eps"]), max_position=hf["max_position_embeddings"],
        tie_embeddings="lm_head.weight" not in tensor_names,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensor_names,
        qk_norm=family.qk_norm, eos_token_ids=_ids(hf.get("eos_token_id")), activation=family.activation,
        embed_scale=float(torch.tensor(hf["hidden_size"] ** 0.5)) if family.embed_scale else 1.0,
        sandwich_norms=family.sandwich_norms,
        attn_scale=hf["query_pre_attn_scalar"] ** -0.5 if "query_pre_attn_scalar" in hf else 0.0,
        sliding_window=window if local else 0, local_layers=local,
        local_rope=local_rope if local and local_rope != global_rope else None,
        sparse_layers=sparse, experts=experts, experts_used=used,
        expert_size=(hf.get("moe_intermediate_size") or hf["intermediate_size"]) if experts else 0,
        norm_topk=bool(experts and hf.get("norm_topk_prob")), topk_softmax=family.topk_softmax, expert_glu=glu,
        biases=family.biases, sinks=family.sinks,
    )


# each layer's projections, by HF's name, and the module of the layer that holds it (a dense layer's MLP)
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def projection_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each layer's projection weights' [n, k], by PROJECTIONS' names."""
    q, kv, h, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def _check_shapes(c: ModelConfig, tensors: dict[str, Tensor]) -> None:
    """Every tensor the forward reads, of the shape the config gives: else an error naming the first that is not."""
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    want = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_embeddings:
        want["lm_head.weight"] = (c.vocab_size, h)
    shapes = {f"{PROJECTIONS[m]}.{m}.weight": shape for m, shape in projection_shapes(c).items()}
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             **{k: v for k, v in shapes.items() if k.startswith("self_attn.")}}
    dense = {k: v for k, v in shapes.items() if k.startswith("mlp.")}
    e = c.expert_size
    experts = {"mlp.gate.weight": (c.experts, h)} | {
        f"mlp.experts.{x}.{m}.weight": shape for x in range(c.experts)
        for m, shape in (("gate_proj", (e, h)), ("up_proj", (e, h)), ("down_proj", (h, e)))}
    if c.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if c.biases:
        layer["self_attn.o_proj.bias"] = (h,)
        experts |= {"mlp.gate.bias": (c.experts,)} | {
            f"mlp.experts.{x}.{m}.bias": (h if m == "down_proj" else e,) for x in range(c.experts)
            for m in ("gate_proj", "up_proj", "down_proj")}
    if c.sinks:
        layer["self_attn.sinks"] = (c.num_heads,)
    if c.qk_norm:
        layer.update({"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)})
    if c.sandwich_norms:
        layer.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
    for n in range(c.num_layers):
        mlp = experts if n in c.sparse_layers else dense
        want.update({f"model.layers.{n}.{k}": v for k, v in (layer | mlp).items()})
    for name, shape in want.items():
        if name not in tensors:
            raise ValueError(f"the model has no tensor {name!r} (a {c.family} model of {c.num_layers} layers needs it)")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, but the config makes it {shape}")


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _with_eos(config: ModelConfig, tokenizer) -> ModelConfig:
    eos = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()  # once: for Gemma's 262k tokens, half a second a call
    specials = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|eom_id|>", "<end_of_turn>", "<|return|>", "<|call|>")
    eos.update(vocab[special] for special in specials if special in vocab)
    return dataclasses.replace(config, eos_token_ids=tuple(sorted(eos)))
