"""Launch-parameter tuning: the table's lookup and its fallback to the heuristics, the table's round
trip, the search space and search, the attributes each wrapper hands its kernel, the command's error
without a GPU, and (on a GPU only) a tiny tune end to end."""

from __future__ import annotations

import importlib
import json

import jax.numpy as jnp
import numpy as np
import pytest

from lithos import cli
from lithos.custom_calls import build, launch, tune
from lithos.errors import LithosError

# The wrapper modules (the package exports functions of the same names).
matvec, qkv, attention, lm_head = (
    importlib.import_module(f"lithos.custom_calls.{name}") for name in ("matvec", "qkv", "attention", "lm_head")
)

H200 = "NVIDIA H200"
KEY_1B_O_PROJ = "matvec in=2048 out=2048 T=1"


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """An empty tuning directory in place of the shipped one, tuning on, this process on an H200."""
    monkeypatch.setenv("LITHOS_TUNING_DIR", str(tmp_path))
    monkeypatch.delenv("LITHOS_TUNING", raising=False)
    monkeypatch.setattr(launch, "current_device_kind", lambda: H200)
    return tmp_path


def write(path, entries, **extra):
    path.write_text(json.dumps({"format": 1, "device": H200, "entries": entries, **extra}))


# --------------------------------------------------------------------------------------------
# Keys and lookup
# --------------------------------------------------------------------------------------------


def test_problem_key_buckets_tokens_and_names_dims():
    assert launch.problem_key("matvec", {"in": 2048, "out": 2048}, 1) == KEY_1B_O_PROJ
    assert launch.problem_key("matvec", {"out": 8, "in": 16}, 3) == "matvec in=16 out=8 T=4"
    assert launch.token_bucket(9) == 16 and launch.token_bucket(5) == 8
    assert launch.length_bucket(1040) == 2048 and launch.length_bucket(1024) == 1024
    with pytest.raises(LithosError, match="1..16"):
        launch.token_bucket(17)
    with pytest.raises(LithosError, match="keyed by in, out"):
        launch.problem_key("matvec", {"hidden": 8}, 1)
    assert launch.device_slug("NVIDIA H200") == "nvidia-h200"
    assert launch.device_slug("AMD Instinct MI355X") == "amd-instinct-mi355x"


def test_lookup_reads_the_device_table_and_falls_back_to_the_heuristics(table_dir, monkeypatch):
    write(table_dir / "nvidia-h200.json", {KEY_1B_O_PROJ: {"params": {"k_split": 8, "blocks_per_unit": 2}}})
    dims = {"in": 2048, "out": 2048}
    assert launch.tuned_params("matvec", dims, 1) == {"k_split": 8, "blocks_per_unit": 2}
    attrs = launch.launch_attributes("matvec", dims, 1)
    assert attrs == {"k_split": 8, "warps_per_block": 0, "blocks_per_unit": 2}
    assert all(isinstance(v, np.int64) for v in attrs.values())
    # Another token bucket, another shape, another kernel, another device: the heuristics (all 0).
    zeros = {"k_split": 0, "warps_per_block": 0, "blocks_per_unit": 0}
    assert launch.launch_attributes("matvec", dims, 2) == zeros
    assert launch.launch_attributes("matvec", {"in": 2048, "out": 4096}, 1) == zeros
    assert launch.launch_attributes("gate_up_silu", dims, 1) == zeros
    assert launch.tuned_params("matvec", dims, 1, device_kind="AMD Instinct MI355X") == {}
    # An explicit launch wins over the table; LITHOS_TUNING=off ignores the table.
    assert launch.launch_attributes("matvec", dims, 1, {"warps_per_block": 4})["warps_per_block"] == 4
    assert launch.launch_attributes("matvec", dims, 1, {})["k_split"] == 0
    monkeypatch.setenv("LITHOS_TUNING", "off")
    assert launch.launch_attributes("matvec", dims, 1) == zeros


