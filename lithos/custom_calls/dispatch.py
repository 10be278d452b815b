"""How a fused op is called: which path runs it, and the argument conventions at the FFI boundary.

Every op takes `path`:
- "auto": the FFI kernel on CUDA and ROCm, the reference twin on every other backend. The choice is
  made by `jax.lax.platform_dependent` when XLA lowers for a platform, so one jitted function serves
  both; a GPU whose kernels cannot be built is an error, never a silent fallback.
- "reference": the jax.numpy twin, on any backend (the specification; what CI runs).
- "ffi": the FFI kernel; needs a CUDA or ROCm backend.

At the boundary, per-layer weights travel stacked with a leading `[layers]` axis plus a device
scalar `layer` (so a call inside `lax.scan` reads the layer in place instead of XLA copying a
slice out first), and an absent optional input travels as an empty array.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lithos.custom_calls.build import PLAIN, Variant, ensure_registered, gpu_platform
from lithos.errors import LithosError

PATHS = ("auto", "reference", "ffi")


@functools.cache
def _gpu_platform() -> str | None:
    return gpu_platform()


def dispatch(path: str, reference: Callable, kernel: Callable, *args: Any, check: Callable[[], None] = lambda: None):
    """Run `reference(*args)` or `kernel(*args)` as `path` says; `check` validates kernel-only limits
    (e.g. at most 16 query positions) wherever the kernel may run."""
    if path == "reference":
        return reference(*args)
    if path == "ffi":
        if _gpu_platform() is None:
            raise LithosError("path='ffi' needs a CUDA or ROCm GPU and jax sees none; use 'auto' or 'reference'")
        check()
        return kernel(*args)
    if path == "auto":
        if _gpu_platform() is None:
            # No GPU backend: the kernel branch could never run, and tracing it would hold the
            # reference path to the kernel's limits (dtypes, sizes).
            return reference(*args)
        check()
        return jax.lax.platform_dependent(*args, cuda=kernel, rocm=kernel, default=reference)
    raise LithosError(f"unknown kernel path {path!r}; choose one of {', '.join(PATHS)}")


def call_kernel(
    source: str,
    target: str,
    out_types: Sequence[jax.ShapeDtypeStruct],
    *args: jax.Array,
    aliases: dict[int, int] | None = None,
    variant: Variant = PLAIN,
    **attrs: Any,
) -> Any:
    """Call FFI handler `target` of csrc/<source>.cu (built as `variant`); where a GPU backend exists,
    build and register it first (so the lowering finds it)."""
    platform = _gpu_platform()
    if platform is not None:
        ensure_registered(source, platform, variant)
    return jax.ffi.ffi_call(variant.target(target), list(out_types), input_output_aliases=aliases)(*args, **attrs)


def absent(dtype=jnp.bfloat16) -> jax.Array:
    """The empty array that stands for an optional input left out."""
    return jnp.zeros((0,), dtype)


def layer_index(layer: int | jax.Array | None) -> jax.Array:
    return jnp.asarray(0 if layer is None else layer, jnp.int32)


def stacked(name: str, array: jax.Array | None, rank: int, layer) -> jax.Array | None:
    """`array` with a leading layer axis, as the kernels take it. An array without one gets an axis of
    1: the same weight for every layer (e.g. a final norm)."""
    if array is None:
        return None
    if array.ndim == rank:
        return array[None]
    if array.ndim != rank + 1:
        raise LithosError(
            f"{name} must have {rank} dimensions, or {rank + 1} stacked by layer; got {list(array.shape)}"
        )
    if layer is None and array.shape[0] != 1:
        raise LithosError(f"{name} is stacked {list(array.shape)} (layers first): pass layer=")
    return array


def at_layer(array: jax.Array | None, layer: jax.Array) -> jax.Array | None:
    """One layer of an array from `stacked` (the reference twins' view of it)."""
    if array is None:
        return None
    if array.shape[0] == 1:
        return array[0]
    return jax.lax.dynamic_index_in_dim(array, layer, 0, keepdims=False)


def require_bf16(op: str, **arrays: jax.Array | None) -> None:
    wrong = {name: a.dtype for name, a in arrays.items() if a is not None and a.dtype != jnp.bfloat16}
    if wrong:
        raise LithosError(
            f"{op}: the fused kernels take bfloat16, got {wrong}; cast the inputs or use path='reference'"
        )


def check_tokens(op: str, tokens: int, limit: int = 16) -> None:
    if not 1 <= tokens <= limit:
        raise LithosError(
            f"{op}: the fused kernels take 1..{limit} query positions (a decode step or k+1 to verify), got "
            f"{tokens}; run prefill with kernels='reference'"
        )


def cache_slots(positions: jax.Array, slots: int, ring: bool) -> jax.Array:
    """Where the kernels store `positions` in a cache of `slots` entries: position % slots in a ring
    (lithos.kv_cache), the position itself in a linear cache; negative positions and, in a linear
    cache, positions past its end map to `slots`, which a scatter with mode="drop" discards."""
    inside = positions >= 0 if ring else (positions >= 0) & (positions < slots)
    return jnp.where(inside, positions % slots, slots)


def check_ring(op: str, ring: bool, window: int, tokens: int, slots: int) -> None:
    """A ring holds the newest `slots` positions only: every query's window must lie within them."""
    if ring and not (window >= 1 and window + tokens - 1 <= slots):
        raise LithosError(
            f"{op}: a ring cache of {slots} slots holds the newest {slots} positions only, so {tokens} queries "
            f"need a sliding window W with W + {tokens} - 1 <= {slots}, got sliding_window={window or None}: make "
            f"the cache with lithos.kv_cache.init_cache(..., window=W, step_tokens={tokens})"
        )


def check_cache_scales(
    op: str, k_cache: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None, layer
) -> tuple[jax.Array | None, jax.Array | None]:
    """An FP8 KV cache (lithos.kv_cache) travels as u8 codes `[layers, 1, kv_heads, max_len, head_dim]` with
    f32 scales `[layers, 1, kv_heads]`; a float cache without scales. Returns the scales stacked like the cache."""
    if (k_scale is None) != (v_scale is None):
        raise LithosError(f"{op}: pass both k_scale and v_scale (an FP8 cache) or neither (a float cache)")
    if k_scale is None:
        if k_cache.dtype == jnp.uint8:
            raise LithosError(f"{op}: the cache holds FP8 codes (u8): pass its k_scale and v_scale")
        return None, None
    k_scale, v_scale = stacked("k_scale", k_scale, 2, layer), stacked("v_scale", v_scale, 2, layer)
    want = tuple(k_cache.shape[:3])
    if k_cache.dtype != jnp.uint8 or k_scale.shape != want or v_scale.shape != want:
        raise LithosError(
            f"{op}: an FP8 cache is u8 codes with f32 scales {list(want)}; got a {k_cache.dtype} cache and scales "
            f"{list(k_scale.shape)}, {list(v_scale.shape)} (make it with lithos.kv_cache.init_cache(..., 'fp8'))"
        )
    return k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)
