// The packed weight formats (lithos.quant) as kernels read them: their codes, the WeightFormat codes the handlers
// take, and per format the decoder of one chunk of 16 weights (`Packed<F>`: its load, its decode to floats, and the
// factors that scale it). packed.h builds the dot products on them; packed_steps.h the megakernel ring's steps.
//
// Decoding never reads a table from memory: codes are turned into fp16 bit patterns two at a time with integer
// masks, then into floats by the hardware's fp16 -> f32 conversion (exact, subnormals too):
//   E2M1 (mxfp4): magnitude bits at fp16 bits 9..11, sign at 15: the fp16 value is v * 2^-14.
//   E4M3 (mxfp8, fp8_block128): the 7 magnitude bits at fp16 bits 7..13: v * 2^-8; codes 0x7F/0xFF
//       are NaN in E4M3 "fn" and are flagged so the row's sum becomes NaN, as the reference's would.
//   2- to 8-bit integers (GGUF): 1024 + code as fp16 (exact), minus 1024 (+4 for Q3_K, +8 for Q4_0, +16 for Q5_0,
//       +32 for Q6_K, +128 for the int8 bias) in fp16, which is exact for integers this small.
//   IQ4 (iq4_nl, iq4_xs): the 16 non-linear values are held in registers and looked up by byte permutes.
// The K-quants (Q2_K to Q6_K) and IQ4_XS scale super-blocks of 256 weights in two levels: a chunk of 16 lies in
// one sub-block, so its factor is the super-block's d times the sub-block's scale, read from the record.
#pragma once

#include <cstdint>
#include <cstring>

#include "portable.h"
#include "rowdot.h"

#if defined(LITHOS_HIP)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

// The decoders below (loads, conversions, Packed<F>'s load, decode and scale) also compile for the host, where
// tests/test_packed_host.py runs them on the CPU against the reference dequantisation; their device code is the
// same either way. LITHOS_DEVICE_PASS tells the two passes apart.
#define LITHOS_DECODE __host__ __device__ __forceinline__
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define LITHOS_DEVICE_PASS 1
#endif

