"""Mixture-of-experts pieces (lithos.models.moe) on random inputs: routers and the GPT-OSS activation
against transformers' modules, the gathered (decode) and dense (prefill) expert paths against each
other, dense and MXFP4 experts, the fused path's expert kernel (its jax.numpy twin on a CPU), and
proof that the gathered path reads only the routed experts."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos import quant
from lithos.models import moe

from .conftest import require

E, K, HIDDEN, FFN, LAYERS = 8, 2, 64, 32, 3


def random_experts(seed: int, packed: bool, dtype=jnp.float32) -> moe.Experts:
    shapes = moe.expert_shapes(LAYERS, E, HIDDEN, FFN, biases=True)
    flat = moe.init_flat(jax.random.key(seed), shapes, dtype, packed="mxfp4" if packed else None)
    flat["experts.router"] = flat["experts.router"] * 8  # decisive routing: no near-ties between paths
    return moe.Experts(**{name.split(".", 1)[1]: w for name, w in flat.items()})


@partial(jax.jit, static_argnames="kernels")
def gpt_oss_mlp(x, experts, layer, kernels="reference"):
    activation = partial(moe.clamped_swiglu_interleaved, alpha=1.702, limit=7.0)
    return moe.moe_mlp(x, experts, layer, moe.Routing(K, softmax_first=False), activation, kernels)


def test_routers_match_transformers():
    transformers = require("transformers")
    torch = require("torch")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, HIDDEN)).astype(np.float32)
    weight = rng.standard_normal((E, HIDDEN)).astype(np.float32)
    bias = rng.standard_normal(E).astype(np.float32)
    logits = jnp.asarray(x @ weight.T + bias)

    config = transformers.GptOssConfig(hidden_size=HIDDEN, num_local_experts=E, num_experts_per_tok=K)
    router = GptOssTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(weight))
        router.bias.copy_(torch.tensor(bias))
        _, hf_weights, hf_ids = router(torch.tensor(x))
    weights, ids = moe.Routing(K, softmax_first=False)(logits)
    np.testing.assert_array_equal(np.asarray(ids), hf_ids.numpy())
    np.testing.assert_allclose(np.asarray(weights), hf_weights.numpy(), rtol=1e-5, atol=1e-6)

    for renormalize in (False, True):
        config = transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN, num_experts=E, num_experts_per_tok=K, norm_topk_prob=renormalize
        )
        router = Qwen3MoeTopKRouter(config)
        with torch.no_grad():
            router.weight.copy_(torch.tensor(weight))
            _, hf_weights, hf_ids = router(torch.tensor(x))
        weights, ids = moe.Routing(K, renormalize=renormalize)(jnp.asarray(x @ weight.T))
        np.testing.assert_array_equal(np.asarray(ids), hf_ids.numpy())
        np.testing.assert_allclose(np.asarray(weights), hf_weights.numpy(), rtol=1e-5, atol=1e-6)
        assert np.allclose(np.asarray(weights).sum(-1), 1.0) == renormalize


def test_clamped_swiglu_matches_transformers():
    transformers = require("transformers")
    torch = require("torch")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=FFN))
    gate_up = np.random.default_rng(1).uniform(-12, 12, (5, 2 * FFN)).astype(np.float32)  # past both clamps
    expected = experts._apply_gate(torch.tensor(gate_up)).numpy()
    got = moe.clamped_swiglu_interleaved(jnp.asarray(gate_up), alpha=1.702, limit=7.0)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_decode_and_prefill_paths_agree(packed):
    """Many tokens at once take the dense loop over experts (prefill); one token at a time takes the
    gathered path (decode). Both give the same output, for dense and MXFP4 experts."""
    experts = random_experts(1, packed)
    assert quant.is_quantized(experts.gate_up) == packed
    x = jax.random.normal(jax.random.key(2), (1, 12, HIDDEN), jnp.float32)
    assert not moe.uses_gather(12, K, E, "reference") and moe.uses_gather(1, K, E, "reference")
    dense, dense_ids = gpt_oss_mlp(x, experts, 1)
    for t in range(x.shape[1]):
        one, ids = gpt_oss_mlp(x[:, t : t + 1], experts, 1)
        np.testing.assert_array_equal(np.asarray(ids)[0], np.asarray(dense_ids)[t])
        np.testing.assert_allclose(np.asarray(one)[0, 0], np.asarray(dense)[0, t], rtol=1e-5, atol=1e-5)
    assert float(jnp.std(dense)) > 0.1


@pytest.mark.parametrize("packed", [False, True])
def test_fused_path_equals_reference(packed):
    """`kernels="fused"` runs the routed experts through `expert_matvec` (its jax.numpy twin on a CPU,
    the kernel on a GPU), in bf16 as the kernel takes it."""
    experts = random_experts(3, packed, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(4), (1, 3, HIDDEN), jnp.bfloat16)
    ref, ref_ids = gpt_oss_mlp(x, experts, 2)
    fused, fused_ids = gpt_oss_mlp(x, experts, 2, kernels="fused")
    np.testing.assert_array_equal(np.asarray(fused_ids), np.asarray(ref_ids))
    ref, fused = np.asarray(ref, np.float32), np.asarray(fused, np.float32)
    np.testing.assert_allclose(fused, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def poison_unrouted(experts: moe.Experts, layer: int, keep: set[int]) -> moe.Experts:
    """NaN in every weight and bias of every expert of every layer, except experts `keep` of `layer`."""
    poisoned = np.ones((LAYERS, E), bool)
    poisoned[layer, sorted(keep)] = False
    mask = jnp.asarray(poisoned)

    def poison(w):
        if w is None:
            return None
        m = mask.reshape(mask.shape + (1,) * (w.ndim - 2))
        if quant.is_quantized(w):  # E8M0 scale 0xFF: the whole block is NaN
            return w.replace(scales=jnp.where(m, jnp.uint8(0xFF), w.scales))
        return jnp.where(m, jnp.nan, w)

    return experts.replace(
        gate_up=poison(experts.gate_up),
        down=poison(experts.down),
        gate_up_bias=poison(experts.gate_up_bias),
        down_bias=poison(experts.down_bias),
    )


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kernels", ["reference", "fused"])
def test_decode_reads_only_the_routed_experts(packed, kernels):
    dtype = jnp.bfloat16 if kernels == "fused" else jnp.float32  # the expert kernel takes bf16
    experts = random_experts(5, packed, dtype)
    x = jax.random.normal(jax.random.key(6), (1, 1, HIDDEN), dtype)
    clean, ids = gpt_oss_mlp(x, experts, 1, kernels)
    routed = set(np.asarray(ids).ravel().tolist())
    assert len(routed) == K
    poisoned, _ = gpt_oss_mlp(x, poison_unrouted(experts, 1, routed), 1, kernels)
    assert np.isfinite(np.asarray(poisoned, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(clean))
    # The same poison on one routed expert does reach the output: the check can fail.
    broken, _ = gpt_oss_mlp(x, poison_unrouted(experts, 1, routed - {min(routed)}), 1, kernels)
    assert np.isnan(np.asarray(broken, np.float32)).all()


def test_random_mxfp4_has_a_dense_init_scale():
    w = moe.random_mxfp4(jax.random.key(7), (4, 64, 256), jnp.bfloat16)
    assert w.format is quant.MXFP4 and w.shape == (4, 64, 256) and w.dtype == jnp.bfloat16
    values = np.asarray(jax.jit(quant.dequantize, static_argnums=1)(w, jnp.float32))
    assert np.isfinite(values).all()
    rms = float(np.sqrt(np.mean(values**2)))
    assert 0.5 / 16 < rms < 2 / 16  # 1/sqrt(in) = 1/16, within the scale's power-of-two steps


@pytest.mark.parametrize("packed", [False, True])
def test_unread_expert_bytes_leaves_the_top_k(packed):
    experts = random_experts(8, packed)
    per_layer = sum(
        (w.nbytes if quant.is_quantized(w) else w.size * w.dtype.itemsize)
        for w in (experts.gate_up, experts.down, experts.gate_up_bias, experts.down_bias)
    )
    assert moe.unread_expert_bytes(experts, K) == per_layer * (E - K) // E
    assert moe.unread_expert_bytes(experts, K, tokens=E) == 0
    assert moe.unread_expert_bytes(None, K) == 0
