"""The packed-weight kernels' reference twins (csrc/matvec_packed_<format>.cu, csrc/expert_matvec.cu)
against numpy (float64) on the exact values lithos.quant dequantises, their plumbing through the
fused decoder (their sources compile for both vendors in test_custom_calls.py)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos import quant
from lithos.custom_calls import build, expert_matvec, gate_up_silu, matvec
from lithos.custom_calls.expert_matvec import expert_gate_up_silu
from lithos.custom_calls.packed_matvec import (
    packed_gate_up_silu,
    packed_lm_head_argmax,
    packed_matvec,
    packed_qkv_rope_append,
)
from lithos.custom_calls.packed_weights import FORMAT_CODES, PACKED_FORMATS, nbytes
from lithos.errors import LithosError, UnsupportedModelError
from lithos.kv_cache import init_cache
from lithos.models import llama
from lithos.quant import random_packed

from .test_custom_calls import BF16, assert_close, f64, rand, rms64, rope64

PACKED_KERNELS = [f"matvec_packed_{name}" for name in PACKED_FORMATS] + ["expert_matvec"]


def fitting(fmt_name: str, n_in: int) -> int:
    """`n_in`, or the next multiple of the format's super-block where its rows need whole ones (K-quants)."""
    fmt = quant.get_format(fmt_name)
    block = fmt.block[1] if fmt.record else 1
    return -(-n_in // block) * block


def values64(w: quant.QuantizedArray) -> np.ndarray:
    return np.asarray(quant.dequantize(w, jnp.float32), np.float64)


# --------------------------------------------------------------------------------------------
# Reference twins against numpy on the dequantised values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt_name", PACKED_FORMATS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_packed_matvec_reference(fmt_name, tokens):
    rng = np.random.default_rng(10)
    layers, n_in, n_out = 3, fitting(fmt_name, 64), 48
    w = random_packed(fmt_name, (layers, n_out, n_in), rng)
    x, norm, residual = rand(rng, tokens, n_in), rand(rng, layers, n_in), rand(rng, tokens, n_out)
    y = packed_matvec(x, w, layer=1, norm_weight=norm, residual=residual, path="reference")
    assert y.dtype == BF16
    assert_close(y, rms64(x, norm[1], 1e-5) @ values64(w)[1].T + f64(residual))
    plain = packed_matvec(x, w, layer=2, path="reference")
    assert_close(plain, f64(x) @ values64(w)[2].T)


@pytest.mark.parametrize("fmt_name", ["mxfp4", "q4_1"])
def test_packed_matvec_f32_logits_are_not_rounded(fmt_name):
    rng = np.random.default_rng(11)
    head = random_packed(fmt_name, (96, 64), rng)
    h, norm = rand(rng, 2, 64), rand(rng, 64)
    logits = packed_matvec(h, head, norm_weight=norm, out_dtype=jnp.float32, path="reference")
    assert logits.dtype == jnp.float32
    assert_close(logits, rms64(h, norm, 1e-5) @ values64(head).T, rel=1e-5)
    tokens, with_logits = packed_lm_head_argmax(h, head, norm_weight=norm, with_logits=True, path="reference")
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(with_logits), -1))
    np.testing.assert_array_equal(packed_lm_head_argmax(h, head, norm_weight=norm, path="reference"), tokens)


@pytest.mark.parametrize("fmt_name", PACKED_FORMATS)
def test_packed_gate_up_silu_reference(fmt_name):
    rng = np.random.default_rng(12)
    layers, hidden, ffn, tokens = 2, fitting(fmt_name, 64), 96, 3
    w_gate = random_packed(fmt_name, (layers, ffn, hidden), rng)
    w_up = random_packed(fmt_name, (layers, ffn, hidden), rng)
    x, norm = rand(rng, tokens, hidden), rand(rng, layers, hidden)
    y = packed_gate_up_silu(x, w_gate, w_up, layer=1, norm_weight=norm, path="reference")
    xn = rms64(x, norm[1], 1e-5)
    gate, up = xn @ values64(w_gate)[1].T, xn @ values64(w_up)[1].T
    with np.errstate(over="ignore"):  # exp(-gate) of a very negative gate is inf: SiLU 0, as it should be
        assert_close(y, gate / (1 + np.exp(-gate)) * up)