namespace lithos {

// The `format` attribute of every packed handler; keep in step with FORMAT_CODES in
// lithos/custom_calls/packed_weights.py.
enum class WeightFormat : int32_t {
  kBf16 = 0,
  kMxfp4 = 1,
  kMxfp8 = 2,
  kFp8Block128 = 3,
  kQ8_0 = 4,
  kQ4_0 = 5,
  kQ4_1 = 6,
  kQ4_K = 7,
  kQ6_K = 8,
  kQ5_0 = 9,
  kQ5_1 = 10,
  kQ5_K = 11,
  kKMix = 12,
  kQ3_K = 13,
  kQ2_K = 14,
  kIq4Nl = 15,
  kIq4Xs = 16,
};
constexpr int32_t kLastWeightFormat = static_cast<int32_t>(WeightFormat::kIq4Xs);

constexpr int kChunk = 16;        // weights of a row a lane reads per step
constexpr int kPackedBlock = 32;  // weights sharing one scale along a row (MX and GGUF)
constexpr int kFp8Tile = 128;     // fp8_block128: rows and columns sharing one scale
constexpr int kSuperBlock = 256;  // K-quants: weights of a row sharing one scale record
constexpr int kQ4KRecord = 16;    // q4_k and q5_k: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and mins
constexpr int kQ5KSuperBytes = 160;  // q5_k data of a super-block: 128 bytes of low nibbles, 32 of high bits
constexpr int kQ6KRecord = 18;    // q6_k and q3_k: f16 d, 16 int8 scales
constexpr int kQ2KRecord = 20;    // q2_k: f16 d, f16 dmin, 16 bytes of 4-bit scale | min << 4
constexpr int kIq4XsRecord = 8;   // iq4_xs: f16 d, u16 of 2-bit high scales, 4 bytes of 4-bit low scales
constexpr int kKMixRecord = 36;   // k_mix: f16 A, f16 B, 16 int8 pairs (a, b)
constexpr int kQ6KSuperBytes = 192;  // q6_k data of a super-block: 128 bytes of low nibbles, 64 of high bits
constexpr int kQ3KSuperBytes = 96;   // q3_k data of a super-block: 64 bytes of low 2 bits, 32 of high bits

// ---------------------------------------------------------------------------------------------
// Loads and conversions
// ---------------------------------------------------------------------------------------------

#if defined(LITHOS_HIP)
typedef uint32_t lithos_u32x2_t __attribute__((ext_vector_type(2)));
#endif

// The host's read of a load below (tests): plain bytes.
template <class T>
LITHOS_DECODE T host_read(const uint8_t* p) {
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
}

LITHOS_DECODE float float_from_bits(uint32_t bits) {
#if defined(LITHOS_DEVICE_PASS)
  return __uint_as_float(bits);
#else
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Weights are read once per step: streaming loads keep them from evicting activations from L1.
LITHOS_DECODE uint2 stream_u2(const uint8_t* p) {
#if !defined(LITHOS_DEVICE_PASS)
  return host_read<uint2>(p);
#elif defined(LITHOS_HIP)
  lithos_u32x2_t v = __builtin_nontemporal_load(reinterpret_cast<const lithos_u32x2_t*>(p));
  return make_uint2(v.x, v.y);
#else
  return __ldcs(reinterpret_cast<const uint2*>(p));
#endif
}

LITHOS_DECODE uint32_t stream_u16(const uint8_t* p) {
#if !defined(LITHOS_DEVICE_PASS)
  return host_read<uint16_t>(p);
#elif defined(LITHOS_HIP)
  return __builtin_nontemporal_load(reinterpret_cast<const uint16_t*>(p));
#else
  return __ldcs(reinterpret_cast<const unsigned short*>(p));
#endif
}

LITHOS_DECODE uint32_t stream_u32(const uint8_t* p) {
#if !defined(LITHOS_DEVICE_PASS)
  return host_read<uint32_t>(p);
#elif defined(LITHOS_HIP)
  return __builtin_nontemporal_load(reinterpret_cast<const uint32_t*>(p));
#else
  return __ldcs(reinterpret_cast<const unsigned int*>(p));
#endif
}

LITHOS_DECODE uint4 stream_u4(const uint8_t* p) {
#if !defined(LITHOS_DEVICE_PASS)
  return host_read<uint4>(p);
#elif defined(LITHOS_HIP)
  u32x4_t v = __builtin_nontemporal_load(reinterpret_cast<const u32x4_t*>(p));
  return make_uint4(v.x, v.y, v.z, v.w);
#else
  return __ldcs(reinterpret_cast<const uint4*>(p));
#endif
}

// Two fp16 bit patterns (element 0 in the low half) to floats.
LITHOS_DECODE float2 half2_bits_to_float2(uint32_t bits) {
  __half2 h;
  memcpy(&h, &bits, sizeof(h));
  return __half22float2(h);
}

// (a - b) per fp16 half, then to floats: exact for the small integers the GGUF decoders form.
LITHOS_DECODE float2 half2_bits_diff(uint32_t a, uint32_t b) {
  __half2 ha, hb;
  memcpy(&ha, &a, sizeof(ha));
  memcpy(&hb, &b, sizeof(hb));
  return __half22float2(__hsub2(ha, hb));
}

// A pair of codes c placed in fp16 1024's mantissa (`codes`: c at bits 0.. of each half), as floats c - OFFSET;
// KEEP_BIAS: as 1024 + c, the subtraction left to the chunk's factors (kBias, debiased): one HADD2 a pair fewer.
template <uint32_t OFFSET, bool KEEP_BIAS = false>
LITHOS_DECODE float2 code_pair(uint32_t codes) {
  if constexpr (KEEP_BIAS) {
    static_assert(OFFSET == 0, "a kept bias is 1024 alone");
    return half2_bits_to_float2(codes | 0x64006400u);
  } else {
    return half2_bits_diff(codes | 0x64006400u, (0x6400u + OFFSET) * 0x00010001u);  // 1024 + OFFSET in both halves
  }
}

LITHOS_DECODE float half_bits_to_float(uint16_t bits) {
  __half h;
  memcpy(&h, &bits, sizeof(h));
  return __half2float(h);
}

// E8M0 scale: 2^(s - 127); 0xFF is NaN (OCP MX). s = 0 is the subnormal 2^-127.
LITHOS_DECODE float e8m0_to_float(uint32_t s) {
  if (s == 0xFFu) return float_from_bits(0x7FC00000u);
  return s == 0 ? float_from_bits(0x00400000u) : float_from_bits(s << 23);
}

// Whether any byte of `w` is an E4M3 NaN code (0x7F or 0xFF): low 7 bits all set.
LITHOS_DECODE uint32_t e4m3_nan_bytes(uint32_t w) {
  return ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

// ---------------------------------------------------------------------------------------------
// One weight row as a kernel sees it, and the per-format decoders
// ---------------------------------------------------------------------------------------------

struct PackedRow {
  const uint8_t* data;    // this row's codes (bf16: its values)
  const uint8_t* scales;  // this row's scales (fp8_block128: the scale row of its 128-row tile)
  const uint8_t* mins;    // q4_1: this row's mins, else unused
};

// What a chunk's sum is multiplied by: acc += (sum(x * code) * kPre) * mul + sum(x) * add.
struct ChunkScale {
  float mul;
  float add;
};

// The factors for codes decoded with the format's kBias added (code + kBias, exact: the decoders of the formats
// with a min leave the f16 magic's 1024 in, one half2 subtraction a pair of weights fewer): sum(x (code + kBias)) =
// sum(x code) + kBias sum(x), so sum(x)'s term gives back kBias kPre mul, once a chunk (NOTES.md, "Codes with their
// half2 bias left in"). Formats with a bias have a min's term (kHasMin): sum(x) is summed for it already.
template <class P>
LITHOS_DECODE ChunkScale debiased(ChunkScale f) {
  static_assert(P::kBias == 0.0f || P::kHasMin, "a bias is taken out through the min's term");
  if (P::kBias != 0.0f) f.add = fmaf(-P::kBias * P::kPre, f.mul, f.add);
  return f;
}

template <WeightFormat F>
struct Packed;

// What the GGUF integer formats share: codes decoded exactly to small integers (plus BIAS: debiased), factors
// applied as they are (no pre-scale), no NaN codes; UNROLL steps of loads in flight.
template <class RawT, bool HAS_MIN, int UNROLL = 4, int BIAS = 0>
struct IntegerChunks {
  using Raw = RawT;
  static constexpr int kUnroll = UNROLL;
  static constexpr float kPre = 1.0f;
  static constexpr float kBias = BIAS;
  static constexpr bool kHasMin = HAS_MIN;
  static constexpr bool kCanBeNaN = false;
};

template <>
struct Packed<WeightFormat::kBf16> {
  struct Raw {
    uint4 lo, hi;
  };
  static constexpr int kUnroll = 1;  // 32 bytes per row per step already
  static constexpr float kPre = 1.0f;
  static constexpr bool kHasMin = false;
  static constexpr float kBias = 0.0f;
  static constexpr bool kCanBeNaN = false;
  __device__ static Raw load(const uint8_t* row, int col) {
    const uint8_t* p = row + static_cast<size_t>(col) * 2;
    return {stream_u4(p), stream_u4(p + 16)};
  }
  __device__ static bool decode(const Raw& r, float (&w)[kChunk]) {
    const uint32_t words[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      w[2 * i] = bf16_pair_at(words[i], 0);
      w[2 * i + 1] = bf16_pair_at(words[i], 1);
    }
    return false;
  }
  __device__ static ChunkScale scale(const PackedRow&, int) { return {1.0f, 0.0f}; }
};

// 4-bit rows: element 2k is the low nibble of byte k, so nibble j of a 32-bit word is element j.
// Elements j and j + 4 of a word share a half2 (their bits are 16 apart, so one mask serves both).
template <class Decode4>
LITHOS_DECODE void decode_nibble_words(const uint2& raw, float (&w)[kChunk], Decode4 pair_of) {
  const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 v = pair_of(words[i] >> (4 * j));
      w[8 * i + j] = v.x;
      w[8 * i + j + 4] = v.y;
    }
}

template <>
struct Packed<WeightFormat::kMxfp4> {
  using Raw = uint2;
  static constexpr int kUnroll = 4;
  static constexpr float kPre = 16384.0f;  // decoded values are v * 2^-14
  static constexpr bool kHasMin = false;
  static constexpr float kBias = 0.0f;
  static constexpr bool kCanBeNaN = false;
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u2(row + col / 2); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_nibble_words(r, w, [](uint32_t t) {
      return half2_bits_to_float2(((t & 0x00070007u) << 9) | ((t & 0x00080008u) << 12));
    });
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return {e8m0_to_float(row.scales[col / kPackedBlock]), 0.0f};
  }
};

template <>
struct Packed<WeightFormat::kQ4_0> : IntegerChunks<uint2, false> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u2(row + col / 2); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_nibble_words(r, w, [](uint32_t t) {
      return code_pair<8>(t & 0x000F000Fu);
    });
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return {half_bits_to_float(reinterpret_cast<const uint16_t*>(row.scales)[col / kPackedBlock]), 0.0f};
  }
};

