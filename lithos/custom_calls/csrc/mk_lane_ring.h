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
// gfx950). bf16 rows at T <= 2 (the decode step and the first speculative buckets), and at T = 1 the packed
// formats whose 16 bytes a lane are 32 codes and whose scales a step can copy beside them (its "side"): MXFP4
// (an MX block; the aligned word holding its E8M0 scale), Q4_K (a sub-block; its super-block's 16-byte record),
// Q5_K (a sub-block's low nibbles; their high bits and the record's words that scale them) and the 6-bit formats
// Q6_K and K_MIX (the codes' low nibbles; their 8 bytes of high bits and the aligned words of the record that scale
// them), IQ4_NL and IQ4_XS (a block; the word of its f16 d, or the super-block's 8-byte record); K_MIX, Q5_K and the
// IQ4 formats where a build asks, below. The other packed formats and the larger buckets use the register
// path (at 4-16 tokens on tensor cores, mma_rowdot.h: the ring in that layout was slower, NOTES.md run 48).
#pragma once

#include <algorithm>

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

#if LITHOS_MK_LANE_RING && defined(LITHOS_HIP)
#error "LITHOS_MK_LANE_RING needs per-lane asynchronous copies (CUDA cp.async); HIP builds stream weights through registers"
#endif
#if LITHOS_MK_LANE_RING == 1 || LITHOS_MK_LANE_RING < 0
#error "LITHOS_MK_LANE_RING is the ring's stages: 0 (off) or at least 2"
#endif

namespace lithos {
namespace mk {

constexpr int kRingStages = LITHOS_MK_LANE_RING;
// One step of a block: 16 bytes of each of a warp's rows, for every lane.
constexpr int kRingStageBytes = kRowsPerWarp * 16 * kMatvecThreads;
// Bytes a step copies beside a row's 16 bytes for a lane in format F (RingChunk<F>::copy_side), 0 for bf16 and the
// formats the ring does not read: 4 (MXFP4's and IQ4_NL's scale word) or 16 (Q4_K's and IQ4_XS's record; Q5_K's and
// the 6-bit formats' high bits and the words of their records a step needs).
template <WeightFormat F>
constexpr int kRingSideBytes = Step32<F>::kSideBytes;

// Whether the TMAX-token kernel's matvecs over weights in format F read them through the ring.
template <WeightFormat F, int TMAX>
constexpr bool kRingFormat = kRingStages > 0 && ((F == WeightFormat::kBf16 && TMAX <= 2) ||
                                                 (kRingSideBytes<F> > 0 && TMAX == 1));
// The memory is also where the tiled gate/up task stages B for 2-16 tokens (mk_gate_up_tiles.h) and the tiled
// single-matrix tasks keep their warps' sums (mk_tiled_matvec.h).
template <int TMAX>
constexpr bool kRingFor = kRingFormat<kAttentionFormat, TMAX> || kRingFormat<kOFormat, TMAX> ||
                          kRingFormat<kMlpFormat, TMAX> || kRingFormat<kDownFormat, TMAX> ||
                          kRingFormat<kHeadFormat, TMAX> ||
                          (kRingStages > 0 && (kGateUpTiles || kDownTiles || kOTiles || kQkvTiles) && TMAX > 1);
// One step's sides, for every lane: as wide as the widest side of the build's formats the ring reads at one token.
template <WeightFormat F>
constexpr int kRingSideOf = kRingFormat<F, 1> ? kRingSideBytes<F> : 0;
constexpr int kRingSideWidest = std::max({kRingSideOf<kAttentionFormat>, kRingSideOf<kOFormat>, kRingSideOf<kMlpFormat>,
                                          kRingSideOf<kDownFormat>, kRingSideOf<kHeadFormat>});
constexpr int kRingSideStageBytes = kRowsPerWarp * kRingSideWidest * kMatvecThreads;
// Shared memory for a task's staged activations and RMSNorm weight: 64 KB, or 56 KB (8B's 14336 inputs as floats)
// where the side stages are 16 bytes a row, so that the block fits an SM's 227 KB beside the kernel's 35 KB of
// static shared memory. A build may ask for another (LITHOS_KERNEL_DEFINES="LITHOS_MK_RING_INPUT_KB=32").
#ifdef LITHOS_MK_RING_INPUT_KB
constexpr int kRingInputBytes = LITHOS_MK_RING_INPUT_KB * 1024;
#else
constexpr int kRingInputBytes = (kRingSideWidest > 4 ? 56 : 64) * 1024;
#endif
// The tiled single-matrix tasks' chunks through the stages (mk_tiles.h, RingTilePipeline), three steps ahead; 0 keeps
// one step in registers (NOTES.md, "Run 143 measured").
#ifndef LITHOS_MK_TILE_RING
#define LITHOS_MK_TILE_RING 1
#endif
// The dynamic shared memory that takes: the staged inputs, the stages, then (one token in a build with packed
// weights the ring reads; every bucket where the tiles' chunks take the stages) the side stages; none in a build
// without weights the ring reads.
template <int TMAX>
constexpr bool kRingSidesFor = TMAX == 1 || LITHOS_MK_TILE_RING;
template <int TMAX>
constexpr int kRingSmemBytes = kRingFor<TMAX> ? kRingInputBytes + kRingStages * kRingStageBytes +
                                                    (kRingSidesFor<TMAX> ? kRingStages * kRingSideStageBytes : 0)
                                              : 0;

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

// This thread's side of row r in ring stage `stage` (SIDE bytes a row), after the stages. A thread's sides of one
// stage fill 16-byte units (4 rows' 4-byte words in one, a 16-byte side in its own), consecutive threads'
// units adjacent, so a warp's reads of one unit are conflict-free.
template <int SIDE>
__device__ __forceinline__ uint8_t* ring_side(int stage, int r) {
  constexpr int kRowsPerUnit = 16 / SIDE;
  uint8_t* sides = ring_memory() + kRingInputBytes + kRingStages * kRingStageBytes + stage * kRingSideStageBytes;
  return sides + ((r / kRowsPerUnit) * kMatvecThreads + threadIdx.x) * 16 + (r % kRowsPerUnit) * SIDE;
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
// The aligned 4-byte word holding byte `p`, asynchronously (a scale beside its block's codes). For the last
// scales of a plane whose size is not a multiple of 4 the word reaches up to 3 bytes past it: inside the
// buffer's allocation, which XLA aligns (and so pads) to at least 64 bytes; the extra bytes are never used.
__device__ __forceinline__ void async_copy_word_of(void* to, const uint8_t* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(to));
  const uint8_t* word = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{3});
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(address), "l"(word) : "memory");
}
// 8 bytes (aligned) from global to shared memory, asynchronously (through L1: cp.async's .cg takes 16 only).
__device__ __forceinline__ void async_copy8(void* to, const void* from) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(address), "l"(from) : "memory");
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

