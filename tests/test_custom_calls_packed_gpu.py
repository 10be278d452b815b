"""Each packed-weight kernel against its reference twin on the GPU: fresh random codes and scales of
every format at the models' shapes (smollm2, Llama-3.2-1B, Llama-3.1-8B, a GPT-OSS-20B expert) and
odd ones, and the fused decoder over packed weights against the reference path.

Skipped unless jax has a CUDA or ROCm device. Run on the device machine with
`PYTHONPATH=. python3 -m pytest tests/test_custom_calls_packed_gpu.py`.
"""

from __future__ import annotations

import itertools
import zlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos import quant
from lithos.bench import model_shape
from lithos.custom_calls import build, expert_matvec
from lithos.custom_calls.expert_matvec import expert_gate_up_silu
from lithos.custom_calls.packed_matvec import (
    packed_gate_up_silu,
    packed_lm_head_argmax,
    packed_matvec,
    packed_qkv_project,
    packed_qkv_rope_append,
)
from lithos.custom_calls.packed_weights import PACKED_FORMATS
from lithos.models import llama
from lithos.quant import random_packed

from .test_custom_calls import BF16, assert_close, f64
from .test_custom_calls_packed import _decode_logits, fitting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(build.gpu_platform() is None, reason="needs a CUDA or ROCm GPU"),
]

KERNEL = "ffi"

# (in, out) of one projection: smollm2's O projection, 1B's gate, 8B's down projection, and rows that
# are not a multiple of the 4 a warp owns.
MATVEC_SHAPES = {
    "smollm2-135m": (576, 576),
    "llama-3.2-1b": (2048, 8192),
    "llama-3.1-8b": (14336, 4096),
    "odd": (96, 43),
    "odd-k": (512, 43),  # the K-quants' rows hold whole super-blocks of 256
}
# (hidden, heads, kv_heads, head_dim)
QKV_SHAPES = {
    "smollm2-135m": (576, 9, 3, 64),
    "llama-3.1-8b": (4096, 32, 8, 128),
    "odd": (64, 5, 1, 16),
    "odd-k": (256, 5, 1, 16),
}


def fits(fmt_name: str, n_in: int) -> bool:
    return fitting(fmt_name, n_in) == n_in


def cases_for(cases, inputs_of) -> list[tuple]:
    """(format, *case) for every packed format and case whose inputs split in the format's blocks; the K-quants
    take the "odd-k" shape where the others take "odd"."""
    out = []
    for fmt_name in PACKED_FORMATS:
        for shape, tokens in cases:
            shape = "odd-k" if shape == "odd" and not fits(fmt_name, inputs_of(shape)) else shape
            if fits(fmt_name, inputs_of(shape)):
                out.append((fmt_name, shape, tokens))
    return out


def rng_for(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def rand(rng, *shape) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), BF16)


MATVEC_CASES = [("smollm2-135m", 1), ("llama-3.2-1b", 16), ("llama-3.1-8b", 1), ("odd", 5)]


@pytest.mark.parametrize("fmt_name, shape, tokens", cases_for(MATVEC_CASES, lambda shape: MATVEC_SHAPES[shape][0]))
def test_packed_matvec(fmt_name, shape, tokens):
    rng = rng_for("matvec", fmt_name, shape, tokens)
    n_in, n_out = MATVEC_SHAPES[shape]
    w = random_packed(fmt_name, (2, n_out, n_in), rng)
    x, norm, residual = rand(rng, tokens, n_in), rand(rng, 2, n_in), rand(rng, tokens, n_out)
    args = dict(layer=1, norm_weight=norm, residual=residual)
    want = packed_matvec(x, w, **args, path="reference")
    assert_close(jax.jit(lambda *a: packed_matvec(*a, **args, path=KERNEL))(x, w), want)
    plain = jax.jit(lambda x, w: packed_matvec(x, w, layer=0, path=KERNEL))(x, w)
    assert_close(plain, packed_matvec(x, w, layer=0, path="reference"))


