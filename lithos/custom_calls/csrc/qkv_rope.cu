// Attention's input half in one pass for 1..16 tokens: RMSNorm(h) -> Q, K, V projections -> rotary
// positions on Q and K -> K and V appended to the layer's cache slots at each token's position.
//
// A warp owns two rotary pairs of one head: rows (j, j + d/2, j + 1, j + 1 + d/2). Both halves of a
// rotation are then in its registers and RoPE needs no shared memory or second pass. The cache is
// updated in place (the handler's cache outputs alias its inputs): linear (slot = position, positions
// past its end dropped) or a ring (lithos/kv_cache.py: slot = position % slots).
// An FP8 cache (lithos/kv_cache.py) gets E4M3 codes of K / scale and V / scale, the scales being the
// row's, set at prefill; like the reference, values beyond 448 * scale saturate. Q/K/V biases (qkv_host.h)
// are added to the projections before the rotation.
// LithosQkvProject is the same pass without the rotation and the cache: for Q and K heads with RMSNorms of
// their own (Qwen3's), which need a whole head's values, and then qk_norm_rope.cu.
#include <string>
#include <type_traits>

#include "cache_store.h"
#include "ffi_util.h"
#include "portable.h"
#include "qkv_host.h"
#include "qkv_epilogue.h"
#include "row_groups.h"
#include "rowdot.h"

namespace lithos {
namespace {

struct QkvArgs {
  const bf16_t* h;         // [tokens, hidden]
  const bf16_t* norm_w;    // [layers, hidden]
  const bf16_t* wq;        // [layers, heads * head_dim, hidden]
  const bf16_t* wk;        // [layers, kv_heads * head_dim, hidden]
  const bf16_t* wv;
  const float* inv_freq;   // [head_dim / 2]
  const int32_t* positions;  // [tokens]
  const int32_t* layer;    // [] device scalar
  int64_t norm_layer_stride, q_layer_stride, kv_layer_stride;
  bf16_t* q;               // [tokens, heads, head_dim]
  void* k_cache;           // [layers, 1, kv_heads, slots, head_dim], aliased: bf16_t, or uint8_t E4M3 codes
  void* v_cache;
  const float* k_scale;    // [layers, 1, kv_heads]: an FP8 cache's scales (nullptr for bf16)
  const float* v_scale;
  float* projected;        // LithosQkvProject's output [tokens, heads + 2 kv_heads, head_dim] (f32)
  QkvBiases biases;        // or none
  int tokens, hidden, heads, kv_heads, head_dim, slots;
  bool ring;    // slot = position % slots (else slot = position, positions >= slots dropped)
  int k_split;  // warps sharing a row group (row_group_grid)
  float eps;
};

// The Q/K/V row groups after the block's RMSNorm factors (into `rms_scale`): unit u is two rotary pairs (j0, j0 + 1)
// of head u / (head_dim / 4), q heads, then k heads, then v heads; `epilogue(head, first_pair, bias, acc)` gets each
// unit's dot products and its head's bias (or nullptr).
template <int TMAX, int VEC, class Epilogue>
__device__ __forceinline__ void qkv_row_groups(const QkvArgs& a, float* rms_scale, Epilogue epilogue) {
  static_assert(kRowsPerWarp == 4, "a warp owns two rotary pairs");
  const int64_t layer = *a.layer;
  const TokenRows in{a.h, a.norm_w + layer * a.norm_layer_stride, a.tokens, a.hidden};
  block_rms_scale<TMAX, VEC>(in, a.eps, rms_scale);

  const int half = a.head_dim / 2;
  const int units_per_head = half / 2;
  const int units = (a.heads + 2 * a.kv_heads) * units_per_head;
  auto head_of = [&](int unit) { return unit / units_per_head; };
  auto first_pair_of = [&](int unit) { return (unit % units_per_head) * 2; };
  auto kv_head_of = [&](int head) {
    return head < a.heads + a.kv_heads ? head - a.heads : head - a.heads - a.kv_heads;
  };

  for_each_row_group<TMAX, VEC, kWideForRest>(
      in, units, a.k_split,
      [&](int unit, const bf16_t* (&rows)[kRowsPerWarp]) {
        const int head = head_of(unit);
        const bf16_t* matrix =
            head < a.heads ? a.wq + layer * a.q_layer_stride + static_cast<size_t>(head) * a.head_dim * a.hidden
                           : (head >= a.heads + a.kv_heads ? a.wv : a.wk) + layer * a.kv_layer_stride +
                                 static_cast<size_t>(kv_head_of(head)) * a.head_dim * a.hidden;
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const int row = first_pair_of(unit) + r / 2 + (r % 2) * half;
          rows[r] = matrix + static_cast<size_t>(row) * a.hidden;
        }
      },
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        const int head = head_of(unit);
        const bool is_q = head < a.heads, is_v = head >= a.heads + a.kv_heads;
        const int kind = is_q ? 0 : (is_v ? 2 : 1);
        const bf16_t* bias = a.biases.head(layer, kind, is_q ? head : kv_head_of(head), a.head_dim);
        epilogue(head, first_pair_of(unit), bias, acc);
      });
}

