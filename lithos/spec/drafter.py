"""The drafter protocol: what every way of proposing tokens provides to the speculative loop.

A drafter is a frozen (hashable) dataclass of static settings; it is a static argument of the
jitted programs, so its methods are traced into them. Its arrays travel separately: its
parameters (`draft_params`, a pytree or None) and its per-request state (`draft_state`, a pytree
carried by the loop). Each method sees the batch as `B` independent rows.

    init(draft_params, target_params, prompt) -> draft_state
        once after the target's prefill.
    propose(draft_params, draft_state, ctx, k, key, sampling, greedy) -> Proposal
        k draft tokens per row, their distributions when sampling, and (for drafters that write the
        target's cache) the cache to verify with.
    update(draft_params, draft_state, verified) -> draft_state
        after verification, with what the target saw and kept.

Positions: the newest token `ctx.last_token` sits at `ctx.position`, not yet in the target's KV
cache (which is valid below it). Draft `i` (0-based) is the proposed token at `position + 1 + i`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from lithos.kv_cache import KVCache
from lithos.sampling import SamplingParams, filter_logits


@struct.dataclass
class DraftContext:
    """What a drafter may read when it proposes."""

    history: jax.Array  # [B, H] i32: the token at each position (prompt, then generated); valid through `position`
    position: jax.Array  # [B] i32: where `last_token` sits
    last_token: jax.Array  # [B] i32
    target_params: Any
    target_cache: KVCache  # valid below `position`
    kernels: str = struct.field(pytree_node=False, default="reference")  # the target's kernel path this round


@struct.dataclass
class PromptContext:
    """What a drafter sees at `init`, after the target's prefill."""

    history: jax.Array  # [B, H] i32: prompt tokens, then the first generated token at `lengths`
    lengths: jax.Array  # [B] i32: prompt lengths (the first generated token sits at `lengths`)
    bucket: int = struct.field(pytree_node=False)  # prompt tokens are `history[:, :bucket]` (right-padded)
    max_len: int = struct.field(pytree_node=False)  # the target's KV cache length
    draft_tokens: int = struct.field(pytree_node=False)  # k, the drafts per round
    features: jax.Array | None = None  # [B, bucket, F]: the target's hidden states over the prompt, if asked


@struct.dataclass
class Proposal:
    """A drafter's answer to `propose`."""

    tokens: jax.Array  # [B, k] i32
    probs: jax.Array | None  # [B, k, V] f32 the drafts were sampled from; None: deterministic (one-hot)
    draft_state: Any
    target_cache: KVCache  # the cache to verify with (the context's, unless the drafter wrote into it)


@struct.dataclass
class Verified:
    """What verification decided, for `update`."""

    history: jax.Array  # [B, H] i32, with this round's emitted tokens written
    round_start: jax.Array  # [B] i32: the position of the round's first input (the old `position`)
    position: jax.Array  # [B] i32: the new position of the newest token
    active: jax.Array  # [B] bool: rows that took part in this round (others must keep their state)
    features: jax.Array | None  # [B, k+1, F]: target hidden states at the round's inputs, if asked


class Drafter(Protocol):
    """Proposes draft tokens; see the module docstring for the contract."""

    name: str

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target residual streams this drafter reads (see `lithos.spec.target`); () for none."""
        ...

    def init(self, draft_params: Any, target_params: Any, prompt: PromptContext) -> Any: ...

    def propose(
        self,
        draft_params: Any,
        draft_state: Any,
        ctx: DraftContext,
        k: int,
        key: jax.Array,
        sampling: SamplingParams,
        greedy: bool,
    ) -> Proposal: ...

    def update(self, draft_params: Any, draft_state: Any, verified: Verified) -> Any: ...


class StatelessDrafter:
    """Defaults for drafters that keep no per-request state and read no target features (prompt
    lookup, early exit): their `draft_state` is `()` and verification leaves it as it is."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()

    def init(self, draft_params: Any, target_params: Any, prompt: PromptContext) -> Any:
        return ()

    def update(self, draft_params: Any, draft_state: Any, verified: Verified) -> Any:
        return draft_state


def match_vocab(logits: jax.Array, vocab: int) -> jax.Array:
    """Draft logits `[..., Vd]` over the target's vocabulary `[..., vocab]`.

    Models that share a tokenizer often pad their vocabularies differently: ids the drafter lacks
    get -inf, ids the target lacks are dropped.
    """
    have = logits.shape[-1]
    if have == vocab:
        return logits
    if have > vocab:
        return logits[..., :vocab]
    pad = jnp.full((*logits.shape[:-1], vocab - have), -jnp.inf, logits.dtype)
    return jnp.concatenate([logits, pad], axis=-1)


def draw(
    logits: jax.Array, sampling: SamplingParams, key: jax.Array, greedy: bool
) -> tuple[jax.Array, jax.Array | None]:
    """A draft token `[B]` from draft logits `[B, V]`, and the distribution it came from `[B, V]`.

    Greedy drafts are the argmax (no distribution needed). Sampled drafts use the same
    `filter_logits` as the target, so q is shaped like p and acceptance stays high.
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    filtered = filter_logits(logits, sampling)
    token = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    return token, jax.nn.softmax(filtered, axis=-1)


def autoregress(
    step: Callable[[Any, jax.Array, jax.Array], tuple[Any, jax.Array]],
    carry: Any,
    first_logits: jax.Array,
    k: int,
    key: jax.Array,
    sampling: SamplingParams,
    greedy: bool,
) -> tuple[jax.Array, jax.Array | None, Any]:
    """Draw k drafts one after another, each from logits computed after feeding the previous one.

    Draft 0 comes from `first_logits` `[B, V]`; draft `i >= 1` from `step(carry, draft[i-1], i)`,
    which returns `(carry, logits [B, V])`. A `fori_loop`, so k costs no extra compile time.
    Returns tokens `[B, k]`, their distributions `[B, k, V]` (None when greedy) and the carry.
    """
    batch, vocab = first_logits.shape
    keys = jax.random.split(key, k)
    token, probs = draw(first_logits, sampling, keys[0], greedy)
    tokens = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(token)
    all_probs = None if greedy else jnp.zeros((batch, k, vocab), jnp.float32).at[:, 0].set(probs)

    def body(i, c):
        carry, tokens, all_probs = c
        carry, logits = step(carry, tokens[:, i - 1], i)
        token, probs = draw(logits, sampling, keys[i], greedy)
        tokens = tokens.at[:, i].set(token)
        if all_probs is not None:
            all_probs = all_probs.at[:, i].set(probs)
        return carry, tokens, all_probs

    carry, tokens, all_probs = jax.lax.fori_loop(1, k, body, (carry, tokens, all_probs))
    return tokens, all_probs, carry
