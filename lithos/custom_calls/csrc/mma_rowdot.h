// The tensor-core twin of warp_rows_dot (rowdot.h) for 4-16 query positions (the speculative
// verification buckets): the same row group of kRowsPerWarp rows, the same share of the inputs, the same
// result in every lane, but the products go through m16n8k16 bf16 mma instead of T FP32 FMAs per weight
// and lane, which made the 8- and 16-token matvecs issue-bound (NOTES.md, "tensor cores for the
// verification buckets").
//
// Layout, per 64-input step of the warp. Lane (g, t) = (lane / 4, lane % 4).
// - B (16 inputs x 8 columns): column n is row n % 4 of the group over the step's half n / 4 (inputs
//   0-31 or 32-63). Lane (g, t) loads the 8 weights at half * 32 + 8t of row g % 4 and feeds them to two
//   mma, 4 each: the mma's k index is permuted within the lane (k = 2t, 2t+1, 2t+8, 2t+9 are the loaded
//   elements 4j..4j+3 of mma j), which the sum does not see as long as A uses the same permutation.
// - A (16 M-rows x 16 inputs): M-row m is token m % 8 (of the token group) over half m / 8. Lane (g, t)
//   holds M-rows g and g + 8: its token's 8 inputs at 8t of both halves, in the same order.
// - D[m][n] pairs half m / 8 of the inputs with half n / 4 of the weights: where they agree it is a
//   partial dot product, elsewhere it is discarded. Lane (g, t) holds D[g][2t..2t+1] (half 0: used
//   when t < 2) and D[g + 8][2t..2t+1] (half 1: used when t >= 2): one shuffle adds the halves, and
//   shuffles hand every lane every sum.
// Half the products are discarded: the mma is cheap enough that the layout that keeps the register
// path's loads (16 bytes a lane, 4 lanes a 64-byte run of a row) is worth more than the arithmetic.
//
// With an RMSNorm weight, x * norm_w is split into a bf16 high and low part, each through the mma: the
// products keep about 16 bits of it (the FMA path keeps 24; one bf16 rounding would keep 8).
// CUDA (sm_80 and later) only: HIP builds keep the FMA path (kMmaRowDot).
#pragma once

#include "rowdot.h"

namespace lithos {

// Whether the TMAX-token bf16 matvecs take this path.
template <int TMAX>
#if defined(LITHOS_HIP)
constexpr bool kMmaRowDot = false;
#else
constexpr bool kMmaRowDot = TMAX >= 4;
#endif

// 256-input chunks loaded at once: 8 weight loads of 16 bytes a lane in flight, as the FMA path's 2
// chunks x 4 rows; one chunk at 16 tokens, whose activations take twice the registers.
template <int TMAX>
constexpr int kMmaChunks = TMAX <= 8 ? 2 : 1;

// Accumulators per token group: a step's mma go round-robin to LITHOS_MMA_ACCUMULATORS of them, added
// before the hand-out, so a round's chain of dependent mma is that much shorter. 4 (the default) made
// the 8B verification round 4.7% faster on the megakernel (NOTES.md, run 51a) and 2.0% on the fused
// kernels (run 57); 1 and 2 stay for comparisons (LITHOS_KERNEL_DEFINES="LITHOS_MMA_ACCUMULATORS=1").
#ifndef LITHOS_MMA_ACCUMULATORS
#define LITHOS_MMA_ACCUMULATORS 4
#endif
#if LITHOS_MMA_ACCUMULATORS != 1 && LITHOS_MMA_ACCUMULATORS != 2 && LITHOS_MMA_ACCUMULATORS != 4
#error "LITHOS_MMA_ACCUMULATORS is 1, 2 or 4 (accumulators per token group)"
#endif
constexpr int kMmaAccumulators = LITHOS_MMA_ACCUMULATORS;

#if !defined(LITHOS_HIP)

// d += a * b: one m16n8k16 bf16 mma, f32 accumulators.
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair, rounded to nearest even (lo in the low half: the lower address).
__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

// x (8 bf16) times the norm weight nw (8 bf16) as bf16 high and low parts: high = x * nw rounded once, low
// = x * nw - high rounded once. A bf16 product is exact in f32 and so is its difference from its
// rounding, so Hopper's bf16x2 arithmetic (mul.rn, then fma.rn with an exact intermediate: 3
// instructions a pair) and the f32 route older GPUs take (about 12) give the same bits. Rounding once
// and skipping the low part would save an mma but keep 8 bits instead of 16 (NOTES.md, run 48).
__device__ __forceinline__ void scaled_parts(const Bf16Vec<8>& x, const Bf16Vec<8>& nw, Bf16Vec<8>& hi,
                                             Bf16Vec<8>& lo) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
#if __CUDA_ARCH__ >= 900
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(hi.pair[p]) : "r"(x.pair[p]), "r"(nw.pair[p]));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;"
        : "=r"(lo.pair[p])
        : "r"(x.pair[p]), "r"(nw.pair[p]), "r"(hi.pair[p] ^ 0x80008000u));
