"""Where a decode step's time goes on the device, between and around its kernels: a jax profiler trace of
`lithos bench`'s timed loop, read back as one row per kernel name (how many per step, how long) and the
time the device spent idle per step.

The megakernel's own trace (`LITHOS_MEGAKERNEL_TRACE`) stamps the tasks inside the launch; this covers what
it cannot see: the launches, memsets and XLA fusions of a step and the gaps between them.

    PYTHONPATH=. python3 -m lithos.step_timeline --shape llama-3.2-1b --kernels megakernel --anchor megakernel

`--anchor` names a kernel that runs once per step (a substring of its name): steps are counted from one
to the next. On a GPU the trace needs CUPTI (the jax CUDA plugin brings it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from lithos.errors import LithosError

# Threads of a device's process that repeat what its streams ran (module and op annotations): skipped when
# the device names no stream threads.
ANNOTATION_THREADS = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source", "TensorFlow")


def device_events(trace: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every activity on a device's streams in a Chrome/Perfetto trace
    (`traceEvents`), sorted by start. Where a device names its stream threads ("Stream #7(Compute)"), only
    those count; otherwise every thread but the annotation lines above."""
    processes: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    named_streams = {pid for (pid, _), name in threads.items() if pid in devices and name.startswith("Stream")}

    def counts(pid: int, tid) -> bool:
        name = threads.get((pid, tid), "")
        return name.startswith("Stream") if pid in named_streams else not name.startswith(ANNOTATION_THREADS)

    events = [
        (float(e["ts"]), float(e.get("dur", 0.0)), e["name"])
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("pid") in devices and counts(e["pid"], e.get("tid"))
    ]
    return sorted(events)


def summarize(events: list[tuple[float, float, str]], anchor: str) -> dict[str, Any]:
    """Per-step figures over the whole steps between the first and the last `anchor` kernel: the period
    (anchor start to anchor start), the device's idle time (no activity on any stream), and for each
    kernel name its launches and device time per step."""
    if not events:
        raise LithosError(
            "step timeline: the trace holds no device activity; run on a GPU, whose jax plugin brings CUPTI "
            "(on the CPU backend XLA's work is host threads, which this does not read)"
        )
    starts = [ts for ts, _, name in events if anchor in name]
    if len(starts) < 2:
        names = sorted({name for _, _, name in events})[:20]
        raise LithosError(
            f"step timeline: the anchor {anchor!r} ran {len(starts)} time(s) in the trace, two are needed to "
            f"bound a step; kernels seen: {names}"
        )
    first, last = starts[0], starts[-1]
    steps = len(starts) - 1
    busy_until, busy = first, 0.0
    per_name: dict[str, list[float]] = defaultdict(list)
    for ts, dur, name in events:
        if ts < first or ts >= last:
            continue
        end = min(ts + dur, last)
        busy += max(0.0, end - max(ts, busy_until))  # the union of busy intervals
        busy_until = max(busy_until, end)
        per_name[name].append(dur)
    period = (last - first) / steps
    kernels = [
        {
            "name": name,
            "per_step": len(durs) / steps,
            "us_per_step": sum(durs) / steps,
            "us_median": statistics.median(durs),
        }
        for name, durs in per_name.items()
    ]
    kernels.sort(key=lambda k: -k["us_per_step"])
    return {"steps": steps, "period_us": period, "idle_us": period - busy / steps, "kernels": kernels}


def load_trace(path: str | Path) -> dict[str, Any]:
    """A gzipped Chrome/Perfetto trace (`perfetto_trace.json.gz`)."""
    with gzip.open(path) as f:
        return json.load(f)


def read_trace(log_dir: Path) -> dict[str, Any]:
    """The Perfetto trace jax.profiler wrote under `log_dir`."""
    found = sorted(log_dir.glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not found:
        raise LithosError(f"step timeline: no perfetto_trace.json.gz under {log_dir}; jax.profiler wrote none")
    return load_trace(found[-1])


def profile_steps(args: argparse.Namespace) -> dict[str, Any]:
    """A trace of one timed loop of `args.steps` decode steps (after a warm-up loop) of random weights of
    `args.shape`, in `args.weight_format` if one is named, laid out for `args.kernels` (as `lithos bench` makes and
    lays them out: a trace of other params would not be the step it times)."""
    import jax
    import jax.numpy as jnp

    from lithos import bench
    from lithos.checkpoint import default_dtype
    from lithos.models import init_model_cache, params_for_kernels

    context, steps, kernels = args.context, args.steps, args.kernels
    _, cfg, params = bench.shape_model_as_asked(args.shape, jnp.dtype(default_dtype()), args)
    params = params_for_kernels(params, cfg, kernels)
    state = bench.decode_state(init_model_cache(cfg, 1, context + 2 * steps, params.embed.dtype), context)
    state = jax.block_until_ready(bench._steps(params, state, cfg, steps, kernels))  # compile and warm up
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            jax.block_until_ready(bench._steps(params, state, cfg, steps, kernels))
        return read_trace(Path(log_dir))


def main(argv: list[str] | None = None) -> int:
    from lithos import bench

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b", help="model shape from configs/models (random weights)")
    p.add_argument("--kernels", default="megakernel", help="kernel path (reference, fused, megakernel)")
    p.add_argument("--anchor", default="megakernel", help="a kernel that runs once per step (substring of its name)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--trace", help="read this perfetto_trace.json.gz instead of running the loop")
    p.add_argument("--out", help="write the summary as JSON here")
    bench.add_weight_format_arguments(p)
    args = p.parse_args(argv)
    try:
        if args.trace:
            trace = load_trace(args.trace)
        else:
            trace = profile_steps(args)
        summary = summarize(device_events(trace), args.anchor)
    except LithosError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{summary['steps']} steps: {summary['period_us']:.1f} us each, device idle {summary['idle_us']:.1f} us")
    print(f"{'per step':>9} {'us/step':>9} {'median us':>10}  kernel")
    for k in summary["kernels"]:
        print(f"{k['per_step']:>9.2f} {k['us_per_step']:>9.1f} {k['us_median']:>10.2f}  {k['name'][:90]}")
    if args.out:
        record = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python3 -m lithos.step_timeline", *(argv if argv is not None else sys.argv[1:])]),
            "environment": None if args.trace else bench.environment(),
            **vars(args),
            **summary,
        }
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
