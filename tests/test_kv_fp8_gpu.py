"""The FP8 KV cache's kernels against their reference twins on the GPU: decode attention over E4M3 codes
(Llama-3.2-1B and Llama-3.1-8B head shapes, 1K and 32K contexts, odd lengths, every edge code in the
cache), the K/V append that writes codes, and a fused decode of a small model from an FP8 cache.

Skipped unless jax has a CUDA or ROCm device. Run on the device machine with
`PYTHONPATH=. python3 -m pytest tests/test_kv_fp8_gpu.py`; tests/test_kv_fp8.py covers the twins on CPU.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.custom_calls import build, decode_attention, qkv_rope_append
from lithos.custom_calls.qk_norm_rope import qk_norm_rope_append
from lithos.kv_cache import FP8, init_cache
from lithos.models import llama
from lithos.quant.kv import dequantize_kv, kv_scales, quantize_kv

from .test_custom_calls_gpu import assert_matches, both_paths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(build.gpu_platform() is None, reason="needs a CUDA or ROCm GPU"),
]

BF16 = jnp.bfloat16
# heads, kv heads, head_dim
HEADS = {"llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128), "odd": (5, 1, 64)}
# Codes every cache gets somewhere: zero, negative zero, the smallest and largest subnormals, the smallest
# normal, the largest value (the saturation code) with both signs.
EDGE_CODES = np.array([0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x88, 0x7E, 0xFE], np.uint8)


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    return np.asarray(dequantize_kv(jnp.asarray(codes)[None, None], jnp.ones((1, 1))))[0, 0]


def keys(name: str, n: int):
    return jax.random.split(jax.random.PRNGKey(zlib.crc32(name.encode())), n)


def fp8_cache(key, layers: int, kv_heads: int, max_len: int, head_dim: int):
    """Codes and scales `[layers, 1, kv_heads]` of keys or values whose size differs by head (so scales
    differ), with the edge codes written into the first keys of every head."""
    size = jnp.exp2(jnp.arange(kv_heads, dtype=jnp.float32) % 5 - 2)[None, None, :, None, None]
    x = jax.random.normal(key, (layers, 1, kv_heads, max_len, head_dim), jnp.float32) * size
    scales = kv_scales(x)
    codes = quantize_kv(x, scales)
    edge = jnp.resize(jnp.asarray(EDGE_CODES), (head_dim,))
    return codes.at[:, :, :, :3].set(edge), scales


# 1K and 32K contexts, a power of two and an odd length each; 1 query (decode) and 16 (verification).
ATTENTION_CASES = [
    (model, tokens, context)
    for model in ("llama-3.2-1b", "llama-3.1-8b")
    for tokens, context in ((1, 1024), (16, 1021), (1, 32771), (16, 32768))
] + [("odd", 3, 4097)]


@pytest.mark.parametrize("model,tokens,context", ATTENTION_CASES)
def test_decode_attention_fp8(model, tokens, context):
    heads, kv_heads, head_dim = HEADS[model]
    max_len = context + 61  # room past the context, never read
    k = keys(f"fp8-attention-{model}-{tokens}-{context}", 3)
    q = jax.random.normal(k[0], (tokens, heads, head_dim), jnp.float32).astype(BF16)
    k_codes, k_scale = fp8_cache(k[1], 2, kv_heads, max_len, head_dim)
    v_codes, v_scale = fp8_cache(k[2], 2, kv_heads, max_len, head_dim)
    positions = jnp.arange(context - tokens, context, dtype=jnp.int32)
    assert_matches(
        *both_paths(decode_attention, q, k_codes, v_codes, positions, layer=1, k_scale=k_scale, v_scale=v_scale)
    )


def test_decode_attention_fp8_window():
    heads, kv_heads, head_dim = HEADS["llama-3.2-1b"]
    k = keys("fp8-attention-window", 3)
    q = jax.random.normal(k[0], (16, heads, head_dim), jnp.float32).astype(BF16)
    k_codes, k_scale = fp8_cache(k[1], 1, kv_heads, 3100, head_dim)
    v_codes, v_scale = fp8_cache(k[2], 1, kv_heads, 3100, head_dim)
    positions = jnp.arange(2984, 3000, dtype=jnp.int32)
    scales = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=1024)
    assert_matches(*both_paths(decode_attention, q, k_codes, v_codes, positions, layer=0, **scales))


def assert_fp8_writes(fused, reference, caches_before, positions, scale) -> None:
    """A kernel's (q, k_cache, v_cache) against its twin's over an FP8 cache: q within bf16 rounding, every code of
    a position not written (and layer 0) untouched, the written codes the twin's but for rare rounding ties."""
    assert_matches(fused[0], reference[0])
    max_len = caches_before[0].shape[3]
    written = np.asarray(positions)[np.asarray(positions) < max_len]
    for got, want, before in zip(fused[1:], reference[1:], caches_before):
        got, want, before = np.asarray(got), np.asarray(want), np.asarray(before)
        untouched = np.ones(max_len, bool)
        untouched[written] = False
        np.testing.assert_array_equal(got[:, :, :, untouched], before[:, :, :, untouched])
        np.testing.assert_array_equal(got[0], before[0])  # layer 0 untouched
        # Codes of values summed in another order: equal but for rare rounding ties, then one step apart.
        new, new_ref = got[1, 0][:, written], want[1, 0][:, written]
        assert (new == new_ref).mean() > 0.99
        read = e4m3_values(new) * np.asarray(scale[1, 0])[:, None, None]
        expected = e4m3_values(new_ref) * np.asarray(scale[1, 0])[:, None, None]
        np.testing.assert_allclose(read, expected, rtol=2.0**-3, atol=float(scale.max()) * 2.0**-9)
        assert ((new_ref & 0x7F) == 0x7E).any()  # the small scales saturate some values


