"""Hugging Face checkpoints: a directory with `config.json` and one or many `.safetensors` files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from lithos.errors import CheckpointError
from lithos.models import family_for_architecture
from lithos.quant import dequantize as dequantize_packed
from lithos.quant import from_fp8_block_scaled, from_gpt_oss_mxfp4
from lithos.quant.layouts import split_rows, stack

# HF tensor name inside `model.layers.{i}.` -> lithos flat parameter name.
LAYER_NAMES = {
    "input_layernorm.weight": "layers.attn_norm",
    "self_attn.q_proj.weight": "layers.wq",
    "self_attn.k_proj.weight": "layers.wk",
    "self_attn.v_proj.weight": "layers.wv",
    "self_attn.o_proj.weight": "layers.wo",
    "self_attn.q_proj.bias": "layers.bq",
    "self_attn.k_proj.bias": "layers.bk",
    "self_attn.v_proj.bias": "layers.bv",
    "self_attn.o_proj.bias": "layers.bo",
    "self_attn.q_norm.weight": "layers.q_norm",
    "self_attn.k_norm.weight": "layers.k_norm",
    "post_attention_layernorm.weight": "layers.mlp_norm",
    "mlp.gate_proj.weight": "layers.w_gate",
    "mlp.up_proj.weight": "layers.w_up",
    "mlp.down_proj.weight": "layers.w_down",
    "mlp.gate_proj.bias": "layers.b_gate",
    "mlp.up_proj.bias": "layers.b_up",
    "mlp.down_proj.bias": "layers.b_down",
}
# Fused projections (Phi-3's) -> the parts LAYER_NAMES names, cut by rows (FUSED_PARTS gives each part's rows).
FUSED_LAYER_NAMES = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def fused_parts(cfg, fused: str) -> tuple[int, ...]:
    """The rows of each part of a fused projection (FUSED_LAYER_NAMES) for `cfg`'s sizes."""
    if fused.startswith("self_attn."):
        return cfg.q_size, cfg.kv_size, cfg.kv_size
    return cfg.intermediate_size, cfg.intermediate_size


GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{path} has no config.json: point --model at a Hugging Face model directory "
            "(config.json + *.safetensors), a .gguf file, or a lithos-converted directory"
        )
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON ({e}): re-download the checkpoint") from e


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt ({e}): re-download the checkpoint") from e
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path} is missing shards named in its index: {', '.join(missing)}; download them")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has a config.json but no .safetensors weights: download them")
    return files


_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
}

# Packed tensors come in pairs: FP8 block-scaled (DeepSeek-V3, Qwen3-FP8) `X.weight` + `X.weight_scale_inv`,
# MXFP4 in the GPT-OSS layout `X_blocks` + `X_scales` (for a Linear, `X` is `....weight`).
FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_SUFFIXES = ("_blocks", "_scales")


