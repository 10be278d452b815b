"""Placement pieces that need no second device: head layouts, the relayout of weights (checked on
one device against the model itself), hardware layouts as data, reading collectives out of HLO,
and the error for a tp larger than the machine. The sharded runs are in test_placement_sharded.py."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lithos.errors import LithosError
from lithos.kv_cache import init_cache
from lithos.models import llama
from lithos.placement import DeviceLayout, HeadSplit, collectives, layout_params, make_mesh, split_heads

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "heads, kv_heads, tp, pad, expected",
    [
        (32, 8, 2, False, HeadSplit(8, 4, 8, 1, 4)),  # Llama-3-8B at tp=2: KV heads split
        (32, 8, 8, False, HeadSplit(8, 4, 8, 1, 4)),
        (32, 8, 16, False, HeadSplit(8, 4, 8, 2, 4)),  # fewer KV heads than devices: each on two
        (4, 2, 4, False, HeadSplit(2, 2, 2, 2, 2)),
        (9, 3, 2, False, None),  # SmolLM2: 9 heads do not split over 2 ...
        (9, 3, 2, True, HeadSplit(3, 3, 4, 1, 3)),  # ... unless a zero KV head (and its 3 heads) is added
        (9, 3, 8, True, HeadSplit(3, 3, 4, 2, 4)),  # 16 heads, 2 per device, KV heads on two devices each
        (4, 2, 8, True, HeadSplit(2, 2, 2, 4, 4)),
    ],
)
def test_split_heads(heads, kv_heads, tp, pad, expected):
    split = split_heads(heads, kv_heads, tp, pad)
    assert split == expected
    if split is not None:
        assert split.placed_kv_heads % tp == 0 and split.placed_heads % tp == 0
        assert split.placed_heads >= heads and split.placed_group * split.kv_repeat >= split.group


def tiny_cfg(**overrides) -> llama.Config:
    hf = dict(
        architectures=["Qwen3ForCausalLM"],  # per-head Q/K norms
        num_hidden_layers=2,
        hidden_size=48,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=8,
        intermediate_size=36,
        vocab_size=64,
        attention_bias=True,
    )
    return llama.config_from_hf(hf | overrides)


@pytest.mark.parametrize("split", [HeadSplit(3, 3, 4, 2, 4), HeadSplit(3, 3, 3, 3, 3)], ids=["padded", "repeated"])
def test_relayout_computes_the_same_function(split):
    """Zero heads, repeated KV heads and a zero-padded FFN leave the logits as they were (one device)."""
    cfg = dataclasses.replace(tiny_cfg(), qkv_bias=True, o_bias=True, mlp_bias=True)
    rng = np.random.default_rng(1)  # numpy: jax.random would compile once per weight shape
    params = llama.params_from_flat(
        {name: rng.normal(size=shape).astype(np.float32) / 4 for name, shape in llama.param_shapes(cfg).items()}
    )
    placed, placed_cfg = layout_params(params, cfg, split, intermediate_size=40)
    assert (placed_cfg.num_heads, placed_cfg.num_kv_heads) == (split.placed_heads, split.placed_kv_heads)
    assert placed.layers.wq.shape == (2, split.placed_heads * 8, 48)
    assert placed.layers.w_down.shape == (2, 48, 40)

    tokens = jnp.array([[5, 17, 3, 60, 22, 9]])
    positions = jnp.arange(6)[None]

    def logits(p, c):
        cache = init_cache(c.num_layers, 1, c.num_kv_heads, 16, c.head_dim, jnp.float32)
        out, _ = jax.jit(partial(llama.forward, cfg=c))(p, tokens, positions, cache)
        return np.asarray(out)

    np.testing.assert_allclose(logits(placed, placed_cfg), logits(params, cfg), rtol=1e-5, atol=1e-5)


def test_devices_per_gpu_is_data_from_the_hardware_profile():
    profile = json.loads((REPO / "configs" / "hardware" / "mi355x.json").read_text())
    assert DeviceLayout.from_profile(profile, "dpx") == DeviceLayout(2)
    assert DeviceLayout.from_profile(profile, "spx") == DeviceLayout(1)
    h200 = json.loads((REPO / "configs" / "hardware" / "h200.json").read_text())
    with pytest.raises(LithosError, match="no logical_devices_per_gpu_dpx.*--devices-per-gpu"):
        DeviceLayout.from_profile(h200, "dpx")
    assert DeviceLayout(2).gpus(16) == 8
    with pytest.raises(LithosError, match="at least 1"):
        DeviceLayout(0)


def test_tp_larger_than_the_machine_says_how_to_get_devices():
    n = jax.device_count()
    with pytest.raises(LithosError, match=rf"tp={2 * n} needs {2 * n} devices but jax sees {n}.*--tp to at most {n}"):
        make_mesh(2 * n)
    with pytest.raises(LithosError, match="tp must be at least 1"):
        make_mesh(0)


HLO = """\
HloModule jit_step, entry_computation_layout={(f32[2,64,48]{2,1,0})->s32[1]{0}}

