"""Packed weights inside models and checkpoints: the forward reads them exactly as their dequantised
values; safetensors FP8 block-scaled and GPT-OSS-layout MXFP4 load packed; `lithos quantize` writes an
orbax checkpoint that loads packed, with its quality report; GGUF stays packed; bench counts packed bytes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lithos import quant
from lithos.bench import weight_bytes_read
from lithos.checkpoint import load_checkpoint
from lithos.checkpoint.safetensors_dir import read_safetensors
from lithos.kv_cache import init_cache
from lithos.models import family_of

TOKENS = [[3, 17, 101, 250, 7, 64, 33, 200, 5]]


def logits_of(params, cfg) -> np.ndarray:
    n = len(TOKENS[0])
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 16, cfg.head_dim, jnp.float32)
    forward = jax.jit(partial(family_of(cfg).forward, cfg=cfg))
    logits, _ = forward(params, jnp.asarray(TOKENS), jnp.arange(n)[None], cache)
    return np.asarray(logits)


@pytest.mark.parametrize("fmt_name, tied", [("mxfp4", False), ("mxfp8", True), ("fp8_block128", False)])
def test_forward_reads_packed_weights_as_their_values(hf_checkpoint, fmt_name, tied):
    """Every matrix packed (embedding and LM head included): the same logits as the dense model made
    of the dequantised values, so packing changes storage and nothing else."""
    ck = load_checkpoint(hf_checkpoint("llama3", tied=tied), dtype="float32", use_cache=False)
    packed = quant.quantize_params(ck.params, fmt_name, ["attention", "mlp", "embed", "lm_head"])
    assert quant.is_quantized(packed.layers.wq) and quant.is_quantized(packed.embed)
    assert (packed.lm_head is None) == tied and (tied or quant.is_quantized(packed.lm_head))
    expected = logits_of(quant.dequantize_params(packed), ck.cfg)
    np.testing.assert_allclose(logits_of(packed, ck.cfg), expected, rtol=0, atol=1e-5)
    assert np.abs(expected - logits_of(ck.params, ck.cfg)).max() > 0  # it did quantize


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A .safetensors file written by hand (the safetensors package has no numpy FP8 writer)."""
    names = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.uint8): "U8"}
    names[np.dtype(ml_dtypes.float8_e4m3fn)] = "F8_E4M3"
    header, offset, blobs = {}, 0, []
    for name, value in tensors.items():
        blob = np.ascontiguousarray(value).tobytes()
        span = [offset, offset + len(blob)]
        header[name] = {"dtype": names[value.dtype], "shape": list(value.shape), "data_offsets": span}
        offset += len(blob)
        blobs.append(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def packed_copy(src: Path, dst: Path, fmt_name: str) -> Path:
    """`src` (a tiny HF checkpoint) with every projection stored as FP8 block-scaled or GPT-OSS MXFP4."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = {k: np.array(v) for k, v in read_safetensors(f).items()}
        out = {}
        for name, value in tensors.items():
            if not name.endswith("_proj.weight"):
                out[name] = value
                continue
            w = quant.quantize(jnp.asarray(value), fmt_name)
            if fmt_name == "fp8_block128":
                out[name] = np.asarray(w.data).view(ml_dtypes.float8_e4m3fn)
                out[name + "_scale_inv"] = np.asarray(w.scales)
            else:
                rows, cols = value.shape
                out[name + "_blocks"] = np.asarray(w.data).reshape(rows, cols // 32, 16)
                out[name + "_scales"] = np.asarray(w.scales)
        f.unlink()
        write_safetensors(f, out)
    return dst


@pytest.mark.parametrize("fmt_name", ["fp8_block128", "mxfp4"])
def test_safetensors_packed_checkpoints_load_packed(hf_checkpoint, tmp_path, fmt_name):
    src = hf_checkpoint("qwen3")
    path = packed_copy(src, tmp_path / fmt_name, fmt_name)
    packed = load_checkpoint(path, dtype="float32", use_cache=False)
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = getattr(packed.params.layers, name)
        assert quant.is_quantized(w) and w.format.name == fmt_name, name
    dense = load_checkpoint(path, dtype="float32", use_cache=False, dequantize=True)
    assert not quant.is_quantized(dense.params.layers.wq)
    values = quant.dequantize(packed.params.layers.w_up)
    np.testing.assert_array_equal(np.asarray(dense.params.layers.w_up), np.asarray(values))
    np.testing.assert_allclose(logits_of(packed.params, packed.cfg), logits_of(dense.params, dense.cfg), atol=1e-5)
    # Close to the unquantized weights it came from (relative error of one E2M1 / E4M3 rounding).
    original = load_checkpoint(src, dtype="float32", use_cache=False).params.layers.w_up
    tolerance = (0.5 if fmt_name == "mxfp4" else 2.0**-4) * np.abs(np.asarray(original)).max()
    assert np.abs(np.asarray(dense.params.layers.w_up) - np.asarray(original)).max() <= tolerance


def test_quantize_command_writes_a_packed_checkpoint_and_a_report(hf_checkpoint, tmp_path):
    from lithos import cli

    src = hf_checkpoint("llama3", tied=True)
    out = tmp_path / "q"
    argv = ["quantize", str(src), str(out), "--format", "mxfp8", "--groups", "attention,mlp,lm_head"]
    assert cli.main(argv + ["--dtype", "float32", "--max-tokens", "48"]) == 0
    report = json.loads((out / "quality.json").read_text())
    q = report["quality"]
    assert q["positions"] == 47 and 0 <= q["kl_mean"] < 0.1 and q["perplexity_quantized"] > 1
    assert set(report["bytes_quantized"]) == {"mxfp8", "float32"}

    ck = load_checkpoint(out)
    assert ck.restored and ck.dtype == "float32"
    assert ck.params.layers.w_down.format.name == "mxfp8" and ck.params.embed.format.name == "mxfp8"  # tied
    assert not quant.is_quantized(ck.params.layers.attn_norm)

    import lithos

    result = lithos.load(out, max_len=64).generate("hello", max_new_tokens=4, raw=True)
    assert result.generated_tokens >= 1


def test_bench_counts_packed_bytes(hf_checkpoint):
    ck = load_checkpoint(hf_checkpoint("llama3"), dtype="float32", use_cache=False)
    packed = quant.quantize_params(ck.params, "mxfp4", ["attention", "mlp", "embed"])
    cfg = ck.cfg
    planes = sum(int(p.size) * p.dtype.itemsize for p in jax.tree_util.tree_leaves(packed))
    embed = packed.embed
    embed_row = (cfg.hidden_size // 2) + (cfg.hidden_size // 32)  # MXFP4 codes + E8M0 scales of one row
    assert weight_bytes_read(packed, cfg) == planes - embed.nbytes + embed_row
    assert quant.bytes_by_format(packed)["mxfp4"] > 0


@pytest.mark.parametrize("fmt_name", ["q4_k", "mxfp4", "q4_k_m"])
def test_bench_shapes_in_formats_lithos_reads_or_makes(hf_checkpoint, monkeypatch, fmt_name):
    """`lithos bench --shape ... --weight-format`: MX formats quantized from the random weights, GGUF formats
    (read, not made) as random codes at the weights' spread; the label names the format, the floor counts its
    planes."""
    import argparse

    from lithos import bench

    ck = load_checkpoint(hf_checkpoint("llama3"), dtype="float32", use_cache=False)
    cfg = dataclasses.replace(ck.cfg, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)
    monkeypatch.setattr(bench, "model_shape", lambda name: cfg)
    _, params = bench.shape_model("small", jnp.bfloat16)
    args = argparse.Namespace(weight_format=fmt_name, quantize_groups="attention,mlp")
    label, _, packed = bench.shape_model_as_asked("small", jnp.bfloat16, args)
    assert label == f"small-{fmt_name}"
    down = "k_mix" if fmt_name == "q4_k_m" else fmt_name  # Q4_K_M's down projections mix Q4_K and Q6_K
    assert packed.layers.wq.format.name == fmt_name.removesuffix("_m") and packed.layers.w_down.format.name == down
    if fmt_name == "q4_k":  # read formats' codes come without the dense weights, yet as if made from them
        names = quant.names_for_groups(["attention", "mlp"], cfg.tie_word_embeddings)
        made = quant.random_packed_params(params, dict.fromkeys(names, fmt_name))
        assert jax.tree.structure(made) == jax.tree.structure(packed)
        for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(packed), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not quant.is_quantized(packed.embed)
    spread = np.std(np.asarray(params.layers.w_up, np.float32))
    assert 0.1 * spread < np.std(np.asarray(quant.dequantize(packed.layers.w_up, jnp.float32))) < 10 * spread
    assert weight_bytes_read(packed, cfg) < weight_bytes_read(params, cfg) / 2  # at most 7.6 bits against 16


@pytest.mark.parametrize("fmt_name", ["q4_k_m", "mxfp4"])
def test_bench_packs_a_mixture_of_experts_shape(monkeypatch, fmt_name):
    """`lithos bench --shape qwen3-30b-a3b --weight-format ...` (here a small shape of that family, with a dense layer):
    the "mlp" group is the experts' and the dense layers' matrices, each packed as GGUF files hold them (Q4_K_M's
    down projections in K_MIX), and the floor counts the routed experts' packed bytes."""
    import argparse

    from lithos import bench
    from lithos.models import qwen3_moe

    small = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2, head_dim=64)
    small |= dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=512)
    hf = (
        json.loads((bench.configs_dir() / "models" / "qwen3-30b-a3b.json").read_text())
        | small
        | {"mlp_only_layers": [1]}
    )
    cfg = qwen3_moe.config_from_hf(hf)
    monkeypatch.setattr(bench, "model_shape", lambda name: cfg)
    _, params = bench.shape_model("small-moe", jnp.bfloat16)
    args = argparse.Namespace(weight_format=fmt_name, quantize_groups="attention,mlp")
    _, _, packed = bench.shape_model_as_asked("small-moe", jnp.bfloat16, args)
    main, down = ("q4_k", "k_mix") if fmt_name == "q4_k_m" else (fmt_name, fmt_name)
    assert packed.layers.wq.format.name == main and packed.experts.gate_up.format.name == main
    assert packed.experts.down.format.name == down and packed.dense.w_down.format.name == down
    assert packed.experts.gate_up.shape == params.experts.gate_up.shape
    assert weight_bytes_read(packed, cfg) < weight_bytes_read(params, cfg) / 2


