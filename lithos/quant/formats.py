"""Low-precision weight formats kept packed: the arrays a kernel reads, and their exact meaning.

A `QuantizedArray` is a pytree of packed planes (`data`, `scales`, optionally `mins`) plus a static
`QuantFormat` and the dtype it stands for in a model. Its logical shape is `[..., out, in]` like a
dense weight (leading axes such as `[layers]` are carried by every plane, so `lax.scan` slices it
like any other leaf); every block of weights shares one scale along the `in` axis (or a 2-D tile
for the FP8 block-scaled format), so a batch-1 matvec reads each output row's codes and scales
contiguously.

Planes, for logical shape `[..., out, in]` (all row-major):

    format        data                       scales                                mins
    mxfp4         u8 [..., out, in/2]        u8  [..., out, in/32]  E8M0           -
    mxfp4_tiles   mxfp4's planes, their bytes in fragment tiles (lithos.quant.tiles)
    mxfp4_rotary_tiles  the same, each head's rows paired by rotation first (lithos.quant.tiles)
    mxfp8         u8 [..., out, in]  E4M3    u8  [..., out, in/32]  E8M0           -
    fp8_block128  u8 [..., out, in]  E4M3    f32 [..., ceil(out/128), ceil(in/128)] (multiplier)
    q8_0          i8 [..., out, in]          f16 [..., out, in/32]                 -
    q4_0          u8 [..., out, in/2]        f16 [..., out, in/32]                 -
    q4_1          u8 [..., out, in/2]        f16 [..., out, in/32]                 f16 [..., out, in/32]
    q5_0          u8 [..., out, 5*in/8]      f16 [..., out, in/32]                 -
    q5_1          u8 [..., out, 5*in/8]      f16 [..., out, in/32]                 f16 [..., out, in/32]
    iq4_nl        u8 [..., out, in/2]        f16 [..., out, in/32]                 -
    iq4_xs        u8 [..., out, in/2]        u8  [..., out, in/256, 8]   records   -
    q2_k          u8 [..., out, in/4]        u8  [..., out, in/256, 20]  records   -
    q3_k          u8 [..., out, 3*in/8]      u8  [..., out, in/256, 18]  records   -
    q4_k          u8 [..., out, in/2]        u8  [..., out, in/256, 16]  records   -
    q5_k          u8 [..., out, 5*in/8]      u8  [..., out, in/256, 16]  records   -
    q6_k          u8 [..., out, 3*in/4]      u8  [..., out, in/256, 18]  records   -
    k_mix         u8 [..., out, 3*in/4]      u8  [..., out, in/256, 36]  records   -

4-bit data: element 2k of a row is the low nibble of byte k, element 2k+1 the high nibble (the
OCP/GPT-OSS order). GGUF files store Q4 blocks with elements 0..15 in the low nibbles and 16..31 in
the high nibbles (Q4_K: 0..31 and 32..63 of each 64); the loader reorders them losslessly so that
every 4-bit format unpacks alike.

The K-quants (llama.cpp) scale super-blocks of 256 weights in two levels, and keep each super-block's
scales as one record of GGUF's bytes (q5_k's re-packed and q3_k's unpacked, below), so they cost what they cost
there (q3_k: 4 bytes a super-block more):

    q4_k record   f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for its 8 sub-blocks of 32
                  (llama.cpp's get_scale_min_k4 packing)
    q5_k record   f16 d, f16 dmin, then the same pairs as 12-bit fields, scale | min << 6 for sub-block j at
                  bits 12j..12j+11 of bytes 4..15 (little-endian): the one re-packing of a record, so that a
                  sub-block's pair lies in two adjacent aligned words (the megakernel's lane ring copies a step's
                  scales beside its codes as 4-byte pieces, and q5_k's high bits take one of its four)
    q6_k record   f16 d, then 16 int8 scales, one per 16 weights
    q6_k data     per super-block 192 bytes: the codes' low 4 bits (128 bytes, in the 4-bit order
                  above), then their high 2 bits (64 bytes: element 4k + i at bits 2i..2i+1 of byte k)
    q3_k record   as q6_k's: f16 d, then the 16 scales less 32 as int8 (GGUF packs them as 6-bit fields in 12
                  bytes, 110 bytes a super-block where this takes 114: the scales unpacked once at load, so
                  that a kernel reads a chunk's scale as one byte)
    q3_k data     per super-block 96 bytes: the codes' low 2 bits (64 bytes: element 4k + i at bits 2i of byte
                  k), then their high bits (32 bytes: element i at bit i % 8 of byte i // 8)
    q2_k record   f16 d, f16 dmin, then 16 bytes scale | min << 4, one per 16 weights (GGUF's bytes, the
                  factors moved first)
    q2_k data     element 4k + i at bits 2i of byte k
    k_mix         a stack whose layers a GGUF holds in different K-quants (Q4_K_M keeps some layers' V and
                  down projections in Q6_K, the others in Q4_K), each layer's values exactly: q6_k's data (4-
                  and 5-bit codes are 6-bit codes too); record f16 A, f16 B, then 16 int8 pairs (a_i, b_i),
                  one per 16 weights (so a kernel's 32 codes find their two pairs in one aligned word): from
                  q6_k, A = d, B = -32 d, a_i = b_i = sc_i (a d of 2048 or more, whose B would overflow f16,
                  has no k_mix form); from q3_k, A = d, B = -4 d, a_i = b_i = s_i (a d of 16384 or more has no
                  k_mix form); from q4_k and q5_k, A = d, B = -dmin, and for the two runs of 16 of sub-block j,
                  a_i = sc_j and b_i = m_j; from q2_k, A = d, B = -dmin, (a_i, b_i) = (sc_i, m_i)

The IQ4 formats (llama.cpp's non-linear 4-bit): a code indexes 16 int8 values (IQ4_VALUES); iq4_nl scales a
block of 32 by f16 d, iq4_xs a super-block of 256 by a record kept as GGUF's 8 bytes: f16 d, a u16 of the 8
sub-blocks' 2 high scale bits (sub-block j at bits 2j), 4 bytes of their low 4 (j at the low nibble of byte j // 2
for even j, the high for odd); the sub-block's 6-bit scale less 32 multiplies d.

5-bit data (q5_0, q5_1 per block of 32, q5_k per super-block of 256): the codes' low 4 bits in the 4-bit
order above, then their high bits, element i at bit i % 8 of byte i // 8 (GGUF's own bit order).

Values (f32, exact):

    mxfp4          e2m1(code) * 2^(scale - 127)        scale 0xFF: NaN for the whole block
    mxfp8          e4m3(code) * 2^(scale - 127)        (E4M3 "fn": 0x7F/0xFF are NaN, no inf)
    fp8_block128   e4m3(code) * scale[row // 128, col // 128]   (the checkpoint's weight_scale_inv)
    q8_0           f32(d) * code                       (code signed)
    q4_0           f32(d) * (code - 8)
    q4_1           f32(d) * code + f32(m)
    q5_0           f32(d) * (code - 16)
    q5_1           f32(d) * code + f32(m)
    q4_k, q5_k     (d * sc_j) * code - (dmin * m_j)    (sub-block j = column // 32 of the super-block)
    q6_k           (d * sc_i) * (code - 32)            (i = column // 16 of the super-block; sc signed)
    q3_k           (d * s_i) * (code - 4)              (the same i; s_i = GGUF's 6-bit scale - 32)
    q2_k           (d * sc_i) * code - (dmin * m_i)    (the same i; 4-bit scale and min)
    iq4_nl         f32(d) * IQ4_VALUES[code]
    iq4_xs         (d * (sc_j - 32)) * IQ4_VALUES[code] (sub-block j = column // 32 of the super-block)
    k_mix          (A * a_i) * code + (B * b_i)        (the same i: every product exact, one rounding; a q6_k
                                                        layer's values but the sign of zero, and NaN for inf d)

`dequantize` is the reference: plain jax.numpy, bit-exact on every backend. XLA on CPU flushes
subnormal f32 results to zero, so the power-of-two MX scaling is done on the exponent bits with
integer arithmetic instead of a multiply (exact there too; a GPU kernel may simply multiply).

For kernels: a packed matvec gets the planes stacked `[layers, ...]` like dense weights, reads row o's
codes `data[l, o, :]` and its scales `scales[l, o, :]` contiguously (block b = columns 32b..32b+31 =
bytes 16b..16b+15 of a 4-bit row), computes each weight in f32 registers with the formula above and
accumulates `x * w` in f32. Its reference twin is `lithos.models.llama.linear(x, w)`: f32 values from
`dequantize(w, jnp.float32)`, an f32-accumulated product, cast to x's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lithos.errors import LithosError


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A packed format: what one element is and how a block of elements shares a scale.

    `block` is `(rows, cols)` of weights sharing one scale: `(1, 32)` for MX and GGUF blocks,
    `(128, 128)` for FP8 block-scaled checkpoints.
    """

    name: str
    element: str  # "e2m1", "e4m3", "int8", "uint2" ... "uint6", "iq4" (an index into IQ4_VALUES)
    element_bits: int  # 2 to 6, or 8
    block: tuple[int, int]
    scale: str  # "e8m0" (u8 biased exponent), "f16", "f32", "record" (u8 records of `record` bytes a block)
    has_min: bool = False
    record: int = 0  # bytes of each block's scale record (K-quants); 0: one scale (and min) a block in its plane
    origin: str = ""
    tile: tuple[int, int] | None = None  # (rows, inputs) a layout's tiles need (lithos.quant.tiles)
    # Rows of each head of this many reordered so that a tile holds both halves of 8 rotary pairs (lithos.quant.tiles
    # rotary tiles); 0: rows in order.
    rotary_head: int = 0

    def data_bytes(self, cols: int) -> int:
        """Bytes of data a row of `cols` weights takes."""
        return cols * self.element_bits // 8

    def data_cols(self, nbytes: int) -> int:
        """Weights a row of `nbytes` data bytes holds."""
        return nbytes * 8 // self.element_bits

    def bits_per_weight(self) -> float:
        """Average storage bits per weight, scales included (for full blocks)."""
        if self.record:
            scale_bits = 8 * self.record
        else:
            scale_bits = {"e8m0": 8, "f16": 16, "f32": 32}[self.scale] * (2 if self.has_min else 1)
        return self.element_bits + scale_bits / (self.block[0] * self.block[1])

    def plane_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of each plane for a logical `[..., out, in]` shape."""
        if len(shape) < 1:
            raise LithosError(f"{self.name}: a packed array needs at least one axis, got shape {shape}")
        *lead, cols = shape
        rows_block, cols_block = self.block
        if rows_block == 1 and cols % cols_block:
            raise LithosError(
                f"{self.name} packs rows in blocks of {cols_block}, but the rows have {cols} elements: "
                f"keep this tensor in bf16/f32 (its input size must be a multiple of {cols_block})"
            )
        if self.tile is not None:
            rows_step = self.rotary_head or self.tile[0]
            if len(shape) < 2 or shape[-2] % rows_step or cols % self.tile[1]:
                heads = f" in heads of {self.rotary_head} rows" if self.rotary_head else ""
                raise LithosError(
                    f"{self.name} lays matrices out in tiles of {self.tile[0]} rows x {self.tile[1]} inputs{heads}; "
                    f"shape {shape} does not split in them"
                )
        data_dtype = np.dtype(np.int8) if self.element == "int8" else np.dtype(np.uint8)
        planes = {"data": ((*lead, self.data_bytes(cols)), data_dtype)}
        if self.record:
            planes["scales"] = ((*lead, cols // cols_block, self.record), np.dtype(np.uint8))
            return planes
        scale_dtype = np.dtype({"e8m0": np.uint8, "f16": np.float16, "f32": np.float32}[self.scale])
        if rows_block == 1:
            scale_shape = (*lead, cols // cols_block)
        else:
            if not lead:
                raise LithosError(f"{self.name} scales 2-D tiles: it needs a [out, in] shape, got {shape}")
            *outer, rows = lead
            scale_shape = (*outer, math.ceil(rows / rows_block), math.ceil(cols / cols_block))
        planes["scales"] = (scale_shape, scale_dtype)
        if self.has_min:
            planes["mins"] = (scale_shape, scale_dtype)
        return planes


MXFP4 = QuantFormat("mxfp4", "e2m1", 4, (1, 32), "e8m0", origin="OCP MX v1.0; GPT-OSS checkpoints")
# MXFP4 in fragment tiles (lithos.quant.tiles): the same planes' sizes, the bits placed for tensor cores.
MXFP4_TILES = QuantFormat(
    "mxfp4_tiles", "e2m1", 4, (1, 32), "e8m0", origin="MXFP4 laid out for the megakernel", tile=(16, 64)
)
MXFP8 = QuantFormat("mxfp8", "e4m3", 8, (1, 32), "e8m0", origin="OCP MX v1.0 (MXFP8 E4M3)")
FP8_BLOCK128 = QuantFormat(
    "fp8_block128", "e4m3", 8, (128, 128), "f32", origin="DeepSeek-V3 / Qwen3 FP8 (weight_scale_inv)"
)
Q8_0 = QuantFormat("q8_0", "int8", 8, (1, 32), "f16", origin="GGUF (llama.cpp)")
Q4_0 = QuantFormat("q4_0", "uint4", 4, (1, 32), "f16", origin="GGUF (llama.cpp)")
Q4_1 = QuantFormat("q4_1", "uint4", 4, (1, 32), "f16", has_min=True, origin="GGUF (llama.cpp)")
Q5_0 = QuantFormat("q5_0", "uint5", 5, (1, 32), "f16", origin="GGUF (llama.cpp)")
Q5_1 = QuantFormat("q5_1", "uint5", 5, (1, 32), "f16", has_min=True, origin="GGUF (llama.cpp)")
Q2_K = QuantFormat("q2_k", "uint2", 2, (1, 256), "record", record=20, origin="GGUF (llama.cpp K-quants)")
Q3_K = QuantFormat("q3_k", "uint3", 3, (1, 256), "record", record=18, origin="GGUF (llama.cpp K-quants)")
Q4_K = QuantFormat("q4_k", "uint4", 4, (1, 256), "record", record=16, origin="GGUF (llama.cpp K-quants)")
Q5_K = QuantFormat("q5_k", "uint5", 5, (1, 256), "record", record=16, origin="GGUF (llama.cpp K-quants)")
Q6_K = QuantFormat("q6_k", "uint6", 6, (1, 256), "record", record=18, origin="GGUF (llama.cpp K-quants)")
IQ4_NL = QuantFormat("iq4_nl", "iq4", 4, (1, 32), "f16", origin="GGUF (llama.cpp IQ4_NL)")
IQ4_XS = QuantFormat("iq4_xs", "iq4", 4, (1, 256), "record", record=8, origin="GGUF (llama.cpp IQ4_XS)")
K_MIX = QuantFormat("k_mix", "uint6", 6, (1, 256), "record", record=36, origin="GGUF K-quant layers of mixed types")

MX_AND_FP8 = (MXFP4, MXFP4_TILES, MXFP8, FP8_BLOCK128)
GGUF_BLOCKS = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS)
K_QUANT_FORMATS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, K_MIX)
FORMATS: dict[str, QuantFormat] = {f.name: f for f in (*MX_AND_FP8, *GGUF_BLOCKS, *K_QUANT_FORMATS)}


def get_format(name: str) -> QuantFormat:
    if name not in FORMATS:
        raise LithosError(f"unknown weight format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


@struct.dataclass
class QuantizedArray:
    """A packed weight of logical shape `[..., out, in]` (see the module docstring for the planes).

    `dtype` is what it stands for in a model (the activations' dtype): `dequantize` and indexing
    return that dtype, and code that asks a weight for its dtype (cache allocation) gets it.
    """

    data: jax.Array
    scales: jax.Array
    format: QuantFormat = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False)
    mins: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantised) shape."""
        *lead, packed = self.data.shape
        return (*lead, self.format.data_cols(packed))

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of all planes: what a kernel reads to use every weight once."""
        return sum(int(p.size) * np.dtype(p.dtype).itemsize for p in self.planes().values())

    def planes(self) -> dict[str, Any]:
        """`{"data": ..., "scales": ..., ["mins": ...]}`: the arrays that are stored and read."""
        out = {"data": self.data, "scales": self.scales}
        if self.mins is not None:
            out["mins"] = self.mins
        return out

    def __getitem__(self, index) -> jax.Array:
        """Index the leading axis and return dequantised values, as `dense[index]` would.

        For an embedding table `[vocab, hidden]` this gathers only the packed rows asked for (so a
        lookup never dequantises the whole table); for stacked weights `[layers, out, in]` it picks
        layers.
        """
        if self.ndim < 2:
            raise LithosError(f"indexing a packed {self.format.name} array needs 2 or more axes, has {self.ndim}")
        if self.format.tile is not None and self.ndim == 2:  # a tile's bytes hold 16 rows: no row stands alone
            return dequantize(self)[index]
        if self.format.block[0] == 1 or self.ndim > 2:  # the leading axis does not share scales
            picked = jax.tree_util.tree_map(lambda p: p[index], self)
            return dequantize(picked, self.dtype)
        rows = jnp.asarray(index)
        values = e4m3_to_f32(self.data[rows])
        scale = jnp.repeat(self.scales[rows // self.format.block[0]], self.format.block[1], axis=-1)
        return (values * scale[..., : values.shape[-1]]).astype(self.dtype)


def from_planes(fmt: QuantFormat | str, planes: dict[str, Any], dtype=np.float32) -> QuantizedArray:
    """Build a QuantizedArray from its planes, checking their shapes and dtypes against the format."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    data = planes["data"]
    shape = (*data.shape[:-1], fmt.data_cols(data.shape[-1]))
    expected = fmt.plane_shapes(shape)
    if set(planes) != set(expected):
        raise LithosError(f"{fmt.name} has planes {sorted(expected)}, got {sorted(planes)}")
    for name, (plane_shape, plane_dtype) in expected.items():
        got = planes[name]
        if tuple(got.shape) != plane_shape or np.dtype(got.dtype) != plane_dtype:
            raise LithosError(
                f"{fmt.name} {name} for shape {shape} must be {plane_dtype} {plane_shape}, "
                f"got {np.dtype(got.dtype)} {tuple(got.shape)}: the packed tensor is corrupt"
            )
    return QuantizedArray(
        data=data, scales=planes["scales"], mins=planes.get("mins"), format=fmt, dtype=np.dtype(dtype)
    )


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def format_name(x: Any) -> str:
    """"mxfp4", "q4_1", ... for packed arrays, the dtype's name ("bfloat16") for dense ones."""
    return x.format.name if isinstance(x, QuantizedArray) else str(np.dtype(x.dtype))


# --------------------------------------------------------------------------------------------
# Reference dequantisation
# --------------------------------------------------------------------------------------------

# IQ4 code -> value (llama.cpp's kvalues_iq4nl).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
# E2M1 code -> value: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
E8M0_NAN = 0xFF
_F32_NAN_BITS = 0x7FC00000
_F32_INF_BITS = 0x7F800000


def unpack_nibbles(data: jax.Array) -> jax.Array:
    """`[..., n]` u8 -> `[..., 2n]` int32 codes 0..15: element 2k from the low nibble of byte k, 2k+1 from
    the high. (A broadcast shift in int32 fuses into one loop on XLA:CPU; stacking two u8 halves does not.)"""
    codes = (data.astype(jnp.int32)[..., None] >> jnp.array([0, 4], jnp.int32)) & 0x0F
    return codes.reshape(*data.shape[:-1], 2 * data.shape[-1])


def e4m3_to_f32(codes: jax.Array) -> jax.Array:
    """E4M3 ("fn") bit patterns (u8) to f32; every E4M3 value is a normal f32, so this is exact."""
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)


