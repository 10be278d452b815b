// A mixture of experts' router for 1..16 tokens: the layer's router logits (the normed input against each expert's
// row, f32 sums of bf16 products, plus the router's bias where a model has one), then the experts each token takes
// and their weights, in one launch where XLA took a slice, a reduce, a softmax, a sort and the renormalisation.
//
// A grid of blocks a token, a warp a router row (read from the stacked [layers, experts, hidden] matrix in place,
// the row's loads in flight together), each block's logits to memory; the last block of a token to arrive
// routes: a softmax over every expert, then the top k, renormalised when asked (Qwen3-MoE, Qwen2-MoE, Mixtral);
// or the top k of the logits, then a softmax over those k (GPT-OSS). Each expert's place in the order is a count
// over the others (one pass, no rounds); ties go to the lower expert id, as jax.lax.top_k's. (NOTES.md, "The
// router in one launch": run 124's first form, one block a token, took some 20 us a layer over Qwen3-30B-A3B's
// 512 KB router and made the steps slower.)
#include <string>

#include "ffi_util.h"
#include "portable.h"

namespace lithos {
namespace {

constexpr int kRouteThreads = 256;
constexpr int kRowsPerBlock = kRouteThreads / WARP_SIZE;  // a warp a row
constexpr int kMaxExperts = 512;

// Blocks of token t that have written their logits. The last to arrive sets it back to 0 for the next launch
// (launches on one stream follow one another; the router is never run on two streams at once).
__device__ unsigned int route_arrivals[kMaxTokens];

struct RouteArgs {
  const bf16_t* x;           // [tokens, hidden], normed
  const bf16_t* router;      // [layers, experts, hidden]
  int64_t router_layer_stride;
  const float* bias;         // [layers, experts] or nullptr
  int64_t bias_layer_stride;
  const int32_t* layer;      // [] device scalar
  float* logits;             // [tokens, experts]: the blocks' hand-off
  float* weights;            // [tokens, top_k]
  int32_t* ids;              // [tokens, top_k]
  int hidden, experts, top_k;
  bool softmax_first, renormalize;
};

// A warp's dot product of x and one router row. The row's loads are issued kChunks at a time, all before their
// products (a 2048-wide row is one round of eight 16-byte loads a lane): a row is one trip to memory, not eight.
constexpr int kChunks = 8;

template <int VEC>
__device__ __forceinline__ float row_dot(const bf16_t* x, const bf16_t* row, int hidden, int lane) {
  float sum = 0.f;
  for (int base = 0; base < hidden; base += kChunks * WARP_SIZE * VEC) {
    Bf16Vec<VEC> w[kChunks], v[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int i = base + (c * WARP_SIZE + lane) * VEC;
      if (i < hidden) {
        w[c] = load_streaming<VEC>(row + i);
        v[c] = load_cached<VEC>(x + i);
      }
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (base + (c * WARP_SIZE + lane) * VEC < hidden) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += w[c][j] * v[c][j];
      }
    }
  }
  return group_sum(sum);
}

// The block's max or sum of each thread's `v` (every thread gets it). `partial` holds a value a warp.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* partial) {
  v = kMax ? group_max(v) : group_sum(v);
  __syncthreads();  // `partial` may still be read from the last call
  if (lane_id() == 0) partial[warp_id()] = v;
  __syncthreads();
  v = partial[0];
  for (int w = 1; w < kRowsPerBlock; ++w) v = kMax ? fmaxf(v, partial[w]) : v + partial[w];
  return v;
}

// The last block's work: `score` (shared, the token's logits) routed into weights and ids.
__device__ void route(const RouteArgs& a, int t, float* score, float* partial, float* top_value, int* top_id) {
  const int tid = static_cast<int>(threadIdx.x);
  if (a.softmax_first) {  // jax.nn.softmax: exp(l - max) / sum(exp(l - max))
    float peak = -INFINITY;
    for (int e = tid; e < a.experts; e += kRouteThreads) peak = fmaxf(peak, score[e]);
    peak = block_reduce<true>(peak, partial);
    float total = 0.f;
    for (int e = tid; e < a.experts; e += kRouteThreads) total += expf(score[e] - peak);
    total = block_reduce<false>(total, partial);
    for (int e = tid; e < a.experts; e += kRouteThreads) score[e] = expf(score[e] - peak) / total;
    __syncthreads();
  }
  // Expert e's place: the experts above it, or level with it and of a lower id.
  for (int e = tid; e < a.experts; e += kRouteThreads) {
    const float v = score[e];
    int place = 0;
    for (int j = 0; j < a.experts; ++j) place += (score[j] > v || (score[j] == v && j < e)) ? 1 : 0;
    if (place < a.top_k) {
      top_value[place] = v;
      top_id[place] = e;
    }
  }
  __syncthreads();
  if (tid != 0) return;
  float* weights = a.weights + static_cast<size_t>(t) * a.top_k;
  int32_t* ids = a.ids + static_cast<size_t>(t) * a.top_k;
  float total = 0.f;
  for (int r = 0; r < a.top_k; ++r) {
    // After a softmax: the probability (summed to renormalise). Before one: exp(logit - the top logit).
    const float w = a.softmax_first ? top_value[r] : expf(top_value[r] - top_value[0]);
    weights[r] = w;
    ids[r] = top_id[r];
    total += w;
  }
  if (!a.softmax_first || a.renormalize)
    for (int r = 0; r < a.top_k; ++r) weights[r] /= total;
}

