"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b).

A decoder of grouped-query attention and routed experts:
- attention with biases on Q/K/V/O and a learned per-head sink logit that joins every softmax;
  layers alternate a 128-token sliding window and full attention (`layer_types`);
- YaRN RoPE (theta 150000, factor 32 over 4096 original positions), whose attention factor scales
  cos and sin;
- each MLP is a router (top-k of the logits, then a softmax over those k) and experts whose gate/up
  projection has interleaved rows (gate = even) and a clamped SwiGLU (alpha 1.702, limit 7.0), with
  biases on both projections;
- the experts ship as MXFP4 (`*_blocks` / `*_scales`) and stay packed (lithos.quant); attention,
  router, embeddings and LM head are bf16.

Order of this file: config, parameters, forward. The MoE pieces are lithos.models.moe; attention
and the head are the llama family's, with sinks and a per-layer window passed in.

Kernel paths: "reference" (jax.numpy) and "fused", which reads the routed experts with the
`expert_matvec` kernel and runs the LM head + argmax kernel; attention stays on jax.numpy there,
since the fused attention kernels have no sinks or biases yet.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lithos.errors import UnsupportedModelError
from lithos.kv_cache import KVCache, append
from lithos.models import llama, moe

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

ARCHITECTURES = ("GptOssForCausalLM",)
GGUF_ARCHITECTURES = {"gpt-oss": "GptOssForCausalLM"}
LAYER_TYPES = ("sliding_attention", "full_attention")
FULL_ATTENTION = np.iinfo(np.int32).max  # the window of a full-attention layer: nothing falls out of it


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN frequency scaling (the only kind GPT-OSS uses), with transformers' parameter names."""

    kind: str
    factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = True
    attention_factor: float | None = None


