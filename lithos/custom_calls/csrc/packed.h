// Batch-1 dot products over packed low-precision weights (lithos.quant formats), dequantised in
// registers and accumulated in float32: the building block of matvec_packed.cu and expert_matvec.cu.
//
// A warp owns kRowsPerWarp weight rows; a lane reads kChunk = 16 consecutive weights of each row per
// step (8 bytes of a 4-bit row, 16 of an 8-bit one, 32 of bf16), so a warp reads each row
// contiguously and every weight byte once for all tokens. Every block of 32 weights shares one scale,
// so a chunk needs one scale per row: the lane sums x * code over its 16 weights, then applies the
// block's scale (and Q4_1's min) once. That is the reference's arithmetic reordered: the scales
// are powers of two (MX) or exact factors of every weight of the block.
//
// The formats' decoders are packed_decode.h's, the megakernel ring's steps packed_steps.h's; here are the dot
// products and row-group loops on them, and the host side's checks of a weight's planes against its format.
#pragma once

#include <cstdint>
#include <string>

#include "ffi_util.h"
#include "packed_steps.h"
#include "portable.h"
#include "rowdot.h"

namespace lithos {

// ---------------------------------------------------------------------------------------------
// A weight matrix (one layer, or one expert of one layer) and its rows
// ---------------------------------------------------------------------------------------------

// Planes of a weight stacked [outer, inner, ...] (outer: layers; inner: experts, or 1), as bytes.
struct PackedWeight {
  const uint8_t* data;
  const uint8_t* scales;
  const uint8_t* mins;
  int64_t data_outer, data_inner;    // bytes between layers / experts (0: shared)
  int64_t scale_outer, scale_inner;  // same for scales and mins
  int64_t row_bytes;                 // data bytes per row
  int64_t scale_row_bytes;           // bytes per scale row (a row of 128-row tiles for fp8_block128)
  int n_out, n_in;
  WeightFormat format;
};

template <WeightFormat F>
__device__ __forceinline__ PackedRow packed_row(const PackedWeight& w, int64_t outer, int64_t inner, int row) {
  const int scale_row = F == WeightFormat::kFp8Block128 ? row / kFp8Tile : row;
  const int64_t scale_at = outer * w.scale_outer + inner * w.scale_inner + scale_row * w.scale_row_bytes;
  return {w.data + outer * w.data_outer + inner * w.data_inner + row * w.row_bytes, w.scales + scale_at,
          w.mins == nullptr ? nullptr : w.mins + scale_at};
}

// ---------------------------------------------------------------------------------------------
// The warp's dot products and the row-group loop
// ---------------------------------------------------------------------------------------------

// acc[r][t] = sum over this warp's share of i of W_r[i] * x[t, i] * norm_w[i] (the share: chunks
// part, part + parts, ...); every lane ends with every sum. n_in is a multiple of kChunk. COHERENT:
// x was written earlier in the same launch (the megakernel; rowdot.h load_activation). UNROLL: steps
// of loads in flight per row and lane.
template <WeightFormat F, int TMAX, bool COHERENT = false, int UNROLL = Packed<F>::kUnroll>
__device__ __forceinline__ void packed_rows_dot(const PackedRow (&rows)[kRowsPerWarp], const TokenRows& in, int part,
                                                int parts, float (&acc)[kRowsPerWarp][TMAX]) {
  using P = Packed<F>;
  constexpr int kUnroll = UNROLL;
  const int step = parts * WARP_SIZE * kChunk;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t) acc[r][t] = 0.0f;