#else
    const float v0 = x[2 * p] * nw[2 * p], v1 = x[2 * p + 1] * nw[2 * p + 1];
    hi.pair[p] = bf16_pair(v0, v1);
    lo.pair[p] = bf16_pair(v0 - bf16_pair_at(hi.pair[p], 0), v1 - bf16_pair_at(hi.pair[p], 1));
#endif
  }
}

// The two mma of one 64-input step for one token group: w this lane's 8 weights, x0 / x1 its token's
// inputs over the step's two halves; mma j adds into accumulator (first + j) % kMmaAccumulators.
__device__ __forceinline__ void mma_step(float (&d)[kMmaAccumulators][4], int first, const Bf16Vec<8>& w,
                                         const Bf16Vec<8>& x0, const Bf16Vec<8>& x1) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
    mma_m16n8k16(d[(first + j) % kMmaAccumulators], x0.pair[2 * j], x1.pair[2 * j], x0.pair[2 * j + 1],
                 x1.pair[2 * j + 1], w.pair[2 * j], w.pair[2 * j + 1]);
}

// This lane's weights within a 64-input step: row (lane / 4) % 4, over half lane / 16, at 8 (lane % 4).
__device__ __forceinline__ int mma_weight_offset() { return (lane_id() / 16) * 32 + 8 * (lane_id() % 4); }

// The four mma of one 64-input step for one token group with an RMSNorm weight: nw0 / nw1 its values
// over the step's two halves (scaled_parts); the high parts' mma go to accumulators 0 and 1, the low
// parts' to 2 and 3 (modulo kMmaAccumulators).
__device__ __forceinline__ void mma_step_normed(float (&d)[kMmaAccumulators][4], const Bf16Vec<8>& w,
                                                const Bf16Vec<8>& x0, const Bf16Vec<8>& x1,
                                                const Bf16Vec<8>& nw0, const Bf16Vec<8>& nw1) {
  Bf16Vec<8> hi0, lo0, hi1, lo1;
  scaled_parts(x0, nw0, hi0, lo0);
  scaled_parts(x1, nw1, hi1, lo1);
  mma_step(d, 0, w, hi0, hi1);
  mma_step(d, 2, w, lo0, lo1);
}

// Every accumulator of every token group at zero.
template <int GROUPS>
__device__ __forceinline__ void zero_accumulators(float (&d)[GROUPS][kMmaAccumulators][4]) {
#pragma unroll
  for (int q = 0; q < GROUPS; ++q)
#pragma unroll
    for (int a = 0; a < kMmaAccumulators; ++a) d[q][a][0] = d[q][a][1] = d[q][a][2] = d[q][a][3] = 0.0f;
}

// sum[q][e] = the total of token group q's accumulators' entry e.
template <int GROUPS>
__device__ __forceinline__ void add_accumulators(const float (&d)[GROUPS][kMmaAccumulators][4],
                                                 float (&sum)[GROUPS][4]) {
#pragma unroll
  for (int q = 0; q < GROUPS; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sum[q][e] = d[q][0][e];
#pragma unroll
      for (int a = 1; a < kMmaAccumulators; ++a) sum[q][e] += d[q][a][e];
    }
}

// The warp's sums from its accumulators d[token group]: lane (g, t) holds token g's sums of rows
// 2(t % 2), 2(t % 2) + 1 over half t / 2 (D's used entries); add the halves, then hand out: row r,
// token q * 8 + gg is at lane 4 gg + r / 2, entry r % 2. Every lane ends with every acc[r][t].
template <int TMAX, int GROUPS>
__device__ __forceinline__ void mma_hand_out(const float (&d)[GROUPS][4], float (&acc)[kRowsPerWarp][TMAX]) {
  const int t = lane_id() % 4;
  float sums[GROUPS][2];
#pragma unroll
  for (int q = 0; q < GROUPS; ++q)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      sums[q][e] = t < 2 ? d[q][e] : d[q][2 + e];
      sums[q][e] += shfl_xor(sums[q][e], 2);
    }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr)
#pragma unroll
    for (int token = 0; token < TMAX; ++token)
      acc[rr][token] = __shfl_sync(0xffffffffu, sums[token / 8][rr % 2], 4 * (token % 8) + rr / 2);
}

// The row of the group this lane's weights come from, (lane / 4) % 4: a select, since an array of
// pointers indexed by a lane-dependent value would go to local memory.
__device__ __forceinline__ const bf16_t* mma_lane_row(const bf16_t* const (&rows)[kRowsPerWarp]) {
  const int r = (lane_id() / 4) % kRowsPerWarp;
  return r == 0 ? rows[0] : r == 1 ? rows[1] : r == 2 ? rows[2] : rows[3];
}

