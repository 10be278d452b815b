// One warp's share of a split on tensor cores (m16n8k16 bf16, f32 accumulators), shared by the fused
// kernel (attention.cu, attention_split_mma_kernel) and the megakernel's 4-16-token attention
// (mk_attention.h, a build variant there). CUDA only: HIP builds keep the FMA splits.
//
// The warp holds a tile of 16 query rows (token x query head of one KV head) and walks 16-key chunks. Lane
// (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of the tile.
// - Scores S = Q K^T, two 8-key tiles a chunk (N side: key g of the tile). A dot product may take its
//   dimensions in any order as long as both sides agree: k-step s = 2c + h of lane t covers dimensions
//   32c + 8t + 4h .. + 3 (k = 2t, 2t + 1, 2t + 8, 2t + 9 in that order), so a lane reads 16 contiguous
//   bytes of a key row (or query row) per c and both fragments come straight from registers.
// - Online softmax on the score fragments (rows g and g + 8: 2 keys per tile, the row max over the 4
//   lanes t by two shuffles), in the exp2 domain as the FMA splits.
// - O += P V: the score fragments of the two key tiles are the A fragment of one 16-key k-step (as in
//   FlashAttention-2), P split into bf16 high and low parts so the weights keep about 16 bits. The
//   output's n-tile j column n is dimension n * (head_dim / 8) + j, so lane (g, t) reads head_dim / 8
//   contiguous dimensions of keys 2t, 2t + 1, 2t + 8, 2t + 9 and pairs them by byte permutes.
#pragma once

#if !defined(LITHOS_HIP)
#include <cmath>
#include <cstdint>

#include "mma_rowdot.h"
#include "portable.h"

namespace lithos {

// A cache row's 16 bytes, asked for where the call stands: as volatile asm it keeps its place before the
// chunk's (volatile) mma. Plain loads of a chunk's values were sunk by the compiler below its Q.K mma
// and into the softmax, so each chunk waited for two round trips one after the other (NOTES.md).
// READ_ONLY: through the non-coherent path (the fused kernel, whose cache an earlier launch wrote); else
// a streaming load (the megakernel, where this step's own keys come from other blocks of the same launch,
// ordered by the task's wait).
template <bool READ_ONLY>
__device__ __forceinline__ Bf16Vec<8> load_issued(const bf16_t* p) {
  Bf16Vec<8> out;
  if constexpr (READ_ONLY) {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(out.pair[0]), "=r"(out.pair[1]), "=r"(out.pair[2]), "=r"(out.pair[3])
                 : "l"(p));
  } else {
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(out.pair[0]), "=r"(out.pair[1]), "=r"(out.pair[2]), "=r"(out.pair[3])
                 : "l"(p));
  }
  return out;
}

