"""GGUF files written the way llama.cpp's converter writes them, from an HF folder: its metadata, q and k with each
head's rotary pairs interleaved (Llama), each weight quantized by the gguf package to a type of our choosing, and
the default model's tokenizer. For tests of the loader and the kernels on files as they ship."""
import functools
import json
import math
import os
import struct

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from prefixcache.models.catalog import default_model_path

# llama.cpp's names, written here apart from models/gguf_file.py's map: a wrong entry there fails the tests rather
# than agreeing with itself
GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",  # each expert's weights stacked [experts, rows, k]
}


GPT_OSS_NAMES = {"post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks"}  # and its
# experts split as _split_experts does
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}  # Gemma 3's sandwich norms, as llama.cpp names them


LEVEL_KINDS = {"IQ4_NL": 1e-3, "IQ4_XS": 1e-4}  # kinds gguf cannot quantize: their scales' spread (IQ4_XS's own
# 6-bit scales multiply by up to 32)


def write_gguf(folder: str, path: str, kind_of, rope_factors: bool = False, arch: str = "") -> str:
    """A GGUF of the HF model in `folder`; `kind_of(gguf name)` gives each 2-D weight's type ("F32" for none; a type
    the gguf package cannot quantize gets random blocks). With `rope_factors`, a Llama 3.x config's RoPE scaling is
    written as llama.cpp does: a rope_freqs tensor. `arch` names another architecture than the model's."""
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    arch = arch or {"mistral": "llama", "gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}.get(
        hf["model_type"], hf["model_type"])
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0)}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers' (its local layers' base is llama.cpp's own)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes gpt-oss's: no bounds, no truncate
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if hf.get("use_sliding_window", True) and hf.get("sliding_window"):
        w.add_sliding_window(hf["sliding_window"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if experts := hf.get("num_experts") or hf.get("num_local_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(hf["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    _copy_tokenizer(w)
    for name, t in _stacked(_split_experts(load_file(os.path.join(folder, "model.safetensors")))).items():
        g = _gguf_name(name, hf["model_type"])
        data = t.float().numpy()
        if _offset_norm(g, hf["model_type"]):  # llama.cpp's converter stores Gemma's norms as 1 + w
            data = data + 1
        if arch == "llama" and g.split(".")[-2] in ("attn_q", "attn_k"):
            data = _permute(data, heads if "attn_q" in g else kv_heads)
        kind = kind_of(g) if data.ndim >= 2 and g.endswith(".weight") else "F32"
        if kind == "F32":
            w.add_tensor(g, data)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            try:
                blocks = gguf.quants.quantize(data, qtype)
            except NotImplementedError:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                rng = np.random.default_rng(0)
                blocks = rng.integers(0, 256, (*data.shape[:-1], data.shape[-1] // block, size), dtype=np.uint8)
                if kind in LEVEL_KINDS:  # a block's fp16 scale first: small, so the weights are of a model's size
                    d = rng.normal(0, LEVEL_KINDS[kind], blocks.shape[:-1]).astype(np.float16)
                    blocks[..., :2] = d.view(np.uint8).reshape(*blocks.shape[:-1], 2)
                blocks = blocks.reshape(*data.shape[:-1], -1)
            w.add_tensor(g, blocks, raw_dtype=qtype)
    if rope_factors:
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_folder(gguf_path: str, hf_folder: str, out: str) -> str:
    """`hf_folder` with its weights replaced by the GGUF's, dequantized by the gguf package (the reference)."""
    os.makedirs(out)
    for f in os.listdir(hf_folder):
        if not f.endswith(".safetensors"):
            os.link(os.path.join(hf_folder, f), os.path.join(out, f))
    reader = gguf.GGUFReader(gguf_path)
    with open(os.path.join(hf_folder, "config.json")) as f:
        hf = json.load(f)
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    names = {_gguf_name(n, hf["model_type"]): n
             for n in _stacked(_split_experts(load_file(os.path.join(hf_folder, "model.safetensors"))))}
    tensors = {}
    for t in reader.tensors:
        if t.name in names:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            if _offset_norm(t.name, hf["model_type"]):
                data = data - 1  # exact: the stored 1 + w lies in [0.5, 2]
            if hf["model_type"] in ("llama", "mistral") and t.name.split(".")[-2] in ("attn_q", "attn_k"):
                data = _unpermute(data, heads if "attn_q" in t.name else kv_heads)
            data = torch.from_numpy(np.ascontiguousarray(data))
            if hf["model_type"] == "gpt_oss":  # fused again below
                tensors[names[t.name]] = data
            elif ".experts." in names[t.name]:  # back to HF's tensor per expert
                tensors.update({names[t.name].replace(".experts.", f".experts.{e}."): one.contiguous()
                                for e, one in enumerate(data)})
            else:
                tensors[names[t.name]] = data
    save_file(_fused_experts(tensors) if hf["model_type"] == "gpt_oss" else tensors,
              os.path.join(out, "model.safetensors"))
    return out


def _split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's tensors as llama.cpp's converter splits them (GptOssModel.modify_tensors): each layer's router as
    mlp.gate, its experts' gate_up_proj [experts, hidden, 2 size] (gate at even columns, up at odd) transposed into
    stacked gate and up projections [experts, size, hidden], down_proj transposed, the biases split likewise; any
    other model's as they are."""
    out = {}
    for name, t in tensors.items():
        if ".mlp.router." in name:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = t
        elif name.endswith("gate_up_proj") or name.endswith("gate_up_proj_bias"):
            t, suffix = (t.transpose(1, 2), "weight") if name.endswith("proj") else (t, "bias")
            base = name.rsplit(".", 1)[0]
            out[f"{base}.gate_proj.{suffix}"], out[f"{base}.up_proj.{suffix}"] = t[:, ::2], t[:, 1::2]
        elif name.endswith("down_proj"):
            out[name + ".weight"] = t.transpose(1, 2)
        elif name.endswith("down_proj_bias"):
            out[name.removesuffix("_bias") + ".bias"] = t
        else:
            out[name] = t
    return out


def _fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """_split_experts' inverse: gpt-oss's tensors as HF names and lays them out."""
    out = {}
    for name, t in tensors.items():
        if ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".mlp.router.")] = t
        elif ".experts.gate_proj." in name:
            up = tensors[name.replace("gate_proj", "up_proj")]
            fused = torch.stack([t, up], dim=2).flatten(1, 2)  # gate, up interleaved by rows
            base = name.split(".experts.")[0] + ".experts.gate_up_proj"
            out.update({base: fused.transpose(1, 2).contiguous()} if name.endswith("weight")
                       else {base + "_bias": fused})
        elif ".experts.down_proj." in name:
            base = name.split(".experts.")[0] + ".experts.down_proj"
            out.update({base: t.transpose(1, 2).contiguous()} if name.endswith("weight") else {base + "_bias": t})
        elif ".experts.up_proj." not in name:
            out[name] = t
    return out


def _stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's tensors with each layer's experts' weights stacked, as llama.cpp's converter writes them: the experts'
    mlp.experts.{e}.down_proj.weight as one mlp.experts.down_proj.weight [experts, rows, k]."""
    out, experts = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            experts.setdefault(".".join(parts[:at + 1] + parts[at + 2:]), {})[int(parts[at + 1])] = t
        else:
            out[name] = t
    return out | {name: torch.stack([by[e] for e in range(len(by))]) for name, by in experts.items()}


def _gguf_name(hf_name: str, model_type: str) -> str:
    names = {**GGUF_NAMES, **{"gemma3_text": GEMMA_NAMES, "gpt_oss": GPT_OSS_NAMES}.get(model_type, {})}
    if hf_name.endswith(".sinks"):  # a bare parameter, a .weight in the file
        hf_name += ".weight"
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{names[rest]}.{suffix}"
    return f"{names[base]}.{suffix}"


def _offset_norm(gguf_name: str, model_type: str) -> bool:
    return model_type == "gemma3_text" and gguf_name.endswith("norm.weight")


def _copy_tokenizer(w: gguf.GGUFWriter) -> None:
    for key, value, vtype, sub in _tokenizer_fields():
        w.add_key_value(key, value, vtype, sub)


@functools.cache
def _tokenizer_fields() -> list[tuple]:
    """The default model's tokenizer fields (the gguf package takes seconds to read them)."""
    reader = gguf.GGUFReader(default_model_path())
    return [(key, field.contents(), field.types[0], field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY
             else None) for key, field in reader.fields.items() if key.startswith("tokenizer.")]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.x: for each frequency, what divides it."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)



def without_tokenizer(path: str, out: str) -> str:
    """The GGUF at `path` with its tokenizer's fields left out and the vocabulary's size said instead, every other
    byte as it was: for a reader given token ids (HF's parses Gemma 3's 262k tokens for half a minute, twice)."""
    with open(path, "rb") as f:
        data = f.read()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data)
    assert magic == b"GGUF" and version == 3, (magic, version)
    pos, kept, arch, vocab, alignment = 24, [], "", 0, 32
    for _ in range(n_kv):
        start = pos
        key, pos = _gguf_string(data, pos)
        vtype, value = struct.unpack_from("<I", data, pos)[0], pos + 4
        pos = _gguf_skip(data, value, vtype)
        if key == "general.architecture":
            arch = _gguf_string(data, value)[0]
        elif key == "general.alignment":
            alignment = struct.unpack_from("<I", data, value)[0]
        elif key == "tokenizer.ggml.tokens":
            vocab = struct.unpack_from("<Q", data, value + 4)[0]
        if not key.startswith("tokenizer."):
            kept.append(data[start:pos])
    infos = pos
    for _ in range(n_tensors):  # a name, its dimensions' count and each, its type, its offset
        _, pos = _gguf_string(data, pos)
        pos += 4 + 8 * struct.unpack_from("<I", data, pos)[0] + 4 + 8
    body = -pos % alignment + pos  # the tensors' data, aligned
    key = f"{arch}.vocab_size".encode()
    kept.append(struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, vocab))
    header = struct.pack("<4sIQQ", magic, version, n_tensors, len(kept)) + b"".join(kept) + data[infos:pos]
    with open(out, "wb") as f:
        f.write(header + bytes(-len(header) % alignment))
        f.write(memoryview(data)[body:])
    return out


def _gguf_string(data: bytes, pos: int) -> tuple[str, int]:
    n = struct.unpack_from("<Q", data, pos)[0]
    return data[pos + 8:pos + 8 + n].decode(), pos + 8 + n


SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF's value types but 8, 9


def _gguf_skip(data: bytes, pos: int, vtype: int) -> int:
    """Where the value of type `vtype` at `pos` ends."""
    if vtype == 8:  # a string
        return _gguf_string(data, pos)[1]
    if vtype != 9:
        return pos + SCALAR_BYTES[vtype]
    item, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item != 8:
        return pos + count * SCALAR_BYTES[item]
    for _ in range(count):
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
    return pos
