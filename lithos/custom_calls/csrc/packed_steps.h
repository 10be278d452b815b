// The megakernel lane ring's steps over packed rows (mk_lane_ring.h): what a one-token step of 32 codes copies of a
// row in each format that the ring reads, and its dot product. Host and device code, as the decoders'
// (packed_decode.h): tests/test_packed_host.py runs the steps on the CPU.
#pragma once

#include "packed_decode.h"

namespace lithos {

// At one token the megakernel streams rows of these formats through shared memory: a lane's step is 16 bytes of
// codes (32 of them) and a "side" of kSideBytes beside them, the bytes of the scales the step needs, copied whole
// from the aligned pieces `side_pieces` names, in order. `dot` multiplies one row's step (its codes and side, read
// back) with 32 inputs xf (x_sums: the sums of their two halves of 16, for the formats with an offset) and adds it
// to `acc`.
struct SidePiece {
  const uint8_t* from;  // 16 or 8 aligned bytes; for 4, the aligned word holding this byte
  int bytes;
};

template <WeightFormat F>
struct Step32 {
  static constexpr int kSideBytes = 0;  // no steps of 32 (bf16 and the formats the ring does not read)
};

// The sums of the 16 codes of each half of a step's 32 (decode(h, w) gives half h's) times the inputs.
template <class Decode>
LITHOS_DECODE void half_dots(const float (&xf)[32], float (&sums)[2], Decode decode) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float w[kChunk];
    decode(h, w);
    float even = 0.0f, odd = 0.0f;  // two chains: half the dependent-FMA latency
#pragma unroll
    for (int v = 0; v < kChunk; v += 2) {
      even = fmaf(w[v], xf[h * kChunk + v], even);
      odd = fmaf(w[v + 1], xf[h * kChunk + v + 1], odd);
    }
    sums[h] = even + odd;
  }
}

// MXFP4: an MX block of 32 codes; the side is the aligned word holding its E8M0 scale.
template <>
struct Step32<WeightFormat::kMxfp4> {
  static constexpr int kSideBytes = 4, kPieces = 1;
  using Side = uint32_t;
  using P = Packed<WeightFormat::kMxfp4>;
  LITHOS_DECODE static const uint8_t* codes(const uint8_t* row, int k) { return row + k / 2; }
  LITHOS_DECODE static const uint8_t* scale(const uint8_t* scales, int k) { return scales + k / kPackedBlock; }
  LITHOS_DECODE static void side_pieces(const uint8_t*, const uint8_t* scales, int k, SidePiece (&pieces)[kPieces]) {
    pieces[0] = {scale(scales, k), 4};
  }
  LITHOS_DECODE static float dot(const uint4& codes, Side word, const PackedRow& row, int k, const float (&xf)[32],
                                 const float (&)[2], float acc) {
    const uint2 halves[2] = {make_uint2(codes.x, codes.y), make_uint2(codes.z, codes.w)};
    float even = 0.0f, odd = 0.0f;  // one pair of chains over the block: its one scale
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float w[kChunk];
      P::decode(halves[h], w);
#pragma unroll
      for (int v = 0; v < kChunk; v += 2) {
        even = fmaf(w[v], xf[h * kChunk + v], even);
        odd = fmaf(w[v + 1], xf[h * kChunk + v + 1], odd);
      }
    }
    const uint32_t byte = (word >> (8 * (reinterpret_cast<uintptr_t>(scale(row.scales, k)) & 3u))) & 0xFFu;
    return fmaf((even + odd) * P::kPre, e8m0_to_float(byte), acc);
  }
};

// Q4_K: a sub-block (32 codes, one scale and min); the side is its super-block's 16-byte record.
template <>
struct Step32<WeightFormat::kQ4_K> {
  static constexpr int kSideBytes = 16, kPieces = 1;
  using Side = uint4;
  using P = Packed<WeightFormat::kQ4_K>;
  LITHOS_DECODE static const uint8_t* codes(const uint8_t* row, int k) { return row + k / 2; }
  LITHOS_DECODE static void side_pieces(const uint8_t*, const uint8_t* scales, int k, SidePiece (&pieces)[kPieces]) {
    pieces[0] = {scales + (k / kSuperBlock) * kQ4KRecord, 16};  // records are 16 bytes: aligned
  }
  LITHOS_DECODE static float dot(const uint4& codes, const Side& record, const PackedRow&, int k,
                                 const float (&xf)[32], const float (&x_sums)[2], float acc) {
    float sums[2];
    half_dots(xf, sums, [&](int h, float(&w)[kChunk]) {
      P::decode(h == 0 ? make_uint2(codes.x, codes.y) : make_uint2(codes.z, codes.w), w);
    });
    const ChunkScale f =
        debiased<P>(k_record_scale(record.x, record.y, record.z, record.w, (k % kSuperBlock) / kPackedBlock));
    return fmaf(x_sums[0] + x_sums[1], f.add, fmaf(sums[0] + sums[1], f.mul, acc));
  }
};

