// Megakernel task kinds 1 (Q/K/V), 3 (O) and 5 (down) over a single MXFP4 matrix group in fragment tiles (builds
// with LITHOS_MK_QKV_TILES, LITHOS_MK_O_TILES, LITHOS_MK_DOWN_TILES; the layout: lithos/quant/tiles.py,
// mxfp4_tiles.h), a tile 16 output rows x 64 inputs, a task whole tiles (kTileRowUnits of tasks.py's 4-row units).
//
// CUDA, every token count, on tensor cores. B is each step's activations as the mma takes them, times 2^64 so that
// the products with A's value * 2^-126 stay normal f32; at 2-16 tokens read straight from memory (8 tokens of 14336
// inputs are 229 KB), each step's asked for as the step before starts (it depends on the k tile only):
// - O and down (ActivationOperand): the attention's output or the gated activations, bf16 already, one part exact, a
//   token a column (8 tokens an n-block, two at 16). y = residual + x W^T. At one token B is staged once instead
//   (StagedActivations: 2 bytes an input), so that a step waits on its weights alone.
// - Q/K/V (NormedOperand): x * norm_w in two bf16 parts (exact, as gate/up's staged B), token u's in columns
//   2 (u % 4) and 2 (u % 4) + 1 of n-block u / 4, so that lane (g, t)'s sums of columns 2t and 2t + 1 add to rows
//   g and g + 8 of token 4 nb + t. The matrices are in rotary tiles (a tile's rows g and g + 8 are the two halves
//   of one rotary pair), so the lane rotates and stores the pair itself (mk_qkv.h's store); the RMSNorm factor
//   from squares each thread sums right after the wait, their loads beside the first step's. At one token B is
//   instead staged once, as gate/up's (StagedOperand), the squares from the same loads.
// Every (tile group, k tile) step is one warp's, so a block reads and scales B once a group. The block's tiles in
// groups of R, the (group, k tile) pairs cut in 8 flat ranges, one a warp (as the one-token gate/up task); each warp
// writes its sums of every tile its range touches in the lane ring's input area, one barrier, then each tile's pieces
// are added in warp order and handed to the kind's store.
// HIP builds have no tensor-core form: kernel.py keeps these matrices in rows there, and the FFI refuses tiles.
#pragma once

#include <type_traits>

#include "mk_qkv.h"
#include "mk_tiles.h"

namespace lithos {
namespace mk {

constexpr int kTileRowUnits = kTileRows / kRowsPerWarp;  // tasks.py's 4-row units in a 16-row tile

#if LITHOS_MK_TILE_MMA
// A tile's sums from one warp and n-block: [lane][fragment], lane (g, t) holding rows g and g + 8 of the n-block's
// columns 2t and 2t + 1.
constexpr int kTiledPieceBytes = 32 * 4 * 4;

// Two consecutive activations written earlier in this launch: a plain coherent load (rowdot.h).
__device__ __forceinline__ uint32_t load_activation_pair(const bf16_t* p) {
  uint32_t v;
  asm volatile("ld.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// B of bf16 activations `x` ([tokens, n_in]), one part: column g of n-block nb is token 8 nb + g. Lane (g, t) asks
// for its pairs of a k tile with `load` and takes them as the mma's B with `fragments`.
template <int TMAX>
struct ActivationOperand {
  static constexpr int NB = (TMAX + 7) / 8;
  const bf16_t* x;
  int n_in, tokens, g, t;
  uint32_t next[NB][4][2];  // [n-block][k16 step][inputs 2t, 2t + 1 | 2t + 8, 2t + 9]

  __device__ __forceinline__ void load(int kt) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int u = 8 * nb + g;
      const bf16_t* p = x + static_cast<size_t>(u) * n_in + kt * kTileInputs + 2 * t;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        next[nb][j][0] = u < tokens ? load_activation_pair(p + 16 * j) : 0u;
        next[nb][j][1] = u < tokens ? load_activation_pair(p + 16 * j + 8) : 0u;
      }
    }
  }
  // Two bf16 activations times kTileOperandShift, exact for |x| < 2^64.
  __device__ __forceinline__ static uint32_t scaled(uint32_t bits) {
    const bf16_t lo = float_to_bf16(__uint_as_float(bits << 16) * kTileOperandShift);
    const bf16_t hi = float_to_bf16(__uint_as_float(bits & 0xFFFF0000u) * kTileOperandShift);
    return lo | static_cast<uint32_t>(hi) << 16;
  }
  __device__ __forceinline__ void fragments(uint2 (&b)[4][NB]) const {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j][nb] = make_uint2(scaled(next[nb][j][0]), scaled(next[nb][j][1]));
  }
};

