"""The mixture-of-experts families' fused path (Qwen3-MoE with its per-head Q/K norms and a dense layer; Qwen2-MoE with
Q/K/V biases and shared experts; Mixtral with a sliding window): llama's fused attention calls, the expert kernel
and the dense layers' fused MLP calls, against the reference path over the same bf16 weights. On a CPU the kernels'
jax.numpy twins run, which checks the plumbing (layer and slot indices, the cache written in place, the experts each
layer picked); on a GPU the kernels."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lithos.checkpoint import load_checkpoint
from lithos.kv_cache import init_cache
from lithos.models import family_of, llama

from .conftest import save_tiny_moe

PROMPT, CACHE = 10, 32
# Head size 64, one the attention kernels are built for.
FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, head_dim=64)
        | dict(num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=2)
        | dict(norm_topk_prob=True, mlp_only_layers=[1]),  # layer 1 dense
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64)
        | dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=8)
        | dict(num_experts_per_tok=2, mlp_only_layers=[1]),  # Q/K/V biases, shared experts
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(hidden_size=128, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
        | dict(num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2, sliding_window=6),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    config_class, architecture, shape = FAMILIES[request.param]
    path, _ = save_tiny_moe(tmp_path_factory.mktemp(request.param), config_class, architecture, shape)
    ck = load_checkpoint(path, dtype="bfloat16", use_cache=False)  # the expert kernel takes bf16
    return ck.cfg, ck.params


@pytest.mark.parametrize("new_tokens", [1, 3])
def test_fused_step_equals_reference(model, new_tokens, monkeypatch):
    """The experts' gate/up through `expert_gate_up_silu` where the family's matrix is [gate | up] (on a CPU through
    its twin)."""
    cfg, params = model
    assert not llama.kernel_gaps(cfg, "fused")
    family = family_of(cfg)
    calls = []
    fused_layers = llama.fused_layers
    monkeypatch.setattr(llama, "fused_layers", lambda *a, **k: calls.append(1) or fused_layers(*a, **k))

    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, PROMPT + new_tokens)))
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, CACHE, cfg.head_dim, jnp.bfloat16)
    _, cache = family.forward(params, tokens[:, :PROMPT], jnp.arange(PROMPT)[None], cache, cfg)
    step = (params, tokens[:, PROMPT:], jnp.arange(PROMPT, PROMPT + new_tokens)[None], cache, cfg)
    ref, ref_cache = family.forward(*step, kernels="reference")
    fused, fused_cache = family.forward(*step, kernels="fused")
    assert calls, "the fused path did not run the fused attention"

    ref, fused = np.asarray(ref[0], np.float32), np.asarray(fused[0], np.float32)
    scale = np.abs(ref).max()
    assert np.abs(fused - ref).max() <= 0.03 * scale, (np.abs(fused - ref).max(), scale)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * scale
    assert clear.any()
    np.testing.assert_array_equal(fused.argmax(-1)[clear], ref.argmax(-1)[clear])
    written = np.s_[:, :, :, PROMPT : PROMPT + new_tokens]  # [layers, batch, kv_heads, slots, head_dim]
    for a, b in ((ref_cache.k, fused_cache.k), (ref_cache.v, fused_cache.v)):
        a, b = np.asarray(a[written], np.float32), np.asarray(b[written], np.float32)
        assert np.abs(a - b).max() <= 0.02 * np.abs(a).max()
    np.testing.assert_array_equal(np.asarray(fused_cache.k[:, :, :, :PROMPT]), np.asarray(cache.k[:, :, :, :PROMPT]))

    ids = {kernels: np.asarray(family.routed_experts(*step, kernels=kernels)) for kernels in ("reference", "fused")}
    assert (ids["fused"] >= 0).sum() == (ids["reference"] >= 0).sum() > 0  # dense layers: -1 on both
    assert (ids["fused"] == ids["reference"]).mean() > 0.9  # a near-tie of two experts' scores may flip in bf16


def test_fused_path_keeps_jax_numpy_attention_where_the_kernels_do_not_take_it(tmp_path, monkeypatch):
    """A head size the attention kernels are not built for (Mixtral's shape with 4 heads of 32): the attention stays
    on jax.numpy, the experts and the head run fused, and the step equals the reference's."""
    config_class, architecture, shape = FAMILIES["mixtral"]
    path, _ = save_tiny_moe(tmp_path, config_class, architecture, shape | dict(num_attention_heads=4))
    ck = load_checkpoint(path, dtype="bfloat16", use_cache=False)
    cfg, params = ck.cfg, ck.params
    assert llama.kernel_gaps(cfg, "fused") == ["head_dim 32 (kernels exist for 64, 128, 256)"]
    monkeypatch.setattr(llama, "fused_layers", lambda *a, **k: pytest.fail("fused attention on head_dim 32"))
    tokens = jnp.asarray([[3, 1, 4, 1, 5]])
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, CACHE, cfg.head_dim, jnp.bfloat16)
    step = (params, tokens, jnp.arange(5)[None], cache, cfg)
    ref, fused = (np.asarray(family_of(cfg).forward(*step, kernels=k)[0], np.float32) for k in ("reference", "fused"))
    assert np.abs(fused - ref).max() <= 0.03 * np.abs(ref).max()


def test_fused_generation_and_speculative_decoding_equal_the_reference(tmp_path):
    """`lithos.load(..., kernels="fused")` of a Qwen3-MoE checkpoint: greedy generation equals the reference path's,
    and n-gram speculative decoding (its verification rounds through the fused layers at several tokens) equals
    plain decoding."""
    import lithos

    config_class, architecture, shape = FAMILIES["qwen3_moe"]
    path, _ = save_tiny_moe(tmp_path, config_class, architecture, shape)
    ref = lithos.load(path, dtype="bfloat16", max_len=64)
    fused = lithos.load(path, dtype="bfloat16", max_len=64, kernels="fused")
    greedy = dict(raw=True, max_new_tokens=16)
    expected = ref.generate("the quick brown fox", **greedy).token_ids
    assert len(set(expected)) > 3, expected
    assert fused.generate("the quick brown fox", **greedy).token_ids == expected
    assert fused.generate("the quick brown fox", spec="ngram", **greedy).token_ids == expected
