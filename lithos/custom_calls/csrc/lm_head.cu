// The end of a decode step for 1..16 tokens: final RMSNorm -> LM head -> greedy token (argmax), and
// the float32 logits when the caller samples. The vocabulary is the largest matrix of small models
// (128256 x 2048 is a fifth of Llama-3.2-1B), so it is streamed once and reduced on the fly: each
// block keeps its best (logit, id) per token, and a one-block pass picks the winner. Ties go to the
// lowest id, as jnp.argmax does.
#include <algorithm>
#include <climits>

#include "ffi_util.h"
#include "portable.h"
#include "row_groups.h"
#include "rowdot.h"

namespace lithos {
namespace {

struct Best {
  float value;
  int index;
};

__device__ __forceinline__ Best better(Best a, Best b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2)
    b = better(b, Best{shfl_xor(b.value, mask), shfl_xor(b.index, mask)});
  return b;
}

constexpr Best kNoBest{-INFINITY, INT_MAX};

struct LmHeadArgs {
  const bf16_t* h;       // [tokens, hidden]
  const bf16_t* head;    // [vocab, hidden]
  const bf16_t* norm_w;  // [hidden] or nullptr (h already normalised)
  float* logits;         // [tokens, vocab] or nullptr
  float* block_value;    // [blocks, tokens]: each block's best logit
  int32_t* block_index;  // [blocks, tokens]: and its id
  int32_t* tokens_out;   // [tokens]
  int tokens, hidden, vocab, blocks;
  int k_split;  // warps sharing a row group (row_group_grid)
  float eps;
};

template <int TMAX, int VEC>
__global__ void __launch_bounds__(kMatvecThreads) lm_head_kernel(LmHeadArgs a) {
  __shared__ float rms_scale[TMAX];
  __shared__ Best warp_bests[kMatvecWarps][TMAX];
  const TokenRows in{a.h, a.norm_w, a.tokens, a.hidden};
  if (a.norm_w != nullptr) block_rms_scale<TMAX, VEC>(in, a.eps, rms_scale);

  Best best[TMAX];
#pragma unroll
  for (int t = 0; t < TMAX; ++t) best[t] = kNoBest;

  const int units = (a.vocab + kRowsPerWarp - 1) / kRowsPerWarp;
  for_each_row_group<TMAX, VEC, kWideForLargeNormed>(
      in, units, a.k_split,
      [&](int unit, const bf16_t* (&rows)[kRowsPerWarp]) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
          rows[r] = a.head + static_cast<size_t>(min(unit * kRowsPerWarp + r, a.vocab - 1)) * a.hidden;
      },
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        // Every lane holds every sum, so every lane tracks the same bests: no shuffles until the end.
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
          if (t < a.tokens) {
            const float scale = a.norm_w != nullptr ? rms_scale[t] : 1.0f;
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r) {
              const int row = unit * kRowsPerWarp + r;
              if (row < a.vocab) {
                const float logit = acc[r][t] * scale;
                best[t] = better(best[t], Best{logit, row});
                if (a.logits != nullptr && lane_id() == r) a.logits[static_cast<size_t>(t) * a.vocab + row] = logit;
              }
            }
          }
        }
      });

#pragma unroll
  for (int t = 0; t < TMAX; ++t)
    if (lane_id() == 0) warp_bests[warp_id()][t] = best[t];
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(a.tokens)) {
    Best b = kNoBest;
#pragma unroll
    for (int w = 0; w < block_warps(); ++w) b = better(b, warp_bests[w][threadIdx.x]);
    a.block_value[static_cast<size_t>(blockIdx.x) * a.tokens + threadIdx.x] = b.value;
    a.block_index[static_cast<size_t>(blockIdx.x) * a.tokens + threadIdx.x] = b.index;
  }
}

// One block: for each token, the best of the blocks' bests.
__global__ void __launch_bounds__(kMatvecThreads) pick_tokens_kernel(LmHeadArgs a) {
  __shared__ Best warp_bests[kMatvecWarps];
  for (int t = 0; t < a.tokens; ++t) {
    Best b = kNoBest;
    for (int i = threadIdx.x; i < a.blocks; i += kMatvecThreads)
      b = better(b, Best{a.block_value[static_cast<size_t>(i) * a.tokens + t],
                         a.block_index[static_cast<size_t>(i) * a.tokens + t]});
    b = warp_best(b);
    if (lane_id() == 0) warp_bests[warp_id()] = b;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kMatvecWarps; ++w) b = better(b, warp_bests[w]);
      a.tokens_out[t] = b.index;
    }
    __syncthreads();
  }
}

