// Decode attention for 1..16 query positions over one layer of the KV cache, split along its length
// (flash-decoding): each block reads one stretch of one KV head's keys and values once for all the
// queries that share that head (GQA), keeps an online softmax, and writes a normalised partial
// output with its log-sum-exp; a second kernel combines the splits.
//
// The key range and the split length come from the positions on the device: the grid is fixed
// (no host sync, no recompilation) while a 1K context inside a 1M cache reads 1K keys, cut into a
// few splits, and a 1M context is cut into as many splits as the grid has.
//
// Lanes: a key's head_dim elements are spread over head_dim / 8 lanes (16 bytes each), so a warp
// reads several consecutive keys with fully coalesced loads and a score needs log2(head_dim / 8)
// shuffles. A query at position p sees keys at positions <= p (and > p - window when windowed).
//
// The cache is linear (key position p in slot p) or a ring (lithos/kv_cache.py: slot p % slots,
// holding the newest `slots` positions, this step's own keys included). The kernel iterates over key
// positions and reads each from its slot; the keys it reads span at most one lap of the ring.
//
// The cache is bf16, or FP8 E4M3 codes with one scale per (layer, KV head) (lithos/kv_cache.py):
// then a lane reads 8 bytes per key, twice the keys per loop step keep the same bytes in flight,
// and the scales and fp8.h's 2^-120 are folded into the query and the output (see CacheRead).
//
// At 4-16 query positions with a bf16 cache and head_dim up to LITHOS_ATTENTION_MMA (CUDA) the splits run
// on tensor cores instead (attention_split_mma_kernel): the query rows of a KV head are the mma's M side,
// so a key is read once for 16 rows and scored by one instruction, where the FMA kernel spends about 30
// lane instructions per row and key (NOTES.md, run 56). 64 by default: the 1B shape's 8-position attention
// 22.1 -> 16.0 us; at head_dim 128 the kernel needs 255 registers and was slower (29.0 against 28.2 us, run
// 60), so "LITHOS_ATTENTION_MMA=128" builds it for A/B runs and 0 turns the tensor cores off.
#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include "ffi_util.h"
#include "fp8.h"
#include "mma_rowdot.h"
#include "portable.h"
#include "split_attention.h"
#include "split_attention_mma.h"

#ifndef LITHOS_ATTENTION_MMA
#define LITHOS_ATTENTION_MMA 64
#endif
#if LITHOS_ATTENTION_MMA != 0 && LITHOS_ATTENTION_MMA != 64 && LITHOS_ATTENTION_MMA != 128
#error "LITHOS_ATTENTION_MMA is the largest head dimension whose splits run on tensor cores: 0, 64 or 128"
#endif

