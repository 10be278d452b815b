"""The megakernel's scheduler and interpreter (its executable specification) on the CPU (its source
compiles for both vendors in test_custom_calls.py).

`forward(..., kernels="megakernel")` runs the interpreter where there is no GPU, so the model-level
tests here check the task list's semantics against transformers and against the reference path.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lithos
from lithos import quant
from lithos.checkpoint import load_checkpoint
from lithos.custom_calls.megakernel import (
    FIELDS,
    ModelShape,
    Op,
    ScheduleError,
    StepWeights,
    build_schedule,
    describe_task,
    interpret,
)
from lithos.custom_calls.megakernel.kernel import WeightFormats, check_tile_staging, lane_steps, weight_formats
from lithos.custom_calls.megakernel.schedule import LaneSteps, k_split_for
from lithos.errors import UnsupportedModelError
from lithos.kv_cache import init_cache
from lithos.models import llama
from lithos.quant.quantize import names_for_groups, param_at, with_param
from lithos.sampling import SamplingParams

from .conftest import require

SHAPES = {
    "tiny": ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=97),
    "smollm2-like": ModelShape(layers=3, hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=1000),
    "llama-3.2-1b": ModelShape(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256),
    "llama-3.1-8b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256),
}


def config_of(shape: ModelShape, window: int | None = None) -> llama.Config:
    return llama.Config(
        architecture="MistralForCausalLM" if window else "LlamaForCausalLM",
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        sliding_window=window,
    )


# --------------------------------------------------------------------------------------------
# Scheduler invariants
# --------------------------------------------------------------------------------------------


def tasks_of(schedule):
    return [schedule.task(i) for i in range(len(schedule))]


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("workers", [1, 7, 132, 264])
def test_schedule_covers_every_row_once_and_waits_only_backwards(name, workers):
    shape = SHAPES[name]
    schedule = build_schedule(shape, workers)
    tasks = tasks_of(schedule)
    assert schedule.tasks.shape == (len(tasks), len(FIELDS)) and schedule.tasks.dtype == np.int32

    # Every row group of every matvec stage is computed exactly once.
    for layer in range(shape.layers + 1):
        for op in (Op.QKV, Op.O_PROJ, Op.GATE_UP, Op.DOWN, Op.HEAD):
            mine = [t for t in tasks if t.op == op and t.layer == layer]
            if layer == shape.layers and op != Op.HEAD or layer < shape.layers and op == Op.HEAD:
                assert not mine
                continue
            covered = np.concatenate([np.arange(t.first, t.first + t.count) for t in mine])
            np.testing.assert_array_equal(np.sort(covered), np.arange(shape.units(op)))
            assert len(mine) <= max(workers, shape.kv_heads if op == Op.QKV else 1)
            assert all(t.k_split in (1, 2, 4, 8) and t.count >= 1 for t in mine)
            if op == Op.QKV:  # a Q/K/V task stays inside one KV group: the attention of that group waits for it
                per_group = shape.qkv_units_per_group
                assert all(t.first // per_group == (t.first + t.count - 1) // per_group for t in mine)
        if layer < shape.layers:
            splits = sorted((t.first, t.count) for t in tasks if t.op == Op.ATTENTION and t.layer == layer)
            assert splits == [(g, s) for g in range(shape.kv_heads) for s in range(schedule.max_splits)]

    # Each wait is on a counter signalled only by earlier tasks, exactly as often as the target says
    # (the attention's second counter is signalled by the last split of each head, after its combine).
    total = np.zeros(schedule.n_counters, int)  # signals each counter gets over the whole step
    for t in tasks:
        total[t.signal_counter] += 1
        if t.op == Op.ATTENTION and t.count == 0:  # one combine per head signals the stage counter
            total[t.aux] += 1
    signalled = np.zeros(schedule.n_counters, int)
    for index, t in enumerate(tasks):
        if t.wait_counter >= 0:
            assert total[t.wait_counter] == t.wait_target, describe_task(schedule, index)
            assert signalled[t.wait_counter] == t.wait_target, f"{describe_task(schedule, index)} waits on later tasks"
        signalled[t.signal_counter] += 1
        if t.op == Op.ATTENTION and signalled[t.signal_counter] == t.arrivals:
            signalled[t.aux] += 1
    assert schedule.head_tasks == sum(t.op == Op.HEAD for t in tasks)


def test_k_split_balances_the_busiest_task():
    # A Llama-3.1-8B KV group: 192 row groups over 16 tasks. One warp per group: 24 rounds of 8, two
    # for some tasks; two warps per group: 48 rounds of half the inputs, three for every task.
    assert k_split_for(192, 4096, 16, 32) == 2
    assert k_split_for(7168, 4096, 132, 32) == 1  # gate/up: no split shortens the busiest task enough
    assert k_split_for(512, 8192, 132, 32) == 2  # 1B down: one warp per group leaves half the grid idle
    assert k_split_for(96, 2048, 16, 32) == 1  # 1B QKV: shares of 512 inputs are too short to pay
    assert k_split_for(96, 256, 16, 32) == 1
    # MXFP4 through the lane ring reads 32 inputs a lane step: the 8B group's halves would be two steps each.
    assert k_split_for(192, 4096, 16, 32, lane_step=32) == 1
    assert k_split_for(512, 8192, 132, 32, lane_step=32) == 2  # 1B down: shares of four steps still
    assert k_split_for(512, 2048, 132, 32, lane_step=32) == 2  # 1B O: whole rows would idle half the blocks


def test_lane_steps_follow_the_weight_format():
    assert lane_steps(WeightFormats(), 1, "cuda") == LaneSteps(8, 8, 8)
    assert lane_steps(WeightFormats("mxfp4", "mxfp4", "bfloat16"), 1, "cuda") == LaneSteps(32, 32, 8)
    assert lane_steps(WeightFormats("q4_k", "q6_k", "q8_0"), 1, "cuda") == LaneSteps(32, 32, 16)
    # the ring carries MXFP4, the K-quants but Q2_K and Q3_K, and the IQ4 formats at one token on CUDA only;
    # elsewhere packed rows step by kChunk, 16
    assert lane_steps(WeightFormats("mxfp4", "mxfp4", "bfloat16"), 4, "cuda") == LaneSteps(16, 16, 8)
    assert lane_steps(WeightFormats("q4_k", "k_mix", "bfloat16"), 1, "rocm") == LaneSteps(16, 16, 8)
    assert lane_steps(WeightFormats("q3_k", "q2_k", "bfloat16"), 1, "cuda") == LaneSteps(16, 16, 8)
    assert lane_steps(WeightFormats("k_mix", "q5_k", "bfloat16"), 1, "cuda") == LaneSteps(32, 32, 8)
    assert lane_steps(WeightFormats("iq4_xs", "iq4_nl", "bfloat16"), 1, "cuda") == LaneSteps(32, 32, 8)
    assert lane_steps(WeightFormats("k_mix", "q5_1", "bfloat16"), 1, "cuda") == LaneSteps(32, 16, 8)
    assert lane_steps(WeightFormats("mxfp4", "q4_1", "mxfp4"), 1, "rocm") == LaneSteps(16, 16, 16)
    shape = ModelShape(layers=1, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256)

    def qkv_split(schedule) -> int:
        return next(schedule.task(i).k_split for i in range(len(schedule)) if schedule.task(i).op == Op.QKV)

    assert qkv_split(build_schedule(shape, 132, True, 32, LaneSteps(32, 32, 8))) == 1
    assert qkv_split(build_schedule(shape, 132, True, 32)) == 2


def test_tiled_gate_up_tasks_take_whole_tile_pairs():
    """Over MXFP4 fragment tiles a gate/up task takes whole pairs of 16-row tiles (8 row groups), shared by the
    block's 8 warps at one token and a warp each at more; every row group is still computed once."""
    tiled = WeightFormats("mxfp4", "mxfp4", "bfloat16", gate_up_tiles=True)
    assert lane_steps(tiled, 1, "cuda") == LaneSteps(32, 32, 8, gate_up_units=8, gate_up_team=8)
    assert lane_steps(tiled, 4, "cuda") == LaneSteps(16, 16, 8, gate_up_units=8, gate_up_team=1)
    for name, workers, tokens in (("llama-3.1-8b", 132, 1), ("llama-3.2-1b", 132, 4), ("smollm2-like", 7, 1)):
        shape = dataclasses.replace(SHAPES[name], layers=1)
        schedule = build_schedule(shape, workers, True, 32, lane_steps(tiled, tokens, "cuda"))
        gate_up = [schedule.task(i) for i in range(len(schedule)) if schedule.task(i).op == Op.GATE_UP]
        assert all(t.first % 8 == 0 and t.count % 8 == 0 for t in gate_up)
        assert {t.k_split for t in gate_up} == {8 if tokens == 1 else 1}
        covered = np.concatenate([np.arange(t.first, t.first + t.count) for t in gate_up])
        np.testing.assert_array_equal(np.sort(covered), np.arange(shape.units(Op.GATE_UP)))
        assert len(gate_up) <= workers
        check_tile_staging(schedule)
    # B (4 bytes an input) and the tile pairs' sums must fit the kernel's staging area: a clear error where not.
    too_wide = dataclasses.replace(SHAPES["llama-3.1-8b"], layers=1, hidden=16384)
    with pytest.raises(lithos.LithosError, match="leave gate_up out of LITHOS_TILES"):
        check_tile_staging(build_schedule(too_wide, 132, True, 32, lane_steps(tiled, 1, "cuda")))


