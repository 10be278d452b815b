// How the fused row-group kernels (matvec, gate/up, Q/K/V, LM head) walk their row groups: warps of the
// grid take groups round-robin, and each group's dot products run on the FMA path (warp_rows_dot) or,
// at 4-16 tokens on CUDA, on tensor cores (mma_rowdot.h, as in the megakernel).
#pragma once

#include "mma_rowdot.h"
#include "rowdot.h"

namespace lithos {

// Runs `epilogue(unit, acc)` for every row group `unit` < units, with acc[r][t] the full dot product
// of rows_of(unit)[r] with token t. Warps of the grid take row groups round-robin; with k_split > 1,
// k_split consecutive warps of a block share each group. Every thread of the block must call it.
template <int TMAX, int VEC, class RowsOf, class Epilogue>
__device__ __forceinline__ void for_each_row_group(const TokenRows& in, int units, int k_split, RowsOf rows_of,
                                                   Epilogue epilogue) {
  __shared__ float partial[kMatvecWarps][kRowsPerWarp][TMAX];
  const int slots = block_warps() / k_split, slot = warp_id() / k_split, part = warp_id() % k_split;
  // The loop bound is block-uniform so the warps sharing a group can meet at the barriers.
  for (int first = blockIdx.x * slots; first < units; first += gridDim.x * slots) {
    const int unit = min(first + slot, units - 1);  // a surplus warp redoes the last group, unused
    const bf16_t* rows[kRowsPerWarp];
    rows_of(unit, rows);
    float acc[kRowsPerWarp][TMAX];
#if !defined(LITHOS_HIP)
    if constexpr (VEC == 8 && kMmaRowDot<TMAX>)
      mma_rows_dot<TMAX, false, kMmaChunks<TMAX>>(rows, in, part, k_split, acc);
    else
#endif
      warp_rows_dot<TMAX, VEC>(rows, in, part, k_split, acc);
    if (k_split > 1) block_team_sum(acc, partial, slot, k_split);
    if (first + slot < units && part == 0) epilogue(unit, acc);
  }
}

}  // namespace lithos