@dataclasses.dataclass(frozen=True)
class Config(llama.AttentionBias):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's FFN width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    experts_per_token: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None = 128  # of the "sliding_attention" layers
    rope_scaling: RopeScaling | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):  # lists from JSON (converted checkpoints) must become tuples: configs are jit-static
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def family(self) -> str:
        return "gpt_oss"

    @property
    def qk_norm(self) -> bool:
        return False

    def describe(self) -> str:
        return (
            f"{self.architecture}: {self.num_layers} layers, hidden {self.hidden_size}, "
            f"{self.num_heads}/{self.num_kv_heads} heads of {self.head_dim}, {self.num_experts} experts "
            f"(top {self.experts_per_token}) of ffn {self.intermediate_size}, window {self.sliding_window} on "
            f"{self.layer_types.count('sliding_attention')} layers, vocab {self.vocab_size}"
            f"{' (tied)' if self.tie_word_embeddings else ''}"
        )


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Theta and YaRN scaling from `rope_theta` + `rope_scaling` (checkpoints) or `rope_parameters`
    (transformers 5)."""
    spec = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    theta = float(spec.get("rope_theta", d.get("rope_theta", 150000.0)))
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise UnsupportedModelError(f"GPT-OSS with RoPE scaling {kind!r} is not supported (supported: yarn, default)")
    return theta, RopeScaling(
        kind="yarn",
        factor=float(spec["factor"]),
        beta_fast=float(spec.get("beta_fast") or 32.0),
        beta_slow=float(spec.get("beta_slow") or 1.0),
        original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        truncate=bool(spec.get("truncate", True)),
        attention_factor=None if spec.get("attention_factor") is None else float(spec["attention_factor"]),
    )


def config_from_hf(d: dict[str, Any]) -> Config:
    """Build a Config from a GPT-OSS `config.json` dict."""
    arch = (d.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} is not GPT-OSS (supported: {', '.join(ARCHITECTURES)})")
    layers = int(d["num_hidden_layers"])
    layer_types = tuple(d.get("layer_types") or ("sliding_attention", "full_attention") * ((layers + 1) // 2))[:layers]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown or len(layer_types) != layers:
        raise UnsupportedModelError(
            f"layer_types must name {layers} layers, each one of {LAYER_TYPES}; got {list(layer_types)}: "
            "fix config.json"
        )
    theta, scaling = _rope_from_hf(d)
    heads = int(d["num_attention_heads"])
    eos = d.get("eos_token_id")
    return Config(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
        num_experts=int(d.get("num_local_experts") or d["num_experts"]),
        experts_per_token=int(d.get("num_experts_per_tok") or d["experts_per_token"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        layer_types=layer_types,
        sliding_window=int(d["sliding_window"]) if d.get("sliding_window") else None,
        rope_scaling=scaling,
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
        attention_bias=bool(d.get("attention_bias", True)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> Config:
    """Build a Config from a `gpt-oss` GGUF's metadata (llama.cpp's keys). What the file does not say comes from
    GPT-OSS's released config: sliding and full attention alternating from layer 0, YaRN's betas 32 and 1 without
    truncating its correction range, the clamped SwiGLU's 1.702 and 7."""
    fields = llama.gguf_fields(meta, tensor_names, GGUF_ARCHITECTURES)
    a = meta["general.architecture"]

    def key(name, default=None):
        return meta.get(f"{a}.{name}", default)

    scaling = None
    kind = key("rope.scaling.type")
    if kind == "yarn":
        scaling = RopeScaling(
            kind="yarn",
            factor=float(key("rope.scaling.factor")),
            original_max_position_embeddings=int(key("rope.scaling.original_context_length", 4096)),
            truncate=False,
        )
        if key("rope.scaling.attn_factor") not in (None, 1.0):  # llama.cpp's factor on YaRN's own: not HF's meaning
            raise UnsupportedModelError("GPT-OSS GGUF with rope.scaling.attn_factor other than 1 is not supported")
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"GPT-OSS with GGUF RoPE scaling {kind!r} is not supported (supported: yarn)")
    if not key("expert_count") or not key("expert_used_count"):
        raise UnsupportedModelError(f"this {a} GGUF names no experts (expert_count, expert_used_count): incomplete")
    window = key("attention.sliding_window")
    layers = fields["num_layers"]
    return Config(
        **{**fields, "intermediate_size": int(key("expert_feed_forward_length", fields["intermediate_size"]))},
        num_experts=int(key("expert_count")),
        experts_per_token=int(key("expert_used_count")),
        layer_types=(LAYER_TYPES * ((layers + 1) // 2))[:layers],
        sliding_window=int(window) if window else None,
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@struct.dataclass
class LayerParams:
    """Attention and norms of every layer, stacked `[layers, ...]`; matrices `[out, in]`. The field
    names are llama's, so `llama.attention_block` reads them."""

    attn_norm: jax.Array  # [L, hidden]
    wq: jax.Array  # [L, heads*head_dim, hidden]
    wk: jax.Array  # [L, kv_heads*head_dim, hidden]
    wv: jax.Array  # [L, kv_heads*head_dim, hidden]
    wo: jax.Array  # [L, hidden, heads*head_dim]
    sinks: jax.Array  # [L, heads]
    mlp_norm: jax.Array  # [L, hidden]
    bq: jax.Array | None = None  # [L, heads*head_dim]
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    bo: jax.Array | None = None  # [L, hidden]


@struct.dataclass
class Params:
    embed: jax.Array  # [vocab, hidden]
    layers: LayerParams
    experts: moe.Experts  # every layer is a MoE layer: stacked [layers, experts, ...]
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None = None  # [vocab, hidden]; None when tied


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter, keyed by its field path (`layers.wq`, `experts.gate_up`)."""
    L, D = cfg.num_layers, cfg.hidden_size
    shapes = llama.attention_param_shapes(cfg) | {"layers.sinks": (L, cfg.num_heads)}
    return shapes | moe.expert_shapes(L, cfg.num_experts, D, cfg.intermediate_size, biases=True)


PARAM_AXES: dict[str, tuple[str, ...]] = {
    **{name: llama.PARAM_AXES[name] for name in ("embed", "lm_head", "final_norm")},
    **{f"layers.{f}": llama.PARAM_AXES[f"layers.{f}"] for f in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm")},
    **{f"layers.{f}": llama.PARAM_AXES[f"layers.{f}"] for f in ("bq", "bk", "bv", "bo")},
    "layers.sinks": ("layers", "heads"),
    **moe.EXPERT_AXES,
}
CACHE_AXES = llama.CACHE_AXES


def params_from_flat(flat: dict[str, Any]) -> Params:
    """Assemble Params from `{"layers.wq": array, "experts.gate_up": ..., ...}` (`param_shapes` keys)."""

    def group(prefix: str) -> dict[str, Any]:
        return {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(prefix + ".")}

    return Params(
        embed=flat["embed"],
        layers=LayerParams(**group("layers")),
        experts=moe.Experts(**group("experts")),
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )


def init_params(cfg: Config, key: jax.Array, dtype=jnp.bfloat16, experts: str | None = "mxfp4") -> Params:
    """Random weights of the right shapes and scale (for benchmarks and tests): experts as MXFP4, as
    GPT-OSS ships them (`experts=None` for dense `dtype`), everything else dense."""
    return params_from_flat(moe.init_flat(key, param_shapes(cfg), dtype, packed=experts))


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------

KERNEL_PATHS = ("reference", "fused")


def check_kernel_path(kernels: str, cfg: Config | None = None) -> None:
    if kernels not in KERNEL_PATHS:
        raise UnsupportedModelError(f"kernel path {kernels!r} is not available; choose one of {KERNEL_PATHS}")


def rope_inv_freq(cfg: Config) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[head_dim/2]` and the attention factor that scales cos and sin, as
    transformers computes YaRN (`_compute_yarn_parameters`), in float32."""
    d = cfg.head_dim
    pos_freqs = (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    attention_factor = (
        s.attention_factor
        if s.attention_factor is not None
        else (0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)
    )

    def correction_dim(rotations: float) -> float:
        return (d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(cfg.rope_theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers does, to avoid a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp  # 1 keeps a dimension's original frequency, 0 interpolates it by `factor`
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def layer_windows(cfg: Config) -> np.ndarray:
    """Each layer's attention window `[layers]` int32 (FULL_ATTENTION where none)."""
    return np.array(
        [
            cfg.sliding_window if t == "sliding_attention" and cfg.sliding_window else FULL_ATTENTION
            for t in cfg.layer_types
        ],
        np.int32,
    )


def cache_window(cfg: Config) -> None:
    """None: the full-attention layers read the whole context, so the KV cache stays linear (max_len slots
    for every layer, lithos.kv_cache). Splitting it into a ring for the sliding layers and a linear part
    for the others is a later step."""
    return None


def _decoder(params: Params, tokens, positions, cache: KVCache, cfg: Config, kernels: str):
    """The decoder layers: `(h [B, T, hidden], cache, expert ids [layers, B*T, top_k])`."""
    check_kernel_path(kernels, cfg)
    if kernels == "fused" and tokens.shape[0] != 1:
        raise UnsupportedModelError(
            f"the fused path decodes one sequence, got a batch of {tokens.shape[0]}: use kernels='reference'"
        )
    inv_freq, rope_scale = rope_inv_freq(cfg)
    eps = cfg.rms_norm_eps
    routing = moe.Routing(cfg.experts_per_token, softmax_first=False)
    activation = partial(moe.clamped_swiglu_interleaved, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)

    def layer(h, xs):
        p, kv, window, i = xs  # kv: this layer's cache (an FP8 one carries its scales)
        x = llama.rms_norm(h, p.attn_norm, eps)
        scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
        attn, new_kv = llama.attention_block(
            cfg, inv_freq, positions, x, p, kv.k, kv.v, rope_scale=rope_scale, sinks=p.sinks, window=window, **scales
        )
        h = h + attn
        y, expert_ids = moe.moe_mlp(llama.rms_norm(h, p.mlp_norm, eps), params.experts, i, routing, activation, kernels)
        return h + y, (new_kv, expert_ids)

    xs = (params.layers, cache, jnp.asarray(layer_windows(cfg)), jnp.arange(cfg.num_layers))
    h, ((k_new, v_new), expert_ids) = jax.lax.scan(layer, params.embed[tokens], xs)
    # The layers only read the cache; every layer's new entries are stored in one scatter afterwards.
    return h, append(cache, positions, k_new, v_new), expert_ids


decoder, routed_experts, hidden_states, forward, forward_argmax = moe.family_functions(_decoder)
lm_logits = llama.lm_logits


# --------------------------------------------------------------------------------------------
# What a decode step reads (lithos bench's floor)
# --------------------------------------------------------------------------------------------


def unread_weight_bytes(params: Params, cfg: Config) -> int:
    """Bytes of weights a one-token step does not read: all experts but the top-k of each layer."""
    return moe.unread_expert_bytes(params.experts, cfg.experts_per_token)


def kv_positions_read(cfg: Config, context: int) -> int:
    """Cache positions a one-token step at `context` reads, summed over layers (sliding layers read
    at most their window)."""
    return int(sum(min(context, int(w)) for w in layer_windows(cfg)))
