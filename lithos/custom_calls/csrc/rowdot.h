// The building block of every batch-1 matvec kernel here (projections, gate/up, LM head): a warp
// computes the dot products of a few weight rows with 1..16 token vectors. Lanes split the input
// dimension in 16-byte chunks, so a warp reads each weight row contiguously and each weight byte
// once for all tokens; the activations are tiny and come from L1.
#pragma once

#include "ffi_util.h"
#include "portable.h"

namespace lithos {

// Four warps (CUDA) or four wavefronts (ROCm) per block.
constexpr int kMatvecWarps = 4;
constexpr int kMatvecThreads = kMatvecWarps * WARP_SIZE;
// Rows a warp reads at once, and chunks of each row per lane in flight: 8 loads of 16 bytes per
// lane, so a few resident warps per SM cover the HBM latency.
constexpr int kRowsPerWarp = 4;
constexpr int kUnroll = 2;
// Resident blocks per SM/CU the persistent grids aim for.
constexpr int kBlocksPerUnit = 8;

// Token activations x[t, :] for t < tokens, optionally scaled elementwise by an RMSNorm weight.
struct TokenRows {
  const bf16_t* x;       // [tokens, n_in]
  const bf16_t* norm_w;  // [n_in], or nullptr
  int tokens;
  int n_in;
};

// acc[r][t] = sum_i rows[r][i] * x[t, i] * norm_w[i]; every lane of the warp ends with every sum.
template <int TMAX, int VEC>
__device__ __forceinline__ void warp_rows_dot(const bf16_t* const (&rows)[kRowsPerWarp], const TokenRows& in,
                                              float (&acc)[kRowsPerWarp][TMAX]) {
  constexpr int kStep = WARP_SIZE * VEC;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t) acc[r][t] = 0.0f;

  for (int base = lane_id() * VEC; base < in.n_in; base += kStep * kUnroll) {
    // Issue every weight load of this step before the first use: the loads are what we wait on.
    Bf16Vec<VEC> w[kUnroll][kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * kStep;
      if (k < in.n_in) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) w[u][r] = load_streaming<VEC>(rows[r] + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * kStep;
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

// Blocks of a persistent grid: enough to fill every SM/CU, never more than there is work for.
inline int persistent_blocks(int64_t warp_units) {
  const int64_t needed = (warp_units + kMatvecWarps - 1) / kMatvecWarps;
  const int64_t full = static_cast<int64_t>(compute_unit_count()) * kBlocksPerUnit;
  return static_cast<int>(needed < full ? (needed > 0 ? needed : 1) : full);
}

}  // namespace lithos