  for (int base = (part * WARP_SIZE + lane_id()) * kChunk; base < in.n_in; base += step * kUnroll) {
    // Every weight and scale load of this step is issued before the first use.
    typename P::Raw raw[kUnroll][kRowsPerWarp];
    ChunkScale scale[kUnroll][kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * step;
      if (k < in.n_in) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) raw[u][r] = P::load(rows[r].data, k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * step;
      if (k < in.n_in) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) scale[u][r] = debiased<P>(P::scale(rows[r], k));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * step;
      if (k >= in.n_in) continue;
      float w[kRowsPerWarp][kChunk];
      bool nan[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) nan[r] = P::decode(raw[u][r], w[r]);
      float norm[kChunk];
#pragma unroll
      for (int v = 0; v < kChunk; ++v) norm[v] = 1.0f;
      if (in.norm_w != nullptr) {
        const Bf16Vec<8> n0 = load_cached<8>(in.norm_w + k), n1 = load_cached<8>(in.norm_w + k + 8);
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          norm[v] = n0[v];
          norm[v + 8] = n1[v];
        }
      }
#pragma unroll
      for (int t = 0; t < TMAX; ++t) {
        if (t < in.tokens) {
          const bf16_t* xt = in.x + static_cast<size_t>(t) * in.n_in + k;
          const Bf16Vec<8> x0 = load_activation<8, COHERENT>(xt), x1 = load_activation<8, COHERENT>(xt + 8);
          float xf[kChunk];
#pragma unroll
          for (int v = 0; v < 8; ++v) {
            xf[v] = x0[v] * norm[v];
            xf[v + 8] = x1[v] * norm[v + 8];
          }
          float x_sum = 0.0f;
          if (P::kHasMin) {
#pragma unroll
            for (int v = 0; v < kChunk; ++v) x_sum += xf[v];
          }
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) {
            // Two chains: half the dependent-FMA latency per chunk.
            float even = 0.0f, odd = 0.0f;
#pragma unroll
            for (int v = 0; v < kChunk; v += 2) {
              even = fmaf(w[r][v], xf[v], even);
              odd = fmaf(w[r][v + 1], xf[v + 1], odd);
            }
            float sum = even + odd;
            if (P::kCanBeNaN && nan[r]) sum = __uint_as_float(0x7FC00000u);
            acc[r][t] = fmaf(sum * P::kPre, scale[u][r].mul, acc[r][t]);
            if (P::kHasMin) acc[r][t] = fmaf(x_sum, scale[u][r].add, acc[r][t]);
          }
        }
      }
    }
  }
  warp_sum_rows(acc, in.tokens);
}

// Runs `epilogue(unit, acc)` for every row group `unit` < units, acc[r][t] being the full dot product
// of row r of the group with token t. `rows_of(unit, rows, in)` names the group's rows and the token
// rows they multiply (a routed expert's pair has its own). Warps take groups round-robin; with
// k_split > 1, k_split consecutive warps of a block share a group. Every thread of the block calls it;
// blocks have kMatvecWarps warps.
// UNROLL: packed_rows_dot's steps of loads in flight (the format's own unless a kernel asks for fewer).
template <WeightFormat F, int TMAX, int UNROLL = Packed<F>::kUnroll, class RowsOf, class Epilogue>
__device__ __forceinline__ void for_each_packed_row_group(int units, int k_split, RowsOf rows_of, Epilogue epilogue) {
  __shared__ float partial[kMatvecWarps][kRowsPerWarp][TMAX];
  const int slots = kMatvecWarps / k_split, slot = warp_id() / k_split, part = warp_id() % k_split;
  // The loop bound is block-uniform so the warps sharing a group meet at the barriers.
  for (int first = blockIdx.x * slots; first < units; first += gridDim.x * slots) {
    const int unit = min(first + slot, units - 1);  // a surplus warp redoes the last group, unused
    PackedRow rows[kRowsPerWarp];
    TokenRows in;
    rows_of(unit, rows, in);
    float acc[kRowsPerWarp][TMAX];
    packed_rows_dot<F, TMAX, false, UNROLL>(rows, in, part, k_split, acc);
    if (k_split > 1) block_team_sum(acc, partial, slot, k_split);
    if (first + slot < units && part == 0) epilogue(unit, acc);
  }
}

