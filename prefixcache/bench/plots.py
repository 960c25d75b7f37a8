"""PNG plots of the runs and sweeps (matplotlib, Agg backend: no display needed)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def on_off(runs: dict[str, dict[str, dict]], path: str) -> str:
    """TTFT p50 and p99 per workload, cache on vs off."""
    names = list(runs)
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(names) + 2), 3.8))
    width = 0.2
    for j, (col, key, color) in enumerate((("cache on", "ttft_p50_s", "tab:green"),
                                            ("cache on", "ttft_p99_s", "#9fd89f"),
                                            ("cache off", "ttft_p50_s", "tab:red"),
                                            ("cache off", "ttft_p99_s", "#f2a3a3"))):
        xs = [i + (j - 1.5) * width for i in range(len(names))]
        ax.bar(xs, [runs[n][col][key] or 0 for n in names], width, color=color,
               label=f"{col}, {key.split('_')[1]}")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("time to first token (s)")
    ax.set_title("TTFT per workload, prefix cache on vs off")
    ax.legend(fontsize=8)
    return _save(fig, path)


def prefix_length(points: list[dict], engine_floor: float | None, path: str) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["prompt_tokens"] for p in points]
    ax.plot(xs, [p["miss_ttft_s"] for p in points], "o-", color="tab:red", label="miss (cold prefix)")
    ax.plot(xs, [p["hit_ttft_s"] for p in points], "o-", color="tab:green", label="hit (prefix cached)")
    ax.plot(xs, [p["alone_64_ttft_s"] for p in points], "--", color="gray",
            label="floor, measured: the 64-token question alone over HTTP")
    if engine_floor:
        ax.plot([4096], [engine_floor], "kx", markersize=9,
                label="floor, engine bench: 64 tokens on 4096 cached, runner only")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (shared prefix + a 64-token question)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("TTFT vs shared-prefix length")
    ax.legend(fontsize=7)
    return _save(fig, path)


def arrival_rate(points: list[dict], path: str) -> str:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    rates = [p["rate"] for p in points]
    a.plot(rates, [p["hit_rate_tokens"] for p in points], "o-", color="tab:green")
    a.set_ylim(0, 1)
    a.set_xlabel("arrival rate (req/s, Poisson)")
    a.set_ylabel("hit rate (token-weighted)")
    for label, color in (("on", "tab:green"), ("off", "tab:red")):
        b.plot(rates, [p[f"ttft_p50_{label}_s"] for p in points], "o-", color=color, label=f"cache {label}, p50")
        b.plot(rates, [p[f"ttft_p99_{label}_s"] for p in points], "o:", color=color, label=f"cache {label}, p99")
    b.set_yscale("log")
    b.set_xlabel("arrival rate (req/s, Poisson)")
    b.set_ylabel("time to first token (s)")
    b.legend(fontsize=7)
    fig.suptitle("shared-system-prompt workload, open loop")
    return _save(fig, path)


def memory_budget(points: list[dict], path: str) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    xs = [p["budget_mb"] for p in points]
    ax.plot(xs, [p["hit_rate_tokens"] or 0 for p in points], "o-", color="tab:green", label="hit rate (tokens)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("KV memory budget (MB), live and cached blocks together")
    ax.set_ylabel("hit rate (token-weighted)")
    ax2 = ax.twinx()
    ax2.plot(xs, [p["ttft_p50_s"] or 0 for p in points], "s--", color="tab:blue", label="TTFT p50")
    ax2.set_ylabel("TTFT p50 (s)")
    for p in points:
        ax.annotate(f"{p['evictions'] or 0:.0f} ev.", (p["budget_mb"], p["hit_rate_tokens"] or 0), fontsize=7,
                    textcoords="offset points", xytext=(0, 6))
    ax.set_title("multi-tenant workload: hit rate vs cache budget")
    ax.legend(handles=ax.lines + ax2.lines, loc="center right", fontsize=7)
    return _save(fig, path)


def compare(columns: dict[str, dict], path: str) -> str:
    names = list(columns)
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(names) + 2), 3.8))
    for j, (key, color) in enumerate((("ttft_p50_s", "tab:blue"), ("ttft_p99_s", "#9ec5ea"))):
        ax.bar([i + (j - 0.5) * 0.35 for i in range(len(names))], [columns[n][key] or 0 for n in names], 0.35,
               color=color, label=key.split("_")[1])
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("time to first token (s)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def goodput(sweep: dict, goal: float, title: str, path: str) -> str:
    """SLO attainment and goodput against arrival rate, one line per target, with the attainment goal."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, run in sweep.items():
        rates = [p["rate"] for p in run["points"]]
        line, = a.plot(rates, [p["slo_attainment"] for p in run["points"]], "o-", label=name)
        if run["max_rate"] is not None:
            a.axvline(run["max_rate"], color=line.get_color(), linestyle=":", linewidth=1)
        b.plot(rates, [p["goodput_req_per_s"] for p in run["points"]], "o-", color=line.get_color(), label=name)
    a.axhline(goal, color="gray", linestyle="--", linewidth=1, label=f"goal: {goal:.0%} meet every objective")
    a.set_ylim(0, 1.05)
    a.set_xlabel("arrival rate (req/s, Poisson)")
    a.set_ylabel("SLO attainment")
    a.legend(fontsize=7)
    b.set_xlabel("arrival rate (req/s, Poisson)")
    b.set_ylabel("goodput (req/s)")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)
