// The tiled tasks' common parts (mk_gate_up_tiles.h: gate and up; mk_tiled_matvec.h: Q/K/V, O and down): MXFP4
// fragment tiles as a lane reads them (lithos/quant/tiles.py, mxfp4_tiles.h), one step of a tile on tensor cores,
// the pipeline of chunks in flight and the walks over a block's steps, and the staged one-token B.
#pragma once

#include <type_traits>

#include "mk_common.h"
#include "mk_lane_ring.h"
#include "mxfp4_tiles.h"

// Tensor cores read B from the lane ring's staging area: CUDA builds with the ring.
#if !defined(LITHOS_HIP) && LITHOS_MK_LANE_RING
#define LITHOS_MK_TILE_MMA 1
#else
#define LITHOS_MK_TILE_MMA 0
#endif

namespace lithos {
namespace mk {

using tiles::decode_pair;
using tiles::kTileBytes;
using tiles::kTileInputs;
using tiles::kTileRows;
using tiles::kTileScaleBytes;
// At one token a tiled step is R tiles (of each matrix) at one k tile, D steps in flight in registers (NOTES.md
// run 94d: the probe's R8 shares a step's B reads, addresses and loop over 8 tiles). A build may ask for others
// (LITHOS_KERNEL_DEFINES="LITHOS_MK_TILE_PAIRS=2 LITHOS_MK_TILE_DEPTH=2").
#ifndef LITHOS_MK_TILE_PAIRS
#define LITHOS_MK_TILE_PAIRS 4
#endif
#ifndef LITHOS_MK_TILE_DEPTH
#define LITHOS_MK_TILE_DEPTH 1
#endif
static_assert(LITHOS_MK_TILE_PAIRS >= 1 && LITHOS_MK_TILE_DEPTH >= 1,
              "tile pairs a step and steps in flight: 1 or more");
// A tile's 32 lanes; a 64-lane wavefront takes two of a tile's 64-input steps at once.
constexpr int kTileHalves = WARP_SIZE / 32;

// One step of a tile, as a lane holds it: its 16 bytes of codes and its lane group's scale word.
struct TileChunk {
  uint32_t codes[4];
  uint32_t scales;
};

// Where a lane's chunks of one matrix at one layer lie, formed once a task: its 16 bytes of step (tile, kt)'s codes
// and its lane group's scale word are chunk tile * k_tiles + kt past these. (Formed at every step, the two addresses
// cost some 30 instructions a tile: NOTES.md, "Tile addresses from per-task bases".)
struct TileSource {
  const uint8_t* codes;
  const uint8_t* scales;
  int k_tiles;