// Launch shape: warps sharing a row group (while there are too few groups to keep kWarpsWantedPerUnit
// warps per SM/CU busy and each share keeps two full steps), and a one-wave persistent grid.
inline RowGroupGrid packed_grid(int64_t units, int64_t n_in, int resident) {
  const int64_t units_per_cu = compute_unit_count();
  int k_split = 1;
  while (k_split < kMatvecWarps && units * k_split < units_per_cu * kWarpsWantedPerUnit &&
         n_in >= int64_t{2} * 2 * k_split * WARP_SIZE * kChunk)
    k_split *= 2;
  const int64_t slots = kMatvecWarps / k_split;
  const int64_t needed = (units + slots - 1) / slots;
  const int64_t full = units_per_cu * resident;
  RowGroupGrid grid{};
  grid.k_split = k_split;
  grid.blocks = static_cast<int>(needed < full ? (needed > 0 ? needed : 1) : full);
  return grid;
}

// Calls f(std::integral_constant<WeightFormat, F>) for the format code `code`.
template <class Fn>
inline ffi::Error with_weight_format(int32_t code, Fn&& f) {
  switch (static_cast<WeightFormat>(code)) {
    case WeightFormat::kBf16: return f(std::integral_constant<WeightFormat, WeightFormat::kBf16>{});
    case WeightFormat::kMxfp4: return f(std::integral_constant<WeightFormat, WeightFormat::kMxfp4>{});
    case WeightFormat::kMxfp8: return f(std::integral_constant<WeightFormat, WeightFormat::kMxfp8>{});
    case WeightFormat::kFp8Block128: return f(std::integral_constant<WeightFormat, WeightFormat::kFp8Block128>{});
    case WeightFormat::kQ8_0: return f(std::integral_constant<WeightFormat, WeightFormat::kQ8_0>{});
    case WeightFormat::kQ4_0: return f(std::integral_constant<WeightFormat, WeightFormat::kQ4_0>{});
    case WeightFormat::kQ4_1: return f(std::integral_constant<WeightFormat, WeightFormat::kQ4_1>{});
    case WeightFormat::kQ4_K: return f(std::integral_constant<WeightFormat, WeightFormat::kQ4_K>{});
    case WeightFormat::kQ6_K: return f(std::integral_constant<WeightFormat, WeightFormat::kQ6_K>{});
    case WeightFormat::kQ5_0: return f(std::integral_constant<WeightFormat, WeightFormat::kQ5_0>{});
    case WeightFormat::kQ5_1: return f(std::integral_constant<WeightFormat, WeightFormat::kQ5_1>{});
    case WeightFormat::kQ5_K: return f(std::integral_constant<WeightFormat, WeightFormat::kQ5_K>{});
    case WeightFormat::kKMix: return f(std::integral_constant<WeightFormat, WeightFormat::kKMix>{});
    case WeightFormat::kQ3_K: return f(std::integral_constant<WeightFormat, WeightFormat::kQ3_K>{});
    case WeightFormat::kQ2_K: return f(std::integral_constant<WeightFormat, WeightFormat::kQ2_K>{});
    case WeightFormat::kIq4Nl: return f(std::integral_constant<WeightFormat, WeightFormat::kIq4Nl>{});
    case WeightFormat::kIq4Xs: return f(std::integral_constant<WeightFormat, WeightFormat::kIq4Xs>{});
    default: return invalid("packed weights: unknown format code " + std::to_string(code));
  }
}

// Token buckets of the packed kernels: 1 (decode), 4 and 16 (verification). Fewer instantiations
// than the bf16 kernels' five: there are six formats to build.
template <class Fn>
inline ffi::Error with_packed_token_bucket(int64_t tokens, Fn&& f) {
  if (tokens == 1) return f(std::integral_constant<int, 1>{});
  if (tokens >= 2 && tokens <= 4) return f(std::integral_constant<int, 4>{});
  if (tokens >= 5 && tokens <= kMaxTokens) return f(std::integral_constant<int, 16>{});
  return invalid("decode kernels take 1.." + std::to_string(kMaxTokens) + " query positions, got " +
                 std::to_string(tokens) + "; use the reference path for prefill");
}

// ---------------------------------------------------------------------------------------------
// Host side: the planes of a weight, checked against its format
// ---------------------------------------------------------------------------------------------

inline int64_t product(ffi::Span<const int64_t> dims, size_t from, size_t to) {
  int64_t n = 1;
  for (size_t i = from; i < to; ++i) n *= dims[i];
  return n;
}

