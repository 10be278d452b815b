"""The decode program: prefill in one forward, then generation as a jitted loop on the device.

`prefill` runs the prompt (right-padded to a length bucket) through the model once, fills the KV
cache and picks the first token. `decode_chunk` then runs a `lax.while_loop` that stops when every
row is done or `chunk` tokens were produced; each iteration runs a fixed block of steps (a
`fori_loop`), because a data-dependent loop condition costs a device-to-host round trip per
iteration while a fixed step costs almost nothing. The host calls `decode_chunk` again only to
stream the tokens so far; nothing in the loop calls back into Python.

Rows of a batch are independent requests with their own lengths: each has its own position, and
attention masks by position, so padding never leaks into another row.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from lithos.kv_cache import KVCache
from lithos.models import family_of
from lithos.sampling import SamplingParams, sample

# Why a row stopped.
RUNNING, STOPPED_ON_TOKEN, STOPPED_AT_LIMIT, STOPPED_CACHE_FULL = 0, 1, 2, 3
FINISH_REASONS = {RUNNING: None, STOPPED_ON_TOKEN: "stop", STOPPED_AT_LIMIT: "length", STOPPED_CACHE_FULL: "cache_full"}


@struct.dataclass
class DecodeState:
    cache: KVCache
    last_token: jax.Array  # [B] i32: the newest token, fed to the next step
    position: jax.Array  # [B] i32: where `last_token` goes in the cache
    generated: jax.Array  # [B] i32: tokens produced so far (including the one from prefill)
    limit: jax.Array  # [B] i32: max new tokens per row
    finish: jax.Array  # [B] i32: RUNNING or a STOPPED_* reason
    rng: jax.Array  # PRNG key
    stop_ids: jax.Array  # [S] i32, padded with -1
    sampling: SamplingParams

    @property
    def done(self) -> jax.Array:
        return self.finish != RUNNING


def _finish_reason(token, generated, limit, next_position, max_len, stop_ids, finish):
    """Update each row's finish reason after it produced `token` (its `generated`-th)."""
    hit_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
    reason = jnp.where(
        hit_stop,
        STOPPED_ON_TOKEN,
        jnp.where(
            generated >= limit, STOPPED_AT_LIMIT, jnp.where(next_position >= max_len, STOPPED_CACHE_FULL, RUNNING)
        ),
    )
    return jnp.where(finish != RUNNING, finish, reason)


@partial(jax.jit, static_argnames=("cfg", "greedy", "kernels"), donate_argnames=("cache",))
def prefill(
    params,
    tokens: jax.Array,
    lengths: jax.Array,
    cache: KVCache,
    limit: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams,
    rng: jax.Array,
    cfg,
    greedy: bool,
    kernels: str = "reference",
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Run prompts `tokens` `[B, bucket]` (row b real up to `lengths[b]`) and pick each row's first token.

    Returns the decode state, the first tokens `[B]` and their logits `[B, vocab]` (float32).
    """
    family = family_of(cfg)
    batch, bucket = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (batch, bucket))
    h, cache = family.hidden_states(params, tokens, positions, cache, cfg, kernels=kernels)
    last_h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = family.lm_logits(params, last_h)
    rng, key = jax.random.split(rng)
    first = sample(logits, sampling, key, greedy)
    generated = jnp.ones_like(lengths)
    finish = _finish_reason(first, generated, limit, lengths, cache.max_len, stop_ids, jnp.zeros_like(lengths))
    # A row with limit 0 is padding of the batch: it is done before it starts.
    finish = jnp.where(limit <= 0, STOPPED_AT_LIMIT, finish)
    state = DecodeState(
        cache=cache,
        last_token=first,
        position=lengths.astype(jnp.int32),
        generated=generated,
        limit=limit,
        finish=finish,
        rng=rng,
        stop_ids=stop_ids,
        sampling=sampling,
    )
    return state, first, logits


def decode_step(params, state: DecodeState, cfg, greedy: bool, kernels: str) -> tuple[DecodeState, jax.Array]:
    """One token for every running row; finished rows stay as they are. Returns (state, tokens `[B]`, -1 where done)."""
    family = family_of(cfg)
    logits, cache = family.forward(
        params, state.last_token[:, None], state.position[:, None], state.cache, cfg, kernels=kernels
    )
    rng, key = jax.random.split(state.rng)
    token = sample(logits[:, 0], state.sampling, key, greedy)
    running = ~state.done
    generated = state.generated + running
    next_position = state.position + running
    finish = _finish_reason(token, generated, state.limit, next_position, cache.max_len, state.stop_ids, state.finish)
    state = state.replace(
        cache=cache,
        last_token=jnp.where(running, token, state.last_token),
        position=next_position,
        generated=generated,
        finish=finish,
        rng=rng,
    )
    return state, jnp.where(running, token, -1)


@partial(jax.jit, static_argnames=("cfg", "chunk", "block", "greedy", "kernels"), donate_argnames=("state",))
def decode_chunk(
    params, state: DecodeState, cfg, chunk: int, block: int, greedy: bool, kernels: str = "reference"
) -> tuple[DecodeState, jax.Array]:
    """Up to `chunk` decode steps on the device, stopping early once every row is done.

    Returns the state and the tokens produced `[B, chunk]` (-1 where a row produced none).
    """
    batch = state.last_token.shape[0]
    out = jnp.full((batch, chunk), -1, jnp.int32)

    def run_block(carry):
        state, out, step = carry

        def one(i, c):
            state, out = c
            state, token = decode_step(params, state, cfg, greedy, kernels)
            return state, jax.lax.dynamic_update_slice(out, token[:, None], (0, step + i))

        state, out = jax.lax.fori_loop(0, block, one, (state, out))
        return state, out, step + block

    def more(carry):
        state, _, step = carry
        return (step < chunk) & ~jnp.all(state.done)

    state, out, _ = jax.lax.while_loop(more, run_block, (state, out, jnp.int32(0)))
    return state, out
