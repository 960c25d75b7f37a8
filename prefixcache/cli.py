"""prefixcache command line: generate | convert | serve | bench | lint | diff."""
import argparse
import sys


def cmd_generate(args) -> None:
    from prefixcache import LLM, SamplingParams

    llm = LLM(model=args.model, enable_prefix_cache=not args.no_prefix_cache)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="prefixcache")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("prompt")
    p.add_argument("--model", default="")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("convert", help="convert a GGUF file into an HF safetensors folder")
    p.add_argument("gguf")
    p.add_argument("out")
    p.set_defaults(func=cmd_convert)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"prefixcache: error: {e}\n")


if __name__ == "__main__":
    main()
