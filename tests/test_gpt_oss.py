"""GPT-OSS against transformers: a tiny random checkpoint whose experts are stored as MXFP4
(`*_blocks` / `*_scales`, built here from random codes and scales), loaded packed through
lithos.load; logits after prefill and after each decode step past the sliding window, greedy
generation, a decode step that reads only the routed experts, and `lithos bench` on the shape."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos import bench, cli, quant
from lithos.checkpoint import load_checkpoint
from lithos.errors import LithosError
from lithos.kv_cache import init_cache
from lithos.models import gpt_oss

from .conftest import (
    assert_greedy_matches_transformers,
    byte_tokenizer,
    close_gguf,
    gguf_writer,
    require,
)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=6,  # layer 0 slides, layer 1 sees everything: the tests run past 6 tokens
)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GPT-OSS MXFP4 `[..., out, in/32, 16]` + `[..., out, in/32]` -> f32 `[..., out, in]` (element 2k in
    the low nibble of byte k, scale 2^(s-127)), written out here independently of lithos.quant."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = E2M1[codes] * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return values.reshape(*values.shape[:-2], -1).astype(np.float32)


def random_mxfp4(rng, experts: int, out: int, inputs: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = rng.integers(0, 256, (experts, out, inputs // 32, 16), dtype=np.uint8)
    scales = rng.integers(123, 126, (experts, out, inputs // 32), dtype=np.uint8)  # 2^-4 .. 2^-2
    return blocks, scales


# Jitted once for the module, so tests of the same shapes share their compilations.
forward = jax.jit(gpt_oss.forward, static_argnames=("cfg", "kernels"))
routed_experts = jax.jit(gpt_oss.routed_experts, static_argnames=("cfg", "kernels"))
PROMPT, CACHE = 10, 32  # prompt length and cache size of every test that prefills


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory of a tiny GPT-OSS checkpoint with MXFP4 experts, the transformers model it holds)."""
    transformers = require("transformers")
    torch = require("torch")
    from safetensors.numpy import load_file, save_file

    path = tmp_path_factory.mktemp("gpt-oss")
    tok = byte_tokenizer()
    config = transformers.GptOssConfig(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SHAPE
    )
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    rng = np.random.default_rng(0)
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
            elif "router.weight" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn_like(p))  # decisive routing, logits of a useful spread
            elif "self_attn" in name or "embed" in name:
                p.copy_((0.2 if "self_attn" in name else 1.0) * torch.randn_like(p))  # attention that picks
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for proj, out, inputs in (("gate_up_proj", 2 * SHAPE["intermediate_size"], 64), ("down_proj", 64, 32)):
                blocks, scales = random_mxfp4(rng, SHAPE["num_local_experts"], out, inputs)
                packed[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
                # transformers keeps dense experts as [experts, in, out]
                getattr(experts, proj).copy_(torch.tensor(mxfp4_values(blocks, scales).transpose(0, 2, 1)))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    # Store the experts as the released checkpoints do: MXFP4 blocks and scales instead of dense tensors.
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, file, metadata={"format": "pt"})
    hf_config = json.loads((path / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(hf_config))
    return path, model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    torch = require("torch")
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def test_checkpoint_loads_with_experts_packed(checkpoint):
    path, _ = checkpoint
    ck = load_checkpoint(path, dtype="float32")
    cfg, experts = ck.cfg, ck.params.experts
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 6
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.factor == 32.0 and not cfg.rope_scaling.truncate
    for w in (experts.gate_up, experts.down):
        assert quant.is_quantized(w) and w.format is quant.MXFP4
    assert experts.gate_up.shape == (2, 8, 64, 64) and experts.down.shape == (2, 8, 64, 32)
    # The converted (orbax) copy restores the same packed planes.
    again = load_checkpoint(path, dtype="float32")
    assert again.restored and again.cfg == cfg
    np.testing.assert_array_equal(np.asarray(again.params.experts.gate_up.data), np.asarray(experts.gate_up.data))


def test_quantizing_the_default_groups_keeps_the_shipped_mxfp4_experts(checkpoint):
    """`lithos quantize --format mxfp4` (attention and MLP) packs the attention matrices and keeps the experts as
    shipped; another format names the experts and the way out, rather than failing on a missing dense MLP."""
    from lithos.quant.quantize import quantize_params

    ck = load_checkpoint(checkpoint[0], dtype="float32")
    packed = quantize_params(ck.params, "mxfp4")
    assert packed.layers.wq.format is quant.MXFP4 and packed.experts.gate_up is ck.params.experts.gate_up
    with pytest.raises(LithosError, match="experts.gate_up is already packed as mxfp4.*leave the group"):
        quantize_params(ck.params, "mxfp8")
    assert quantize_params(ck.params, "mxfp8", groups=["attention"]).layers.wo.format is quant.MXFP8


def test_prefill_and_decode_match_transformers(checkpoint):
    path, model = checkpoint
    ck = load_checkpoint(path, dtype="float32")
    cfg, params = ck.cfg, ck.params
    prompt_len, steps = PROMPT, 6
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, prompt_len + steps))
    expected = hf_logits(model, tokens)
    assert expected.std() > 0.5  # logits that can tell a wrong layer from a right one

    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, CACHE, cfg.head_dim, jnp.float32)
    logits, cache = forward(params, jnp.asarray(tokens[:, :prompt_len]), jnp.arange(prompt_len)[None], cache, cfg)
    np.testing.assert_allclose(np.asarray(logits), expected[:, :prompt_len], atol=1e-4, rtol=1e-4)
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = forward(params, jnp.asarray(tokens[:, t : t + 1]), jnp.array([[t]]), cache, cfg)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], expected[:, t], atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(checkpoint):
    prompt = "the quick brown fox"
    lm = assert_greedy_matches_transformers(*checkpoint, prompt)
    # Speculative decoding (n-gram drafts verified several tokens at a time) gives the same tokens.
    plain = lm.generate(prompt, raw=True, max_new_tokens=12).token_ids
    assert lm.generate(prompt, raw=True, max_new_tokens=12, spec="ngram").token_ids == plain


