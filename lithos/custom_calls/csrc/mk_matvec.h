// The megakernel's matvec tasks' common loop (Q/K/V, O, gate/up, down, LM head): wait for the task's
// input, then the dot products of its row groups, then each group's epilogue.
#pragma once

#include "mk_common.h"
#include "mk_lane_ring.h"
#include "mma_rowdot.h"
#include "rowdot.h"

namespace lithos {
namespace mk {

// 16-byte chunks per row a lane loads at once in the megakernel's matvecs: 2, half of what the fused
// kernels use at T <= 2. Loads in flight beyond what the bandwidth needs only queue, and every memory
// round trip on the step's critical path (hand-offs, attention, epilogues) waits behind them:
// measured on the H200, 2 is 5-7% faster per step than 4 (NOTES.md). A build may ask for another
// (LITHOS_KERNEL_DEFINES="LITHOS_MK_UNROLL=1").
#ifndef LITHOS_MK_UNROLL
#define LITHOS_MK_UNROLL 2
#endif
template <int TMAX>
constexpr int kMkUnroll = LITHOS_MK_UNROLL;

// Steps of packed loads in flight per row and lane: at most 2 (16 bytes of a 4-bit row, 32 of an
// 8-bit one), where the fused kernels keep 4 of a 4-bit row. Measured on the H200 with MXFP4 layers:
// 2 steps are 7.7% (1B) and 2.2% (8B) faster per step than 4, and 8 spill (NOTES.md). A build may ask
// for another (LITHOS_KERNEL_DEFINES="LITHOS_MK_PACKED_UNROLL=1").
template <WeightFormat F>
#ifdef LITHOS_MK_PACKED_UNROLL
constexpr int kMkPackedUnroll = LITHOS_MK_PACKED_UNROLL;
#else
constexpr int kMkPackedUnroll = Packed<F>::kUnroll < 2 ? Packed<F>::kUnroll : 2;
#endif

// The matvec tasks' common part: wait for the task's input, then run `epilogue(unit, acc)` for every
// row group `unit` in [first, first + count), acc[r][t] the full dot product of rows_of(unit)[r] (rows
// stored in format F) with token t (activations read coherently: other blocks wrote them in this
// launch). Every thread of the block calls it.
//
// The block's warps take the groups in rounds; k_split consecutive warps (a team) share a group, each
// reading an interleaved share of the input. Warps never meet at a block barrier inside the loop:
// one that waits there drains its loads while the slowest warp finishes, and the block streams in
// bursts. A team adds its partial sums through shared memory instead; the member that arrives last
// reduces them and runs the epilogue. Partials and arrival counters are double-buffered by round
// parity, and a member about to write round n's buffer first waits until round n - 2 is reduced
// (rare: a team's warps stream alike), so a counter never mixes two rounds' arrivals.
// `before_epilogue(in)` runs once, by the whole block, after the first dot products (the RMSNorm
// factor: its pass over the inputs then hits L1, or reads their staged copy).
//
// bf16 rows in the 1- and 2-token kernels and MXFP4, Q4_K, Q6_K and K_MIX rows in the 1-token kernel come through
// the lane ring (mk_lane_ring.h: each lane's chunks copied into shared memory steps ahead, the task's first steps
// before its wait) and the inputs from a shared-memory copy when they fit; otherwise the warps stream
// the rows through registers, and in the 4- to 16-token kernels (CUDA) multiply them on tensor cores
// (mma_rowdot.h).
template <WeightFormat F, int TMAX, class RowsOf, class BeforeEpilogue, class Epilogue>
__device__ bool stream_row_groups(const Args& a, const Task& task, int index,
                                  const TokenRows& task_in, RowsOf rows_of, BeforeEpilogue before_epilogue,
                                  Epilogue epilogue) {
  __shared__ float partial[2][kMatvecWarps][kRowsPerWarp][TMAX];
  __shared__ int arrivals[2][kMatvecWarps];  // per parity and team: members that wrote a partial
  __shared__ int reduced[kMatvecWarps];      // per team: rounds reduced
  const int k_split = task.k_split, slots = kMatvecWarps / k_split;
  const int slot = warp_id() / k_split, part = warp_id() % k_split;
  const int end = task.first + task.count;
  if (threadIdx.x < kMatvecWarps) arrivals[0][threadIdx.x] = arrivals[1][threadIdx.x] = reduced[threadIdx.x] = 0;
  __syncthreads();  // the counters are zero (and the last task's staged inputs read) before anyone writes
#if LITHOS_MK_LANE_RING
  constexpr bool kRing = kRingFormat<F, TMAX>;
  constexpr int kLaneElements = RingChunk<kRing ? F : WeightFormat::kBf16>::kElements;
  const int step = k_split * WARP_SIZE * kLaneElements;
  RingStream<kRing ? F : WeightFormat::kBf16, RowsOf> stream{
      rows_of, end, slots, slot, (part * WARP_SIZE + lane_id()) * kLaneElements, step,
      (task_in.n_in + step - 1) / step, task_in.n_in};
  int read_stage = 0;
  if constexpr (kRing) {  // the task's first steps: the weights do not depend on the step's data
    stream.start(task.first);
    for (int i = 0; i < kRingStages - 1; ++i) stream.issue();
  }
#else
  constexpr bool kRing = false;
#endif
  if (!block_wait(a, task, index)) {
    ring_drain();
    return false;
  }
#if LITHOS_MK_LANE_RING
  // Packed rows at one token stage x * norm_w as floats (formed once, not once per row group); bf16 rows, and
  // packed rows too long for that, stage x and norm_w as they are.
  const float* products = nullptr;
  if constexpr (kRing && F != WeightFormat::kBf16) products = ring_stage_products(task_in);
  const TokenRows in = kRing && products == nullptr ? ring_stage_inputs(task_in) : task_in;
#else
  const TokenRows& in = task_in;
#endif
  trace_phase(a, index, 0);

  bool first_round = true;
  // The loop bound is block-uniform: before_epilogue's barriers need every warp in the first round.
  for (int base = task.first, round = 0; base < end; base += slots, ++round) {
    const int unit = min(base + slot, end - 1);  // a surplus warp redoes the last group, unused
    float acc[kRowsPerWarp][TMAX];
    PackedRow rows[kRowsPerWarp];
    if constexpr (!kRing || F != WeightFormat::kBf16) rows_of(unit, rows);
#if LITHOS_MK_LANE_RING
    if constexpr (kRing && F != WeightFormat::kBf16) {
      ring_rows_dot_packed<F>(stream, read_stage, rows, in, products, acc);
    } else if constexpr (kRing) {
      ring_rows_dot<TMAX>(stream, read_stage, in, acc);
    } else
#endif
    if constexpr (F == WeightFormat::kBf16) {
      const bf16_t* bf16_rows[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) bf16_rows[r] = reinterpret_cast<const bf16_t*>(rows[r].data);
#if !defined(LITHOS_HIP)
      if constexpr (kMmaRowDot<TMAX>)
        mma_rows_dot<TMAX, true, kMmaChunks<TMAX>>(bf16_rows, in, part, k_split, acc);
      else
#endif
        warp_rows_dot<TMAX, 8, true, kMkUnroll<TMAX>>(bf16_rows, in, part, k_split, acc);
    } else {
      // Packed rows are decoded in registers (packed_decode.h).
      packed_rows_dot<F, TMAX, true, kMkPackedUnroll<F>>(rows, in, part, k_split, acc);
    }
    trace_phase(a, index, 1);  // each round's overwrites the last: the task's last dot products
    bool mine = part == 0;  // the member that runs the epilogue
    if (k_split > 1) {
      float(&buffer)[kMatvecWarps][kRowsPerWarp][TMAX] = partial[round & 1];
      int order = 0;
      if (lane_id() == 0) {
        while (*static_cast<volatile int*>(&reduced[slot]) < round - 1) {
        }
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
          for (int t = 0; t < TMAX; ++t) buffer[warp_id()][r][t] = acc[r][t];
        __threadfence_block();
        order = atomicAdd(&arrivals[round & 1][slot], 1);
      }
      mine = shfl_from(order, 0) == (round / 2 + 1) * k_split - 1;  // the last of this round's team
      if (mine) {
        __threadfence_block();
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
          for (int t = 0; t < TMAX; ++t) {
            float sum = 0.0f;
            for (int p = 0; p < k_split; ++p) sum += static_cast<volatile float*>(&buffer[slot * k_split + p][r][0])[t];
            acc[r][t] = sum;
          }
        __threadfence_block();  // the reads are done before the buffer is released
        if (lane_id() == 0) *static_cast<volatile int*>(&reduced[slot]) = round + 1;
      }
    }
    if (first_round) {
      before_epilogue(in);
      first_round = false;
    }
    if (base + slot < end && mine) epilogue(unit, acc);
  }
  trace_phase(a, index, 2);
  return true;
}

// The LM head of the 4- to 16-token kernels in the fused kernels' 16-row layout (mma_wide_rows_dot), where its
// tasks take whole row groups a warp (NOTES.md, "The LM head of the 4-16-token kernels in the 16-row layout": the 8B
// MXFP4 k = 7 round 4.4% faster on an H100, run 137). Tensor-core builds only: HIP keeps the 4-row FMA path.
template <WeightFormat F, int TMAX>
constexpr bool kMkWideHead = F == WeightFormat::kBf16 && kMmaRowDot<TMAX>;

#if !defined(LITHOS_HIP)
// stream_row_groups for bf16 rows on tensor cores, a task whose warps each take whole row groups (k_split 1), in
// the 16-row layout: each warp four consecutive groups a round, `epilogue(unit, acc)` for each. The loop bound is
// block-uniform (before_epilogue's barriers); a warp past the task's end redoes its last group, unused.
template <int TMAX, class RowsOf, class BeforeEpilogue, class Epilogue>
__device__ bool stream_wide_row_groups(const Args& a, const Task& task, int index, const TokenRows& in,
                                       RowsOf rows_of, BeforeEpilogue before_epilogue, Epilogue epilogue) {
  const int end = task.first + task.count;
  const int g = lane_id() / 4;  // this lane's rows g and g + 8 of the 16: row g % 4 of groups g / 4 and 2 + g / 4
  __syncthreads();  // the last task's staged inputs read before anyone writes shared memory
  if (!block_wait(a, task, index)) return false;
  trace_phase(a, index, 0);
  bool first_round = true;
  for (int base = task.first; base < end; base += 4 * kMatvecWarps) {
    const int item = base + 4 * warp_id();
    const bf16_t* lane_rows[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      PackedRow rows[kRowsPerWarp];
      rows_of(min(item + 2 * half + g / 4, end - 1), rows);
      const bf16_t* bf16_rows[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) bf16_rows[r] = reinterpret_cast<const bf16_t*>(rows[r].data);
      lane_rows[half] = mma_lane_row(bf16_rows);
    }
    float sum[(TMAX + 7) / 8][4];
    mma_wide_rows_dot<TMAX, true>(lane_rows[0], lane_rows[1], in, 0, 1, sum);
    trace_phase(a, index, 1);
    if (first_round) {
      before_epilogue(in);
      first_round = false;
    }
#pragma unroll
    for (int sub = 0; sub < 4; ++sub) {
      if (item + sub >= end) break;  // warp-uniform: the hand-out's shuffles take every lane
      float acc[kRowsPerWarp][TMAX];
      mma_wide_hand_out<TMAX>(sum, sub, acc);
      epilogue(item + sub, acc);
    }
  }
  trace_phase(a, index, 2);
  return true;
}
#endif

}  // namespace mk
}  // namespace lithos
