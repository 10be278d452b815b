"""The `lithos` command: generate, bench, convert.

Problems a user can fix (bad paths, corrupt checkpoints, prompts too long) print one line that says
what to do, with no traceback, and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from lithos.errors import LithosError


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="HF safetensors dir, .gguf file or lithos-converted dir (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), help="weight dtype (default: bf16 on GPU, f32 on CPU)"
    )
    p.add_argument("--max-len", type=int, default=2048, help="KV cache length in tokens (prompt + generation)")
    p.add_argument("--kernels", default="reference", help="kernel path: reference, fused, megakernel")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)


def cmd_generate(args: argparse.Namespace) -> int:
    import lithos

    model = lithos.load(args.model, max_len=args.max_len, kernels=args.kernels, dtype=args.dtype)
    if args.raw:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    stream = model.stream(prompt, max_new_tokens=args.max_new_tokens, raw=args.raw, **sampling)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    result = stream.result
    note = " (stopped: the KV cache is full; raise --max-len)" if result.finish_reason == "cache_full" else ""
    print(result.figures() + note, file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from lithos.checkpoint import convert

    out = convert(args.source, args.out, dtype=args.dtype)
    print(f"converted {args.source} -> {out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from lithos import bench

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lithos", description="Low-latency LLM decoding in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for a prompt (chat-formatted unless --raw)")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    g.add_argument("--system", help="system message for the chat template")
    _add_model_options(g)
    _add_sampling_options(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a HF or GGUF checkpoint to lithos's orbax format")
    c.add_argument("source")
    c.add_argument("out")
    c.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    c.set_defaults(func=cmd_convert)

    from lithos import bench

    b = sub.add_parser("bench", help="decode step time against the memory-bandwidth floor")
    bench.add_arguments(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LithosError as e:
        print(f"lithos: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lithos: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
