"""The engine benchmark's Markdown report (bench/results/engine.md), from its sides' figures."""


def report(sides: dict[str, dict], hf: dict, cpu: str, decode_ctx: int) -> str:
    """sides: our variants by column name, "prefixcache" first; prefill with its ratio to that side's own GEMM
    floor, decode with its ratio to the byte floor."""
    ours = sides["prefixcache"]
    lines = ["# Engine benchmark", "", f"SmolLM2-135M-Instruct on {cpu}; prefixcache runs "
             f"{ours['exactness']['kernels'] or 'the torch path'}. Decode steps at context {decode_ctx}, followed by "
             "their ratio to the byte floor: the bytes a step must read (every layer's weights and the LM head, "
             "as that side reads them, and the keys and values it attends to) over the read bandwidth of a working "
             "set of those bytes, read again and again as a step's are (one that fits in the last-level cache reads "
             "faster than DRAM), measured in the same process just before and after those steps (the higher). "
             "Prefill, by its ratio to the GEMM floor: the model's weight GEMMs alone, unpadded, in chunks of 512 "
             "rows, on that side's own GEMM. "
             "prefixcache reads the GGUF's Q4_1/Q8_0 blocks as shipped in calls of few rows (the fp32 weights' "
             "bits: models/quant.py); fp32 panels only: the same kernels reading fp32 weights alone. "
             "Torch path: our kernels off. "
             "Padding off: the torch path's probed plan without its padding (not exact; what exactness costs "
             "there; on our kernels nothing is padded). Fixed fallback: the torch path's guaranteed plan, forced.",
             "",
             "| figure | " + " | ".join(sides) + " | HF transformers fp32 | HF / prefixcache |",
             "|---|" + "---|" * (len(sides) + 2)]
    for label, key, floor in [("prefill 1k (s)", "prefill_1024_s", "prefill_1024_floor_s"),
                              ("prefill 4k (s)", "prefill_4096_s", "prefill_4096_floor_s"),
                              ("decode step b=1 (ms)", "decode_b1_step_ms", "decode_b1_byte_floor_ms"),
                              ("decode step b=8 (ms)", "decode_b8_step_ms", "decode_b8_byte_floor_ms")]:
        cells = [f"{r[key]:.3g} ({r[key] / r[floor]:.2f}x)" for r in sides.values()]
        lines.append(f"| {label} | {' | '.join(cells)} | {hf[key]:.3g} | {hf[key] / ours[key]:.2f}x |")
    for label, key in (("byte floor, decode b=1 (ms)", "decode_b1_byte_floor_ms"),
                       ("byte floor, decode b=8 (ms)", "decode_b8_byte_floor_ms"),
                       ("GEMM floor, decode b=1 (ms)", "decode_b1_floor_ms"),
                       ("GEMM floor, decode b=8 (ms)", "decode_b8_floor_ms"),
                       ("read bandwidth at decode b=1 (GB/s)", "decode_b1_read_gb_s"),
                       ("read bandwidth at decode b=8 (GB/s)", "decode_b8_read_gb_s"),
                       ("load time (s)", "load_s"), ("peak RSS (MB)", "peak_rss_mb")):
        hf_cells = f"{hf[key]:.3g} | {hf[key] / ours[key]:.2f}x" if key in hf else " | "
        lines.append(f"| {label} | {' | '.join(f'{r[key]:.3g}' for r in sides.values())} | {hf_cells} |")
    if "bf16 weights" in sides:
        g = sides["bf16 weights"]["greedy_agreement"]
        lines += ["", f"bf16 weights, greedy against fp32 (= HF fp32) on {g['prompts']} chats with ~1k-token system "
                  f"prompts, {g['tokens']} tokens each: {g['identical']} identical; the others first differ at "
                  f"token {g['first_difference'] or '-'}."]
    if "shipped_ab" in ours:
        ab = ours["shipped_ab"]
        lines += ["", f"Decode steps at context {decode_ctx} reading the weights as shipped and reading fp32 panels "
                  "alone, a step of each in turn in one process (median ms):", "",
                  "| sequences | as shipped | fp32 panels | fp32 / shipped |", "|---|---|---|---|"]
        lines += [f"| {b} | {t['shipped']:.1f} | {t['fp32']:.1f} | {t['fp32'] / t['shipped']:.2f}x |"
                  for b, t in ab.items()]
    lines += ["", "## Prefix cache", "", "| figure | value |", "|---|---|"]
    for key in ("hit_4096_64_ttft_s", "miss_4096_64_ttft_s", "suffix_floor_64_on_4096_s", "hit_over_floor",
                "miss_over_hit", "kv_bytes_per_token", "kv_dtype"):
        v = ours[key]
        lines.append(f"| {key} | {v:.3f} |" if isinstance(v, float) else f"| {key} | {v} |")
    lines += ["", "Match + lock (hash the prompt, walk the tree, take references) for an 8192-token prompt:", "",
              "| tokens cached | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in ours["match_lock"]["cached_tokens_to_ms"].items()]
    return "\n".join(lines) + "\n"
