"""Each FFI kernel against its reference twin on the GPU: fresh random inputs of the models' shapes
(and odd ones that take the kernels' unaligned paths), for 1, 4, 8 and 16 query positions.

Skipped unless jax has a CUDA or ROCm device. Run on the device machine with
`PYTHONPATH=. python3 -m pytest tests/test_custom_calls_gpu.py`.
"""

from __future__ import annotations

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.custom_calls import build, decode_attention, gate_up_silu, lm_head_argmax, matvec, qkv_rope_append
from lithos.custom_calls.qk_norm_rope import qk_norm_rope_append
from lithos.custom_calls.qkv import qkv_project
from lithos.custom_calls.step_shape import StepShape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(build.gpu_platform() is None, reason="needs a CUDA or ROCm GPU"),
]

# The path under test; tests/test_custom_calls.py covers the reference twins on CPU.
KERNEL = "ffi"
BF16 = jnp.bfloat16


# One layer of each shape: every case runs a single layer's kernels.
SHAPES = {
    "smollm2-135m": StepShape(1, 576, 9, 3, 64, 1536, 49152),
    "llama-3.2-1b": StepShape(1, 2048, 32, 8, 64, 8192, 128256),
    "llama-3.1-8b": StepShape(1, 4096, 32, 8, 128, 14336, 128256),
    # hidden not a multiple of 8 (scalar loads), rows not a multiple of 4, a group of 5 query heads.
    "odd": StepShape(1, 100, 5, 1, 64, 250, 1001),
}
TOKENS = [1, 4, 8, 16]
CASES = list(itertools.product(SHAPES, TOKENS)) + [("odd", 3), ("odd", 13)]


def rand(key, *shape, scale: float = 1.0) -> jax.Array:
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(BF16)


def keys(name: str, tokens: int, n: int):
    """Fresh inputs per test and case (a different seed each), but reproducible."""
    return jax.random.split(jax.random.PRNGKey(zlib.crc32(f"{name}/{tokens}".encode())), n)


def assert_matches(kernel_out, reference_out, rel: float = 5e-3):
    """Relative 2-norm error: each side rounds a float32 result to bf16 once (about 4e-3 per element,
    rarely a whole unit apart), so a wrong index or an unwritten element stands far above it."""
    k = np.asarray(jnp.asarray(kernel_out, jnp.float32), np.float64)
    r = np.asarray(jnp.asarray(reference_out, jnp.float32), np.float64)
    assert k.shape == r.shape
    assert np.isfinite(k).all(), "non-finite output"
    err = np.linalg.norm(k - r) / max(np.linalg.norm(r), 1e-30)
    assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"


def both_paths(op, *args, **kwargs):
    run = jax.jit(lambda path, *a: op(*a, **kwargs, path=path), static_argnums=0)
    return run(KERNEL, *args), run("reference", *args)


@pytest.mark.parametrize("model,tokens", CASES)
@pytest.mark.parametrize("projection", ["o_proj", "down"])
def test_matvec_residual(model, tokens, projection):
    s = SHAPES[model]
    n_in = s.q_size if projection == "o_proj" else s.ffn
    k = keys(f"matvec-{projection}-{model}", tokens, 3)
    x, w, residual = (
        rand(k[0], tokens, n_in),
        rand(k[1], 2, s.hidden, n_in, scale=n_in**-0.5),
        rand(k[2], tokens, s.hidden),
    )
    assert_matches(*both_paths(matvec, x, w, layer=1, residual=residual))


@pytest.mark.parametrize("model,tokens", CASES)
def test_matvec_norm_no_residual(model, tokens):
    s = SHAPES[model]
    k = keys(f"matvec-norm-{model}", tokens, 3)
    x, w, norm = (
        rand(k[0], tokens, s.hidden),
        rand(k[1], s.ffn, s.hidden),
        1 + rand(k[2], s.hidden, scale=0.1),
    )
    assert_matches(*both_paths(matvec, x, w, norm_weight=norm, eps=1e-5))


