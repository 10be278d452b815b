"""The host side of speculative decoding: choosing a drafter, and the programs `Model` runs with it.

    model.generate(prompt, spec="ngram", draft_tokens=5)
    model.generate(prompt, spec="self", draft_layers=8)
    model.generate(prompt, spec="draft", draft_model="path/to/small")   # or a loaded lithos.Model
    model.generate(prompt, spec="head", draft_head="path/to/eagle3")

`Model._run` builds the same padded batch as plain decoding and asks a `SpecProgram` instead of
itself for the three programs (compile, prefill, decode chunk), so batching, streaming, stopping
and the result are shared code. Each result carries a `SpecReport` with the round statistics.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lithos.errors import LithosError
from lithos.kv_cache import init_cache
from lithos.spec.drafter import Drafter
from lithos.spec.loop import SpecState, spec_chunk, spec_prefill

SPEC_KINDS = ("ngram", "self", "draft", "head")
DEFAULT_DRAFT_TOKENS = 5
MAX_DRAFT_TOKENS = 15  # k + 1 scored positions; the fused kernels take up to 16 new tokens


@dataclasses.dataclass
class Speculator:
    """A drafter with its parameters and the number of drafts per round."""

    drafter: Drafter
    draft_params: Any
    draft_tokens: int

    def describe(self) -> str:
        return f"{self.drafter.describe()}, k={self.draft_tokens}"


@dataclasses.dataclass
class SpecReport:
    """One request's speculative statistics."""

    drafter: str
    draft_tokens: int  # k
    rounds: int
    accepted: int  # drafts accepted in all rounds
    emitted: int  # tokens emitted by rounds (a round that hit a stop rule is cut there)
    histogram: list[int]  # rounds by drafts accepted, index 0..k
    decode_ms: float  # time of the whole decode loop (all rows of the batch together)

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens a round produced (accepted drafts + the target's own token), before any cut."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens accepted."""
        return self.accepted / (self.rounds * self.draft_tokens) if self.rounds else 0.0

    @property
    def round_ms(self) -> float:
        """Mean wall time of a round, host overheads included (for one request: its round time)."""
        return self.decode_ms / self.rounds if self.rounds else 0.0

    def describe(self) -> str:
        return (
            f"{self.drafter}: {self.rounds} rounds, {self.tokens_per_round:.2f} tokens/round "
            f"({100 * self.acceptance_rate:.0f}% of {self.draft_tokens} drafts accepted), {self.round_ms:.1f} ms/round"
        )


def make_speculator(
    model,
    spec: str | Speculator | None = None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    draft_model: Any = None,
    draft_layers: int | None = None,
    draft_head: Any = None,
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> Speculator:
    """The speculator the options name, for `model` (a `lithos.Model`).

    spec: "ngram" (prompt lookup), "self" (the target's first `draft_layers` layers), "draft" (the
    lithos model `draft_model`, a path or a loaded Model, with the target's tokenizer), "head" (a
    trained EAGLE-3 or MTP head at `draft_head`). Left out, `draft_model` or `draft_head` imply
    "draft" or "head".
    """
    if isinstance(spec, Speculator):
        return spec
    if spec is None:
        spec = "draft" if draft_model is not None else "head" if draft_head is not None else None
    if spec not in SPEC_KINDS:
        raise LithosError(f"spec={spec!r} is not a drafter; choose one of {', '.join(SPEC_KINDS)}")
    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise LithosError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {draft_tokens}")
    if model.placement is not None:
        raise LithosError("speculative decoding runs on one device for now: load the model with tp=1")
    if spec != "draft" and draft_model is not None:
        raise LithosError(f"draft_model is used by spec='draft', not spec={spec!r}")
    if spec != "head" and draft_head is not None:
        raise LithosError(f"draft_head is used by spec='head', not spec={spec!r}")
    if spec == "ngram":
        from lithos.spec.ngram import NGramDrafter

        return Speculator(NGramDrafter(max_ngram=max_ngram, min_ngram=min_ngram), None, draft_tokens)
    if spec == "self":
        from lithos.spec.early_exit import EarlyExitDrafter

        if draft_layers is None:
            raise LithosError(
                "spec='self' needs draft_layers (--draft-layers): how many of the target's layers draft, e.g. 8"
            )
        return Speculator(EarlyExitDrafter(model.cfg, draft_layers), None, draft_tokens)
    if spec == "draft":
        return Speculator(*_draft_model(model, draft_model), draft_tokens)
    from lithos.spec.heads import HeadDrafter, load_head

    if draft_head is None:
        raise LithosError(
            "spec='head' needs draft_head (--draft-head): a directory in the layout of lithos/spec/README.md"
        )
    if isinstance(draft_head, tuple):  # (HeadConfig, HeadParams) built in memory
        head, params = draft_head
    else:
        head, params = load_head(draft_head, model.cfg, dtype=model.params.embed.dtype)
    return Speculator(HeadDrafter(head), params, draft_tokens)


def _draft_model(model, draft_model) -> tuple[Drafter, Any]:
    from lithos.spec.draft_model import DraftModelDrafter

    if draft_model is None:
        raise LithosError(
            "spec='draft' needs draft_model (--draft-model): a path or a loaded lithos.Model with the same tokenizer"
        )
    if not hasattr(draft_model, "params"):
        import lithos

        draft_model = lithos.load(draft_model, max_len=model.max_len, dtype=model.checkpoint.dtype)
    probe = "Speculative decoding: 1, 2, 3 — ¿sí? <tags> and\ttabs"
    tokenizers = [getattr(m, "tokenizer", None) for m in (draft_model, model)]
    if None not in tokenizers and tokenizers[0].encode(probe) != tokenizers[1].encode(probe):
        raise LithosError(
            "the draft model's tokenizer splits text differently from the target's: a draft model must share "
            "the target's tokenizer (e.g. a smaller model of the same family)"
        )
    drafter = DraftModelDrafter(draft_model.cfg, model.cfg.vocab_size)
    return drafter, draft_model.params


class SpecProgram:
    """Speculative counterparts of `Model._compile`, `_prefill` and `_decode_chunk`."""

    def __init__(self, model, speculator: Speculator, block: int = 1):
        self.model = model
        self.speculator = speculator
        self.block = block  # rounds between loop-condition checks
        self.queues_chunks = False  # a round's early exit is a loop condition: each chunk call waits for it
        self._compiled: set[tuple] = set()

    def _prefill(self, tokens, lengths, limits, stop, sp, greedy, seed=0) -> tuple[SpecState, jax.Array]:
        model, cfg, s = self.model, self.model.cfg, self.speculator
        dims = (cfg.num_layers, tokens.shape[0], cfg.num_kv_heads, model.max_len, cfg.head_dim)
        # A ring cache (windowed models) must hold a round's k + 1 writes besides the window.
        cache = init_cache(*dims, model.kv_cache_dtype, window=model.cache_window, step_tokens=s.draft_tokens + 1)
        return spec_prefill(
            model.params,
            s.draft_params,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            cache,
            jnp.asarray(limits),
            jnp.asarray(stop),
            sp,
            jax.random.key(seed),
            cfg=cfg,
            drafter=s.drafter,
            k=s.draft_tokens,
            greedy=greedy,
        )

    def _decode_chunk(self, state: SpecState, greedy: bool) -> tuple[SpecState, jax.Array]:
        model, s = self.model, self.speculator
        return spec_chunk(
            model.params,
            s.draft_params,
            state,
            cfg=model.cfg,
            drafter=s.drafter,
            k=s.draft_tokens,
            chunk=model.stream_every,
            block=self.block,
            greedy=greedy,
            kernels=model.kernels,
        )

    def _compile(self, tokens, lengths, limits, stop, sp, greedy) -> float:
        """Compile both programs for this shape (rows with a zero budget end in prefill); ms spent, 0 if done."""
        key = (tokens.shape, greedy, self.model.kernels)
        if key in self._compiled:
            return 0.0
        t = time.perf_counter()
        state, _ = self._prefill(tokens, lengths, np.zeros_like(limits), stop, sp, greedy)
        jax.block_until_ready(self._decode_chunk(state, greedy))
        self._compiled.add(key)
        return (time.perf_counter() - t) * 1e3

    def reports(self, state: SpecState, decode_ms: float) -> list[SpecReport]:
        """Per-row statistics of a finished run."""
        stats = jax.device_get(state.stats)
        s = self.speculator
        return [
            SpecReport(
                drafter=s.drafter.name,
                draft_tokens=s.draft_tokens,
                rounds=int(stats.rounds[r]),
                accepted=int(stats.accepted[r]),
                emitted=int(stats.emitted[r]),
                histogram=[int(c) for c in stats.histogram[r]],
                decode_ms=decode_ms,
            )
            for r in range(len(stats.rounds))
        ]


# Programs per model and options, so that a draft model is loaded and a shape compiled only once.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


SPEC_OPTIONS = ("draft_tokens", "draft_model", "draft_layers", "draft_head", "max_ngram", "min_ngram")


def program_for(model, spec: Any = None, **options) -> SpecProgram:
    """The SpecProgram for `model` with these options (cached while the model lives)."""
    unknown = sorted(set(options) - set(SPEC_OPTIONS))
    if unknown:
        raise LithosError(
            f"unknown generation option {', '.join(map(repr, unknown))}: sampling takes temperature, top_k, top_p, "
            f"min_p, seed; speculative decoding takes spec, {', '.join(SPEC_OPTIONS)}"
        )
    cache = _PROGRAMS.setdefault(model, {})
    try:
        key = (spec, tuple(sorted(options.items())))
        hash(key)
    except TypeError:  # a loaded draft Model or an in-memory head: no caching by value
        key = (id(spec), tuple((k, id(v)) for k, v in sorted(options.items())))
    if key not in cache:
        cache[key] = SpecProgram(model, make_speculator(model, spec, **options))
    return cache[key]