// B of x * norm_w (x [tokens, n_in], the norm weights [n_in]) in two bf16 parts: column g of n-block nb is part
// g % 2 of token 4 nb + g / 2 (hi, then lo: their sum is the f32 product times 2^64 exactly, operand_parts).
template <int TMAX>
struct NormedOperand {
  static constexpr int NB = (TMAX + 3) / 4;
  const bf16_t* x;
  const bf16_t* norm_w;
  int n_in, tokens, g, t;
  uint32_t next[NB][4][2];
  uint32_t norm[4][2];

  __device__ __forceinline__ void load(int kt) {
    const int k = kt * kTileInputs + 2 * t;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      norm[j][0] = *reinterpret_cast<const uint32_t*>(norm_w + k + 16 * j);
      norm[j][1] = *reinterpret_cast<const uint32_t*>(norm_w + k + 16 * j + 8);
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int u = 4 * nb + g / 2;
      const bf16_t* p = x + static_cast<size_t>(u) * n_in + k;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        next[nb][j][0] = u < tokens ? load_activation_pair(p + 16 * j) : 0u;
        next[nb][j][1] = u < tokens ? load_activation_pair(p + 16 * j + 8) : 0u;
      }
    }
  }
  // Part `lo` of two products x * w * 2^64: hi rounded to bf16, or what is left of it (exact: at most 8 bits).
  __device__ __forceinline__ static uint32_t part(uint32_t xs, uint32_t ws, bool lo) {
    const float v0 = __uint_as_float(xs << 16) * __uint_as_float(ws << 16) * kTileOperandShift;
    const float v1 = __uint_as_float(xs & 0xFFFF0000u) * __uint_as_float(ws & 0xFFFF0000u) * kTileOperandShift;
    bf16_t p0 = float_to_bf16(v0), p1 = float_to_bf16(v1);
    if (lo) {
      p0 = float_to_bf16(v0 - bf16_to_float(p0));
      p1 = float_to_bf16(v1 - bf16_to_float(p1));
    }
    return p0 | static_cast<uint32_t>(p1) << 16;
  }
  __device__ __forceinline__ void fragments(uint2 (&b)[4][NB]) const {
    const bool lo = g % 2 != 0;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        b[j][nb] = make_uint2(part(next[nb][j][0], norm[j][0], lo), part(next[nb][j][1], norm[j][1], lo));
  }
};

// One token of bf16 activations (O's and down's B), staged once in the lane ring's memory by stage_activations: one
// part (x * 2^64 is exact in bf16), read by lanes g = 0 (column 0, the token), 32 bytes a k-step of 16 inputs. Read
// from memory a step ahead instead (ActivationOperand), down's one-token steps waited on B: run 128 (NOTES.md,
// "Q/K/V and O in fragment tiles") took twice the weights in flight and only 15% off its dot products.
struct StagedActivations {
  static constexpr int NB = 1;
  int lane32, kt;

  __device__ __forceinline__ void load(int k_tile) { kt = k_tile; }
  __device__ __forceinline__ void fragments(uint2 (&b)[4][NB]) const {
    const uint2* bs = tile_operand();
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j][0] = lane32 < 4 ? bs[(kt * 4 + j) * 4 + lane32] : make_uint2(0u, 0u);
  }
};

