"""A GGUF file read as it ships: its metadata as an HF config, each tensor by its HF name (quantized ones as the
blocks the file stores, for our kernels to read; F32 ones as tensors), and its tokenizer. Nothing is converted;
what takes seconds to read (the metadata, the tokenizer) is kept once in the user cache, under the file's digest."""
import json
import mmap
import os
import shutil
from typing import Callable

import numpy as np
import torch
import xxhash

from prefixcache.files import cache_home
from prefixcache.models.families import Family, by_gguf_arch
from prefixcache.models.quant import KINDS, Blocks

NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # stacked: [experts,
# rows, k], each expert's slice HF's mlp.experts.{e}.{name}
BARE = {"attn_sinks"}  # tensors whose HF name has no .weight
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.x's RoPE scaling, as llama.cpp's converter writes it


def read(path: str) -> tuple[dict, dict[str, torch.Tensor | Blocks], object, str, Callable[[], None]]:
    """(HF config, tensors by HF name, tokenizer, the file's digest, release). Weights as shipped are views of the
    file mapped copy-on-write (never written), not copies: laying them out for the kernels is the one copy, and
    release() drops the pages read so far from the process's memory (a later read maps them again), so loading peaks
    near the laid-out size rather than twice the file's."""
    digest = file_digest(path)
    fields, table = _index(path, digest)
    family = by_gguf_arch(fields.get("general.architecture"))
    tokenizer = read_tokenizer(path, digest)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors = dict(_tensors(np.frombuffer(mapped, dtype=np.uint8), table, fields, family))
    return (_hf_config(fields, family, tensors, tokenizer), tensors, tokenizer, digest,
            lambda: mapped.madvise(mmap.MADV_DONTNEED))


