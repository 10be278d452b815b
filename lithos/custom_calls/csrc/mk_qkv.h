// Megakernel task kind 1: RMSNorm -> the Q, K and V rows of one KV group -> RoPE -> K and V appended
// to the layer's cache slots (the fused twin is qkv_rope.cu): slot = position in a linear cache
// (positions past its end dropped), position % slots in a ring.
//
// Row groups (mk_weight_rows.h, qkv_rows) hold two rotary pairs of one head, so a warp holds both
// halves of each rotation. A task covers row groups of one KV group only, and the attention of that
// group waits for exactly those tasks.
#pragma once

#include "mk_matvec.h"
#include "qkv_epilogue.h"
#include "mk_weight_rows.h"

namespace lithos {
namespace mk {

// Rotary pair j of head `slot` of KV group `kv_head` for token t (rotated already, but for V), where it lands: the
// query head's row of a.q, or the key or value head's cache slot for `position` (none past a linear cache's end).
// The tiled task (mk_tiled_matvec.h) stores through it too.
__device__ __forceinline__ void store_qkv_pair(const Args& a, int layer, int t, int position, const QkvRowGroup& g,
                                               int j, float lo, float hi) {
  const int group = a.heads / a.kv_heads, half = a.head_dim / 2;
  if (g.slot < group) {
    store_pair(a.q + (static_cast<size_t>(t) * a.heads + g.kv_head * group + g.slot) * a.head_dim, j, half, lo, hi);
  } else if (const int at = cache_slot(position, a.slots, a.ring); at >= 0) {
    const size_t cache_layer = static_cast<size_t>(layer) * a.kv_heads * a.slots * a.head_dim;
    store_pair((g.slot == group + 1 ? a.v_cache : a.k_cache) + cache_layer +
                   (static_cast<size_t>(g.kv_head) * a.slots + at) * a.head_dim,
               j, half, lo, hi);
  }
}

template <int TMAX>
__device__ bool qkv_task(const Args& a, const Task& task, int index) {
  __shared__ float rms_scale[TMAX];
  const int layer = task.layer;
  const int group = a.heads / a.kv_heads;
  auto rows_of = [&](int unit, PackedRow (&rows)[kRowsPerWarp]) { qkv_rows<kAttentionFormat>(a, layer, unit, rows); };
  const TokenRows in{layer_input(a, layer), a.attn_norm + static_cast<size_t>(layer) * a.hidden, a.tokens, a.hidden};
  if (!stream_row_groups<kAttentionFormat, TMAX>(
          a, task, index, in, rows_of,
      [&](const TokenRows& staged) { block_rms_scale<TMAX, 8, true>(staged, a.eps, rms_scale); },
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        const QkvRowGroup g = qkv_row_group(a, unit);
        rope_pairs<TMAX>(acc, rms_scale, a.tokens, a.positions, a.inv_freq, g.first_pair, g.slot != group + 1,
                         [&](int t, int position, int j, float lo, float hi) {
          store_qkv_pair(a, layer, t, position, g, j, lo, hi);
        });
      }))
    return false;
  block_release(a, task.signal_counter);
  return true;
}

}  // namespace mk
}  // namespace lithos
