"""How a weight, bf16 or packed (lithos.quant), crosses the FFI boundary, and what its reference twin reads.

A kernel that reads packed weights takes three planes and a format code:

    data    [layers, out, in * bits / 8]  u8 (i8 for q8_0), or bf16 [layers, out, in] for code 0
    scales  the format's scale plane (the K-quants: their records), stacked by layer the same way (empty for bf16)
    mins    q4_1's and q5_1's mins plane (empty otherwise)

The codes below are the `format` attribute of every packed handler (csrc/packed_decode.h reads the same table).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls.dispatch import absent
from lithos.errors import LithosError
from lithos.quant import QuantizedArray, dequantize

# Keep in step with `enum class WeightFormat` in csrc/packed_decode.h.
FORMAT_CODES: dict[str, int] = {
    "bfloat16": 0,
    "mxfp4": 1,
    "mxfp8": 2,
    "fp8_block128": 3,
    "q8_0": 4,
    "q4_0": 5,
    "q4_1": 6,
    "q4_k": 7,
    "q6_k": 8,
    "q5_0": 9,
    "q5_1": 10,
    "q5_k": 11,
    "k_mix": 12,
    "q3_k": 13,
    "q2_k": 14,
    "iq4_nl": 15,
    "iq4_xs": 16,
}
FORMAT_NAMES: dict[int, str] = {code: name for name, code in FORMAT_CODES.items()}
PACKED_FORMATS = tuple(name for name in FORMAT_CODES if name != "bfloat16")

Weight = jax.Array | QuantizedArray


def format_code(w: Weight) -> int:
    """The kernel's format code for `w` (bf16 dense arrays are code 0)."""
    if isinstance(w, QuantizedArray):
        if w.format.name not in FORMAT_CODES:
            raise LithosError(
                f"no kernel reads {w.format.name} weights; use path='reference' or dequantize the weights"
            )
        return FORMAT_CODES[w.format.name]
    if w.dtype != jnp.bfloat16:
        raise LithosError(f"the fused kernels take bfloat16 or packed weights, got {w.dtype}; cast or quantize them")
    return 0


def planes(w: Weight) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(data, scales, mins) as the kernels take them; an absent plane is an empty array."""
    if not isinstance(w, QuantizedArray):
        return w, absent(jnp.uint8), absent(jnp.float16)
    mins = absent(jnp.float16) if w.mins is None else w.mins
    return w.data, w.scales, mins


def pick(w: Weight, index: Any) -> Weight:
    """`w[index]` on the leading axis, still packed (a dense array is simply indexed)."""
    if isinstance(w, QuantizedArray):
        return jax.tree_util.tree_map(lambda p: p[index], w)
    return w[index]


def add_leading_axis(w: Weight) -> Weight:
    return pick(w, None)


def values_f32(w: Weight) -> jax.Array:
    """Exact float32 values of `w` (the reference twins' weights): dequantised with lithos.quant, or cast."""
    if isinstance(w, QuantizedArray):
        return dequantize(w, jnp.float32)
    return w.astype(jnp.float32)


def stacked_weight(name: str, w: Weight, rank: int, layer) -> Weight:
    """`w` with a leading layer axis, as `dispatch.stacked` does for dense arrays, packed or not."""
    if w.ndim == rank:
        return add_leading_axis(w)
    if w.ndim != rank + 1:
        raise LithosError(f"{name} must have {rank} dimensions, or {rank + 1} stacked by layer; got {list(w.shape)}")
    if layer is None and w.shape[0] != 1:
        raise LithosError(f"{name} is stacked {list(w.shape)} (layers first): pass layer=")
    return w


def weight_at_layer(w: Weight, layer: jax.Array) -> Weight:
    """One layer of a stacked weight, still packed (the reference twins' view of it)."""
    if w.shape[0] == 1:
        return pick(w, 0)
    if isinstance(w, QuantizedArray):
        return jax.tree_util.tree_map(lambda p: jax.lax.dynamic_index_in_dim(p, layer, 0, keepdims=False), w)
    return jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)


def nbytes(w: Weight) -> int:
    """Bytes a kernel reads to use every weight of `w` once (all planes of a packed array)."""
    if isinstance(w, QuantizedArray):
        return w.nbytes
    return int(w.size) * np.dtype(w.dtype).itemsize
