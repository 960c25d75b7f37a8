"""`prefixcache bench` (workloads cache on vs off, sweeps, plots), `prefixcache bench compare` (several targets) and
`prefixcache bench goodput` (SLO attainment and goodput against arrival rate, per target).

Results go to bench/results/<name>/: report.json, report.md and PNGs (or compare.*, or goodput.*).
"""
import json
import os
import sys
import time
from dataclasses import asdict

from prefixcache.bench.report import Prices, prices_note, table
from prefixcache.bench.trace import export_trace, load_trace
from prefixcache.bench.workloads import GENERATORS, SPECULATIVE, Size, build, multi_tenant
from prefixcache.options import default, size
from prefixcache.slo import Objectives

QUICK_WORKLOADS = ["shared-system-prompt", "multi-tenant"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="workload benchmark over HTTP: cache on vs off, sweeps, plots; or compare targets")
    p.add_argument("action", nargs="?", choices=["run", "compare", "goodput"], default="run")
    p.add_argument("--quick", action="store_true", help="a smoke run: small prompts, few requests, < 2 minutes")
    p.add_argument("--name", default=None, help="results folder under --out (default: quick, default or compare)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--workload", action="append", default=[], metavar="W",
                   help=f"one of {', '.join(GENERATORS)}, or a JSONL file of OpenAI/Anthropic requests "
                        "(optional `tenant`, `arrival`); repeatable; default: all built-in ones")
    p.add_argument("--url", default=None, help="drive this running server instead of starting ours (no on/off)")
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="compare: a target; URL `local`, `local-nocache`, `local-spec` (speculation from prompts and "
                        "answers), `local-unpaced` (the --goodput objectives only counted, not scheduled by) or `hf` "
                        "starts that server here")
    p.add_argument("--users", type=int, default=8, help="closed loop: concurrent users")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--prefix-tokens", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--min-cache-tokens", type=int, default=default("min_cache_tokens"),
                   help="for the servers started here")
    p.add_argument("--kv-cache-bytes", type=size, default=default("kv_cache_bytes"),
                   help="for the servers started here (e.g. 2GiB)")
    p.add_argument("--no-sweeps", action="store_true")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="latency objectives, as vLLM's serving benchmark takes them (ttft, tpot, e2el in ms): every "
                        "run reports goodput (req/s meeting all) and each objective's attainment")
    p.add_argument("--rates", default="0.5,1,2,4", help="goodput: the Poisson arrival rates (req/s) to sweep")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay a Mooncake-style trace (JSONL: timestamp ms, input_length, output_length, hash_ids of "
                        "512-token blocks) instead of --workload; see bench/trace.py")
    p.add_argument("--trace-speed", type=float, default=1.0, help="trace timestamps are divided by this")
    p.add_argument("--trace-errors", choices=["refuse", "skip"], default="refuse",
                   help="a malformed trace line stops the run (refuse) or is reported and left out (skip)")
    p.add_argument("--export-trace", default=None, metavar="FILE",
                   help="write the one --workload as a trace (hash ids from our scope-chained block keys; "
                        "timestamps its arrivals, or Poisson at --rate, default 1/s) and exit")
    p.add_argument("--price-input", type=float, default=Prices.input, help="$ per million input tokens")
    p.add_argument("--price-cached", type=float, default=Prices.cached, help="$ per million cached input tokens")
    p.add_argument("--price-output", type=float, default=Prices.output, help="$ per million output tokens")
    p.set_defaults(func=main)


def _size(args) -> Size:
    size = Size.quick() if args.quick else Size()
    for field in ("requests", "prefix_tokens", "max_tokens"):
        if getattr(args, field) is not None:
            setattr(size, field, getattr(args, field))
    return size


