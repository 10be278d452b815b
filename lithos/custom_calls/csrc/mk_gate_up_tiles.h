// Megakernel task kind 4 over MXFP4 gate and up matrices in fragment tiles (a build with
// LITHOS_MK_GATE_UP_TILES=1; the layout: lithos/quant/tiles.py, mxfp4_tiles.h). A tile is 16 rows x 64 inputs,
// 512 bytes of codes and 32 of scales; the task's unit is a tile of the gate matrix and the same rows' tile of
// the up matrix: 16 outputs (kTileUnits of tasks.py's 2-output row groups), whose lane group g holds both
// halves of outputs g and g + 8.
//
// One token, CUDA: the block's tiles in groups of 4 pairs, the (group, step) pairs cut in one flat range a warp;
// each step's A fragments are the lane's 16 bytes of a tile, every pair of codes a bf16x2 of value * 2^-126 after
// one to three integer operations; B is x * norm_w * 2^64 as two bf16 parts (hi, lo: their sum is the f32 product
// exactly) in columns 0 and 1, staged once per task in fragment order. A block's two mma start from zero and its scale,
// 2^(c - 65), multiplies their sum in f32. Each warp's sums of a tile go beside B; after one barrier a tile's
// pieces are added in warp order.
// 2-16 tokens, CUDA, where B for every token fits the lane ring's memory (all of it at 2-8 tokens of 8B, at 2-16 of
// 1B): tensor cores as well, a warp a tile pair over all its k tiles (gate_up_tiles_mma_tokens).
// Elsewhere (HIP, B too large: 16 tokens of 8B) each lane decodes its codes to f32 and multiplies them with the
// activations (a dot product's order of inputs is free), in teams of k_split warps that add their sums through
// shared memory as stream_row_groups' teams do.
// The megakernel's layout for MXFP4 gate and up on CUDA (kernel.py tiles_wanted): on the H200 an 8B step is 5%
// faster than with the rows and an 8-position verification round 18% faster (NOTES.md, runs 106-108).
#pragma once

#include "mk_common.h"
#include "mk_gate_up.h"
#include "mk_tiles.h"

