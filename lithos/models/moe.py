"""Mixture-of-experts layers as pure functions: the experts' activations, and expert computation that at small
batch reads only the experts the router selected (the routers: `Routing`).

Weights. Every MoE layer's experts are stacked `[moe_layers, experts, out, in]` (dense or packed,
lithos.quant), in an `Experts` pytree. The expert computation sees them flattened to
`[moe_layers * experts, out, in]` (a free reshape of the leading axes) and names each selected
(token, expert) pair by its global row `layer * experts + expert`. So a decode step gathers exactly
the selected experts out of the whole stack: no per-layer slice of it is ever made (a slice handed
to a loop or to a kernel is copied, and the copy would read every expert).

Two ways to compute, chosen by the number of (token, expert) pairs against the number of experts:

- gathered (decode, speculative verification): one input row per pair, `y = w[id] @ x` for the
  gate/up and the down projection. `kernels="reference"`: `gathered_matvec`, which gathers the
  selected experts' rows (packed planes included) and multiplies in float32, the specification of
  the kernel. `kernels="fused"`: `lithos.custom_calls.expert_matvec`, a kernel that reads the same
  rows and nothing else (for experts whose matrix is [gate | up] and who have no gate/up bias, the gate/up
  with its SwiGLU in one launch: `expert_gate_up_silu`).
- dense (prefill): a loop over the layer's experts, each applied to every token and masked by the
  routing; it reads every expert once, as a dense model's MLP would.

Unrouted experts never reach the output in either: the dense loop selects with `where`, not by
multiplying with a zero weight (0 * NaN is NaN).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lithos.errors import LithosError, UnsupportedModelError
from lithos.quant import MXFP4, QuantizedArray, dequantize, from_planes

# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


@struct.dataclass
class Experts:
    """The routed experts of every MoE layer, stacked `[moe_layers, ...]`; matrices `[out, in]`.

    `gate_up` holds each expert's gate and up projections as one matrix `[2*ffn, hidden]`; how the
    two are laid out in it (halves or interleaved rows) is the family's activation's business.
    """

    router: jax.Array  # [Lm, E, hidden]
    gate_up: jax.Array | QuantizedArray  # [Lm, E, 2*ffn, hidden]
    down: jax.Array | QuantizedArray  # [Lm, E, hidden, ffn]
    router_bias: jax.Array | None = None  # [Lm, E]
    gate_up_bias: jax.Array | None = None  # [Lm, E, 2*ffn]
    down_bias: jax.Array | None = None  # [Lm, E, hidden]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[1]


def expert_shapes(num_layers: int, num_experts: int, hidden: int, ffn: int, biases: bool) -> dict[str, tuple]:
    """Shapes of an `Experts` pytree's fields (keys as in a family's `param_shapes`, "experts." prefixed)."""
    L, E = num_layers, num_experts
    shapes = {
        "experts.router": (L, E, hidden),
        "experts.gate_up": (L, E, 2 * ffn, hidden),
        "experts.down": (L, E, hidden, ffn),
    }
    if biases:
        shapes |= {
            "experts.router_bias": (L, E),
            "experts.gate_up_bias": (L, E, 2 * ffn),
            "experts.down_bias": (L, E, hidden),
        }
    return shapes


# Logical axes of the expert weights (lithos.placement maps them to mesh axes).
EXPERT_AXES: dict[str, tuple[str, ...]] = {
    "experts.router": ("layers", "experts", "embed"),
    "experts.gate_up": ("layers", "experts", "expert_ffn", "embed"),
    "experts.down": ("layers", "experts", "embed", "expert_ffn"),
    "experts.router_bias": ("layers", "experts"),
    "experts.gate_up_bias": ("layers", "experts", "expert_ffn"),
    "experts.down_bias": ("layers", "experts", "embed"),
}

# Elements of a random E2M1 code drawn uniformly from all 16: mean square 68.5/8, so rms ~2.93.
_E2M1_UNIFORM_RMS = math.sqrt(68.5 / 8)


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash (the murmur3 finaliser): consecutive inputs give unrelated outputs."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _random_u32(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Pseudo-random u32 for `shape`, as `[shape[0], prod(shape[1:])]` (callers cast, then reshape),
    each element a hash of its index and the key. Random weights for speed runs need no more than
    that, and inside a jit it fuses into its consumer, so a 57 GB gpt-oss-120b expert stack is drawn
    with no temporaries (a counter-based generator such as threefry needs several times the output
    in scratch). Each leading index hashes its own counter, so no index overflows 32 bits."""
    seed = _mix32(jnp.bitwise_xor.reduce(jax.random.key_data(key).astype(jnp.uint32).ravel()))
    lead = jax.lax.broadcasted_iota(jnp.uint32, (shape[0], math.prod(shape[1:])), 0)
    inner = jax.lax.broadcasted_iota(jnp.uint32, (shape[0], math.prod(shape[1:])), 1)
    return _mix32(inner ^ _mix32(lead * jnp.uint32(0x9E3779B9) + seed))