%add.clone (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  ROOT %add = f32[] add(%x.1, %y.1)
}

%wide.region_2.5_spmd.clone (wide.param.3: (s32[], f32[1,1,64], /*index=2*/f32[2,1,1,64,16])) -> (s32[], f32[1,1,64]) {
  %all-reduce.6 = f32[1,1,64]{2,1,0} all-reduce(%fusion.3), to_apply=%add.clone, metadata={op_name="jit(step)/dot"}
  %all-reduce-start = f32[1,1,64]{2,1,0} all-reduce-start(%fusion.4), channel_id=2, to_apply=%add.clone
  %all-reduce-done = f32[1,1,64]{2,1,0} all-reduce-done(%all-reduce-start)
  ROOT %tuple = (s32[], f32[1,1,64]) tuple(%i, %all-reduce-done)
}

ENTRY %main.19_spmd (param.15: f32[128,64]) -> s32[1] {
  %all-gather.10 = (f32[1,2]{0,1}, s32[1,2]{0,1}) all-gather(%a, %b), metadata={op_name="jit(step)/argmax"}
  ROOT %r = s32[1]{0} fusion(%all-gather.10), kind=kLoop
}
"""


def test_collectives_are_read_per_computation():
    found = collectives(HLO)
    assert [(c.kind, c.computation, c.elements) for c in found] == [
        ("all-reduce", "wide.region_2.5_spmd.clone", 64),
        ("all-reduce", "wide.region_2.5_spmd.clone", 64),  # an async start/done pair counts once
        ("all-gather", "main.19_spmd", 4),
    ]
    assert found[0].op_name == "jit(step)/dot"


ON_GPUS = jax.default_backend() in ("gpu", "cuda", "rocm") and jax.device_count() >= 2


@pytest.mark.skipif(not ON_GPUS, reason="needs two GPUs: the FFI kernels per device, in bf16")
@pytest.mark.parametrize("overlap", [False, True], ids=["all-reduce", "overlapped"])
def test_fused_kernels_per_gpu_decode_as_one_gpu(hf_checkpoint, overlap):
    """The FFI kernels inside shard_map on two GPUs: the greedy tokens of one GPU, and the compiled step
    holds only the reductions of partial sums (no weight gathered)."""
    import lithos
    from lithos import decode
    from lithos.sampling import SamplingParams

    path = hf_checkpoint("llama_hd64", tied=False)
    options = dict(dtype="bfloat16", max_len=128, kernels="fused")
    one = lithos.load(path, **options)
    split = lithos.load(path, tp=2, overlap=overlap, **options)
    for prompt in ("hello", "the quick brown fox jumps"):
        expected = one.generate(prompt, raw=True, max_new_tokens=24).token_ids
        assert split.generate(prompt, raw=True, max_new_tokens=24).token_ids == expected

    ids = split.prompt_ids("hello", raw=True)
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, : len(ids)] = ids
    one_row = dict(lengths=np.array([len(ids)], np.int32), limits=np.array([4], np.int32))
    state, _ = split._prefill(tokens, **one_row, stop=np.array([-1], np.int32), sp=SamplingParams.make(), greedy=True)
    _, program = decode.programs(split.placement)
    lowered = program.lower(split.params, state, cfg=split.cfg, chunk=8, block=4, greedy=True, kernels="fused")
    found = collectives(lowered.compile().as_text())
    assert {c.kind for c in found} <= {"all-reduce", "all-gather", "collective-permute"}, found
    hidden = split.cfg.hidden_size
    # Hidden states and (logit, id) pairs, never a weight. XLA's GPU combiners merge small collectives into
    # one tuple-shaped instruction, so each array is checked, not their sum.
    assert all(max(c.array_sizes) <= hidden for c in found), found