def test_bad_launch_parameters_name_the_fix(table_dir):
    with pytest.raises(LithosError, match="no launch parameter splits; it takes k_split"):
        launch.launch_attributes("matvec", {"in": 8, "out": 8}, 1, {"splits": 4})
    with pytest.raises(LithosError, match="integer >= 0"):
        launch.launch_attributes(
            "decode_attention", {"heads": 4, "kv_heads": 1, "head_dim": 64, "cache": 64}, 1, {"splits": -1}
        )
    (table_dir / "nvidia-h200.json").write_text("{not json")
    with pytest.raises(LithosError, match="re-run `lithos tune` or delete"):
        launch.tuned_params("matvec", {"in": 8, "out": 8}, 1)
    write(table_dir / "nvidia-h200.json", {KEY_1B_O_PROJ: {"params": {"k_split": 2.5}}})
    with pytest.raises(LithosError, match="entry 'matvec in=2048"):
        launch.tuned_params("matvec", {"in": 2048, "out": 2048}, 1)


def test_table_round_trip_merges_entries(tmp_path):
    path = tmp_path / "tuning" / "nvidia-h200.json"
    first = {KEY_1B_O_PROJ: {"params": {"k_split": 8}, "us": 6.1, "heuristic_us": 8.0}}
    launch.write_table(path, H200, first)
    assert launch.read_table(path) == first
    second = {"lm_head_argmax hidden=2048 vocab=128256 T=1": {"params": {}, "us": 130.0, "heuristic_us": 130.0}}
    launch.write_table(path, H200, second | {KEY_1B_O_PROJ: {"params": {"k_split": 4}}})
    table = json.loads(path.read_text())
    assert table["format"] == 1 and table["device"] == H200
    assert list(table["entries"]) == sorted(table["entries"])
    assert launch.read_table(path)[KEY_1B_O_PROJ]["params"] == {"k_split": 4}  # rewritten: read again
    assert "lm_head_argmax hidden=2048 vocab=128256 T=1" in launch.read_table(path)
    with pytest.raises(LithosError, match="no launch parameter"):
        launch.write_table(path, H200, {KEY_1B_O_PROJ: {"params": {"splits": 2}}})


def test_shipped_tables_are_valid():
    for path in sorted(launch.TABLE_DIR.glob("*.json")):
        entries = launch.read_table(path)
        assert entries, f"{path} has no entries"
        for key in entries:
            kernel, *dims, tokens = key.split(" ")
            parsed = dict(d.split("=") for d in dims)
            assert launch.problem_key(kernel, {k: int(v) for k, v in parsed.items()}, int(tokens[2:])) == key


# --------------------------------------------------------------------------------------------
# What each wrapper hands its kernel
# --------------------------------------------------------------------------------------------


@pytest.fixture
def captured_attrs(monkeypatch):
    """Replaces call_kernel in every wrapper with one that records the attributes and returns zeros."""
    seen: list[dict] = []

    def fake_call(source, target, out_types, *args, aliases=None, **attrs):
        seen.append(attrs)
        return [jnp.zeros(t.shape, t.dtype) for t in out_types]

    for module in (matvec, qkv, attention, lm_head):
        monkeypatch.setattr(module, "call_kernel", fake_call)
    return seen