namespace lithos {
namespace mk {

constexpr int kTileUnits = kTileRows / 2;  // 2-output row groups (tasks.py) in a 16-output tile pair
// One token on tensor cores where B can be staged in the ring's input area; the decode-to-float path takes one
// pair a step, 2 in flight (its accumulators hold 16 tokens).
template <int TMAX>
constexpr bool kTileMmaFor = LITHOS_MK_TILE_MMA && TMAX == 1 && kRingSmemBytes<TMAX> > 0;
// 2-16 tokens on tensor cores too, where B fits the ring's memory (checked as the task starts).
template <int TMAX>
constexpr bool kTileMmaTokensFor = LITHOS_MK_TILE_MMA && TMAX > 1 && kRingSmemBytes<TMAX> > 0;
template <int TMAX>
constexpr int kTilePairs = kTileMmaFor<TMAX> ? LITHOS_MK_TILE_PAIRS : 1;
template <int TMAX>
constexpr int kTileDepth = kTileMmaFor<TMAX> ? LITHOS_MK_TILE_DEPTH : 2;

#if LITHOS_MK_TILE_MMA
// A tile's sums from one warp, beside B: [warp][lane group][gate g, gate g + 8, up g, up g + 8].
constexpr int kTilePieceBytes = kMatvecWarps * 8 * 4 * 4;

// n-blocks of the mma for TMAX tokens: columns 2 u' and 2 u' + 1 of n-block u / 4 are token u's two parts
// (u' = u % 4), so lane (g, t)'s sums end up as rows g and g + 8 of token 4 nb + t.
template <int TMAX>
constexpr int kTileTokenBlocks = (TMAX + 3) / 4;
// B for up to TMAX tokens: k-step s's n-block nb for lane (g, t) at [(s NB + nb) 32 + 4 g + t], 16 bytes an input
// and n-block (64 KB at 4096 inputs and 2-4 tokens, 128 KB at 8, 256 KB at 16); tokens past in.tokens are zeros.
// Every thread calls it; a barrier ends it.
template <int TMAX>
__device__ inline void stage_tile_operand_tokens(const TokenRows& in) {
  constexpr int NB = kTileTokenBlocks<TMAX>;
  uint2* bs = tile_operand();
  float unused = 0.0f;
  for (int i = static_cast<int>(threadIdx.x); i < in.n_in / 16 * 4 * NB; i += kMatvecThreads) {
    const int s = i / (4 * NB), u = i % (4 * NB), nb = u / 4, column = 2 * (u % 4);
    uint32_t part[kTileOperandParts][8] = {};
    if (u < in.tokens) operand_parts(in.x + static_cast<size_t>(u) * in.n_in, in.norm_w, 16 * s, part, unused);
#pragma unroll
    for (int g = 0; g < kTileOperandParts; ++g)
#pragma unroll
      for (int t = 0; t < 4; ++t)
        bs[(s * NB + nb) * 32 + 4 * (column + g) + t] = make_uint2(part[g][t], part[g][t + 4]);
  }
  __syncthreads();
}
#endif

// acc[rh][t] += one step of a tile decoded to f32 on the CUDA cores: rows g (rh = 0) and g + 8 (rh = 1) of the
// lane's inputs 64 kt + 16 j + 2 t' + {0, 1, 8, 9} (t' = lane % 4) with token t.
template <int TMAX>
__device__ __forceinline__ void tile_step_decoded(const TileChunk& c, const TokenRows& in, int kt, int lane32,
                                                  float (&acc)[2][TMAX]) {
  constexpr float kUndo = 85070591730234615865843651857942052864.0f;  // 2^126: value * 2^-126 -> value
#pragma unroll
  for (int blk = 0; blk < 2; ++blk) {
    float part[2][TMAX];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
#pragma unroll
      for (int t = 0; t < TMAX; ++t) part[rh][t] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int j = 2 * blk + jj;
      const uint32_t w = c.codes[j];
      const uint32_t pairs[4] = {decode_pair<0>(w), decode_pair<1>(w), decode_pair<2>(w), decode_pair<3>(w)};
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int k = kt * kTileInputs + 16 * j + 2 * (lane32 % 4) + 8 * (p >> 1);
        const float v0 = __uint_as_float(pairs[p] << 16) * kUndo, v1 = __uint_as_float(pairs[p] & 0xFFFF0000u) * kUndo;
        const float n0 = in.norm_w != nullptr ? bf16_to_float(in.norm_w[k]) : 1.0f;
        const float n1 = in.norm_w != nullptr ? bf16_to_float(in.norm_w[k + 1]) : 1.0f;
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
          if (t < in.tokens) {
            const bf16_t* x = in.x + static_cast<size_t>(t) * in.n_in + k;
            const float x0 = load_activation<1, true>(x)[0] * n0, x1 = load_activation<1, true>(x + 1)[0] * n1;
            part[p & 1][t] = fmaf(v0, x0, fmaf(v1, x1, part[p & 1][t]));
          }
        }
      }
    }
    const float s0 = blk == 0 ? mx_scale<0>(c.scales) : mx_scale<1>(c.scales);
    const float s8 = blk == 0 ? mx_scale<2>(c.scales) : mx_scale<3>(c.scales);
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
      acc[0][t] = fmaf(part[0][t], s0, acc[0][t]);
      acc[1][t] = fmaf(part[1][t], s8, acc[1][t]);
    }
  }
}

// The matrices a tiled task reads at each step of a tile (load(m, tile, kt) of matrix m): gate and up (a tile pair),
// or one matrix of a single-matrix task (mk_tiled_matvec.h), which maps the task's tiles to the matrix's.
struct GateUpMatrices {
  static constexpr int kCount = 2;
  TileSource gate, up;
  __device__ __forceinline__ static GateUpMatrices of(const Args& a, int layer, int lane32) {
    return {TileSource::of(a.w_gate, layer, lane32), TileSource::of(a.w_up, layer, lane32)};
  }
  __device__ __forceinline__ TileChunk load(int m, int tile, int kt) const {
    return (m == 0 ? gate : up).load(tile, kt);
  }
};

// A team member's steps: in round r, tile `first + min(r * slots + slot, tiles - 1)` (a surplus member redoes the
// last, unused), k tiles kt0 + s * kTileHalves + half for s < span.
struct RoundWalk {
  int first, tiles, slots, slot, kt0, span, half, k_tiles, round = 0, step = 0;
  __device__ __forceinline__ int tile_of(int r) const { return first + min(r * slots + slot, tiles - 1); }
  __device__ __forceinline__ void next(int& t, int& k, int& count) {
    t = tile_of(round);
    k = min(kt0 + step * kTileHalves + half, k_tiles - 1);
    count = 1;
    if (++step == span) {
      step = 0;
      ++round;
    }
  }
};

