"""Choosing the next token from logits: greedy, or temperature with top-k, top-p and min-p.

The knobs are arrays, not Python numbers, so changing them does not recompile the decode program;
only greedy vs sampling is a static choice. `filter_logits` is shared with speculative verification,
which must shape the target's and the drafter's distributions the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from lithos.errors import LithosError


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # f32 scalar; 0 means greedy
    top_k: jax.Array  # i32 scalar; 0 keeps all
    top_p: jax.Array  # f32 scalar; 1 keeps all
    min_p: jax.Array  # f32 scalar; 0 keeps all

    @staticmethod
    def make(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> SamplingParams:
        if temperature < 0:
            raise LithosError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        if top_k < 0:
            raise LithosError(f"top_k must be >= 0 (0 keeps every token), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise LithosError(f"top_p must be in (0, 1], got {top_p}")
        if not 0.0 <= min_p < 1.0:
            raise LithosError(f"min_p must be in [0, 1), got {min_p}")
        return SamplingParams(
            temperature=jnp.float32(temperature),
            top_k=jnp.int32(top_k),
            top_p=jnp.float32(top_p),
            min_p=jnp.float32(min_p),
        )

    @property
    def greedy(self) -> bool:
        """Host-side: whether these settings mean argmax (needs concrete values)."""
        return float(self.temperature) == 0.0


def filter_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Temperature-scaled logits `[..., vocab]` with tokens outside top-k / top-p / min-p set to -inf.

    Applied in transformers' order: temperature, top-k, top-p (over the top-k survivors), min-p.
    """
    scaled = logits.astype(jnp.float32) / jnp.maximum(sp.temperature, 1e-6)
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    rank = jnp.arange(vocab)
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, vocab), vocab)
    sorted_desc = jnp.where(rank < k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < sp.top_p) & (rank < k)
    keep &= probs >= sp.min_p * probs[..., :1]
    keep = keep.at[..., 0].set(True)  # the most likely token always survives
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, sp: SamplingParams, key: jax.Array, greedy: bool) -> jax.Array:
    """Next token ids `[batch]` from logits `[batch, vocab]`."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, sp), axis=-1).astype(jnp.int32)
