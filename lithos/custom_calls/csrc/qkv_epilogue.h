// The epilogue the three Q/K/V kernels share (qkv_rope.cu, its packed twin in matvec_packed.h, and the
// megakernel's mk_qkv.h): a row group's dot products scaled by the token's RMSNorm factor, rotated by
// RoPE, and handed to the kernel's own store (Q rows, or K and V appended to the cache).
#pragma once

#include <cstdint>

#include "portable.h"
#include "rowdot.h"

namespace lithos {

// Rotates the rotary pair (lo, hi) at `position`: the same float32 product as the reference, so both
// rotate by the same angle.
__device__ __forceinline__ void rope_rotate(float& lo, float& hi, int position, float inv_freq) {
  const float angle = static_cast<float>(position) * inv_freq;
  float sin_a, cos_a;
  sincosf(angle, &sin_a, &cos_a);
  const float rotated_lo = lo * cos_a - hi * sin_a;
  hi = hi * cos_a + lo * sin_a;
  lo = rotated_lo;
}

// The slot `position` is written to: position % slots in a ring, position in a linear cache; -1 when it
// has none (a negative position, or one past a linear cache's end).
__device__ __forceinline__ int cache_slot(int position, int slots, bool ring) {
  if (position < 0 || !(ring || position < slots)) return -1;
  return ring ? position % slots : position;
}

// Writes a rotary pair to elements j and j + half of a bf16 row.
__device__ __forceinline__ void store_pair(bf16_t* row, int j, int half, float lo, float hi) {
  row[j] = float_to_bf16(lo);
  row[j + half] = float_to_bf16(hi);
}

// A row group of two rotary pairs (first_pair, first_pair + 1; acc rows 2p and 2p + 1 are pair p's
// halves): lane t takes token t (for_each_token), scales by the token's RMSNorm factor, adds the head's
// bias (its head_dim values, Qwen2's) as the reference adds it (the projection rounded to bf16, the sum rounded
// again: a bf16 `linear(x, w) + b`; greedy tokens follow that rounding), rotates unless `rotate` is false
// (V rows, or a projection stored before its per-head norm), and calls `store(t, position, j, lo, hi)` for
// each pair j. With kOptional, `bias` and `positions` may be nullptr (no bias; no positions, position -1,
// when nothing rotates or goes to a cache); without it no such code exists, and the megakernel's build is
// the one it was before either.
template <int TMAX, bool kOptional, class Store>
__device__ __forceinline__ void rope_pairs_with(const float (&acc)[kRowsPerWarp][TMAX], const float* rms_scale,
                                                int tokens, const int32_t* positions, const float* inv_freq,
                                                int first_pair, bool rotate, const bf16_t* bias, int half,
                                                Store store) {
  static_assert(kRowsPerWarp == 4, "a row group holds two rotary pairs");
  float bias_lo[2] = {0.f, 0.f}, bias_hi[2] = {0.f, 0.f};
  if constexpr (kOptional) {
    if (bias != nullptr) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        bias_lo[p] = bf16_to_float(bias[first_pair + p]);
        bias_hi[p] = bf16_to_float(bias[first_pair + p + half]);
      }
    }
  }
  for_each_token<TMAX>(acc, tokens, [&](int t, const float (&sums)[kRowsPerWarp]) {
    const int position = (kOptional && positions == nullptr) ? -1 : positions[t];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int j = first_pair + p;
      float lo = sums[2 * p] * rms_scale[t];
      float hi = sums[2 * p + 1] * rms_scale[t];
      if constexpr (kOptional) {
        if (bias != nullptr) {  // only then: `+ 0.f` would turn -0 into +0, and unbiased sums stay unrounded
          lo = round_to_bf16(round_to_bf16(lo) + bias_lo[p]);
          hi = round_to_bf16(round_to_bf16(hi) + bias_hi[p]);
        }
      }
      if (rotate) rope_rotate(lo, hi, position, inv_freq[j]);
      store(t, position, j, lo, hi);
    }
  });
}

// The fused Q/K/V kernels' pairs: the head's `bias` or nullptr, `positions` or nullptr (see above).
template <int TMAX, class Store>
__device__ __forceinline__ void rope_pairs(const float (&acc)[kRowsPerWarp][TMAX], const float* rms_scale, int tokens,
                                           const int32_t* positions, const float* inv_freq, int first_pair,
                                           bool rotate, const bf16_t* bias, int half, Store store) {
  rope_pairs_with<TMAX, true>(acc, rms_scale, tokens, positions, inv_freq, first_pair, rotate, bias, half, store);
}

// Without biases, every position given: the megakernel, which refuses biased and normed models.
template <int TMAX, class Store>
__device__ __forceinline__ void rope_pairs(const float (&acc)[kRowsPerWarp][TMAX], const float* rms_scale, int tokens,
                                           const int32_t* positions, const float* inv_freq, int first_pair,
                                           bool rotate, Store store) {
  rope_pairs_with<TMAX, false>(acc, rms_scale, tokens, positions, inv_freq, first_pair, rotate, nullptr, 0, store);
}

}  // namespace lithos