@pytest.mark.parametrize("fmt_name", PACKED_FORMATS)
def test_packed_qkv_rope_append_reference(fmt_name):
    rng = np.random.default_rng(13)
    layers, hidden, heads, kv_heads, dim, max_len, tokens = 2, fitting(fmt_name, 64), 4, 2, 16, 12, 3
    h, norm = rand(rng, tokens, hidden), rand(rng, layers, hidden)
    wq, wk, wv = (random_packed(fmt_name, (layers, n * dim, hidden), rng) for n in (heads, kv_heads, kv_heads))
    k_cache, v_cache = (rand(rng, layers, 1, kv_heads, max_len, dim) for _ in range(2))
    inv_freq = 1.0 / 100.0 ** (np.arange(0, dim, 2) / dim)
    positions = np.asarray([5, 11, 12], np.int32)  # 12 is past max_len: dropped
    q, k_new, v_new = packed_qkv_rope_append(
        h, norm, wq, wk, wv, jnp.asarray(inv_freq, jnp.float32), jnp.asarray(positions), k_cache, v_cache,
        layer=1, path="reference",
    )  # fmt: skip
    x = rms64(h, norm[1], 1e-5)
    assert_close(q, rope64((x @ values64(wq)[1].T).reshape(tokens, heads, dim), positions, inv_freq))
    k_rows = rope64((x @ values64(wk)[1].T).reshape(tokens, kv_heads, dim), positions, inv_freq)
    v_rows = (x @ values64(wv)[1].T).reshape(tokens, kv_heads, dim)
    expect_k, expect_v = f64(k_cache), f64(v_cache)
    for t in range(2):
        expect_k[1, 0, :, positions[t]] = k_rows[t]
        expect_v[1, 0, :, positions[t]] = v_rows[t]
    assert_close(k_new, expect_k)
    assert_close(v_new, expect_v)
    np.testing.assert_array_equal(f64(k_new[0]), f64(k_cache[0]))  # other layers untouched


@pytest.mark.parametrize("formats", [("q4_k", "q4_k", "q6_k"), ("q4_k", "q4_k", "bfloat16")])
def test_packed_qkv_rope_append_of_mixed_formats(formats):
    """Q, K and V in different formats (a GGUF K-quant mix's V in Q6_K, or dense where its layers mix types):
    three projections, then the same rotation and cache write."""
    rng = np.random.default_rng(20)
    layers, hidden, heads, kv_heads, dim, max_len, tokens = 2, 256, 4, 2, 16, 12, 2
    h, norm = rand(rng, tokens, hidden), rand(rng, layers, hidden)
    wq, wk, wv = (
        rand(rng, layers, n * dim, hidden) if fmt == "bfloat16" else random_packed(fmt, (layers, n * dim, hidden), rng)
        for fmt, n in zip(formats, (heads, kv_heads, kv_heads), strict=True)
    )
    k_cache, v_cache = (rand(rng, layers, 1, kv_heads, max_len, dim) for _ in range(2))
    inv_freq = 1.0 / 100.0 ** (np.arange(0, dim, 2) / dim)
    positions = np.asarray([4, 9], np.int32)
    q, k_new, v_new = jax.jit(partial(packed_qkv_rope_append, layer=1))(
        h, norm, wq, wk, wv, jnp.asarray(inv_freq, jnp.float32), jnp.asarray(positions), k_cache, v_cache
    )
    x = rms64(h, norm[1], 1e-5)
    dense = [f64(w)[1] if fmt == "bfloat16" else values64(w)[1] for w, fmt in zip((wq, wk, wv), formats, strict=True)]
    assert_close(q, rope64((x @ dense[0].T).reshape(tokens, heads, dim), positions, inv_freq))
    expect_k, expect_v = f64(k_cache), f64(v_cache)
    expect_k[1, 0, :, positions] = rope64((x @ dense[1].T).reshape(tokens, kv_heads, dim), positions, inv_freq)
    expect_v[1, 0, :, positions] = (x @ dense[2].T).reshape(tokens, kv_heads, dim)
    assert_close(k_new, expect_k)
    assert_close(v_new, expect_v)


@pytest.mark.parametrize("fmt_name", ["bfloat16", *PACKED_FORMATS])
def test_expert_matvec_reference(fmt_name):
    rng = np.random.default_rng(14)
    layers, experts, n_in, n_out = 2, 5, 64 if fmt_name == "bfloat16" else fitting(fmt_name, 64), 40
    shape = (layers, experts, n_out, n_in)
    w = rand(rng, *shape) if fmt_name == "bfloat16" else random_packed(fmt_name, shape, rng)
    dense = f64(w) if fmt_name == "bfloat16" else values64(w)
    x = rand(rng, 6, n_in)
    ids = jnp.asarray([4, 0, 4, 2, 7, -1], jnp.int32)  # 7 and -1 are out of range: the nearest expert
    y = expert_matvec(x, w, ids, layer=1, path="reference")
    nearest = np.clip(np.asarray(ids), 0, experts - 1)
    assert_close(y, np.einsum("pi,poi->po", f64(x), dense[1][nearest]))
    one_layer = jax.tree_util.tree_map(lambda p: p[1], w)
    np.testing.assert_array_equal(f64(expert_matvec(x, one_layer, ids, path="reference")), f64(y))