// Bytes of one token's staged activations for `n_in` inputs, rounded up to 16 (kernel.py activation_operand_bytes).
__device__ __forceinline__ int activation_operand_bytes(int n_in) { return (n_in * 2 + 15) / 16 * 16; }

// One token's activations x[0 .. n_in) staged as StagedActivations reads them, a thread a k-step of 16 inputs (two
// 16-byte loads issued together): lane t's pairs t (inputs 2t, 2t + 1) and t + 4 (2t + 8, 2t + 9), times 2^64.
// Every thread calls it; a barrier ends it.
__device__ inline void stage_activations(const bf16_t* x, int n_in) {
  uint2* bs = tile_operand();
  for (int s = static_cast<int>(threadIdx.x); s < n_in / 16; s += kMatvecThreads) {
    const Bf16Vec<8> v[2] = {load_activation<8, true>(x + 16 * s), load_activation<8, true>(x + 16 * s + 8)};
    uint32_t pair[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const bf16_t lo = float_to_bf16(v[p / 4][2 * (p % 4)] * kTileOperandShift);
      const bf16_t hi = float_to_bf16(v[p / 4][2 * (p % 4) + 1] * kTileOperandShift);
      pair[p] = lo | static_cast<uint32_t>(hi) << 16;
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) bs[4 * s + t] = make_uint2(pair[t], pair[t + 4]);
  }
  __syncthreads();
}

// One token of x * norm_w, staged once in the lane ring's memory by stage_tile_operand (gate/up's one-token B: columns
// 0 and 1 the two parts, lanes g < 2), each step's read at use: a k tile's B costs 4 shared-memory loads where forming
// it costs some 270 instructions a step.
struct StagedOperand {
  static constexpr int NB = 1;
  int lane32, kt;

  __device__ __forceinline__ void load(int k_tile) { kt = k_tile; }
  __device__ __forceinline__ void fragments(uint2 (&b)[4][NB]) const {
    constexpr int kLanes = 4 * kTileOperandParts;  // lane groups 0 .. parts - 1: B's columns
    const uint2* bs = tile_operand();
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j][0] = lane32 < kLanes ? bs[(kt * 4 + j) * kLanes + lane32] : make_uint2(0u, 0u);
  }
};

// O and down: the matrix (chosen by the task's kind at run time, so that both share one copy of the task), its
// inputs, and y = residual + x W^T. Lane (g, t)'s fragment q is row g + 8 (q / 2) of token 8 nb + 2t + q % 2.
struct ProjectionTiles {
  template <int TMAX>
  using Operand = std::conditional_t<TMAX == 1, StagedActivations, ActivationOperand<TMAX>>;
  struct Matrix {
    static constexpr int kCount = 1;
    TileSource source;
    __device__ __forceinline__ TileSource::Where where(int, int tile, int kt) const { return source.where(tile, kt); }
    __device__ __forceinline__ TileChunk load(int, int tile, int kt) const { return source.load(tile, kt); }
  };
  const Args& a;
  int layer;
  bool o;
  int n_in;

