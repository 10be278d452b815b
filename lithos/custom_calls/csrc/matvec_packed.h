// The fused decode projections over packed weights (lithos.quant formats, dequantised in registers by
// packed.h), for 1..16 tokens: the same fusions as the bf16 kernels.
//
//   LithosPackedMatvec_<format>:        y = residual + RMSNorm?(x) @ W.T   (bf16, or f32 for an LM head)
//   LithosPackedGateUpSilu_<format>:    y = silu(xn @ Wg.T) * (xn @ Wu.T)
//   LithosPackedQkvRopeAppend_<format>: RMSNorm -> Q, K, V -> RoPE on Q and K -> K, V into the cache
//   LithosPackedQkvProject_<format>:    RMSNorm -> Q, K, V, stored f32 (per-head norms follow: qk_norm_rope.cu)
//
// One source per format (matvec_packed_<format>.cu) instantiates these templates and defines its
// four handlers, so the formats build in parallel and a model builds only the formats it holds.
// Weights arrive as planes (data, scales, mins) stacked [layers, ...] with a device scalar `layer`.
// The RMSNorm factor multiplies the dot products in the epilogue, so normalised activations never
// exist in memory.
#pragma once

#include "cache_store.h"
#include "ffi_util.h"
#include "packed.h"
#include "portable.h"
#include "qkv_host.h"
#include "qkv_epilogue.h"
#include "rowdot.h"

namespace lithos {
namespace packed_matvec {

struct PackedMatvecArgs {
  const bf16_t* x;         // [tokens, n_in]
  PackedWeight w;          // [layers, n_out, n_in] (the gate rows in the gated variant)
  PackedWeight w_up;       // gated variant only
  const int32_t* layer;    // [] device scalar
  const bf16_t* norm_w;    // [layers, n_in] or nullptr: fuse RMSNorm of x
  int64_t norm_layer_stride;
  const bf16_t* residual;  // [tokens, n_out] or nullptr
  void* y;                 // [tokens, n_out], bf16 or f32
  bool y_f32;
  int tokens;
  int k_split;
  float eps;
};

template <WeightFormat F, int TMAX, bool GATED>
__global__ void __launch_bounds__(kMatvecThreads) packed_matvec_kernel(PackedMatvecArgs a) {
  constexpr int kOutsPerWarp = GATED ? kRowsPerWarp / 2 : kRowsPerWarp;
  __shared__ float rms_scale[TMAX];
  const int64_t layer = *a.layer;
  const int n_out = a.w.n_out, n_in = a.w.n_in;
  const TokenRows in{a.x, a.norm_w ? a.norm_w + layer * a.norm_layer_stride : nullptr, a.tokens, n_in};
  if (in.norm_w != nullptr) block_rms_scale<TMAX, 8>(in, a.eps, rms_scale);

  const int units = (n_out + kOutsPerWarp - 1) / kOutsPerWarp;
  for_each_packed_row_group<F, TMAX>(
      units, a.k_split,
      [&](int unit, PackedRow (&rows)[kRowsPerWarp], TokenRows& tokens) {
        tokens = in;
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          // Rows past the end re-read the last row: valid memory, results discarded.
          const int out = min(unit * kOutsPerWarp + (GATED ? r / 2 : r), n_out - 1);
          rows[r] = packed_row<F>((GATED && r % 2 == 1) ? a.w_up : a.w, layer, 0, out);
        }
      },
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        for_each_token<TMAX>(acc, a.tokens, [&](int t, const float (&sums)[kRowsPerWarp]) {
          const float scale = in.norm_w != nullptr ? rms_scale[t] : 1.0f;
#pragma unroll
          for (int j = 0; j < kOutsPerWarp; ++j) {
            const int out = unit * kOutsPerWarp + j;
            if (out < n_out) {
              const size_t at = static_cast<size_t>(t) * n_out + out;
              float value = GATED ? silu(sums[2 * j] * scale) * (sums[2 * j + 1] * scale) : sums[j] * scale;
              if (a.residual != nullptr) value += bf16_to_float(a.residual[at]);
              if (a.y_f32)
                static_cast<float*>(a.y)[at] = value;
              else
                static_cast<bf16_t*>(a.y)[at] = float_to_bf16(value);
            }
          }
        });
      });
}

