r"""Where a megakernel step's time goes, from a trace the kernel records.

With `LITHOS_MEGAKERNEL_TRACE=path` set, every megakernel step stamps, per task, the block that ran
it and three times on a clock all SMs share: when the block reached the task, when its inputs were
ready, and when it had signalled its outputs (csrc/mk_common.h `trace_mark`). The handler writes the
last step's record to `path` (JSON, csrc/megakernel.cu `StepTrace`); every traced step waits for the
GPU, so a traced run's timings are not the benchmark's (write them elsewhere):

    LITHOS_MEGAKERNEL_TRACE=/tmp/step.json lithos bench --shape llama-3.2-1b --kernels megakernel \
        --context 1024 --steps 128 --runs 1 --out /tmp/traced
    python -m lithos.custom_calls.megakernel.trace /tmp/step.json [--chrome /tmp/step-events.json]

A stage is one task kind of one layer (the list is stage by stage). Per stage: its span, from the
first task having its inputs to the last one signalling; the hand-off before it, from the previous
stage's last signal to this stage's first start (negative where the stage depends on part of the
previous one only: attention of KV head g starts when group g's Q/K/V are done); and the rate its
bytes (its weights, in the formats the build read them in, or the keys and values) streamed at over
the span. Then, per task kind, the phases of a task after its wait (marks the kernel stamps inside it,
csrc/mk_common.h kTracePhases): for a matvec its inputs staged, its last dot products, its epilogues
and its signal (in fragment tiles also its block's barrier, the wait for its slowest warp, before the
epilogues); for an attention split its queries and first keys landed, its key loop, its lanes
merged (keys scored), its partial written, its arrival counted and, on the split that arrives last,
the head's combine. `--chrome` also writes the step as Chrome trace events, a track
per block, to open in Perfetto (ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from lithos.custom_calls.megakernel.tasks import FIELDS, NO_COUNTER, ModelShape, Op
from lithos.custom_calls.packed_weights import FORMAT_NAMES
from lithos.quant import get_format

TIMES = ("block", "begin", "ready", "end")
# Marks inside a task (csrc/mk_common.h kTracePhases), in the order a task reaches them; 0 where a task
# has none (the phases its kind does not mark, and every phase of an attention split past the step's
# plan). Per task kind, the names of the phases that end at its marks and then at its end:
PHASES = ("phase0", "phase1", "phase2", "phase3", "phase4")
MATVEC_PHASES = ("staged", "dots", "epilogues", "signal")
# A task in fragment tiles reduces its warps' sums after a block barrier: the wait for its slowest warp apart.
TILED_MATVEC_PHASES = ("staged", "dots", "barrier", "epilogues", "signal")
ATTENTION_PHASES = ("inputs", "looped", "scored", "written", "arrived", "combined")
# Traces with three marks (before the attention's queries-landed and loop-done marks).
ATTENTION_PHASES_3 = ("scored", "written", "arrived", "combined")
BF16_BYTES = 2
# The weights each matvec stage reads (csrc/megakernel.cu kWeightNames).
STAGE_WEIGHTS = {
    Op.QKV: ("wq", "wk", "wv"),
    Op.O_PROJ: ("wo",),
    Op.GATE_UP: ("w_gate", "w_up"),
    Op.DOWN: ("w_down",),
    Op.HEAD: ("lm_head",),
}


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """One traced step: the task list `tasks` `[n, len(FIELDS)]` and, per task, its block and its
    times in ns from the step's first begin."""

    shape: ModelShape
    grid: int
    tokens: int
    context: int  # keys the step's last query sees (its position + 1, at most the cache's slots)
    tasks: np.ndarray
    block: np.ndarray
    begin: np.ndarray
    ready: np.ndarray
    end: np.ndarray
    phases: np.ndarray | None = None  # [n, 5 or 3] like the times, NaN where unmarked; None in older traces
    formats: dict[str, str] | None = None  # weight name -> the format the build read it in; None: bf16 (older traces)

    @property
    def step_ns(self) -> float:
        return float(self.end.max() - self.begin.min())


