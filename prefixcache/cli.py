"""prefixcache command line: generate | convert | serve | route | bench | lint | diff | doctor."""
import argparse
import sys

from prefixcache.options import add_engine_options, default, size
from prefixcache.server.config import ServeConfig

BENCH_EXTRA = ("rich", "matplotlib")  # pyproject's `bench` extra: benchmarks and plots, not serving


def cmd_generate(args) -> None:
    from prefixcache import LLM, SamplingParams
    from prefixcache.options import resolve

    llm = LLM(**resolve(args)[0])
    params = SamplingParams(temperature=args.temperature, seed=args.seed)  # max_tokens: Config's (--max-tokens)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate([args.prompt], params)[0]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, ttft={out.ttft:.3f}s, "
          f"cached={out.cached_tokens}]", file=sys.stderr)


def cmd_convert(args) -> None:
    from prefixcache.models.loader import convert_gguf

    convert_gguf(args.gguf, args.out)
    print(f"wrote {args.out}")


def cmd_serve(args) -> None:
    import logging

    from prefixcache.config import Config
    from prefixcache.options import resolve
    from prefixcache.server.config import SERVE_OPTIONS
    from prefixcache.server.serve import serve

    engine, options = resolve(args, SERVE_OPTIONS)
    cfg = ServeConfig(Config(**engine), **options)
    if cfg.host not in ("127.0.0.1", "localhost") and not cfg.api_keys and not cfg.auth_oidc:
        print(f"prefixcache: warning: serving {cfg.host} without --api-keys: anyone who can reach it is admin",
              file=sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(cfg)


def budget_list(text: str) -> list[int]:
    """Comma-separated byte sizes (512MiB, 2GiB, ...), each positive."""
    out = [size(t) for t in text.split(",")]
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"budgets must be positive sizes, got {text!r}")
    return out


def tier_sizes(text: str) -> dict[str, int]:
    from prefixcache.bench.plan_tiers import parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_plan(args) -> None:
    from prefixcache.bench import plan, plan_live

    workload = plan.load(args.log, args.seed, errors=args.trace_errors)
    points = plan.plan(workload, args.budgets, args.policy, args.ttl, args.model or "", args.min_cache_tokens,
                       args.tiers)
    measured = (plan_live.measure_hit_rates(workload, args.budgets, args.min_cache_tokens, args.seed, args.tiers,
                                            args.model or "")
                if args.validate else None)
    if args.json:
        for i, p in enumerate(points):
            print(plan.as_json(p, **({} if measured is None else {"measured_hit_rate": measured[i]})))
        return
    print(plan.markdown(points))
    if measured is not None:
        print("\n| budget | predicted hit rate | measured (live, 1 user) | difference |\n|---|---|---|---|")
        for p, m in zip(points, measured):
            live = "n/a (nothing served)" if m is None else f"{m:.3f} | {m - p.hit_rate:+.3f}"
            print(f"| {plan.mib(p.budget_bytes)} | {plan.rate(p)} | {live} |")
    if args.plot:
        print(f"wrote {plan.plot(points, f'{args.log}: hit rate against KV memory', args.plot)}")


def cmd_route(args) -> None:
    import logging

    import uvicorn

    from prefixcache.cache.credentials import redis_password, router_admin_key
    from prefixcache.router.app import create_app
    from prefixcache.router.balance import Policy
    from prefixcache.router.config import RouterConfig

    policy = Policy(args.policy, args.min_match_fraction, args.balance_abs_threshold, args.balance_rel_threshold)
    cfg = RouterConfig(args.replica, args.host, args.port, args.redis_url, policy, args.health_interval,
                       args.max_retries, args.max_body_bytes, args.max_model_len, args.max_pending_keys,
                       redis_password(args.redis_password_file), router_admin_key(args.admin_key_file))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check and forwarded request
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="info")


def cmd_lint(args) -> None:
    from prefixcache.lint.check import Options
    from prefixcache.lint.run import lint

    if not args.files and not args.requests:
        raise ValueError("lint: give FILE... and/or --requests LOG")
    opt = Options(min_tokens=args.min_tokens, prefix_tokens=args.prefix_tokens, block_size=args.block_size)
    report = lint(args.files, opt, args.requests, args.model)
    print(report.to_json() if args.format == "json" else report.to_text())
    sys.exit(1 if report.errors else 0)