def file_digest(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _hf_config(fields: dict, family: Family, tensors: dict, tokenizer) -> dict:
    arch = family.gguf_arch
    hidden, heads = fields[f"{arch}.embedding_length"], fields[f"{arch}.attention.head_count"]
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported yet; supported: linear, yarn, and Llama "
                         f"3.x's factors ({ROPE_FACTORS})")
    rope = {"rope_type": "default", "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0))}
    if scaling != "none":
        rope.update(rope_type=scaling, factor=float(fields[f"{arch}.rope.scaling.factor"]))
    if scaling == "yarn":  # llama.cpp's defaults of the bounds, as transformers'
        rope.update(original_max_position_embeddings=fields[f"{arch}.rope.scaling.original_context_length"],
                    beta_fast=float(fields.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(fields.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                    truncate=family.gguf_yarn_truncate)
    layers, window = fields[f"{arch}.block_count"], fields.get(f"{arch}.attention.sliding_window", 0)
    windows = {}
    if window and family.gguf_window_pattern:
        every = family.gguf_window_pattern
        windows = {"sliding_window": window, "layer_types": [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]}
        if family.gguf_local_theta:
            rope = {"full_attention": rope,
                    "sliding_attention": {"rope_type": "default", "rope_theta": family.gguf_local_theta}}
    elif window:
        windows = {"sliding_window": window}
    moe = {}
    if family.moe:  # llama.cpp's files say which layers are sparse by the routers they hold
        sparse = {int(n.split(".")[2]) for n in tensors if n.endswith(".mlp.gate.weight")}
        moe = {"num_experts": fields[f"{arch}.expert_count"],
               "num_experts_per_tok": fields[f"{arch}.expert_used_count"],
               "moe_intermediate_size": fields[f"{arch}.expert_feed_forward_length"],
               "norm_topk_prob": bool(fields.get(f"{arch}.expert_weights_norm", family.gguf_norm_topk)),
               "mlp_only_layers": [i for i in range(layers) if i not in sparse]}
    embed = tensors["model.embed_tokens.weight"]
    return {**windows, **moe,
        "model_type": family.hf_type, "architectures": [family.hf_class], "vocab_size": embed.shape[0],
        "hidden_size": hidden, "intermediate_size": fields[f"{arch}.feed_forward_length"],
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": fields.get(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": fields.get(f"{arch}.attention.key_length", hidden // heads), "rope_parameters": rope,
        "rms_norm_eps": float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": fields[f"{arch}.context_length"],
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "torch_dtype": "float32",
    }


def _index(path: str, digest: str) -> tuple[dict, list[dict]]:
    """The file's metadata but its tokenizer's, and where each tensor lies: the gguf package reads them (seconds,
    most of them on the tokenizer's arrays) once per file; they are kept in the user cache under its digest."""
    index = os.path.join(cache_home(), "gguf", f"{os.path.basename(path).removesuffix('.gguf')}-{digest}.json")
    if os.path.exists(index):
        with open(index) as f:
            kept = json.load(f)
        return kept["fields"], kept["tensors"]
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on a bad or truncated file
        raise ValueError(f"corrupt or unreadable GGUF file {path}: {e}") from e
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    table = [{"name": t.name, "kind": t.tensor_type.name, "dtype": str(t.data.dtype), "shape": list(t.data.shape),
              "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors]
    os.makedirs(os.path.dirname(index), exist_ok=True)
    with open(f"{index}.tmp{os.getpid()}", "w") as f:
        json.dump({"fields": fields, "tensors": table}, f)
    os.replace(f"{index}.tmp{os.getpid()}", index)
    return fields, table


def _tensors(file: np.ndarray, table: list[dict], fields: dict, family: Family):
    """(HF name, tensor or Blocks) for each tensor, rows in HF order; the RoPE factors under their GGUF name."""
    arch = family.gguf_arch
    heads = fields[f"{arch}.attention.head_count"]
    kv_heads = fields.get(f"{arch}.attention.head_count_kv") or heads
    names = {**NAMES, **family.gguf_names}
    for t in table:
        name, kind, parts = t["name"], t["kind"], t["name"].split(".")
        raw = file[t["offset"]:t["offset"] + t["bytes"]]
        if len(raw) != t["bytes"]:
            raise ValueError(f"GGUF tensor {name!r} is cut short: the file is truncated")
        values = raw.view(t["dtype"]).reshape(t["shape"])
        if name == ROPE_FACTORS:
            yield name, torch.from_numpy(np.array(values, dtype=np.float32))
            continue
        stacked = parts[0] == "blk" and parts[2] in EXPERTS
        if stacked:
            experts = fields.get(f"{arch}.expert_count")
            if values.shape[0] != experts:
                raise ValueError(f"GGUF tensor {name!r} holds {values.shape[0]} experts, but {arch}.expert_count says "
                                 f"{experts}")
        elif parts[0] == "blk" and parts[2] in names:
            name = f"model.layers.{parts[1]}.{names[parts[2]]}" + ("" if parts[2] in BARE else f".{parts[3]}")
        elif parts[0] in NAMES and len(parts) == 2:
            name = f"{NAMES[parts[0]]}.{parts[1]}"
        else:
            raise ValueError(f"GGUF tensor {name!r} ({family.name}) is not one we know how to use")
        if kind == "F32":
            data = np.array(values, dtype=np.float32)
            if family.norm_offset and name.endswith("norm.weight"):
                data -= 1  # llama.cpp stores Gemma's 1 + w; HF's w (transformers reads such a GGUF so too)
        elif kind in KINDS:
            data = values  # [rows, bytes of a row's blocks] (float16 values, for F16): the file's bytes
        else:
            raise ValueError(f"GGUF tensor {t['name']!r} is of type {kind}, which we cannot read yet; supported: "
                             f"F32, {', '.join(KINDS)}")
        if family.gguf_permuted_qk and parts[-2] in ("attn_q", "attn_k"):
            data = _unpermute(data, heads if parts[-2] == "attn_q" else kv_heads)
        data = torch.from_numpy(np.ascontiguousarray(data))
        if stacked:  # each expert's slice a view of the file
            for e, one in enumerate(data):
                yield f"model.layers.{parts[1]}.mlp.experts.{e}.{EXPERTS[parts[2]]}.{parts[3]}", \
                    one if kind == "F32" else Blocks(kind, one)
            continue
        yield name, data if kind == "F32" else Blocks(kind, data)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def read_tokenizer(path: str, digest: str = ""):
    """The file's tokenizer, converted once by transformers and kept in the user cache under the file's digest; with
    its family's chat template where the file has none."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    digest = digest or file_digest(path)
    folder = os.path.join(cache_home(), "tokenizers", f"{os.path.basename(path).removesuffix('.gguf')}-{digest}")
    if os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        return _kept_tokenizer(folder)
    family = by_gguf_arch(_index(path, digest)[0]["general.architecture"])
    reader = AutoTokenizer if family.gguf_auto_tokenizer else PreTrainedTokenizerFast
    tokenizer = reader.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    if not tokenizer.chat_template:
        tokenizer.chat_template = family.chat_template or None
    tmp = f"{folder}.tmp{os.getpid()}"
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process kept it first
        shutil.rmtree(tmp)
    return _kept_tokenizer(folder)


def _kept_tokenizer(folder: str):
    """The tokenizer save_pretrained kept in `folder`: its tokenizer.json read by the tokenizers library, not rebuilt
    from its vocabulary by the model's tokenizer class in Python (for Gemma's 262k tokens, 4.8 s to 1.5 s)."""
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    template = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(template):
        with open(template) as f:
            config["chat_template"] = f.read()
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), **config)
