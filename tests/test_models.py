"""The Llama family against transformers: tiny random checkpoints saved by transformers itself,
logits after prefill and after each of 16 decode steps."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.checkpoint import load_checkpoint
from lithos.kv_cache import init_cache
from lithos.models import family_of

from .conftest import TINY_ARCHS, require

CASES = [(arch, tied) for arch in TINY_ARCHS for tied in (False, True)]


def jitted_forward(cfg):
    return jax.jit(partial(family_of(cfg).forward, cfg=cfg))


def hf_logits(path, tokens: np.ndarray) -> np.ndarray:
    transformers = require("transformers")
    torch = require("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("arch,tied", CASES)
def test_prefill_and_decode_match_transformers(hf_checkpoint, arch, tied):
    path = hf_checkpoint(arch, tied)
    loaded = load_checkpoint(path, dtype="float32")
    cfg, params = loaded.cfg, loaded.params
    assert cfg.tie_word_embeddings == tied
    forward = jitted_forward(cfg)

    prompt_len, steps = 20, 16
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (1, prompt_len + steps))
    expected = hf_logits(path, tokens)

    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, jnp.float32)
    positions = jnp.arange(prompt_len)[None]
    logits, cache = forward(params, jnp.asarray(tokens[:, :prompt_len]), positions, cache)
    np.testing.assert_allclose(np.asarray(logits), expected[:, :prompt_len], atol=2e-4, rtol=1e-4)
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = forward(params, jnp.asarray(tokens[:, t : t + 1]), jnp.array([[t]]), cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], expected[:, t], atol=2e-4, rtol=1e-4)


def test_verification_block_matches_single_steps(hf_checkpoint):
    """Several new tokens in one forward (as speculative verification does) equal one at a time."""
    loaded = load_checkpoint(hf_checkpoint("qwen3", False), dtype="float32")
    cfg, params = loaded.cfg, loaded.params
    forward = jitted_forward(cfg)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 24)))
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 32, cfg.head_dim, jnp.float32)
    _, cache = forward(params, tokens[:, :16], jnp.arange(16)[None], cache)
    block, _ = forward(params, tokens[:, 16:24], jnp.arange(16, 24)[None], cache)
    singles = []
    for t in range(16, 24):
        logits, cache = forward(params, tokens[:, t : t + 1], jnp.array([[t]]), cache)
        singles.append(np.asarray(logits)[:, 0])
    np.testing.assert_allclose(np.asarray(block)[0], np.stack(singles, 1)[0], atol=1e-4, rtol=1e-4)


def test_config_reads_both_rope_styles():
    from lithos.models import llama

    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    old = llama.config_from_hf(base | {"rope_theta": 5e5, "rope_scaling": scaling})
    new = llama.config_from_hf(base | {"rope_parameters": scaling | {"rope_theta": 5e5}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling.kind == "llama3"
