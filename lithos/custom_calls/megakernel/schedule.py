"""The scheduler: the task list of one decode step for a model shape.

The list is stage by stage, layer by layer: Q/K/V (per KV group), attention splits (per KV head
and length split), O projection, gate/up, down; then the LM head. Every task waits only on a
counter that earlier tasks signal, so executing the list in order (the interpreter) is valid, and
so is the kernel's assignment of task i to block i mod grid: the lowest unfinished task always has
its inputs and its block is at it. Dependencies are the real ones: the attention of KV head g waits
for the Q/K/V tasks of group g only; a projection waits for the whole vector it reads (an RMSNorm
or a matvec needs every input element).

Each matvec stage is cut into at most `workers` tasks (the kernel's resident blocks: one task per
block per stage, so each block pays one wait and one signal per stage), in whole rounds of the
block's warps.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lithos.custom_calls.megakernel.tasks import (
    FIELDS,
    NO_COUNTER,
    ROWS_PER_UNIT,
    WARPS_PER_BLOCK,
    ModelShape,
    Op,
    Task,
)
from lithos.errors import LithosError
from lithos.quant.tiles import TILE_ROWS

MAX_SPLITS = 64  # attention splits per KV head, at most
BF16_LANE_STEP = 8  # inputs a lane reads per step of bf16 rows: 16 bytes
TILE_ROW_UNITS = TILE_ROWS // ROWS_PER_UNIT  # row groups in a 16-row fragment tile (csrc kTileRowUnits)


@dataclasses.dataclass(frozen=True)
class LaneSteps:
    """Inputs a lane reads per step of each weight group's rows (csrc/mk_matvec.h): 8 for bf16's 16 bytes, 32
    for an MXFP4 block through the lane ring, 16 for packed rows decoded from registers (packed_decode.h kChunk)."""

    attention: int = BF16_LANE_STEP
    mlp: int = BF16_LANE_STEP
    head: int = BF16_LANE_STEP
    # Gate/up row groups a task takes together: 8 over MXFP4 fragment tiles (a gate tile and an up tile of 16
    # rows, csrc/mk_gate_up_tiles.h), with `gate_up_team` warps sharing each: the block's 8 at one token, each a
    # range of every tile's inputs; at more tokens a warp takes whole tiles.
    gate_up_units: int = 1
    gate_up_team: int = 1
    # Task kinds whose single matrix group is in MXFP4 fragment tiles (Q/K/V, O, down: csrc/mk_tiled_matvec.h): a
    # task takes whole 16-row tiles (TILE_ROW_UNITS row groups), shared by the block's 8 warps at every token count.
    tiled: tuple[Op, ...] = ()
    # The O and down projections' lane steps where their formats differ from their groups' (None: the group's).
    o: int | None = None
    down: int | None = None
    # The most tiles a task of each `tiled` kind may take (in `tiled`'s order; 0 or absent: any number): its warps'
    # sums of its tiles are staged in a fixed area (csrc/mk_tiled_matvec.h), so where the grid's share of a group
    # would not fit there, the group is cut into more tasks than the grid has blocks, each block taking several.
    tiled_caps: tuple[int, ...] = ()

    def of(self, op: Op) -> int:
        """The lane step of the rows task kind `op` reads."""
        if op == Op.O_PROJ and self.o is not None:
            return self.o
        if op == Op.DOWN and self.down is not None:
            return self.down
        if op in (Op.QKV, Op.O_PROJ):
            return self.attention
        return self.head if op == Op.HEAD else self.mlp

    def tasks_for(self, op: Op, units: int, tasks: int) -> int:
        """Tasks to cut `units` row groups of kind `op` into: `tasks`, or more where `op` is tiled and its cap on a
        task's tiles asks for more."""
        cap = dict(zip(self.tiled, self.tiled_caps)).get(op, 0)
        return max(tasks, -(-units // (TILE_ROW_UNITS * cap))) if cap > 0 else tasks


class ScheduleError(LithosError):
    """A task list that cannot run: a task waits for something no earlier task provides."""


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """One decode step's tasks: `tasks` `[n, len(FIELDS)]` int32, executed in order."""

    shape: ModelShape
    workers: int
    max_splits: int  # attention splits per KV head (the device plan may use fewer)
    head_tasks: int  # 0: the step ends after the last layer (no LM head)
    tasks: np.ndarray
    counter_names: tuple[str, ...]

    @property
    def n_counters(self) -> int:
        return len(self.counter_names)

    def task(self, index: int) -> Task:
        return Task.from_row(self.tasks[index])

    def __len__(self) -> int:
        return len(self.tasks)


def describe_task(schedule: Schedule, index: int) -> str:
    """A line naming task `index`: what it computes and what it waits for."""
    t = schedule.task(index)
    what = (
        f"KV head {t.first}, split {t.count}"
        if t.op == Op.ATTENTION
        else f"row groups {t.first}..{t.first + t.count - 1}"
    )
    layer = "" if t.op == Op.HEAD else f"layer {t.layer} "
    waits = (
        "nothing" if t.wait_counter == NO_COUNTER else f"'{schedule.counter_names[t.wait_counter]}' >= {t.wait_target}"
    )
    return f"task {index}: {layer}{t.op.name.lower()} {what}; waits for {waits}"


def k_split_for(units: int, n_in: int, tasks: int, warp_size: int, lane_step: int = BF16_LANE_STEP) -> int:
    """Warps that share a row group (1, 2, 4 or 8): the fewest that minimise the busiest task's work,
    ceil(rounds / tasks) rounds of n_in / k inputs per warp, where a round is 8 / k row groups. A stage
    ends with its slowest task, so a QKV group of 24 rounds over 16 tasks (two rounds for some, one for
    others) costs as much as 32: with k = 2, 48 rounds of half the inputs split 3 per task. More warps
    per group must save an eighth of that work at least (each team adds its sums once per round), and
    each warp's share keeps four 16-byte chunks of bf16 per lane at least (shorter shares cost more in
    sums and activation loads than they stream: measured, 1B's QKV with k = 4). A lane step of a packed
    format holds more inputs (`lane_step`: 32 for MXFP4 through the ring), and its shares keep four of
    those unless the smaller split leaves tasks idle (measured: split in two, the 8B MXFP4 QKV's dot products
    took 14 us a layer against 9 whole; the 1B MXFP4 step was 3% slower with its O projection on half the
    blocks)."""
    best_work, best_k = None, 1
    for k in (1, 2, 4, 8):
        if k > WARPS_PER_BLOCK or n_in < k * warp_size * BF16_LANE_STEP * 4:
            break
        if k > 1 and n_in < k * warp_size * lane_step * 4 and -(-units // (WARPS_PER_BLOCK // (k // 2))) >= tasks:
            break  # shares under four lane steps, and the split k / 2 keeps every task busy
        rounds = -(-units // (WARPS_PER_BLOCK // k))
        work = -(-rounds // tasks) * -(-n_in // k)
        if best_work is None or 8 * work < 7 * best_work:
            best_work, best_k = work, k
    return best_k


def split_units(units: int, slots: int, tasks: int) -> list[tuple[int, int]]:
    """Cut `units` row groups into at most `tasks` contiguous (first, count) ranges of whole rounds of
    `slots` row groups, as even as rounds allow."""
    rounds = -(-units // slots)
    n = max(1, min(tasks, rounds))
    base, extra = divmod(rounds, n)
    ranges, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        first, last = start * slots, min(end * slots, units)
        ranges.append((first, last - first))
        start = end
    return ranges


@functools.lru_cache(maxsize=64)
def build_schedule(
    shape: ModelShape, workers: int, with_head: bool = True, warp_size: int = 32, lane_steps: LaneSteps = LaneSteps()
) -> Schedule:
    """The task list of one step of `shape` for a grid of `workers` blocks (any grid runs it correctly;
    `workers` and `lane_steps` only size the tasks), with the LM head and greedy token when `with_head`."""
    if workers < 1:
        raise ScheduleError(f"workers must be at least 1, got {workers}")
    names: list[str] = []

    def counter(name: str) -> int:
        names.append(name)
        return len(names) - 1

    tasks: list[Task] = []
    S = max(1, min(MAX_SPLITS, workers // shape.kv_heads))
    waits = (NO_COUNTER, 0)  # what the next layer's first stage waits for

    def matvec_stage(op: Op, layer: int, after: tuple[int, int], name: str) -> tuple[int, int]:
        units = shape.units(op)
        done = counter(name)
        if op == Op.GATE_UP and lane_steps.gate_up_units > 1:
            k, unit = lane_steps.gate_up_team, lane_steps.gate_up_units
        elif op in lane_steps.tiled:
            k, unit = WARPS_PER_BLOCK, TILE_ROW_UNITS
        else:
            k, unit = k_split_for(units, shape.input_size(op), workers, warp_size, lane_steps.of(op)), 1
        ranges = split_units(units, unit * (WARPS_PER_BLOCK // k), lane_steps.tasks_for(op, units, workers))
        for first, count in ranges:
            tasks.append(Task(op, layer, first, count, k, after[0], after[1], done))
        return done, len(ranges)

    for layer in range(shape.layers):
        per_group = shape.qkv_units_per_group
        group_tasks = lane_steps.tasks_for(Op.QKV, per_group, max(1, workers // shape.kv_heads))
        if Op.QKV in lane_steps.tiled:  # whole tiles (a head is whole tiles), the block's warps sharing each
            k, slots = WARPS_PER_BLOCK, TILE_ROW_UNITS
        else:
            k = k_split_for(per_group, shape.hidden, group_tasks, warp_size, lane_steps.attention)
            slots = WARPS_PER_BLOCK // k
        qkv_done = []
        for g in range(shape.kv_heads):
            done = counter(f"layer {layer} qkv group {g}")
            ranges = split_units(per_group, slots, group_tasks)
            for first, count in ranges:
                tasks.append(Task(Op.QKV, layer, g * per_group + first, count, k, *waits, done))
            qkv_done.append((done, len(ranges)))
        attention_done = counter(f"layer {layer} attention")
        for g in range(shape.kv_heads):
            arrived = counter(f"layer {layer} attention splits of KV head {g}")
            for s in range(S):
                tasks.append(Task(Op.ATTENTION, layer, g, s, 1, *qkv_done[g], arrived, S, attention_done))
        after = matvec_stage(Op.O_PROJ, layer, (attention_done, shape.kv_heads), f"layer {layer} o_proj")
        after = matvec_stage(Op.GATE_UP, layer, after, f"layer {layer} gate_up")
        waits = matvec_stage(Op.DOWN, layer, after, f"layer {layer} down")

    head_tasks = 0
    if with_head:
        units = shape.units(Op.HEAD)
        k = k_split_for(units, shape.hidden, workers, warp_size, lane_steps.head)
        arrived = counter("head")
        ranges = split_units(units, WARPS_PER_BLOCK // k, workers)
        head_tasks = len(ranges)
        for slot, (first, count) in enumerate(ranges):
            tasks.append(Task(Op.HEAD, shape.layers, first, count, k, *waits, arrived, head_tasks, slot))

    table = np.array([t.row() for t in tasks], np.int32).reshape(-1, len(FIELDS))
    table.setflags(write=False)
    return Schedule(shape, workers, S, head_tasks, table, tuple(names))