@pytest.mark.parametrize("fmt_name", ["bfloat16", "q4_k", "mxfp4"])
def test_expert_gate_up_silu_reference(fmt_name):
    """The gated op against float64: each pair's [gate | up] rows of its expert against its token's row of x (a
    token's k experts together), gate and up rounded to x's dtype, then silu(gate) * up."""
    rng = np.random.default_rng(20)
    layers, experts, ffn, n_in = 2, 5, 24, 64 if fmt_name == "bfloat16" else fitting(fmt_name, 64)
    shape = (layers, experts, 2 * ffn, n_in)
    w = rand(rng, *shape) if fmt_name == "bfloat16" else random_packed(fmt_name, shape, rng)
    dense = f64(w) if fmt_name == "bfloat16" else values64(w)
    x = rand(rng, 3, n_in)
    ids = jnp.asarray([4, 0, 2, 2, 1, 3], jnp.int32)  # tokens 0, 1, 2 with two experts each
    y = expert_gate_up_silu(x, w, ids, layer=1, path="reference")
    gate_up = np.einsum("pi,poi->po", np.repeat(f64(x), 2, axis=0), dense[1][np.asarray(ids)])
    gate_up = f64(jnp.asarray(gate_up, x.dtype))  # rounded as the plain op stores it
    gate, up = gate_up[:, :ffn], gate_up[:, ffn:]
    assert y.shape == (6, ffn)
    assert_close(y, gate / (1 + np.exp(-gate)) * up)
    with pytest.raises(LithosError, match="must hold k for each of x's 3 rows"):
        expert_gate_up_silu(x, w, ids[:5], layer=1, path="reference")


@pytest.mark.parametrize("fmt_name", ["bfloat16", "mxfp4"])
def test_expert_matvec_reads_only_routed_experts(fmt_name):
    """Unrouted experts poisoned with NaN (values for bf16, an E8M0 NaN scale for MXFP4) change nothing."""
    rng = np.random.default_rng(15)
    shape, ids = (6, 32, 64), jnp.asarray([1, 4, 1], jnp.int32)
    w = rand(rng, *shape) if fmt_name == "bfloat16" else random_packed(fmt_name, shape, rng)
    unrouted = np.setdiff1d(np.arange(6), np.asarray(ids))
    if fmt_name == "bfloat16":
        poisoned = w.at[unrouted].set(jnp.nan)
    else:
        poisoned = w.replace(scales=w.scales.at[unrouted].set(quant.formats.E8M0_NAN))
        assert np.isnan(values64(poisoned)[unrouted]).all()
    x = rand(rng, 3, 64)
    clean = expert_matvec(x, w, ids, path="reference")
    dirty = jax.jit(partial(expert_matvec, path="auto"))(x, poisoned, ids)
    assert np.isfinite(f64(dirty)).all()
    np.testing.assert_array_equal(f64(dirty), f64(clean))


def test_bf16_weights_take_the_bf16_ops():
    rng = np.random.default_rng(16)
    x, w, w2, norm = rand(rng, 2, 64), rand(rng, 3, 32, 64), rand(rng, 3, 32, 64), rand(rng, 3, 64)
    np.testing.assert_array_equal(
        f64(packed_matvec(x, w, layer=1, norm_weight=norm)), f64(matvec(x, w, layer=1, norm_weight=norm))
    )
    np.testing.assert_array_equal(f64(packed_gate_up_silu(x, w, w2, layer=2)), f64(gate_up_silu(x, w, w2, layer=2)))


def test_nan_codes_and_scales_reach_the_output():
    """E4M3's NaN codes and an E8M0 NaN scale make their rows NaN, as the reference dequantisation says."""
    rng = np.random.default_rng(17)
    w = random_packed("mxfp8", (8, 64), rng)
    w = w.replace(data=w.data.at[3, 5].set(0x7F))
    y = np.asarray(packed_matvec(rand(rng, 1, 64), w, path="reference"), np.float32)
    assert np.isnan(y[0, 3]) and np.isfinite(np.delete(y[0], 3)).all()


def test_format_codes_match_the_kernel_header():
    header = (build.CSRC / "packed_decode.h").read_text()
    enums = dict(bfloat16="kBf16", mxfp4="kMxfp4", mxfp8="kMxfp8", fp8_block128="kFp8Block128", q8_0="kQ8_0")
    enums.update(q4_0="kQ4_0", q4_1="kQ4_1", q5_0="kQ5_0", q5_1="kQ5_1", q4_k="kQ4_K", q5_k="kQ5_K", q6_k="kQ6_K")
    enums.update(k_mix="kKMix", q3_k="kQ3_K", q2_k="kQ2_K", iq4_nl="kIq4Nl", iq4_xs="kIq4Xs")
    for name, code in FORMAT_CODES.items():
        enum = enums[name]
        assert f"{enum} = {code}," in header, (name, enum)
    for name in PACKED_FORMATS:
        assert f"matvec_packed_{name}" in build.KERNELS


