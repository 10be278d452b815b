"""Qwen2-MoE against transformers: a tiny random checkpoint saved by transformers (Q/K/V biases and none on the output
projection, a shared expert with its sigmoid gate in every MoE layer, one dense layer, top-k not renormalised),
loaded through lithos.load; logits after prefill and decode, greedy generation, the fused path over the same bf16
weights, and the shared expert's weights packed by `lithos quantize`'s groups."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos import quant
from lithos.checkpoint import load_checkpoint
from lithos.errors import UnsupportedModelError
from lithos.kv_cache import init_cache
from lithos.models import family_of, llama, qwen3_moe

from .conftest import (
    assert_greedy_matches_transformers,
    assert_steps_match_transformers,
    assert_transformers_reads_gguf_as,
    save_tiny_moe,
    write_moe_gguf,
)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[1],  # layers 0 and 2 are MoE, layer 1 dense
)
PROMPT, STEPS = 10, 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory of a tiny Qwen2-MoE checkpoint saved by transformers, the transformers model)."""
    return save_tiny_moe(tmp_path_factory.mktemp("qwen2-moe"), "Qwen2MoeConfig", "Qwen2MoeForCausalLM", SHAPE)


def test_prefill_and_decode_match_transformers(checkpoint):
    path, model = checkpoint
    ck = load_checkpoint(path, dtype="float32", use_cache=False)
    cfg, params = ck.cfg, ck.params
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and not cfg.norm_topk_prob
    assert cfg.moe_layers == (0, 2) and cfg.shared_expert_ffn == 64
    assert params.shared.w_gate.shape == (2, 64, 64) and params.shared.gate.shape == (2, 64)
    assert params.layers.bq is not None and params.layers.bo is None
    assert_steps_match_transformers(model, cfg, params, PROMPT, STEPS)


def test_greedy_generation_matches_transformers(checkpoint):
    assert_greedy_matches_transformers(*checkpoint)


def test_fused_step_equals_reference(checkpoint):
    """The fused path (the experts and the shared expert through kernels; attention, whose head size here the
    attention kernels are not built for, on jax.numpy: test_moe_fused.py has Qwen2-MoE's attention in kernels)
    against the reference over the same bf16 weights, a step of 2 tokens after a prefill."""
    path, _ = checkpoint
    ck = load_checkpoint(path, dtype="bfloat16", use_cache=False)
    cfg, params = ck.cfg, ck.params
    assert llama.kernel_gaps(cfg, "fused") == ["head_dim 16 (kernels exist for 64, 128, 256)"]
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, PROMPT + 2)))
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 32, cfg.head_dim, jnp.bfloat16)
    _, cache = qwen3_moe.forward(params, tokens[:, :PROMPT], jnp.arange(PROMPT)[None], cache, cfg)
    step = (params, tokens[:, PROMPT:], jnp.arange(PROMPT, PROMPT + 2)[None], cache, cfg)
    ref, fused = (np.asarray(qwen3_moe.forward(*step, kernels=k)[0], np.float32) for k in ("reference", "fused"))
    assert np.abs(fused - ref).max() <= 0.03 * np.abs(ref).max()
    # without its shared experts the step is another one: they are read on both paths
    unshared = params.replace(shared=params.shared.replace(gate=params.shared.gate - 100.0))  # sigmoid -> 0
    alone = np.asarray(qwen3_moe.forward(*((unshared,) + step[1:]), kernels="fused")[0], np.float32)
    assert np.abs(alone - fused).max() > 0.1 * np.abs(ref).max()


def test_quantize_groups_pack_the_shared_experts(checkpoint):
    path, _ = checkpoint
    params = load_checkpoint(path, dtype="float32", use_cache=False).params
    packed = quant.quantize_params(params, "mxfp8", ["mlp"])
    assert all(quant.is_quantized(w) for w in (packed.shared.w_gate, packed.shared.w_up, packed.shared.w_down))
    assert not quant.is_quantized(packed.shared.gate)


