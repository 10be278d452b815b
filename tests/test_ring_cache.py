"""The ring KV cache (lithos.kv_cache): a model whose every layer attends within a window W keeps
W + K - 1 slots, however long its sequences grow.

Against a linear cache of max_len slots (same tokens, same logits), against transformers, under
speculative decoding with rollbacks, on the fused and megakernel paths (their reference twins on a
CPU), over tensor parallelism, and with bad inputs. tests/test_ring_cache_gpu.py runs the kernels.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos import bench, engine, models
from lithos.checkpoint import load_checkpoint
from lithos.custom_calls import decode_attention, qkv_rope_append
from lithos.custom_calls.packed_matvec import packed_qkv_rope_append
from lithos.errors import LithosError
from lithos.kv_cache import FP8, cache_bytes, init_cache, layer_of, prompt_positions, ring_for
from lithos.models import llama
from lithos.quant import quantize
from lithos.sampling import SamplingParams
from lithos.spec import engine as spec_engine
from lithos.spec.loop import spec_prefill
from lithos.spec.ngram import NGramDrafter

from .conftest import byte_tokenizer, require, run_on_cpu_devices
from .test_kv_fp8 import TINY

WINDOW = 8
MAX_LEN = 128
PROMPTS = ["abcabcabcabcabcabcabcabcab", "hi"]  # 26 and 2 tokens: one row longer than the ring, one padded
# Attention sums a ring's slots in another order than a linear cache's (f32 rounding, ~1e-7), which can
# move a later key across an E4M3 rounding boundary: one code apart, for as long as it is in the window.
FP8_ATOL = 5e-4


def save_mistral(path: Path, window: int, seed: int, hidden: int = 64, head_dim: int = 16) -> Path:
    """A tiny random MistralForCausalLM (4 heads, 2 KV heads) with a sliding window, saved by transformers
    with a byte tokenizer."""
    transformers = require("transformers")
    torch = require("torch")
    tok = byte_tokenizer()
    config = transformers.MistralConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
        sliding_window=window,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    config.architectures = ["MistralForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():  # random norms, so that a wrong one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def windowed_path(tmp_path_factory) -> Path:
    return save_mistral(tmp_path_factory.mktemp("mistral-w8"), WINDOW, seed=0)


@pytest.fixture(scope="module")
def windowed(windowed_path):
    return lithos.load(windowed_path, dtype="float32", max_len=MAX_LEN, stream_every=8, block=4)


@pytest.fixture(scope="module")
def plain(windowed):
    """Plain greedy decoding (ring cache): 60 new tokens per prompt, far past the 8-slot ring."""
    return windowed.generate_batch(PROMPTS, raw=True, max_new_tokens=60)


def record_slots(monkeypatch, module) -> list[int]:
    """Spy on `module.init_cache`: the slot count of every cache it makes."""
    made, real = [], module.init_cache

    def spy(*args, **kwargs):
        cache = real(*args, **kwargs)
        made.append(cache.slots)
        return cache

    monkeypatch.setattr(module, "init_cache", spy)
    return made


# --------------------------------------------------------------------------------------------
# The cache itself
# --------------------------------------------------------------------------------------------


def test_ring_has_window_plus_step_tokens_minus_one_slots():
    cache = init_cache(2, 1, 2, MAX_LEN, 16, jnp.float32, window=WINDOW)
    assert (cache.slots, cache.max_len, cache.ring.step_tokens) == (WINDOW, MAX_LEN, 1)
    assert init_cache(2, 1, 2, MAX_LEN, 16, jnp.float32, window=WINDOW, step_tokens=4).slots == WINDOW + 3
    fp8 = init_cache(2, 1, 2, MAX_LEN, 16, FP8, window=WINDOW, step_tokens=6)
    assert fp8.k.shape == (2, 1, 2, WINDOW + 5, 16) and fp8.k_scale.shape == (2, 1, 2) and fp8.max_len == MAX_LEN
    linear = init_cache(2, 1, 2, MAX_LEN, 16, jnp.float32)
    assert linear.ring is None and linear.slots == linear.max_len == MAX_LEN
    assert cache_bytes(cache) * MAX_LEN == cache_bytes(linear) * WINDOW
    # No ring where it would not be smaller: a short max_len keeps the linear cache.
    assert ring_for(10, WINDOW, step_tokens=3) is None and ring_for(11, WINDOW, step_tokens=3) is not None
    # The static fields survive per-layer views, tree maps and jit.
    assert layer_of(cache, 1).ring == cache.ring
    assert jax.tree_util.tree_map(jnp.copy, cache).ring == cache.ring
    assert jax.jit(lambda c: c)(cache).max_len == MAX_LEN


def test_prompt_padding_is_moved_out_of_every_cache():
    positions = np.asarray(prompt_positions(jnp.array([3, 1]), 5))
    assert positions[0, :3].tolist() == [0, 1, 2] and positions[1, 0] == 0
    assert (positions[0, 3:] >= 1 << 30).all() and (positions[1, 1:] >= 1 << 30).all()


# --------------------------------------------------------------------------------------------
# Ring against linear, and against transformers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["model", "fp8"])
def test_generate_with_a_ring_equals_a_linear_cache(windowed, plain, monkeypatch, kv):
    """lithos.Model on two prompts of different lengths (padding; one prompt longer than the ring), 60 new
    tokens: the same greedy tokens from 8 slots as from 128."""
    ring = windowed if kv == "model" else lithos.Model(windowed.checkpoint, max_len=MAX_LEN, kv_cache_dtype=kv)
    linear = lithos.Model(windowed.checkpoint, max_len=MAX_LEN, kv_cache_dtype=kv)
    linear.cache_window = None  # the same windowed attention over a linear cache
    slots = record_slots(monkeypatch, engine)
    got = ring.generate_batch(PROMPTS, raw=True, max_new_tokens=60)
    expected = linear.generate_batch(PROMPTS, raw=True, max_new_tokens=60)
    assert set(slots) == {WINDOW, MAX_LEN}
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids and g.finish_reason == e.finish_reason
    if kv == "model":
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]
        assert all(len(r.token_ids) == 60 for r in got if r.finish_reason == "length")


def decode_logits(params, cfg, cache, prompts: np.ndarray, lengths: np.ndarray, steps: int) -> np.ndarray:
    """Prefill right-padded `prompts` `[B, bucket]`, then `steps` greedy single-token steps: logits
    `[B, steps + 1, vocab]`."""
    forward = jax.jit(partial(llama.forward, cfg=cfg))
    lengths = jnp.asarray(lengths)
    logits, cache = forward(params, jnp.asarray(prompts), prompt_positions(lengths, prompts.shape[1]), cache)
    out = [logits[jnp.arange(len(lengths)), lengths - 1]]
    position = lengths
    for _ in range(steps):
        token = jnp.argmax(out[-1], axis=-1).astype(jnp.int32)
        logits, cache = forward(params, token[:, None], position[:, None], cache)
        out.append(logits[:, 0])
        position = position + 1
    return np.stack([np.asarray(x) for x in out], axis=1)


@pytest.mark.parametrize("dtype", [jnp.float32, FP8])
def test_ring_logits_equal_linear_logits(windowed_path, dtype):
    loaded = load_checkpoint(windowed_path, dtype="float32")
    cfg, params = loaded.cfg, loaded.params
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    lengths = np.array([13, 5], np.int32)
    dims = (cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim)
    ring = decode_logits(params, cfg, init_cache(*dims, dtype, window=WINDOW), prompts, lengths, 60)
    linear = decode_logits(params, cfg, init_cache(*dims, dtype), prompts, lengths, 60)
    np.testing.assert_allclose(ring, linear, atol=FP8_ATOL if dtype == FP8 else 2e-5, rtol=1e-5)


def test_ring_matches_transformers(windowed_path):
    """Two rows of different prompt lengths (padding) through a ring of W + 3 slots, then single steps and
    4-token blocks (as verification writes them) far past the window: transformers' logits per row."""
    transformers = require("transformers")
    torch = require("torch")
    loaded = load_checkpoint(windowed_path, dtype="float32")
    cfg, params = loaded.cfg, loaded.params
    forward = jax.jit(partial(llama.forward, cfg=cfg))
    lengths, total = np.array([11, 4]), 60
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, total + 11))
    hf = transformers.AutoModelForCausalLM.from_pretrained(windowed_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf(torch.tensor(tokens[r : r + 1, : lengths[r] + total])).logits.numpy()[0] for r in range(2)]

    cache = init_cache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, jnp.float32, WINDOW, step_tokens=4)
    assert cache.slots == WINDOW + 3
    prompt = np.where(np.arange(16) < lengths[:, None], tokens[:, :16], 0)
    logits, cache = forward(params, jnp.asarray(prompt), prompt_positions(jnp.asarray(lengths), 16), cache)
    for r in range(2):
        np.testing.assert_allclose(logits[r, : lengths[r]], expected[r][: lengths[r]], atol=2e-4, rtol=1e-4)
    done = 0
    for width in [1, 4] * 12:  # 60 tokens past each prompt
        positions = lengths[:, None] + done + np.arange(width)
        block = np.take_along_axis(tokens, positions, axis=1)
        logits, cache = forward(params, jnp.asarray(block), jnp.asarray(positions), cache)
        for r in range(2):
            np.testing.assert_allclose(logits[r], expected[r][positions[r]], atol=2e-4, rtol=1e-4)
        done += width
    assert done == total