def simulate_grid(schedule, grid: int) -> int:
    """Run the task list as the kernel does (block b takes tasks b, b + grid, ...; a block waits on its
    current task's counter) and return the rounds taken; fails on a deadlock."""
    tasks = tasks_of(schedule)
    counters = np.zeros(schedule.n_counters, int)
    next_task = list(range(grid))
    rounds = 0
    while any(i < len(tasks) for i in next_task):
        progressed = False
        for block in range(grid):
            i = next_task[block]
            if i >= len(tasks):
                continue
            t = tasks[i]
            if t.wait_counter >= 0 and counters[t.wait_counter] < t.wait_target:
                continue
            counters[t.signal_counter] += 1
            if t.op == Op.ATTENTION and counters[t.signal_counter] == t.arrivals:
                counters[t.aux] += 1
            next_task[block] += grid
            progressed = True
        assert progressed, f"deadlock with a grid of {grid}: blocks wait at {next_task}"
        rounds += 1
    return rounds


@pytest.mark.parametrize("grid", [1, 2, 5, 64, 100, 131])
def test_any_grid_size_completes_the_schedule(grid):
    schedule = build_schedule(SHAPES["smollm2-like"], 64)
    simulate_grid(schedule, grid)


def test_a_task_that_runs_before_its_inputs_is_an_error():
    schedule = build_schedule(SHAPES["tiny"], 4)
    rows = schedule.tasks.copy()
    first_o = next(i for i, t in enumerate(tasks_of(schedule)) if t.op == Op.O_PROJ)
    rows = np.concatenate([rows[first_o : first_o + 1], np.delete(rows, first_o, axis=0)])
    broken = dataclasses.replace(schedule, tasks=rows)
    with pytest.raises(ScheduleError, match="task 0: layer 0 o_proj row groups .* runs before its input"):
        interpret(broken, *random_step(SHAPES["tiny"], 1, 10, jnp.float32), eps=1e-5)
    with pytest.raises(AssertionError, match="deadlock"):
        simulate_grid(broken, 1)


def test_describe_task_names_the_work_and_the_wait():
    schedule = build_schedule(SHAPES["tiny"], 4)
    text = [describe_task(schedule, i) for i in range(len(schedule))]
    assert text[0].startswith("task 0: layer 0 qkv row groups 0..") and text[0].endswith("waits for nothing")
    assert any("attention KV head 1, split 0; waits for 'layer 0 qkv group 1' >= " in line for line in text)
    assert text[-1].startswith(f"task {len(schedule) - 1}: head row groups")


# --------------------------------------------------------------------------------------------
# Interpreter
# --------------------------------------------------------------------------------------------


def random_step(shape: ModelShape, tokens: int, context: int, dtype, seed: int = 0, max_len: int | None = None):
    """Random weights, embedded tokens, positions context..context+tokens-1 and a cache whose first
    `context` positions hold random keys and values (drawn on the default device: 1B shapes too)."""
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    L, D, F, H, KV, d = shape.layers, shape.hidden, shape.ffn, shape.heads, shape.kv_heads, shape.head_dim

    def rand(*dims, scale=1.0):
        return (scale * jax.random.normal(next(keys), dims, jnp.float32)).astype(dtype)

    weights = StepWeights(
        attn_norm=1 + rand(L, D, scale=0.1),
        wq=rand(L, H * d, D, scale=D**-0.5),
        wk=rand(L, KV * d, D, scale=D**-0.5),
        wv=rand(L, KV * d, D, scale=D**-0.5),
        wo=rand(L, D, H * d, scale=(H * d) ** -0.5),
        mlp_norm=1 + rand(L, D, scale=0.1),
        w_gate=rand(L, F, D, scale=D**-0.5),
        w_up=rand(L, F, D, scale=D**-0.5),
        w_down=rand(L, D, F, scale=F**-0.5),
        final_norm=1 + rand(D, scale=0.1),
        lm_head=rand(shape.vocab, D, scale=D**-0.5),
    )
    max_len = max_len or context + tokens + 3
    filled = (jnp.arange(max_len) < context)[None, None, None, :, None]
    k_cache = jnp.where(filled, rand(L, 1, KV, max_len, d), 0).astype(dtype)
    v_cache = jnp.where(filled, rand(L, 1, KV, max_len, d), 0).astype(dtype)
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), jnp.float32)
    positions = jnp.arange(context, context + tokens, dtype=jnp.int32)
    return weights, rand(tokens, D), positions, inv_freq, k_cache, v_cache


def interpreted(schedule, *args, **options):
    """`interpret` compiled as one program: run op by op, its thousands of small operations cost the suite
    minutes on a CPU (the ops and their order are the same; the results agree to float rounding)."""
    return jax.jit(partial(interpret, schedule, **options))(*args)


