"""Attention's input half after `qkv_project`, for Q and K heads with RMSNorms of their own (Qwen3's; kernel in
csrc/qk_norm_rope.cu) beside its reference twin: each Q and K head normalised, Q and K rotated, K and V written
into the cache (in place, bf16 or an FP8 cache's codes, as `qkv_rope_append` writes them).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from lithos.custom_calls.dispatch import (
    call_kernel,
    check_cache_scales,
    dispatch,
    layer_index,
    require_bf16,
    stacked,
)
from lithos.custom_calls.numerics import f32
from lithos.custom_calls.qkv import rope_and_append
from lithos.errors import LithosError


def _reference(projected, q_norm, k_norm, inv_freq, positions, layer, k_cache, v_cache, k_scale, v_scale, *, eps,
               ring, dtype):  # fmt: skip
    heads = projected.shape[1] - 2 * k_cache.shape[2]
    q, k, v = (
        part.reshape(projected.shape[0], -1)
        for part in jax.numpy.split(projected, (heads, heads + k_cache.shape[2]), axis=1)
    )
    caches = (k_cache, v_cache, k_scale, v_scale)
    return rope_and_append(q, k, v, dtype, inv_freq, positions, layer, *caches, ring=ring, qk_norms=(q_norm, k_norm),
                           eps=eps)  # fmt: skip


def _kernel(projected, q_norm, k_norm, inv_freq, positions, layer, k_cache, v_cache, k_scale, v_scale, *, eps, ring,
            dtype):  # fmt: skip
    heads = projected.shape[1] - 2 * k_cache.shape[2]
    out_types = [
        jax.ShapeDtypeStruct((projected.shape[0], heads, projected.shape[2]), dtype),
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    ]
    return tuple(
        call_kernel(
            "qk_norm_rope",
            "LithosQkNormRopeAppend" if k_scale is None else "LithosQkNormRopeAppendFp8",
            out_types,
            *(projected, q_norm, k_norm, inv_freq, positions, layer, k_cache, v_cache),
            *(() if k_scale is None else (k_scale, v_scale)),
            aliases={6: 1, 7: 2},
            eps=np.float32(eps),
            ring=bool(ring),
        )
    )


def qk_norm_rope_append(
    projected: jax.Array,
    q_norm: jax.Array,
    k_norm: jax.Array,
    inv_freq: jax.Array,
    positions: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    dtype=jax.numpy.bfloat16,
    layer: int | jax.Array | None = None,
    eps: float = 1e-6,
    ring: bool = False,
    path: str = "auto",
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries in `dtype` for the projections `projected` f32 `[tokens, heads + 2 kv_heads, head_dim]` (from
    `qkv_project`) at `positions` `[tokens]`, each Q head normalised with `q_norm` and each K head with `k_norm`
    (`[head_dim]` or stacked `[layers, head_dim]`) before the rotation, K and V written into the caches `[layers, 1,
    kv_heads, slots, head_dim]` (linear or, `ring`, a ring; an FP8 cache with `k_scale`, `v_scale`). Returns (q
    `[tokens, heads, head_dim]`, k_cache, v_cache)."""
    q_norm, k_norm = (stacked(name, w, 1, layer) for name, w in (("q_norm", q_norm), ("k_norm", k_norm)))
    k_cache = stacked("k_cache", k_cache, 4, layer)
    v_cache = stacked("v_cache", v_cache, 4, layer)
    k_scale, v_scale = check_cache_scales("qk_norm_rope_append", k_cache, k_scale, v_scale, layer)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[4]
    heads = projected.shape[1] - 2 * kv_heads if projected.ndim == 3 else 0
    if projected.ndim != 3 or projected.shape[2] != head_dim or heads <= 0 or heads % kv_heads:
        raise LithosError(
            f"qk_norm_rope_append: projections {list(projected.shape)} must be [tokens, heads + 2 * {kv_heads}, "
            f"{head_dim}] (heads a multiple of {kv_heads}) for the cache {list(k_cache.shape)}"
        )
    if q_norm.shape[-1] != head_dim or k_norm.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise LithosError(
            f"qk_norm_rope_append: q_norm {list(q_norm.shape)}, k_norm {list(k_norm.shape)} and the caches "
            f"{list(k_cache.shape)} / {list(v_cache.shape)} do not fit head_dim {head_dim}"
        )
    if inv_freq.shape != (head_dim // 2,) or positions.shape != (projected.shape[0],):
        raise LithosError(
            f"qk_norm_rope_append: inv_freq must be [{head_dim // 2}] and positions [{projected.shape[0]}]"
        )

    def check():
        require_bf16("qk_norm_rope_append", q_norm=q_norm, k_norm=k_norm)
        if k_scale is None:
            require_bf16("qk_norm_rope_append", k_cache=k_cache, v_cache=v_cache)
        if projected.dtype != np.float32 or jax.numpy.dtype(dtype) != jax.numpy.bfloat16 or k_cache.shape[1] != 1:
            raise LithosError(
                "qk_norm_rope_append: the kernel takes f32 projections, gives bf16 queries and writes a batch-1 "
                "cache; use path='reference'"
            )

    return dispatch(
        path,
        functools.partial(_reference, eps=eps, ring=ring, dtype=dtype),
        functools.partial(_kernel, eps=eps, ring=ring, dtype=dtype),
        *(projected, q_norm, k_norm, f32(jax.numpy.asarray(inv_freq)), positions.astype(np.int32)),
        *(layer_index(layer), k_cache, v_cache, k_scale, v_scale),
        check=check,
    )
