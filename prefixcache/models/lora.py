"""LoRA adapters as PEFT saves them (adapter_config.json and adapter_model.safetensors), applied per request.

A request that names an adapter computes, for each GEMM the adapter targets, y + s * (x A^T) B^T on its own rows,
where y is the base model's result and s = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA): PEFT's forward.
Our GEMMs stack weights by rows (q, k and v as one qkv; gate and up as one gate_up), so an adapter's parts for one
of them are stacked too: their A's by rows, their B's each in its own rows and columns (zeros elsewhere), which adds
exact zeros. A row's delta depends on that row alone, so batching, chunking and cache hits keep its bits.
"""
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import xxhash
from safetensors.torch import load_file

from prefixcache.models.loader import ModelConfig, projection_shapes
from prefixcache.models.rowwise import Packed

# PEFT's module names, as the stacked GEMM each belongs to and its part there
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class Delta:
    """One GEMM's update: s * (x a^T) b^T, a [rank of every part, k] and b [n, rank of every part]."""
    a: torch.Tensor | Packed  # each as the model's ops hold a weight (their prepare)
    b: torch.Tensor | Packed
    scale: float


@dataclass
class Adapter:
    name: str
    fingerprint: str  # of its files' bytes: the `adapter` field of its requests' cache scope
    deltas: dict[tuple[int, str], Delta]  # by (layer, GEMM)


def event_name(adapters: Iterable[Adapter], fingerprint: str) -> tuple[int, str] | None:
    """The adapter of this fingerprint as vLLM's KV events name it: its place in --lora-modules from 1, its name."""
    return next(((i, a.name) for i, a in enumerate(adapters, 1) if a.fingerprint == fingerprint),
                None) if fingerprint else None


def load(name: str, folder: str, config: ModelConfig, prepare: Callable[[torch.Tensor], torch.Tensor | Packed],
         dtype: torch.dtype) -> Adapter:
    """An adapter's deltas for a model of `config`, each weight made ready by `prepare` (the model's ops). A
    ValueError names what the model or we do not support."""
    where = f"LoRA adapter {name!r} ({folder})"
    missing = [f for f in FILES if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ValueError(f"{where}: {', '.join(missing)} not found (PEFT's files, with safetensors weights)")
    with open(os.path.join(folder, FILES[0])) as f:
        peft = json.load(f)
    _check(peft, where)
    rank = int(peft["r"])
    scale = peft["lora_alpha"] / (rank ** 0.5 if peft.get("use_rslora") else rank)
    parts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    found = _pairs(load_file(os.path.join(folder, FILES[1])), where)
    for (layer, module), (a, b) in found.items():
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"{where}: layer {layer} of {module}, but the model has {config.num_layers} layers")
        gemm, part = TARGETS[module]
        if gemm in ("gate_up", "down") and layer in config.sparse_layers:
            raise ValueError(f"{where}: layer {layer} {module}: the layer's MLP is a mixture of experts, which we do "
                             "not apply LoRA to yet")
        n, k = projection_shapes(config)[module]
        if a.shape != (rank, k) or b.shape != (n, rank):
            raise ValueError(f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"expected ({rank}, {k}) and ({n}, {rank})")
        parts.setdefault((layer, gemm), {})[part] = (a, b)
    deltas = {key: _stacked(config, key[1], by_part, rank, scale, prepare, dtype) for key, by_part in parts.items()}
    digest = xxhash.xxh3_128()
    for f in FILES:
        with open(os.path.join(folder, f), "rb") as fh:
            digest.update(fh.read())
    return Adapter(name, digest.hexdigest(), deltas)


def _check(peft: dict, where: str) -> None:
    unsupported = [(peft.get("peft_type", "LORA") != "LORA", f"peft_type {peft.get('peft_type')!r} (LORA only)"),
                   (bool(peft.get("use_dora")), "DoRA (use_dora)"),
                   (peft.get("bias", "none") != "none", f"trained biases (bias={peft.get('bias')!r})"),
                   (bool(peft.get("modules_to_save")), f"modules_to_save {peft.get('modules_to_save')}"),
                   (bool(peft.get("rank_pattern")) or bool(peft.get("alpha_pattern")),
                    "per-module ranks or alphas (rank_pattern, alpha_pattern)")]
    reasons = [why for bad, why in unsupported if bad]
    if reasons:
        raise ValueError(f"{where}: not supported: {'; '.join(reasons)}")
    if not isinstance(peft.get("r"), int) or peft["r"] < 1 or not isinstance(peft.get("lora_alpha"), (int, float)):
        raise ValueError(f"{where}: adapter_config.json needs an integer r >= 1 and a number lora_alpha")


def _pairs(tensors: dict[str, torch.Tensor], where: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (lora_A, lora_B), from PEFT's names (…layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight,
    with or without the adapter's name before .weight)."""
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, t in tensors.items():
        path = key.replace(".default.weight", ".weight").split(".")
        if len(path) < 5 or path[-1] != "weight" or path[-2] not in ("lora_A", "lora_B") or "layers" not in path:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A or B of a layer's module")
        module, layer = path[-3], path[path.index("layers") + 1]
        if module not in TARGETS or not layer.isdigit():
            raise ValueError(f"{where}: tensor {key!r}: we apply LoRA to {', '.join(TARGETS)} of a layer only")
        found[int(layer), module, path[-2]] = t.float()
    pairs = {}
    for layer, module, which in found:
        if (layer, module, "lora_A") not in found or (layer, module, "lora_B") not in found:
            raise ValueError(f"{where}: layer {layer} {module} has lora_A or lora_B but not both")
        pairs[layer, module] = found[layer, module, "lora_A"], found[layer, module, "lora_B"]
    return pairs


def _stacked(config: ModelConfig, gemm: str, by_part: dict[int, tuple[torch.Tensor, torch.Tensor]], rank: int,
             scale: float, prepare: Callable[[torch.Tensor], torch.Tensor | Packed], dtype: torch.dtype) -> Delta:
    """One stacked GEMM's delta from its parts' (A, B): A's stacked by rows, B's block-diagonal."""
    modules = [m for m, (g, _) in TARGETS.items() if g == gemm]  # in part order
    rows = [projection_shapes(config)[m][0] for m in modules]
    b = torch.zeros(sum(rows), rank * len(by_part))
    a_rows = []
    for col, part in enumerate(sorted(by_part)):
        a, b_part = by_part[part]
        a_rows.append(a)
        first = sum(rows[:part])
        b[first:first + rows[part], col * rank:(col + 1) * rank] = b_part
    return Delta(prepare(torch.cat(a_rows).to(dtype)), prepare(b.to(dtype)), scale)
