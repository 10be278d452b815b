// Host-side helpers shared by the FFI handlers: argument checks that return ffi::Error with a
// message, optional buffers, and the compile-time token-count buckets kernels are instantiated for.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "portable.h"

namespace lithos {

// Decode kernels take 1..kMaxTokens query positions: one decode step, or k drafts + 1 to verify.
constexpr int kMaxTokens = 16;

// An absent optional input travels as an empty array: its pointer becomes nullptr.
template <ffi::DataType DT>
inline auto optional_data(const ffi::Buffer<DT>& buffer) -> decltype(buffer.typed_data()) {
  return buffer.element_count() == 0 ? nullptr : buffer.typed_data();
}

inline ffi::Error invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("lithos: " + message);
}

inline std::string shape_string(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Stacked per-layer weights are [layers, ...]: elements from one layer to the next. A leading axis
// of 1 is one array shared by every layer (stride 0).
template <ffi::DataType DT>
inline int64_t layer_stride(const ffi::Buffer<DT>& stacked) {
  auto dims = stacked.dimensions();
  if (dims.size() == 0 || dims[0] <= 1) return 0;
  return static_cast<int64_t>(stacked.element_count()) / dims[0];
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Calls f(std::integral_constant<int, TMAX>) with TMAX the smallest of 1, 2, 4, 8, 16 that holds
// `tokens`: five instantiations cover every count, padded positions are skipped at run time.
// LITHOS_TWO_BUCKETS (a compile check's build, build.py CHECK_OPT_LEVEL): 1 and 16 only, which instantiate
// every template and code path in two fifths of the compile time; counts 2..16 then run padded to 16.
// LITHOS_ONE_BUCKET=B: bucket B's instantiation alone, for the counts B serves. The megakernel is built a library
// a bucket (megakernel/kernel.py, WeightFormats.variant): a program compiles only the buckets it runs, and a build
// of all five is five compiles side by side rather than one five times as long.
template <class F>
inline ffi::Error with_token_bucket(int64_t tokens, F&& f) {
#ifdef LITHOS_ONE_BUCKET
  constexpr int kBucket = LITHOS_ONE_BUCKET;
  static_assert(kBucket == 1 || kBucket == 2 || kBucket == 4 || kBucket == 8 || kBucket == 16,
                "LITHOS_ONE_BUCKET is one of 1, 2, 4, 8, 16");
  if (tokens >= kBucket / 2 + 1 && tokens <= kBucket) return f(std::integral_constant<int, kBucket>{});
  return invalid("this build holds the kernels for " + std::to_string(kBucket / 2 + 1) + ".." +
                 std::to_string(kBucket) + " query positions only, got " + std::to_string(tokens) +
                 "; call the build of that count's bucket");
#else
  if (tokens == 1) return f(std::integral_constant<int, 1>{});
#if !LITHOS_TWO_BUCKETS
  if (tokens == 2) return f(std::integral_constant<int, 2>{});
  if (tokens >= 3 && tokens <= 4) return f(std::integral_constant<int, 4>{});
  if (tokens >= 5 && tokens <= 8) return f(std::integral_constant<int, 8>{});
#endif
  if (tokens >= 2 && tokens <= kMaxTokens) return f(std::integral_constant<int, 16>{});
  return invalid("decode kernels take 1.." + std::to_string(kMaxTokens) + " query positions, got " +
                 std::to_string(tokens) + "; use the reference path for prefill");
#endif
}

// Calls f(std::integral_constant<int, VEC>) with VEC = 8 (16-byte loads) when every row of length
// `row_len` starts 16-byte aligned, else 1: odd sizes stay correct, common sizes stay fast.
template <class F>
inline ffi::Error with_vector_width(int64_t row_len, bool bases_aligned, F&& f) {
  if (row_len % 8 == 0 && bases_aligned) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 1>{});
}

}  // namespace lithos
