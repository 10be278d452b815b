"""`kernels="fused"` against `kernels="reference"` through the whole model.

On a CPU the fused path runs the kernels' jax.numpy twins, which checks the plumbing (stacked
weights + layer index, in-place cache writes, the fused head); on a GPU it runs the FFI kernels in
bf16, which checks the kernels inside the real decode loop.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos.bench import model_shape
from lithos.errors import UnsupportedModelError
from lithos.kv_cache import init_cache
from lithos.models import llama

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")


@pytest.mark.parametrize("arch", ["llama_hd64", "mistral_hd64_window", "qwen3_hd64", "qwen2_hd64", "llama_bias_hd64"])
def test_fused_generation_equals_reference(hf_checkpoint, arch):
    path = hf_checkpoint(arch, tied=False)
    dtype = "bfloat16" if ON_GPU else "float32"
    ref = lithos.load(path, dtype=dtype, max_len=128)
    fused = lithos.load(path, dtype=dtype, max_len=128, kernels="fused")
    for prompt in ("hello", "the quick brown fox jumps"):
        assert fused.generate(prompt, raw=True, max_new_tokens=24).token_ids == ref.generate(
            prompt, raw=True, max_new_tokens=24
        ).token_ids
    sampled = dict(raw=True, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=5)
    assert fused.generate("sample", **sampled).token_ids == ref.generate("sample", **sampled).token_ids
    # n-gram speculative decoding: its verification rounds run the fused layers over several tokens
    greedy = dict(raw=True, max_new_tokens=24)
    plain = fused.generate("the quick brown fox jumps", **greedy).token_ids
    assert fused.generate("the quick brown fox jumps", spec="ngram", **greedy).token_ids == plain


@pytest.mark.parametrize("arch", ["qwen3_hd64", "qwen2_hd64"])
@pytest.mark.parametrize("qk_format, v_format", [("q8_0", "q8_0"), ("q4_1", "q8_0")])
def test_fused_norms_and_biases_over_packed_attention(hf_checkpoint, arch, qk_format, v_format):
    """Qwen3's per-head Q/K norms and Qwen2's Q/K/V biases on the fused path with Q/K/V packed, in one format or
    two (three projection calls, then the biases, the norms, the rotation and the cache write): a step's logits
    equal the reference path's over the same weights (in f32 through the twins on a CPU; in bf16, which the packed
    kernels take, within bf16 rounding on a GPU)."""
    from lithos import quant
    from lithos.checkpoint import load_checkpoint

    ck = load_checkpoint(hf_checkpoint(arch), dtype="bfloat16" if ON_GPU else "float32", use_cache=False)
    formats = {"layers.wq": qk_format, "layers.wk": qk_format, "layers.wv": v_format}
    params = quant.random_packed_params(ck.params, formats)
    ref = _step_logits(ck.cfg, params, "reference", 24, 3)
    fused = _step_logits(ck.cfg, params, "fused", 24, 3)
    tol = 3e-2 if ON_GPU else 1e-4
    np.testing.assert_allclose(fused, ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("arch", ["qwen2_hd64", "llama_bias_hd64", "qwen3_hd64"])
@pytest.mark.parametrize("qkv_format", [None, "q8_0"])
def test_fused_new_qkv_kernels(hf_checkpoint, monkeypatch, arch, qkv_format):
    """Q/K/V biases added in the Q/K/V kernel's epilogue (one launch), per-head Q/K norms through
    `qkv_project` and `qk_norm_rope_append` (two), Q/K/V bf16 or packed, never through the split form: a step's
    logits equal the reference path's."""
    from lithos import quant
    from lithos.checkpoint import load_checkpoint
    from lithos.custom_calls import packed_matvec

    def no_split(*args, **kwargs):
        raise AssertionError("Q/K/V took the split form")

    monkeypatch.setattr(packed_matvec, "_qkv_split", no_split)
    ck = load_checkpoint(hf_checkpoint(arch), dtype="bfloat16" if ON_GPU else "float32", use_cache=False)
    params = ck.params
    if qkv_format:
        params = quant.random_packed_params(params, dict.fromkeys(("layers.wq", "layers.wk", "layers.wv"), qkv_format))
    ref = _step_logits(ck.cfg, params, "reference", 24, 3)
    fused = _step_logits(ck.cfg, params, "fused", 24, 3)
    tol = 3e-2 if ON_GPU else 1e-4
    np.testing.assert_allclose(fused, ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_qkv_of_mixed_k_quants_in_one_format(monkeypatch, qk_norm):
    """A Q4_K_M file's Q4_K Q and K beside its K_MIX V are laid out all in K_MIX for the fused path
    (`params_for_kernels`), every value the same, and a step takes the Q/K/V kernels, not the split form, with the
    reference path's logits. The other paths keep the file's formats."""
    from lithos import quant
    from lithos.custom_calls import packed_matvec
    from lithos.models import params_for_kernels
    from lithos.quant import dequantize

    cfg = llama.Config(
        "Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM",
        *(300, 256, 512, 2, 4, 2, 64),  # vocab, hidden, ffn, layers, heads, kv heads, head_dim
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qk_norm=qk_norm,
    )
    dtype = jnp.bfloat16 if ON_GPU else jnp.float32
    params = llama.init_params(cfg, jax.random.key(0), dtype)
    params = quant.random_packed_params(params, {"layers.wq": "q4_k", "layers.wk": "q4_k", "layers.wv": "k_mix"})
    assert params_for_kernels(params, cfg, "reference") is params

    def no_split(*args, **kwargs):
        raise AssertionError("Q/K/V took the split form")

    laid_out = params_for_kernels(params, cfg, "fused")
    for name in ("wq", "wk", "wv"):
        before, after = getattr(params.layers, name), getattr(laid_out.layers, name)
        assert after.format.name == "k_mix"
        np.testing.assert_array_equal(np.asarray(dequantize(after, jnp.float32)), dequantize(before, jnp.float32))
    monkeypatch.setattr(packed_matvec, "_qkv_split", no_split)
    ref = _step_logits(cfg, params, "reference", 24, 3)
    fused = _step_logits(cfg, laid_out, "fused", 24, 3)
    tol = 3e-2 if ON_GPU else 1e-4
    np.testing.assert_allclose(fused, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_fused_rejects_what_it_does_not_implement(hf_checkpoint):
    with pytest.raises(UnsupportedModelError, match="megakernel kernels do not implement Q/K/V biases"):
        lithos.load(hf_checkpoint("qwen2_hd64"), dtype="float32", kernels="megakernel")
    with pytest.raises(UnsupportedModelError, match="head_dim 16"):
        lithos.load(hf_checkpoint("llama3"), dtype="float32", kernels="fused")


def _step_logits(cfg, params, kernels, context, new_tokens):
    """Logits of `new_tokens` tokens after a random `context`-token prefix, through one path."""
    forward = jax.jit(partial(llama.forward, cfg=cfg, kernels=kernels))
    prefill = jax.jit(partial(llama.forward, cfg=cfg, kernels="reference"))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, context + new_tokens)), jnp.int32)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, context + 16, cfg.head_dim, params.embed.dtype)
    _, cache = prefill(params, tokens[:, :context], jnp.arange(context)[None], cache)
    logits, _ = forward(params, tokens[:, context:], jnp.arange(context, context + new_tokens)[None], cache)
    return np.asarray(logits[0], np.float32)


@pytest.mark.skipif(not ON_GPU, reason="the FFI kernels need a CUDA or ROCm GPU")
@pytest.mark.parametrize("shape", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b", "qwen2.5-7b"])
@pytest.mark.parametrize("new_tokens", [1, 8])
def test_fused_logits_within_bf16_tolerance_on_model_shapes(shape, new_tokens):
    cfg = model_shape(shape)
    params = llama.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    ref = _step_logits(cfg, params, "reference", 1000, new_tokens)
    fused = _step_logits(cfg, params, "fused", 1000, new_tokens)
    scale = np.abs(ref).max()
    assert np.abs(fused - ref).max() <= 0.03 * scale, (np.abs(fused - ref).max(), scale)
    # Greedy choices agree wherever the reference's top two are not a near-tie.
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * scale
    np.testing.assert_array_equal(fused.argmax(-1)[clear], ref.argmax(-1)[clear])
