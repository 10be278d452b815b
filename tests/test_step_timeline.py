"""lithos.step_timeline reads a profiler trace's device streams into per-step figures."""

from __future__ import annotations

import gzip
import json

import pytest

from lithos import step_timeline
from lithos.errors import LithosError


def trace_of(steps: int) -> dict:
    """A Perfetto-style trace of `steps` decode steps on one GPU stream: per step a 2 us memset, a 100 us
    megakernel and a 3 us fusion, with 5 us idle before the next step's memset. The host process and the
    device's annotation thread (which repeats the stream's activity) must not count."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    t = 1000.0
    for _ in range(steps):
        for name, dur in (("Memset (Device)", 2.0), ("lithos::mk::megakernel<1>", 100.0), ("loop_add_fusion", 3.0)):
            events.append({"ph": "X", "pid": 2, "tid": 7, "ts": t, "dur": dur, "name": name})
            events.append({"ph": "X", "pid": 2, "tid": 9, "ts": t, "dur": dur, "name": name})  # an annotation
            events.append({"ph": "X", "pid": 1, "tid": 1, "ts": t, "dur": 50.0, "name": "host work"})
            t += dur
        t += 5.0
    return {"traceEvents": events}


def test_summary_counts_each_steps_kernels_and_idle_time():
    summary = step_timeline.summarize(step_timeline.device_events(trace_of(5)), anchor="megakernel")
    # 5 anchors bound 4 whole steps, each 2 + 100 + 3 + 5 us from megakernel start to megakernel start.
    assert summary["steps"] == 4
    assert summary["period_us"] == pytest.approx(110.0)
    assert summary["idle_us"] == pytest.approx(5.0)
    by_name = {k["name"]: k for k in summary["kernels"]}
    assert set(by_name) == {"Memset (Device)", "lithos::mk::megakernel<1>", "loop_add_fusion"}
    assert summary["kernels"][0]["name"] == "lithos::mk::megakernel<1>"  # the most time first
    assert by_name["loop_add_fusion"]["per_step"] == pytest.approx(1.0)
    assert by_name["Memset (Device)"]["us_per_step"] == pytest.approx(2.0)


def test_overlapping_activities_count_once_as_busy():
    trace = trace_of(3)
    trace["traceEvents"].append({"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8"}})
    # A copy on a second stream during the first step's megakernel: busy already, so no less idle time.
    trace["traceEvents"].append({"ph": "X", "pid": 2, "tid": 8, "ts": 1010.0, "dur": 20.0, "name": "copy"})
    summary = step_timeline.summarize(step_timeline.device_events(trace), anchor="megakernel")
    assert summary["idle_us"] == pytest.approx(5.0)


def test_an_anchor_that_does_not_repeat_names_the_kernels_seen():
    with pytest.raises(LithosError, match="loop_add_fusion"):
        step_timeline.summarize(step_timeline.device_events(trace_of(3)), anchor="lm_head")


def test_the_command_reads_a_saved_trace(tmp_path, capsys):
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace_of(4), f)
    out = tmp_path / "summary.json"
    assert step_timeline.main(["--trace", str(path), "--out", str(out)]) == 0
    assert "3 steps: 110.0 us each, device idle 5.0 us" in capsys.readouterr().out
    assert json.loads(out.read_text())["kernels"][0]["name"] == "lithos::mk::megakernel<1>"


def test_a_trace_without_device_activity_says_so():
    host_only = {"traceEvents": [e for e in trace_of(3)["traceEvents"] if e["pid"] == 1]}
    with pytest.raises(LithosError, match="no device activity"):
        step_timeline.summarize(step_timeline.device_events(host_only), anchor="megakernel")


def test_without_stream_names_every_thread_but_the_annotations_counts():
    trace = trace_of(3)
    for e in trace["traceEvents"]:
        if e.get("name") == "thread_name" and e["tid"] == 7:
            e["args"]["name"] = "GPU 0"  # a device that does not name its streams
    events = step_timeline.device_events(trace)
    assert len(events) == 9  # three steps of three activities, the "XLA Ops" repeats left out
    trace["traceEvents"].append({"ph": "X", "pid": 2, "tid": 9, "ts": 5000.0, "dur": 1.0, "name": "an op"})
    assert len(step_timeline.device_events(trace)) == 9


def test_profile_steps_times_the_weight_format_asked_for(monkeypatch):
    """`--weight-format` makes the shape's weights as `lithos bench` does (here Q8_0 codes), and the loop that is
    profiled reads them."""
    from lithos import bench

    seen = {}
    steps = bench._steps

    def spy(params, state, cfg, n, kernels, *args, **kwargs):
        seen["format"] = params.layers.wq.format.name
        return steps(params, state, cfg, n, kernels, *args, **kwargs)

    monkeypatch.setattr(bench, "_steps", spy)
    shape = dict(shape="smollm2-135m", kernels="reference", context=16, steps=2)
    args = step_timeline.argparse.Namespace(**shape, weight_format="q8_0", quantize_groups="attention")
    trace = step_timeline.profile_steps(args)
    assert seen["format"] == "q8_0" and trace["traceEvents"]



def test_profile_steps_lays_the_weights_out_for_the_kernels(monkeypatch):
    """The loop traced reads the params `lithos bench` times: laid out for the kernel path (a Q4_K_M file's Q/K/V
    in one format on the fused path, llama.qkv_in_one_format), not as made."""
    import lithos.models
    from lithos import bench

    seen = {}

    class Seen(Exception):
        pass

    def lay_out(params, cfg, kernels):
        seen["kernels"] = kernels
        seen["laid_out"] = step_timeline.argparse.Namespace(embed=params.embed)  # a stand-in the loop must get
        return seen["laid_out"]

    def spy(params, state, cfg, n, kernels, *args, **kwargs):
        seen["params"] = params
        raise Seen

    monkeypatch.setattr(lithos.models, "params_for_kernels", lay_out)
    monkeypatch.setattr(bench, "_steps", spy)
    args = step_timeline.argparse.Namespace(
        shape="smollm2-135m", kernels="fused", context=16, steps=2, weight_format=None, quantize_groups="attention"
    )
    with pytest.raises(Seen):
        step_timeline.profile_steps(args)
    assert seen["kernels"] == "fused" and seen["params"] is seen["laid_out"]
