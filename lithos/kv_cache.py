"""The static key/value cache: one preallocated buffer per model, filled in place.

A slot's contents are valid only below the row's current length; attention masks by position
(a query at position p sees keys at positions <= p), so rolling the cache back after a rejected
speculative draft is just moving the length, and stale entries past it are never read.

The cache holds the model's dtype, or FP8 E4M3 codes with per-(layer, row, KV head) scales
(`kv_cache_dtype="fp8"`, format in lithos.quant.kv): half the bytes a bf16 step reads from a long
context. A row's scales are 0 until its first write (the prompt, at prefill), which sets them from
that write's keys and values; they never change afterwards, so a rollback stays a length move.
Attention reads every key as stored, the new tokens' own keys included: a token sees the same
values whether it was verified in one pass with its neighbours or decoded alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lithos.errors import LithosError
from lithos.quant.kv import dequantize_kv, kv_scales, quantize_kv

FP8 = "fp8"  # the 8-bit cache: E4M3 codes (u8) + f32 scales
CACHE_DTYPES = ("model", FP8, "bfloat16", "float16", "float32")  # what `kv_cache_dtype` accepts


@struct.dataclass
class KVCache:
    """Keys and values `[layers, batch, kv_heads, max_len, head_dim]` each, in a float dtype or as E4M3
    codes (u8) with scales `[layers, batch, kv_heads]` f32 (None for a float cache; 0 = not yet set).
    Indexing every leaf by a layer gives that layer's cache, which `attention_inputs` reads."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


def is_fp8(dtype) -> bool:
    """Whether a resolved cache dtype (`cache_dtype`) is the FP8 cache."""
    return isinstance(dtype, str) and dtype == FP8


def cache_dtype(kv_cache_dtype: str | None, model_dtype) -> str | np.dtype:
    """What `init_cache` takes for the option `kv_cache_dtype`: None or "model" -> the model's dtype,
    "fp8" -> FP8, or a float dtype name."""
    if kv_cache_dtype in (None, "model"):
        return jnp.dtype(model_dtype)
    if kv_cache_dtype == FP8:
        return FP8
    if kv_cache_dtype in CACHE_DTYPES:
        return jnp.dtype(kv_cache_dtype)
    raise LithosError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of {', '.join(CACHE_DTYPES)}")


def init_cache(num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype) -> KVCache:
    """An empty cache; `dtype` is a float dtype or "fp8" (codes 0 = +0.0, scales 0 = not yet set)."""
    shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
    if is_fp8(dtype):
        scales = (num_layers, batch, num_kv_heads)
        # Four distinct buffers: the cache is donated, and a buffer must not be donated twice.
        return KVCache(
            k=jnp.zeros(shape, jnp.uint8),
            v=jnp.zeros(shape, jnp.uint8),
            k_scale=jnp.zeros(scales, jnp.float32),
            v_scale=jnp.zeros(scales, jnp.float32),
        )
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def cache_bytes(cache: KVCache) -> int:
    """Bytes the cache occupies, scales included."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(cache))


def layer_of(cache: KVCache, layer: int | jax.Array) -> KVCache:
    """Layer `layer` of the cache: k, v `[batch, kv_heads, max_len, head_dim]`, scales `[batch, kv_heads]`."""
    return jax.tree_util.tree_map(lambda a: a[layer], cache)


def _settled(scale: jax.Array, new: jax.Array) -> jax.Array:
    """Scales `[..., batch, kv_heads]` with the unset ones (0) taken from `new` `[..., batch, tokens, kv_heads,
    head_dim]`: a row's first write fixes them."""
    return jnp.where(scale > 0, scale, kv_scales(jnp.swapaxes(new, -3, -2)))


def _codes(new: jax.Array, scale: jax.Array) -> jax.Array:
    """`new` `[..., batch, tokens, kv_heads, head_dim]` as E4M3 codes in the same layout."""
    return jnp.swapaxes(quantize_kv(jnp.swapaxes(new, -3, -2), scale), -3, -2)


def attention_inputs(
    layer: KVCache, k_new: jax.Array, v_new: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What attention reads for one layer (`layer_of`): the cache `[batch, kv_heads, max_len, head_dim]`
    and the new keys/values `[batch, tokens, kv_heads, head_dim]`, all in k_new's dtype.

    A float cache passes through. An FP8 cache is dequantised exactly, and the new entries are rounded
    through E4M3 with the scales `append` will store them with, so they read as they will be stored.
    """
    if not layer.quantized:
        return layer.k, layer.v, k_new, v_new
    dtype = k_new.dtype
    k_scale, v_scale = _settled(layer.k_scale, k_new), _settled(layer.v_scale, v_new)

    def as_stored(new, scale):
        return jnp.swapaxes(dequantize_kv(jnp.swapaxes(_codes(new, scale), -3, -2), scale, dtype), -3, -2)

    return (
        dequantize_kv(layer.k, k_scale, dtype),
        dequantize_kv(layer.v, v_scale, dtype),
        as_stored(k_new, k_scale),
        as_stored(v_new, v_scale),
    )


def append(cache: KVCache, positions: jax.Array, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Store the new keys/values `[n, batch, tokens, kv_heads, head_dim]` of the first n layers (usually
    all) at `positions` `[batch, tokens]`; an FP8 cache first sets the scales of rows written for the first
    time (as `attention_inputs` did).

    Positions past the end are dropped (never clamped onto valid slots); callers check lengths on
    the host before they get here.
    """
    n = k_new.shape[0]
    batch = jnp.arange(positions.shape[0])[:, None]

    def put(buf, new):
        # Index [:n, batch, :, positions] puts the broadcast (batch, tokens) dims first.
        update = new.transpose(1, 2, 0, 3, 4).astype(buf.dtype)
        return buf.at[:n, batch, :, positions].set(update, mode="drop")

    if not cache.quantized:
        return cache.replace(k=put(cache.k, k_new), v=put(cache.v, v_new))
    k_scale, v_scale = _settled(cache.k_scale[:n], k_new), _settled(cache.v_scale[:n], v_new)
    return cache.replace(
        k=put(cache.k, _codes(k_new, k_scale)),
        v=put(cache.v, _codes(v_new, v_scale)),
        k_scale=cache.k_scale.at[:n].set(k_scale),
        v_scale=cache.v_scale.at[:n].set(v_scale),
    )
