"""Speculative greedy decoding of the real SmolLM2-135M-Instruct is token-for-token its plain greedy
decoding, for 24 varied prompts and every drafter. The prompts go in batches of 8 (a power of two:
no padding rows to compute), so each drafter compiles once. The Q4_1 weights are dequantized once
(exactly) up front: on a CPU, dequantizing inside every forward costs 40% more time; packed weights
under speculation are checked on a tiny model in test_spec.py."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from lithos.engine import Model
from lithos.quant import dequantize_params
from lithos.spec import head_config, init_head

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a land far away,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import numpy as np\nimport",
    "Q: What is 12 times 12?\nA:",
    "Monday, Tuesday, Wednesday,",
    "To be or not to be,",
    "<html><body><h1>",
    "SELECT name FROM users WHERE",
    "La capitale de l'Italie est",
    "Water boils at",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Dear Sir or Madam,",
    "The mitochondria is",
    "for i in range(10):\n    print(",
    "Roses are red, violets are",
    "In 1969, the first humans",
    "The three primary colors are",
    "git commit -m",
    "Translate to German: good morning ->",
    "E = mc",
    "The best way to learn a language is",
]
NEW_TOKENS = 6
BATCH = 8


@pytest.fixture(scope="module")
def smollm2(smollm2_model) -> Model:
    ckpt = smollm2_model.checkpoint
    return Model(dataclasses.replace(ckpt, params=dequantize_params(ckpt.params)), max_len=256)


def generate(model: Model, **options) -> list:
    results = []
    for start in range(0, len(PROMPTS), BATCH):
        batch = PROMPTS[start : start + BATCH]
        results += model.generate_batch(batch, raw=True, max_new_tokens=NEW_TOKENS, **options)
    return results


@pytest.fixture(scope="module")
def plain(smollm2):
    return generate(smollm2)


def first_layers(model: Model, n: int) -> Model:
    """SmolLM2's first n layers as a model of its own: a small draft model with the same tokenizer."""
    ckpt = model.checkpoint
    layers = jax.tree_util.tree_map(lambda w: w[:n], ckpt.params.layers)
    small = dataclasses.replace(
        ckpt, cfg=dataclasses.replace(ckpt.cfg, num_layers=n), params=ckpt.params.replace(layers=layers)
    )
    return Model(small, max_len=model.max_len)


def options(name: str, model: Model) -> dict:
    if name == "ngram":
        return dict(spec="ngram")
    if name == "self":
        return dict(spec="self", draft_layers=6)
    if name == "draft":
        return dict(spec="draft", draft_model=first_layers(model, 4))
    head = head_config("eagle3", model.cfg, draft_vocab_size=4096)
    return dict(spec="head", draft_head=(head, init_head(head, seed=3)))


@pytest.mark.parametrize("name", ["ngram", "self", "draft", "eagle3"])
def test_greedy_identical_on_smollm2(name, smollm2, plain):
    got = generate(smollm2, draft_tokens=3, **options(name, smollm2))
    for expected, result in zip(plain, got):
        assert result.token_ids == expected.token_ids, result.spec.describe()
        assert result.finish_reason == expected.finish_reason
    if name != "eagle3":  # a random head rarely guesses right; the others do on real text
        assert sum(r.spec.accepted for r in got) > 0
