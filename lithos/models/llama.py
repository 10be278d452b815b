"""The Llama family: Llama 2/3/3.1+, Mistral, Qwen2/2.5, Qwen3 and SmolLM2.

They share one decoder: RMSNorm, grouped-query attention with rotary positions, a SiLU-gated MLP.
They differ only in switches the config carries: biases on Q/K/V (Qwen2), per-head RMSNorm on Q
and K (Qwen3), llama3 RoPE scaling (Llama 3.1+), a sliding attention window (Mistral), tied
embeddings (SmolLM2, small Llamas and Qwens).

Order of this file: config, parameters, forward.

Weights keep the checkpoint's `[out, in]` layout: a batch-1 matvec then reads each output's row
contiguously, which is what the decode kernels want.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lithos.errors import LithosError, UnsupportedModelError
from lithos.kv_cache import KVCache, append, attention_inputs, check_step_tokens, slot_positions
from lithos.quant import QuantizedArray, dequantize

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # Phi-3 and Phi-4: fused Q/K/V and gate/up projections, cut apart at load
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "llama3" or "linear"."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class HeadSizes:
    """The projection widths of any family's config with num_heads, num_kv_heads and head_dim."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class AttentionBias(HeadSizes):
    """A config whose one `attention_bias` flag covers the Q/K/V and output projections (GPT-OSS, Qwen3-MoE)."""

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias


@dataclasses.dataclass(frozen=True)
class Config(HeadSizes):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        return "llama"

    def describe(self) -> str:
        return (
            f"{self.architecture}: {self.num_layers} layers, hidden {self.hidden_size}, "
            f"{self.num_heads}/{self.num_kv_heads} heads of {self.head_dim}, ffn {self.intermediate_size}, "
            f"vocab {self.vocab_size}{' (tied)' if self.tie_word_embeddings else ''}"
        )


