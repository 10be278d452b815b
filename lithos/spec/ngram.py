"""Prompt lookup: draft the tokens that followed the last occurrence of the newest n-gram.

No weights. On the device: for every earlier position, count how many of the newest `max_ngram`
tokens match the tokens ending there; take the longest match (at least `min_ngram`), the most
recent among equals, and propose the k tokens that followed it. When the match is so recent that
fewer than k tokens follow it before the present, the text is read as periodic (period = distance
from the match to the present), which is what a repeating pattern continues as. With no match the
newest token is repeated; verification rejects what is wrong at no extra cost, since the target
scores k + 1 positions for about the price of one.

Deterministic: q is one-hot on the draft, so `probs` is None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from lithos.errors import LithosError
from lithos.sampling import SamplingParams
from lithos.spec.drafter import DraftContext, Proposal, StatelessDrafter


def prompt_lookup(history: jax.Array, position: jax.Array, k: int, min_ngram: int, max_ngram: int) -> jax.Array:
    """Draft tokens `[B, k]` from `history` `[B, H]` (valid through `position` `[B]`)."""
    batch, length = history.shape
    index = jnp.arange(length)[None, :]
    back = jnp.arange(max_ngram)
    suffix = jnp.take_along_axis(history, jnp.maximum(position[:, None] - back, 0), axis=1)  # [B, max_n], newest first
    matched = jnp.ones((batch, length), bool)
    run = jnp.zeros((batch, length), jnp.int32)
    for j in range(max_ngram):
        # shifted[:, e] = history[:, e - j]: does the j-th newest token match j before position e?
        shifted = jnp.pad(history, ((0, 0), (j, 0)))[:, :length]
        matched &= (shifted == suffix[:, j : j + 1]) & (index >= j) & (position[:, None] >= j)
        run += matched
    # Only matches that end before the newest token count (the suffix trivially matches itself).
    candidate = (run >= min_ngram) & (index < position[:, None])
    score = jnp.where(candidate, run * length + index, -1)  # longest first, then most recent
    end = jnp.argmax(score, axis=1).astype(jnp.int32)
    found = jnp.max(score, axis=1) >= 0
    period = jnp.maximum(position - end, 1)
    follow = end[:, None] + 1 + jnp.arange(k)[None, :] % period[:, None]
    drafts = jnp.take_along_axis(history, jnp.minimum(follow, length - 1), axis=1)
    newest = jnp.take_along_axis(history, position[:, None], axis=1)
    return jnp.where(found[:, None], drafts, newest).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NGramDrafter(StatelessDrafter):
    """Prompt-lookup drafting over the prompt and everything generated so far."""

    max_ngram: int = 3
    min_ngram: int = 1
    name: ClassVar[str] = "ngram"

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise LithosError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(
        self,
        draft_params: Any,
        draft_state: Any,
        ctx: DraftContext,
        k: int,
        key: jax.Array,
        sampling: SamplingParams,
        greedy: bool,
    ) -> Proposal:
        tokens = prompt_lookup(ctx.history, ctx.position, k, self.min_ngram, self.max_ngram)
        return Proposal(tokens=tokens, probs=None, draft_state=draft_state, target_cache=ctx.target_cache)

    def describe(self) -> str:
        return f"prompt lookup (n-grams {self.min_ngram}..{self.max_ngram})"
