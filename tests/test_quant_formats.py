"""Packed formats: the jax.numpy reference dequantisation against independent numpy implementations
written from the format specs (OCP MX v1.0, DeepSeek-V3 FP8) and against `gguf.quants.dequantize`,
bit for bit, on random blocks and on every edge code (zero, maximum and NaN scales, negative zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lithos import quant
from lithos.errors import LithosError

from .conftest import require

RNG = np.random.default_rng(1234)


# ---- independent numpy decoders, from the specs ------------------------------------------------


def np_e2m1(codes: np.ndarray) -> np.ndarray:
    """OCP E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 8, -1.0, 1.0)
    exp, man = (codes >> 1) & 3, codes & 1
    mag = np.where(exp == 0, man * 0.5, np.ldexp(1.0 + man / 2.0, exp - 1))
    return sign * mag  # float64; -0.0 for code 8


def np_e4m3(codes: np.ndarray) -> np.ndarray:
    """OCP E4M3 ("fn"): sign bit 7, exponent bits 6..3 (bias 7), mantissa 2..0; S.1111.111 is NaN, no inf."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 15, codes & 7
    mag = np.where(exp == 0, np.ldexp(man / 8.0, -6), np.ldexp(1.0 + man / 8.0, exp - 7))
    return np.where((exp == 15) & (man == 7), np.nan, sign * mag)


def np_e8m0(codes: np.ndarray) -> np.ndarray:
    """OCP E8M0: 2^(code - 127); 0xFF is NaN."""
    codes = codes.astype(np.int64)
    return np.where(codes == 255, np.nan, np.ldexp(1.0, codes - 127))


def to_f32(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 with IEEE rounding (exact here: every product below fits in f32 or overflows)."""
    with np.errstate(over="ignore"):
        return x.astype(np.float32)