  __device__ __forceinline__ static TileSource of(const PackedWeight& w, int layer, int lane32) {
    return {w.data + layer * w.data_outer + lane32 * 16, w.scales + layer * w.scale_outer + (lane32 / 4) * 4,
            w.n_in / kTileInputs};
  }
  // Where the lane's chunk of step `kt` of output tile `tile` lies (a layer's matrix has under 2^31 chunks).
  struct Where {
    const uint8_t* codes;
    const uint8_t* scale;  // the lane group's aligned 4-byte scale word
  };
  __device__ __forceinline__ Where where(int tile, int kt) const {
    const unsigned at = static_cast<unsigned>(tile * k_tiles + kt);
    return {codes + static_cast<size_t>(at) * kTileBytes, scales + static_cast<size_t>(at) * kTileScaleBytes};
  }
  // The chunk itself, into registers.
  __device__ __forceinline__ static TileChunk load(Where w) {
    const Bf16Vec<8> v = load_streaming<8>(reinterpret_cast<const bf16_t*>(w.codes));
    const uint32_t word = *reinterpret_cast<const uint32_t*>(w.scale);
    return {{v.pair[0], v.pair[1], v.pair[2], v.pair[3]}, word};
  }
  __device__ __forceinline__ TileChunk load(int tile, int kt) const { return load(where(tile, kt)); }
};

// Scale byte I of a lane group's word, 2^(c - 127) (packed_decode.h's E8M0 decode).
template <int I>
__device__ __forceinline__ float mx_scale(uint32_t word) {
  return e8m0_to_float((word >> (8 * I)) & 0xFFu);
}

#if LITHOS_MK_TILE_MMA
// Where a task stages B (one token: k-step s's part g for lanes (g, t) at [8 s + 4 g + t], 64 bytes a step of 16
// inputs; more tokens: stage_tile_operand_tokens).
__device__ __forceinline__ uint2* tile_operand() { return reinterpret_cast<uint2*>(ring_memory()); }
constexpr int kTileOperandBytesPerInput = 4;
// Bytes of one token's staged B for `n_in` inputs, rounded up to 16 (what follows it is 16-byte aligned).
__device__ __forceinline__ int tile_operand_bytes(int n_in) {
  return (n_in * kTileOperandBytesPerInput + 15) / 16 * 16;
}
constexpr int kTileOperandParts = 2;
// B is the activations times 2^64 (exact: an exponent moved), so that its products with A's value * 2^-126 stay
// normal f32; mma_scale undoes both.
constexpr float kTileOperandShift = 18446744073709551616.0f;

// B's parts for inputs k .. k + 15 of one token's row `x`: x * norm_w * 2^64 as hi and lo bf16 parts, exact (a
// product of two bf16 values has at most 16 significant bits; hi takes the top 8, rounded to nearest, and the
// rest, at most 8 bits, is lo: checked over every pair of significands). part[g][p] holds inputs k + 2p and
// k + 2p + 1 of part g; lane t of the mma reads pairs t (its x) and t + 4 (its y). Four 16-byte loads issued
// together; the inputs' x^2 are added to `squares`.
__device__ __forceinline__ void operand_parts(const bf16_t* x, const bf16_t* norm_w, int k,
                                              uint32_t (&part)[kTileOperandParts][8], float& squares) {
  const Bf16Vec<8> xv[2] = {load_activation<8, true>(x + k), load_activation<8, true>(x + k + 8)};
  Bf16Vec<8> n[2];
  if (norm_w != nullptr) {
    n[0] = load_cached<8>(norm_w + k);
    n[1] = load_cached<8>(norm_w + k + 8);
  }
  float v[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    squares = fmaf(xv[e / 8][e % 8], xv[e / 8][e % 8], squares);
    v[e] = (norm_w != nullptr ? xv[e / 8][e % 8] * n[e / 8][e % 8] : xv[e / 8][e % 8]) * kTileOperandShift;
  }
#pragma unroll
  for (int g = 0; g < kTileOperandParts; ++g)
#pragma unroll
    for (int e = 0; e < 16; e += 2) {
      const bf16_t b0 = float_to_bf16(v[e]), b1 = float_to_bf16(v[e + 1]);
      part[g][e / 2] = b0 | static_cast<uint32_t>(b1) << 16;
      v[e] -= bf16_to_float(b0);  // exact: the rest, for the next part
      v[e + 1] -= bf16_to_float(b1);
    }
}

// B for one token, a thread a k-step of 16 inputs (one memory round trip); the same loads give each warp's sum of
// x^2 for the RMSNorm factor (`squares[warp]`), so the factor costs no pass of its own. Every thread calls it; a
// barrier ends it.
__device__ inline void stage_tile_operand(const TokenRows& in, float* squares) {
  uint2* bs = tile_operand();
  float sq = 0.0f;
  for (int s = static_cast<int>(threadIdx.x); s < in.n_in / 16; s += kMatvecThreads) {
    uint32_t part[kTileOperandParts][8];
    operand_parts(in.x, in.norm_w, 16 * s, part, sq);
#pragma unroll
    for (int g = 0; g < kTileOperandParts; ++g)
#pragma unroll
      for (int t = 0; t < 4; ++t) bs[4 * kTileOperandParts * s + 4 * g + t] = make_uint2(part[g][t], part[g][t + 4]);
  }
  sq = warp_sum(sq);
  if (lane_id() == 0) squares[warp_id()] = sq;
  __syncthreads();
}

// Scale byte I as the f32 2^(c - 127 + 62): 2^-126 (A) times 2^64 (B) undone; exact for c <= 192.
template <int I>
__device__ __forceinline__ float mma_scale(uint32_t word) {
  return __uint_as_float(__byte_perm(word, 0u, 0x4440u + I) * (1u << 23) + (62u << 23));
}

// acc[nb] += one step of a tile on tensor cores against n-block nb of B: acc[nb][0..1] row g (columns 2t, 2t + 1),
// acc[nb][2..3] row g + 8. The codes are decoded once for every n-block.
template <int NB>
__device__ __forceinline__ void tile_step_mma(const TileChunk& c, const uint2 (&b)[4][NB], float (&acc)[NB][4]) {
#pragma unroll
  for (int blk = 0; blk < 2; ++blk) {
    uint32_t pairs[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t w = c.codes[2 * blk + j];
      pairs[j][0] = decode_pair<0>(w);
      pairs[j][1] = decode_pair<1>(w);
      pairs[j][2] = decode_pair<2>(w);
      pairs[j][3] = decode_pair<3>(w);
    }
    const float sg = blk == 0 ? mma_scale<0>(c.scales) : mma_scale<1>(c.scales);
    const float sg8 = blk == 0 ? mma_scale<2>(c.scales) : mma_scale<3>(c.scales);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the block's own sum, scaled once below
#pragma unroll
      for (int j = 0; j < 2; ++j)
        mma_m16n8k16(d, pairs[j][0], pairs[j][1], pairs[j][2], pairs[j][3], b[2 * blk + j][nb].x,
                     b[2 * blk + j][nb].y);
      acc[nb][0] = fmaf(d[0], sg, acc[nb][0]);
      acc[nb][1] = fmaf(d[1], sg, acc[nb][1]);
      acc[nb][2] = fmaf(d[2], sg8, acc[nb][2]);
      acc[nb][3] = fmaf(d[3], sg8, acc[nb][3]);
    }
  }
}
#endif

// The chunks a warp has in flight: D steps of R tiles of each matrix, in slots used round robin. The loops run D
// steps an iteration, step i in slot i % D (a compile-time index once unrolled): a step takes its slot's chunks,
// which landed long ago, and asks for step i + D into the same slot. (Moving the younger chunks up a slot each step
// instead, as run 101 did, waits for each to land: a register copy waits for its load.) `Walk` gives the steps in
// order (next(tile, kt, count): tiles tile .. tile + count - 1 at k tile kt; a step's other tiles are zeros); the
// first D are asked for before the task's wait (the weights do not depend on the step).
template <int D, int R, class Matrices>
struct TilePipeline {
  static constexpr int M = Matrices::kCount;
  Matrices matrices;  // set before `fill`
  TileChunk chunk[D][M][R];

