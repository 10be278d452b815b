"""The decode program: prefill in one forward, then generation as a jitted loop on the device.

`prefill` runs the prompt (right-padded to a length bucket) through the model once, fills the KV
cache and picks the first token. `decode_chunk` then runs a `lax.while_loop` that stops when every
row is done or `chunk` tokens were produced; each iteration runs a fixed block of steps (a
`fori_loop`), because a data-dependent loop condition costs a device-to-host round trip per
iteration while a fixed step costs almost nothing. The host calls `decode_chunk` again only to
stream the tokens so far; nothing in the loop calls back into Python.

A data-dependent loop also makes the call synchronous: XLA runs its iterations from the host, so the call
returns only once its chunk has run, and the device idles while the host reads the tokens back and
dispatches the next chunk. Paths whose step does nothing for a finished row (`FIXED_CHUNK_PATHS`) run
chunks of exactly `chunk` steps instead: the call returns at once, the engine queues the next chunk before
reading this one, and the steps past the end cost little.

Rows of a batch are independent requests with their own lengths: each has its own position, and
attention masks by position, so padding never leaks into another row.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from lithos.kv_cache import KVCache, prompt_positions
from lithos.models import family_of
from lithos.sampling import SamplingParams, sample

if TYPE_CHECKING:
    from lithos.placement import Placement

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


# Kernel paths whose step computes and stores nothing at a negative position (the megakernel's blocks leave
# after their first task: `empty_step`, csrc/mk_common.h), so a finished row's steps cost little and their
# chunks run a fixed number of steps. The others keep the `while_loop`'s early exit, which spares them
# those steps.
FIXED_CHUNK_PATHS = frozenset({"megakernel"})

# jit options shared by the one-device programs and their placed twins (`programs`).
PREFILL_JIT = dict(static_argnames=("cfg", "greedy"), donate_argnames=("cache",))
DECODE_CHUNK_JIT = dict(
    static_argnames=("cfg", "chunk", "block", "greedy", "kernels", "placement"), donate_argnames=("state",)
)


@partial(jax.jit, **PREFILL_JIT)
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
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Run prompts `tokens` `[B, bucket]` (row b real up to `lengths[b]`) and pick each row's first token.

    Returns the decode state, the first tokens `[B]` and their logits `[B, vocab]` (float32).
    """
    family = family_of(cfg)
    positions = prompt_positions(lengths, tokens.shape[1])
    # Prefill is one large matrix product per weight, which XLA does well; the fused kernels are
    # built for 1..16 new tokens (decode and verification), so prefill takes the reference path.
    h, cache = family.hidden_states(params, tokens, positions, cache, cfg, kernels="reference")
    return start_decoding(params, h, lengths, cache, limit, stop_ids, sampling, rng, cfg, greedy)


def start_decoding(params, h, lengths, cache, limit, stop_ids, sampling, rng, cfg, greedy):
    """From a prompt pass's hidden states `h` `[B, bucket, hidden]`: each row's first token, its
    logits and the decode state that continues from it (shared by plain and speculative prefill)."""
    last_h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = family_of(cfg).lm_logits(params, last_h)
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


def decode_step(
    params, state: DecodeState, cfg, greedy: bool, kernels: str, placement: Placement | None = None
) -> tuple[DecodeState, jax.Array]:
    """One token for every running row; finished rows stay as they are. Returns (state, tokens `[B]`, -1 where done).

    `placement`: the one params and cache are split by, which the fused kernels need to run per device."""
    family = family_of(cfg)
    running = ~state.done
    position = state.position
    if kernels in FIXED_CHUNK_PATHS:  # a finished row's step is empty: nothing computed, its cache untouched
        position = jnp.where(running, position, -1)
    args = (params, state.last_token[:, None], position[:, None], state.cache, cfg)
    rng = state.rng  # greedy decoding draws nothing, so its key is kept as it is (no split on the device)
    if greedy:
        token, cache = family.forward_argmax(*args, kernels=kernels, placement=placement)
        token = token[:, 0]
    else:
        rng, key = jax.random.split(state.rng)
        logits, cache = family.forward(*args, kernels=kernels, placement=placement)
        token = sample(logits[:, 0], state.sampling, key, greedy)
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