@pytest.mark.parametrize("model,tokens", CASES)
def test_gate_up_silu(model, tokens):
    s = SHAPES[model]
    k = keys(f"gate-up-{model}", tokens, 4)
    x = rand(k[0], tokens, s.hidden)
    w_gate, w_up = (rand(kk, 2, s.ffn, s.hidden, scale=s.hidden**-0.5) for kk in k[1:3])
    norm = 1 + rand(k[3], 2, s.hidden, scale=0.1)
    assert_matches(*both_paths(gate_up_silu, x, w_gate, w_up, layer=1, norm_weight=norm, eps=1e-5))


# Q/K/V biases (Qwen2's) added in the kernel's epilogue, at one token and at a verification round's.
BIASED_QKV_CASES = [("llama-3.1-8b", 1, True), ("llama-3.2-1b", 8, True), ("odd", 3, True)]
QKV_CASES = [(*case, False) for case in CASES] + BIASED_QKV_CASES


@pytest.mark.parametrize("model,tokens,biased", QKV_CASES)
def test_qkv_rope_append(model, tokens, biased):
    s = SHAPES[model]
    max_len = 300
    k = keys(f"qkv-{model}" + ("-biased" if biased else ""), tokens, 8)
    h, norm = rand(k[0], tokens, s.hidden), 1 + rand(k[1], 2, s.hidden, scale=0.1)
    wq = rand(k[2], 2, s.q_size, s.hidden, scale=s.hidden**-0.5)
    wk, wv = (rand(kk, 2, s.kv_heads * s.head_dim, s.hidden, scale=s.hidden**-0.5) for kk in k[3:5])
    # Random caches, so a write to a wrong slot or a lost write shows.
    k_cache, v_cache = (rand(kk, 2, 1, s.kv_heads, max_len, s.head_dim) for kk in k[5:7])
    inv_freq = jnp.asarray(1.0 / 5e5 ** (np.arange(0, s.head_dim, 2) / s.head_dim), jnp.float32)
    # Speculative verification's consecutive positions; the last case runs past max_len (dropped).
    start = max_len - tokens // 2 if tokens >= 8 else 77 * tokens
    positions = jnp.arange(start, start + tokens, dtype=jnp.int32)
    kv = s.kv_heads * s.head_dim
    biases = tuple(rand(kk, 2, n) for kk, n in zip(jax.random.split(k[7], 3), (s.q_size, kv, kv))) if biased else None
    fused, reference = both_paths(qkv_rope_append, h, norm, wq, wk, wv, inv_freq, positions, k_cache, v_cache,
                                  layer=1, eps=1e-5, biases=biases)  # fmt: skip
    for got, want in zip(fused, reference, strict=True):
        assert_matches(got, want)
    np.testing.assert_array_equal(np.asarray(fused[1][0]), np.asarray(k_cache[0]))  # layer 0 untouched


# Per-head Q/K norms (Qwen3's) in two launches, with and without biases; the 8-token case runs past the cache's end.
QK_NORM_CASES = [("llama-3.1-8b", 1, False), ("llama-3.2-1b", 8, True), ("odd", 3, False), ("smollm2-135m", 16, True)]