template <int TMAX, int VEC, typename Cache>
__global__ void __launch_bounds__(kMatvecThreads) qkv_rope_append_kernel(QkvArgs a) {
  __shared__ float rms_scale[TMAX];
  const QkvStore<Cache> store = layer_qkv_store<Cache>(a.q, a.k_cache, a.v_cache, a.k_scale, a.v_scale, *a.layer,
                                                       a.heads, a.kv_heads, a.head_dim, a.slots, a.ring);
  qkv_row_groups<TMAX, VEC>(a, rms_scale, [&](int head, int first_pair, const bf16_t* bias,
                                              const float (&acc)[kRowsPerWarp][TMAX]) {
    const bool rotate = head < a.heads + a.kv_heads;  // Q and K, not V
    rope_pairs<TMAX>(acc, rms_scale, a.tokens, a.positions, a.inv_freq, first_pair, rotate, bias, a.head_dim / 2,
                     [&](int t, int position, int j, float lo, float hi) { store(head, t, position, j, lo, hi); });
  });
}

// RMSNorm -> Q, K, V projections (biases added), stored as they are: a per-head norm comes between them and the
// rotation (Qwen3's), and qk_norm_rope.cu applies it.
template <int TMAX, int VEC>
__global__ void __launch_bounds__(kMatvecThreads) qkv_project_kernel(QkvArgs a) {
  __shared__ float rms_scale[TMAX];
  const int all_heads = a.heads + 2 * a.kv_heads;
  qkv_row_groups<TMAX, VEC>(a, rms_scale, [&](int head, int first_pair, const bf16_t* bias,
                                              const float (&acc)[kRowsPerWarp][TMAX]) {
    rope_pairs<TMAX>(acc, rms_scale, a.tokens, nullptr, a.inv_freq, first_pair, false, bias, a.head_dim / 2,
                     [&](int t, int, int j, float lo, float hi) {
      store_projected_pair(a.projected, all_heads, a.head_dim, head, t, j, lo, hi);
    });
  });
}

// The checks and arguments both handlers share: h [tokens, hidden], the norm, wq / wk / wv for `heads` and
// `kv_heads` of `head_dim`, the layer and the biases.
ffi::Error projection_args(const std::string& op, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> norm_w,
                           ffi::Buffer<ffi::BF16> wq, ffi::Buffer<ffi::BF16> wk, ffi::Buffer<ffi::BF16> wv,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> bq, ffi::Buffer<ffi::BF16> bk,
                           ffi::Buffer<ffi::BF16> bv, int heads, int kv_heads, int head_dim, float eps, QkvArgs& a) {
  auto hd = h.dimensions();
  if (hd.size() != 2) return invalid(op + ": h must be [tokens, hidden], got " + shape_string(hd));
  a.tokens = static_cast<int>(hd[0]);
  a.hidden = static_cast<int>(hd[1]);
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = head_dim;
  if (a.head_dim % 4 != 0) return invalid(op + ": head_dim must be a multiple of 4, got " + std::to_string(head_dim));
  const int64_t q_rows = int64_t{a.heads} * a.head_dim, kv_rows = int64_t{a.kv_heads} * a.head_dim;
  if (wq.dimensions().size() != 3 || wq.dimensions()[1] != q_rows || wq.dimensions()[2] != a.hidden ||
      wk.dimensions().size() != 3 || wk.dimensions()[1] != kv_rows || wk.dimensions()[2] != a.hidden ||
      wv.element_count() != wk.element_count() || norm_w.dimensions().back() != a.hidden)
    return invalid(op + ": weights wq " + shape_string(wq.dimensions()) + ", wk " + shape_string(wk.dimensions()) +
                   ", wv " + shape_string(wv.dimensions()) + ", norm " + shape_string(norm_w.dimensions()) +
                   " do not fit hidden " + std::to_string(a.hidden));
  if (layer.element_count() != 1) return invalid(op + ": layer must be a scalar");
  a.h = h.typed_data();
  a.norm_w = norm_w.typed_data();
  a.wq = wq.typed_data();
  a.wk = wk.typed_data();
  a.wv = wv.typed_data();
  a.layer = layer.typed_data();
  a.norm_layer_stride = layer_stride(norm_w);
  a.q_layer_stride = layer_stride(wq);
  a.kv_layer_stride = layer_stride(wk);
  if (layer_stride(wv) != a.kv_layer_stride) return invalid(op + ": wk and wv must be stacked alike");
  a.eps = eps;
  return qkv_biases(op, bq, bk, bv, q_rows, kv_rows, wq.dimensions()[0], a.biases);
}