def cmd_diff(args) -> None:
    import json
    from dataclasses import asdict

    from prefixcache.lint.run import diff

    result = diff(args.a, args.b, args.block_size, args.model)
    print(json.dumps(asdict(result.divergence), indent=2) if args.format == "json" else result.to_text())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    add_engine_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("convert", help="convert a GGUF file into an HF safetensors folder")
    p.add_argument("gguf")
    p.add_argument("out")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("serve", help="serve the OpenAI- and Anthropic-compatible HTTP APIs")
    p.add_argument("--config", help="TOML file with any of these options (underscored names); flags override it")
    p.add_argument("--host", help="(default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="(default: 8000)")
    p.add_argument("--api-keys", help='JSON: {"sk-key": {"tenant": "acme", "labels": [], "admin": false, "rpm": 60, '
                   '"tpm": 100000, "cache_share": 0.25}} (optional: rpm, tpm, per-tenant rate limits; cache_share, '
                   'the tenant\'s guaranteed fraction of the KV cache, evicted last)')
    p.add_argument("--auth-oidc", help="JSON or TOML: tenants and labels from identity tokens (issuer, audience, "
                   "jwks, tenant_claim, label_claims, labels, admin_label; see server/oidc.py), beside --api-keys")
    p.add_argument("--shared-prefixes", help="JSON list of system prompts shared by all tenants")
    p.add_argument("--max-queue", type=int,
                   help=f"waiting requests before 429 / 529 (default: {ServeConfig.max_queue})")
    p.add_argument("--max-body-bytes", type=size,
                   help=f"larger request bodies get 413 (default: {ServeConfig.max_body_bytes})")
    p.add_argument("--intake-bytes-per-s", type=size, help="bytes of one tenant's request bodies read a second "
                   "(parsing them holds the GIL the engine needs); 0: no limit (default: "
                   f"{ServeConfig.intake_bytes_per_s})")
    p.add_argument("--stream-stall-timeout", type=float, help="seconds a stream's output may wait unread by its "
                   "client before the request is aborted and its memory freed (default: "
                   f"{ServeConfig.stream_stall_timeout})")
    p.add_argument("--grace-seconds", type=float, help="on SIGTERM, how long running requests may finish while new "
                   f"ones get 503 (default: {ServeConfig.grace_seconds})")
    p.add_argument("--metrics-port", type=int, help="a second listener that serves GET /metrics only, with no key, for "
                   "scrapers that send none (the Inference Extension's endpoint picker); keep it off the clients' "
                   "network (default: none)")
    p.add_argument("--allow-torch-path", action="store_true", default=None, help="serve even where our kernels cannot "
                   "run, on the torch path (4-5x slower decode); without it the server refuses to start there and "
                   "says why")
    add_engine_options(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plan", help="what KV memory budgets buy for a request log, replayed through the real cache")
    p.add_argument("--log", required=True, help="a JSONL of OpenAI/Anthropic requests (optional tenant, arrival), a "
                   "Mooncake-style trace, or a built-in workload's name")
    p.add_argument("--budgets", type=budget_list, default=budget_list("256MiB,1GiB,4GiB"),
                   help="comma-separated KV budgets (default: 256MiB,1GiB,4GiB)")
    p.add_argument("--policy", choices=["lru", "fair", "ttl"], default="lru",
                   help="lru: as served; fair: equal per-tenant shares; ttl: entries live --ttl seconds")
    p.add_argument("--ttl", type=float, default=None, help="--policy ttl: seconds")
    p.add_argument("--tiers", type=tier_sizes, default=None, metavar="disk:SIZE,redis:SIZE",
                   help="KV tiers below memory: L2 on disk, L3 in Redis (its maxmemory), each of this size")
    p.add_argument("--model", default=None, help="the model whose KV geometry sizes a block (default: the default)")
    p.add_argument("--min-cache-tokens", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="for built-in workloads")
    p.add_argument("--trace-errors", choices=["refuse", "skip"], default="refuse")
    p.add_argument("--json", action="store_true", help="one JSON object per budget")
    p.add_argument("--plot", default=None, metavar="PNG", help="hit rate against budget, with the knee")
    p.add_argument("--validate", action="store_true",
                   help="also measure each budget on a live server of ours (one user) and print both")
    p.set_defaults(func=cmd_plan)

    from prefixcache.router.balance import POLICIES, Policy
    from prefixcache.router.config import RouterConfig

    p = sub.add_parser("route", help="route requests over `serve` replicas by their cached prefixes and load")
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://replica-1:8000 (repeat for each)")
    p.add_argument("--host", default=RouterConfig.host, help=f"(default: {RouterConfig.host})")
    p.add_argument("--port", type=int, default=RouterConfig.port, help=f"(default: {RouterConfig.port})")
    p.add_argument("--redis-url", help="the Redis of the replicas' KV events, e.g. redis://redis:6379/0; "
                   "without it, requests are routed by load alone")
    p.add_argument("--redis-password-file", default="", metavar="PATH",
                   help="a file holding Redis's password (default: $PREFIXCACHE_REDIS_PASSWORD, if set)")
    p.add_argument("--admin-key-file", default="", metavar="PATH",
                   help="a file holding an admin API key of the replicas, which the health checks send to read each "
                   "replica's id and load (default: $PREFIXCACHE_ROUTER_ADMIN_KEY, if set); without it the router "
                   "knows no replica's cached prefixes")
    p.add_argument("--policy", choices=POLICIES, default=Policy.kind,
                   help=f"(default: {Policy.kind}); round-robin ignores caches and load (a baseline)")
    p.add_argument("--min-match-fraction", type=float, default=Policy.min_match_fraction,
                   help="follow the longest cached prefix when it covers this share of the request's blocks "
                   f"(default: {Policy.min_match_fraction})")
    p.add_argument("--balance-abs-threshold", type=int, default=Policy.balance_abs_threshold,
                   help="load is uneven when the busiest replica has more than this many requests more than the "
                   f"idlest (default: {Policy.balance_abs_threshold}) ...")
    p.add_argument("--balance-rel-threshold", type=float, default=Policy.balance_rel_threshold,
                   help=f"... and more than this multiple of its load (default: {Policy.balance_rel_threshold}); "
                   "then the idlest is chosen, whatever is cached where")
    p.add_argument("--health-interval", type=float, default=RouterConfig.health_interval,
                   help=f"seconds between health checks of each replica (default: {RouterConfig.health_interval})")
    p.add_argument("--max-retries", type=int, default=RouterConfig.max_retries,
                   help="other replicas tried when one fails before any of its answer was sent on "
                   f"(default: {RouterConfig.max_retries})")
    p.add_argument("--max-body-bytes", type=size, default=RouterConfig.max_body_bytes,
                   help=f"larger request bodies get 413 (default: {RouterConfig.max_body_bytes})")
    p.add_argument("--max-model-len", type=int, default=RouterConfig.max_model_len,
                   help="the replicas' context in tokens: a request's keys past it are not held "
                   f"(default: {RouterConfig.max_model_len})")
    p.add_argument("--max-pending-keys", type=int, default=RouterConfig.max_pending_keys,
                   help="keys of routed requests held until their replica's events arrive, over all requests; past "
                   f"it the oldest go (default: {RouterConfig.max_pending_keys})")
    p.set_defaults(func=cmd_route)

    p = sub.add_parser("lint", help="lint prompt templates and logged requests for prefix-cache killers")
    p.add_argument("files", nargs="*", help="request .json/.jsonl (OpenAI or Anthropic) or plain-text templates")
    p.add_argument("--requests", action="append", default=[], metavar="LOG",
                   help="a JSONL request log: also report hit rate per template, actual vs achievable")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.add_argument("--min-tokens", type=int, default=default("min_cache_tokens"),
                   help="the server's --min-cache-tokens (default: Config's)")
    p.add_argument("--prefix-tokens", type=int, default=0, help="only lint the first N tokens (0: up to the "
                   "last breakpoint, else up to the final message)")
    p.add_argument("--block-size", type=int, default=default("block_size"))
    p.add_argument("--model", default="", help="GGUF file or HF folder whose tokenizer and chat template to use")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("diff", help="where two requests' prompts diverge, and how much prefix is reusable")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.add_argument("--block-size", type=int, default=default("block_size"))
    p.add_argument("--model", default="")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("doctor", help="this CPU, the exactness probe's findings, the mode chosen and its cost")
    add_engine_options(p)
    p.set_defaults(func=cmd_doctor)

    from prefixcache.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def cmd_doctor(args) -> None:
    from prefixcache.doctor import run

    run(args)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"prefixcache: error: {e}\n")
    except ModuleNotFoundError as e:
        if e.name not in BENCH_EXTRA:
            raise
        parser.exit(2, f"prefixcache: error: {e.name} is missing: pip install 'prefixcache[bench]'\n")


if __name__ == "__main__":
    main()
