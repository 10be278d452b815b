"""Batch-1 projections for 1..16 tokens (kernels in csrc/matvec.cu) beside their reference twins.

- `matvec`:       y = residual + xn @ w.T                     (O projection, down projection, ...)
- `gate_up_silu`: y = silu(xn @ w_gate.T) * (xn @ w_up.T)      (the MLP's first half)

with xn = RMSNorm(x, norm_weight) when `norm_weight` is given, else x. Weights keep the checkpoint's
`[out, in]` layout, optionally stacked `[layers, out, in]` and picked by `layer`. The kernels read
every weight byte once for all tokens and accumulate in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import numpy as np

from lithos.custom_calls.dispatch import (
    absent,
    at_layer,
    call_kernel,
    check_tokens,
    dispatch,
    layer_index,
    require_bf16,
    stacked,
)
from lithos.custom_calls.launch import launch_attributes
from lithos.custom_calls.numerics import f32, project, rms_normalize
from lithos.errors import LithosError


def _matvec_reference(x, w, layer, norm_weight, residual, *, eps):
    y = project(rms_normalize(x, at_layer(norm_weight, layer), eps), at_layer(w, layer))
    if residual is not None:
        y = y + f32(residual)
    return y.astype(x.dtype)


def _matvec_kernel(x, w, layer, norm_weight, residual, *, eps, launch):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    norm = absent() if norm_weight is None else norm_weight
    res = absent() if residual is None else residual
    attrs = launch_attributes("matvec", {"in": w.shape[2], "out": w.shape[1]}, x.shape[0], launch)
    (y,) = call_kernel("matvec", "LithosMatvec", [out], x, w, layer, norm, res, eps=np.float32(eps), **attrs)
    return y


def _gate_up_reference(x, w_gate, w_up, layer, norm_weight, *, eps):
    xn = rms_normalize(x, at_layer(norm_weight, layer), eps)
    gate = project(xn, at_layer(w_gate, layer))
    up = project(xn, at_layer(w_up, layer))
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def _gate_up_kernel(x, w_gate, w_up, layer, norm_weight, *, eps, launch):
    out = jax.ShapeDtypeStruct((x.shape[0], w_gate.shape[1]), x.dtype)
    norm = absent() if norm_weight is None else norm_weight
    attrs = launch_attributes("gate_up_silu", {"in": w_gate.shape[2], "out": w_gate.shape[1]}, x.shape[0], launch)
    (y,) = call_kernel(
        "matvec", "LithosGateUpSilu", [out], x, w_gate, w_up, layer, norm, eps=np.float32(eps), **attrs
    )
    return y


def _check_input(op: str, x: jax.Array, w: jax.Array, norm_weight: jax.Array | None) -> None:
    if x.ndim != 2 or x.shape[1] != w.shape[-1]:
        raise LithosError(
            f"{op}: x must be [tokens, {w.shape[-1]}] for w {list(w.shape)}, not {list(x.shape)}"
        )
    if norm_weight is not None and norm_weight.shape[-1] != x.shape[1]:
        raise LithosError(f"{op}: norm_weight {list(norm_weight.shape)} does not match x {list(x.shape)}")


def matvec(
    x: jax.Array,
    w: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    residual: jax.Array | None = None,
    eps: float = 1e-5,
    path: str = "auto",
    launch: Mapping[str, int] | None = None,
) -> jax.Array:
    """`residual + RMSNorm?(x) @ w.T`: x `[tokens, in]`, w `[out, in]` or `[layers, out, in]`,
    norm_weight `[in]` or `[layers, in]`, residual `[tokens, out]`; returns `[tokens, out]` in x's dtype.
    `launch` fixes the kernel's launch parameters (see launch.py); by default the tuning table's."""
    w = stacked("w", w, 2, layer)
    norm_weight = stacked("norm_weight", norm_weight, 1, layer)
    _check_input("matvec", x, w, norm_weight)
    if residual is not None and residual.shape != (x.shape[0], w.shape[1]):
        raise LithosError(
            f"matvec: residual must be [{x.shape[0]}, {w.shape[1]}], not {list(residual.shape)}"
        )

    def check():
        check_tokens("matvec", x.shape[0])
        require_bf16("matvec", x=x, w=w, norm_weight=norm_weight, residual=residual)

    return dispatch(
        path,
        functools.partial(_matvec_reference, eps=eps),
        functools.partial(_matvec_kernel, eps=eps, launch=launch),
        x,
        w,
        layer_index(layer),
        norm_weight,
        residual,
        check=check,
    )


def gate_up_silu(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    eps: float = 1e-5,
    path: str = "auto",
    launch: Mapping[str, int] | None = None,
) -> jax.Array:
    """`silu(xn @ w_gate.T) * (xn @ w_up.T)`, xn = RMSNorm?(x): x `[tokens, hidden]`, w_gate and w_up
    `[ffn, hidden]` or `[layers, ffn, hidden]`; returns `[tokens, ffn]` in x's dtype. `launch` as in matvec."""
    w_gate = stacked("w_gate", w_gate, 2, layer)
    w_up = stacked("w_up", w_up, 2, layer)
    norm_weight = stacked("norm_weight", norm_weight, 1, layer)
    _check_input("gate_up_silu", x, w_gate, norm_weight)
    if w_up.shape != w_gate.shape:
        raise LithosError(f"gate_up_silu: w_up {list(w_up.shape)} must match w_gate {list(w_gate.shape)}")

    def check():
        check_tokens("gate_up_silu", x.shape[0])
        require_bf16("gate_up_silu", x=x, w_gate=w_gate, w_up=w_up, norm_weight=norm_weight)

    return dispatch(
        path,
        functools.partial(_gate_up_reference, eps=eps),
        functools.partial(_gate_up_kernel, eps=eps, launch=launch),
        x,
        w_gate,
        w_up,
        layer_index(layer),
        norm_weight,
        check=check,
    )


__all__ = ["matvec", "gate_up_silu"]
