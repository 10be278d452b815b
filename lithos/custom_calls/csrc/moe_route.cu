// A mixture of experts' router for 1..16 tokens: the layer's router logits (the normed input against each expert's
// row, f32 sums of bf16 products, plus the router's bias where a model has one), then the experts each token takes
// and their weights, in one launch where XLA took a slice, a reduce, a softmax, a sort and the renormalisation.
//
// One block a token: its warps take the router's rows in turn (a router is at most 128 x 4096 bf16 in the models
// served, 1 MB, read from the stacked [layers, experts, hidden] matrix in place) into shared logits, and one warp
// routes: a softmax over every expert, then the top k, renormalised when asked (Qwen3-MoE, Qwen2-MoE, Mixtral);
// or the top k of the logits, then a softmax over those k (GPT-OSS). Ties go to the lower expert id, as
// jax.lax.top_k's. One block needs no hand-off between blocks (NOTES.md, "The router in one launch").
#include <climits>
#include <string>

#include "ffi_util.h"
#include "portable.h"

namespace lithos {
namespace {

constexpr int kRouteThreads = 1024;
constexpr int kMaxExperts = 512;
constexpr int kExpertsPerLane = kMaxExperts / WARP_SIZE;

struct RouteArgs {
  const bf16_t* x;           // [tokens, hidden], normed
  const bf16_t* router;      // [layers, experts, hidden]
  int64_t router_layer_stride;
  const float* bias;         // [layers, experts] or nullptr
  int64_t bias_layer_stride;
  const int32_t* layer;      // [] device scalar
  float* weights;            // [tokens, top_k]
  int32_t* ids;              // [tokens, top_k]
  int hidden, experts, top_k;
  bool softmax_first, renormalize;
};

struct Pick {
  float value;
  int index;
};

__device__ __forceinline__ Pick better(Pick a, Pick b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

template <int VEC>
__device__ __forceinline__ float row_dot(const bf16_t* x, const bf16_t* row, int hidden, int lane) {
  float sum = 0.f;
#pragma unroll 4
  for (int i = lane * VEC; i < hidden; i += WARP_SIZE * VEC) {
    const Bf16Vec<VEC> w = load_streaming<VEC>(row + i);
    const Bf16Vec<VEC> v = load_cached<VEC>(x + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum += w[j] * v[j];
  }
  return group_sum(sum);
}

// The top k of the lanes' values (expert e is lane e % WARP_SIZE's value e / WARP_SIZE; absent ones -inf): each
// round the warp's best, lower id first on ties, is taken out. Every lane ends with the same picks.
__device__ __forceinline__ void top_k(float (&values)[kExpertsPerLane], int k, int lane, Pick* picks) {
  for (int r = 0; r < k; ++r) {
    Pick best{-INFINITY, INT_MAX};
#pragma unroll
    for (int s = 0; s < kExpertsPerLane; ++s) best = better(best, Pick{values[s], s * WARP_SIZE + lane});
#pragma unroll
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2)
      best = better(best, Pick{shfl_xor(best.value, mask), shfl_xor(best.index, mask)});
    if (best.index % WARP_SIZE == lane) {
#pragma unroll
      for (int s = 0; s < kExpertsPerLane; ++s)
        if (s == best.index / WARP_SIZE) values[s] = -INFINITY;
    }
    picks[r] = best;
  }
}

template <int VEC>
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(RouteArgs a) {
  __shared__ float logits[kMaxExperts];
  __shared__ Pick picks[kMaxExperts];
  const int t = static_cast<int>(blockIdx.x), lane = lane_id(), warp = warp_id();
  const int64_t layer = *a.layer;
  const bf16_t* x = a.x + static_cast<size_t>(t) * a.hidden;
  const bf16_t* router = a.router + layer * a.router_layer_stride;
  for (int e = warp; e < a.experts; e += kRouteThreads / WARP_SIZE) {
    const float dot = row_dot<VEC>(x, router + static_cast<size_t>(e) * a.hidden, a.hidden, lane);
    if (lane == 0) logits[e] = a.bias ? dot + a.bias[layer * a.bias_layer_stride + e] : dot;
  }
  __syncthreads();
  if (warp != 0) return;

  float values[kExpertsPerLane];
#pragma unroll
  for (int s = 0; s < kExpertsPerLane; ++s) {
    const int e = s * WARP_SIZE + lane;
    values[s] = e < a.experts ? logits[e] : -INFINITY;
  }
  if (a.softmax_first) {  // jax.nn.softmax: exp(l - max) / sum(exp(l - max))
    float peak = -INFINITY;
#pragma unroll
    for (int s = 0; s < kExpertsPerLane; ++s) peak = fmaxf(peak, values[s]);
    peak = group_max(peak);
    float total = 0.f;
#pragma unroll
    for (int s = 0; s < kExpertsPerLane; ++s) {
      values[s] = expf(values[s] - peak);  // absent experts: exp(-inf) = 0
      total += values[s];
    }
    total = group_sum(total);
#pragma unroll
    for (int s = 0; s < kExpertsPerLane; ++s)
      values[s] = s * WARP_SIZE + lane < a.experts ? values[s] / total : -INFINITY;
  }
  top_k(values, a.top_k, lane, picks);
  if (lane != 0) return;
  float* weights = a.weights + static_cast<size_t>(t) * a.top_k;
  int32_t* ids = a.ids + static_cast<size_t>(t) * a.top_k;
  float total = 0.f;
  for (int r = 0; r < a.top_k; ++r) {
    // After a softmax: the probability (summed to renormalise). Before one: exp(logit - the top logit).
    const float w = a.softmax_first ? picks[r].value : expf(picks[r].value - picks[0].value);
    weights[r] = w;
    ids[r] = picks[r].index;
    total += w;
  }
  if (!a.softmax_first || a.renormalize)
    for (int r = 0; r < a.top_k; ++r) weights[r] /= total;
}

ffi::Error moe_route_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> router,
                          ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> layer,
                          ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<ffi::Buffer<ffi::S32>> ids,
                          int32_t top_k, bool softmax_first, bool renormalize) {
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
  const bool aligned = aligned16(a.x) && aligned16(a.router);
  return with_vector_width(a.hidden, aligned, [&](auto vec) {
    moe_route_kernel<decltype(vec)::value><<<static_cast<unsigned>(xd[0]), kRouteThreads, 0, stream>>>(a);
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
                                  .Attr<int32_t>("top_k")
                                  .Attr<bool>("softmax_first")
                                  .Attr<bool>("renormalize"),
                              {ffi::Traits::kCmdBufferCompatible});
