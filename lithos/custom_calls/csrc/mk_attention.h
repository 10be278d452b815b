// Megakernel task kind 2: attention of one KV head's queries (every token, every query head of the
// group) over one split of the cache's length (flash-decoding, as attention.cu), in the exp2 domain.
// Each split writes its normalised partial output and log2-sum-exp2; the split that arrives last for
// its head combines them into the head group's attention output, so no second launch and no separate
// combine stage exist.
//
// The split plan comes from the positions on the device: a 1K context inside a 1M cache reads 1K keys.
// It iterates over key positions, each read from its slot: p in a linear cache, p % slots in a ring
// (lithos/kv_cache.py), whose keys read span at most one lap.
// A key's head_dim elements are spread over head_dim / 8 lanes of 16 bytes. The head dimension is a
// template parameter (one copy each for 64, 128 and 256, chosen per task): with it known, a score's sum
// over its lanes and the folds unroll, so the shuffle chains of a loop step's keys and rows interleave
// (with a run-time width they ran one after another: 2.9 us per step, NOTES.md).
#pragma once

#include <climits>

#include "mk_common.h"
#include "split_attention.h"
#include "split_attention_mma.h"

namespace lithos {
namespace mk {

constexpr int kAttnRowsPerWarp = 4;   // query rows (token, head of the group) whose state a warp keeps
// Keys per lane group per loop step (two loads of 16 bytes each); with the next step's loaded during a
// step, twice that in flight. 3 in the 1- and 2-token kernels (4-8% faster at 32K-128K, the same at 1K),
// 2 in the larger ones (the 16-token kernel spills at 3; NOTES.md, run 36). A build may ask for one
// count in every kernel (LITHOS_KERNEL_DEFINES="LITHOS_MK_ATTN_KEYS=2").
template <int TMAX>
#ifdef LITHOS_MK_ATTN_KEYS
constexpr int kAttnKeysPerStep = LITHOS_MK_ATTN_KEYS;
#else
constexpr int kAttnKeysPerStep = TMAX <= 2 ? 3 : 2;
#endif

// The second loop step's older keys loaded before the task's wait too (at 1K an 8B split is two steps; NOTES.md,
// "The second step's keys during the wait"): on in every build that reads a packed format, where it takes the
// attention loop's spills out (the 8B MXFP4 step 3.223 -> 3.038 ms, the 1B 0.988 -> 0.971, H100, run 132); off in
// the bf16 build, whose one-token loop never spilled (0.3% slower with it, run 131; its 4-16-token kernels do spill,
// yet its 8B k = 7 round was 0.4% slower with it too, run 134). LITHOS_KERNEL_DEFINES="LITHOS_MK_ATTN_SECOND_AHEAD=0|1"
// sets it either way.
#ifndef LITHOS_MK_ATTN_SECOND_AHEAD
#define LITHOS_MK_ATTN_SECOND_AHEAD \
  (LITHOS_MK_ATTENTION_FORMAT != 0 || LITHOS_MK_MLP_FORMAT != 0 || LITHOS_MK_HEAD_FORMAT != 0 || \
   LITHOS_MK_O_FORMAT != 0 || LITHOS_MK_DOWN_FORMAT != 0)
#endif
constexpr bool kAttnSecondAhead = LITHOS_MK_ATTN_SECOND_AHEAD != 0;

// The 4-16-token splits on tensor cores (split_attention_mma.h, as the fused kernel's; NOTES.md, "The 4-16-token
// attention on tensor cores"): CUDA, head dimension 64 and 128 (256 keeps the FMA splits: its 16 rows of output
// fragments would take 128 registers a lane). A build variant, LITHOS_KERNEL_DEFINES="LITHOS_MK_ATTN_MMA=1", off by
// default: at 8 tokens of 8B the attention took 13 us a layer less, but with its code in the kernel the tiled matvec
// loops spill and lost more (the 8B MXFP4 round 14% slower, the 1B round 3.6% faster; run 140, NOTES.md).
#ifndef LITHOS_MK_ATTN_MMA
#define LITHOS_MK_ATTN_MMA 0
#endif
#if LITHOS_MK_ATTN_MMA && !defined(LITHOS_HIP)
#define LITHOS_MK_ATTN_ON_TENSOR_CORES 1
#else
#define LITHOS_MK_ATTN_ON_TENSOR_CORES 0
#endif
template <int TMAX, int D>
constexpr bool kAttnOnTensorCores = LITHOS_MK_ATTN_ON_TENSOR_CORES && TMAX >= 4 && D <= 128;

constexpr int kMinKeysPerSplit = 64;  // below this a split costs more in overhead than it saves
constexpr int kMaxHeadDim = 256;

__device__ inline SplitPlan plan_splits(const Args& a) {
  return ::lithos::plan_splits(a.positions, a.tokens, a.slots, a.window, a.ring, a.max_splits, kMinKeysPerSplit);
}

// Rows of the partial buffers: row = token * group + head-in-group.
__device__ __forceinline__ size_t partial_row(const Args& a, int kv_head, int split, int row) {
  const int rows = a.tokens * (a.heads / a.kv_heads);
  return (static_cast<size_t>(kv_head) * a.max_splits + split) * rows + row;
}

// Where the warps that split a pass's keys fold their states: one copy for every head dimension's code
// (a __shared__ variable in a template would be one per instantiation).
struct AttentionShared {
  float acc[kMatvecWarps][kAttnRowsPerWarp][kMaxHeadDim];
  float max[kMatvecWarps][kAttnRowsPerWarp];
  float sum[kMatvecWarps][kAttnRowsPerWarp];
};
__device__ __forceinline__ AttentionShared& attention_shared() {
  __shared__ AttentionShared shared;
  return shared;
}

// One split's partial output, for head dimension D. `wait()` (the task's wait for its Q/K/V) is called
// once by every thread, after the split's first keys that earlier steps wrote are loaded: those loads
// fly during the wait. False when the step aborted.
template <int D, int KEYS, class Wait>
__device__ inline bool attention_split(const Args& a, const SplitPlan& plan, int layer, int kv_head, int split,
                                       int index, Wait wait) {
  AttentionShared& shared = attention_shared();

  // A split past the plan's count writes nothing; it still waits, so that every task's wait is in
  // the trace and its signal comes after its head's Q/K/V, like every split's.
  if (split >= plan.splits) return wait();
  const int key_begin = plan.split_begin(split), key_end = plan.split_end(split);

  constexpr int d = D, lanes_per_key = D / 8, keys_per_warp = WARP_SIZE / lanes_per_key;
  static_assert(D % 64 == 0 && lanes_per_key <= WARP_SIZE, "a key's lanes are within a warp");
  const int group = a.heads / a.kv_heads, rows = a.tokens * group;
  // Warps split the query rows while there are enough of them, and the keys otherwise.
  const int chunks = (rows + kAttnRowsPerWarp - 1) / kAttnRowsPerWarp;
  const int q_warps = chunks >= 8 ? 8 : (chunks >= 4 ? 4 : (chunks >= 2 ? 2 : 1));
  const int k_warps = kMatvecWarps / q_warps, rows_per_pass = q_warps * kAttnRowsPerWarp;
  const int warp_q = warp_id() % q_warps, warp_k = warp_id() / q_warps;
  const int key_lane = lane_id() / lanes_per_key, dim0 = (lane_id() % lanes_per_key) * 8;

  const size_t head_offset = (static_cast<size_t>(layer) * a.kv_heads + kv_head) * a.slots * d;
  const bf16_t* keys = a.k_cache + head_offset + dim0;
  const bf16_t* values = a.v_cache + head_offset + dim0;
  const int key_stride = k_warps * keys_per_warp;  // between a lane's consecutive keys

  // The keys of a loop step from `base`: key[u] for u < KEYS. Keys from `from` on are loaded, earlier
  // ones kept (the first step loads the older keys before the wait, the rest after).
  struct KeyStep {
    int key[KEYS];
    Bf16Vec<8> k[KEYS], v[KEYS];
  };
  auto load_step = [&](KeyStep& step, int base, int from, int to) {
#pragma unroll
    for (int u = 0; u < KEYS; ++u) {
      step.key[u] = base + key_lane + u * key_stride;
      if (step.key[u] >= from && step.key[u] < to) {
        // Weak loads (this step's keys written by its Q/K/V tasks, ordered by the wait), past L1.
        const size_t at = static_cast<size_t>(slot_of(plan, a.slots, step.key[u])) * d;
        step.k[u] = load_streaming<8>(keys + at);
        step.v[u] = load_streaming<8>(values + at);
      } else if (step.key[u] >= key_end) {
        step.k[u] = Bf16Vec<8>{{0u, 0u, 0u, 0u}};
        step.v[u] = step.k[u];
      }
    }
  };
  const int first_base = key_begin + warp_k * keys_per_warp, step_keys = key_stride * KEYS;
  KeyStep now, next;
  load_step(now, first_base, INT_MIN, min(key_end, plan.fresh));
  if constexpr (kAttnSecondAhead) load_step(next, first_base + step_keys, INT_MIN, min(key_end, plan.fresh));
  if (!wait()) return false;

  for (int pass_first = 0; pass_first < rows; pass_first += rows_per_pass) {
    const int first_row = pass_first + warp_q * kAttnRowsPerWarp;
    float q[kAttnRowsPerWarp][8];
    int see_from[kAttnRowsPerWarp], see_to[kAttnRowsPerWarp];
    Softmax state[kAttnRowsPerWarp];
#pragma unroll
    for (int j = 0; j < kAttnRowsPerWarp; ++j) {
      const int row = first_row + j;
      const bool valid = row < rows;
      const int token = valid ? row / group : 0;
      const int head = kv_head * group + (valid ? row % group : 0);
      const Bf16Vec<8> qv = load_activation<8, true>(a.q + (static_cast<size_t>(token) * a.heads + head) * d + dim0);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[j][e] = qv[e] * a.scale_log2;
      see_to[j] = valid ? a.positions[token] : -1;  // an invalid row sees nothing
      see_from[j] = a.window > 0 ? see_to[j] - a.window + 1 : 0;
      state[j].max = -INFINITY;
      state[j].sum = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) state[j].acc[e] = 0.0f;
    }

    if (pass_first == 0)
      load_step(now, first_base, max(plan.fresh, key_begin), key_end);  // this step's own keys, now written
    else
      load_step(now, first_base, INT_MIN, key_end);
    if (pass_first == 0) trace_phase_when(a, index, 0, q[0][0] + now.k[0][0]);
    // The loop bound is warp-uniform: the score reductions shuffle across the whole warp.
    for (int base = first_base; base < key_end; base += step_keys) {
      // The next step's keys fly while this step's are scored (at long context a step waited for its
      // loads: 3 us per step, NOTES.md); with kAttnSecondAhead the second step's older ones since before the wait.
      if (base + step_keys < key_end) {
        const bool second = kAttnSecondAhead && pass_first == 0 && base == first_base;
        load_step(next, base + step_keys, second ? max(plan.fresh, key_begin) : INT_MIN, key_end);
      }
      score_keys<kAttnRowsPerWarp, KEYS, lanes_per_key>(q, now.key, now.k, now.v, key_end, see_from, see_to, 1.0f,
                                                         1.0f, state);
      now = next;
    }
    if (pass_first == 0) trace_phase_when(a, index, 1, state[0].sum + state[0].acc[0]);

    fold_lane_groups<kAttnRowsPerWarp, lanes_per_key>(state);
    if (pass_first == 0) trace_phase(a, index, 2);

    // Warps that split the keys fold together through shared memory; the block writes the split.
    if (key_lane == 0) {
#pragma unroll
      for (int j = 0; j < kAttnRowsPerWarp; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) shared.acc[warp_id()][j][dim0 + e] = state[j].acc[e];
        if (lane_id() == 0) {
          shared.max[warp_id()][j] = state[j].max;
          shared.sum[warp_id()][j] = state[j].sum;
        }
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows_per_pass * d; i += blockDim.x) {
      const int local_row = i / d, e = i % d;
      const int row = pass_first + local_row;
      if (row >= rows) continue;
      const int wq = local_row / kAttnRowsPerWarp, j = local_row % kAttnRowsPerWarp;
      float best = -INFINITY;
      for (int w = wq; w < kMatvecWarps; w += q_warps) best = fmaxf(best, shared.max[w][j]);
      float sum = 0.0f, acc = 0.0f;
      if (best != -INFINITY) {
        for (int w = wq; w < kMatvecWarps; w += q_warps) {
          const float weight = exp2f(shared.max[w][j] - best);
          sum += shared.sum[w][j] * weight;
          acc += shared.acc[w][j][e] * weight;
        }
      }
      const size_t at = partial_row(a, kv_head, split, row);
      a.part_out[at * d + e] = sum > 0.0f ? acc / sum : 0.0f;
      if (e == 0) a.part_lse[at] = sum > 0.0f ? best + log2f(sum) : -INFINITY;
    }
    __syncthreads();  // shared memory is reused by the next pass
  }
  trace_phase(a, index, 3);
  return true;
}

#if LITHOS_MK_ATTN_ON_TENSOR_CORES
// Where the warps of one row tile fold their states, over the FMA fold's shared memory: in each round half of a
// tile's remaining warps write (out normalised by its row's sum, then the row's log2-sum-exp2) and the other half
// fold that in, so at most 4 warps write at once (8 warps over 1, 2, 4 or 8 tiles): 4 x 16 rows x 128 floats.
struct AttentionMmaFold {
  float out[4][16 * 128];  // [slot][(j * 4 + e) * 32 + lane]: fragment element e of n-tile j
  float lse[4][16];        // [slot][row of the tile]
};
static_assert(sizeof(AttentionMmaFold) <= sizeof(AttentionShared), "the fold reuses the FMA fold's memory");

// attention_split's contract on tensor cores (MmaSplitWarp<D>): the block's 8 warps take the split's row tiles
// (16 query rows each) tw at a time, and each tile's 8 / tw warps every (8 / tw)-th 16-key chunk. The first pass's
// first chunk's keys, where every one of them was written by earlier steps, fly during the wait.
template <int D, class Wait>
__device__ inline bool attention_split_mma(const Args& a, const SplitPlan& plan, int layer, int kv_head, int split,
                                           int index, Wait wait) {
  using Warp = MmaSplitWarp<D>;
  constexpr int kOutTiles = Warp::kOutTiles, kChunk = Warp::kChunk, kTileRows = 16;
  if (split >= plan.splits) return wait();  // as attention_split: no keys, but the wait is traced
  const int key_begin = plan.split_begin(split), key_end = plan.split_end(split);
  const int group = a.heads / a.kv_heads, rows = a.tokens * group, tiles = (rows + kTileRows - 1) / kTileRows;
  const int tw = tiles >= 8 ? 8 : (tiles >= 4 ? 4 : (tiles >= 2 ? 2 : 1));
  const int key_warps = kMatvecWarps / tw, chunk_stride = key_warps * kChunk;
  const int warp_tile = warp_id() % tw, warp_keys = warp_id() / tw;
  const int g = lane_id() / 4, t = lane_id() % 4;
  AttentionMmaFold& fold = reinterpret_cast<AttentionMmaFold&>(attention_shared());

  const size_t head_offset = (static_cast<size_t>(layer) * a.kv_heads + kv_head) * a.slots * D;
  const bf16_t* keys = a.k_cache + head_offset;
  const bf16_t* values = a.v_cache + head_offset;
  // Keys past the split's end read its last key (valid memory) and are masked.
  auto row_at = [&](int key) { return static_cast<size_t>(slot_of(plan, a.slots, min(key, key_end - 1))) * D; };
  // A chunk's values are asked for once its Q.K mma are issued, and the next chunk's keys once it is scored: with
  // the whole next chunk in flight (the fused kernel's way) the 4-16-token kernels spilled 700-800 accesses more,
  // all over the task loop (NOTES.md).
  typename Warp::KeyRows keys_now;
  typename Warp::ValueRows values_now;
  auto load_keys = [&](int from) { Warp::template load_keys<false>(keys_now, keys, row_at, from); };
  const int first_chunk = key_begin + warp_keys * kChunk;
  const bool early = warp_tile * kTileRows < rows && first_chunk < key_end &&
                     min(first_chunk + kChunk, key_end) <= plan.fresh;
  if (early) load_keys(first_chunk);
  if (!wait()) return false;

  for (int pass_first = 0; pass_first < tiles; pass_first += tw) {
    const int first_row = (pass_first + warp_tile) * kTileRows;
    const bool has_rows = first_row < rows;  // a pass may hold tiles past the last
    Warp warp;
    warp.set_rows(first_row, rows, group, kv_head, a.heads, a.q, a.positions, a.window,
                  [](const bf16_t* p) { return load_activation<8, true>(p); });
    warp.clear();
    int chunk = first_chunk;
    if (has_rows && chunk < key_end && !(pass_first == 0 && early)) load_keys(chunk);
    if (pass_first == 0) trace_phase_when(a, index, 0, bf16_pair_at(warp.qa[0][0], 0) + keys_now.k[0][0][0]);
    for (; has_rows && chunk < key_end; chunk += chunk_stride) {
      if (chunk != first_chunk) load_keys(chunk);
      float score[2][4];
      warp.scores(keys_now, score);
      Warp::template load_values<false>(values_now, values, row_at, chunk);
      warp.softmax(score, chunk, key_end, a.scale_log2);
      warp.accumulate(values_now, score);
    }
    if (pass_first == 0) trace_phase_when(a, index, 1, warp.row_sum[0] + warp.out[0][0]);
    warp.finish_sums();
    if (pass_first == 0) trace_phase(a, index, 2);

    // The tile's warps fold in rounds; its warp with warp_keys 0 ends with the split's state.
    for (int half = key_warps / 2; half >= 1; half /= 2) {
      if (has_rows && warp_keys >= half && warp_keys < 2 * half) {
        const int slot = warp_tile * half + warp_keys - half;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float scale = warp.row_scale(r);
#pragma unroll
          for (int j = 0; j < kOutTiles; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c)
              fold.out[slot][(j * 4 + 2 * r + c) * 32 + lane_id()] = warp.out[j][2 * r + c] * scale;
          if (t == 0) fold.lse[slot][g + 8 * r] = warp.row_lse(r);
        }
      }
      __syncthreads();
      if (has_rows && warp_keys < half) {
        const int slot = warp_tile * half + warp_keys;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float other = fold.lse[slot][g + 8 * r], best = fmaxf(warp.row_max[r], other);
          if (best == -INFINITY) continue;  // neither saw a key
          const float mine = exp2f(warp.row_max[r] - best), theirs = exp2f(other - best);
          warp.row_sum[r] = warp.row_sum[r] * mine + theirs;
          warp.row_max[r] = best;
#pragma unroll
          for (int j = 0; j < kOutTiles; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c)
              warp.out[j][2 * r + c] =
                  warp.out[j][2 * r + c] * mine + fold.out[slot][(j * 4 + 2 * r + c) * 32 + lane_id()] * theirs;
        }
      }
      __syncthreads();  // the slots are written again by the next round or pass
    }
    if (has_rows && warp_keys == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = first_row + g + 8 * r;
        if (row >= rows) continue;
        const float scale = warp.row_scale(r);
        const size_t at = partial_row(a, kv_head, split, row);
#pragma unroll
        for (int j = 0; j < kOutTiles; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) a.part_out[at * D + Warp::dim_of(j, c)] = warp.out[j][2 * r + c] * scale;
        if (t == 0) a.part_lse[at] = warp.row_lse(r);
      }
    }
  }
  __syncthreads();  // every warp's part written before the task signals
  trace_phase(a, index, 3);
  return true;
}
#endif  // LITHOS_MK_ATTN_ON_TENSOR_CORES

