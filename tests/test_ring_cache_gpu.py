"""The ring KV cache's kernels against their reference twins on the GPU: the K/V append (bf16 and packed
weights; bf16 and FP8 caches), decode attention and the megakernel at positions that wrap past slot 0,
for 1 and 4 query positions; then the fused and megakernel greedy decode of a windowed model, far past
its ring, against the reference path and against the same kernels over a linear cache.

Skipped unless jax has a CUDA or ROCm device. Run on the device machine with
`PYTHONPATH=. python3 -m pytest tests/test_ring_cache_gpu.py`; tests/test_ring_cache.py covers the twins
on CPU.
"""

from __future__ import annotations

import dataclasses
import zlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos import quant
from lithos.custom_calls import build, decode_attention, qkv_rope_append
from lithos.custom_calls.megakernel import decode_step
from lithos.custom_calls.packed_matvec import packed_qkv_rope_append
from lithos.kv_cache import init_cache
from lithos.models import llama

from .test_custom_calls_gpu import assert_matches, both_paths, rand
from .test_megakernel import SHAPES, random_step
from .test_ring_cache import save_mistral

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(build.gpu_platform() is None, reason="needs a CUDA or ROCm GPU"),
]

BF16 = jnp.bfloat16
WINDOW = 100
# hidden, heads, kv heads, head_dim
HEADS = {"llama-3.2-1b": (2048, 32, 8, 64), "llama-3.1-8b": (4096, 32, 8, 128)}
CASES = [(model, tokens, cache) for model in HEADS for tokens in (1, 4) for cache in ("bf16", "fp8")]


def keys(name: str, n: int):
    return jax.random.split(jax.random.PRNGKey(zlib.crc32(name.encode())), n)


def wrapping_positions(tokens: int, slots: int) -> jax.Array:
    """Consecutive positions deep into the sequence whose slots cross slot 0 (for more than one token)."""
    start = 37 * slots - tokens // 2
    return jnp.arange(start, start + tokens, dtype=jnp.int32)


def ring_caches(key, cache: str, layers: int, kv_heads: int, slots: int, dim: int):
    """Random K and V rings `[layers, 1, kv_heads, slots, head_dim]` (every slot written): bf16, or E4M3
    codes (NaN codes left out) with power-of-two scales `[layers, 1, kv_heads]`. Returns (k, v, scales)."""
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (layers, 1, kv_heads, slots, dim)
    if cache == "bf16":
        return rand(k1, *shape), rand(k2, *shape), {}
    magnitude = jax.random.randint(k1, (2, *shape), 0, 0x7F)  # 0x7F is NaN
    sign = jax.random.randint(k2, (2, *shape), 0, 2) << 7
    codes = (magnitude | sign).astype(jnp.uint8)
    exponents = jax.random.randint(k3, (2, layers, 1, kv_heads), -6, 2)
    scales = jnp.ldexp(jnp.ones((2, layers, 1, kv_heads), jnp.float32), exponents)
    return codes[0], codes[1], dict(k_scale=scales[0], v_scale=scales[1])


def assert_same_entries(kernel_cache, reference_cache, written: np.ndarray, fp8: bool):
    """The slots this call wrote match (FP8: the same codes but for rare rounding ties); the others are untouched."""
    k, r = np.asarray(kernel_cache), np.asarray(reference_cache)
    others = np.setdiff1d(np.arange(k.shape[3]), written)
    np.testing.assert_array_equal(k[:, :, :, others], r[:, :, :, others])
    if fp8:
        assert (k[:, :, :, written] == r[:, :, :, written]).mean() > 0.99
    else:
        assert_matches(k[:, :, :, written], r[:, :, :, written])


