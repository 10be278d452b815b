"""Attention's input half for 1..16 tokens (kernel in csrc/qkv_rope.cu) beside its reference twin:
RMSNorm -> Q, K, V projections -> rotary positions on Q and K -> K and V written into the cache.

The caches are updated in place: the kernel's cache outputs alias its cache inputs, so under `jit`
with the caches donated (or carried through a `scan`/`while_loop`) no copy is made. A linear cache
stores position p in slot p (positions past its end are dropped), a ring (`ring`, lithos.kv_cache)
in slot p % slots. An FP8 cache
(lithos.kv_cache: u8 codes with scales `[layers, 1, kv_heads]`) gets the codes of K / scale and
V / scale, the scales being read, never changed (prefill set them). Q/K/V biases (Qwen2's) are added to
the projections before the rotation. `qkv_project` is the same pass without the rotation and the
cache, for Q and K heads normalised first (Qwen3's; then lithos.custom_calls.qk_norm_rope).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import numpy as np

from lithos.custom_calls.dispatch import (
    absent,
    at_layer,
    cache_slots,
    call_kernel,
    check_cache_scales,
    check_tokens,
    dispatch,
    layer_index,
    require_bf16,
    stacked,
)
from lithos.custom_calls.launch import launch_attributes
from lithos.custom_calls.numerics import f32, project, rms_normalize, rotate
from lithos.errors import LithosError
from lithos.quant.kv import quantize_kv


def stacked_biases(biases, layer) -> tuple:
    """Q/K/V biases (bq, bk, bv) each stacked `[layers, out]` (see `stacked`), or three Nones."""
    if biases is None:
        return None, None, None
    return tuple(stacked(name, b, 1, layer) for name, b in zip(("bq", "bk", "bv"), biases, strict=True))


def check_biases(op: str, biases: tuple, q_rows: int, kv_rows: int) -> None:
    """Stacked biases (from `stacked_biases`) must have Q's rows and K's and V's."""
    if biases[0] is not None and tuple(b.shape[-1] for b in biases) != (q_rows, kv_rows, kv_rows):
        shapes = ", ".join(str(list(b.shape)) for b in biases)
        raise LithosError(f"{op}: biases {shapes} must end in {q_rows}, {kv_rows} and {kv_rows} (the rows of Q, K, V)")


def bias_args(biases: tuple) -> tuple:
    """The kernels' three bias operands: the biases, or empty arrays for none (the handler reads nullptr)."""
    return (absent(),) * 3 if biases[0] is None else biases


def _stored(new, cache, scale, layer):
    """New keys or values `[tokens, kv_heads, head_dim]` (f32) as the cache stores them: rounded once to its
    dtype, or E4M3 codes of new / scale for an FP8 cache."""
    if scale is None:
        return new.astype(cache.dtype)
    return quantize_kv(new.swapaxes(0, 1), at_layer(scale, layer)[0]).swapaxes(0, 1)


