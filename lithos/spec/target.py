"""Target-model passes that speculative decoding needs beyond `forward`.

- `verify_pass`: the verification forward. Without feature layers it is the model family's own
  `forward_argmax` (greedy) or `forward`, so verification runs on whatever kernel path the model is
  given; `prompt_pass` is the prefill, on the reference path as plain prefill runs it. Drafters
  that read the target's hidden states (EAGLE-3, MTP heads) get them from `run_layers`, which runs
  the same decoder layers and keeps the residual stream where asked.
- `run_layers`: the decoder's first `stop` layers over the full stacked weights and the full KV
  cache. It indexes layer `i` inside a `fori_loop` instead of slicing `params.layers[:stop]`,
  because a slice handed to a loop is materialized: that would copy the first layers' weights
  and cache on every draft step.

Feature index `i` means the residual stream entering decoder layer `i` (Hugging Face's
`output_hidden_states[i]`); index `num_layers` is the last layer's output before the final norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lithos.errors import UnsupportedModelError
from lithos.kv_cache import KVCache, append, layer_of
from lithos.models import family_of, llama


def check_llama_family(cfg, what: str) -> None:
    """Early exit and feature capture run the decoder layer by layer, which is written for the llama family."""
    if family_of(cfg) is not llama:
        raise UnsupportedModelError(f"{what} needs a llama-family target; {cfg.architecture} is not one")


def store_layers(cache: KVCache, positions: jax.Array, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Store keys/values `[n, B, T, kv_heads, head_dim]` of the first `n` layers at `positions` `[B, T]`.

    Positions past the cache end are dropped; an FP8 cache quantises them (`kv_cache.append` does both).
    """
    return append(cache, positions, k_new, v_new)


def run_layers(
    params: llama.Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: llama.Config,
    stop: int,
    features: tuple[int, ...] = (),
) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Embed `tokens` `[B, T]` and run decoder layers `[0, stop)` at `positions` `[B, T]`.

    Each layer reads its cache below the row's start position and the new tokens; the new keys and
    values of layers `[0, stop)` are stored in `cache` afterwards (in place on a donated buffer).
    Returns the residual stream after layer `stop - 1` `[B, T, hidden]` (not normed), the cache, and
    the requested `features` concatenated `[B, T, len(features) * hidden]` (None if none asked).
    """
    check_llama_family(cfg, "running a layer prefix")
    if not 0 < stop <= cfg.num_layers:
        raise UnsupportedModelError(f"layer count {stop} is outside 1..{cfg.num_layers}")
    if any(not 0 <= f <= stop for f in features):
        raise UnsupportedModelError(f"feature layers {features} must lie in 0..{stop}")
    batch, length = tokens.shape
    h = params.embed[tokens]
    inv_freq = llama.rope_inv_freq(cfg)
    kv_shape = (stop, batch, length, cfg.num_kv_heads, cfg.head_dim)
    captured = jnp.zeros((len(features), *h.shape), h.dtype)

    def body(i, carry):
        h, k_all, v_all, captured = carry
        for slot, layer_index in enumerate(features):
            captured = captured.at[slot].set(jnp.where(i == layer_index, h, captured[slot]))
        layer = jax.tree_util.tree_map(lambda w: w[i], params.layers)
        h, (k, v) = llama._layer(cfg, inv_freq, positions, h, (layer, layer_of(cache, i)))
        return h, k_all.at[i].set(k), v_all.at[i].set(v), captured

    k_all = jnp.zeros(kv_shape, h.dtype)  # as computed; `store_layers` converts them to the cache's format
    v_all = jnp.zeros(kv_shape, h.dtype)
    h, k_all, v_all, captured = jax.lax.fori_loop(0, stop, body, (h, k_all, v_all, captured))
    for slot, layer_index in enumerate(features):
        if layer_index == stop:  # the output of the last layer run
            captured = captured.at[slot].set(h)
    cache = store_layers(cache, positions, k_all, v_all)
    if not features:
        return h, cache, None
    feats = jnp.concatenate(list(captured), axis=-1)
    return h, cache, feats


def prompt_pass(
    params, tokens: jax.Array, positions: jax.Array, cache: KVCache, cfg, features: tuple[int, ...] = ()
) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Prefill: final-normed hidden states `[B, T, hidden]`, the cache, and features `[B, T, F]` (or None).

    On the reference path, as `decode.prefill` runs it: the fused kernels serve 1..16 new tokens.
    """
    if not features:
        h, cache = family_of(cfg).hidden_states(params, tokens, positions, cache, cfg, kernels="reference")
        return h, cache, None
    check_llama_family(cfg, "a drafter that reads the target's hidden states")
    h, cache, feats = run_layers(params, tokens, positions, cache, cfg, cfg.num_layers, features)
    return llama.rms_norm(h, params.final_norm, cfg.rms_norm_eps), cache, feats


def verify_pass(
    params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg,
    kernels: str,
    greedy: bool,
    features: tuple[int, ...] = (),
) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Score a round's `tokens` `[B, k+1]`: the target's argmax `[B, k+1]` i32 when `greedy`, else its
    logits `[B, k+1, V]` f32; the cache with their keys and values stored; features (or None).

    Without features this is the family's `forward_argmax` / `forward` on the `kernels` path, so
    verification runs on the fastest kernels the model has. With features, the reference layers.
    """
    family = family_of(cfg)
    if not features:
        if greedy:
            target, cache = family.forward_argmax(params, tokens, positions, cache, cfg, kernels=kernels)
        else:
            target, cache = family.forward(params, tokens, positions, cache, cfg, kernels=kernels)
        return target, cache, None
    h, cache, feats = prompt_pass(params, tokens, positions, cache, cfg, features)
    logits = family.lm_logits(params, h)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, feats
    return logits, cache, feats
