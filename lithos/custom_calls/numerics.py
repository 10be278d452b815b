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
