"""What a decode step costs outside its kernels: the same device-side loop as `lithos bench`, with 1, 2,
4 and 8 steps per loop iteration (fori_loop unroll) and loops of several lengths, per kernel path.

A megakernel step at 1K on the llama-3.2-1b shape is 0.958 ms in `lithos bench` and 0.932 ms from its
first task to its last in a trace (run 65): about 27 us of each step is outside the kernel (the loop's
iteration, the FFI call, the counters' memset, the embedding gather and the decode state's bookkeeping).
The unrolled loops split off the loop's own share: what a step gains at unroll 8 over 1 is about 7/8 of
one iteration's cost. Run 66 (megakernel, 1B): none within noise (0.956-0.962 ms at both), so the rest is
the step's own. Loops of several lengths (`--steps 8,32,128`) split each loop's time into a fixed part per
dispatch (the call, the launch of its first kernels, the wait for the result) and a part per step: a least-
squares line through (steps, loop ms). `lithos bench` divides the fixed part by its --steps.

    PYTHONPATH=. python3 benchmarks/probes/step_overhead.py --shape llama-3.2-1b --kernels megakernel,fused

Prints a table and writes the JSON to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from lithos import bench
from lithos.checkpoint import default_dtype


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", help="model shape from configs/models (repeatable)")
    p.add_argument("--kernels", default="megakernel,fused", help="comma-separated kernel paths")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--unroll", default="1,2,4,8", help="comma-separated steps per loop iteration")
    p.add_argument("--steps", default="32", help="comma-separated steps per timed loop (multiples of every unroll)")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--out", default=str(bench.REPO / "benchmarks" / "results"))
    p.add_argument("--tag", default="step-overhead")
    args = p.parse_args()
    unrolls = [int(u) for u in args.unroll.split(",")]
    lengths = [int(n) for n in args.steps.split(",")]
    if any(n % u for n in lengths for u in unrolls):
        p.error(f"--steps {args.steps} must be multiples of every --unroll ({args.unroll})")

    dtype = jax.numpy.dtype(default_dtype())
    rows = []
    for shape in args.shape or ["llama-3.2-1b"]:
        cfg, params = bench.shape_model(shape, dtype)
        for kernels in args.kernels.split(","):
            for steps in lengths:
                for unroll in unrolls:
                    per_step = bench.time_decode_steps(
                        params, cfg, args.context, kernels, steps, args.runs, unroll=unroll
                    )
                    rows.append(
                        {
                            "model": shape,
                            "kernels": kernels,
                            "context": args.context,
                            "steps": steps,
                            "unroll": unroll,
                            "step_ms": statistics.median(per_step),
                            "step_ms_runs": per_step,
                        }
                    )
                    step_ms = rows[-1]["step_ms"]
                    print(f"  {shape} {kernels} {steps} steps, unroll {unroll}: {step_ms:.4f} ms/step", flush=True)
        del params
    fits = dispatch_fits(rows) if len(lengths) > 1 else []

    protocol = f"batch 1, greedy, random weights, median of {args.runs} device loops of {args.steps} steps"
    script = "benchmarks/probes/step_overhead.py"
    path = bench.write_probe_record(args.out, args.tag, script, protocol, rows, dispatch_fits=fits)
    print(f"{'model':<16}{'kernels':<12}{'steps':>6}{'unroll':>7}{'step ms':>10}{f'vs unroll {unrolls[0]} us':>16}")
    for row in rows:
        loop = (row["model"], row["kernels"], row["steps"])
        base = next(r for r in rows if (r["model"], r["kernels"], r["steps"]) == loop)
        delta_us = (row["step_ms"] - base["step_ms"]) * 1e3
        print(
            f"{row['model']:<16}{row['kernels']:<12}{row['steps']:>6}{row['unroll']:>7}{row['step_ms']:>10.4f}"
            f"{delta_us:>16.2f}"
        )
    for fit in fits:
        print(
            f"{fit['model']} {fit['kernels']} unroll {fit['unroll']}: {fit['fixed_us']:.1f} us per dispatch + "
            f"{fit['step_us']:.2f} us per step"
        )
    print(f"wrote {path}")


def dispatch_fits(rows: list[dict]) -> list[dict]:
    """Per (model, kernels, unroll): the least-squares line through (steps, loop ms), split into the
    fixed us per dispatch and the us per step."""
    fits = []
    for key in dict.fromkeys((r["model"], r["kernels"], r["unroll"]) for r in rows):
        group = [r for r in rows if (r["model"], r["kernels"], r["unroll"]) == key]
        steps = np.array([r["steps"] for r in group], float)
        loop_us = np.array([r["step_ms"] * r["steps"] * 1e3 for r in group])
        step_us, fixed_us = np.polyfit(steps, loop_us, 1)
        fits.append(dict(zip(("model", "kernels", "unroll"), key), fixed_us=float(fixed_us), step_us=float(step_us)))
    return fits


if __name__ == "__main__":
    main()
