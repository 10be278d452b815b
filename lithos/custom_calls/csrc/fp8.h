// FP8 E4M3 ("fn": bias 7, no infinity, 0x7F/0xFF are NaN) for the 8-bit KV cache (lithos/quant/kv.py):
// encoding a float on the way in, and reading eight codes per 8-byte load on the way out.
//
// Reading is the hot path (every key and value of a long context), so it avoids conversion
// instructions (16 per SM per clock on Hopper) and uses three integer ops per element: the code's
// seven magnitude bits are moved to f32 bits 26..20 and its sign to bit 31. That f32 is the E4M3
// value times 2^-120, uniformly: E4M3 normals become f32 normals and E4M3 subnormals f32 subnormals
// (kernels must not be built with flush-to-zero; the build never asks for it). Callers fold 2^120
// and the per-head scale into the query and the output, so no element is multiplied.
#pragma once

#include <cstdint>

#include "portable.h"

namespace lithos {

// The raw E4M3 value times 2^-kE4m3RawExp is what `e4m3_raw` returns.
constexpr int kE4m3RawExp = 120;

// Byte i (0..3, compile-time) of `word` read as an E4M3 code: its value times 2^-120. NaN codes read
// as 480 * 2^-120; the cache writer never stores one for a finite input (it saturates at 448).
template <int I>
__device__ __forceinline__ float e4m3_raw(uint32_t word) {
  // Byte I to the top (sign at bit 31), arithmetic shift by 4 (magnitude to bits 26..20, sign copies
  // above it), then clear the copies.
  const int32_t top = static_cast<int32_t>(word << (24 - 8 * I));
  return __uint_as_float(static_cast<uint32_t>(top >> 4) & 0x87f00000u);
}

// Eight consecutive codes from one 8-byte load; element e is e4m3 value * 2^-120.
struct E4m3Vec8 {
  uint32_t word[2];
  __device__ __forceinline__ float operator[](int e) const {
    const uint32_t w = word[e / 4];
    switch (e % 4) {  // e is a compile-time constant in unrolled loops: the switch folds away
      case 0: return e4m3_raw<0>(w);
      case 1: return e4m3_raw<1>(w);
      case 2: return e4m3_raw<2>(w);
      default: return e4m3_raw<3>(w);
    }
  }
};

#if defined(LITHOS_HIP)
typedef uint32_t u32x2_t __attribute__((ext_vector_type(2)));
#endif

// Cache rows are read once per step: streaming loads, as the bf16 cache's.
__device__ __forceinline__ E4m3Vec8 load_e4m3_streaming(const uint8_t* p) {
  E4m3Vec8 out;
#if defined(LITHOS_HIP)
  u32x2_t v = __builtin_nontemporal_load(reinterpret_cast<const u32x2_t*>(p));
  out.word[0] = v.x;
  out.word[1] = v.y;
#else
  uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
  out.word[0] = v.x;
  out.word[1] = v.y;
#endif
  return out;
}

// f32 -> E4M3 code, rounded to nearest even and saturated at +-448, as the reference
// (`jnp.clip(x, -448, 448).astype(float8_e4m3fn)`): infinities saturate, NaN stays NaN, -0 keeps its sign.
__device__ __forceinline__ uint8_t float_to_e4m3(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  const float magnitude = fminf(__uint_as_float(bits & 0x7fffffffu), 448.0f);
  if (magnitude < 0.015625f) {
    // Below 2^-6 the codes are steps of 2^-9; rintf rounds half to even. 8 steps is 2^-6, whose code
    // (exponent 1, mantissa 0) is 8 as well.
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(rintf(magnitude * 512.0f)));
  }
  uint32_t m = __float_as_uint(magnitude);
  m += 0x7ffffu + ((m >> 20) & 1u);  // keep 3 mantissa bits, ties to even; a carry bumps the exponent
  const uint32_t exponent = (m >> 23) - 120u;  // f32 bias 127 -> E4M3 bias 7
  return static_cast<uint8_t>(sign | (exponent << 3) | ((m >> 20) & 7u));
}

}  // namespace lithos