namespace lithos {
namespace {

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * WARP_SIZE;
constexpr int kQueryRowsPerWarp = 4;  // query rows (token, head-in-group) whose state a warp keeps
constexpr int kKeysPerStep = 4;       // keys per lane group per loop step: 8 loads of 16 bytes in flight
constexpr int kMinKeysPerSplit = 64;  // below this a split costs more in overhead than it saves
constexpr int kSplitBlocksPerUnit = 4;
constexpr double kLog2e = 1.4426950408889634;

struct AttnArgs {
  const bf16_t* q;           // [tokens, heads, head_dim]
  const void* k_cache;       // [layers, 1, kv_heads, slots, head_dim]: bf16_t, or uint8_t E4M3 codes
  const void* v_cache;
  const float* k_scale;      // [layers, 1, kv_heads]: an FP8 cache's scales (nullptr for bf16)
  const float* v_scale;
  const int32_t* positions;  // [tokens]
  const int32_t* layer;      // [] device scalar
  float* split_out;          // [max_splits, kv_heads, rows, head_dim]: normalised partial outputs
  float* split_lse;          // [max_splits, kv_heads, rows]: their log2-sum-exp2
  bf16_t* out;               // [tokens, heads, head_dim]
  int tokens, heads, kv_heads, slots, window, max_splits;
  bool ring;                 // key position p in slot p % slots (else slot p, positions >= slots absent)
  int min_split_keys;        // a split covers at least this many keys (kMinKeysPerSplit unless tuned)
  float scale_log2;          // log2(e) / sqrt(head_dim): scores live in the exp2 domain
};

// Query rows of one KV head: its group of query heads for every token, row = token * group + g.
__host__ __device__ inline int query_rows(const AttnArgs& a) { return a.tokens * (a.heads / a.kv_heads); }

// Warps that split a block's query rows (the rest split its keys): all four split keys at T = 1.
__host__ __device__ inline int query_warps(int rows) {
  const int chunks = (rows + kQueryRowsPerWarp - 1) / kQueryRowsPerWarp;
  return chunks >= 4 ? 4 : (chunks >= 2 ? 2 : 1);
}

// Whether a call's splits run on tensor cores (attention_split_mma_kernel): CUDA, a bf16 cache, head_dim
// up to LITHOS_ATTENTION_MMA (at most 128: the output fragments of 16 rows take head_dim / 2 registers a
// lane), and 4-16 positions.
__host__ __device__ inline bool splits_on_tensor_cores(int tokens, int head_dim, bool fp8_cache) {
#if defined(LITHOS_HIP)
  return false;
#else
  return !fp8_cache && head_dim <= LITHOS_ATTENTION_MMA && tokens >= 4;
#endif
}

// The tensor-core kernel's query rows come in tiles of 16 (the mma's M side); a block's warps take up to
// four tiles, the rest of them split the keys.
constexpr int kRowTile = 16;
__host__ __device__ inline int row_tiles(int rows) { return (rows + kRowTile - 1) / kRowTile; }
__host__ __device__ inline int tile_warps(int tiles) { return tiles >= 4 ? 4 : (tiles >= 2 ? 2 : 1); }

// Blocks along a split's query rows, for either kernel.
inline int split_row_blocks(int rows, bool on_tensor_cores) {
  const int per_block = on_tensor_cores ? tile_warps(row_tiles(rows)) * kRowTile : query_warps(rows) * kQueryRowsPerWarp;
  return (rows + per_block - 1) / per_block;
}

__device__ SplitPlan plan_splits(const AttnArgs& a) {
  return ::lithos::plan_splits(a.positions, a.tokens, a.slots, a.window, a.ring, a.max_splits, a.min_split_keys);
}

// The split a block of either split kernel takes: split blockIdx.y of KV head blockIdx.z, its keys
// [begin(), end()). A split past the plan's count is not in use: its block writes nothing.
struct BlockSplit {
  SplitPlan plan;
  int split, kv_head;
  __device__ bool in_use() const { return split < plan.splits; }  // the combine reads only these
  __device__ int begin() const { return plan.split_begin(split); }
  __device__ int end() const { return plan.split_end(split); }
};
__device__ __forceinline__ BlockSplit block_split(const AttnArgs& a) {
  return {plan_splits(a), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
}

// How the split kernel reads a cache element type: 8 consecutive elements per lane and load, and the
// factors that turn what it reads into true values (bf16: none).
template <typename Cache>
struct CacheRead {
  using Vec = Bf16Vec<8>;
  static constexpr int kStepKeys = kKeysPerStep;
  static constexpr float kQueryFold = 1.0f, kScoreFold = 1.0f, kValueFold = 1.0f, kOutFold = 1.0f;
  static __device__ __forceinline__ Vec load(const bf16_t* p) { return load_streaming<8>(p); }
  static __device__ __forceinline__ Vec zero() { return Vec{{0u, 0u, 0u, 0u}}; }
};

// E4M3 elements read as value * 2^-120 (fp8.h). The 2^120 is split 64 + 56 so that neither the
// pre-scaled query nor any product q * k or p * v leaves the normal f32 range: scores are
// (q * scale * 2^64) . k_raw * 2^56, and the output sum(p * 2^64 * v_raw) / sum(p) * scale * 2^56.
template <>
struct CacheRead<uint8_t> {
  using Vec = E4m3Vec8;
  static constexpr int kStepKeys = 8;  // 8-byte loads: twice the keys for the same bytes in flight
  static constexpr float kQueryFold = 0x1p64f, kScoreFold = 0x1p56f, kValueFold = 0x1p64f, kOutFold = 0x1p56f;
  static_assert(64 + 56 == kE4m3RawExp, "the folds must undo e4m3_raw's 2^-120");
  static __device__ __forceinline__ Vec load(const uint8_t* p) { return load_e4m3_streaming(p); }
  static __device__ __forceinline__ Vec zero() { return Vec{{0u, 0u}}; }
};

// The block's split, written once its warps' states are in shared memory: warp w holds ROWS query rows
// (row group w % row_warps of the block) over its share of the keys; the warps of one row group fold
// (online-softmax merge) into each row's normalised partial output and log2-sum-exp2. `out_scale`
// undoes a scale folded into the values (FP8; 1 for bf16).
template <int HEAD_DIM, int ROWS>
__device__ __forceinline__ void write_split(const AttnArgs& a, int split, int kv_head, int row_warps,
                                            const float (&acc)[kAttnWarps][ROWS][HEAD_DIM],
                                            const float (&max)[kAttnWarps][ROWS], const float (&sum)[kAttnWarps][ROWS],
                                            float out_scale) {
  __syncthreads();
  const int rows = query_rows(a), rows_per_block = row_warps * ROWS;
  const size_t split_base = (static_cast<size_t>(split) * a.kv_heads + kv_head) * rows;
  for (int i = threadIdx.x; i < rows_per_block * HEAD_DIM; i += kAttnThreads) {
    const int local_row = i / HEAD_DIM, d = i % HEAD_DIM;
    const int row = blockIdx.x * rows_per_block + local_row;
    if (row >= rows) continue;
    const int first_warp = local_row / ROWS, j = local_row % ROWS;
    float best = -INFINITY;
    for (int w = first_warp; w < kAttnWarps; w += row_warps) best = fmaxf(best, max[w][j]);
    float total = 0.0f, out = 0.0f;
    if (best != -INFINITY) {
      for (int w = first_warp; w < kAttnWarps; w += row_warps) {
        const float weight = exp2f(max[w][j] - best);
        total += sum[w][j] * weight;
        out += acc[w][j][d] * weight;
      }
    }
    a.split_out[(split_base + row) * HEAD_DIM + d] = total > 0.0f ? out / total * out_scale : 0.0f;
    if (d == 0) a.split_lse[split_base + row] = total > 0.0f ? best + log2f(total) : -INFINITY;
  }
}

template <int HEAD_DIM, typename Cache>
__global__ void __launch_bounds__(kAttnThreads) attention_split_kernel(AttnArgs a) {
  using Read = CacheRead<Cache>;
  constexpr int kSteps = Read::kStepKeys;
  constexpr int kLanesPerKey = HEAD_DIM / 8;
  constexpr int kKeysPerWarp = WARP_SIZE / kLanesPerKey;
  static_assert(kLanesPerKey <= WARP_SIZE, "head_dim too large for one warp");

  const BlockSplit block = block_split(a);
  if (!block.in_use()) return;
  const SplitPlan& plan = block.plan;
  const int split = block.split, kv_head = block.kv_head, key_begin = block.begin(), key_end = block.end();
  const int group = a.heads / a.kv_heads;
  const int rows = query_rows(a);
  const int q_warps = query_warps(rows);
  const int k_warps = kAttnWarps / q_warps;
  const int rows_per_block = q_warps * kQueryRowsPerWarp;
  const int warp_q = warp_id() % q_warps, warp_k = warp_id() / q_warps;
  const int first_row = blockIdx.x * rows_per_block + warp_q * kQueryRowsPerWarp;
  const int key_lane = lane_id() / kLanesPerKey;
  const int dim0 = (lane_id() % kLanesPerKey) * 8;

  // This lane's slice of each query row, pre-scaled, and the key window each row sees.
  const size_t scale_at = static_cast<size_t>(*a.layer) * a.kv_heads + kv_head;
  const float q_scale = a.scale_log2 * (a.k_scale ? a.k_scale[scale_at] * Read::kQueryFold : 1.0f);
  const float out_scale = a.v_scale ? a.v_scale[scale_at] * Read::kOutFold : 1.0f;
  float q[kQueryRowsPerWarp][8];
  int see_from[kQueryRowsPerWarp], see_to[kQueryRowsPerWarp];
  Softmax state[kQueryRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kQueryRowsPerWarp; ++j) {
    const int row = first_row + j;
    const bool valid = row < rows;
    const int token = valid ? row / group : 0;
    const int head = kv_head * group + (valid ? row % group : 0);
    const Bf16Vec<8> qv = load_cached<8>(a.q + (static_cast<size_t>(token) * a.heads + head) * HEAD_DIM + dim0);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[j][e] = qv[e] * q_scale;
    see_to[j] = valid ? a.positions[token] : -1;  // an invalid row sees nothing
    see_from[j] = a.window > 0 ? see_to[j] - a.window + 1 : 0;
    state[j].max = -INFINITY;
    state[j].sum = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) state[j].acc[e] = 0.0f;
  }

  const size_t head_offset = ((static_cast<size_t>(*a.layer) * a.kv_heads) + kv_head) * a.slots * HEAD_DIM;
  const Cache* keys = static_cast<const Cache*>(a.k_cache) + head_offset + dim0;
  const Cache* values = static_cast<const Cache*>(a.v_cache) + head_offset + dim0;
  const int key_stride = k_warps * kKeysPerWarp;  // between a lane's consecutive keys

  // The loop bound is warp-uniform: the score reductions shuffle across the whole warp.
  for (int base = key_begin + warp_k * kKeysPerWarp; base < key_end; base += key_stride * kSteps) {
    int key[kSteps];
    typename Read::Vec k[kSteps], v[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      key[u] = base + key_lane + u * key_stride;
      if (key[u] < key_end) {
        const size_t at = static_cast<size_t>(slot_of(plan, a.slots, key[u])) * HEAD_DIM;
        k[u] = Read::load(keys + at);
        v[u] = Read::load(values + at);
      } else {
        k[u] = Read::zero();
        v[u] = k[u];
      }
    }
    score_keys<kQueryRowsPerWarp, kSteps, kLanesPerKey>(q, key, k, v, key_end, see_from, see_to, Read::kScoreFold,
                                                        Read::kValueFold, state);
  }

  fold_lane_groups<kQueryRowsPerWarp, kLanesPerKey>(state);

  // Warps that split the keys fold together through shared memory, then the block writes its split.
  __shared__ float shared_acc[kAttnWarps][kQueryRowsPerWarp][HEAD_DIM];
  __shared__ float shared_max[kAttnWarps][kQueryRowsPerWarp];
  __shared__ float shared_sum[kAttnWarps][kQueryRowsPerWarp];
  if (key_lane == 0) {
#pragma unroll
    for (int j = 0; j < kQueryRowsPerWarp; ++j) {
#pragma unroll
      for (int e = 0; e < 8; ++e) shared_acc[warp_id()][j][dim0 + e] = state[j].acc[e];
      if (lane_id() == 0) {
        shared_max[warp_id()][j] = state[j].max;
        shared_sum[warp_id()][j] = state[j].sum;
      }
    }
  }
  write_split<HEAD_DIM>(a, split, kv_head, q_warps, shared_acc, shared_max, shared_sum, out_scale);
}

#if !defined(LITHOS_HIP)
// The splits on tensor cores (split_attention_mma.h). Warp w takes row tile w % tile_warps of the block and
// every (key_warps)-th 16-key chunk of the split, and asks for its next chunk's keys and values before scoring
// the current one (two register sets of a chunk's rows), so a split waits for one round trip, not two per chunk.
// Warps that share a tile fold their states through shared memory and the block writes its split as the FMA
// kernel does; attention_combine_kernel is the same for both.
template <int HEAD_DIM>
__global__ void __launch_bounds__(kAttnThreads) attention_split_mma_kernel(AttnArgs a) {
  using Warp = MmaSplitWarp<HEAD_DIM>;
  constexpr int kOutTiles = Warp::kOutTiles, kChunk = Warp::kChunk;

  const BlockSplit block = block_split(a);
  if (!block.in_use()) return;
  const SplitPlan& plan = block.plan;
  const int split = block.split, kv_head = block.kv_head, key_begin = block.begin(), key_end = block.end();
  const int group = a.heads / a.kv_heads;
  const int rows = query_rows(a);
  const int tw = tile_warps(row_tiles(rows));
  const int key_warps = kAttnWarps / tw;
  const int warp_tile = warp_id() % tw, warp_keys = warp_id() / tw;
  const int first_row = (blockIdx.x * tw + warp_tile) * kRowTile;
  const int g = lane_id() / 4, t = lane_id() % 4;

  Warp warp;
  warp.set_rows(first_row, rows, group, kv_head, a.heads, a.q, a.positions, a.window,
                [](const bf16_t* p) { return load_cached<8>(p); });
  warp.clear();

  const size_t head_offset = ((static_cast<size_t>(*a.layer) * a.kv_heads) + kv_head) * a.slots * HEAD_DIM;
  const bf16_t* keys = static_cast<const bf16_t*>(a.k_cache) + head_offset;
  const bf16_t* values = static_cast<const bf16_t*>(a.v_cache) + head_offset;
  // Keys past the split's end read its last key (valid memory) and are masked.
  auto row_at = [&](int key) {
    return static_cast<size_t>(slot_of(plan, a.slots, min(key, key_end - 1))) * HEAD_DIM;
  };

  const bool has_rows = first_row < rows;  // the grid's last block may hold a warp without a tile
  const int chunk_stride = key_warps * kChunk;
  // Zeros until a next chunk exists: the copy after the last chunk reads defined values.
  typename Warp::ChunkRows now, next{};
  auto load_chunk = [&](typename Warp::ChunkRows& rows_of, int from) {
    Warp::template load_chunk<true>(rows_of, keys, values, row_at, from);
  };
  int chunk = key_begin + warp_keys * kChunk;
  if (has_rows && chunk < key_end) load_chunk(now, chunk);
  for (; has_rows && chunk < key_end; chunk += chunk_stride) {
    // The next chunk's rows fly while this one is scored: one round trip per split, not two per chunk.
    if (chunk + chunk_stride < key_end) load_chunk(next, chunk + chunk_stride);
    warp.score(now, chunk, key_end, a.scale_log2);
    now = next;
  }
  warp.finish_sums();

  // Warps of one tile fold together through shared memory, then the block writes its split.
  __shared__ float shared_out[kAttnWarps][kRowTile][HEAD_DIM];
  __shared__ float shared_max[kAttnWarps][kRowTile];
  __shared__ float shared_sum[kAttnWarps][kRowTile];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int local_row = g + 8 * r;
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) {
      shared_out[warp_id()][local_row][Warp::dim_of(j, 0)] = warp.out[j][2 * r];
      shared_out[warp_id()][local_row][Warp::dim_of(j, 1)] = warp.out[j][2 * r + 1];
    }
    if (t == 0) {
      shared_max[warp_id()][local_row] = warp.row_max[r];
      shared_sum[warp_id()][local_row] = warp.row_sum[r];
    }
  }
  write_split<HEAD_DIM>(a, split, kv_head, tw, shared_out, shared_max, shared_sum, 1.0f);
}
#endif  // !LITHOS_HIP

