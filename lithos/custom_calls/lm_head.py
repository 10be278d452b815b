"""The end of a decode step for 1..16 tokens (kernel in csrc/lm_head.cu) beside its reference twin:
final RMSNorm -> LM head -> greedy token, and the float32 logits when asked (for sampling)."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls.dispatch import absent, call_kernel, check_tokens, dispatch, require_bf16
from lithos.custom_calls.launch import launch_attributes
from lithos.custom_calls.numerics import project, rms_normalize
from lithos.errors import LithosError

# Rows of the kernel's scratch: one best (logit, id) per block and token.
MAX_BLOCKS = 2048


def _reference(h, head, norm_weight, *, eps, with_logits):
    logits = project(rms_normalize(h, norm_weight, eps), head)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return (tokens, logits) if with_logits else tokens


def _kernel(h, head, norm_weight, *, eps, with_logits, launch):
    tokens, vocab = h.shape[0], head.shape[0]
    attrs = launch_attributes("lm_head_argmax", {"hidden": h.shape[1], "vocab": vocab}, tokens, launch)
    out_types = [
        jax.ShapeDtypeStruct((tokens,), jnp.int32),
        jax.ShapeDtypeStruct((tokens, vocab) if with_logits else (0,), jnp.float32),
        jax.ShapeDtypeStruct((MAX_BLOCKS, tokens), jnp.float32),  # scratch
        jax.ShapeDtypeStruct((MAX_BLOCKS, tokens), jnp.int32),  # scratch
    ]
    norm = absent() if norm_weight is None else norm_weight
    ids, logits, _, _ = call_kernel(
        "lm_head", "LithosLmHeadArgmax", out_types, h, head, norm, eps=np.float32(eps), **attrs
    )
    return (ids, logits) if with_logits else ids


def lm_head_argmax(
    h: jax.Array,
    head: jax.Array,
    *,
    norm_weight: jax.Array | None = None,
    eps: float = 1e-5,
    with_logits: bool = False,
    path: str = "auto",
    launch: Mapping[str, int] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Greedy next tokens `[tokens]` (int32) for hidden states h `[tokens, hidden]` through the head
    `[vocab, hidden]` (the embedding when tied), after RMSNorm with `norm_weight` `[hidden]` if given.
    With `with_logits`, returns (tokens, logits `[tokens, vocab]` float32). Ties go to the lowest id.
    `launch` fixes the kernel's launch parameters (see launch.py); by default the tuning table's."""
    if h.ndim != 2 or head.ndim != 2 or head.shape[1] != h.shape[1]:
        raise LithosError(f"lm_head_argmax: h {list(h.shape)} does not fit head {list(head.shape)}")
    if norm_weight is not None and norm_weight.shape != (h.shape[1],):
        raise LithosError(
            f"lm_head_argmax: norm_weight must be [{h.shape[1]}], not {list(norm_weight.shape)}"
        )

    def check():
        check_tokens("lm_head_argmax", h.shape[0])
        require_bf16("lm_head_argmax", h=h, head=head, norm_weight=norm_weight)

    options = dict(eps=eps, with_logits=with_logits)
    return dispatch(
        path,
        functools.partial(_reference, **options),
        functools.partial(_kernel, **options, launch=launch),
        h,
        head,
        norm_weight,
        check=check,
    )
