// Keys and values into their cache slot, as lithos/kv_cache.py stores them: bf16, or E4M3 codes of value / scale
// (the row's scale, set at prefill; like the reference, values beyond 448 * scale saturate).
#pragma once

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

}  // namespace lithos