// One block per (token, query head), one thread per output dimension: weight each split's output by
// its share of the softmax mass. A row that sees no key (no valid position) gets zeros.
template <int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM) attention_combine_kernel(AttnArgs a) {
  const SplitPlan plan = plan_splits(a);
  const int token = blockIdx.x / a.heads, head = blockIdx.x % a.heads;
  const int group = a.heads / a.kv_heads;
  const int kv_head = head / group, row = token * group + head % group;
  const int rows = query_rows(a);
  const int d = threadIdx.x;

  float best = -INFINITY;
  for (int s = 0; s < plan.splits; ++s)
    best = fmaxf(best, a.split_lse[(static_cast<size_t>(s) * a.kv_heads + kv_head) * rows + row]);
  float sum = 0.0f, acc = 0.0f;
  if (best != -INFINITY) {
    for (int s = 0; s < plan.splits; ++s) {
      const size_t at = (static_cast<size_t>(s) * a.kv_heads + kv_head) * rows + row;
      const float weight = exp2f(a.split_lse[at] - best);
      sum += weight;
      acc += weight * a.split_out[at * HEAD_DIM + d];
    }
  }
  a.out[(static_cast<size_t>(token) * a.heads + head) * HEAD_DIM + d] = float_to_bf16(sum > 0.0f ? acc / sum : 0.0f);
}

