// The lane ring: each lane of a matvec task copies its own weight chunks into its own slots of a
// shared-memory ring with per-lane asynchronous copies (`cp.async`, no registers held), kRingStages - 1
// steps ahead of its dot products, and reads them back from there. The copies run ahead across the
// task's round boundaries (its epilogues and team reductions) and its first steps are issued before
// the task's wait, so the bandwidth keeps streaming where the register path (warp_rows_dot) has no
// load in flight. A lane reads only what it copied itself: `cp.async.wait_group` orders it, and no
// barrier or mbarrier is needed (a bulk-copy pipeline, since removed, paid for those: NOTES.md).
// The task's activations (and RMSNorm weight) are copied to shared memory after the wait when they fit,
// so a step waits on nothing but its own copy.
//
// CUDA (sm_80 and later) only for now: HIP builds stream weights through registers (the CDNA
// equivalent, buffer loads with LDS as their destination, has no form for 16 bytes a lane before
// gfx950). bf16 rows at T <= 2 (the decode step and the first speculative buckets); packed rows and
// the larger buckets use the register path (at 4-16 tokens on tensor cores, mma_rowdot.h: the ring in
// that layout was slower, NOTES.md run 48).
#pragma once

#include "mk_common.h"
#include "rowdot.h"

// Stages of the ring (0: off). A build may ask for another (LITHOS_KERNEL_DEFINES="LITHOS_MK_LANE_RING=3").
#ifndef LITHOS_MK_LANE_RING
#if defined(LITHOS_HIP)
#define LITHOS_MK_LANE_RING 0
#else
#define LITHOS_MK_LANE_RING 4
#endif
#endif
// Shared memory for a task's staged activations and RMSNorm weight.
#ifndef LITHOS_MK_RING_INPUT_KB
#define LITHOS_MK_RING_INPUT_KB 64
#endif

#if LITHOS_MK_LANE_RING && defined(LITHOS_HIP)
#error "LITHOS_MK_LANE_RING needs per-lane asynchronous copies (CUDA cp.async); HIP builds stream weights through registers"
#endif
#if LITHOS_MK_LANE_RING == 1 || LITHOS_MK_LANE_RING < 0
#error "LITHOS_MK_LANE_RING is the ring's stages: 0 (off) or at least 2"
#endif

namespace lithos {
namespace mk {

constexpr int kRingStages = LITHOS_MK_LANE_RING;
constexpr int kRingInputBytes = LITHOS_MK_RING_INPUT_KB * 1024;
// One step of a block: 16 bytes of each of a warp's rows, for every lane.
constexpr int kRingStageBytes = kRowsPerWarp * 16 * kMatvecThreads;

// Whether the TMAX-token kernel's bf16 matvecs read their weights through the ring, and the dynamic
// shared memory that takes (the staged inputs, then the stages); none in a build without bf16 weights.
template <int TMAX>
constexpr bool kRingFor = kRingStages > 0 && TMAX <= 2 &&
                          (kAttentionFormat == WeightFormat::kBf16 || kMlpFormat == WeightFormat::kBf16 ||
                           kHeadFormat == WeightFormat::kBf16);
template <int TMAX>
constexpr int kRingSmemBytes = kRingFor<TMAX> ? kRingInputBytes + kRingStages * kRingStageBytes : 0;

#if LITHOS_MK_LANE_RING

__device__ __forceinline__ unsigned char* ring_memory() {
  extern __shared__ __align__(128) unsigned char lane_ring_memory[];
  return lane_ring_memory;
}

// This thread's slot for row r in ring stage `stage`: a warp's 32 slots are 512 contiguous bytes.
__device__ __forceinline__ uint4* ring_slot(int stage, int r) {
  return reinterpret_cast<uint4*>(ring_memory() + kRingInputBytes) + (stage * kRowsPerWarp + r) * kMatvecThreads +
         threadIdx.x;
}

// An L2 policy for data read once (the weights): evicted first, as the register path's streaming loads.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// 16 bytes from global to shared memory, asynchronously; past L1 (coherent at L2: activations other
// blocks wrote in this launch are read right once the task's wait has ordered them).
__device__ __forceinline__ void async_copy16(void* to, const void* from, uint64_t policy) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(address), "l"(from), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void async_copy16(void* to, const void* from) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(from) : "memory");
}
// Closes this thread's copies issued since the last commit into one group (possibly empty).
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's groups are in flight: the older ones have landed and are
// visible to this thread.
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// After the task's wait: copy its activations (and RMSNorm weight) into shared memory when they fit;
// returns where to read them. Every thread calls it; one memory round trip, then a barrier (the block
// reads what every thread copied). It waits for this thread's earlier groups too: the ring's first
// steps, issued before the wait.
__device__ inline TokenRows ring_stage_inputs(const TokenRows& in) {
  const int x_elements = in.tokens * in.n_in, norm_elements = in.norm_w != nullptr ? in.n_in : 0;
  const int elements = x_elements + norm_elements;
  if (elements * 2 > kRingInputBytes) return in;
  bf16_t* staged = reinterpret_cast<bf16_t*>(ring_memory());
  for (int i = static_cast<int>(threadIdx.x) * 8; i < elements; i += kMatvecThreads * 8)
    async_copy16(staged + i, i < x_elements ? in.x + i : in.norm_w + (i - x_elements));
  async_commit();
  async_wait<0>();
  __syncthreads();
  return TokenRows{staged, norm_elements > 0 ? staged + x_elements : nullptr, in.tokens, in.n_in};
}

