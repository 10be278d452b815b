"""Phi-3 (`Phi3ForCausalLM`, also Phi-4's architecture) as a GGUF: llama.cpp's `phi3` files hold Q/K/V in one matrix
(attn_qkv) and gate and up in ffn_up, which lithos cuts apart by rows as it cuts the safetensors' qkv_proj and
gate_up_proj (tests/test_models.py checks the safetensors load against transformers). The file loads as the
safetensors checkpoint does, packed types stay packed through the cut, transformers' own GGUF reader takes the file
as the checkpoint it came from, and greedy decoding of it equals transformers'."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from lithos import quant
from lithos.checkpoint import gguf_file, load_checkpoint
from lithos.errors import UnsupportedModelError
from lithos.models import llama

from .conftest import (
    assert_greedy_matches_transformers,
    assert_transformers_reads_gguf_as,
    close_gguf,
    gguf_writer,
    make_hf_checkpoint,
    require,
)

PROMPT = 10


def write_phi3_gguf(path, checkpoint_dir, fused_type: str = "F32"):
    """The checkpoint's tensors as llama.cpp's converter writes a `phi3` GGUF (no Q/K row permutation), the fused
    matrices in `fused_type`."""
    gguf = require("gguf")
    from safetensors.numpy import load_file

    t = load_file(next(checkpoint_dir.glob("*.safetensors")))
    cfg = load_checkpoint(checkpoint_dir, dtype="float32", use_cache=False).cfg
    w = gguf_writer(path, "phi3", cfg, ffn=cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.o_proj": "attn_output"}
    names |= {"mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    qtype = gguf.GGMLQuantizationType[fused_type]
    for i in range(cfg.num_layers):
        for hf, name in names.items():
            value = t[f"model.layers.{i}.{hf}.weight"]
            if fused_type != "F32" and name in ("attn_qkv", "ffn_up"):
                w.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(value, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(f"blk.{i}.{name}.weight", value)
    close_gguf(w)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory of a tiny Phi-3 checkpoint saved by transformers, with a sliding window of 12)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3", tied=False)


def test_gguf_file_holds_the_same_model(checkpoint, tmp_path):
    write_phi3_gguf(tmp_path / "tiny.gguf", checkpoint)
    want = load_checkpoint(checkpoint, dtype="float32", use_cache=False)
    cfg, flat, _, unpacked = gguf_file.load(tmp_path / "tiny.gguf")
    assert unpacked == {} and cfg.sliding_window == 12 and cfg.architecture == "Phi3ForCausalLM"
    same = dict(max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=float(np.float32(cfg.rms_norm_eps)))
    assert cfg == dataclasses.replace(want.cfg, **same)
    got = llama.params_from_flat(flat)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    write_phi3_gguf(tmp_path / "tiny-q8_0.gguf", checkpoint, fused_type="Q8_0")
    _, packed, _, unpacked = gguf_file.load(tmp_path / "tiny-q8_0.gguf")
    _, dense, _, _ = gguf_file.load(tmp_path / "tiny-q8_0.gguf", dequantize=True)
    assert unpacked == {}
    for name in ("layers.wq", "layers.wk", "layers.wv", "layers.w_gate", "layers.w_up"):
        assert packed[name].format == quant.Q8_0, name
        np.testing.assert_array_equal(np.asarray(quant.dequantize(packed[name])), dense[name])


def test_transformers_reads_the_gguf_as_the_same_model_and_lithos_decodes_it_alike(checkpoint, tmp_path):
    torch = require("torch")
    transformers = require("transformers")
    write_phi3_gguf(tmp_path / "tiny.gguf", checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert_transformers_reads_gguf_as(tmp_path / "tiny.gguf", model, PROMPT)
    assert_greedy_matches_transformers(tmp_path / "tiny.gguf", model, steps=16)


def test_unsupported_rope_forms_are_refused():
    base = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96}
    base |= {"num_hidden_layers": 2, "num_attention_heads": 4}
    assert llama.config_from_hf(base).architecture == "Phi3ForCausalLM"
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        llama.config_from_hf(base | {"partial_rotary_factor": 0.75})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling type 'longrope' is not supported"):
        llama.config_from_hf(base | {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}})
    with pytest.raises(UnsupportedModelError, match="LongRoPE .* use a model without it"):
        llama.config_from_gguf({"general.architecture": "phi3"}, {"rope_factors_long.weight", "token_embd.weight"})
