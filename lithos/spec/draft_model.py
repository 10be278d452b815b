"""A smaller model with the target's tokenizer drafts; it keeps its own KV cache.

Its cache follows the target's positions. Each round it feeds the two newest tokens (at
`position - 1` and `position`), then its own drafts one at a time. Why two: after a round, its
cache holds the previous newest token and its own drafts 0..k-2, and whatever the target
accepted of those is already right; only the token before the new newest one can be missing (when
all k drafts were accepted, the last draft was never fed), and the newest token never is. Feeding
the pair rewrites at most one valid entry with the same values. Entries past the newest token
are stale and never read, because attention masks by position, so a rejection needs no undo.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from lithos.kv_cache import KVCache, prompt_positions
from lithos.models import family_of, init_model_cache
from lithos.sampling import SamplingParams
from lithos.spec.drafter import DraftContext, PromptContext, Proposal, Verified, autoregress, match_vocab


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """Draft with another lithos model (`draft_params` are its weights) sharing the target's tokenizer."""

    cfg: Any  # the draft model's Config
    target_vocab: int
    kernels: str | None = None  # None: the target's kernel path (fused drafting at batch 1 when it verifies fused)
    name: ClassVar[str] = "draft"

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()

    def init(self, draft_params: Any, target_params: Any, prompt: PromptContext) -> KVCache:
        """The draft model's cache `[layers, B, kv_heads, slots, head_dim]`, filled with the prompt: a ring
        when the draft model is windowed, for k + 1 new tokens per forward like the target's (a round
        writes its pair, then one token at a time, up to k - 1 past the newest: lithos.kv_cache)."""
        cfg = self.cfg
        batch = prompt.history.shape[0]
        cache = init_model_cache(cfg, batch, prompt.max_len, draft_params.embed.dtype, prompt.draft_tokens + 1)
        tokens = prompt.history[:, : prompt.bucket]
        positions = prompt_positions(prompt.lengths, prompt.bucket)
        # The prompt runs on the reference path, as the target's prefill does.
        _, cache = family_of(cfg).hidden_states(draft_params, tokens, positions, cache, cfg, kernels="reference")
        return cache

    def propose(
        self,
        draft_params: Any,
        draft_state: KVCache,
        ctx: DraftContext,
        k: int,
        key: jax.Array,
        sampling: SamplingParams,
        greedy: bool,
    ) -> Proposal:
        family = family_of(self.cfg)
        kernels = self.kernels or ctx.kernels
        forward = lambda tokens, positions, cache: family.forward(
            draft_params, tokens, positions, cache, self.cfg, kernels=kernels
        )
        pos = ctx.position
        previous = jnp.take_along_axis(ctx.history, (pos - 1)[:, None], axis=1)[:, 0]
        pair = jnp.stack([previous, ctx.last_token], axis=1)
        logits, cache = forward(pair, jnp.stack([pos - 1, pos], axis=1), draft_state)

        def step(cache, token, i):
            logits, cache = forward(token[:, None], (pos + i)[:, None], cache)
            return cache, match_vocab(logits[:, 0], self.target_vocab)

        first = match_vocab(logits[:, 1], self.target_vocab)
        tokens, probs, cache = autoregress(step, cache, first, k, key, sampling, greedy)
        return Proposal(tokens=tokens, probs=probs, draft_state=cache, target_cache=ctx.target_cache)

    def update(self, draft_params: Any, draft_state: KVCache, verified: Verified) -> KVCache:
        return draft_state  # its cache is rolled back by position alone (see the module docstring)

    def describe(self) -> str:
        return f"draft model ({self.cfg.describe()})"
