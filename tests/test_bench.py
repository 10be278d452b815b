"""What a benchmark record says about the run that made it."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos import bench
from lithos.errors import LithosError
from lithos.models import init_model_cache, llama


def test_the_record_names_the_kernel_build_variant(monkeypatch):
    """A build variant (LITHOS_KERNEL_DEFINES) is part of what was measured, so the record keeps it."""
    monkeypatch.setenv("LITHOS_KERNEL_DEFINES", "LITHOS_TWO_BUCKETS=1 LITHOS_MK_LANE_RING=3")
    assert bench.environment()["kernel_defines"] == ["LITHOS_TWO_BUCKETS=1", "LITHOS_MK_LANE_RING=3"]
    monkeypatch.delenv("LITHOS_KERNEL_DEFINES")
    assert bench.environment()["kernel_defines"] == []


def test_the_record_names_the_sources_it_ran(tmp_path):
    """A digest of the package's sources in every record: a file's change moves it, a compiled cache does not."""
    package = tmp_path / "lithos"
    (package / "csrc").mkdir(parents=True)
    (package / "step.py").write_text("x = 1\n")
    (package / "csrc" / "kernel.cu").write_text("// kernel\n")
    first = bench.source_digest(package)
    (package / "step.cpython-311.pyc").write_bytes(b"\0")
    assert bench.source_digest(package) == first
    (package / "csrc" / "kernel.cu").write_text("// kernel, changed\n")
    assert bench.source_digest(package) != first
    assert bench.environment()["lithos_source_sha256"] == bench.source_digest()


def test_the_record_names_the_knobs_set_in_the_environment(monkeypatch):
    """Every LITHOS_* variable set when a bench ran (e.g. the matrix groups the megakernel reads in tiles) is in its
    record."""
    monkeypatch.setenv("LITHOS_TILES", "gate_up,down")
    monkeypatch.setenv("NOT_LITHOS", "x")
    env = bench.environment()["lithos_environment"]
    assert env["LITHOS_TILES"] == "gate_up,down" and "NOT_LITHOS" not in env
    monkeypatch.delenv("LITHOS_TILES")
    assert "LITHOS_TILES" not in bench.environment()["lithos_environment"]


def test_unrolled_timing_loop_decodes_the_same_tokens():
    """Steps per loop iteration (`unroll`, benchmarks/probes/step_overhead.py) change how the timed loop
    is laid out, not what it computes: the same tokens, positions and cache as one step per iteration."""
    cfg = llama.Config(
        architecture="LlamaForCausalLM",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    params = llama.init_params(cfg, jax.random.key(1), jnp.float32)

    def run(unroll: int):
        state = bench.decode_state(init_model_cache(cfg, 1, 24, jnp.float32), context=8)
        return bench._steps(params, state, cfg, 8, "reference", unroll=unroll)

    one, four = run(1), run(4)
    assert int(one.position[0]) == int(four.position[0]) == 16
    assert int(one.last_token[0]) == int(four.last_token[0])
    np.testing.assert_array_equal(np.asarray(one.cache.k), np.asarray(four.cache.k))
    assert np.abs(np.asarray(one.cache.k[:, :, :, 8:16])).sum() > 0  # the steps wrote their keys


def test_loop_timing_needs_128_steps_a_path():
    """BENCHMARKS.md: a step time is a median over at least 128 steps; the record says how they ran."""
    timing = bench.LoopTiming(steps=32, loops=4, runs=1)
    assert "1 timed runs, each 4 device loops of 32 steps dispatched back to back" in timing.describe()
    assert bench.LoopTiming(steps=32, loops=1, runs=4).describe().endswith("each one device loop of 32 steps")
    with pytest.raises(LithosError, match=r"at least 128 .* got 32 x 1 x 3"):
        bench.LoopTiming(steps=32, loops=1, runs=3)
    with pytest.raises(LithosError, match="each at least 1"):
        bench.LoopTiming(steps=256, loops=0, runs=1)


def test_a_probe_record_names_its_date_device_command_and_environment(tmp_path, monkeypatch):
    """benchmarks/probes write their JSON through bench.write_probe_record: BENCHMARKS.md's fields, one place."""
    monkeypatch.setattr("sys.argv", ["probe.py", "--shape", "tiny"])
    path = bench.write_probe_record(tmp_path / "out", "probe-test", "benchmarks/probes/probe.py", "a loop", [1], fit=2)
    record = json.loads(path.read_text())
    assert path.name.endswith("-probe-test.json") and path.name[:10] == record["date"][:10]
    assert record["command"] == "python3 benchmarks/probes/probe.py --shape tiny"
    assert record["device"] == jax.devices()[0].device_kind and record["environment"]["jax"] == jax.__version__
    assert (record["protocol"], record["rows"], record["fit"]) == ("a loop", [1], 2)


@pytest.mark.parametrize(
    "shape, published, digits",
    [
        ("smollm2-135m", 0.135, 3),
        ("llama-3.2-1b", 1.24, 2),
        ("llama-3.1-8b", 8.03, 2),
        ("qwen3-8b", 8.2, 1),
        ("qwen2.5-7b", 7.6, 1),
        ("phi-4", 14.7, 1),
    ],
)
def test_dense_shapes_hold_their_published_parameter_counts(shape, published, digits):
    """configs/models/: each dense bench shape has the parameters its model card states (billions, as rounded
    there), so a floor computed from it is the model's."""
    from functools import partial

    from lithos.models import family_for_architecture

    cfg = bench.model_shape(shape)
    init = partial(family_for_architecture(cfg.architecture).init_params, cfg, dtype=jnp.bfloat16)
    count = sum(x.size for x in jax.tree_util.tree_leaves(jax.eval_shape(init, jax.random.key(0))))
    assert round(count / 1e9, digits) == published
