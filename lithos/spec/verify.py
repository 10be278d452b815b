"""Verification: which of the drafted tokens the target model keeps, and the token it adds.

A round scores `k + 1` positions in one target forward: the newest token followed by the `k`
drafts. Row `i` of the target's logits is its distribution for the token after input `i`, so it
judges draft `i` (the `i`-th draft sits at input `i + 1`). Both rules return the number of drafts
accepted, `n` in `[0, k]`, and the `k + 1` tokens of which the first `n + 1` are emitted: the
accepted drafts, then one token of the target's own (its correction at the first rejection, or a
bonus token after all `k` were accepted).

- Greedy: accept while the draft equals the target's argmax. The emitted tokens are then exactly
  the target's argmaxes, so the output is token-for-token plain greedy decoding.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft `x` with probability
  `min(1, p(x) / q(x))`; at the first rejection sample from `normalize(max(p - q, 0))`; after `k`
  acceptances sample the bonus from `p`. Every emitted token is then distributed exactly as the
  target's `p`, whatever the drafter proposed. `p` and `q` are both shaped by `filter_logits`
  (temperature, top-k, top-p, min-p), so the output follows the same filtered distribution that
  plain sampling draws from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lithos.sampling import SamplingParams, filter_logits


def accepted_prefix(accept: jax.Array) -> jax.Array:
    """Length `[B]` of the leading run of True in `accept` `[B, k]`."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_greedy(target: jax.Array, draft_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy verification.

    target: `[B, k+1]` i32, the target's argmax at each scored position; draft_tokens: `[B, k]`.
    Returns (accepted `[B]` i32 in `[0, k]`, tokens `[B, k+1]` i32: the target's argmax at every
    position, of which the first `accepted + 1` are emitted).
    """
    k = draft_tokens.shape[1]
    return accepted_prefix(draft_tokens == target[:, :k]), target


def verify_sampling(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    sampling: SamplingParams,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Lossless rejection-sampling verification.

    target_logits: `[B, k+1, V]` (raw; filtered here as plain sampling filters them);
    draft_tokens: `[B, k]`; draft_probs: `[B, k, V]`, the (filtered) distributions the drafts were
    sampled from, or None for a deterministic drafter (q is one-hot on the draft).
    Returns (accepted `[B]` i32 in `[0, k]`, tokens `[B, k+1]` i32: drafts, with the correction or
    bonus token at index `accepted`).
    """
    batch, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    key_accept, key_residual = jax.random.split(key)
    p = jax.nn.softmax(filter_logits(target_logits, sampling), axis=-1)  # [B, k+1, V]
    if draft_probs is None:
        q = jax.nn.one_hot(draft_tokens, vocab, dtype=p.dtype)
    else:
        q = draft_probs.astype(p.dtype)
    p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # [B, k]
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_accept, (batch, k))
    # u < p/q without dividing: q(x) > 0 for any x the drafter actually sampled.
    accepted = accepted_prefix(u * q_draft < p_draft)

    # The residual at the first rejection; after k acceptances q is taken as 0, which leaves p itself.
    q_padded = jnp.concatenate([q, jnp.zeros((batch, 1, vocab), q.dtype)], axis=1)  # [B, k+1, V]
    p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    q_at = jnp.take_along_axis(q_padded, accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    # An all-zero residual means p == q there, where a rejection has probability 0; fall back to p.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_at)
    extra = jax.random.categorical(key_residual, jnp.log(residual), axis=-1).astype(jnp.int32)

    tokens = jnp.concatenate([draft_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(k + 1)[None] == accepted[:, None], extra[:, None], tokens)
    return accepted, tokens
