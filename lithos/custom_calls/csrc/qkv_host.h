// Host-side pieces the Q/K/V handlers share (qkv_rope.cu and its packed twin in matvec_packed.h): the Q/K/V
// projection biases (Qwen2's, Qwen2-MoE's), three bf16 arrays `[layers, rows]` that travel as empty arrays when a
// model has none (the epilogue, qkv_epilogue.h's rope_pairs, adds a head's values to its projections before the
// rotation, so one launch does what the split form did in three launches and an XLA fusion), and the checks of
// the rotation's inputs.
#pragma once

#include <cstdint>
#include <string>

#include "ffi_util.h"
#include "portable.h"

namespace lithos {

struct QkvBiases {
  const bf16_t* q = nullptr;  // [layers, heads * head_dim], or nullptr: no biases
  const bf16_t* k = nullptr;  // [layers, kv_heads * head_dim]
  const bf16_t* v = nullptr;
  int64_t q_layer_stride = 0, kv_layer_stride = 0;

  // The head_dim values of head `head` of Q (kind 0), K (1) or V (2) at `layer`; nullptr when there are none.
  __device__ __forceinline__ const bf16_t* head(int64_t layer, int kind, int head, int head_dim) const {
    if (q == nullptr) return nullptr;
    const bf16_t* base = kind == 0 ? q + layer * q_layer_stride : (kind == 1 ? k : v) + layer * kv_layer_stride;
    return base + static_cast<size_t>(head) * head_dim;
  }
};

// The biases from their buffers: all three empty (none), or each `[layers, rows]` (or `[rows]`, shared by every
// layer) with Q's `q_rows` and K's and V's `kv_rows` a layer, at least `layers` layers.
inline ffi::Error qkv_biases(const std::string& op, const ffi::Buffer<ffi::BF16>& bq, const ffi::Buffer<ffi::BF16>& bk,
                             const ffi::Buffer<ffi::BF16>& bv, int64_t q_rows, int64_t kv_rows, int64_t layers,
                             QkvBiases& out) {
  out = QkvBiases{};
  if (bq.element_count() == 0 && bk.element_count() == 0 && bv.element_count() == 0) return ffi::Error::Success();
  auto fits = [&](const ffi::Buffer<ffi::BF16>& b, int64_t rows) {
    auto d = b.dimensions();
    return d.size() >= 1 && d.back() == rows && static_cast<int64_t>(b.element_count()) % rows == 0 &&
           (layer_stride(b) == 0 || static_cast<int64_t>(b.element_count()) / rows >= layers);
  };
  if (!fits(bq, q_rows) || !fits(bk, kv_rows) || !fits(bv, kv_rows) || layer_stride(bk) != layer_stride(bv))
    return invalid(op + ": biases bq " + shape_string(bq.dimensions()) + ", bk " + shape_string(bk.dimensions()) +
                   ", bv " + shape_string(bv.dimensions()) + " must be [layers, " + std::to_string(q_rows) +
                   "] and [layers, " + std::to_string(kv_rows) + "], stacked alike");
  out.q = bq.typed_data();
  out.k = bk.typed_data();
  out.v = bv.typed_data();
  out.q_layer_stride = layer_stride(bq);
  out.kv_layer_stride = layer_stride(bk);
  return ffi::Error::Success();
}

// q [tokens, heads, head_dim] against the projections' `tokens` and `head_dim`, and the rotation's inputs:
// inv_freq [head_dim / 2], positions [tokens].
inline ffi::Error check_rotary_inputs(const std::string& op, ffi::Span<const int64_t> qd, int tokens, int head_dim,
                                      const ffi::Buffer<ffi::F32>& inv_freq, const ffi::Buffer<ffi::S32>& positions) {
  if (qd[2] != head_dim || qd[0] != tokens)
    return invalid(op + ": q " + shape_string(qd) + " does not fit the cache's head_dim and h's tokens");
  if (inv_freq.element_count() != static_cast<size_t>(head_dim / 2) ||
      positions.element_count() != static_cast<size_t>(tokens))
    return invalid(op + ": inv_freq must be [head_dim/2] and positions [tokens]");
  return ffi::Error::Success();
}

}  // namespace lithos