// Elements of a row a thread of the combine takes, adjacent: 4 (one 16-byte load a split) in the 2-16-token kernels,
// where at 2 a head group's rows took several passes of the block (run 138: the 8B k = 7 round 2.1% faster, the 1B
// k = 15 round 1.8%); 2 (one 8-byte load) in the one-token kernel, whose rows are one pass either way and whose
// step took 1.2% longer at 4 (NOTES.md, "The attention's combine four elements a thread").
template <int TMAX>
constexpr int kCombineVec = TMAX == 1 ? 2 : 4;

// v = the VEC floats at p (one 8- or 16-byte load).
template <int VEC>
__device__ __forceinline__ void load_combine_elements(const float* p, float (&v)[VEC]) {
  static_assert(VEC == 2 || VEC == 4, "the combine loads 2 or 4 floats at once");
  if constexpr (VEC == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
    const float2 x = *reinterpret_cast<const float2*>(p);
    v[0] = x.x, v[1] = x.y;
  }
}

// Weight each split's output by its share of the softmax mass; a row that sees no key gets zeros.
// Writes the group's heads of the attention output [tokens, heads * head_dim]. A thread takes VEC
// adjacent elements of a row (one load per split: at T = 1 and head_dim 128 the block covers the 512 elements
// in one pass, one memory round trip instead of two), loads kCombineChunk splits' values before using any and
// folds the chunks online.
template <int D, int VEC>
__device__ inline void attention_combine(const Args& a, const SplitPlan& plan, int kv_head) {
  constexpr int kCombineChunk = 16, d = D;
  const int group = a.heads / a.kv_heads, rows = a.tokens * group;
  for (int i = VEC * threadIdx.x; i < rows * d; i += VEC * blockDim.x) {
    const int row = i / d, e = i % d;  // d is a multiple of 64: the thread's elements stay in their row
    float best = -INFINITY, sum = 0.0f, acc[VEC] = {};
    for (int first = 0; first < plan.splits; first += kCombineChunk) {
      float lse[kCombineChunk];
      float out[kCombineChunk][VEC];
      float chunk_best = -INFINITY;
#pragma unroll
      for (int c = 0; c < kCombineChunk; ++c) {
        lse[c] = -INFINITY;
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[c][j] = 0.0f;
        if (first + c < plan.splits) {
          const size_t at = partial_row(a, kv_head, first + c, row);
          lse[c] = a.part_lse[at];
          load_combine_elements(a.part_out + at * d + e, out[c]);
        }
      }
#pragma unroll
      for (int c = 0; c < kCombineChunk; ++c) chunk_best = fmaxf(chunk_best, lse[c]);
      const float new_best = fmaxf(best, chunk_best);
      if (new_best == -INFINITY) continue;  // no split so far saw a visible key
      const float rescale = exp2f(best - new_best);
      sum *= rescale;
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] *= rescale;
#pragma unroll
      for (int c = 0; c < kCombineChunk; ++c) {
        const float weight = exp2f(lse[c] - new_best);
        sum += weight;
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += weight * out[c][j];
      }
      best = new_best;
    }
    const int token = row / group, head = kv_head * group + row % group;
    bf16_t* to = a.attn + (static_cast<size_t>(token) * a.heads + head) * d + e;
#pragma unroll
    for (int j = 0; j < VEC; ++j) to[j] = float_to_bf16(sum > 0.0f ? acc[j] / sum : 0.0f);
  }
}

