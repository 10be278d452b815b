"""Speculative decoding, greedy: token-for-token identical to plain greedy decoding for every
drafter on tiny random models, under every stopping rule, and whatever the drafter proposes.

Each (drafter, k) compiles its own programs, so the tests share a few and vary what is data:
prompts, budgets, stop ids, the oracle drafter's corruption rate and seed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos.errors import LithosError
from lithos.spec import (
    HeadDrafter,
    Proposal,
    Speculator,
    head_config,
    init_head,
    prompt_lookup,
    save_head,
)

PROMPTS = [
    "hello there",
    "abcabcabcabcabc",
    "the cat sat on the mat. the cat sat on",
    "x",
    "1, 2, 3, 4, 5, 6, 7,",
    "def f(x):\n    return x",
    "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzz",
    "Speculative decoding keeps the target's output.",
]


@pytest.fixture(scope="module")
def tiny(hf_checkpoint):
    return lithos.load(hf_checkpoint("llama3", tied=True), dtype="float32", max_len=128, stream_every=8, block=4)


@pytest.fixture(scope="module")
def plain(tiny):
    """Plain greedy outputs for PROMPTS, 24 new tokens each."""
    return tiny.generate_batch(PROMPTS, raw=True, max_new_tokens=24)


def assert_same(expected, got):
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert g.finish_reason == e.finish_reason
        report = g.spec
        # Every token after the first came from a round; a cut round emits fewer than it produced.
        assert report.emitted == len(g.token_ids) - 1
        assert sum(report.histogram) == report.rounds
        assert report.accepted == sum(n * c for n, c in enumerate(report.histogram))
        assert report.emitted <= report.accepted + report.rounds


def drafter_options(name: str, tiny, hf_checkpoint, tmp_path_factory) -> dict[str, Any]:
    if name == "ngram":
        return dict(spec="ngram", draft_tokens=4)
    if name == "self":
        return dict(spec="self", draft_layers=1, draft_tokens=3)
    if name == "draft":
        # Another architecture with the same byte tokenizer stands in for a smaller model.
        draft = lithos.load(hf_checkpoint("qwen2", tied=False), dtype="float32", max_len=128)
        return dict(spec="draft", draft_model=draft, draft_tokens=2)
    kind = {"eagle3": "eagle3", "mtp": "mtp"}[name]
    # EAGLE-3 with a reduced draft vocabulary (d2t), MTP with the target's LM head.
    head = head_config(kind, tiny.cfg, draft_vocab_size=100 if kind == "eagle3" else None, intermediate_size=48)
    path = save_head(tmp_path_factory.mktemp(kind), head, init_head(head, seed=7))
    return dict(spec="head", draft_head=str(path), draft_tokens=5 if kind == "mtp" else 3)


@pytest.mark.parametrize("name", ["ngram", "self", "draft", "eagle3", "mtp"])
def test_greedy_identical_for_every_drafter(name, tiny, plain, hf_checkpoint, tmp_path_factory):
    options = drafter_options(name, tiny, hf_checkpoint, tmp_path_factory)
    got = tiny.generate_batch(PROMPTS, raw=True, max_new_tokens=24, **options)
    assert_same(plain, got)
    assert got[0].spec.draft_tokens == options["draft_tokens"]


def test_ngram_finds_repeats(tiny, plain):
    """Prompt lookup accepts drafts on repetitive text (the tiny model loops)."""
    got = tiny.generate_batch(PROMPTS, raw=True, max_new_tokens=24, spec="ngram", draft_tokens=4)
    assert sum(r.spec.accepted for r in got) > 0
    assert max(r.spec.tokens_per_round for r in got) > 2


# --- whatever the drafter proposes ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Proposes the known greedy continuation with each token replaced, with probability `rate`, by a
    random one: every acceptance length from 0 to k occurs, and rate 1 is a purely random drafter.

    draft_params: (reference `[B, H]` tokens by position, rate scalar)."""

    vocab: int
    name: ClassVar[str] = "oracle"

    @property
    def feature_layers(self):
        return ()

    def init(self, draft_params, target_params, prompt):
        return ()

    def propose(self, draft_params, draft_state, ctx, k, key, sampling, greedy):
        reference, rate = draft_params
        index = jnp.minimum(ctx.position[:, None] + 1 + jnp.arange(k), reference.shape[1] - 1)
        truth = jnp.take_along_axis(reference, index, axis=1)
        key_noise, key_mask = jax.random.split(key)
        noise = jax.random.randint(key_noise, truth.shape, 0, self.vocab)
        corrupt = jax.random.uniform(key_mask, truth.shape) < rate
        return Proposal(jnp.where(corrupt, noise, truth), None, draft_state, ctx.target_cache)

    def update(self, draft_params, draft_state, verified):
        return draft_state

    def describe(self):
        return "oracle"


