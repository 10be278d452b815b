"""FFI custom-call kernels for the decode step, one CUDA/HIP source each under `csrc/`, with their
jax.numpy reference twins. Each op takes `path="auto" | "reference" | "ffi"` (see `dispatch`)."""

from lithos.custom_calls.attention import decode_attention
from lithos.custom_calls.dispatch import PATHS
from lithos.custom_calls.expert_matvec import expert_matvec
from lithos.custom_calls.lm_head import lm_head_argmax
from lithos.custom_calls.matvec import gate_up_silu, matvec
from lithos.custom_calls.qkv import qkv_rope_append

__all__ = [
    "PATHS",
    "decode_attention",
    "expert_matvec",
    "gate_up_silu",
    "lm_head_argmax",
    "matvec",
    "qkv_rope_append",
]