def pack_quantized(tensors: dict[str, np.ndarray], dequantize: bool = False) -> dict[str, Any]:
    """Merge each packed pair into one tensor named as the dense weight would be: a QuantizedArray, or
    its exact float32 values when `dequantize`."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if name.endswith(FP8_SCALE_SUFFIX) or name.endswith(MXFP4_SUFFIXES[1]):
            continue  # consumed with its weight below
        if name.endswith(MXFP4_SUFFIXES[0]):
            base = name[: -len(MXFP4_SUFFIXES[0])]
            scales = tensors.get(base + MXFP4_SUFFIXES[1])
            if scales is None:
                raise CheckpointError(f"{name} has no {base + MXFP4_SUFFIXES[1]}: the MXFP4 checkpoint is incomplete")
            packed = from_gpt_oss_mxfp4(value, scales)
            name = base
        elif name + FP8_SCALE_SUFFIX in tensors:
            packed = from_fp8_block_scaled(value, tensors[name + FP8_SCALE_SUFFIX])
        elif value.dtype == ml_dtypes.float8_e4m3fn:
            raise CheckpointError(
                f"{name} is FP8 without a {name + FP8_SCALE_SUFFIX}: only 128x128 block-scaled FP8 checkpoints "
                "(DeepSeek-V3 / Qwen3-FP8 layout) are supported"
            )
        else:
            out[name] = value
            continue
        out[name] = np.asarray(dequantize_packed(packed, np.float32)) if dequantize else packed
    for name in tensors:
        if name.endswith(FP8_SCALE_SUFFIX) and name[: -len(FP8_SCALE_SUFFIX)] not in tensors:
            weight = name[: -len(FP8_SCALE_SUFFIX)]
            raise CheckpointError(f"{name} has no weight {weight}: the checkpoint is incomplete")
        if name.endswith(MXFP4_SUFFIXES[1]) and name[: -len(MXFP4_SUFFIXES[1])] + MXFP4_SUFFIXES[0] not in tensors:
            raise CheckpointError(f"{name} has no matching {MXFP4_SUFFIXES[0]} tensor: the checkpoint is incomplete")
    return out


def read_safetensors(f: Path) -> dict[str, np.ndarray]:
    """Memory-map one .safetensors file; every tensor is checked against the file's real size.

    Parsed by hand (8-byte header length, JSON header, raw data) so that bf16 stays bf16 and a
    truncated download is reported as such instead of failing later inside a reshape.
    """
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} does not fit in {size} bytes")
            header = json.loads(fh.read(header_len))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is truncated or corrupt ({e}): re-download this file") from e
    data = np.memmap(f, dtype=np.uint8, mode="r", offset=8 + header_len) if size > 8 + header_len else None
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
        except KeyError as e:
            raise CheckpointError(f"{f}: tensor {name!r} has an unsupported or missing field {e}") from e
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - begin != expected or data is None or end > data.size:
            raise CheckpointError(
                f"{f} is truncated or corrupt (tensor {name!r} needs bytes {begin}..{end} "
                f"of {0 if data is None else data.size}): re-download this file"
            )
        tensors[name] = data[begin:end].view(dtype).reshape(shape)
    return tensors


def _read_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors


def _split_fused(tensors: dict[str, Any], cfg) -> dict[str, Any]:
    """`tensors` with each fused projection (FUSED_LAYER_NAMES) replaced by its parts."""
    out = {}
    for name, value in tensors.items():
        m = _LAYER_RE.fullmatch(name)
        fused = m.group(2) if m else None
        if fused not in FUSED_LAYER_NAMES:
            out[name] = value
            continue
        parts = split_rows(value, fused_parts(cfg, fused))
        out |= {f"model.layers.{m.group(1)}.{part}": w for part, w in zip(FUSED_LAYER_NAMES[fused], parts, strict=True)}
    return out


def load(path: Path, dequantize: bool = False) -> tuple[Any, dict[str, Any]]:
    """Read config and weights; returns (Config, flat params `{"layers.wq": [L, out, in], ...}`).

    FP8 block-scaled and MXFP4 weights stay packed (lithos.quant.QuantizedArray) unless `dequantize`.
    """
    hf_config = read_config(path)
    arch = (hf_config.get("architectures") or ["(none given)"])[0]
    family = family_for_architecture(arch)
    cfg = family.config_from_hf(hf_config)
    raw = _read_tensors(safetensors_files(path))
    tensors = pack_quantized(raw, dequantize)
    from lithos.checkpoint import hf_moe  # it reads this module's name tables

    if arch in hf_moe.CONVERTERS:
        mxfp4_names = {n[: -len(MXFP4_SUFFIXES[0])] for n in raw if n.endswith(MXFP4_SUFFIXES[0])}
        return cfg, hf_moe.CONVERTERS[arch](tensors, cfg, path, mxfp4_names)

    per_layer: dict[str, list] = {}
    flat: dict[str, np.ndarray] = {}
    for name, value in _split_fused(tensors, cfg).items():
        if name in GLOBAL_NAMES:
            flat[GLOBAL_NAMES[name]] = value
            continue
        m = _LAYER_RE.fullmatch(name)
        if m and m.group(2) in LAYER_NAMES:
            layers = per_layer.setdefault(LAYER_NAMES[m.group(2)], [None] * cfg.num_layers)
            i = int(m.group(1))
            if i >= cfg.num_layers:
                raise CheckpointError(f"{name} is past num_hidden_layers={cfg.num_layers} in config.json")
            layers[i] = value
        elif name.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints store RoPE frequencies; they are recomputed from the config
        else:
            raise CheckpointError(f"unexpected tensor {name!r} in {path}: this checkpoint is not a plain {arch}")
    for name, layers in per_layer.items():
        missing = [i for i, t in enumerate(layers) if t is None]
        if missing:
            raise CheckpointError(f"{path} lacks {name} for layers {missing}: the checkpoint is incomplete")
        flat[name] = stack(layers)
    if cfg.tie_word_embeddings:
        flat.pop("lm_head", None)
    return cfg, flat