// Launches `kernel_for(tmax, vec)`'s kernel over the Q/K/V row groups with `a`.
template <class KernelFor>
ffi::Error launch_row_groups(gpuStream_t stream, const QkvArgs& a, const RowGroupLaunch& launch, const char* op,
                             KernelFor kernel_for) {
  const bool aligned = aligned16(a.h) && aligned16(a.norm_w) && aligned16(a.wq) && aligned16(a.wk) &&
                       aligned16(a.wv) && a.norm_layer_stride % 8 == 0 && a.q_layer_stride % 8 == 0 &&
                       a.kv_layer_stride % 8 == 0;
  const int64_t units = int64_t{a.heads + 2 * a.kv_heads} * (a.head_dim / 4);
  return with_token_bucket(a.tokens, [&](auto tmax) {
    return with_vector_width(a.hidden, aligned, [&](auto vec) {
      constexpr auto kernel = decltype(kernel_for(tmax, vec))::value;
      const RowGroupGrid grid =
          row_group_grid(row_group_work<decltype(tmax)::value, decltype(vec)::value, kWideForRest>(units),
                         a.hidden, resident_blocks_per_unit<kernel>(launch.threads()), launch);
      QkvArgs args = a;
      args.k_split = grid.k_split;
      kernel<<<grid.blocks, grid.warps * WARP_SIZE, 0, stream>>>(args);
      return launch_status(op);
    });
  });
}

// The cache is bf16 (CacheType BF16, no scales) or E4M3 codes (U8) with scales [layers, 1, kv_heads].
template <ffi::DataType CacheType>
ffi::Error qkv_rope_append_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> norm_w,
                                ffi::Buffer<ffi::BF16> wq, ffi::Buffer<ffi::BF16> wk, ffi::Buffer<ffi::BF16> wv,
                                ffi::Buffer<ffi::F32> inv_freq, ffi::Buffer<ffi::S32> positions,
                                ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::BF16>> q,
                                ffi::Result<ffi::Buffer<CacheType>> k_cache, ffi::Result<ffi::Buffer<CacheType>> v_cache,
                                const ffi::Buffer<ffi::F32>* k_scale, const ffi::Buffer<ffi::F32>* v_scale,
                                ffi::Buffer<ffi::BF16> bq, ffi::Buffer<ffi::BF16> bk, ffi::Buffer<ffi::BF16> bv,
                                float eps, bool ring, int64_t k_split, int64_t warps_per_block,
                                int64_t blocks_per_unit) {
  using Cache = std::conditional_t<CacheType == ffi::U8, uint8_t, bf16_t>;
  const std::string op = "qkv_rope_append";
  const RowGroupLaunch launch{k_split, warps_per_block, blocks_per_unit};
  if (ffi::Error err = check_launch(op.c_str(), launch); err.failure()) return err;
  auto cd = k_cache->dimensions();
  auto qd = q->dimensions();
  if (cd.size() != 5 || qd.size() != 3)
    return invalid(op + ": expected q [tokens, heads, head_dim] and caches [layers, batch, kv_heads, slots, "
                        "head_dim]; got q " + shape_string(qd) + ", cache " + shape_string(cd));
  if (cd[1] != 1) return invalid(op + ": the fused kernels decode batch 1, cache has batch " + std::to_string(cd[1]));
  QkvArgs a{};
  if (ffi::Error err = projection_args(op, h, norm_w, wq, wk, wv, layer, bq, bk, bv, static_cast<int>(qd[1]),
                                       static_cast<int>(cd[2]), static_cast<int>(cd[4]), eps, a);
      err.failure())
    return err;
  a.slots = static_cast<int>(cd[3]);
  a.ring = ring;
  if (ffi::Error err = check_rotary_inputs(op, qd, a.tokens, a.head_dim, inv_freq, positions); err.failure())
    return err;
  a.inv_freq = inv_freq.typed_data();
  a.positions = positions.typed_data();
  a.q = q->typed_data();
  a.k_cache = k_cache->typed_data();
  a.v_cache = v_cache->typed_data();
  const size_t scale_count = static_cast<size_t>(cd[0]) * cd[1] * cd[2];
  if (k_scale && (k_scale->element_count() != scale_count || v_scale->element_count() != scale_count))
    return invalid(op + ": an FP8 cache " + shape_string(cd) + " needs k/v scales [layers, 1, kv_heads], got " +
                   shape_string(k_scale->dimensions()) + " and " + shape_string(v_scale->dimensions()));
  a.k_scale = k_scale ? k_scale->typed_data() : nullptr;
  a.v_scale = v_scale ? v_scale->typed_data() : nullptr;
  return launch_row_groups(stream, a, launch, "qkv_rope_append", [](auto tmax, auto vec) {
    return std::integral_constant<decltype(&qkv_rope_append_kernel<1, 1, Cache>),
                                  qkv_rope_append_kernel<decltype(tmax)::value, decltype(vec)::value, Cache>>{};
  });
}