@pytest.mark.parametrize("model,tokens,biased", QK_NORM_CASES)
def test_qkv_project_then_qk_norm_rope_append(model, tokens, biased):
    """The projections stored as they are (`qkv_project`), then each Q and K head's norm, the rotation and the
    cache write (`qk_norm_rope_append`, from the reference's projections so that it is checked alone)."""
    s = SHAPES[model]
    max_len, kv = 300, s.kv_heads * s.head_dim
    k = keys(f"qk-norm-{model}-{biased}", tokens, 10)
    h, norm = rand(k[0], tokens, s.hidden), 1 + rand(k[1], 2, s.hidden, scale=0.1)
    wq = rand(k[2], 2, s.q_size, s.hidden, scale=s.hidden**-0.5)
    wk, wv = (rand(kk, 2, kv, s.hidden, scale=s.hidden**-0.5) for kk in k[3:5])
    k_cache, v_cache = (rand(kk, 2, 1, s.kv_heads, max_len, s.head_dim) for kk in k[5:7])
    q_norm, k_norm = (1 + rand(kk, 2, s.head_dim, scale=0.3) for kk in k[7:9])
    biases = tuple(rand(kk, 2, n) for kk, n in zip(jax.random.split(k[9], 3), (s.q_size, kv, kv))) if biased else None
    inv_freq = jnp.asarray(1.0 / 1e6 ** (np.arange(0, s.head_dim, 2) / s.head_dim), jnp.float32)
    start = max_len - tokens // 2 if tokens >= 8 else 77 * tokens
    positions = jnp.arange(start, start + tokens, dtype=jnp.int32)
    projected, want = both_paths(qkv_project, h, norm, wq, wk, wv, head_dim=s.head_dim, layer=1, biases=biases)
    assert projected.shape == (tokens, s.heads + 2 * s.kv_heads, s.head_dim) and projected.dtype == jnp.float32
    assert_matches(projected, want, rel=1e-4)  # f32 sums in another order
    args = (want, q_norm, k_norm, inv_freq, positions, k_cache, v_cache)
    fused, reference = both_paths(qk_norm_rope_append, *args, layer=1, eps=1e-6)
    for got, expected in zip(fused, reference, strict=True):
        assert_matches(got, expected)
    np.testing.assert_array_equal(np.asarray(fused[1][0]), np.asarray(k_cache[0]))  # layer 0 untouched


# Every case at 1K; longer and windowed contexts at 1 and 16 tokens; one long context (splits).
ATTENTION_CASES = (
    [(model, tokens, 1000, None) for model, tokens in CASES]
    + [(model, tokens, 4097, None) for model in SHAPES for tokens in (1, 16)]
    + [(model, tokens, 3000, 1024) for model in SHAPES for tokens in (1, 16)]
    + [("llama-3.2-1b", tokens, 262_144, None) for tokens in (1, 16)]
)


@pytest.mark.parametrize("model,tokens,context,window", ATTENTION_CASES)
def test_decode_attention(model, tokens, context, window):
    s = SHAPES[model]
    max_len = max(8192, context + 64)
    k = keys(f"attention-{model}-{context}-{window}", tokens, 3)
    q = rand(k[0], tokens, s.heads, s.head_dim)
    k_cache, v_cache = (rand(kk, 1, 1, s.kv_heads, max_len, s.head_dim) for kk in k[1:3])
    positions = jnp.arange(context - tokens, context, dtype=jnp.int32)
    assert_matches(
        *both_paths(decode_attention, q, k_cache, v_cache, positions, layer=0, sliding_window=window)
    )


@pytest.mark.parametrize("model,tokens", CASES)
def test_lm_head_argmax(model, tokens):
    s = SHAPES[model]
    k = keys(f"lm-head-{model}", tokens, 3)
    h, head, norm = (
        rand(k[0], tokens, s.hidden),
        rand(k[1], s.vocab, s.hidden),
        1 + rand(k[2], s.hidden, scale=0.1),
    )
    (ids, logits), (ref_ids, ref_logits) = both_paths(
        lm_head_argmax, h, head, norm_weight=norm, with_logits=True
    )
    assert_matches(logits, ref_logits, rel=1e-4)  # float32 logits: only the summation order differs
    ref = np.asarray(ref_logits)
    picked = ref[np.arange(tokens), np.asarray(ids)]
    # The same id, or (summation order deciding a near-tie) one within float32 noise of the best.
    assert np.all(
        (np.asarray(ids) == np.asarray(ref_ids)) | (ref.max(-1) - picked < 1e-4 * np.abs(ref).max())
    )
    only_ids = jax.jit(lambda *a: lm_head_argmax(*a, norm_weight=norm, path=KERNEL))(h, head)
    np.testing.assert_array_equal(np.asarray(only_ids), np.asarray(ids))
