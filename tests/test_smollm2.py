"""The default model, SmolLM2-135M-Instruct from its Q4_1 GGUF, against transformers loading the
same file (which dequantizes it to float32, as lithos does)."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.kv_cache import init_cache
from lithos.models import family_of

from .conftest import require

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    transformers = require("transformers")
    torch = require("torch")
    require("gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return model.eval(), tokenizer


def test_prompt_logits_match_transformers(smollm2_model, hf_model):
    model, hf_tok = hf_model
    ids = smollm2_model.prompt_ids(QUESTION)
    assert ids == hf_tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert_prompt_logits_match(smollm2_model, model, ids)


def assert_prompt_logits_match(model, hf_model, ids: list[int], tolerance: float = 2e-3) -> None:
    """lithos's logits of prompt `ids` (reference path) within `tolerance` of transformers' everywhere."""
    torch = require("torch")
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits.numpy()[0]
    cfg = model.cfg
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, jnp.float32)
    forward = jax.jit(partial(family_of(cfg).forward, cfg=cfg))
    logits, _ = forward(model.params, jnp.asarray([ids]), jnp.arange(len(ids))[None], cache)
    diff = np.abs(np.asarray(logits)[0] - expected).max()
    assert diff < tolerance, f"max abs logit difference {diff}"


def test_greedy_chat_matches_transformers(smollm2_model, hf_model):
    torch = require("torch")
    model, hf_tok = hf_model
    ids = smollm2_model.prompt_ids(QUESTION)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    result = smollm2_model.generate(QUESTION, max_new_tokens=24)
    assert result.token_ids == expected
    assert result.text == "The capital of France is Paris."
    assert result.finish_reason == "stop"
    # what the model holds, as its repr says: Q4_1 layers beside the Q8_0 tied embedding, packed
    assert re.search(r"weights [\d.]+ MB: q4_1 \d+%, q8_0 \d+%", repr(smollm2_model)), repr(smollm2_model)


def test_second_load_restores_converted_copy(smollm2_gguf, smollm2_model):
    """The first load wrote an orbax copy; loading again restores it with identical weights."""
    from lithos.checkpoint import load_checkpoint

    again = load_checkpoint(smollm2_gguf, dtype="float32")
    assert again.restored and again.source == str(smollm2_gguf)
    for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(smollm2_model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.tokenizer.encode("hello world") == smollm2_model.tokenizer.encode("hello world")
