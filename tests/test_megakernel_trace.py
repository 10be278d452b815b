"""The megakernel trace reader (lithos.custom_calls.megakernel.trace) on traces in the kernel's JSON
format, made here by running a schedule on simulated blocks with known task durations. The kernel's
own traces are checked on the GPU (tests/test_megakernel_gpu.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from lithos.custom_calls.megakernel import build_schedule
from lithos.custom_calls.megakernel import trace as mk_trace
from lithos.custom_calls.megakernel.tasks import FIELDS, NO_COUNTER, Op

from .test_megakernel import SHAPES

DURATION_NS = {Op.QKV: 3000, Op.ATTENTION: 2000, Op.O_PROJ: 2500, Op.GATE_UP: 9000, Op.DOWN: 5000, Op.HEAD: 20000}
# Where a task's duration goes: the shares of the phases that end at its marks (the rest is the last
# phase); a matvec task marks three phases, an attention split five.
PHASE_SHARES = (0.1, 0.6, 0.2)
ATTENTION_SHARES = (0.1, 0.3, 0.1, 0.2, 0.1)
COMBINE_NS = 400  # what the last split of an attention head adds to its duration
HANDOFF_NS = 700  # from a producer's signal to a waiting consumer's start
EPOCH = 5_000_000_000  # the global timer does not start at zero


def simulated_trace(schedule, grid: int, context: int) -> dict:
    """Block b runs tasks b, b + grid, ... as the kernel does; a task starts when its block is free and
    its counter has its signals (plus the hand-off), and signals DURATION_NS[op] later."""
    free = [0] * grid
    sent: dict[int, list[int]] = {}
    rows = []
    for i, row in enumerate(schedule.tasks):
        task = dict(zip(FIELDS, (int(v) for v in row), strict=True))
        block = i % grid
        begin = free[block]
        ready = begin
        if task["wait_counter"] != NO_COUNTER:
            ready = max(begin, sorted(sent[task["wait_counter"]])[task["wait_target"] - 1] + HANDOFF_NS)
        duration = DURATION_NS[Op(task["op"])]
        shares = ATTENTION_SHARES if task["op"] == Op.ATTENTION else PHASE_SHARES
        marks = [EPOCH + int(m) for m in ready + np.cumsum(shares) * duration]
        marks += [0] * (len(mk_trace.PHASES) - len(marks))  # phases the kind does not mark
        end = ready + duration
        sent.setdefault(task["signal_counter"], []).append(end)
        if task["op"] == Op.ATTENTION and len(sent[task["signal_counter"]]) == task["arrivals"]:
            end += COMBINE_NS
            sent.setdefault(task["aux"], []).append(end)
        free[block] = end
        rows.append([*row.tolist(), block, EPOCH + begin, EPOCH + ready, EPOCH + end, *marks])
    s = schedule.shape
    return {
        "ns_per_tick": 1.0,
        "grid": grid,
        "layers": s.layers,
        "tokens": 1,
        "hidden": s.hidden,
        "heads": s.heads,
        "kv_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "ffn": s.ffn,
        "vocab": s.vocab,
        "slots": 4096,
        "ring": False,
        "formats": dict.fromkeys(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"), 0),  # bf16
        "positions": [context - 1],
        "fields": [*FIELDS, *mk_trace.TIMES, *mk_trace.PHASES],
        "tasks": rows,
    }


@pytest.fixture
def traced(tmp_path):
    shape = SHAPES["smollm2-like"]
    schedule = build_schedule(shape, 16)
    path = tmp_path / "step.json"
    path.write_text(json.dumps(simulated_trace(schedule, 16, context=1000)))
    return schedule, path


def test_stages_spans_and_handoffs_follow_the_simulated_step(traced):
    schedule, path = traced
    trace = mk_trace.load(path)
    shape = schedule.shape
    assert trace.context == 1000 and trace.grid == 16 and len(trace.tasks) == len(schedule)
    assert trace.begin.min() == 0.0  # times are relative to the step's first task
    stages = mk_trace.stages(trace)
    assert [s.op for s in stages[:5]] == [Op.QKV, Op.ATTENTION, Op.O_PROJ, Op.GATE_UP, Op.DOWN]
    assert len(stages) == 5 * shape.layers + 1 and stages[-1].op == Op.HEAD
    assert sum(s.tasks for s in stages) == len(schedule)
    for stage in stages:
        combine = COMBINE_NS * schedule.shape.kv_heads / stage.tasks if stage.op == Op.ATTENTION else 0
        assert stage.work == pytest.approx(DURATION_NS[stage.op] + combine)  # every task of a kind took its duration
        if stage.op in (Op.O_PROJ, Op.GATE_UP, Op.DOWN, Op.HEAD):
            # Each waits for the whole previous stage: it starts one hand-off after that stage's end.
            assert stage.handoff == HANDOFF_NS
    gate_up = next(s for s in stages if s.op == Op.GATE_UP)
    assert gate_up.bytes == 2 * shape.ffn * shape.hidden * 2
    attention = next(s for s in stages if s.op == Op.ATTENTION)
    assert attention.bytes == 2 * shape.kv_heads * 1000 * shape.head_dim * 2
    assert trace.step_ns == stages[-1].finish


def test_summary_averages_each_kind_over_its_layers(traced, capsys):
    schedule, path = traced
    trace = mk_trace.load(path)
    rows = {r["op"]: r for r in mk_trace.summary(trace)}
    assert set(rows) == {op.name.lower() for op in Op}
    assert rows["gate_up"]["stages"] == schedule.shape.layers and rows["head"]["stages"] == 1
    assert rows["down"]["task_us"] == pytest.approx(DURATION_NS[Op.DOWN] / 1e3)
    assert rows["down"]["handoff_us"] == pytest.approx(HANDOFF_NS / 1e3)
    down = next(s for s in mk_trace.stages(trace) if s.op == Op.DOWN)
    assert rows["down"]["gb_per_s"] == pytest.approx(down.bytes / down.span)
    assert mk_trace.main([str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"step {trace.step_ns / 1e3:.1f} us") and "gate_up" in printed


def test_phases_split_each_kind_of_task_and_time_the_combine_on_the_last_split(traced, capsys):
    _, path = traced
    phases = {r["op"]: r for r in mk_trace.phase_summary(mk_trace.load(path))}
    assert set(phases) == {op.name.lower() for op in Op}
    down = DURATION_NS[Op.DOWN] / 1e3
    expected = [share * down for share in PHASE_SHARES] + [down * (1 - sum(PHASE_SHARES))]
    assert [phases["down"][k] for k in mk_trace.MATVEC_PHASES] == pytest.approx(expected, abs=1e-3)
    attention = DURATION_NS[Op.ATTENTION] / 1e3
    names = mk_trace.ATTENTION_PHASES
    assert [phases["attention"][k] for k in names[:-1]] == pytest.approx(
        [share * attention for share in ATTENTION_SHARES], abs=1e-3
    )
    # Only the split that arrives last combines: its last phase is the rest of its duration and the combine.
    rest = attention * (1 - sum(ATTENTION_SHARES)) + COMBINE_NS / 1e3
    assert phases["attention"]["combined"] == pytest.approx(rest, abs=1e-3)
    assert mk_trace.main([str(path)]) == 0
    assert "looped" in capsys.readouterr().out


def test_a_tiled_matvec_times_its_block_barrier_apart(traced, capsys):
    """A task in fragment tiles marks its block's barrier between its dot products and its epilogues (the wait for
    its slowest warp): its kind gets TILED_MATVEC_PHASES, the others keep theirs."""
    _, path = traced
    record = json.loads(path.read_text())
    first_mark = len(FIELDS) + len(mk_trace.TIMES)
    barrier_ns = 300
    for row in record["tasks"]:
        if row[0] == Op.GATE_UP:  # its marks: staged, dots, then the barrier before the epilogues' end
            staged, dots, epilogues = row[first_mark : first_mark + 3]
            row[first_mark : first_mark + 4] = [staged, dots, dots + barrier_ns, epilogues]
    path.write_text(json.dumps(record))
    phases = {r["op"]: r for r in mk_trace.phase_summary(mk_trace.load(path))}
    assert list(phases["gate_up"])[1:] == list(mk_trace.TILED_MATVEC_PHASES)
    assert list(phases["down"])[1:] == list(mk_trace.MATVEC_PHASES)
    gate_up = DURATION_NS[Op.GATE_UP] / 1e3
    assert phases["gate_up"]["barrier"] == pytest.approx(barrier_ns / 1e3, abs=1e-3)
    assert phases["gate_up"]["epilogues"] == pytest.approx(PHASE_SHARES[2] * gate_up - barrier_ns / 1e3, abs=1e-3)
    assert phases["gate_up"]["signal"] == pytest.approx((1 - sum(PHASE_SHARES)) * gate_up, abs=1e-3)
    assert mk_trace.main([str(path)]) == 0
    assert "barrier" in capsys.readouterr().out


def test_a_trace_with_three_marks_per_task_reads_with_the_older_names(traced):
    """Traces recorded before the attention's first two marks have three phase fields: matvec phases as
    now, attention's scored, written, arrived and combined."""
    _, path = traced
    record = json.loads(path.read_text())
    attention = [row[0] == Op.ATTENTION for row in record["tasks"]]
    first_mark = len(FIELDS) + len(mk_trace.TIMES)
    record["fields"] = record["fields"][: first_mark + 3]
    # An attention split's three marks were its scored, written and arrived: today's last three.
    record["tasks"] = [
        row[:first_mark] + (row[first_mark + 2 :] if is_attention else row[first_mark : first_mark + 3])
        for row, is_attention in zip(record["tasks"], attention, strict=True)
    ]
    path.write_text(json.dumps(record))
    phases = {r["op"]: r for r in mk_trace.phase_summary(mk_trace.load(path))}
    attention_us = DURATION_NS[Op.ATTENTION] / 1e3
    assert list(phases["attention"])[1:] == list(mk_trace.ATTENTION_PHASES_3)
    scored = sum(ATTENTION_SHARES[:3]) * attention_us  # the first three phases of today, in one
    assert phases["attention"]["scored"] == pytest.approx(scored, abs=1e-3)
    assert phases["attention"]["written"] == pytest.approx(ATTENTION_SHARES[3] * attention_us, abs=1e-3)
    down = DURATION_NS[Op.DOWN] / 1e3
    assert phases["down"]["dots"] == pytest.approx(PHASE_SHARES[1] * down, abs=1e-3)