// This lane's inputs for the 64-input step at input `at`: x[q][h], its token of group q over half h
// (zero past the inputs or the tokens).
template <int GROUPS, bool COHERENT>
__device__ __forceinline__ void mma_step_inputs(Bf16Vec<8> (&x)[GROUPS][2], const TokenRows& in, int at) {
  const int g = lane_id() / 4, t = lane_id() % 4;
#pragma unroll
  for (int q = 0; q < GROUPS; ++q)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = at + h * 32 + 8 * t, token = q * 8 + g;
      x[q][h] = k < in.n_in && token < in.tokens
                    ? load_activation<8, COHERENT>(in.x + static_cast<size_t>(token) * in.n_in + k)
                    : Bf16Vec<8>{};
    }
}

// The RMSNorm weights over the two halves of the 64-input step at `at`, for this lane's inputs. STAGED:
// in.norm_w may be a copy in shared memory (generic loads), else it is read-only global memory.
template <bool STAGED>
__device__ __forceinline__ void mma_step_norm(Bf16Vec<8>& nw0, Bf16Vec<8>& nw1, const TokenRows& in, int at) {
  const int k = at + 8 * (lane_id() % 4);
  auto load = [&](int i) {
    if (i >= in.n_in) return Bf16Vec<8>{};
    if constexpr (STAGED) return load_activation<8, true>(in.norm_w + i);
    else return load_cached<8>(in.norm_w + i);
  };
  nw0 = load(k);
  nw1 = load(k + 32);
}

// acc[r][t] = sum over this warp's share of i of rows[r][i] * x[t, i] * norm_w[i], as warp_rows_dot<TMAX,
// 8, COHERENT> computes it: the share is the 256-input chunks part, part + parts, ...; CHUNKS of them are
// loaded at once. Every lane ends with every sum (zero for t >= in.tokens). Rows and x rows are
// 16-byte aligned and n_in a multiple of 8 (the VEC = 8 condition).
template <int TMAX, bool COHERENT, int CHUNKS>
__device__ __forceinline__ void mma_rows_dot(const bf16_t* const (&rows)[kRowsPerWarp], const TokenRows& in,
                                             int part, int parts, float (&acc)[kRowsPerWarp][TMAX]) {
  static_assert(kRowsPerWarp == 4 && WARP_SIZE == 32, "the fragment layout is 4 rows x 2 halves, 32 lanes");
  constexpr int kGroups = (TMAX + 7) / 8;      // token groups of 8: the mma's M side
  constexpr int kSteps = WARP_SIZE * 8 / 64;   // 64-input steps per 256-input chunk
  const bf16_t* row = mma_lane_row(rows);
  const int w_at = mma_weight_offset();
  const int chunk = WARP_SIZE * 8, stride = parts * chunk;
  float d[kGroups][kMmaAccumulators][4];
  zero_accumulators(d);

  for (int base = part * chunk; base < in.n_in; base += stride * CHUNKS) {
    // Every load of the round first, weights then activations: the weights are what we wait on.
    Bf16Vec<8> w[CHUNKS][kSteps], x[CHUNKS][kSteps][kGroups][2];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int k = base + c * stride + s * 64 + w_at;
        w[c][s] = k < in.n_in ? load_streaming<8>(row + k) : Bf16Vec<8>{};
      }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) mma_step_inputs<kGroups, COHERENT>(x[c][s], in, base + c * stride + s * 64);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        if (in.norm_w == nullptr) {
          const int first = 2 * ((c * kSteps + s) % 2);  // steps alternate between pairs when there are 4
#pragma unroll
          for (int q = 0; q < kGroups; ++q) mma_step(d[q], first, w[c][s], x[c][s][q][0], x[c][s][q][1]);
        } else {
          Bf16Vec<8> nw0, nw1;
          mma_step_norm<false>(nw0, nw1, in, base + c * stride + s * 64);
#pragma unroll
          for (int q = 0; q < kGroups; ++q) mma_step_normed(d[q], w[c][s], x[c][s][q][0], x[c][s][q][1], nw0, nw1);
        }
      }
  }

  float sum[kGroups][4];
  add_accumulators(d, sum);
  mma_hand_out(sum, acc);
}

// The wide layout of the fused row-group kernels: 16 rows a warp (four row groups), the weights as the
// mma's A side and the tokens as its N side, so no product is discarded. Per 32-input span, lane (g, t)
// loads the 8 weights at 8t of rows g and g + 8 and the 8 inputs at 8t of token g of each token group;
// mma j takes the loaded elements 4j..4j+3 as its k = 2t, 2t+1, 2t+8, 2t+9 on both sides (mma_step with
// the roles swapped: its "x0 / x1" are the two rows, its "w" the token's inputs). Per weight byte that is
// a quarter of the 4-row layout's activation loads and half its mma, and a lane holds a quarter of the
// activation registers, which at 8 tokens kept that layout at one block per SM (NOTES.md, eighth session).
// D[row][token]: lane (g, t) ends with rows g (entries 0, 1) and g + 8 (2, 3), tokens 2t and 2t + 1 of
// each token group.

