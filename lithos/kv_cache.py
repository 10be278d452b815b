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

**Linear or ring.** A linear cache has `max_len` slots, slot = position. When every layer attends
within a window W (a query at p sees keys at positions in (p - W, p]: the dense Llama family with
`sliding_window`), the cache is a ring of R = W + K - 1 slots (`Ring`, when that is fewer than
max_len), slot = position mod R, where K (`step_tokens`) is the most new tokens one forward writes
after prefill: 1 for plain decoding, k + 1 to verify k drafts. `max_len` stays the logical limit
(the positions a sequence may reach, far beyond R); `slots` is the buffer's length. Mixed models
(GPT-OSS: half the layers see everything) keep a linear cache.

Reading. A forward whose first query is at p0 reads the cache as it was before it, with
base = p0 - 1, the newest position stored: slot s holds position base - ((base - s) mod R), the
newest position <= base with slot s; a negative one was never written and is masked. For a
linear cache (base < R) that is s for s <= base and negative past it: today's reading, so one
formula serves both (`slot_positions`).

Why R = W + K - 1 suffices, rollback included. Callers keep one rule: a forward that writes up to
position P is never followed by one starting before P - K + 1 (decoding writes p and goes on at
p + 1; verification writes pos..pos + k and goes on at pos + 1 + accepted; the early-exit drafter
writes pos..pos + k - 1 of its layers before the verification at pos; a draft model's round
writes up to pos + k - 1 and its next one starts at the new pos - 1 >= pos). So when a forward
writes p0..P (P <= p0 + K - 1), no position above p0 + K - 1 has ever been written, and:
- what its queries need is intact. A query p >= p0 reads keys j in (p - W, p]; slot j mod R was
  last written by j itself: a later position j + mR (m >= 1) would be >= j + R > p0 - W + R =
  p0 + K - 1, and a smaller one j - mR written after j would need a forward starting at or below
  it although j <= (j - mR) + K - 1, i.e. R <= mR < K: impossible. This holds also when the
  forward's own entries are stored before its queries read (the fused kernels), since P <= p0 + K - 1;
- stale entries are invisible. A slot last written by q > base (a rejected draft) reads as
  q - R <= p0 + K - 1 - R = p0 - W, outside the window of every query >= p0.
Prefill writes a whole prompt at once (more than K tokens) but reads nothing from the cache:
`append` keeps each row's newest R positions (older ones share their slots, and a scatter with
duplicate indices is undefined) and drops prompt padding, which `prompt_positions` moves past
max_len. The fused kernels wrap every position (they know the slots, not max_len): a position at
or past max_len is written only by a row's last forward, after which the row reads nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lithos.errors import LithosError
from lithos.quant.kv import dequantize_kv, kv_scales, quantize_kv

FP8 = "fp8"  # the 8-bit cache: E4M3 codes (u8) + f32 scales
CACHE_DTYPES = ("model", FP8, "bfloat16", "float16", "float32")  # what `kv_cache_dtype` accepts
PAD_POSITION = 1 << 30  # where prompt padding goes (`prompt_positions`): past every cache's max_len


@dataclasses.dataclass(frozen=True)
class Ring:
    """What makes a cache a ring (module docstring): `window` + `step_tokens` - 1 slots, slot =
    position mod slots, for sequences of up to `max_len` positions."""

    max_len: int  # the logical limit: positions a sequence may reach
    window: int  # W: every layer's attention window
    step_tokens: int  # K: the most new tokens one forward writes after prefill

    @property
    def slots(self) -> int:
        return self.window + self.step_tokens - 1


def ring_for(max_len: int, window: int | None, step_tokens: int = 1) -> Ring | None:
    """The ring for a model whose every layer attends within `window` (None: some layer sees the whole
    context), writing at most `step_tokens` new tokens per forward after prefill; None (a linear cache)
    without a window or when the ring would not be smaller."""
    if window is None:
        return None
    if window < 1 or step_tokens < 1:
        raise LithosError(
            f"a ring KV cache needs a window >= 1 and step_tokens >= 1 (new tokens per forward), got window "
            f"{window} and step_tokens {step_tokens}"
        )
    ring = Ring(max_len, window, step_tokens)
    return ring if ring.slots < max_len else None


@struct.dataclass
class KVCache:
    """Keys and values `[layers, batch, kv_heads, slots, head_dim]` each, in a float dtype or as E4M3
    codes (u8) with scales `[layers, batch, kv_heads]` f32 (None for a float cache; 0 = not yet set).
    `ring` (static) is None for a linear cache (slots = max_len) or the ring it is.
    Indexing every leaf by a layer gives that layer's cache, which `attention_inputs` reads."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    ring: Ring | None = struct.field(pytree_node=False, default=None)

    @property
    def slots(self) -> int:
        """Entries per (layer, row, KV head): the buffer's length."""
        return self.k.shape[3]

    @property
    def max_len(self) -> int:
        """Positions a sequence may reach: the slots of a linear cache, the logical limit of a ring."""
        return self.slots if self.ring is None else self.ring.max_len

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