@pytest.mark.parametrize("model,tokens,cache", CASES)
def test_qkv_rope_append_into_a_ring(model, tokens, cache):
    hidden, heads, kv_heads, dim = HEADS[model]
    slots = WINDOW + tokens - 1
    k = keys(f"ring-qkv-{model}-{tokens}-{cache}", 6)
    h, norm = rand(k[0], tokens, hidden), 1 + rand(k[1], 2, hidden, scale=0.1)
    wq = rand(k[2], 2, heads * dim, hidden, scale=hidden**-0.5)
    wk, wv = (rand(kk, 2, kv_heads * dim, hidden, scale=hidden**-0.5) for kk in k[3:5])
    k_cache, v_cache, scales = ring_caches(k[5], cache, 2, kv_heads, slots, dim)
    inv_freq = jnp.asarray(1.0 / 5e5 ** (np.arange(0, dim, 2) / dim), jnp.float32)
    positions = wrapping_positions(tokens, slots)
    options = dict(layer=1, eps=1e-5, ring=True, **scales)
    got, want = both_paths(qkv_rope_append, h, norm, wq, wk, wv, inv_freq, positions, k_cache, v_cache, **options)
    assert_matches(got[0], want[0])
    written = np.asarray(positions) % slots
    for kernel_cache, reference_cache in zip(got[1:], want[1:], strict=True):
        assert_same_entries(kernel_cache, reference_cache, written, fp8=cache == "fp8")


@pytest.mark.parametrize("tokens", [1, 4])
def test_packed_qkv_rope_append_into_a_ring(tokens):
    hidden, heads, kv_heads, dim = HEADS["llama-3.2-1b"]
    slots = WINDOW + tokens - 1
    k = keys(f"ring-packed-qkv-{tokens}", 6)
    h, norm = rand(k[0], tokens, hidden), 1 + rand(k[1], 2, hidden, scale=0.1)
    wq = quant.quantize(rand(k[2], 2, heads * dim, hidden, scale=hidden**-0.5), "mxfp4")
    wk, wv = (quant.quantize(rand(kk, 2, kv_heads * dim, hidden, scale=hidden**-0.5), "mxfp4") for kk in k[3:5])
    k_cache, v_cache, _ = ring_caches(k[5], "bf16", 2, kv_heads, slots, dim)
    inv_freq = jnp.asarray(1.0 / 5e5 ** (np.arange(0, dim, 2) / dim), jnp.float32)
    positions = wrapping_positions(tokens, slots)
    run = jax.jit(
        lambda path, h, kc, vc: packed_qkv_rope_append(
            h, norm, wq, wk, wv, inv_freq, positions, kc, vc, layer=1, ring=True, path=path
        ),
        static_argnums=0,
    )
    got, want = run("ffi", h, k_cache, v_cache), run("reference", h, k_cache, v_cache)
    assert_matches(got[0], want[0])
    for kernel_cache, reference_cache in zip(got[1:], want[1:], strict=True):
        assert_same_entries(kernel_cache, reference_cache, np.asarray(positions) % slots, fp8=False)


@pytest.mark.parametrize("model,tokens,cache", CASES)
@pytest.mark.parametrize("spare", [0, 15])  # a ring made for up to 16 new tokens has 15 spare slots at T = 1
def test_decode_attention_over_a_ring(model, tokens, cache, spare):
    _, heads, kv_heads, dim = HEADS[model]
    slots = WINDOW + tokens - 1 + spare
    k = keys(f"ring-attention-{model}-{tokens}-{cache}-{spare}", 2)
    q = rand(k[0], tokens, heads, dim)
    k_cache, v_cache, scales = ring_caches(k[1], cache, 2, kv_heads, slots, dim)
    positions = wrapping_positions(tokens, slots)
    options = dict(layer=1, sliding_window=WINDOW, ring=True, **scales)
    assert_matches(*both_paths(decode_attention, q, k_cache, v_cache, positions, **options))


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


