"""Hugging Face mixture-of-experts checkpoints -> lithos flat parameters (`experts.gate_up`, ...).

GPT-OSS, per layer `model.layers.{i}.`:
    self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks, input/post_attention_layernorm.weight
    mlp.router.{weight,bias}                       [E, hidden], [E]
    mlp.experts.gate_up_proj_{blocks,scales}       MXFP4 [E, 2*ffn, hidden/32, 16] + [E, 2*ffn, hidden/32]
    mlp.experts.down_proj_{blocks,scales}          MXFP4 [E, hidden, ffn/32, 16] + [E, hidden, ffn/32]
    mlp.experts.{gate_up,down}_proj_bias           [E, 2*ffn], [E, hidden]
  The MXFP4 pairs are already `[out, in]` and stay packed. A dequantised copy (what transformers'
  `save_pretrained` writes for a bf16 model) stores `mlp.experts.gate_up_proj` dense as
  `[E, hidden, 2*ffn]` (`[in, out]`), so those are transposed; which one a tensor was is told by its
  name in the file (`_blocks`), never by its shape (hidden == ffn in the real models).

Qwen3-MoE, per layer (Qwen2-MoE's the same, with mlp.shared_expert.{gate,up,down}_proj.weight and
mlp.shared_expert_gate.weight in its MoE layers; Mixtral's the same under other names: block_sparse_moe.gate,
experts.{j}.w1/w3/w2 for gate/up/down; every layer routed):
    self_attn.* as Qwen3, mlp.gate.weight (router) [E, hidden]
    mlp.experts.{j}.{gate,up,down}_proj.weight     per expert (or transformers 5's fused
                                                   mlp.experts.gate_up_proj [E, 2*ffn, hidden], down_proj)
    mlp.{gate,up,down}_proj.weight                 dense layers (mlp_only_layers, decoder_sparse_step)
  Each expert's gate and up rows are joined into one `[2*ffn, hidden]` matrix (gate first), so one
  gathered matvec computes both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from lithos.checkpoint.safetensors_dir import GLOBAL_NAMES, LAYER_NAMES
from lithos.errors import CheckpointError
from lithos.quant.layouts import join_rows, stack

ATTENTION_NAMES = {
    hf: name
    for hf, name in LAYER_NAMES.items()
    if hf.startswith(("self_attn.", "input_layernorm.", "post_attention_layernorm."))
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _by_layer(tensors: dict[str, Any], cfg, path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Global parameters (already under their lithos names) and each layer's tensors by HF suffix."""
    flat: dict[str, Any] = {}
    layers: list[dict[str, Any]] = [{} for _ in range(cfg.num_layers)]
    for name, value in tensors.items():
        if name in GLOBAL_NAMES:
            flat[GLOBAL_NAMES[name]] = value
            continue
        m = _LAYER_RE.fullmatch(name)
        if m:
            i = int(m.group(1))
            if i >= cfg.num_layers:
                raise CheckpointError(f"{name} is past num_hidden_layers={cfg.num_layers} in config.json")
            layers[i][m.group(2)] = value
        elif not name.endswith("rotary_emb.inv_freq"):  # old checkpoints store RoPE frequencies
            raise CheckpointError(
                f"unexpected tensor {name!r} in {path}: this checkpoint is not a plain {cfg.architecture}"
            )
    if cfg.tie_word_embeddings:
        flat.pop("lm_head", None)
    return flat, layers


def _stack_layers(flat: dict[str, Any], per_name: dict[str, dict[int, Any]], layer_ids, path: Path) -> None:
    """Stack each parameter over `layer_ids` (in order) into `flat`, naming the layers that lack it."""
    for name, values in per_name.items():
        missing = [i for i in layer_ids if i not in values]
        if missing:
            raise CheckpointError(f"{path} lacks {name} for layers {missing}: the checkpoint is incomplete")
        flat[name] = stack([values[i] for i in layer_ids])


def _unexpected(i: int, suffix: str, path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"unexpected tensor model.layers.{i}.{suffix} in {path} ({what}): config.json and weights disagree"
    )


# --------------------------------------------------------------------------------------------
# GPT-OSS
# --------------------------------------------------------------------------------------------

GPT_OSS_NAMES = ATTENTION_NAMES | {
    "self_attn.sinks": "layers.sinks",
    "mlp.router.weight": "experts.router",
    "mlp.router.bias": "experts.router_bias",
    "mlp.experts.gate_up_proj": "experts.gate_up",
    "mlp.experts.gate_up_proj_bias": "experts.gate_up_bias",
    "mlp.experts.down_proj": "experts.down",
    "mlp.experts.down_proj_bias": "experts.down_bias",
}
_GPT_OSS_PROJECTIONS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def gpt_oss(tensors: dict[str, Any], cfg, path: Path, mxfp4_names: set[str]) -> dict[str, Any]:
    """Flat GPT-OSS params from a checkpoint's tensors (MXFP4 pairs already merged under their base
    name; `mxfp4_names` are the names that were stored as `_blocks`/`_scales`)."""
    flat, layers = _by_layer(tensors, cfg, path)
    per_name: dict[str, dict[int, Any]] = {}
    for i, layer in enumerate(layers):
        for suffix, value in layer.items():
            if suffix not in GPT_OSS_NAMES:
                raise _unexpected(i, suffix, path, "not a GPT-OSS weight")
            if suffix in _GPT_OSS_PROJECTIONS and f"model.layers.{i}.{suffix}" not in mxfp4_names:
                value = np.swapaxes(value, -1, -2)  # dense experts are stored [E, in, out]
            per_name.setdefault(GPT_OSS_NAMES[suffix], {})[i] = value
    _stack_layers(flat, per_name, range(cfg.num_layers), path)
    return flat