// Where the staged products keep their 16-byte group f (inputs 4f..4f+3): a lane reads the 8 groups of its
// 32-input block, and consecutive lanes read consecutive blocks, 128 bytes apart, so the groups of a block are
// stored rotated by the block's index (an XOR of its low 3 bits): the 8 lanes of a shared-memory phase then
// read 8 different bank groups, where unrotated they would all read the same one (run 92).
__device__ __forceinline__ int product_slot(int f) { return (f & ~7) | ((f & 7) ^ ((f >> 3) & 7)); }

// After the wait of a packed task at one token: x * norm_w (or x, without an RMSNorm weight) as floats in the
// staged-input area (product_slot's order), formed once for all of the task's row groups (the products the
// steps would form: a bf16 product is exact in f32). nullptr when they do not fit; the steps then form them
// from `in`. Every thread calls it; one memory round trip, then a barrier.
__device__ inline const float* ring_stage_products(const TokenRows& in) {
  if (in.tokens != 1 || in.n_in * static_cast<int>(sizeof(float)) > kRingInputBytes) return nullptr;
  float* staged = reinterpret_cast<float*>(ring_memory());
  for (int i = static_cast<int>(threadIdx.x) * 8; i < in.n_in; i += kMatvecThreads * 8) {
    const Bf16Vec<8> xv = load_activation<8, true>(in.x + i);
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = xv[j];
    if (in.norm_w != nullptr) {
      const Bf16Vec<8> nw = load_cached<8>(in.norm_w + i);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] *= nw[j];
    }
    reinterpret_cast<float4*>(staged)[product_slot(i / 4)] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(staged)[product_slot(i / 4 + 1)] = make_float4(v[4], v[5], v[6], v[7]);
  }
  __syncthreads();
  return staged;
}

// Lets this thread's copies in flight land before its block leaves an aborted step.
__device__ __forceinline__ void ring_drain() { async_wait<0>(); }

// What a ring step copies of a row in format F: 16 bytes (kElements elements) at input element k, and for the
// packed formats (packed_steps.h Step32<F>, whose dot products the steps run) their side beside them.
template <WeightFormat F>
struct RingChunk : Step32<F> {
  using Step = Step32<F>;
  static constexpr int kElements = kPackedBlock;
  __device__ static const void* data(const uint8_t* row, int k) { return Step::codes(row, k); }
  __device__ static void copy_side(uint8_t* side, const uint8_t* row, const uint8_t* scales, int k) {
    SidePiece pieces[Step::kPieces];
    Step::side_pieces(row, scales, k, pieces);
#pragma unroll
    for (int i = 0, at = 0; i < Step::kPieces; at += pieces[i].bytes, ++i) {
      if (pieces[i].bytes == 16) {
        async_copy16(side + at, pieces[i].from);
      } else if (pieces[i].bytes == 8) {
        async_copy8(side + at, pieces[i].from);
      } else {
        async_copy_word_of(side + at, pieces[i].from);
      }
    }
  }
  // A stage's sides as `Side`s, one a row: 4-byte sides are one 16-byte unit for the 4 rows (one read).
  __device__ static void read_sides(int stage, typename Step::Side (&side)[kRowsPerWarp]) {
    if constexpr (Step::kSideBytes == 4) {
      const uint4 words = *reinterpret_cast<const uint4*>(ring_side<4>(stage, 0));
      side[0] = words.x;
      side[1] = words.y;
      side[2] = words.z;
      side[3] = words.w;
    } else {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) side[r] = *reinterpret_cast<const uint4*>(ring_side<16>(stage, r));
    }
  }
};
template <>
struct RingChunk<WeightFormat::kBf16> {
  static constexpr int kElements = 8;
  __device__ static const void* data(const uint8_t* row, int k) { return reinterpret_cast<const bf16_t*>(row) + k; }
};

