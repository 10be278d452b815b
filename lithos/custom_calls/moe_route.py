"""A mixture of experts' router for 1..16 tokens (kernel in csrc/moe_route.cu) beside its reference twin: the
layer's router logits, then the experts each token takes and their weights, as the model's `Routing` says.

The twin is the model's own arithmetic (the logits as an f32 einsum of the bf16 input and router, the softmax and
`jax.lax.top_k`), so the kernel is held to the routing decisions the reference path makes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls.dispatch import (
    absent,
    at_layer,
    call_kernel,
    check_tokens,
    dispatch,
    layer_index,
    require_bf16,
    stacked,
)
from lithos.errors import LithosError

MAX_EXPERTS = 512  # csrc/moe_route.cu kMaxExperts: the logits a block keeps in shared memory


@dataclasses.dataclass(frozen=True)
class Routing:
    """How router logits `[n, experts]` pick each token's `top_k` experts and weigh them. `softmax_first`: a
    softmax over every expert, then the top k probabilities, rescaled to sum to one when `renormalize`
    (Qwen3-MoE's `norm_topk_prob`, Mixtral; Qwen2-MoE keeps them as they are). Otherwise the top k logits, then a
    softmax over those k (GPT-OSS). Ties go to the lower expert id (`jax.lax.top_k`)."""

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


def router_logits(x: jax.Array, router: jax.Array, bias: jax.Array | None, layer) -> jax.Array:
    """f32 logits `[n, experts]` of `x` `[n, hidden]` against layer `layer` of the stacked router (and its bias)."""
    logits = jnp.einsum("nd,ed->ne", x, at_layer(router, layer), preferred_element_type=jnp.float32)
    return logits if bias is None else logits + at_layer(bias, layer)


def _reference(x, router, bias, layer, *, routing):
    return routing(router_logits(x, router, bias, layer))


def _kernel(x, router, bias, layer, *, routing):
    n, k = x.shape[0], routing.top_k
    out_types = [
        jax.ShapeDtypeStruct((n, k), jnp.float32),
        jax.ShapeDtypeStruct((n, k), jnp.int32),
        jax.ShapeDtypeStruct((n, router.shape[1]), jnp.float32),  # the logits: the kernel's blocks hand them over
    ]
    weights, ids, _ = call_kernel(
        "moe_route",
        "LithosMoeRoute",
        out_types,
        x,
        router,
        absent(jnp.float32) if bias is None else bias.astype(jnp.float32),
        layer,
        top_k=np.int32(k),
        softmax_first=bool(routing.softmax_first),
        renormalize=bool(routing.renormalize),
    )
    return weights, ids


def moe_route(
    x: jax.Array,
    router: jax.Array,
    routing: Routing,
    *,
    layer: int | jax.Array | None = None,
    bias: jax.Array | None = None,
    path: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Each token's experts: `x` `[n, hidden]` (normed) against the router `[experts, hidden]` or stacked
    `[layers, experts, hidden]` (layer `layer`), plus `bias` `[experts]` / `[layers, experts]` where the model has
    one, routed by `routing`. Returns (weights f32, expert ids int32), each `[n, top_k]`."""
    router = stacked("router", router, 2, layer)
    bias = stacked("router bias", bias, 1, layer)
    experts = router.shape[1]
    if x.ndim != 2 or router.shape[2] != x.shape[1]:
        raise LithosError(f"moe_route: x {list(x.shape)} does not fit the router {list(router.shape)}")
    if bias is not None and bias.shape[1] != experts:
        raise LithosError(f"moe_route: the router bias {list(bias.shape)} must have {experts} experts")
    if not 1 <= routing.top_k <= experts:
        raise LithosError(f"moe_route: top_k {routing.top_k} must be 1..{experts} (the router's experts)")

    def check():
        check_tokens("moe_route", x.shape[0])
        require_bf16("moe_route", x=x, router=router)
        if experts > MAX_EXPERTS:
            raise LithosError(f"moe_route: the kernel routes at most {MAX_EXPERTS} experts, got {experts}; use "
                              "path='reference'")  # fmt: skip

    return dispatch(
        path,
        functools.partial(_reference, routing=routing),
        functools.partial(_kernel, routing=routing),
        *(x, router, bias, layer_index(layer)),
        check=check,
    )
