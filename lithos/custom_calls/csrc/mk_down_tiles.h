// Megakernel task kind 5 over an MXFP4 down matrix in fragment tiles (a build with LITHOS_MK_DOWN_TILES=1; the
// layout: lithos/quant/tiles.py, mxfp4_tiles.h): y = residual + gated W_down^T, a tile 16 output rows x 64 of the
// ffn inputs, a task whole tiles (4 of tasks.py's 4-row units each).
//
// CUDA, every token count, on tensor cores. B is the gated activations, bf16 already: one part, exact, a token a
// column (8 tokens an n-block, two at 16). Staged it would not fit (8 tokens of 14336 inputs are 229 KB), so each
// step's B fragments are read straight from the gated vector (lane (g, t): token g's inputs 2t, 2t + 1, 2t + 8,
// 2t + 9 of each 16), times 2^64 so that the products with A's value * 2^-126 stay normal f32 (exact for
// |x| < 2^64). Every (tile group, k tile) step is one warp's, so a block reads and scales B once a group; a warp
// asks for the next step's B as each step starts, as it does for the weights.
// The block's tiles in groups of R, the (group, k tile) pairs cut in 8 flat ranges, one a warp (as the one-token
// gate/up task); each warp writes its sums of every tile its range touches in the lane ring's input area, one
// barrier, then each tile's pieces are added in warp order and the residual added to them.
// HIP builds have no tensor-core form: kernel.py keeps down in rows there, and the FFI refuses a tiled down.
#pragma once

#include "mk_gate_up_tiles.h"

namespace lithos {
namespace mk {

constexpr int kDownTileUnits = kTileRows / kRowsPerWarp;  // tasks.py's 4-row units in a 16-row tile

#if LITHOS_MK_TILE_MMA
// n-blocks of the mma for TMAX tokens: column g of n-block nb is token 8 nb + g.
template <int TMAX>
constexpr int kDownTokenBlocks = (TMAX + 7) / 8;
// A tile's sums from one warp and n-block: [lane][fragment], lane (g, t) holding rows g and g + 8 of tokens
// 8 nb + 2t and 8 nb + 2t + 1.
constexpr int kDownPieceBytes = 32 * 4 * 4;

// Two bf16 activations as the mma's B takes them: each times kTileOperandShift, exact for |x| < 2^64.
__device__ __forceinline__ uint32_t scaled_pair(uint32_t bits) {
  const bf16_t lo = float_to_bf16(__uint_as_float(bits << 16) * kTileOperandShift);
  const bf16_t hi = float_to_bf16(__uint_as_float(bits & 0xFFFF0000u) * kTileOperandShift);
  return lo | static_cast<uint32_t>(hi) << 16;
}

// Two consecutive gated activations, written earlier in this launch: a plain coherent load (rowdot.h).
__device__ __forceinline__ uint32_t load_gated_pair(const bf16_t* p) {
  uint32_t v;
  asm volatile("ld.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

template <int TMAX>
__device__ bool down_tiles_task(const Args& a, const Task& task, int index) {
  constexpr int NB = kDownTokenBlocks<TMAX>, D = LITHOS_MK_TILE_DEPTH, R = LITHOS_MK_TILE_PAIRS;
  const int layer = task.layer, lane32 = lane_id() % 32, g = lane32 / 4, t = lane32 % 4;
  const int first_tile = task.first / kDownTileUnits, tiles = task.count / kDownTileUnits;
  const int k_tiles = a.ffn / kTileInputs;
  if (tiles * kMatvecWarps * NB * kDownPieceBytes > kRingInputBytes) {  // kernel.py checks it before the launch
    if (threadIdx.x == 0) abort_step(a, index);
    return false;
  }
  const int all = (tiles + R - 1) / R * k_tiles;
  const int q0 = all * warp_id() / kMatvecWarps, q1 = all * (warp_id() + 1) / kMatvecWarps, steps = q1 - q0;
  FlatWalk<R> walk{first_tile, tiles, q0 / k_tiles, q0 % k_tiles, k_tiles};
  TilePipeline<D, R, DownMatrix> pipe;
  pipe.fill(a, layer, lane32, steps, walk);
  if (!block_wait(a, task, index)) return false;
  trace_phase(a, index, 0);
  float(*pieces)[kMatvecWarps][NB][32][4] =
      reinterpret_cast<float(*)[kMatvecWarps][NB][32][4]>(ring_memory());  // [tile][warp][n-block][lane][q]
  float acc[R][NB][4] = {};
  int group = q0 / k_tiles, kt = q0 % k_tiles;
  // B of k tile `k` as loaded, [n-block][k16 step][pair]: the next step's asked for as the step starts, beside the
  // pipeline's weights (B depends on the k tile only; the first after the wait, the activations being this layer's).
  uint32_t next[NB][4][2];
  auto load_operand = [&](int k) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int u = 8 * nb + g;
      const bf16_t* x = a.gated + static_cast<size_t>(u) * a.ffn + k * kTileInputs + 2 * t;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        next[nb][j][0] = u < a.tokens ? load_gated_pair(x + 16 * j) : 0u;
        next[nb][j][1] = u < a.tokens ? load_gated_pair(x + 16 * j + 8) : 0u;
      }
    }
  };
  if (steps > 0) load_operand(kt);
  pipe.for_each_step(a, layer, lane32, steps, walk, [&](int i, const TileChunk(&down)[R]) {
    const int count = min(R, tiles - R * group);  // the group's tiles; the step's others are zeros
    uint2 b[4][NB];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j][nb] = make_uint2(scaled_pair(next[nb][j][0]), scaled_pair(next[nb][j][1]));
    if (i + 1 < steps) load_operand(kt + 1 == k_tiles ? 0 : kt + 1);
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < count) tile_step_mma(down[r], b, acc[r]);
    if (++kt < k_tiles && i + 1 < steps) return;
    // The group's last step in this range: its tiles' pieces out.
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        if (r < count) {
#pragma unroll
          for (int q = 0; q < 4; ++q) pieces[R * group + r][warp_id()][nb][lane32][q] = acc[r][nb][q];
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[r][nb][q] = 0.0f;
      }
    }
    if (kt == k_tiles) {
      kt = 0;
      ++group;
    }
  });
  trace_phase(a, index, 1);
  __syncthreads();
  const bf16_t* residual_in = after_attention(a);
  bf16_t* out = after_mlp(a);
  for (int i = static_cast<int>(threadIdx.x); i < tiles * NB * 32; i += kMatvecThreads) {
    const int j = i / (NB * 32), nb = i / 32 % NB, lane = i % 32;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int j0 = j / R * k_tiles;  // its group's steps
    for_each_warp_in(all, j0, j0 + k_tiles, [&](int w) {
#pragma unroll
      for (int q = 0; q < 4; ++q) sums[q] += pieces[j][w][nb][lane][q];
    });
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int row = (first_tile + j) * kTileRows + lane / 4 + 8 * (q / 2);
      const int token = 8 * nb + 2 * (lane % 4) + q % 2;
      if (token < a.tokens) {
        const size_t at = static_cast<size_t>(token) * a.hidden + row;
        out[at] = float_to_bf16(sums[q] + bf16_to_float(residual_in[at]));
      }
    }
  }
  trace_phase(a, index, 2);
  block_release(a, task.signal_counter);
  return true;
}
#endif

}  // namespace mk
}  // namespace lithos