@pytest.mark.parametrize("fmt_name, tokens", list(itertools.product(PACKED_FORMATS, [1, 16])))
def test_packed_gate_up_silu(fmt_name, tokens):
    rng = rng_for("gate_up", fmt_name, tokens)
    hidden, ffn = (2048, 8192) if tokens == 1 else (fitting(fmt_name, 576), 1536)
    w_gate, w_up = (random_packed(fmt_name, (2, ffn, hidden), rng) for _ in range(2))
    x, norm = rand(rng, tokens, hidden), rand(rng, 2, hidden)
    want = packed_gate_up_silu(x, w_gate, w_up, layer=1, norm_weight=norm, path="reference")
    got = jax.jit(lambda *a: packed_gate_up_silu(*a, layer=1, norm_weight=norm, path=KERNEL))(x, w_gate, w_up)
    assert_close(got, want)


QKV_CASES = [("llama-3.1-8b", 1), ("smollm2-135m", 4), ("odd", 3)]


def check_qkv_kernel(formats: tuple[str, str, str], shape: str, tokens: int, rng, biased: bool = False) -> None:
    """The Q/K/V kernel (or, for formats that differ, its three projections) against its reference twin: Q, K
    and V in `formats` (bf16 or packed) at `shape`, `tokens` positions from 40, with bf16 biases if `biased`."""
    hidden, heads, kv_heads, dim = QKV_SHAPES[shape]
    layers, max_len = 2, 64
    wq, wk, wv = (
        rand(rng, layers, n * dim, hidden) if fmt == "bfloat16" else random_packed(fmt, (layers, n * dim, hidden), rng)
        for fmt, n in zip(formats, (heads, kv_heads, kv_heads), strict=True)
    )
    h, norm = rand(rng, tokens, hidden), rand(rng, layers, hidden)
    caches = [rand(rng, layers, 1, kv_heads, max_len, dim) for _ in range(2)]
    inv_freq = jnp.asarray(1.0 / 10000.0 ** (np.arange(0, dim, 2) / dim), jnp.float32)
    positions = jnp.arange(tokens, dtype=jnp.int32) + 40
    biases = tuple(rand(rng, layers, n * dim) for n in (heads, kv_heads, kv_heads)) if biased else None

    def run(path):
        fn = jax.jit(
            lambda h, k, v: packed_qkv_rope_append(
                h, norm, wq, wk, wv, inv_freq, positions, k, v, layer=1, path=path, biases=biases
            )
        )
        return fn(h, *caches)

    for got, want in zip(run(KERNEL), run("reference"), strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("fmt_name, shape, tokens", cases_for(QKV_CASES, lambda shape: QKV_SHAPES[shape][0]))
def test_packed_qkv_rope_append(fmt_name, shape, tokens):
    check_qkv_kernel((fmt_name,) * 3, shape, tokens, rng_for("qkv", fmt_name, shape, tokens))


@pytest.mark.parametrize("formats", [("q4_k", "q4_k", "k_mix"), ("q4_k", "q4_k", "bfloat16")])
def test_packed_qkv_rope_append_of_mixed_formats(formats):
    check_qkv_kernel(formats, "llama-3.1-8b", 1, rng_for("qkv-mixed", formats))


@pytest.mark.parametrize("formats", [("q8_0",) * 3, ("q4_k",) * 3, ("mxfp4",) * 3, ("q4_k", "q4_k", "k_mix")])
@pytest.mark.parametrize("tokens", [1, 4])
def test_packed_qkv_rope_append_with_biases(formats, tokens):
    """Qwen2's Q/K/V biases: in the one kernel's epilogue, or (formats that differ) after the three projections."""
    check_qkv_kernel(formats, "llama-3.1-8b", tokens, rng_for("qkv-biased", formats, tokens), biased=True)


@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_k", "mxfp4"])
@pytest.mark.parametrize("tokens, biased", [(1, False), (4, True)])
def test_packed_qkv_project(fmt_name, tokens, biased):
    """The projections a model with per-head Q/K norms takes first (stored f32, neither rotated nor cached)."""
    rng = rng_for("qkv-project", fmt_name, tokens, biased)
    hidden, heads, kv_heads, dim = QKV_SHAPES["llama-3.1-8b"]
    wq, wk, wv = (random_packed(fmt_name, (2, n * dim, hidden), rng) for n in (heads, kv_heads, kv_heads))
    h, norm = rand(rng, tokens, hidden), rand(rng, 2, hidden)
    biases = tuple(rand(rng, 2, n * dim) for n in (heads, kv_heads, kv_heads)) if biased else None

    def run(path):
        project = partial(packed_qkv_project, head_dim=dim, layer=1, biases=biases, path=path)
        return jax.jit(project)(h, norm, wq, wk, wv)

    got, want = run(KERNEL), run("reference")
    assert got.shape == (tokens, heads + 2 * kv_heads, dim) and got.dtype == jnp.float32
    assert_close(got, want)


@pytest.mark.parametrize("fmt_name", ["mxfp4", "q8_0", "q4_1", "q6_k"])
def test_packed_lm_head_argmax(fmt_name):
    rng = rng_for("head", fmt_name)
    hidden = fitting(fmt_name, 576)
    head, h, norm = random_packed(fmt_name, (49152, hidden), rng), rand(rng, 3, hidden), rand(rng, hidden)
    ids, logits = jax.jit(lambda *a: packed_lm_head_argmax(*a, norm_weight=norm, with_logits=True, path=KERNEL))(
        h, head
    )
    want_ids, want = packed_lm_head_argmax(h, head, norm_weight=norm, with_logits=True, path="reference")
    assert_close(logits, want, rel=1e-4)
    top2 = np.sort(np.asarray(want), -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3 * np.abs(np.asarray(want)).max()
    np.testing.assert_array_equal(np.asarray(ids)[clear], np.asarray(want_ids)[clear])


# (experts, out, in, pairs): GPT-OSS-20B's gate/up experts (top-4), and an odd stack.
EXPERT_SHAPES = {"gpt-oss-20b": (32, 5760, 2880, 4), "odd": (5, 43, 96, 7)}


@pytest.mark.parametrize("fmt_name, shape", list(itertools.product(["bfloat16", "mxfp4", "q4_1"], EXPERT_SHAPES)))
def test_expert_matvec(fmt_name, shape):
    rng = rng_for("expert", fmt_name, shape)
    experts, n_out, n_in, pairs = EXPERT_SHAPES[shape]
    dims = (2, experts, n_out, n_in)
    w = rand(rng, *dims) if fmt_name == "bfloat16" else random_packed(fmt_name, dims, rng)
    x = rand(rng, pairs, n_in)
    ids = jnp.asarray(rng.integers(-1, experts + 1, pairs), jnp.int32)  # includes out-of-range ids
    want = expert_matvec(x, w, ids, layer=1, path="reference")
    assert_close(jax.jit(lambda *a: expert_matvec(*a, layer=1, path=KERNEL))(x, w, ids), want)


@pytest.mark.parametrize("fmt_name, shape", [("bfloat16", "qwen1.5-moe"), ("q4_k", "qwen3-30b-a3b"), ("q8_0", "odd")])
def test_expert_gate_up_silu(fmt_name, shape):
    """The gated build: (experts, ffn, in, tokens, k) of Qwen1.5-MoE-A2.7B's and Qwen3-30B-A3B's experts, and an odd
    stack; x a row a token, out-of-range ids among the pairs."""
    experts, ffn, n_in, tokens, k = {
        "qwen1.5-moe": (60, 1408, 2048, 1, 4), "qwen3-30b-a3b": (128, 768, 2048, 3, 8), "odd": (5, 22, 96, 2, 3)
    }[shape]  # fmt: skip
    rng = rng_for("expert-gated", fmt_name, shape)
    dims = (2, experts, 2 * ffn, n_in)
    w = rand(rng, *dims) if fmt_name == "bfloat16" else random_packed(fmt_name, dims, rng)
    x = rand(rng, tokens, n_in)
    ids = jnp.asarray(rng.integers(-1, experts + 1, tokens * k), jnp.int32)
    want = expert_gate_up_silu(x, w, ids, layer=1, path="reference")
    assert_close(jax.jit(lambda *a: expert_gate_up_silu(*a, layer=1, path=KERNEL))(x, w, ids), want)


def test_expert_matvec_kernel_reads_only_routed_experts():
    rng = rng_for("expert-poison")
    w = random_packed("mxfp4", (8, 64, 128), rng)
    ids = jnp.asarray([6, 1, 6], jnp.int32)
    unrouted = np.setdiff1d(np.arange(8), np.asarray(ids))
    poisoned = w.replace(scales=w.scales.at[unrouted].set(quant.formats.E8M0_NAN))
    x = rand(rng, 3, 128)
    run = jax.jit(lambda *a: expert_matvec(*a, path=KERNEL))
    got = np.asarray(run(x, poisoned, ids), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, np.asarray(run(x, w, ids), np.float32))


# Q4_K_M's formats as lithos loads them: V and down, Q6_K in some layers and Q4_K in others, as K_MIX.
Q4_K_M = {"wq": "q4_k", "wk": "q4_k", "wv": "k_mix", "wo": "q4_k", "w_gate": "q4_k", "w_up": "q4_k", "w_down": "k_mix"}


@pytest.mark.parametrize(
    "kernels, shape, fmt_name",
    [
        *(
            (kernels, *case)
            for case in [("smollm2-135m", "q4_1"), ("llama-3.2-1b", "mxfp4"), ("llama-3.2-1b", "q4_k")]
            for kernels in ("fused", "megakernel")
        ),
        # Q/K/V of two formats: the fused path's three projections; the megakernel's groups in K_MIX
        ("fused", "llama-3.2-1b", "q4_k_m"),
        ("megakernel", "llama-3.2-1b", "q4_k_m"),
    ],
)
def test_decoder_over_packed_weights_matches_reference(shape, fmt_name, kernels):
    """A random model of the shape, attention and MLP packed: the fused (or megakernel) and reference
    decode steps agree within bf16 tolerance, and pick the same tokens wherever the reference's top
    two are not a near-tie."""
    cfg = model_shape(shape)
    params = llama.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    if fmt_name in ("mxfp4", "mxfp8", "fp8_block128"):
        params = quant.quantize_params(params, fmt_name, ["attention", "mlp"])
    else:  # GGUF formats are read, not made: random codes with small scales
        rng = rng_for("model", shape, fmt_name)
        formats = Q4_K_M if fmt_name == "q4_k_m" else dict.fromkeys(Q4_K_M, fmt_name)
        layers = params.layers.replace(
            **{n: random_packed(fmt, getattr(params.layers, n).shape, rng) for n, fmt in formats.items()}
        )
        params = params.replace(layers=layers)
    # As the engine lays them out (the megakernel: MXFP4 gate and up in tiles, mixed K-quant groups in K_MIX).
    fused = _decode_logits(cfg, llama.params_for_kernels(params, cfg, kernels), kernels, steps=8)
    reference = _decode_logits(cfg, params, "reference", steps=8)
    scale = np.abs(reference).max()
    assert np.abs(fused - reference).max() <= 0.03 * scale, (np.abs(fused - reference).max(), scale)
    top2 = np.sort(reference, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * scale
    np.testing.assert_array_equal(fused.argmax(-1)[clear], reference.argmax(-1)[clear])
    assert f64(fused).std() > 0