  __device__ __forceinline__ ProjectionTiles(const Args& args, const Task& task)
      : a(args), layer(task.layer), o(task.op == kOpOProj), n_in(projection_inputs(args, task.op)) {}
  __device__ __forceinline__ Matrix matrix(int lane32) const {
    return {TileSource::of(o ? a.wo : a.w_down, layer, lane32)};
  }
  __device__ __forceinline__ const bf16_t* input() const { return o ? a.attn : a.gated; }
  template <int TMAX>
  __device__ __forceinline__ Operand<TMAX> operand(int g, int t) const {
    if constexpr (TMAX == 1) {
      return {4 * g + t, 0};
    } else {
      return {input(), n_in, a.tokens, g, t, {}};
    }
  }
  // Where the warps' sums go in the ring's memory: after the one-token B; at more tokens its start (B is read from
  // the activations).
  template <int TMAX>
  __device__ __forceinline__ int pieces_offset() const {
    return TMAX == 1 ? activation_operand_bytes(n_in) : 0;
  }
  template <int TMAX>
  __device__ __forceinline__ void after_wait(float (&)[kMatvecWarps][TMAX]) const {
    if constexpr (TMAX == 1) stage_activations(input(), n_in);
  }
  // Tile `tile`'s sums of n-block nb for lane `lane`, once every warp's are added.
  template <int TMAX>
  __device__ __forceinline__ void store(int tile, int nb, int lane, const float (&sums)[4],
                                        const float (&)[kMatvecWarps][TMAX]) const {
    const bf16_t* residual_in = o ? layer_input(a, layer) : after_attention(a);
    bf16_t* out = o ? after_attention(a) : after_mlp(a);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int row = tile * kTileRows + lane / 4 + 8 * (q / 2);
      const int token = 8 * nb + 2 * (lane % 4) + q % 2;
      if (token < a.tokens) {
        const size_t at = static_cast<size_t>(token) * a.hidden + row;
        out[at] = float_to_bf16(sums[q] + bf16_to_float(residual_in[at]));
      }
    }
  }
};

// Q/K/V of one KV group (a task's tiles never leave it): the group's query heads, key head and value head in the
// schedule's order, each head_dim / 16 rotary tiles of its matrix (lithos/quant/tiles.py); B is the layer's input
// times the attention's norm weights, the RMSNorm factor applied to the sums.
struct QkvTiles {
  template <int TMAX>
  using Operand = std::conditional_t<TMAX == 1, StagedOperand, NormedOperand<TMAX>>;
  // The task's tile `tile` (of the layer's, in schedule order) as head `slot` of the group and tile q of that head.
  struct Place {
    int first, kv_head, group, head_shift;  // the group's first tile, its KV head, query heads, log2 tiles a head
    __device__ __forceinline__ int slot(int tile) const { return (tile - first) >> head_shift; }
    __device__ __forceinline__ int q(int tile) const { return (tile - first) & ((1 << head_shift) - 1); }
  };
  // One source a matrix, each from the group's first head in it: its query heads in wq, its key head in wk, its
  // value head in wv (chosen by selects: indexed, they would live on the stack). Formed at every step from the
  // matrices' fields instead, the loop was 561 instructions a step against 480 (NOTES.md, "Tile addresses from
  // per-task bases").
  struct Matrix {
    static constexpr int kCount = 1;
    Place place;
    TileSource q, k, v;
    __device__ __forceinline__ TileSource::Where where(int, int tile, int kt) const {
      const int slot = place.slot(tile), group = place.group;
      const bool is_q = slot < group, is_k = slot == group;
      // Field by field: a select of the structs themselves chose between their copies on the stack.
      const TileSource s{is_q ? q.codes : (is_k ? k.codes : v.codes), is_q ? q.scales : (is_k ? k.scales : v.scales),
                         q.k_tiles};
      return s.where(((is_q ? slot : 0) << place.head_shift) + place.q(tile), kt);
    }
    __device__ __forceinline__ TileChunk load(int m, int tile, int kt) const {
      return TileSource::load(where(m, tile, kt));
    }
  };
  const Args& a;
  int layer, n_in;
  Place place;