def poison_unrouted(experts, routed: np.ndarray):
    """Every expert of every layer that `routed` `[layers, k]` does not name gets NaN weights (E8M0
    scale 0xFF makes a whole MXFP4 block NaN) and NaN biases."""
    keep = np.zeros((experts.gate_up.shape[0], experts.num_experts), bool)
    for layer, ids in enumerate(routed):
        keep[layer, ids] = True
    poison = jnp.asarray(~keep)

    def nan_scales(w):
        return w.replace(scales=jnp.where(poison[:, :, None, None], jnp.uint8(0xFF), w.scales))

    return experts.replace(
        gate_up=nan_scales(experts.gate_up),
        down=nan_scales(experts.down),
        gate_up_bias=jnp.where(poison[..., None], jnp.nan, experts.gate_up_bias),
        down_bias=jnp.where(poison[..., None], jnp.nan, experts.down_bias),
    )


@pytest.mark.parametrize("kernels,dtype", [("reference", jnp.float32), ("fused", jnp.bfloat16)])
def test_decode_step_reads_only_routed_experts(checkpoint, kernels, dtype):
    """Every expert the step's routers did not pick gets NaN weights and biases: the logits stay the
    same. On a GPU the fused path runs the expert kernel itself (bf16 activations, as it takes them)."""
    path, _ = checkpoint
    ck = load_checkpoint(path, dtype=jnp.dtype(dtype).name)
    cfg, params = ck.cfg, ck.params
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, PROMPT + 1)))
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, CACHE, cfg.head_dim, dtype)
    _, cache = forward(params, tokens[:, :PROMPT], jnp.arange(PROMPT)[None], cache, cfg)
    step = partial(forward, cfg=cfg, kernels=kernels)
    last, position = tokens[:, PROMPT:], jnp.array([[PROMPT]])

    routed = np.asarray(routed_experts(params, last, position, cache, cfg))[:, 0]  # [layers, k]
    assert routed.shape == (cfg.num_layers, cfg.experts_per_token)
    clean, _ = step(params, last, position, cache)
    poisoned = params.replace(experts=poison_unrouted(params.experts, routed))
    logits, _ = step(poisoned, last, position, cache)
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(clean))
    # Poison that reaches a routed expert shows in the output: the check above can fail.
    also_first = routed.copy()
    also_first[0, 0] = routed[0, 1]  # layer 0 keeps only its second expert
    broken, _ = step(params.replace(experts=poison_unrouted(params.experts, also_first)), last, position, cache)
    assert np.isnan(np.asarray(broken)).all()