def scale_by_e8m0(values: jax.Array, exponents: jax.Array) -> jax.Array:
    """`values * 2^(exponents - 127)` exactly, by adding to the f32 exponent field.

    values: f32 `[..., blocks, block]` whose nonzero entries are normal f32 with at most 4
    significant bits (E2M1 or E4M3 values), so no product ever needs rounding, even when it lands
    among the subnormals (the smallest, 2^-9 * 2^-127, is far above 2^-149). exponents: u8
    `[..., blocks]`; 0xFF (E8M0 NaN) makes the whole block NaN, as the OCP spec says. A multiply
    would give the same bits on a GPU, but XLA on CPU flushes subnormal results to zero.
    """
    bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
    sign = bits & jnp.uint32(0x80000000)
    magnitude = bits & jnp.uint32(0x7FFFFFFF)
    mantissa = magnitude & jnp.uint32(0x7FFFFF)
    k = exponents.astype(jnp.int32)[..., None] - 127
    new_exp = (magnitude >> 23).astype(jnp.int32) + k
    normal = sign | (jnp.clip(new_exp, 1, 254).astype(jnp.uint32) << 23) | mantissa
    # Below the normal range: the significand (implicit bit made explicit) shifted right; exact, see above.
    shift = jnp.clip(1 - new_exp, 0, 31).astype(jnp.uint32)
    subnormal = sign | ((mantissa | jnp.uint32(0x800000)) >> shift)
    out = jnp.where(new_exp >= 255, sign | jnp.uint32(_F32_INF_BITS), jnp.where(new_exp >= 1, normal, subnormal))
    out = jnp.where(magnitude == 0, sign, out)
    nan = jnp.isnan(values) | (exponents == E8M0_NAN)[..., None]
    out = jnp.where(nan, jnp.uint32(_F32_NAN_BITS), out)
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """`[..., n]` -> `[..., n/block, block]`."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblock(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _record_f16(records: jax.Array, at: int) -> jax.Array:
    """The f16 at bytes `at`, `at + 1` of every record `[..., blocks, record]`, as f32 `[..., blocks]`."""
    return jax.lax.bitcast_convert_type(records[..., at : at + 2], jnp.float16).astype(jnp.float32)


def q4_k_scales_and_mins(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 8 sub-blocks' 6-bit scales and mins from a Q4_K record's 12 bytes `[..., 12]` (llama.cpp's
    get_scale_min_k4): sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and 4..7 (mins); 4..7
    in the nibbles of bytes 8..11, their top 2 bits in the top bits of bytes 0..3 and 4..7."""
    q = packed.astype(jnp.int32)
    low_sc, low_m, high = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    scales = jnp.concatenate([low_sc & 63, (high & 0xF) | ((low_sc >> 6) << 4)], axis=-1)
    mins = jnp.concatenate([low_m & 63, (high >> 4) | ((low_m >> 6) << 4)], axis=-1)
    return scales, mins


