"""The fused decode projections over packed weights (kernels in csrc/matvec_packed_<format>.cu, shared
code in csrc/matvec_packed.h and csrc/packed.h) beside their reference twins.

Each op takes a weight that is either bf16 (then it is the bf16 op of matvec.py / qkv.py / lm_head.py)
or a lithos.quant QuantizedArray (MXFP4, MXFP8, FP8 128x128 block-scaled, GGUF Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
IQ4_NL, IQ4_XS, the K-quants Q2_K to Q6_K and K_MIX), whose codes the kernel dequantises in registers, accumulating
in float32:

- `packed_matvec`:          y = residual + RMSNorm?(x) @ w.T
- `packed_gate_up_silu`:    y = silu(xn @ w_gate.T) * (xn @ w_up.T)
- `packed_qkv_rope_append`: RMSNorm -> Q, K, V -> RoPE -> K, V written into the cache in place
- `packed_lm_head_argmax`:  final RMSNorm -> packed LM head -> greedy token. Not one kernel: the packed
  matvec writes f32 logits `[tokens, vocab]` (0.5 MB at 128K vocab, against the head's 280 MB in
  MXFP4) and XLA takes the argmax; a fused argmax would save one small launch.

A reference twin dequantises the one layer it needs exactly (lithos.quant) and runs the bf16 op's
reference twin on the float32 values, so packed and bf16 share one specification.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls.dispatch import (
    absent,
    at_layer,
    call_kernel,
    check_cache_scales,
    check_tokens,
    dispatch,
    layer_index,
    require_bf16,
    stacked,
)
from lithos.custom_calls.lm_head import lm_head_argmax
from lithos.custom_calls.matvec import gate_up_silu, matvec
from lithos.custom_calls.numerics import f32, project, rms_normalize
from lithos.custom_calls.packed_weights import (
    PACKED_FORMATS,
    Weight,
    planes,
    stacked_weight,
    values_f32,
    weight_at_layer,
)
from lithos.custom_calls.qk_norm_rope import qk_norm_rope_append
from lithos.custom_calls.qkv import (
    add_bias,
    bias_args,
    check_biases,
    qkv_project,
    qkv_rope_append,
    rope_and_append,
    stacked_biases,
)
from lithos.errors import LithosError
from lithos.quant import QuantizedArray


def _kernel_name(w: QuantizedArray) -> str:
    return f"matvec_packed_{w.format.name}"


def _check_packed(op: str, x: jax.Array, *weights: QuantizedArray, tokens_limit: bool = True) -> None:
    """Kernel-only limits (run wherever the kernel may run)."""
    if tokens_limit:
        check_tokens(op, x.shape[0])
    if x.dtype != jnp.bfloat16:
        raise LithosError(
            f"{op}: the fused kernels take bfloat16 activations, got {x.dtype}; cast or use path='reference'"
        )
    names = {w.format.name for w in weights}
    if any(w.format.tile is not None for w in weights):
        raise LithosError(
            f"{op}: these weights are MXFP4 in fragment tiles, the layout only the megakernel reads; use the "
            "model's own params (lithos.models.params_for_kernels lays them out for kernels='megakernel' only) or "
            "lithos.quant.from_tiles"
        )
    if len(names) != 1 or not names <= set(PACKED_FORMATS):
        raise LithosError(
            f"{op}: the packed kernels read one format per call from {', '.join(PACKED_FORMATS)}; got {sorted(names)}"
        )
    if x.shape[1] % 16:
        raise LithosError(f"{op}: the packed kernels take inputs of a multiple of 16 features, got {x.shape[1]}")


# --------------------------------------------------------------------------------------------
# matvec (+ RMSNorm prologue, + residual)
# --------------------------------------------------------------------------------------------


def _matvec_reference(x, w, layer, norm_weight, residual, *, eps, out_dtype):
    # matvec.py's reference arithmetic on the exact weight values; f32 logits stay unrounded.
    y = project(rms_normalize(x, at_layer(norm_weight, layer), eps), values_f32(weight_at_layer(w, layer)))
    if residual is not None:
        y = y + f32(residual)
    return y.astype(out_dtype)


def _matvec_kernel(x, w, layer, norm_weight, residual, *, eps, out_dtype):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[-2]), out_dtype)
    data, scales, mins = planes(w)
    norm = absent() if norm_weight is None else norm_weight
    res = absent() if residual is None else residual
    (y,) = call_kernel(
        _kernel_name(w),
        f"LithosPackedMatvec_{w.format.name}",
        [out],
        x,
        data,
        scales,
        mins,
        layer,
        norm,
        res,
        eps=np.float32(eps),
    )
    return y


def packed_matvec(
    x: jax.Array,
    w: Weight,
    *,
    layer: int | jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    residual: jax.Array | None = None,
    eps: float = 1e-5,
    out_dtype=None,
    path: str = "auto",
) -> jax.Array:
    """`residual + RMSNorm?(x) @ w.T`: x `[tokens, in]`, w `[out, in]` or `[layers, out, in]` (bf16 or
    packed), norm_weight `[in]` or `[layers, in]`, residual `[tokens, out]`; returns `[tokens, out]` in
    x's dtype, or float32 with `out_dtype=jnp.float32` (logits; packed weights only)."""
    if not isinstance(w, QuantizedArray):
        if out_dtype is not None and np.dtype(out_dtype) != np.dtype(x.dtype):
            raise LithosError("packed_matvec: out_dtype is for packed weights; use lm_head_argmax for a bf16 head")
        return matvec(x, w, layer=layer, norm_weight=norm_weight, residual=residual, eps=eps, path=path)
    w = stacked_weight("w", w, 2, layer)
    norm_weight = stacked("norm_weight", norm_weight, 1, layer)
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    if x.ndim != 2 or x.shape[1] != w.shape[-1]:
        raise LithosError(
            f"packed_matvec: x must be [tokens, {w.shape[-1]}] for w {list(w.shape)}, not {list(x.shape)}"
        )
    if norm_weight is not None and norm_weight.shape[-1] != x.shape[1]:
        raise LithosError(f"packed_matvec: norm_weight {list(norm_weight.shape)} does not match x {list(x.shape)}")
    if residual is not None and residual.shape != (x.shape[0], w.shape[-2]):
        raise LithosError(f"packed_matvec: residual must be [{x.shape[0]}, {w.shape[-2]}], not {list(residual.shape)}")
    if out_dtype not in (np.dtype(x.dtype), np.dtype(np.float32)):
        raise LithosError(f"packed_matvec: out_dtype must be x's dtype or float32, not {out_dtype}")

    def check():
        _check_packed("packed_matvec", x, w)
        if norm_weight is not None and norm_weight.dtype != jnp.bfloat16:
            raise LithosError("packed_matvec: norm_weight must be bfloat16 for the kernel")
        if residual is not None and residual.dtype != jnp.bfloat16:
            raise LithosError("packed_matvec: residual must be bfloat16 for the kernel")

    options = dict(eps=eps, out_dtype=out_dtype)
    return dispatch(
        path,
        functools.partial(_matvec_reference, **options),
        functools.partial(_matvec_kernel, **options),
        x,
        w,
        layer_index(layer),
        norm_weight,
        residual,
        check=check,
    )


