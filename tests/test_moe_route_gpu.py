"""The router kernel (csrc/moe_route.cu) against its reference twin on the GPU, over the routers of the mixture
models served (experts, top k, hidden size, how they route), one and several tokens, a stacked router read at a
layer, and an odd hidden size that takes the scalar loads. The expert ids must be the same; the weights within f32
rounding. Skipped unless jax has a CUDA or ROCm device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.custom_calls import build
from lithos.custom_calls.moe_route import Routing, moe_route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(build.gpu_platform() is None, reason="needs a CUDA or ROCm GPU"),
]

# name: (experts, hidden, routing, biased)
ROUTERS = {
    "qwen3-30b-a3b": (128, 2048, Routing(8, renormalize=True), False),
    "qwen1.5-moe-a2.7b": (60, 2048, Routing(4), False),
    "gpt-oss-20b": (32, 2880, Routing(4, softmax_first=False), True),
    "mixtral-8x7b": (8, 4096, Routing(2, renormalize=True), False),
    "odd": (37, 100, Routing(5), True),
}


def router_inputs(name: str, tokens: int):
    experts, hidden, routing, biased = ROUTERS[name]
    kx, kr, kb = jax.random.split(jax.random.key(len(name) * 100 + tokens), 3)
    x = jax.random.normal(kx, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
    router = (jax.random.normal(kr, (3, experts, hidden), jnp.float32) / np.sqrt(hidden)).astype(jnp.bfloat16)
    bias = jax.random.normal(kb, (3, experts), jnp.float32).astype(jnp.bfloat16) if biased else None
    return x, router, bias, routing


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_moe_route(name, tokens):
    x, router, bias, routing = router_inputs(name, tokens)

    def run(path):
        return jax.jit(lambda x, r, b: moe_route(x, r, routing, layer=2, bias=b, path=path))(x, router, bias)

    (weights, ids), (want_weights, want_ids) = run("ffi"), run("reference")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=2e-5, atol=1e-6)


def test_moe_route_ties_go_to_the_lower_expert():
    """Three experts with one row score alike (the kernel's sums for them are the same arithmetic): the lower ids
    come first, as jax.lax.top_k orders ties."""
    x, router, _, _ = router_inputs("qwen3-30b-a3b", 4)
    router = router.at[2, 100].set(router[2, 3]).at[2, 50].set(router[2, 3])
    weights, ids = moe_route(x, router, Routing(128), layer=2, path="ffi")
    for row, weight in zip(np.asarray(ids), np.asarray(weights), strict=True):
        order = list(row)
        assert order.index(3) < order.index(50) < order.index(100)
        assert weight[order.index(3)] == weight[order.index(50)] == weight[order.index(100)]
        assert sorted(order) == list(range(128))