def unpack_5bit(data: jax.Array, group: int) -> jax.Array:
    """5-bit codes `[..., n]` int32 from data `[..., 5n/8]` laid out per `group` weights: their low nibbles
    (`unpack_nibbles` order), then their high bits (element i at bit i % 8 of byte i // 8)."""
    runs = _blocks(data, group * 5 // 8)
    low = unpack_nibbles(runs[..., : group // 2])
    high = (runs[..., group // 2 :].astype(jnp.int32)[..., None] >> jnp.arange(8, dtype=jnp.int32)) & 1
    return _unblock(low | (high.reshape(low.shape) << 4))


def q5_k_scales_and_mins(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 8 sub-blocks' 6-bit scales and mins from a q5_k record's 12 bytes `[..., 12]`: sub-block j's pair
    scale | min << 6 at bits 12j..12j+11 (an even j's in byte 3i and the low nibble of byte 3i + 1, j = 2i; an odd
    j's in the high nibble of byte 3i + 1 and byte 3i + 2)."""
    q = packed.astype(jnp.int32)
    b0, b1, b2 = q[..., 0::3], q[..., 1::3], q[..., 2::3]  # [..., 4] each: the pairs 2i and 2i + 1
    pairs = jnp.stack([b0 | (b1 & 0xF) << 8, b1 >> 4 | b2 << 4], axis=-1).reshape(*q.shape[:-1], 8)
    return pairs & 63, pairs >> 6


def q5_k_pack_pairs(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """The 12 bytes `[..., 12]` u8 of a q5_k record that hold the 6-bit `scales` and `mins` `[..., 8]`
    (q5_k_scales_and_mins' inverse)."""
    pairs = (np.asarray(scales, np.uint16) & 63) | (np.asarray(mins, np.uint16) & 63) << 6
    even, odd = pairs[..., 0::2], pairs[..., 1::2]
    packed = np.stack([even & 0xFF, even >> 8 | (odd & 0xF) << 4, odd >> 4], axis=-1)
    return packed.reshape(*pairs.shape[:-1], 12).astype(np.uint8)


def k_scales_and_mins(records: jax.Array, fmt_name: str) -> tuple[jax.Array, jax.Array]:
    """The 8 sub-blocks' 6-bit scales and mins `[..., 8]` int32 from q4_k or q5_k records `[..., 16]`."""
    unpack = q4_k_scales_and_mins if fmt_name == "q4_k" else q5_k_scales_and_mins
    return unpack(records[..., 4:16])


def unpack_2bit(data: jax.Array) -> jax.Array:
    """2-bit codes `[..., 4n]` int32 from bytes `[..., n]`: element 4k + i at bits 2i of byte k."""
    codes = (data.astype(jnp.int32)[..., None] >> jnp.array([0, 2, 4, 6], jnp.int32)) & 3
    return codes.reshape(*data.shape[:-1], 4 * data.shape[-1])


def k_quant_codes(data: jax.Array, fmt_name: str) -> jax.Array:
    """The codes `[..., n]` int32 of K-quant data (q2_k ... q6_k, k_mix: the layouts in the module docstring)."""
    if fmt_name == "q4_k":
        return unpack_nibbles(data)
    if fmt_name == "q5_k":
        return unpack_5bit(data, 256)
    if fmt_name == "q2_k":
        return unpack_2bit(data)
    if fmt_name == "q3_k":
        blocks = _blocks(data, 96)  # [..., super-blocks, 96]
        high = (blocks[..., 64:].astype(jnp.int32)[..., None] >> jnp.arange(8, dtype=jnp.int32)) & 1
        return _unblock(unpack_2bit(blocks[..., :64]) | high.reshape(*high.shape[:-2], 256) << 2)
    blocks = _blocks(data, 192)  # q6_k, k_mix: [..., super-blocks, 192]
    high = (blocks[..., 128:].astype(jnp.int32)[..., None] >> jnp.array([0, 2, 4, 6], jnp.int32)) & 3
    return _unblock(unpack_nibbles(blocks[..., :128]) | (high.reshape(*high.shape[:-2], 256) << 4))


def _dequantize_k_quant(w: QuantizedArray) -> jax.Array:
    records = w.scales  # [..., super-blocks, record]
    d = _record_f16(records, 0)[..., None]
    if w.format.name in ("q4_k", "q5_k"):
        codes = _blocks(k_quant_codes(w.data, w.format.name), 32)  # [..., sub-blocks, 32]
        scales, mins = k_scales_and_mins(records, w.format.name)  # [..., super-blocks, 8]
        scale = (d * scales.astype(jnp.float32)).reshape(codes.shape[:-1])[..., None]
        low = (_record_f16(records, 2)[..., None] * mins.astype(jnp.float32)).reshape(codes.shape[:-1])[..., None]
        return _unblock(scale * codes.astype(jnp.float32) - low)
    codes = _blocks(_blocks(k_quant_codes(w.data, w.format.name), 256), 16)  # the rest: [..., sb, 16, 16]
    if w.format.name == "q2_k":
        scales, mins = records[..., 4:20] & 0x0F, records[..., 4:20] >> 4  # [..., 16]
        scale = d * scales.astype(jnp.float32)
        low = _record_f16(records, 2)[..., None] * mins.astype(jnp.float32)
        return _unblock(_unblock(scale[..., None] * codes.astype(jnp.float32) - low[..., None]))
    if w.format.name in ("q3_k", "q6_k"):
        offset = 4 if w.format.name == "q3_k" else 32
        scales = jax.lax.bitcast_convert_type(records[..., 2:18], jnp.int8).astype(jnp.float32)  # [..., 16]
        return _unblock(_unblock((d * scales)[..., None] * (codes - offset).astype(jnp.float32)))
    pairs = jax.lax.bitcast_convert_type(records[..., 4:36], jnp.int8).astype(jnp.float32)  # (a_i, b_i)
    mul, add = d * pairs[..., 0::2], _record_f16(records, 2)[..., None] * pairs[..., 1::2]
    return _unblock(_unblock(mul[..., None] * codes.astype(jnp.float32) + add[..., None]))


def _dequantize_iq4_xs(w: QuantizedArray) -> jax.Array:
    records = w.scales.astype(jnp.int32)  # [..., super-blocks, 8]
    high = (records[..., 2:3] | records[..., 3:4] << 8) >> (2 * jnp.arange(8)) & 3  # [..., 8]
    low = (records[..., 4:8, None] >> jnp.array([0, 4])) & 0xF  # [..., 4, 2]: sub-blocks 2k, 2k + 1
    scales = (low.reshape(high.shape) | high << 4) - 32
    factor = (_record_f16(w.scales, 0)[..., None] * scales.astype(jnp.float32))[..., None]  # [..., 8, 1]
    values = jnp.asarray(IQ4_VALUES)[_blocks(_blocks(unpack_nibbles(w.data), 256), 32)]  # [..., sb, 8, 32]
    return _unblock(_unblock(factor * values))


def _dequantize_f32(w: QuantizedArray) -> jax.Array:
    if w.format.tile is not None:
        from lithos.quant.tiles import from_tiles

        w = from_tiles(w)
    fmt = w.format
    name = fmt.name
    if name == "iq4_xs":
        return _dequantize_iq4_xs(w)
    if fmt.record:
        return _dequantize_k_quant(w)
    if name in ("mxfp4", "mxfp8"):
        if name == "mxfp4":
            values = jnp.asarray(E2M1_VALUES)[unpack_nibbles(w.data)]
        else:
            values = e4m3_to_f32(w.data)
        return _unblock(scale_by_e8m0(_blocks(values, fmt.block[1]), w.scales))
    if name == "fp8_block128":
        values = e4m3_to_f32(w.data)
        rows, cols = values.shape[-2:]
        scale = jnp.repeat(jnp.repeat(w.scales, fmt.block[0], axis=-2), fmt.block[1], axis=-1)
        return values * scale[..., :rows, :cols]
    d = w.scales.astype(jnp.float32)[..., None]
    if name == "q8_0":
        return _unblock(d * _blocks(w.data.astype(jnp.float32), 32))
    codes = _blocks(unpack_nibbles(w.data) if fmt.element_bits == 4 else unpack_5bit(w.data, 32), 32)
    if name == "iq4_nl":
        return _unblock(d * jnp.asarray(IQ4_VALUES)[codes])
    if name in ("q4_0", "q5_0"):  # signed codes, offset by half their range
        return _unblock(d * (codes - (8 if name == "q4_0" else 16)).astype(jnp.float32))
    if name in ("q4_1", "q5_1"):
        return _unblock(d * codes.astype(jnp.float32) + w.mins.astype(jnp.float32)[..., None])
    raise LithosError(f"no reference dequantisation for format {name!r}")


def dequantize(w: QuantizedArray, dtype=None) -> jax.Array:
    """The reference: exact values `[..., out, in]` in f32, cast to `dtype` (default `w.dtype`) last."""
    out = _dequantize_f32(w)
    dtype = w.dtype if dtype is None else dtype
    return out if np.dtype(dtype) == np.float32 else out.astype(dtype)


def as_dense(w: Any, dtype=None) -> Any:
    """`w` itself if it is a plain array, else its dequantised values (reference path of a packed weight)."""
    return dequantize(w, dtype) if isinstance(w, QuantizedArray) else w


def with_dtype(w: QuantizedArray, dtype) -> QuantizedArray:
    """The same packed planes, standing for `dtype` in the model."""
    return w.replace(dtype=np.dtype(dtype))


def dequantize_params(params: Any) -> Any:
    """`params` with every packed leaf replaced by its dequantised values (in its model dtype)."""
    return jax.tree_util.tree_map(
        lambda w: dequantize(w) if isinstance(w, QuantizedArray) else w,
        params,
        is_leaf=lambda w: isinstance(w, QuantizedArray),
    )


def describe_formats(params: Any) -> str:
    """What `params` are stored in, for people: "96.6 MB: q4_1 69%, q8_0 31%, float32 <1%" (bytes_by_format)."""
    by_format = bytes_by_format(params)
    total = max(sum(by_format.values()), 1)

    def share(n: int) -> str:
        return f"{100 * n / total:.0f}%" if 200 * n >= total else "<1%"

    ranked = sorted(by_format.items(), key=lambda item: -item[1])
    return f"{total / 1e6:.1f} MB: " + ", ".join(f"{name} {share(n)}" for name, n in ranked)


def bytes_by_format(params: Any) -> dict[str, int]:
    """Bytes of `params` per storage format: `{"q4_1": ..., "q8_0": ..., "float32": ...}` (packed arrays
    count all their planes)."""
    out: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=lambda w: isinstance(w, QuantizedArray)):
        nbytes = leaf.nbytes if isinstance(leaf, QuantizedArray) else int(leaf.size) * np.dtype(leaf.dtype).itemsize
        out[format_name(leaf)] = out.get(format_name(leaf), 0) + nbytes
    return out