// The K-quants' scales: one u8 record a super-block, stacked [outer, (inner,) rows, super-blocks, record].
inline ffi::Error k_quant_records(const std::string& op, WeightFormat format, const ffi::AnyBuffer& scales, size_t lead,
                                  int64_t n_in, ffi::Span<const int64_t> dd, PackedWeight& w) {
  const int64_t record = format == WeightFormat::kQ6_K || format == WeightFormat::kQ3_K ? kQ6KRecord
                         : format == WeightFormat::kKMix                                 ? kKMixRecord
                         : format == WeightFormat::kQ2_K                                 ? kQ2KRecord
                         : format == WeightFormat::kIq4Xs                                ? kIq4XsRecord
                                                                                         : kQ4KRecord;
  auto sd = scales.dimensions();
  if (sd.size() != lead + 3 || sd[lead] != w.n_out || sd[lead + 1] != n_in / kSuperBlock || sd[lead + 2] != record ||
      product(sd, 0, lead) != product(dd, 0, lead) || scales.element_type() != ffi::DataType::U8)
    return invalid(op + ": scale records " + shape_string(sd) + " do not fit weight data " + shape_string(dd) +
                   " (one u8 record of " + std::to_string(record) + " bytes per 256 values of a row)");
  w.scales = static_cast<const uint8_t*>(scales.untyped_data());
  w.scale_row_bytes = n_in / kSuperBlock * record;
  const int64_t scale_matrix = w.scale_row_bytes * w.n_out;
  w.scale_inner = lead == 2 ? scale_matrix : 0;
  w.scale_outer = dd[0] > 1 ? scale_matrix * (lead == 2 ? dd[1] : 1) : 0;
  return ffi::Error::Success();
}

