// The second half of attention's input for Q and K heads with RMSNorms of their own (Qwen3's): from the projections
// LithosQkvProject (or its packed twin) stored, f32 [tokens, heads + 2 kv_heads, head_dim], each Q and K head is
// normalised (f32, times its norm weight), Q and K are rotated, and K and V are written into the layer's cache slots
// (bf16, or E4M3 codes of value / scale, as qkv_rope.cu writes them). The caches are updated in place.
//
// One warp a (token, head): a head's values are one warp's loads, its sum of squares one shuffle reduction, and
// both halves of each rotary pair are in the warp. The work is small (heads + 2 kv_heads warps a token) and
// latency-bound; one launch here replaces the XLA norm, rotation and cache-write fusions of the split form.
#include <string>
#include <type_traits>

#include "cache_store.h"
#include "ffi_util.h"
#include "portable.h"
#include "qkv_epilogue.h"

namespace lithos {
namespace {

constexpr int kNormRopeThreads = 256;

struct QkNormArgs {
  const float* projected;    // [tokens, heads + 2 kv_heads, head_dim]
  const bf16_t* q_norm;      // [layers, head_dim]
  const bf16_t* k_norm;
  int64_t norm_layer_stride;
  const float* inv_freq;     // [head_dim / 2]
  const int32_t* positions;  // [tokens]
  const int32_t* layer;      // [] device scalar
  bf16_t* q;                 // [tokens, heads, head_dim]
  void* k_cache;             // [layers, 1, kv_heads, slots, head_dim], aliased: bf16_t, or uint8_t E4M3 codes
  void* v_cache;
  const float* k_scale;      // [layers, 1, kv_heads]: an FP8 cache's scales (nullptr for bf16)
  const float* v_scale;
  int tokens, heads, kv_heads, head_dim, slots;
  bool ring;  // slot = position % slots (else slot = position, positions >= slots dropped)
  float eps;
};

template <typename Cache>
__global__ void __launch_bounds__(kNormRopeThreads) qk_norm_rope_append_kernel(QkNormArgs a) {
  const int all_heads = a.heads + 2 * a.kv_heads;
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE);
  const int lane = static_cast<int>(threadIdx.x % WARP_SIZE);
  if (warp >= a.tokens * all_heads) return;  // whole warps leave: the shuffles below see every lane
  const int t = warp / all_heads, head = warp % all_heads;
  const bool is_q = head < a.heads, is_v = head >= a.heads + a.kv_heads;
  const int64_t layer = *a.layer;
  const int half = a.head_dim / 2;
  const float* row = a.projected + static_cast<size_t>(warp) * a.head_dim;

  // RMSNorm of the head, in f32 as the reference: x * rsqrt(mean(x^2) + eps) * w.
  float rms = 1.f;
  const bf16_t* norm_w = nullptr;
  if (!is_v) {
    float squares = 0.f;
    for (int i = lane; i < a.head_dim; i += WARP_SIZE) squares += row[i] * row[i];
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) squares += shfl_xor(squares, mask);
    rms = rsqrtf(squares / static_cast<float>(a.head_dim) + a.eps);
    norm_w = (is_q ? a.q_norm : a.k_norm) + layer * a.norm_layer_stride;
  }
  const int position = a.positions[t];
  const QkvStore<Cache> store = layer_qkv_store<Cache>(a.q, a.k_cache, a.v_cache, a.k_scale, a.v_scale, layer,
                                                       a.heads, a.kv_heads, a.head_dim, a.slots, a.ring);
  for (int j = lane; j < half; j += WARP_SIZE) {
    float lo = row[j], hi = row[j + half];
    if (!is_v) {
      lo = lo * rms * bf16_to_float(norm_w[j]);
      hi = hi * rms * bf16_to_float(norm_w[j + half]);
      rope_rotate(lo, hi, position, a.inv_freq[j]);
    }
    store(head, t, position, j, lo, hi);
  }
}

