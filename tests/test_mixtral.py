"""Mixtral against transformers: a tiny random checkpoint saved by transformers (per-expert w1/w2/w3 tensors, a
sliding window shorter than the test's sequences), loaded through lithos.load; logits after prefill and decode, and
greedy generation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos import quant
from lithos.checkpoint import load_checkpoint
from lithos.models import family_of

from .conftest import (
    assert_greedy_matches_transformers,
    assert_steps_match_transformers,
    close_gguf,
    gguf_writer,
    require,
    save_tiny_moe,
)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=6,  # the tests run past 6 tokens
)
PROMPT, STEPS = 10, 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory of a tiny Mixtral checkpoint saved by transformers, the transformers model)."""
    return save_tiny_moe(tmp_path_factory.mktemp("mixtral"), "MixtralConfig", "MixtralForCausalLM", SHAPE)


def test_prefill_and_decode_match_transformers(checkpoint):
    path, model = checkpoint
    ck = load_checkpoint(path, dtype="float32", use_cache=False)
    cfg, params = ck.cfg, ck.params
    assert cfg.moe_layers == (0, 1) and not cfg.qk_norm and cfg.sliding_window == 6 and cfg.norm_topk_prob
    assert params.experts.gate_up.shape == (2, 8, 64, 64) and params.layers.q_norm is None
    assert family_of(cfg).cache_window(cfg) == 6  # the decode steps pass the window
    assert_steps_match_transformers(model, cfg, params, PROMPT, STEPS)


def test_greedy_generation_matches_transformers(checkpoint):
    assert_greedy_matches_transformers(*checkpoint)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for `llama` GGUFs (rotary halves interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_file_holds_the_same_model(checkpoint, tmp_path):
    """A Mixtral GGUF as llama.cpp writes one (a `llama` file whose layers hold stacked experts, Q and K rows
    permuted, experts in Q8_0 here) loads as the same model: the config, the dense tensors exactly, the experts packed
    with gguf's values; lithos.load of it decodes greedily what transformers decodes."""
    torch = require("torch")
    gguf = require("gguf")
    from safetensors.numpy import load_file

    from lithos.checkpoint import gguf_file

    path, model = checkpoint
    want = load_checkpoint(path, dtype="float32", use_cache=False)
    cfg = want.cfg
    t = load_file(next(path.glob("*.safetensors")))
    gguf_path = tmp_path / "tiny-mixtral.gguf"
    w = gguf_writer(gguf_path, "llama", cfg, ffn=cfg.moe_intermediate_size)
    w.add_sliding_window(cfg.sliding_window)  # the released Mixtrals have none; this tiny one's is 6
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for i in range(cfg.num_layers):
        layer = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", t[layer + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", t[layer + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(t[layer + "self_attn.q_proj.weight"], cfg.num_heads))
        w.add_tensor(
            f"blk.{i}.attn_k.weight", llama_cpp_permute(t[layer + "self_attn.k_proj.weight"], cfg.num_kv_heads)
        )
        w.add_tensor(f"blk.{i}.attn_v.weight", t[layer + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", t[layer + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", t[layer + "block_sparse_moe.gate.weight"])
        for name, proj in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
            stacked = np.stack(
                [t[f"{layer}block_sparse_moe.experts.{j}.{proj}.weight"] for j in range(cfg.num_experts)]
            )
            w.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(stacked, q8_0), raw_dtype=q8_0)
    close_gguf(w)

    got, flat, _, unpacked = gguf_file.load(gguf_path)
    _, dense, _, _ = gguf_file.load(gguf_path, dequantize=True)
    assert unpacked == {} and flat["experts.gate_up"].format.name == "q8_0"
    eps = float(np.float32(cfg.rms_norm_eps))  # GGUF keeps it as f32
    assert got == dataclasses.replace(cfg, max_position_embeddings=got.max_position_embeddings, rms_norm_eps=eps)
    for name in ("layers.wq", "layers.wk", "layers.wo", "experts.router", "embed"):
        field = want.params
        for part in name.split("."):
            field = getattr(field, part)
        np.testing.assert_array_equal(flat[name], np.asarray(field), err_msg=name)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(flat["experts.gate_up"])), dense["experts.gate_up"])

    lm = lithos.load(gguf_path, dtype="float32", max_len=64)
    prompt = "jumps over the lazy dog"
    ids = lm.prompt_ids(prompt, raw=True)
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    assert lm.generate(prompt, raw=True, max_new_tokens=12).token_ids == hf


def test_mixtral_8x7b_floor_counts_two_of_eight_experts():
    """The published Mixtral-8x7B shape (configs/models): about 46.7B parameters, of which a step reads the attention,
    the routers, two experts a layer and one embedding row."""
    from functools import partial

    from lithos import bench

    cfg = bench.model_shape("mixtral-8x7b")
    assert (cfg.num_layers, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (32, 8, 2, 14336)
    params = jax.eval_shape(partial(family_of(cfg).init_params, cfg, dtype=jnp.bfloat16), jax.random.key(0))
    D, F, V, L = 4096, 14336, 32000, 32
    attention = 2 * (2 * D * D + 2 * 1024 * D + 2 * D)  # Q, O, K, V and the two norms, bf16
    router, expert = 2 * 8 * D, 2 * 3 * F * D
    total = L * (attention + router + 8 * expert) + 2 * (2 * V * D) + 2 * D
    assert total == 2 * 46_702_792_704  # bf16 bytes of the published parameter count
    assert sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)) == total
    assert bench.weight_bytes_read(params, cfg) == L * (attention + router + 2 * expert) + 2 * V * D + 2 * D + 2 * D
