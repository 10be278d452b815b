"""Checkpoint layouts -> packed planes (numpy, at load time, lossless).

- GGUF blocks (Q8_0, Q4_0, Q4_1, IQ4_NL, MXFP4): llama.cpp interleaves each block's scale with its codes
  (`[f16 d][f16 m]?[codes]`, 18 to 34 bytes, unaligned); the planes split them apart so that a
  kernel reads aligned codes and aligned scales, and 4-bit codes are reordered to the common
  "element 2k in the low nibble of byte k" order.
- GGUF K-quant super-blocks (Q2_K ... Q6_K: 256 weights, 84, 110, 144, 176 and 210 bytes): their scales stay one
  record per super-block (lithos.quant.formats; Q5_K's scale and min pairs re-packed as 12-bit fields, Q3_K's
  6-bit scales unpacked to bytes: 114), their codes are reordered as above. 5-bit codes (Q5_0, Q5_1, Q5_K) keep
  GGUF's high bits as they are, after their low nibbles. A stack whose layers mix K-quants becomes K_MIX, each
  layer's values exactly. IQ4_XS keeps its 8-byte records as they are, its codes reordered as Q4_0's.
- GGUF ternary blocks (TQ1_0, TQ2_0: 256 weights d * (c - 1), c in 0..2, base-3 digits or 2-bit codes) become
  Q2_K, whose (d sc) c - (dmin m) with sc = m = 1 and dmin = d is the same value: 2.625 bits a weight where the
  file has 1.69 or 2.06, read by the Q2_K kernels.
- GGUF IQ3_S super-blocks (256 weights (d (1 + 2 s_j)) * g * sign, g an odd magnitude 1..15 from llama.cpp's grid,
  s_j a 4-bit scale per 32) become Q6_K, whose (d * sc_i) * (c - 32) with sc_i = 1 + 2 s_j and c = 32 + g * sign
  is the same value bit for bit: 6.5625 bits a weight where the file has 3.44, read by the Q6_K kernels.
- GPT-OSS MXFP4 safetensors: `*_blocks` u8 `[..., out, in/32, 16]` (already in that order) and
  `*_scales` u8 `[..., out, in/32]`.
- FP8 block-scaled safetensors (DeepSeek-V3, Qwen3-FP8): `weight` F8_E4M3 `[out, in]` and
  `weight_scale_inv` f32 (or bf16) `[ceil(out/128), ceil(in/128)]`, the multiplier that dequantises.
"""

from __future__ import annotations

import numpy as np

from lithos.errors import CheckpointError
from lithos.quant.formats import (
    FP8_BLOCK128,
    IQ4_NL,
    IQ4_XS,
    K_MIX,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    QuantFormat,
    QuantizedArray,
    dequantize,
    from_planes,
    k_quant_codes,
    k_scales_and_mins,
    q4_k_scales_and_mins,
    q5_k_pack_pairs,
)

# GGUF tensor type name -> (format, weights per block, bytes per block).
GGUF_FORMATS: dict[str, tuple[QuantFormat, int, int]] = {
    "Q8_0": (Q8_0, 32, 34),
    "Q4_0": (Q4_0, 32, 18),
    "Q4_1": (Q4_1, 32, 20),
    "MXFP4": (MXFP4, 32, 17),
    "Q5_0": (Q5_0, 32, 22),
    "Q5_1": (Q5_1, 32, 24),
    "Q4_K": (Q4_K, 256, 144),
    "Q5_K": (Q5_K, 256, 176),
    "Q6_K": (Q6_K, 256, 210),
    "Q3_K": (Q3_K, 256, 110),
    "Q2_K": (Q2_K, 256, 84),
    "IQ4_NL": (IQ4_NL, 32, 18),
    "IQ4_XS": (IQ4_XS, 256, 136),
    "TQ1_0": (Q2_K, 256, 54),
    "TQ2_0": (Q2_K, 256, 66),
    "IQ3_S": (Q6_K, 256, 110),
}


class NoPackedForm(CheckpointError):
    """Values a packed format cannot hold exactly (a K-quant d so large that K_MIX's B would overflow f16, a ternary
    block's infinite d): the loader keeps them as float32 instead."""