def init_cache(
    num_layers: int,
    batch: int,
    num_kv_heads: int,
    max_len: int,
    head_dim: int,
    dtype,
    window: int | None = None,
    step_tokens: int = 1,
) -> KVCache:
    """An empty cache for sequences of up to `max_len` positions; `dtype` is a float dtype or "fp8" (codes
    0 = +0.0, scales 0 = not yet set). With `window` (every layer attends within it; the family's
    `cache_window`) it is a ring of window + step_tokens - 1 slots when that is fewer than max_len
    (`ring_for`); `step_tokens`: the most new tokens one forward writes after prefill (k + 1 to verify
    k drafts)."""
    ring = ring_for(max_len, window, step_tokens)
    shape = (num_layers, batch, num_kv_heads, max_len if ring is None else ring.slots, head_dim)
    if is_fp8(dtype):
        scales = (num_layers, batch, num_kv_heads)
        # Four distinct buffers: the cache is donated, and a buffer must not be donated twice.
        return KVCache(
            k=jnp.zeros(shape, jnp.uint8),
            v=jnp.zeros(shape, jnp.uint8),
            k_scale=jnp.zeros(scales, jnp.float32),
            v_scale=jnp.zeros(scales, jnp.float32),
            ring=ring,
        )
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), ring=ring)


def check_step_tokens(cache: KVCache, tokens: int, what: str) -> None:
    """Raise unless the cache takes forwards of `tokens` new tokens followed by a rollback (`what` writes
    them): a ring is made for at most its `step_tokens` (module docstring)."""
    ring = cache.ring
    if ring is not None and tokens > ring.step_tokens:
        raise LithosError(
            f"{what} writes {tokens} new tokens per forward, but the KV cache is a ring of {ring.slots} slots for "
            f"window {ring.window} and at most {ring.step_tokens} new tokens per forward: make it with "
            f"init_cache(..., window={ring.window}, step_tokens={tokens})"
        )


def prompt_positions(lengths: jax.Array, bucket: int) -> jax.Array:
    """Positions `[B, bucket]` of right-padded prompts of `lengths` `[B]`: 0, 1, ... through each row's
    prompt, PAD_POSITION after it, so that `append` drops the padding (in a ring it would overwrite the
    prompt's own entries) and no real token attends to it (it lies in their future)."""
    positions = jnp.arange(bucket, dtype=jnp.int32)[None, :]
    return jnp.where(positions < lengths[:, None], positions, PAD_POSITION)


def slot_positions(base: jax.Array, slots: int) -> jax.Array:
    """The position each slot holds when `base` `[...]` is the newest position stored: `[..., slots]`,
    negative where never written (module docstring). A linear cache with base < slots: s, or < 0 past base."""
    return base[..., None] - jnp.mod(base[..., None] - jnp.arange(slots), slots)


def cache_bytes(cache: KVCache) -> int:
    """Bytes the cache occupies, scales included."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(cache))


def layer_of(cache: KVCache, layer: int | jax.Array) -> KVCache:
    """Layer `layer` of the cache: k, v `[batch, kv_heads, slots, head_dim]`, scales `[batch, kv_heads]`."""
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
    """What attention reads for one layer (`layer_of`): the cache `[batch, kv_heads, slots, head_dim]`
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
    all) at `positions` `[batch, tokens]`, in slot position mod slots; an FP8 cache first sets the scales
    of rows written for the first time (as `attention_inputs` did).

    Positions outside [0, max_len) are dropped (never clamped onto valid slots): past a linear cache's
    end, and prompt padding (`prompt_positions`); callers check lengths on the host before they get
    here. A ring stores each row's newest `slots` positions only.
    """
    n = k_new.shape[0]
    batch = jnp.arange(positions.shape[0])[:, None]
    stored = (positions >= 0) & (positions < cache.max_len)
    if cache.ring is not None:
        # A prompt longer than the ring: older positions would share slots with newer ones.
        newest = jnp.max(jnp.where(stored, positions, -1), axis=1, keepdims=True)
        stored &= positions > newest - cache.slots
    slots = jnp.where(stored, positions % cache.slots, cache.slots)  # `slots` is past the end: dropped

    def put(buf, new):
        # Index [:n, batch, :, slots] puts the broadcast (batch, tokens) dims first.
        update = new.transpose(1, 2, 0, 3, 4).astype(buf.dtype)
        return buf.at[:n, batch, :, slots].set(update, mode="drop")

    if not cache.quantized:
        return cache.replace(k=put(cache.k, k_new), v=put(cache.v, v_new))
    k_scale, v_scale = _settled(cache.k_scale[:n], k_new), _settled(cache.v_scale[:n], v_new)
    return cache.replace(
        k=put(cache.k, _codes(k_new, k_scale)),
        v=put(cache.v, _codes(v_new, v_scale)),
        k_scale=cache.k_scale.at[:n].set(k_scale),
        v_scale=cache.v_scale.at[:n].set(v_scale),
    )