@pytest.mark.parametrize("tokens", [1, 4])
def test_megakernel_over_a_ring(tokens):
    shape = dataclasses.replace(SHAPES["smollm2-like"], layers=4)
    slots = WINDOW + tokens - 1
    context = 37 * slots - tokens // 2  # every slot holds a random entry; the step's positions wrap
    weights, h0, positions, inv_freq, k_cache, v_cache = random_step(
        shape, tokens, context, BF16, seed=tokens, max_len=slots
    )

    def run(path):
        step = jax.jit(lambda *a: decode_step(*a, eps=1e-5, window=WINDOW, ring=True, head="logits", path=path))
        caches = (jnp.array(k_cache, copy=True), jnp.array(v_cache, copy=True))  # updated in place
        return jax.block_until_ready(step(weights, h0, positions, inv_freq, *caches))

    kernel, spec = run("ffi"), run("reference")
    assert relative_error(kernel.h, spec.h) < 2e-2
    assert relative_error(kernel.logits, spec.logits) < 2e-2
    written = np.asarray(positions) % slots
    for got, want in ((kernel.k_cache, spec.k_cache), (kernel.v_cache, spec.v_cache)):
        others = np.setdiff1d(np.arange(slots), written)
        np.testing.assert_array_equal(np.asarray(got)[:, :, :, others], np.asarray(want)[:, :, :, others])
        assert (
            relative_error(
                np.asarray(got, np.float32)[:, :, :, written], np.asarray(want, np.float32)[:, :, :, written]
            )
            < 1e-2
        )


@pytest.fixture(scope="module")
def windowed_hd64(tmp_path_factory):
    """A tiny random Mistral with a 16-token window and head_dim 64 (a size the kernels exist for)."""
    return save_mistral(tmp_path_factory.mktemp("mistral-w16-hd64"), 16, seed=3, hidden=128, head_dim=64)


def reference_logits(model, ids: list[int], new: list[int]) -> np.ndarray:
    """The logits `[len(new), vocab]` the reference path picks each of `new` from after the prompt `ids`:
    the prompt prefilled (an FP8 cache takes its scales from it, as in generation), then `new` in one block."""
    cfg = model.cfg
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, len(ids) + len(new), cfg.head_dim, model.kv_cache_dtype)
    forward = jax.jit(partial(llama.forward, cfg=cfg))
    first, cache = forward(model.params, jnp.asarray([ids]), jnp.arange(len(ids))[None], cache)
    positions = jnp.arange(len(ids), len(ids) + len(new) - 1)[None]
    rest, _ = forward(model.params, jnp.asarray([new[:-1]]), positions, cache)
    return np.concatenate([np.asarray(first[0, -1:]), np.asarray(rest[0])])


@pytest.mark.parametrize("kernels,kv", [("fused", "model"), ("fused", "fp8"), ("megakernel", "model")])
def test_fused_greedy_decode_of_a_windowed_model(windowed_hd64, kernels, kv):
    """80 new tokens through a ring of 16 slots (20 when verifying 4 drafts). The kernels over a linear
    cache read the same key positions in the same order: identical tokens. The reference path, fed the
    output, picks each token too wherever its top two are not a bf16 near-tie."""
    options = dict(dtype="bfloat16", max_len=256, kv_cache_dtype=kv)
    ring = lithos.load(windowed_hd64, kernels=kernels, **options)
    linear = lithos.load(windowed_hd64, kernels=kernels, **options)
    linear.cache_window = None
    for prompt in ["hello", "the quick brown fox jumps over the lazy dog"]:
        got = ring.generate(prompt, raw=True, max_new_tokens=80).token_ids
        assert got == linear.generate(prompt, raw=True, max_new_tokens=80).token_ids
        assert ring.generate(prompt, raw=True, max_new_tokens=80, spec="ngram", draft_tokens=4).token_ids == got
        ids = ring.prompt_ids(prompt, raw=True)
        logits = reference_logits(ring, ids, got)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 0.02 * np.abs(logits).max()
        np.testing.assert_array_equal(np.asarray(got)[clear], logits.argmax(-1)[clear])
