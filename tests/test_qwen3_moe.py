"""Qwen3-MoE against transformers: a tiny random checkpoint saved by transformers (per-expert tensors,
one dense layer among MoE layers, renormalised top-k), loaded through lithos.load; logits after
prefill and decode, greedy generation, a decode step that reads only the routed experts, the layer
rule of mlp_only_layers / decoder_sparse_step, and the floor's bytes for the Qwen3-30B-A3B shape."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos import bench, quant
from lithos.checkpoint import load_checkpoint
from lithos.kv_cache import init_cache
from lithos.models import qwen3_moe

from .conftest import (
    assert_greedy_matches_transformers,
    assert_transformers_reads_gguf_as,
    require,
    save_tiny_moe,
    write_moe_gguf,
)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],  # layers 0 and 2 are MoE, layer 1 dense
)

# Jitted once for the module, so tests of the same shapes share their compilations.
forward = jax.jit(qwen3_moe.forward, static_argnames=("cfg", "kernels"))
routed_experts = jax.jit(qwen3_moe.routed_experts, static_argnames=("cfg", "kernels"))
PROMPT, CACHE = 10, 32  # prompt length and cache size of every test that prefills


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory of a tiny Qwen3-MoE checkpoint saved by transformers, the transformers model)."""
    return _save_tiny_model(tmp_path_factory.mktemp("qwen3-moe"), SHAPE)


def _save_tiny_model(path, shape: dict):
    return save_tiny_moe(path, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", shape)


def test_checkpoint_layout(checkpoint):
    path, _ = checkpoint
    from safetensors import safe_open

    with safe_open(next(path.glob("*.safetensors")), "np") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names  # per-expert, as released checkpoints
    cfg = load_checkpoint(path, dtype="float32").cfg
    assert cfg.moe_layers == (0, 2) and cfg.dense_layers == (1,) and cfg.norm_topk_prob


def test_prefill_and_decode_match_transformers(checkpoint):
    torch = require("torch")
    path, model = checkpoint
    ck = load_checkpoint(path, dtype="float32")
    cfg, params = ck.cfg, ck.params
    assert params.experts.gate_up.shape == (2, 8, 64, 64) and params.dense.w_up.shape == (1, 96, 64)
    prompt_len, steps = PROMPT, 6
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, prompt_len + steps))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    assert expected.std() > 0.5

    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, CACHE, cfg.head_dim, jnp.float32)
    logits, cache = forward(params, jnp.asarray(tokens[:, :prompt_len]), jnp.arange(prompt_len)[None], cache, cfg)
    np.testing.assert_allclose(np.asarray(logits), expected[:, :prompt_len], atol=1e-4, rtol=1e-4)
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = forward(params, jnp.asarray(tokens[:, t : t + 1]), jnp.array([[t]]), cache, cfg)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], expected[:, t], atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(checkpoint):
    assert_greedy_matches_transformers(*checkpoint)


@pytest.mark.parametrize("kernels,dtype", [("reference", jnp.float32), ("fused", jnp.bfloat16)])
def test_decode_step_reads_only_routed_experts(checkpoint, kernels, dtype):
    """Every expert the step's routers did not pick gets NaN weights: the logits stay the same."""
    path, _ = checkpoint
    ck = load_checkpoint(path, dtype=jnp.dtype(dtype).name)  # the expert kernel takes bf16
    cfg, params = ck.cfg, ck.params
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, PROMPT + 1)))
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, CACHE, cfg.head_dim, dtype)
    _, cache = forward(params, tokens[:, :PROMPT], jnp.arange(PROMPT)[None], cache, cfg)
    last, position = tokens[:, PROMPT:], jnp.array([[PROMPT]])
    routed = np.asarray(routed_experts(params, last, position, cache, cfg))[:, 0]  # [layers, k]
    assert (routed[1] == -1).all() and (routed[[0, 2]] >= 0).all()  # layer 1 is dense

    keep = np.zeros((2, cfg.num_experts), bool)
    for slot, layer in enumerate(cfg.moe_layers):
        keep[slot, routed[layer]] = True
    mask = jnp.asarray(~keep)[:, :, None, None]
    experts = params.experts
    poisoned = params.replace(
        experts=experts.replace(
            gate_up=jnp.where(mask, jnp.nan, experts.gate_up), down=jnp.where(mask, jnp.nan, experts.down)
        )
    )
    step = partial(forward, cfg=cfg, kernels=kernels)
    clean, _ = step(params, last, position, cache)
    logits, _ = step(poisoned, last, position, cache)
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(clean))
    keep[0, routed[0, 0]] = False  # now a routed expert is poisoned too: the check can fail
    broken = experts.replace(gate_up=jnp.where(jnp.asarray(~keep)[:, :, None, None], jnp.nan, experts.gate_up))
    assert np.isnan(np.asarray(step(params.replace(experts=broken), last, position, cache)[0])).all()


