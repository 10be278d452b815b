"""What a decode step costs outside its kernels: the same device-side loop as `lithos bench`, with 1, 2,
4 and 8 steps per loop iteration (fori_loop unroll), per kernel path.

A megakernel step at 1K on the llama-3.2-1b shape is 0.958 ms in `lithos bench` and 0.932 ms from its
first task to its last in a trace (run 65): about 27 us of each step is outside the kernel (the loop's
iteration, the FFI call, the counters' memset, the embedding gather and the decode state's bookkeeping).
The unrolled loops split off the loop's own share: what a step gains at unroll 8 over 1 is about 7/8 of
one iteration's cost. Run 66 (megakernel, 1B): none within noise (0.956-0.962 ms at both), so the rest is
the step's own.

    PYTHONPATH=. python3 benchmarks/probes/step_overhead.py --shape llama-3.2-1b --kernels megakernel,fused

Prints a table and writes the JSON to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

import jax

from lithos import bench
from lithos.checkpoint import default_dtype


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", help="model shape from configs/models (repeatable)")
    p.add_argument("--kernels", default="megakernel,fused", help="comma-separated kernel paths")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--unroll", default="1,2,4,8", help="comma-separated steps per loop iteration")
    p.add_argument("--steps", type=int, default=32, help="steps per timed loop (a multiple of every unroll)")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--out", default=str(bench.REPO / "benchmarks" / "results"))
    p.add_argument("--tag", default="step-overhead")
    args = p.parse_args()
    unrolls = [int(u) for u in args.unroll.split(",")]
    if any(args.steps % u for u in unrolls):
        p.error(f"--steps {args.steps} must be a multiple of every --unroll ({args.unroll})")

    dtype = jax.numpy.dtype(default_dtype())
    rows = []
    for shape in args.shape or ["llama-3.2-1b"]:
        cfg, params = bench.shape_model(shape, dtype)
        for kernels in args.kernels.split(","):
            for unroll in unrolls:
                per_step = bench.time_decode_steps(
                    params, cfg, args.context, kernels, args.steps, args.runs, unroll=unroll
                )
                rows.append(
                    {
                        "model": shape,
                        "kernels": kernels,
                        "context": args.context,
                        "unroll": unroll,
                        "step_ms": statistics.median(per_step),
                        "step_ms_runs": per_step,
                    }
                )
                print(f"  {shape} {kernels} unroll {unroll}: {rows[-1]['step_ms']:.4f} ms/step", flush=True)
        del params

    now = dt.datetime.now(dt.timezone.utc)
    result = {
        "date": now.isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "command": " ".join(["python3 benchmarks/probes/step_overhead.py", *sys.argv[1:]]),
        "environment": bench.environment(),
        "protocol": f"batch 1, greedy, random weights, median of {args.runs} device loops of {args.steps} steps",
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{now:%Y-%m-%d}-{bench.hardware_profile(None)['id']}-{args.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{'model':<16}{'kernels':<12}{'unroll':>7}{'step ms':>10}{f'vs unroll {unrolls[0]} us':>16}")
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["kernels"] == row["kernels"])
        delta_us = (row["step_ms"] - base["step_ms"]) * 1e3
        print(f"{row['model']:<16}{row['kernels']:<12}{row['unroll']:>7}{row['step_ms']:>10.4f}{delta_us:>16.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
