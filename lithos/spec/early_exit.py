"""Early-exit self-drafting: the target's first N layers, its final norm and its LM head draft.

No weights of its own, and no cache of its own either. The first N layers of the target compute
exactly the same keys and values whether the full model runs or only its prefix, so the drafter
reads the target's own cache for those layers below `position` (the target wrote them when it
verified the tokens there). It writes its draft tokens' entries into the same cache at
`position .. position + k - 1`: those are the positions the verification pass writes next, for
the same tokens, over all layers. So the positions stay consistent by construction: after
verification, everything below the new position is the target's own, and entries past it (draft
tokens the target rejected) are stale and never read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from lithos.errors import LithosError
from lithos.models import family_of, llama
from lithos.sampling import SamplingParams
from lithos.spec.drafter import DraftContext, Proposal, StatelessDrafter, autoregress
from lithos.spec.target import check_llama_family, run_layers


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(StatelessDrafter):
    """Draft with the target's first `num_layers` layers (the target's params; no draft params)."""

    cfg: Any  # the target's Config
    num_layers: int
    name: ClassVar[str] = "self"

    def __post_init__(self):
        check_llama_family(self.cfg, "early-exit self-drafting")
        if not 1 <= self.num_layers < self.cfg.num_layers:
            raise LithosError(
                f"draft layers must be in 1..{self.cfg.num_layers - 1} for a {self.cfg.num_layers}-layer target, "
                f"got {self.num_layers}"
            )

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
        params, cfg = ctx.target_params, self.cfg
        family = family_of(cfg)

        def run(cache, token, offset):
            positions = (ctx.position + offset)[:, None]
            h, cache, _ = run_layers(params, token[:, None], positions, cache, cfg, stop=self.num_layers)
            h = llama.rms_norm(h[:, 0], params.final_norm, cfg.rms_norm_eps)
            return cache, family.lm_logits(params, h)

        cache, first = run(ctx.target_cache, ctx.last_token, 0)
        tokens, probs, cache = autoregress(run, cache, first, k, key, sampling, greedy)
        return Proposal(tokens=tokens, probs=probs, draft_state=draft_state, target_cache=cache)

    def describe(self) -> str:
        return f"early exit after {self.num_layers} of {self.cfg.num_layers} layers"