def load(path: str | Path) -> StepTrace:
    record = json.loads(Path(path).read_text())
    fields = list(record["fields"])
    if fields not in ([*FIELDS, *TIMES, *PHASES], [*FIELDS, *TIMES, *PHASES[:3]], [*FIELDS, *TIMES]):
        raise ValueError(f"{path}: trace fields {fields} are not this lithos's {[*FIELDS, *TIMES, *PHASES]}")
    rows = np.asarray(record["tasks"], np.int64).reshape(-1, len(fields))
    times = slice(len(FIELDS) + 1, len(FIELDS) + len(TIMES))
    if (rows[:, times] == 0).any():
        raise ValueError(f"{path}: some tasks have no times: the step did not finish (it aborted)")
    epoch, ns_per_tick = rows[:, len(FIELDS) + 1].min(), float(record["ns_per_tick"])
    ticks = (rows[:, times] - epoch).astype(np.float64) * ns_per_tick
    phases = None
    if len(fields) > len(FIELDS) + len(TIMES):
        marks = rows[:, len(FIELDS) + len(TIMES) :]
        phases = np.where(marks == 0, np.nan, (marks - epoch).astype(np.float64) * ns_per_tick)
    shape = ModelShape(
        **{k: int(record[k]) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")}
    )
    context = min(max(record["positions"]) + 1, int(record["slots"]))
    formats = None
    if "formats" in record:  # traces from before the handler wrote them have none
        formats = {name: FORMAT_NAMES[int(code)] for name, code in record["formats"].items()}
    return StepTrace(
        shape,
        int(record["grid"]),
        int(record["tokens"]),
        context,
        rows[:, : len(FIELDS)],
        rows[:, len(FIELDS)],
        ticks[:, 0],
        ticks[:, 1],
        ticks[:, 2],
        phases,
        formats,
    )


def weight_bytes(rows: int, cols: int, fmt: str) -> int:
    """Bytes of a `[rows, cols]` weight stored in `fmt` (every plane of a packed one)."""
    if fmt == "bfloat16":
        return rows * cols * BF16_BYTES
    planes = get_format(fmt).plane_shapes((rows, cols)).values()
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in planes)


def stage_bytes(shape: ModelShape, op: Op, context: int, formats: dict[str, str] | None = None) -> int:
    """Bytes one stage of `op` must read: its weights in the formats the build read them in (bf16 where
    `formats` is None), or for attention the keys and values."""
    s = shape
    if op == Op.ATTENTION:
        return 2 * s.kv_heads * context * s.head_dim * BF16_BYTES
    rows = {
        "wq": s.heads * s.head_dim,
        "wk": s.kv_heads * s.head_dim,
        "wv": s.kv_heads * s.head_dim,
        "wo": s.hidden,
        "w_gate": s.ffn,
        "w_up": s.ffn,
        "w_down": s.hidden,
        "lm_head": s.vocab,
    }
    fmt = formats or {}
    return sum(weight_bytes(rows[w], s.input_size(op), fmt.get(w, "bfloat16")) for w in STAGE_WEIGHTS[op])


@dataclasses.dataclass(frozen=True)
class Stage:
    op: Op
    layer: int
    tasks: int
    start: float  # first task's inputs ready, ns
    finish: float  # last task's signal, ns
    handoff: float  # start minus the previous stage's finish, ns
    work: float  # mean per task of end - ready, ns
    slowest: float  # the longest task's end - ready, ns
    wait: float  # mean per task of ready - begin, ns
    bytes: int

    @property
    def span(self) -> float:
        return self.finish - self.start


def stages(trace: StepTrace) -> list[Stage]:
    """The step's stages in list order: runs of consecutive tasks of one kind and layer."""
    ops, layers = trace.tasks[:, FIELDS.index("op")], trace.tasks[:, FIELDS.index("layer")]
    cuts = np.flatnonzero((np.diff(ops) != 0) | (np.diff(layers) != 0)) + 1
    out: list[Stage] = []
    previous_finish = 0.0
    for run in np.split(np.arange(len(ops)), cuts):
        op = Op(int(ops[run[0]]))
        ready, end = trace.ready[run], trace.end[run]
        start, finish = float(ready.min()), float(end.max())
        out.append(
            Stage(
                op,
                int(layers[run[0]]),
                len(run),
                start,
                finish,
                start - previous_finish,
                float((end - ready).mean()),
                float((end - ready).max()),
                float((ready - trace.begin[run]).mean()),
                stage_bytes(trace.shape, op, trace.context, trace.formats),
            )
        )
        previous_finish = finish
    return out


def _signal_times(trace: StepTrace) -> dict[int, np.ndarray]:
    """Per counter, the earliest each of its signals can have been sent: a task's signal comes after its
    inputs were ready; an attention head's combine signal (`aux`) after every split of the head was."""
    col = {name: trace.tasks[:, FIELDS.index(name)] for name in ("op", "signal_counter", "aux")}
    times: dict[int, list[float]] = {}
    for i in range(len(trace.tasks)):
        times.setdefault(int(col["signal_counter"][i]), []).append(float(trace.ready[i]))
    attention = col["op"] == Op.ATTENTION
    for head_counter in np.unique(col["signal_counter"][attention]):
        splits = attention & (col["signal_counter"] == head_counter)
        combined = int(col["aux"][splits][0])
        times.setdefault(combined, []).append(float(trace.ready[splits].max()))
    return {c: np.sort(np.asarray(t)) for c, t in times.items()}


