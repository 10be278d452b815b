// Which weight rows a megakernel matvec task reads: the map from a task's row group to its 4 rows,
// for each task kind. The task headers (mk_qkv.h, mk_gate_up.h, mk_projection.h, mk_lm_head.h) and the
// weight pipeline (mk_weight_pipe.h, which copies the rows ahead of the tasks) both use it, so the two
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

// Row r (0..3) of row group `unit` of `layer` (see above). Every map below comes as one row (what a
// copying lane needs: an array indexed at run time would live in local memory) and as the group's
// 4 rows (what a warp's dot products need), the second made of the first.
__device__ __forceinline__ const bf16_t* qkv_row(const Args& a, int layer, int unit, int r) {
  const int group = a.heads / a.kv_heads, half = a.head_dim / 2;
  const size_t head_rows = static_cast<size_t>(a.head_dim) * a.hidden;
  const QkvRowGroup g = qkv_row_group(a, unit);
  const bf16_t* matrix =
      g.slot < group ? a.wq + (static_cast<size_t>(layer) * a.heads + g.kv_head * group + g.slot) * head_rows
                     : (g.slot == group ? a.wk : a.wv) + (static_cast<size_t>(layer) * a.kv_heads + g.kv_head) * head_rows;
  return matrix + static_cast<size_t>(g.first_pair + r / 2 + (r % 2) * half) * a.hidden;
}

__device__ __forceinline__ void qkv_rows(const Args& a, int layer, int unit, const bf16_t* (&rows)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = qkv_row(a, layer, unit, r);
}

// Gate/up (kOpGateUp): a row group is two outputs f, f + 1 as (gate f, up f, gate f + 1, up f + 1),
// so the product is formed in registers.
constexpr int kGatedPerGroup = kRowsPerWarp / 2;

// Row r of row group `unit` of `layer`: gate f, up f, gate f + 1, up f + 1 for r = 0..3.
__device__ __forceinline__ const bf16_t* gate_up_row(const Args& a, int layer, int unit, int r) {
  const size_t layer_offset = static_cast<size_t>(layer) * a.ffn * a.hidden;
  const int f = min(unit * kGatedPerGroup + r / 2, a.ffn - 1);  // past the end: the last row again, unused
  return (r % 2 == 0 ? a.w_gate : a.w_up) + layer_offset + static_cast<size_t>(f) * a.hidden;
}

__device__ __forceinline__ void gate_up_rows(const Args& a, int layer, int unit, const bf16_t* (&rows)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = gate_up_row(a, layer, unit, r);
}

// Input size of the O (kOpOProj) or down projection.
__device__ __forceinline__ int projection_inputs(const Args& a, int op) {
  return op == kOpOProj ? a.heads * a.head_dim : a.ffn;
}

// Row r of row group `unit` of `layer`: output row 4 unit + r.
__device__ __forceinline__ const bf16_t* projection_row(const Args& a, int op, int layer, int unit, int r) {
  const int n_in = projection_inputs(a, op);
  const bf16_t* w = (op == kOpOProj ? a.wo : a.w_down) + static_cast<size_t>(layer) * a.hidden * n_in;
  // rows past the end re-read the last row, results unused
  return w + static_cast<size_t>(min(unit * kRowsPerWarp + r, a.hidden - 1)) * n_in;
}

__device__ __forceinline__ void projection_rows(const Args& a, int op, int layer, int unit,
                                                const bf16_t* (&rows)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = projection_row(a, op, layer, unit, r);
}

// LM head row r of row group `unit`: vocabulary entry 4 unit + r.
__device__ __forceinline__ const bf16_t* head_row(const Args& a, int unit, int r) {
  // rows past the end re-read the last row, results unused
  return a.lm_head + static_cast<size_t>(min(unit * kRowsPerWarp + r, a.vocab - 1)) * a.hidden;
}

__device__ __forceinline__ void head_rows(const Args& a, int unit, const bf16_t* (&rows)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = head_row(a, unit, r);
}

// Input size of a task's weight rows; 0 for a task that reads no weights (attention).
__device__ __forceinline__ int task_weight_columns(const Args& a, int op) {
  switch (op) {
    case kOpQkv:
    case kOpGateUp:
    case kOpHead: return a.hidden;
    case kOpOProj:
    case kOpDown: return projection_inputs(a, op);
    default: return 0;
  }
}

// Row r of row group `unit` of a matvec task of kind `op` in `layer`.
__device__ __forceinline__ const bf16_t* task_weight_row(const Args& a, int op, int layer, int unit, int r) {
  switch (op) {
    case kOpQkv: return qkv_row(a, layer, unit, r);
    case kOpGateUp: return gate_up_row(a, layer, unit, r);
    case kOpHead: return head_row(a, unit, r);
    default: return projection_row(a, op, layer, unit, r);
  }
}

}  // namespace mk
}  // namespace lithos
