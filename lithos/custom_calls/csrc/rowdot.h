// The building block of every batch-1 matvec kernel here (projections, gate/up, LM head): a warp
// computes the dot products of a few weight rows with 1..16 token vectors. Lanes split the input
// dimension in 16-byte chunks, so a warp reads each weight row contiguously and each weight byte
// once for all tokens; the activations are tiny and come from L1.
//
// Small matrices (a 1B model's O projection has 2048 rows) give too few row groups to keep enough
// loads in flight on every SM; then `k_split` warps of a block share a row group, each reading an
// interleaved share of the input dimension, and add their sums through shared memory.
#pragma once

#include "ffi_util.h"
#include "portable.h"

namespace lithos {

// Eight warps (CUDA) or eight wavefronts (ROCm) per block.
constexpr int kMatvecWarps = 8;
constexpr int kMatvecThreads = kMatvecWarps * WARP_SIZE;
// Rows a warp reads at once.
constexpr int kRowsPerWarp = 4;
// Warps per SM/CU wanted in flight before row groups are split over several warps.
constexpr int kWarpsWantedPerUnit = 24;

// 16-byte chunks of each row a lane has in flight: 16 loads per lane at 1-2 tokens, 8 when the
// accumulators for more tokens need the registers.
template <int TMAX>
struct Unroll {
  static constexpr int value = TMAX <= 2 ? 4 : 2;
};

// Token activations x[t, :] for t < tokens, optionally scaled elementwise by an RMSNorm weight.
struct TokenRows {
  const bf16_t* x;       // [tokens, n_in]
  const bf16_t* norm_w;  // [n_in], or nullptr
  int tokens;
  int n_in;
};

// acc[r][t] = sum over this warp's share of i of rows[r][i] * x[t, i] * norm_w[i]; the share is
// chunks part, part + parts, ... Every lane of the warp ends with every sum.
template <int TMAX, int VEC>
__device__ __forceinline__ void warp_rows_dot(const bf16_t* const (&rows)[kRowsPerWarp], const TokenRows& in,
                                              int part, int parts, float (&acc)[kRowsPerWarp][TMAX]) {
  constexpr int kUnroll = Unroll<TMAX>::value;
  const int step = parts * WARP_SIZE * VEC;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t) acc[r][t] = 0.0f;

  for (int base = (part * WARP_SIZE + lane_id()) * VEC; base < in.n_in; base += step * kUnroll) {
    // Issue every weight load of this step before the first use: the loads are what we wait on.
    Bf16Vec<VEC> w[kUnroll][kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * step;
      if (k < in.n_in) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) w[u][r] = load_streaming<VEC>(rows[r] + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * step;
      if (k < in.n_in) {
        float norm[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) norm[v] = 1.0f;
        if (in.norm_w != nullptr) {
          const Bf16Vec<VEC> nw = load_cached<VEC>(in.norm_w + k);
#pragma unroll
          for (int v = 0; v < VEC; ++v) norm[v] = nw[v];
        }
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
          if (t < in.tokens) {
            const Bf16Vec<VEC> xv = load_cached<VEC>(in.x + static_cast<size_t>(t) * in.n_in + k);
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
              const float xf = xv[v] * norm[v];
#pragma unroll
              for (int r = 0; r < kRowsPerWarp; ++r) acc[r][t] = fmaf(w[u][r][v], xf, acc[r][t]);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t)
      if (t < in.tokens) acc[r][t] = warp_sum(acc[r][t]);
}

// Runs `epilogue(unit, acc)` for every row group `unit` < units, with acc[r][t] the full dot product
// of rows_of(unit)[r] with token t. Warps of the grid take row groups round-robin; with k_split > 1,
// k_split consecutive warps of a block share each group. Every thread of the block must call it.
template <int TMAX, int VEC, class RowsOf, class Epilogue>
__device__ __forceinline__ void for_each_row_group(const TokenRows& in, int units, int k_split, RowsOf rows_of,
                                                   Epilogue epilogue) {
  __shared__ float partial[kMatvecWarps][kRowsPerWarp][TMAX];
  const int slots = kMatvecWarps / k_split, slot = warp_id() / k_split, part = warp_id() % k_split;
  // The loop bound is block-uniform so the warps sharing a group can meet at the barriers.
  for (int first = blockIdx.x * slots; first < units; first += gridDim.x * slots) {
    const int unit = min(first + slot, units - 1);  // a surplus warp redoes the last group, unused
    const bf16_t* rows[kRowsPerWarp];
    rows_of(unit, rows);
    float acc[kRowsPerWarp][TMAX];
    warp_rows_dot<TMAX, VEC>(rows, in, part, k_split, acc);
    if (k_split > 1) {
      if (lane_id() == 0) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
          for (int t = 0; t < TMAX; ++t) partial[warp_id()][r][t] = acc[r][t];
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
          float sum = 0.0f;
          for (int p = 0; p < k_split; ++p) sum += partial[slot * k_split + p][r][t];
          acc[r][t] = sum;
        }
      __syncthreads();
    }
    if (first + slot < units && part == 0) epilogue(unit, acc);
  }
}

// RMSNorm factor rsqrt(mean(x[t, :]^2) + eps) for t < tokens, computed by the whole block (every
// thread must call it) into scale[t] in shared memory. The matvecs apply it after the dot product,
// so the normalised activations never exist in memory.
template <int TMAX, int VEC>
__device__ void block_rms_scale(const TokenRows& in, float eps, float* scale) {
  __shared__ float partial[kMatvecWarps][TMAX];
  float squares[TMAX];
#pragma unroll
  for (int t = 0; t < TMAX; ++t) squares[t] = 0.0f;
  for (int k = static_cast<int>(threadIdx.x) * VEC; k < in.n_in; k += kMatvecThreads * VEC) {
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
      if (t < in.tokens) {
        const Bf16Vec<VEC> xv = load_cached<VEC>(in.x + static_cast<size_t>(t) * in.n_in + k);
#pragma unroll
        for (int v = 0; v < VEC; ++v) squares[t] = fmaf(xv[v], xv[v], squares[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TMAX; ++t) {
    const float total = warp_sum(squares[t]);
    if (lane_id() == 0) partial[warp_id()][t] = total;
  }
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(in.tokens)) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kMatvecWarps; ++w) total += partial[w][threadIdx.x];
    scale[threadIdx.x] = rsqrtf(total / static_cast<float>(in.n_in) + eps);
  }
  __syncthreads();
}

// Launch shape of a row-group kernel: how many warps share a group, and the persistent grid.
struct RowGroupGrid {
  int k_split;
  int blocks;
};

// `resident` is how many blocks of the kernel fit on one SM/CU (resident_blocks_per_unit): the grid
// is one wave of them, each block striding over row groups, so every block pays its prologue (the
// RMSNorm factor) once and no second wave waits on the first.
inline RowGroupGrid row_group_grid(int64_t units, int64_t n_in, int resident) {
  const int64_t units_per_cu = compute_unit_count();
  int k_split = 1;
  // Split the input dimension while there are too few groups for the warps wanted, and each share
  // still spans a few full warp-wide chunks.
  while (k_split < kMatvecWarps && units * k_split < units_per_cu * kWarpsWantedPerUnit &&
         n_in >= int64_t{2} * k_split * WARP_SIZE * 8 * 2)
    k_split *= 2;
  const int64_t slots = kMatvecWarps / k_split;
  const int64_t needed = (units + slots - 1) / slots;
  const int64_t full = units_per_cu * resident;
  return {k_split, static_cast<int>(needed < full ? (needed > 0 ? needed : 1) : full)};
}

}  // namespace lithos
