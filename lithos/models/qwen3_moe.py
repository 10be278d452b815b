"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B), Qwen2-MoE (`Qwen2MoeForCausalLM`:
Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) and Mixtral (`MixtralForCausalLM`: Mixtral-8x7B, 8x22B), one family:
grouped-query attention with a routed MLP in every MoE layer.

Attention: Qwen3's with per-head RMSNorm on Q and K, Mixtral's and Qwen2-MoE's without (`qk_norm`); Qwen2-MoE's
with Q/K/V biases (`attention_bias`, `qkv_bias_only`). The routed MLP: a softmax over all experts, the top-k
probabilities (renormalised to sum to one when `norm_topk_prob`, as Mixtral always does), experts with a SiLU-gated
MLP; Qwen2-MoE adds a shared expert, a SiLU-gated MLP every token reads, scaled by sigmoid(x . gate). Layers listed
in `mlp_only_layers`, and layers off the `decoder_sparse_step` grid, have a dense MLP of `intermediate_size` instead
(the Qwen families only).

Order of this file: config, parameters, forward. The MoE pieces are lithos.models.moe; attention,
RoPE and the head are the llama family's.

Kernel paths: "reference" and "fused": llama's fused attention (Qwen3's per-head Q/K norms and Qwen2-MoE's Q/K/V
biases applied between its projection calls and the rotation), the routed experts through the `expert_matvec`
kernel, the dense layers' MLPs and Qwen2-MoE's shared experts through the fused gate/up and down calls, and the LM
head + argmax kernel. Where the attention kernels do not take the config (a head size they are not built for:
`llama.kernel_gaps`), the fused path keeps its attention and dense MLPs on jax.numpy and runs the experts and the
head through the kernels.
"""

from __future__ import annotations

import dataclasses
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

ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
GGUF_ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}
# llama.cpp writes Mixtral as a `llama` GGUF whose layers hold expert tensors (lithos.models.family_for_gguf).
MIXTRAL_GGUF_ARCHITECTURES = {"llama": "MixtralForCausalLM"}
RopeScaling = llama.RopeScaling


@dataclasses.dataclass(frozen=True)
class Config(llama.AttentionBias):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' FFN width
    moe_intermediate_size: int  # each expert's FFN width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    experts_per_token: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = True  # Qwen3-MoE's per-head Q/K RMSNorm; Mixtral and Qwen2-MoE have none
    qkv_bias_only: bool = False  # Qwen2-MoE: `attention_bias` on Q/K/V, none on the output projection
    shared_expert_ffn: int = 0  # Qwen2-MoE: every MoE layer's always-read expert, gated by a sigmoid

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and not self.qkv_bias_only

    def __post_init__(self):  # lists from JSON (converted checkpoints) must become tuples: configs are jit-static
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def family(self) -> str:
        return "qwen3_moe"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is routed (transformers' rule)."""
        return tuple(
            i
            for i in range(self.num_layers)
            if i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    def describe(self) -> str:
        return (
            f"{self.architecture}: {self.num_layers} layers ({len(self.moe_layers)} MoE), hidden {self.hidden_size}, "
            f"{self.num_heads}/{self.num_kv_heads} heads of {self.head_dim}, {self.num_experts} experts "
            f"(top {self.experts_per_token}) of ffn {self.moe_intermediate_size}"
            f"{f' and a shared expert of ffn {self.shared_expert_ffn}' if self.shared_expert_ffn else ''}, "
            f"vocab {self.vocab_size}"
            f"{' (tied)' if self.tie_word_embeddings else ''}"
        )


def config_from_hf(d: dict[str, Any]) -> Config:
    """Build a Config from a Qwen3-MoE, Qwen2-MoE or Mixtral `config.json` dict."""
    arch = (d.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} is not a routed MLP family's ({', '.join(ARCHITECTURES)})")
    if arch == "MixtralForCausalLM":
        return _mixtral_config(d)
    if d.get("use_sliding_window", False) and arch == "Qwen2MoeForCausalLM":
        raise UnsupportedModelError(
            "Qwen2-MoE's use_sliding_window (a window on the layers past max_window_layers) is not supported: "
            "set it false in config.json (the released checkpoints do)"
        )
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"activation {act!r} is not supported (only silu)")
    theta, scaling = llama._rope_scaling_from_hf(d)
    heads = int(d["num_attention_heads"])
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    eos = d.get("eos_token_id")
    step = int(d.get("decoder_sparse_step") or 1)
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step must be at least 1, got {step}: fix config.json")
    family_fields = (
        _qwen2_moe_fields(d)
        if arch == "Qwen2MoeForCausalLM"
        else {"attention_bias": bool(d.get("attention_bias", False))}
    )
    return Config(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
        num_experts=int(d.get("num_experts", d.get("num_local_experts", 0)) or 0),
        experts_per_token=int(d["num_experts_per_tok"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        decoder_sparse_step=step,
        rope_scaling=scaling,
        sliding_window=int(window) if window else None,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        **family_fields,
    )


def _qwen2_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """What Qwen2-MoE's `config.json` says beyond Qwen3-MoE's: Q/K/V biases (`qkv_bias`, on by default) and none on
    the output projection, no per-head norms, and the shared expert's width."""
    return dict(
        attention_bias=bool(d.get("qkv_bias", True)),
        qkv_bias_only=True,
        qk_norm=False,
        shared_expert_ffn=int(d.get("shared_expert_intermediate_size") or 0),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> Config:
    """Build a Config from a `qwen3moe` or `qwen2moe` GGUF's metadata (llama.cpp's keys), or a Mixtral's (llama.cpp
    writes Mixtral as a `llama` GGUF with expert tensors). Layers without expert tensors are the dense ones
    (`mlp_only_layers`); llama.cpp renormalises the top-k probabilities unless the file says otherwise
    (`expert_weights_norm`), but for qwen2moe, whose graph never does. A qwen2moe file's attention biases are on
    Q/K/V only, and its shared experts' width is `expert_shared_feed_forward_length`."""
    a = meta["general.architecture"]
    fields = llama.gguf_fields(meta, tensor_names, GGUF_ARCHITECTURES | MIXTRAL_GGUF_ARCHITECTURES)
    layers = fields["num_layers"]
    experts = int(meta.get(f"{a}.expert_count") or 0)
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in tensor_names]
    if not experts or not routed or f"{a}.expert_used_count" not in meta:
        raise UnsupportedModelError(
            f"this {a} GGUF names no experts (expert_count, expert_used_count, blk.N.ffn_gate_exps) or stores them one "
            "tensor each (an old llama.cpp's Mixtral): re-convert it with a current llama.cpp convert_hf_to_gguf.py"
        )
    return Config(
        **fields,
        rope_scaling=llama.gguf_linear_rope(meta),
        moe_intermediate_size=int(meta.get(f"{a}.expert_feed_forward_length", fields["intermediate_size"])),
        num_experts=experts,
        experts_per_token=int(meta[f"{a}.expert_used_count"]),
        norm_topk_prob=a != "qwen2moe" and bool(meta.get(f"{a}.expert_weights_norm", True)),
        mlp_only_layers=tuple(i for i in range(layers) if i not in routed),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qkv_bias_only=a == "qwen2moe",
        shared_expert_ffn=int(meta.get(f"{a}.expert_shared_feed_forward_length") or 0),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=int(window) if (window := meta.get(f"{a}.attention.sliding_window")) else None,
    )


def _mixtral_config(d: dict[str, Any]) -> Config:
    """Mixtral's `config.json`: every layer routed, `intermediate_size` each expert's width, its own sliding window
    (no use_sliding_window flag), no Q/K norms."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"activation {act!r} is not supported (only silu)")
    theta, scaling = llama._rope_scaling_from_hf(d)
    heads = int(d["num_attention_heads"])
    eos = d.get("eos_token_id")
    window = d.get("sliding_window")
    return Config(
        architecture="MixtralForCausalLM",
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        moe_intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
        num_experts=int(d["num_local_experts"]),
        experts_per_token=int(d["num_experts_per_tok"]),
        norm_topk_prob=True,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        sliding_window=int(window) if window else None,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        qk_norm=False,
    )


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@struct.dataclass
class LayerParams:
    """Attention and norms of every layer, stacked `[layers, ...]` (llama's field names)."""

    attn_norm: jax.Array  # [L, hidden]
    wq: jax.Array  # [L, heads*head_dim, hidden]
    wk: jax.Array  # [L, kv_heads*head_dim, hidden]
    wv: jax.Array  # [L, kv_heads*head_dim, hidden]
    wo: jax.Array  # [L, hidden, heads*head_dim]
    mlp_norm: jax.Array  # [L, hidden]
    q_norm: jax.Array | None = None  # [L, head_dim] (qk_norm)
    k_norm: jax.Array | None = None
    bq: jax.Array | None = None  # [L, heads*head_dim] (attention_bias)
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    bo: jax.Array | None = None  # [L, hidden]


@struct.dataclass
class DenseMLP:
    """The dense layers' MLPs, stacked `[dense_layers, ...]` in layer order."""

    w_gate: jax.Array  # [Ld, ffn, hidden]
    w_up: jax.Array  # [Ld, ffn, hidden]
    w_down: jax.Array  # [Ld, hidden, ffn]


@struct.dataclass
class SharedExpert:
    """Qwen2-MoE's shared experts, stacked `[moe_layers, ...]`: a gated MLP every token reads, its output scaled by
    sigmoid(x . gate)."""

    w_gate: jax.Array  # [Lm, ffn, hidden]
    w_up: jax.Array  # [Lm, ffn, hidden]
    w_down: jax.Array  # [Lm, hidden, ffn]
    gate: jax.Array  # [Lm, hidden]


@struct.dataclass
class Params:
    embed: jax.Array  # [vocab, hidden]
    layers: LayerParams
    final_norm: jax.Array  # [hidden]
    experts: moe.Experts | None = None  # MoE layers, stacked [moe_layers, experts, ...]; gate_up = [gate | up]
    dense: DenseMLP | None = None
    lm_head: jax.Array | None = None  # [vocab, hidden]; None when tied
    shared: SharedExpert | None = None


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter, keyed by its field path (`layers.wq`, `experts.gate_up`, `dense.w_up`)."""
    D = cfg.hidden_size
    shapes = llama.attention_param_shapes(cfg)
    if cfg.moe_layers:
        shapes |= moe.expert_shapes(len(cfg.moe_layers), cfg.num_experts, D, cfg.moe_intermediate_size, biases=False)
    if cfg.dense_layers:
        Ld, F = len(cfg.dense_layers), cfg.intermediate_size
        shapes |= {"dense.w_gate": (Ld, F, D), "dense.w_up": (Ld, F, D), "dense.w_down": (Ld, D, F)}
    if cfg.shared_expert_ffn and cfg.moe_layers:
        Lm, F = len(cfg.moe_layers), cfg.shared_expert_ffn
        shapes |= {"shared.w_gate": (Lm, F, D), "shared.w_up": (Lm, F, D), "shared.w_down": (Lm, D, F)}
        shapes["shared.gate"] = (Lm, D)
    return shapes


PARAM_AXES: dict[str, tuple[str, ...]] = {
    **{name: axes for name, axes in llama.PARAM_AXES.items() if not name.startswith(("layers.w_", "layers.b_"))},
    **{f"{g}.{f}": llama.PARAM_AXES[f"layers.{f}"] for g in ("dense", "shared") for f in ("w_gate", "w_up", "w_down")},
    "shared.gate": ("layers", "embed"),
    **moe.EXPERT_AXES,
}
CACHE_AXES = llama.CACHE_AXES


def params_from_flat(flat: dict[str, Any]) -> Params:
    """Assemble Params from `{"layers.wq": array, "experts.gate_up": ..., "dense.w_up": ...}`."""

    def group(prefix: str) -> dict[str, Any]:
        return {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(prefix + ".")}

    experts, dense, shared = group("experts"), group("dense"), group("shared")
    return Params(
        embed=flat["embed"],
        layers=LayerParams(**group("layers")),
        final_norm=flat["final_norm"],
        experts=moe.Experts(**experts) if experts else None,
        dense=DenseMLP(**dense) if dense else None,
        lm_head=flat.get("lm_head"),
        shared=SharedExpert(**shared) if shared else None,
    )


def init_params(cfg: Config, key: jax.Array, dtype=jnp.bfloat16, experts: str | None = None) -> Params:
    """Random weights of the right shapes and scale (for benchmarks and tests); experts dense in
    `dtype`, as Qwen ships them, or packed (`experts="mxfp4"`)."""
    return params_from_flat(moe.init_flat(key, param_shapes(cfg), dtype, packed=experts))


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------

KERNEL_PATHS = ("reference", "fused")


def check_kernel_path(kernels: str, cfg: Config | None = None) -> None:
    if kernels not in KERNEL_PATHS:
        raise UnsupportedModelError(f"kernel path {kernels!r} is not available; choose one of {KERNEL_PATHS}")


def _slots(cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer, whether it is a MoE layer, and its index in the MoE stack and in the dense stack (0 where it has
    none)."""
    is_moe = np.zeros(cfg.num_layers, bool)
    is_moe[list(cfg.moe_layers)] = True
    moe_slot = np.zeros(cfg.num_layers, np.int32)
    dense_slot = np.zeros(cfg.num_layers, np.int32)
    moe_slot[list(cfg.moe_layers)] = np.arange(len(cfg.moe_layers))
    dense_slot[list(cfg.dense_layers)] = np.arange(len(cfg.dense_layers))
    return is_moe, moe_slot, dense_slot


def _dense_mlp(x: jax.Array, dense: DenseMLP, slot: jax.Array) -> jax.Array:
    pick = partial(jax.tree_util.tree_map, lambda p: jax.lax.dynamic_index_in_dim(p, slot, 0, keepdims=False))
    gated = jax.nn.silu(llama.linear(x, pick(dense.w_gate))) * llama.linear(x, pick(dense.w_up))
    return llama.linear(gated, pick(dense.w_down))


def _shared_expert(x: jax.Array, shared: SharedExpert, slot: jax.Array, kernels: str) -> jax.Array:
    """Qwen2-MoE's shared expert on normed tokens `x` `[n, hidden]`: its gated MLP times sigmoid(x . gate)."""
    if kernels == "fused":
        from lithos.custom_calls.packed_matvec import packed_gate_up_silu, packed_matvec

        gated = packed_gate_up_silu(x, shared.w_gate, shared.w_up, layer=slot)
        y = packed_matvec(gated, shared.w_down, layer=slot)
    else:
        y = _dense_mlp(x, shared, slot)
    gate = jax.lax.dynamic_index_in_dim(shared.gate, slot, 0, keepdims=False)
    scale = jax.nn.sigmoid(jnp.einsum("nd,d->n", x, gate, preferred_element_type=jnp.float32))
    return (scale[:, None] * y.astype(jnp.float32)).astype(x.dtype)


def _decoder(params: Params, tokens, positions, cache: KVCache, cfg: Config, kernels: str):
    """The decoder layers: `(h [B, T, hidden], cache, expert ids [layers, B*T, top_k])`, ids -1 on dense layers."""
    check_kernel_path(kernels, cfg)
    if kernels == "fused" and tokens.shape[0] != 1:
        raise UnsupportedModelError(
            f"the fused path decodes one sequence, got a batch of {tokens.shape[0]}: use kernels='reference'"
        )
    if kernels == "fused" and not llama.kernel_gaps(cfg, "fused"):
        return _fused_decoder(params, tokens, positions, cache, cfg)
    inv_freq = llama.rope_inv_freq(cfg)
    eps = cfg.rms_norm_eps
    B, T = tokens.shape
    k = max(cfg.experts_per_token, 1)
    routing = _routing(cfg)
    is_moe, moe_slot, dense_slot = _slots(cfg)

    def routed(x, i):
        y, ids = moe.moe_mlp(x, params.experts, i, routing, moe.swiglu_halves, kernels)
        if params.shared is not None:
            y = y + _shared_expert(x.reshape(B * T, -1), params.shared, i, kernels).reshape(y.shape)
        return y, ids

    def dense(x, i):
        return _dense_mlp(x, params.dense, i).astype(x.dtype), jnp.full((B * T, k), -1, jnp.int32)

    def layer(h, xs):
        p, kv, routed_layer, m, d = xs  # kv: this layer's cache (an FP8 one carries its scales)
        x = llama.rms_norm(h, p.attn_norm, eps)
        attn, new_kv = llama.attention_block(
            cfg, inv_freq, positions, x, p, kv.k, kv.v, k_scale=kv.k_scale, v_scale=kv.v_scale
        )
        h = h + attn
        x = llama.rms_norm(h, p.mlp_norm, eps)
        if is_moe.all():
            y, expert_ids = routed(x, m)
        elif not is_moe.any():
            y, expert_ids = dense(x, d)
        else:  # both kinds in one scan: only the taken branch runs
            y, expert_ids = jax.lax.cond(routed_layer, lambda: routed(x, m), lambda: dense(x, d))
        return h + y, (new_kv, expert_ids)

    xs = (params.layers, cache, jnp.asarray(is_moe), jnp.asarray(moe_slot), jnp.asarray(dense_slot))
    h, ((k_new, v_new), expert_ids) = jax.lax.scan(layer, params.embed[tokens], xs)
    return h, append(cache, positions, k_new, v_new), expert_ids


def _routing(cfg: Config) -> moe.Routing:
    return moe.Routing(cfg.experts_per_token, renormalize=cfg.norm_topk_prob)


def _fused_decoder(params: Params, tokens, positions, cache: KVCache, cfg: Config):
    """The fused path's layers (batch 1): llama's fused attention (`llama.fused_layers`), then the routed experts
    through the expert kernel, or a dense layer's gated MLP through the fused gate/up and down calls."""
    from lithos.custom_calls.packed_matvec import packed_gate_up_silu

    L, D, eps = params.layers, params.dense, cfg.rms_norm_eps
    n, k = tokens.shape[1], max(cfg.experts_per_token, 1)
    is_moe, moe_slot, dense_slot = (jnp.asarray(per_layer) for per_layer in _slots(cfg))
    routing = _routing(cfg)

    def routed(h, i, norm):
        x = llama.rms_norm(h, norm, eps)
        y, ids = moe.moe_mlp(x[None], params.experts, moe_slot[i], routing, moe.swiglu_halves, "fused")
        if params.shared is not None:
            y = y + _shared_expert(x, params.shared, moe_slot[i], "fused")
        return h + y[0], ids

    def dense(h, i, norm):
        gated = packed_gate_up_silu(h, D.w_gate, D.w_up, layer=dense_slot[i], norm_weight=norm, eps=eps)
        return llama.residual_matvec(gated, D.w_down, dense_slot[i], h), jnp.full((n, k), -1, jnp.int32)

    def mlp(h, i, expert_ids):
        norm = jax.lax.dynamic_index_in_dim(L.mlp_norm, i, 0, keepdims=False)
        if not cfg.dense_layers:
            h, ids = routed(h, i, norm)
        elif not cfg.moe_layers:
            h, ids = dense(h, i, norm)
        else:  # only the taken branch runs
            h, ids = jax.lax.cond(is_moe[i], routed, dense, h, i, norm)
        return h, expert_ids.at[i].set(ids)

    ids = jnp.full((cfg.num_layers, n, k), -1, jnp.int32)
    return llama.fused_layers(params, tokens, positions, cache, cfg, mlp, ids)


decoder, routed_experts, hidden_states, forward, forward_argmax = moe.family_functions(_decoder)
lm_logits = llama.lm_logits
cache_window = llama.cache_window  # every layer attends within cfg.sliding_window, if set


def params_for_kernels(params: Params, cfg: Config, kernels: str) -> Params:
    """`params` as `kernels` reads them: the fused path's attention reads Q/K/V as llama's does
    (`llama.qkv_in_one_format`); nothing else is laid out."""
    return llama.qkv_in_one_format(params) if kernels == "fused" else params


# --------------------------------------------------------------------------------------------
# What a decode step reads (lithos bench's floor)
# --------------------------------------------------------------------------------------------


def unread_weight_bytes(params: Params, cfg: Config) -> int:
    """Bytes of weights a one-token step does not read: all experts but the top-k of each MoE layer."""
    return moe.unread_expert_bytes(params.experts, cfg.experts_per_token)