@partial(jax.jit, static_argnames=("data_shape", "scales_shape", "exponent"))
def _random_mxfp4_planes(key: jax.Array, data_shape, scales_shape, exponent: int) -> tuple[jax.Array, jax.Array]:
    """Codes uniform over all 16 E2M1 values per nibble; block scales 2^(exponent-1) or 2^exponent."""
    data = _random_u32(jax.random.fold_in(key, 0), data_shape).astype(jnp.uint8).reshape(data_shape)
    coin = (_random_u32(jax.random.fold_in(key, 1), scales_shape) >> 31).astype(jnp.int32)
    return data, (exponent - 1 + coin + 127).astype(jnp.uint8).reshape(scales_shape)


def random_mxfp4(key: jax.Array, shape: tuple[int, ...], dtype) -> QuantizedArray:
    """A random MXFP4 weight of logical `shape` `[..., out, in]` built directly in packed form (a dense
    draw of a gpt-oss-120b expert stack would need 230 GB): uniform codes, block scales chosen so
    that each row has rms about 1/sqrt(in), as a dense init would."""
    *lead, cols = shape
    exponent = round(math.log2(1.0 / (_E2M1_UNIFORM_RMS * math.sqrt(cols))))
    planes = MXFP4.plane_shapes(tuple(shape))
    data, scales = _random_mxfp4_planes(key, planes["data"][0], planes["scales"][0], exponent)
    return from_planes(MXFP4, {"data": data, "scales": scales}, dtype)


def _uniform(key: jax.Array, shape: tuple[int, ...], rms: float, dtype) -> jax.Array:
    """Uniform values of root-mean-square `rms` (a hashed draw, see `_random_u32`)."""
    unit = (_random_u32(key, shape) >> 8).astype(jnp.float32) * (2.0**-24)  # [0, 1)
    return ((2 * unit - 1) * (rms * math.sqrt(3))).astype(dtype).reshape(shape)


@partial(jax.jit, static_argnames=("shapes", "dtype", "packed"))
def _init_flat(key, shapes: tuple, dtype, packed: str | None) -> dict[str, Any]:
    out = {}
    for i, (name, shape) in enumerate(shapes):
        k, leaf = jax.random.fold_in(key, i), name.rsplit(".", 1)[-1]
        if name in ("experts.gate_up", "experts.down") and packed == "mxfp4":
            out[name] = random_mxfp4(k, shape, dtype)
        elif "norm" in leaf:
            out[name] = 1.0 + _uniform(k, shape, 0.1, jnp.float32).astype(dtype)
        elif name == "embed" or leaf in ("sinks", "bq", "bk", "bv", "bo") or leaf.endswith("bias"):
            out[name] = _uniform(k, shape, 0.02, dtype)
        else:  # a matrix [..., out, in]: rms 1/sqrt(in), as a dense init would give
            out[name] = _uniform(k, shape, 1.0 / math.sqrt(shape[-1]), dtype)
    return out


def init_flat(
    key: jax.Array, shapes: dict[str, tuple[int, ...]], dtype, packed: str | None = "mxfp4"
) -> dict[str, jax.Array | QuantizedArray]:
    """Random parameters `{"layers.wq": ..., "experts.gate_up": ...}` of a MoE family's `param_shapes`,
    in one compiled program, on the default device, with no temporaries beyond the outputs (a dense
    draw of gpt-oss-120b's experts alone would need 230 GB): expert projections packed as `packed`
    ("mxfp4", or None for dense `dtype`); norms about 1; embeddings, biases and sinks small; every
    matrix of rms 1/sqrt(in). For speed runs and tests: the values are sane, not trained."""
    if packed not in (None, "mxfp4"):
        raise UnsupportedModelError(f"random experts come dense or as mxfp4, not {packed!r}")
    return _init_flat(key, tuple(sorted(shapes.items())), jnp.dtype(dtype), packed)