def _field(blocks: np.ndarray, start: int, stop: int, dtype) -> np.ndarray:
    """Bytes `start:stop` of every block, reinterpreted as `dtype`: `[..., blocks]` or `[..., blocks, n]`."""
    raw = np.ascontiguousarray(blocks[..., start:stop]).view(dtype)
    return raw[..., 0] if raw.shape[-1] == 1 else raw


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes `[..., n]` in element order -> u8 `[..., n/2]`, element 2k in the low nibble of byte k."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def gguf_nibbles_to_planar(qs: np.ndarray) -> np.ndarray:
    """GGUF 4-bit codes `[..., blocks, 16]` (elements 0..15 low nibbles, 16..31 high) -> `[..., blocks*16]`
    with element 2k in the low nibble of byte k."""
    elements = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., blocks, 32] in element order
    return pack_nibbles(elements).reshape(*qs.shape[:-2], qs.shape[-2] * 16)


def _q4_k_planes(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K super-blocks `[..., n, 144]` (f16 d, f16 dmin, 12 scale bytes, 128 code bytes whose 32-byte
    run c holds elements 64c..64c+31 in its low nibbles and 64c+32.. in its high) -> planes."""
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(*blocks.shape[:-1], 256)
    lead = blocks.shape[:-2]
    return {"scales": np.ascontiguousarray(blocks[..., :16]), "data": pack_nibbles(codes).reshape(*lead, -1)}


def _5bit_runs(low_codes: np.ndarray, high_bits: np.ndarray) -> np.ndarray:
    """Codes' low 4 bits `[..., n, group]` in element order and their high bits as GGUF packs them `[..., n,
    group/8]` (element i at bit i % 8 of byte i // 8) -> `[..., n * 5 * group / 8]`: each run's low nibbles in
    the common 4-bit order, then its high bits."""
    runs = np.concatenate([pack_nibbles(low_codes), high_bits], axis=-1)
    return runs.reshape(*runs.shape[:-2], -1)


def _q5_k_planes(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q5_K super-blocks `[..., n, 176]` (Q4_K's 16-byte record, 32 bytes of high bits: element 32s + l's at bit s
    of byte l, then Q4_K's 128 code bytes) -> planes (the record's pairs re-packed as q5_k keeps them)."""
    qs = blocks[..., 48:].reshape(*blocks.shape[:-1], 4, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(*blocks.shape[:-1], 256)
    high = (blocks[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [..., n, l, s]
    high = np.swapaxes(high, -1, -2).reshape(*blocks.shape[:-1], 256)  # element 32s + l
    high_bytes = np.packbits(high.reshape(*high.shape[:-1], 32, 8), axis=-1, bitorder="little")[..., 0]
    sc, m = (np.asarray(v) for v in q4_k_scales_and_mins(blocks[..., 4:16]))
    record = np.concatenate([blocks[..., :4], q5_k_pack_pairs(sc, m)], axis=-1)  # the pairs re-packed
    return {"scales": record, "data": _5bit_runs(low, high_bytes)}


def _2bit_codes(qs: np.ndarray) -> np.ndarray:
    """A Q2_K, Q3_K or TQ2_0 super-block's 2-bit codes `[..., n, 64]` (byte 32h + 16t + l holds element 128h + 32j +
    16t + l at bits 2j) -> `[..., n, 2, 4, 2, 16]` (h, j, t, l: element order)."""
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
    return (qs.reshape(*qs.shape[:-1], 2, 1, 2, 16) >> shifts) & 3


def _q2_k_planes(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q2_K super-blocks `[..., n, 84]` (16 bytes of 4-bit scale | min << 4, one per 16 weights; 64 of 2-bit codes;
    f16 d and dmin; w = (d sc_i) c - dmin m_i) -> planes: the codes in element order, and a record of d, dmin and
    the 16 scale bytes."""
    codes = _2bit_codes(blocks[..., 16:80]).reshape(*blocks.shape[:-1], 256)
    record = np.concatenate([blocks[..., 80:84], blocks[..., :16]], axis=-1)
    return {"scales": record, "data": _2bit_bytes(codes).reshape(*blocks.shape[:-2], -1)}


def _ternary_codes(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """A TQ1_0 or TQ2_0 block's codes `[..., n, 256]` in element order (gguf.quants' TQ1_0/TQ2_0 decoders). TQ2_0
    keeps Q2_K's 2-bit layout; TQ1_0 packs five base-3 digits a byte (four in its last 4 bytes), digit p of byte b
    being ((b * 3^p mod 256) * 3) >> 8: 32 bytes for elements 32p + b, 16 for 160 + 16p + b, 4 for 240 + 4p + b."""
    if type_name == "TQ2_0":
        return _2bit_codes(blocks[..., :64]).reshape(*blocks.shape[:-1], 256)
    powers = np.array([1, 3, 9, 27, 81], np.uint8)

    def digits(b: np.ndarray, count: int) -> np.ndarray:
        shifted = b[..., None, :] * powers[:count, None]  # u8: mod 256
        return ((shifted.astype(np.uint16) * 3) >> 8).astype(np.uint8).reshape(*b.shape[:-1], -1)

    runs = (digits(blocks[..., :32], 5), digits(blocks[..., 32:48], 5), digits(blocks[..., 48:52], 4))
    return np.concatenate(runs, axis=-1)


def _ternary_planes(blocks: np.ndarray, type_name: str) -> dict[str, np.ndarray]:
    """TQ1_0 blocks `[..., n, 54]` (48 bytes of base-3 digits, 4 more, f16 d) or TQ2_0 `[..., n, 66]` (64 bytes of
    2-bit codes, f16 d), w = d (c - 1) -> Q2_K planes holding the same values: (d * 1) c - (d * 1), records of d,
    dmin = d and 16 bytes of scale | min << 4 = 0x11. The values are exact but the sign of zero (d * 0 is -0 for a
    negative d; Q2_K's d - d is +0); an infinite d (inf * 2 - inf is NaN) is a NoPackedForm."""
    d = blocks[..., -2:]
    if np.isinf(d.copy().view(np.float16)).any():
        raise NoPackedForm(f"a GGUF {type_name} block with an infinite d has no q2_k form")
    codes = _ternary_codes(blocks, type_name)
    record = np.concatenate([d, d, np.full((*d.shape[:-1], 16), 0x11, np.uint8)], axis=-1)
    return {"scales": record, "data": _2bit_bytes(codes).reshape(*blocks.shape[:-2], -1)}


def _2bit_bytes(codes: np.ndarray) -> np.ndarray:
    """2-bit codes `[..., 4n]` -> bytes `[..., n]`: element 4k + i at bits 2i of byte k."""
    packed = codes[..., 0::4] | (codes[..., 1::4] << 2) | (codes[..., 2::4] << 4) | (codes[..., 3::4] << 6)
    return packed.astype(np.uint8)


def _q3_k_planes(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q3_K super-blocks `[..., n, 110]` (32 bytes of high bits: element 128h + 32j + 16t + l's at bit 4h + j of byte
    16t + l; 64 of low 2 bits as Q2_K's; 12 of 6-bit scales; f16 d; w = d (sc_i - 32) (c - 4) for the 3-bit code c)
    -> planes: the codes' low 2 bits and high bits (lithos.quant.formats), and a record of d and the scales less
    32 as int8. The scales' packing is llama.cpp's: scale 4q + k has its low 4 bits in byte k (q = 0, 2) or 4 + k
    (q = 1, 3), that byte's low nibble for q < 2 and its high one above, and its top 2 bits at bits 2q of byte
    8 + k."""
    lead = blocks.shape[:-1]
    high_shifts = np.arange(8, dtype=np.uint8).reshape(2, 4, 1, 1)
    high = (blocks[..., :32].reshape(*lead, 1, 1, 2, 16) >> high_shifts) & 1
    codes = (_2bit_codes(blocks[..., 32:96]) | high << 2).reshape(*lead, 256)
    s = blocks[..., 96:108].astype(np.int16)
    low = np.stack([s[..., 0:4] & 0xF, s[..., 4:8] & 0xF, s[..., 0:4] >> 4, s[..., 4:8] >> 4], axis=-2)
    top = (s[..., None, 8:12] >> (2 * np.arange(4, dtype=np.int16))[:, None]) & 3  # [..., q, k]
    scales = ((low | top << 4) - 32).reshape(*lead, 16).astype(np.int8)
    record = np.concatenate([blocks[..., 108:110], scales.view(np.uint8)], axis=-1)
    return {"scales": record, "data": _3bit_runs(codes)}


def _3bit_runs(codes: np.ndarray) -> np.ndarray:
    """3-bit codes `[..., n, 256]` -> `[..., n * 96]`: each super-block's low 2 bits (element 4k + i at bits 2i of
    byte k), then its high bits (element i at bit i % 8 of byte i // 8)."""
    high_bytes = np.packbits((codes >> 2).reshape(*codes.shape[:-1], 32, 8) & 1, axis=-1, bitorder="little")[..., 0]
    runs = np.concatenate([_2bit_bytes(codes & 3), high_bytes], axis=-1)
    return runs.reshape(*runs.shape[:-2], -1)


def _b_factor(d: np.ndarray, times: int, fmt_name: str) -> np.ndarray:
    """K_MIX's B = `times` * d in f16 (exact where finite: `times` is a power of two); a NoPackedForm where a finite
    d of `fmt_name` overflows."""
    with np.errstate(over="ignore"):
        b = d * np.float16(times)
    overflow = np.isinf(b) & np.isfinite(d)
    if overflow.any():
        raise NoPackedForm(
            f"a {fmt_name} super-block's d of {float(d[overflow][0])} is {65536 // abs(times)} or more, so it has no "
            f"k_mix form ({times} d overflows f16)"
        )
    return b


def _6bit_runs(codes: np.ndarray) -> np.ndarray:
    """6-bit codes `[..., n, 256]` -> `[..., n * 192]`: each super-block's low nibbles in the common 4-bit order,
    then its high 2 bits (element 4k + i at bits 2i of byte k)."""
    runs = np.concatenate([pack_nibbles(codes & 0x0F), _2bit_bytes(codes >> 4)], axis=-1)
    return runs.reshape(*runs.shape[:-2], -1)


def _q6_k_planes(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K super-blocks `[..., n, 210]` (ql: 128 bytes of low 4 bits, qh: 64 of high 2 bits, 16 int8 scales,
    f16 d) -> planes. In half h of a super-block, ql byte 64h + l holds elements 128h + l (low nibble) and
    128h + 64 + l (high); qh byte 32h + l holds the high bits of elements 128h + 32s + l at bits 2s."""
    ql = blocks[..., :128].reshape(*blocks.shape[:-1], 2, 64)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1).reshape(*blocks.shape[:-1], 256)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(*blocks.shape[:-1], 256)
    record = np.concatenate([blocks[..., 208:210], blocks[..., 192:208]], axis=-1)  # d first, then the scales
    return {"scales": record, "data": _6bit_runs(low | (high << 4))}


def _iq3_s_planes(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """IQ3_S super-blocks `[..., n, 110]` (f16 d, 64 bytes of grid indices' low 8 bits, 8 of their high bits, 32 of
    signs, 4 of 4-bit scales) -> Q6_K planes of the same values (above). The signed grid values come from gguf's own
    IQ3_S decoder run with d = 1 and every scale 0 (so 1 + 2 s = 1): integers, exact."""
    import gguf

    unit = blocks.copy()
    unit[..., 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    unit[..., 106:110] = 0
    signed = gguf.quants.dequantize(unit.reshape(-1, 110), gguf.GGMLQuantizationType.IQ3_S)
    codes = (signed.astype(np.int8) + 32).astype(np.uint8).reshape(*blocks.shape[:-1], 256)
    nibbles = (blocks[..., 106:110, None] >> np.array([0, 4], np.uint8)) & 0x0F  # sub-block 2k + i: byte k, nibble i
    sc = np.repeat((1 + 2 * nibbles).reshape(*blocks.shape[:-1], 8), 2, axis=-1).astype(np.int8)  # one per 16
    record = np.concatenate([blocks[..., 0:2], sc.view(np.uint8)], axis=-1)
    return {"scales": record, "data": _6bit_runs(codes)}


def to_k_mix(w: QuantizedArray) -> QuantizedArray:
    """A Q2_K ... Q6_K array (numpy planes) as K_MIX, every value exactly (lithos.quant.formats; a K_MIX
    array as it is); a NoPackedForm for a Q6_K (Q3_K) array with a finite d of 2048 (16384) or more, which has no
    K_MIX form (B = -32 d, -4 d, would overflow f16)."""
    if w.format == K_MIX:
        return w
    records = np.asarray(w.scales)
    if w.format.name in ("q3_k", "q6_k"):
        d = records[..., 0:2].copy().view(np.float16)
        factors = np.concatenate([d, _b_factor(d, -4 if w.format.name == "q3_k" else -32, w.format.name)], axis=-1)
        a = b = records[..., 2:18].view(np.int8)
    elif w.format.name == "q2_k":
        factors = np.concatenate([records[..., 0:2], records[..., 2:4] ^ np.uint8([0, 0x80])], axis=-1)  # B = -dmin
        factors = factors.view(np.float16)
        a, b = records[..., 4:20] & 0x0F, records[..., 4:20] >> 4
    else:
        sc, m = (np.asarray(v) for v in k_scales_and_mins(records, w.format.name))
        a, b = np.repeat(sc, 2, axis=-1).astype(np.int8), np.repeat(m, 2, axis=-1).astype(np.int8)
        factors = np.concatenate([records[..., 0:2], records[..., 2:4] ^ np.uint8([0, 0x80])], axis=-1)  # B = -dmin
        factors = factors.view(np.float16)
    pairs = np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 32)
    record = np.concatenate([factors.view(np.uint8), pairs.view(np.uint8)], axis=-1)
    codes = np.asarray(k_quant_codes(w.data, w.format.name)).astype(np.uint8)
    data = _6bit_runs(codes.reshape(*codes.shape[:-1], -1, 256))
    return from_planes(K_MIX, {"data": data, "scales": record}, w.dtype)


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, ...], dtype=np.float32) -> QuantizedArray:
    """A GGUF tensor's bytes (u8, any shape with `shape`'s total size in blocks) -> QuantizedArray of
    logical `shape` `[..., out, in]` (row-major, as `gguf.quants.dequantize` returns it)."""
    if type_name not in GGUF_FORMATS:
        raise CheckpointError(f"GGUF type {type_name} is not kept packed (packed: {', '.join(GGUF_FORMATS)})")
    fmt, block_elements, block_bytes = GGUF_FORMATS[type_name]
    *lead, cols = shape
    if cols % block_elements:
        raise CheckpointError(
            f"GGUF {type_name} tensor of shape {shape}: rows of {cols} do not split in blocks of {block_elements}"
        )
    blocks = np.asarray(raw, np.uint8).reshape(*lead, cols // block_elements, block_bytes)
    if type_name in ("Q5_0", "Q5_1"):
        # [f16 d][f16 m]?[u32 high bits, element i at bit i][16 bytes: elements 0..15 low nibbles, 16..31 high]
        at = 2 if type_name == "Q5_0" else 4
        qs = blocks[..., at + 4 : at + 20]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        planes = {"scales": _field(blocks, 0, 2, np.float16), "data": _5bit_runs(low, blocks[..., at : at + 4])}
        if type_name == "Q5_1":
            planes["mins"] = _field(blocks, 2, 4, np.float16)
    elif type_name == "Q4_K":
        planes = _q4_k_planes(blocks)
    elif type_name == "Q5_K":
        planes = _q5_k_planes(blocks)
    elif type_name == "Q6_K":
        planes = _q6_k_planes(blocks)
    elif type_name == "Q2_K":
        planes = _q2_k_planes(blocks)
    elif type_name == "Q3_K":
        planes = _q3_k_planes(blocks)
    elif type_name in ("TQ1_0", "TQ2_0"):
        planes = _ternary_planes(blocks, type_name)
    elif type_name == "IQ3_S":
        planes = _iq3_s_planes(blocks)
    elif type_name == "Q8_0":
        planes = {"scales": _field(blocks, 0, 2, np.float16), "data": _field(blocks, 2, 34, np.int8)}
        planes["data"] = planes["data"].reshape(*lead, cols)
    elif type_name in ("Q4_0", "IQ4_NL"):  # [f16 d][16 bytes of codes]
        planes = {"scales": _field(blocks, 0, 2, np.float16), "data": gguf_nibbles_to_planar(blocks[..., 2:18])}
    elif type_name == "IQ4_XS":  # [8-byte record][8 sub-blocks' 16 bytes of codes, each as Q4_0's]
        qs = blocks[..., 8:].reshape(*blocks.shape[:-1], 8, 16)
        planes = {
            "scales": np.ascontiguousarray(blocks[..., :8]),
            "data": gguf_nibbles_to_planar(qs).reshape(*lead, -1),
        }
    elif type_name == "Q4_1":
        planes = {
            "scales": _field(blocks, 0, 2, np.float16),
            "mins": _field(blocks, 2, 4, np.float16),
            "data": gguf_nibbles_to_planar(blocks[..., 4:20]),
        }
    else:
        # MXFP4: [e8m0][16 bytes]. llama.cpp doubles its value table and halves the scale (same numbers),
        # but its integer table makes code 8 +0 (E2M1: -0) and it reads scale 0xFF as 2^128 (E8M0: NaN);
        # lithos keeps the OCP meaning of both, which no real weight uses.
        planes = {"scales": np.ascontiguousarray(blocks[..., 0]), "data": gguf_nibbles_to_planar(blocks[..., 1:17])}
    return from_planes(fmt, planes, dtype)


def from_gpt_oss_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> QuantizedArray:
    """GPT-OSS `*_blocks` u8 `[..., out, in/32, 16]` + `*_scales` u8 `[..., out, in/32]` -> MXFP4 `[..., out, in]`."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair as [..., out, in/32, 16] "
            "and [..., out, in/32]: the checkpoint is not in the GPT-OSS layout"
        )
    data = np.asarray(blocks).reshape(*blocks.shape[:-2], blocks.shape[-2] * 16)
    return from_planes(MXFP4, {"data": data, "scales": np.asarray(scales)}, dtype)


def from_fp8_block_scaled(weight: np.ndarray, scale_inv: np.ndarray, dtype=np.float32) -> QuantizedArray:
    """`weight` E4M3 `[..., out, in]` (float8_e4m3fn or its u8 bits) + `weight_scale_inv` `[..., ceil(out/128),
    ceil(in/128)]` -> FP8_BLOCK128. bf16 scales widen to f32 exactly."""
    data = np.asarray(weight)
    if data.dtype.itemsize != 1:
        raise CheckpointError(f"an FP8 weight must have 1-byte elements, got {data.dtype}")
    data = data.view(np.uint8)
    scales = np.asarray(scale_inv).astype(np.float32)
    expected = FP8_BLOCK128.plane_shapes(data.shape)["scales"][0]
    if scales.shape != expected:
        raise CheckpointError(
            f"FP8 weight {data.shape} needs weight_scale_inv of shape {expected} (128x128 blocks), got "
            f"{scales.shape}: only weight_block_size [128, 128] is supported"
        )
    return from_planes(FP8_BLOCK128, {"data": data, "scales": scales}, dtype)


def map_planes(fn, w):
    """Apply `fn` to every plane of a packed array (or to a dense array): for row permutations, which
    move each row's codes and scales together (valid for formats whose blocks are one row)."""
    if isinstance(w, QuantizedArray):
        if w.format.block[0] != 1 or w.format.tile is not None:
            raise CheckpointError(f"rows of a {w.format.name} tensor share tiles: they cannot be permuted")
        return w.replace(**{name: fn(plane) for name, plane in w.planes().items()})
    return fn(w)


def join_rows(a, b):
    """Rows of `b` under rows of `a` (`[..., out, in]`: an expert's gate and up projections as one matrix), packed
    plane by plane when both are packed in one format whose scale blocks do not straddle the seam (every plane
    holds its rows on the same axis as the logical shape); otherwise as exact f32 values."""
    if isinstance(a, QuantizedArray) and isinstance(b, QuantizedArray) and a.format == b.format:
        if a.shape[-2] % a.format.block[0] == 0:
            rows, below = len(a.shape) - 2, b.planes()
            planes = {n: np.concatenate([np.asarray(p), np.asarray(below[n])], rows) for n, p in a.planes().items()}
            return from_planes(a.format, planes, a.dtype)
    dense = [np.asarray(dequantize(w, np.float32)) if isinstance(w, QuantizedArray) else w for w in (a, b)]
    return np.concatenate(dense, -2)


def split_rows(w, sizes: tuple[int, ...]) -> list:
    """`w` (`[..., out, in]`) cut into consecutive row ranges of `sizes` (a fused Q/K/V or gate/up matrix into its
    parts): the inverse of `join_rows`. Packed plane by plane where every cut falls on a block of rows; otherwise
    exact f32 values."""
    out = w.shape[-2]
    if sum(sizes) != out:
        raise CheckpointError(f"rows {out} cannot be cut into {list(sizes)}: the checkpoint and its config differ")
    cuts = np.cumsum((0, *sizes))
    if isinstance(w, QuantizedArray):
        if all(c % w.format.block[0] == 0 for c in cuts) and w.format.tile is None:
            rows = len(w.shape) - 2
            planes = {n: np.asarray(p) for n, p in w.planes().items()}

            def part(start, stop):  # a plane holds a row, or a block of rows, at each index of the rows axis
                return {n: np.take(p, range(start * p.shape[rows] // out, stop * p.shape[rows] // out), rows)
                        for n, p in planes.items()}

            return [from_planes(w.format, part(a, b), w.dtype) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        w = np.asarray(dequantize(w, np.float32))
    return [w[..., a:b, :] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def interleave_rows(a, b):
    """Rows of `a` and `b` (`[..., out, in]`) alternating, a's first: GPT-OSS's gate_up matrix from its gate and up
    projections. Packed plane by plane when both share a format whose blocks are one row; otherwise exact f32."""
    if isinstance(a, QuantizedArray) and isinstance(b, QuantizedArray) and a.format == b.format:
        if a.format.block[0] == 1 and a.format.tile is None:
            rows, other = len(a.shape) - 2, b.planes()
            planes = {}
            for n, p in a.planes().items():
                pair = np.stack([np.asarray(p), np.asarray(other[n])], axis=rows + 1)
                planes[n] = pair.reshape(*p.shape[:rows], 2 * p.shape[rows], *p.shape[rows + 1 :])
            return from_planes(a.format, planes, a.dtype)
    dense = [np.asarray(dequantize(w, np.float32)) if isinstance(w, QuantizedArray) else np.asarray(w) for w in (a, b)]
    return np.stack(dense, axis=-2).reshape(*dense[0].shape[:-2], 2 * dense[0].shape[-2], dense[0].shape[-1])


K_QUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def stack(arrays: list) -> np.ndarray | QuantizedArray:
    """Stack per-layer tensors on a new leading axis. Packed tensors of one format stack plane by plane; K-quants
    of several (Q4_K_M's V and down projections) as K_MIX, exactly; any other mix (a
    GGUF whose layers use different types, or a layer with no K_MIX form) falls back to exact f32 values."""
    packed = [a for a in arrays if isinstance(a, QuantizedArray)]
    formats = {a.format.name for a in packed}
    if packed and len(packed) == len(arrays) and len(formats) > 1 and formats <= {*K_QUANTS, K_MIX.name}:
        try:
            packed = arrays = [to_k_mix(a) for a in packed]
        except NoPackedForm:  # the values as f32 below
            pass
    if packed and len(packed) == len(arrays) and len({a.format for a in packed}) == 1:
        first = packed[0]
        planes = {name: np.stack([np.asarray(a.planes()[name]) for a in packed]) for name in first.planes()}
        return from_planes(first.format, planes, first.dtype)
    if packed:
        from lithos.quant.formats import dequantize

        arrays = [np.asarray(dequantize(a, np.float32)) if isinstance(a, QuantizedArray) else a for a in arrays]
    return np.stack(arrays)