@pytest.mark.parametrize("tokens", [1, 5])
def test_per_task_and_batched_interpretation_agree(tokens):
    shape = dataclasses.replace(SHAPES["tiny"], layers=1)  # every task kind; per task, a long program
    schedule = build_schedule(shape, 6)
    args = random_step(shape, tokens, 150, jnp.float32)
    batched = interpreted(schedule, *args, eps=1e-5, with_logits=True)
    single = interpreted(schedule, *args, eps=1e-5, with_logits=True, per_task=True)
    for a, b in zip(batched, single, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("workers", [3, 64])
def test_interpreter_result_does_not_depend_on_the_task_cut(workers):
    """More workers means more, smaller tasks and more attention splits: the same step."""
    shape = SHAPES["tiny"]
    args = random_step(shape, 4, 700, jnp.float32, seed=3)
    base = interpreted(build_schedule(shape, 1), *args, eps=1e-5, with_logits=True)
    other = interpreted(build_schedule(shape, workers), *args, eps=1e-5, with_logits=True)
    for a, b in zip(base, other, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def step_logits(cfg, params, kernels, context, new_tokens, seed=0):
    """Logits of `new_tokens` tokens after a random `context`-token prefix (prefill on the reference path)."""
    forward = jax.jit(partial(llama.forward, cfg=cfg, kernels=kernels))
    prefill = jax.jit(partial(llama.forward, cfg=cfg, kernels="reference"))
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, context + new_tokens)), jnp.int32)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, context + 16, cfg.head_dim, params.embed.dtype)
    _, cache = prefill(params, tokens[:, :context], jnp.arange(context)[None], cache)
    positions = jnp.arange(context, context + new_tokens)[None]
    logits, cache = forward(params, tokens[:, context:], positions, cache)
    argmax = jax.jit(partial(llama.forward_argmax, cfg=cfg, kernels=kernels))
    _, cache2 = prefill(params, tokens[:, :context], jnp.arange(context)[None], cache)
    greedy, _ = argmax(params, tokens[:, context:], positions, cache2)
    return np.asarray(logits[0]), np.asarray(greedy[0])


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("new_tokens", [1, 5])
def test_megakernel_path_equals_reference_forward(window, new_tokens):
    """Float32 weights: the interpreter and the reference differ only in summation order."""
    cfg = config_of(SHAPES["smollm2-like"], window)
    params = llama.init_params(cfg, jax.random.key(1), jnp.float32)
    ref, ref_tokens = step_logits(cfg, params, "reference", 130, new_tokens)
    mega, mega_tokens = step_logits(cfg, params, "megakernel", 130, new_tokens)
    np.testing.assert_allclose(mega, ref, atol=2e-4 * np.abs(ref).max(), rtol=1e-4)
    np.testing.assert_array_equal(mega_tokens, ref_tokens)
    np.testing.assert_array_equal(mega_tokens, ref.argmax(-1))


def test_megakernel_path_in_bf16_within_rounding_of_reference():
    cfg = config_of(SHAPES["smollm2-like"])
    params = llama.init_params(cfg, jax.random.key(2), jnp.bfloat16)
    ref, _ = step_logits(cfg, params, "reference", 100, 4)
    mega, mega_tokens = step_logits(cfg, params, "megakernel", 100, 4)
    scale = np.abs(ref).max()
    assert np.abs(mega - ref).max() <= 0.03 * scale
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * scale
    np.testing.assert_array_equal(mega_tokens[clear], ref.argmax(-1)[clear])


def test_decoder_and_hidden_states_on_the_megakernel_path():
    cfg = config_of(SHAPES["tiny"])
    cfg = dataclasses.replace(cfg, head_dim=64, hidden_size=128, num_heads=2, num_kv_heads=1)
    params = llama.init_params(cfg, jax.random.key(3), jnp.float32)
    tokens = jnp.asarray([[5, 9, 11]], jnp.int32)
    positions = jnp.arange(3)[None]
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 8, cfg.head_dim, jnp.float32)
    ref_h, ref_cache = llama.hidden_states(params, tokens, positions, cache, cfg, "reference")
    h, mega_cache = llama.hidden_states(params, tokens, positions, cache, cfg, "megakernel")
    np.testing.assert_allclose(np.asarray(h), np.asarray(ref_h), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(mega_cache.k), np.asarray(ref_cache.k), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mega_cache.v), np.asarray(ref_cache.v), rtol=1e-4, atol=1e-5)


def hf_logits(path, tokens: np.ndarray) -> np.ndarray:
    transformers = require("transformers")
    torch = require("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("arch", ["llama_hd64", "mistral_hd64_window"])
@pytest.mark.parametrize("tied", [False, True])
def test_megakernel_steps_match_transformers(hf_checkpoint, arch, tied):
    """Decode steps (T = 1) and a verification block (T = 4) through the task list, against transformers."""
    path = hf_checkpoint(arch, tied)
    loaded = load_checkpoint(path, dtype="float32")
    cfg, params = loaded.cfg, loaded.params
    prefill = jax.jit(partial(llama.forward, cfg=cfg, kernels="reference"))
    forward = jax.jit(partial(llama.forward, cfg=cfg, kernels="megakernel"))
    prompt_len, steps, block = 20, 6, 4
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (1, prompt_len + steps + block))
    expected = hf_logits(path, tokens)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, jnp.float32)
    _, cache = prefill(params, jnp.asarray(tokens[:, :prompt_len]), jnp.arange(prompt_len)[None], cache)
    for t in range(prompt_len, prompt_len + steps):
        logits, cache = forward(params, jnp.asarray(tokens[:, t : t + 1]), jnp.array([[t]]), cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], expected[:, t], atol=2e-4, rtol=1e-4)
    start = prompt_len + steps
    logits, _ = forward(params, jnp.asarray(tokens[:, start:]), jnp.arange(start, start + block)[None], cache)
    np.testing.assert_allclose(np.asarray(logits), expected[:, start:], atol=2e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# Packed weights (lithos.quant formats, read as stored)
# --------------------------------------------------------------------------------------------


def pack(w: jax.Array, fmt_name: str, rng: np.random.Generator) -> quant.QuantizedArray:
    """`w`'s shape in `fmt_name`: quantized from `w` where lithos makes the format (MX, FP8 block),
    random GGUF blocks of `w`'s spread otherwise (lithos reads GGUF but does not make it)."""
    if fmt_name in ("mxfp4", "mxfp8", "fp8_block128"):
        return quant.quantize(w, fmt_name, dtype=w.dtype)
    return quant.random_packed_like(w, fmt_name, rng)


# Matrix groups of a model, and what a packed model holds in them.
PACKED_CASES = {
    # MX and FP8 block formats as lithos quantizes them; a tied head packed too (gathers and LM head).
    "mx": {"attention": "mxfp8", "mlp": "mxfp4", "embed": "fp8_block128"},
    # GGUF formats, as in the default model (Q4_1 layers, Q8_0 tied embedding).
    "gguf": {"attention": "q4_0", "mlp": "q4_1", "embed": "q8_0"},
    # GGUF K-quants, as in Q4_K_M files (Q6_K where more bits are kept, the output among them).
    "k_quants": {"attention": "q4_k", "mlp": "q6_k", "embed": "q6_k"},
    "k_quants_5": {"attention": "q5_k", "mlp": "k_mix", "embed": "q5_k"},
    "k_quants_3": {"attention": "q3_k", "mlp": "q2_k", "embed": "q6_k"},  # as in Q3_K_M and Q2_K files
    "iq4": {"attention": "iq4_nl", "mlp": "iq4_xs", "embed": "iq4_nl"},  # llama.cpp's non-linear 4-bit
    # GGUF's 5-bit blocks of 32, where K-quant files fall back for rows of no whole super-blocks (SmolLM2's 576).
    "gguf_5": {"attention": "q5_0", "mlp": "q5_1", "embed": "q8_0"},
}
# A tiny model's sizes; the K-quants' rows hold whole super-blocks of 256.
PACKED_SIZES = {
    "k_quants": dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "k_quants_5": dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "k_quants_3": dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "iq4": dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512),
}


