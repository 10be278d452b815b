"""The models' routing (lithos.models.moe: `route`, `Routing`) against a float64 numpy router written from the
models' definitions, and its errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lithos.errors import LithosError
from lithos.models.moe import Routing, route

LAYERS, EXPERTS, HIDDEN = 3, 12, 40


def numpy_route(x, router, bias, routing: Routing):
    """float64: softmax over all then top k (renormalised or not), or top k of the logits then their softmax."""
    logits = x @ router.T + (0.0 if bias is None else bias)
    scores = logits if not routing.softmax_first else np.exp(logits - logits.max(-1, keepdims=True))
    if routing.softmax_first:
        scores = scores / scores.sum(-1, keepdims=True)
    ids = np.argsort(-scores, axis=-1, kind="stable")[:, : routing.top_k]  # stable: lower id first on ties
    top = np.take_along_axis(scores, ids, -1)
    if not routing.softmax_first:
        top = np.exp(top - top[:, :1])
        top = top / top.sum(-1, keepdims=True)
    elif routing.renormalize:
        top = top / top.sum(-1, keepdims=True)
    return top, ids


def inputs(seed: int, tokens: int, biased: bool):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, HIDDEN))
    router = rng.standard_normal((LAYERS, EXPERTS, HIDDEN)) / np.sqrt(HIDDEN)
    bias = rng.standard_normal((LAYERS, EXPERTS)) if biased else None
    return x, router, bias


@pytest.mark.parametrize(
    "routing, biased",
    [(Routing(4), False), (Routing(4, renormalize=True), False), (Routing(3, softmax_first=False), True)],
)
@pytest.mark.parametrize("tokens", [1, 5])
def test_route(routing, biased, tokens):
    x, router, bias = inputs(tokens * 10 + routing.top_k, tokens, biased)
    bias = None if bias is None else jnp.asarray(bias, jnp.float32)
    weights, ids = route(jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32), routing, 2, bias)
    want_weights, want_ids = numpy_route(x, router[2], None if bias is None else np.asarray(bias)[2], routing)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-5, atol=1e-6)


def test_route_ties_go_to_the_lower_expert():
    """Two experts with the same row score alike: the lower id is taken first, as jax.lax.top_k does."""
    x, router, _ = inputs(0, 2, False)
    router[1, 7] = router[1, 2]
    probs = numpy_route(x, router[1], None, Routing(EXPERTS))[1]
    assert (list(probs[0]).index(2) < list(probs[0]).index(7)) and (list(probs[1]).index(2) < list(probs[1]).index(7))
    ids = route(jnp.asarray(x), jnp.asarray(router), Routing(EXPERTS), 1)[1]
    np.testing.assert_array_equal(np.asarray(ids), probs)


def test_route_rejects_what_does_not_fit():
    x, router, bias = (jnp.asarray(a, jnp.float32) for a in inputs(1, 2, True))
    with pytest.raises(LithosError, match="does not fit the router"):
        route(x[:, :-1], router, Routing(2), 0)
    with pytest.raises(LithosError, match=r"must be \[3, 12\]"):
        route(x, router, Routing(2), 0, bias[:, :-1])
    with pytest.raises(LithosError, match="top_k 13 must be 1..12"):
        route(x, router, Routing(13), 0)
