#!/usr/bin/env bash
# Start one peer as an OpenAI-compatible server on loopback, with its prefix cache on, then give its URL to
# `prefixcache bench compare --target NAME=http://127.0.0.1:PORT`.
# Usage: peers/serve.sh vllm|vllm-ngram|llamacpp [PORT]
set -euo pipefail
cd "$(dirname "$0")"
PORT=${2:-8100}
case "$1" in
  vllm)
    # --enforce-eager: a 40-55 s start instead of ~150 s; the bind uses both cores (the default uses one)
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 exec .venv-vllm/bin/python \
      -m vllm.entrypoints.openai.api_server --model model-hf --served-model-name smollm2 --dtype float32 \
      --host 127.0.0.1 --port "$PORT" --enforce-eager --enable-prefix-caching --enable-prompt-tokens-details \
      --enable-auto-tool-choice --tool-call-parser hermes ;;
  vllm-ngram)
    # vLLM's prompt-lookup speculation (n-grams of 2-4 tokens, 8 draft tokens), for the speculative workloads
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 exec .venv-vllm/bin/python \
      -m vllm.entrypoints.openai.api_server --model model-hf --served-model-name smollm2 --dtype float32 \
      --host 127.0.0.1 --port "$PORT" --enforce-eager --enable-prefix-caching --enable-prompt-tokens-details \
      --speculative-config '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}' ;;
  llamacpp)
    GGUF=$(../.venv/bin/python -c 'from prefixcache.models.catalog import default_model_path; print(default_model_path())')
    exec .venv-llamacpp/bin/python -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$PORT" \
      --n_ctx 8192 --n_threads 2 --cache true --cache_type ram ;;
  *) echo "usage: $0 vllm|vllm-ngram|llamacpp [PORT]" >&2; exit 2 ;;
esac
