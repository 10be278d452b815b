// Megakernel task kinds 3 and 5: a projection into the residual stream, y = residual + x W^T, for
// the O projection (x = the attention output) and the down projection (x = the gated MLP
// activations). Row groups are four consecutive output rows.
#pragma once

#include "mk_matvec.h"
#include "mk_weight_rows.h"

namespace lithos {
namespace mk {

// F: the format of the task's matrix (kOFormat for O, kDownFormat for down).
template <WeightFormat F, int TMAX>
__device__ bool projection_task(const Args& a, const Task& task, int index) {
  const bool o_proj = task.op == kOpOProj;
  const int layer = task.layer;
  const int n_in = projection_inputs(a, task.op);
  auto rows_of = [&](int unit, PackedRow (&rows)[kRowsPerWarp]) { projection_rows<F>(a, task.op, layer, unit, rows); };
  const TokenRows in{o_proj ? a.attn : a.gated, nullptr, a.tokens, n_in};
  const bf16_t* residual_in = o_proj ? layer_input(a, layer) : after_attention(a);
  bf16_t* out = o_proj ? after_attention(a) : after_mlp(a);
  if (!stream_row_groups<F, TMAX>(
          a, task, index, in, rows_of, [](const TokenRows&) {},
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        for_each_token<TMAX>(acc, a.tokens, [&](int t, const float (&sums)[kRowsPerWarp]) {
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) {
            const int row = unit * kRowsPerWarp + r;
            if (row < a.hidden) {
              const size_t at = static_cast<size_t>(t) * a.hidden + row;
              out[at] = float_to_bf16(sums[r] + bf16_to_float(residual_in[at]));
            }
          }
        });
      }))
    return false;
  block_release(a, task.signal_counter);
  return true;
}

}  // namespace mk
}  // namespace lithos