// byte_perm(a, b, s): byte n of the result is byte (s >> 4n) & 7 of the 8 bytes b:a (CUDA's __byte_perm, HIP's).
LITHOS_DECODE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#if defined(LITHOS_DEVICE_PASS)
  return __byte_perm(a, b, s);
#else
  const uint64_t bytes = static_cast<uint64_t>(b) << 32 | a;
  uint32_t out = 0;
  for (int n = 0; n < 4; ++n) out |= static_cast<uint32_t>(bytes >> (8 * ((s >> (4 * n)) & 7)) & 0xFF) << (8 * n);
  return out;
#endif
}

// IQ4 (IQ4_NL, IQ4_XS): a 4-bit code indexes llama.cpp's 16 int8 values (kvalues_iq4nl, lithos.quant IQ4_VALUES),
// held here as bytes value + 128 in four words and looked up four codes at a time by byte permutes.
constexpr uint32_t kIq4Values0 = 0x3F2D1801u, kIq4Values1 = 0x766A5D4Fu;  // codes 0..7: -127 .. -10
constexpr uint32_t kIq4Values2 = 0xA6998D81u, kIq4Values3 = 0xF1D9C5B5u;  // codes 8..15: 1 .. 113

// The table bytes of the codes in the low nibbles of `word`'s four bytes.
LITHOS_DECODE uint32_t iq4_lookup(uint32_t word) {
  const uint32_t low3 = word & 0x07070707u;
  const uint32_t nibbles = low3 | low3 >> 4;  // bytes 0, 1 as nibbles 0, 1 of bits 0..7; bytes 2, 3 of bits 16..23
  const uint32_t select = (nibbles & 0xFFu) | ((nibbles >> 8) & 0xFF00u);
  const uint32_t negative = byte_perm(kIq4Values0, kIq4Values1, select);
  const uint32_t positive = byte_perm(kIq4Values2, kIq4Values3, select);
  const uint32_t high = ((word >> 3) & 0x01010101u) * 0xFFu;  // code >= 8
  return (negative & ~high) | (positive & high);
}

