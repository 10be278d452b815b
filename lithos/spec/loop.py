"""The speculative decode program: prefill, then rounds of draft / verify / accept in one jitted loop.

A round, for every row at once:
1. the drafter proposes k tokens (and, when sampling, the distributions they came from);
2. the target scores the newest token and the k drafts, k + 1 positions, in one forward that also
   writes their keys and values at `position .. position + k`;
3. verification (greedy or lossless rejection sampling, `lithos.spec.verify`) keeps a prefix of
   the drafts and adds one token of the target's own;
4. the new tokens are emitted one by one under plain decoding's stopping rules (a stop token, the
   token budget, a full cache), so a round that crosses one of them is cut exactly where plain
   decoding would have stopped;
5. the position moves past the emitted tokens. That is the whole rollback: the cache entries of
   rejected drafts lie past the position, where attention never reads (in a ring cache too, made
   for k + 1 new tokens per forward: see lithos.kv_cache).

`spec_chunk` is a `lax.while_loop` over fixed blocks of rounds that returns to the host once
every row has emitted `chunk` tokens (rows that reach it sit out the remaining rounds, so the
output buffer is bounded) or is done: the host streams text between chunks and nothing in the
loop calls back into Python.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lithos import decode
from lithos.decode import RUNNING, DecodeState
from lithos.kv_cache import KVCache, check_step_tokens, prompt_positions
from lithos.sampling import SamplingParams
from lithos.spec import verify
from lithos.spec.drafter import DraftContext, Drafter, PromptContext, Verified
from lithos.spec.target import prompt_pass, verify_pass


@struct.dataclass
class SpecStats:
    """Per-row counters, on the device."""

    rounds: jax.Array  # [B] i32: rounds the row took part in
    accepted: jax.Array  # [B] i32: drafts accepted, summed over rounds
    emitted: jax.Array  # [B] i32: tokens emitted by rounds (the first token comes from prefill)
    histogram: jax.Array  # [B, k+1] i32: rounds by number of drafts accepted (0..k)


@struct.dataclass
class SpecState:
    """Everything a speculative round needs; `decode` is exactly plain decoding's state."""

    decode: DecodeState
    history: jax.Array  # [B, max_len + k + 1] i32: the token at each position; valid through decode.position
    draft: Any  # the drafter's state
    stats: SpecStats

    @property
    def done(self) -> jax.Array:
        return self.decode.done

    @property
    def finish(self) -> jax.Array:
        return self.decode.finish


def history_length(max_len: int, k: int) -> int:
    """Room for a round's writes past the last position a sequence may reach (up to max_len + k)."""
    return max_len + k + 1


@partial(jax.jit, static_argnames=("cfg", "drafter", "k", "greedy"), donate_argnames=("cache",))
def spec_prefill(
    params,
    draft_params,
    tokens: jax.Array,
    lengths: jax.Array,
    cache: KVCache,
    limit: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams,
    rng: jax.Array,
    cfg,
    drafter: Drafter,
    k: int,
    greedy: bool,
) -> tuple[SpecState, jax.Array]:
    """Run prompts `tokens` `[B, bucket]` (row b real up to `lengths[b]`), pick each row's first token
    exactly as `decode.prefill` does, and set up the drafter. Returns the state and first tokens `[B]`."""
    check_step_tokens(cache, k + 1, f"speculative decoding with {k} drafts")
    batch, bucket = tokens.shape
    positions = prompt_positions(lengths, bucket)
    h, cache, features = prompt_pass(params, tokens, positions, cache, cfg, drafter.feature_layers)
    state, first, _ = decode.start_decoding(params, h, lengths, cache, limit, stop_ids, sampling, rng, cfg, greedy)
    history = jnp.zeros((batch, history_length(cache.max_len, k)), jnp.int32)
    history = history.at[:, :bucket].set(tokens)
    history = history.at[jnp.arange(batch), lengths].set(first)
    prompt = PromptContext(
        history=history, lengths=lengths, bucket=bucket, max_len=cache.max_len, draft_tokens=k, features=features
    )
    draft_state = drafter.init(draft_params, params, prompt)
    zeros = jnp.zeros((batch,), jnp.int32)
    stats = SpecStats(rounds=zeros, accepted=zeros, emitted=zeros, histogram=jnp.zeros((batch, k + 1), jnp.int32))
    return SpecState(decode=state, history=history, draft=draft_state, stats=stats), first