def test_stage_bytes_count_the_weights_in_the_formats_the_build_read(traced, capsys):
    """An MXFP4 build (attention and MLP, bf16 head): 4 bits a weight and an 8-bit scale every 32."""
    schedule, path = traced
    record = json.loads(path.read_text())
    record["formats"] = {**dict.fromkeys(record["formats"], 1), "lm_head": 0}
    path.write_text(json.dumps(record))
    trace = mk_trace.load(path)
    shape = schedule.shape
    assert trace.formats == {**dict.fromkeys(record["formats"], "mxfp4"), "lm_head": "bfloat16"}
    of = {s.op: s.bytes for s in mk_trace.stages(trace)}
    mxfp4 = 4.25 / 8  # bytes a weight
    assert of[Op.GATE_UP] == 2 * shape.ffn * shape.hidden * mxfp4
    assert of[Op.DOWN] == shape.hidden * shape.ffn * mxfp4
    assert of[Op.QKV] == (shape.heads + 2 * shape.kv_heads) * shape.head_dim * shape.hidden * mxfp4
    assert of[Op.HEAD] == shape.vocab * shape.hidden * 2
    assert of[Op.ATTENTION] == 2 * shape.kv_heads * 1000 * shape.head_dim * 2  # the cache stays bf16
    assert mk_trace.main([str(path)]) == 0
    assert "w_down mxfp4" in capsys.readouterr().out


