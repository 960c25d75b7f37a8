"""Load Llama-family weights (GGUF or HF safetensors) into HF-named fp32 tensors, plus tokenizer and fingerprint."""
import json
import os
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import xxhash

from prefixcache.models.quant import SHIPPED, Blocks

GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]


@dataclass
class Weights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names, fp32
    tokenizer: object  # transformers PreTrainedTokenizerFast
    fingerprint: str
    name: str
    # a GGUF's quantized weights as the file stores them, by HF name (fp32 only: `tensors` holds their values)
    shipped: dict[str, Blocks] = field(default_factory=dict)


def load(path: str, dtype: torch.dtype = torch.float32, shipped: bool = True) -> Weights:
    """Load a GGUF file or an HF safetensors folder. A GGUF file is converted once into an HF folder in the
    user cache (keyed by the file's hash), so later loads only map safetensors; with `shipped`, its Q4_1 and Q8_0
    blocks are read too."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    if os.path.isdir(path):
        folder = path
    elif path.endswith(".gguf"):
        folder = converted_folder(path)
    else:
        raise ValueError(f"unsupported model path {path!r}: expected a .gguf file or an HF safetensors folder")
    config, tensors, tokenizer = _load_hf_dir(folder)
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    name = os.path.basename(path.rstrip("/")).removesuffix(".gguf")
    blocks = _shipped(path, folder) if shipped and dtype == torch.float32 and path.endswith(".gguf") else {}
    return Weights(config, tensors, tokenizer, fingerprint(config, tensors, dtype), name, blocks)


def converted_folder(gguf_path: str) -> str:
    with open(gguf_path, "rb") as f:
        digest = xxhash.xxh3_64_hexdigest(f.read())
    cache = os.environ.get("PREFIXCACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache", "prefixcache"))
    folder = os.path.join(cache, f"{os.path.basename(gguf_path).removesuffix('.gguf')}-{digest}")
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        convert_gguf(gguf_path, folder)
    return folder


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write an HF folder (config.json, model.safetensors, tokenizer) with the GGUF's weights dequantized to fp32."""
    from safetensors.torch import save_file

    hf_config, tensors, tokenizer = _read_gguf(gguf_path)
    tmp = f"{out_dir}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    tokenizer.save_pretrained(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def fingerprint(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """Stable across processes and runs: xxh3-128 over config, dtype and every tensor's name, shape and bytes."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(asdict(config), sort_keys=True).encode())
    h.update(str(dtype).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().data if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().data)
    return h.hexdigest()


def _read_gguf(path: str):
    from transformers import AutoTokenizer

    reader, fields, arch = _open_gguf(path)
    tensors = {name: torch.from_numpy(data) for name, _, data in _gguf_tensors(reader, fields, arch, _dequantized)}
    hidden = fields[f"{arch}.embedding_length"]
    heads = fields[f"{arch}.attention.head_count"]
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    hf_config = {
        "model_type": arch, "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                               "mistral": "MistralForCausalLM"}[arch]],
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0], "hidden_size": hidden,
        "intermediate_size": fields[f"{arch}.feed_forward_length"], "num_hidden_layers": fields[f"{arch}.block_count"],
        "num_attention_heads": heads, "num_key_value_heads": fields.get(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": fields.get(f"{arch}.attention.key_length", hidden // heads),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": fields[f"{arch}.context_length"],
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "torch_dtype": "float32",
    }
    return hf_config, tensors, tokenizer


def _shipped(gguf_path: str, folder: str) -> dict[str, Blocks]:
    """The GGUF's Q4_1 and Q8_0 weights as it stores them, rows in the order of the dequantized ones; kept beside
    in its converted folder, apart from the model's tensors (reading the GGUF's metadata takes seconds, mapping this
    file none)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = os.path.join(folder, "shipped", "blocks.safetensors")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        reader, fields, arch = _open_gguf(gguf_path)
        found = list(_gguf_tensors(reader, fields, arch, _raw))
        save_file({name: torch.from_numpy(data) for name, _, data in found}, f"{path}.tmp{os.getpid()}",
                  metadata={name: kind for name, kind, _ in found})
        os.replace(f"{path}.tmp{os.getpid()}", path)
    with safe_open(path, "pt") as f:
        kinds = f.metadata() or {}
        return {name: Blocks(kinds[name], f.get_tensor(name)) for name in f.keys()}


def _open_gguf(path: str):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on a bad file
        raise ValueError(f"corrupt or unreadable GGUF file {path}: {e}") from e
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {ARCHITECTURES}")
    return reader, fields, arch


def _dequantized(t) -> np.ndarray:
    import gguf

    return np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def _raw(t) -> np.ndarray | None:
    """A tensor's blocks as stored, [rows, bytes], if it is of a kind our kernels read (quant.SHIPPED)."""
    return np.array(t.data) if t.tensor_type.name in SHIPPED else None


def _gguf_tensors(reader, fields: dict, arch: str, read):
    """(HF name, GGUF type, read(tensor)) for each tensor that `read` gives, rows in HF order."""
    heads = fields[f"{arch}.attention.head_count"]
    kv_heads = fields.get(f"{arch}.attention.head_count_kv") or heads
    for t in reader.tensors:
        data = read(t)
        if data is None:
            continue
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{parts[3]}"
        else:
            name = f"{GGUF_NAMES[parts[0]]}.{parts[1]}"
        if arch == "llama" and parts[-2] in ("attn_q", "attn_k"):  # llama.cpp interleaves rotary pairs
            data = _unpermute(data, heads if parts[-2] == "attn_q" else kv_heads)
        yield name, t.tensor_type.name, np.ascontiguousarray(data)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def read_config(path: str) -> ModelConfig:
    """An HF folder's model config, from config.json and its tensors' names: no weight is read."""
    from safetensors import safe_open

    names = set()
    for f in _safetensors(path):
        with safe_open(os.path.join(path, f), "pt") as st:
            names.update(st.keys())
    return _config(_hf_config(path), names)


def _load_hf_dir(path: str):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    hf = _hf_config(path)
    tensors = {}
    for f in _safetensors(path):
        tensors.update(load_file(os.path.join(path, f)))
    config = _config(hf, tensors)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return _with_eos(config, tokenizer), tensors, tokenizer


def _hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cfg_path) as f:
        hf = json.load(f)
    if hf.get("model_type") not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {hf.get('model_type')!r}; supported: {ARCHITECTURES}")
    if hf.get("rope_scaling"):  # e.g. Llama 3.1's "llama3" scaling: refuse rather than compute wrong RoPE
        raise ValueError(f"rope_scaling {hf['rope_scaling']!r} is not supported yet")
    return hf


def _safetensors(path: str) -> list[str]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def _config(hf: dict, tensor_names) -> ModelConfig:
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        # full attention only: a sliding-window model is exact up to its window
        max_position=min(hf["max_position_embeddings"],
                         hf.get("use_sliding_window", True) and hf.get("sliding_window")
                         or hf["max_position_embeddings"]),
        tie_embeddings="lm_head.weight" not in tensor_names,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensor_names,
        eos_token_ids=_ids(hf.get("eos_token_id")),
    )


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _with_eos(config: ModelConfig, tokenizer) -> ModelConfig:
    eos = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(special) if special in tokenizer.get_vocab() else None
        if tid is not None:
            eos.add(tid)
    return ModelConfig(**{**asdict(config), "eos_token_ids": tuple(sorted(eos))})
