"""SmolLM2-135M-Instruct requantized as llama.cpp's Q4_K_M files hold small models, against transformers loading
the same file (which dequantizes it with gguf, as lithos's reference does): the 1536-wide down projections in
Q4_K, and in Q6_K in every other layer (Q4_K_M gives some layers more bits), the 576-wide matrices in the formats
llama.cpp falls back to where a row is not whole super-blocks (Q5_0, and Q5_1 for V), the Q8_0 embedding as
shipped. lithos keeps them all packed: the down projections as K_MIX."""

from __future__ import annotations

import numpy as np
import pytest

from lithos import quant

from .conftest import require
from .test_smollm2 import assert_prompt_logits_match

QUESTION = "What is the capital of France?"
# The GGUF type each layer matrix is requantized to (the rest is copied as shipped); the down projections of
# even layers in Q6_K.
REQUANTIZED = {
    "ffn_down.weight": "Q4_K",
    "attn_v.weight": "Q5_1",
    "attn_q.weight": "Q5_0",
    "attn_k.weight": "Q5_0",
    "attn_output.weight": "Q5_0",
    "ffn_gate.weight": "Q5_0",
    "ffn_up.weight": "Q5_0",
}


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """f32 `[rows, cols]` -> Q4_K super-blocks u8 `[rows, cols / 256 * 144]`: each sub-block of 32 min-max scaled to
    4 bits, its scale and min in 6 bits of the super-block's f16 d and dmin (gguf has no K-quant quantizer)."""
    rows, cols = x.shape
    sub = x.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / 15
    d, dmin = (scale.max(-1) / 63).astype(np.float16), ((-low).max(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.round(scale / d32), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32 > 0, np.round(-low / dmin32), 0).clip(0, 63).astype(np.uint8)
        step, offset = (d32 * sc)[..., None], (dmin32 * m)[..., None]
        q = np.where(step > 0, np.round((sub + offset) / step), 0).clip(0, 15).astype(np.uint8)
    # llama.cpp's get_scale_min_k4 packing: sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and 4..7 (mins),
    # 4..7 in the nibbles of bytes 8..11 with their top 2 bits in the top bits of bytes 0..7.
    scales = np.concatenate(
        [
            sc[..., :4] | (sc[..., 4:] >> 4 << 6),
            m[..., :4] | (m[..., 4:] >> 4 << 6),
            (sc[..., 4:] & 15) | (m[..., 4:] << 4),
        ],
        axis=-1,
    )
    codes = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(rows, cols // 256, 128)  # runs of 32: 2 sub-blocks
    factors = np.stack([d, dmin], axis=-1).view(np.uint8)
    return np.concatenate([factors, scales, codes], axis=-1).reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """f32 `[rows, cols]` -> Q6_K super-blocks u8 `[rows, cols / 256 * 210]`: each run of 16 scaled to 6 bits by
    its int8 scale of the super-block's f16 d."""
    rows, cols = x.shape
    runs = x.reshape(rows, cols // 256, 16, 16).astype(np.float32)
    scale = np.abs(runs).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.round(scale / d32), 0).clip(-128, 127).astype(np.int8)
        step = (d32 * sc)[..., None]
        q = (np.where(step != 0, np.round(runs / step), 0) + 32).clip(0, 63).astype(np.uint8)
    # Per half of 128: ql byte l holds elements l (low nibble) and 64 + l (high); qh byte l the high 2 bits of
    # elements 32s + l at bits 2s.
    low, high = (q.reshape(rows, cols // 256, 2, 128) & 15), (q.reshape(rows, cols // 256, 2, 128) >> 4)
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(rows, -1, 128)
    qh = (high[..., 0:32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:] << 6)).reshape(
        rows, -1, 64
    )
    d_bytes = d.reshape(rows, -1, 1).view(np.uint8)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=-1).reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_the_quantizers_write_what_gguf_reads(kind):
    gguf = require("gguf")
    x = (np.random.default_rng(0).standard_normal((64, 1536)) * 0.05).astype(np.float32)
    quantizer = quantize_q4_k if kind == "Q4_K" else quantize_q6_k
    values = gguf.quants.dequantize(quantizer(x), gguf.GGMLQuantizationType[kind])
    levels = 15 if kind == "Q4_K" else 31
    assert np.abs(values - x).max() <= np.abs(x).max() / levels  # a step, at most: rounding and the scales' own


@pytest.fixture(scope="module")
def k_quant_gguf(smollm2_gguf, tmp_path_factory):
    """SmolLM2's GGUF with its layer matrices requantized as REQUANTIZED says, its metadata as shipped."""
    gguf = require("gguf")
    reader = gguf.GGUFReader(str(smollm2_gguf))
    path = tmp_path_factory.mktemp("k_quants") / "SmolLM2-135M-Instruct.K-quants.gguf"
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        kind = REQUANTIZED.get(t.name.split(".", 2)[-1]) if t.name.startswith("blk.") else None
        if kind is None:  # as shipped: the F32 norms, the Q8_0 embedding's blocks
            writer.add_tensor(t.name, t.data, raw_dtype=None if t.data.dtype == np.float32 else t.tensor_type)
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        if kind == "Q4_K" and int(t.name.split(".")[1]) % 2 == 0:
            kind = "Q6_K"
        qtype = gguf.GGMLQuantizationType[kind]
        quantizers = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
        blocks = quantizers[kind](values) if kind in quantizers else gguf.quants.quantize(values, qtype)
        writer.add_tensor(t.name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def k_quant_models(k_quant_gguf):
    """(lithos model, transformers model) of the requantized file, both float32."""
    import lithos

    transformers = require("transformers")
    torch = require("torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        k_quant_gguf.parent, gguf_file=k_quant_gguf.name, dtype=torch.float32
    )
    return lithos.load(k_quant_gguf, dtype="float32", max_len=512), hf.eval()


@pytest.mark.slow
def test_k_quant_smollm2_stays_packed_and_matches_transformers(k_quant_models):
    torch = require("torch")
    model, hf = k_quant_models
    layers = model.params.layers
    assert (layers.w_down.format, layers.wv.format, layers.wq.format) == (quant.K_MIX, quant.Q5_1, quant.Q5_0)
    assert model.params.embed.format == quant.Q8_0
    ids = model.prompt_ids(QUESTION)
    assert_prompt_logits_match(model, hf, ids)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert model.generate(QUESTION, max_new_tokens=16).token_ids == out[0, len(ids) :].tolist()