def oracle(tiny, prompts, results, rate: float, k: int = 4) -> Speculator:
    reference = np.zeros((8, tiny.max_len + 32), np.int32)
    for row, (prompt, result) in enumerate(zip(prompts, results)):
        start = len(tiny.prompt_ids(prompt, raw=True))
        reference[row, start : start + len(result.token_ids)] = result.token_ids
    params = (jnp.asarray(reference), jnp.float32(rate))
    return Speculator(OracleDrafter(tiny.cfg.vocab_size), params, k)


def test_random_and_corrupted_drafts_give_identical_output(tiny, plain):
    """Property: for any drafts (random, or the right ones with random errors), output is plain greedy."""
    hist = np.zeros(5, int)
    for rate, seed in [(1.0, 0), (1.0, 1), (0.5, 2), (0.25, 3), (0.1, 4), (0.0, 5)]:
        spec = oracle(tiny, PROMPTS, plain, rate)
        got = tiny.generate_batch(PROMPTS, raw=True, max_new_tokens=24, spec=spec, seed=seed)
        assert_same(plain, got)
        hist += np.sum([r.spec.histogram for r in got], axis=0)
    assert (hist > 0).all(), hist  # every acceptance length 0..k was exercised


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 6, 11])
def test_token_budget_cut_inside_a_round(tiny, plain, budget):
    """A round that would cross max_new_tokens is cut exactly there."""
    spec = oracle(tiny, PROMPTS, plain, rate=0.0)  # all drafts right: rounds of 5 tokens
    expected = tiny.generate_batch(PROMPTS, raw=True, max_new_tokens=budget)
    got = tiny.generate_batch(PROMPTS, raw=True, max_new_tokens=budget, spec=spec)
    assert_same(expected, got)
    assert all(len(r.token_ids) == budget for r in got if r.finish_reason == "length")


def test_stop_token_inside_a_round(tiny, plain):
    """Make the stop set hold a token greedy produces mid-round: output ends right at it, as plain does."""
    original = tiny.tokenizer.stop_ids
    row = 0
    stop = plain[row].token_ids[6]
    tiny.tokenizer.stop_ids = (stop, original[0])  # same count of stop ids: same compiled programs
    try:
        expected = tiny.generate_batch(PROMPTS, raw=True, max_new_tokens=24)
        spec = oracle(tiny, PROMPTS, plain, rate=0.0)
        got = tiny.generate_batch(PROMPTS, raw=True, max_new_tokens=24, spec=spec)
    finally:
        tiny.tokenizer.stop_ids = original
    assert expected[row].finish_reason == "stop"
    assert_same(expected, got)


def test_cache_full_inside_a_round(tiny):
    """Long prompts fill the cache mid-round: the output stops where plain decoding's does."""
    prompts = [p * 40 for p in PROMPTS]  # prompts of 40..110+ tokens, cut to fit
    prompts = [p[: tiny.max_len - 3 - i] for i, p in enumerate(prompts)]
    expected = tiny.generate_batch(prompts, raw=True, max_new_tokens=100)
    assert {r.finish_reason for r in expected} == {"cache_full"}
    spec = oracle(tiny, prompts, expected, rate=0.0)
    got = tiny.generate_batch(prompts, raw=True, max_new_tokens=100, spec=spec)
    assert_same(expected, got)
    for r in got:
        assert r.prompt_tokens + len(r.token_ids) == tiny.max_len + 1


