"""Engine benchmark: our engine and HF transformers side by side on the same weights, plus cache figures.

Each side runs in its own subprocess (so peak RSS is its own); the parent writes
bench/results/engine.json and bench/results/engine.md. Run: `make bench` or `python -m prefixcache.bench.engine`.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from prefixcache.bench.engine_report import report

PREFILL_LENS = (1024, 4096)
DECODE_CTX, DECODE_TOKENS = 1024, 24
REPEATS = 3
GEMMS = ("qkv", "o", "gate_up", "down")  # per layer; plus the LM head


def _tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def _median(f, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def side_ours(exactness: str = "auto", dtype: str = "float32", kernels: str = "auto",
              quantized_reads: bool = True) -> dict:
    """Our figures; exactness "off" runs the torch path's probed plan without its padding (row counts as they come,
    every attention size and key length): what invariance costs there, never a mode to serve with."""
    t0 = time.perf_counter()
    from prefixcache import LLM, SamplingParams

    cold = LLM(enable_prefix_cache=False, exactness="auto" if exactness == "off" else exactness, dtype=dtype,
               kernels=kernels, quantized_reads=quantized_reads)
    model = cold.engine.runner.model
    if exactness == "off":
        model.exact = _unpadded(model.exact, model.tile)
    r = {"load_s": time.perf_counter() - t0, "exactness": cold.exactness.summary()}
    one = SamplingParams(temperature=0.0, max_tokens=1)
    chunk = cold.engine.config.max_batch_tokens
    for n in PREFILL_LENS:
        ids = _tokens(n, n)
        r[f"prefill_{n}_s"] = _median(lambda: cold.generate([ids], one), 2 if n > 2000 else REPEATS)
        r[f"prefill_{n}_floor_s"] = (n // chunk * _gemm_ms(model, chunk, 0, 2) + _gemm_ms(model, n % chunk, 1)) / 1e3
    for b in (1, 8):
        # the bandwidth just before and just after the steps, the higher: a shared machine's varies by the minute
        r[f"decode_b{b}_bytes"] = _step_bytes(cold, b, DECODE_CTX)
        before = _read_gb_s(r[f"decode_b{b}_bytes"])
        r[f"decode_b{b}_step_ms"] = _decode_step_ms([cold], b)[0]
        r[f"decode_b{b}_read_gb_s"] = max(before, _read_gb_s(r[f"decode_b{b}_bytes"]))
        r[f"decode_b{b}_floor_ms"] = _gemm_ms(model, b, b, 10)
        r[f"decode_b{b}_byte_floor_ms"] = r[f"decode_b{b}_bytes"] / (r[f"decode_b{b}_read_gb_s"] * 1e9) * 1e3
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # one engine, before the cache runs
    if exactness == "auto" and dtype == "float32":
        r.update(_cache_figures(cold))
        if quantized_reads and cold.engine.runner.model.paged:  # decode steps reading fp32 panels alone, in turn
            fp32 = LLM(enable_prefix_cache=False, quantized_reads=False)
            r["shipped_ab"] = {str(b): dict(zip(("shipped", "fp32"), _decode_step_ms([cold, fp32], b)))
                               for b in (1, 2, 4, 8)}
    if dtype == "bfloat16":
        r["greedy_agreement"] = _greedy_agreement(cold)
    return r


def _greedy_agreement(llm, prompts: int = 6, tokens: int = 32) -> dict:
    """Greedy output of `llm` against our fp32 engine (which equals HF transformers fp32) on chats with ~1k-token
    system prompts: how many are identical, and where the others first differ."""
    import random

    from prefixcache import LLM, SamplingParams
    from prefixcache.bench.workloads import question, system_prompt

    rng = random.Random(3)
    chats = [[{"role": "system", "content": system_prompt(rng, 1000)}, question(rng, 24)] for _ in range(prompts)]
    tok = llm.engine.tokenizer
    ids = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
           .input_ids for c in chats]
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(ids, greedy)]
    ref = [o.token_ids for o in LLM(enable_prefix_cache=False).generate(ids, greedy)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, ref)]
    return {"prompts": prompts, "tokens": tokens, "identical": first.count(None),
            "first_difference": [f for f in first if f is not None]}


def _read_gb_s(nbytes: int) -> float:
    """The read bandwidth of this process over a working set of nbytes, read again and again as a step's weights and
    keys are: a sum over nbytes of fp32, the median of 3 after a first (GB/s). Not a fixed 1 GiB: a step's set that
    fits in the last-level cache reads faster (an Intel Xeon of 480 MiB L3, 2026-12-05: 39-44 GB/s over 143 MiB,
    SmolLM2's step at b = 1, against 26-29 over 1 GiB; 26 over 473 MiB, its step at b = 8)."""
    import torch

    x = torch.ones(nbytes // 4)
    x.sum()
    return x.numel() * 4 / 1e9 / _median(x.sum)


def _step_bytes(llm, b: int, ctx: int) -> int:
    """What a decode step of b sequences at context ctx must read: every layer's weights and the LM head, as the
    step reads them (on our kernels as kept: as shipped, or fp32 panels; on torch's as tensors), and each sequence's
    keys and values."""
    model, c = llm.engine.runner.model, llm.engine.runner.model.config
    weights = sum(w.nbytes if model.paged else w.numel() * w.element_size() for w in model.gemm_weights().values())
    kv = b * ctx * c.num_layers * 2 * c.num_kv_heads * c.head_dim * llm.engine.pool.k.dtype.itemsize
    return weights + kv


def _unpadded(plan, tile: int):
    from prefixcache.models.exactness import ATTN_SIZES, KEY_STEP, Exactness

    return Exactness("pad", 1, [1], list(ATTN_SIZES), plan.cpu, "bench: no padding",
                     key_lengths=list(range(KEY_STEP, tile, KEY_STEP)))


def _decode_step_ms(llms: list, b: int) -> list[float]:
    """The median engine step of b sequences decoding at context DECODE_CTX, for each engine; with several, a step
    of each in turn (a shared machine's bandwidth moves by the minute). Only steps in which all b decode count: the
    first sequences prefilled start decoding while the others prefill, so with a fixed output length they would
    finish first and leave steps of fewer (at b = 8, about half of 24 steps were of fewer than 8 before 2026-12-05)."""
    from prefixcache import SamplingParams
    from prefixcache.engine.sequence import Status

    params = SamplingParams(temperature=0.0, max_tokens=DECODE_CTX, ignore_eos=True)
    running = []
    for llm in llms:
        seqs = [llm.engine.add_request(_tokens(DECODE_CTX, 100 + i), params) for i in range(b)]
        while any(s.num_computed < s.num_prompt for s in seqs):
            llm.engine.step()
        running.append(seqs)
    times = [[] for _ in llms]
    for _ in range(DECODE_TOKENS):
        for llm, steps in zip(llms, times):
            t = time.perf_counter()
            llm.engine.step()
            steps.append(time.perf_counter() - t)
    for llm, seqs in zip(llms, running):
        assert all(s.status is Status.RUNNING for s in seqs), "every timed step decodes all b sequences"
        for s in seqs:
            llm.engine.abort(s)
    return [statistics.median(steps) * 1e3 for steps in times]


def _gemm_ms(model, rows: int, head_rows: int, repeats: int = REPEATS) -> float:
    """The GEMM floor: the model's weight GEMMs alone, unpadded, every layer's on `rows` rows and the LM head on
    `head_rows`, in this process (median ms)."""
    import torch

    c = model.config
    calls = [(rows, op.args) for i in range(c.num_layers) for op in model.row_ops(i) if op.name in GEMMS]
    calls += [(head_rows, (model.lm_head,))]
    xs = [torch.randn(m, args[0].shape[1], dtype=model.norm.dtype) for m, args in calls]
    return _median(lambda: [model.ops.linear(x, *args) for x, (m, args) in zip(xs, calls) if m], repeats) * 1e3


def _cache_figures(cold) -> dict:
    """TTFT of a 4096+64 hit vs miss vs the suffix-only floor, and KV bytes per token."""
    from prefixcache import LLM, SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1)
    prefix = _tokens(4096, 7)
    suffixes = [_tokens(64, 1000 + i) for i in range(5)]
    warm = LLM()
    warm.generate([prefix + [5]], one)
    hits = []
    for s in suffixes:
        out = warm.generate([prefix + s], one)[0]
        assert out.cached_tokens == 4096
        hits.append(out.ttft)
    miss = _median(lambda: cold.generate([prefix + suffixes[0]], one), 2)
    floor = _suffix_floor(warm, prefix, [_tokens(64, 2000 + i) for i in range(5)])  # suffixes not cached yet
    hit = statistics.median(hits)
    return {"hit_4096_64_ttft_s": hit, "miss_4096_64_ttft_s": miss, "suffix_floor_64_on_4096_s": floor,
            "hit_over_floor": hit / floor, "miss_over_hit": miss / hit,
            "kv_bytes_per_token": warm.engine.pool.block_bytes // warm.engine.pool.block_size,
            "kv_dtype": warm.engine.config.kv_storage_dtype, "match_lock": _match_lock_times()}


def _suffix_floor(warm, prefix: list[int], suffixes: list[list[int]]) -> float:
    """The one engine step that prefills 64 tokens over the cached prefix: what a hit cannot avoid."""
    from prefixcache import SamplingParams

    times = []
    for s in suffixes:
        seq = warm.engine.add_request(prefix + s, SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        warm.engine.step()
        times.append(time.perf_counter() - t)
        assert seq.finish_reason is not None and seq.cache.num_cached == len(prefix)
    return statistics.median(times)


def _match_lock_times() -> dict:
    """Hash + match + lock for an 8k-token prompt as the cache holds more and more tokens (synthetic KV)."""
    import torch

    from prefixcache.cache.pool import KVPool
    from prefixcache.cache.scope import CacheScope
    from prefixcache.engine.blocks import BlockManager
    from prefixcache.engine.sequence import SamplingParams, Sequence
    from prefixcache.options import default

    bs = default("block_size")
    pool = KVPool(1, 1, 1, bs, budget_bytes=(420_000 // bs + 2) * 2 * bs * 2, dtype=torch.bfloat16)
    manager = BlockManager(pool, True, 0, None, [])
    scope = CacheScope(tenant="bench", fingerprint="x")
    prompt = _tokens(8192, 99)
    out, cached, i = {}, 0, 0
    for target in (50_000, 100_000, 200_000, 400_000):
        while cached < target:
            seq = Sequence(prompt if i == 0 else _tokens(8192, 10_000 + i), SamplingParams(), scope)
            manager.prepare(seq)
            manager.admit(seq)
            seq.num_computed = len(seq.tokens)
            manager.release(seq, finished=False)
            cached, i = manager.cache.num_blocks * bs, i + 1
        times = []
        for _ in range(20):
            seq = Sequence(prompt, SamplingParams(), scope)
            t = time.perf_counter()
            manager.prepare(seq)
            manager.admit(seq)
            times.append(time.perf_counter() - t)
            assert seq.cache.num_cached == 8191
            manager.release(seq, finished=False)
        out[str(cached)] = statistics.median(times) * 1000
    return {"cached_tokens_to_ms": out}


def side_hf() -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from prefixcache.models.catalog import default_model_path
    from prefixcache.models.loader import converted_folder

    folder = converted_folder(default_model_path())
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    r = {"load_s": time.perf_counter() - t0}
    with torch.inference_mode():
        for n in PREFILL_LENS:
            ids = torch.tensor([_tokens(n, n)])
            r[f"prefill_{n}_s"] = _median(lambda: model(ids, logits_to_keep=1), 2 if n > 2000 else REPEATS)
        for b in (1, 8):
            ids = torch.tensor([_tokens(DECODE_CTX, 100 + i) for i in range(b)])
            kw = dict(do_sample=False, pad_token_id=0, min_new_tokens=DECODE_TOKENS + 1)
            prefill = _median(lambda: model.generate(ids, max_new_tokens=1, **{**kw, "min_new_tokens": 1}), 1)
            total = _median(lambda: model.generate(ids, max_new_tokens=DECODE_TOKENS + 1, **kw), 2)
            r[f"decode_b{b}_step_ms"] = (total - prefill) / DECODE_TOKENS * 1e3
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return r


def _run_side(name: str, exactness: str = "auto", dtype: str = "float32", kernels: str = "auto",
              quantized_reads: bool = True) -> dict:
    out = subprocess.run([sys.executable, "-m", "prefixcache.bench.engine", "--side", name, "--exactness", exactness,
                          "--dtype", dtype, "--kernels", kernels,
                          "--quantized-reads" if quantized_reads else "--no-quantized-reads"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["ours", "hf"])
    ap.add_argument("--exactness", default="auto", help="ours: the exactness mode (Config.exactness), or off")
    ap.add_argument("--dtype", default="float32", help="ours: the weights' dtype (Config.dtype)")
    ap.add_argument("--kernels", default="auto", help="ours: the kernel build (Config.kernels)")
    ap.add_argument("--quantized-reads", action=argparse.BooleanOptionalAction, default=True,
                    help="ours: read a GGUF's weights as shipped in decode (Config.quantized_reads)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side_ours(args.exactness, args.dtype, args.kernels, args.quantized_reads)
                         if args.side == "ours" else side_hf()))
        return
    from prefixcache.models.cpu import cpu_info

    cpu = cpu_info()
    sides = {"prefixcache": _run_side("ours"), "fp32 panels only": _run_side("ours", quantized_reads=False),
             "torch path": _run_side("ours", kernels="off"),
             "padding off": _run_side("ours", "off", kernels="off"), "fixed fallback": _run_side("ours", "fixed")}
    if cpu.has_bf16:
        sides["bf16 weights"] = _run_side("ours", dtype="bfloat16")
    hf = _run_side("hf")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine.json"), "w") as f:
        json.dump({"cpu": str(cpu), **sides, "hf_transformers": hf}, f, indent=1)
    md = report(sides, hf, str(cpu), DECODE_CTX)
    with open(os.path.join(args.out, "engine.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
