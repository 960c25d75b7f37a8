"""The 1B-class model of the models benchmark (issue 34): shaped as Llama 3.2 1B (16 layers, hidden 2048, 32 heads of
64, 8 KV heads, MLP 8192, llama3 RoPE scaling, a tied embedding) with random weights, made into a Q4_K_M GGUF by
llama.cpp's own tools, as people make theirs: HF transformers builds and saves it, `convert_hf_to_gguf.py` writes
an F16 GGUF, `llama-quantize` makes it Q4_K_M (mixed Q4_K and Q6_K). Its tokenizer is the default model's (49,152
tokens: Llama 3's 128k cannot be downloaded here), so its embedding holds 0.1 B parameters where Llama 3.2's holds
0.26 B. Needs `bash peers/setup.sh llamacpp_server`. `python -m prefixcache.bench.models` makes it once (about
2 minutes) and keeps it in the user cache; `python -m prefixcache.bench.llama1b` makes it and prints its path.
"""
import glob
import os
import subprocess
import sys
import tempfile

import torch

from prefixcache.files import cache_home
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import tokenizer

LLAMA_CPP = "peers/llama.cpp-src/*/llama.cpp"
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
             rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})


def make(out: str, llama_cpp: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as work:
        hf = os.path.join(work, "hf")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer(default_model_path())), **SHAPE))
        model.half().save_pretrained(hf)
        del model
        tokenizer(default_model_path()).save_pretrained(hf)
        f16 = os.path.join(work, "f16.gguf")
        env = {**os.environ, "PYTHONPATH": os.path.join(llama_cpp, "gguf-py")}  # the converter's own gguf
        subprocess.run([sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), hf, "--outtype", "f16",
                        "--outfile", f16], check=True, env=env)
        subprocess.run([os.path.join(llama_cpp, "build", "bin", "llama-quantize"), f16, out, "Q4_K_M"], check=True)
    return out


def path() -> str:
    """The model's GGUF, made first if it is not in the user cache."""
    out = os.path.join(cache_home(), "models", "llama-3.2-1b-shaped-random-q4_k_m.gguf")
    if not os.path.exists(out):
        found = sorted(glob.glob(LLAMA_CPP))
        assert found, "no llama.cpp sources: run `bash peers/setup.sh llamacpp_server`"
        os.makedirs(os.path.dirname(out), exist_ok=True)
        make(out, found[-1])
    return out


if __name__ == "__main__":
    print(path())