template <int HEAD_DIM>
struct MmaSplitWarp {
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 128, "16 rows of output fragments: head_dim / 2 registers");
  static constexpr int kSteps = HEAD_DIM / 16;       // Q.K k-steps
  static constexpr int kDimLoads = HEAD_DIM / 32;    // 16-byte loads per key (or query) row and lane
  static constexpr int kOutTiles = HEAD_DIM / 8;     // P.V n-tiles
  static constexpr int kValueLoads = HEAD_DIM / 64;  // 16-byte loads per value row and lane (head_dim / 8 dims)
  static constexpr int kChunk = 16;                  // keys per loop step

  // A chunk's keys and values.
  struct KeyRows {
    Bf16Vec<8> k[2][kDimLoads];
  };
  struct ValueRows {
    Bf16Vec<8> v[4][kValueLoads];
  };
  struct ChunkRows {
    KeyRows keys;
    ValueRows values;
  };

  uint32_t qa[kSteps][4];  // the query fragments, kept for the whole split
  int see_from[2], see_to[2];
  float row_max[2], row_sum[2];  // sum: this lane's keys only until finish_sums
  float out[kOutTiles][4];

  // The tile of query rows from first_row (row = token * group + head of the group; `rows` in all) of KV head
  // kv_head: the query fragments of the lane's two rows from q [tokens, heads, HEAD_DIM] as `load` gives 16 bytes
  // (zeros past the last row), and the keys each row sees (to its token's position; a window's worth, if any).
  template <class Load>
  __device__ __forceinline__ void set_rows(int first_row, int rows, int group, int kv_head, int heads, const bf16_t* q,
                                           const int32_t* positions, int window, Load load) {
    const int g = lane_id() / 4, t = lane_id() % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = first_row + g + 8 * r;
      const bool valid = row < rows;
      const int token = valid ? row / group : 0;
      const int head = kv_head * group + (valid ? row % group : 0);
      const bf16_t* q_row = q + (static_cast<size_t>(token) * heads + head) * HEAD_DIM + 8 * t;
#pragma unroll
      for (int c = 0; c < kDimLoads; ++c) {
        const Bf16Vec<8> v = valid ? load(q_row + 32 * c) : Bf16Vec<8>{{0u, 0u, 0u, 0u}};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          qa[2 * c + h][r] = v.pair[2 * h];
          qa[2 * c + h][r + 2] = v.pair[2 * h + 1];
        }
      }
      see_to[r] = valid ? positions[token] : -1;  // an invalid row sees nothing
      see_from[r] = window > 0 ? see_to[r] - window + 1 : 0;
    }
  }

  __device__ __forceinline__ void clear() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) out[j][0] = out[j][1] = out[j][2] = out[j][3] = 0.0f;
  }

  // The chunk from key `chunk`: key rows of keys chunk + 8n + g, value rows of keys 2t, 2t + 1, 2t + 8, 2t + 9
  // of the chunk; row_at(key) is the key's element offset in `keys` and `values`.
  template <bool READ_ONLY, class RowAt>
  static __device__ __forceinline__ void load_keys(KeyRows& rows_of, const bf16_t* keys, RowAt row_at, int chunk) {
    const int g = lane_id() / 4, t = lane_id() % 4;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const bf16_t* key_row = keys + row_at(chunk + 8 * n + g) + 8 * t;
#pragma unroll
      for (int c = 0; c < kDimLoads; ++c) rows_of.k[n][c] = load_issued<READ_ONLY>(key_row + 32 * c);
    }
  }
  template <bool READ_ONLY, class RowAt>
  static __device__ __forceinline__ void load_values(ValueRows& rows_of, const bf16_t* values, RowAt row_at,
                                                     int chunk) {
    const int g = lane_id() / 4, t = lane_id() % 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // keys 2t, 2t + 1, 2t + 8, 2t + 9 of the chunk
      const bf16_t* value_row = values + row_at(chunk + 2 * t + (i & 1) + 8 * (i >> 1)) + g * (HEAD_DIM / 8);
#pragma unroll
      for (int c = 0; c < kValueLoads; ++c) rows_of.v[i][c] = load_issued<READ_ONLY>(value_row + 8 * c);
    }
  }
  template <bool READ_ONLY, class RowAt>
  static __device__ __forceinline__ void load_chunk(ChunkRows& rows_of, const bf16_t* keys, const bf16_t* values,
                                                    RowAt row_at, int chunk) {
    load_keys<READ_ONLY>(rows_of.keys, keys, row_at, chunk);
    load_values<READ_ONLY>(rows_of.values, values, row_at, chunk);
  }

  // score[n][e]: row g + 8 * (e / 2), key chunk + 8n + 2t + e % 2 (S = Q K^T).
  __device__ __forceinline__ void scores(const KeyRows& keys, float (&score)[2][4]) const {
    const auto& k = keys.k;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      score[n][0] = score[n][1] = score[n][2] = score[n][3] = 0.0f;
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        mma_m16n8k16(score[n], qa[s][0], qa[s][1], qa[s][2], qa[s][3], k[n][s / 2].pair[2 * (s % 2)],
                     k[n][s / 2].pair[2 * (s % 2) + 1]);
    }
  }

  // The chunk's scores turned into weights (keys from key_end on masked), the rows' states rescaled to them.
  __device__ __forceinline__ void softmax(float (&score)[2][4], int chunk, int key_end, float scale_log2) {
    const int t = lane_id() % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float chunk_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const int key = chunk + 8 * n + 2 * t + e % 2;
          const bool visible = key < key_end && key >= see_from[r] && key <= see_to[r];
          score[n][e] = visible ? score[n][e] * scale_log2 : -INFINITY;
          chunk_max = fmaxf(chunk_max, score[n][e]);
        }
      chunk_max = fmaxf(chunk_max, shfl_xor(chunk_max, 1));
      chunk_max = fmaxf(chunk_max, shfl_xor(chunk_max, 2));
      const float new_max = fmaxf(row_max[r], chunk_max);
      // Nothing visible yet: no rescale, and every weight 0 (exp2(-inf - -inf) would be NaN).
      const float rescale = new_max == -INFINITY ? 1.0f : exp2f(row_max[r] - new_max);
      row_sum[r] *= rescale;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          score[n][e] = new_max == -INFINITY ? 0.0f : exp2f(score[n][e] - new_max);
          row_sum[r] += score[n][e];
        }
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        out[j][2 * r] *= rescale;
        out[j][2 * r + 1] *= rescale;
      }
      row_max[r] = new_max;
    }
  }

  // O += P V, P (the weights) as one k-step's A fragment in high and low bf16 parts.
  __device__ __forceinline__ void accumulate(const ValueRows& values, const float (&score)[2][4]) {
    const auto& v = values.v;
    uint32_t p_hi[4], p_lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float p0 = score[i / 2][2 * (i % 2)], p1 = score[i / 2][2 * (i % 2) + 1];
      p_hi[i] = bf16_pair(p0, p1);
      p_lo[i] = bf16_pair(p0 - bf16_pair_at(p_hi[i], 0), p1 - bf16_pair_at(p_hi[i], 1));
    }
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) {
      // Column g of n-tile j is dimension g * head_dim / 8 + j: element j of each loaded value run.
      const uint32_t select = j % 2 == 0 ? 0x5410u : 0x7632u;
      const int word = (j % 8) / 2, load = j / 8;
      const uint32_t b0 = __byte_perm(v[0][load].pair[word], v[1][load].pair[word], select);
      const uint32_t b1 = __byte_perm(v[2][load].pair[word], v[3][load].pair[word], select);
      mma_m16n8k16(out[j], p_hi[0], p_hi[1], p_hi[2], p_hi[3], b0, b1);
      mma_m16n8k16(out[j], p_lo[0], p_lo[1], p_lo[2], p_lo[3], b0, b1);
    }
  }

  // The chunk from key `chunk`, both halves in registers, scored and folded in.
  __device__ __forceinline__ void score(const ChunkRows& now, int chunk, int key_end, float scale_log2) {
    float score[2][4];
    scores(now.keys, score);
    softmax(score, chunk, key_end, scale_log2);
    accumulate(now.values, score);
  }

  // Each row's sum over the four lanes t that hold its keys.
  __device__ __forceinline__ void finish_sums() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += shfl_xor(row_sum[r], 1);
      row_sum[r] += shfl_xor(row_sum[r], 2);
    }
  }

  // Row r's factor from out to its normalised output (0 where it saw no key) and its log2-sum-exp2 (after
  // finish_sums): how a split's state leaves the warp.
  __device__ __forceinline__ float row_scale(int r) const { return row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f; }
  __device__ __forceinline__ float row_lse(int r) const {
    return row_sum[r] > 0.0f ? row_max[r] + log2f(row_sum[r]) : -INFINITY;
  }

  // Dimension of out[j][2 r + c] (row g + 8 r): column 2t + c of n-tile j.
  static __device__ __forceinline__ int dim_of(int j, int c) { return (2 * (lane_id() % 4) + c) * (HEAD_DIM / 8) + j; }
};

}  // namespace lithos
#endif  // !LITHOS_HIP