# --------------------------------------------------------------------------------------------
# Speculative decoding: rollbacks leave rejected drafts in the ring
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(spec="ngram", draft_tokens=3),
        dict(spec="ngram", draft_tokens=5),
        dict(spec="self", draft_layers=1, draft_tokens=3),
        dict(spec="self", draft_layers=1, draft_tokens=5),
        dict(spec="draft", draft_tokens=3),
    ],
    ids=["ngram-3", "ngram-5", "self-3", "self-5", "draft-3"],
)
def test_speculative_decoding_with_a_ring_equals_plain_greedy(windowed, plain, tmp_path_factory, monkeypatch, options):
    k = options["draft_tokens"]
    if options["spec"] == "draft":  # another windowed model of the same shape: its own ring, many rejections
        draft = save_mistral(tmp_path_factory.mktemp("mistral-w8-draft"), WINDOW, seed=1)
        options = dict(options, draft_model=lithos.load(draft, dtype="float32", max_len=MAX_LEN))
    slots = record_slots(monkeypatch, spec_engine)
    got = windowed.generate_batch(PROMPTS, raw=True, max_new_tokens=60, **options)
    assert set(slots) == {WINDOW + k}  # the target's ring holds a round's k + 1 writes besides the window
    for g, e in zip(got, plain, strict=True):
        assert g.token_ids == e.token_ids and g.finish_reason == e.finish_reason
    histogram = np.sum([r.spec.histogram for r in got], axis=0)
    assert histogram[:k].sum() > 0, "no round rejected a draft: the rollback path went untested"
    assert sum(r.spec.accepted for r in got) > 0


