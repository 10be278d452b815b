"""The float32 arithmetic the kernels define, shared by their reference twins.

Kernels read bf16, accumulate in float32 and round once, when they write. The twins do the same
in jax.numpy, so a twin and its kernel differ only by summation order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def rms_normalize(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in float32 without rounding the result; x `[tokens, n]`, weight `[n]` (None: no norm)."""
    xf = f32(x)
    if weight is None:
        return xf
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * f32(weight)


def project(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w.T` in float32 for `[out, in]` weights: x `[tokens, in]` -> `[tokens, out]`."""
    return jnp.einsum("ti,oi->to", f32(x), f32(w), precision=HIGHEST)


def rotate(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary positions in float32, rotate-half form (as `lithos.models.llama.apply_rope`):
    x `[tokens, heads, head_dim]`, positions `[tokens]`, inv_freq `[head_dim / 2]`."""
    angles = positions[:, None].astype(jnp.float32) * f32(inv_freq)  # [T, D/2], one rounding, as the kernel
    cos = jnp.concatenate([jnp.cos(angles), jnp.cos(angles)], -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles), jnp.sin(angles)], -1)[:, None, :]
    xf = f32(x)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return xf * cos + rotated * sin