template <ffi::DataType CacheType>
ffi::Error qk_norm_rope_append_impl(gpuStream_t stream, ffi::Buffer<ffi::F32> projected,
                                    ffi::Buffer<ffi::BF16> q_norm, ffi::Buffer<ffi::BF16> k_norm,
                                    ffi::Buffer<ffi::F32> inv_freq, ffi::Buffer<ffi::S32> positions,
                                    ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::BF16>> q,
                                    ffi::Result<ffi::Buffer<CacheType>> k_cache,
                                    ffi::Result<ffi::Buffer<CacheType>> v_cache, const ffi::Buffer<ffi::F32>* k_scale,
                                    const ffi::Buffer<ffi::F32>* v_scale, float eps, bool ring) {
  using Cache = std::conditional_t<CacheType == ffi::U8, uint8_t, bf16_t>;
  const std::string op = "qk_norm_rope_append";
  auto pd = projected.dimensions();
  auto cd = k_cache->dimensions();
  auto qd = q->dimensions();
  if (pd.size() != 3 || cd.size() != 5 || qd.size() != 3 || cd[1] != 1)
    return invalid(op + ": expected projections [tokens, heads + 2 kv_heads, head_dim], q [tokens, heads, "
                        "head_dim] and caches [layers, 1, kv_heads, slots, head_dim]; got " + shape_string(pd) + ", " +
                   shape_string(qd) + ", " + shape_string(cd));
  QkNormArgs a{};
  a.tokens = static_cast<int>(pd[0]);
  a.heads = static_cast<int>(qd[1]);
  a.kv_heads = static_cast<int>(cd[2]);
  a.head_dim = static_cast<int>(cd[4]);
  a.slots = static_cast<int>(cd[3]);
  a.ring = ring;
  a.eps = eps;
  if (pd[1] != a.heads + 2 * a.kv_heads || pd[2] != a.head_dim || qd[0] != pd[0] || qd[2] != a.head_dim ||
      a.head_dim % 2 != 0)
    return invalid(op + ": projections " + shape_string(pd) + ", q " + shape_string(qd) + " and cache " +
                   shape_string(cd) + " do not fit one another");
  if (q_norm.dimensions().back() != a.head_dim || k_norm.dimensions().back() != a.head_dim ||
      layer_stride(q_norm) != layer_stride(k_norm))
    return invalid(op + ": q_norm " + shape_string(q_norm.dimensions()) + " and k_norm " +
                   shape_string(k_norm.dimensions()) + " must be [layers, head_dim], stacked alike");
  if (inv_freq.element_count() != static_cast<size_t>(a.head_dim / 2) ||
      positions.element_count() != static_cast<size_t>(a.tokens) || layer.element_count() != 1)
    return invalid(op + ": inv_freq must be [head_dim/2], positions [tokens], layer a scalar");
  const size_t scale_count = static_cast<size_t>(cd[0]) * cd[1] * cd[2];
  if (k_scale && (k_scale->element_count() != scale_count || v_scale->element_count() != scale_count))
    return invalid(op + ": an FP8 cache " + shape_string(cd) + " needs k/v scales [layers, 1, kv_heads]");
  a.projected = projected.typed_data();
  a.q_norm = q_norm.typed_data();
  a.k_norm = k_norm.typed_data();
  a.norm_layer_stride = layer_stride(q_norm);
  a.inv_freq = inv_freq.typed_data();
  a.positions = positions.typed_data();
  a.layer = layer.typed_data();
  a.q = q->typed_data();
  a.k_cache = k_cache->typed_data();
  a.v_cache = v_cache->typed_data();
  a.k_scale = k_scale ? k_scale->typed_data() : nullptr;
  a.v_scale = v_scale ? v_scale->typed_data() : nullptr;
  const int64_t warps = int64_t{a.tokens} * (a.heads + 2 * a.kv_heads);
  const int64_t blocks = (warps * WARP_SIZE + kNormRopeThreads - 1) / kNormRopeThreads;
  qk_norm_rope_append_kernel<Cache><<<static_cast<unsigned>(blocks), kNormRopeThreads, 0, stream>>>(a);
  return launch_status(op.c_str());
}

ffi::Error qk_norm_rope_append_bf16(gpuStream_t stream, ffi::Buffer<ffi::F32> projected, ffi::Buffer<ffi::BF16> q_norm,
                                    ffi::Buffer<ffi::BF16> k_norm, ffi::Buffer<ffi::F32> inv_freq,
                                    ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> layer,
                                    ffi::Buffer<ffi::BF16> /*k_cache_in*/, ffi::Buffer<ffi::BF16> /*v_cache_in*/,
                                    ffi::Result<ffi::Buffer<ffi::BF16>> q, ffi::Result<ffi::Buffer<ffi::BF16>> k_cache,
                                    ffi::Result<ffi::Buffer<ffi::BF16>> v_cache, float eps, bool ring) {
  return qk_norm_rope_append_impl(stream, projected, q_norm, k_norm, inv_freq, positions, layer, q, k_cache, v_cache,
                                  nullptr, nullptr, eps, ring);
}

ffi::Error qk_norm_rope_append_fp8(gpuStream_t stream, ffi::Buffer<ffi::F32> projected, ffi::Buffer<ffi::BF16> q_norm,
                                   ffi::Buffer<ffi::BF16> k_norm, ffi::Buffer<ffi::F32> inv_freq,
                                   ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> layer,
                                   ffi::Buffer<ffi::U8> /*k_cache_in*/, ffi::Buffer<ffi::U8> /*v_cache_in*/,
                                   ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                   ffi::Result<ffi::Buffer<ffi::BF16>> q, ffi::Result<ffi::Buffer<ffi::U8>> k_cache,
                                   ffi::Result<ffi::Buffer<ffi::U8>> v_cache, float eps, bool ring) {
  return qk_norm_rope_append_impl(stream, projected, q_norm, k_norm, inv_freq, positions, layer, q, k_cache, v_cache,
                                  &k_scale, &v_scale, eps, ring);
}

}  // namespace
}  // namespace lithos

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosQkNormRopeAppend, lithos::qk_norm_rope_append_bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // projections [tokens, heads + 2 kv_heads, head_dim]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // q_norm [layers, head_dim]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k_norm [layers, head_dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k cache (aliased to output 1)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // v cache (aliased to output 2)
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // q
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // k cache
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // v cache
                                  .Attr<float>("eps")
                                  .Attr<bool>("ring"),  // slot = position % slots
                              {ffi::Traits::kCmdBufferCompatible});

// The same with an FP8 E4M3 cache (u8 codes) and its scales [layers, 1, kv_heads] f32 (read only).
XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosQkNormRopeAppendFp8, lithos::qk_norm_rope_append_fp8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // projections [tokens, heads + 2 kv_heads, head_dim]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // q_norm [layers, head_dim]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k_norm [layers, head_dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::U8>>()    // k cache: E4M3 codes (aliased to output 1)
                                  .Arg<ffi::Buffer<ffi::U8>>()    // v cache (aliased to output 2)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k scales
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v scales
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // q
                                  .Ret<ffi::Buffer<ffi::U8>>()    // k cache
                                  .Ret<ffi::Buffer<ffi::U8>>()    // v cache
                                  .Attr<float>("eps")
                                  .Attr<bool>("ring"),  // slot = position % slots
                              {ffi::Traits::kCmdBufferCompatible});
