"""The megakernel's instruction format and the row groups each kind of task covers.

A task is one row of int32 (`FIELDS`, the same order as `Task` in csrc/mk_common.h). The scheduler
(schedule.py) writes the list, the kernel (csrc/megakernel.cu) and the interpreter (interpreter.py)
both execute it. A task waits until `counters[wait_counter] >= wait_target`, does its work, and adds
1 to `counters[signal_counter]`; where `arrivals > 0`, the task that brings that counter to
`arrivals` also reduces what all of them wrote (the attention combine, the head's argmax).

Row groups ("units") are the matvec tasks' granularity: four weight rows a warp reads together.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from lithos.custom_calls.step_shape import StepShape

FIELDS = (
    "op",
    "layer",
    "first",  # first row group; attention: the KV head
    "count",  # row groups; attention: the split index
    "k_split",  # warps sharing a row group (1, 2, 4, 8)
    "wait_counter",  # -1: waits for nothing
    "wait_target",
    "signal_counter",
    "arrivals",  # attention and head: how many tasks signal the counter; the last one reduces
    "aux",  # attention: the counter signalled after the combine; head: this task's slot
)
NO_COUNTER = -1
ROWS_PER_UNIT = 4  # csrc/rowdot.h kRowsPerWarp
WARPS_PER_BLOCK = 8  # csrc/rowdot.h kMatvecWarps
STATUS_WORDS = 2  # after the counters: the abort flag and the failing task (csrc/mk_common.h)


class Op(enum.IntEnum):
    QKV = 1  # RMSNorm + Q/K/V rows of one KV group + RoPE + cache append
    ATTENTION = 2  # one length split of one KV head; the last split to arrive combines
    O_PROJ = 3  # O projection + residual
    GATE_UP = 4  # RMSNorm + gate/up rows + SiLU
    DOWN = 5  # down projection + residual
    HEAD = 6  # final RMSNorm + LM head rows (+ logits) + best token; the last task picks


@dataclasses.dataclass(frozen=True)
class Task:
    op: Op
    layer: int
    first: int
    count: int
    k_split: int = 1
    wait_counter: int = NO_COUNTER
    wait_target: int = 0
    signal_counter: int = NO_COUNTER
    arrivals: int = 0
    aux: int = 0

    def row(self) -> tuple[int, ...]:
        return tuple(int(getattr(self, name)) for name in FIELDS)

    @classmethod
    def from_row(cls, row) -> Task:
        values = dict(zip(FIELDS, (int(v) for v in row), strict=True))
        return cls(**{**values, "op": Op(values["op"])})


@dataclasses.dataclass(frozen=True)
class ModelShape(StepShape):
    """What the schedule depends on: a Llama-family decoder's sizes, and the row groups of its matrices."""

    @property
    def qkv_units_per_group(self) -> int:
        """Row groups of one KV group: its query heads, its key head and its value head, each
        head_dim / 4 groups of two rotary pairs."""
        return (self.group + 2) * (self.head_dim // 4)

    def units(self, op: Op) -> int:
        """Row groups of one layer's (or the head's) matrix for a matvec task kind."""
        if op == Op.QKV:
            return self.kv_heads * self.qkv_units_per_group
        if op in (Op.O_PROJ, Op.DOWN):
            return -(-self.hidden // ROWS_PER_UNIT)
        if op == Op.GATE_UP:
            return -(-self.ffn // (ROWS_PER_UNIT // 2))
        if op == Op.HEAD:
            return -(-self.vocab // ROWS_PER_UNIT)
        raise ValueError(f"{op!r} has no row groups")

    def input_size(self, op: Op) -> int:
        """Length of the rows a matvec task kind reads."""
        if op == Op.O_PROJ:
            return self.heads * self.head_dim
        if op == Op.DOWN:
            return self.ffn
        return self.hidden


@dataclasses.dataclass(frozen=True)
class QkvRows:
    """Where QKV row groups `units` live (arrays over the units; as csrc/mk_qkv.h qkv_row_group)."""

    kv_head: np.ndarray
    slot: np.ndarray  # < group: query head slot of the KV group; group: its key head; group + 1: its value head
    first_pair: np.ndarray  # rotary pairs first_pair, first_pair + 1

    @classmethod
    def of(cls, shape: ModelShape, units: np.ndarray) -> QkvRows:
        per_head = shape.head_dim // 4
        within = units % shape.qkv_units_per_group
        return cls(units // shape.qkv_units_per_group, within // per_head, (within % per_head) * 2)

    def rows(self, shape: ModelShape) -> np.ndarray:
        """`[units, 4]` rows of the stacked [wq; wk; wv] matrix: (j, j + d/2, j + 1, j + 1 + d/2)."""
        H, KV, g = shape.heads, shape.kv_heads, shape.group
        head = np.where(
            self.slot < g,
            self.kv_head * g + self.slot,
            np.where(self.slot == g, H + self.kv_head, H + KV + self.kv_head),
        )
        offsets = np.array([0, shape.head_dim // 2, 1, 1 + shape.head_dim // 2])
        return head[:, None] * shape.head_dim + self.first_pair[:, None] + offsets[None, :]
