"""Greedy speculative rounds replayed from plain greedy output: every k from one decode.

Under greedy verification a round accepts drafts while each equals the target's own next token,
and the text produced is plain greedy decoding's. So once the plain greedy continuation of a prompt
is known, the rounds can be replayed on the host: a round whose newest token sits at generated
index p proposes drafts d_0..d_{k-1}; it accepts the longest prefix with d_i == output[p + 1 + i]
and moves p by accepted + 1.

- Prompt lookup reads only the token history, so its drafts at p are exactly the loop's: the same
  `prompt_lookup` over the same history.
- Early exit drafts from the target's first layers; while its drafts are accepted it has seen
  exactly the target's tokens, so draft i of the round at p is the exit layer's argmax after the
  tokens through p + i: one teacher-forced forward over prompt + output gives them all. (Float
  rounding at a near-tie can differ between that one pass and the loop's one-token steps.)

The continuation is decoded `max(k)` tokens past the measured length, so the last round of a
prompt sees the drafts it would verify; only prompts that stop on an end-of-sequence token end
with a round whose drafts past that token are unknown (counted as rejected). `lithos bench --spec
... --replay` reports these rows next to the loop's own where both ran, so the two can be compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos.kv_cache import init_cache
from lithos.spec.ngram import prompt_lookup


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def replay(accepted_at: Callable[[int, int], int], generated: int, k: int) -> dict[str, Any]:
    """Rounds over a continuation of which `generated` tokens are emitted (the first by prefill).

    `accepted_at(p, k)` is the number of drafts the round whose newest token is generated token p
    accepts. Returns rounds, accepted, histogram (rounds by drafts accepted, 0..k)."""
    rounds = accepted = 0
    histogram = [0] * (k + 1)
    p = 0
    while p < generated - 1:  # the loop runs rounds until `generated` tokens are out
        n = accepted_at(p, k)
        rounds, accepted, p = rounds + 1, accepted + n, p + n + 1
        histogram[n] += 1
    return {"rounds": rounds, "accepted": accepted, "histogram": histogram}


def prefix_matches(drafts: np.ndarray, following: np.ndarray) -> int:
    """How many leading `drafts` equal `following` (which may be shorter)."""
    n = min(len(drafts), len(following))
    miss = np.flatnonzero(drafts[:n] != following[:n])
    return int(miss[0]) if miss.size else n


def ngram_accepted_at(
    prompt_ids: list[int], output: list[int], k_max: int, min_ngram: int, max_ngram: int
) -> Callable[[int, int], int]:
    """`accepted_at` for prompt lookup: the drafts at every generated index in one call."""
    ids = np.asarray(prompt_ids + output, np.int32)
    start = len(prompt_ids)
    positions = np.arange(start, len(ids), dtype=np.int32)  # the newest token of a round sits here
    history = np.zeros((len(positions), _pow2(len(ids))), np.int32)
    history[:, : len(ids)] = ids  # prompt_lookup reads a row only through its position
    drafts = np.asarray(_lookup(jnp.asarray(history), jnp.asarray(positions), k_max, min_ngram, max_ngram))
    following = ids[start + 1 :]
    return lambda p, k: prefix_matches(drafts[p, :k], following[p : p + k])


_lookup = jax.jit(prompt_lookup, static_argnums=(2, 3, 4))


def exit_agreement(model, prompts: list[str], outputs: list[list[int]], layers: list[int]) -> list[list[np.ndarray]]:
    """Per exit layer, per prompt: whether the exit's argmax after generated token p equals token p + 1."""
    from lithos.models import llama
    from lithos.spec.target import run_layers

    cfg, params = model.cfg, model.params
    exits = tuple(layers)

    @jax.jit
    def exit_tokens(params, tokens, positions, cache):  # [exits, 1, T]: each exit's greedy next token
        _, _, feats = run_layers(params, tokens, positions, cache, cfg, max(exits), exits)
        feats = jnp.moveaxis(feats.reshape(*feats.shape[:2], len(exits), cfg.hidden_size), 2, 0)
        head = lambda h: jnp.argmax(llama.lm_logits(params, llama.rms_norm(h, params.final_norm, cfg.rms_norm_eps)), -1)
        return jax.lax.map(head, feats)

    agreement: list[list[np.ndarray]] = [[] for _ in exits]
    for prompt, output in zip(prompts, outputs):
        ids = model.prompt_ids(prompt) + output
        bucket = _pow2(len(ids))
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, : len(ids)] = ids
        cache = init_cache(max(exits), 1, cfg.num_kv_heads, bucket, cfg.head_dim, params.embed.dtype)
        predicted = np.asarray(exit_tokens(params, jnp.asarray(tokens), jnp.arange(bucket)[None], cache))[:, 0]
        start = len(ids) - len(output)  # the first generated token (from prefill) sits here
        following = np.asarray(ids[start + 1 :])
        for e in range(len(exits)):
            agreement[e].append(predicted[e, start : len(ids) - 1] == following)
    return agreement


def exit_accepted_at(agree: np.ndarray) -> Callable[[int, int], int]:
    """`accepted_at` for early exit from its per-position agreement: the run of agreements from p."""
    return lambda p, k: prefix_matches(agree[p : p + k], np.ones(k, bool))
