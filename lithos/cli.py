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
    p.add_argument(
        "--dequantize", action="store_true", help="turn packed weights (GGUF Q4/Q8, MXFP4, FP8) into dense dtype"
    )
    from lithos.kv_cache import CACHE_DTYPES

    p.add_argument(
        "--kv-cache",
        choices=CACHE_DTYPES,
        default="model",
        help="what the KV cache holds: the weights' dtype (model), fp8 (E4M3 with per-head scales: half the bytes "
        "of bf16, for long contexts) or a float dtype",
    )


def _add_placement_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="split the model over this many logical devices (tensor parallel)")
    p.add_argument(
        "--devices-per-gpu",
        type=int,
        default=1,
        help="logical devices each GPU shows: 2 for AMD MI355X in DPX mode (one per die), else 1",
    )
    p.add_argument(
        "--pad-heads", action="store_true", help="add zero attention heads if the model's heads do not split over --tp"
    )
    p.add_argument(
        "--tp-overlap",
        action="store_true",
        help="with --kernels fused and --tp > 1: overlap each layer's reductions with its projections "
        "(collective matmul) instead of one all-reduce each",
    )


def placement_options(args: argparse.Namespace) -> dict:
    """The `lithos.load` keywords that `_add_placement_options` parsed."""
    return dict(tp=args.tp, devices_per_gpu=args.devices_per_gpu, pad_heads=args.pad_heads, overlap=args.tp_overlap)


def load_model(args: argparse.Namespace):
    """`lithos.load` with the model, cache, kernel, dtype and placement options a generating command parsed
    (`lithos generate`, `lithos eval`)."""
    import lithos

    return lithos.load(
        args.model,
        max_len=args.max_len,
        kernels=args.kernels,
        dtype=args.dtype,
        dequantize=args.dequantize,
        kv_cache_dtype=args.kv_cache,
        **placement_options(args),
    )


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)


def cmd_generate(args: argparse.Namespace) -> int:

    model = load_model(args)
    if args.raw:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    from lithos.spec import cli as spec_cli

    sampling |= spec_cli.options(args)
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

    out = convert(args.source, args.out, dtype=args.dtype, dequantize=args.dequantize)
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
    _add_placement_options(g)
    _add_sampling_options(g)
    from lithos.spec import cli as spec_cli

    spec_cli.add_generate_arguments(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a HF or GGUF checkpoint to lithos's orbax format")
    c.add_argument("source")
    c.add_argument("out")
    c.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    c.add_argument("--dequantize", action="store_true", help="store packed weights (GGUF Q4/Q8, ...) as dense dtype")
    c.set_defaults(func=cmd_convert)

    from lithos import bench

    b = sub.add_parser("bench", help="decode step time against the memory-bandwidth floor")
    bench.add_arguments(b)
    b.set_defaults(func=cmd_bench)

    from lithos.eval import cli as eval_cli

    e = sub.add_parser("eval", help="accuracy and speed on a JSONL task file; compare two configurations")
    eval_cli.add_arguments(e)
    e.set_defaults(func=eval_cli.main)

    from lithos.quant import cli as quant_cli

    q = sub.add_parser("quantize", help="quantize a bf16/f32 checkpoint to MXFP4 or MXFP8, with a quality report")
    quant_cli.add_arguments(q)
    q.set_defaults(func=quant_cli.main)

    from lithos.custom_calls import tune

    t = sub.add_parser("tune", help="choose the fused kernels' launch parameters by measurement (on a GPU)")
    tune.add_arguments(t)
    t.set_defaults(func=tune.main)
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
