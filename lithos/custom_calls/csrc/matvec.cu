// Batch-1 projections for 1..16 tokens: y[t, o] = residual[t, o] + sum_i xn[t, i] W[o, i], where
// xn is x or RMSNorm(x) (fused: the norm factor multiplies the dot product), and the gated variant
// y[t, f] = silu(xn . Wg[f]) * (xn . Wu[f]) reads the gate and up rows side by side. Weights are
// stacked per layer, [layers, out, in]; `layer` is a device scalar so the call sits inside a scan.
#include "ffi_util.h"
#include "portable.h"
#include "row_groups.h"
#include "rowdot.h"

namespace lithos {
namespace {

struct MatvecArgs {
  const bf16_t* x;         // [tokens, n_in]
  const bf16_t* w;         // [layers, n_out, n_in] (the gate rows in the gated variant)
  const bf16_t* w_up;      // [layers, n_out, n_in] (gated variant only)
  const int32_t* layer;    // [] device scalar
  int64_t w_layer_stride;  // elements between layers of w and w_up
  const bf16_t* norm_w;    // [layers, n_in] or nullptr: fuse RMSNorm of x
  int64_t norm_layer_stride;
  const bf16_t* residual;  // [tokens, n_out] or nullptr
  bf16_t* y;               // [tokens, n_out]
  int tokens;
  int n_in;
  int n_out;
  int k_split;  // warps sharing a row group (row_group_grid)
  float eps;
};

// The gate/up kernel reads many rows with normed inputs; the plain one serves the O and down projections.
template <bool GATED>
constexpr int kMatvecWideFrom = GATED ? kWideForLargeNormed : kWideForRest;

// Each warp owns kRowsPerWarp weight rows at a time: four outputs, or in the gated variant two
// outputs as (gate, up) row pairs so silu(gate) * up is formed in registers.
template <int TMAX, int VEC, bool GATED>
__global__ void __launch_bounds__(kMatvecThreads) matvec_kernel(MatvecArgs a) {
  constexpr int kOutsPerWarp = GATED ? kRowsPerWarp / 2 : kRowsPerWarp;
  __shared__ float rms_scale[TMAX];

  const int64_t layer = *a.layer;
  const bf16_t* w = a.w + layer * a.w_layer_stride;
  const bf16_t* w_up = GATED ? a.w_up + layer * a.w_layer_stride : nullptr;
  const TokenRows in{a.x, a.norm_w ? a.norm_w + layer * a.norm_layer_stride : nullptr, a.tokens, a.n_in};
  if (in.norm_w != nullptr) block_rms_scale<TMAX, VEC>(in, a.eps, rms_scale);

  const int units = (a.n_out + kOutsPerWarp - 1) / kOutsPerWarp;
  for_each_row_group<TMAX, VEC, kMatvecWideFrom<GATED>>(
      in, units, a.k_split,
      [&](int unit, const bf16_t* (&rows)[kRowsPerWarp]) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          // Rows past the end re-read the last row: valid memory, results discarded.
          const int out = min(unit * kOutsPerWarp + (GATED ? r / 2 : r), a.n_out - 1);
          rows[r] = ((GATED && r % 2 == 1) ? w_up : w) + static_cast<size_t>(out) * a.n_in;
        }
      },
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        for_each_token<TMAX>(acc, a.tokens, [&](int t, const float (&sums)[kRowsPerWarp]) {
          const float scale = in.norm_w != nullptr ? rms_scale[t] : 1.0f;
#pragma unroll
          for (int j = 0; j < kOutsPerWarp; ++j) {
            const int out = unit * kOutsPerWarp + j;
            if (out < a.n_out) {
              const size_t at = static_cast<size_t>(t) * a.n_out + out;
              float value = GATED ? silu(sums[2 * j] * scale) * (sums[2 * j + 1] * scale) : sums[j] * scale;
              if (a.residual != nullptr) value += bf16_to_float(a.residual[at]);
              a.y[at] = float_to_bf16(value);
            }
          }
        });
      });
}

template <bool GATED>
ffi::Error launch_matvec(gpuStream_t stream, const MatvecArgs& a, const RowGroupLaunch& launch) {
  if (ffi::Error err = check_launch(GATED ? "gate_up_silu" : "matvec", launch); err.failure()) return err;
  const int outs_per_warp = GATED ? kRowsPerWarp / 2 : kRowsPerWarp;
  const bool aligned = aligned16(a.x) && aligned16(a.w) && (!GATED || aligned16(a.w_up)) &&
                       (a.norm_w == nullptr || aligned16(a.norm_w)) && a.w_layer_stride % 8 == 0 &&
                       a.norm_layer_stride % 8 == 0;
  return with_token_bucket(a.tokens, [&](auto tmax) {
    return with_vector_width(a.n_in, aligned, [&](auto vec) {
      constexpr auto kernel = matvec_kernel<decltype(tmax)::value, decltype(vec)::value, GATED>;
      const RowGroupGrid grid = row_group_grid(
          row_group_work<decltype(tmax)::value, decltype(vec)::value, kMatvecWideFrom<GATED>>(
              (a.n_out + outs_per_warp - 1) / outs_per_warp),
          a.n_in, resident_blocks_per_unit<kernel>(launch.threads()), launch);
      MatvecArgs args = a;
      args.k_split = grid.k_split;
      kernel<<<grid.blocks, grid.warps * WARP_SIZE, 0, stream>>>(args);
      return launch_status(GATED ? "gate_up_silu" : "matvec");
    });
  });
}