// 16 outputs of the gated activation from one token's sums of a tile pair, by lane group g (lanes t = 0):
// sums = (gate g, gate g + 8, up g, up g + 8), before the RMSNorm factor.
__device__ __forceinline__ void store_gated(const Args& a, int t, int tile, int g, const float (&sums)[4], float rms) {
  const int f = tile * kTileRows + g;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const float gate = sums[rh] * rms, up = sums[2 + rh] * rms;
    a.gated[static_cast<size_t>(t) * a.ffn + f + 8 * rh] = float_to_bf16(silu(gate) * up);
  }
}

#if LITHOS_MK_TILE_MMA
// 2-16 tokens on tensor cores: a warp a tile pair a round over all its k tiles (the
// schedule's k_split 1 at more tokens), B for every token staged once (stage_tile_operand_tokens), each step's
// codes decoded once for all of B's n-blocks; lane (g, t) ends a round with rows g and g + 8 of tokens t, t + 4,
// ... and stores them itself: no sums to share.
template <int TMAX>
__device__ bool gate_up_tiles_mma_tokens(const Args& a, const Task& task, int index) {
  constexpr int NB = kTileTokenBlocks<TMAX>, D = kTileDepth<TMAX>;
  const int layer = task.layer, lane32 = lane_id() % 32, g = lane32 / 4, t = lane32 % 4;
  const int first_tile = task.first / kTileUnits, tiles = task.count / kTileUnits;
  const int k_tiles = a.hidden / kTileInputs;
  if (task.k_split != 1) {
    if (threadIdx.x == 0) abort_step(a, index);
    return false;
  }
  const int slot = warp_id(), rounds = (tiles + kMatvecWarps - 1) / kMatvecWarps, steps = rounds * k_tiles;
  RoundWalk walk{first_tile, tiles, kMatvecWarps, slot, 0, k_tiles, 0, k_tiles};
  TilePipeline<D, 1, GateUpMatrices> pipe;
  pipe.matrices = GateUpMatrices::of(a, layer, lane32);
  pipe.fill(steps, walk);
  const TokenRows in{after_attention(a), a.mlp_norm + static_cast<size_t>(layer) * a.hidden, a.tokens, a.hidden};
  if (!block_wait(a, task, index)) return false;
  __shared__ float rms_scale[TMAX];
  block_rms_scale<TMAX, 8, true>(in, a.eps, rms_scale);
  stage_tile_operand_tokens<TMAX>(in);
  trace_phase(a, index, 0);
  const uint2* bs = tile_operand();
  float acc[2][NB][4] = {};  // [gate, up][n-block][fragment]
  int kt = 0, round = 0;
  pipe.for_each_step(steps, walk, [&](int, const TileChunk(&gate)[1], const TileChunk(&up)[1]) {
    uint2 b[4][NB];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) b[j][nb] = bs[((kt * 4 + j) * NB + nb) * 32 + lane32];
    tile_step_mma(gate[0], b, acc[0]);
    tile_step_mma(up[0], b, acc[1]);
    if (++kt < k_tiles) return;
    kt = 0;
    const int tile = round * kMatvecWarps + slot;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int u = 4 * nb + t;
      if (tile < tiles && u < a.tokens) {
        const float sums[4] = {acc[0][nb][0] + acc[0][nb][1], acc[0][nb][2] + acc[0][nb][3],
                               acc[1][nb][0] + acc[1][nb][1], acc[1][nb][2] + acc[1][nb][3]};
        store_gated(a, u, first_tile + tile, g, sums, rms_scale[u]);
      }
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][nb][e] = 0.0f;
    }
    ++round;
  });
  trace_phase(a, index, 2);
  block_release(a, task.signal_counter);
  return true;
}
#endif