  __device__ __forceinline__ QkvTiles(const Args& args, const Task& task)
      : a(args), layer(task.layer), n_in(args.hidden) {
    const int group = args.heads / args.kv_heads, tiles_a_head = args.head_dim / kTileRows;
    const int kv_head = task.first / ((group + 2) * tiles_a_head * kTileRowUnits);
    place = {kv_head * (group + 2) * tiles_a_head, kv_head, group, __ffs(tiles_a_head) - 1};
  }
  __device__ __forceinline__ Matrix matrix(int lane32) const {
    // Each source's chunk 0 moved to the group's first head of its matrix (whole tiles of k_tiles chunks a tile);
    // one k_tiles for the three (the hidden size's inputs), so that they share its register.
    const int k_tiles = n_in / kTileInputs;
    auto at_head = [&](const PackedWeight& w, int head) {
      const TileSource s = TileSource::of(w, layer, lane32);
      const size_t chunks = static_cast<size_t>(head << place.head_shift) * k_tiles;
      return TileSource{s.codes + chunks * kTileBytes, s.scales + chunks * kTileScaleBytes, k_tiles};
    };
    return {place, at_head(a.wq, place.kv_head * place.group), at_head(a.wk, place.kv_head),
            at_head(a.wv, place.kv_head)};
  }
  __device__ __forceinline__ TokenRows input() const {
    return {layer_input(a, layer), a.attn_norm + static_cast<size_t>(layer) * a.hidden, a.tokens, a.hidden};
  }
  template <int TMAX>
  __device__ __forceinline__ Operand<TMAX> operand(int g, int t) const {
    if constexpr (TMAX == 1) {
      return {4 * g + t, 0};
    } else {
      const TokenRows in = input();
      return {in.x, in.norm_w, in.n_in, in.tokens, g, t, {}, {}};
    }
  }
  // Where the warps' sums go in the ring's memory: after the one-token B.
  template <int TMAX>
  __device__ __forceinline__ int pieces_offset() const {
    return TMAX == 1 ? tile_operand_bytes(a.hidden) : 0;
  }
  // One token: B staged, and each warp's squares of x from the same loads. More: each warp's squares, their loads
  // issued beside the first step's B. Either is read after the task's barrier (`store`).
  template <int TMAX>
  __device__ __forceinline__ void after_wait(float (&squares)[kMatvecWarps][TMAX]) const {
    if constexpr (TMAX == 1) {
      stage_tile_operand(input(), &squares[0][0]);
    } else {
      warp_squares<TMAX, 8, true>(TokenRows{layer_input(a, layer), nullptr, a.tokens, a.hidden}, squares);
    }
  }
  // Lane (g, t)'s sums are rows g and g + 8 of token 4 nb + t, its columns 2t and 2t + 1 being the two parts: the
  // two halves of rotary pair 8 q + g.
  template <int TMAX>
  __device__ __forceinline__ void store(int tile, int nb, int lane, const float (&sums)[4],
                                        const float (&squares)[kMatvecWarps][TMAX]) const {
    const int token = 4 * nb + lane % 4;
    if (token >= a.tokens) return;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kMatvecWarps; ++w) total += squares[w][token];
    const float rms = rms_factor(total, a.hidden, a.eps);
    const int slot = place.slot(tile), j = 8 * place.q(tile) + lane / 4, position = a.positions[token];
    float lo = (sums[0] + sums[1]) * rms, hi = (sums[2] + sums[3]) * rms;
    if (slot != place.group + 1) rope_rotate(lo, hi, position, a.inv_freq[j]);
    store_qkv_pair(a, layer, token, position, QkvRowGroup{place.kv_head, slot, j}, j, lo, hi);
  }
};

// The one-token Q/K/V tiles through registers, a step in flight, where the other tiled tasks take the ring
// (LITHOS_MK_TILE_RING): its few steps a warp gain less from three in flight than its copies cost the attention after
// it (run 143: the 8B MXFP4 step 2.756-2.764 -> 2.708-2.709 ms; NOTES.md, "Run 143 measured"). 1 takes them through
// the ring too (a build variant).
#ifndef LITHOS_MK_QKV_RING
#define LITHOS_MK_QKV_RING 0
#endif
template <int TMAX, class Kind, int D, int R>
using TiledPipelineFor = std::conditional_t<TMAX == 1 && !LITHOS_MK_QKV_RING && std::is_same_v<Kind, QkvTiles>,
                                            TilePipeline<D, R, typename Kind::Matrix>,
                                            TilePipelineOf<TMAX, D, R, typename Kind::Matrix>>;