def _write(folder: str, stem: str, data: dict, md: str) -> None:
    with open(os.path.join(folder, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(folder, f"{stem}.md"), "w") as f:
        f.write(md)


def main(args) -> None:
    # imported here so that `prefixcache --help` and the other commands do not load matplotlib
    from prefixcache.bench.driver import Load
    from prefixcache.bench.runs import Bench
    from prefixcache.bench.server import ServerOptions, Servers

    size = _size(args)
    name = args.name or ("compare" if args.action == "compare" else "quick" if args.quick else "default")
    folder = os.path.join(args.out, name)
    os.makedirs(folder, exist_ok=True)
    prices = Prices(args.price_input, args.price_cached, args.price_output)
    objectives = Objectives.parse(args.goodput) if args.goodput else None
    if args.action == "goodput" and not objectives:
        raise ValueError("bench goodput: give the objectives, e.g. --goodput ttft:1000 tpot:200")
    names = args.workload or (QUICK_WORKLOADS if args.quick else [g for g in GENERATORS if g not in SPECULATIVE])
    if args.export_trace and len(args.workload) != 1:
        raise ValueError("bench --export-trace: give the one --workload to export")
    if args.trace:
        if args.workload or args.action == "goodput":
            raise ValueError("bench --trace: the trace is the workload, with its own arrivals (no --workload, "
                             "no goodput sweep of rates; scale its time with --trace-speed)")
        workload, problems = load_trace(args.trace, args.trace_speed, args.trace_errors)
        for problem in problems:
            print(f"prefixcache bench: {args.trace}: skipped {problem}", file=sys.stderr)
        workloads = [workload]
    else:
        workloads = [build(n, args.seed, size) for n in names]
    # every server started here knows every tenant's key, so one server serves all workloads and sweeps
    tenants = sorted({t for w in workloads for t in w.tenants} | set(multi_tenant(args.seed, size).tenants))
    servers = Servers(tenants, os.path.join(folder, "server.log"))
    bench = Bench(Load(users=args.users, rate=args.rate, seed=args.seed), prices,
                  ServerOptions(kv_cache_bytes=args.kv_cache_bytes, min_cache_tokens=args.min_cache_tokens,
                                extra=slo_flags(objectives)), servers, objectives)
    try:
        if args.export_trace:
            return export(args, workloads[0], bench)
        _main(args, name, folder, size, workloads, bench)
    finally:
        servers.close()


def slo_flags(objectives: Objectives | None) -> tuple[str, ...]:
    """The servers started here are told the objectives they are measured against: they schedule by them and their
    /metrics count them (a `local-unpaced` target only counts them)."""
    given = objectives.given() if objectives else {}
    return tuple(x for name in ("ttft", "tpot") if name in given
                 for x in (f"--slo-{name}-ms", f"{given[name] * 1000:g}"))


def export(args, workload, bench) -> None:
    from prefixcache.bench.driver import Load, Target
    from prefixcache.bench.runs import local

    srv = local(bench, prefix_cache=True)
    n = export_trace(workload, Target("export", srv.url, srv.keys), Load(rate=args.rate or 1.0, seed=args.seed),
                     args.export_trace)
    print(f"wrote {args.export_trace}: {n} requests")


def _main(args, name: str, folder: str, size: Size, workloads: list, bench) -> None:
    from prefixcache.bench import plots
    from prefixcache.bench.driver import Target
    from prefixcache.bench.runs import compare, measure, on_off
    from prefixcache.models.cpu import cpu_info

    prices = bench.prices
    load = (f"{args.rate} req/s Poisson (open loop)" if args.rate else
            "Poisson arrivals of sessions at each rate below (open loop)" if args.action == "goodput" else
            f"{args.users} concurrent users (closed loop)")
    setup = (f"CPU: {cpu_info()}. Load: {load}, seed {args.seed}, temperature 0. "
             "Servers started here: SmolLM2-135M-Instruct, "
             f"--min-cache-tokens {args.min_cache_tokens}, --kv-cache-bytes {args.kv_cache_bytes}. "
             f"{prices_note(prices)}")
    config = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "size": asdict(size),
              "prices": asdict(prices), "cpu_count": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.action == "goodput":
        return goodput_sweep(args, folder, size, setup, config, bench)
    if args.action == "compare":
        if not args.target or len(workloads) != 1:
            raise ValueError("bench compare: give one --workload and at least one --target NAME=URL")
        workload = workloads[0]
        targets = [tuple(t.split("=", 1)) for t in args.target]
        columns = compare(workload, targets, bench)
        md = (f"# Compare: {workload.name}\n\n{workload.notes}. {workload.num_requests} requests. {setup}\n\n"
              f"{table(columns, ratio_to=targets[0][0])}\n\n![TTFT](compare.png)\n")
        plots.compare(columns, os.path.join(folder, "compare.png"))
        _write(folder, "compare", {"config": config, "workload": workload.name, "targets": dict(targets),
                                   "results": columns}, md)
        print(md)
        return

    runs, sections = {}, [f"# Workload benchmark: {name}\n", setup, "Ratios are cache off / cache on (for times, "
                          "above 1 means the cache helps; for throughput, below 1 means it does).\n"]
    for workload in workloads:
        if args.url:
            runs[workload.name] = {"target": measure(workload, Target("target", args.url.rstrip("/")), bench,
                                                     "target")[0]}
            ratio = None
        else:
            runs[workload.name] = on_off(workload, bench)
            ratio = "cache on"
        sections.append(f"## {workload.name}\n\n{workload.notes}. {workload.num_requests} requests.\n\n"
                        f"{table(runs[workload.name], ratio_to=ratio)}\n")
    result = {"config": config, "runs": runs}
    if not args.url:
        plots.on_off(runs, os.path.join(folder, "on_off.png"))
        sections.append("![TTFT on vs off](on_off.png)\n")
    if not args.no_sweeps and not args.url:
        result["sweeps"] = run_sweeps(args, size, bench, folder, sections)
    _write(folder, "report", result, "\n".join(sections))
    print("\n".join(sections))
    print(f"wrote {folder}/")


def run_sweeps(args, size: Size, bench, folder: str, sections: list[str]) -> dict:
    from prefixcache.bench import plots, sweeps

    if args.quick:
        lengths, hits, rates, fractions = [128, 384], 1, [2.0, 8.0], [0.6]
        rate_size = mem_size = Size.quick()
    else:
        lengths, hits, rates, fractions = [256, 1024, 4096], 2, [0.5, 1.0, 2.0], [0.4, 0.7, 1.5]
        rate_size = Size(requests=8, prefix_tokens=512)
        mem_size = Size(requests=16, prefix_tokens=512, tenants=4)
    out = {"prefix_length": sweeps.prefix_length(lengths, hits, bench), "engine_floor_s": sweeps.engine_floor()}
    plots.prefix_length(out["prefix_length"], out["engine_floor_s"], os.path.join(folder, "prefix_length.png"))
    rows = [f"| {p['prompt_tokens']} | {p['cached_tokens']:.0f} | {p['miss_ttft_s']:.3f} | {p['hit_ttft_s']:.3f} | "
            f"{p['miss_ttft_s'] / p['hit_ttft_s']:.1f}x |" for p in out["prefix_length"]]
    sections.append("## TTFT vs shared-prefix length\n\nOne cold request, then the median of "
                    f"{hits} hit(s) with a new 64-token question each (1 user, max_tokens 1). The dashed floor is the "
                    f"64-token question sent alone ({out['prefix_length'][0]['alone_64_ttft_s']:.3f} s): it pays "
                    "HTTP, scheduling and a 64-token prefill but no attention over a prefix. "
                    + (f"The x marks the engine benchmark's runner-only floor on 4096 cached tokens "
                       f"({out['engine_floor_s']:.3f} s). " if out["engine_floor_s"] else "")
                    + "\n\n| prompt tokens | cached on hit | miss TTFT (s) | hit TTFT (s) | miss / hit |\n"
                      "|---|---|---|---|---|\n"
                    + "\n".join(rows) + "\n\n![prefix length](prefix_length.png)\n")
    out["arrival_rate"] = sweeps.arrival_rate(rates, rate_size, args.seed + 100, bench)
    plots.arrival_rate(out["arrival_rate"], os.path.join(folder, "arrival_rate.png"))
    rows = [f"| {p['rate']} | {p['hit_rate_tokens'] or 0:.3f} | {p['ttft_p50_on_s']:.3f} | {p['ttft_p50_off_s']:.3f} | "
            f"{p['ttft_p99_on_s']:.3f} | {p['ttft_p99_off_s']:.3f} |" for p in out["arrival_rate"]]
    sections.append(f"## Hit rate and TTFT vs arrival rate\n\nshared-system-prompt, {rate_size.requests} requests "
                    "per rate, Poisson arrivals, the cache emptied before each run.\n\n| rate (req/s) | hit rate | "
                    "TTFT p50 on (s) | TTFT p50 off (s) | TTFT p99 on (s) | TTFT p99 off (s) |\n"
                    "|---|---|---|---|---|---|\n"
                    + "\n".join(rows) + "\n\n![arrival rate](arrival_rate.png)\n")
    out["memory_budget"] = sweeps.memory_budget(fractions, mem_size, args.seed, bench)
    plots.memory_budget(out["memory_budget"], os.path.join(folder, "memory_budget.png"))
    rows = [f"| {p['budget_mb']:.0f} | {p['fraction_of_working_set']} | {p['hit_rate_tokens'] or 0:.3f} | "
            f"{p['ttft_p50_s'] or 0:.3f} | {p['evictions'] or 0:.0f} | {p['errors']} |" for p in out["memory_budget"]]
    sections.append(f"## Hit rate vs cache memory budget\n\nmulti-tenant workload, {mem_size.tenants} tenants, "
                    f"{mem_size.requests} requests, 2 users; the budget is a fraction of its working set: every "
                    "tenant's prefix once plus the question and reply of each user.\n\n"
                    "| budget (MB) | fraction of working set | hit rate | TTFT p50 (s) | evictions | errors |\n"
                    "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n![memory](memory_budget.png)\n")
    return out


def goodput_sweep(args, folder: str, size: Size, setup: str, config: dict, bench) -> None:
    """SLO attainment and goodput against Poisson arrival rate for each target (default: ours, and ours scheduling
    against the objectives),
    and the highest rate at which 90% of the requests meet every objective."""
    from prefixcache.bench import plots, sweeps

    try:
        rates = sorted(float(r) for r in args.rates.split(","))
    except ValueError:
        raise ValueError(f"--rates: a comma-separated list of req/s, got {args.rates!r}") from None
    if not rates or rates[0] <= 0:
        raise ValueError(f"--rates: positive req/s, got {args.rates!r}")
    if len(args.workload) > 1:
        raise ValueError("bench goodput: give one --workload (default: shared-system-prompt)")
    name = args.workload[0] if args.workload else "shared-system-prompt"
    targets = [tuple(t.split("=", 1)) for t in args.target] or [("ours", "local"), ("ours, unpaced", "local-unpaced")]
    runs = [(rate, build(name, args.seed + i, size)) for i, rate in enumerate(rates)]
    sweep = sweeps.goodput_rates(runs, targets, bench)
    goal = sweeps.ATTAINMENT_GOAL
    objectives = ", ".join(f"{k} {v * 1000:g} ms" for k, v in bench.objectives.given().items())
    title = f"{name}, {runs[0][1].num_requests} requests per rate; objectives: {objectives}"
    plots.goodput(sweep, goal, title, os.path.join(folder, "goodput.png"))
    head = "| target | " + " | ".join(f"{r:g} req/s" for r in rates) + f" | highest rate at {goal:.0%} |"
    lines = [head, "|" + "---|" * (len(rates) + 2)]
    for target, run in sweep.items():
        cells = [f"{p['slo_attainment']:.2f} ({p['goodput_req_per_s']:.2f})" for p in run["points"]]
        best = "below the lowest" if run["max_rate"] is None else f"{run['max_rate']:.2f}"
        lines.append(f"| {target} | " + " | ".join(cells) + f" | {best} |")
    md = (f"# Goodput: {name}\n\n{setup}\n\nObjectives (vLLM's `--goodput`): {objectives}; a request counts when it "
          f"meets every one. Each cell: SLO attainment (goodput, req/s) at that Poisson arrival rate; a new seed per "
          f"rate. The last column is the highest rate at which {goal:.0%} of requests meet them (DistServe's "
          f"measure), interpolated between the tested rates.\n\n" + "\n".join(lines) + "\n\n![goodput](goodput.png)\n")
    _write(folder, "goodput", {"config": config, "workload": name, "targets": dict(targets),
                               "objectives": bench.objectives.given(), "goal": goal, "sweep": sweep}, md)
    print(md)