ffi::Error qkv_project(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> norm_w,
                       ffi::Buffer<ffi::BF16> wq, ffi::Buffer<ffi::BF16> wk, ffi::Buffer<ffi::BF16> wv,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> bq, ffi::Buffer<ffi::BF16> bk,
                       ffi::Buffer<ffi::BF16> bv, ffi::Result<ffi::Buffer<ffi::F32>> projected, float eps,
                       int64_t k_split, int64_t warps_per_block, int64_t blocks_per_unit) {
  const std::string op = "qkv_project";
  const RowGroupLaunch launch{k_split, warps_per_block, blocks_per_unit};
  if (ffi::Error err = check_launch(op.c_str(), launch); err.failure()) return err;
  auto pd = projected->dimensions();
  const int64_t head_dim = pd.size() == 3 ? pd[2] : 0;
  if (pd.size() != 3 || head_dim == 0 || wq.dimensions().size() != 3 || wk.dimensions().size() != 3 ||
      wq.dimensions()[1] % head_dim != 0 || wk.dimensions()[1] % head_dim != 0 ||
      pd[1] != (wq.dimensions()[1] + 2 * wk.dimensions()[1]) / head_dim)
    return invalid(op + ": the output " + shape_string(pd) + " must be [tokens, heads + 2 kv_heads, head_dim] for wq " +
                   shape_string(wq.dimensions()) + " and wk " + shape_string(wk.dimensions()));
  QkvArgs a{};
  if (ffi::Error err = projection_args(op, h, norm_w, wq, wk, wv, layer, bq, bk, bv,
                                       static_cast<int>(wq.dimensions()[1] / head_dim),
                                       static_cast<int>(wk.dimensions()[1] / head_dim), static_cast<int>(head_dim),
                                       eps, a);
      err.failure())
    return err;
  if (pd[0] != a.tokens) return invalid(op + ": the output " + shape_string(pd) + " does not have h's tokens");
  a.projected = projected->typed_data();
  return launch_row_groups(stream, a, launch, "qkv_project", [](auto tmax, auto vec) {
    return std::integral_constant<decltype(&qkv_project_kernel<1, 1>),
                                  qkv_project_kernel<decltype(tmax)::value, decltype(vec)::value>>{};
  });
}

ffi::Error qkv_rope_append_bf16(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> norm_w,
                                ffi::Buffer<ffi::BF16> wq, ffi::Buffer<ffi::BF16> wk, ffi::Buffer<ffi::BF16> wv,
                                ffi::Buffer<ffi::F32> inv_freq, ffi::Buffer<ffi::S32> positions,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> /*k_cache_in*/,
                                ffi::Buffer<ffi::BF16> /*v_cache_in*/, ffi::Buffer<ffi::BF16> bq,
                                ffi::Buffer<ffi::BF16> bk, ffi::Buffer<ffi::BF16> bv,
                                ffi::Result<ffi::Buffer<ffi::BF16>> q, ffi::Result<ffi::Buffer<ffi::BF16>> k_cache,
                                ffi::Result<ffi::Buffer<ffi::BF16>> v_cache, float eps, bool ring, int64_t k_split,
                                int64_t warps_per_block, int64_t blocks_per_unit) {
  return qkv_rope_append_impl(stream, h, norm_w, wq, wk, wv, inv_freq, positions, layer, q, k_cache, v_cache, nullptr,
                              nullptr, bq, bk, bv, eps, ring, k_split, warps_per_block, blocks_per_unit);
}