def test_shapes_count_only_routed_expert_bytes():
    """gpt-oss-20b and -120b as published (configs/models): total bytes, and the floor's bytes per step
    (attention, router, top-4 experts of each layer, one embedding row, LM head), counted here from the
    shapes alone, without allocating them."""
    for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
        cfg = bench.model_shape(name)
        assert (cfg.num_layers, cfg.num_experts, cfg.experts_per_token, cfg.hidden_size) == (layers, experts, 4, 2880)
        params = jax.eval_shape(partial(gpt_oss.init_params, cfg, dtype=jnp.bfloat16), jax.random.key(0))
        D, F, V, q, kv = 2880, 2880, 201088, 64 * 64, 8 * 64
        attention = 2 * (2 * q * D + 2 * kv * D + q + 2 * kv + D + 64 + 2 * D)  # bf16 weights, biases, sinks, norms
        router = 2 * (experts * D + experts)
        expert = (2 * F * D + D * F) // 2 + (2 * F * D + D * F) // 32 + 2 * (2 * F + D)  # MXFP4 codes + scales, biases
        head = 2 * V * D
        total = layers * (attention + router + experts * expert) + 2 * head + 2 * D
        assert sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)) == total
        read = layers * (attention + router + 4 * expert) + head + 2 * D + 2 * D
        assert bench.weight_bytes_read(params, cfg) == read
        # Sliding layers read at most 128 positions of a 1K context.
        assert bench.kv_bytes_read(cfg, 1024, 2) == 2 * 2 * kv * (layers // 2) * (1024 + 128)
    assert 60e9 < total < 70e9  # gpt-oss-120b: about 61 GiB in MXFP4


def test_bench_runs_the_shape_on_cpu(tmp_path, monkeypatch):
    """`lithos bench --shape` with the gpt-oss-20b config file shrunk to a few layers and experts
    (the full shape is 14 GB and runs on the GPU machine): random MXFP4 experts, attention as random Q8_0 codes
    (`--weight-format q8_0`: the format a GGUF of it holds them in), both kernel paths."""
    configs = Path(bench.configs_dir())
    shape = json.loads((configs / "models" / "gpt-oss-20b.json").read_text())
    shape |= dict(num_hidden_layers=2, layer_types=shape["layer_types"][:2], num_local_experts=8, vocab_size=512)
    shape |= dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "configs" / "models").mkdir(parents=True)
    (tmp_path / "configs" / "hardware").mkdir()
    (tmp_path / "configs" / "models" / "gpt-oss-small.json").write_text(json.dumps(shape))
    monkeypatch.setenv("LITHOS_CONFIGS", str(tmp_path / "configs"))
    argv = ["bench", "--shape", "gpt-oss-small", "--kernels", "reference,fused", "--context", "16",
            "--steps", "16", "--loops", "2", "--runs", "4", "--bandwidth-bytes", str(1 << 22),
            "--weight-format", "q8_0", "--out", str(tmp_path / "out")]  # fmt: skip
    result = bench.run(cli.build_parser().parse_args(argv), argv[1:])
    rows = result["rows"]
    assert [r["kernels"] for r in rows] == ["reference", "fused"]
    for r in rows:  # attention in Q8_0 (a GGUF's), the experts in the MXFP4 they ship in
        assert r["weight_formats"]["mxfp4"] > 0 and r["weight_formats"]["q8_0"] > 0 and r["step_ms"] > 0
        total = sum(r["weight_formats"].values())
        assert r["weight_bytes"] < total  # unrouted experts and all but one embedding row are not counted