def test_a_trace_without_formats_counts_bf16_weights_and_says_so(traced, capsys):
    _, path = traced
    record = json.loads(path.read_text())
    del record["formats"]
    path.write_text(json.dumps(record))
    trace = mk_trace.load(path)
    assert trace.formats is None
    gate_up = next(s for s in mk_trace.stages(trace) if s.op == Op.GATE_UP)
    assert gate_up.bytes == 2 * trace.shape.ffn * trace.shape.hidden * 2
    assert mk_trace.main([str(path)]) == 0
    assert "counted in bf16" in capsys.readouterr().out


def test_a_trace_without_phase_marks_still_reads(traced):
    _, path = traced
    record = json.loads(path.read_text())
    record["fields"] = record["fields"][: -len(mk_trace.PHASES)]
    record["tasks"] = [row[: -len(mk_trace.PHASES)] for row in record["tasks"]]
    path.write_text(json.dumps(record))
    trace = mk_trace.load(path)
    assert trace.phases is None and mk_trace.phase_summary(trace) == []
    assert mk_trace.stages(trace)


def test_causality_check_accepts_the_protocol_and_flags_an_early_start(traced):
    schedule, path = traced
    record = json.loads(path.read_text())
    assert mk_trace.causality_violations(mk_trace.load(path)) == []
    # The first O projection task claims its inputs were ready before any attention head combined.
    first_o = next(i for i, row in enumerate(record["tasks"]) if row[0] == Op.O_PROJ)
    ready = len(FIELDS) + 2  # after the task fields: block, begin, ready, end
    record["tasks"][first_o][ready] = EPOCH + 1
    path.write_text(json.dumps(record))
    assert mk_trace.causality_violations(mk_trace.load(path)) == [first_o]


