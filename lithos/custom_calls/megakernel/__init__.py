"""The persistent megakernel: a whole decode step in one launch (csrc/megakernel.cu), beside the
scheduler that builds its task list and the interpreter that is its executable specification."""

from lithos.custom_calls.megakernel.interpreter import StepOutputs, StepWeights, interpret
from lithos.custom_calls.megakernel.kernel import (
    HEAD_DIMS,
    decode_step,
    in_rows,
    one_format_a_group,
    step_schedule,
    tiles_for_megakernel,
)
from lithos.custom_calls.megakernel.schedule import Schedule, ScheduleError, build_schedule, describe_task
from lithos.custom_calls.megakernel.tasks import FIELDS, ModelShape, Op, Task

__all__ = [
    "FIELDS",
    "HEAD_DIMS",
    "ModelShape",
    "Op",
    "Schedule",
    "ScheduleError",
    "StepOutputs",
    "StepWeights",
    "Task",
    "build_schedule",
    "decode_step",
    "describe_task",
    "in_rows",
    "interpret",
    "one_format_a_group",
    "step_schedule",
    "tiles_for_megakernel",
]
