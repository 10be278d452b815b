"""The 8-bit KV cache format: FP8 E4M3 codes with one f32 scale per (layer, batch row, KV head).

    codes  u8  [layers, batch, kv_heads, max_len, head_dim]   E4M3 ("fn") bit patterns
    scales f32 [layers, batch, kv_heads]                      value = e4m3(code) * scale

Scales are powers of two, chosen once per row from the first keys/values written (the prompt, at
prefill) with headroom above their largest magnitude; larger values later saturate at +-448 * scale
(never NaN). Why powers of two:
- E4M3 rounds to 4 significant bits wherever a value lands in its normal range, so with a
  power-of-two scale the stored value is the value rounded to 4 significant bits whatever the
  scale: the scale only decides where saturation and the subnormal range begin. Headroom is
  therefore nearly free, and a scale a little too large or too small changes almost nothing.
- Dequantising is exact in f32, bf16 and f16 (a 4-bit significand times a power of two), and a
  kernel can fold the scale into the query and the output instead of multiplying every element.
Why fixed per row rather than per token: appending a token is a divide-and-round with no rescaling
of what is stored, attention reads one byte per element and one scale per head, and a speculative
rollback (moving the length back) leaves nothing to undo.

`dequantize_kv` is the reference: an attention kernel computes `e4m3(code) * scale` in registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lithos.quant.formats import e4m3_to_f32
from lithos.quant.quantize import E4M3_MAX, e4m3_codes

# The first write's largest magnitude maps to 448 / HEADROOM or a little below (the power of two
# rounds up), so later tokens may be 4-8x larger before they saturate. The price is the subnormal
# range: values below 2^-6 * scale (about max / 7000 of the first write) keep an absolute error
# of at most scale * 2^-10 instead of a relative one.
HEADROOM = 4.0
# Scale exponents are kept where every dequantised value is a normal f32/bf16.
MIN_SCALE_EXP, MAX_SCALE_EXP = -100, 100


def kv_scales(x: jax.Array, headroom: float = HEADROOM) -> jax.Array:
    """Power-of-two scales `x.shape[:-2]` from keys or values `[..., tokens, head_dim]` (e.g. `[layers,
    batch, kv_heads, tokens, head_dim]` -> `[layers, batch, kv_heads]`): the smallest 2^e with
    max |x| * headroom <= 448 * 2^e. An all-zero slice gets 1."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(-2, -1))
    mantissa, exponent = jnp.frexp(amax * (headroom / E4M3_MAX))  # = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # already a power of two
    exponent = jnp.where(amax > 0, jnp.clip(exponent, MIN_SCALE_EXP, MAX_SCALE_EXP), 0)
    return jnp.ldexp(jnp.ones_like(amax), exponent)


def quantize_kv(x: jax.Array, scales: jax.Array) -> jax.Array:
    """Keys or values `[..., tokens, head_dim]` -> E4M3 codes (u8): x / scale rounded to nearest even and
    saturated at +-448; scales `x.shape[:-2]`."""
    return e4m3_codes(x.astype(jnp.float32) / scales[..., None, None])


def dequantize_kv(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The reference: E4M3 codes `[..., tokens, head_dim]` times their scale (`codes.shape[:-2]`), in
    `dtype` (exact for f32 and bf16 with power-of-two scales)."""
    return (e4m3_to_f32(codes) * scales[..., None, None]).astype(dtype)