@pytest.mark.slow
def test_default_gguf_loads_packed(smollm2_model):
    """The default SmolLM2 Q4_1 GGUF runs from its packed weights (test_smollm2 checks its logits and
    greedy output against transformers through this same fixture)."""
    layers = smollm2_model.params.layers
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert getattr(layers, name).format.name == "q4_1", name
    assert smollm2_model.params.embed.format.name == "q8_0"  # tied: also the LM head
    assert not quant.is_quantized(layers.attn_norm)


@pytest.mark.slow
def test_gguf_packed_equals_dequantized_load(smollm2_gguf):
    """Tensor by tensor, the packed load (Q/K rows un-permuted plane by plane) decodes to exactly what
    the dequantizing load (gguf.quants.dequantize, then un-permuted) gives."""
    from lithos.checkpoint import gguf_file

    _, packed, _, unpacked = gguf_file.load(smollm2_gguf)
    _, dense, _, _ = gguf_file.load(smollm2_gguf, dequantize=True)
    assert unpacked == {}  # every quantized tensor of the default model stays packed
    assert set(packed) == set(dense)
    for name, w in packed.items():
        values = np.asarray(jax.jit(quant.dequantize)(w)) if quant.is_quantized(w) else w
        np.testing.assert_array_equal(values, dense[name], err_msg=name)