def packed_params(params, groups: dict[str, str], seed: int = 0):
    rng = np.random.default_rng(seed)
    for group, fmt_name in groups.items():
        for name in names_for_groups([group], tied=params.lm_head is None):
            if (w := param_at(params, name)) is not None:  # a group names every family's matrices
                params = with_param(params, name, pack(w, fmt_name, rng))
    return params


def packed_step_weights(weights: StepWeights, groups: dict[str, str], seed: int = 0) -> StepWeights:
    """`weights` with the matrices of `groups` ("attention", "mlp", "lm_head", or one matrix's name, which then
    overrides its group's format: {"attention": "k_mix", "wo": "q4_k"}) packed."""
    rng = np.random.default_rng(seed)
    names = {"attention": ("wq", "wk", "wv", "wo"), "mlp": ("w_gate", "w_up", "w_down")}
    packed = {
        name: pack(getattr(weights, name), fmt, rng)
        for group, fmt in groups.items()
        for name in names.get(group, (group,))
    }
    return weights._replace(**packed)


@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_megakernel_path_on_packed_weights_equals_reference_forward(case):
    """Every packed format, read as stored: the interpreter dequantises exactly, as the reference path
    does, so the two differ only in summation order."""
    sizes = PACKED_SIZES.get(case, dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=160))
    cfg = dataclasses.replace(config_of(SHAPES["tiny"]), head_dim=64, **sizes)
    params = packed_params(llama.init_params(cfg, jax.random.key(4), jnp.float32), PACKED_CASES[case])
    assert all(isinstance(w, quant.QuantizedArray) for w in (params.embed, params.layers.wq, params.layers.w_down))
    ref, ref_tokens = step_logits(cfg, params, "reference", 40, 3)
    mega, mega_tokens = step_logits(cfg, params, "megakernel", 40, 3)
    np.testing.assert_allclose(mega, ref, atol=2e-4 * np.abs(ref).max(), rtol=1e-4)
    np.testing.assert_array_equal(mega_tokens, ref_tokens)


def test_groups_of_mixed_k_quants_are_laid_out_in_k_mix_for_the_megakernel():
    """A Q4_K_M file's Q/K/V mix Q4_K with K_MIX (its V); the megakernel reads one format a group (Q/K/V, gate/up;
    O and down each their own), so params_for_kernels lays Q/K/V out in K_MIX, the same values, and keeps O, gate,
    up and down as they are; the step equals the reference path's on the params as loaded."""
    sizes = PACKED_SIZES["k_quants"]
    cfg = dataclasses.replace(config_of(SHAPES["tiny"]), head_dim=64, **sizes)
    params = llama.init_params(cfg, jax.random.key(5), jnp.float32)
    rng = np.random.default_rng(5)
    q4_k_m = {
        "wq": "q4_k",
        "wk": "q4_k",
        "wv": "k_mix",
        "wo": "q4_k",
        "w_gate": "q4_k",
        "w_up": "q4_k",
        "w_down": "k_mix",
    }
    layers = params.layers.replace(**{n: pack(getattr(params.layers, n), f, rng) for n, f in q4_k_m.items()})
    params = params.replace(layers=layers)
    with pytest.raises(lithos.LithosError, match="Q/K/V matrices must share one format.*params_for_kernels"):
        step_logits(cfg, params, "megakernel", 40, 3)
    laid_out = llama.params_for_kernels(params, cfg, "megakernel")
    for name, fmt in q4_k_m.items():
        w, mixed = getattr(params.layers, name), getattr(laid_out.layers, name)
        assert mixed.format == (quant.K_MIX if name in ("wq", "wk", "wv") else quant.get_format(fmt)), name
        np.testing.assert_array_equal(np.asarray(quant.dequantize(mixed)), np.asarray(quant.dequantize(w)))
    ref, ref_tokens = step_logits(cfg, params, "reference", 40, 3)
    mega, mega_tokens = step_logits(cfg, laid_out, "megakernel", 40, 3)
    np.testing.assert_allclose(mega, ref, atol=2e-4 * np.abs(ref).max(), rtol=1e-4)
    np.testing.assert_array_equal(mega_tokens, ref_tokens)
    # a Q6_K V with a d of 4096 has no K_MIX form: refused with the way out
    wv = pack(quant.dequantize(params.layers.wv), "q6_k", rng)
    records = np.asarray(wv.scales).copy()
    records[0, 0, 0, 0:2] = np.float16(4096).reshape(1).view(np.uint8)
    wide = params.replace(layers=params.layers.replace(wv=wv.replace(scales=jnp.asarray(records))))
    with pytest.raises(lithos.LithosError, match="no k_mix form.*kernels='fused'"):
        llama.params_for_kernels(wide, cfg, "megakernel")


def test_weight_formats_choose_the_build():
    """Each (Q/K/V, gate/up, head) format triple, and O's and down's where they differ, is its own build, registered
    under its own name; bf16 weights take the plain build, and a group of mixed formats is an error that names the
    fix."""
    from lithos.custom_calls import build

    weights, *_ = random_step(SHAPES["tiny"], 1, 8, jnp.bfloat16)
    assert weight_formats(weights) == WeightFormats() and WeightFormats().variant() == build.PLAIN
    packed = packed_step_weights(weights, {"attention": "mxfp8", "mlp": "q4_1", "lm_head": "q8_0"})
    formats = weight_formats(packed)
    assert formats == WeightFormats("mxfp8", "q4_1", "q8_0")
    variant = formats.variant()
    assert variant.defines == ("LITHOS_MK_ATTENTION_FORMAT=2", "LITHOS_MK_MLP_FORMAT=6", "LITHOS_MK_HEAD_FORMAT=4")
    assert variant.target("LithosMegakernel") == "LithosMegakernel_mxfp8_q4_1_q8_0"
    # O and down in formats of their own (a Q4_K_M file's O in Q4_K beside a K_MIX Q/K/V): defines of their own
    split = packed._replace(wo=weights.wo, w_down=packed.wq)
    formats = weight_formats(split)
    assert formats == WeightFormats("mxfp8", "q4_1", "q8_0", o="bfloat16", down="mxfp8")
    assert formats.every_format == ("mxfp8", "bfloat16", "q4_1", "mxfp8", "q8_0")
    assert formats.variant().defines[3:] == ("LITHOS_MK_O_FORMAT=0", "LITHOS_MK_DOWN_FORMAT=2")
    assert formats.variant().suffix == "mxfp8_q4_1_q8_0_o_bfloat16_down_mxfp8"
    assert lane_steps(formats, 1, "cuda") == LaneSteps(16, 16, 16, o=8, down=16)
    with pytest.raises(lithos.LithosError, match="Q/K/V matrices must share one format"):
        weight_formats(packed._replace(wv=weights.wv))
    with pytest.raises(lithos.LithosError, match="gate/up matrices must share one format"):
        weight_formats(packed._replace(w_up=weights.w_up))