template <int HEAD_DIM, typename Cache>
ffi::Error launch_attention(gpuStream_t stream, const AttnArgs& a) {
  constexpr bool kFp8 = std::is_same_v<Cache, uint8_t>;
  const int rows = query_rows(a);
  const bool on_tensor_cores = splits_on_tensor_cores(a.tokens, HEAD_DIM, kFp8);
  const dim3 split_grid(split_row_blocks(rows, on_tensor_cores), a.max_splits, a.kv_heads);
#if !defined(LITHOS_HIP)
  if constexpr (!kFp8 && HEAD_DIM <= LITHOS_ATTENTION_MMA) {
    if (on_tensor_cores) attention_split_mma_kernel<HEAD_DIM><<<split_grid, kAttnThreads, 0, stream>>>(a);
  }
#endif
  if (!on_tensor_cores) attention_split_kernel<HEAD_DIM, Cache><<<split_grid, kAttnThreads, 0, stream>>>(a);
  if (ffi::Error err = launch_status("decode_attention (splits)"); err.failure()) return err;
  attention_combine_kernel<HEAD_DIM><<<a.tokens * a.heads, HEAD_DIM, 0, stream>>>(a);
  return launch_status("decode_attention (combine)");
}

// The cache is bf16 (CacheType BF16, no scales) or E4M3 codes (U8) with scales [layers, 1, kv_heads].
template <ffi::DataType CacheType>
ffi::Error decode_attention_impl(gpuStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<CacheType> k_cache,
                                 ffi::Buffer<CacheType> v_cache, const ffi::Buffer<ffi::F32>* k_scale,
                                 const ffi::Buffer<ffi::F32>* v_scale, ffi::Buffer<ffi::S32> positions,
                                 ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> split_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> split_lse, int64_t window, bool ring,
                                 int64_t splits, int64_t split_keys) {
  // Launch parameters from `lithos tune`'s table; 0 = the heuristic below.
  if (splits < 0 || splits > 4096 || split_keys < 0 || split_keys > (int64_t{1} << 20))
    return invalid("decode_attention: launch parameters splits=" + std::to_string(splits) + ", split_keys=" +
                   std::to_string(split_keys) + " are out of range (splits 0..4096, split_keys 0..2^20; 0 = "
                   "heuristic): fix or delete the tuning table entry");
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || v_cache.dimensions().size() != 5 ||
      v_cache.element_count() != k_cache.element_count())
    return invalid("decode_attention: expected q [tokens, heads, head_dim] and k/v caches [layers, batch, kv_heads, "
                   "slots, head_dim]; got q " + shape_string(qd) + ", cache " + shape_string(cd));
  if (cd[1] != 1) return invalid("decode_attention: the fused kernels decode batch 1, cache has batch " +
                                 std::to_string(cd[1]));
  if (qd[2] != cd[4] || cd[2] <= 0 || qd[1] % cd[2] != 0)
    return invalid("decode_attention: q " + shape_string(qd) + " does not fit cache " + shape_string(cd) +
                   " (head_dim must match and heads be a multiple of kv_heads)");
  if (positions.element_count() != static_cast<size_t>(qd[0]) || layer.element_count() != 1)
    return invalid("decode_attention: positions must be [tokens] and layer a scalar");
  if (qd[0] < 1 || qd[0] > kMaxTokens)
    return invalid("decode_attention: 1.." + std::to_string(kMaxTokens) + " query positions, got " +
                   std::to_string(qd[0]));
  using Cache = std::conditional_t<CacheType == ffi::U8, uint8_t, bf16_t>;
  const size_t scale_count = static_cast<size_t>(cd[0]) * cd[1] * cd[2];
  if (k_scale && (k_scale->element_count() != scale_count || v_scale->element_count() != scale_count))
    return invalid("decode_attention: an FP8 cache " + shape_string(cd) + " needs k/v scales [layers, 1, kv_heads], "
                   "got " + shape_string(k_scale->dimensions()) + " and " + shape_string(v_scale->dimensions()));
  AttnArgs a{};
  a.q = q.typed_data();
  a.k_cache = k_cache.typed_data();
  a.v_cache = v_cache.typed_data();
  a.k_scale = k_scale ? k_scale->typed_data() : nullptr;
  a.v_scale = v_scale ? v_scale->typed_data() : nullptr;
  a.positions = positions.typed_data();
  a.layer = layer.typed_data();
  a.split_out = split_out->typed_data();
  a.split_lse = split_lse->typed_data();
  a.out = out->typed_data();
  a.tokens = static_cast<int>(qd[0]);
  a.heads = static_cast<int>(qd[1]);
  a.kv_heads = static_cast<int>(cd[2]);
  a.slots = static_cast<int>(cd[3]);
  a.window = static_cast<int>(window);
  a.ring = ring;
  if (ring && (window < 1 || window + a.tokens - 1 > a.slots))
    return invalid("decode_attention: a ring cache of " + std::to_string(a.slots) + " slots holds the newest " +
                   std::to_string(a.slots) + " positions only; " + std::to_string(a.tokens) + " queries need a window "
                   "W >= 1 with W + tokens - 1 <= slots, got " + std::to_string(window));
  const int head_dim = static_cast<int>(cd[4]);
  a.scale_log2 = static_cast<float>(kLog2e / std::sqrt(static_cast<double>(head_dim)));

  // Enough splits to put a few blocks on every SM/CU at long context, within the scratch provided.
  const int rows = query_rows(a);
  const int row_blocks = split_row_blocks(rows, splits_on_tensor_cores(a.tokens, head_dim, k_scale != nullptr));
  const int capacity = static_cast<int>(split_lse->dimensions()[0]);
  if (split_lse->element_count() != static_cast<size_t>(capacity) * a.kv_heads * rows ||
      split_out->element_count() != split_lse->element_count() * head_dim)
    return invalid("decode_attention: scratch must be [splits, kv_heads, rows(, head_dim)]");
  const int wanted = (compute_unit_count() * kSplitBlocksPerUnit + a.kv_heads * row_blocks - 1) /
                     (a.kv_heads * row_blocks);
  a.min_split_keys = split_keys > 0 ? static_cast<int>(split_keys) : kMinKeysPerSplit;
  const int by_length = (a.slots + a.min_split_keys - 1) / a.min_split_keys;
  a.max_splits = std::max(1, std::min({splits > 0 ? static_cast<int>(splits) : wanted, capacity, by_length}));

  if (!aligned16(a.q) || !aligned16(a.k_cache) || !aligned16(a.v_cache))
    return invalid("decode_attention: q and the caches must be 16-byte aligned");
  switch (head_dim) {
    case 64: return launch_attention<64, Cache>(stream, a);
    case 128: return launch_attention<128, Cache>(stream, a);
    case 256: return launch_attention<256, Cache>(stream, a);
    default:
      return invalid("decode_attention: head_dim " + std::to_string(head_dim) +
                     " has no fused kernel (64, 128, 256); use kernels='reference'");
  }
}

