"""PEFT-format LoRA adapters with random weights for a model folder of tests/family_models.py, for the LoRA tests."""
import json
import os

import torch
from safetensors.torch import save_file

RANK, ALPHA = 4, 8.0
MLP = ("gate_proj", "up_proj", "down_proj")


def write_adapter(folder: str, base: str, modules: list[str], seed: int, **config) -> str:
    """A PEFT adapter folder: random A and B (PEFT starts B at zero; a trained one is not) for `modules` of every
    layer, named as PEFT names them."""
    hf = json.load(open(os.path.join(base, "config.json")))
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    q, kv, h, i = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim, hf["hidden_size"], \
        hf["intermediate_size"]
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf["num_hidden_layers"]):
        for m in modules:
            n, k = shapes[m]
            where = f"base_model.model.model.layers.{layer}.{'mlp' if m in MLP else 'self_attn'}"
            tensors[f"{where}.{m}.lora_A.weight"] = torch.randn(RANK, k, generator=gen) / k ** 0.5
            tensors[f"{where}.{m}.lora_B.weight"] = torch.randn(n, RANK, generator=gen) * 0.05
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": modules, "bias": "none",
                   "base_model_name_or_path": base, **config}, f)
    return folder