def test_wrappers_pass_the_table_entry_as_attributes(table_dir, captured_attrs, pretend_gpu):
    rng = np.random.default_rng(0)
    T, D, F, H, KV, HD, V, S = 1, 64, 96, 4, 2, 64, 50, 100
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
    entries = {
        "matvec in=64 out=96 T=1": {"params": {"k_split": 2}},
        "gate_up_silu in=64 out=96 T=1": {"params": {"warps_per_block": 4}},
        "qkv_rope_append hidden=64 heads=4 kv_heads=2 head_dim=64 T=1": {"params": {"blocks_per_unit": 3}},
        "decode_attention heads=4 kv_heads=2 head_dim=64 cache=128 T=1": {"params": {"splits": 96, "split_keys": 32}},
        "lm_head_argmax hidden=64 vocab=50 T=1": {"params": {"k_split": 1, "warps_per_block": 2}},
    }
    write(table_dir / "nvidia-h200.json", entries)
    x, cache = bf(T, D), bf(1, 1, KV, S, HD)
    matvec.matvec(x, bf(F, D), path="ffi")
    matvec.gate_up_silu(x, bf(F, D), bf(F, D), path="ffi")
    inv_freq = jnp.ones((HD // 2,), jnp.float32)
    qkv.qkv_rope_append(x, bf(D), bf(H * HD, D), bf(KV * HD, D), bf(KV * HD, D), inv_freq, jnp.zeros((T,), jnp.int32),
                        cache, cache, path="ffi")  # fmt: skip
    attention.decode_attention(bf(T, H, HD), cache, cache, jnp.zeros((T,), jnp.int32), path="ffi")
    lm_head.lm_head_argmax(x, bf(V, D), path="ffi")
    got = [{k: int(v) for k, v in attrs.items() if k not in ("eps", "window", "ring")} for attrs in captured_attrs]
    assert got == [
        {"k_split": 2, "warps_per_block": 0, "blocks_per_unit": 0},
        {"k_split": 0, "warps_per_block": 4, "blocks_per_unit": 0},
        {"k_split": 0, "warps_per_block": 0, "blocks_per_unit": 3},
        {"splits": 96, "split_keys": 32},
        {"k_split": 1, "warps_per_block": 2, "blocks_per_unit": 0},
    ]


@pytest.fixture
def pretend_gpu(monkeypatch):
    """dispatch believes a CUDA backend exists (call_kernel is faked, so nothing is built)."""
    from lithos.custom_calls import dispatch

    monkeypatch.setattr(dispatch, "_gpu_platform", lambda: "cuda")


def test_attention_scratch_grows_with_a_tuned_split_count(pretend_gpu, monkeypatch):
    shapes = []

    def fake_call(source, target, out_types, *args, aliases=None, **attrs):
        shapes.append([t.shape for t in out_types])
        return [jnp.zeros(t.shape, t.dtype) for t in out_types]

    monkeypatch.setattr(attention, "call_kernel", fake_call)
    q, cache = jnp.zeros((1, 4, 64), jnp.bfloat16), jnp.zeros((1, 1, 2, 300, 64), jnp.bfloat16)
    for splits in (0, 128):
        attention.decode_attention(q, cache, cache, jnp.zeros((1,), jnp.int32), path="ffi", launch={"splits": splits})
    assert shapes[0][1][0] == attention.MAX_SPLITS and shapes[1][1][0] == 128


def test_auto_path_on_cpu_ignores_launch_parameters():
    rng = np.random.default_rng(1)
    x, w = (
        jnp.asarray(rng.standard_normal((2, 32)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16),
    )
    tuned = matvec.matvec(x, w, launch={"k_split": 4, "blocks_per_unit": 1})
    np.testing.assert_array_equal(
        np.asarray(tuned, np.float32), np.asarray(matvec.matvec(x, w, path="reference"), np.float32)
    )


# --------------------------------------------------------------------------------------------
# Search space and search
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", sorted(launch.LAUNCH_PARAMS))
def test_search_space_is_valid_complete_and_starts_at_the_heuristic(kernel):
    space = tune.search_space(kernel)
    assert space[0] == {name: 0 for name in launch.LAUNCH_PARAMS[kernel]}
    assert len({tuple(sorted(p.items())) for p in space}) == len(space)
    for params in space:
        assert set(params) == set(launch.LAUNCH_PARAMS[kernel])
        launch.check_params(kernel, params, "test")
        if kernel != "decode_attention":  # the handler's rule: k_split a power of two <= warps per block
            assert params["k_split"] <= (params["warps_per_block"] or 8)
    sizes = [len(v) for v in tune.SEARCH_SPACES[kernel].values()]
    if kernel == "decode_attention":
        assert len(space) == np.prod(sizes)
    else:  # k_split 8 needs 8 warps
        assert len(space) == (5 + 4) * 4


def test_coordinate_search_finds_a_separable_minimum_and_skips_failures():
    best_values = {"k_split": 4, "warps_per_block": 0, "blocks_per_unit": 2}
    calls = []

    def measure(params):
        calls.append(params)
        if params["blocks_per_unit"] == 4:
            return None  # a candidate that failed its check
        return 1.0 + sum(abs(params[k] - v) for k, v in best_values.items())

    best, seconds = tune.coordinate_search("matvec", measure)
    assert best == best_values and seconds == 1.0
    assert calls[0] == {"k_split": 0, "warps_per_block": 0, "blocks_per_unit": 0}
    assert len({tuple(sorted(c.items())) for c in calls}) == len(calls)  # each candidate once
    capped = []
    tune.coordinate_search("matvec", lambda p: capped.append(p) or 1.0, max_trials=3)
    assert len(capped) == 3


def test_grid_search_times_every_candidate():
    seen = []
    best, _ = tune.grid_search(
        "decode_attention", lambda p: seen.append(p) or 1.0 / (1 + p["splits"] + p["split_keys"])
    )
    assert len(seen) == len(tune.search_space("decode_attention"))
    assert best == {"splits": 64, "split_keys": 256}


def test_model_problems_cover_a_decode_step_once():
    shape = tune.StepShape(16, 2048, 32, 8, 64, 8192, 128256)
    keys = [p.key for p in tune.model_problems(shape, [1, 8], 1024)]
    assert len(keys) == len(set(keys)) == 12
    assert "matvec in=2048 out=2048 T=1" in keys and "matvec in=8192 out=2048 T=8" in keys
    assert "decode_attention heads=32 kv_heads=8 head_dim=64 cache=2048 T=1" in keys
    only = tune.model_problems(shape, [1], 1024, ["lm_head_argmax"])
    assert [p.key for p in only] == ["lm_head_argmax hidden=2048 vocab=128256 T=1"]
    with pytest.raises(LithosError, match="tunable kernels are"):
        tune.model_problems(shape, [1], 1024, ["matmul"])
    with pytest.raises(LithosError, match="1..16"):
        tune.model_problems(shape, [32], 1024)


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def test_dry_run_lists_problems_without_a_gpu(capsys):
    assert cli.main(["tune", "--shape", "llama-3.2-1b", "--tokens", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "qkv_rope_append hidden=2048 heads=32 kv_heads=8 head_dim=64 T=1" in out
    assert "candidates" in out


@pytest.mark.skipif(build.gpu_platform() is not None, reason="checks the error on a machine without a GPU")
def test_tune_without_a_gpu_names_the_fix(capsys):
    assert cli.main(["tune", "--shape", "llama-3.2-1b"]) == 2
    err = capsys.readouterr().err
    assert "jax sees none" in err and "jax[cuda13]" in err


def test_tune_argument_errors(capsys):
    assert cli.main(["tune", "--shape", "no-such-model", "--dry-run"]) == 2
    assert "unknown model shape" in capsys.readouterr().err
    assert cli.main(["tune", "--dry-run"]) == 2
    assert "--shape NAME" in capsys.readouterr().err
    assert cli.main(["tune", "--shape", "llama-3.2-1b", "--tokens", "one", "--dry-run"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# On a GPU: a tiny tune end to end
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(build.gpu_platform() is None, reason="needs a CUDA or ROCm GPU")
def test_tiny_tune_writes_checked_trials_and_a_readable_table(tmp_path, capsys):
    table = tmp_path / "table.json"
    options = "--kernels matvec,decode_attention --trials 4 --repeats 2 --iters 2 --context 256".split()
    argv = ["tune", "--shape", "smollm2-135m", *options, "--table", str(table), "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    entries = launch.read_table(table)
    assert set(entries) == {
        "matvec in=576 out=576 T=1",
        "matvec in=1536 out=576 T=1",
        "decode_attention heads=9 kv_heads=3 head_dim=64 cache=512 T=1",
    }
    (trials_file,) = tmp_path.glob("*-tune-smollm2-135m-T1.json")
    trials = json.loads(trials_file.read_text())["trials"]
    timed = [t for t in trials if t["us"] is not None and t["error"] is not None]
    assert len(timed) >= 3 and all(t["error"] <= tune.MAX_RELATIVE_ERROR for t in timed)
    assert all(entry["us"] <= entry["heuristic_us"] for entry in entries.values())