// The chunk's IQ4 values as floats: elements 2k and 2k + 1 of a word are byte k's low and high nibbles, so a
// lookup of each nibble plane gives four values, two of them a half2 (bytes 0 and 2, or 1 and 3).
LITHOS_DECODE void decode_iq4_chunk(const uint2& raw, float (&w)[kChunk]) {
  const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t even = iq4_lookup(words[i]), odd = iq4_lookup(words[i] >> 4);
    const uint32_t pairs[4] = {even, odd, even >> 8, odd >> 8};  // elements (0, 4), (1, 5), (2, 6), (3, 7)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 v = code_pair<128>(pairs[j] & 0x00FF00FFu);  // table bytes b: b - 128
      w[8 * i + j] = v.x;
      w[8 * i + j + 4] = v.y;
    }
  }
}

// IQ4_NL: w = d * value[c], d one f16 per block of 32 (Q4_0's planes).
template <>
struct Packed<WeightFormat::kIq4Nl> : IntegerChunks<uint2, false> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u2(row + col / 2); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_iq4_chunk(r, w);
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return Packed<WeightFormat::kQ4_0>::scale(row, col);
  }
};

// IQ4_XS: w = (d * (sc_j - 32)) * value[c] for sub-block j (32 weights) of a super-block, its 6-bit scale's top 2
// bits at bits 2j of the record's u16 and its low 4 in the nibble j % 2 of byte j / 2 after it.
template <>
struct Packed<WeightFormat::kIq4Xs> : IntegerChunks<uint2, false> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u2(row + col / 2); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_iq4_chunk(r, w);
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    const uint32_t* record = reinterpret_cast<const uint32_t*>(row.scales + (col / kSuperBlock) * kIq4XsRecord);
    return factor(record[0], record[1], (col % kSuperBlock) / kPackedBlock);
  }
  // d (sc_j - 32) from the record's two words: f16 d and the top bits (j at bits 16 + 2j), the low nibbles (j at
  // bits 4j). Also the lane ring's (mk_lane_ring.h).
  LITHOS_DECODE static ChunkScale factor(uint32_t d_high, uint32_t low, int j) {
    const int sc = static_cast<int>((low >> (4 * j) & 0xF) | ((d_high >> (16 + 2 * j) & 3) << 4)) - 32;
    return {half_bits_to_float(static_cast<uint16_t>(d_high)) * static_cast<float>(sc), 0.0f};
  }
};

