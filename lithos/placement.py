"""Placement: which slice of every weight and of the KV cache lives on which logical device.

A `Placement` is a `Mesh` over logical devices with one named axis, `tp` (tensor parallelism), and
a rule table from logical axes to mesh axes. Every array declares its logical axes once, as data
(`PARAM_AXES` and `CACHE_AXES` in the model family's module); the rules turn them into
`NamedSharding`s, and the decode programs are jitted with those as explicit in/out shardings.

The rules are Megatron's split, which is what a batch-1 decode step wants: each device reads only
its own slice of the weights and XLA never gathers one.

    heads, kv_heads   q/k/v rows and wo columns split by head: attention runs on local heads
    ffn               w_gate/w_up rows and w_down columns split
    vocab             the embedding table and LM head split by row; greedy argmax runs per shard
                      and only (best logit, token id) pairs cross devices
    everything else   replicated (hidden state, norms, positions, tokens)

so a decode step costs two all-reduces of a `[batch, tokens, hidden]` activation per layer (after
wo and after w_down), one for the embedding lookup, and two all-gathers of `[batch, tp]` for the
argmax. `collectives()` reads them back out of a compiled program; the tests count them.

KV heads: split when the tp degree divides them; when there are fewer KV heads than devices, each is
repeated so that every device holds the one KV head its query heads read (a Llama-3-8B shape,
8 KV heads, at tp=16 keeps each KV head on two devices). Heads that do not split at all (SmolLM2:
9 heads, 3 KV heads) are an error unless `pad_heads=True`, which adds zero heads: a zero query row
with a zero wo column adds exactly nothing to the output, so logits are unchanged.

Logical devices per GPU are data (`DeviceLayout`): an MI355X in DPX mode shows jax two devices per
package, one per die, each with its own HBM; a tp group is laid over consecutive devices so that
tp=2 there keeps the pair on one package.

FFI kernels cannot be partitioned by XLA (it would gather their inputs): `Placement.shard_step`
runs a whole decode step per device inside `jax.shard_map`, with specs derived from the same
logical axes (the fused kernel path: each device runs the kernels on its local heads, FFN slice and
vocabulary slice, and `lithos.tensor_parallel` combines the partial results with the same
collectives as above); `Placement.shard_kernel` does the same for one op.

`overlap=True` schedules the per-layer reductions of that per-device step as a collective matmul
(a ring reduce-scatter interleaved with chunks of the projection, then an all-gather; see
`lithos.tensor_parallel`) instead of one all-reduce each.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lithos.errors import LithosError
from lithos.kv_cache import FP8, KVCache, Ring, init_cache, is_fp8
from lithos.models import family_of
from lithos.quant import format_name, is_quantized
from lithos.tensor_parallel import TP, TensorParallel

# Logical axis -> mesh axis. `make_placement` may replicate an axis a model cannot split (vocab).
TP_RULES: dict[str, str | None] = {
    "heads": TP,
    "kv_heads": TP,
    "ffn": TP,
    "vocab": TP,
    "embed": None,
    "head_dim": None,
    "layers": None,
    "batch": None,
    "sequence": None,
}

Axes = tuple[str | None, ...]  # one logical axis name per dimension; None = no name, replicated


# --------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """How the logical devices jax sees sit on physical GPUs.

    `devices_per_gpu` is 1 for a normal GPU and 2 for an AMD MI355X in DPX mode (each die is a
    device with its own memory; `logical_devices_per_gpu_dpx` in configs/hardware/mi355x.json).
    jax lists the logical devices of one GPU consecutively, so device i is on GPU
    i // devices_per_gpu and a tp group never splits a GPU between two groups.
    """

    devices_per_gpu: int = 1

    def __post_init__(self):
        if self.devices_per_gpu < 1:
            raise LithosError(f"devices_per_gpu must be at least 1, got {self.devices_per_gpu}")

    @classmethod
    def from_profile(cls, profile: dict[str, Any], partition: str = "spx") -> DeviceLayout:
        """The layout a hardware profile (configs/hardware/*.json) gives for a partition mode
        ("spx": one device per GPU; "dpx": `logical_devices_per_gpu_dpx`, and so on)."""
        if partition.lower() == "spx":
            return cls(1)
        key = f"logical_devices_per_gpu_{partition.lower()}"
        if key not in profile:
            raise LithosError(
                f"hardware profile {profile.get('name', '?')!r} has no {key}: it does not describe a "
                f"{partition.upper()} mode; pass --devices-per-gpu explicitly"
            )
        return cls(int(profile[key]))

    def gpus(self, num_devices: int) -> int:
        return num_devices // self.devices_per_gpu


def make_mesh(tp: int, layout: DeviceLayout = DeviceLayout(), devices: Sequence[Any] | None = None) -> Mesh:
    """A 1-D mesh `("tp",)` over the first `tp` logical devices, after checking that tp fits the
    machine: at most the devices there are, dividing their number, and never splitting a GPU's
    logical devices between groups."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    kind = devices[0].platform if devices else "none"
    if tp < 1:
        raise LithosError(f"tp must be at least 1, got {tp}")
    if n % layout.devices_per_gpu:
        raise LithosError(
            f"jax sees {n} {kind} devices, not a whole number of GPUs at {layout.devices_per_gpu} logical "
            "devices per GPU: set --devices-per-gpu to what the machine has (2 for MI355X in DPX mode, else 1)"
        )
    if tp > n:
        hint = (
            f"; on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={tp} before jax starts"
            if kind == "cpu"
            else ""
        )
        raise LithosError(f"tp={tp} needs {tp} devices but jax sees {n} ({kind}): lower --tp to at most {n}{hint}")
    if n % tp:
        choices = [t for t in range(1, n + 1) if n % t == 0]
        raise LithosError(f"tp={tp} does not divide the {n} devices jax sees: choose --tp from {choices}")
    d = layout.devices_per_gpu
    if tp % d and d % tp:
        raise LithosError(
            f"tp={tp} would split a GPU's {d} logical devices between tp groups: use a multiple or a divisor of {d}"
        )
    return Mesh(np.array(devices[:tp]), (TP,))


# --------------------------------------------------------------------------------------------
# Attention heads over tp
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """How a checkpoint's attention heads are laid out for `tp` devices.

    The checkpoint has `kv_heads` KV heads with `group` query heads each. Placed, there are
    `kv_pad` KV heads (the extra ones zero), each repeated `kv_repeat` times, each copy serving
    `group_pad // kv_repeat` query heads (those past `group` zero). Query head g of KV head k goes
    to copy g // placed_group of k. Every device then holds whole KV heads and the query heads
    that read them.
    """

    kv_heads: int
    group: int
    kv_pad: int
    kv_repeat: int
    group_pad: int

    @property
    def placed_kv_heads(self) -> int:
        return self.kv_pad * self.kv_repeat

    @property
    def placed_group(self) -> int:
        return self.group_pad // self.kv_repeat

    @property
    def placed_heads(self) -> int:
        return self.placed_kv_heads * self.placed_group

    @property
    def padded(self) -> bool:
        return self.kv_pad != self.kv_heads or self.group_pad != self.group

    @property
    def identity(self) -> bool:
        return not self.padded and self.kv_repeat == 1


def split_heads(num_heads: int, num_kv_heads: int, tp: int, pad: bool) -> HeadSplit | None:
    """The head layout for `tp` devices, or None when it needs zero heads and `pad` is False."""
    group = num_heads // num_kv_heads
    if num_kv_heads % tp == 0:
        return HeadSplit(num_kv_heads, group, num_kv_heads, 1, group)
    if tp % num_kv_heads == 0 and group % (tp // num_kv_heads) == 0:
        return HeadSplit(num_kv_heads, group, num_kv_heads, tp // num_kv_heads, group)
    if not pad:
        return None
    # Fewest extra KV heads first: a multiple of tp (split) or a divisor of it (repeated).
    kv_pad = next(k for k in range(num_kv_heads, num_kv_heads + tp + 1) if k % tp == 0 or tp % k == 0)
    repeat = tp // kv_pad if kv_pad < tp else 1
    return HeadSplit(num_kv_heads, group, kv_pad, repeat, -(-group // repeat) * repeat)


def _array_module(x: Any) -> Any:
    """jnp for device arrays (relaid out where they are), numpy for host arrays (no compiles)."""
    return jnp if isinstance(x, jax.Array) else np


def _place_heads(x: jax.Array, dim: int, split: HeadSplit, head_dim: int) -> jax.Array:
    """Lay out a "heads" dimension ([kv_heads, group, head_dim] flattened) as `split` says."""
    xp, shape = _array_module(x), x.shape
    x = x.reshape(shape[:dim] + (split.kv_heads, split.group, head_dim) + shape[dim + 1 :])
    pads = [(0, 0)] * x.ndim
    pads[dim] = (0, split.kv_pad - split.kv_heads)
    pads[dim + 1] = (0, split.group_pad - split.group)
    x = xp.pad(x, pads)  # zero query heads: their wo columns are zero too, so they add nothing
    return x.reshape(shape[:dim] + (split.placed_heads * head_dim,) + shape[dim + 1 :])


def _place_kv_heads(x: jax.Array, dim: int, split: HeadSplit, head_dim: int) -> jax.Array:
    """Lay out a "kv_heads" dimension ([kv_heads, head_dim] flattened): pad, then repeat each head."""
    xp, shape = _array_module(x), x.shape
    x = x.reshape(shape[:dim] + (split.kv_heads, 1, head_dim) + shape[dim + 1 :])
    pads = [(0, 0)] * x.ndim
    pads[dim] = (0, split.kv_pad - split.kv_heads)
    x = xp.repeat(xp.pad(x, pads), split.kv_repeat, axis=dim + 1)
    return x.reshape(shape[:dim] + (split.placed_kv_heads * head_dim,) + shape[dim + 1 :])


# --------------------------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """A model's layout over a mesh: rules, the head split, and the config its placed params follow.

    `cfg` is the config of the placed parameters (heads and FFN padded or KV heads repeated when
    that was needed; identical to `source_cfg` otherwise): decode with it. `overlap` picks the
    schedule of the per-layer reductions in a per-device step (`shard_step`): one all-reduce each,
    or a collective matmul (lithos.tensor_parallel). `fp8_cache`: the KV cache holds FP8 codes plus
    scales (lithos.kv_cache), which split by KV head like the cache. `ring`: the KV cache is that ring
    (lithos.kv_cache.ring_for; None: linear), a static part of the cache pytree its shardings must match.
    Hashable, so jitted programs can be cached per placement.
    """

    mesh: Mesh
    rules: tuple[tuple[str, str | None], ...]
    cfg: Any
    source_cfg: Any
    heads: HeadSplit
    layout: DeviceLayout = DeviceLayout()
    overlap: bool = False
    fp8_cache: bool = False
    ring: Ring | None = None

    @property
    def tp(self) -> int:
        return self.mesh.shape[TP]

    @property
    def axis(self) -> str:
        """The mesh axis to reduce over inside a per-shard function (`jax.lax.psum(x, p.axis)`)."""
        return TP

    def spec(self, axes: Axes) -> PartitionSpec:
        """PartitionSpec for an array whose dimensions have logical `axes`."""
        rules = dict(self.rules)
        unknown = [a for a in axes if a is not None and a not in rules]
        if unknown:
            raise LithosError(f"unknown logical axes {unknown}; the rule table knows {sorted(rules)}")
        return PartitionSpec(*(rules[a] if a is not None else None for a in axes))

    def sharding(self, axes: Axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def local_cfg(self) -> Any:
        """The config one shard sees inside `shard_kernel` (its heads, KV heads, FFN and vocab)."""
        rules = dict(self.rules)

        def local(n: int, axis: str) -> int:
            return n // self.tp if rules[axis] is not None else n

        c = self.cfg
        return dataclasses.replace(
            c,
            num_heads=local(c.num_heads, "heads"),
            num_kv_heads=local(c.num_kv_heads, "kv_heads"),
            intermediate_size=local(c.intermediate_size, "ffn"),
            vocab_size=local(c.vocab_size, "vocab"),
        )

    # ---- parameters and cache ------------------------------------------------------------

    def param_shardings(self) -> Any:
        """A Params pytree of NamedShardings (None where the model has no such parameter)."""
        return family_of(self.cfg).params_from_flat(_flat_shardings(self))

    def cache_shardings(self) -> KVCache:
        family = family_of(self.cfg)
        s = self.sharding(family.CACHE_AXES)
        if not self.fp8_cache:
            return KVCache(k=s, v=s, ring=self.ring)
        scales = self.sharding(family.CACHE_SCALE_AXES)
        return KVCache(k=s, v=s, k_scale=scales, v_scale=scales, ring=self.ring)

    def put_params(self, params: Any) -> Any:
        """Place a checkpoint's params (on any device, or host arrays): lay out their heads and FFN
        as this placement needs (`layout_params`), then put every array with its sharding."""
        family = family_of(self.source_cfg)
        params, _ = layout_params(params, self.source_cfg, self.heads, self.cfg.intermediate_size)
        flat = {name: jax.device_put(_lookup(params, name), s) for name, s in _flat_shardings(self).items()}
        return family.params_from_flat(flat)

    def init_cache(self, batch: int, max_len: int, dtype) -> KVCache:
        """An empty KV cache `[layers, batch, kv_heads, slots, head_dim]` for sequences of up to `max_len`
        positions (a ring when the placement has one), allocated already split (no device ever holds the
        whole of it). `dtype` "fp8" needs a placement made with `fp8_cache`."""
        fp8 = is_fp8(dtype)
        if fp8 != self.fp8_cache:
            raise LithosError(
                f"this placement lays out a {'FP8' if self.fp8_cache else 'float'} KV cache, not {dtype}: "
                f"use dataclasses.replace(placement, fp8_cache={fp8})"
            )
        if self.ring is not None and self.ring.max_len != max_len:
            raise LithosError(
                f"this placement lays out a ring KV cache for max_len {self.ring.max_len}, not {max_len}: use "
                "dataclasses.replace(placement, ring=lithos.kv_cache.ring_for(max_len, window))"
            )
        return _cache_initializer(self, batch, max_len, FP8 if fp8 else jnp.dtype(dtype).name)()

    # ---- custom calls --------------------------------------------------------------------

    def shard_kernel(
        self,
        per_shard: Callable,
        in_axes: Sequence[Axes],
        out_axes: Axes | Sequence[Axes],
        check_vma: bool = False,
    ) -> Callable:
        """Run `per_shard` (an FFI op, or anything XLA must not partition itself) on each device's
        shard, inside `jax.shard_map` with specs from logical axes, so XLA never gathers its inputs.

        `in_axes` has one logical-axes tuple per positional input (`()` for a replicated scalar);
        `out_axes` is one tuple, or a sequence of them for several outputs. `per_shard` sees local
        shapes (`local_cfg` describes them) and combines partial results itself, e.g.
        `jax.lax.psum(y, placement.axis)` after a row-split matvec. `check_vma` is off by default:
        jax cannot track which mesh axes an FFI call's outputs vary over.
        """
        single = all(a is None or isinstance(a, str) for a in out_axes)
        out_specs = self.spec(out_axes) if single else tuple(self.spec(a) for a in out_axes)
        return jax.shard_map(
            per_shard,
            mesh=self.mesh,
            in_specs=tuple(self.spec(a) for a in in_axes),
            out_specs=out_specs,
            check_vma=check_vma,
        )

    @property
    def tensor_parallel(self) -> TensorParallel:
        """What a per-device step needs to combine its partial results (see lithos.tensor_parallel)."""
        return TensorParallel(self.axis, self.tp, dict(self.rules)["vocab"] is not None, self.overlap)

    def shard_step(self, per_shard: Callable, logits: bool) -> Callable:
        """A decode step run per device inside `jax.shard_map`, so XLA never gathers the inputs of the
        FFI kernels it calls.

        `per_shard(params, tokens, positions, cache) -> (out, cache)` sees this device's slices of
        the params and of the KV cache (`local_cfg` describes them) and the replicated tokens and
        positions `[batch, tokens]`; its `out` is either the greedy tokens `[batch, tokens]`, the
        same on every device, or (`logits`) this device's logits `[batch, tokens, vocab / tp]`,
        which leave split over the vocabulary.
        """
        specs = functools.partial(jax.tree_util.tree_map, lambda s: s.spec)
        cache = specs(self.cache_shardings())
        out = self.spec(("batch", "sequence", "vocab")) if logits else PartitionSpec()
        return jax.shard_map(
            per_shard,
            mesh=self.mesh,
            in_specs=(specs(self.param_shardings()), PartitionSpec(), PartitionSpec(), cache),
            out_specs=(out, cache),
            check_vma=False,  # jax cannot track which mesh axes an FFI call's outputs vary over
        )

    def describe(self) -> str:
        c, s = self.cfg, self.source_cfg
        ids = [int(i) for i in self.mesh.device_ids.flat]
        parts = [f"tp={self.tp} over {self.mesh.devices.flat[0].platform} devices {ids}"]
        if self.layout.devices_per_gpu > 1:
            parts.append(f"{self.layout.devices_per_gpu} logical devices per GPU")
        if not self.heads.identity:
            parts.append(
                f"heads {s.num_heads}/{s.num_kv_heads} KV placed as {c.num_heads}/{c.num_kv_heads}"
                + (" (zero heads added)" if self.heads.padded else " (KV heads repeated)")
            )
        if c.intermediate_size != s.intermediate_size:
            parts.append(f"ffn {s.intermediate_size} padded to {c.intermediate_size}")
        if dict(self.rules)["vocab"] is None:
            parts.append(f"vocab {c.vocab_size} replicated (not divisible by {self.tp})")
        if self.overlap:
            parts.append("reductions overlapped with the projections (collective matmul)")
        return "; ".join(parts)


def _flat_shardings(placement: Placement) -> dict[str, NamedSharding]:
    family = family_of(placement.cfg)
    return {name: placement.sharding(family.PARAM_AXES[name]) for name in family.param_shapes(placement.cfg)}


def placed_config(cfg: Any, heads: HeadSplit, intermediate_size: int) -> Any:
    """The config that params laid out by `layout_params` follow."""
    return dataclasses.replace(
        cfg, num_heads=heads.placed_heads, num_kv_heads=heads.placed_kv_heads, intermediate_size=intermediate_size
    )


def layout_params(params: Any, cfg: Any, heads: HeadSplit, intermediate_size: int) -> tuple[Any, Any]:
    """Params with their attention heads laid out as `heads` says and the FFN zero-padded to
    `intermediate_size`, where they are, and the config they follow. The model computes the same
    function with them: zero query heads meet zero wo columns, zero FFN rows meet zero w_down
    columns, repeated KV heads hold the same keys."""
    family = family_of(cfg)
    placed = placed_config(cfg, heads, intermediate_size)
    if heads.identity and intermediate_size == cfg.intermediate_size:
        return params, placed
    flat = {}
    for name in family.param_shapes(cfg):
        x = _lookup(params, name)
        for dim, axis in enumerate(family.PARAM_AXES[name]):
            if axis in ("heads", "kv_heads", "ffn"):
                x = _relayout(x, name, dim, axis, heads, cfg.head_dim, intermediate_size)
        flat[name] = x
    return family.params_from_flat(flat), placed


def _relayout(x: Any, name: str, dim: int, axis: str, heads: HeadSplit, head_dim: int, ffn: int) -> Any:
    """Lay out dimension `dim` of one weight, dense or packed (lithos.quant.QuantizedArray).

    A packed weight's planes (data, scales, mins) keep the logical dimensions except the last,
    which they store `factor` times as wide (1/2 for 4-bit data, 1/32 for block scales); the same
    layout applies to each plane with sizes scaled, when whole blocks move. Zero planes decode to
    zero in every format lithos packs.
    """
    if not is_quantized(x):
        return _relayout_dense(x, dim, axis, heads, head_dim, ffn)
    logical = x.shape[dim]

    def plane(p):
        if p is None:
            return None
        factor = Fraction(p.shape[dim], logical)
        if (head_dim * factor).denominator != 1 or ((ffn - logical) * factor).denominator != 1:
            raise LithosError(
                f"{name} is packed ({format_name(x)}) in blocks that this tp layout would cut: "
                "load with dequantize=True (--dequantize), or choose a tp that needs no zero heads"
            )
        return _relayout_dense(p, dim, axis, heads, int(head_dim * factor), int(ffn * factor))

    return x.replace(data=plane(x.data), scales=plane(x.scales), mins=plane(x.mins))


def _relayout_dense(x: Any, dim: int, axis: str, heads: HeadSplit, head_dim: int, ffn: int) -> Any:
    if axis == "heads" and not heads.identity:
        return _place_heads(x, dim, heads, head_dim)
    if axis == "kv_heads" and not heads.identity:
        return _place_kv_heads(x, dim, heads, head_dim)
    if axis == "ffn" and x.shape[dim] != ffn:
        pads = [(0, 0)] * x.ndim
        pads[dim] = (0, ffn - x.shape[dim])
        return _array_module(x).pad(x, pads)  # silu(0) * 0 = 0, and the w_down columns are zero
    return x


def _lookup(params: Any, name: str) -> Any:
    for part in name.split("."):
        params = getattr(params, part)
    return params


@functools.cache
def _cache_initializer(placement: Placement, batch: int, max_len: int, dtype: str) -> Callable[[], KVCache]:
    c, ring = placement.cfg, placement.ring
    dtype = dtype if is_fp8(dtype) else jnp.dtype(dtype)
    layout = {} if ring is None else dict(window=ring.window, step_tokens=ring.step_tokens)
    make = functools.partial(init_cache, c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, dtype, **layout)
    return jax.jit(make, out_shardings=placement.cache_shardings())


def _clean_tp_values(cfg: Any, num_devices: int) -> list[int]:
    """tp degrees up to `num_devices` that split this model without zero heads or FFN padding."""
    return [
        t
        for t in range(1, num_devices + 1)
        if num_devices % t == 0
        and split_heads(cfg.num_heads, cfg.num_kv_heads, t, pad=False) is not None
        and cfg.intermediate_size % t == 0
    ]


def make_placement(
    cfg: Any,
    tp: int,
    layout: DeviceLayout = DeviceLayout(),
    pad_heads: bool = False,
    devices: Sequence[Any] | None = None,
    overlap: bool = False,
) -> Placement:
    """The placement of a model with config `cfg` over `tp` logical devices (the first `tp` of
    `devices`, default `jax.devices()`); `overlap` schedules the per-device step's reductions as a
    collective matmul (lithos.tensor_parallel).

    Raises LithosError, naming the fix, when tp does not fit the machine or the model's heads or
    FFN do not split over tp (unless `pad_heads`, which adds zero heads and FFN rows instead).
    """
    mesh = make_mesh(tp, layout, devices)
    num_devices = len(jax.devices() if devices is None else devices)
    heads = split_heads(cfg.num_heads, cfg.num_kv_heads, tp, pad_heads)
    if heads is None:
        padded = split_heads(cfg.num_heads, cfg.num_kv_heads, tp, pad=True)
        extra = padded.placed_heads / cfg.num_heads - 1
        raise LithosError(
            f"{cfg.num_heads} attention heads ({cfg.num_kv_heads} KV heads) do not split over tp={tp}: choose --tp "
            f"from {_clean_tp_values(cfg, num_devices)}, or pass pad_heads=True (--pad-heads) to add zero heads "
            f"({padded.placed_heads} heads, {extra:.0%} more attention weights)"
        )
    ffn = cfg.intermediate_size
    if ffn % tp:
        if not pad_heads:
            raise LithosError(
                f"the FFN width {ffn} does not split over tp={tp}: choose --tp from "
                f"{_clean_tp_values(cfg, num_devices)}, or pass pad_heads=True (--pad-heads) to pad it with zeros"
            )
        ffn = -(-ffn // tp) * tp
    if overlap and cfg.hidden_size % tp:
        raise LithosError(
            f"overlap=True cuts the hidden state ({cfg.hidden_size}) into tp={tp} chunks, which does not divide it: "
            "leave overlap off (--tp-overlap) or choose a tp that divides the hidden size"
        )
    rules = dict(TP_RULES)
    if cfg.vocab_size % tp:
        # Padding the vocabulary would add logits the sampler must mask; replicating costs only the
        # LM head's memory on each device.
        rules["vocab"] = None
    return Placement(mesh, tuple(rules.items()), placed_config(cfg, heads, ffn), cfg, heads, layout, overlap=overlap)


# --------------------------------------------------------------------------------------------
# Reading collectives out of a compiled program
# --------------------------------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
# A computation starts on an unindented line ending in "{": `[ENTRY] %name (params) -> type {`.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+(?P<kind>" + "|".join(COLLECTIVES) + r")(?:-start)?\("
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled HLO program."""

    kind: str  # "all-reduce", "all-gather", ...
    type: str  # result type as HLO prints it, e.g. "f32[1,1,576]{2,1,0}"
    computation: str  # the HLO computation that holds it (a loop body is its own computation)
    op_name: str  # the jax operation it came from

    @property
    def array_sizes(self) -> list[int]:
        """Elements of each array in the result (one, or a tuple's members)."""
        return [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([\d,]*)\]", self.type)]

    @property
    def elements(self) -> int:
        """Elements in the result (summed over a tuple's members)."""
        return sum(self.array_sizes)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in a compiled program's HLO text (`jitted.lower(...).compile().as_text()`).
    An async pair (`all-reduce-start` / `-done`) counts once."""
    found = []
    computation = ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if m:
            op = _OP_NAME.search(line)
            found.append(Collective(m.group("kind"), m.group("type"), computation, op.group(1) if op else ""))
    return found
