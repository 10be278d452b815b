// Routed-expert projections for mixture-of-experts decoding: y[p] = x[p] @ W[layer, expert_ids[p]].T
// for each selected (token, expert) pair p. Only the rows of the experts named in expert_ids are
// read, so a decode step costs the bytes of its routed experts, not of the whole stack.
//
// Weights are bf16 or packed (packed.h: dequantised in registers, f32 accumulation), stacked
// [layers, experts, out, in] (a leading axis of 1 when the caller passes one layer). Work units are
// (pair, group of kRowsPerWarp rows), pair-major, so neighbouring warps stream one expert's rows.
// Out-of-range ids read the nearest expert, as the reference twin does.
#include "ffi_util.h"
#include "packed.h"
#include "portable.h"
#include "rowdot.h"

namespace lithos {
namespace {

struct ExpertArgs {
  const bf16_t* x;            // [pairs, n_in]
  PackedWeight w;             // [layers, experts, n_out, n_in]
  const int32_t* expert_ids;  // [pairs]
  const int32_t* layer;       // [] device scalar
  bf16_t* y;                  // [pairs, n_out]
  int pairs;
  int experts;
  int k_split;
};

template <WeightFormat F>
__global__ void __launch_bounds__(kMatvecThreads) expert_matvec_kernel(ExpertArgs a) {
  const int64_t layer = *a.layer;
  const int n_out = a.w.n_out, n_in = a.w.n_in;
  const int groups = (n_out + kRowsPerWarp - 1) / kRowsPerWarp;
  for_each_packed_row_group<F, 1>(
      a.pairs * groups, a.k_split,
      [&](int unit, PackedRow (&rows)[kRowsPerWarp], TokenRows& tokens) {
        const int pair = unit / groups, group = unit % groups;
        const int expert = min(max(a.expert_ids[pair], 0), a.experts - 1);
        tokens = TokenRows{a.x + static_cast<size_t>(pair) * n_in, nullptr, 1, n_in};
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
          // Rows past the end re-read the last row: valid memory, results discarded.
          rows[r] = packed_row<F>(a.w, layer, expert, min(group * kRowsPerWarp + r, n_out - 1));
      },
      [&](int unit, const float (&acc)[kRowsPerWarp][1]) {
        const int pair = unit / groups, group = unit % groups;
        if (lane_id() == 0) {
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) {
            const int out = group * kRowsPerWarp + r;
            if (out < n_out) a.y[static_cast<size_t>(pair) * n_out + out] = float_to_bf16(acc[r][0]);
          }
        }
      });
}

ffi::Error expert_matvec_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer data,
                              ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::Buffer<ffi::S32> expert_ids,
                              ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::BF16>> y, int32_t format) {
  const std::string op = "expert_matvec";
  auto xd = x.dimensions();
  auto dd = data.dimensions();
  if (xd.size() != 2 || dd.size() != 4)
    return invalid(op + ": expected x [pairs, in] and w [layers, experts, out, in]; got x " + shape_string(xd) +
                   " and w data " + shape_string(dd));
  ExpertArgs a{};
  if (ffi::Error err = packed_weight(op, format, data, scales, mins, 2, xd[1], a.w); err.failure()) return err;
  if (expert_ids.element_count() != static_cast<size_t>(xd[0]) || layer.element_count() != 1)
    return invalid(op + ": expert_ids must be [pairs] and layer a scalar");
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != a.w.n_out) return invalid(op + ": output must be [pairs, out]");
  if (!aligned16(x.typed_data()) || !packed_aligned(a.w)) return invalid(op + ": inputs must be 16-byte aligned");
  a.x = x.typed_data();
  a.expert_ids = expert_ids.typed_data();
  a.layer = layer.typed_data();
  a.y = y->typed_data();
  a.pairs = static_cast<int>(xd[0]);
  a.experts = static_cast<int>(dd[1]);
  if (a.pairs == 0 || a.w.n_out == 0) return ffi::Error::Success();
  const int64_t units = int64_t{a.pairs} * ((a.w.n_out + kRowsPerWarp - 1) / kRowsPerWarp);
  return with_weight_format(format, [&](auto fmt) {
    constexpr auto kernel = expert_matvec_kernel<decltype(fmt)::value>;
    const RowGroupGrid grid = packed_grid(units, a.w.n_in, resident_blocks_per_unit<kernel>(kMatvecThreads));
    ExpertArgs args = a;
    args.k_split = grid.k_split;
    kernel<<<grid.blocks, kMatvecThreads, 0, stream>>>(args);
    return launch_status("expert_matvec");
  });
}

}  // namespace
}  // namespace lithos

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosExpertMatvec, lithos::expert_matvec_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::AnyBuffer>()          // w data (bf16 values, or packed codes)
                                  .Arg<ffi::AnyBuffer>()          // w scales or empty
                                  .Arg<ffi::AnyBuffer>()          // w mins or empty
                                  .Arg<ffi::Buffer<ffi::S32>>()   // expert ids
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // y
                                  .Attr<int32_t>("format"),
                              {ffi::Traits::kCmdBufferCompatible});