def laid_out(weights: StepWeights, head_dim: int, platform: str | None = "cuda") -> StepWeights:
    """`weights` as the megakernel on `platform` is asked to read them (LITHOS_TILES)."""
    from lithos.custom_calls.megakernel import tiles_for_megakernel
    from lithos.custom_calls.megakernel.kernel import TILE_GROUPS

    names = [name for group in TILE_GROUPS.values() for name in group]
    matrices = {n: getattr(weights, n) for n in names}
    return weights._replace(**tiles_for_megakernel(matrices, head_dim, platform))


def same_layout(a: StepWeights, b: StepWeights) -> bool:
    return all(x is y for x, y in zip(a, b, strict=True))


def test_gate_up_in_fragment_tiles_is_a_build_of_its_own(monkeypatch):
    """MXFP4 Q/K/V, O, gate and up laid out in tiles on CUDA by default (down's 160 inputs are no whole tiles) take
    the tiles build; where rows are asked for (LITHOS_TILES=none), elsewhere, or where the tiles do not fit, the
    weights stay as they are; the interpreter reads both layouts alike; a bad LITHOS_TILES, or a variable it
    replaced, is an error that names the fix."""
    shape = dataclasses.replace(SHAPES["tiny"], hidden=128, ffn=160)
    weights, *rest = random_step(shape, 2, 40, jnp.float32)
    packed = packed_step_weights(weights, {"attention": "mxfp4", "mlp": "mxfp4"})
    hd = shape.head_dim

    monkeypatch.setenv("LITHOS_TILES", "none")
    assert same_layout(laid_out(packed, hd), packed)
    monkeypatch.setenv("LITHOS_TILES", "gate_up,mlp")
    with pytest.raises(lithos.LithosError, match="from qkv, o, gate_up, down"):
        laid_out(packed, hd)
    monkeypatch.delenv("LITHOS_TILES")  # the default
    monkeypatch.setenv("LITHOS_GATE_UP_TILES", "0")
    with pytest.raises(lithos.LithosError, match="replaced by LITHOS_TILES"):
        laid_out(packed, hd)
    monkeypatch.delenv("LITHOS_GATE_UP_TILES")
    assert same_layout(laid_out(packed, hd, None), packed) and same_layout(laid_out(packed, hd, "rocm"), packed)
    default = laid_out(packed, hd)
    assert all(getattr(default, n).format.rotary_head == hd for n in ("wq", "wk", "wv"))
    assert default.w_gate.format == default.w_up.format == default.wo.format == quant.MXFP4_TILES
    rows = {n: getattr(packed, n) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up")}
    assert same_layout(default._replace(**rows), packed)
    formats = WeightFormats("mxfp4", "mxfp4", "bfloat16", True, qkv_tiles=True, o_tiles=True)
    assert weight_formats(default) == formats
    monkeypatch.setenv("LITHOS_TILES", "gate_up")
    tiled = laid_out(packed, hd)
    assert tiled.w_gate.format == tiled.w_up.format == quant.MXFP4_TILES
    assert same_layout(tiled._replace(w_gate=packed.w_gate, w_up=packed.w_up), packed)
    formats = weight_formats(tiled)
    assert formats == WeightFormats("mxfp4", "mxfp4", "bfloat16", gate_up_tiles=True)
    assert formats.variant().defines[-1] == "LITHOS_MK_GATE_UP_TILES=1"
    assert formats.variant().target("LithosMegakernel") == "LithosMegakernel_mxfp4_mxfp4_bfloat16_tiles"
    schedule = build_schedule(shape, 5, True, 32, LaneSteps(gate_up_units=8, gate_up_team=8))
    rows, tiles = (interpreted(schedule, w, *rest, eps=1e-5, with_logits=True) for w in (packed, tiled))
    for a, b in zip(rows, tiles, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Gate in tiles but up in rows: two layouts of one pair, an error.
    with pytest.raises(lithos.LithosError, match="gate_up matrices laid out as"):
        weight_formats(packed._replace(w_gate=tiled.w_gate))
    # A scale the tiled kernel cannot convert exactly keeps the rows.
    large = packed._replace(w_gate=packed.w_gate.replace(scales=packed.w_gate.scales.at[0, 0, 0].set(200)))
    assert same_layout(laid_out(large, hd), large)
    # rows of 12352 inputs would leave B too little room beside the sums
    wide = quant.quantize(np.ones((1, 16, 12352), np.float32), "mxfp4")
    assert same_layout(laid_out(packed._replace(w_gate=wide, w_up=wide), hd), packed._replace(w_gate=wide, w_up=wide))
    # rows of 96 inputs are not whole tiles of 64
    odd = dataclasses.replace(SHAPES["tiny"], hidden=96)
    small = packed_step_weights(random_step(odd, 1, 8, jnp.float32)[0], {"mlp": "mxfp4"})
    assert same_layout(laid_out(small, odd.head_dim), small)


def test_tiles_laid_out_again_for_fewer_groups(monkeypatch):
    """Every MXFP4 group in tiles by default; weights laid out for other groups (LITHOS_TILES) change only the
    groups that differ (the rest the same arrays), back to the rows' very codes and scales; HIP reads rows, even of
    tiled weights."""
    from lithos.custom_calls.megakernel.kernel import TILE_GROUPS, tiles_wanted

    monkeypatch.delenv("LITHOS_TILES", raising=False)
    assert tiles_wanted("cuda") == TILE_GROUPS.keys()
    assert tiles_wanted("rocm") == tiles_wanted(None) == frozenset()
    shape = dataclasses.replace(SHAPES["tiny"], hidden=128, ffn=192)
    packed = packed_step_weights(random_step(shape, 3, 40, jnp.float32)[0], {"attention": "mxfp4", "mlp": "mxfp4"})
    hd = shape.head_dim
    every = laid_out(packed, hd)
    assert weight_formats(every) == WeightFormats("mxfp4", "mxfp4", "bfloat16", True, True, True, True)
    monkeypatch.setenv("LITHOS_TILES", "qkv,gate_up")
    fewer = laid_out(every, hd)
    assert weight_formats(fewer) == WeightFormats("mxfp4", "mxfp4", "bfloat16", True, qkv_tiles=True)
    assert all(getattr(fewer, n) is getattr(every, n) for n in ("wq", "wk", "wv", "w_gate", "w_up"))
    for name in ("wo", "w_down"):  # from the tiles back to the rows as stored
        got, stored = getattr(fewer, name), getattr(packed, name)
        assert got.format == stored.format == quant.MXFP4
        np.testing.assert_array_equal(np.asarray(got.data), np.asarray(stored.data))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(stored.scales))
    assert weight_formats(laid_out(packed, hd)) == weight_formats(fewer)  # from the rows alike
    monkeypatch.delenv("LITHOS_TILES")
    assert all(getattr(laid_out(fewer, hd), n) is getattr(fewer, n) for n in ("wq", "wk", "wv", "w_gate", "w_up"))
    rows = laid_out(every, hd, "rocm")
    assert weight_formats(rows) == WeightFormats("mxfp4", "mxfp4", "bfloat16")
    np.testing.assert_array_equal(np.asarray(rows.wq.data), np.asarray(packed.wq.data))  # rotary rows in order


@pytest.mark.parametrize("asked", ["gate_up,down", "down", "o", "qkv", "qkv,o,gate_up,down"])
def test_single_matrix_groups_in_fragment_tiles_are_builds_of_their_own(monkeypatch, asked):
    """Down, O and Q/K/V laid out in tiles on CUDA when LITHOS_TILES names them (Q/K/V in rotary tiles of the
    model's heads) take builds of their own; their tasks take whole 16-row tiles at every token count (Q/K/V's
    within one KV group); the interpreter reads every layout alike; a group laid out in two ways is an error."""
    from lithos.custom_calls.megakernel.kernel import TILE_GROUPS, check_tiled_staging, tiled_ops

    shape = dataclasses.replace(SHAPES["tiny"], hidden=128, ffn=192)
    weights, *rest = random_step(shape, 3, 40, jnp.float32)
    packed = packed_step_weights(weights, {"attention": "mxfp4", "mlp": "mxfp4"})
    monkeypatch.setenv("LITHOS_TILES", asked)
    groups = asked.split(",")
    tiled = laid_out(packed, shape.head_dim)
    for group, names in TILE_GROUPS.items():
        for name in names:
            fmt = getattr(tiled, name).format
            assert fmt.tile is not None if group in groups else fmt == quant.MXFP4
            assert fmt.rotary_head == (shape.head_dim if group == "qkv" and group in groups else 0)
    formats = weight_formats(tiled)
    flags = {g: g in groups for g in TILE_GROUPS}
    assert formats == WeightFormats(
        "mxfp4", "mxfp4", "bfloat16", flags["gate_up"], flags["down"], flags["qkv"], flags["o"]
    )
    defines = formats.variant().defines
    for group, define in (("down", "DOWN_TILES"), ("qkv", "QKV_TILES"), ("o", "O_TILES")):
        assert (f"LITHOS_MK_{define}=1" in defines) == (group in groups)
        assert (f"_{group}_tiles" in formats.variant().suffix) == (group in groups)
    ops = tiled_ops(formats)
    for tokens in (1, 3):
        schedule = build_schedule(shape, 5, True, 32, lane_steps(formats, tokens, "cuda"))
        for op in ops:
            mine = [t for t in tasks_of(schedule) if t.op == op and t.layer == 0]
            assert all(t.first % 4 == 0 and t.count % 4 == 0 and t.k_split == 8 for t in mine)
            covered = np.concatenate([np.arange(t.first, t.first + t.count) for t in mine])
            np.testing.assert_array_equal(np.sort(covered), np.arange(shape.units(op)))
            if op == Op.QKV:  # a task's tiles within one KV group
                per_group = shape.qkv_units_per_group
                assert all(t.first // per_group == (t.first + t.count - 1) // per_group for t in mine)
        check_tiled_staging(schedule, tokens, ops)
    schedule = build_schedule(shape, 5, True, 32, lane_steps(formats, 3, "cuda"))
    rows, tiles = (interpreted(schedule, w, *rest, eps=1e-5, with_logits=True) for w in (packed, tiled))
    for a, b in zip(rows, tiles, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if "qkv" in groups:  # Q in rotary tiles, K and V in rows; or plain tiles where rotary ones are read
        with pytest.raises(lithos.LithosError, match="qkv matrices laid out as"):
            weight_formats(packed._replace(wq=tiled.wq))
        with pytest.raises(lithos.LithosError, match="all in rotary tiles"):
            weight_formats(packed._replace(**{n: quant.to_tiles(getattr(packed, n)) for n in TILE_GROUPS["qkv"]}))
    if "o" in groups:
        with pytest.raises(lithos.LithosError, match="o matrices laid out as"):
            weight_formats(packed._replace(wo=quant.to_tiles(packed.wo, shape.head_dim)))


def test_tiled_sums_that_do_not_fit_are_an_error_that_names_the_fix():
    """A tiled task keeps its warps' sums of its tiles (and at one token its B) in 64 KB: 16 tokens of 8B's down over
    8 blocks (32 tiles a task) would need 256 KB; over 132 blocks they fit, and so do Q/K/V's (4 tokens an
    n-block)."""
    from lithos.custom_calls.megakernel.kernel import check_tiled_staging, tiled_ops, tiled_staging_bytes

    wide = dataclasses.replace(SHAPES["llama-3.1-8b"], layers=1)
    # At one token B is staged before the sums: Q/K/V's x * norm_w in two parts (4 bytes an input), as gate/up's;
    # O's and down's activations in one (2 bytes an input). 4 tokens an n-block for Q/K/V at more, 8 for O and down.
    assert tiled_staging_bytes(Op.QKV, 3, 1, wide) == 4096 * 4 + 3 * 4096
    assert tiled_staging_bytes(Op.DOWN, 2, 1, wide) == 14336 * 2 + 2 * 4096
    assert tiled_staging_bytes(Op.O_PROJ, 2, 1, wide) == 4096 * 2 + 2 * 4096
    assert tiled_staging_bytes(Op.QKV, 3, 5, wide) == 3 * 2 * 4096
    assert tiled_staging_bytes(Op.DOWN, 3, 5, wide) == 3 * 4096
    formats = WeightFormats("mxfp4", "mxfp4", "bfloat16", True, True, True, True)
    with pytest.raises(lithos.LithosError, match="leave down out of LITHOS_TILES"):
        check_tiled_staging(build_schedule(wide, 8, True, 32, lane_steps(formats, 16, "cuda")), 16, (Op.DOWN,))
    for tokens in (1, 8, 16):
        check_tiled_staging(
            build_schedule(wide, 132, True, 32, lane_steps(formats, tokens, "cuda")), tokens, tiled_ops(formats)
        )


def test_tiled_tasks_are_cut_to_fit_their_staging(monkeypatch):
    """Where a group's share of the grid would not fit a tiled task's staging (a 70B shape's Q/K/V at 16 tokens on
    132 blocks: 5 tiles, 80 KB of 64), the schedule the kernel runs cuts the group into more tasks than the grid has
    blocks, each block taking several; where it fits (8B on 132 blocks) the schedule is the one without caps; the
    interpreter's result does not depend on the cut."""
    from lithos.custom_calls.megakernel.kernel import check_tiled_staging, largest_task, staged_lane_steps, tiled_ops

    formats = WeightFormats("mxfp4", "mxfp4", "bfloat16", True, qkv_tiles=True)
    large = dataclasses.replace(SHAPES["llama-3.1-8b"], layers=1, hidden=8192, heads=64)
    with pytest.raises(lithos.LithosError, match="leave qkv out of LITHOS_TILES"):
        check_tiled_staging(build_schedule(large, 132, True, 32, lane_steps(formats, 16, "cuda")), 16, (Op.QKV,))
    for tokens in (1, 8, 16):
        steps = staged_lane_steps(large, formats, tokens, "cuda")
        schedule = build_schedule(large, 132, True, 32, steps)
        check_tiled_staging(schedule, tokens, tiled_ops(formats))
        qkv_tasks = sum(t.op == Op.QKV for t in tasks_of(schedule))
        assert (largest_task(schedule, Op.QKV) // 4, qkv_tasks) == ((4, 160) if tokens == 16 else (5, 128))
        eight = dataclasses.replace(SHAPES["llama-3.1-8b"], layers=1)
        capped, plain = (
            build_schedule(eight, 132, True, 32, s)
            for s in (staged_lane_steps(eight, formats, tokens, "cuda"), lane_steps(formats, tokens, "cuda"))
        )
        np.testing.assert_array_equal(capped.tasks, plain.tasks)

    shape = dataclasses.replace(SHAPES["tiny"], hidden=128, ffn=192)
    weights, *rest = random_step(shape, 3, 40, jnp.float32)
    monkeypatch.setenv("LITHOS_TILES", "qkv,gate_up,down")
    tiled = laid_out(packed_step_weights(weights, {"attention": "mxfp4", "mlp": "mxfp4"}), shape.head_dim)
    steps = lane_steps(weight_formats(tiled), 3, "cuda")
    one_tile = dataclasses.replace(steps, tiled_caps=(1,) * len(steps.tiled))
    whole, cut = (build_schedule(shape, 2, True, 32, s) for s in (steps, one_tile))
    for op in (Op.QKV, Op.DOWN):
        assert largest_task(whole, op) > 4 and largest_task(cut, op) == 4
    for a, b in zip(*(interpreted(s, tiled, *rest, eps=1e-5, with_logits=True) for s in (whole, cut)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_down_of_inputs_that_are_not_whole_tiles_stays_in_rows(monkeypatch):
    """ffn of 160 is not whole tiles of 64 inputs: down keeps its rows where LITHOS_TILES names it."""
    monkeypatch.setenv("LITHOS_TILES", "down")
    shape = dataclasses.replace(SHAPES["tiny"], hidden=128, ffn=160)
    odd = packed_step_weights(random_step(shape, 1, 8, jnp.float32)[0], {"mlp": "mxfp4"})
    assert same_layout(laid_out(odd, shape.head_dim), odd)


def test_params_laid_out_in_tiles_read_the_same_values(monkeypatch):
    """A model's params laid out for the megakernel on CUDA with every group in tiles (Q/K/V in rotary tiles of its
    heads): the reference path and the megakernel's interpreter read the same logits from them as from the rows."""
    from lithos.custom_calls.megakernel import kernel as mk
    from lithos.models import params_for_kernels

    cfg = dataclasses.replace(
        config_of(SHAPES["tiny"]), head_dim=64, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=192
    )
    params = packed_params(
        llama.init_params(cfg, jax.random.key(5), jnp.float32), {"attention": "mxfp4", "mlp": "mxfp4"}
    )
    monkeypatch.setenv("LITHOS_TILES", "qkv,o,gate_up,down")
    monkeypatch.setattr(mk, "_gpu_platform", lambda: "cuda")
    tiled = params_for_kernels(params, cfg, "megakernel")
    monkeypatch.undo()  # the interpreter, on this machine's CPU
    layers = tiled.layers
    assert layers.wq.format.rotary_head == layers.wk.format.rotary_head == layers.wv.format.rotary_head == 64
    assert layers.wo.format == layers.w_gate.format == layers.w_down.format == quant.MXFP4_TILES
    assert params_for_kernels(params, cfg, "fused") is params
    for kernels in ("reference", "megakernel"):
        expected, expected_tokens = step_logits(cfg, params, kernels, 40, 3)
        got, tokens = step_logits(cfg, tiled, kernels, 40, 3)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(tokens, expected_tokens)


def test_megakernel_generation_equals_reference(hf_checkpoint):
    """The jitted decode loop and speculative verification (k + 1 positions) on the megakernel path."""
    path = hf_checkpoint("llama_hd64", tied=False)
    ref = lithos.load(path, dtype="float32", max_len=128)
    mega = lithos.load(path, dtype="float32", max_len=128, kernels="megakernel")
    expected = ref.generate("the quick brown fox", raw=True, max_new_tokens=16).token_ids
    assert mega.generate("the quick brown fox", raw=True, max_new_tokens=16).token_ids == expected
    spec = mega.generate("the quick brown fox", raw=True, max_new_tokens=16, spec="ngram", draft_tokens=3)
    assert spec.token_ids == expected


def test_one_layout_for_steps_and_rounds(hf_checkpoint, monkeypatch):
    """MXFP4 weights laid out as the megakernel on CUDA reads them (the interpreter runs them here): one-token
    steps and speculative programs read the same params, every group in tiles, and both decode the reference path's
    tokens. The model keeps its checkpoint as laid out (no second copy of the tiled matrices' rows), and a fused
    model made from it reads them in rows again."""
    import lithos.spec.engine as spec_engine
    from lithos.custom_calls.megakernel import kernel as mk
    from lithos.engine import Model

    checkpoint = load_checkpoint(hf_checkpoint("llama_hd64", tied=False), dtype="bfloat16")
    params = quant.quantize_params(checkpoint.params, "mxfp4", ["attention", "mlp"])
    checkpoint = dataclasses.replace(checkpoint, params=params)
    ref = Model(checkpoint, max_len=128)
    monkeypatch.delenv("LITHOS_TILES", raising=False)
    with monkeypatch.context() as cuda:
        cuda.setattr(mk, "_gpu_platform", lambda: "cuda")
        mega = Model(checkpoint, max_len=128, kernels="megakernel")
        fused = Model(mega.checkpoint, max_len=128, kernels="fused")
    assert mega.checkpoint.params is mega.params
    # down's 96 inputs are no whole tiles of 64: its rows
    assert all(getattr(mega.params.layers, n).format == quant.MXFP4_TILES for n in ("wo", "w_gate", "w_up"))
    assert all(getattr(fused.params.layers, n).format == quant.MXFP4 for n in ("wq", "wk", "wv", "wo", "w_gate"))
    read = []
    chunk = spec_engine.spec_chunk
    monkeypatch.setattr(
        spec_engine, "spec_chunk", lambda params, *a, **kw: read.append(params) or chunk(params, *a, **kw)
    )
    prompt = "the quick brown fox"
    expected = ref.generate(prompt, raw=True, max_new_tokens=16).token_ids
    assert mega.generate(prompt, raw=True, max_new_tokens=16).token_ids == expected
    assert fused.generate(prompt, raw=True, max_new_tokens=16).token_ids == expected
    assert not read
    assert mega.generate(prompt, raw=True, max_new_tokens=16, spec="ngram", draft_tokens=3).token_ids == expected
    assert read and all(params is mega.params for params in read)


def test_fixed_length_chunks_stop_where_the_reference_stops(hf_checkpoint, monkeypatch):
    """The megakernel's chunks run all their steps and are queued one behind the other; a stop token or
    the token budget in the middle of a chunk ends the text where the reference path's early exit does,
    and the steps past it change nothing."""
    path = hf_checkpoint("llama_hd64", tied=False)
    ref = lithos.load(path, dtype="float32", max_len=128, stream_every=8, block=4)
    mega = lithos.load(path, dtype="float32", max_len=128, stream_every=8, block=4, kernels="megakernel")
    assert mega.queues_chunks and not ref.queues_chunks
    prompt = "the quick brown fox"
    for model in (ref, mega):  # first without stop tokens, so that the budget ends the text
        monkeypatch.setattr(model.tokenizer, "stop_ids", ())
    free = ref.generate(prompt, raw=True, max_new_tokens=21)
    budget = mega.generate(prompt, raw=True, max_new_tokens=21)
    assert (budget.token_ids, budget.finish_reason) == (free.token_ids, "length")
    # The reply came back with the chunk after its end still queued; the next call waits for it first.
    assert mega._in_flight is not None and ref._in_flight is None
    # A stop token past the first chunk: the first token that has not come before it, from the 12th on.
    stop_at = next(i for i, t in enumerate(free.token_ids) if i >= 11 and t not in free.token_ids[:i])
    for model in (ref, mega):
        model.tokenizer.stop_ids = (free.token_ids[stop_at],)
    stopped = [m.generate(prompt, raw=True, max_new_tokens=40) for m in (ref, mega)]
    assert stopped[0].token_ids == stopped[1].token_ids == free.token_ids[: stop_at + 1]
    assert stopped[0].finish_reason == stopped[1].finish_reason == "stop"
    streamed = mega.stream(prompt, raw=True, max_new_tokens=40)
    assert "".join(streamed) == stopped[1].text and streamed.result.token_ids == stopped[1].token_ids


def test_sampled_text_on_fixed_length_chunks_equals_the_reference(hf_checkpoint):
    """Both paths split the key once a step from the same seed, so the text's steps draw the same keys; the
    megakernel's fixed-length chunks go on past the end, sampling from empty steps' logits, and drop those."""
    path = hf_checkpoint("llama_hd64", tied=False)
    ref = lithos.load(path, dtype="float32", max_len=128, stream_every=8, block=4)
    mega = lithos.load(path, dtype="float32", max_len=128, stream_every=8, block=4, kernels="megakernel")
    options = dict(raw=True, max_new_tokens=19, temperature=0.9, top_k=20, seed=5)
    expected = ref.generate("the quick brown fox", **options)
    got = mega.generate("the quick brown fox", **options)
    assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason)
    assert got.token_ids != ref.generate("the quick brown fox", raw=True, max_new_tokens=19).token_ids  # it sampled


def test_a_finished_rows_steps_leave_its_state_and_cache(hf_checkpoint):
    """On the megakernel's path a finished row's step runs at position -1: its cache, position and tokens
    stay as they were (the kernel's blocks leave after their first task, whose cache writes are dropped;
    the interpreter drops the writes)."""
    mega = lithos.load(hf_checkpoint("llama_hd64", tied=False), dtype="float32", max_len=64, kernels="megakernel")
    ids = np.asarray([mega.prompt_ids("hello", raw=True)], np.int32)
    lengths, limits, stop = np.array([ids.shape[1]], np.int32), np.array([1], np.int32), np.array([-1], np.int32)
    state, _ = mega._prefill(ids, lengths, limits, stop, SamplingParams.make(), greedy=True)
    assert bool(state.done[0])  # a budget of one token: done after prefill
    names = ("position", "generated", "finish", "last_token")
    before = {name: np.asarray(getattr(state, name)) for name in names}
    cache = np.asarray(state.cache.k), np.asarray(state.cache.v)
    after, out = mega._decode_chunk(state, greedy=True)  # the state is donated: read above
    np.testing.assert_array_equal(np.asarray(out), -1)
    for name in names:
        np.testing.assert_array_equal(np.asarray(getattr(after, name)), before[name])
    np.testing.assert_array_equal(np.asarray(after.cache.k), cache[0])
    np.testing.assert_array_equal(np.asarray(after.cache.v), cache[1])


def test_megakernel_rejects_what_it_does_not_implement(hf_checkpoint):
    with pytest.raises(UnsupportedModelError, match="megakernel kernels do not implement per-head Q/K norms"):
        lithos.load(hf_checkpoint("qwen3"), dtype="float32", kernels="megakernel")
    with pytest.raises(UnsupportedModelError, match="head_dim 16"):
        lithos.load(hf_checkpoint("llama3"), dtype="float32", kernels="megakernel")
    cfg = config_of(SHAPES["smollm2-like"])
    params = llama.init_params(cfg, jax.random.key(0), jnp.float32)
    cache = init_cache(cfg.num_layers, 2, cfg.num_kv_heads, 8, cfg.head_dim, jnp.float32)
    with pytest.raises(UnsupportedModelError, match="one sequence, got a batch of 2"):
        llama.forward_argmax(
            params, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32), cache, cfg, "megakernel"
        )


@pytest.mark.parametrize(
    "blocks, message",
    [
        (0, r"cannot hold one block of this build \(LITHOS_KERNEL_DEFINES='LITHOS_MK_RING_INPUT_KB=200'\)"),
        (-1, r"no grid for 1 query positions"),
    ],
)
def test_a_grid_that_cannot_be_had_is_a_clear_error(monkeypatch, blocks, message):
    """A build variant whose block does not fit on the GPU names its defines and what to change,
    rather than a grid of 0 reaching the scheduler."""
    from lithos.custom_calls import build
    from lithos.custom_calls.megakernel import kernel

    class Library:
        @staticmethod
        def LithosMegakernelBlocks(tokens):  # noqa: N802 (the C symbol's name)
            return blocks

    variant = build.Toolchain("cuda", "nvcc", "13.0", "sm_90a", defines=("LITHOS_MK_RING_INPUT_KB=200",))
    monkeypatch.setattr(build, "toolchain", lambda platform: variant)
    monkeypatch.setattr(build, "build", lambda name, toolchain: "unused.so")
    monkeypatch.setattr(kernel.ctypes.cdll, "LoadLibrary", lambda path: Library)
    kernel.resident_blocks.cache_clear()
    try:
        with pytest.raises(lithos.LithosError, match=message):
            kernel.resident_blocks("cuda", 1)
    finally:
        kernel.resident_blocks.cache_clear()
