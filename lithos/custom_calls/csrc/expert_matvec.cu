// Routed-expert projections for mixture-of-experts decoding: y[p] = x[p] @ W[layer, expert_ids[p]].T
// for each selected (token, expert) pair p. Only the rows of the experts named in expert_ids are
// read, so a decode step costs the bytes of its routed experts, not of the whole stack.
//
// Weights are bf16 or packed (packed.h: dequantised in registers, f32 accumulation), stacked
// [layers, experts, out, in] (a leading axis of 1 when the caller passes one layer). Work units are
// (pair, group of kRowsPerWarp rows), pair-major, so neighbouring warps stream one expert's rows.
// Out-of-range ids read the nearest expert, as the reference twin does.
//
// LithosExpertGateUpSilu is the gate/up projection with the SwiGLU after it, for experts whose matrix holds the gate
// rows then the up rows ([gate | up], 2 ffn rows: Qwen3-MoE, Qwen2-MoE, Mixtral): y[p] = silu(g) * u, g and u
// rounded to bf16 first, as the unfused projection stores them. Its x has a row a token, not a pair: pair p reads
// row p / (pairs / tokens), so nothing repeats x k times first.
#include "ffi_util.h"
#include "packed.h"
#include "portable.h"
#include "rowdot.h"

// For A/B runs (LITHOS_KERNEL_DEFINES="LITHOS_EXPERT_TWO_BLOCKS=1", NOTES.md "The expert kernels' occupancy"): two
// blocks a CUDA SM (the compiler keeps the registers to 128) with at most two steps of loads in flight a row and lane
// (the format's own, Packed<F>::kUnroll, otherwise), so that one warp's decode runs beside another's loads. 0, the
// default, is the kernels as they were.
#ifndef LITHOS_EXPERT_TWO_BLOCKS
#define LITHOS_EXPERT_TWO_BLOCKS 0
#endif
#if LITHOS_EXPERT_TWO_BLOCKS != 0 && LITHOS_EXPERT_TWO_BLOCKS != 1
#error "LITHOS_EXPERT_TWO_BLOCKS is 0 or 1"
#endif
#if LITHOS_EXPERT_TWO_BLOCKS && !defined(LITHOS_HIP)
#define LITHOS_EXPERT_BOUNDS __launch_bounds__(kMatvecThreads, 2)
#else
#define LITHOS_EXPERT_BOUNDS __launch_bounds__(kMatvecThreads)
#endif