def spec_round(
    params, draft_params, state: SpecState, active: jax.Array, cfg, drafter: Drafter, k: int, greedy: bool, kernels: str
) -> tuple[SpecState, jax.Array, jax.Array]:
    """One round for the rows in `active` `[B]` (others keep their state).

    Returns the state, the round's tokens `[B, k+1]` (-1 past what was emitted) and the number
    emitted `[B]` (0 for rows that sat out).
    """
    dec = state.decode
    rng, key_draft, key_verify = jax.random.split(dec.rng, 3)
    ctx = DraftContext(
        history=state.history,
        position=dec.position,
        last_token=dec.last_token,
        target_params=params,
        target_cache=dec.cache,
        kernels=kernels,
    )
    proposal = drafter.propose(draft_params, state.draft, ctx, k, key_draft, dec.sampling, greedy)

    inputs = jnp.concatenate([dec.last_token[:, None], proposal.tokens], axis=1)  # [B, k+1]
    offsets = jnp.arange(k + 1, dtype=jnp.int32)
    positions = dec.position[:, None] + offsets[None, :]
    target, cache, features = verify_pass(
        params, inputs, positions, proposal.target_cache, cfg, kernels, greedy, drafter.feature_layers
    )
    if greedy:
        accepted, tokens = verify.verify_greedy(target, proposal.tokens)
    else:
        accepted, tokens = verify.verify_sampling(target, proposal.tokens, proposal.probs, dec.sampling, key_verify)

    # Emit tokens one by one as plain decoding would: the j-th new token (j = 1..) is the row's
    # (generated + j)-th and would be stored at position + j; the first that ends the row is the last.
    j = offsets[None, :] + 1
    produced = j <= (accepted + 1)[:, None]
    is_stop = jnp.any(tokens[..., None] == dec.stop_ids, axis=-1)
    ends = produced & (is_stop | (dec.generated[:, None] + j >= dec.limit[:, None]) | (positions + 1 >= cache.max_len))
    ended = jnp.any(ends, axis=1)
    count = jnp.where(ended, jnp.argmax(ends, axis=1) + 1, accepted + 1)
    count = jnp.where(active, count, 0).astype(jnp.int32)
    moved = count > 0

    newest = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    generated = dec.generated + count
    position = dec.position + count
    reason = decode._finish_reason(
        newest, generated, dec.limit, position, cache.max_len, dec.stop_ids, jnp.full_like(dec.finish, RUNNING)
    )
    finish = jnp.where(moved & ended, reason, dec.finish)

    emitted = jnp.where(j <= count[:, None], tokens, -1)
    rows = jnp.arange(tokens.shape[0])[:, None]
    # Writes of tokens not emitted go past the array's end and are dropped.
    slots = jnp.where(j <= count[:, None], positions + 1, state.history.shape[1])
    history = state.history.at[rows, slots].set(tokens, mode="drop")

    decoded = dec.replace(
        cache=cache,
        last_token=jnp.where(moved, newest, dec.last_token),
        position=position,
        generated=generated,
        finish=finish,
        rng=rng,
    )
    verified = Verified(history=history, round_start=dec.position, position=position, active=active, features=features)
    draft_state = drafter.update(draft_params, proposal.draft_state, verified)
    s = state.stats
    took_part = active.astype(jnp.int32)
    stats = SpecStats(
        rounds=s.rounds + took_part,
        accepted=s.accepted + accepted * took_part,
        emitted=s.emitted + count,
        histogram=s.histogram + jax.nn.one_hot(accepted, k + 1, dtype=jnp.int32) * took_part[:, None],
    )
    return SpecState(decode=decoded, history=history, draft=draft_state, stats=stats), emitted, count


@partial(
    jax.jit,
    static_argnames=("cfg", "drafter", "k", "chunk", "block", "greedy", "kernels"),
    donate_argnames=("state",),
)
def spec_chunk(
    params,
    draft_params,
    state: SpecState,
    cfg,
    drafter: Drafter,
    k: int,
    chunk: int,
    block: int,
    greedy: bool,
    kernels: str = "reference",
) -> tuple[SpecState, jax.Array]:
    """Rounds until every row has emitted `chunk` tokens in this call or is done.

    Runs `block` rounds between checks of the loop condition (a data-dependent condition costs a
    device-to-host round trip). Returns the state and the tokens emitted `[B, chunk + k]` in order
    (-1 past each row's count).
    """
    batch = state.decode.last_token.shape[0]
    width = chunk + k  # a row below `chunk` can emit at most k + 1 more
    out = jnp.full((batch, width), -1, jnp.int32)
    rows = jnp.arange(batch)[:, None]

    def one_round(_, carry):
        state, out, count = carry
        active = ~state.done & (count < chunk)
        state, tokens, emitted = spec_round(params, draft_params, state, active, cfg, drafter, k, greedy, kernels)
        slots = jnp.where(tokens >= 0, count[:, None] + jnp.arange(k + 1)[None, :], width)
        return state, out.at[rows, slots].set(tokens, mode="drop"), count + emitted

    def run_block(carry):
        return jax.lax.fori_loop(0, block, one_round, carry)

    def more(carry):
        state, _, count = carry
        return jnp.any(~state.done & (count < chunk))

    state, out, _ = jax.lax.while_loop(more, run_block, (state, out, jnp.zeros((batch,), jnp.int32)))
    return state, out


@partial(jax.jit, static_argnames=("cfg", "drafter", "k", "rounds", "greedy", "kernels"), donate_argnames=("state",))
def spec_rounds(
    params, draft_params, state: SpecState, cfg, drafter: Drafter, k: int, rounds: int, greedy: bool, kernels: str
) -> SpecState:
    """Exactly `rounds` rounds on the device with no condition checks (for timing round time)."""

    def one_round(_, state):
        return spec_round(params, draft_params, state, ~state.done, cfg, drafter, k, greedy, kernels)[0]

    return jax.lax.fori_loop(0, rounds, one_round, state)
