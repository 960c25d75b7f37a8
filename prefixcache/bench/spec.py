"""Speculative-decoding benchmark: decode speed with speculation off / prompt / answers / both on workloads where
answers copy (code-edit, rag-quote), repeat (agent-steps) or do neither (open-ended), one request at a time,
side by side in one process, the modes taking turns. Checks that every greedy output equals speculation off's. Writes
bench/results/spec.{json,md,png}. Run: `make bench` or `python -m prefixcache.bench.spec`."""
import argparse
import inspect
import json
import os
import random
import time

from prefixcache import LLM, SamplingParams
from prefixcache.bench.workloads import system_prompt, text
from prefixcache.cache.scope import CacheScope
from prefixcache.engine import scheduler
from prefixcache.models.exactness import cpu_info

MODES = ("off", "prompt", "answers", "both")
REPEATS = 2
CITIES = ("Paris", "Lagos", "Lima", "Oslo", "Pune", "Quito", "Riga", "Seoul")


def workloads() -> dict[str, list[list[dict]]]:
    """Each workload: the chats of one tenant, run in order."""
    rng = random.Random(11)
    code = inspect.getsource(scheduler)
    doc = system_prompt(rng, 700)
    return {
        "code-edit": [[{"role": "user", "content": "Rewrite this Python file with the class Scheduler renamed to "
                        f"BatchScheduler. Output the whole file.\n\n```python\n{code}```"}]],
        "rag-quote": [[{"role": "system", "content": doc},
                       {"role": "user", "content": "Quote the first three sentences of the text above word for word."}]],
        "agent-steps": [[{"role": "system", "content": "You call tools. Reply with one JSON object only."},
                         *_shot("Rome"), *_shot("Cairo"),
                         {"role": "user", "content": f"What is the weather in {city}?"}] for city in CITIES],
        "open-ended": [[{"role": "user", "content": f"Write a short story about {text(rng, 12)}."}]],
    }


def _shot(city: str) -> list[dict]:
    call = {"tool": "get_weather", "arguments": {"city": city, "unit": "celsius", "days": 1}}
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": json.dumps(call)}]


def run(llm: LLM, chats: list[list[dict]], max_tokens: int) -> dict:
    """Decode figures over the chats, run one at a time in one scope: tokens, seconds and engine steps after
    each request's first token, and the outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    scope = CacheScope(tenant="bench")
    tokens = steps = 0
    seconds, outputs = 0.0, []
    for chat in chats:
        seq = llm.engine.add_request(llm.encode_chat(chat), params, scope)
        while not seq.output_ids:
            llm.engine.step()
        t, n = time.perf_counter(), len(seq.output_ids)
        while seq.finish_reason is None:
            llm.engine.step()
            steps += 1
        seconds += time.perf_counter() - t
        tokens += len(seq.output_ids) - n
        outputs.append(seq.output_ids)
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "tok_s": tokens / seconds,
            "tokens_per_step": tokens / max(steps, 1), "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    loads, results = workloads(), {}
    engines = {mode: LLM(enable_prefix_cache=False, speculative=mode) for mode in MODES}
    for name, chats in loads.items():
        for rep in range(REPEATS):  # the modes take turns, in a rotated order: the best time of each counts
            for mode in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]:
                engines[mode].engine.drafter.tables.clear()  # each repeat starts from the same answers
                r = run(engines[mode], chats, args.max_tokens)
                best = results.setdefault((name, mode), r)
                if r["seconds"] < best["seconds"]:
                    results[(name, mode)] = r
    cpu = cpu_info()
    rows, table = [], {}
    for name in loads:
        off = results[(name, "off")]
        for mode in MODES:
            r = results[(name, mode)]
            assert r["outputs"] == off["outputs"], f"{name}: greedy output with speculation {mode} differs from off"
            speedup = r["tok_s"] / off["tok_s"]
            table[f"{name}/{mode}"] = {k: v for k, v in r.items() if k != "outputs"} | {
                "speedup": speedup, "efficiency": speedup / r["tokens_per_step"]}
            rows.append(f"| {name} | {mode} | {r['tokens']} | {r['tok_s']:.1f} | {speedup:.2f}x | "
                        f"{r['tokens_per_step']:.2f} | {speedup / r['tokens_per_step']:.2f} |")
    md = "\n".join([
        "# Speculative decoding", "", f"{cpu.model} ({' '.join(cpu.simd)}), {cpu.threads} threads; "
        f"SmolLM2-135M-Instruct fp32, greedy, one request at a time, up to {args.max_tokens} tokens each, best of "
        f"{REPEATS} turns. Speedup: "
        "decode tok/s against speculation off. Tokens per step: output tokens per engine step (accepted drafts + 1 "
        "when drafting). Efficiency: speedup / tokens per step. Every output equals speculation off's (checked).",
        "", "| workload | speculation | tokens | tok/s | speedup | tokens per step | efficiency |",
        "|---|---|---|---|---|---|---|", *rows, ""])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spec.json"), "w") as f:
        json.dump({"cpu": str(cpu), **table}, f, indent=1)
    with open(os.path.join(args.out, "spec.md"), "w") as f:
        f.write(md)
    _plot(table, list(loads), os.path.join(args.out, "spec.png"))
    print(md)


def _plot(table: dict, names: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        ax.bar([j + i * width for j in range(len(names))], [table[f"{n}/{mode}"]["tok_s"] for n in names], width,
               label=mode)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("decode tok/s (b = 1)")
    ax.legend(title="speculation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