// The bias the decoders of formats with a min's term leave in their codes (code_pair's KEEP_BIAS), taken out by
// debiased: Q4_1, Q4_K, Q5_1, Q5_K, Q2_K, K_MIX.
constexpr int kKeptBias = 1024;

// Unsigned 4-bit codes c as floats 1024 + c (Q4_1, Q4_K).
LITHOS_DECODE void decode_uint4_chunk(const uint2& raw, float (&w)[kChunk]) {
  decode_nibble_words(raw, w, [](uint32_t t) { return code_pair<0, true>(t & 0x000F000Fu); });
}

template <>
struct Packed<WeightFormat::kQ4_1> : IntegerChunks<uint2, true, 4, kKeptBias> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u2(row + col / 2); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_uint4_chunk(r, w);
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    const int block = col / kPackedBlock;
    return {half_bits_to_float(reinterpret_cast<const uint16_t*>(row.scales)[block]),
            half_bits_to_float(reinterpret_cast<const uint16_t*>(row.mins)[block])};
  }
};

// Q4_K (and Q5_K, whose pairs lie otherwise: below): w = (d * sc_j) * c - dmin * m_j for sub-block j (32 weights)
// of a super-block, its 6-bit scale and min read from the record's four words (f16 d and dmin, then 12 bytes q) as
// llama.cpp's get_scale_min_k4 does: sub-blocks 0..3 in the low 6 bits of q bytes 0..3 (scales) and 4..7 (mins),
// 4..7 in the nibbles of q bytes 8..11 with their top bits in the top bits of q bytes 0..7. Shifts by j, no byte
// indexing: the lane ring (mk_lane_ring.h) holds the record in registers.
LITHOS_DECODE ChunkScale k_record_scale(uint32_t d_dmin, uint32_t q0, uint32_t q1, uint32_t q2, int j) {
  const int shift = 8 * (j & 3);
  const uint32_t s = q0 >> shift, m = q1 >> shift;
  uint32_t scale, min;
  if (j < 4) {
    scale = s & 63;
    min = m & 63;
  } else {
    const uint32_t low = q2 >> shift;
    scale = (low & 0xF) | ((s >> 6 & 3) << 4);
    min = (low >> 4 & 0xF) | ((m >> 6 & 3) << 4);
  }
  return {half_bits_to_float(static_cast<uint16_t>(d_dmin)) * static_cast<float>(scale),
          -(half_bits_to_float(static_cast<uint16_t>(d_dmin >> 16)) * static_cast<float>(min))};
}

// A Q4_K super-block's 16-byte record in one load (16-byte aligned: records are 16 bytes, the planes 16-byte
// aligned), where reading it word by word took three or four loads a chunk (NOTES.md, "Q4_K's scale records in one
// load"). A record is read by the 16 lanes of its super-block's chunks: cached, not streamed.
LITHOS_DECODE uint4 load_record(const uint8_t* p) {
#if defined(LITHOS_DEVICE_PASS)
  return *reinterpret_cast<const uint4*>(p);
#else
  return host_read<uint4>(p);
#endif
}

// The factors of the chunk at `col` of a Q4_K row.
LITHOS_DECODE ChunkScale k_sub_block_scale(const PackedRow& row, int col) {
  const uint4 record = load_record(row.scales + (col / kSuperBlock) * kQ4KRecord);
  return k_record_scale(record.x, record.y, record.z, record.w, (col % kSuperBlock) / kPackedBlock);
}

template <>
struct Packed<WeightFormat::kQ4_K> : IntegerChunks<uint2, true, 4, kKeptBias> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u2(row + col / 2); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_uint4_chunk(r, w);
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) { return k_sub_block_scale(row, col); }
};

// 6-bit rows (Q6_K, K_MIX): per super-block, 128 bytes of low nibbles, then 64 of high 2 bits. A chunk is 8
// bytes of low nibbles and the 4 bytes holding its 16 codes' high bits (element e at bits 2e).
struct Raw6 {
  uint2 low;
  uint32_t high;
};

LITHOS_DECODE Raw6 load_6bit_chunk(const uint8_t* row, int col) {
  const uint8_t* super = row + (col / kSuperBlock) * kQ6KSuperBytes;
  const int at = col % kSuperBlock;
  return {stream_u2(super + at / 2), stream_u32(super + kSuperBlock / 2 + at / 4)};
}

