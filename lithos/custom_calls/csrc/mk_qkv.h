// Megakernel task kind 1: RMSNorm -> the Q, K and V rows of one KV group -> RoPE -> K and V appended
// to the layer's cache slots (the fused twin is qkv_rope.cu): slot = position in a linear cache
// (positions past its end dropped), position % slots in a ring.
//
// Row groups (mk_weight_rows.h, qkv_rows) hold two rotary pairs of one head, so a warp holds both
// halves of each rotation. A task covers row groups of one KV group only, and the attention of that
// group waits for exactly those tasks.
#pragma once

#include "mk_matvec.h"
#include "mk_weight_rows.h"

namespace lithos {
namespace mk {

template <int TMAX>
__device__ bool qkv_task(const Args& a, const Task& task, int index) {
  __shared__ float rms_scale[TMAX];
  const int layer = task.layer;
  const int group = a.heads / a.kv_heads, half = a.head_dim / 2;
  auto rows_of = [&](int unit, PackedRow (&rows)[kRowsPerWarp]) { qkv_rows<kAttentionFormat>(a, layer, unit, rows); };
  const TokenRows in{layer_input(a, layer), a.attn_norm + static_cast<size_t>(layer) * a.hidden, a.tokens, a.hidden};
  const size_t cache_layer = static_cast<size_t>(layer) * a.kv_heads * a.slots * a.head_dim;
  if (!stream_row_groups<kAttentionFormat, TMAX>(
          a, task, index, in, rows_of,
      [&](const TokenRows& staged) { block_rms_scale<TMAX, 8, true>(staged, a.eps, rms_scale); },
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        const QkvRowGroup g = qkv_row_group(a, unit);
        const bool is_q = g.slot < group, is_v = g.slot == group + 1;
        // Lane t writes token t's values (a compile-time index into acc keeps it in registers).
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
          if (t < a.tokens && lane_id() == t) {
            const int position = a.positions[t];
#pragma unroll
            for (int p = 0; p < 2; ++p) {
              const int j = g.first_pair + p;
              float lo = acc[2 * p][t] * rms_scale[t];
              float hi = acc[2 * p + 1][t] * rms_scale[t];
              if (!is_v) {
                // The same float32 product as the reference, so both rotate by the same angle.
                const float angle = static_cast<float>(position) * a.inv_freq[j];
                float sin_a, cos_a;
                sincosf(angle, &sin_a, &cos_a);
                const float rotated_lo = lo * cos_a - hi * sin_a;
                hi = hi * cos_a + lo * sin_a;
                lo = rotated_lo;
              }
              if (is_q) {
                bf16_t* out = a.q + (static_cast<size_t>(t) * a.heads + g.kv_head * group + g.slot) * a.head_dim;
                out[j] = float_to_bf16(lo);
                out[j + half] = float_to_bf16(hi);
              } else if (position >= 0 && (a.ring || position < a.slots)) {
                const int at = a.ring ? position % a.slots : position;
                bf16_t* slot = (is_v ? a.v_cache : a.k_cache) + cache_layer +
                               (static_cast<size_t>(g.kv_head) * a.slots + at) * a.head_dim;
                slot[j] = float_to_bf16(lo);
                slot[j + half] = float_to_bf16(hi);
              }
            }
          }
        }
      }))
    return false;
  block_release(a, task.signal_counter);
  return true;
}

}  // namespace mk
}  // namespace lithos