def unread_expert_bytes(experts: Experts | None, top_k: int, tokens: int = 1) -> int:
    """Bytes of expert tensors that a step of `tokens` tokens cannot read: each MoE layer reads at most
    `tokens * top_k` of its experts' projections and biases (the router is read whole)."""
    if experts is None:
        return 0
    E = experts.num_experts
    read = min(E, tokens * top_k)
    total = 0
    for w in (experts.gate_up, experts.down, experts.gate_up_bias, experts.down_bias):
        if w is None:
            continue
        total += w.nbytes if isinstance(w, QuantizedArray) else int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
    return total - total * read // E


# --------------------------------------------------------------------------------------------
# Routers: router logits [tokens, experts] -> (weights [tokens, k] float32, expert ids [tokens, k] int32)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Routing:
    """How router logits `[n, experts]` pick each token's `top_k` experts and weigh them. `softmax_first`: a
    softmax over every expert, then the top k probabilities, rescaled to sum to one when `renormalize`
    (Qwen3-MoE's `norm_topk_prob`, Mixtral; Qwen2-MoE keeps them as they are). Otherwise the top k logits, then a
    softmax over those k (GPT-OSS). Ties go to the lower expert id (`jax.lax.top_k`).

    XLA runs it on every path: a one-launch router kernel measured slower than these ops on Qwen3-30B-A3B
    (lithos/custom_calls/NOTES.md, "The router in one launch", run 125)."""

    top_k: int
    softmax_first: bool = True
    renormalize: bool = False

    def __call__(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights f32, expert ids int32), each `[n, top_k]`."""
        logits = logits.astype(jnp.float32)
        if not self.softmax_first:
            top, ids = jax.lax.top_k(logits, self.top_k)
            return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
        top, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.top_k)
        if self.renormalize:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        return top, ids.astype(jnp.int32)


def route(x: jax.Array, router: jax.Array, routing: Routing, layer, bias: jax.Array | None = None):
    """Each token's experts: `x` `[n, hidden]` (normed) against layer `layer` of the stacked router
    `[layers, experts, hidden]` (f32 sums of x's products with its rows), plus the router's bias `[layers, experts]`
    where the model has one, routed by `routing`. Returns (weights f32, expert ids int32), each `[n, top_k]`."""
    experts = router.shape[1]
    if x.ndim != 2 or router.ndim != 3 or router.shape[2] != x.shape[1]:
        raise LithosError(f"route: x {list(x.shape)} does not fit the router {list(router.shape)}")
    if bias is not None and bias.shape != router.shape[:2]:
        raise LithosError(f"route: the router bias {list(bias.shape)} must be {list(router.shape[:2])}")
    if not 1 <= routing.top_k <= experts:
        raise LithosError(f"route: top_k {routing.top_k} must be 1..{experts} (the router's experts)")
    at = partial(jax.lax.dynamic_index_in_dim, index=layer, axis=0, keepdims=False)
    logits = jnp.einsum("nd,ed->ne", x, at(router), preferred_element_type=jnp.float32)
    return routing(logits if bias is None else logits + at(bias).astype(jnp.float32))


# --------------------------------------------------------------------------------------------
# Activations: gate_up [n, 2*ffn] -> [n, ffn], computed in float32
# --------------------------------------------------------------------------------------------


def swiglu_halves(gate_up: jax.Array) -> jax.Array:
    """silu(gate) * up with `gate_up` = [gate | up] (Qwen3-MoE, Mixtral)."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)


def clamped_swiglu_interleaved(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GPT-OSS: gate = even columns, up = odd columns; gate clamped above at `limit`, up to
    [-limit, limit]; out = (up + 1) * gate * sigmoid(alpha * gate)."""
    g = gate_up.astype(jnp.float32)
    gate = jnp.minimum(g[..., 0::2], limit)
    up = jnp.clip(g[..., 1::2], -limit, limit)
    return ((up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)).astype(gate_up.dtype)


# --------------------------------------------------------------------------------------------
# Expert computation
# --------------------------------------------------------------------------------------------


def flatten_experts(w):
    """`[moe_layers, experts, ...]` -> `[moe_layers * experts, ...]` for a dense or packed weight (a bitcast)."""
    return jax.tree_util.tree_map(lambda p: p.reshape(-1, *p.shape[2:]), w)


def take_rows(w, ids: jax.Array):
    """The experts `ids` `[n]` of a flattened dense or packed weight, still packed if it was."""
    return jax.tree_util.tree_map(lambda p: p[ids], w)


def gathered_matvec(x: jax.Array, w, ids: jax.Array) -> jax.Array:
    """Reference twin of `lithos.custom_calls.expert_matvec`: `y[n] = w[ids[n]] @ x[n]`.

    x: `[n, in]`; w: `[E, out, in]` dense or QuantizedArray; ids: `[n]` int32. Reads only the rows of
    the experts named (a packed weight is gathered plane by plane, then its exact f32 values are
    taken); multiplies in float32 and returns `[n, out]` in x's dtype.
    """
    picked = take_rows(w, ids)
    values = dequantize(picked, jnp.float32) if isinstance(picked, QuantizedArray) else picked
    return jnp.einsum("ni,noi->no", x, values, preferred_element_type=jnp.float32).astype(x.dtype)


def _matvec_all(x: jax.Array, w) -> jax.Array:
    """`x @ w.T` for one expert's `[out, in]` weight (dense or packed) and all tokens `x` `[N, in]`."""
    values = dequantize(w, jnp.float32) if isinstance(w, QuantizedArray) else w
    return jnp.einsum("ni,oi->no", x, values, preferred_element_type=jnp.float32).astype(x.dtype)


def _add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    return y if bias is None else (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)


def _gathered_experts(x, weights, ids, experts: Experts, first: jax.Array, activation, kernels: str):
    """Sum over each token's k experts, computed only for the (token, expert) pairs routed."""
    n_tokens, k = ids.shape
    rows = (first + ids).reshape(-1)  # [N*k] global expert rows, token-major
    if kernels == "fused":
        from lithos.custom_calls.expert_matvec import expert_gate_up_silu, expert_matvec

        matvec = expert_matvec
    else:
        matvec = gathered_matvec
    gate_up, down = flatten_experts(experts.gate_up), flatten_experts(experts.down)
    gate_up_bias = None if experts.gate_up_bias is None else flatten_experts(experts.gate_up_bias)[rows]
    down_bias = None if experts.down_bias is None else flatten_experts(experts.down_bias)[rows]
    if kernels == "fused" and activation is swiglu_halves and gate_up_bias is None:
        hidden = expert_gate_up_silu(x, gate_up, rows)  # x a row a token: the kernel pairs them
    else:
        pairs = jnp.repeat(x, k, axis=0)  # [N*k, hidden], token-major like `rows`
        hidden = activation(_add_bias(matvec(pairs, gate_up, rows), gate_up_bias))
    out = _add_bias(matvec(hidden, down, rows), down_bias)  # [N*k, hidden]
    out = out.reshape(n_tokens, k, -1).astype(jnp.float32)
    return jnp.einsum("nk,nkd->nd", weights, out)


def _dense_experts(x, weights, ids, experts: Experts, first: jax.Array, activation):
    """Every expert over every token, one expert at a time; each token keeps its routed experts' outputs."""
    n_tokens = x.shape[0]
    E = experts.num_experts
    token = jnp.arange(n_tokens)[:, None]
    combine = jnp.zeros((n_tokens, E), jnp.float32).at[token, ids].add(weights)
    routed = jnp.zeros((n_tokens, E), bool).at[token, ids].set(True)
    gate_up, down = flatten_experts(experts.gate_up), flatten_experts(experts.down)

    def one(e, acc):
        row = first + e
        pick = partial(jax.tree_util.tree_map, lambda p: jax.lax.dynamic_index_in_dim(p, row, 0, keepdims=False))
        gate_up_bias = None if experts.gate_up_bias is None else pick(flatten_experts(experts.gate_up_bias))
        down_bias = None if experts.down_bias is None else pick(flatten_experts(experts.down_bias))
        hidden = activation(_add_bias(_matvec_all(x, pick(gate_up)), gate_up_bias))
        out = _add_bias(_matvec_all(hidden, pick(down)), down_bias).astype(jnp.float32)
        return acc + jnp.where(routed[:, e, None], combine[:, e, None] * out, 0.0)

    return jax.lax.fori_loop(0, E, one, jnp.zeros((n_tokens, x.shape[-1]), jnp.float32))


def uses_gather(n_tokens: int, top_k: int, num_experts: int, kernels: str) -> bool:
    """Whether `n_tokens` tokens take the gathered path: always on the fused path; on the reference
    path while the (token, expert) pairs are no more than the experts (decode and verification)."""
    return kernels == "fused" or n_tokens * top_k <= num_experts


def moe_mlp(
    x: jax.Array,
    experts: Experts,
    layer: jax.Array | int,
    routing: Routing,
    activation: Callable[[jax.Array], jax.Array],
    kernels: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """A routed MLP: router, the selected experts, their weighted sum.

    x: normed hidden states `[batch, tokens, hidden]`; experts: all MoE layers' weights; layer: this
    layer's index in the MoE stack (traced inside a layer loop); routing: how the router's logits pick each
    token's experts; activation: `[n, 2*ffn]` -> `[n, ffn]`.
    Returns the output `[batch, tokens, hidden]` (x's dtype) and the expert ids `[batch*tokens, k]`.
    """
    B, T, D = x.shape
    tokens = x.reshape(B * T, D)
    E = experts.num_experts
    weights, ids = route(tokens, experts.router, routing, layer, experts.router_bias)
    first = jnp.asarray(layer, jnp.int32) * E
    if uses_gather(B * T, ids.shape[-1], E, kernels):
        out = _gathered_experts(tokens, weights, ids, experts, first, activation, kernels)
    else:
        out = _dense_experts(tokens, weights, ids, experts, first, activation)
    return out.astype(x.dtype).reshape(B, T, D), ids


# --------------------------------------------------------------------------------------------
# The functions a MoE family module exposes
# --------------------------------------------------------------------------------------------


def family_functions(layers: Callable) -> tuple[Callable, ...]:
    """`decoder, routed_experts, hidden_states, forward, forward_argmax` for a MoE family, built on
    its `layers(params, tokens, positions, cache, cfg, kernels) -> (h, cache, expert_ids)`: the
    families differ only in their layers; the head and the entry points are the same."""
    from lithos.models import llama

    def check_unplaced(placement, cfg) -> None:
        if placement is not None:
            raise UnsupportedModelError(
                f"{cfg.architecture} does not run split over devices yet (no placement rule for its experts): use tp=1"
            )

    def decoder(params, tokens, positions, cache, cfg, kernels: str = "reference"):
        """The decoder layers over `tokens` `[batch, tokens]` at `positions`: the last layer's output
        `[batch, tokens, hidden]` (before the final norm) and the cache with the new keys/values."""
        h, cache, _ = layers(params, tokens, positions, cache, cfg, kernels)
        return h, cache

    def routed_experts(params, tokens, positions, cache, cfg, kernels: str = "reference"):
        """The experts each layer's router picks for `tokens`: `[layers, batch*tokens, top_k]` int32
        (-1 on dense layers)."""
        return layers(params, tokens, positions, cache, cfg, kernels)[2]

    def hidden_states(params, tokens, positions, cache, cfg, kernels: str = "reference"):
        """`decoder` followed by the final norm."""
        h, cache = decoder(params, tokens, positions, cache, cfg, kernels)
        return llama.rms_norm(h, params.final_norm, cfg.rms_norm_eps), cache

    def forward(params, tokens, positions, cache, cfg, kernels: str = "reference", placement=None):
        """Logits `[batch, tokens, vocab]` (float32) and the updated cache: prefill, decode and
        verification. `placement` (tensor parallelism) is not supported for MoE families yet."""
        check_unplaced(placement, cfg)
        h, cache = decoder(params, tokens, positions, cache, cfg, kernels)
        return llama.head_logits(params, h, cfg, kernels), cache

    def forward_argmax(params, tokens, positions, cache, cfg, kernels: str = "reference", placement=None):
        """Greedy next tokens `[batch, tokens]` (int32) and the updated cache."""
        check_unplaced(placement, cfg)
        h, cache = decoder(params, tokens, positions, cache, cfg, kernels)
        return llama.head_argmax(params, h, cfg, kernels), cache

    return decoder, routed_experts, hidden_states, forward, forward_argmax
