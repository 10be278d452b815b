"""The static key/value cache: one preallocated buffer per model, filled in place.

A slot's contents are valid only below the row's current length; attention masks by position
(a query at position p sees keys at positions <= p), so rolling the cache back after a rejected
speculative draft is just moving the length, and stale entries past it are never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Keys and values, `[layers, batch, kv_heads, max_len, head_dim]` each."""

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype) -> KVCache:
    shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def cache_bytes(cache: KVCache) -> int:
    return cache.k.size * cache.k.dtype.itemsize + cache.v.size * cache.v.dtype.itemsize


def append(cache: KVCache, positions: jax.Array, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Store every layer's new keys/values `[layers, batch, tokens, kv_heads, head_dim]` at `positions`
    `[batch, tokens]`.

    Positions past the end are dropped (never clamped onto valid slots); callers check lengths on
    the host before they get here.
    """
    batch = jnp.arange(positions.shape[0])[:, None]

    def put(buf, new):
        # Index [:, batch, :, positions] puts the broadcast (batch, tokens) dims first.
        update = new.transpose(1, 2, 0, 3, 4).astype(buf.dtype)
        return buf.at[:, batch, :, positions].set(update, mode="drop")

    return KVCache(k=put(cache.k, k_new), v=put(cache.v, v_new))