def test_streaming_matches(tiny, plain):
    stream = tiny.stream(PROMPTS[2], raw=True, max_new_tokens=24, spec="ngram", draft_tokens=4)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == plain[2].text
    assert stream.result.spec.rounds > 0


def test_sliding_window(hf_checkpoint):
    """Early exit reads the target's cache under a sliding window shorter than the output."""
    model = lithos.load(
        hf_checkpoint("mistral_window", tied=False), dtype="float32", max_len=64, stream_every=8, block=4
    )
    prompts = PROMPTS[:4]
    expected = model.generate_batch(prompts, raw=True, max_new_tokens=30)
    assert_same(expected, model.generate_batch(prompts, raw=True, max_new_tokens=30, spec="self", draft_layers=1))


def test_packed_weights(tiny):
    """Early exit indexes the target's layers one by one: packed (MXFP8) weights index plane by plane."""
    from lithos.engine import Model
    from lithos.quant import quantize_params

    ckpt = tiny.checkpoint
    packed = Model(dataclasses.replace(ckpt, params=quantize_params(ckpt.params, "mxfp8")), max_len=64)
    prompts = PROMPTS[:4]
    expected = packed.generate_batch(prompts, raw=True, max_new_tokens=16)
    assert_same(expected, packed.generate_batch(prompts, raw=True, max_new_tokens=16, spec="self", draft_layers=1))


# --- prompt lookup --------------------------------------------------------------------------


def test_prompt_lookup_takes_longest_most_recent_match():
    history = jnp.array(
        [
            [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3, 0, 0],  # "5 2 3" never occurred before: the 2-gram "2 3"
            [4, 5, 6, 4, 5, 6, 4, 5, 0, 0, 0, 0, 0, 0],  # periodic: the match continues into the future
            [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0],  # no earlier occurrence of 8
        ]
    )
    position = jnp.array([11, 7, 7])
    drafts = np.asarray(jax.jit(prompt_lookup, static_argnums=(2, 3, 4))(history, position, 4, 1, 3))
    # Row 0: "2 3" occurs ending at 2 and 6; the latest (6) is followed by 7 8 5 2.
    assert drafts[0].tolist() == [7, 8, 5, 2]
    # Row 1: "6 4 5" last ends at 4 (5 before position 7), followed by 6 4 5, then period 3 repeats.
    assert drafts[1].tolist() == [6, 4, 5, 6]
    # Row 2: no match: repeat the newest token.
    assert drafts[2].tolist() == [8, 8, 8, 8]


def test_bad_options_are_clear(tiny):
    with pytest.raises(LithosError, match="draft_layers"):
        tiny.generate("hi", raw=True, spec="self")
    with pytest.raises(LithosError, match="draft layers must be in 1..1"):
        tiny.generate("hi", raw=True, spec="self", draft_layers=2)
    with pytest.raises(LithosError, match="not a drafter"):
        tiny.generate("hi", raw=True, spec="medusa")
    with pytest.raises(LithosError, match="draft_tokens"):
        tiny.generate("hi", raw=True, spec="ngram", draft_tokens=0)
    with pytest.raises(LithosError, match="draft_model"):
        tiny.generate("hi", raw=True, spec="draft")
    with pytest.raises(LithosError, match="unknown generation option 'draft_token'"):
        tiny.generate("hi", raw=True, spec="ngram", draft_token=3)


def test_head_drafter_is_a_drafter(tiny):
    head = head_config("eagle3", tiny.cfg)
    assert HeadDrafter(head).feature_layers == (1, 1, 0)  # a 2-layer target: layers 2, L/2, L-3 clipped