namespace lithos {
namespace {

template <WeightFormat F>
constexpr int kExpertUnroll = LITHOS_EXPERT_TWO_BLOCKS && Packed<F>::kUnroll > 2 ? 2 : Packed<F>::kUnroll;

struct ExpertArgs {
  const bf16_t* x;            // [pairs / pairs_per_x_row, n_in]
  PackedWeight w;             // [layers, experts, n_out, n_in]
  const int32_t* expert_ids;  // [pairs]
  const int32_t* layer;       // [] device scalar
  bf16_t* y;                  // [pairs, n_out], or [pairs, n_out / 2] gated
  int pairs;
  int pairs_per_x_row;        // 1, or a token's k pairs (gated)
  int experts;
  int k_split;
};

template <WeightFormat F, bool GATED>
__global__ void LITHOS_EXPERT_BOUNDS expert_matvec_kernel(ExpertArgs a) {
  constexpr int kOutsPerWarp = GATED ? kRowsPerWarp / 2 : kRowsPerWarp;  // gated: rows gate, up, gate, up
  const int64_t layer = *a.layer;
  const int n_in = a.w.n_in, outs = GATED ? a.w.n_out / 2 : a.w.n_out;
  const int groups = (outs + kOutsPerWarp - 1) / kOutsPerWarp;
  for_each_packed_row_group<F, 1, kExpertUnroll<F>>(
      a.pairs * groups, a.k_split,
      [&](int unit, PackedRow (&rows)[kRowsPerWarp], TokenRows& tokens) {
        const int pair = unit / groups, group = unit % groups;
        const int expert = min(max(a.expert_ids[pair], 0), a.experts - 1);
        const int x_row = GATED ? pair / a.pairs_per_x_row : pair;
        tokens = TokenRows{a.x + static_cast<size_t>(x_row) * n_in, nullptr, 1, n_in};
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          // Rows past the end re-read the last row: valid memory, results discarded.
          const int out = min(group * kOutsPerWarp + (GATED ? r / 2 : r), outs - 1);
          rows[r] = packed_row<F>(a.w, layer, expert, (GATED && r % 2 == 1) ? outs + out : out);
        }
      },
      [&](int unit, const float (&acc)[kRowsPerWarp][1]) {
        const int pair = unit / groups, group = unit % groups;
        if (lane_id() == 0) {
#pragma unroll
          for (int j = 0; j < kOutsPerWarp; ++j) {
            const int out = group * kOutsPerWarp + j;
            const float value = GATED ? silu(round_to_bf16(acc[2 * j][0])) * round_to_bf16(acc[2 * j + 1][0])
                                      : acc[j][0];
            if (out < outs) a.y[static_cast<size_t>(pair) * outs + out] = float_to_bf16(value);
          }
        }
      });
}

template <bool GATED>
ffi::Error expert_matvec_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer data,
                              ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::Buffer<ffi::S32> expert_ids,
                              ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::BF16>> y, int32_t format) {
  const std::string op = GATED ? "expert_gate_up_silu" : "expert_matvec";
  auto xd = x.dimensions();
  auto dd = data.dimensions();
  if (xd.size() != 2 || dd.size() != 4)
    return invalid(op + ": expected x [" + (GATED ? "tokens" : "pairs") + ", in] and w [layers, experts, out, in]; " +
                   "got x " + shape_string(xd) + " and w data " + shape_string(dd));
  ExpertArgs a{};
  if (ffi::Error err = packed_weight(op, format, data, scales, mins, 2, xd[1], a.w); err.failure()) return err;
  const int64_t pairs = static_cast<int64_t>(expert_ids.element_count());
  if ((GATED ? (xd[0] == 0 || pairs % xd[0] != 0) : pairs != xd[0]) || layer.element_count() != 1)
    return invalid(op + ": expert_ids must be [pairs] (" + (GATED ? "a token's pairs together" : "one per row of x") +
                   ") and layer a scalar");
  if (GATED && a.w.n_out % 2 != 0) return invalid(op + ": w must hold 2 ffn rows, [gate | up]");
  const int outs = GATED ? a.w.n_out / 2 : a.w.n_out;
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != pairs || yd[1] != outs)
    return invalid(op + ": output must be [pairs, " + std::to_string(outs) + "]");
  if (!aligned16(x.typed_data()) || !packed_aligned(a.w)) return invalid(op + ": inputs must be 16-byte aligned");
  a.x = x.typed_data();
  a.expert_ids = expert_ids.typed_data();
  a.layer = layer.typed_data();
  a.y = y->typed_data();
  a.pairs = static_cast<int>(pairs);
  a.pairs_per_x_row = GATED ? static_cast<int>(pairs / xd[0]) : 1;
  a.experts = static_cast<int>(dd[1]);
  if (a.pairs == 0 || outs == 0) return ffi::Error::Success();
  constexpr int outs_per_warp = GATED ? kRowsPerWarp / 2 : kRowsPerWarp;
  const int64_t units = int64_t{a.pairs} * ((outs + outs_per_warp - 1) / outs_per_warp);
  return with_weight_format(format, [&](auto fmt) {
    constexpr auto kernel = expert_matvec_kernel<decltype(fmt)::value, GATED>;
    const RowGroupGrid grid = packed_grid(units, a.w.n_in, resident_blocks_per_unit<kernel>(kMatvecThreads));
    ExpertArgs args = a;
    args.k_split = grid.k_split;
    kernel<<<grid.blocks, kMatvecThreads, 0, stream>>>(args);
    return launch_status(GATED ? "expert_gate_up_silu" : "expert_matvec");
  });
}

}  // namespace
}  // namespace lithos

namespace ffi = xla::ffi;

#define LITHOS_EXPERT_BINDING                                              \
  ffi::Ffi::Bind()                                                         \
      .Ctx<ffi::PlatformStream<gpuStream_t>>()                             \
      .Arg<ffi::Buffer<ffi::BF16>>()  /* x */                              \
      .Arg<ffi::AnyBuffer>()          /* w data (bf16, or packed codes) */ \
      .Arg<ffi::AnyBuffer>()          /* w scales or empty */              \
      .Arg<ffi::AnyBuffer>()          /* w mins or empty */                \
      .Arg<ffi::Buffer<ffi::S32>>()   /* expert ids */                     \
      .Arg<ffi::Buffer<ffi::S32>>()   /* layer */                          \
      .Ret<ffi::Buffer<ffi::BF16>>()  /* y */                              \
      .Attr<int32_t>("format")

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosExpertMatvec, lithos::expert_matvec_impl<false>, LITHOS_EXPERT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosExpertGateUpSilu, lithos::expert_matvec_impl<true>, LITHOS_EXPERT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