// The chunk's codes c minus OFFSET (32 for Q6_K) as floats, or 1024 + c (KEEP_BIAS: K_MIX), pairs as in
// decode_nibble_words.
template <uint32_t OFFSET, bool KEEP_BIAS = false>
LITHOS_DECODE void decode_6bit_chunk(const Raw6& r, float (&w)[kChunk]) {
  const uint32_t words[2] = {r.low.x, r.low.y};
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // elements 8i + j and 8i + j + 4
      const uint32_t low = (words[i] >> (4 * j)) & 0x000F000Fu;
      const uint32_t high = r.high >> (16 * i + 2 * j);  // element 8i + j's bits at 0..1, 8i + j + 4's at 8..9
      const float2 v = code_pair<OFFSET, KEEP_BIAS>(low | ((high & 0x3u) << 4) | ((high & 0x300u) << 12));
      w[8 * i + j] = v.x;
      w[8 * i + j + 4] = v.y;
    }
}

// Q6_K: w = (d * sc_i) * (c - 32) for a 6-bit code c and the int8 scale of its 16 weights.
template <>
struct Packed<WeightFormat::kQ6_K> : IntegerChunks<Raw6, false> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return load_6bit_chunk(row, col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_6bit_chunk<32>(r, w);
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    const uint8_t* record = row.scales + (col / kSuperBlock) * kQ6KRecord;
    const int8_t sc = static_cast<int8_t>(record[2 + (col % kSuperBlock) / 16]);
    return factor(*reinterpret_cast<const uint16_t*>(record), sc);
  }
  // d * sc from the record's f16 d and a 16-weight run's int8 scale (also the lane ring's, mk_lane_ring.h).
  LITHOS_DECODE static ChunkScale factor(uint16_t d, int8_t sc) {
    return {half_bits_to_float(d) * static_cast<float>(sc), 0.0f};
  }
};

// The 16 2-bit codes of a word (element e at bits 2e) as floats less OFFSET, or 1024 + c (KEEP_BIAS), pairs (e,
// e + 8) a half2; `high(e)` places the third bit of the pair (Q3_K's, at bits 2 and 18) or 0.
template <uint32_t OFFSET, bool KEEP_BIAS, class High>
LITHOS_DECODE void decode_2bit_word(uint32_t low, float (&w)[kChunk], High high) {
#pragma unroll
  for (int e = 0; e < kChunk / 2; ++e) {
    const float2 v = code_pair<OFFSET, KEEP_BIAS>(((low >> (2 * e)) & 0x00030003u) | high(e));
    w[e] = v.x;
    w[e + 8] = v.y;
  }
}

// Q2_K: w = (d * sc_i) * c - dmin * m_i for a 2-bit code c (element 4k + i of a row at bits 2i of byte k) and the
// 4-bit scale and min of its 16 weights.
template <>
struct Packed<WeightFormat::kQ2_K> : IntegerChunks<uint32_t, true, 4, kKeptBias> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u32(row + col / 4); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_2bit_word<0, kBias != 0>(r, w, [](int) { return 0u; });
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    const uint8_t* record = row.scales + (col / kSuperBlock) * kQ2KRecord;
    const uint32_t pair = record[4 + (col % kSuperBlock) / 16];
    const uint16_t* factors = reinterpret_cast<const uint16_t*>(record);
    return {half_bits_to_float(factors[0]) * static_cast<float>(pair & 0xF),
            -(half_bits_to_float(factors[1]) * static_cast<float>(pair >> 4))};
  }
};

// 3-bit rows (Q3_K): per super-block, 64 bytes of low 2 bits (element 4k + i at bits 2i of byte k), then 32 of high
// bits (element i at bit i). A chunk is the word of its 16 codes' low bits and the 2 bytes of their high bits.
struct Raw3 {
  uint32_t low;
  uint32_t high;
};

LITHOS_DECODE Raw3 load_3bit_chunk(const uint8_t* row, int col) {
  const uint8_t* super = row + (col / kSuperBlock) * kQ3KSuperBytes;
  const int at = col % kSuperBlock;
  return {stream_u32(super + at / 4), stream_u16(super + kSuperBlock / 4 + at / 8)};
}

// Q3_K: w = (d * s_i) * (c - 4) for a 3-bit code c and the int8 scale of its 16 weights (GGUF's 6-bit scale less
// 32): Q6_K's record.
template <>
struct Packed<WeightFormat::kQ3_K> : IntegerChunks<Raw3, false> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return load_3bit_chunk(row, col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_2bit_word<4, false>(r.low, w, [&](int e) {
      const uint32_t high = r.high >> e;  // element e's bit at 0, e + 8's at 8
      return ((high & 0x1u) << 2) | ((high & 0x100u) << 10);
    });
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return Packed<WeightFormat::kQ6_K>::scale(row, col);
  }
};

