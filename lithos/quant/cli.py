"""`lithos quantize`: a bf16/f32 checkpoint to MXFP4 or MXFP8 per tensor group, saved with orbax, with
a quality report (KL divergence of next-token distributions and perplexity against the unquantized
model on a text sample).

    lithos quantize MODEL OUT --format mxfp4 --groups attention,mlp
    lithos generate "Hello" --model OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from lithos.errors import LithosError
from lithos.quant.formats import bytes_by_format
from lithos.quant.quality import SAMPLE_TEXT, quality_report
from lithos.quant.quantize import DEFAULT_GROUPS, GROUPS, SCALE_RULES, param_at, quantize_params


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="checkpoint to quantize: HF safetensors dir, lithos-converted dir, or .gguf")
    p.add_argument("out", help="directory for the quantized checkpoint (lithos's orbax format)")
    p.add_argument("--format", choices=("mxfp4", "mxfp8"), default="mxfp4", help="element format (default mxfp4)")
    p.add_argument(
        "--groups",
        default=",".join(DEFAULT_GROUPS),
        help=f"comma-separated tensor groups to quantize, from {', '.join(GROUPS)} (default attention,mlp); "
        "with tied embeddings embed and lm_head are one table",
    )
    p.add_argument(
        "--scale-rule",
        choices=SCALE_RULES,
        default="floor",
        help="MX block exponent: floor (OCP spec, may clip the block max) or ceil (never clips)",
    )
    p.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), help="model dtype (default: bf16 on GPU, f32 on CPU)"
    )
    p.add_argument("--text", help="text file for the quality report (default: a built-in English sample)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens of the text the report scores")
    p.add_argument("--report", help="where to write the report JSON (default OUT/quality.json)")
    p.add_argument("--no-report", action="store_true", help="skip the quality report")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    """Quantize, save, and (unless --no-report) score against the unquantized model; returns the report."""
    from lithos.bench import environment
    from lithos.checkpoint import default_dtype, load_checkpoint, save_params
    from lithos.models import family_of

    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    if not groups:
        raise LithosError("--groups is empty: name at least one of " + ", ".join(GROUPS))
    dtype = args.dtype or default_dtype()
    source = Path(args.source).expanduser()
    t0 = time.perf_counter()
    ck = load_checkpoint(source, dtype=dtype, dequantize=True)
    cfg = ck.cfg
    quantized = quantize_params(ck.params, args.format, groups, args.scale_rule)
    names = family_of(cfg).param_shapes(cfg)
    save_params(args.out, source, cfg, {n: param_at(quantized, n) for n in names}, dtype)
    seconds = time.perf_counter() - t0
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "lithos quantize " + " ".join(argv if argv is not None else sys.argv[2:]),
        "environment": environment(),
        "source": str(source),
        "out": str(args.out),
        "model": cfg.describe(),
        "dtype": dtype,
        "format": args.format,
        "groups": groups,
        "scale_rule": args.scale_rule,
        "bytes_reference": bytes_by_format(ck.params),
        "bytes_quantized": bytes_by_format(quantized),
        "quantize_seconds": seconds,
    }
    print(f"quantized {source} -> {args.out} ({args.format}: {', '.join(groups)}) in {seconds:.1f} s")
    if not args.no_report:
        text = Path(args.text).read_text() if args.text else SAMPLE_TEXT
        tokens = ck.tokenizer.encode(text)[: args.max_tokens]
        if len(tokens) < 2:
            raise LithosError("the report text has fewer than 2 tokens: pass a longer --text file")
        report["text"] = args.text or "built-in sample (lithos.quant.quality.SAMPLE_TEXT)"
        report["quality"] = quality_report(ck.params, quantized, cfg, tokens)
        q = report["quality"]
        print(
            f"quality on {q['positions']} tokens: KL mean {q['kl_mean']:.5f} (p99 {q['kl_p99']:.4f}, max "
            f"{q['kl_max']:.4f}), perplexity {q['perplexity_reference']:.3f} -> {q['perplexity_quantized']:.3f}, "
            f"top-1 agreement {q['top1_agreement']:.3f}"
        )
    path = Path(args.report) if args.report else Path(args.out) / "quality.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return report


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
