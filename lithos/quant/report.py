"""SmolLM2-135M-Instruct Q4_1 from its packed weights, side by side with the dequantised path and with
transformers (which dequantises the same GGUF to float32): prompt logits and greedy chat outputs.

    python -m lithos.quant.report [--max-new-tokens 16] [--out benchmarks/results]

Writes `<date>-<device>-quant-smollm2-q4_1-side-by-side.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 7 times 8?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What does a thermometer measure?",
    "Give me a synonym for happy.",
    "How many days are in a week?",
    "What is the opposite of cold?",
    "Translate 'thank you' into Spanish.",
    "What planet is closest to the sun?",
    "Say hello in one short sentence.",
    "What is water made of?",
    "List two fruits that are red.",
    "Why is the sky blue?",
    "What is the boiling point of water in Celsius?",
    "Complete the sentence: The early bird...",
    "What animal says moo?",
    "Suggest a name for a pet cat.",
    "What is the largest ocean on Earth?",
    "How do plants make food?",
    "What language is spoken in Brazil?",
]


def _prompt_logits(params, cfg, ids: list[int], bucket: int) -> np.ndarray:
    """Logits `[len(ids), vocab]` from one forward over the prompt, right-padded to `bucket` (causal, so
    padding never reaches the real positions) so that every prompt reuses one compiled program."""
    from lithos.kv_cache import init_cache
    from lithos.models import family_of

    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, : len(ids)] = ids
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, bucket, cfg.head_dim, jnp.float32)
    logits, _ = _forward(family_of(cfg).forward, cfg)(params, jnp.asarray(tokens), jnp.arange(bucket)[None], cache)
    return np.asarray(logits)[0, : len(ids)]


_COMPILED: dict[Any, Any] = {}


def _forward(fn, cfg):
    if (fn, cfg) not in _COMPILED:
        _COMPILED[(fn, cfg)] = jax.jit(partial(fn, cfg=cfg))
    return _COMPILED[(fn, cfg)]


def run(max_new_tokens: int, out_dir: Path, argv: list[str]) -> dict[str, Any]:
    import torch
    import transformers

    import lithos
    from lithos.bench import environment, hardware_profile
    from lithos.checkpoint import default_model_path
    from lithos.quant import bytes_by_format

    gguf_path = default_model_path()
    packed = lithos.load(gguf_path, dtype="float32", max_len=256)
    dense = lithos.load(gguf_path, dtype="float32", max_len=256, dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()

    ids = [packed.prompt_ids(p) for p in PROMPTS]
    bucket = 1 << max(len(x) for x in ids).bit_length()
    rows = []
    for prompt, prompt_ids in zip(PROMPTS, ids):
        with torch.no_grad():
            hf_logits = hf(torch.tensor([prompt_ids])).logits.numpy()[0]
            hf_out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
        packed_logits = _prompt_logits(packed.params, packed.cfg, prompt_ids, bucket)
        dense_logits = _prompt_logits(dense.params, dense.cfg, prompt_ids, bucket)
        rows.append(
            {
                "prompt": prompt,
                "prompt_tokens": len(prompt_ids),
                "max_abs_logit_diff_packed_vs_transformers": float(np.abs(packed_logits - hf_logits).max()),
                "max_abs_logit_diff_packed_vs_dequantized": float(np.abs(packed_logits - dense_logits).max()),
                "transformers_token_ids": hf_out[0, len(prompt_ids) :].tolist(),
            }
        )
        print(f"logits: {prompt!r}: vs transformers {rows[-1]['max_abs_logit_diff_packed_vs_transformers']:.2e}")

    timings = {}
    for name, model in (("packed", packed), ("dequantized", dense)):
        t = time.perf_counter()
        results = [model.generate(p, max_new_tokens=max_new_tokens) for p in PROMPTS]
        timings[name] = time.perf_counter() - t
        for row, result in zip(rows, results):
            row[f"{name}_text"] = result.text
            row[f"{name}_token_ids"] = result.token_ids
            row[f"{name}_decode_tokens_per_s"] = result.decode_tokens_per_s
    tokenizer = packed.tokenizer
    stop = set(tokenizer.stop_ids)
    for row in rows:
        hf_ids = [t for t in row["transformers_token_ids"] if t not in stop]
        row["transformers_text"] = tokenizer.decode(hf_ids)
        row["packed_equals_dequantized"] = row["packed_token_ids"] == row["dequantized_token_ids"]
        row["packed_equals_transformers"] = [t for t in row["packed_token_ids"] if t not in stop] == hf_ids
        print(f"{row['prompt']!r}\n  packed:       {row['packed_text']!r}\n  dequantized:  {row['dequantized_text']!r}")

    now = dt.datetime.now(dt.timezone.utc)
    report = {
        "date": now.isoformat(timespec="seconds"),
        "command": "python -m lithos.quant.report " + " ".join(argv),
        "environment": environment()
        | {"torch": torch.__version__, "transformers": transformers.__version__, "gguf_path": str(gguf_path)},
        "model": packed.cfg.describe(),
        "weights": {"packed": bytes_by_format(packed.params), "dequantized": bytes_by_format(dense.params)},
        "protocol": (
            f"chat template, greedy, max_new_tokens={max_new_tokens}, each prompt generated alone (batch 1), "
            "float32 activations; transformers loads the same GGUF dequantised to float32"
        ),
        "summary": {
            "prompts": len(rows),
            "packed_equals_dequantized": sum(r["packed_equals_dequantized"] for r in rows),
            "packed_equals_transformers": sum(r["packed_equals_transformers"] for r in rows),
            **{
                key: max(r[key] for r in rows)
                for key in ("max_abs_logit_diff_packed_vs_transformers", "max_abs_logit_diff_packed_vs_dequantized")
            },
            "generate_seconds": timings,
        },
        "rows": rows,
    }
    profile = hardware_profile(None)["id"]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{now:%Y-%m-%d}-{profile}-quant-smollm2-q4_1-side-by-side.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    from lithos.bench import REPO

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m lithos.quant.report", description=__doc__)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    run(args.max_new_tokens, Path(args.out), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