# GGUF super-blocks of 256 weights: bytes each, and where their f16 factors (d, then dmin) sit.
K_QUANT_BLOCKS = {
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
    "IQ4_XS": (136, (0,)),
    "TQ1_0": (54, (52,)),
    "TQ2_0": (66, (64,)),
    "IQ3_S": (110, (0,)),
    "IQ2_XXS": (66, (0,)),  # a type lithos has no packed layout for
}
# Q4_K_M's choice of types (llama.cpp): Q6_K for the value and down projections where it keeps more bits,
# and for the output; Q4_K elsewhere.
Q4_K_M = {
    "token_embd.weight": "Q4_K",
    "output.weight": "Q6_K",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q4_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q4_K",
    "blk.0.ffn_gate.weight": "Q4_K",
    "blk.0.ffn_up.weight": "Q4_K",
    "blk.0.ffn_down.weight": "Q6_K",
}


def _write_k_quant_gguf(path, types: dict[str, str], layers: int = 1, d: float = 0.0004, large_d: str | None = None):
    """A llama GGUF of `layers` layers (hidden and ffn 256, 4 heads of 64, byte-level tokenizer of 32 tokens)
    with the tensors of `types` in those GGUF types (random super-blocks, factors `d` and d / 2 that keep weights
    below 1, but one super-block of tensor `large_d` whose d is 2^14), the rest float32."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    hidden, ffn, vocab = 256, 256, 32
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i) for i in range(26)] + ["0", "1", "2", "3", "ab", "<|endoftext|>"])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(vocab - 1)
    layer_shapes = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (hidden, hidden),
        "attn_k.weight": (hidden // 2, hidden),
        "attn_v.weight": (hidden // 2, hidden),
        "attn_output.weight": (hidden, hidden),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    shapes.update({f"blk.{i}.{name}": shape for i in range(layers) for name, shape in layer_shapes.items()})
    for name, shape in shapes.items():
        if name not in types:
            writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        if types[name] not in K_QUANT_BLOCKS:  # the block-32 types gguf can make
            values = (0.1 * rng.standard_normal(shape)).astype(np.float32)
            qtype = gguf.GGMLQuantizationType[types[name]]
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
            continue
        block_bytes, factors = K_QUANT_BLOCKS[types[name]]
        blocks = rng.integers(0, 256, (shape[0], shape[1] // 256, block_bytes), dtype=np.uint8)
        for at, factor in zip(factors, (d, d / 2), strict=False):
            blocks[..., at : at + 2] = np.frombuffer(np.float16(factor).tobytes(), np.uint8)
        if name == large_d:
            blocks[1, 0, factors[0] : factors[0] + 2] = np.frombuffer(np.float16(2**14).tobytes(), np.uint8)
        writer.add_tensor(name, blocks.reshape(shape[0], -1), raw_dtype=gguf.GGMLQuantizationType[types[name]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors if t.name in types}


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M"])
def test_a_k_quant_gguf_loads_packed_and_runs_from_its_packed_weights(tmp_path, mix):
    """Q4_K (Q5_K) and Q6_K tensors stay packed, decode bit for bit to what gguf's dequantizer gives (Q and K
    rows un-permuted, as for the dense load), and the fused path (its kernels' reference twins here) over them
    gives the reference path's logits over the dense load's exact values."""
    from lithos.checkpoint import gguf_file

    path = tmp_path / f"tiny-{mix}.gguf"
    main = mix[:4]
    _write_k_quant_gguf(path, {name: main if kind == "Q4_K" else kind for name, kind in Q4_K_M.items()})
    cfg, packed, _, unpacked = gguf_file.load(path)
    _, dense, _, _ = gguf_file.load(path, dequantize=True)
    assert unpacked == {}
    main_format = quant.get_format(main.lower())
    assert packed["layers.wq"].format == main_format and packed["layers.w_down"].format == quant.Q6_K
    assert packed["embed"].format == main_format and packed["lm_head"].format == quant.Q6_K
    for name, w in packed.items():
        values = np.asarray(jax.jit(quant.dequantize)(w)) if quant.is_quantized(w) else w
        np.testing.assert_array_equal(values, dense[name], err_msg=name)
    params = load_checkpoint(path, dtype="float32", use_cache=False).params
    dense_params = load_checkpoint(path, dtype="float32", use_cache=False, dequantize=True).params
    assert params.layers.wv.format == quant.Q6_K and not quant.is_quantized(dense_params.layers.wv)
    want = logits_of(dense_params, cfg)
    np.testing.assert_allclose(logits_of(params, cfg), want, rtol=0, atol=1e-5 * np.abs(want).max())
    forward = family_of(cfg).forward
    n = len(TOKENS[0])
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 16, cfg.head_dim, jnp.float32)
    _, cache = jax.jit(partial(forward, cfg=cfg))(dense_params, jnp.asarray(TOKENS), jnp.arange(n)[None], cache)
    step = (jnp.asarray([[9]]), jnp.asarray([[n]]), cache)
    fused, _ = jax.jit(partial(forward, cfg=cfg, kernels="fused"))(params, *step)
    reference, _ = jax.jit(partial(forward, cfg=cfg))(dense_params, *step)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(reference), rtol=0, atol=1e-4 * np.abs(reference).max())


def test_tensors_whose_layers_mix_types_load_exact_and_the_fused_path_runs_them(tmp_path):
    """Q4_K_M gives some layers' V and down projections more bits (Q6_K) than others' (Q4_K): such a stack
    becomes K_MIX, every value exact; a mix outside the K-quants (Q8_0 beside Q4_0) arrives as exact float32
    values, and the load says so where bf16 would round them. The fused path runs both (Q and K in Q4_K, V in
    K_MIX: three projections; O dense), and agrees with the reference."""
    from lithos.checkpoint import gguf_file

    path = tmp_path / "tiny-mixed.gguf"
    types = {f"blk.{i}.{name}": "Q4_K" for i in range(2) for name in ("attn_q.weight", "attn_k.weight")}
    mixed = {
        "attn_v.weight": ("Q6_K", "Q4_K"),
        "ffn_down.weight": ("Q6_K", "Q5_K"),
        "attn_output.weight": ("Q8_0", "Q4_0"),
    }
    types.update({f"blk.{i}.{name}": kinds[i] for name, kinds in mixed.items() for i in range(2)})
    expected = _write_k_quant_gguf(path, types, layers=2)
    cfg, flat, _, unpacked = gguf_file.load(path)
    assert unpacked == {"Q4_0/Q8_0 mixed across layers": 1}
    assert flat["layers.wv"].format == flat["layers.w_down"].format == quant.K_MIX
    assert not quant.is_quantized(flat["layers.wo"])
    for name, gguf_name in (
        ("layers.wv", "attn_v.weight"),
        ("layers.w_down", "ffn_down.weight"),
        ("layers.wo", "attn_output.weight"),
    ):
        values = np.asarray(quant.dequantize(flat[name])) if quant.is_quantized(flat[name]) else flat[name]
        for i in range(2):
            np.testing.assert_array_equal(values[i], expected[f"blk.{i}.{gguf_name}"], err_msg=f"{name} {i}")
    with pytest.warns(UserWarning, match=r"\(1 Q4_0/Q8_0 mixed across layers\).*dtype='float32'"):
        params = load_checkpoint(path, dtype="bfloat16", use_cache=False).params
    assert params.layers.wo.dtype == jnp.bfloat16 and params.layers.wv.format == quant.K_MIX
    forward = family_of(cfg).forward
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 16, cfg.head_dim, jnp.bfloat16)
    n = len(TOKENS[0])
    _, cache = jax.jit(partial(forward, cfg=cfg))(params, jnp.asarray(TOKENS), jnp.arange(n)[None], cache)
    step = (jnp.asarray([[9]]), jnp.asarray([[n]]), cache)
    fused, _ = jax.jit(partial(forward, cfg=cfg, kernels="fused"))(params, *step)
    reference, _ = jax.jit(partial(forward, cfg=cfg))(params, *step)
    fused, reference = np.asarray(fused, np.float32), np.asarray(reference, np.float32)
    np.testing.assert_allclose(fused, reference, rtol=0, atol=0.02 * np.abs(reference).max())


def test_a_k_quant_gguf_loads_exact_in_float32_and_warns_where_its_dtype_rounds(tmp_path, monkeypatch):
    """Types without a packed layout (IQ2_XXS) arrive dequantized; stored as bf16 their values round, and the
    load says so and names the fix, again when the converted copy is loaded; stored as float32 they are
    exact and nothing is said."""
    import warnings

    from lithos.checkpoint import gguf_file, load_checkpoint

    path = tmp_path / "tiny-iq2_xxs.gguf"
    expected = _write_k_quant_gguf(path, {"blk.0.ffn_up.weight": "IQ2_XXS"}, d=0.002)["blk.0.ffn_up.weight"]
    _, flat, _, unpacked = gguf_file.load(path)
    assert unpacked == {"IQ2_XXS": 1}
    np.testing.assert_array_equal(flat["layers.w_up"][0], expected)
    assert not np.array_equal(expected.astype(ml_dtypes.bfloat16).astype(np.float32), expected)
    monkeypatch.setenv("LITHOS_CACHE", str(tmp_path / "cache"))
    for source in ("the GGUF", "its converted copy"):
        with pytest.warns(UserWarning, match=r"\(1 IQ2_XXS\).*stored as bfloat16.*dtype='float32'"):
            assert load_checkpoint(path, dtype="bfloat16").restored == (source == "its converted copy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact = load_checkpoint(path, dtype="float32", use_cache=False)
    np.testing.assert_array_equal(np.asarray(exact.params.layers.w_up[0]), expected)


def test_q3_k_q2_k_iq4_xs_ternary_and_iq3_s_load_packed_exactly(tmp_path):
    """Q3_K (its scales unpacked to bytes), Q2_K and IQ4_XS stay packed, TQ1_0 and TQ2_0 become Q2_K and IQ3_S Q6_K,
    every value gguf's; a stack whose layers mix them with other K-quants (Q3_K_M's V and down beside Q4_K and Q5_K)
    is K_MIX. A Q3_K layer with a d that K_MIX cannot hold (2^14: its B = -4 d overflows f16) beside a Q4_K one
    arrives as exact float32, counted as unpacked; the reference path over the packed load gives the dense load's
    logits."""
    from lithos.checkpoint import gguf_file

    path = tmp_path / "tiny-q3_k_m.gguf"
    kinds = {
        "attn_q.weight": ("Q3_K", "Q3_K"),
        "attn_k.weight": ("Q2_K", "Q2_K"),
        "attn_v.weight": ("IQ3_S", "Q5_K"),
        "ffn_down.weight": ("Q4_K", "Q3_K"),
        "ffn_up.weight": ("Q3_K", "Q4_K"),
        "attn_output.weight": ("IQ4_XS", "IQ4_XS"),
        "ffn_gate.weight": ("TQ1_0", "TQ2_0"),
    }
    types = {f"blk.{i}.{name}": pair[i] for name, pair in kinds.items() for i in range(2)}
    _write_k_quant_gguf(path, types, layers=2, large_d="blk.0.ffn_up.weight")
    cfg, flat, _, unpacked = gguf_file.load(path)
    _, dense, _, _ = gguf_file.load(path, dequantize=True)  # gguf's values, Q and K rows un-permuted
    assert unpacked == {"Q3_K/Q4_K mixed across layers": 1}
    assert flat["layers.wq"].format == quant.Q3_K and flat["layers.wk"].format == quant.Q2_K
    assert flat["layers.wo"].format == quant.IQ4_XS and flat["layers.w_gate"].format == quant.Q2_K
    for name in ("layers.wv", "layers.w_down"):
        assert flat[name].format == quant.K_MIX, name
    assert not quant.is_quantized(flat["layers.w_up"])
    for name, w in flat.items():
        values = np.asarray(jax.jit(quant.dequantize)(w)) if quant.is_quantized(w) else w
        np.testing.assert_array_equal(values, dense[name], err_msg=name)  # -0 == +0
    params = load_checkpoint(path, dtype="float32", use_cache=False).params
    dense_params = load_checkpoint(path, dtype="float32", use_cache=False, dequantize=True).params
    assert params.layers.wq.format == quant.Q3_K
    want = logits_of(dense_params, cfg)
    np.testing.assert_allclose(logits_of(params, cfg), want, rtol=0, atol=1e-5 * np.abs(want).max())