template <int TMAX>
__device__ bool gate_up_tiles_task(const Args& a, const Task& task, int index) {
  const int layer = task.layer;
  const int lane32 = lane_id() % 32, g = lane32 / 4;
  const int first_tile = task.first / kTileUnits, tiles = task.count / kTileUnits;
  const int k_tiles = a.hidden / kTileInputs;
  constexpr int D = kTileDepth<TMAX>, R = kTilePairs<TMAX>;
  TilePipeline<D, R, GateUpMatrices> pipe;
  pipe.matrices = GateUpMatrices::of(a, layer, lane32);
  const TokenRows in{after_attention(a), a.mlp_norm + static_cast<size_t>(layer) * a.hidden, a.tokens, a.hidden};

#if LITHOS_MK_TILE_MMA
  // One token on tensor cores: the block's tiles in groups of R, the (group, k tile) pairs cut in 8 flat ranges,
  // one a warp, its loads running on across groups (the probe's fastest form, NOTES.md run 94d), B staged once.
  // Each warp writes its sums of every tile its range touches beside B; one barrier, then each tile's pieces are
  // added in warp order. The only form the one-token kernel has: the decode to f32 below stays out of its code
  // (kernel.py checks that B and the pieces fit before it launches).
  if constexpr (kTileMmaFor<TMAX>) {
    const int operand_bytes = tile_operand_bytes(a.hidden);
    if (operand_bytes + tiles * kTilePieceBytes > kRingInputBytes) {
      if (threadIdx.x == 0) abort_step(a, index);
      return false;
    }
    const int all = (tiles + R - 1) / R * k_tiles;
    const int q0 = all * warp_id() / kMatvecWarps, q1 = all * (warp_id() + 1) / kMatvecWarps, steps = q1 - q0;
    FlatWalk<R> walk{first_tile, tiles, q0 / k_tiles, q0 % k_tiles, k_tiles};
    pipe.fill(steps, walk);
    if (!block_wait(a, task, index)) {
      pipe.drain();
      return false;
    }
    __shared__ float squares[kMatvecWarps];
    stage_tile_operand(in, squares);
    trace_phase(a, index, 0);
    float(*pieces)[kMatvecWarps][8][4] =
        reinterpret_cast<float(*)[kMatvecWarps][8][4]>(ring_memory() + operand_bytes);  // [tile][warp][g][q]
    const uint2* bs = tile_operand();
    float acc[R][2][1][4] = {};  // [pair][gate, up][n-block][fragment]
    int group = q0 / k_tiles, kt = q0 % k_tiles;
    pipe.for_each_step(steps, walk, [&](int i, const TileChunk(&gate)[R], const TileChunk(&up)[R]) {
      const int count = min(R, tiles - R * group);  // the group's tiles; the step's other pairs are zeros
      uint2 b[4][1];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        constexpr int kLanes = 4 * kTileOperandParts;  // lane groups 0 .. parts - 1: B's columns
        b[j][0] = lane32 < kLanes ? bs[(kt * 4 + j) * kLanes + lane32] : make_uint2(0u, 0u);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < count) {
          tile_step_mma(gate[r], b, acc[r][0]);
          tile_step_mma(up[r], b, acc[r][1]);
        }
      }
      if (++kt < k_tiles && i + 1 < steps) return;
      // The group's last step in this range: its tiles' pieces out. Columns 0 and 1 (lane t = 0) are the hi and
      // lo parts; the other lanes' columns are zero.
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const float(&f)[4] = acc[r][m][0];
          const float sum_g = f[0] + f[1], sum_g8 = f[2] + f[3];
          if (r < count && lane32 % 4 == 0) {
            pieces[R * group + r][warp_id()][g][2 * m] = sum_g;
            pieces[R * group + r][warp_id()][g][2 * m + 1] = sum_g8;
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[r][m][0][e] = 0.0f;
        }
      }
      if (kt == k_tiles) {
        kt = 0;
        ++group;
      }
    });
    trace_phase(a, index, 1);
    __syncthreads();
    trace_phase(a, index, 2);  // the block's slowest warp done too
    float all_squares = 0.0f;
#pragma unroll
    for (int w = 0; w < kMatvecWarps; ++w) all_squares += squares[w];
    const float rms = rms_factor(all_squares, a.hidden, a.eps);
    for (int j = warp_id(); j < tiles; j += kMatvecWarps) {
      if (lane32 % 4 != 0) continue;
      float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const int j0 = j / R * k_tiles, j1 = j0 + k_tiles;  // its group's steps
      for_each_warp_in(all, j0, j1, [&](int w) {
#pragma unroll
        for (int q = 0; q < 4; ++q) sums[q] += pieces[j][w][g][q];
      });
      store_gated(a, 0, first_tile + j, g, sums, rms);
    }
    trace_phase(a, index, 3);
    block_release(a, task.signal_counter);
    return true;
  } else