  template <class Walk>
  __device__ __forceinline__ void fill(int steps, Walk& walk) {
#pragma unroll
    for (int d = 0; d < D; ++d)
      if (d < steps) load(walk, chunk[d]);
  }
  __device__ __forceinline__ void drain() const {}  // nothing in flight outside registers
  // body(i, gate, up) (or body(i, chunk) of a single matrix) for steps i = 0 .. steps - 1 in order: step i from slot
  // i % D (a constant once the loop is unrolled by D), which then asks for step i + D.
  template <class Walk, class Body>
  __device__ __forceinline__ void for_each_step(int steps, Walk& walk, Body body) {
    for (int i0 = 0; i0 < steps; i0 += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const int i = i0 + d;
        if (i >= steps) break;
        TileChunk c[M][R];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) c[m][r] = chunk[d][m][r];
        if (i + D < steps) load(walk, chunk[d]);
        if constexpr (M == 2) {
          body(i, c[0], c[1]);
        } else {
          body(i, c[0]);
        }
      }
    }
  }

 private:
  template <class Walk>
  __device__ __forceinline__ void load(Walk& walk, TileChunk (&c)[M][R]) const {
    int tile, kt, count;
    walk.next(tile, kt, count);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < count) {
#pragma unroll
        for (int m = 0; m < M; ++m) c[m][r] = matrices.load(m, tile + r, kt);
      } else {
#pragma unroll
        for (int m = 0; m < M; ++m) c[m][r] = TileChunk{};
      }
    }
  }
};