template <WeightFormat F, bool GATED>
ffi::Error launch_packed_matvec(gpuStream_t stream, const PackedMatvecArgs& a) {
  if (!aligned16(a.x) || !packed_aligned(a.w) || (GATED && !packed_aligned(a.w_up)) ||
      (a.norm_w != nullptr && !aligned16(a.norm_w)))
    return invalid("packed matvec: inputs must be 16-byte aligned");
  const int outs_per_warp = GATED ? kRowsPerWarp / 2 : kRowsPerWarp;
  return with_packed_token_bucket(a.tokens, [&](auto tmax) {
    constexpr auto kernel = packed_matvec_kernel<F, decltype(tmax)::value, GATED>;
    const RowGroupGrid grid = packed_grid((a.w.n_out + outs_per_warp - 1) / outs_per_warp, a.w.n_in,
                                          resident_blocks_per_unit<kernel>(kMatvecThreads));
    PackedMatvecArgs args = a;
    args.k_split = grid.k_split;
    kernel<<<grid.blocks, kMatvecThreads, 0, stream>>>(args);
    return launch_status(GATED ? "packed gate_up_silu" : "packed matvec");
  });
}

// Shapes shared by both variants: everything but the weights.
inline ffi::Error check_packed_inputs(const char* op, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::S32>& layer,
                               ffi::Buffer<ffi::BF16>& norm_w, PackedMatvecArgs& a) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return invalid(std::string(op) + ": x must be [tokens, in], got " + shape_string(xd));
  if (layer.element_count() != 1) return invalid(std::string(op) + ": layer must be a scalar");
  if (norm_w.element_count() != 0 && (norm_w.dimensions().size() != 2 || norm_w.dimensions()[1] != xd[1]))
    return invalid(std::string(op) + ": norm weight " + shape_string(norm_w.dimensions()) +
                   " does not match in=" + std::to_string(xd[1]));
  a.x = x.typed_data();
  a.layer = layer.typed_data();
  a.norm_w = optional_data(norm_w);
  a.norm_layer_stride = a.norm_w ? layer_stride(norm_w) : 0;
  a.tokens = static_cast<int>(xd[0]);
  return ffi::Error::Success();
}

template <WeightFormat F>
ffi::Error packed_matvec_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer data,
                              ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::BF16> norm_w, ffi::Buffer<ffi::BF16> residual,
                              ffi::Result<ffi::AnyBuffer> y, float eps) {
  constexpr int32_t format = static_cast<int32_t>(F);
  PackedMatvecArgs a{};
  if (ffi::Error err = check_packed_inputs("packed matvec", x, layer, norm_w, a); err.failure()) return err;
  if (ffi::Error err = packed_weight("packed matvec", format, data, scales, mins, 1, x.dimensions()[1], a.w);
      err.failure())
    return err;
  auto yd = y->dimensions();
  a.y_f32 = y->element_type() == ffi::DataType::F32;
  if (yd.size() != 2 || yd[0] != a.tokens || yd[1] != a.w.n_out ||
      (!a.y_f32 && y->element_type() != ffi::DataType::BF16))
    return invalid("packed matvec: output must be [tokens, out] in bf16 or f32");
  a.y = y->untyped_data();
  a.residual = optional_data(residual);
  if (a.residual != nullptr && residual.element_count() != y->element_count())
    return invalid("packed matvec: residual " + shape_string(residual.dimensions()) + " must be [tokens, out]");
  a.eps = eps;
  return launch_packed_matvec<F, false>(stream, a);
}