def causality_violations(trace: StepTrace, slack_ns: float = 0.0) -> list[int]:
    """Tasks whose inputs were ready before enough producers could have signalled: task i waits for
    `wait_target` signals on `wait_counter`, so the wait_target-th earliest of those signals must precede
    i's ready time. Empty for a correct kernel (the hand-off protocol of csrc/mk_common.h); `slack_ns`
    allows for the clock's granularity."""
    wait_c, target = trace.tasks[:, FIELDS.index("wait_counter")], trace.tasks[:, FIELDS.index("wait_target")]
    signals = _signal_times(trace)
    bad = []
    for i in np.flatnonzero(wait_c != NO_COUNTER):
        sent = signals.get(int(wait_c[i]), np.empty(0))
        if len(sent) < target[i] or sent[target[i] - 1] > trace.ready[i] + slack_ns:
            bad.append(int(i))
    return bad


def summary(trace: StepTrace) -> list[dict]:
    """Per task kind, averaged over its stages (the layers): what the table of `main` prints."""
    rows = []
    all_stages = stages(trace)
    for op in Op:
        of_op = [s for s in all_stages if s.op == op]
        if not of_op:
            continue
        span = float(np.mean([s.span for s in of_op]))
        rows.append(
            {
                "op": op.name.lower(),
                "stages": len(of_op),
                "tasks": of_op[0].tasks,
                "span_us": span / 1e3,
                "handoff_us": float(np.mean([s.handoff for s in of_op])) / 1e3,
                "task_us": float(np.mean([s.work for s in of_op])) / 1e3,
                "slowest_task_us": float(np.mean([s.slowest for s in of_op])) / 1e3,
                "wait_us": float(np.mean([s.wait for s in of_op])) / 1e3,
                "mb": of_op[0].bytes / 1e6,
                "gb_per_s": of_op[0].bytes / span if span > 0 else float("nan"),
                "total_us": sum(s.span + max(s.handoff, 0.0) for s in of_op) / 1e3,
            }
        )
    return rows


def _phase_marks(trace: StepTrace) -> np.ndarray:
    """Per task the times its phases end at, `[n, 2 + marks]`: its ready time, its marks, its end."""
    return np.column_stack([trace.ready, trace.phases, trace.end])


def _phase_columns(trace: StepTrace, op: Op) -> tuple[tuple[str, ...], list[int]]:
    """The names of a task kind's phases and the columns of `_phase_marks` they start and end at: phase
    k runs from column columns[k] to columns[k + 1] (its marks in order, then its end)."""
    if op == Op.ATTENTION:
        names = ATTENTION_PHASES if trace.phases.shape[1] == len(PHASES) else ATTENTION_PHASES_3
    else:
        of_op = trace.tasks[:, FIELDS.index("op")] == op
        tiled = trace.phases.shape[1] > 3 and not np.isnan(trace.phases[of_op, 3]).all()
        names = TILED_MATVEC_PHASES if tiled else MATVEC_PHASES
    return names, [0, *range(1, len(names)), trace.phases.shape[1] + 1]


def _combining_splits(trace: StepTrace) -> np.ndarray:
    """Per task, whether it is the attention split that combined its head (and layer): the one that ends
    last, the combine being after every split's arrival (arrivals themselves can tie on a coarse clock)."""
    ops = trace.tasks[:, FIELDS.index("op")]
    heads = trace.tasks[:, FIELDS.index("signal_counter")]
    attention = ops == Op.ATTENTION
    last = np.zeros(len(ops), bool)
    for counter in np.unique(heads[attention]):
        splits = np.flatnonzero(attention & (heads == counter))
        last[splits[np.argmax(trace.end[splits])]] = True
    return last


def phase_summary(trace: StepTrace) -> list[dict]:
    """Per task kind, where a task's time goes from its inputs being ready to its end: the mean time of
    each phase (MATVEC_PHASES, ATTENTION_PHASES) over the tasks that marked it, in us. An attention
    head's combine is timed on the split that arrived last (the one that runs it); empty for a trace
    without phase marks."""
    if trace.phases is None:
        return []
    ops = trace.tasks[:, FIELDS.index("op")]
    marks = _phase_marks(trace)
    combining = _combining_splits(trace)
    rows = []
    for op in Op:
        of_op = ops == op
        names, columns = _phase_columns(trace, op)
        # An attention split's last phase is the combine, which only the head's last split runs.
        of_phase = [of_op] * (len(names) - 1) + [combining if op == Op.ATTENTION else of_op]
        durations = {}
        for k, name in enumerate(names):
            d = (marks[:, columns[k + 1]] - marks[:, columns[k]])[of_phase[k]]
            d = d[~np.isnan(d)]
            if len(d):
                durations[name] = float(d.mean()) / 1e3
        if durations:
            rows.append({"op": op.name.lower(), **durations})
    return rows