def np_mx(elements: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """elements `[..., n]` float64, scales `[..., n/32]` u8 -> f32 `[..., n]`."""
    blocks = elements.reshape(*scales.shape, 32) * np_e8m0(scales)[..., None]
    return to_f32(blocks.reshape(elements.shape))


def assert_bits_equal(got, expected) -> None:
    """Same f32 bit patterns, except that any NaN equals any NaN (the spec gives no NaN payload)."""
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    assert got.shape == expected.shape
    both_nan = np.isnan(got) & np.isnan(expected)
    same = (got.view(np.uint32) == expected.view(np.uint32)) | both_nan
    bad = np.argwhere(~same)
    first = tuple(bad[:3].T)
    assert same.all(), f"{len(bad)} mismatches, first at {bad[:3].tolist()}: {got[first]} vs {expected[first]}"


# Every E8M0 edge: smallest (2^-127, subnormal results), 1.0, largest (2^127, overflow to inf), NaN.
E8M0_EDGES = np.array([0, 1, 2, 126, 127, 128, 253, 254, 255], np.uint8)


def random_scales(shape) -> np.ndarray:
    scales = RNG.integers(0, 256, shape, dtype=np.uint8)
    flat = scales.reshape(-1)
    flat[: len(E8M0_EDGES)] = E8M0_EDGES
    return scales


# ---- MX ----------------------------------------------------------------------------------------


def test_mxfp4_matches_spec_bit_for_bit():
    rows, cols = 24, 256
    codes = RNG.integers(0, 16, (rows, cols), dtype=np.uint8)
    codes[0, :16] = np.arange(16)  # every code, including -0 (8), beside every edge scale
    codes[1, :16] = np.arange(16)
    scales = random_scales((rows, cols // 32))
    scales[0, :] = 0  # the smallest scale: every product is f32-subnormal or tiny
    scales[1, :] = 254  # the largest: 3 * 2^128 and above overflow to inf
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    w = quant.from_planes("mxfp4", {"data": data, "scales": scales})
    got = jax.jit(quant.dequantize)(w)
    assert_bits_equal(got, np_mx(np_e2m1(codes), scales))
    assert np.isinf(np.asarray(got)[1, 7]) and np.asarray(got)[0, 1] == np.float32(2.0**-128)
    assert np.signbit(np.asarray(got)[0, 8]) and np.asarray(got)[0, 8] == 0  # negative zero stays negative


def test_mxfp8_matches_spec_bit_for_bit():
    rows, cols = 16, 512
    codes = RNG.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[0, :256] = np.arange(256)  # every E4M3 code: subnormals, -0 (0x80), NaN (0x7F, 0xFF)
    codes[1, :256] = np.arange(256)
    scales = random_scales((rows, cols // 32))
    scales[0, :] = 0
    scales[1, :] = 254
    w = quant.from_planes("mxfp8", {"data": codes, "scales": scales})
    got = jax.jit(quant.dequantize)(w)
    assert_bits_equal(got, np_mx(np_e4m3(codes), scales))
    # E4M3's smallest subnormal under the smallest scale: 2^-9 * 2^-127, an f32 subnormal.
    assert np.asarray(got)[0, 1] == np.float32(2.0**-136)


def test_mx_nan_scale_makes_the_whole_block_nan():
    data = np.zeros((1, 32), np.uint8)  # zeros, which any finite scale leaves zero
    w = quant.from_planes("mxfp8", {"data": data, "scales": np.array([[255]], np.uint8)})
    assert np.isnan(np.asarray(quant.dequantize(w))).all()


def test_gpt_oss_layout_low_nibble_is_the_even_element():
    """The GPT-OSS `_blocks [.., out, in/32, 16]` + `_scales` pair, decoded as transformers' GPT-OSS
    conversion does it (lut[low nibble] -> even columns, lut[high] -> odd, then ldexp by scale - 127)."""
    out_rows, n_blocks = 6, 3
    blocks = RNG.integers(0, 256, (2, out_rows, n_blocks, 16), dtype=np.uint8)  # a leading experts axis
    scales = RNG.integers(100, 150, (2, out_rows, n_blocks), dtype=np.uint8)
    lut = np.array([+0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    expected = np.empty((2, out_rows, n_blocks, 32))
    expected[..., 0::2] = lut[blocks & 0x0F]
    expected[..., 1::2] = lut[blocks >> 4]
    expected = np.ldexp(expected, scales.astype(np.int64)[..., None] - 127).reshape(2, out_rows, n_blocks * 32)
    w = quant.from_gpt_oss_mxfp4(blocks, scales)
    assert w.shape == (2, out_rows, n_blocks * 32)
    assert_bits_equal(quant.dequantize(w), to_f32(expected))


# ---- FP8 with 128x128 block scales -------------------------------------------------------------


def test_fp8_block128_matches_spec_bit_for_bit():
    """`weight * weight_scale_inv[row // 128, col // 128]`, with partial edge tiles (200 x 300)."""
    rows, cols = 200, 300
    codes = RNG.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[0, :256] = np.arange(256)
    scale_inv = np.exp(RNG.uniform(-12, 2, (2, 3))).astype(np.float32)
    # Edge scales: zero, negative zero, the largest f32 (overflows with most codes), inf and NaN.
    # (Subnormal f32 scales are left out: XLA on CPU flushes subnormal inputs and results to zero.)
    scale_inv[0, 0] = 0.0
    scale_inv[0, 1] = -0.0
    scale_inv[1, 0] = np.finfo(np.float32).max
    scale_inv[1, 1] = np.inf
    scale_inv[1, 2] = np.nan
    w = quant.from_fp8_block_scaled(codes.view(ml_dtypes.float8_e4m3fn), scale_inv)
    expand = np.repeat(np.repeat(scale_inv.astype(np.float64), 128, 0), 128, 1)[:rows, :cols]
    with np.errstate(invalid="ignore"):
        expected = to_f32(np_e4m3(codes) * expand)  # the f64 product is exact; one rounding to f32
    assert_bits_equal(jax.jit(quant.dequantize)(w), expected)


def test_fp8_block_scales_must_be_128x128():
    with pytest.raises(LithosError, match="128x128"):
        quant.from_fp8_block_scaled(np.zeros((256, 256), np.uint8), np.ones((4, 4), np.float32))


# ---- GGUF ----------------------------------------------------------------------------------------


# Where each GGUF block keeps its f16 factors: d (and Q4_1's m, Q4_K's dmin).
F16_FACTORS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ3_S": (0,),
}
# K-quants whose K_MIX form scales d by a power of two (B = -32 d, -4 d): the d at which B overflows f16.
D_LIMITS = {"Q6_K": 2048, "Q3_K": 16384}


GGUF_TYPES = [
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "IQ4_NL",
    "MXFP4",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_XS",
    "IQ3_S",  # as Q6_K
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy decoder meets the NaN/inf scales too
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_blocks_match_gguf_dequantize(type_name):
    """Random bytes cover every f16 factor (zero, -0, subnormal, 65504, inf, NaN) and every code (and every
    6-bit K-quant scale and min, every Q6_K int8 scale)."""
    gguf = require("gguf")
    qtype = gguf.GGMLQuantizationType[type_name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = 64, 8 * 32 // block_elems + 1
    raw = RNG.integers(0, 256, (rows, blocks * block_bytes), dtype=np.uint8)
    if type_name != "MXFP4":
        edges = np.array([0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF, 0x7C00, 0x7E00], np.uint16)
        for at in F16_FACTORS[type_name]:
            raw.reshape(rows, blocks, block_bytes)[: len(edges), 0, at : at + 2] = edges.view(np.uint8).reshape(-1, 2)
    else:
        raw.reshape(rows, blocks, block_bytes)[: len(E8M0_EDGES), 0, 0] = E8M0_EDGES
    expected = gguf.quants.dequantize(raw, qtype)
    w = quant.from_gguf(raw, type_name, expected.shape)
    got = np.asarray(jax.jit(quant.dequantize)(w))
    if type_name == "MXFP4":
        # Two places where llama.cpp departs from OCP MX, which lithos follows: its value table is
        # integers, so code 8 is +0 (E2M1 says -0), and it decodes scale 0xFF as 2^128 (E8M0 says NaN).
        # Compare zeros by value and NaN-scale blocks by the OCP rule; everything else bit for bit.
        got = np.where(got == 0, np.float32(0), got)
        nan_scale = np.repeat(raw.reshape(rows, blocks, block_bytes)[..., 0] == 0xFF, 32, axis=1)
        assert nan_scale.any() and np.isnan(got[nan_scale]).all()
        expected = np.where(nan_scale, np.float32(np.nan), expected)
    assert_bits_equal(got, expected)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy decoder meets the NaN/inf factors too
@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_become_k_mix_exactly(type_name):
    """A stack of K-quant layers of several types is K_MIX (Q4_K_M's V and down projections): every value of every
    type, f16 edges included, the same as gguf's, but the sign of zero (a K_MIX zero is +0) and a Q6_K or Q3_K
    super-block of infinite d (NaN in K_MIX: inf * q - inf * 32). A Q6_K d of 2048 or more (Q3_K: 16384) has no
    K_MIX form (its B = -32 d, -4 d, overflows f16): refused, and a stack holding one arrives as exact float32."""
    gguf = require("gguf")
    qtype = gguf.GGMLQuantizationType[type_name]
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, (64, 3 * block_bytes), dtype=np.uint8)
    limit = D_LIMITS.get(type_name)
    edges = np.array([0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF, 0x7E00] + [0x7C00] * (limit is None), np.uint16)
    blocks = raw.reshape(64, 3, block_bytes)
    for at in F16_FACTORS[type_name]:
        blocks[: len(edges), 0, at : at + 2] = edges.view(np.uint8).reshape(-1, 2)
    if limit is not None:  # no other infinite d either, and none at the limit or above (below)
        at = F16_FACTORS[type_name][0]
        d = blocks[..., at : at + 2].copy().view(np.float16)
        big = np.isinf(d) | (np.abs(d) >= limit)
        blocks[..., at : at + 2] = np.where(big, np.float16(1), d).view(np.uint8)
    expected = gguf.quants.dequantize(raw, qtype)
    mixed = quant.layouts.to_k_mix(quant.from_gguf(raw, type_name, expected.shape))
    assert mixed.format == quant.K_MIX and mixed.nbytes == 64 * 3 * (192 + 36)
    got = np.asarray(jax.jit(quant.dequantize)(mixed))
    np.testing.assert_array_equal(got, expected)  # -0 == +0, NaN == NaN
    if limit is not None:
        blocks[5, 1, at : at + 2] = np.float16(-limit).reshape(1).view(np.uint8)
        wide = quant.from_gguf(raw, type_name, expected.shape)
        with pytest.raises(LithosError, match="no k_mix form"):
            quant.layouts.to_k_mix(wide)
        q4_k = quant.from_gguf(RNG.integers(0, 256, (64, 3 * 144), dtype=np.uint8), "Q4_K", expected.shape)
        stacked = quant.layouts.stack([q4_k, wide])
        assert isinstance(stacked, np.ndarray) and stacked.dtype == np.float32
        np.testing.assert_array_equal(stacked[1], gguf.quants.dequantize(raw, qtype))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy decoder meets the NaN factors too
@pytest.mark.parametrize("type_name", ["TQ1_0", "TQ2_0"])
def test_ternary_blocks_become_q2_k_exactly(type_name):
    """TQ1_0 and TQ2_0 load as Q2_K: every value the same as gguf's (random bytes: every base-3 digit and 2-bit code,
    the f16 edges of d but infinity), but the sign of zero; in a stack beside Q4_K layers, K_MIX with the same values.
    An infinite d has no Q2_K form (inf * 2 - inf is NaN): refused, and the loader keeps that tensor as float32."""
    gguf = require("gguf")
    qtype = gguf.GGMLQuantizationType[type_name]
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, (64, 3 * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(64, 3, block_bytes)
    edges = np.array([0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF, 0x7E00], np.uint16)
    blocks[: len(edges), 0, -2:] = edges.view(np.uint8).reshape(-1, 2)
    d = blocks[..., -2:].copy().view(np.float16)
    blocks[..., -2:] = np.where(np.isinf(d), np.float16(-3), d).view(np.uint8)
    expected = gguf.quants.dequantize(raw, qtype)
    w = quant.from_gguf(raw, type_name, expected.shape)
    assert w.format == quant.Q2_K and w.nbytes == 64 * 3 * 84
    got = np.asarray(jax.jit(quant.dequantize)(w))
    np.testing.assert_array_equal(got, expected)  # -0 == +0, NaN == NaN
    assert_bits_equal(got[expected != 0], expected[expected != 0])
    q4_k = quant.from_gguf(RNG.integers(0, 256, (64, 3 * 144), dtype=np.uint8), "Q4_K", expected.shape)
    mixed = quant.layouts.stack([q4_k, w])
    assert mixed.format == quant.K_MIX
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.dequantize)(mixed))[1], expected)
    blocks[7, 2, -2:] = np.array([0xFC00], np.uint16).view(np.uint8)  # -inf
    with pytest.raises(LithosError, match="no q2_k form"):
        quant.from_gguf(raw, type_name, expected.shape)


def test_k_quant_planes_cost_what_the_gguf_blocks_cost():
    """The K-quants' records keep GGUF's bytes: 4.5 bits a weight for Q4_K, 5.5 for Q5_K, 6.5625 for Q6_K (Q6_K's
    record holds its d before its 16 scales: the same 18 bytes), 2.625 for Q2_K; Q3_K's 6-bit scales take a byte
    each (3.5625 bits a weight against the file's 3.4375). Their rows split only in whole super-blocks."""
    sizes = ((quant.Q2_K, 84), (quant.Q3_K, 114), (quant.Q4_K, 144), (quant.Q5_K, 176), (quant.Q6_K, 210))
    for fmt, block_bytes in sizes:
        planes = fmt.plane_shapes((3, 512))
        assert sum(np.prod(shape) * dtype.itemsize for shape, dtype in planes.values()) == 3 * 2 * block_bytes
        assert fmt.bits_per_weight() == block_bytes * 8 / 256
        with pytest.raises(LithosError, match="blocks of 256"):
            fmt.plane_shapes((3, 576))


def test_gguf_quantized_weights_round_trip():
    """Realistic blocks (gguf's own quantizer) through the loader's converter."""
    gguf = require("gguf")
    x = RNG.standard_normal((96, 128)).astype(np.float32)
    for type_name in ("Q8_0", "Q4_0", "Q4_1"):
        qtype = gguf.GGMLQuantizationType[type_name]
        raw = gguf.quants.quantize(x, qtype)
        w = quant.from_gguf(raw, type_name, x.shape)
        assert_bits_equal(quant.dequantize(w), gguf.quants.dequantize(raw, qtype))


# ---- quantizers ------------------------------------------------------------------------------------


def np_quantize_mx(x: np.ndarray, element, largest: float, emax: int) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX quantization with ml_dtypes doing the element rounding: (element values, scale codes)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        shared = np.where(amax > 0, np.clip(np.floor(np.log2(amax)) - emax, -127, 127), -127).astype(np.int64)
    scaled = np.clip(blocks / np.ldexp(1.0, shared)[..., None], -largest, largest).astype(np.float32)
    elements = scaled.astype(element).astype(np.float64).reshape(x.shape)
    return elements, (shared + 127).astype(np.uint8)


@pytest.mark.parametrize(
    "fmt_name, element, largest, emax",
    [("mxfp4", ml_dtypes.float4_e2m1fn, 6.0, 2), ("mxfp8", ml_dtypes.float8_e4m3fn, 448.0, 8)],
)
def test_mx_quantizer_matches_ocp_rounding(fmt_name, element, largest, emax):
    x = (RNG.standard_normal((32, 256)) * np.exp(RNG.uniform(-20, 20, (32, 1)))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = np.linspace(-7, 7, 32)  # ties and saturation
    x[2, :32] = -1e-30  # rounds to negative zero
    elements, scales = np_quantize_mx(x, element, largest, emax)
    w = jax.jit(quant.quantize, static_argnums=1)(jnp.asarray(x), fmt_name)
    np.testing.assert_array_equal(np.asarray(w.scales), scales)
    assert_bits_equal(quant.dequantize(w), np_mx(elements, scales))


def test_ceil_scale_rule_never_clips():
    x = RNG.standard_normal((8, 128)).astype(np.float32)
    for fmt_name, largest in (("mxfp4", 6.0), ("mxfp8", 448.0)):
        w = quant.quantize(jnp.asarray(x), fmt_name, scale_rule="ceil")
        scale = np.ldexp(1.0, np.asarray(w.scales).astype(np.int64) - 127)
        assert (np.abs(x).reshape(8, 4, 32).max(-1) <= largest * scale).all()
        floor = quant.quantize(jnp.asarray(x), fmt_name)
        assert (np.asarray(w.scales).astype(int) - np.asarray(floor.scales)).min() >= 0


def test_fp8_block_quantizer_round_trip():
    x = RNG.standard_normal((3, 200, 300)).astype(np.float32)
    w = quant.quantize(jnp.asarray(x), "fp8_block128")
    assert w.scales.shape == (3, 2, 3) and w.data.shape == x.shape
    err = np.abs(np.asarray(quant.dequantize(w)) - x)
    assert err.max() <= np.abs(x).max() * 2.0**-4  # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 relative


# ---- the pytree ----------------------------------------------------------------------------------


def test_packed_array_is_a_pytree_that_scans_and_indexes():
    x = RNG.standard_normal((3, 64, 96)).astype(np.float32)  # [layers, out, in]
    for fmt_name in ("mxfp4", "fp8_block128"):  # one-row blocks and 128x128 tiles (mxfp8 shares mxfp4's path)
        w = quant.quantize(jnp.asarray(x), fmt_name)
        assert w.shape == x.shape and w.dtype == np.float32
        dense = np.asarray(quant.dequantize(w))
        leaves, treedef = jax.tree_util.tree_flatten(w)
        assert len(leaves) == 2 and jax.tree_util.tree_unflatten(treedef, leaves).format is w.format

        def body(carry, layer):  # lax.scan slices every plane's leading axis
            return carry, quant.dequantize(layer)

        _, per_layer = jax.jit(lambda w: jax.lax.scan(body, 0, w))(w)
        np.testing.assert_array_equal(np.asarray(per_layer), dense)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda w: w[1])(w)), dense[1])
        table = quant.quantize(jnp.asarray(x[0]), fmt_name)  # [vocab, hidden]: gather rows, then dequantise
        rows = jnp.array([[5, 0], [63, 5]])
        gathered = jax.jit(lambda t, r: t[r])(table, rows)
        np.testing.assert_array_equal(np.asarray(gathered), np.asarray(quant.dequantize(table))[np.asarray(rows)])


def test_bad_planes_are_reported():
    with pytest.raises(LithosError, match="multiple of 32"):
        quant.quantize(jnp.ones((4, 40)), "mxfp4")
    with pytest.raises(LithosError, match="scales"):
        quant.from_planes("q4_1", {"data": np.zeros((4, 16), np.uint8), "scales": np.zeros((4, 2), np.float16)})


def test_fp8_kv_cache_reference():
    from lithos.quant import kv

    head_scale = np.array([1.0, 10.0, 0.1], np.float32)[None, None, :, None, None]  # heads of different sizes
    x = RNG.standard_normal((2, 1, 3, 40, 16)).astype(np.float32) * head_scale
    scales = kv.kv_scales(jnp.asarray(x))
    assert scales.shape == (2, 1, 3)  # [layers, batch, kv_heads]
    codes = kv.quantize_kv(jnp.asarray(x), scales)
    assert codes.dtype == jnp.uint8 and codes.shape == x.shape
    expected = to_f32(np_e4m3(np.asarray(codes)) * np.asarray(scales, np.float64)[..., None, None])
    got = kv.dequantize_kv(codes, scales)
    assert_bits_equal(got, expected)
    # Relative error of one E4M3 rounding (3 mantissa bits), never worse than the subnormal step.
    bound = np.maximum(np.abs(x) * 2.0**-4, np.asarray(scales)[..., None, None] * 2.0**-10)
    assert (np.abs(np.asarray(got) - x) <= bound).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy decoder meets the NaN/inf factors too
def test_expert_rows_join_and_stack_in_every_record_format():
    """Stacked experts `[E, out, in]` (a qwen3moe GGUF's): an expert's gate and up rows join plane by plane, the record
    formats' scales on their row axis too, and layers of two K-quants stack as K_MIX, every value gguf's."""
    gguf = require("gguf")
    decoded = {}
    for type_name in ("Q4_K", "Q6_K"):
        qtype = gguf.GGMLQuantizationType[type_name]
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = RNG.integers(0, 256, (3, 4, 2 * block_bytes), dtype=np.uint8)
        d = raw.reshape(3, 4, 2, block_bytes)[..., 208:210]  # Q6_K's d: below K_MIX's limit (2048)
        if type_name == "Q6_K":
            d[...] = np.abs(np.nan_to_num(d.copy().view(np.float16), posinf=1)).clip(0, 1000).view(np.uint8)
        decoded[type_name] = (quant.from_gguf(raw, type_name, (3, 4, 512)), gguf.quants.dequantize(raw, qtype))
    (q4_k, q4_values), (q6_k, q6_values) = decoded["Q4_K"], decoded["Q6_K"]
    joined = quant.layouts.join_rows(q4_k, q4_k)
    assert joined.format == quant.Q4_K and joined.shape == (3, 8, 512)
    assert_bits_equal(np.asarray(quant.dequantize(joined)), np.concatenate([q4_values, q4_values], axis=-2))
    stacked = quant.layouts.stack([q4_k, q6_k])
    assert stacked.format == quant.K_MIX and stacked.shape == (2, 3, 4, 512)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(stacked)), np.stack([q4_values, q6_values]))


@pytest.mark.parametrize("fmt_name", ["q4_k", "mxfp4", "fp8_block128"])
def test_split_rows_cuts_packed_matrices_plane_by_plane(fmt_name):
    """A fused projection `[..., out, in]` (Phi-3's Q/K/V, its gate and up) cut into its parts by rows: packed plane
    by plane, the record formats' scales and the 128-row blocks' scales with their rows, every value the whole
    matrix's; a cut inside a block of rows falls back to exact f32 values."""
    w = quant.random_packed(fmt_name, (2, 512, 256), RNG, spread=0.05)
    values = np.asarray(quant.dequantize(w, jnp.float32))
    sizes = (256, 128, 128)
    parts = quant.layouts.split_rows(w, sizes)
    starts = np.cumsum((0, *sizes))
    for part, start, size in zip(parts, starts[:-1], sizes, strict=True):
        assert isinstance(part, quant.QuantizedArray) and part.format == w.format and part.shape == (2, size, 256)
        assert_bits_equal(np.asarray(quant.dequantize(part, jnp.float32)), values[:, start : start + size])
    uneven = quant.layouts.split_rows(w, (192, 320))
    packed_ok = w.format.block[0] == 1
    assert isinstance(uneven[0], quant.QuantizedArray) == packed_ok
    assert_bits_equal(np.asarray(quant.dequantize(uneven[1], jnp.float32)) if packed_ok else uneven[1], values[:, 192:])
    with pytest.raises(LithosError, match="cannot be cut"):
        quant.layouts.split_rows(w, (256, 128))
