"""The fused kernel path on the real SmolLM2-135M-Instruct (GPU only): greedy chat answers to 24
varied prompts equal the reference path's, token for token, both in bf16 from the same weights.

The GGUF's Q4_1 weights are dequantized at load (exactly): the fused kernels read bf16 weights;
packed-weight kernels are tested on their own."""

from __future__ import annotations

import jax
import pytest

import lithos

from .test_spec_smollm2 import PROMPTS

pytestmark = pytest.mark.skipif(
    jax.default_backend() not in ("gpu", "cuda", "rocm"), reason="the FFI kernels need a CUDA or ROCm GPU"
)


def test_fused_greedy_chat_equals_reference(smollm2_gguf):
    ref = lithos.load(smollm2_gguf, dtype="bfloat16", max_len=256, dequantize=True)
    fused = lithos.load(smollm2_gguf, dtype="bfloat16", max_len=256, dequantize=True, kernels="fused")
    mismatches = []
    for prompt in PROMPTS:
        expected = ref.generate(prompt, max_new_tokens=32)
        got = fused.generate(prompt, max_new_tokens=32)
        print(f"{prompt!r}: {got.text!r}")
        if got.token_ids != expected.token_ids:
            mismatches.append((prompt, expected.text, got.text))
    assert not mismatches, mismatches