template <int VEC>
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(RouteArgs a) {
  __shared__ float score[kMaxExperts];
  __shared__ float top_value[kMaxExperts];
  __shared__ int top_id[kMaxExperts];
  __shared__ float partial[kRowsPerBlock];
  __shared__ bool last;
  const int t = static_cast<int>(blockIdx.y), lane = lane_id();
  const int64_t layer = *a.layer;
  const int e = static_cast<int>(blockIdx.x) * kRowsPerBlock + warp_id();
  if (e < a.experts) {
    const bf16_t* row = a.router + layer * a.router_layer_stride + static_cast<size_t>(e) * a.hidden;
    const float dot = row_dot<VEC>(a.x + static_cast<size_t>(t) * a.hidden, row, a.hidden, lane);
    const float bias = a.bias ? a.bias[layer * a.bias_layer_stride + e] : 0.f;
    if (lane == 0) a.logits[static_cast<size_t>(t) * a.experts + e] = a.bias ? dot + bias : dot;
  }
  // The hand-off: each writer's fence orders its logits before the block's arrival is counted; the last block's
  // fence after the count, and loads that skip L1 (volatile), make every block's logits visible to it.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&route_arrivals[t], 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const volatile float* logits = a.logits + static_cast<size_t>(t) * a.experts;
  for (int i = static_cast<int>(threadIdx.x); i < a.experts; i += kRouteThreads) score[i] = logits[i];
  if (threadIdx.x == 0) route_arrivals[t] = 0;
  __syncthreads();
  route(a, t, score, partial, top_value, top_id);
}

ffi::Error moe_route_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> router,
                          ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> layer,
                          ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<ffi::Buffer<ffi::S32>> ids,
                          ffi::Result<ffi::Buffer<ffi::F32>> logits, int32_t top_k, bool softmax_first,
                          bool renormalize) {
  const std::string op = "moe_route";
  auto xd = x.dimensions();
  auto rd = router.dimensions();
  auto wd = weights->dimensions();
  auto id = ids->dimensions();
  if (xd.size() != 2 || rd.size() != 3 || wd.size() != 2 || id.size() != 2 || id[0] != wd[0] || id[1] != wd[1])
    return invalid(op + ": expected x [tokens, hidden], router [layers, experts, hidden] and weights, ids [tokens, "
                        "top_k]; got " + shape_string(xd) + ", " + shape_string(rd) + ", " + shape_string(wd));
  RouteArgs a{};
  a.hidden = static_cast<int>(xd[1]);
  a.experts = static_cast<int>(rd[1]);
  a.top_k = top_k;
  a.softmax_first = softmax_first;
  a.renormalize = renormalize;
  if (rd[2] != xd[1] || wd[0] != xd[0] || wd[1] != top_k)
    return invalid(op + ": x " + shape_string(xd) + ", router " + shape_string(rd) + " and weights " +
                   shape_string(wd) + " do not fit one another with top_k " + std::to_string(top_k));
  if (a.experts > kMaxExperts || top_k < 1 || top_k > a.experts)
    return invalid(op + ": the kernel routes at most " + std::to_string(kMaxExperts) + " experts to 1..experts of "
                        "them, got top " + std::to_string(top_k) + " of " + std::to_string(a.experts));
  if (bias.element_count() != 0 && (bias.dimensions().back() != a.experts || bias.dimensions().size() != 2))
    return invalid(op + ": a router bias must be [layers, experts], got " + shape_string(bias.dimensions()));
  if (layer.element_count() != 1) return invalid(op + ": layer must be a scalar");
  if (logits->element_count() != static_cast<size_t>(xd[0]) * a.experts)
    return invalid(op + ": logits must be [tokens, experts], got " + shape_string(logits->dimensions()));
  if (xd[0] < 1 || xd[0] > kMaxTokens)
    return invalid(op + ": the kernel routes 1.." + std::to_string(kMaxTokens) + " tokens, got " +
                   std::to_string(xd[0]) + "; use the reference path for prefill");
  a.x = x.typed_data();
  a.router = router.typed_data();
  a.router_layer_stride = layer_stride(router);
  a.bias = optional_data(bias);
  a.bias_layer_stride = a.bias ? layer_stride(bias) : 0;
  a.layer = layer.typed_data();
  a.weights = weights->typed_data();
  a.ids = ids->typed_data();
  a.logits = logits->typed_data();
  const bool aligned = aligned16(a.x) && aligned16(a.router);
  return with_vector_width(a.hidden, aligned, [&](auto vec) {
    const dim3 grid((a.experts + kRowsPerBlock - 1) / kRowsPerBlock, static_cast<unsigned>(xd[0]));
    moe_route_kernel<decltype(vec)::value><<<grid, kRouteThreads, 0, stream>>>(a);
    return launch_status(op.c_str());
  });
}

}  // namespace
}  // namespace lithos

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosMoeRoute, lithos::moe_route_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [tokens, hidden], normed
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // router [layers, experts, hidden]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // router bias [layers, experts], or empty
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()   // weights [tokens, top_k]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // expert ids [tokens, top_k]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // logits [tokens, experts]: the hand-off
                                  .Attr<int32_t>("top_k")
                                  .Attr<bool>("softmax_first")
                                  .Attr<bool>("renormalize"),
                              {ffi::Traits::kCmdBufferCompatible});
