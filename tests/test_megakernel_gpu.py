"""The megakernel on a GPU: the kernel against its interpreter (the executable specification) on
random weights of real model shapes, greedy output against the reference path in the jitted decode
loop and in speculative verification, and the bounded wait that turns a broken schedule into an
error instead of a hung GPU. Skipped where jax sees no CUDA or ROCm device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos import quant
from lithos.checkpoint import load_checkpoint
from lithos.custom_calls.megakernel import decode_step, step_schedule
from lithos.custom_calls.megakernel import trace as mk_trace
from lithos.custom_calls.megakernel.kernel import shape_of
from lithos.custom_calls.megakernel.tasks import FIELDS, ModelShape, Op
from lithos.engine import Model

from .test_megakernel import SHAPES, laid_out, packed_step_weights, random_step

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
pytestmark = pytest.mark.skipif(not ON_GPU, reason="the megakernel needs a CUDA or ROCm GPU")


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def run(path: str, args, head: str | None, window: int | None = None):
    weights, h0, positions, inv_freq, k_cache, v_cache = args
    # Fresh cache buffers for each path: the kernel updates them in place.
    k_cache, v_cache = jnp.array(k_cache, copy=True), jnp.array(v_cache, copy=True)
    step = jax.jit(lambda *a: decode_step(*a, eps=1e-5, window=window, head=head, path=path))
    return jax.block_until_ready(step(weights, h0, positions, inv_freq, k_cache, v_cache))


@pytest.mark.parametrize("name", ["smollm2-like", "llama-3.2-1b"])
@pytest.mark.parametrize("tokens", [1, 2, 4, 16])  # 1 and 2: weights through the lane ring (CUDA)
def test_megakernel_equals_interpreter(name, tokens):
    shape = SHAPES[name]
    if name == "llama-3.2-1b" and tokens in (2, 4):
        shape = dataclasses.replace(shape, layers=4)  # a shorter stack: the same tasks per layer
    check_against_interpreter(random_step(shape, tokens, 1000, jnp.bfloat16, seed=tokens), 1000)


@pytest.mark.parametrize(
    "name, context, tokens",
    [
        ("llama-3.2-1b", 8192, 1),
        ("llama-3.2-1b", 8192, 2),
        ("llama-3.1-8b", 4096, 1),
        ("llama-3.1-8b", 4096, 8),
        ("smollm2-like", 6000, 1),
        ("smollm2-like", 6000, 16),
    ],
)
def test_megakernel_equals_interpreter_at_long_context(name, context, tokens):
    """Attention splits of several loop steps of keys (at a 1K context a split is one step), on both
    head sizes and an odd group size; at 8 and 16 tokens several 16-key chunks a warp where the splits run on
    tensor cores (LITHOS_MK_ATTN_MMA), and at 16 tokens of the odd group three 16-row tiles, two passes."""
    shape = dataclasses.replace(SHAPES[name], layers=2)
    check_against_interpreter(random_step(shape, tokens, context, jnp.bfloat16, seed=5), context)


# The third head dimension the kernel has a copy of its attention for (csrc/mk_attention.h): 256, one
# key per 32 lanes.
HEAD_DIM_256 = ModelShape(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=256, ffn=2048, vocab=1000)


@pytest.mark.parametrize("context, tokens", [(1000, 1), (1000, 16), (5000, 2)])
def test_megakernel_equals_interpreter_with_head_dim_256(context, tokens):
    check_against_interpreter(random_step(HEAD_DIM_256, tokens, context, jnp.bfloat16, seed=7), context)


@pytest.mark.parametrize(
    "name, groups, tokens",
    [
        ("smollm2-like", {"attention": "q4_1", "mlp": "q4_1", "lm_head": "q8_0"}, 1),  # the default model's formats
        ("smollm2-like", {"attention": "q4_1", "mlp": "q4_1", "lm_head": "q8_0"}, 16),
        ("llama-3.2-1b", {"attention": "mxfp4", "mlp": "mxfp4"}, 1),  # the benchmark's (bf16 head)
        # MXFP4 through the lane ring with scale rows of 18 bytes (576 inputs): the scale words unaligned to
        # the rows, and most lanes past the end of a row's one step.
        ("smollm2-like", {"attention": "mxfp4", "mlp": "mxfp4"}, 1),
        ("llama-3.2-1b", {"attention": "mxfp4", "mlp": "mxfp4"}, 4),
        # the 8B Q/K/V stage in MXFP4 takes whole rows a warp (schedule.k_split_for's lane steps)
        ("llama-3.1-8b", {"attention": "mxfp4", "mlp": "mxfp4"}, 1),
        ("smollm2-like", {"attention": "mxfp8", "mlp": "fp8_block128", "lm_head": "q4_0"}, 4),
        # GGUF K-quants (rows of whole super-blocks: the 1B shape), as Q4_K_M files hold them
        # at one token Q4_K and Q6_K rows come through the lane ring (their records and high bits beside the codes)
        ("llama-3.2-1b", {"attention": "q4_k", "mlp": "q6_k", "lm_head": "q6_k"}, 1),
        ("llama-3.1-8b", {"attention": "q6_k", "mlp": "q4_k"}, 1),
        ("llama-3.2-1b", {"attention": "q6_k", "mlp": "q4_k"}, 16),
        ("llama-3.2-1b", {"attention": "q5_k", "mlp": "q5_k", "lm_head": "q6_k"}, 4),
        # Q5_K at one token: through the lane ring (its re-packed pairs beside the codes)
        ("llama-3.2-1b", {"attention": "q5_k", "mlp": "q5_k", "lm_head": "q6_k"}, 1),
        ("llama-3.2-1b", {"attention": "q4_k", "mlp": "k_mix"}, 1),  # Q4_K_M's down projections
        # as the megakernel reads a Q4_K_M file: Q/K/V in K_MIX, O, gate and up in Q4_K, down in K_MIX
        ("llama-3.1-8b", {"attention": "k_mix", "mlp": "q4_k", "wo": "q4_k", "w_down": "k_mix"}, 1),
        ("llama-3.1-8b", {"attention": "k_mix", "mlp": "q5_k", "wo": "q5_k", "w_down": "k_mix"}, 1),  # Q5_K_M's
        ("llama-3.2-1b", {"attention": "q3_k", "mlp": "q2_k", "lm_head": "q6_k"}, 1),  # 3- and 2-bit codes
        ("llama-3.2-1b", {"attention": "iq4_nl", "mlp": "iq4_xs", "lm_head": "iq4_nl"}, 1),  # IQ4's looked-up values
        ("llama-3.2-1b", {"attention": "iq4_xs", "mlp": "iq4_xs", "lm_head": "iq4_xs"}, 16),
        ("llama-3.2-1b", {"attention": "k_mix", "mlp": "q3_k", "wo": "q3_k", "w_down": "k_mix"}, 4),  # Q3_K_M's
        # the 5-bit blocks of 32 that K-quant files of SmolLM2 hold where rows are not whole super-blocks
        ("smollm2-like", {"attention": "q5_0", "mlp": "q5_1", "lm_head": "q8_0"}, 1),
    ],
    ids=lambda v: "-".join(v.values()) if isinstance(v, dict) else None,
)
def test_packed_megakernel_equals_interpreter(name, groups, tokens):
    """Packed weights read as stored, in the build for their formats (one per format triple)."""
    shape = SHAPES[name] if name == "smollm2-like" else dataclasses.replace(SHAPES[name], layers=4)
    weights, *rest = random_step(shape, tokens, 1000, jnp.bfloat16, seed=tokens)
    check_against_interpreter((packed_step_weights(weights, groups), *rest), 1000)


# The tiny checkpoints' shape (tests/conftest.py llama_hd64): fewer steps of a tile group than warps.
NARROW = ModelShape(layers=2, hidden=128, heads=2, kv_heads=1, head_dim=64, ffn=96, vocab=1000)


@pytest.mark.parametrize(
    "name, tokens",
    [
        ("llama-3.2-1b", 1),  # tensor cores: 3-4 tile pairs a block, one group, 32 steps over 8 warps
        ("llama-3.1-8b", 1),  # 6-7 tile pairs a block: a group of 4 and a partial one, 16 steps a warp
        ("smollm2-like", 1),  # 576 inputs: 9 steps a group over 8 warps (one takes 2)
        ("narrow", 1),  # 128 inputs: a block's 2 steps over 8 warps, 6 of them with none
        ("narrow", 4),
        ("smollm2-like", 4),  # more tokens on tensor cores: a warp a tile pair over all its k tiles
        ("llama-3.1-8b", 8),  # a verification round's 8 positions: B 128 KB, all of the ring's memory
        ("llama-3.2-1b", 16),  # 16 tokens of 2048 inputs: B 128 KB too
        ("llama-3.1-8b", -16),  # B 256 KB does not fit: the decode to f32
        ("smollm2-like", -1),  # one token, scales spread 2^-12 .. 2^12 around the quantizer's
        ("smollm2-like", -4),
    ],
)
def test_tiled_gate_up_megakernel_equals_interpreter(name, tokens, monkeypatch):
    """MXFP4 gate and up in fragment tiles (lithos.quant.tiles), in the build that reads them: on tensor
    cores where B fits the lane ring's memory, decoded to f32 where it does not (and on HIP). A negative count: as
    many tokens, with every 7th block's scale 2^12 larger and every 11th 2^12 smaller (each path's conversion of
    scales far from 2^0)."""
    # gate and up alone (the default build, Q/K/V tiled too: test_tiled_single_matrix_megakernel_equals_interpreter,
    # its qkv cases)
    monkeypatch.setenv("LITHOS_TILES", "gate_up")
    args = mxfp4_step_laid_out(name, tokens, ("w_gate", "w_up"), seed=abs(tokens) + 1)
    assert args[0].w_gate.format == args[0].w_up.format == quant.MXFP4_TILES
    check_against_interpreter(args, 1000)


@pytest.mark.parametrize(
    "group, name, tokens",
    [
        ("down", "llama-3.2-1b", 1),  # 1 tile a block: 128 steps of a group over 8 warps
        ("down", "llama-3.1-8b", 1),  # 2 tiles a block, 14336 inputs
        ("down", "smollm2-like", 1),  # 576 rows: 36 tiles, fewer than the blocks
        ("down", "smollm2-like", 4),  # one n-block, half its columns tokens
        ("down", "llama-3.1-8b", 8),  # a verification round's 8 positions: the whole n-block
        ("down", "llama-3.2-1b", 16),  # two n-blocks
        ("down", "smollm2-like", -1),  # scales spread 2^-12 .. 2^12 around the quantizer's
        ("down", "smollm2-like", -16),
        ("o", "llama-3.1-8b", 1),  # 256 tiles over the blocks: 1-2 a block
        ("o", "smollm2-like", 4),
        ("o", "llama-3.2-1b", 16),
        ("o", "smollm2-like", -1),
        ("qkv", "llama-3.2-1b", 1),  # heads of 64: 4 rotary tiles a head, 24 a KV group, 1-2 a block
        ("qkv", "llama-3.1-8b", 1),  # heads of 128: 8 rotary tiles a head, 3 a block
        ("qkv", "smollm2-like", 3),  # 3 query heads a KV group, 576 inputs; one n-block, 3 of its 4 tokens
        ("qkv", "llama-3.1-8b", 8),  # two n-blocks of two-part B
        ("qkv", "llama-3.2-1b", 16),  # four
        ("qkv", "smollm2-like", -1),
    ],
)
def test_tiled_single_matrix_megakernel_equals_interpreter(group, name, tokens, monkeypatch):
    """Down, O or Q/K/V (in rotary tiles) in fragment tiles, gate and up in tiles too, in the build that reads them:
    tensor cores at every token count, B read straight from the activations (Q/K/V: from the layer's input and the
    norm weights, in two parts). A negative count: as many tokens, with every 7th block's scale 2^12 larger and every
    11th 2^12 smaller."""
    monkeypatch.setenv("LITHOS_TILES", f"gate_up,{group}")
    names = {"down": ("w_down",), "o": ("wo",), "qkv": ("wq", "wk", "wv")}[group]
    args = mxfp4_step_laid_out(name, tokens, names, seed=abs(tokens) + 3)
    assert args[0].w_gate.format == quant.MXFP4_TILES and all(getattr(args[0], n).format.tile for n in names)
    check_against_interpreter(args, 1000)


def mxfp4_step_laid_out(name: str, tokens: int, spread: tuple[str, ...], seed: int):
    """random_step's arguments for shape `name` (4 layers of a model shape), attention and MLP in MXFP4, laid out as
    the megakernel reads them here (LITHOS_TILES). A negative token count: as many tokens, with every 7th block's
    scale of the `spread` matrices 2^12 larger and every 11th 2^12 smaller (within E8M0's 0 .. 192, which the tiled
    kernels convert exactly)."""

    def spread_scales(w):
        codes = w.scales.astype(jnp.int32)
        codes = codes.at[..., ::7].add(12).at[..., 3::11].add(-12)
        return w.replace(scales=jnp.clip(codes, 0, 192).astype(jnp.uint8))

    shape = {"smollm2-like": SHAPES["smollm2-like"], "narrow": NARROW}.get(name)
    shape = shape or dataclasses.replace(SHAPES[name], layers=4)
    weights, *rest = random_step(shape, abs(tokens), 1000, jnp.bfloat16, seed=seed)
    weights = packed_step_weights(weights, {"attention": "mxfp4", "mlp": "mxfp4"})
    if tokens < 0:
        weights = weights._replace(**{m: spread_scales(getattr(weights, m)) for m in spread})
    return (laid_out(weights, shape.head_dim, None), *rest)


def check_against_interpreter(args, context: int):
    """The kernel's step against the interpreter's on `args` (random_step's), `context` positions filled."""
    kernel = run("ffi", args, head="logits")
    spec = run("reference", args, head="logits")
    tokens = args[1].shape[0]
    new = slice(context, context + tokens)
    assert relative_error(kernel.h, spec.h) < 2e-2
    assert relative_error(kernel.logits, spec.logits) < 2e-2
    for cache, expected, before in ((kernel.k_cache, spec.k_cache, args[4]), (kernel.v_cache, spec.v_cache, args[5])):
        assert relative_error(cache[:, :, :, new], expected[:, :, :, new]) < 1e-2  # this step's entries
        np.testing.assert_array_equal(np.asarray(cache[:, :, :, :context]), np.asarray(before[:, :, :, :context]))
    logits = np.asarray(spec.logits)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * np.abs(logits).max()
    np.testing.assert_array_equal(np.asarray(kernel.tokens)[clear], logits.argmax(-1)[clear])
    np.testing.assert_array_equal(np.asarray(kernel.tokens), np.asarray(kernel.logits).argmax(-1))


def test_megakernel_decoder_only_and_sliding_window():
    shape = dataclasses.replace(SHAPES["smollm2-like"], layers=4)
    args = random_step(shape, 3, 300, jnp.bfloat16, seed=7)
    kernel, spec = run("ffi", args, head=None, window=100), run("reference", args, head=None, window=100)
    assert kernel.tokens is None and kernel.logits is None
    assert relative_error(kernel.h, spec.h) < 2e-2


@pytest.mark.parametrize("tokens", [1, 4])
def test_a_step_at_negative_positions_leaves_the_caches(tokens):
    """A step whose positions are all negative holds no token: its blocks leave after their first task and
    its cache writes are dropped, so the caches come back bit for bit as they went in, as the interpreter's
    dropped writes leave them."""
    shape = dataclasses.replace(SHAPES["smollm2-like"], layers=2)
    weights, h0, _, inv_freq, k_cache, v_cache = random_step(shape, tokens, 200, jnp.bfloat16, seed=3)
    empty = jnp.full((tokens,), -1, jnp.int32)
    for path in ("ffi", "reference"):
        out = run(path, (weights, h0, empty, inv_freq, k_cache, v_cache), head="argmax")
        np.testing.assert_array_equal(np.asarray(out.k_cache), np.asarray(k_cache))
        np.testing.assert_array_equal(np.asarray(out.v_cache), np.asarray(v_cache))


@pytest.mark.parametrize("arch", ["llama_hd64", "mistral_hd64_window"])
def test_megakernel_greedy_generation_equals_reference(hf_checkpoint, arch):
    """The jitted decode loop, and speculative verification of k + 1 positions, on the megakernel."""
    path = hf_checkpoint(arch, tied=False)
    ref = lithos.load(path, dtype="bfloat16", max_len=128)
    mega = lithos.load(path, dtype="bfloat16", max_len=128, kernels="megakernel")
    for prompt in ("hello", "the quick brown fox jumps"):
        expected = ref.generate(prompt, raw=True, max_new_tokens=24).token_ids
        assert mega.generate(prompt, raw=True, max_new_tokens=24).token_ids == expected
        spec = mega.generate(prompt, raw=True, max_new_tokens=24, spec="ngram", draft_tokens=4)
        assert spec.token_ids == expected


@pytest.mark.parametrize("tiles", [None, "qkv,gate_up"], ids=["default-tiles", "qkv-gate_up-tiles"])
def test_megakernel_greedy_generation_over_mxfp4_equals_reference(hf_checkpoint, monkeypatch, tiles):
    """MXFP4 attention and MLP (on CUDA by default every group in fragment tiles; O and down in rows where
    LITHOS_TILES names Q/K/V and gate/up alone): the jitted decode loop and speculative verification of k + 1
    positions against the reference path over the same packed values."""
    if tiles is None:
        monkeypatch.delenv("LITHOS_TILES", raising=False)
    else:
        monkeypatch.setenv("LITHOS_TILES", tiles)
    checkpoint = load_checkpoint(hf_checkpoint("llama_hd64", tied=False), dtype="bfloat16")
    params = quant.quantize_params(checkpoint.params, "mxfp4", ["attention", "mlp"])
    checkpoint = dataclasses.replace(checkpoint, params=params)
    ref = Model(checkpoint, max_len=128)
    mega = Model(checkpoint, max_len=128, kernels="megakernel")
    if jax.default_backend() != "rocm":
        assert mega.params.layers.w_gate.format == quant.MXFP4_TILES
        assert mega.params.layers.wq.format.rotary_head == 64  # Q/K/V in rotary tiles in both
        assert (mega.params.layers.wo.format.tile is not None) == (tiles is None)
    for prompt in ("hello", "the quick brown fox jumps"):
        expected = ref.generate(prompt, raw=True, max_new_tokens=24).token_ids
        assert mega.generate(prompt, raw=True, max_new_tokens=24).token_ids == expected
        for k in (4, 7):  # 5 and 8 positions: a partial and a whole n-block pair of B
            spec = mega.generate(prompt, raw=True, max_new_tokens=24, spec="ngram", draft_tokens=k)
            assert spec.token_ids == expected


def test_a_stuck_task_ends_in_an_error_not_a_hang(monkeypatch):
    """A task whose input never arrives: every wait is bounded, the step is abandoned, the handler says so."""
    shape = dataclasses.replace(SHAPES["smollm2-like"], layers=1)
    args = random_step(shape, 1, 64, jnp.bfloat16)
    schedule = step_schedule(shape_of(args[0], args[4]), 1, True)
    rows = schedule.tasks.copy()
    rows[-1, 6] += 1000  # the last head task waits for signals that never come
    broken = dataclasses.replace(schedule, tasks=rows)
    monkeypatch.setenv("LITHOS_MEGAKERNEL_SYNC", "1")
    from lithos.custom_calls.megakernel import kernel as mk

    monkeypatch.setattr(mk, "step_schedule", lambda *a, **k: broken)
    with pytest.raises(Exception, match=rf"megakernel task {len(rows) - 1} waited"):
        run("ffi", args, head="argmax")
    monkeypatch.undo()
    # The GPU is usable afterwards and the next step is right.
    assert relative_error(run("ffi", args, head="argmax").h, run("reference", args, head="argmax").h) < 2e-2


@pytest.mark.parametrize("context", [1000, 100])  # 100: most attention splits have no keys
def test_trace_records_every_task_in_causal_order(monkeypatch, tmp_path, context):
    """LITHOS_MEGAKERNEL_TRACE: one record per task, in the kernel's block assignment, with every task's
    inputs ready only after the producers it waits for had theirs; tracing does not change the step."""
    shape = dataclasses.replace(SHAPES["llama-3.2-1b"], layers=2)
    args = random_step(shape, 1, context, jnp.bfloat16, seed=3)
    plain = run("ffi", args, head="argmax")
    path = tmp_path / "step.json"
    monkeypatch.setenv("LITHOS_MEGAKERNEL_TRACE", str(path))
    traced = run("ffi", args, head="argmax")
    monkeypatch.delenv("LITHOS_MEGAKERNEL_TRACE")
    np.testing.assert_array_equal(np.asarray(traced.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(traced.h), np.asarray(plain.h))
    trace = mk_trace.load(path)
    schedule = step_schedule(shape_of(args[0], args[4]), 1, True)
    np.testing.assert_array_equal(trace.tasks, schedule.tasks)
    np.testing.assert_array_equal(trace.block, np.arange(len(schedule)) % trace.grid)
    assert np.all(trace.begin <= trace.ready) and np.all(trace.ready <= trace.end)  # the timer ticks in 256 ns
    assert mk_trace.causality_violations(trace, slack_ns=100) == []
    assert trace.context == context + 1 and 0 < trace.step_ns < 1e8
    assert set(trace.formats.values()) == {"bfloat16"} and len(trace.formats) == 8  # the bf16 build's weights
    # Phase marks lie in order between a task's ready and end: a matvec task's first three, every one of an
    # attention split's five; only attention splits past the step's plan (at context 100) have none.
    attention = trace.tasks[:, FIELDS.index("op")] == Op.ATTENTION
    matvec_marks = np.column_stack([trace.ready, trace.phases[:, :3], trace.end])[~attention]
    assert not np.isnan(matvec_marks).any() and np.isnan(trace.phases[~attention, 3:]).all()
    assert np.all(np.diff(matvec_marks, axis=1) >= 0)
    attention_marks = np.column_stack([trace.ready, trace.phases, trace.end])[attention]
    marked = ~np.isnan(attention_marks).any(axis=1)
    assert np.all(np.diff(attention_marks[marked], axis=1) >= 0)
    assert marked.any() and marked.all() == (context == 1000)
    assert {r["op"] for r in mk_trace.phase_summary(trace)} == {op.name.lower() for op in Op}


def test_trace_of_a_tiled_build_marks_its_block_barriers(monkeypatch, tmp_path):
    """Gate/up and down in fragment tiles (an MXFP4 build): their tasks mark a fourth phase, the block's barrier
    before the epilogues, in order between ready and end; the rows tasks (Q/K/V, O) keep three marks. The trace
    records the build's formats (MXFP4 attention and MLP, a bf16 head)."""
    monkeypatch.setenv("LITHOS_TILES", "gate_up,down")
    args = mxfp4_step_laid_out("llama-3.2-1b", 1, (), seed=7)
    path = tmp_path / "step.json"
    monkeypatch.setenv("LITHOS_MEGAKERNEL_TRACE", str(path))
    run("ffi", args, head="argmax")
    trace = mk_trace.load(path)
    assert trace.formats == {
        **dict.fromkeys(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"), "mxfp4"),
        "lm_head": "bfloat16",
    }
    ops = trace.tasks[:, FIELDS.index("op")]
    tiled = np.isin(ops, [Op.GATE_UP, Op.DOWN])
    rows = np.isin(ops, [Op.QKV, Op.O_PROJ])
    marks = np.column_stack([trace.ready, trace.phases[:, :4], trace.end])
    assert not np.isnan(marks[tiled]).any() and np.all(np.diff(marks[tiled], axis=1) >= 0)
    assert np.isnan(trace.phases[rows, 3:]).all() and not np.isnan(trace.phases[rows, :3]).any()
    phases = {r["op"]: r for r in mk_trace.phase_summary(trace)}
    assert list(phases["down"])[1:] == list(mk_trace.TILED_MATVEC_PHASES)
    assert list(phases["o_proj"])[1:] == list(mk_trace.MATVEC_PHASES)