// At one token, the O projection's first chunks asked for after its wait rather than before it, where the build asks
// (LITHOS_KERNEL_DEFINES="LITHOS_MK_O_LATE_FILL=1"; NOTES.md, "The one-token O projection's chunks after its wait"):
// before it, three steps of every block's O tiles (70% of O's bytes on 8B) queue in front of the attention's
// combine, which that wait is for. A build variant.
#ifndef LITHOS_MK_O_LATE_FILL
#define LITHOS_MK_O_LATE_FILL 0
#endif

// The task: Kind is ProjectionTiles or QkvTiles.
template <int TMAX, class Kind>
__device__ bool tiled_matvec_task(const Args& a, const Task& task, int index) {
  using Operand = typename Kind::template Operand<TMAX>;
  constexpr int NB = Operand::NB, D = LITHOS_MK_TILE_DEPTH, R = LITHOS_MK_TILE_PAIRS;
  const Kind kind(a, task);
  const int lane32 = lane_id() % 32, g = lane32 / 4, t = lane32 % 4;
  const int first_tile = task.first / kTileRowUnits, tiles = task.count / kTileRowUnits;
  const int k_tiles = kind.n_in / kTileInputs;
  const int offset = kind.template pieces_offset<TMAX>();
  if (offset + tiles * kMatvecWarps * NB * kTiledPieceBytes > kRingInputBytes) {  // kernel.py checks it first
    if (threadIdx.x == 0) abort_step(a, index);
    return false;
  }
  const int all = (tiles + R - 1) / R * k_tiles;
  const int q0 = all * warp_id() / kMatvecWarps, q1 = all * (warp_id() + 1) / kMatvecWarps, steps = q1 - q0;
  FlatWalk<R> walk{first_tile, tiles, q0 / k_tiles, q0 % k_tiles, k_tiles};
  TiledPipelineFor<TMAX, Kind, D, R> pipe;
  pipe.matrices = kind.matrix(lane32);
  const bool late_fill = LITHOS_MK_O_LATE_FILL && TMAX == 1 && task.op == kOpOProj;
  if (!late_fill) pipe.fill(steps, walk);
  if (!block_wait(a, task, index)) {
    pipe.drain();
    return false;
  }
  if (late_fill) pipe.fill(steps, walk);
  int group = q0 / k_tiles, kt = q0 % k_tiles;
  // B of the first step asked for after the wait (the activations are this layer's), each next one as a step starts.
  Operand operand = kind.template operand<TMAX>(g, t);
  if (steps > 0) operand.load(kt);
  __shared__ float squares[kMatvecWarps][TMAX];  // Q/K/V's, for the RMSNorm factor
  kind.template after_wait<TMAX>(squares);
  trace_phase(a, index, 0);
  float(*pieces)[kMatvecWarps][NB][32][4] =
      reinterpret_cast<float(*)[kMatvecWarps][NB][32][4]>(ring_memory() + offset);  // [tile][warp][n-block][lane][q]
  float acc[R][NB][4] = {};
  pipe.for_each_step(steps, walk, [&](int i, const TileChunk(&chunk)[R]) {
    const int count = min(R, tiles - R * group);  // the group's tiles; the step's others are zeros
    uint2 b[4][NB];
    operand.fragments(b);
    if (i + 1 < steps) operand.load(kt + 1 == k_tiles ? 0 : kt + 1);
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < count) tile_step_mma(chunk[r], b, acc[r]);
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
  trace_phase(a, index, 2);  // the block's slowest warp done too
  for (int i = static_cast<int>(threadIdx.x); i < tiles * NB * 32; i += kMatvecThreads) {
    const int j = i / (NB * 32), nb = i / 32 % NB, lane = i % 32;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int j0 = j / R * k_tiles;  // its group's steps
    for_each_warp_in(all, j0, j0 + k_tiles, [&](int w) {
#pragma unroll
      for (int q = 0; q < 4; ++q) sums[q] += pieces[j][w][nb][lane][q];
    });
    kind.template store<TMAX>(first_tile + j, nb, lane, sums, squares);
  }
  trace_phase(a, index, 3);
  block_release(a, task.signal_counter);
  return true;
}
#endif

}  // namespace mk
}  // namespace lithos