# --------------------------------------------------------------------------------------------
# Qwen3-MoE
# --------------------------------------------------------------------------------------------

QWEN3_MOE_NAMES = ATTENTION_NAMES | {"mlp.gate.weight": "experts.router"}
QWEN3_DENSE_NAMES = {
    "mlp.gate_proj.weight": "dense.w_gate",
    "mlp.up_proj.weight": "dense.w_up",
    "mlp.down_proj.weight": "dense.w_down",
}
# Qwen2-MoE's MoE layers also hold a shared expert and its sigmoid gate (`[1, hidden]`, stored as `[hidden]`).
QWEN2_SHARED_NAMES = {
    "mlp.shared_expert.gate_proj.weight": "shared.w_gate",
    "mlp.shared_expert.up_proj.weight": "shared.w_up",
    "mlp.shared_expert.down_proj.weight": "shared.w_down",
    "mlp.shared_expert_gate.weight": "shared.gate",
}


def _qwen3_experts(i: int, layer: dict[str, Any], cfg, path: Path) -> tuple[Any, Any]:
    """One MoE layer's `(gate_up [E, 2*ffn, hidden], down [E, hidden, ffn])` from per-expert or fused tensors."""
    if "mlp.experts.gate_up_proj" in layer:  # transformers 5's fused layout, already [E, out, in]
        return layer.pop("mlp.experts.gate_up_proj"), layer.pop("mlp.experts.down_proj")
    parts: dict[str, dict[int, Any]] = {"gate_proj": {}, "up_proj": {}, "down_proj": {}}
    for suffix in [s for s in layer if s.startswith("mlp.experts.")]:
        m = _EXPERT_RE.fullmatch(suffix)
        if not m:
            raise _unexpected(i, suffix, path, "not a Qwen3-MoE expert weight")
        parts[m.group(2)][int(m.group(1))] = layer.pop(suffix)
    for proj, experts in parts.items():
        missing = [j for j in range(cfg.num_experts) if j not in experts]
        if missing:
            raise CheckpointError(
                f"{path} lacks mlp.experts.{{j}}.{proj}.weight of layer {i} for experts {missing}: "
                "the checkpoint is incomplete"
            )
    E = range(cfg.num_experts)
    gate_up = stack([join_rows(parts["gate_proj"][j], parts["up_proj"][j]) for j in E])
    return gate_up, stack([parts["down_proj"][j] for j in E])


def qwen3_moe(tensors: dict[str, Any], cfg, path: Path, mxfp4_names: set[str]) -> dict[str, Any]:
    """Flat Qwen3-MoE (and Qwen2-MoE) params: attention stacked over all layers, experts (and shared experts) over
    the MoE layers, dense MLPs over the others."""
    flat, layers = _by_layer(tensors, cfg, path)
    per_name: dict[str, dict[int, Any]] = {}
    moe_layers = set(cfg.moe_layers)
    moe_names = QWEN3_MOE_NAMES | (QWEN2_SHARED_NAMES if cfg.shared_expert_ffn else {})
    for i, layer in enumerate(layers):
        layer = dict(layer)
        if i in moe_layers and any(s.startswith("mlp.experts.") for s in layer):
            gate_up, down = _qwen3_experts(i, layer, cfg, path)
            per_name.setdefault("experts.gate_up", {})[i] = gate_up
            per_name.setdefault("experts.down", {})[i] = down
        names = ATTENTION_NAMES | (moe_names if i in moe_layers else QWEN3_DENSE_NAMES)
        for suffix, value in layer.items():
            if suffix not in names:
                kind = "a MoE layer" if i in moe_layers else "a dense layer (mlp_only_layers / decoder_sparse_step)"
                raise _unexpected(i, suffix, path, f"layer {i} is {kind}")
            per_name.setdefault(names[suffix], {})[i] = value.reshape(-1) if names[suffix] == "shared.gate" else value
    for name, values in per_name.items():
        layer_ids = (
            cfg.moe_layers
            if name.startswith(("experts.", "shared."))
            else (cfg.dense_layers if name.startswith("dense.") else range(cfg.num_layers))
        )
        _stack_layers(flat, {name: values}, list(layer_ids), path)
    return flat


# Mixtral's names for what Qwen3-MoE's layers hold: its router and each expert's w1 (gate), w3 (up) and w2 (down).
_MIXTRAL_RE = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.\d+\.)(w1|w2|w3)?(\.weight)?")
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def mixtral(tensors: dict[str, Any], cfg, path: Path, mxfp4_names: set[str]) -> dict[str, Any]:
    """Flat Mixtral params: its tensors under Qwen3-MoE's names (every layer routed), then as Qwen3-MoE's."""

    def renamed(name: str) -> str:
        m = _MIXTRAL_RE.fullmatch(name)
        if not m:
            return name
        layer, what, proj, _ = m.groups()
        return f"{layer}mlp.{what}" if proj is None else f"{layer}mlp.{what}{_MIXTRAL_PROJECTIONS[proj]}.weight"

    return qwen3_moe({renamed(n): v for n, v in tensors.items()}, cfg, path, mxfp4_names)


CONVERTERS = {
    "GptOssForCausalLM": gpt_oss,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "Qwen2MoeForCausalLM": qwen3_moe,
    "MixtralForCausalLM": mixtral,
}
