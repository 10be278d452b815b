"""Packed weights with random codes: what a benchmark or a test times and checks where lithos reads a format
but does not make it (the GGUF formats). Speed does not depend on the values, and every code is valid.

    w = random_packed("q4_k", (layers, out, in), np.random.default_rng(0), spread=0.02)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos.quant.formats import QuantizedArray, from_planes, get_format

# The span of each record format's random f16 d (times `spread`): values of order 0.1 to 1.
RECORD_SPANS = {
    "q2_k": 0.02,
    "q3_k": 0.01,
    "q4_k": 0.002,
    "q5_k": 0.001,
    "q6_k": 0.0005,
    "k_mix": 0.0005,
    "iq4_xs": 0.0002,
}


def random_packed(
    fmt_name: str, shape: tuple[int, ...], rng: np.random.Generator, dtype=jnp.bfloat16, spread: float = 1.0
) -> QuantizedArray:
    """`shape` `[..., out, in]` in `fmt_name` with random codes (every code of the format but E4M3's NaN codes)
    and scales that keep the values near `spread` (MX formats: near 1 whatever `spread`)."""
    fmt = get_format(fmt_name)
    planes = {}
    for name, (plane_shape, plane_dtype) in fmt.plane_shapes(shape).items():
        if name == "data":
            codes = rng.integers(0, 256, plane_shape, dtype=np.uint8)
            if fmt.element == "e4m3":
                codes = np.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes).astype(np.uint8)
            plane = codes.view(plane_dtype)
        elif fmt.record:  # K-quant records: random 6-bit (q4_k, q5_k) or int8 (q3_k, q6_k, k_mix's pairs) scales
            plane = rng.integers(0, 256, plane_shape, dtype=np.uint8)
            if fmt.name == "q3_k":  # GGUF's 6-bit scales less 32
                plane = (rng.integers(-32, 32, plane_shape) & 0xFF).astype(np.uint8)
            factors = 1 if fmt.name in ("q3_k", "q6_k", "iq4_xs") else 2  # f16 d (and dmin, or A and B)
            span = spread * RECORD_SPANS[fmt.name]
            d = (span * (0.5 + rng.random((*plane_shape[:-1], factors)))).astype(np.float16)
            plane[..., : 2 * factors] = d.view(np.uint8)
        elif plane_dtype == np.uint8:  # E8M0 exponents around 2^0
            plane = rng.integers(120, 128, plane_shape).astype(np.uint8)
        elif name == "mins":
            plane = (-0.1 * spread * rng.random(plane_shape)).astype(plane_dtype)
        else:
            span = {"e4m3": 0.002, "iq4": 0.01}.get(fmt.element, 0.1)
            plane = (span * spread * (0.5 + rng.random(plane_shape))).astype(plane_dtype)
        planes[name] = jnp.asarray(plane)
    return from_planes(fmt, planes, dtype)


def spread_of(w: jax.Array) -> jax.Array:
    """The standard deviation of `w`'s first million values, taken from its first matrix's first rows: a large
    model's whole stack would not fit the host as float32, nor a flattened copy of it the device."""
    first = w[(0,) * (w.ndim - 2)] if w.ndim > 2 else w
    return jnp.std(first[: max(1, (1 << 20) // w.shape[-1])].astype(jnp.float32))


def random_packed_like(w: jax.Array, fmt_name: str, rng: np.random.Generator) -> QuantizedArray:
    """Random codes in `fmt_name` of `w`'s shape and dtype, their values near `w`'s spread (`spread_of`)."""
    return random_packed(fmt_name, tuple(w.shape), rng, w.dtype, spread=float(spread_of(w)))


def random_packed_params(params: Any, formats: dict[str, str], seed: int = 0) -> Any:
    """`params` with the flat-named matrices of `formats` ({"layers.wq": "q4_k", ...}) replaced by random codes in
    their formats."""
    from lithos.quant.quantize import param_at, with_param

    rng = np.random.default_rng(seed)
    for name, fmt_name in formats.items():
        w = param_at(params, name)
        if w is not None and not isinstance(w, QuantizedArray):  # one already packed stays as the model holds it
            params = with_param(params, name, random_packed_like(w, fmt_name, rng))
    return params


def random_packed_init(init: Callable[[jax.Array], Any], key: jax.Array, formats: dict[str, str], seed: int = 0):
    """`random_packed_params(init(key), formats, seed)` without ever holding the matrices of `formats` in their
    dense dtype: a 30B mixture of experts in bf16 does not fit beside its packed copy on an 80 GB card. Each
    matrix's spread comes from a jitted `init` that XLA prunes to that matrix, the other weights from one that
    leaves the packed ones out."""
    from lithos.quant.quantize import param_at, with_param

    shapes = jax.eval_shape(init, key)
    # A weight the model already holds packed (GPT-OSS's MXFP4 experts) stays as it is, as in random_packed_params.
    names = [name for name in formats if param_at(shapes, name) is not None]
    names = [name for name in names if not isinstance(param_at(shapes, name), QuantizedArray)]
    spreads = {name: float(jax.jit(lambda k, n=name: spread_of(param_at(init(k), n)))(key)) for name in names}
    params = jax.jit(lambda k: functools.reduce(lambda p, n: with_param(p, n, None), names, init(k)))(key)
    rng = np.random.default_rng(seed)
    for name in names:
        w = param_at(shapes, name)
        params = with_param(params, name, random_packed(formats[name], w.shape, rng, w.dtype, spread=spreads[name]))
    return params
