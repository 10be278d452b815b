"""Trained draft heads (EAGLE-3 style, MTP): the checkpoint layout round-trips, EAGLE-3's own tensor
names and d2t table load, and broken checkpoints say what is wrong. (Lossless decoding with random
heads of both kinds is in test_spec.py.)"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from lithos.errors import CheckpointError
from lithos.kv_cache import init_cache
from lithos.models import llama
from lithos.spec import head_config, init_head, load_head, save_head
from lithos.spec.heads import head_step

TARGET = llama.Config(
    architecture="LlamaForCausalLM",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def assert_params_equal(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        assert (x is None) == (y is None), field.name
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=field.name)


@pytest.mark.parametrize("kind, draft_vocab", [("eagle3", 20), ("eagle3", None), ("mtp", None)])
def test_layout_round_trips(kind, draft_vocab, tmp_path):
    head = head_config(kind, TARGET, draft_vocab_size=draft_vocab)
    params = init_head(head, seed=0)
    loaded_head, loaded = load_head(save_head(tmp_path, head, params), TARGET)
    assert loaded_head == head
    assert_params_equal(params, loaded)
    assert head.feature_layers == ((2, 3, 3) if kind == "eagle3" else (6,))


def test_eagle3_checkpoint_as_published(tmp_path):
    """EAGLE-3's own names (with a `model.` prefix here), its config keys and its d2t offsets."""
    d, heads, kv, hd, ffn, vd = 32, 4, 2, 8, 48, 10
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    tensors = {
        "model.fc.weight": w(d, 3 * d),
        "model.midlayer.hidden_norm.weight": w(d),
        "model.midlayer.input_layernorm.weight": w(d),
        "model.midlayer.post_attention_layernorm.weight": w(d),
        "model.midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * d),
        "model.midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * d),
        "model.midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * d),
        "model.midlayer.self_attn.o_proj.weight": w(d, heads * hd),
        "model.midlayer.mlp.gate_proj.weight": w(ffn, d),
        "model.midlayer.mlp.up_proj.weight": w(ffn, d),
        "model.midlayer.mlp.down_proj.weight": w(d, ffn),
        "model.norm.weight": w(d),
        "model.lm_head.weight": w(vd, d),
        "model.d2t": np.array([0, 1, 1, 3, 5, 8, 13, 21, 30, 40], np.int64),
        "model.t2d": np.ones(50, bool),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": d,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "vocab_size": 50,
        "draft_vocab_size": vd,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    head, params = load_head(tmp_path, TARGET)
    assert head.kind == "eagle3" and head.layer.intermediate_size == ffn and head.layer.head_dim == hd
    assert np.asarray(params.draft_to_target).tolist() == [i + o for i, o in enumerate(tensors["model.d2t"])]
    np.testing.assert_array_equal(np.asarray(params.fc), tensors["model.fc.weight"])

    # Its logits cover only the draft vocabulary, mapped to target ids.
    target = llama.Params(embed=jnp.asarray(w(50, d)), layers=None, final_norm=None)  # the head reads the embedding
    cache = init_cache(1, 1, kv, 16, hd, jnp.float32)
    hidden, tokens, positions = jnp.ones((1, 2, d)), jnp.array([[3, 4]]), jnp.array([[0, 1]])
    _, logits, cache = jax.jit(head_step, static_argnums=0)(head, params, target, hidden, tokens, positions, cache)
    finite = np.isfinite(np.asarray(logits[0, 0]))
    assert np.flatnonzero(finite).tolist() == sorted(np.asarray(params.draft_to_target).tolist())
    assert float(jnp.abs(cache.k[0, 0, :, :2]).sum()) > 0  # the pair's keys are stored


def test_broken_checkpoints_say_what_is_wrong(tmp_path):
    head = head_config("mtp", TARGET)
    params = init_head(head, seed=0)
    path = save_head(tmp_path / "ok", head, params)

    with pytest.raises(CheckpointError, match="hidden_size 32 differs from the target's 64"):
        load_head(path, dataclasses.replace(TARGET, hidden_size=64))

    config = json.loads((path / "config.json").read_text())
    del config["lithos_draft_head"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="lithos_draft_head"):
        load_head(path, TARGET)

    config["lithos_draft_head"] = "mtp"
    config["intermediate_size"] = 99
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight has shape \(64, 32\) but config.json implies"):
        load_head(path, TARGET)

    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_head(path, TARGET)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_head(tmp_path / "missing", TARGET)
