// MXFP4 in fragment tiles (lithos/quant/tiles.py): a tile's sizes, and a pair of codes as the bf16x2 an mma
// m16n8k16 reads. Shared by the megakernel's tiled gate/up task (mk_gate_up_tiles.h) and the probe that measured
// the layout (benchmarks/probes/mxfp4_fragments.cu).
#pragma once

#include <cstdint>

namespace lithos {
namespace tiles {

constexpr int kTileRows = 16, kTileInputs = 64, kTileBytes = 512, kTileScaleBytes = 32;
constexpr uint32_t kPairMask = 0x81C081C0u;  // a bf16x2 of value * 2^-126: bits 6..8 and 15 of each half

// Pair P of a codes word as a bf16x2 of value * 2^-126 (lithos/quant/tiles.py PAIR_BITS): pair 0 in place,
// pairs 1 and 2 three and six places lower, pair 3 in the bits left over (10, 11 -> 6, 7; 13 -> 8; 14 -> 15).
template <int P>
__host__ __device__ __forceinline__ uint32_t decode_pair(uint32_t w) {
  if constexpr (P == 0) return w & kPairMask;
  if constexpr (P == 1) return (w << 3) & kPairMask;
  if constexpr (P == 2) return (w << 6) & kPairMask;
  return ((w >> 4) & 0x00C000C0u) | ((w >> 5) & 0x01000100u) | ((w << 1) & 0x80008000u);
}

}  // namespace tiles
}  // namespace lithos