def test_an_unfinished_step_or_another_format_is_refused(traced):
    _, path = traced
    record = json.loads(path.read_text())
    record["tasks"][3][len(FIELDS) + 3] = 0  # the step aborted before task 3 signalled
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="did not finish"):
        mk_trace.load(path)
    record["fields"] = record["fields"][1:]
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="trace fields"):
        mk_trace.load(path)


def test_times_use_the_clock_rate(traced, tmp_path):
    _, path = traced
    record = json.loads(path.read_text())
    record["ns_per_tick"] = 10.0  # a 100 MHz wall clock (HIP)
    slow_path = tmp_path / "slow.json"
    slow_path.write_text(json.dumps(record))
    slow, fast = mk_trace.load(slow_path), mk_trace.load(path)
    assert slow.step_ns == pytest.approx(10 * fast.step_ns)
    np.testing.assert_allclose(slow.ready, 10 * fast.ready)


def test_the_kernel_names_the_fields_as_the_task_format_does():
    """The trace's field names come from csrc/mk_common.h kFieldNames: the same list as tasks.py FIELDS."""
    header = Path(mk_trace.__file__).parents[1] / "csrc" / "mk_common.h"
    names = re.search(r"kFieldNames\[kFields\] = \{([^}]*)\}", header.read_text())
    assert names is not None
    assert tuple(re.findall(r'"(\w+)"', names.group(1))) == FIELDS


def test_chrome_events_put_each_task_and_its_phases_on_its_blocks_track(traced, tmp_path):
    schedule, path = traced
    trace = mk_trace.load(path)
    out = tmp_path / "events.json"
    assert mk_trace.main([str(path), "--chrome", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    tasks = [e for e in events if e["ph"] == "X" and "args" in e]
    assert len(tasks) == len(schedule)
    for e in tasks:
        i = e["args"]["task"]
        assert e["tid"] == trace.block[i] and e["name"].split()[0] == Op(e["args"]["op"]).name.lower()
        assert e["ts"] == pytest.approx(trace.ready[i] / 1e3) and e["dur"] == pytest.approx(
            (trace.end[i] - trace.ready[i]) / 1e3
        )
    # Phases nest inside their task: a matvec task has four, an attention split five, six on the split that
    # combined its head.
    phases = [e for e in events if e["ph"] == "X" and "args" not in e and e["name"] != "wait"]
    names = {e["name"] for e in phases}
    assert set(mk_trace.MATVEC_PHASES) | set(mk_trace.ATTENTION_PHASES) == names
    attention = sum(1 for row in schedule.tasks if row[0] == Op.ATTENTION)
    heads = schedule.shape.kv_heads * schedule.shape.layers
    assert len(phases) == 4 * (len(schedule) - attention) + 5 * attention + heads
    for e in phases:
        inside = [t for t in tasks if t["tid"] == e["tid"] and t["ts"] <= e["ts"] + 1e-9]
        task = max(inside, key=lambda t: t["ts"])
        assert e["ts"] + e["dur"] <= task["ts"] + task["dur"] + 1e-6
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {f"block {b}" for b in range(16)}