template <WeightFormat F>
ffi::Error packed_gate_up_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer gate_data,
                               ffi::AnyBuffer gate_scales, ffi::AnyBuffer gate_mins, ffi::AnyBuffer up_data,
                               ffi::AnyBuffer up_scales, ffi::AnyBuffer up_mins, ffi::Buffer<ffi::S32> layer,
                               ffi::Buffer<ffi::BF16> norm_w, ffi::Result<ffi::Buffer<ffi::BF16>> y, float eps) {
  constexpr int32_t format = static_cast<int32_t>(F);
  PackedMatvecArgs a{};
  const char* op = "packed gate_up_silu";
  if (ffi::Error err = check_packed_inputs(op, x, layer, norm_w, a); err.failure()) return err;
  const int64_t n_in = x.dimensions()[1];
  if (ffi::Error err = packed_weight(op, format, gate_data, gate_scales, gate_mins, 1, n_in, a.w); err.failure())
    return err;
  if (ffi::Error err = packed_weight(op, format, up_data, up_scales, up_mins, 1, n_in, a.w_up); err.failure())
    return err;
  if (a.w_up.n_out != a.w.n_out || a.w_up.data_outer != a.w.data_outer)
    return invalid("packed gate_up_silu: w_up " + shape_string(up_data.dimensions()) + " must match w_gate " +
                   shape_string(gate_data.dimensions()));
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != a.tokens || yd[1] != a.w.n_out)
    return invalid("packed gate_up_silu: output must be [tokens, ffn]");
  a.y = y->typed_data();
  a.eps = eps;
  return launch_packed_matvec<F, true>(stream, a);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm -> Q, K, V -> RoPE -> cache append, as csrc/qkv_rope.cu does for bf16: a warp owns two
// rotary pairs of one head, rows (j, j + d/2, j + 1, j + 1 + d/2), so RoPE happens in registers.
// ---------------------------------------------------------------------------------------------

struct PackedQkvArgs {
  const bf16_t* h;           // [tokens, hidden]
  const bf16_t* norm_w;      // [layers, hidden]
  int64_t norm_layer_stride;
  PackedWeight wq, wk, wv;   // [layers, heads * head_dim | kv_heads * head_dim, hidden]
  const float* inv_freq;     // [head_dim / 2]
  const int32_t* positions;  // [tokens]
  const int32_t* layer;      // [] device scalar
  bf16_t* q;                 // [tokens, heads, head_dim]
  bf16_t* k_cache;           // [layers, 1, kv_heads, max_len, head_dim], aliased
  bf16_t* v_cache;
  float* projected;          // LithosPackedQkvProject's output [tokens, heads + 2 kv_heads, head_dim] (f32)
  QkvBiases biases;          // or none (qkv_host.h)
  int tokens, hidden, heads, kv_heads, head_dim, max_len;
  bool ring;  // slot = position % max_len (lithos/kv_cache.py; else positions >= max_len are dropped)
  int k_split;
  float eps;
};

// The Q/K/V row groups after the block's RMSNorm factors: unit u is two rotary pairs (j0, j0 + 1) of head
// u / (head_dim / 4), q heads, then k heads, then v heads; `epilogue(head, first_pair, bias, rms_scale, acc)` gets
// each unit's dot products and its head's bias (or nullptr).
template <WeightFormat F, int TMAX, class Epilogue>
__device__ __forceinline__ void packed_qkv_row_groups(const PackedQkvArgs& a, float* rms_scale, Epilogue epilogue) {
  static_assert(kRowsPerWarp == 4, "a warp owns two rotary pairs");
  const int64_t layer = *a.layer;
  const TokenRows in{a.h, a.norm_w + layer * a.norm_layer_stride, a.tokens, a.hidden};
  block_rms_scale<TMAX, 8>(in, a.eps, rms_scale);

  const int half = a.head_dim / 2;
  const int units_per_head = half / 2;
  const int units = (a.heads + 2 * a.kv_heads) * units_per_head;
  auto head_of = [&](int unit) { return unit / units_per_head; };
  auto first_pair_of = [&](int unit) { return (unit % units_per_head) * 2; };
  auto kv_head_of = [&](int head) {
    return head < a.heads + a.kv_heads ? head - a.heads : head - a.heads - a.kv_heads;
  };

  for_each_packed_row_group<F, TMAX>(
      units, a.k_split,
      [&](int unit, PackedRow (&rows)[kRowsPerWarp], TokenRows& tokens) {
        tokens = in;
        const int head = head_of(unit);
        const bool is_q = head < a.heads, is_v = head >= a.heads + a.kv_heads;
        const PackedWeight& w = is_q ? a.wq : (is_v ? a.wv : a.wk);
        const int row0 = (is_q ? head : kv_head_of(head)) * a.head_dim;
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
          rows[r] = packed_row<F>(w, layer, 0, row0 + first_pair_of(unit) + r / 2 + (r % 2) * half);
      },
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        const int head = head_of(unit);
        const bool is_q = head < a.heads, is_v = head >= a.heads + a.kv_heads;
        const int kind = is_q ? 0 : (is_v ? 2 : 1);
        const bf16_t* bias = a.biases.head(layer, kind, is_q ? head : kv_head_of(head), a.head_dim);
        epilogue(head, first_pair_of(unit), bias, acc);
      });
}