// The 16 rows' span of 32 inputs at `at` for one token group's inputs x (this lane's 8): with an RMSNorm
// weight nw, x * nw goes through as its high and low parts (scaled_parts).
template <bool NORMED>
__device__ __forceinline__ void mma_wide_span(float (&d)[kMmaAccumulators][4], const Bf16Vec<8>& row_g,
                                              const Bf16Vec<8>& row_g8, const Bf16Vec<8>& x, const Bf16Vec<8>& nw) {
  if constexpr (NORMED) {
    Bf16Vec<8> hi, lo;
    scaled_parts(x, nw, hi, lo);
    mma_step(d, 0, hi, row_g, row_g8);
    mma_step(d, 2, lo, row_g, row_g8);
  } else {
    mma_step(d, 0, x, row_g, row_g8);
  }
}

// Inputs per round of the wide layout: 4 spans, so a lane has 8 weight loads of 16 bytes in flight (as
// the 4-row layout's 2 chunks x 4 steps).
constexpr int kWideChunk = 128;

// d[q] = this warp's share of the 16 rows' dot products with token group q (layout above), before the
// hand-out; the share is the 128-input chunks part, part + parts, ... `row_g` / `row_g8` are this lane's
// rows g and g + 8. Rows and x rows are 16-byte aligned and n_in a multiple of 8. COHERENT: x was written
// earlier in the same launch (the megakernel's; load_activation).
template <int TMAX, bool COHERENT = false>
__device__ __forceinline__ void mma_wide_rows_dot(const bf16_t* row_g, const bf16_t* row_g8, const TokenRows& in,
                                                  int part, int parts, float (&sum)[(TMAX + 7) / 8][4]) {
  constexpr int kGroups = (TMAX + 7) / 8;
  constexpr int kSpans = kWideChunk / 32;
  const int g = lane_id() / 4, at = 8 * (lane_id() % 4);
  float d[kGroups][kMmaAccumulators][4];
  zero_accumulators(d);

  for (int base = part * kWideChunk; base < in.n_in; base += parts * kWideChunk) {
    // Every weight load of the round first: the weights are what we wait on.
    Bf16Vec<8> wg[kSpans], wg8[kSpans], x[kSpans][kGroups], nw[kSpans];
#pragma unroll
    for (int s = 0; s < kSpans; ++s) {
      const int k = base + s * 32 + at;
      wg[s] = k < in.n_in ? load_streaming<8>(row_g + k) : Bf16Vec<8>{};
      wg8[s] = k < in.n_in ? load_streaming<8>(row_g8 + k) : Bf16Vec<8>{};
    }
#pragma unroll
    for (int s = 0; s < kSpans; ++s) {
      const int k = base + s * 32 + at;
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        const int token = q * 8 + g;
        x[s][q] = k < in.n_in && token < in.tokens
                      ? load_activation<8, COHERENT>(in.x + static_cast<size_t>(token) * in.n_in + k)
                      : Bf16Vec<8>{};
      }
      if (in.norm_w != nullptr) nw[s] = k < in.n_in ? load_cached<8>(in.norm_w + k) : Bf16Vec<8>{};
    }
#pragma unroll
    for (int s = 0; s < kSpans; ++s)
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        if (in.norm_w != nullptr) mma_wide_span<true>(d[q], wg[s], wg8[s], x[s][q], nw[s]);
        else mma_wide_span<false>(d[q], wg[s], wg8[s], x[s][q], nw[s]);
      }
  }
  add_accumulators(d, sum);
}

// Row group `sub` (rows 4 sub .. 4 sub + 3) of the wide layout's sums, in every lane: row r's sums are in
// lane 4 (r % 8) + token % 8 / 2, entry 2 (r / 8) + token % 2 of token group token / 8. Called from an
// unrolled loop, so `sub` is a constant and the entries stay in registers.
template <int TMAX>
__device__ __forceinline__ void mma_wide_hand_out(const float (&sum)[(TMAX + 7) / 8][4], int sub,
                                                  float (&acc)[kRowsPerWarp][TMAX]) {
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int r = sub * kRowsPerWarp + rr;
#pragma unroll
    for (int token = 0; token < TMAX; ++token)
      acc[rr][token] = __shfl_sync(0xffffffffu, sum[token / 8][2 * (r / 8) + token % 2], 4 * (r % 8) + token % 8 / 2);
  }
}

#endif  // !LITHOS_HIP

}  // namespace lithos