# --------------------------------------------------------------------------------------------
# gate/up + SiLU (+ RMSNorm prologue)
# --------------------------------------------------------------------------------------------


def _gate_up_reference(x, w_gate, w_up, layer, norm_weight, *, eps):
    return gate_up_silu(
        x,
        values_f32(weight_at_layer(w_gate, layer)),
        values_f32(weight_at_layer(w_up, layer)),
        norm_weight=at_layer(norm_weight, layer),
        eps=eps,
        path="reference",
    )


def _gate_up_kernel(x, w_gate, w_up, layer, norm_weight, *, eps):
    out = jax.ShapeDtypeStruct((x.shape[0], w_gate.shape[-2]), x.dtype)
    norm = absent() if norm_weight is None else norm_weight
    (y,) = call_kernel(
        _kernel_name(w_gate),
        f"LithosPackedGateUpSilu_{w_gate.format.name}",
        [out],
        x,
        *planes(w_gate),
        *planes(w_up),
        layer,
        norm,
        eps=np.float32(eps),
    )
    return y


def packed_gate_up_silu(
    x: jax.Array,
    w_gate: Weight,
    w_up: Weight,
    *,
    layer: int | jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    eps: float = 1e-5,
    path: str = "auto",
) -> jax.Array:
    """`silu(xn @ w_gate.T) * (xn @ w_up.T)`, xn = RMSNorm?(x): x `[tokens, hidden]`, w_gate and w_up
    `[ffn, hidden]` or `[layers, ffn, hidden]` (both bf16 or both packed); returns `[tokens, ffn]`."""
    if not isinstance(w_gate, QuantizedArray) and not isinstance(w_up, QuantizedArray):
        return gate_up_silu(x, w_gate, w_up, layer=layer, norm_weight=norm_weight, eps=eps, path=path)
    if not (isinstance(w_gate, QuantizedArray) and isinstance(w_up, QuantizedArray)):
        raise LithosError("packed_gate_up_silu: w_gate and w_up must both be packed (or both bf16)")
    w_gate = stacked_weight("w_gate", w_gate, 2, layer)
    w_up = stacked_weight("w_up", w_up, 2, layer)
    norm_weight = stacked("norm_weight", norm_weight, 1, layer)
    if x.ndim != 2 or x.shape[1] != w_gate.shape[-1]:
        raise LithosError(f"packed_gate_up_silu: x {list(x.shape)} does not fit w_gate {list(w_gate.shape)}")
    if w_up.shape != w_gate.shape:
        raise LithosError(f"packed_gate_up_silu: w_up {list(w_up.shape)} must match w_gate {list(w_gate.shape)}")
    if norm_weight is not None and norm_weight.shape[-1] != x.shape[1]:
        raise LithosError(
            f"packed_gate_up_silu: norm_weight {list(norm_weight.shape)} does not match x {list(x.shape)}"
        )

    def check():
        _check_packed("packed_gate_up_silu", x, w_gate, w_up)

    return dispatch(
        path,
        functools.partial(_gate_up_reference, eps=eps),
        functools.partial(_gate_up_kernel, eps=eps),
        x,
        w_gate,
        w_up,
        layer_index(layer),
        norm_weight,
        check=check,
    )