def test_sliding_window_on_some_layers_is_refused():
    hf = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 300} | SHAPE
    assert family_of(qwen3_moe.config_from_hf(hf)) is qwen3_moe
    with pytest.raises(UnsupportedModelError, match=r"use_sliding_window .* set it false in config.json"):
        qwen3_moe.config_from_hf(hf | {"use_sliding_window": True})


def test_gguf_file_is_the_same_model_for_transformers_and_lithos(checkpoint, tmp_path):
    """A `qwen2moe` GGUF as llama.cpp lays it out (stacked experts, shared experts as ffn_*_shexp, Q/K/V biases, a
    dense layer): lithos loads the config and every tensor the safetensors load has (the experts in Q8_0 kept
    packed); transformers' own GGUF reader takes the all-MoE file as the checkpoint it came from, and lithos's load of
    it gives transformers' logits; lithos.load of it decodes greedily what transformers decodes."""
    from lithos.checkpoint import gguf_file

    path, model = checkpoint
    write_moe_gguf(tmp_path / "tiny.gguf", path, "qwen2moe")
    want = load_checkpoint(path, dtype="float32", use_cache=False)
    cfg, flat, _, unpacked = gguf_file.load(tmp_path / "tiny.gguf")
    assert unpacked == {} and not cfg.norm_topk_prob and cfg.shared_expert_ffn == 64 and cfg.moe_layers == (0, 2)
    same = dict(max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=float(np.float32(cfg.rms_norm_eps)))
    assert cfg == dataclasses.replace(want.cfg, **same)
    for got, expected in zip(
        jax.tree_util.tree_leaves(qwen3_moe.params_from_flat(flat)), jax.tree_util.tree_leaves(want.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    write_moe_gguf(tmp_path / "tiny-q8_0.gguf", path, "qwen2moe", "Q8_0")
    assert gguf_file.load(tmp_path / "tiny-q8_0.gguf")[1]["experts.gate_up"].format == quant.Q8_0

    assert_greedy_matches_transformers(tmp_path / "tiny.gguf", model)

    all_moe, all_moe_model = save_tiny_moe(
        tmp_path / "hf", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", SHAPE | dict(mlp_only_layers=[])
    )
    write_moe_gguf(tmp_path / "all-moe.gguf", all_moe, "qwen2moe")
    assert_transformers_reads_gguf_as(tmp_path / "all-moe.gguf", all_moe_model, PROMPT)


def test_qwen1_5_moe_floor_counts_the_shared_and_four_routed_experts():
    """The published Qwen1.5-MoE-A2.7B shape (configs/models): 14.3B parameters, 2.7B of them active a token; a step
    reads the attention, the routers, the shared expert, four of sixty experts a layer and one embedding row."""
    from functools import partial

    from lithos import bench

    cfg = bench.model_shape("qwen1.5-moe-a2.7b")
    assert (cfg.num_experts, cfg.experts_per_token, cfg.shared_expert_ffn) == (60, 4, 5632)
    assert cfg.moe_layers == tuple(range(24)) and cfg.qkv_bias and not cfg.o_bias
    params = jax.eval_shape(partial(qwen3_moe.init_params, cfg, dtype=jnp.bfloat16), jax.random.key(0))
    D, F, S, V, L = 2048, 1408, 5632, 151936, 24
    attention = 4 * D * D + 3 * D + 2 * D  # Q, K, V, O, the Q/K/V biases and the two norms
    shared, router, expert = 3 * S * D + D, 60 * D, 3 * F * D
    total = L * (attention + shared + router + 60 * expert) + 2 * V * D + D
    assert round(total / 1e9, 1) == 14.3 and round((total - L * 56 * expert) / 1e9, 1) == 2.7
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == total
    assert bench.weight_bytes_read(params, cfg) == 2 * (L * (attention + shared + router + 4 * expert) + V * D + 2 * D)
