"""Quantizing dense weights: MXFP4 and MXFP8 as the OCP MX spec rounds them, FP8 with 128x128 block
scales as DeepSeek-V3 does, and choosing which tensor groups of a model to quantize.

All of it is jax.numpy, so it runs on the accelerator for large models (a random Llama-3.1-8B shape
for `lithos bench`) as well as on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos.errors import LithosError
from lithos.quant.formats import FP8_BLOCK128, MXFP4, MXFP8, QuantizedArray, get_format

# Largest element magnitude and its exponent (floor(log2(max))), per MX element type.
E2M1_MAX, E2M1_EMAX = 6.0, 2
E4M3_MAX, E4M3_EMAX = 448.0, 8

# Round-to-nearest-even onto the E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} (codes 0..7): the code is
# how many midpoints a magnitude passes. At a midpoint the even code wins, so a tie counts as passed
# only when the code above it is even.
_E2M1_TIES_DOWN = np.array([0.25, 1.25, 2.5, 5.0], np.float32)  # code above is odd: stay below
_E2M1_TIES_UP = np.array([0.75, 1.75, 3.5], np.float32)  # code above is even: go up


def _pow2(exponent: jax.Array) -> jax.Array:
    """2^exponent as f32 for integer exponents in [-126, 127], built from bits (exact, no libm)."""
    return jax.lax.bitcast_convert_type(((exponent + 127).astype(jnp.uint32)) << 23, jnp.float32)


def e2m1_codes(scaled: jax.Array) -> jax.Array:
    """f32 values already divided by their block scale -> E2M1 codes (u8), saturating at +-6."""
    magnitude = jnp.minimum(jnp.abs(scaled), E2M1_MAX)
    code = jnp.sum(magnitude[..., None] > _E2M1_TIES_DOWN, axis=-1) + jnp.sum(
        magnitude[..., None] >= _E2M1_TIES_UP, axis=-1
    )
    return (code.astype(jnp.uint8)) | (jnp.signbit(scaled).astype(jnp.uint8) << 3)


def e4m3_codes(scaled: jax.Array) -> jax.Array:
    """f32 -> E4M3 bit patterns (u8), round to nearest even, saturating at +-448 (never NaN)."""
    fp8 = jnp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(fp8, jnp.uint8)


SCALE_RULES = ("floor", "ceil")


def quantize_mx(x: jax.Array, fmt_name: str = "mxfp4", dtype=None, scale_rule: str = "floor") -> QuantizedArray:
    """Quantize `x` `[..., out, in]` (in a multiple of 32) to MXFP4 or MXFP8.

    Per block of 32 along `in`, the OCP MX v1.0 rule (`scale_rule="floor"`): shared exponent =
    floor(log2(max |x|)) minus the element type's largest exponent (2 for E2M1, 8 for E4M3), clamped
    to the E8M0 range; each element is x / 2^shared rounded to nearest even and saturated to the
    element's largest value (so a block whose max lies in [6, 8) * 2^shared is clipped to 6).
    `scale_rule="ceil"` takes one step more where that would clip: the smallest exponent with
    max |x| <= largest element * 2^shared. An all-zero block gets exponent -127 (code 0).
    `dtype` (default x's) is what the array stands for in a model.
    """
    fmt = get_format(fmt_name)
    if fmt not in (MXFP4, MXFP8):
        raise LithosError(f"quantize_mx makes mxfp4 or mxfp8, not {fmt_name!r}")
    fmt.plane_shapes(tuple(x.shape))  # checks that `in` splits into blocks of 32
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    _, exp = jnp.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2(amax)) = exp - 1
    emax = E2M1_EMAX if fmt is MXFP4 else E4M3_EMAX
    shared = exp - 1 - emax
    if scale_rule == "ceil":
        largest = E2M1_MAX if fmt is MXFP4 else E4M3_MAX
        shared = jnp.where(amax > largest * _pow2(jnp.clip(shared, -126, 127)), shared + 1, shared)
    elif scale_rule != "floor":
        raise LithosError(f"unknown MX scale rule {scale_rule!r}; choose one of {', '.join(SCALE_RULES)}")
    shared = jnp.where(amax > 0, jnp.clip(shared, -127, 127), -127)
    # Dividing by 2^shared is an exact multiply by 2^-shared, and -shared is in [-125, 127] for finite x.
    scaled = blocks * _pow2(-shared)[..., None]
    if fmt is MXFP4:
        codes = e2m1_codes(scaled).reshape(*x.shape[:-1], x.shape[-1])
        data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    else:
        data = e4m3_codes(scaled).reshape(x.shape)
    return QuantizedArray(
        data=data,
        scales=(shared + 127).astype(jnp.uint8),
        format=fmt,
        dtype=np.dtype(dtype if dtype is not None else x.dtype),
    )


def quantize_fp8_block(x: jax.Array, dtype=None) -> QuantizedArray:
    """Quantize `x` `[..., out, in]` to E4M3 with one f32 scale per 128x128 tile (DeepSeek-V3's rule:
    scale = max |x| / 448 over the tile, elements x / scale rounded to nearest even). An all-zero
    tile gets scale 1."""
    rows, cols = x.shape[-2:]
    br, bc = FP8_BLOCK128.block
    pad_rows, pad_cols = -rows % br, -cols % bc
    xf = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 2) + [(0, pad_rows), (0, pad_cols)])
    tiles = xf.reshape(*x.shape[:-2], (rows + pad_rows) // br, br, (cols + pad_cols) // bc, bc)
    amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    scaled = tiles / scale[..., :, None, :, None]
    codes = e4m3_codes(scaled).reshape(xf.shape)[..., :rows, :cols]
    return QuantizedArray(
        data=codes, scales=scale, format=FP8_BLOCK128, dtype=np.dtype(dtype if dtype is not None else x.dtype)
    )


def quantize(x: jax.Array, fmt_name: str, dtype=None, scale_rule: str = "floor") -> QuantizedArray:
    """Quantize a dense `[..., out, in]` array to `fmt_name` ("mxfp4", "mxfp8", "fp8_block128");
    `scale_rule` picks the MX block exponent (see `quantize_mx`)."""
    if fmt_name in ("mxfp4", "mxfp8"):
        return quantize_mx(x, fmt_name, dtype, scale_rule)
    if fmt_name == "fp8_block128":
        return quantize_fp8_block(x, dtype)
    raise LithosError(
        f"lithos cannot quantize to {fmt_name!r} (it reads GGUF formats but makes mxfp4, mxfp8, fp8_block128)"
    )


# --------------------------------------------------------------------------------------------
# Which tensors
# --------------------------------------------------------------------------------------------

# Tensor groups by flat parameter name (as in `param_shapes`); a family's params hold the names of its own layers
# (a mixture of experts: experts.* for the routed layers, dense.* for the others, shared.* for Qwen2-MoE's shared
# experts), and lack the rest.
GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("layers.wq", "layers.wk", "layers.wv", "layers.wo"),
    "mlp": (
        *("layers.w_gate", "layers.w_up", "layers.w_down"),
        *("experts.gate_up", "experts.down", "dense.w_gate", "dense.w_up", "dense.w_down"),
        *("shared.w_gate", "shared.w_up", "shared.w_down"),
    ),
    "embed": ("embed",),
    "lm_head": ("lm_head",),
}
DEFAULT_GROUPS = ("attention", "mlp")


def names_for_groups(groups: Iterable[str], tied: bool) -> list[str]:
    """Flat parameter names of `groups`. With tied embeddings the table is both "embed" and "lm_head":
    choosing either quantizes it."""
    names: list[str] = []
    for group in groups:
        if group not in GROUPS:
            raise LithosError(f"unknown tensor group {group!r}; choose from {', '.join(GROUPS)}")
        for name in GROUPS[group]:
            name = "embed" if (tied and name == "lm_head") else name
            if name not in names:
                names.append(name)
    return names


def param_at(params: Any, name: str) -> Any:
    """The parameter at flat name `name` ("layers.wq") of a Params pytree; None where the model has none (a
    mixture of experts' layers.w_gate, a model without dense layers' dense.w_up)."""
    obj = params
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj


def with_param(params: Any, name: str, value: Any) -> Any:
    """A copy of `params` with the parameter at flat name `name` replaced by `value`."""
    head, _, rest = name.partition(".")
    if not rest:
        return params.replace(**{head: value})
    return params.replace(**{head: with_param(getattr(params, head), rest, value)})


def quantize_params(
    params: Any, fmt_name: str, groups: Iterable[str] = DEFAULT_GROUPS, scale_rule: str = "floor"
) -> Any:
    """A copy of model `params` (a `Params` pytree) with the weights of `groups` quantized to `fmt_name`.

    Each tensor is quantized in one jitted call (on the accelerator when there is one); the dense
    copy is dropped as soon as it is replaced.
    """
    tied = getattr(params, "lm_head", None) is None
    run = jax.jit(quantize, static_argnums=(1, 2, 3))
    for name in names_for_groups(groups, tied):
        w = param_at(params, name)
        if w is None:
            continue
        if isinstance(w, QuantizedArray) and w.format.name == fmt_name:
            continue  # already what was asked (GPT-OSS ships its experts in MXFP4)
        if isinstance(w, QuantizedArray):
            raise LithosError(
                f"{name} is already packed as {w.format.name}: quantize from a bf16/f32 checkpoint, or leave the "
                "group that holds it out"
            )
        params = with_param(params, name, run(w, fmt_name, np.dtype(w.dtype), scale_rule))
    return params