@partial(jax.jit, **DECODE_CHUNK_JIT)
def decode_chunk(
    params,
    state: DecodeState,
    cfg,
    chunk: int,
    block: int,
    greedy: bool,
    kernels: str = "reference",
    placement: Placement | None = None,
) -> tuple[DecodeState, jax.Array]:
    """Up to `chunk` decode steps on the device, stopping early once every row is done (blocks of
    `block` steps between checks); exactly `chunk` on `FIXED_CHUNK_PATHS`, so that the call is
    asynchronous.

    Returns the state and the tokens produced `[B, chunk]` (-1 where a row produced none).
    """
    batch = state.last_token.shape[0]
    out = jnp.full((batch, chunk), -1, jnp.int32)

    def steps(start, count: int, carry):
        def one(i, c):
            state, out = c
            state, token = decode_step(params, state, cfg, greedy, kernels, placement)
            return state, jax.lax.dynamic_update_slice(out, token[:, None], (0, start + i))

        return jax.lax.fori_loop(0, count, one, carry)

    if kernels in FIXED_CHUNK_PATHS:
        return steps(0, chunk, (state, out))

    def run_block(carry):
        state, out, step = carry
        state, out = steps(step, block, (state, out))
        return state, out, step + block

    def more(carry):
        state, _, step = carry
        return (step < chunk) & ~jnp.all(state.done)

    state, out, _ = jax.lax.while_loop(more, run_block, (state, out, jnp.int32(0)))
    return state, out


def programs(placement: Placement | None = None) -> tuple[Callable, Callable]:
    """`(prefill, decode_chunk)`: the programs above for one device, or, given a
    `lithos.placement.Placement`, the same functions jitted with its explicit in/out shardings
    (params and KV cache split over the mesh, everything else replicated), decode_chunk with
    `placement` bound."""
    if placement is None:
        return prefill, decode_chunk
    return _placed_programs(placement)


@functools.cache
def _placed_programs(placement: Placement) -> tuple[Callable, Callable]:
    rep = placement.replicated
    params = placement.param_shardings()
    cache = placement.cache_shardings()
    state = DecodeState(
        cache=cache,
        last_token=rep,
        position=rep,
        generated=rep,
        limit=rep,
        finish=rep,
        rng=rep,
        stop_ids=rep,
        sampling=rep,
    )
    # Prefill's logits stay split over the vocabulary: only the caller that asks for them gathers.
    logits = placement.sharding(("batch", "vocab"))
    placed_prefill = _jit_with_shardings(
        prefill,
        PREFILL_JIT,
        in_shardings=(params, rep, rep, cache, rep, rep, rep, rep),
        out_shardings=(state, rep, logits),
    )
    placed_decode_chunk = _jit_with_shardings(
        decode_chunk, DECODE_CHUNK_JIT, in_shardings=(params, state), out_shardings=(state, rep), placement=placement
    )
    return placed_prefill, placed_decode_chunk


def _jit_with_shardings(jitted, options: dict, in_shardings, out_shardings, **bound) -> Callable:
    """The function under `jitted`, jitted again with explicit shardings and called the same way
    (`.lower` too), with the keyword arguments `bound` fixed. jax refuses keyword arguments once
    in_shardings are given, so the static arguments, passed by keyword, are handed over by position."""
    fn = jitted.__wrapped__
    signature = inspect.signature(fn).parameters
    names = list(signature)
    program = jax.jit(
        fn,
        static_argnums=tuple(names.index(n) for n in options["static_argnames"]),
        donate_argnums=tuple(names.index(n) for n in options["donate_argnames"]),
        in_shardings=in_shardings,
        out_shardings=out_shardings,
    )

    def positional(args: tuple, kwargs: dict) -> tuple:
        kwargs = {**kwargs, **bound}
        rest = [kwargs.pop(n) if n in kwargs else signature[n].default for n in names[len(args) :]]
        if kwargs:
            raise TypeError(f"{fn.__name__}() got unexpected arguments {sorted(kwargs)}")
        return (*args, *rest)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return program(*positional(args, dict(kwargs)))

    call.lower = lambda *args, **kwargs: program.lower(*positional(args, dict(kwargs)))
    return call
