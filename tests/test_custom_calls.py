"""The fused ops' reference twins against plain numpy (float64) and against the model's own math,
their dispatch, the build cache, and a compile of every kernel source with nvcc (sm_90a) and with
hipcc (gfx90a) where those compilers are installed."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.custom_calls import build, decode_attention, gate_up_silu, lm_head_argmax, matvec, qkv_rope_append
from lithos.errors import LithosError
from lithos.models import llama

from .conftest import STRICT

BF16 = jnp.bfloat16


def rand(rng: np.random.Generator, *shape, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(scale * rng.standard_normal(shape), BF16)


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def rms64(x, w, eps):
    x = f64(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * f64(w)


def assert_close(actual, expected, rel: float = 1e-2):
    """Relative error in the 2-norm: a bf16 rounding of the output is about 4e-3."""
    actual, expected = f64(actual), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all()
    err = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
    assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"


# --------------------------------------------------------------------------------------------
# Reference twins against numpy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_matvec_reference(tokens):
    rng = np.random.default_rng(tokens)
    x, w, norm = rand(rng, tokens, 40), rand(rng, 3, 24, 40), rand(rng, 3, 40)
    residual = rand(rng, tokens, 24)
    out = matvec(x, w, layer=2, norm_weight=norm, residual=residual, eps=1e-5, path="reference")
    assert out.dtype == BF16
    assert_close(out, f64(residual) + rms64(x, norm[2], 1e-5) @ f64(w[2]).T)
    assert_close(matvec(x, w[1], path="reference"), f64(x) @ f64(w[1]).T)


def test_gate_up_silu_reference():
    rng = np.random.default_rng(0)
    x, wg, wu, norm = rand(rng, 4, 32), rand(rng, 2, 48, 32), rand(rng, 2, 48, 32), rand(rng, 2, 32)
    out = gate_up_silu(x, wg, wu, layer=1, norm_weight=norm, eps=1e-6, path="reference")
    xn = rms64(x, norm[1], 1e-6)
    gate, up = xn @ f64(wg[1]).T, xn @ f64(wu[1]).T
    assert_close(out, gate / (1 + np.exp(-gate)) * up)


def attention64(q, k, v, positions, window=None):
    """Per-query softmax attention in float64; k, v `[kv_heads, S, D]`."""
    q, k, v = f64(q), f64(k), f64(v)
    tokens, heads, dim = q.shape
    group = heads // k.shape[0]
    out = np.zeros_like(q)
    for t in range(tokens):
        visible = np.arange(k.shape[1]) <= positions[t]
        if window:
            visible &= np.arange(k.shape[1]) > positions[t] - window
        for h in range(heads):
            scores = k[h // group][visible] @ q[t, h] / math.sqrt(dim)
            p = np.exp(scores - scores.max())
            out[t, h] = p @ v[h // group][visible] / p.sum()
    return out


@pytest.mark.parametrize("tokens,window", [(1, None), (5, None), (4, 7)])
def test_decode_attention_reference(tokens, window):
    rng = np.random.default_rng(tokens)
    layers, kv_heads, max_len, dim, heads = 2, 2, 40, 16, 6
    k, v = rand(rng, layers, 1, kv_heads, max_len, dim), rand(rng, layers, 1, kv_heads, max_len, dim)
    q = rand(rng, tokens, heads, dim)
    positions = np.arange(20, 20 + tokens, dtype=np.int32)
    out = decode_attention(q, k, v, jnp.asarray(positions), layer=1, sliding_window=window, path="reference")
    assert_close(out, attention64(q, k[1, 0], v[1, 0], positions, window))


def rope64(x, positions, inv_freq):
    x = f64(x)
    angles = positions[:, None].astype(np.float32) * np.asarray(inv_freq, np.float32)
    cos, sin = (
        np.cos(np.concatenate([angles] * 2, -1))[:, None],
        np.sin(np.concatenate([angles] * 2, -1))[:, None],
    )
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def test_qkv_rope_append_reference():
    rng = np.random.default_rng(2)
    layers, hidden, heads, kv_heads, dim, max_len, tokens = 2, 32, 4, 2, 8, 12, 3
    h, norm = rand(rng, tokens, hidden), rand(rng, layers, hidden)
    wq, wk, wv = (rand(rng, layers, n * dim, hidden) for n in (heads, kv_heads, kv_heads))
    k_cache, v_cache = (
        rand(rng, layers, 1, kv_heads, max_len, dim),
        rand(rng, layers, 1, kv_heads, max_len, dim),
    )
    inv_freq = 1.0 / 100.0 ** (np.arange(0, dim, 2) / dim)
    positions = np.asarray([5, 11, 12], np.int32)  # 12 is past max_len: dropped
    q, k_new, v_new = qkv_rope_append(
        h,
        norm,
        wq,
        wk,
        wv,
        jnp.asarray(inv_freq, jnp.float32),
        jnp.asarray(positions),
        k_cache,
        v_cache,
        layer=1,
        eps=1e-5,
        path="reference",
    )
    x = rms64(h, norm[1], 1e-5)
    assert_close(q, rope64((x @ f64(wq[1]).T).reshape(tokens, heads, dim), positions, inv_freq))
    k_rows = rope64((x @ f64(wk[1]).T).reshape(tokens, kv_heads, dim), positions, inv_freq)
    v_rows = (x @ f64(wv[1]).T).reshape(tokens, kv_heads, dim)
    expect_k, expect_v = f64(k_cache), f64(v_cache)
    for t in range(2):
        expect_k[1, 0, :, positions[t]] = k_rows[t]
        expect_v[1, 0, :, positions[t]] = v_rows[t]
    assert_close(k_new, expect_k)
    assert_close(v_new, expect_v)
    np.testing.assert_array_equal(f64(k_new[0]), f64(k_cache[0]))  # other layers untouched


@pytest.mark.parametrize("biased", [False, True])
def test_qkv_project_and_qk_norm_rope_append_reference(biased):
    """Qwen3's two launches' twins against float64 numpy: the projections (biases added), then each Q and K head's
    RMSNorm, the rotation and the cache write; and the one-kernel twin's biases (Qwen2's) likewise."""
    from lithos.custom_calls.qk_norm_rope import qk_norm_rope_append
    from lithos.custom_calls.qkv import qkv_project

    rng = np.random.default_rng(4)
    layers, hidden, heads, kv_heads, dim, max_len, tokens = 2, 32, 4, 2, 8, 12, 3
    h, norm = rand(rng, tokens, hidden), rand(rng, layers, hidden)
    wq, wk, wv = (rand(rng, layers, n * dim, hidden) for n in (heads, kv_heads, kv_heads))
    biases = tuple(rand(rng, layers, n * dim) for n in (heads, kv_heads, kv_heads)) if biased else None
    q_norm, k_norm = rand(rng, layers, dim), rand(rng, layers, dim)
    k_cache, v_cache = rand(rng, layers, 1, kv_heads, max_len, dim), rand(rng, layers, 1, kv_heads, max_len, dim)
    inv_freq = 1.0 / 100.0 ** (np.arange(0, dim, 2) / dim)
    positions = np.asarray([5, 11, 12], np.int32)  # 12 is past max_len: dropped
    projected = qkv_project(h, norm, wq, wk, wv, head_dim=dim, layer=1, biases=biases, path="reference")
    x = rms64(h, norm[1], 1e-5)
    rows = [x @ f64(w[1]).T + (0 if biases is None else f64(b[1])) for w, b in zip((wq, wk, wv), biases or [None] * 3)]
    assert_close(projected, np.concatenate(rows, -1).reshape(tokens, heads + 2 * kv_heads, dim))

    args = (jnp.asarray(inv_freq, jnp.float32), jnp.asarray(positions), k_cache, v_cache)
    q, k_new, v_new = qk_norm_rope_append(projected, q_norm, k_norm, *args, layer=1, eps=1e-6, path="reference")

    def head_norm(y, w, n):  # [tokens, n * dim] -> [tokens, n, dim], each head's RMSNorm
        y = y.reshape(tokens, n, dim)
        return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + 1e-6) * f64(w[1])

    assert_close(q, rope64(head_norm(rows[0], q_norm, heads), positions, inv_freq))
    k_rows = rope64(head_norm(rows[1], k_norm, kv_heads), positions, inv_freq)
    expect_k, expect_v = f64(k_cache), f64(v_cache)
    for t in range(2):
        expect_k[1, 0, :, positions[t]] = k_rows[t]
        expect_v[1, 0, :, positions[t]] = rows[2].reshape(tokens, kv_heads, dim)[t]
    assert_close(k_new, expect_k)
    assert_close(v_new, expect_v)
    if biased:  # the one-kernel twin with biases and no norms
        q, _, _ = qkv_rope_append(h, norm, wq, wk, wv, *args, layer=1, eps=1e-5, biases=biases, path="reference")
        assert_close(q, rope64(rows[0].reshape(tokens, heads, dim), positions, inv_freq))


def test_q_k_v_biases_and_projections_of_the_wrong_size_are_refused():
    from lithos.custom_calls.qk_norm_rope import qk_norm_rope_append

    rng = np.random.default_rng(5)
    h, norm = rand(rng, 1, 32), rand(rng, 32)
    wq, wk, wv = rand(rng, 32, 32), rand(rng, 16, 32), rand(rng, 16, 32)
    caches = (rand(rng, 1, 1, 2, 8, 8), rand(rng, 1, 1, 2, 8, 8))
    rope = (jnp.ones((4,), jnp.float32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(LithosError, match="biases .* must end in 32, 16 and 16"):
        qkv_rope_append(h, norm, wq, wk, wv, *rope, *caches, biases=(rand(rng, 32),) * 3, path="reference")
    with pytest.raises(LithosError, match="projections \\[1, 5, 8\\] must be"):
        qk_norm_rope_append(jnp.zeros((1, 5, 8)), rand(rng, 8), rand(rng, 8), *rope, *caches, path="reference")


def test_rotate_matches_model_rope():
    rng = np.random.default_rng(3)
    cfg = llama.config_from_hf(
        dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=32, intermediate_size=8,
             num_hidden_layers=1, num_attention_heads=2, head_dim=16, rope_theta=5e5,
             rope_scaling=dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=64))
    )  # fmt: skip
    from lithos.custom_calls.numerics import rotate

    x, positions = rand(rng, 3, 2, 16), jnp.asarray([0, 700, 100000], jnp.int32)
    inv_freq = llama.rope_inv_freq(cfg)
    model = llama.apply_rope(x[None].astype(jnp.float32), positions[None], inv_freq)[0]
    np.testing.assert_allclose(
        np.asarray(rotate(x, positions, jnp.asarray(inv_freq))), np.asarray(model), rtol=1e-6
    )


def test_lm_head_argmax_reference():
    rng = np.random.default_rng(4)
    h, head, norm = rand(rng, 3, 32), rand(rng, 50, 32), rand(rng, 32)
    head = head.at[17].set(head[9])  # an exact tie: the lowest id wins, as jnp.argmax
    tokens, logits = lm_head_argmax(h, head, norm_weight=norm, with_logits=True, path="reference")
    expected = rms64(h, norm, 1e-5) @ f64(head).T
    assert_close(logits, expected, rel=1e-5)
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))
    assert tokens.dtype == jnp.int32


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def test_auto_path_is_reference_on_cpu_under_jit():
    rng = np.random.default_rng(5)
    x, w = rand(rng, 2, 16), rand(rng, 4, 8, 16)
    auto = jax.jit(lambda x, w, i: matvec(x, w, layer=i))(x, w, 3)
    np.testing.assert_array_equal(
        np.asarray(auto, np.float32), np.asarray(matvec(x, w[3], path="reference"), np.float32)
    )


def test_auto_path_serves_prefill_on_cpu():
    """More than 16 tokens is a kernel limit; the reference path (what CPU runs) has none."""
    rng = np.random.default_rng(6)
    assert matvec(rand(rng, 40, 16), rand(rng, 8, 16)).shape == (40, 8)


def test_path_errors_say_what_to_do():
    x, w = jnp.zeros((1, 8), BF16), jnp.zeros((4, 8), BF16)
    if build.gpu_platform() is None:
        with pytest.raises(LithosError, match="needs a CUDA or ROCm GPU"):
            matvec(x, w, path="ffi")
    with pytest.raises(LithosError, match="unknown kernel path"):
        matvec(x, w, path="fast")
    with pytest.raises(LithosError, match="pass layer="):
        matvec(x, jnp.zeros((3, 4, 8), BF16))


# --------------------------------------------------------------------------------------------
# Build: cache keys, missing compilers, and compiling every source
# --------------------------------------------------------------------------------------------


def test_missing_compiler_names_what_to_install(monkeypatch):
    monkeypatch.setattr(build, "find_compiler", lambda platform: None)
    with pytest.raises(LithosError, match="cuda-nvcc") as err:
        build.toolchain("cuda", "sm_90a")
    assert "LITHOS_NVCC" in str(err.value)
    with pytest.raises(LithosError, match="hipcc"):
        build.toolchain("rocm", "gfx942")


def check_build(tc: build.Toolchain, **changes) -> build.Toolchain:
    """`tc` as a compile check builds it (CI: unoptimised, two token buckets)."""
    return dataclasses.replace(tc, opt_level=build.CHECK_OPT_LEVEL, **changes)


def test_library_key_covers_source_arch_compiler_flags_and_jaxlib(monkeypatch, tmp_path):
    monkeypatch.setenv("LITHOS_CACHE_DIR", str(tmp_path))
    base = build.Toolchain("cuda", "nvcc", "V13.0", "sm_90a")
    paths = {
        build.library_path("matvec", base),
        build.library_path("matvec", build.Toolchain("cuda", "nvcc", "V13.0", "sm_100a")),
        build.library_path("matvec", build.Toolchain("cuda", "nvcc", "V13.1", "sm_90a")),
        build.library_path("matvec", check_build(base)),  # a check build is never loaded
        build.library_path("matvec", dataclasses.replace(base, defines=("LITHOS_FUSED_MMA_CHUNKS=2",))),
        build.library_path("attention", base),
    }
    assert len(paths) == 6 and all(p.parent == tmp_path for p in paths)
    assert "-O3" in base.command(Path("k.cu"), Path("k.so"))
    # A check build instantiates two token buckets (ffi_util.h); a library the GPU loads, all five.
    assert "-DLITHOS_TWO_BUCKETS=1" in check_build(base).command(Path("k.cu"), Path("k.so"))
    assert not any("TWO_BUCKETS" in part for part in base.command(Path("k.cu"), Path("k.so")))
    monkeypatch.setattr(build, "jaxlib_version", lambda: "0.0.0")
    assert build.library_path("matvec", base) not in paths


def test_a_define_keys_only_the_kernels_whose_sources_name_it(monkeypatch, tmp_path):
    """A megakernel experiment's define leaves the fused kernels' libraries as they are (no rebuild of every
    kernel for each experiment), while a define read by a header that an included header includes still keys
    its kernel."""
    monkeypatch.setenv("LITHOS_CACHE_DIR", str(tmp_path))
    base = build.Toolchain("cuda", "nvcc", "V13.0", "sm_90a")
    megakernel_only = dataclasses.replace(base, defines=("LITHOS_MK_MIN_BLOCKS=2", "LITHOS_MK_ATTN_KEYS=3"))
    for kernel in ("matvec", "attention", "lm_head", "matvec_packed_mxfp4"):
        assert build.library_path(kernel, megakernel_only) == build.library_path(kernel, base)
        assert build.kernel_toolchain(kernel, megakernel_only) == base
    assert build.library_path("megakernel", megakernel_only) != build.library_path("megakernel", base)
    # Includes of includes: megakernel.cu -> mk_lm_head.h -> mk_matvec.h -> mk_lane_ring.h reads LITHOS_MK_LANE_RING,
    # matvec.cu -> row_groups.h -> mma_rowdot.h LITHOS_MMA_ACCUMULATORS (both kernels), row_groups.h
    # LITHOS_FUSED_MMA_CHUNKS (not the megakernel's).
    defines = ("LITHOS_MK_LANE_RING=0", "LITHOS_MMA_ACCUMULATORS=1", "LITHOS_FUSED_MMA_CHUNKS=2")
    mixed = dataclasses.replace(base, defines=defines)
    assert build.kernel_toolchain("megakernel", mixed).defines == ("LITHOS_MK_LANE_RING=0", "LITHOS_MMA_ACCUMULATORS=1")
    assert build.kernel_toolchain("matvec", mixed).defines == ("LITHOS_MMA_ACCUMULATORS=1", "LITHOS_FUSED_MMA_CHUNKS=2")
    command = build.kernel_toolchain("megakernel", mixed).command(Path("megakernel.cu"), Path("megakernel.so"))
    assert "-DLITHOS_FUSED_MMA_CHUNKS=2" not in command and "-DLITHOS_MK_LANE_RING=0" in command


def test_kernel_defines_come_from_the_environment(monkeypatch):
    monkeypatch.setattr(build, "find_compiler", lambda platform: "/usr/bin/nvcc")
    monkeypatch.setattr(build, "compiler_version", lambda compiler: "V13.0")
    monkeypatch.setenv("LITHOS_KERNEL_DEFINES", "LITHOS_MK_MIN_BLOCKS=2  LITHOS_MK_UNROLL=1")
    command = build.toolchain("cuda", "sm_90a").command(Path("k.cu"), Path("k.so"))
    assert "-DLITHOS_MK_MIN_BLOCKS=2" in command and "-DLITHOS_MK_UNROLL=1" in command
    monkeypatch.delenv("LITHOS_KERNEL_DEFINES")
    command = build.toolchain("cuda", "sm_90a").command(Path("k.cu"), Path("k.so"))
    assert not any(part.startswith("-D") for part in command)


def test_build_command_builds_check_libraries_at_the_check_level(monkeypatch, capsys):
    monkeypatch.setattr(build, "find_compiler", lambda platform: "/usr/bin/nvcc")
    monkeypatch.setattr(build, "compiler_version", lambda compiler: "V13.0")
    built = []
    monkeypatch.setattr(build, "build", lambda kernel, tc, force=False: built.append((kernel, tc)) or Path(kernel))
    check = str(build.CHECK_OPT_LEVEL)
    assert build.main(["--platform", "cuda", "--arch", "sm_90a", "--kernel", "matvec", "--opt-level", check]) == 0
    assert build.main(["--platform", "cuda", "--arch", "sm_90a", "--kernel", "matvec"]) == 0
    assert [(kernel, tc.opt_level) for kernel, tc in built] == [("matvec", build.CHECK_OPT_LEVEL), ("matvec", 3)]
    command = built[0][1].command(Path("k.cu"), Path("k.so"))
    # the host's and the assembler's; the device compiler at -O1 (its unoptimised PTX is the slower build)
    assert " ".join(command).count(f"-O{check}") == 2 and "-Xcicc -O1" in " ".join(command)


def test_the_megakernel_runs_from_a_library_a_token_bucket(monkeypatch, tmp_path):
    """A step calls the library of its token count's bucket alone (one handler name and one cache entry a bucket;
    counts of one bucket share them), and the ahead-of-time command builds the five a GPU loads; its compile check
    stays one library of every code path."""
    from lithos.custom_calls.megakernel.kernel import WeightFormats

    monkeypatch.setenv("LITHOS_CACHE_DIR", str(tmp_path))
    base = build.Toolchain("cuda", "nvcc", "V13.0", "sm_90a")
    formats = WeightFormats("mxfp4", "mxfp4", "bfloat16", gate_up_tiles=True)
    assert formats.variant(3) == formats.variant(4) != formats.variant(5)
    assert formats.variant(4).defines == (*formats.variant().defines, "LITHOS_ONE_BUCKET=4")
    assert formats.variant(1).target("LithosMegakernel") == "LithosMegakernel_mxfp4_mxfp4_bfloat16_tiles_t1"
    assert WeightFormats().variant(16).target("LithosMegakernel") == "LithosMegakernel_t16"
    paths = {build.library_path("megakernel", formats.variant(n).toolchain(base)) for n in range(1, 17)}
    assert len(paths) == 5 and build.library_path("megakernel", formats.variant().toolchain(base)) not in paths
    with pytest.raises(LithosError, match="1..16 query positions, got 17"):
        formats.variant(17)

    monkeypatch.setattr(build, "find_compiler", lambda platform: "/usr/bin/nvcc")
    monkeypatch.setattr(build, "compiler_version", lambda compiler: "V13.0")
    monkeypatch.delenv("LITHOS_KERNEL_DEFINES", raising=False)
    built = []
    monkeypatch.setattr(build, "build", lambda kernel, tc, force=False: built.append((kernel, tc)) or Path(kernel))
    assert build.main(["--platform", "cuda", "--arch", "sm_90a", "--kernel", "megakernel", "--kernel", "matvec"]) == 0
    assert [(kernel, tc.defines) for kernel, tc in built] == [
        *(("megakernel", (f"LITHOS_ONE_BUCKET={bucket}",)) for bucket in (1, 2, 4, 8, 16)),
        ("matvec", ()),
    ]
    built.clear()
    check = ["--opt-level", str(build.CHECK_OPT_LEVEL)]
    assert build.main(["--platform", "cuda", "--arch", "sm_90a", "--kernel", "megakernel", *check]) == 0
    assert [(kernel, tc.defines) for kernel, tc in built] == [("megakernel", ())]


def test_variants_command_passes_each_define_of_a_variant(monkeypatch):
    """`--variants` (CI's prebuild) compiles each experiment variant with every define its key names, as
    test_build_variant_compiles does: an experiment on the MXFP4 build names that build's defines after its own."""
    monkeypatch.setattr(build, "find_compiler", lambda platform: "/usr/bin/nvcc")
    monkeypatch.setattr(build, "compiler_version", lambda compiler: "V13.0")
    monkeypatch.delenv("LITHOS_KERNEL_DEFINES", raising=False)
    mxfp4_experiment = "LITHOS_MK_ATTN_KEYS=3 LITHOS_MK_ATTENTION_FORMAT=1 LITHOS_MK_MLP_FORMAT=1"
    monkeypatch.setitem(build.EXPERIMENT_VARIANTS, mxfp4_experiment, ("megakernel",))
    built = []
    monkeypatch.setattr(build, "build", lambda kernel, tc, force=False: built.append((kernel, tc)) or Path(kernel))
    check = ["--opt-level", str(build.CHECK_OPT_LEVEL)]  # as CI builds them (an -O3 build: a library a bucket)
    assert build.main(["--platform", "cuda", "--arch", "sm_90a", "--variants", *check]) == 0
    variants = build.EXPERIMENT_VARIANTS.items()
    expected = [(kernel, tuple(key.split())) for key, kernels in variants for kernel in kernels]
    assert [(kernel, tc.defines) for kernel, tc in built] == expected
    assert any(len(defines) > 1 for _, defines in expected)
    for _, tc in built:
        command = tc.command(Path("k.cu"), Path("k.so"))
        assert all(f"-D{define}" in command for define in tc.defines)


COMPILERS = {"cuda": ("nvcc", "sm_90a"), "rocm": ("hipcc", "gfx90a")}


def compiler_toolchain(platform):
    """The toolchain for COMPILERS[platform]; a missing compiler skips (fails under STRICT)."""
    name, arch = COMPILERS[platform]
    if build.find_compiler(platform) is None:
        reason = f"{name} is not installed ({build.INSTALL_HINT[platform]})"
        if STRICT:
            pytest.fail(reason)
        pytest.skip(reason)
    return build.toolchain(platform, arch)


@pytest.fixture(scope="module", params=sorted(COMPILERS))
def toolchain(request):
    return compiler_toolchain(request.param)


def test_megakernel_on_a_gpu_older_than_hopper_names_the_fused_path(monkeypatch, tmp_path):
    """An A100 or L40 (sm_80-sm_89) cannot hold the megakernel's static shared memory: the build stops
    before the compiler with a message naming kernels='fused'; newer GPUs and AMD pass the check."""
    monkeypatch.setenv("LITHOS_CACHE_DIR", str(tmp_path))
    for arch in ("sm_80", "sm_86", "sm_89"):
        with pytest.raises(LithosError, match=rf"compute capability 9\.0 or newer .* is {arch}: use kernels='fused'"):
            build.build("megakernel", build.Toolchain("cuda", "nvcc", "V13.0", arch))
    for tc in (
        build.Toolchain("cuda", "nvcc", "V13.0", "sm_90a"),
        build.Toolchain("cuda", "nvcc", "V13.0", "sm_100a"),
        build.Toolchain("rocm", "hipcc", "5.2", "gfx90a"),
    ):
        build.check_arch("megakernel", tc)
    build.check_arch("matvec", build.Toolchain("cuda", "nvcc", "V13.0", "sm_80"))


@pytest.mark.parametrize("kernel", ["matvec", "qkv_rope", "lm_head"])
def test_fused_kernels_compile_for_ampere(kernel):
    """The fused row-group kernels build for sm_80, where the tensor-core matvec splits its normed
    inputs in f32 (mma_rowdot.h's route for GPUs without bf16x2 arithmetic) instead of bf16x2."""
    library = build.build(kernel, check_build(compiler_toolchain("cuda"), arch="sm_80"))
    assert library.stat().st_size > 0


@pytest.mark.parametrize("kernel", sorted(set(build.KERNELS) - set(build.PACKED_KERNELS)))
def test_kernel_source_compiles(toolchain, kernel):
    """Every kernel builds for Hopper with nvcc and for CDNA (wave64) with hipcc; a compiler error fails.
    The per-user cache key covers the source and the compiler, so a cached library was built from this
    exact source. Unoptimised, with two of the five token buckets: every compiler phase and code path,
    in a third of the time of the -O3 build the GPU loads (which `test_ahead_of_time_command` and the
    GPU tests make). The packed formats' sources: test_packed_sources_compile_together."""
    library = build.build(kernel, check_build(toolchain))
    assert library.exists() and library.stat().st_size > 0
    assert_exports(library, kernel)


def test_one_token_bucket_of_the_megakernel_compiles(toolchain):
    """The library a step loads (build.bucket_variant: its bucket's kernels alone, ffi_util.h LITHOS_ONE_BUCKET),
    for both vendors; its exports are the whole library's."""
    library = build.build("megakernel", build.bucket_variant(build.PLAIN, 3).toolchain(check_build(toolchain)))
    assert library != build.build("megakernel", check_build(toolchain))
    assert_exports(library, "megakernel")


def assert_exports(library, kernel: str) -> None:
    """The handlers of `kernel`'s source, and the host-side queries some sources export (ctypes, not FFI)."""
    symbols = library.read_bytes()
    for symbol in (*build.KERNELS[kernel], *HOST_SYMBOLS.get(kernel, ())):
        assert symbol.encode() in symbols, f"{library.name} lacks {symbol}"


def test_a_compile_leaves_nothing_in_the_temporary_folder(toolchain, monkeypatch, tmp_path):
    """The compiler's temporaries live and die with the build's scratch folder (hipcc 5.2 left two empty folders in
    TMPDIR a compile, hundreds a day on a machine that builds kernels)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    source = tmp_path / "tiny.cu"
    source.write_text('extern "C" int lithos_tiny() { return 1; }\n')
    output = tmp_path / "cache" / "tiny.so"
    build.compile_library("tiny.cu", source, output, check_build(toolchain))
    assert output.stat().st_size > 0 and b"lithos_tiny" in output.read_bytes()
    assert list(scratch.iterdir()) == []


def test_packed_sources_compile_together(toolchain):
    """The packed formats' sources (each one format's instance of matvec_packed.h) compiled as one translation unit,
    for both vendors as test_kernel_source_compiles builds the others: every format's handlers in one library, its
    headers compiled once (CI: 176 s of nvcc and 96 of hipcc for 16 libraries, 47 and 32 so)."""
    tc = check_build(toolchain)
    library = build.build_together(build.PACKED_KERNELS, tc)
    assert library.stat().st_size > 0
    assert library != build.together_path(build.PACKED_KERNELS[:2], tc)  # its key names the sources
    for kernel in build.PACKED_KERNELS:
        assert_exports(library, kernel)


HOST_SYMBOLS = {"megakernel": ("LithosMegakernelBlocks",)}


@pytest.mark.parametrize(
    "define,kernel", [(define, kernel) for define, kernels in build.EXPERIMENT_VARIANTS.items() for kernel in kernels]
)
def test_build_variant_compiles(define, kernel):
    """Each experiment variant (build.EXPERIMENT_VARIANTS) builds beside the default, for every kernel that
    reads its define."""
    variant = check_build(compiler_toolchain("cuda"), defines=tuple(define.split()))
    library = build.build(kernel, variant)
    assert library != build.library_path(kernel, dataclasses.replace(variant, defines=()))
    for symbol in build.KERNELS[kernel]:
        assert symbol.encode() in library.read_bytes()


@pytest.mark.parametrize(
    "formats",
    [
        ("q4_1", "q4_1", "q8_0"),
        ("mxfp4", "mxfp4", "bfloat16"),
        ("mxfp4", "mxfp4", "bfloat16", True),
        ("mxfp4", "mxfp4", "bfloat16", True, True, True, True),
        ("k_mix", "q4_k", "bfloat16", False, False, False, False, "q4_k", "k_mix"),
        ("k_mix", "q5_k", "iq4_xs", False, False, False, False, "q3_k", "k_mix"),
    ],
    ids=[
        "q4_1",
        "mxfp4",
        "mxfp4-tiles",
        "mxfp4-all-tiles",
        "q4_k_m",
        "q5_k_m-q3_k-iq4_xs",
    ],
)
def test_packed_megakernel_compiles(toolchain, formats):
    """The megakernel over packed weights, for both vendors: in the build the default model needs (Q4_1
    layers, a Q8_0 head: the packed dot products with mins, and a second format in one kernel), in the
    benchmark's (MXFP4 layers, whose rows take the lane ring on CUDA at one token), and with its gate and up
    in fragment tiles (tensor cores on CUDA, the decode to f32 on HIP and where B does not fit), and with Q/K/V, O
    and down in tiles too (tensor cores on CUDA, HIP builds refuse them at the FFI: with the gate/up-only build, each
    projection's rows form and its tiled form compile; the builds of one or two tiled groups mix the same code), and
    with O and down in formats of their own (a Q4_K_M file's; a Q5_K_M file's, its O in
    Q3_K and its head in IQ4_XS: every ring step but MXFP4's and the register path's 2- and 3-bit codes). Every other
    format triple instantiates the register path's templates with decoders the fused packed sources compile
    (test_kernel_source_compiles)."""
    from lithos.custom_calls.megakernel.kernel import WeightFormats

    variant = WeightFormats(*formats).variant()
    library = build.build("megakernel", variant.toolchain(check_build(toolchain)))
    assert library != build.library_path("megakernel", check_build(toolchain))
    assert b"LithosMegakernel" in library.read_bytes()


def test_ahead_of_time_command(toolchain, capsys):
    # Two small sources, unoptimised (the compile check's libraries, so CI's prebuild has made them): this is about
    # the command, the compile itself is tested above.
    args = ["--platform", toolchain.platform, "--arch", toolchain.arch, "--kernel", "expert_matvec", "--kernel"]
    args += ["matvec", "--opt-level", str(build.CHECK_OPT_LEVEL), "--jobs", "1"]  # one compiler at a time, as CI's
    assert build.main(args) == 0
    out = capsys.readouterr().out
    assert "expert_matvec" in out and "matvec " in out