// The tiled single-matrix tasks' pipeline with its slots in the lane ring's stages rather than registers (by default,
// LITHOS_MK_TILE_RING, but for the one-token Q/K/V, LITHOS_MK_QKV_RING; NOTES.md, "The tiled loops' chunks through the
// lane ring"): a step's chunks are copied into this thread's slots of one stage asynchronously (cp.async, no register
// held while they fly), kRingStages - 1 steps ahead, and read back just before the step's mma, so they live in
// registers for the step alone. A thread reads only what it copied: cp.async.wait_group orders it, as in the lane
// ring's row tasks. `Matrices` gives where(m, tile, kt) (TileSource::Where). A step's tiles past the walk's count are
// not copied and read stale: the bodies skip them.
#if LITHOS_MK_TILE_RING && LITHOS_MK_TILE_MMA
template <int R, class Matrices>
struct RingTilePipeline {
  static constexpr int M = Matrices::kCount, S = kRingStages;
  static_assert(M * R <= kRowsPerWarp, "a step's chunks fill at most a thread's slots of one stage");
  // On R, so that it is checked where a build instantiates the pipeline: a build without packed weights (the bf16
  // one, whose ring has no sides) never does, and must compile with the define too.
  static_assert(R > 0 && kRingSideWidest >= 4, "a chunk's scale word is a 4-byte side");
  Matrices matrices;  // set before `fill`

  template <class Walk>
  __device__ __forceinline__ void fill(int steps, Walk& walk) {
#pragma unroll
    for (int d = 0; d < S - 1; ++d) {
      if (d < steps) copy(walk, d);
      async_commit();  // a group a step, empty or not, so that the waits below count steps
    }
  }
  template <class Walk, class Body>
  __device__ __forceinline__ void for_each_step(int steps, Walk& walk, Body body) {
    for (int i = 0; i < steps; ++i) {
      if (i + S - 1 < steps) copy(walk, (i + S - 1) % S);
      async_commit();
      async_wait<S - 1>();  // step i's group has landed
      const int stage = i % S;
      TileChunk c[M][R];
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint4 codes = *ring_slot(stage, m * R + r);
          const uint32_t scale = *reinterpret_cast<const uint32_t*>(ring_side<4>(stage, m * R + r));
          c[m][r] = {{codes.x, codes.y, codes.z, codes.w}, scale};
        }
      if constexpr (M == 2) {
        body(i, c[0], c[1]);
      } else {
        body(i, c[0]);
      }
    }
  }
  // Lets the copies in flight land before the block leaves an aborted step.
  __device__ __forceinline__ void drain() const { ring_drain(); }

 private:
  template <class Walk>
  __device__ __forceinline__ void copy(Walk& walk, int stage) const {
    int tile, kt, count;
    walk.next(tile, kt, count);
    const uint64_t policy = evict_first_policy();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < count) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const TileSource::Where w = matrices.where(m, tile + r, kt);
          async_copy16(ring_slot(stage, m * R + r), w.codes, policy);
          async_copy_word_of(ring_side<4>(stage, m * R + r), w.scale);
        }
      }
    }
  }
};
#endif

// The pipeline a TMAX-token single-matrix task's tiles take: the ring's where the build asks for it (at one token the
// stages are free while a tiled task runs: the row tasks before and after it drain their own copies), registers
// otherwise.
#if LITHOS_MK_TILE_RING && LITHOS_MK_TILE_MMA
template <int TMAX, int D, int R, class Matrices>
using TilePipelineOf = std::conditional_t<kRingFor<TMAX>, RingTilePipeline<R, Matrices>,
                                          TilePipeline<D, R, Matrices>>;
#else
template <int TMAX, int D, int R, class Matrices>
using TilePipelineOf = TilePipeline<D, R, Matrices>;
#endif

// A warp's flat range of the block's (group, k tile) pairs, group-major: group j is tiles first + R j .. first +
// min(R (j + 1), tiles) - 1.
template <int R>
struct FlatWalk {
  int first, tiles, group, kt, k_tiles;
  __device__ __forceinline__ void next(int& t, int& k, int& count) {
    t = first + R * group;
    k = kt;
    count = min(R, tiles - R * group);
    if (++kt == k_tiles) {
      kt = 0;
      ++group;
    }
  }
};

// f(w), in warp order, for each warp whose flat range (of `all` steps cut in kMatvecWarps, as FlatWalk's) holds
// steps of [j0, j1): the warps whose pieces a tile of that group adds. An empty range wrote none.
template <class F>
__device__ __forceinline__ void for_each_warp_in(int all, int j0, int j1, F f) {
  for (int w = j0 * kMatvecWarps / all; w < kMatvecWarps; ++w) {
    const int w_begin = all * w / kMatvecWarps, w_end = all * (w + 1) / kMatvecWarps;
    if (w_begin >= j1) break;
    if (w_end > j0 && w_end > w_begin) f(w);
  }
}

}  // namespace mk
}  // namespace lithos
