// Which weight rows a megakernel matvec task reads: the map from a task's row group to its 4 rows,
// for each task kind. The task headers (mk_qkv.h, mk_gate_up.h, mk_projection.h, mk_lm_head.h) and the
// lane ring (mk_lane_ring.h, which copies the rows ahead of the dot products) both use it, so the two
// can never disagree.
#pragma once

#include "mk_common.h"

namespace lithos {
namespace mk {

// Q/K/V (kOpQkv): row groups are numbered KV group by KV group: the group's query heads, then its key
// head, then its value head, each head_dim / 4 row groups of two rotary pairs (rows j, j + d/2, j + 1,
// j + 1 + d/2), so a warp holds both halves of each rotation.
struct QkvRowGroup {
  int kv_head;
  int slot;        // < group: the group's query head `slot`; group: its key head; group + 1: its value head
  int first_pair;  // rotary pairs first_pair and first_pair + 1
};

__device__ __forceinline__ QkvRowGroup qkv_row_group(const Args& a, int unit) {
  const int per_head = a.head_dim / 4;
  const int per_group = (a.heads / a.kv_heads + 2) * per_head;
  const int within = unit % per_group;
  return {unit / per_group, within / per_head, (within % per_head) * 2};
}

// Row r (0..3) of row group `unit` of `layer` (see above), in the format F its matrix is stored in.
// Every map below comes as one row and as the group's 4 rows (what a warp's dot products and its lane
// ring's copies read), the second made of the first.
template <WeightFormat F>
__device__ __forceinline__ PackedRow qkv_row(const Args& a, int layer, int unit, int r) {
  const int group = a.heads / a.kv_heads, half = a.head_dim / 2;
  const QkvRowGroup g = qkv_row_group(a, unit);
  const int in_head = g.first_pair + r / 2 + (r % 2) * half;
  if (g.slot < group) return packed_row<F>(a.wq, layer, 0, (g.kv_head * group + g.slot) * a.head_dim + in_head);
  return packed_row<F>(g.slot == group ? a.wk : a.wv, layer, 0, g.kv_head * a.head_dim + in_head);
}

template <WeightFormat F>
__device__ __forceinline__ void qkv_rows(const Args& a, int layer, int unit, PackedRow (&rows)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = qkv_row<F>(a, layer, unit, r);
}

// Gate/up (kOpGateUp): a row group is two outputs f, f + 1 as (gate f, up f, gate f + 1, up f + 1),
// so the product is formed in registers.
constexpr int kGatedPerGroup = kRowsPerWarp / 2;

// Row r of row group `unit` of `layer`: gate f, up f, gate f + 1, up f + 1 for r = 0..3.
template <WeightFormat F>
__device__ __forceinline__ PackedRow gate_up_row(const Args& a, int layer, int unit, int r) {
  const int f = min(unit * kGatedPerGroup + r / 2, a.ffn - 1);  // past the end: the last row again, unused
  return packed_row<F>(r % 2 == 0 ? a.w_gate : a.w_up, layer, 0, f);
}

template <WeightFormat F>
__device__ __forceinline__ void gate_up_rows(const Args& a, int layer, int unit, PackedRow (&rows)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = gate_up_row<F>(a, layer, unit, r);
}

// Input size of the O (kOpOProj) or down projection.
__device__ __forceinline__ int projection_inputs(const Args& a, int op) {
  return op == kOpOProj ? a.heads * a.head_dim : a.ffn;
}

// Row r of row group `unit` of `layer`: output row 4 unit + r.
template <WeightFormat F>
__device__ __forceinline__ PackedRow projection_row(const Args& a, int op, int layer, int unit, int r) {
  // rows past the end re-read the last row, results unused
  return packed_row<F>(op == kOpOProj ? a.wo : a.w_down, layer, 0, min(unit * kRowsPerWarp + r, a.hidden - 1));
}

template <WeightFormat F>
__device__ __forceinline__ void projection_rows(const Args& a, int op, int layer, int unit,
                                                PackedRow (&rows)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = projection_row<F>(a, op, layer, unit, r);
}

// LM head row r of row group `unit`: vocabulary entry 4 unit + r.
template <WeightFormat F>
__device__ __forceinline__ PackedRow head_row(const Args& a, int unit, int r) {
  // rows past the end re-read the last row, results unused
  return packed_row<F>(a.lm_head, 0, 0, min(unit * kRowsPerWarp + r, a.vocab - 1));
}

template <WeightFormat F>
__device__ __forceinline__ void head_rows(const Args& a, int unit, PackedRow (&rows)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = head_row<F>(a, unit, r);
}

}  // namespace mk
}  // namespace lithos