def gguf_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GPT-OSS MXFP4 `[..., out, in/32, 16]` + `[..., out, in/32]` as a GGUF MXFP4 tensor's bytes `[..., out, in/32 *
    17]`: each block its E8M0 byte, then elements 0..15 in the low nibbles and 16..31 in the high (llama.cpp's order,
    what its converter writes for GPT-OSS)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    return np.concatenate([scales[..., None], packed], axis=-1).reshape(*blocks.shape[:-2], -1)


def _write_gpt_oss_gguf(path, checkpoint_dir):
    """The tiny checkpoint as llama.cpp's converter writes a `gpt-oss` GGUF: experts stacked, MXFP4 kept, each
    expert's interleaved gate_up rows (and bias) split into ffn_gate_exps (even rows) and ffn_up_exps (odd), the
    MLP's norm as post_attention_norm, the sinks as attn_sinks, YaRN in the metadata."""
    gguf = require("gguf")
    from safetensors.numpy import load_file

    t = load_file(next(checkpoint_dir.glob("*.safetensors")))
    cfg = load_checkpoint(checkpoint_dir, dtype="float32").cfg
    w = gguf_writer(path, "gpt-oss", cfg, ffn=cfg.intermediate_size, expert_ffn=cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    w.add_rope_scaling_orig_ctx_len(cfg.rope_scaling.original_max_position_embeddings)
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
    }
    names |= {
        f"self_attn.{p}_proj.{k}": f"attn_{g}.{k}"
        for p, g in zip("qkvo", ("q", "k", "v", "output"))
        for k in ("weight", "bias")
    }
    names |= {"self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight"}
    names |= {"mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for hf, name in names.items():
            w.add_tensor(f"blk.{i}.{name}", t[prefix + hf])
        blocks, scales = t[prefix + "mlp.experts.gate_up_proj_blocks"], t[prefix + "mlp.experts.gate_up_proj_scales"]
        for name, rows in (("ffn_gate_exps", slice(0, None, 2)), ("ffn_up_exps", slice(1, None, 2))):
            w.add_tensor(f"blk.{i}.{name}.weight", gguf_mxfp4(blocks[:, rows], scales[:, rows]), raw_dtype=mxfp4)
            w.add_tensor(f"blk.{i}.{name}.bias", t[prefix + "mlp.experts.gate_up_proj_bias"][:, rows])
        down = gguf_mxfp4(t[prefix + "mlp.experts.down_proj_blocks"], t[prefix + "mlp.experts.down_proj_scales"])
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", down, raw_dtype=mxfp4)
    close_gguf(w)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_gguf_file_holds_the_same_model(checkpoint, tmp_path):
    """A `gpt-oss` GGUF of the checkpoint, laid out as llama.cpp's converter writes one (its MXFP4 bytes checked
    against gguf's own decoder here), loads as the same config and parameters (experts packed: gate and up rows
    interleaved again, plane by plane), and lithos.load of it decodes greedily what transformers decodes."""
    torch = require("torch")
    gguf = require("gguf")
    from lithos.checkpoint import gguf_file

    path, model = checkpoint
    gguf_path = tmp_path / "tiny-gpt-oss.gguf"
    _write_gpt_oss_gguf(gguf_path, path)
    reader = gguf.GGUFReader(str(gguf_path))
    up = next(x for x in reader.tensors if x.name == "blk.1.ffn_up_exps.weight")
    dense_up = model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy().transpose(0, 2, 1)[:, 1::2]
    np.testing.assert_array_equal(gguf.quants.dequantize(up.data, up.tensor_type), dense_up)  # -0 == +0

    want = load_checkpoint(path, dtype="float32")
    cfg, flat, _, unpacked = gguf_file.load(gguf_path)
    assert unpacked == {}
    eps = float(np.float32(want.cfg.rms_norm_eps))  # GGUF keeps it as f32
    assert cfg == dataclasses.replace(want.cfg, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=eps)
    params = gpt_oss.params_from_flat(flat)
    assert params.experts.gate_up.format is quant.MXFP4
    for got, expected in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))

    lm = lithos.load(gguf_path, dtype="float32", max_len=64)
    prompt = "the quick brown fox"
    ids = lm.prompt_ids(prompt, raw=True)
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    assert lm.generate(prompt, raw=True, max_new_tokens=12).token_ids == hf
