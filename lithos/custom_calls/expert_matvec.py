"""Routed-expert projections for mixture-of-experts decoding (kernel in csrc/expert_matvec.cu) beside
their reference twin.

    y[p] = x[p] @ w[expert_ids[p]].T        for each selected (token, expert) pair p

The kernel reads only the rows of the experts named in `expert_ids`, so a decode step's bytes are
those of its routed experts, never of the whole `[experts, out, in]` stack. Weights are bf16 or
packed (lithos.quant: MXFP4 as GPT-OSS ships its experts, and every other packed format), dequantised
in registers and accumulated in float32. Biases and the router stay with the caller: they are tiny next
to the expert weights. `expert_gate_up_silu` is the gate/up projection with the SwiGLU of experts whose
matrix is [gate | up] in the same launch.
"""

from __future__ import annotations

import functools

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


def _gated_reference(x, w, expert_ids, layer):
    """silu(gate) * up of the pairs' [gate | up] projections (bf16, as the plain op gives them), x a row a token."""
    pairs = jnp.repeat(x, expert_ids.shape[0] // x.shape[0], axis=0)
    gate, up = jnp.split(f32(_reference(pairs, w, expert_ids, layer)), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def _kernel(x, w, expert_ids, layer, *, gated: bool):
    out = jax.ShapeDtypeStruct((expert_ids.shape[0], w.shape[-2] // (2 if gated else 1)), x.dtype)
    data, scales, mins = planes(w)
    (y,) = call_kernel(
        "expert_matvec",
        "LithosExpertGateUpSilu" if gated else "LithosExpertMatvec",
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


def _checked(op: str, x: jax.Array, w: Weight, expert_ids: jax.Array, layer, pairs_per_row: str):
    """`w` stacked, after the checks both ops share; returns it and the kernel-only `check`."""
    w = stacked_weight("w", w, 3, layer)
    if x.ndim != 2 or x.shape[1] != w.shape[-1]:
        raise LithosError(f"{op}: x must be [rows, {w.shape[-1]}] for w {list(w.shape)}, not {list(x.shape)}")
    if expert_ids.ndim != 1 or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise LithosError(f"{op}: expert_ids must be a vector of integers ({pairs_per_row}), got "
                          f"{list(expert_ids.shape)} {expert_ids.dtype}")  # fmt: skip

    def check():
        if x.dtype != jnp.bfloat16:
            raise LithosError(f"{op}: the kernel takes bfloat16 x, got {x.dtype}; cast it or use path='reference'")
        format_code(w)
        if w.shape[-1] % 16:
            raise LithosError(
                f"{op}: the kernel takes inputs of a multiple of 16 features, got {w.shape[-1]}; use path='reference'"
            )

    return w, check


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
    w, check = _checked("expert_matvec", x, w, expert_ids, layer, "one per row of x")
    if expert_ids.shape != (x.shape[0],):
        raise LithosError(
            f"expert_matvec: expert_ids must be [{x.shape[0]}] (one expert per row of x), not {list(expert_ids.shape)}"
        )
    if x.shape[0] == 0:
        return jnp.zeros((0, w.shape[-2]), x.dtype)
    kernel = functools.partial(_kernel, gated=False)
    return dispatch(path, _reference, kernel, x, w, expert_ids, layer_index(layer), check=check)


def expert_gate_up_silu(
    x: jax.Array,
    w: Weight,
    expert_ids: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    path: str = "auto",
) -> jax.Array:
    """The gated experts' first half for experts whose matrix is [gate | up] (`[.., 2 ffn, in]`): for each pair p,
    silu(g) * u of `g, u = x[p // k] @ w[expert_ids[p]].T` (each rounded to x's dtype, as `expert_matvec` gives
    them). x `[tokens, in]` (a row a token), expert_ids `[tokens * k]` (a token's k experts together); returns
    `[tokens * k, ffn]` in x's dtype."""
    w, check = _checked("expert_gate_up_silu", x, w, expert_ids, layer, "a token's experts together")
    if x.shape[0] == 0 or expert_ids.shape[0] % x.shape[0] or w.shape[-2] % 2:
        raise LithosError(
            f"expert_gate_up_silu: expert_ids {list(expert_ids.shape)} must hold k for each of x's {x.shape[0]} rows, "
            f"and w {list(w.shape)} 2 ffn rows ([gate | up])"
        )
    kernel = functools.partial(_kernel, gated=True)
    return dispatch(path, _gated_reference, kernel, x, w, expert_ids, layer_index(layer), check=check)


__all__ = ["expert_gate_up_silu", "expert_matvec"]