template <WeightFormat F, int TMAX>
__global__ void __launch_bounds__(kMatvecThreads) packed_qkv_rope_kernel(PackedQkvArgs a) {
  __shared__ float rms_scale[TMAX];
  const QkvStore<bf16_t> store = layer_qkv_store<bf16_t>(a.q, a.k_cache, a.v_cache, nullptr, nullptr, *a.layer,
                                                         a.heads, a.kv_heads, a.head_dim, a.max_len, a.ring);
  packed_qkv_row_groups<F, TMAX>(a, rms_scale, [&](int head, int first_pair, const bf16_t* bias,
                                                   const float (&acc)[kRowsPerWarp][TMAX]) {
    const bool rotate = head < a.heads + a.kv_heads;  // Q and K, not V
    rope_pairs<TMAX>(acc, rms_scale, a.tokens, a.positions, a.inv_freq, first_pair, rotate, bias, a.head_dim / 2,
                     [&](int t, int position, int j, float lo, float hi) { store(head, t, position, j, lo, hi); });
  });
}

// The projections (biases added) as they are, for heads normalised before their rotation (qk_norm_rope.cu).
template <WeightFormat F, int TMAX>
__global__ void __launch_bounds__(kMatvecThreads) packed_qkv_project_kernel(PackedQkvArgs a) {
  __shared__ float rms_scale[TMAX];
  const int all_heads = a.heads + 2 * a.kv_heads;
  packed_qkv_row_groups<F, TMAX>(a, rms_scale, [&](int head, int first_pair, const bf16_t* bias,
                                                   const float (&acc)[kRowsPerWarp][TMAX]) {
    rope_pairs<TMAX>(acc, rms_scale, a.tokens, nullptr, a.inv_freq, first_pair, false, bias, a.head_dim / 2,
                     [&](int t, int, int j, float lo, float hi) {
      store_projected_pair(a.projected, all_heads, a.head_dim, head, t, j, lo, hi);
    });
  });
}