def add_bias(y: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """A projection `y` plus its bias `b` in f32, with the model's rounding: `y` in the activations' `dtype` plus
    `b` in it, as `linear(x, w, b)` computes them (the kernels' epilogue does the same for bf16)."""
    return f32(y.astype(dtype) + b.astype(dtype))


def _projections(h, norm_weight, wq, wk, wv, layer, bq, bk, bv, eps) -> list[jax.Array]:
    """The twins' Q, K and V `[tokens, out]` in f32: RMSNorm(h) projected, biases (if any) added."""
    x = rms_normalize(h, at_layer(norm_weight, layer), eps)
    ys = [project(x, at_layer(w, layer)) for w in (wq, wk, wv)]
    if bq is not None:
        ys = [add_bias(y, at_layer(b, layer), h.dtype) for y, b in zip(ys, (bq, bk, bv), strict=True)]
    return ys


def _reference(
    h, norm_weight, wq, wk, wv, inv_freq, positions, layer, k_cache, v_cache, k_scale, v_scale, bq, bk, bv, *, eps, ring
):
    q, k, v = _projections(h, norm_weight, wq, wk, wv, layer, bq, bk, bv, eps)
    return rope_and_append(q, k, v, h.dtype, inv_freq, positions, layer, k_cache, v_cache, k_scale, v_scale, ring=ring)


def rope_and_append(
    q, k, v, dtype, inv_freq, positions, layer, k_cache, v_cache, k_scale, v_scale, *, ring, qk_norms=None, eps=0.0
):
    """The projections' f32 results `[tokens, heads * head_dim]` rotated, K and V written into layer `layer` of
    the stacked caches: returns (q `[tokens, heads, head_dim]` in `dtype`, k_cache, v_cache). `qk_norms`: the
    per-head RMSNorm weights of Q and K (stacked `[layers, head_dim]`: Qwen3's q_norm and k_norm), applied to each
    head before the rotation."""
    tokens = q.shape[0]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[4]
    q = q.reshape(tokens, -1, head_dim)
    k = k.reshape(tokens, kv_heads, head_dim)
    v = v.reshape(tokens, kv_heads, head_dim)
    if qk_norms is not None:
        q, k = (rms_normalize(x, at_layer(w, layer), eps) for x, w in zip((q, k), qk_norms, strict=True))
    q = rotate(q, positions, inv_freq)
    k = rotate(k, positions, inv_freq)
    # A layer index into a cache with one layer (shared) is 0.
    cache_layer = layer if k_cache.shape[0] > 1 else 0
    slots = cache_slots(positions, k_cache.shape[3], ring)
    k_cache = k_cache.at[cache_layer, 0, :, slots].set(_stored(k, k_cache, k_scale, layer), mode="drop")
    v_cache = v_cache.at[cache_layer, 0, :, slots].set(_stored(v, v_cache, v_scale, layer), mode="drop")
    return q.astype(dtype), k_cache, v_cache


def _kernel(
    h, norm_weight, wq, wk, wv, inv_freq, positions, layer, k_cache, v_cache, k_scale, v_scale, bq, bk, bv, *, eps,
    ring, launch
):
    head_dim = k_cache.shape[4]
    dims = {"hidden": h.shape[1], "heads": wq.shape[1] // head_dim, "kv_heads": k_cache.shape[2], "head_dim": head_dim}
    attrs = launch_attributes("qkv_rope_append", dims, h.shape[0], launch)
    q_type = jax.ShapeDtypeStruct((h.shape[0], wq.shape[1] // head_dim, head_dim), h.dtype)
    out_types = [
        q_type,
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    ]
    return tuple(
        call_kernel(
            "qkv_rope",
            "LithosQkvRopeAppend" if k_scale is None else "LithosQkvRopeAppendFp8",
            out_types,
            h,
            norm_weight,
            wq,
            wk,
            wv,
            inv_freq,
            positions,
            layer,
            k_cache,
            v_cache,
            *(() if k_scale is None else (k_scale, v_scale)),
            *bias_args((bq, bk, bv)),
            aliases={8: 1, 9: 2},
            eps=np.float32(eps),
            ring=bool(ring),
            **attrs,
        )
    )


def qkv_rope_append(
    h: jax.Array,
    norm_weight: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    inv_freq: jax.Array,
    positions: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    eps: float = 1e-5,
    ring: bool = False,
    path: str = "auto",
    launch: Mapping[str, int] | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries for `h` `[tokens, hidden]` at `positions` `[tokens]` (int32), with K and V written into
    the caches. Weights `[out, hidden]` or stacked `[layers, out, hidden]` (norm `[hidden]` or
    `[layers, hidden]`); caches `[layers, 1, kv_heads, slots, head_dim]`, linear or (`ring`) a ring;
    inv_freq `[head_dim/2]` float32 (e.g. `rope_inv_freq(cfg)`). Returns (q `[tokens, heads, head_dim]`,
    k_cache, v_cache).
    `launch` fixes the kernel's launch parameters (see launch.py); by default the tuning table's. An FP8
    cache (u8 codes) comes with `k_scale`, `v_scale` `[layers, 1, kv_heads]` f32, set (> 0) beforehand.
    `biases`: (bq, bk, bv), `[out]` or stacked `[layers, out]`, added to the projections before the rotation."""
    norm_weight = stacked("norm_weight", norm_weight, 1, layer)
    bq, bk, bv = stacked_biases(biases, layer)
    wq, wk, wv = (stacked(name, w, 2, layer) for name, w in (("wq", wq), ("wk", wk), ("wv", wv)))
    k_cache = stacked("k_cache", k_cache, 4, layer)
    v_cache = stacked("v_cache", v_cache, 4, layer)
    k_scale, v_scale = check_cache_scales("qkv_rope_append", k_cache, k_scale, v_scale, layer)
    head_dim, kv_heads = k_cache.shape[4], k_cache.shape[2]
    if h.ndim != 2 or wq.shape[2] != h.shape[1] or wq.shape[1] % head_dim != 0:
        raise LithosError(f"qkv_rope_append: h {list(h.shape)} and wq {list(wq.shape)} do not fit head_dim {head_dim}")
    kv_shape = (kv_heads * head_dim, h.shape[1])
    if wk.shape != wv.shape or wk.shape[1:] != kv_shape or v_cache.shape != k_cache.shape:
        raise LithosError(
            f"qkv_rope_append: wk {list(wk.shape)} / wv {list(wv.shape)} do not fit the cache {list(k_cache.shape)}"
        )
    if inv_freq.shape != (head_dim // 2,) or positions.shape != (h.shape[0],):
        raise LithosError(f"qkv_rope_append: inv_freq must be [{head_dim // 2}] and positions [{h.shape[0]}]")
    check_biases("qkv_rope_append", (bq, bk, bv), wq.shape[1], kv_shape[0])

    def check():
        check_tokens("qkv_rope_append", h.shape[0])
        require_bf16(
            "qkv_rope_append",
            h=h,
            norm_weight=norm_weight,
            wq=wq,
            wk=wk,
            wv=wv,
            bq=bq,
            bk=bk,
            bv=bv,
        )
        if k_scale is None:
            require_bf16("qkv_rope_append", k_cache=k_cache, v_cache=v_cache)
        if k_cache.shape[1] != 1 or head_dim % 4 != 0:
            raise LithosError("qkv_rope_append: the fused kernel takes batch 1 and head_dim a multiple of 4")

    return dispatch(
        path,
        functools.partial(_reference, eps=eps, ring=ring),
        functools.partial(_kernel, eps=eps, ring=ring, launch=launch),
        h,
        norm_weight,
        wq,
        wk,
        wv,
        f32(jax.numpy.asarray(inv_freq)),
        positions.astype(np.int32),
        layer_index(layer),
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        bq,
        bk,
        bv,
        check=check,
    )


def _project_reference(h, norm_weight, wq, wk, wv, layer, bq, bk, bv, *, eps, head_dim):
    ys = _projections(h, norm_weight, wq, wk, wv, layer, bq, bk, bv, eps)
    return jax.numpy.concatenate(ys, axis=-1).reshape(h.shape[0], -1, head_dim)


def _project_kernel(h, norm_weight, wq, wk, wv, layer, bq, bk, bv, *, eps, head_dim, launch):
    heads, kv_heads = wq.shape[1] // head_dim, wk.shape[1] // head_dim
    dims = {"hidden": h.shape[1], "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    attrs = launch_attributes("qkv_rope_append", dims, h.shape[0], launch)  # the same row groups
    out = jax.ShapeDtypeStruct((h.shape[0], heads + 2 * kv_heads, head_dim), np.float32)
    (projected,) = call_kernel(
        "qkv_rope",
        "LithosQkvProject",
        [out],
        *(h, norm_weight, wq, wk, wv, layer, *bias_args((bq, bk, bv))),
        eps=np.float32(eps),
        **attrs,
    )
    return projected


def qkv_project(
    h: jax.Array,
    norm_weight: jax.Array,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    *,
    head_dim: int,
    layer: int | jax.Array | None = None,
    eps: float = 1e-5,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    path: str = "auto",
    launch: Mapping[str, int] | None = None,
) -> jax.Array:
    """RMSNorm(h) -> the Q, K and V projections (biases added), f32 `[tokens, heads + 2 kv_heads, head_dim]`: Q's
    heads, then K's, then V's, neither rotated nor cached (`qk_norm_rope_append` does that after each head's
    norm). Shapes as `qkv_rope_append`'s."""
    norm_weight = stacked("norm_weight", norm_weight, 1, layer)
    bq, bk, bv = stacked_biases(biases, layer)
    wq, wk, wv = (stacked(name, w, 2, layer) for name, w in (("wq", wq), ("wk", wk), ("wv", wv)))
    if h.ndim != 2 or wq.shape[2] != h.shape[1] or wq.shape[1] % head_dim or wk.shape[1] % head_dim:
        raise LithosError(f"qkv_project: h {list(h.shape)}, wq {list(wq.shape)} and wk {list(wk.shape)} do not fit "
                          f"head_dim {head_dim}")  # fmt: skip
    if wk.shape != wv.shape or wk.shape[2] != h.shape[1]:
        raise LithosError(f"qkv_project: wk {list(wk.shape)} and wv {list(wv.shape)} must be alike and take h")
    check_biases("qkv_project", (bq, bk, bv), wq.shape[1], wk.shape[1])

    def check():
        check_tokens("qkv_project", h.shape[0])
        require_bf16("qkv_project", h=h, norm_weight=norm_weight, wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv)
        if head_dim % 4 != 0:
            raise LithosError("qkv_project: the fused kernel takes head_dim a multiple of 4")

    return dispatch(
        path,
        functools.partial(_project_reference, eps=eps, head_dim=head_dim),
        functools.partial(_project_kernel, eps=eps, head_dim=head_dim, launch=launch),
        *(h, norm_weight, wq, wk, wv, layer_index(layer), bq, bk, bv),
        check=check,
    )