# --------------------------------------------------------------------------------------------
# The kernels' reference twins with wrapping positions
# --------------------------------------------------------------------------------------------

# test_kv_fp8's tiny model (head_dim 64: a size the fused kernels exist for), windowed.
TWIN_CFG = dataclasses.replace(
    TINY, architecture="MistralForCausalLM", max_position_embeddings=512, sliding_window=WINDOW
)


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_twins_with_wrapping_positions_equal_llama_attention(tokens, packed):
    """qkv_rope_append writes into a ring at positions that wrap past slot 0, decode_attention reads it:
    the entries a linear cache gets, and llama's reference attention over the linear cache."""
    cfg, slots = TWIN_CFG, WINDOW + tokens - 1
    start = 4 * slots - 2  # positions start..start+tokens-1 cross a lap for tokens = 4
    kv, dim, hidden = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    rng = np.random.default_rng(tokens)

    def rand(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    h, norm = rand(tokens, hidden), 1 + rand(hidden, scale=0.1)
    wq, wk, wv = (rand(n * dim, hidden, scale=hidden**-0.5) for n in (cfg.num_heads, kv, kv))
    if packed:
        wq, wk, wv = (quantize(w, "mxfp8") for w in (wq, wk, wv))
    inv_freq = jnp.asarray(llama.rope_inv_freq(cfg))
    positions = jnp.arange(start, start + tokens, dtype=jnp.int32)
    # The keys and values of every earlier position; the linear cache holds them all, the ring the newest.
    old_k, old_v = rand(1, 1, kv, start, dim), rand(1, 1, kv, start, dim)
    garbage = rand(1, 1, kv, tokens + 3, dim)  # past the start: stale, never read
    linear_k, linear_v = (jnp.concatenate([old, garbage], axis=3) for old in (old_k, old_v))
    lap = np.arange(start - slots, start)
    ring_k, ring_v = (
        jnp.zeros((1, 1, kv, slots, dim)).at[:, :, :, lap % slots].set(old[:, :, :, lap]) for old in (old_k, old_v)
    )

    append = packed_qkv_rope_append if packed else qkv_rope_append
    run = partial(append, h, norm, wq, wk, wv, inv_freq, positions, eps=cfg.rms_norm_eps, path="reference")
    q, k_lin, v_lin = run(linear_k, linear_v)
    q_ring, k_ring, v_ring = run(ring_k, ring_v, ring=True)
    np.testing.assert_array_equal(np.asarray(q_ring), np.asarray(q))
    new = np.asarray(positions)
    np.testing.assert_array_equal(np.asarray(k_ring[..., new % slots, :]), np.asarray(k_lin[..., new, :]))
    np.testing.assert_array_equal(np.asarray(v_ring[..., new % slots, :]), np.asarray(v_lin[..., new, :]))

    out = decode_attention(q_ring, k_ring, v_ring, positions, sliding_window=WINDOW, ring=True, path="reference")
    k_new, v_new = (c[0, 0][:, new].swapaxes(0, 1)[None] for c in (k_lin, v_lin))  # [1, T, kv, dim]
    expected = llama.attention(q[None], k_new, v_new, linear_k[0], linear_v[0], positions[None], cfg)
    np.testing.assert_allclose(np.asarray(out).reshape(tokens, -1), np.asarray(expected[0]), atol=2e-5, rtol=1e-5)


def step_through(params, cfg, kernels: str, cache, prompt, schedule) -> list[np.ndarray]:
    """Prefill `prompt` (reference path), then forwards of (tokens, start) from `schedule` on `kernels`."""
    prefill = jax.jit(partial(llama.forward, cfg=cfg))
    forward = jax.jit(partial(llama.forward, cfg=cfg, kernels=kernels))
    _, cache = prefill(params, prompt, jnp.arange(prompt.shape[1])[None], cache)
    out = []
    for tokens, start in schedule:
        logits, cache = forward(params, tokens, jnp.arange(start, start + tokens.shape[1])[None], cache)
        out.append(np.asarray(logits))
    return out


@pytest.mark.parametrize("kernels,dtype", [("fused", jnp.float32), ("fused", FP8), ("megakernel", jnp.float32)])
def test_fused_paths_with_a_ring_equal_the_reference(kernels, dtype):
    """Single steps and 4-token verification blocks, each followed by a rollback of two drafts, on the
    kernels' path (their twins on a CPU) over a ring: the same path's logits over a linear cache, and (a
    float cache) the reference path's."""
    cfg = TWIN_CFG
    params = llama.init_params(cfg, jax.random.key(5), jnp.float32)
    rng = np.random.default_rng(6)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 12)), jnp.int32)
    schedule, position = [], 12
    for i in range(20):
        block = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 4 if i % 2 else 1)), jnp.int32)
        schedule.append((block, position))
        position += block.shape[1] - (2 if block.shape[1] == 4 else 0)  # two drafts rejected
    dims = (cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim)
    ring = step_through(params, cfg, kernels, init_cache(*dims, dtype, window=WINDOW, step_tokens=4), prompt, schedule)
    linear = step_through(params, cfg, kernels, init_cache(*dims, dtype), prompt, schedule)
    for got, want in zip(ring, linear, strict=True):
        np.testing.assert_allclose(got, want, atol=FP8_ATOL if dtype == FP8 else 2e-5, rtol=1e-5)
    if dtype != FP8:  # the FP8 twins may round a tie differently from the reference (tests/test_kv_fp8.py)
        reference = step_through(params, cfg, "reference", init_cache(*dims, dtype), prompt, schedule)
        for got, want in zip(ring, reference, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# Tensor parallelism: the placed cache is the same ring
# --------------------------------------------------------------------------------------------

TENSOR_PARALLEL = """
import sys, lithos
path = sys.argv[1]
one = lithos.load(path, dtype="float32", max_len=128)
prompts = ["abcabcabcabcabcabcabcabcab", "hi"]
expected = [r.token_ids for r in one.generate_batch(prompts, raw=True, max_new_tokens=40)]
for kernels in ("reference", "fused"):
    two = lithos.load(path, dtype="float32", max_len=128, tp=2, kernels=kernels)
    assert two.placement.ring.slots == 8, two.placement.ring
    rows = prompts if kernels == "reference" else prompts[:1]  # the fused path decodes batch 1
    got = [r.token_ids for r in two.generate_batch(rows, raw=True, max_new_tokens=40)]
    assert got == expected[: len(rows)], (kernels, got, expected)
print("tp=2 ring ok")
"""


def test_tensor_parallel_ring_cache(tmp_path_factory):
    """tp=2 over two CPU devices (a fresh process: jax fixes its device count at start), the KV heads split;
    head_dim 64 for the fused path."""
    path = save_mistral(tmp_path_factory.mktemp("mistral-w8-hd64"), WINDOW, seed=2, hidden=128, head_dim=64)
    run = run_on_cpu_devices(2, ["-c", TENSOR_PARALLEL, str(path)])
    assert run.returncode == 0, run.stderr[-4000:]
    assert "tp=2 ring ok" in run.stdout


# --------------------------------------------------------------------------------------------
# Bad input, and the benchmark's floor
# --------------------------------------------------------------------------------------------


def test_a_ring_too_small_for_the_step_is_a_clear_error(windowed):
    cfg, params = windowed.cfg, windowed.params
    ring = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, jnp.float32, window=WINDOW)
    tokens, lengths = jnp.zeros((1, 16), jnp.int32), jnp.array([5], jnp.int32)
    args = (jnp.array([10]), jnp.array([-1]), SamplingParams.make(), jax.random.key(0))
    with pytest.raises(LithosError, match=r"speculative decoding with 3 drafts writes 4 .*step_tokens=4\)"):
        spec_prefill(params, None, tokens, lengths, ring, *args, cfg=cfg, drafter=NGramDrafter(), k=3, greedy=True)

    twin = TWIN_CFG
    twin_params = llama.init_params(twin, jax.random.key(0), jnp.float32)
    small = init_cache(twin.num_layers, 1, twin.num_kv_heads, 64, twin.head_dim, jnp.float32, window=WINDOW)
    positions = jnp.arange(20, 24)[None]
    for kernels in ("fused", "megakernel"):
        with pytest.raises(LithosError, match=r"forward writes 4 new tokens .* ring of 8 slots .*step_tokens=4\)"):
            llama.forward(twin_params, jnp.zeros((1, 4), jnp.int32), positions, small, twin, kernels=kernels)
    # The kernels' own wrappers say the same to a direct caller.
    q = jnp.zeros((4, twin.num_heads, twin.head_dim))
    with pytest.raises(LithosError, match=r"ring cache of 8 slots .*init_cache\(\.\.\., window=W, step_tokens=4\)"):
        decode_attention(q, small.k, small.v, positions[0], layer=0, sliding_window=WINDOW, ring=True)
    with pytest.raises(LithosError, match="window >= 1"):
        init_cache(1, 1, 1, 64, 16, jnp.float32, window=0)


def test_bench_counts_the_window_for_windowed_dense_models():
    cfg = TWIN_CFG
    per_position = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V in bf16
    assert bench.kv_bytes_read(cfg, 1000, 2) == cfg.num_layers * WINDOW * per_position
    assert bench.kv_bytes_read(cfg, 5, 2) == cfg.num_layers * 5 * per_position


def test_bench_times_windowed_dense_models_on_their_ring(monkeypatch):
    """`lithos bench` decodes a windowed model from its ring, as lithos.Model does, so the timed step
    reads what the floor counts."""
    made = record_slots(monkeypatch, models)
    params = llama.init_params(TWIN_CFG, jax.random.PRNGKey(0), jnp.float32)
    times = bench.time_decode_steps(params, TWIN_CFG, context=40, kernels="reference", steps=2, runs=1)
    assert len(times) == 1 and times[0] > 0
    assert made == [WINDOW]  # window + 1 - 1 slots, not context + steps