// The arguments both packed Q/K/V handlers share: h, the norm, the three weights' planes for `heads` and
// `kv_heads` of `head_dim`, the layer and the biases.
template <WeightFormat F>
ffi::Error packed_projection_args(const std::string& op, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> norm_w,
                                  ffi::AnyBuffer q_data, ffi::AnyBuffer q_scales, ffi::AnyBuffer q_mins,
                                  ffi::AnyBuffer k_data, ffi::AnyBuffer k_scales, ffi::AnyBuffer k_mins,
                                  ffi::AnyBuffer v_data, ffi::AnyBuffer v_scales, ffi::AnyBuffer v_mins,
                                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> bq, ffi::Buffer<ffi::BF16> bk,
                                  ffi::Buffer<ffi::BF16> bv, int heads, int kv_heads, int head_dim, float eps,
                                  PackedQkvArgs& a) {
  constexpr int32_t format = static_cast<int32_t>(F);
  auto hd = h.dimensions();
  if (hd.size() != 2) return invalid(op + ": h must be [tokens, hidden], got " + shape_string(hd));
  a.tokens = static_cast<int>(hd[0]);
  a.hidden = static_cast<int>(hd[1]);
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = head_dim;
  if (a.head_dim % 4 != 0) return invalid(op + ": head_dim must be a multiple of 4, got " + std::to_string(head_dim));
  if (ffi::Error err = packed_weight(op, format, q_data, q_scales, q_mins, 1, a.hidden, a.wq); err.failure())
    return err;
  if (ffi::Error err = packed_weight(op, format, k_data, k_scales, k_mins, 1, a.hidden, a.wk); err.failure())
    return err;
  if (ffi::Error err = packed_weight(op, format, v_data, v_scales, v_mins, 1, a.hidden, a.wv); err.failure())
    return err;
  if (a.wq.n_out != a.heads * a.head_dim || a.wk.n_out != a.kv_heads * a.head_dim || a.wv.n_out != a.wk.n_out)
    return invalid(op + ": wq/wk/wv rows do not fit " + std::to_string(a.heads) + " query and " +
                   std::to_string(a.kv_heads) + " key/value heads of " + std::to_string(a.head_dim));
  if (norm_w.dimensions().size() != 2 || norm_w.dimensions()[1] != a.hidden)
    return invalid(op + ": norm weight " + shape_string(norm_w.dimensions()) + " must be [layers, hidden]");
  if (layer.element_count() != 1) return invalid(op + ": layer must be a scalar");
  a.h = h.typed_data();
  a.norm_w = norm_w.typed_data();
  a.norm_layer_stride = layer_stride(norm_w);
  a.layer = layer.typed_data();
  a.eps = eps;
  if (!aligned16(a.h) || !aligned16(a.norm_w) || !packed_aligned(a.wq) || !packed_aligned(a.wk) ||
      !packed_aligned(a.wv))
    return invalid(op + ": inputs must be 16-byte aligned");
  const int64_t layers = static_cast<int64_t>(norm_w.dimensions()[0]);
  return qkv_biases(op, bq, bk, bv, a.wq.n_out, a.wk.n_out, layers, a.biases);
}

// Launches `kernel_for(tmax)`'s kernel over the Q/K/V row groups with `a`.
template <class KernelFor>
ffi::Error launch_packed_qkv(gpuStream_t stream, const PackedQkvArgs& a, const char* op, KernelFor kernel_for) {
  const int64_t units = int64_t{a.heads + 2 * a.kv_heads} * (a.head_dim / 4);
  return with_packed_token_bucket(a.tokens, [&](auto tmax) {
    constexpr auto kernel = decltype(kernel_for(tmax))::value;
    const RowGroupGrid grid = packed_grid(units, a.hidden, resident_blocks_per_unit<kernel>(kMatvecThreads));
    PackedQkvArgs args = a;
    args.k_split = grid.k_split;
    kernel<<<grid.blocks, kMatvecThreads, 0, stream>>>(args);
    return launch_status(op);
  });
}

template <WeightFormat F>
ffi::Error packed_qkv_rope_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> norm_w,
                                ffi::AnyBuffer q_data, ffi::AnyBuffer q_scales, ffi::AnyBuffer q_mins,
                                ffi::AnyBuffer k_data, ffi::AnyBuffer k_scales, ffi::AnyBuffer k_mins,
                                ffi::AnyBuffer v_data, ffi::AnyBuffer v_scales, ffi::AnyBuffer v_mins,
                                ffi::Buffer<ffi::F32> inv_freq, ffi::Buffer<ffi::S32> positions,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> /*k_cache_in*/,
                                ffi::Buffer<ffi::BF16> /*v_cache_in*/, ffi::Buffer<ffi::BF16> bq,
                                ffi::Buffer<ffi::BF16> bk, ffi::Buffer<ffi::BF16> bv,
                                ffi::Result<ffi::Buffer<ffi::BF16>> q, ffi::Result<ffi::Buffer<ffi::BF16>> k_cache,
                                ffi::Result<ffi::Buffer<ffi::BF16>> v_cache, float eps, bool ring) {
  const std::string op = "packed qkv_rope_append";
  auto cd = k_cache->dimensions();
  auto qd = q->dimensions();
  if (cd.size() != 5 || qd.size() != 3 || cd[1] != 1)
    return invalid(op + ": expected q [tokens, heads, head_dim] and caches [layers, 1, kv_heads, max_len, "
                        "head_dim]; got q " + shape_string(qd) + ", cache " + shape_string(cd));
  PackedQkvArgs a{};
  if (ffi::Error err = packed_projection_args<F>(op, h, norm_w, q_data, q_scales, q_mins, k_data, k_scales, k_mins,
                                                 v_data, v_scales, v_mins, layer, bq, bk, bv, static_cast<int>(qd[1]),
                                                 static_cast<int>(cd[2]), static_cast<int>(cd[4]), eps, a);
      err.failure())
    return err;
  a.max_len = static_cast<int>(cd[3]);
  a.ring = ring;
  if (ffi::Error err = check_rotary_inputs(op, qd, a.tokens, a.head_dim, inv_freq, positions); err.failure())
    return err;
  a.inv_freq = inv_freq.typed_data();
  a.positions = positions.typed_data();
  a.q = q->typed_data();
  a.k_cache = k_cache->typed_data();
  a.v_cache = v_cache->typed_data();
  return launch_packed_qkv(stream, a, "packed qkv_rope_append", [](auto tmax) {
    return std::integral_constant<decltype(&packed_qkv_rope_kernel<F, 1>),
                                  packed_qkv_rope_kernel<F, decltype(tmax)::value>>{};
  });
}