def _rope_scaling_from_hf(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read rope theta and scaling from either config.json style (`rope_theta` + `rope_scaling`,
    or the newer `rope_parameters` that holds both)."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    spec = {**scaling, **params}
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind == "llama3":
        return float(theta), RopeScaling(
            kind="llama3",
            factor=float(spec["factor"]),
            low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
            high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return float(theta), RopeScaling(kind="linear", factor=float(spec["factor"]))
    raise UnsupportedModelError(
        f"RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3); "
        "use a checkpoint without it or add it to lithos/models/llama.py"
    )


def config_from_hf(d: dict[str, Any]) -> Config:
    """Build a Config from a Hugging Face `config.json` dict."""
    arch = (d.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported by the llama family (supported: {', '.join(ARCHITECTURES)})"
        )
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"activation {act!r} is not supported (only silu)")
    if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor {d['partial_rotary_factor']} (rotary positions on part of each head, as "
            "Phi-4-mini's) is not supported: lithos rotates whole heads"
        )
    theta, scaling = _rope_scaling_from_hf(d)
    heads = int(d["num_attention_heads"])
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    window = d.get("sliding_window")
    if arch.startswith("Qwen") and not d.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window size they do not use
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    attention_bias = bool(d.get("attention_bias", False))
    return Config(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=attention_bias and arch != "Qwen2ForCausalLM",
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=int(window) if window else None,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# The GGUF architectures whose `attention.sliding_window` is the model's (Qwen files carry one they do not use).
GGUF_WINDOWED = ("mistral", "phi3")


def gguf_fields(meta: dict[str, Any], tensor_names: set[str], supported: dict[str, str]) -> dict[str, Any]:
    """The Config fields every family's GGUF shares (sizes, attention, RoPE theta, norms, special tokens), from
    metadata under `general.architecture`'s prefix as llama.cpp writes it; `supported` maps the GGUF architectures a
    family reads to their HF names. RoPE scaling is each family's (`gguf_linear_rope`)."""
    gguf_arch = meta["general.architecture"]
    if gguf_arch not in supported:
        raise UnsupportedModelError(
            f"GGUF architecture {gguf_arch!r} is not supported (supported: {', '.join(supported)})"
        )

    def key(name, default=None):
        return meta.get(f"{gguf_arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = key("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return dict(
        architecture=supported[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def gguf_linear_rope(meta: dict[str, Any]) -> RopeScaling | None:
    """A GGUF's RoPE scaling where it is none or linear (llama3 scaling arrives as rope_freqs, derived from the config
    instead); any other kind is refused."""
    kind = meta.get(f"{meta['general.architecture']}.rope.scaling.type")
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(meta[f"{meta['general.architecture']}.rope.scaling.factor"]))
    if kind not in (None, "none"):
        raise UnsupportedModelError(f"GGUF RoPE scaling {kind!r} is not supported")
    return None


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> Config:
    """Build a Config from GGUF metadata (keys as llama.cpp writes them)."""
    if "rope_factors_long.weight" in tensor_names:
        raise UnsupportedModelError(
            "this GGUF's RoPE is LongRoPE (rope_factors_long/short: Phi-3's 128K-context variants), which is not "
            "supported: use a model without it (Phi-3-mini-4k, Phi-4)"
        )
    fields = gguf_fields(meta, tensor_names, GGUF_ARCHITECTURES)
    window = meta.get(f"{meta['general.architecture']}.attention.sliding_window")
    return Config(
        **fields,
        rope_scaling=gguf_linear_rope(meta),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=int(window) if window and meta["general.architecture"] in GGUF_WINDOWED else None,
    )


def cache_window(cfg: Config) -> int | None:
    """The window every layer attends within (None: the whole context): a windowed model's KV cache is a
    ring of about that many slots (lithos.kv_cache)."""
    return cfg.sliding_window


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@struct.dataclass
class LayerParams:
    """One decoder layer's weights, each stacked on a leading `[layers]` axis; matrices `[out, in]`."""

    attn_norm: jax.Array  # [L, hidden]
    wq: jax.Array  # [L, heads*head_dim, hidden]
    wk: jax.Array  # [L, kv_heads*head_dim, hidden]
    wv: jax.Array  # [L, kv_heads*head_dim, hidden]
    wo: jax.Array  # [L, hidden, heads*head_dim]
    mlp_norm: jax.Array  # [L, hidden]
    w_gate: jax.Array  # [L, ffn, hidden]
    w_up: jax.Array  # [L, ffn, hidden]
    w_down: jax.Array  # [L, hidden, ffn]
    bq: jax.Array | None = None  # [L, heads*head_dim]
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    bo: jax.Array | None = None  # [L, hidden]
    q_norm: jax.Array | None = None  # [L, head_dim]
    k_norm: jax.Array | None = None
    b_gate: jax.Array | None = None  # [L, ffn]
    b_up: jax.Array | None = None
    b_down: jax.Array | None = None  # [L, hidden]


@struct.dataclass
class Params:
    embed: jax.Array  # [vocab, hidden]
    layers: LayerParams
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None = None  # [vocab, hidden]; None when tied to `embed`


def attention_param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Shapes of what every decoder family here shares: embeddings, norms, attention (with the
    biases and Q/K norms `cfg.qkv_bias`, `cfg.o_bias`, `cfg.qk_norm` ask for) and an untied LM head."""
    L, D = cfg.num_layers, cfg.hidden_size
    shapes = {
        "embed": (cfg.vocab_size, D),
        "final_norm": (D,),
        "layers.attn_norm": (L, D),
        "layers.wq": (L, cfg.q_size, D),
        "layers.wk": (L, cfg.kv_size, D),
        "layers.wv": (L, cfg.kv_size, D),
        "layers.wo": (L, D, cfg.q_size),
        "layers.mlp_norm": (L, D),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, D)
    if cfg.qkv_bias:
        shapes |= {"layers.bq": (L, cfg.q_size), "layers.bk": (L, cfg.kv_size), "layers.bv": (L, cfg.kv_size)}
    if cfg.o_bias:
        shapes["layers.bo"] = (L, D)
    if cfg.qk_norm:
        shapes |= {"layers.q_norm": (L, cfg.head_dim), "layers.k_norm": (L, cfg.head_dim)}
    return shapes


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter, keyed by its field path (`layers.wq`), for loaders and init."""
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    shapes = attention_param_shapes(cfg)
    shapes |= {"layers.w_gate": (L, F, D), "layers.w_up": (L, F, D), "layers.w_down": (L, D, F)}
    if cfg.mlp_bias:
        shapes |= {"layers.b_gate": (L, F), "layers.b_up": (L, F), "layers.b_down": (L, D)}
    return shapes


# Logical axes of every parameter (keys as in `param_shapes`) and of the KV cache, declared once;
# lithos.placement maps them to mesh axes with a rule table. In weights, a "heads" dimension is
# [kv_heads, heads per KV head, head_dim] flattened (the order `attention` reshapes q into) and a
# "kv_heads" dimension is [kv_heads, head_dim] flattened.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("embed",),
    "layers.attn_norm": ("layers", "embed"),
    "layers.wq": ("layers", "heads", "embed"),
    "layers.wk": ("layers", "kv_heads", "embed"),
    "layers.wv": ("layers", "kv_heads", "embed"),
    "layers.wo": ("layers", "embed", "heads"),
    "layers.mlp_norm": ("layers", "embed"),
    "layers.w_gate": ("layers", "ffn", "embed"),
    "layers.w_up": ("layers", "ffn", "embed"),
    "layers.w_down": ("layers", "embed", "ffn"),
    "layers.bq": ("layers", "heads"),
    "layers.bk": ("layers", "kv_heads"),
    "layers.bv": ("layers", "kv_heads"),
    "layers.bo": ("layers", "embed"),
    "layers.q_norm": ("layers", "head_dim"),
    "layers.k_norm": ("layers", "head_dim"),
    "layers.b_gate": ("layers", "ffn"),
    "layers.b_up": ("layers", "ffn"),
    "layers.b_down": ("layers", "embed"),
}
CACHE_AXES = ("layers", "batch", "kv_heads", "sequence", "head_dim")  # KVCache.k and .v
CACHE_SCALE_AXES = ("layers", "batch", "kv_heads")  # KVCache.k_scale and .v_scale (an FP8 cache)


def params_from_flat(flat: dict[str, Any]) -> Params:
    """Assemble Params from `{"layers.wq": array, ...}` as produced by `param_shapes` keys."""
    layer_fields = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("layers.")}
    return Params(
        embed=flat["embed"],
        layers=LayerParams(**layer_fields),
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )


def init_params(cfg: Config, key: jax.Array, dtype=jnp.bfloat16) -> Params:
    """Random weights of the right shapes and a sane scale (for benchmarks and tests)."""
    flat = {}
    shapes = param_shapes(cfg)
    keys = jax.random.split(key, len(shapes))
    for k, (name, shape) in zip(keys, sorted(shapes.items())):
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in leaf:
            flat[name] = (1.0 + 0.1 * jax.random.normal(k, shape)).astype(dtype)
        else:
            fan_in = shape[-1] if len(shape) > 1 and leaf not in ("embed",) else 1
            scale = 1.0 / math.sqrt(fan_in) if fan_in > 1 else 0.02
            flat[name] = (scale * jax.random.normal(k, shape)).astype(dtype)
    return params_from_flat(flat)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


# "reference": plain jax.numpy, any backend, any batch. "fused": FFI kernels (lithos/custom_calls)
# on CUDA/ROCm and their jax.numpy twins elsewhere; batch 1, 1..16 new tokens per call (decode and
# speculative verification; prefill always takes the reference path).
KERNEL_PATHS = ("reference", "fused", "megakernel")  # megakernel: one launch per step
FUSED_HEAD_DIMS = (64, 128, 256)  # the attention kernel's instantiations


def check_kernel_path(kernels: str, cfg: Config | None = None) -> None:
    """Raise a clear error if `kernels` is unknown or cannot run this model."""
    if kernels not in KERNEL_PATHS:
        raise UnsupportedModelError(f"kernel path {kernels!r} is not available; choose one of {KERNEL_PATHS}")
    if kernels in ("fused", "megakernel") and cfg is not None:
        missing = kernel_gaps(cfg, kernels)
        if missing:
            raise UnsupportedModelError(
                f"the {kernels} kernels do not implement {', '.join(missing)} ({cfg.architecture}); "
                "use kernels='reference'"
            )


def kernel_gaps(cfg, kernels: str) -> list[str]:
    """What the `kernels` path ("fused" or "megakernel") lacks for `cfg`'s layers (any config with llama's attention
    fields): [] when it runs them."""
    missing = [
        name
        for name, present in (
            ("Q/K/V biases", cfg.qkv_bias and kernels == "megakernel"),
            ("output-projection bias", cfg.o_bias and kernels == "megakernel"),
            ("MLP biases", getattr(cfg, "mlp_bias", False)),
            ("per-head Q/K norms", cfg.qk_norm and kernels == "megakernel"),
        )
        if present
    ]
    if cfg.head_dim not in FUSED_HEAD_DIMS:
        missing.append(f"head_dim {cfg.head_dim} (kernels exist for {', '.join(map(str, FUSED_HEAD_DIMS))})")
    return missing


def params_for_kernels(params: Params, cfg: Config, kernels: str) -> Params:
    """`params` laid out as `kernels` is set to read them: for the megakernel, groups of mixed K-quants in K_MIX
    (lithos.custom_calls.megakernel.one_format_a_group) and the MXFP4 matrix groups it is asked to read in fragment
    tiles on CUDA (tiles_for_megakernel: every group by default); for the fused path, MXFP4 in rows
    (`in_rows`: a megakernel model's tiles back in them) and `qkv_in_one_format`. The values are the same; the
    reference path reads any layout. `params` may be laid out already (for another path): the matrices laid out
    alike are the same arrays."""
    if kernels not in ("fused", "megakernel"):
        return params
    from lithos.custom_calls.megakernel import in_rows, one_format_a_group, tiles_for_megakernel
    from lithos.custom_calls.megakernel.kernel import ATTENTION_WEIGHTS, MLP_WEIGHTS

    layers = params.layers
    matrices = {name: getattr(layers, name) for name in (*ATTENTION_WEIGHTS, *MLP_WEIGHTS) if hasattr(layers, name)}
    if kernels == "fused":
        return qkv_in_one_format(with_layers(params, in_rows(matrices)))
    return with_layers(params, tiles_for_megakernel(one_format_a_group(matrices), cfg.head_dim))


def with_layers(params, laid_out: dict):
    """`params` with the layer matrices `laid_out` (a dict of names); the same params where each is the array
    they hold already (not a copy of the tree)."""
    layers = params.layers
    if all(w is getattr(layers, name) for name, w in laid_out.items()):
        return params
    return params.replace(layers=layers.replace(**laid_out))


def qkv_in_one_format(params):
    """For the fused path: Q/K/V that mix K-quants (a Q4_K_M file's Q4_K Q and K beside its V, K_MIX) all in K_MIX,
    every value the same, so that they take one Q/K/V launch (two with per-head norms) instead of three projections
    and XLA's norms, rotation and cache writes, at 7.1 bits a weight on Q and K where Q4_K takes 4.5 (on an H100,
    a wash for Llama-3.1-8B, 8% of Qwen3-30B-A3B's step saved: NOTES.md, run 122). `params` with a `layers` of
    wq/wk/wv (every family on `fused_layers`)."""
    from lithos.custom_calls.megakernel import one_format_a_group
    from lithos.custom_calls.megakernel.kernel import QKV_WEIGHTS

    try:
        laid_out = one_format_a_group({name: getattr(params.layers, name) for name in QKV_WEIGHTS})
    except LithosError:  # a mix K_MIX does not hold: the split form reads any
        return params
    return with_layers(params, laid_out)


def rope_inv_freq(cfg: Config) -> np.ndarray:
    """Inverse frequencies `[head_dim/2]`, with llama3 or linear scaling applied (as transformers does)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    if s.kind == "linear":
        return (inv_freq / s.factor).astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotate `x` `[batch, tokens, heads, head_dim]` by `positions` `[batch, tokens]` (rotate-half form).

    `scale` multiplies cos and sin (YaRN's attention factor, as transformers applies it)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :] * scale
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :] * scale
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array | QuantizedArray, b: jax.Array | None = None) -> jax.Array:
    """`x @ w.T (+ b)` for `[out, in]` weights, dense or packed (lithos.quant)."""
    if isinstance(w, QuantizedArray):
        # The exact f32 weight values (a bf16 copy would round Q4/Q8/FP8 values), f32 accumulation, as a
        # kernel that dequantises in registers computes it.
        y = jnp.einsum("...i,oi->...o", x, dequantize(w, jnp.float32), preferred_element_type=jnp.float32)
        y = y.astype(x.dtype)
        return y if b is None else y + b
    y = jnp.einsum("...i,oi->...o", x, w)
    return y if b is None else y + b


def attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    cfg: Config,
    sinks: jax.Array | None = None,
    window: int | jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention of new queries over one layer's cache plus the new tokens themselves.

    q: `[batch, tokens, heads, head_dim]`; k_new, v_new: `[batch, tokens, kv_heads, head_dim]`;
    k_cache, v_cache: `[batch, kv_heads, slots, head_dim]`, linear or a ring (lithos.kv_cache), valid
    below each row's start position `positions[:, 0]` (entries past it are stale and never read);
    positions: `[batch, tokens]`, consecutive per row. Token t sees the cache below the start and new
    tokens t' <= t (within the sliding window, if any). Returns `[batch, tokens, heads*head_dim]`.

    `sinks` `[heads]` (GPT-OSS): a per-head logit that joins every softmax and takes its share of the
    probability without adding a value. `window`: this layer's sliding window, overriding
    `cfg.sliding_window` (a traced scalar lets one scan mix windowed and full layers).
    `k_scale`, `v_scale` `[batch, kv_heads]`: the caches hold FP8 codes (lithos.kv_cache), read as stored.
    """
    if k_scale is not None:
        layer_cache = KVCache(k=k_cache, v=v_cache, k_scale=k_scale, v_scale=v_scale)
        k_cache, v_cache, k_new, v_new = attention_inputs(layer_cache, k_new, v_new)
    B, T, H, D = q.shape
    G = H // cfg.num_kv_heads
    qg = q.reshape(B, T, cfg.num_kv_heads, G, D) / jnp.asarray(math.sqrt(D), q.dtype)
    s_cache = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    s_new = jnp.einsum("btkgd,bukd->bkgtu", qg, k_new, preferred_element_type=jnp.float32)

    # The position each slot holds, read before this call's entries are stored: [B, 1, S], < 0 unwritten.
    cache_pos = slot_positions(positions[:, :1] - 1, k_cache.shape[2])
    query_pos = positions[:, :, None]  # [B, T, 1]
    see_cache = cache_pos >= 0
    see_new = positions[:, None, :] <= query_pos  # [B, T, T]
    window = cfg.sliding_window if window is None else window
    if window is not None:
        see_cache &= cache_pos > query_pos - window
        see_new &= positions[:, None, :] > query_pos - window
    scores = jnp.concatenate(
        [jnp.where(see_cache[:, None, None], s_cache, -jnp.inf), jnp.where(see_new[:, None, None], s_new, -jnp.inf)],
        axis=-1,
    )
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks.astype(jnp.float32).reshape(1, cfg.num_kv_heads, G, 1, 1)
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    S = k_cache.shape[2]
    out = jnp.einsum(
        "bkgts,bksd->btkgd", probs[..., :S].astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32
    ) + jnp.einsum("bkgtu,bukd->btkgd", probs[..., S:].astype(v_new.dtype), v_new, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H * D).astype(q.dtype)


def attention_block(
    cfg,
    inv_freq,
    positions,
    x,
    p,
    k_cache,
    v_cache,
    rope_scale: float = 1.0,
    sinks=None,
    window=None,
    k_scale=None,
    v_scale=None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Q/K/V projections (with biases and per-head Q/K norms where `p` has them), RoPE, attention over
    the cache and the new tokens, output projection. Shared by every family whose layer params carry
    llama's attention fields (wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm).

    x: normed input `[batch, tokens, hidden]`. Returns the attention output `[batch, tokens, hidden]`
    (to add to the residual) and the new keys/values `[batch, tokens, kv_heads, head_dim]` each.
    """
    B, T, _ = x.shape
    q = linear(x, p.wq, p.bq).reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = linear(x, p.wk, p.bk).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = linear(x, p.wv, p.bv).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq, rope_scale)
    k = apply_rope(k, positions, inv_freq, rope_scale)
    attn = attention(
        q, k, v, k_cache, v_cache, positions, cfg, sinks=sinks, window=window, k_scale=k_scale, v_scale=v_scale
    )
    return linear(attn, p.wo, p.bo), (k, v)


def _layer(cfg: Config, inv_freq, positions, h, layer):
    """One decoder layer. `layer` = (its params, its cache: `kv_cache.layer_of`). Reads the cache; returns
    the new keys/values for the caller to store."""
    p, kv = layer

    x = rms_norm(h, p.attn_norm, cfg.rms_norm_eps)
    scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
    attn, (k, v) = attention_block(cfg, inv_freq, positions, x, p, kv.k, kv.v, **scales)
    h = h + attn

    x = rms_norm(h, p.mlp_norm, cfg.rms_norm_eps)
    gated = jax.nn.silu(linear(x, p.w_gate, p.b_gate)) * linear(x, p.w_up, p.b_up)
    h = h + linear(gated, p.w_down, p.b_down)
    return h, (k, v)


def _reference_decoder(params: Params, tokens, positions, cache: KVCache, cfg: Config):
    h = params.embed[tokens]
    inv_freq = rope_inv_freq(cfg)

    def body(h, layer):
        return _layer(cfg, inv_freq, positions, h, layer)

    # The layers only read the cache; all layers' new entries are stored in one scatter afterwards,
    # which XLA does in place on the donated buffer.
    h, (k_new, v_new) = jax.lax.scan(body, h, (params.layers, cache))
    return h, append(cache, positions, k_new, v_new)


def _fused_decoder(params: Params, tokens, positions, cache: KVCache, cfg: Config, tp=None):
    """The decoder as five fused calls per layer (see lithos/custom_calls/NOTES.md), batch 1: `fused_layers` with
    the gated MLP's two calls (gate/up with SiLU, down into the residual).

    With `tp` (a lithos.tensor_parallel.TensorParallel, inside shard_map) the params and cache are
    this device's slices and `cfg` describes them; the embedding lookup and the two projections
    into the residual stream combine their partial results across devices.
    """
    from lithos.custom_calls.packed_matvec import packed_gate_up_silu

    L = params.layers
    project_residual = tp.project_residual if tp is not None else residual_matvec

    def mlp(h, i, _):
        gated = packed_gate_up_silu(h, L.w_gate, L.w_up, layer=i, norm_weight=L.mlp_norm, eps=cfg.rms_norm_eps)
        return project_residual(gated, L.w_down, i, h), None

    h, cache, _ = fused_layers(params, tokens, positions, cache, cfg, mlp, tp=tp)
    return h, cache


def residual_matvec(x, w, i, residual):
    """`residual + x @ w[i].T`, one fused call (bf16 or packed `w`)."""
    from lithos.custom_calls.packed_matvec import packed_matvec

    return packed_matvec(x, w, layer=i, residual=residual)


def fused_layers(params, tokens, positions, cache: KVCache, cfg, mlp, aux=None, tp=None):
    """The decoder loop of the fused paths, batch 1: each layer's attention as three fused calls (RMSNorm, Q/K/V
    and RoPE with the cache write; attention; O into the residual), then `mlp(h, i, aux) -> (h, aux)`, which adds
    layer i's MLP into the residual `h` `[tokens, hidden]` (llama's gated MLP; a mixture of experts' routed ones) and
    may carry a value through the loop (`aux`: the experts each layer picked). Families whose layers carry llama's
    attention fields share it. Returns (h `[1, tokens, hidden]`, the cache, aux).

    Each kernel takes the stacked weights and the layer index, so nothing is sliced out; the K/V
    kernel writes the new entries into the cache in place (aliased buffers carried by the loop).
    """
    from lithos.custom_calls import decode_attention

    # Each takes bf16 or packed (lithos.quant) weights: bf16 goes to the bf16 kernels.
    from lithos.custom_calls.packed_matvec import packed_qkv_rope_append

    if tokens.shape[0] != 1:
        raise UnsupportedModelError(
            f"the fused kernels decode one sequence, got a batch of {tokens.shape[0]}: use kernels='reference'"
        )
    layer_weights = {f.name: getattr(params.layers, f.name) for f in dataclasses.fields(params.layers)}
    packed = [name for name, w in layer_weights.items() if isinstance(w, QuantizedArray)]
    if packed and (tp is not None or cache.k_scale is not None):
        raise UnsupportedModelError(
            f"the fused kernels read packed weights ({', '.join(packed)}) on one device with a bf16 cache only, "
            "not with tensor parallelism or an FP8 cache: load with dequantize=True (--dequantize) or use "
            "kernels='reference'"
        )
    # The kernels store a forward's entries before its queries read: a ring must hold them besides the window.
    check_step_tokens(cache, tokens.shape[1], "the fused kernels' forward")
    L, eps = params.layers, cfg.rms_norm_eps
    pos = positions[0].astype(jnp.int32)
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    n_tokens = tokens.shape[1]
    ring = cache.ring is not None  # the kernels store position p in slot p % slots
    # Q/K/V biases (Qwen2's) and per-head norms (Qwen3's): packed_qkv_rope_append says which take three projections
    qkv_extras = dict(
        biases=(L.bq, L.bk, L.bv) if cfg.qkv_bias else None, qk_norms=(L.q_norm, L.k_norm) if cfg.qk_norm else None
    )
    project_residual = tp.project_residual if tp is not None else residual_matvec

    def layer(i, carry):
        h, k_cache, v_cache, aux = carry
        # An FP8 cache's scales were set by prefill (reference path) and are only read here.
        scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        q, k_cache, v_cache = packed_qkv_rope_append(
            *(h, L.attn_norm, L.wq, L.wk, L.wv, inv_freq, pos, k_cache, v_cache),
            **dict(layer=i, eps=eps, ring=ring, **qkv_extras, **scales),
        )
        attn = decode_attention(
            q, k_cache, v_cache, pos, layer=i, sliding_window=cfg.sliding_window, ring=ring, **scales
        )
        h = project_residual(attn.reshape(n_tokens, cfg.q_size), L.wo, i, h)
        if cfg.o_bias:  # after the devices' partial projections are summed: added once
            h = h + jax.lax.dynamic_index_in_dim(L.bo, i, 0, keepdims=False).astype(h.dtype)
        h, aux = mlp(h, i, aux)
        return h, k_cache, v_cache, aux

    h = params.embed[tokens[0]] if tp is None else tp.embed_rows(params.embed, tokens[0])
    h, k, v, aux = jax.lax.fori_loop(0, cfg.num_layers, layer, (h, cache.k, cache.v, aux))
    return h[None], cache.replace(k=k, v=v), aux


def decoder(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: Config,
    kernels: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """Run the decoder layers over `tokens` `[batch, tokens]` at `positions` (consecutive per row),
    appending their keys and values to `cache`.

    Returns the last layer's output `[batch, tokens, hidden]` (before the final norm) and the cache.
    """
    check_kernel_path(kernels, cfg)
    if kernels == "fused":
        return _fused_decoder(params, tokens, positions, cache, cfg)
    if kernels == "megakernel":
        out, cache = _megakernel_step(params, tokens, positions, cache, cfg, head=None)
        return out.h[None], cache
    return _reference_decoder(params, tokens, positions, cache, cfg)


def hidden_states(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: Config,
    kernels: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """`decoder` followed by the final norm: hidden states `[batch, tokens, hidden]` and the cache."""
    h, cache = decoder(params, tokens, positions, cache, cfg, kernels)
    return rms_norm(h, params.final_norm, cfg.rms_norm_eps), cache


def lm_head(params: Params) -> jax.Array:
    """The output projection `[vocab, hidden]`: the embedding when tied."""
    return params.embed if params.lm_head is None else params.lm_head


def lm_logits(params: Params, h: jax.Array) -> jax.Array:
    """Logits `[..., vocab]` in float32 from final-normed hidden states."""
    head = lm_head(params)
    if isinstance(head, QuantizedArray):
        head = dequantize(head, jnp.float32)
    return jnp.einsum("...d,vd->...v", h, head, preferred_element_type=jnp.float32)


def _fused_head(params: Params, h: jax.Array, cfg: Config, with_logits: bool):
    """Final norm + LM head + argmax in one kernel (a packed head: packed matvec + argmax), for `h`
    `[1, tokens, hidden]` before the norm."""
    from lithos.custom_calls.packed_matvec import packed_lm_head_argmax

    out = packed_lm_head_argmax(
        h[0], lm_head(params), norm_weight=params.final_norm, eps=cfg.rms_norm_eps, with_logits=with_logits
    )
    return jax.tree_util.tree_map(lambda a: a[None], out)


def _megakernel_step(params: Params, tokens, positions, cache: KVCache, cfg: Config, head: str | None):
    """The whole step (every layer, and with `head` the final norm, LM head and greedy token) in one
    persistent kernel launch (lithos/custom_calls/megakernel), batch 1. Returns its StepOutputs and
    the cache, updated in place."""
    from lithos.custom_calls.megakernel import StepWeights, decode_step

    check_kernel_path("megakernel", cfg)
    if tokens.shape[0] != 1:
        raise UnsupportedModelError(
            f"the megakernel decodes one sequence, got a batch of {tokens.shape[0]}: use kernels='reference'"
        )
    L = params.layers
    weights = StepWeights(
        L.attn_norm, L.wq, L.wk, L.wv, L.wo, L.mlp_norm, L.w_gate, L.w_up, L.w_down, params.final_norm, lm_head(params)
    )
    if cache.quantized:
        raise UnsupportedModelError(
            "the megakernel reads a bf16 KV cache, not FP8: load with kv_cache_dtype='model' or use kernels='fused'"
        )
    check_step_tokens(cache, tokens.shape[1], "the megakernel's forward")
    out = decode_step(
        weights,
        params.embed[tokens[0]],
        positions[0],
        jnp.asarray(rope_inv_freq(cfg)),
        cache.k,
        cache.v,
        eps=cfg.rms_norm_eps,
        window=cfg.sliding_window,
        ring=cache.ring is not None,
        head=head,
    )
    return out, cache.replace(k=out.k_cache, v=out.v_cache)


def head_logits(params, h: jax.Array, cfg, kernels: str = "reference") -> jax.Array:
    """Final norm + LM head: logits `[batch, tokens, vocab]` (float32) from the decoder's output `h`
    `[batch, tokens, hidden]`. Any family whose params have `embed`, `lm_head` and `final_norm`."""
    if kernels in ("fused", "megakernel"):  # the megakernel's own head runs inside its step
        _, logits = _fused_head(params, h, cfg, with_logits=True)
        return logits
    return lm_logits(params, rms_norm(h, params.final_norm, cfg.rms_norm_eps))


def head_argmax(params, h: jax.Array, cfg, kernels: str = "reference") -> jax.Array:
    """Greedy tokens `[batch, tokens]` (int32) from the decoder's output; the fused path never
    materialises the logits."""
    if kernels in ("fused", "megakernel"):
        return _fused_head(params, h, cfg, with_logits=False)
    return jnp.argmax(head_logits(params, h, cfg), axis=-1).astype(jnp.int32)


def _fused_per_device(params: Params, tokens, positions, cache: KVCache, cfg: Config, placement, logits: bool):
    """The fused step split over `placement`'s devices (lithos.placement): each device runs the kernels
    on its own heads, FFN slice and vocabulary slice inside shard_map, so XLA never gathers a kernel's
    inputs. Returns logits split over the vocabulary `[1, tokens, vocab]`, or the greedy tokens."""
    check_kernel_path("fused", cfg)
    if cfg != placement.cfg:
        raise UnsupportedModelError("the params were placed for another config: decode with placement.cfg")
    local_cfg, tp = placement.local_cfg, placement.tensor_parallel

    def per_device(params, tokens, positions, cache):
        h, cache = _fused_decoder(params, tokens, positions, cache, local_cfg, tp)
        head = tp.head_logits if logits else tp.head_tokens
        return head(h[0], lm_head(params), params.final_norm, local_cfg.rms_norm_eps)[None], cache

    return placement.shard_step(per_device, logits)(params, tokens, positions, cache)


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: Config,
    kernels: str = "reference",
    placement: Any = None,
) -> tuple[jax.Array, KVCache]:
    """Logits `[batch, tokens, vocab]` (float32) for `tokens` at `positions`, and the updated cache.

    Serves prefill (many tokens), decode (one) and speculative verification (k+1) alike. With a
    `placement` (lithos.placement) the fused path runs per device inside shard_map; the reference
    path needs none (XLA partitions it from the arrays' shardings).
    """
    if kernels == "fused" and placement is not None:
        return _fused_per_device(params, tokens, positions, cache, cfg, placement, logits=True)
    if kernels == "megakernel":
        out, cache = _megakernel_step(params, tokens, positions, cache, cfg, head="logits")
        return out.logits[None], cache
    h, cache = decoder(params, tokens, positions, cache, cfg, kernels)
    return head_logits(params, h, cfg, kernels), cache


def forward_argmax(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: Config,
    kernels: str = "reference",
    placement: Any = None,
) -> tuple[jax.Array, KVCache]:
    """Greedy next tokens `[batch, tokens]` (int32) and the updated cache; the fused path never
    materialises the logits. `placement` as in `forward`."""
    if kernels == "fused" and placement is not None:
        return _fused_per_device(params, tokens, positions, cache, cfg, placement, logits=False)
    if kernels == "megakernel":
        out, cache = _megakernel_step(params, tokens, positions, cache, cfg, head="argmax")
        return out.tokens[None], cache
    h, cache = decoder(params, tokens, positions, cache, cfg, kernels)
    return head_argmax(params, h, cfg, kernels), cache


# --------------------------------------------------------------------------------------------
# What a decode step reads (lithos bench's floor)
# --------------------------------------------------------------------------------------------


def kv_positions_read(cfg: Config, context: int) -> int:
    """Cache positions a one-token step at `context` reads, summed over layers: at most the window each."""
    return cfg.num_layers * min(context, cfg.sliding_window or context)