// Q5_K: a sub-block's low nibbles (32 codes); the side is their 4 bytes of high bits (x), the record's word of f16 d
// and dmin (y) and the two words holding the sub-block's pair (z, w). 4-byte pieces, each aligned: a super-block's
// data is 160 bytes, its record 16.
template <>
struct Step32<WeightFormat::kQ5_K> {
  static constexpr int kSideBytes = 16, kPieces = 4;
  using Side = uint4;
  using P = Packed<WeightFormat::kQ5_K>;
  LITHOS_DECODE static const uint8_t* super_block(const uint8_t* row, int k) {
    return row + (k / kSuperBlock) * kQ5KSuperBytes;
  }
  LITHOS_DECODE static const uint8_t* codes(const uint8_t* row, int k) {
    return super_block(row, k) + (k % kSuperBlock) / 2;
  }
  LITHOS_DECODE static void side_pieces(const uint8_t* row, const uint8_t* scales, int k,
                                        SidePiece (&pieces)[kPieces]) {
    const uint8_t* record = scales + (k / kSuperBlock) * kQ4KRecord;
    const int at = 4 * P::pair_word((k % kSuperBlock) / kPackedBlock);
    pieces[0] = {super_block(row, k) + kSuperBlock / 2 + (k % kSuperBlock) / 8, 4};
    pieces[1] = {record, 4};
    pieces[2] = {record + at, 4};
    pieces[3] = {record + at + 4, 4};
  }
  LITHOS_DECODE static float dot(const uint4& codes, const Side& side, const PackedRow&, int k, const float (&xf)[32],
                                 const float (&x_sums)[2], float acc) {
    float sums[2];
    half_dots(xf, sums, [&](int h, float(&w)[kChunk]) {
      P::decode(h == 0 ? Raw5{make_uint2(codes.x, codes.y), side.x} : Raw5{make_uint2(codes.z, codes.w), side.x >> 16},
                w);
    });
    const ChunkScale f = debiased<P>(P::factor(side.y, side.z, side.w, (k % kSuperBlock) / kPackedBlock));
    return fmaf(x_sums[0] + x_sums[1], f.add, fmaf(sums[0] + sums[1], f.mul, acc));
  }
};

// The IQ4 formats: a block (sub-block) of 32 codes; the side is IQ4_NL's aligned word holding the block's f16 d (the
// block's address says which half), IQ4_XS's super-block's 8-byte record (in a 16-byte side).
template <WeightFormat F>
struct Iq4Step {
  using P = Packed<F>;
  LITHOS_DECODE static const uint8_t* codes(const uint8_t* row, int k) { return row + k / 2; }
  LITHOS_DECODE static float sum(const uint4& codes, const float (&xf)[32]) {
    float sums[2];
    half_dots(xf, sums, [&](int h, float(&w)[kChunk]) {
      decode_iq4_chunk(h == 0 ? make_uint2(codes.x, codes.y) : make_uint2(codes.z, codes.w), w);
    });
    return sums[0] + sums[1];
  }
};

template <>
struct Step32<WeightFormat::kIq4Nl> : Iq4Step<WeightFormat::kIq4Nl> {
  static constexpr int kSideBytes = 4, kPieces = 1;
  using Side = uint32_t;
  LITHOS_DECODE static const uint8_t* scale(const uint8_t* scales, int k) { return scales + 2 * (k / kPackedBlock); }
  LITHOS_DECODE static void side_pieces(const uint8_t*, const uint8_t* scales, int k, SidePiece (&pieces)[kPieces]) {
    pieces[0] = {scale(scales, k), 4};
  }
  LITHOS_DECODE static float dot(const uint4& codes, Side word, const PackedRow& row, int k, const float (&xf)[32],
                                 const float (&)[2], float acc) {
    const uint32_t d = word >> (8 * (reinterpret_cast<uintptr_t>(scale(row.scales, k)) & 3u));
    return fmaf(sum(codes, xf), half_bits_to_float(static_cast<uint16_t>(d)), acc);
  }
};

template <>
struct Step32<WeightFormat::kIq4Xs> : Iq4Step<WeightFormat::kIq4Xs> {
  static constexpr int kSideBytes = 16, kPieces = 1;
  using Side = uint4;
  LITHOS_DECODE static void side_pieces(const uint8_t*, const uint8_t* scales, int k, SidePiece (&pieces)[kPieces]) {
    pieces[0] = {scales + (k / kSuperBlock) * kIq4XsRecord, 8};  // records are 8 bytes: aligned
  }
  LITHOS_DECODE static float dot(const uint4& codes, const Side& record, const PackedRow&, int k,
                                 const float (&xf)[32], const float (&)[2], float acc) {
    const ChunkScale f = Packed<WeightFormat::kIq4Xs>::factor(record.x, record.y, (k % kSuperBlock) / kPackedBlock);
    return fmaf(sum(codes, xf), f.mul, acc);
  }
};