template <WeightFormat F>
ffi::Error packed_qkv_project_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> norm_w,
                                   ffi::AnyBuffer q_data, ffi::AnyBuffer q_scales, ffi::AnyBuffer q_mins,
                                   ffi::AnyBuffer k_data, ffi::AnyBuffer k_scales, ffi::AnyBuffer k_mins,
                                   ffi::AnyBuffer v_data, ffi::AnyBuffer v_scales, ffi::AnyBuffer v_mins,
                                   ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> bq, ffi::Buffer<ffi::BF16> bk,
                                   ffi::Buffer<ffi::BF16> bv, ffi::Result<ffi::Buffer<ffi::F32>> projected,
                                   float eps) {
  const std::string op = "packed qkv_project";
  auto pd = projected->dimensions();
  auto qdims = q_data.dimensions(), kdims = k_data.dimensions();
  // The rows of Q and K from their data planes ([layers, rows, ...]); PackedWeight checks them against the rest.
  const int64_t head_dim = pd.size() == 3 ? pd[2] : 0;
  if (pd.size() != 3 || head_dim == 0 || qdims.size() < 2 || kdims.size() < 2 || qdims[1] % head_dim != 0 ||
      kdims[1] % head_dim != 0 || pd[1] != (qdims[1] + 2 * kdims[1]) / head_dim)
    return invalid(op + ": the output " + shape_string(pd) + " must be [tokens, heads + 2 kv_heads, head_dim] for " +
                   "Q and K data planes " + shape_string(qdims) + " and " + shape_string(kdims));
  PackedQkvArgs a{};
  if (ffi::Error err = packed_projection_args<F>(op, h, norm_w, q_data, q_scales, q_mins, k_data, k_scales, k_mins,
                                                 v_data, v_scales, v_mins, layer, bq, bk, bv,
                                                 static_cast<int>(qdims[1] / head_dim),
                                                 static_cast<int>(kdims[1] / head_dim), static_cast<int>(head_dim),
                                                 eps, a);
      err.failure())
    return err;
  if (pd[0] != a.tokens) return invalid(op + ": the output " + shape_string(pd) + " does not have h's tokens");
  a.projected = projected->typed_data();
  return launch_packed_qkv(stream, a, "packed qkv_project", [](auto tmax) {
    return std::integral_constant<decltype(&packed_qkv_project_kernel<F, 1>),
                                  packed_qkv_project_kernel<F, decltype(tmax)::value>>{};
  });
}

}  // namespace packed_matvec
}  // namespace lithos