def chrome_trace(trace: StepTrace) -> dict:
    """The step as Chrome trace events (chrome://tracing, Perfetto): a track per block, on it each task's
    wait and the task itself (named by kind and layer), with its phases nested inside."""
    ops = trace.tasks[:, FIELDS.index("op")]
    layers = trace.tasks[:, FIELDS.index("layer")]
    marks = _phase_marks(trace) if trace.phases is not None else None
    phase_columns = {op: _phase_columns(trace, op) for op in Op} if marks is not None else {}  # once a kind
    combining = _combining_splits(trace)
    events = []

    def slice_(name: str, start: float, end: float, block: int, args: dict | None = None) -> None:
        if np.isnan(start) or np.isnan(end) or end < start:
            return
        event = {"name": name, "ph": "X", "ts": start / 1e3, "dur": (end - start) / 1e3, "pid": 0, "tid": int(block)}
        events.append(event | ({"args": args} if args else {}))

    for i in range(len(ops)):
        op, block = Op(int(ops[i])), trace.block[i]
        fields = {name: int(v) for name, v in zip(FIELDS, trace.tasks[i], strict=True)}
        if trace.ready[i] > trace.begin[i]:
            slice_("wait", trace.begin[i], trace.ready[i], block)
        slice_(f"{op.name.lower()} {int(layers[i])}", trace.ready[i], trace.end[i], block, {"task": i, **fields})
        if marks is None:
            continue
        names, columns = phase_columns[op]
        for k, name in enumerate(names):
            if op == Op.ATTENTION and k == len(names) - 1 and not combining[i]:
                continue  # only the head's last split combines
            slice_(name, marks[i, columns[k]], marks[i, columns[k + 1]], block)
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": int(b), "args": {"name": f"block {int(b)}"}}
        for b in np.unique(trace.block)
    ]
    s = trace.shape
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {"step_us": trace.step_ns / 1e3, "tokens": trace.tokens, "context": trace.context, **vars(s)},
    }


def format_phases(trace: StepTrace) -> list[str]:
    lines = []
    for r in phase_summary(trace):
        names = [k for k in r if k != "op"]
        lines.append(f"{r['op']:<10}" + "".join(f"{name:>11}{r[name]:6.2f}" for name in names))
    if lines:
        lines.insert(0, "phases, us per task after its wait (attention's combine: on each head's last split)")
    return lines


def format_summary(trace: StepTrace) -> str:
    s = trace.shape
    lines = [
        f"step {trace.step_ns / 1e3:.1f} us: {s.layers} layers, hidden {s.hidden}, ffn {s.ffn}, {trace.tokens} "
        f"token(s), context {trace.context}, grid {trace.grid} blocks",
        f"{'stage':<10}{'n':>4}{'tasks':>6}{'span us':>9}{'handoff':>9}{'task us':>9}{'slowest':>9}"
        f"{'wait us':>9}{'MB':>8}{'GB/s':>7}{'total us':>10}",
    ]
    for r in summary(trace):
        lines.append(
            f"{r['op']:<10}{r['stages']:>4}{r['tasks']:>6}{r['span_us']:>9.2f}{r['handoff_us']:>9.2f}"
            f"{r['task_us']:>9.2f}{r['slowest_task_us']:>9.2f}{r['wait_us']:>9.2f}{r['mb']:>8.2f}"
            f"{r['gb_per_s']:>7.0f}{r['total_us']:>10.1f}"
        )
    lines.append(
        "span: first input ready to last signal; handoff: previous stage's last signal to this one's first "
        "start; total: spans + positive hand-offs over the layers"
    )
    if trace.formats is None:
        lines.append("MB: the weights counted in bf16 (a trace from a build that did not record its formats)")
    else:
        read_in = ", ".join(f"{w} {f}" for w, f in trace.formats.items())
        lines.append(f"MB: the weights in the formats the build read ({read_in})")
    return "\n".join(lines + format_phases(trace))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise a megakernel step trace (LITHOS_MEGAKERNEL_TRACE).")
    parser.add_argument("trace", type=Path)
    parser.add_argument("--json", action="store_true", help="print the per-kind summary and phases as JSON")
    parser.add_argument("--chrome", type=Path, help="also write the step as Chrome trace events (Perfetto) here")
    args = parser.parse_args(argv)
    trace = load(args.trace)
    if args.chrome:
        args.chrome.write_text(json.dumps(chrome_trace(trace)))
    if args.json:
        print(json.dumps({"stages": summary(trace), "phases": phase_summary(trace)}, indent=1))
    else:
        print(format_summary(trace))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
