"""8-bit KV cache format (reference only; not wired into `lithos.kv_cache` yet): FP8 E4M3 codes with
one f32 scale per (layer, KV head), as vLLM's `fp8_e4m3` cache with per-head scales.

    codes  u8  [layers, batch, kv_heads, max_len, head_dim]   E4M3 bit patterns
    scales f32 [layers, kv_heads]                             value = e4m3(code) * scale

Scales are static (fixed before decoding, e.g. from a calibration prompt: max |k| / 448 per head), so
appending a token is a divide-and-round with no rescaling of what is already stored, and attention
reads one byte per element plus one scale per head. An attention kernel dequantises in registers:
`k = e4m3_to_f32(code) * scale[layer, head]`, exactly `dequantize_kv` below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lithos.quant.formats import e4m3_to_f32
from lithos.quant.quantize import E4M3_MAX, e4m3_codes


def kv_scales(x: jax.Array, margin: float = 1.0) -> jax.Array:
    """Per-(layer, head) scales `[layers, kv_heads]` from sample keys or values `[layers, batch, kv_heads,
    tokens, head_dim]`: max |x| * margin / 448, so the sample's largest entry maps to E4M3's largest."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 3, 4))
    return jnp.where(amax > 0, amax * margin / E4M3_MAX, 1.0).astype(jnp.float32)


def quantize_kv(x: jax.Array, scales: jax.Array) -> jax.Array:
    """Keys or values `[layers, batch, kv_heads, tokens, head_dim]` -> E4M3 codes (u8), x / scale rounded
    to nearest even and saturated at +-448."""
    return e4m3_codes(x.astype(jnp.float32) / scales[:, None, :, None, None])


def dequantize_kv(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The reference: E4M3 codes `[layers, batch, kv_heads, tokens, head_dim]` times their head's scale."""
    return (e4m3_to_f32(codes) * scales[:, None, :, None, None]).astype(dtype)
