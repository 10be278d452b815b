// How the fused row-group kernels (matvec, gate/up, Q/K/V, LM head) walk their row groups: warps of the
// grid take groups round-robin, and each group's dot products run on the FMA path (warp_rows_dot) or,
// at 4-16 tokens on CUDA, on tensor cores (mma_rowdot.h): in the megakernel's 4-row layout, or where
// LITHOS_FUSED_WIDE_MMA asks, four groups at a time in the wide layout (16 rows a warp).
#pragma once

#include "mma_rowdot.h"
#include "rowdot.h"

namespace lithos {

// Which kernels' tensor-core paths take the wide layout (16 rows a warp) instead of the megakernel's 4:
// 0 none, 1 the gate/up and LM-head kernels (the default: many rows and normed inputs, where it measured
// faster; the O, down and Q/K/V projections, with fewer rows, spread better over the SMs in groups of 4:
// NOTES.md runs 54 and 55), 2 every row-group kernel. Others by LITHOS_KERNEL_DEFINES, for experiments.
#ifndef LITHOS_FUSED_WIDE_MMA
#define LITHOS_FUSED_WIDE_MMA 1
#endif
#if LITHOS_FUSED_WIDE_MMA < 0 || LITHOS_FUSED_WIDE_MMA > 2
#error "LITHOS_FUSED_WIDE_MMA is 0, 1 or 2 (which kernels take the wide layout)"
#endif

// The LITHOS_FUSED_WIDE_MMA level from which a kernel takes the wide layout.
constexpr int kWideForLargeNormed = 1;  // gate/up, LM head
constexpr int kWideForRest = 2;         // Q/K/V, the plain matvec (O and down projections)

// 256-input chunks in flight per lane on the fused kernels' 4-row tensor-core path at up to 8 tokens: 1 (the
// default) halves the registers of 2, the megakernel's count (Q/K/V at 8 tokens: 209 -> 124), so two blocks
// of 8 warps fit per SM with the same bytes in flight where one did (NOTES.md, runs 56 and 61: 8B rounds
// 8.13 -> 7.36 ms); LITHOS_KERNEL_DEFINES="LITHOS_FUSED_MMA_CHUNKS=2" builds the one-block layout.
#ifndef LITHOS_FUSED_MMA_CHUNKS
#define LITHOS_FUSED_MMA_CHUNKS 1
#endif
#if LITHOS_FUSED_MMA_CHUNKS != 1 && LITHOS_FUSED_MMA_CHUNKS != 2
#error "LITHOS_FUSED_MMA_CHUNKS is 1 or 2 (256-input chunks in flight per lane)"
#endif
template <int TMAX>
constexpr int kFusedMmaChunks = TMAX <= 8 ? LITHOS_FUSED_MMA_CHUNKS : kMmaChunks<TMAX>;

// Row groups a warp takes at once: 4 (16 rows) on the tensor-core path's wide layout, else 1.
template <int TMAX, int VEC, int WIDE_FROM>
#if defined(LITHOS_HIP)
constexpr int kGroupsPerWarp = 1;
#else
constexpr int kGroupsPerWarp = LITHOS_FUSED_WIDE_MMA >= WIDE_FROM && VEC == 8 && kMmaRowDot<TMAX> ? 4 : 1;
#endif

// The work items row_group_grid sizes the grid by: row groups, or sets of kGroupsPerWarp of them.
template <int TMAX, int VEC, int WIDE_FROM>
inline int64_t row_group_work(int64_t units) {
  return (units + kGroupsPerWarp<TMAX, VEC, WIDE_FROM> - 1) / kGroupsPerWarp<TMAX, VEC, WIDE_FROM>;
}

#if !defined(LITHOS_HIP)
// block_team_sum for the wide layout's fragments: the k_split warps of team `slot` add their sum[q][e]
// lane by lane ([warp][q][e][lane] keeps the accesses conflict-free); each member ends with the total.
template <int GROUPS>
__device__ __forceinline__ void block_team_sum_fragments(float (&sum)[GROUPS][4],
                                                         float (&team)[kMatvecWarps][GROUPS][4][WARP_SIZE], int slot,
                                                         int k_split) {
#pragma unroll
  for (int q = 0; q < GROUPS; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) team[warp_id()][q][e][lane_id()] = sum[q][e];
  __syncthreads();
#pragma unroll
  for (int q = 0; q < GROUPS; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float total = 0.0f;
      for (int p = 0; p < k_split; ++p) total += team[slot * k_split + p][q][e][lane_id()];
      sum[q][e] = total;
    }
  __syncthreads();
}

// One work item of the wide layout: row groups 4 item .. 4 item + 3 (16 rows).
template <int TMAX, class RowsOf, class Epilogue>
__device__ __forceinline__ void wide_row_groups(const TokenRows& in, int item, int units, int part, int k_split,
                                                int slot, bool owner, RowsOf rows_of, Epilogue epilogue) {
  constexpr int kTokenGroups = (TMAX + 7) / 8;
  __shared__ float team[kMatvecWarps][kTokenGroups][4][WARP_SIZE];
  // This lane's rows g and g + 8 of the 16: row g % 4 of groups g / 4 and 2 + g / 4.
  const int g = lane_id() / 4;
  const bf16_t* rows[kRowsPerWarp];
  rows_of(min(item * 4 + g / 4, units - 1), rows);
  const bf16_t* row_g = mma_lane_row(rows);
  rows_of(min(item * 4 + 2 + g / 4, units - 1), rows);
  const bf16_t* row_g8 = mma_lane_row(rows);
  float sum[kTokenGroups][4];
  mma_wide_rows_dot<TMAX>(row_g, row_g8, in, part, k_split, sum);
  // The team adds its fragments before the hand-out: 4 values a lane, not 4 rows x TMAX sums a group.
  if (k_split > 1) block_team_sum_fragments(sum, team, slot, k_split);
  if (!owner) return;
#pragma unroll
  for (int sub = 0; sub < 4; ++sub) {
    if (item * 4 + sub >= units) break;
    float acc[kRowsPerWarp][TMAX];
    mma_wide_hand_out<TMAX>(sum, sub, acc);
    epilogue(item * 4 + sub, acc);
  }
}
#endif

// One work item of 4 rows: row group `item`.
template <int TMAX, int VEC, class RowsOf, class Epilogue>
__device__ __forceinline__ void row_group(const TokenRows& in, int item, int part, int k_split, int slot, bool owner,
                                          RowsOf rows_of, Epilogue epilogue) {
  __shared__ float partial[kMatvecWarps][kRowsPerWarp][TMAX];
  const bf16_t* rows[kRowsPerWarp];
  rows_of(item, rows);
  float acc[kRowsPerWarp][TMAX];
#if !defined(LITHOS_HIP)
  if constexpr (VEC == 8 && kMmaRowDot<TMAX>)
    mma_rows_dot<TMAX, false, kFusedMmaChunks<TMAX>>(rows, in, part, k_split, acc);
  else
#endif
    warp_rows_dot<TMAX, VEC>(rows, in, part, k_split, acc);
  if (k_split > 1) block_team_sum(acc, partial, slot, k_split);
  if (owner) epilogue(item, acc);
}

// Runs `epilogue(unit, acc)` for every row group `unit` < units, with acc[r][t] the full dot product
// of rows_of(unit)[r] with token t. Warps of the grid take work items (row_group_work) round-robin;
// with k_split > 1, k_split consecutive warps of a block share each item. Every thread of the block
// must call it.
template <int TMAX, int VEC, int WIDE_FROM, class RowsOf, class Epilogue>
__device__ __forceinline__ void for_each_row_group(const TokenRows& in, int units, int k_split, RowsOf rows_of,
                                                   Epilogue epilogue) {
  constexpr int kGroups = kGroupsPerWarp<TMAX, VEC, WIDE_FROM>;
  const int items = (units + kGroups - 1) / kGroups;
  const int slots = block_warps() / k_split, slot = warp_id() / k_split, part = warp_id() % k_split;
  // The loop bound is block-uniform so the warps sharing an item can meet at the barriers.
  for (int first = blockIdx.x * slots; first < items; first += gridDim.x * slots) {
    const int item = min(first + slot, items - 1);  // a surplus warp redoes the last item, unused
    const bool owner = first + slot < items && part == 0;
#if !defined(LITHOS_HIP)
    if constexpr (kGroups == 4) {
      wide_row_groups<TMAX>(in, item, units, part, k_split, slot, owner, rows_of, epilogue);
      continue;
    }
#endif
    row_group<TMAX, VEC>(in, item, part, k_split, slot, owner, rows_of, epilogue);
  }
}

}  // namespace lithos