// K_MIX (a stack of K-quant layers of mixed types, lithos.quant.formats): w = (A * a_i) * c + B * b_i for the
// int8 pair (a_i, b_i) of its 16 weights.
template <>
struct Packed<WeightFormat::kKMix> : IntegerChunks<Raw6, true, 4, kKeptBias> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return load_6bit_chunk(row, col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_6bit_chunk<0, kBias != 0>(r, w);
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    const uint8_t* record = row.scales + (col / kSuperBlock) * kKMixRecord;
    const uint8_t* pair = record + 4 + 2 * ((col % kSuperBlock) / 16);
    return factor(*reinterpret_cast<const uint32_t*>(record), pair[0] | pair[1] << 8);
  }
  // The factors from the record's f16 A and B (`ab`: A in the low half) and a run's pair (a_i in the low byte);
  // also the lane ring's (mk_lane_ring.h).
  LITHOS_DECODE static ChunkScale factor(uint32_t ab, uint32_t pair) {
    const float a = static_cast<int8_t>(pair), b = static_cast<int8_t>(pair >> 8);
    return {half_bits_to_float(static_cast<uint16_t>(ab)) * a, half_bits_to_float(static_cast<uint16_t>(ab >> 16)) * b};
  }
};

// 5-bit rows, laid out per GROUP weights (32: Q5_0, Q5_1; 256: Q5_K): the group's low nibbles, then its high
// bits (element i at bit i). A chunk is 8 bytes of low nibbles (two 4-byte loads: a 32-weight group is 20
// bytes, so 8-byte alignment is not given) and the 2 bytes of its 16 high bits.
struct Raw5 {
  uint2 low;
  uint32_t high;
};

template <int GROUP>
LITHOS_DECODE Raw5 load_5bit_chunk(const uint8_t* row, int col) {
  const uint8_t* group = row + (col / GROUP) * (GROUP * 5 / 8);
  const int at = col % GROUP;
  const uint2 low = make_uint2(stream_u32(group + at / 2), stream_u32(group + at / 2 + 4));
  return {low, stream_u16(group + GROUP / 2 + at / 8)};
}

// The chunk's codes c minus OFFSET (16 for Q5_0) as floats, or 1024 + c (KEEP_BIAS: Q5_1, Q5_K), pairs as in
// decode_nibble_words.
template <uint32_t OFFSET, bool KEEP_BIAS = false>
LITHOS_DECODE void decode_5bit_chunk(const Raw5& r, float (&w)[kChunk]) {
  const uint32_t words[2] = {r.low.x, r.low.y};
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t low = (words[i] >> (4 * j)) & 0x000F000Fu;
      const uint32_t high = r.high >> (8 * i + j);  // element 8i + j's bit at 0, 8i + j + 4's at 4
      const float2 v = code_pair<OFFSET, KEEP_BIAS>(low | ((high & 0x1u) << 4) | ((high & 0x10u) << 16));
      w[8 * i + j] = v.x;
      w[8 * i + j + 4] = v.y;
    }
}

// Q5_0: w = d * (c - 16).
template <>
struct Packed<WeightFormat::kQ5_0> : IntegerChunks<Raw5, false> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return load_5bit_chunk<kPackedBlock>(row, col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_5bit_chunk<16>(r, w);
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return Packed<WeightFormat::kQ4_0>::scale(row, col);
  }
};

// Q5_1: w = d * c + m.
template <>
struct Packed<WeightFormat::kQ5_1> : IntegerChunks<Raw5, true, 4, kKeptBias> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return load_5bit_chunk<kPackedBlock>(row, col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_5bit_chunk<0, kBias != 0>(r, w);
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return Packed<WeightFormat::kQ4_1>::scale(row, col);
  }
};