// Fills `w` from planes stacked [outer, inner, rows..., cols] (lead = 2 leading axes) or
// [outer, rows, cols] (lead = 1), for a logical [n_out, n_in] matrix; an error names what is wrong.
inline ffi::Error packed_weight(const std::string& op, int32_t code, const ffi::AnyBuffer& data,
                                const ffi::AnyBuffer& scales, const ffi::AnyBuffer& mins, size_t lead, int64_t n_in,
                                PackedWeight& w) {
  const auto format = static_cast<WeightFormat>(code);
  if (code < 0 || code > kLastWeightFormat) return invalid(op + ": unknown weight format code " + std::to_string(code));
  auto dd = data.dimensions();
  auto sd = scales.dimensions();
  if (dd.size() != lead + 2)
    return invalid(op + ": weight data must have " + std::to_string(lead + 2) + " axes, got " + shape_string(dd));
  const bool four_bit = format == WeightFormat::kMxfp4 || format == WeightFormat::kQ4_0 ||
                        format == WeightFormat::kQ4_1 || format == WeightFormat::kQ4_K ||
                        format == WeightFormat::kIq4Nl || format == WeightFormat::kIq4Xs;
  const bool five_bit = format == WeightFormat::kQ5_0 || format == WeightFormat::kQ5_1 || format == WeightFormat::kQ5_K;
  const bool six_bit = format == WeightFormat::kQ6_K || format == WeightFormat::kKMix;
  const bool three_bit = format == WeightFormat::kQ3_K, two_bit = format == WeightFormat::kQ2_K;
  const bool k_quant = two_bit || three_bit || format == WeightFormat::kQ4_K || format == WeightFormat::kQ5_K ||
                       six_bit || format == WeightFormat::kIq4Xs;
  const ffi::DataType want_data = format == WeightFormat::kBf16   ? ffi::DataType::BF16
                                  : format == WeightFormat::kQ8_0 ? ffi::DataType::S8
                                                                  : ffi::DataType::U8;
  if (data.element_type() != want_data) return invalid(op + ": weight data has the wrong dtype for its format");
  // Values a row holds: bytes x 4 (2-bit), x 8/3 (3-bit), x 2 (4-bit), x 8/5 (5-bit), x 4/3 (6-bit), else one a
  // byte (or bf16 element).
  const int64_t bytes = dd[lead + 1];
  const int64_t cols = six_bit     ? bytes * 4 / 3
                       : five_bit  ? bytes * 8 / 5
                       : three_bit ? bytes * 8 / 3
                       : two_bit   ? bytes * 4
                                   : bytes * (four_bit ? 2 : 1);
  if (cols != n_in || n_in % kChunk != 0 || ((six_bit || three_bit) && bytes % 3 != 0) ||
      (five_bit && bytes % 5 != 0))
    return invalid(op + ": weight rows hold " + std::to_string(cols) + " values but the input has " +
                   std::to_string(n_in) + " (a multiple of 16 is required)");
  if (k_quant && n_in % kSuperBlock != 0)
    return invalid(op + ": rows of a super-block format (K-quants, IQ4_XS) must hold a multiple of 256 values, got " +
                   std::to_string(n_in));
  w.data = static_cast<const uint8_t*>(data.untyped_data());
  w.n_out = static_cast<int>(dd[lead]);
  w.n_in = static_cast<int>(n_in);
  w.format = format;
  const int64_t elem = format == WeightFormat::kBf16 ? 2 : 1;
  w.row_bytes = dd[lead + 1] * elem;
  const int64_t matrix_bytes = w.row_bytes * w.n_out;
  w.data_inner = lead == 2 ? matrix_bytes : 0;
  w.data_outer = dd[0] > 1 ? matrix_bytes * (lead == 2 ? dd[1] : 1) : 0;
  w.scales = nullptr;
  w.mins = nullptr;
  w.scale_outer = w.scale_inner = w.scale_row_bytes = 0;
  if (format == WeightFormat::kBf16) return ffi::Error::Success();
  if (k_quant) return k_quant_records(op, format, scales, lead, n_in, dd, w);

  int64_t scale_rows = w.n_out, scale_cols = n_in / kPackedBlock;
  ffi::DataType want_scale = ffi::DataType::F16;
  if (format == WeightFormat::kMxfp4 || format == WeightFormat::kMxfp8) want_scale = ffi::DataType::U8;
  if (format == WeightFormat::kFp8Block128) {
    want_scale = ffi::DataType::F32;
    scale_rows = (w.n_out + kFp8Tile - 1) / kFp8Tile;
    scale_cols = (n_in + kFp8Tile - 1) / kFp8Tile;
  } else if (n_in % kPackedBlock != 0) {
    return invalid(op + ": rows of a block-32 format must hold a multiple of 32 values, got " + std::to_string(n_in));
  }
  if (sd.size() != lead + 2 || sd[lead] != scale_rows || sd[lead + 1] != scale_cols ||
      product(sd, 0, lead) != product(dd, 0, lead) || scales.element_type() != want_scale)
    return invalid(op + ": scales " + shape_string(sd) + " do not fit weight data " + shape_string(dd) +
                   " in this format");
  const int64_t scale_elem = want_scale == ffi::DataType::U8 ? 1 : want_scale == ffi::DataType::F16 ? 2 : 4;
  w.scales = static_cast<const uint8_t*>(scales.untyped_data());
  w.scale_row_bytes = scale_cols * scale_elem;
  const int64_t scale_matrix = w.scale_row_bytes * scale_rows;
  w.scale_inner = lead == 2 ? scale_matrix : 0;
  w.scale_outer = dd[0] > 1 ? scale_matrix * (lead == 2 ? dd[1] : 1) : 0;
  if (format == WeightFormat::kQ4_1 || format == WeightFormat::kQ5_1) {
    if (mins.element_count() != scales.element_count() || mins.element_type() != ffi::DataType::F16)
      return invalid(op + ": q4_1 and q5_1 need mins shaped like their scales, got " +
                     shape_string(mins.dimensions()));
    w.mins = static_cast<const uint8_t*>(mins.untyped_data());
  }
  return ffi::Error::Success();
}

// Every load of a packed kernel is aligned when the planes' bases are (rows are multiples of 16 values).
inline bool packed_aligned(const PackedWeight& w) {
  return aligned16(w.data) && (w.scales == nullptr || (reinterpret_cast<uintptr_t>(w.scales) & 3u) == 0) &&
         (w.mins == nullptr || (reinterpret_cast<uintptr_t>(w.mins) & 1u) == 0);
}

}  // namespace lithos