// One warp's weight stream over a task: the chunks of its row group in each round (groups base + slot
// for base = first, first + slots, ...), 16 bytes of each of the 4 rows per step (and their sides), at input
// element k0 + s * step of step s. `issue()` copies the next step into the ring and closes a group (an empty
// one past the task's end, so that every step's wait counts the same); `rows_of(unit, rows)` is the
// task's row map (mk_weight_rows.h).
template <WeightFormat F, class RowsOf>
struct RingStream {
  using Chunk = RingChunk<F>;
  static constexpr int kSide = kRingSideBytes<F>;
  RowsOf rows_of;
  int end, slots, slot;      // the task's row groups end; teams per round; this warp's team
  int k0, step, steps, n_in;  // this lane's first input element; stride; steps per round; input size
  int base = 0, s = 0, stage = 0;  // the next step to issue: its round, its step, its ring stage
  uint64_t policy = 0;
  const uint8_t* rows[kRowsPerWarp];
  const uint8_t* scales[kSide > 0 ? kRowsPerWarp : 1];

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
    for (int r = 0; r < kRowsPerWarp; ++r) {
      rows[r] = packed[r].data;
      if constexpr (kSide > 0) scales[r] = packed[r].scales;
    }
  }
  __device__ __forceinline__ void issue() {
    if (base < end) {
      const int k = k0 + s * step;
      if (k < n_in) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) async_copy16(ring_slot(stage, r), Chunk::data(rows[r], k), policy);
        if constexpr (kSide > 0) {
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) Chunk::copy_side(ring_side<kSide>(stage, r), rows[r], scales[r], k);
        }
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

// ring_rows_dot for packed rows at one token (kRingSideBytes<F> > 0): each step's 16 bytes of a row are 32 codes,
// decoded in registers as the register path decodes them (packed_decode.h), scaled by what its side holds (`rows`: this
// round's rows, as the stream saw them, say where in a copied word a scale lies). The inputs times the RMSNorm
// weight come from `products` (ring_stage_products) or, where that is nullptr, from `in`.
template <WeightFormat F, class Stream>
__device__ __forceinline__ void ring_rows_dot_packed(Stream& stream, int& stage, const PackedRow (&rows)[kRowsPerWarp],
                                                     const TokenRows& in, const float* products,
                                                     float (&acc)[kRowsPerWarp][1]) {
  using Chunk = RingChunk<F>;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) acc[r][0] = 0.0f;
  for (int s = 0; s < stream.steps; ++s) {
    async_wait<kRingStages - 2>();  // this step's group has landed
    uint4 codes[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) codes[r] = *ring_slot(stage, r);
    typename Chunk::Side side[kRowsPerWarp];
    Chunk::read_sides(stage, side);
    stage = stage + 1 == kRingStages ? 0 : stage + 1;
    stream.issue();  // into the stage read one step ago: its values are in registers and used
    const int k = stream.k0 + s * stream.step;
    if (k >= in.n_in) continue;
    float xf[kPackedBlock];
    if (products != nullptr) {
#pragma unroll
      for (int c = 0; c < kPackedBlock; c += 4) {
        const float4 p = reinterpret_cast<const float4*>(products)[product_slot((k + c) / 4)];
        xf[c] = p.x;
        xf[c + 1] = p.y;
        xf[c + 2] = p.z;
        xf[c + 3] = p.w;
      }
    } else {
#pragma unroll
      for (int c = 0; c < kPackedBlock; c += 8) {
        const Bf16Vec<8> xv = load_activation<8, true>(in.x + k + c);
#pragma unroll
        for (int v = 0; v < 8; ++v) xf[c + v] = xv[v];
        if (in.norm_w != nullptr) {
          const Bf16Vec<8> nw = load_activation<8, true>(in.norm_w + k + c);
#pragma unroll
          for (int v = 0; v < 8; ++v) xf[c + v] *= nw[v];
        }
      }
    }
    float x_sums[2] = {0.0f, 0.0f};  // for a min's term: each half's
    if constexpr (Chunk::P::kHasMin) {
#pragma unroll
      for (int c = 0; c < kPackedBlock; ++c) x_sums[c / kChunk] += xf[c];
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[r][0] = Chunk::dot(codes[r], side[r], rows[r], k, xf, x_sums, acc[r][0]);
  }
  warp_sum_rows(acc, in.tokens);
}

#else

__device__ __forceinline__ void ring_drain() {}

#endif  // LITHOS_MK_LANE_RING

}  // namespace mk
}  // namespace lithos