# --------------------------------------------------------------------------------------------
# RMSNorm -> Q/K/V -> RoPE -> cache append
# --------------------------------------------------------------------------------------------


def _qkv_reference(h, norm_weight, wq, wk, wv, inv_freq, positions, layer, k_cache, v_cache, bq, bk, bv, *, eps, ring):
    wq, wk, wv = (values_f32(weight_at_layer(w, layer)) for w in (wq, wk, wv))
    biases = None if bq is None else tuple(at_layer(b, layer) for b in (bq, bk, bv))
    return qkv_rope_append(
        h,
        at_layer(norm_weight, layer),
        wq,
        wk,
        wv,
        inv_freq,
        positions,
        k_cache,
        v_cache,
        layer=layer,
        eps=eps,
        ring=ring,
        path="reference",
        biases=biases,
    )


def _qkv_split(
    h, norm_weight, wq, wk, wv, inv_freq, positions, k_cache, v_cache, layer, eps, ring, path, *, biases, qk_norms,
    scales
):
    """Q, K and V in different formats (biases and norms stacked `[layers, ...]`): a projection call each (f32
    results from packed weights, bf16 from dense ones, as their ops give them) and its bias, then the reference's
    norms, rotation and cache write (an FP8 cache's codes with its `scales`, (None, None) for a float cache)."""
    layer = layer_index(layer)

    def project_f32(w, b):
        out_dtype = jnp.float32 if isinstance(w, QuantizedArray) else None
        y = packed_matvec(h, w, layer=layer, norm_weight=norm_weight, eps=eps, out_dtype=out_dtype, path=path)
        return y.astype(jnp.float32) if b is None else add_bias(y, at_layer(b, layer), h.dtype)

    q, k, v = (project_f32(w, b) for w, b in zip((wq, wk, wv), biases or (None,) * 3, strict=True))
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    caches = (k_cache, v_cache, *scales)
    return rope_and_append(q, k, v, h.dtype, inv_freq, positions, layer, *caches, ring=ring, qk_norms=qk_norms, eps=eps)