// The Q/K/V handlers' weight operands (data, scales, mins or empty, for wq, wk, wv) and their biases (bf16
// [layers, rows] or empty).
#define LITHOS_PACKED_QKV_PLANES                                                                          \
  .Arg<xla::ffi::AnyBuffer>()       /* wq data */                                                        \
      .Arg<xla::ffi::AnyBuffer>()   /* wq scales */                                                      \
      .Arg<xla::ffi::AnyBuffer>()   /* wq mins or empty */                                               \
      .Arg<xla::ffi::AnyBuffer>()   /* wk data */                                                        \
      .Arg<xla::ffi::AnyBuffer>()   /* wk scales */                                                      \
      .Arg<xla::ffi::AnyBuffer>()   /* wk mins or empty */                                               \
      .Arg<xla::ffi::AnyBuffer>()   /* wv data */                                                        \
      .Arg<xla::ffi::AnyBuffer>()   /* wv scales */                                                      \
      .Arg<xla::ffi::AnyBuffer>()   /* wv mins or empty */
#define LITHOS_QKV_BIAS_ARGS                                                                              \
  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()     /* bq [layers, rows] or empty */                          \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* bk or empty */                                         \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* bv or empty */

// Defines the four handlers of one format: LithosPackedMatvec_<SUFFIX>, LithosPackedGateUpSilu_<SUFFIX>,
// LithosPackedQkvRopeAppend_<SUFFIX> and LithosPackedQkvProject_<SUFFIX>.
#define LITHOS_PACKED_MATVEC_HANDLERS(FORMAT, SUFFIX)                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosPackedMatvec_##SUFFIX,                                                  \
                                lithos::packed_matvec::packed_matvec_impl<lithos::WeightFormat::FORMAT>,      \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<gpuStream_t>>()                             \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* x */                          \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w data */                     \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w scales */                   \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w mins or empty */            \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  /* layer */                      \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* norm weight or empty */       \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* residual or empty */          \
                                    .Ret<xla::ffi::AnyBuffer>()              /* y, bf16 or f32 */             \
                                    .Attr<float>("eps"),                                                      \
                                {xla::ffi::Traits::kCmdBufferCompatible});                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosPackedGateUpSilu_##SUFFIX,                                              \
                                lithos::packed_matvec::packed_gate_up_impl<lithos::WeightFormat::FORMAT>,     \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<gpuStream_t>>()                             \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* x */                          \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w_gate data */                \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w_gate scales */              \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w_gate mins or empty */       \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w_up data */                  \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w_up scales */                \
                                    .Arg<xla::ffi::AnyBuffer>()              /* w_up mins or empty */         \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  /* layer */                      \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* norm weight or empty */       \
                                    .Ret<xla::ffi::Buffer<xla::ffi::BF16>>() /* y */                          \
                                    .Attr<float>("eps"),                                                      \
                                {xla::ffi::Traits::kCmdBufferCompatible});                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosPackedQkvRopeAppend_##SUFFIX,                                           \
                                lithos::packed_matvec::packed_qkv_rope_impl<lithos::WeightFormat::FORMAT>,    \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<gpuStream_t>>()                             \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* h */                          \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* attention norm weight */      \
                                    LITHOS_PACKED_QKV_PLANES                                                  \
                                    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  /* inv_freq */                   \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  /* positions */                  \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  /* layer */                      \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* k cache, aliased to out 1 */  \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* v cache, aliased to out 2 */  \
                                    LITHOS_QKV_BIAS_ARGS                                                      \
                                    .Ret<xla::ffi::Buffer<xla::ffi::BF16>>() /* q */                          \
                                    .Ret<xla::ffi::Buffer<xla::ffi::BF16>>() /* k cache */                    \
                                    .Ret<xla::ffi::Buffer<xla::ffi::BF16>>() /* v cache */                    \
                                    .Attr<float>("eps")                                                       \
                                    .Attr<bool>("ring"), /* slot = position % max_len */                      \
                                {xla::ffi::Traits::kCmdBufferCompatible});                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosPackedQkvProject_##SUFFIX,                                              \
                                lithos::packed_matvec::packed_qkv_project_impl<lithos::WeightFormat::FORMAT>, \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<gpuStream_t>>()                             \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* h */                          \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() /* attention norm weight */      \
                                    LITHOS_PACKED_QKV_PLANES                                                  \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  /* layer */                      \
                                    LITHOS_QKV_BIAS_ARGS                                                      \
                                    .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  /* projections */                \
                                    .Attr<float>("eps"),                                                      \
                                {xla::ffi::Traits::kCmdBufferCompatible})