def test_packed_bytes_count_every_plane():
    w = random_packed("q4_1", (4, 64, 128), np.random.default_rng(18))
    assert nbytes(w) == 4 * 64 * 64 + 2 * (4 * 64 * 4 * 2)
    assert nbytes(jnp.zeros((4, 64, 128), BF16)) == 4 * 64 * 128 * 2


def test_errors_name_the_fix():
    rng = np.random.default_rng(19)
    x = rand(rng, 1, 64)
    packed, dense = random_packed("mxfp4", (32, 64), rng), rand(rng, 32, 64)
    with pytest.raises(LithosError, match="both be packed"):
        packed_gate_up_silu(x, packed, dense)
    with pytest.raises(LithosError, match="expert_ids must be"):
        expert_matvec(x, jax.tree_util.tree_map(lambda p: p[None], packed), jnp.zeros((2,), jnp.int32))
    with pytest.raises(LithosError, match="pass layer="):
        packed_matvec(x, random_packed("q8_0", (2, 32, 64), rng))
    with pytest.raises(LithosError, match="needs a CUDA or ROCm GPU"):
        packed_matvec(x, packed, path="ffi")
    k_cache = rand(rng, 1, 1, 1, 8, 16)
    scale = jnp.ones((1, 1, 1), jnp.float32)
    with pytest.raises(LithosError, match="unquantized KV cache"):
        packed_qkv_rope_append(
            x, rand(rng, 64), random_packed("mxfp4", (32, 64), rng), random_packed("mxfp4", (16, 64), rng),
            random_packed("mxfp4", (16, 64), rng), jnp.ones((8,), jnp.float32), jnp.zeros((1,), jnp.int32),
            k_cache, k_cache, k_scale=scale, v_scale=scale,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The fused decoder over packed weights (twins on CPU, kernels on a GPU)
# --------------------------------------------------------------------------------------------


def _decode_logits(cfg, params, kernels, steps=6):
    """Greedy logits of `steps` decode steps after a 7-token prompt, through one kernel path."""
    forward = jax.jit(partial(llama.forward, cfg=cfg, kernels=kernels))
    prefill = jax.jit(partial(llama.forward, cfg=cfg, kernels="reference"))
    tokens = jnp.asarray([[3, 17, 101, 250, 7, 64, 33]], jnp.int32)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 32, cfg.head_dim, params.embed.dtype)
    logits, cache = prefill(params, tokens, jnp.arange(7)[None], cache)
    out, token = [], jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
    for step in range(steps):
        logits, cache = forward(params, token, jnp.asarray([[7 + step]]), cache)
        out.append(np.asarray(logits[0, -1], np.float32))
        token = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
    return np.stack(out)


@pytest.mark.parametrize("fmt_name", ["mxfp4", "fp8_block128"])
def test_fused_decoder_reads_packed_weights(hf_checkpoint, fmt_name):
    from lithos.checkpoint import load_checkpoint

    ck = load_checkpoint(hf_checkpoint("llama_hd64", tied=False), dtype="float32", use_cache=False)
    packed = quant.quantize_params(ck.params, fmt_name, ["attention", "mlp", "lm_head"])
    assert quant.is_quantized(packed.layers.wq) and quant.is_quantized(packed.lm_head)
    fused = _decode_logits(ck.cfg, packed, "fused")
    reference = _decode_logits(ck.cfg, packed, "reference")
    np.testing.assert_allclose(fused, reference, rtol=0, atol=1e-4 * np.abs(reference).max())
    np.testing.assert_array_equal(fused.argmax(-1), reference.argmax(-1))


def test_fused_decoder_rejects_packed_weights_with_an_fp8_cache(hf_checkpoint):
    from lithos.checkpoint import load_checkpoint

    ck = load_checkpoint(hf_checkpoint("llama_hd64", tied=False), dtype="float32", use_cache=False)
    packed = quant.quantize_params(ck.params, "mxfp4", ["attention", "mlp"])
    cfg = ck.cfg
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 16, cfg.head_dim, jnp.float32)
    cache = cache.replace(k_scale=jnp.ones((cfg.num_layers, 1, cfg.num_kv_heads)), v_scale=jnp.ones((1,)))
    with pytest.raises(UnsupportedModelError, match="bf16 cache"):
        llama.forward(packed, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache, cfg, kernels="fused")