def _qkv_kernel(h, norm_weight, wq, wk, wv, inv_freq, positions, layer, k_cache, v_cache, bq, bk, bv, *, eps, ring):
    head_dim = k_cache.shape[4]
    out_types = [
        jax.ShapeDtypeStruct((h.shape[0], wq.shape[-2] // head_dim, head_dim), h.dtype),
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    ]
    return tuple(
        call_kernel(
            _kernel_name(wq),
            f"LithosPackedQkvRopeAppend_{wq.format.name}",
            out_types,
            h,
            norm_weight,
            *planes(wq),
            *planes(wk),
            *planes(wv),
            inv_freq,
            positions,
            layer,
            k_cache,
            v_cache,
            *bias_args((bq, bk, bv)),
            aliases={14: 1, 15: 2},
            eps=np.float32(eps),
            ring=bool(ring),
        )
    )


def packed_qkv_rope_append(
    h: jax.Array,
    norm_weight: jax.Array,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    inv_freq: jax.Array,
    positions: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    eps: float = 1e-5,
    ring: bool = False,
    path: str = "auto",
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    qk_norms: tuple[jax.Array, jax.Array] | None = None,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As `qkv_rope_append` (same shapes, cache update in place and `ring`), with wq, wk, wv bf16 or packed:
    returns (q `[tokens, heads, head_dim]`, k_cache, v_cache). `biases`: Qwen2's bq, bk, bv (`[layers, out]` each),
    which the kernels add before the rotation. One kernel when all three are bf16 or packed in one format; with
    `qk_norms` (Qwen3's q_norm and k_norm, `[layers, head_dim]` each: each head of Q and K normalised before its
    rotation) two, `packed_qkv_project` and `qk_norm_rope_append`; three projections (then biases, norms, rotation
    and the cache write in XLA) when their formats differ, as a GGUF's K-quant mix keeps V in more bits than Q and K
    (`llama.qkv_in_one_format` lays such a mix out in one format for the fused path). An FP8 cache (`k_scale`,
    `v_scale`) goes with bf16 weights only."""
    formats = {w.format.name if isinstance(w, QuantizedArray) else "dense" for w in (wq, wk, wv)}
    if qk_norms is not None and len(formats) == 1:
        projected = packed_qkv_project(
            h, norm_weight, wq, wk, wv, head_dim=k_cache.shape[-1], layer=layer, eps=eps, biases=biases, path=path
        )
        caches = dict(k_scale=k_scale, v_scale=v_scale)
        options = dict(dtype=h.dtype, layer=layer, eps=eps, ring=ring, path=path, **caches)
        return qk_norm_rope_append(projected, *qk_norms, inv_freq, positions, k_cache, v_cache, **options)
    if formats == {"dense"}:
        options = dict(layer=layer, eps=eps, ring=ring, path=path, biases=biases)
        scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
        return qkv_rope_append(h, norm_weight, wq, wk, wv, inv_freq, positions, k_cache, v_cache, **options, **scales)
    if formats != {"dense"} and (k_scale is not None or v_scale is not None):
        raise LithosError("packed_qkv_rope_append: packed weights write a bf16 cache; use an unquantized KV cache")
    norm_weight = stacked("norm_weight", norm_weight, 1, layer)
    wq, wk, wv = (stacked_weight(name, w, 2, layer) for name, w in (("wq", wq), ("wk", wk), ("wv", wv)))
    k_cache = stacked("k_cache", k_cache, 4, layer)
    v_cache = stacked("v_cache", v_cache, 4, layer)
    head_dim, kv_heads = k_cache.shape[4], k_cache.shape[2]
    if h.ndim != 2 or wq.shape[-1] != h.shape[1] or wq.shape[-2] % head_dim != 0:
        raise LithosError(
            f"packed_qkv_rope_append: h {list(h.shape)} and wq {list(wq.shape)} do not fit head_dim {head_dim}"
        )
    if (
        wk.shape != wv.shape
        or tuple(wk.shape[1:]) != (kv_heads * head_dim, h.shape[1])
        or v_cache.shape != k_cache.shape
    ):
        raise LithosError(f"packed_qkv_rope_append: wk {wk.shape} / wv {wv.shape} do not fit the cache {k_cache.shape}")
    if inv_freq.shape != (head_dim // 2,) or positions.shape != (h.shape[0],):
        raise LithosError(f"packed_qkv_rope_append: inv_freq must be [{head_dim // 2}] and positions [{h.shape[0]}]")
    bq, bk, bv = stacked_biases(biases, layer)
    check_biases("packed_qkv_rope_append", (bq, bk, bv), wq.shape[-2], wk.shape[-2])
    if len(formats) > 1:
        biases = None if bq is None else (bq, bk, bv)
        if qk_norms is not None:
            qk_norms = tuple(stacked(n, w, 1, layer) for n, w in zip(("q_norm", "k_norm"), qk_norms, strict=True))
        scales = check_cache_scales("packed_qkv_rope_append", k_cache, k_scale, v_scale, layer)
        args = (h, norm_weight, wq, wk, wv, inv_freq, positions, k_cache, v_cache, layer, eps, ring, path)
        return _qkv_split(*args, biases=biases, qk_norms=qk_norms, scales=scales)

    def check():
        _check_packed("packed_qkv_rope_append", h, wq, wk, wv)
        require_bf16("packed_qkv_rope_append", bq=bq, bk=bk, bv=bv)
        if k_cache.dtype != jnp.bfloat16 or k_cache.shape[1] != 1 or head_dim % 4 != 0:
            raise LithosError(
                "packed_qkv_rope_append: the kernel takes a bf16 cache of batch 1 and head_dim a multiple of 4; "
                "use path='reference'"
            )

    return dispatch(
        path,
        functools.partial(_qkv_reference, eps=eps, ring=ring),
        functools.partial(_qkv_kernel, eps=eps, ring=ring),
        h,
        norm_weight,
        wq,
        wk,
        wv,
        jnp.asarray(inv_freq, jnp.float32),
        positions.astype(np.int32),
        layer_index(layer),
        k_cache,
        v_cache,
        bq,
        bk,
        bv,
        check=check,
    )


def _project_reference(h, norm_weight, wq, wk, wv, layer, bq, bk, bv, *, eps, head_dim):
    wq, wk, wv = (values_f32(weight_at_layer(w, layer)) for w in (wq, wk, wv))
    biases = None if bq is None else tuple(at_layer(b, layer) for b in (bq, bk, bv))
    options = dict(head_dim=head_dim, layer=layer, eps=eps, biases=biases, path="reference")
    return qkv_project(h, at_layer(norm_weight, layer), wq, wk, wv, **options)


def _project_kernel(h, norm_weight, wq, wk, wv, layer, bq, bk, bv, *, eps, head_dim):
    heads, kv_heads = wq.shape[-2] // head_dim, wk.shape[-2] // head_dim
    out = jax.ShapeDtypeStruct((h.shape[0], heads + 2 * kv_heads, head_dim), jnp.float32)
    (projected,) = call_kernel(
        _kernel_name(wq),
        f"LithosPackedQkvProject_{wq.format.name}",
        [out],
        *(h, norm_weight, *planes(wq), *planes(wk), *planes(wv), layer, *bias_args((bq, bk, bv))),
        eps=np.float32(eps),
    )
    return projected


def packed_qkv_project(
    h: jax.Array,
    norm_weight: jax.Array,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    *,
    head_dim: int,
    layer: int | jax.Array | None = None,
    eps: float = 1e-5,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    path: str = "auto",
) -> jax.Array:
    """As `qkv_project` (f32 `[tokens, heads + 2 kv_heads, head_dim]`, neither rotated nor cached), with wq, wk, wv
    bf16 or packed in one format."""
    formats = {w.format.name if isinstance(w, QuantizedArray) else "dense" for w in (wq, wk, wv)}
    if formats == {"dense"}:
        options = dict(head_dim=head_dim, layer=layer, eps=eps, biases=biases, path=path)
        return qkv_project(h, norm_weight, wq, wk, wv, **options)
    if len(formats) > 1:
        raise LithosError(f"packed_qkv_project: Q, K and V must share one format, got {sorted(formats)}")
    norm_weight = stacked("norm_weight", norm_weight, 1, layer)
    wq, wk, wv = (stacked_weight(name, w, 2, layer) for name, w in (("wq", wq), ("wk", wk), ("wv", wv)))
    bq, bk, bv = stacked_biases(biases, layer)
    if h.ndim != 2 or wq.shape[-1] != h.shape[1] or wq.shape[-2] % head_dim or wk.shape[-2] % head_dim:
        raise LithosError(
            f"packed_qkv_project: h {list(h.shape)}, wq {wq.shape} and wk {wk.shape} do not fit head_dim {head_dim}"
        )
    if wk.shape != wv.shape:
        raise LithosError(f"packed_qkv_project: wk {wk.shape} and wv {wv.shape} must be alike")
    check_biases("packed_qkv_project", (bq, bk, bv), wq.shape[-2], wk.shape[-2])

    def check():
        _check_packed("packed_qkv_project", h, wq, wk, wv)
        require_bf16("packed_qkv_project", bq=bq, bk=bk, bv=bv)
        if head_dim % 4 != 0:
            raise LithosError("packed_qkv_project: the kernel takes head_dim a multiple of 4; use path='reference'")

    return dispatch(
        path,
        functools.partial(_project_reference, eps=eps, head_dim=head_dim),
        functools.partial(_project_kernel, eps=eps, head_dim=head_dim),
        *(h, norm_weight, wq, wk, wv, layer_index(layer), bq, bk, bv),
        check=check,
    )


# --------------------------------------------------------------------------------------------
# final RMSNorm -> LM head -> argmax
# --------------------------------------------------------------------------------------------


def packed_lm_head_argmax(
    h: jax.Array,
    head: Weight,
    *,
    norm_weight: jax.Array | None = None,
    eps: float = 1e-5,
    with_logits: bool = False,
    path: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """As `lm_head_argmax`: greedy tokens `[tokens]` (and f32 logits `[tokens, vocab]` with
    `with_logits`) for h `[tokens, hidden]`, head `[vocab, hidden]` bf16 or packed. Ties go to the
    lowest id."""
    if not isinstance(head, QuantizedArray):
        return lm_head_argmax(h, head, norm_weight=norm_weight, eps=eps, with_logits=with_logits, path=path)
    logits = packed_matvec(h, head, norm_weight=norm_weight, eps=eps, out_dtype=jnp.float32, path=path)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return (tokens, logits) if with_logits else tokens


__all__ = [
    "packed_gate_up_silu",
    "packed_lm_head_argmax",
    "packed_matvec",
    "packed_qkv_project",
    "packed_qkv_rope_append",
]
