"""`decode_step`: one whole decode step in one persistent kernel launch (csrc/megakernel.cu), or its
interpreter where there is no GPU, chosen like every fused op (lithos.custom_calls.dispatch).

Weights are bf16 or packed (lithos.quant formats, read as stored and dequantised in registers). The
kernel reads one format for the attention matrices, one for the MLP's and one for the LM head, fixed
when it is compiled: `weight_formats` says which build a set of weights needs, and each is built on
first use beside the others (lithos.custom_calls.build.Variant).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls import build
from lithos.custom_calls.dispatch import _gpu_platform, call_kernel, check_ring, check_tokens, dispatch, require_bf16
from lithos.custom_calls.megakernel.interpreter import StepOutputs, StepWeights, interpret
from lithos.custom_calls.megakernel.schedule import (
    BF16_LANE_STEP,
    TILE_ROW_UNITS,
    LaneSteps,
    Schedule,
    build_schedule,
)
from lithos.custom_calls.megakernel.tasks import FIELDS, STATUS_WORDS, WARPS_PER_BLOCK, ModelShape, Op
from lithos.custom_calls.packed_weights import FORMAT_CODES, FORMAT_NAMES, add_leading_axis, format_code, planes
from lithos.errors import CheckpointError, LithosError
from lithos.quant import K_MIX, MXFP4, QuantizedArray, from_tiles, to_tiles
from lithos.quant.layouts import K_QUANTS, to_k_mix
from lithos.quant.tiles import TILE_ROWS

HEAD_DIMS = (64, 128, 256)  # head sizes the kernel's attention task serves
CPU_WORKERS = 64  # the interpreter's schedule where no GPU sizes it
WARP_SIZE = {"cuda": 32, "rocm": 64}
HEADS = (None, "argmax", "logits")
# The weight matrices in the kernel's argument order (csrc/megakernel.cu kWeightNames), by format group.
ATTENTION_WEIGHTS = ("wq", "wk", "wv", "wo")
MLP_WEIGHTS = ("w_gate", "w_up", "w_down")
MATRICES = (*ATTENTION_WEIGHTS, *MLP_WEIGHTS, "lm_head")
# The matrices a build reads in one format (csrc/mk_common.h kAttentionFormat, kMlpFormat); O and down have their own.
QKV_WEIGHTS, GATE_UP_WEIGHTS = ("wq", "wk", "wv"), ("w_gate", "w_up")
TILE_UNITS = TILE_ROWS // 2  # 2-output gate/up row groups in one pair of fragment tiles (csrc kTileUnits)
# The matrix groups the megakernel may read in MXFP4 fragment tiles (LITHOS_TILES), and their matrices; Q/K/V in
# rotary tiles (lithos.quant.tiles), whose lanes hold both halves of a rotation.
TILE_GROUPS = {"qkv": QKV_WEIGHTS, "o": ("wo",), "gate_up": GATE_UP_WEIGHTS, "down": ("w_down",)}
DEFAULT_TILES = "qkv,o,gate_up,down"  # the groups tiled unless LITHOS_TILES says otherwise (tiles_wanted)


class WeightFormats(NamedTuple):
    """The formats a megakernel build reads (lithos.custom_calls.packed_weights names): Q/K/V (`attention`), gate
    and up (`mlp`), the head, and O and down where theirs differ (None: the group's); and which MXFP4 matrix groups
    it reads in fragment tiles (lithos.quant.tiles: csrc/mk_gate_up_tiles.h for gate and up, csrc/mk_tiled_matvec.h
    for down, O and Q/K/V)."""

    attention: str = "bfloat16"
    mlp: str = "bfloat16"
    head: str = "bfloat16"
    gate_up_tiles: bool = False
    down_tiles: bool = False
    qkv_tiles: bool = False
    o_tiles: bool = False
    o: str | None = None
    down: str | None = None

    @property
    def every_format(self) -> tuple[str, ...]:
        """Every format the build reads."""
        return (self.attention, self.o or self.attention, self.mlp, self.down or self.mlp, self.head)

    def variant(self, tokens: int | None = None) -> build.Variant:
        """The build that reads these formats (the plain one for bf16 weights), every token bucket in one library;
        with `tokens`, that count's bucket alone (build.bucket_variant), the library a step calls."""
        if tokens is not None:
            return build.bucket_variant(self.variant(), tokens)
        if self == WeightFormats():  # bf16 throughout
            return build.PLAIN
        groups = [("ATTENTION", self.attention), ("MLP", self.mlp), ("HEAD", self.head)]
        groups += [(group, name) for group, name in (("O", self.o), ("DOWN", self.down)) if name is not None]
        defines = tuple(f"LITHOS_MK_{group}_FORMAT={FORMAT_CODES[name]}" for group, name in groups)
        suffix = "_".join(self[:3]) + "".join(f"_{group.lower()}_{name}" for group, name in groups[3:])
        for flag, define, name in (
            (self.gate_up_tiles, "GATE_UP_TILES", "tiles"),
            (self.down_tiles, "DOWN_TILES", "down_tiles"),
            (self.qkv_tiles, "QKV_TILES", "qkv_tiles"),
            (self.o_tiles, "O_TILES", "o_tiles"),
        ):
            if flag:
                defines, suffix = (*defines, f"LITHOS_MK_{define}=1"), f"{suffix}_{name}"
        return build.Variant(defines=defines, suffix=suffix)


BF16 = WeightFormats()


def _layout(w) -> str:
    if isinstance(w, QuantizedArray) and w.format.tile is not None:
        return "rotary tiles" if w.format.rotary_head else "tiles"
    return "rows"


def weight_formats(weights: StepWeights) -> WeightFormats:
    """The formats of `weights`; an error when the matrices of one group (Q/K/V, gate/up) differ, or a group's
    matrices are not laid out as the megakernel reads them."""

    def format_of(w) -> str:  # a dense array's dtype is checked with the activations'
        if isinstance(w, QuantizedArray):
            return "mxfp4" if w.format.tile is not None else FORMAT_NAMES[format_code(w)]
        return "bfloat16"

    def group_format(group: str, names: tuple[str, ...]) -> str:
        found = {name: format_of(getattr(weights, name)) for name in names}
        if len(set(found.values())) > 1:
            raise LithosError(
                f"megakernel: the {group} matrices must share one format, got {found}; quantize the group alike "
                "(lithos quantize --groups), lay out mixed K-quants with lithos.models.params_for_kernels, or use "
                "kernels='fused'"
            )
        return found[names[0]]

    def tiled(group: str) -> bool:
        names = TILE_GROUPS[group]
        layouts = {name: _layout(getattr(weights, name)) for name in names}
        tiles = "rotary tiles" if group == "qkv" else "tiles"
        if set(layouts.values()) in ({tiles}, {"rows"}):
            return layouts[names[0]] == tiles
        raise LithosError(
            f"megakernel: {group} matrices laid out as {layouts}; it reads them all in rows or all in {tiles} "
            "(lithos.custom_calls.megakernel.tiles_for_megakernel lays them out)"
        )

    if _layout(weights.lm_head) != "rows":
        raise LithosError("megakernel: the LM head is in fragment tiles; it reads the head in rows (quant.from_tiles)")
    attention, mlp = group_format("Q/K/V", QKV_WEIGHTS), group_format("gate/up", GATE_UP_WEIGHTS)
    o, down = format_of(weights.wo), format_of(weights.w_down)
    return WeightFormats(
        attention,
        mlp,
        format_of(weights.lm_head),
        tiled("gate_up"),
        tiled("down"),
        tiled("qkv"),
        tiled("o"),
        None if o == attention else o,
        None if down == mlp else down,
    )


def tiles_wanted(platform: str | None) -> frozenset[str]:
    """The matrix groups (TILE_GROUPS) the megakernel reads in MXFP4 fragment tiles: those LITHOS_TILES names (a
    comma list; "none" for rows throughout), by default every group, for one-token steps and speculative
    verification's rounds of k + 1 positions alike. Gate and up tiled made the H200's 8B step 5% faster than their
    rows and an 8-position verification round 18% (runs 108-109), Q/K/V 7% faster again on an H100 (run 133); O and
    down in tiles take 31% off the 8B k = 7 round and 28% off the 1B k = 15 round (run 136), and since their chunks
    go through the lane ring three steps ahead, the one-token steps too: on an H100, over run 143's calls, the 8B
    MXFP4 step 2.767 -> 2.708 ms and the 1B 0.921 -> 0.874 against Q/K/V + gate/up tiled through registers
    (lithos/custom_calls/NOTES.md, "Which groups pay in tiles", "Run 142 measured", "Run 143 measured"). Only on
    CUDA: the tiled tasks run on tensor cores, and HIP reads rows."""
    for old in ("LITHOS_GATE_UP_TILES", "LITHOS_DOWN_TILES"):
        if old in os.environ:
            raise LithosError(
                f"{old} is replaced by LITHOS_TILES, a comma list of {', '.join(TILE_GROUPS)} (or none): e.g. "
                "LITHOS_TILES=gate_up,down; unset it"
            )
    asked = os.environ.get("LITHOS_TILES", DEFAULT_TILES).strip()
    groups = frozenset() if asked in ("", "none") else frozenset(g.strip() for g in asked.split(","))
    if not groups <= TILE_GROUPS.keys():
        raise LithosError(
            f"LITHOS_TILES={asked!r}: name the matrix groups to read in fragment tiles from {', '.join(TILE_GROUPS)}, "
            "comma separated, or none"
        )
    return groups if platform == "cuda" else frozenset()


def one_format_a_group(matrices: dict) -> dict:
    """The layer matrices `matrices` (a dict of ATTENTION_WEIGHTS' and MLP_WEIGHTS' names, or of some) with each group
    whose matrices mix K-quants (a Q4_K_M file's Q4_K Q and K beside its V, K_MIX) all in K_MIX, every value the same:
    the megakernel reads one format a group (Q/K/V, gate/up; O and down each their own), at 7.1 bits a weight where
    Q4_K takes 4.5. Anything else unchanged."""
    out = dict(matrices)
    for names in (QKV_WEIGHTS, GATE_UP_WEIGHTS):
        if not all(name in matrices for name in names):
            continue
        ws = [matrices[name] for name in names]
        if not all(isinstance(w, QuantizedArray) for w in ws):
            continue
        formats = {w.format.name for w in ws}
        if len(formats) > 1 and formats <= {*K_QUANTS, K_MIX.name}:
            try:
                mixed = [w if w.format == K_MIX else jax.tree_util.tree_map(jnp.asarray, to_k_mix(w)) for w in ws]
            except CheckpointError as e:
                group = "/".join(names)
                raise LithosError(f"megakernel: the {group} matrices mix K-quants, but {e}; use kernels='fused'") from e
            out.update(zip(names, mixed, strict=True))
    return out


def tiles_for_megakernel(matrices: dict, head_dim: int, platform: str | None = None) -> dict:
    """The layer matrices `matrices` (a dict of TILE_GROUPS' names: `[layers, out, in]`, in rows or in tiles) as
    this GPU's megakernel is asked to read them: each group `tiles_wanted` names whose matrices are all MXFP4 in
    fragment tiles (Q/K/V in rotary tiles of heads of `head_dim`), each other group in rows; unchanged where the
    tiles do not fit (a shape, or a scale above 2^65, that the tiled tasks do not take), and the same arrays where
    a group is laid out as asked already, so that params laid out for other groups are laid out again at the cost
    of the groups that differ."""
    platform = _gpu_platform() if platform is None else platform
    wanted = tiles_wanted(platform)
    out = in_rows(matrices, [group for group in TILE_GROUPS if group not in wanted])
    for group in wanted:
        names = TILE_GROUPS[group]
        ws = [matrices[name] for name in names if name in matrices]
        if len(ws) < len(names) or not all(isinstance(w, QuantizedArray) for w in ws):
            continue
        if not all(w.format == MXFP4 for w in ws):
            continue  # in tiles already, or a format the tiles do not take
        if group == "gate_up" and ws[0].shape[-1] * TILE_OPERAND_BYTES_PER_INPUT > TILE_STAGING_BYTES * 3 // 4:
            continue  # B would leave no room for the sums
        try:
            out.update({name: to_tiles(w, head_dim if group == "qkv" else 0) for name, w in zip(names, ws)})
        except LithosError:  # a shape or a scale the tiles do not take (to_tiles says which): rows read the same values
            continue
    return out


def in_rows(matrices: dict, groups=TILE_GROUPS) -> dict:
    """The layer matrices `matrices` (a dict of TILE_GROUPS' names) with each of `groups` whose matrices are all in
    fragment tiles back in MXFP4 rows as stored (what the fused kernels and HIP read); anything else the same
    arrays."""
    out = dict(matrices)
    for group in groups:
        names = TILE_GROUPS[group]
        ws = [matrices[name] for name in names if name in matrices]
        if len(ws) == len(names) and all(isinstance(w, QuantizedArray) and w.format.tile is not None for w in ws):
            out.update({name: from_tiles(w) for name, w in zip(names, ws)})
    return out


# csrc/mk_lane_ring.h kRingInputBytes (LITHOS_MK_RING_INPUT_KB), where the one-token tiled task stages B (4 bytes
# an input) and its warps' sums (1 KB a tile pair): csrc/mk_gate_up_tiles.h. 56 KB in a build whose ring copies 16
# bytes beside a row's (RING_SIDES, on CUDA), so that its block fits an SM.
TILE_STAGING_BYTES = 64 * 1024
TILE_OPERAND_BYTES_PER_INPUT, TILE_PIECE_BYTES = 4, 1024


# The packed formats whose rows the one-token kernel streams through the lane ring (CUDA), and the bytes of their
# scales each step copies beside a row's 16 (csrc/mk_lane_ring.h kRingSideBytes, packed.h Step32).
RING_SIDES = {"mxfp4": 4, "iq4_nl": 4, "q4_k": 16, "q5_k": 16, "q6_k": 16, "k_mix": 16, "iq4_xs": 16}


def staging_bytes(formats: WeightFormats) -> int:
    """The lane ring's input area in the build that reads `formats` (csrc/mk_lane_ring.h kRingInputBytes)."""
    wide = any(RING_SIDES.get(name, 0) > 4 for name in formats.every_format) and _gpu_platform() != "rocm"
    return 56 * 1024 if wide else TILE_STAGING_BYTES


# csrc/mk_tiled_matvec.h: a single-matrix tiled task's sums of a tile from each warp, for each n-block of tokens (8 a
# block of activations, 4 of Q/K/V's two-part B), in that area too.
TILE_PIECE_BLOCK_BYTES = WARPS_PER_BLOCK * 32 * 4 * 4
TILED_OPS = {Op.QKV: "qkv", Op.O_PROJ: "o", Op.DOWN: "down"}


def tile_operand_bytes(hidden: int) -> int:
    """Bytes of one token's B a tiled task stages for `hidden` inputs (csrc/mk_tiles.h tile_operand_bytes)."""
    return -(-hidden * TILE_OPERAND_BYTES_PER_INPUT // 16) * 16


def largest_task(schedule: Schedule, op: Op) -> int:
    """The most units a task of kind `op` takes in `schedule` (0 where there is none)."""
    table = schedule.tasks
    counts = table[table[:, FIELDS.index("op")] == op, FIELDS.index("count")]
    return int(counts.max()) if counts.size else 0


def activation_operand_bytes(n_in: int) -> int:
    """Bytes of one token's activations O's and down's tiled tasks stage (csrc/mk_tiled_matvec.h)."""
    return -(-n_in * 2 // 16) * 16


def tiled_staging_bytes(op: Op, tiles: int, tokens: int, shape: ModelShape) -> int:
    """Bytes of the ring's input area a tiled task of kind `op` over `tiles` tiles takes for `tokens` tokens: its
    warps' sums, after B where it stages B (at one token: Q/K/V's x * norm_w in two parts, as gate/up; O's and down's
    activations in one)."""
    per_block = 4 if op == Op.QKV else 8
    operand = 0
    if tokens == 1:
        n_in = shape.input_size(op)
        operand = tile_operand_bytes(n_in) if op == Op.QKV else activation_operand_bytes(n_in)
    return operand + tiles * -(-tokens // per_block) * TILE_PIECE_BLOCK_BYTES


def check_tiled_staging(schedule: Schedule, tokens: int, ops: tuple[Op, ...], room: int = TILE_STAGING_BYTES) -> None:
    """The single-matrix tiled tasks (`ops`) keep their warps' sums of their tiles (and at one token their B) in
    the lane ring's input area: an error naming the fix where a task's would not fit (the kernel would abort the
    step)."""
    for op in ops:
        tiles = largest_task(schedule, op) // TILE_ROW_UNITS
        need = tiled_staging_bytes(op, tiles, tokens, schedule.shape)
        if need > room:
            raise LithosError(
                f"megakernel: {TILED_OPS[op]} in fragment tiles needs {need} bytes of staging a task ({tiles} tiles, "
                f"{tokens} tokens), more than the {room} the kernel has; leave {TILED_OPS[op]} out of "
                "LITHOS_TILES or run on a GPU with more blocks"
            )


def check_tile_staging(schedule: Schedule, room: int = TILE_STAGING_BYTES) -> None:
    """The one-token tiled gate/up task stages B and its sums in the lane ring's input area: an error naming the
    fix where a task's would not fit (the kernel would abort the step)."""
    s = schedule.shape
    tiles = largest_task(schedule, Op.GATE_UP) // TILE_UNITS
    need = tile_operand_bytes(s.hidden) + tiles * TILE_PIECE_BYTES
    if need > room:
        raise LithosError(
            f"megakernel: gate/up in fragment tiles needs {need} bytes of staging a task (hidden {s.hidden}, {tiles} "
            f"tile pairs), more than the {room} the kernel has; leave gate_up out of LITHOS_TILES"
        )


@functools.cache
def resident_blocks(platform: str, tokens: int, variant: build.Variant = build.PLAIN) -> int:
    """Blocks of the kernel (built as `variant`) for `tokens` query positions that the GPU holds at once
    (its grid)."""
    toolchain = variant.toolchain(build.toolchain(platform))
    library = ctypes.cdll.LoadLibrary(str(build.build("megakernel", toolchain)))
    blocks = int(library.LithosMegakernelBlocks(ctypes.c_int(tokens)))
    if blocks == 0:  # a build variant whose block does not fit (LITHOS_KERNEL_DEFINES)
        raise LithosError(
            "megakernel: this GPU cannot hold one block of this build (LITHOS_KERNEL_DEFINES="
            f"{' '.join(toolchain.defines)!r}): its lane ring asks for more shared memory than the GPU has. "
            "Use a smaller ring (LITHOS_MK_LANE_RING=3, LITHOS_MK_RING_INPUT_KB=32), none (LITHOS_MK_LANE_RING=0), "
            "or decode with kernels='fused'"
        )
    if blocks < 0:
        raise LithosError(f"megakernel: no grid for {tokens} query positions (1..16 are supported)")
    return blocks


def lane_steps(formats: WeightFormats, tokens: int, platform: str | None) -> LaneSteps:
    """Inputs a lane of the kernel reads per step of each group's rows (csrc/mk_matvec.h): 8 of bf16 (16 bytes),
    32 of the packed formats the lane ring reads (RING_SIDES, CUDA, one token), 16 of other packed rows
    (packed_decode.h's chunk); and the gate/up row groups a task takes together (a pair of fragment tiles: 8) and
    the warps that share them."""

    def step(name: str) -> int:
        if name == "bfloat16":
            return BF16_LANE_STEP
        return 32 if name in RING_SIDES and tokens == 1 and platform == "cuda" else 16

    units, team = (TILE_UNITS, WARPS_PER_BLOCK if tokens == 1 else 1) if formats.gate_up_tiles else (1, 1)
    o, down = (None if name is None else step(name) for name in (formats.o, formats.down))
    return LaneSteps(
        step(formats.attention), step(formats.mlp), step(formats.head), units, team, tiled_ops(formats), o, down
    )


def tiled_ops(formats: WeightFormats) -> tuple[Op, ...]:
    """The task kinds that read a single matrix group in tiles (csrc/mk_tiled_matvec.h)."""
    return tuple(op for op, group in TILED_OPS.items() if getattr(formats, f"{group}_tiles"))


def step_schedule(shape: ModelShape, tokens: int, with_head: bool, formats: WeightFormats = BF16) -> Schedule:
    """The schedule `decode_step` runs: sized for this GPU's resident blocks (of the build that reads
    `formats`) and its lanes' steps, or for CPU_WORKERS."""
    platform = _gpu_platform()
    if platform is None:
        return build_schedule(shape, CPU_WORKERS, with_head)
    blocks = resident_blocks(platform, tokens, formats.variant(tokens))
    steps = staged_lane_steps(shape, formats, tokens, platform)
    return build_schedule(shape, blocks, with_head, WARP_SIZE[platform], steps)


def staged_lane_steps(shape: ModelShape, formats: WeightFormats, tokens: int, platform: str) -> LaneSteps:
    """`lane_steps`, with each tiled task kind's cap: the most tiles whose staging fits the build's area at `tokens`
    tokens (a 70B shape's Q/K/V at 16 tokens on 132 blocks would take 5 tiles, 80 KB of 64: cut into more tasks)."""
    steps = lane_steps(formats, tokens, platform)
    room = staging_bytes(formats)
    return dataclasses.replace(steps, tiled_caps=tuple(most_tiles(op, tokens, shape, room) for op in steps.tiled))


def most_tiles(op: Op, tokens: int, shape: ModelShape, room: int) -> int:
    """The most tiles a tiled task of kind `op` may take for `tokens` tokens with `room` bytes of staging (0 where
    not even one fits: check_tiled_staging then names the fix)."""
    fixed = tiled_staging_bytes(op, 0, tokens, shape)
    return max(0, (room - fixed) // (tiled_staging_bytes(op, 1, tokens, shape) - fixed))


def shape_of(weights: StepWeights, k_cache: jax.Array) -> ModelShape:
    layers, _, kv_heads, _, head_dim = k_cache.shape
    return ModelShape(
        layers=layers,
        hidden=weights.wq.shape[2],
        heads=weights.wq.shape[1] // head_dim,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=weights.w_gate.shape[1],
        vocab=weights.lm_head.shape[0],
    )


def weight_planes(weights: StepWeights) -> list[jax.Array]:
    """The kernel's weight arguments: (data, scales, mins) of each of MATRICES, stacked by layer (the
    head as one layer)."""
    out: list[jax.Array] = []
    for name in MATRICES:
        w = getattr(weights, name)
        out.extend(planes(add_leading_axis(w) if name == "lm_head" else w))
    return out


def _kernel(
    schedule: Schedule,
    formats: WeightFormats,
    eps: float,
    window: int,
    ring: bool,
    with_logits: bool,
    weights,
    h0,
    positions,
    inv_freq,
    k_cache,
    v_cache,
) -> StepOutputs:
    s = schedule.shape
    T = h0.shape[0]
    rows = T * s.group
    out_types = [
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        jax.ShapeDtypeStruct((2, T, s.hidden), h0.dtype),  # residual stream: after attention, after MLP
        jax.ShapeDtypeStruct((T,), jnp.int32),
        jax.ShapeDtypeStruct((T, s.vocab) if with_logits else (0,), jnp.float32),
        jax.ShapeDtypeStruct((T, s.heads * s.head_dim), h0.dtype),  # scratch: q
        jax.ShapeDtypeStruct((T, s.heads * s.head_dim), h0.dtype),  # scratch: attention output
        jax.ShapeDtypeStruct((T, s.ffn), h0.dtype),  # scratch: gated activations
        jax.ShapeDtypeStruct((s.kv_heads, schedule.max_splits, rows, s.head_dim), jnp.float32),
        jax.ShapeDtypeStruct((s.kv_heads, schedule.max_splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((max(schedule.head_tasks, 1), T), jnp.float32),
        jax.ShapeDtypeStruct((max(schedule.head_tasks, 1), T), jnp.int32),
        jax.ShapeDtypeStruct((schedule.n_counters + STATUS_WORDS,), jnp.int32),
    ]
    k_cache, v_cache, residual, tokens, logits, *_ = call_kernel(
        "megakernel",
        "LithosMegakernel",
        out_types,
        h0,
        positions,
        inv_freq,
        weights.attn_norm,
        weights.mlp_norm,
        weights.final_norm,
        jnp.asarray(schedule.tasks),
        k_cache,
        v_cache,
        *weight_planes(weights),
        aliases={7: 0, 8: 1},
        variant=formats.variant(T),
        eps=np.float32(eps),
        window=np.int64(window),
        ring=bool(ring),
        max_splits=np.int64(schedule.max_splits),
        n_counters=np.int64(schedule.n_counters),
    )
    return StepOutputs(
        k_cache, v_cache, residual[1], tokens if schedule.head_tasks else None, logits if with_logits else None
    )


def _reference(
    schedule: Schedule,
    formats: WeightFormats,
    eps: float,
    window: int,
    ring: bool,
    with_logits: bool,
    weights,
    h0,
    positions,
    inv_freq,
    k_cache,
    v_cache,
) -> StepOutputs:
    options = dict(eps=eps, window=window, ring=ring, with_logits=with_logits)
    return interpret(schedule, weights, h0, positions, inv_freq, k_cache, v_cache, **options)


def decode_step(
    weights: StepWeights,
    h0: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    eps: float,
    window: int | None = None,
    ring: bool = False,
    head: str | None = "argmax",
    path: str = "auto",
) -> StepOutputs:
    """Every decoder layer (and, with `head`, the final norm, LM head and greedy token; "logits" also
    returns the float32 logits) for h0 `[tokens, hidden]`, the embedded tokens at `positions`
    `[tokens]` (1..16 of them: a decode step or k+1 to verify), appending their keys and values to the
    caches `[layers, 1, kv_heads, slots, head_dim]` in place: linear, or (`ring`) a ring, slot =
    position % slots (lithos.kv_cache), which needs a window with window + tokens - 1 <= slots."""
    if head not in HEADS:
        raise LithosError(f"megakernel: head must be one of {HEADS}, not {head!r}")
    layers, batch, kv_heads, _, head_dim = k_cache.shape
    if h0.ndim != 2 or positions.shape != (h0.shape[0],) or v_cache.shape != k_cache.shape:
        raise LithosError(
            f"megakernel: h0 must be [tokens, hidden] with positions [tokens]; got h0 {list(h0.shape)}, positions "
            f"{list(positions.shape)}, caches {list(k_cache.shape)} / {list(v_cache.shape)}"
        )
    if weights.wq.shape[0] != layers or weights.wq.shape[2] != h0.shape[1] or inv_freq.shape != (head_dim // 2,):
        raise LithosError(
            f"megakernel: wq {list(weights.wq.shape)} and inv_freq {list(inv_freq.shape)} do not fit h0 "
            f"{list(h0.shape)} and caches {list(k_cache.shape)}"
        )
    check_ring("megakernel", ring, int(window or 0), h0.shape[0], k_cache.shape[3])
    shape = shape_of(weights, k_cache)
    formats = weight_formats(weights)
    schedule = step_schedule(shape, h0.shape[0], head is not None, formats)

    def check():
        check_tokens("megakernel", h0.shape[0])
        room = staging_bytes(formats)
        if formats.gate_up_tiles and h0.shape[0] == 1:
            check_tile_staging(schedule, room)
        check_tiled_staging(schedule, h0.shape[0], tiled_ops(formats), room)
        if formats.qkv_tiles and weights.wq.format.rotary_head != head_dim:
            raise LithosError(
                f"megakernel: Q/K/V in rotary tiles of heads of {weights.wq.format.rotary_head}, the cache's heads "
                f"have {head_dim}; lay them out for this model (tiles_for_megakernel with its head_dim)"
            )
        dense = {name: w for name, w in weights._asdict().items() if not isinstance(w, QuantizedArray)}
        require_bf16("megakernel", h0=h0, k_cache=k_cache, **dense)
        if batch != 1:
            raise LithosError(f"megakernel: decodes one sequence, the cache has batch {batch}; use kernels='reference'")
        if head_dim not in HEAD_DIMS or shape.hidden % 8 or shape.ffn % 8:
            raise LithosError(
                f"megakernel: head_dim {head_dim} (kernels for {HEAD_DIMS}), hidden {shape.hidden} and ffn "
                f"{shape.ffn} (multiples of 8) have no kernel; use kernels='fused' or 'reference'"
            )

    options = (schedule, formats, float(eps), int(window or 0), ring, head == "logits")
    return dispatch(
        path,
        functools.partial(_reference, *options),
        functools.partial(_kernel, *options),
        weights,
        h0,
        positions.astype(jnp.int32),
        jnp.asarray(inv_freq, jnp.float32),
        k_cache,
        v_cache,
        check=check,
    )
