"""Speculative decoding: drafters propose k tokens, the target verifies k + 1 positions in one
forward, and one jitted loop drafts, verifies, accepts and rolls back on the device.

    model.generate(prompt, spec="ngram", draft_tokens=5)     # prompt lookup
    model.generate(prompt, spec="self", draft_layers=8)      # early exit
    model.generate(prompt, spec="draft", draft_model=path)   # a smaller model
    model.generate(prompt, spec="head", draft_head=path)     # EAGLE-3 / MTP head

Greedy output is token-for-token plain greedy decoding; sampled output follows exactly the
target's distribution. See lithos/spec/README.md.
"""

from lithos.spec.draft_model import DraftModelDrafter
from lithos.spec.drafter import DraftContext, Drafter, PromptContext, Proposal, Verified
from lithos.spec.early_exit import EarlyExitDrafter
from lithos.spec.engine import SPEC_KINDS, SpecProgram, SpecReport, Speculator, make_speculator, program_for
from lithos.spec.heads import HeadConfig, HeadDrafter, HeadParams, head_config, init_head, load_head, save_head
from lithos.spec.loop import SpecState, SpecStats, spec_chunk, spec_prefill, spec_round, spec_rounds
from lithos.spec.ngram import NGramDrafter, prompt_lookup
from lithos.spec.verify import verify_greedy, verify_sampling

__all__ = [
    "SPEC_KINDS",
    "DraftContext",
    "DraftModelDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "HeadConfig",
    "HeadDrafter",
    "HeadParams",
    "NGramDrafter",
    "PromptContext",
    "Proposal",
    "SpecProgram",
    "SpecReport",
    "SpecState",
    "SpecStats",
    "Speculator",
    "Verified",
    "head_config",
    "init_head",
    "load_head",
    "make_speculator",
    "program_for",
    "prompt_lookup",
    "save_head",
    "spec_chunk",
    "spec_prefill",
    "spec_round",
    "spec_rounds",
    "verify_greedy",
    "verify_sampling",
]