@pytest.mark.parametrize(
    "model,tokens,biased", [("llama-3.2-1b", 1, False), ("llama-3.2-1b", 16, False), ("llama-3.1-8b", 4, True),
                            ("odd", 3, False)]
)  # fmt: skip
def test_qkv_rope_append_fp8(model, tokens, biased):
    heads, kv_heads, head_dim = HEADS[model]
    hidden = {"llama-3.2-1b": 2048, "llama-3.1-8b": 4096, "odd": 100}[model]
    max_len = 300
    k = keys(f"fp8-qkv-{model}-{tokens}", 8)
    h = jax.random.normal(k[0], (tokens, hidden), jnp.float32).astype(BF16)
    norm = (1 + 0.1 * jax.random.normal(k[1], (2, hidden), jnp.float32)).astype(BF16)
    wq, wk, wv = (
        (jax.random.normal(kk, (2, n * head_dim, hidden), jnp.float32) * hidden**-0.5).astype(BF16)
        for kk, n in zip(k[2:5], (heads, kv_heads, kv_heads))
    )
    # Random codes, so a write to a wrong slot or a lost write shows.
    k_cache, v_cache = (
        jax.random.randint(kk, (2, 1, kv_heads, max_len, head_dim), 0, 0x7F).astype(jnp.uint8) for kk in k[5:7]
    )
    # Per-(layer, head) scales 2^-9 .. 2^1: at the small ones, values of unit size saturate.
    scale = jnp.exp2(jnp.arange(2 * kv_heads, dtype=jnp.float32).reshape(2, 1, kv_heads) % 11 - 9)
    inv_freq = jnp.asarray(1.0 / 5e5 ** (np.arange(0, head_dim, 2) / head_dim), jnp.float32)
    start = max_len - tokens // 2 if tokens >= 8 else 50 * tokens  # the 16-token case runs past max_len
    positions = jnp.arange(start, start + tokens, dtype=jnp.int32)
    args = (h, norm, wq, wk, wv, inv_freq, positions, k_cache, v_cache)
    biases = None
    if biased:  # Qwen2's Q/K/V biases, added before the rotation and the codes
        biases = tuple(
            jax.random.normal(kk, (2, n * head_dim), jnp.float32).astype(BF16)
            for kk, n in zip(jax.random.split(k[7], 3), (heads, kv_heads, kv_heads))
        )
    fused, reference = both_paths(
        qkv_rope_append, *args, layer=1, eps=1e-5, k_scale=scale, v_scale=scale, biases=biases
    )
    assert_fp8_writes(fused, reference, (k_cache, v_cache), positions, scale)