ffi::Error decode_attention_bf16(gpuStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k_cache,
                                 ffi::Buffer<ffi::BF16> v_cache, ffi::Buffer<ffi::S32> positions,
                                 ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> split_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> split_lse, int64_t window, bool ring,
                                 int64_t splits, int64_t split_keys) {
  return decode_attention_impl(stream, q, k_cache, v_cache, nullptr, nullptr, positions, layer, out, split_out,
                               split_lse, window, ring, splits, split_keys);
}

ffi::Error decode_attention_fp8(gpuStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::U8> k_cache,
                                ffi::Buffer<ffi::U8> v_cache, ffi::Buffer<ffi::F32> k_scale,
                                ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> positions,
                                ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> split_out,
                                ffi::Result<ffi::Buffer<ffi::F32>> split_lse, int64_t window, bool ring,
                                int64_t splits, int64_t split_keys) {
  return decode_attention_impl(stream, q, k_cache, v_cache, &k_scale, &v_scale, positions, layer, out, split_out,
                               split_lse, window, ring, splits, split_keys);
}

}  // namespace
}  // namespace lithos

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosDecodeAttention, lithos::decode_attention_bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // q
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k cache
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scratch: split outputs
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scratch: split log-sum-exp
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("ring")       // slot = position % slots
                                  .Attr<int64_t>("splits")  // launch parameters: 0 = heuristic
                                  .Attr<int64_t>("split_keys"),
                              {ffi::Traits::kCmdBufferCompatible});

// The same with an FP8 E4M3 cache (u8 codes) and its scales [layers, 1, kv_heads] f32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosDecodeAttentionFp8, lithos::decode_attention_fp8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // q
                                  .Arg<ffi::Buffer<ffi::U8>>()    // k cache: E4M3 codes
                                  .Arg<ffi::Buffer<ffi::U8>>()    // v cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k scales
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scratch: split outputs
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scratch: split log-sum-exp
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("ring")       // slot = position % slots
                                  .Attr<int64_t>("splits")  // launch parameters: 0 = heuristic
                                  .Attr<int64_t>("split_keys"),
                              {ffi::Traits::kCmdBufferCompatible});
