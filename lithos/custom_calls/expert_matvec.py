"""Routed-expert projections for mixture-of-experts decoding (kernel in csrc/expert_matvec.cu) beside
their reference twin.

    y[p] = x[p] @ w[expert_ids[p]].T        for each selected (token, expert) pair p

The kernel reads only the rows of the experts named in `expert_ids`, so a decode step's bytes are
those of its routed experts, never of the whole `[experts, out, in]` stack. Weights are bf16 or
packed (lithos.quant: MXFP4 as GPT-OSS ships its experts, and every other packed format), dequantised
in registers and accumulated in float32. Biases, the router and the gated activation stay with the
caller: they are tiny next to the expert weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls.dispatch import call_kernel, dispatch, layer_index
from lithos.custom_calls.numerics import HIGHEST, f32
from lithos.custom_calls.packed_weights import (
    Weight,
    format_code,
    pick,
    planes,
    stacked_weight,
    values_f32,
    weight_at_layer,
)
from lithos.errors import LithosError


def _clamped(expert_ids: jax.Array, experts: int) -> jax.Array:
    # Out-of-range ids read the nearest expert on both paths (jnp indexing would wrap negatives).
    return jnp.clip(expert_ids.astype(jnp.int32), 0, experts - 1)


def _reference(x, w, expert_ids, layer):
    w = weight_at_layer(w, layer)
    picked = values_f32(pick(w, _clamped(expert_ids, w.shape[0])))  # [n, out, in]: only the routed experts
    y = jnp.einsum("ni,noi->no", f32(x), picked, precision=HIGHEST)
    return y.astype(x.dtype)


def _kernel(x, w, expert_ids, layer):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[-2]), x.dtype)
    data, scales, mins = planes(w)
    (y,) = call_kernel(
        "expert_matvec",
        "LithosExpertMatvec",
        [out],
        x,
        data,
        scales,
        mins,
        expert_ids.astype(jnp.int32),
        layer,
        format=np.int32(format_code(w)),
    )
    return y


def expert_matvec(
    x: jax.Array,
    w: Weight,
    expert_ids: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    path: str = "auto",
) -> jax.Array:
    """`y[p] = x[p] @ w[expert_ids[p]].T`: x `[n, in]` (one row per selected (token, expert) pair), w
    `[experts, out, in]` or stacked `[layers, experts, out, in]` (then pass `layer`), bf16 or a packed
    QuantizedArray, expert_ids `[n]` int32; returns `[n, out]` in x's dtype."""
    w = stacked_weight("w", w, 3, layer)
    if x.ndim != 2 or x.shape[1] != w.shape[-1]:
        raise LithosError(f"expert_matvec: x must be [pairs, {w.shape[-1]}] for w {list(w.shape)}, not {list(x.shape)}")
    if expert_ids.shape != (x.shape[0],):
        raise LithosError(
            f"expert_matvec: expert_ids must be [{x.shape[0]}] (one expert per row of x), not {list(expert_ids.shape)}"
        )
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise LithosError(f"expert_matvec: expert_ids must be integers, got {expert_ids.dtype}")

    def check():
        if x.dtype != jnp.bfloat16:
            raise LithosError(
                f"expert_matvec: the kernel takes bfloat16 x, got {x.dtype}; cast it or use path='reference'"
            )
        format_code(w)
        if w.shape[-1] % 16:
            raise LithosError(
                f"expert_matvec: the kernel takes inputs of a multiple of 16 features, got {w.shape[-1]}; "
                "use path='reference'"
            )

    if x.shape[0] == 0:
        return jnp.zeros((0, w.shape[-2]), x.dtype)
    return dispatch(path, _reference, _kernel, x, w, expert_ids, layer_index(layer), check=check)


__all__ = ["expert_matvec"]