@pytest.mark.parametrize("model,tokens", [("llama-3.1-8b", 1), ("llama-3.2-1b", 16), ("odd", 3)])
def test_qk_norm_rope_append_fp8(model, tokens):
    """Qwen3's second Q/K/V launch over an FP8 cache: each Q and K head normalised, rotated, and K and V written as
    codes of value / scale."""
    heads, kv_heads, head_dim = HEADS[model]
    max_len = 300
    k = keys(f"fp8-qk-norm-{model}-{tokens}", 5)
    projected = 3 * jax.random.normal(k[0], (tokens, heads + 2 * kv_heads, head_dim), jnp.float32)
    q_norm, k_norm = ((1 + 0.3 * jax.random.normal(kk, (2, head_dim), jnp.float32)).astype(BF16) for kk in k[1:3])
    k_cache, v_cache = (
        jax.random.randint(kk, (2, 1, kv_heads, max_len, head_dim), 0, 0x7F).astype(jnp.uint8) for kk in k[3:5]
    )
    scale = jnp.exp2(jnp.arange(2 * kv_heads, dtype=jnp.float32).reshape(2, 1, kv_heads) % 11 - 9)
    inv_freq = jnp.asarray(1.0 / 1e6 ** (np.arange(0, head_dim, 2) / head_dim), jnp.float32)
    start = max_len - tokens // 2 if tokens >= 8 else 50 * tokens
    positions = jnp.arange(start, start + tokens, dtype=jnp.int32)
    args = (projected, q_norm, k_norm, inv_freq, positions, k_cache, v_cache)
    fused, reference = both_paths(qk_norm_rope_append, *args, layer=1, eps=1e-6, k_scale=scale, v_scale=scale)
    assert_fp8_writes(fused, reference, (k_cache, v_cache), positions, scale)


def test_fused_decode_from_fp8_cache():
    """A small model (1B head shape): prefill on the reference path fills the FP8 cache and sets its scales,
    then three decode steps on the fused kernels and on the reference path read and extend it alike."""
    cfg = llama.Config(
        architecture="LlamaForCausalLM",
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    params = llama.init_params(cfg, jax.random.key(1), BF16)
    prompt = jax.random.randint(jax.random.key(2), (1, 1000), 0, cfg.vocab_size)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 1024, cfg.head_dim, FP8)
    forward = jax.jit(llama.forward, static_argnames=("cfg", "kernels"))
    _, cache = forward(params, prompt, jnp.arange(1000)[None], cache, cfg=cfg, kernels="reference")
    assert float(cache.k_scale.min()) > 0
    tokens = jnp.asarray([[7]], jnp.int32)
    caches = {"fused": cache, "reference": jax.tree_util.tree_map(jnp.copy, cache)}
    for step in range(3):
        logits = {}
        for kernels in caches:
            logits[kernels], caches[kernels] = forward(
                params, tokens, jnp.asarray([[1000 + step]]), caches[kernels], cfg=cfg, kernels=kernels
            )
        # bf16 activations rounded at other points, as tests/test_fused_path.py bounds them
        diff = np.abs(np.asarray(logits["fused"]) - np.asarray(logits["reference"])).max()
        assert diff <= 0.03 * np.abs(np.asarray(logits["reference"])).max()
        tokens = jnp.argmax(logits["reference"], -1).astype(jnp.int32)
    np.testing.assert_array_equal(np.asarray(caches["fused"].k_scale), np.asarray(cache.k_scale))