#endif
  {
    // The codes decoded to f32 on the CUDA cores (HIP, B too large for the ring, a build without it): teams of
    // k_split warps, a tile pair a round, each member a contiguous range of its steps; sums through shared memory,
    // one buffer (HIP compiles every bucket's shared memory into one kernel): a member writes round n's sums after
    // its team has reduced round n - 1. At more tokens the schedule gives a warp whole tiles (k_split 1, no sums to
    // share).
#if LITHOS_MK_TILE_MMA
    if constexpr (kTileMmaTokensFor<TMAX>) {  // where B fits; elsewhere the decode to f32 below
      if (a.hidden * 16 * kTileTokenBlocks<TMAX> <= kRingSmemBytes<TMAX>)
        return gate_up_tiles_mma_tokens<TMAX>(a, task, index);
    }
#endif
    static_assert(R == 1, "the decode to f32 takes one tile pair a step");
    __shared__ float partial[kMatvecWarps][8][4];  // per warp: gate g, gate g + 8, up g, up g + 8, one token
    __shared__ int arrivals[kMatvecWarps];
    __shared__ int reduced[kMatvecWarps];
    if (TMAX > 1 && task.k_split != 1) {
      if (threadIdx.x == 0) abort_step(a, index);
      return false;
    }
    const int k_split = task.k_split, slots = kMatvecWarps / k_split;
    const int slot = warp_id() / k_split, part = warp_id() % k_split, half = lane_id() / 32;
    const int rounds = (tiles + slots - 1) / slots;
    const int kt0 = k_tiles * part / k_split, kt1 = k_tiles * (part + 1) / k_split;
    const int span = (kt1 - kt0 + kTileHalves - 1) / kTileHalves, steps = rounds * span;
    RoundWalk walk{first_tile, tiles, slots, slot, kt0, span, half, k_tiles};
    if (threadIdx.x < kMatvecWarps) arrivals[threadIdx.x] = reduced[threadIdx.x] = 0;
    pipe.fill(steps, walk);
    if (!block_wait(a, task, index)) return false;
    __shared__ float rms_scale[TMAX];
    block_rms_scale<TMAX, 8, true>(in, a.eps, rms_scale);
    trace_phase(a, index, 0);
    float acc[2][2][TMAX];  // [gate, up][row g, g + 8][token]
    auto clear = [&]() {
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh)
#pragma unroll
          for (int t = 0; t < TMAX; ++t) acc[m][rh][t] = 0.0f;
    };
    clear();
    int step = 0, round = 0;
    pipe.for_each_step(steps, walk, [&](int, const TileChunk(&gate)[R], const TileChunk(&up)[R]) {
      const int kt = kt0 + step * kTileHalves + half;
      if (kt < kt1) {
        tile_step_decoded<TMAX>(gate[0], in, kt, lane32, acc[0]);
        tile_step_decoded<TMAX>(up[0], in, kt, lane32, acc[1]);
      }
      if (++step < span) return;
      step = 0;
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh)
#pragma unroll
          for (int t = 0; t < TMAX; ++t) {
            float v = acc[m][rh][t];
            v += shfl_xor(v, 1);
            v += shfl_xor(v, 2);
            if constexpr (kTileHalves > 1) v += shfl_xor(v, 32);
            acc[m][rh][t] = v;
          }
      bool mine = part == 0;  // the member that stores the round's outputs
      if (TMAX == 1 && k_split > 1) {
        int order = 0;
        if (lane_id() == 0)
          while (*static_cast<volatile int*>(&reduced[slot]) < round) {
          }
        warp_sync();
        if (lane_id() < 32 && lane32 % 4 == 0) {
#pragma unroll
          for (int q = 0; q < 4; ++q) partial[warp_id()][g][q] = acc[q / 2][q % 2][0];
        }
        __threadfence_block();
        warp_sync();
        if (lane_id() == 0) order = atomicAdd(&arrivals[slot], 1);
        mine = shfl_from(order, 0) == (round + 1) * k_split - 1;  // the last of this round's team
        if (mine) {
          __threadfence_block();
          float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int p = 0; p < k_split; ++p) {
            const volatile float* member = partial[slot * k_split + p][g];
#pragma unroll
            for (int q = 0; q < 4; ++q) sums[q] += member[q];
          }
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[q / 2][q % 2][0] = sums[q];
          __threadfence_block();  // the reads are done before the buffer is released
          warp_sync();
          if (lane_id() == 0) *static_cast<volatile int*>(&reduced[slot]) = round + 1;
        }
      }
      if (mine && round * slots + slot < tiles && lane_id() < 32 && lane32 % 4 == 0) {
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
          if (t < a.tokens) {
            const float sums[4] = {acc[0][0][t], acc[0][1][t], acc[1][0][t], acc[1][1][t]};
            store_gated(a, t, walk.tile_of(round), g, sums, rms_scale[t]);
          }
        }
      }
      ++round;
      clear();
    });
    trace_phase(a, index, 2);
    block_release(a, task.signal_counter);
    return true;
  }
}

}  // namespace mk
}  // namespace lithos