ffi::Error qkv_rope_append_fp8(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> norm_w,
                               ffi::Buffer<ffi::BF16> wq, ffi::Buffer<ffi::BF16> wk, ffi::Buffer<ffi::BF16> wv,
                               ffi::Buffer<ffi::F32> inv_freq, ffi::Buffer<ffi::S32> positions,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::U8> /*k_cache_in*/,
                               ffi::Buffer<ffi::U8> /*v_cache_in*/, ffi::Buffer<ffi::F32> k_scale,
                               ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::BF16> bq, ffi::Buffer<ffi::BF16> bk,
                               ffi::Buffer<ffi::BF16> bv, ffi::Result<ffi::Buffer<ffi::BF16>> q,
                               ffi::Result<ffi::Buffer<ffi::U8>> k_cache, ffi::Result<ffi::Buffer<ffi::U8>> v_cache,
                               float eps, bool ring, int64_t k_split, int64_t warps_per_block,
                               int64_t blocks_per_unit) {
  return qkv_rope_append_impl(stream, h, norm_w, wq, wk, wv, inv_freq, positions, layer, q, k_cache, v_cache, &k_scale,
                              &v_scale, bq, bk, bv, eps, ring, k_split, warps_per_block, blocks_per_unit);
}

}  // namespace
}  // namespace lithos

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosQkvRopeAppend, lithos::qkv_rope_append_bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // attention norm weight
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wq
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wk
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wv
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k cache (aliased to output 1)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // v cache (aliased to output 2)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bq [layers, heads * head_dim] or empty
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bk [layers, kv_heads * head_dim] or empty
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bv or empty
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // q
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // k cache
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // v cache
                                  .Attr<float>("eps")
                                  .Attr<bool>("ring")        // slot = position % slots
                                  .Attr<int64_t>("k_split")  // launch parameters: 0 = heuristic
                                  .Attr<int64_t>("warps_per_block")
                                  .Attr<int64_t>("blocks_per_unit"),
                              {ffi::Traits::kCmdBufferCompatible});

// The same with an FP8 E4M3 cache (u8 codes) and its scales [layers, 1, kv_heads] f32 (read only).
XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosQkvRopeAppendFp8, lithos::qkv_rope_append_fp8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // attention norm weight
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wq
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wk
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wv
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::U8>>()    // k cache: E4M3 codes (aliased to output 1)
                                  .Arg<ffi::Buffer<ffi::U8>>()    // v cache (aliased to output 2)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k scales
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v scales
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bq [layers, heads * head_dim] or empty
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bk [layers, kv_heads * head_dim] or empty
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bv or empty
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // q
                                  .Ret<ffi::Buffer<ffi::U8>>()    // k cache
                                  .Ret<ffi::Buffer<ffi::U8>>()    // v cache
                                  .Attr<float>("eps")
                                  .Attr<bool>("ring")        // slot = position % slots
                                  .Attr<int64_t>("k_split")  // launch parameters: 0 = heuristic
                                  .Attr<int64_t>("warps_per_block")
                                  .Attr<int64_t>("blocks_per_unit"),
                              {ffi::Traits::kCmdBufferCompatible});

// RMSNorm -> Q, K, V projections (and their biases), f32 [tokens, heads + 2 kv_heads, head_dim], for a model whose
// Q and K heads have their own RMSNorm (then LithosQkNormRopeAppend, qk_norm_rope.cu).
XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosQkvProject, lithos::qkv_project,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // attention norm weight
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wq
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wk
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // wv
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bq [layers, heads * head_dim] or empty
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bk [layers, kv_heads * head_dim] or empty
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // bv or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()   // projections
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("k_split")  // launch parameters: 0 = heuristic
                                  .Attr<int64_t>("warps_per_block")
                                  .Attr<int64_t>("blocks_per_unit"),
                              {ffi::Traits::kCmdBufferCompatible});
