// Megakernel task kind 6: final RMSNorm -> LM head rows -> each task's best (logit, id) per token,
// and the float32 logits when the caller samples (the fused twin is lm_head.cu). The task that
// arrives last picks each token's winner from every task's best: no second launch. Ties go to the
// lowest id, as jnp.argmax does.
#pragma once

#include <climits>

#include "mk_matvec.h"
#include "mk_weight_rows.h"

namespace lithos {
namespace mk {

struct Best {
  float value;
  int index;
};

constexpr Best kNoBest{-INFINITY, INT_MAX};

__device__ __forceinline__ Best better(Best x, Best y) {
  return (y.value > x.value || (y.value == x.value && y.index < x.index)) ? y : x;
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) b = better(b, Best{shfl_xor(b.value, mask), shfl_xor(b.index, mask)});
  return b;
}

// For t < tokens: the best of bests[0..n) (every thread calls it; thread 0 ends with the answer).
template <class BestOf>
__device__ Best block_best(int n, BestOf best_of) {
  __shared__ Best warp_bests[kMatvecWarps];
  Best b = kNoBest;
  for (int i = threadIdx.x; i < n; i += blockDim.x) b = better(b, best_of(i));
  b = warp_best(b);
  if (lane_id() == 0) warp_bests[warp_id()] = b;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < kMatvecWarps; ++w) b = better(b, warp_bests[w]);
  __syncthreads();
  return b;
}

template <int TMAX>
__device__ bool head_task(const Args& a, const Task& task, int index) {
  __shared__ float rms_scale[TMAX];
  __shared__ Best warp_bests[kMatvecWarps][TMAX];

  auto rows_of = [&](int unit, PackedRow (&rows)[kRowsPerWarp]) { head_rows<kHeadFormat>(a, unit, rows); };
  Best best[TMAX];
#pragma unroll
  for (int t = 0; t < TMAX; ++t) best[t] = kNoBest;
  const TokenRows in{after_mlp(a), a.final_norm, a.tokens, a.hidden};
  auto rms = [&](const TokenRows& staged) { block_rms_scale<TMAX, 8, true>(staged, a.eps, rms_scale); };
  auto track = [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
    // Every lane holds every sum, so every lane tracks the same bests: no shuffles until the end.
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
      if (t < a.tokens) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const int row = unit * kRowsPerWarp + r;
          if (row < a.vocab) {
            const float logit = acc[r][t] * rms_scale[t];
            best[t] = better(best[t], Best{logit, row});
            if (a.logits != nullptr && lane_id() == r) a.logits[static_cast<size_t>(t) * a.vocab + row] = logit;
          }
        }
      }
    }
  };
  auto stream = [&]() {
#if !defined(LITHOS_HIP)
    if constexpr (kMkWideHead<kHeadFormat, TMAX>) {
      if (task.k_split == 1) return stream_wide_row_groups<TMAX>(a, task, index, in, rows_of, rms, track);
    }
#endif
    return stream_row_groups<kHeadFormat, TMAX>(a, task, index, in, rows_of, rms, track);
  };
  if (!stream()) return false;

  // This task's best per token (warps that only helped a k-split hold kNoBest).
#pragma unroll
  for (int t = 0; t < TMAX; ++t)
    if (lane_id() == 0) warp_bests[warp_id()][t] = best[t];
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(a.tokens)) {
    Best b = kNoBest;
#pragma unroll
    for (int w = 0; w < kMatvecWarps; ++w) b = better(b, warp_bests[w][threadIdx.x]);
    a.best_value[static_cast<size_t>(task.aux) * a.tokens + threadIdx.x] = b.value;
    a.best_index[static_cast<size_t>(task.aux) * a.tokens + threadIdx.x] = b.index;
  }

  if (block_signal(a, task.signal_counter) == task.arrivals - 1) {
    for (int t = 0; t < a.tokens; ++t) {
      const Best b = block_best(task.arrivals, [&](int slot) {
        const size_t at = static_cast<size_t>(slot) * a.tokens + t;
        return Best{a.best_value[at], a.best_index[at]};
      });
      if (threadIdx.x == 0) a.tokens_out[t] = b.index;
    }
  }
  return true;
}

}  // namespace mk
}  // namespace lithos