template <int D, int KEYS, int VEC, bool MMA>
__device__ inline bool attention_task_of(const Args& a, const Task& task, int index) {
  const SplitPlan plan = plan_splits(a);  // from the positions: the step's input, readable before the wait
  auto wait = [&] { return block_wait(a, task, index); };
  bool ok;
#if LITHOS_MK_ATTN_ON_TENSOR_CORES
  if constexpr (MMA)
    ok = attention_split_mma<D>(a, plan, task.layer, task.first, task.count, index, wait);
  else
#endif
    ok = attention_split<D, KEYS>(a, plan, task.layer, task.first, task.count, index, wait);
  if (!ok) return false;
  const int arrived = block_signal(a, task.signal_counter);
  trace_phase(a, index, 4);
  if (arrived == task.arrivals - 1) {
    attention_combine<D, VEC>(a, plan, task.first);
    block_release(a, task.aux);
  }
  return true;
}

// The handler admits head dimensions 64, 128 and 256 only (megakernel.cu).
template <int TMAX>
__device__ inline bool attention_task(const Args& a, const Task& task, int index) {
  constexpr int keys = kAttnKeysPerStep<TMAX>, vec = kCombineVec<TMAX>;
  switch (a.head_dim) {
    case 64: return attention_task_of<64, keys, vec, kAttnOnTensorCores<TMAX, 64>>(a, task, index);
    case 128: return attention_task_of<128, keys, vec, kAttnOnTensorCores<TMAX, 128>>(a, task, index);
    default: return attention_task_of<256, keys, vec, false>(a, task, index);
  }
}

}  // namespace mk
}  // namespace lithos