// The 6-bit formats (Q6_K, K_MIX): the low nibbles of 32 codes; the side is their 8 bytes of high bits (x, y) and
// two words of the record (z, w: RECORD bytes a super-block; which, the format says).
template <WeightFormat F, int RECORD>
struct SixBitStep {
  static constexpr int kSideBytes = 16, kPieces = 3;
  using Side = uint4;
  using P = Packed<F>;
  LITHOS_DECODE static const uint8_t* super_block(const uint8_t* row, int k) {
    return row + (k / kSuperBlock) * kQ6KSuperBytes;
  }
  LITHOS_DECODE static const uint8_t* record(const uint8_t* scales, int k) {
    return scales + (k / kSuperBlock) * RECORD;
  }
  LITHOS_DECODE static const uint8_t* codes(const uint8_t* row, int k) {
    return super_block(row, k) + (k % kSuperBlock) / 2;
  }
  LITHOS_DECODE static SidePiece high_bits(const uint8_t* row, int k) {
    return {super_block(row, k) + kSuperBlock / 2 + (k % kSuperBlock) / 4, 8};
  }
  LITHOS_DECODE static void half_dots(const uint4& codes, const Side& side, const float (&xf)[32], float (&sums)[2]) {
    lithos::half_dots(xf, sums, [&](int h, float(&w)[kChunk]) {
      P::decode(h == 0 ? Raw6{make_uint2(codes.x, codes.y), side.x} : Raw6{make_uint2(codes.z, codes.w), side.y}, w);
    });
  }
};

// Q6_K: the record's words holding f16 d (z) and the 32 codes' two int8 scales (w). Its 18-byte records are only
// 2-aligned, so where in each word they lie is the record's address's to say.
template <>
struct Step32<WeightFormat::kQ6_K> : SixBitStep<WeightFormat::kQ6_K, kQ6KRecord> {
  LITHOS_DECODE static const uint8_t* scale_pair(const uint8_t* scales, int k) {
    return record(scales, k) + 2 + (k % kSuperBlock) / 16;  // an even byte: both scales in one word
  }
  LITHOS_DECODE static void side_pieces(const uint8_t* row, const uint8_t* scales, int k,
                                        SidePiece (&pieces)[kPieces]) {
    pieces[0] = high_bits(row, k);
    pieces[1] = {record(scales, k), 4};
    pieces[2] = {scale_pair(scales, k), 4};
  }
  LITHOS_DECODE static float dot(const uint4& codes, const Side& side, const PackedRow& row, int k,
                                 const float (&xf)[32], const float (&)[2], float acc) {
    float sums[2];
    half_dots(codes, side, xf, sums);
    const uint32_t d = side.z >> (8 * (reinterpret_cast<uintptr_t>(record(row.scales, k)) & 3u));
    const uint32_t scales = side.w >> (8 * (reinterpret_cast<uintptr_t>(scale_pair(row.scales, k)) & 3u));
    const ChunkScale f0 = P::factor(static_cast<uint16_t>(d), static_cast<int8_t>(scales));
    const ChunkScale f1 = P::factor(static_cast<uint16_t>(d), static_cast<int8_t>(scales >> 8));
    return fmaf(sums[1], f1.mul, fmaf(sums[0], f0.mul, acc));
  }
};

// K_MIX: the record's first word (f16 A and B, z) and the one holding the 32 codes' two (a_i, b_i) pairs (w).
template <>
struct Step32<WeightFormat::kKMix> : SixBitStep<WeightFormat::kKMix, kKMixRecord> {
  LITHOS_DECODE static void side_pieces(const uint8_t* row, const uint8_t* scales, int k,
                                        SidePiece (&pieces)[kPieces]) {
    pieces[0] = high_bits(row, k);
    pieces[1] = {record(scales, k), 4};  // 36-byte records: aligned words
    pieces[2] = {record(scales, k) + 4 + 2 * ((k % kSuperBlock) / 16), 4};
  }
  LITHOS_DECODE static float dot(const uint4& codes, const Side& side, const PackedRow&, int, const float (&xf)[32],
                                 const float (&x_sums)[2], float acc) {
    float sums[2];
    half_dots(codes, side, xf, sums);
    const ChunkScale f0 = debiased<P>(P::factor(side.z, side.w)), f1 = debiased<P>(P::factor(side.z, side.w >> 16));
    acc = fmaf(x_sums[0], f0.add, fmaf(sums[0], f0.mul, acc));
    return fmaf(x_sums[1], f1.add, fmaf(sums[1], f1.mul, acc));
  }
};

}  // namespace lithos
