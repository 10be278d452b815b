"""Decode attention over the KV cache for 1..16 query positions (kernel in csrc/attention.cu) beside
its reference twin.

The kernel splits the cache along its length (flash-decoding): partial softmax per split, then a
combine. It reads, per KV head, only the keys some query can see, positions being device data, so
the same compiled step serves a 1K context and a 1M one.

The cache is bf16, or FP8 E4M3 codes (u8) with per-(layer, KV head) scales `[layers, 1, kv_heads]`
f32 (lithos.kv_cache); the reference dequantises those exactly (lithos.quant.kv.dequantize_kv). It is
linear (key position p in slot p) or a ring (`ring`: slot p % slots, holding the newest `slots`
positions, this call's own keys included: qkv_rope_append stores them first).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls.dispatch import (
    at_layer,
    call_kernel,
    check_cache_scales,
    check_ring,
    check_tokens,
    dispatch,
    layer_index,
    require_bf16,
    stacked,
)
from lithos.custom_calls.launch import launch_attributes, length_bucket
from lithos.custom_calls.numerics import HIGHEST, f32
from lithos.errors import LithosError
from lithos.kv_cache import slot_positions
from lithos.quant.kv import dequantize_kv

# Rows of the kernel's scratch: it cuts the cache into at most this many splits per KV head.
MAX_SPLITS = 64


def _cache_layer(cache, scale, layer):
    """One layer of the cache, batch 0, in f32 `[kv_heads, slots, head_dim]`; FP8 codes dequantised."""
    values = at_layer(cache, layer)[0]
    return f32(values) if scale is None else dequantize_kv(values, at_layer(scale, layer)[0])


def _reference(q, k_cache, v_cache, positions, layer, k_scale, v_scale, *, window, ring):
    keys = _cache_layer(k_cache, k_scale, layer)  # [kv_heads, slots, head_dim]
    values = _cache_layer(v_cache, v_scale, layer)
    tokens, heads, head_dim = q.shape
    kv_heads, slots = keys.shape[:2]
    qg = f32(q).reshape(tokens, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("tkgd,ksd->tkgs", qg, keys, precision=HIGHEST) / math.sqrt(head_dim)
    # The key position each slot holds (< 0: never written); a ring's newest is the last query's own.
    key_pos = slot_positions(jnp.max(positions), slots) if ring else jnp.arange(slots)
    visible = (key_pos[None, :] >= 0) & (key_pos[None, :] <= positions[:, None])  # [T, S]
    if window:
        visible &= key_pos[None, :] > positions[:, None] - window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgs,ksd->tkgd", probs, values, precision=HIGHEST)
    # A query that sees no key (no valid position) reads zeros, as the kernel writes.
    out = jnp.where(visible.any(-1)[:, None, None, None], out, 0.0)
    return out.reshape(tokens, heads, head_dim).astype(q.dtype)


def _kernel(q, k_cache, v_cache, positions, layer, k_scale, v_scale, *, window, ring, launch):
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    rows = tokens * (heads // kv_heads)
    dims = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "cache": length_bucket(k_cache.shape[3])}
    attrs = launch_attributes("decode_attention", dims, tokens, launch)
    splits = max(MAX_SPLITS, int(attrs["splits"]))  # a tuned split count gets scratch rows for all its splits
    out_types = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((splits, kv_heads, rows, head_dim), jnp.float32),  # scratch
        jax.ShapeDtypeStruct((splits, kv_heads, rows), jnp.float32),  # scratch
    ]
    fp8 = k_scale is not None
    out, _, _ = call_kernel(
        "attention",
        "LithosDecodeAttentionFp8" if fp8 else "LithosDecodeAttention",
        out_types,
        q,
        k_cache,
        v_cache,
        *((k_scale, v_scale) if fp8 else ()),
        positions,
        layer,
        window=np.int64(window),
        ring=bool(ring),
        **attrs,
    )
    return out


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    sliding_window: int | None = None,
    ring: bool = False,
    path: str = "auto",
    launch: Mapping[str, int] | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Attention of queries q `[tokens, heads, head_dim]` at `positions` `[tokens]` (int32) over one
    layer of the cache: k_cache, v_cache `[layers, 1, kv_heads, slots, head_dim]` with `layer`, or
    `[1, kv_heads, slots, head_dim]`. A query at position p sees keys at positions <= p (and
    > p - sliding_window). `ring`: key position p lives in slot p % slots (lithos.kv_cache), which
    needs a window with sliding_window + tokens - 1 <= slots. Returns `[tokens, heads, head_dim]` in
    q's dtype. `launch` fixes the split plan's parameters (see launch.py); by default the tuning
    table's. An FP8 cache (u8 codes) comes with `k_scale`, `v_scale` `[layers, 1, kv_heads]` (or
    `[1, kv_heads]`) f32."""
    k_cache = stacked("k_cache", k_cache, 4, layer)
    v_cache = stacked("v_cache", v_cache, 4, layer)
    k_scale, v_scale = check_cache_scales("decode_attention", k_cache, k_scale, v_scale, layer)
    if q.ndim != 3 or k_cache.shape != v_cache.shape or q.shape[2] != k_cache.shape[4]:
        raise LithosError(f"decode_attention: q {list(q.shape)} does not fit caches {list(k_cache.shape)}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise LithosError(
            f"decode_attention: {q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads"
        )
    if positions.shape != (q.shape[0],):
        raise LithosError(f"decode_attention: positions must be [{q.shape[0]}], got {list(positions.shape)}")
    window = int(sliding_window or 0)
    check_ring("decode_attention", ring, window, q.shape[0], k_cache.shape[3])

    def check():
        check_tokens("decode_attention", q.shape[0])
        require_bf16("decode_attention", q=q)
        if k_scale is None:
            require_bf16("decode_attention", k_cache=k_cache, v_cache=v_cache)
        if k_cache.shape[1] != 1:
            raise LithosError(
                f"decode_attention: the fused kernels decode batch 1, the cache has batch {k_cache.shape[1]}"
            )
        if q.shape[2] not in (64, 128, 256):
            raise LithosError(f"decode_attention: head_dim {q.shape[2]} has no fused kernel (64, 128, 256)")

    return dispatch(
        path,
        functools.partial(_reference, window=window, ring=ring),
        functools.partial(_kernel, window=window, ring=ring, launch=launch),
        q,
        k_cache,
        v_cache,
        positions.astype(jnp.int32),
        layer_index(layer),
        k_scale,
        v_scale,
        check=check,
    )
