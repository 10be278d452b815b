"""The decode step's dimensions (lithos.custom_calls.step_shape) that the tuner, the microbench and the
megakernel's scheduler share."""

from __future__ import annotations

import pytest

from lithos.custom_calls.megakernel.tasks import ModelShape
from lithos.custom_calls.step_shape import StepShape
from lithos.errors import LithosError


def test_named_shapes_come_from_configs_models():
    one_b = StepShape.named("llama-3.2-1b")
    assert one_b == StepShape(16, 2048, 32, 8, 64, 8192, 128256)
    assert one_b.q_size == 2048 and one_b.group == 4
    qwen = StepShape.named("qwen3-8b")
    assert (qwen.layers, qwen.ffn, qwen.vocab) == (36, 12288, 151936)


def test_the_schedule_shape_is_a_step_shape():
    shape = ModelShape(**vars(StepShape.named("llama-3.1-8b")))
    assert isinstance(shape, StepShape) and shape.group == 4 and shape.q_size == 4096


def test_a_model_without_dense_llama_layers_is_named_in_the_error():
    with pytest.raises(LithosError, match="the microbench times the dense Llama-family kernels"):
        StepShape.named("gpt-oss-20b", "the microbench")
    with pytest.raises(LithosError, match="unknown model shape"):
        StepShape.named("no-such-model")