// Shapes shared by both variants; fills everything in MatvecArgs but the weights.
ffi::Error check_matvec_shapes(const char* op, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::BF16>& w,
                               ffi::Buffer<ffi::S32>& layer, ffi::Buffer<ffi::BF16>& norm_w,
                               ffi::Result<ffi::Buffer<ffi::BF16>>& y, float eps, MatvecArgs& a) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2])
    return invalid(std::string(op) + ": expected x [tokens, in] and w [layers, out, in], got x " + shape_string(xd) +
                   " and w " + shape_string(wd));
  if (layer.element_count() != 1) return invalid(std::string(op) + ": layer must be a scalar");
  if (norm_w.element_count() != 0 && (norm_w.dimensions().size() != 2 || norm_w.dimensions()[1] != xd[1]))
    return invalid(std::string(op) + ": norm weight " + shape_string(norm_w.dimensions()) + " does not match in=" +
                   std::to_string(xd[1]));
  if (y->dimensions().size() != 2 || y->dimensions()[0] != xd[0] || y->dimensions()[1] != wd[1])
    return invalid(std::string(op) + ": output must be [tokens, out]");
  a.x = x.typed_data();
  a.layer = layer.typed_data();
  a.w_layer_stride = layer_stride(w);
  a.norm_w = optional_data(norm_w);
  a.norm_layer_stride = a.norm_w ? layer_stride(norm_w) : 0;
  a.y = y->typed_data();
  a.tokens = static_cast<int>(xd[0]);
  a.n_in = static_cast<int>(xd[1]);
  a.n_out = static_cast<int>(wd[1]);
  a.eps = eps;
  return ffi::Error::Success();
}

ffi::Error matvec_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> norm_w, ffi::Buffer<ffi::BF16> residual,
                       ffi::Result<ffi::Buffer<ffi::BF16>> y, float eps, int64_t k_split, int64_t warps_per_block,
                       int64_t blocks_per_unit) {
  MatvecArgs a{};
  if (ffi::Error err = check_matvec_shapes("matvec", x, w, layer, norm_w, y, eps, a); err.failure()) return err;
  a.w = w.typed_data();
  a.residual = optional_data(residual);
  if (a.residual != nullptr && residual.element_count() != y->element_count())
    return invalid("matvec: residual " + shape_string(residual.dimensions()) + " must be [tokens, out]");
  return launch_matvec<false>(stream, a, RowGroupLaunch{k_split, warps_per_block, blocks_per_unit});
}

ffi::Error gate_up_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w_gate,
                        ffi::Buffer<ffi::BF16> w_up, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> norm_w,
                        ffi::Result<ffi::Buffer<ffi::BF16>> y, float eps, int64_t k_split, int64_t warps_per_block,
                        int64_t blocks_per_unit) {
  MatvecArgs a{};
  if (ffi::Error err = check_matvec_shapes("gate_up_silu", x, w_gate, layer, norm_w, y, eps, a); err.failure())
    return err;
  if (w_up.dimensions().size() != 3 || w_up.element_count() != w_gate.element_count())
    return invalid("gate_up_silu: w_up " + shape_string(w_up.dimensions()) + " must match w_gate " +
                   shape_string(w_gate.dimensions()));
  a.w = w_gate.typed_data();
  a.w_up = w_up.typed_data();
  return launch_matvec<true>(stream, a, RowGroupLaunch{k_split, warps_per_block, blocks_per_unit});
}

}  // namespace
}  // namespace lithos

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosMatvec, lithos::matvec_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // norm weight or empty
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // residual or empty
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // y
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("k_split")  // launch parameters: 0 = heuristic
                                  .Attr<int64_t>("warps_per_block")
                                  .Attr<int64_t>("blocks_per_unit"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosGateUpSilu, lithos::gate_up_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_gate
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_up
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // norm weight or empty
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // y
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("k_split")  // launch parameters: 0 = heuristic
                                  .Attr<int64_t>("warps_per_block")
                                  .Attr<int64_t>("blocks_per_unit"),
                              {ffi::Traits::kCmdBufferCompatible});