ffi::Error lm_head_argmax_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> head,
                               ffi::Buffer<ffi::BF16> norm_w, ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                               ffi::Result<ffi::Buffer<ffi::F32>> logits, ffi::Result<ffi::Buffer<ffi::F32>> block_value,
                               ffi::Result<ffi::Buffer<ffi::S32>> block_index, float eps, int64_t k_split,
                               int64_t warps_per_block, int64_t blocks_per_unit) {
  const RowGroupLaunch launch{k_split, warps_per_block, blocks_per_unit};
  if (ffi::Error err = check_launch("lm_head_argmax", launch); err.failure()) return err;
  auto hd = h.dimensions();
  auto wd = head.dimensions();
  if (hd.size() != 2 || wd.size() != 2 || hd[1] != wd[1])
    return invalid("lm_head_argmax: expected h [tokens, hidden] and head [vocab, hidden], got h " + shape_string(hd) +
                   " and head " + shape_string(wd));
  if (norm_w.element_count() != 0 && norm_w.element_count() != static_cast<size_t>(hd[1]))
    return invalid("lm_head_argmax: norm weight " + shape_string(norm_w.dimensions()) + " must be [hidden]");
  if (logits->element_count() != 0 && logits->element_count() != static_cast<size_t>(hd[0] * wd[0]))
    return invalid("lm_head_argmax: logits must be [tokens, vocab] or empty");
  LmHeadArgs a{};
  a.h = h.typed_data();
  a.head = head.typed_data();
  a.norm_w = optional_data(norm_w);
  a.logits = logits->element_count() ? logits->typed_data() : nullptr;
  a.block_value = block_value->typed_data();
  a.block_index = block_index->typed_data();
  a.tokens_out = tokens->typed_data();
  a.tokens = static_cast<int>(hd[0]);
  a.hidden = static_cast<int>(hd[1]);
  a.vocab = static_cast<int>(wd[0]);
  // The scratch holds one best per block and token: never launch more blocks than it has rows for.
  const int capacity = static_cast<int>(block_value->dimensions()[0]);
  a.eps = eps;
  const bool aligned = aligned16(a.h) && aligned16(a.head) && (a.norm_w == nullptr || aligned16(a.norm_w));
  return with_token_bucket(a.tokens, [&](auto tmax) {
    return with_vector_width(a.hidden, aligned, [&](auto vec) {
      constexpr auto kernel = lm_head_kernel<decltype(tmax)::value, decltype(vec)::value>;
      const RowGroupGrid grid = row_group_grid(
          row_group_work<decltype(tmax)::value, decltype(vec)::value, kWideForLargeNormed>(
              (a.vocab + kRowsPerWarp - 1) / kRowsPerWarp),
          a.hidden, resident_blocks_per_unit<kernel>(launch.threads()), launch);
      LmHeadArgs args = a;
      args.blocks = std::min(grid.blocks, capacity);  // one best per block and token fits the scratch
      args.k_split = grid.k_split;
      kernel<<<args.blocks, grid.warps * WARP_SIZE, 0, stream>>>(args);
      if (ffi::Error err = launch_status("lm_head_argmax"); err.failure()) return err;
      pick_tokens_kernel<<<1, kMatvecThreads, 0, stream>>>(args);
      return launch_status("lm_head_argmax (pick)");
    });
  });
}

}  // namespace
}  // namespace lithos

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosLmHeadArgmax, lithos::lm_head_argmax_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // head
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // final norm weight or empty
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens
                                  .Ret<ffi::Buffer<ffi::F32>>()   // logits or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scratch: best logit per block
                                  .Ret<ffi::Buffer<ffi::S32>>()   // scratch: its id
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("k_split")  // launch parameters: 0 = heuristic
                                  .Attr<int64_t>("warps_per_block")
                                  .Attr<int64_t>("blocks_per_unit"),
                              {ffi::Traits::kCmdBufferCompatible});