# --- acceptance replayed from plain greedy output --------------------------------------------


@pytest.mark.parametrize("kind,options", [("ngram", {}), ("self", {"draft_layers": 1})])
def test_replayed_rounds_equal_the_loops(tiny, kind, options):
    """`lithos bench --spec ... --replay` counts the same rounds, accepted drafts and histogram as
    the speculative loop itself, for every k, from one plain greedy decode."""
    from lithos.spec import make_speculator
    from lithos.spec.bench import early_exit_profile, measure_acceptance, plain_greedy, replayed_acceptance

    categories, new_tokens, ks = ["all"] * len(PROMPTS), 24, (2, 5)
    continuations = plain_greedy(tiny, PROMPTS, new_tokens + max(ks), len(PROMPTS))
    _, agreement = early_exit_profile(tiny, PROMPTS, continuations, new_tokens, [1], list(ks))
    for k in ks:
        speculator = make_speculator(tiny, kind, draft_tokens=k, **options)
        loop, _ = measure_acceptance(tiny, {"spec": speculator}, PROMPTS, categories, new_tokens, len(PROMPTS))
        replayed = replayed_acceptance(tiny, speculator, PROMPTS, categories, continuations, new_tokens, agreement)
        assert loop["accepted"] > 0, "a test that accepts nothing compares nothing"
        for field in ("rounds", "accepted", "histogram", "per_prompt_tokens_per_round"):
            assert replayed[field] == loop[field], (field, k)


def test_round_timing_starts_every_loop_from_the_same_prefill(tiny):
    """`lithos bench --spec` round timing: each timed run runs exactly `loops` x `rounds` rounds from one
    prefill, so the counters it reports are one run's, whatever the number of runs."""
    from lithos.spec import make_speculator
    from lithos.spec.bench import time_rounds

    speculator = make_speculator(tiny, "ngram", draft_tokens=3)
    per_round, seen = time_rounds(tiny.params, tiny.cfg, speculator, 16, "reference", rounds=4, runs=2)
    assert len(per_round) == 2 and min(per_round) > 0
    assert sum(seen["histogram"]) == 4
    assert 1 <= seen["tokens_per_round"] <= 4
    per_round, seen = time_rounds(tiny.params, tiny.cfg, speculator, 16, "reference", rounds=4, runs=2, loops=3)
    assert len(per_round) == 2 and sum(seen["histogram"]) == 12


def test_round_timing_of_a_shape_reads_the_weight_format_asked_for(tmp_path, monkeypatch):
    """`lithos bench --spec --shape S --weight-format mxfp4` times rounds over MXFP4 weights, as `lithos bench`
    does for steps (the rounds once read the shape's bf16 weights whatever the flag said)."""
    from lithos import bench, cli
    from lithos.spec import bench as spec_bench

    configs = Path(bench.configs_dir())
    shape = json.loads((configs / "models" / "llama-3.2-1b.json").read_text())
    shape |= dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, head_dim=32, vocab_size=512)
    (tmp_path / "configs" / "models").mkdir(parents=True)
    (tmp_path / "configs" / "hardware").mkdir()
    (tmp_path / "configs" / "models" / "llama-small.json").write_text(json.dumps(shape))
    monkeypatch.setenv("LITHOS_CONFIGS", str(tmp_path / "configs"))
    argv = ["bench", "--spec", "ngram", "--draft-tokens", "3", "--no-acceptance", "--shape", "llama-small",
            "--weight-format", "mxfp4", "--kernels", "reference", "--context", "16", "--steps", "16",
            "--loops", "8", "--runs", "1", "--bandwidth-bytes", str(1 << 22),
            "--out", str(tmp_path / "out")]  # fmt: skip
    result = spec_bench.run(cli.build_parser().parse_args(argv), argv[1:])
    [row] = result["rounds"]
    assert row["model"] == "llama-small-mxfp4"
    assert row["weight_formats"]["mxfp4"] > 0 and row["round_ms"] > 0
