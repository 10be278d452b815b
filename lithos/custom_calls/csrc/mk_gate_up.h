// Megakernel task kind 4: RMSNorm -> gate and up rows side by side -> silu(gate) * up (the fused twin
// is matvec.cu's gated variant). A row group (mk_weight_rows.h, gate_up_rows) is two outputs side by
// side, so the product is formed in registers.
#pragma once

#include "mk_matvec.h"
#include "mk_weight_rows.h"

namespace lithos {
namespace mk {

template <int TMAX>
__device__ bool gate_up_task(const Args& a, const Task& task, int index) {
  __shared__ float rms_scale[TMAX];
  const int layer = task.layer;
  constexpr int kOuts = kGatedPerGroup;
  auto rows_of = [&](int unit, PackedRow (&rows)[kRowsPerWarp]) { gate_up_rows<kMlpFormat>(a, layer, unit, rows); };
  const TokenRows in{after_attention(a), a.mlp_norm + static_cast<size_t>(layer) * a.hidden, a.tokens, a.hidden};
  if (!stream_row_groups<kMlpFormat, TMAX>(
          a, task, index, in, rows_of,
      [&](const TokenRows& staged) { block_rms_scale<TMAX, 8, true>(staged, a.eps, rms_scale); },
      [&](int unit, const float (&acc)[kRowsPerWarp][TMAX]) {
        for_each_token<TMAX>(acc, a.tokens, [&](int t, const float (&sums)[kRowsPerWarp]) {
#pragma unroll
          for (int j = 0; j < kOuts; ++j) {
            const int f = unit * kOuts + j;
            if (f < a.ffn) {
              const float gate = sums[2 * j] * rms_scale[t], up = sums[2 * j + 1] * rms_scale[t];
              a.gated[static_cast<size_t>(t) * a.ffn + f] = float_to_bf16(silu(gate) * up);
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