def test_moe_layers_follow_transformers_rule():
    transformers = require("transformers")
    for extra in (dict(decoder_sparse_step=2, mlp_only_layers=[]), dict(decoder_sparse_step=1, mlp_only_layers=[0, 3])):
        hf_config = transformers.Qwen3MoeConfig(**(SHAPE | dict(num_hidden_layers=4) | extra))
        model = transformers.Qwen3MoeForCausalLM(hf_config)
        expected = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
        cfg = qwen3_moe.config_from_hf(hf_config.to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]})
        assert cfg.moe_layers == expected and set(cfg.dense_layers) == set(range(4)) - set(expected)
        shapes = qwen3_moe.param_shapes(cfg)
        assert shapes["experts.gate_up"][0] == len(expected) and shapes["dense.w_gate"][0] == 4 - len(expected)


def test_qwen3_30b_a3b_floor_counts_eight_of_128_experts():
    cfg = bench.model_shape("qwen3-30b-a3b")
    assert (cfg.num_layers, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (48, 128, 8, 768)
    assert cfg.moe_layers == tuple(range(48)) and cfg.norm_topk_prob
    params = jax.eval_shape(partial(qwen3_moe.init_params, cfg, dtype=jnp.bfloat16), jax.random.key(0))
    D, F, V, q, kv, L = 2048, 768, 151936, 32 * 128, 4 * 128, 48
    attention = 2 * (2 * q * D + 2 * kv * D + 2 * 128 + 2 * D)
    router, expert = 2 * 128 * D, 2 * 3 * F * D
    total = L * (attention + router + 128 * expert) + 2 * (2 * V * D) + 2 * D
    assert sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)) == total  # about 61 GB
    assert bench.weight_bytes_read(params, cfg) == L * (attention + router + 8 * expert) + 2 * V * D + 2 * D + 2 * D


def test_gguf_file_holds_the_same_model(checkpoint, tmp_path):
    """A `qwen3moe` GGUF of the checkpoint's tensors (as llama.cpp lays them out: stacked experts, a dense layer
    without them) loads as the same config and parameters as the safetensors checkpoint, whose logits match
    transformers'; with Q8_0 experts, the experts stay packed (gate and up joined plane by plane) with the
    values gguf decodes, and the model's logits over them are the dense load's."""
    from lithos.checkpoint import gguf_file

    path, _ = checkpoint
    gguf_path = tmp_path / "tiny-qwen3moe.gguf"
    write_moe_gguf(gguf_path, path, "qwen3moe")
    want = load_checkpoint(path, dtype="float32")
    cfg, flat, _, unpacked = gguf_file.load(gguf_path)
    assert unpacked == {}
    assert cfg.moe_layers == (0, 2) and cfg.norm_topk_prob
    eps = float(np.float32(want.cfg.rms_norm_eps))  # GGUF keeps it as f32
    same = dict(max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=eps)
    assert cfg == dataclasses.replace(want.cfg, **same)
    params = qwen3_moe.params_from_flat(flat)
    for got, expected in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))

    packed_path = tmp_path / "tiny-qwen3moe-q8_0.gguf"
    write_moe_gguf(packed_path, path, "qwen3moe", "Q8_0")
    cfg, packed, _, unpacked = gguf_file.load(packed_path)
    _, dense, _, _ = gguf_file.load(packed_path, dequantize=True)
    assert unpacked == {}
    gate_up = packed["experts.gate_up"]
    assert gate_up.format == quant.Q8_0 and gate_up.shape == (2, 8, 64, 64)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(gate_up)), dense["experts.gate_up"])
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (1, PROMPT)))
    logits = []
    for values in (packed, dense):
        cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, CACHE, cfg.head_dim, jnp.float32)
        out, _ = forward(qwen3_moe.params_from_flat(values), tokens, jnp.arange(PROMPT)[None], cache, cfg)
        logits.append(np.asarray(out))
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-5 * np.abs(logits[1]).max())


def test_transformers_reads_the_gguf_as_the_same_model(tmp_path):
    """transformers' own GGUF reader (given the config: its qwen3moe key map has no expert_feed_forward_length)
    takes the file the test writes as the checkpoint it came from, and lithos's load of it gives transformers'
    logits: the file's layout is llama.cpp's as transformers reads it. All layers MoE (neither reader has dense
    layers in a qwen3moe file beside lithos)."""
    path, model = _save_tiny_model(tmp_path / "hf", SHAPE | dict(mlp_only_layers=[]))
    write_moe_gguf(tmp_path / "tiny.gguf", path, "qwen3moe")
    assert_transformers_reads_gguf_as(tmp_path / "tiny.gguf", model, PROMPT)


def test_gguf_file_generates_what_transformers_generates(checkpoint, tmp_path):
    """lithos.load of the `qwen3moe` GGUF (its tokenizer from the metadata) decodes greedily what transformers
    decodes from the checkpoint."""
    path, model = checkpoint
    gguf_path = tmp_path / "tiny-qwen3moe.gguf"
    write_moe_gguf(gguf_path, path, "qwen3moe")
    lm = assert_greedy_matches_transformers(gguf_path, model)
    safetensors, prompt = lithos.load(path, dtype="float32", max_len=64), "jumps over the lazy dog"
    assert lm.prompt_ids(prompt, raw=True) == safetensors.prompt_ids(prompt, raw=True)  # the GGUF's own tokenizer