// Q5_K: Q4_K's factors over 5-bit codes, sub-block j's 6-bit scale and min as the 12-bit pair scale | min << 6 at
// bit 12j of the record's words 1..3 (lithos.quant.formats re-packs GGUF's), so that one pair lies in two adjacent
// words: 1 and 2 for j < 4, else 2 and 3 (pair_word's).
template <>
struct Packed<WeightFormat::kQ5_K> : IntegerChunks<Raw5, true, 4, kKeptBias> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return load_5bit_chunk<kSuperBlock>(row, col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    decode_5bit_chunk<0, kBias != 0>(r, w);
    return false;
  }
  // The first of the two record words holding sub-block j's pair.
  LITHOS_DECODE static int pair_word(int j) { return j < 4 ? 1 : 2; }
  // The factors from the record's first word (f16 d and dmin) and words pair_word(j), pair_word(j) + 1.
  LITHOS_DECODE static ChunkScale factor(uint32_t d_dmin, uint32_t low, uint32_t high, int j) {
    const uint64_t words = static_cast<uint64_t>(high) << 32 | low;
    const uint32_t pair = static_cast<uint32_t>(words >> (12 * j - 32 * (pair_word(j) - 1))) & 0xFFF;
    return {half_bits_to_float(static_cast<uint16_t>(d_dmin)) * static_cast<float>(pair & 63),
            -(half_bits_to_float(static_cast<uint16_t>(d_dmin >> 16)) * static_cast<float>(pair >> 6))};
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    const uint32_t* record = reinterpret_cast<const uint32_t*>(row.scales + (col / kSuperBlock) * kQ4KRecord);
    const int j = (col % kSuperBlock) / kPackedBlock, at = pair_word(j);
    return factor(record[0], record[at], record[at + 1], j);
  }
};

// 8-bit rows: bytes 0 and 2 of a word share a half2, and bytes 1 and 3.
template <class Decode8>
LITHOS_DECODE void decode_byte_words(const uint4& raw, float (&w)[kChunk], Decode8 pairs_of) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 even, odd;
    pairs_of(words[i], even, odd);
    w[4 * i] = even.x;
    w[4 * i + 2] = even.y;
    w[4 * i + 1] = odd.x;
    w[4 * i + 3] = odd.y;
  }
}

// E4M3 bytes to fp16 patterns: sign to bit 15, the 7 magnitude bits to 7..13 (v * 2^-8).
LITHOS_DECODE bool decode_e4m3_chunk(const uint4& raw, float (&w)[kChunk]) {
  decode_byte_words(raw, w, [](uint32_t b, float2& even, float2& odd) {
    even = half2_bits_to_float2(((b & 0x007F007Fu) << 7) | ((b & 0x00800080u) << 8));
    odd = half2_bits_to_float2(((b >> 1) & 0x3F803F80u) | (b & 0x80008000u));
  });
  return (e4m3_nan_bytes(raw.x) | e4m3_nan_bytes(raw.y) | e4m3_nan_bytes(raw.z) | e4m3_nan_bytes(raw.w)) != 0;
}

template <>
struct Packed<WeightFormat::kMxfp8> {
  using Raw = uint4;
  static constexpr int kUnroll = 2;
  static constexpr float kPre = 256.0f;  // decoded values are v * 2^-8
  static constexpr bool kHasMin = false;
  static constexpr float kBias = 0.0f;
  static constexpr bool kCanBeNaN = true;
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u4(row + col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) { return decode_e4m3_chunk(r, w); }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return {e8m0_to_float(row.scales[col / kPackedBlock]), 0.0f};
  }
};

template <>
struct Packed<WeightFormat::kFp8Block128> {
  using Raw = uint4;
  static constexpr int kUnroll = 2;
  static constexpr float kPre = 256.0f;
  static constexpr bool kHasMin = false;
  static constexpr float kBias = 0.0f;
  static constexpr bool kCanBeNaN = true;
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u4(row + col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) { return decode_e4m3_chunk(r, w); }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return {reinterpret_cast<const float*>(row.scales)[col / kFp8Tile], 0.0f};
  }
};

template <>
struct Packed<WeightFormat::kQ8_0> : IntegerChunks<uint4, false, 2> {
  LITHOS_DECODE static Raw load(const uint8_t* row, int col) { return stream_u4(row + col); }
  LITHOS_DECODE static bool decode(const Raw& r, float (&w)[kChunk]) {
    // int8 c -> c + 128 (its sign bit flipped), less 128.
    decode_byte_words(r, w, [](uint32_t b, float2& even, float2& odd) {
      even = code_pair<128>((b & 0x00FF00FFu) ^ 0x00800080u);
      odd = code_pair<128>(((b >> 8) & 0x00FF00FFu) ^ 0x00800080u);
    });
    return false;
  }
  LITHOS_DECODE static ChunkScale scale(const PackedRow& row, int col) {
    return {half_bits_to_float(reinterpret_cast<const uint16_t*>(row.scales)[col / kPackedBlock]), 0.0f};
  }
};

}  // namespace lithos
