// Where the fused Q/K/V kernels (qkv_rope.cu, its packed twin in matvec_packed.h, qk_norm_rope.cu) put their
// results: queries into q, keys and values into their cache slot as lithos/kv_cache.py stores them (bf16, or E4M3
// codes of value / scale: the row's scale, set at prefill; like the reference, values beyond 448 * scale
// saturate), or the unrotated projections a per-head norm comes after.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "fp8.h"
#include "portable.h"
#include "qkv_epilogue.h"

namespace lithos {

// Writes rotary pair j (elements j and j + half) of a key or value row into `slot`, a bf16_t or uint8_t row.
template <class Cache>
__device__ __forceinline__ void store_cache_pair(Cache* slot, int j, int half, float lo, float hi, float scale) {
  if constexpr (std::is_same_v<Cache, uint8_t>) {
    slot[j] = float_to_e4m3(lo / scale);  // a division, as the reference's
    slot[j + half] = float_to_e4m3(hi / scale);
  } else {
    store_pair(slot, j, half, lo, hi);
  }
}

// One layer's destinations of rotated pairs: Q heads' into q [tokens, heads, head_dim], K's and V's into the
// layer's caches, nothing for a position the cache does not keep.
template <class Cache>
struct QkvStore {
  bf16_t* q;
  Cache* k_cache;        // the layer's [kv_heads, slots, head_dim]
  Cache* v_cache;
  const float* k_scale;  // the layer's [kv_heads] (an FP8 cache), else nullptr
  const float* v_scale;
  int heads, kv_heads, head_dim, slots;
  bool ring;  // slot = position % slots (else slot = position, positions >= slots dropped)

  // Pair j (elements j and j + head_dim / 2) of head `head` (Q's, then K's, then V's) for token t at `position`.
  __device__ __forceinline__ void operator()(int head, int t, int position, int j, float lo, float hi) const {
    const int half = head_dim / 2;
    if (head < heads) {
      store_pair(q + (static_cast<size_t>(t) * heads + head) * head_dim, j, half, lo, hi);
    } else if (const int at = cache_slot(position, slots, ring); at >= 0) {
      const bool is_v = head >= heads + kv_heads;
      const int kv_head = is_v ? head - heads - kv_heads : head - heads;
      Cache* slot = (is_v ? v_cache : k_cache) + (static_cast<size_t>(kv_head) * slots + at) * head_dim;
      const float scale = std::is_same_v<Cache, uint8_t> ? (is_v ? v_scale : k_scale)[kv_head] : 1.f;
      store_cache_pair(slot, j, half, lo, hi, scale);
    }
  }
};

// Layer `layer`'s QkvStore over the kernels' stacked caches [layers, 1, kv_heads, slots, head_dim] (bf16_t, or
// uint8_t codes with scales [layers, 1, kv_heads]; nullptr for a bf16 cache).
template <class Cache>
__device__ __forceinline__ QkvStore<Cache> layer_qkv_store(bf16_t* q, void* k_cache, void* v_cache,
                                                           const float* k_scale, const float* v_scale, int64_t layer,
                                                           int heads, int kv_heads, int head_dim, int slots,
                                                           bool ring) {
  const size_t cache_layer = static_cast<size_t>(layer) * kv_heads * slots * head_dim;
  const int64_t scale_layer = layer * kv_heads;
  return {q,
          static_cast<Cache*>(k_cache) + cache_layer,
          static_cast<Cache*>(v_cache) + cache_layer,
          k_scale ? k_scale + scale_layer : nullptr,
          v_scale ? v_scale + scale_layer : nullptr,
          heads,
          kv_heads,
          head_dim,
          slots,
          ring};
}

// Pair j of head `head`'s unrotated projection for token t into `projected` [tokens, all_heads, head_dim] (f32).
__device__ __forceinline__ void store_projected_pair(float* projected, int all_heads, int head_dim, int head, int t,
                                                     int j, float lo, float hi) {
  float* row = projected + (static_cast<size_t>(t) * all_heads + head) * head_dim;
  row[j] = lo;
  row[j + head_dim / 2] = hi;
}

}  // namespace lithos