// Lets this thread's copies in flight land before its block leaves an aborted step.
__device__ __forceinline__ void ring_drain() { async_wait<0>(); }

// One warp's weight stream over a task: the chunks of its row group in each round (groups base + slot
// for base = first, first + slots, ...), 16 bytes of each of the 4 rows per step, at input element
// k0 + s * step of step s. `issue()` copies the next step into the ring and closes a group (an empty
// one past the task's end, so that every step's wait counts the same); `rows_of(unit, rows)` is the
// task's row map (mk_weight_rows.h).
template <class RowsOf>
struct RingStream {
  RowsOf rows_of;
  int end, slots, slot;      // the task's row groups end; teams per round; this warp's team
  int k0, step, steps, n_in;  // this lane's first input element; stride; steps per round; input size
  int base = 0, s = 0, stage = 0;  // the next step to issue: its round, its step, its ring stage
  uint64_t policy = 0;
  const bf16_t* rows[kRowsPerWarp];

  __device__ __forceinline__ void start(int first) {
    policy = evict_first_policy();
    base = first;
    s = 0;
    stage = 0;
    if (base < end) set_rows();
  }
  __device__ __forceinline__ void set_rows() {
    PackedRow packed[kRowsPerWarp];
    rows_of(min(base + slot, end - 1), packed);  // a surplus warp redoes the last group, as the loop does
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = reinterpret_cast<const bf16_t*>(packed[r].data);
  }
  __device__ __forceinline__ void issue() {
    if (base < end) {
      const int k = k0 + s * step;
      if (k < n_in) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) async_copy16(ring_slot(stage, r), rows[r] + k, policy);
      }
      if (++s == steps) {
        s = 0;
        base += slots;
        if (base < end) set_rows();
      }
    }
    async_commit();
    stage = stage + 1 == kRingStages ? 0 : stage + 1;
  }
};

// acc[r][t] = the dot product of the warp's 4 rows with token t over its share of the input, reading
// one round's steps from the ring (the read stage starts at `stage` and advances) and issuing one step
// ahead per step read. As warp_rows_dot: every lane ends with every sum.
template <int TMAX, class Stream>
__device__ __forceinline__ void ring_rows_dot(Stream& stream, int& stage, const TokenRows& in,
                                              float (&acc)[kRowsPerWarp][TMAX]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t) acc[r][t] = 0.0f;
  for (int s = 0; s < stream.steps; ++s) {
    async_wait<kRingStages - 2>();  // this step's group has landed
    Bf16Vec<8> w[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const uint4 v = *ring_slot(stage, r);
      w[r].pair[0] = v.x;
      w[r].pair[1] = v.y;
      w[r].pair[2] = v.z;
      w[r].pair[3] = v.w;
    }
    stage = stage + 1 == kRingStages ? 0 : stage + 1;
    stream.issue();  // into the stage read one step ago: its values are in registers and used
    const int k = stream.k0 + s * stream.step;
    if (k < in.n_in) add_chunk<TMAX, 8, true, true>(w, in, k, acc);
  }
  warp_sum_rows(acc, in.tokens);
}

#else

__device__ __forceinline__ void ring_drain() {}

#endif  // LITHOS_MK_LANE_RING

}  // namespace mk
}  // namespace lithos
