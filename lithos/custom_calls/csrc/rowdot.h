// The building block of every batch-1 matvec kernel here (projections, gate/up, LM head): a warp
// computes the dot products of a few weight rows with 1..16 token vectors. Lanes split the input
// dimension in 16-byte chunks, so a warp reads each weight row contiguously and each weight byte
// once for all tokens; the activations are tiny and come from L1.
//
// Small matrices (a 1B model's O projection has 2048 rows) give too few row groups to keep enough
// loads in flight on every SM; then `k_split` warps of a block share a row group, each reading an
// interleaved share of the input dimension, and add their sums through shared memory.
#pragma once

#include "ffi_util.h"
#include "portable.h"

namespace lithos {

// Eight warps (CUDA) or eight wavefronts (ROCm) per block.
constexpr int kMatvecWarps = 8;
constexpr int kMatvecThreads = kMatvecWarps * WARP_SIZE;
// Rows a warp reads at once.
constexpr int kRowsPerWarp = 4;
// Warps per SM/CU wanted in flight before row groups are split over several warps.
constexpr int kWarpsWantedPerUnit = 24;

// Runs body(t, sums) on lane t for each token t < tokens, where sums[r] = acc[r][t] is row r's dot product
// with token t: the one way the row-group kernels hand their sums to their stores. Every token's epilogue
// runs at once, each lane first selecting its token's sums into registers, so the 4-16-token epilogues'
// loads (residuals, positions) and RoPE overlap instead of queueing (rounds of 8 positions: fused 14-17%
// faster, megakernel 15%; NOTES.md runs 61 and 64). One token keeps its lane and index compile-time constants.
template <int TMAX, class Body>
__device__ __forceinline__ void for_each_token(const float (&acc)[kRowsPerWarp][TMAX], int tokens, Body body) {
  float sums[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) sums[r] = acc[r][0];
  if constexpr (TMAX == 1) {
    if (tokens > 0 && lane_id() == 0) body(0, sums);
  } else {
#pragma unroll
    for (int t = 1; t < TMAX; ++t) {  // selects: acc's token index must stay a compile-time constant
      if (lane_id() == t) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) sums[r] = acc[r][t];
      }
    }
    if (lane_id() < tokens) body(lane_id(), sums);
  }
}

// Warps of the running block: kMatvecWarps unless a tuned launch asked for fewer (RowGroupLaunch).
__device__ __forceinline__ int block_warps() { return static_cast<int>(blockDim.x) / WARP_SIZE; }

// 16-byte chunks of each row a lane has in flight: 16 loads per lane at 1-2 tokens, 8 when the
// accumulators for more tokens need the registers.
template <int TMAX>
struct Unroll {
  static constexpr int value = TMAX <= 2 ? 4 : 2;
};

// Token activations x[t, :] for t < tokens, optionally scaled elementwise by an RMSNorm weight.
struct TokenRows {
  const bf16_t* x;       // [tokens, n_in]
  const bf16_t* norm_w;  // [n_in], or nullptr
  int tokens;
  int n_in;
};

// Activations written earlier in the same launch (by other blocks of the megakernel) are read with
// plain coherent loads: the read-only path of load_cached (ld.global.nc) may serve stale lines. The
// load is generic, so `p` may also point at a copy in shared memory (the megakernel stages its
// inputs there).
template <int VEC, bool COHERENT>
__device__ __forceinline__ Bf16Vec<VEC> load_activation(const bf16_t* p) {
  if constexpr (!COHERENT) {
    return load_cached<VEC>(p);
  } else if constexpr (VEC == 8) {
    Bf16Vec<8> out;
#if defined(LITHOS_HIP)
    const u32x4_t v = *reinterpret_cast<const u32x4_t*>(p);
    out.pair[0] = v.x; out.pair[1] = v.y; out.pair[2] = v.z; out.pair[3] = v.w;
#else
    asm volatile("ld.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(out.pair[0]), "=r"(out.pair[1]), "=r"(out.pair[2]), "=r"(out.pair[3])
                 : "l"(p));
#endif
    return out;
  } else {
    return Bf16Vec<VEC>{*p};
  }
}

// acc[r][t] += sum over v of w[r][v] * x[t, k + v] * norm_w[k + v]: one chunk of VEC inputs at input
// element k. The RMSNorm weight is read-only global memory (load_cached), or, with STAGED_NORM, may be a
// copy in shared memory (the megakernel's staged inputs).
template <int TMAX, int VEC, bool COHERENT, bool STAGED_NORM = false>
__device__ __forceinline__ void add_chunk(const Bf16Vec<VEC> (&w)[kRowsPerWarp], const TokenRows& in, int k,
                                          float (&acc)[kRowsPerWarp][TMAX]) {
  float norm[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) norm[v] = 1.0f;
  if (in.norm_w != nullptr) {
    Bf16Vec<VEC> nw;
    if constexpr (STAGED_NORM) nw = load_activation<VEC, true>(in.norm_w + k);
    else nw = load_cached<VEC>(in.norm_w + k);
#pragma unroll
    for (int v = 0; v < VEC; ++v) norm[v] = nw[v];
  }
#pragma unroll
  for (int t = 0; t < TMAX; ++t) {
    if (t < in.tokens) {
      const Bf16Vec<VEC> xv = load_activation<VEC, COHERENT>(in.x + static_cast<size_t>(t) * in.n_in + k);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float xf = xv[v] * norm[v];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) acc[r][t] = fmaf(w[r][v], xf, acc[r][t]);
      }
    }
  }
}

// Each lane's partial sums acc[r][t] (t < tokens) become the warp's: every lane ends with every sum.
template <int TMAX>
__device__ __forceinline__ void warp_sum_rows(float (&acc)[kRowsPerWarp][TMAX], int tokens) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t)
      if (t < tokens) acc[r][t] = warp_sum(acc[r][t]);
}

// acc[r][t] = sum over this warp's share of i of rows[r][i] * x[t, i] * norm_w[i]; the share is
// chunks part, part + parts, ... Every lane of the warp ends with every sum. UNROLL chunks per row are
// loaded at once.
template <int TMAX, int VEC, bool COHERENT = false, int UNROLL = Unroll<TMAX>::value>
__device__ __forceinline__ void warp_rows_dot(const bf16_t* const (&rows)[kRowsPerWarp], const TokenRows& in,
                                              int part, int parts, float (&acc)[kRowsPerWarp][TMAX]) {
  constexpr int kUnroll = UNROLL;
  const int step = parts * WARP_SIZE * VEC;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t) acc[r][t] = 0.0f;

  for (int base = (part * WARP_SIZE + lane_id()) * VEC; base < in.n_in; base += step * kUnroll) {
    // Issue every weight load of this step before the first use: the loads are what we wait on.
    Bf16Vec<VEC> w[kUnroll][kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * step;
      if (k < in.n_in) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) w[u][r] = load_streaming<VEC>(rows[r] + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = base + u * step;
      if (k < in.n_in) add_chunk<TMAX, VEC, COHERENT>(w[u], in, k, acc);
    }
  }
  warp_sum_rows(acc, in.tokens);
}

// The k_split consecutive warps of team `slot` (each with a share of a row group's inputs) add their
// sums through shared memory `partial`; each member ends with the total. Every thread of the block calls
// it (two block barriers).
template <int TMAX>
__device__ __forceinline__ void block_team_sum(float (&acc)[kRowsPerWarp][TMAX],
                                               float (&partial)[kMatvecWarps][kRowsPerWarp][TMAX], int slot,
                                               int k_split) {
  if (lane_id() == 0) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
      for (int t = 0; t < TMAX; ++t) partial[warp_id()][r][t] = acc[r][t];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
      float sum = 0.0f;
      for (int p = 0; p < k_split; ++p) sum += partial[slot * k_split + p][r][t];
      acc[r][t] = sum;
    }
  __syncthreads();
}

// RMSNorm's factor from the sum of a row's n squares.
__device__ __forceinline__ float rms_factor(float squares, int n, float eps) {
  return rsqrtf(squares / static_cast<float>(n) + eps);
}

// Each warp's sums of x[t, :]^2 over its threads' shares into partial[warp][t] (every thread must call it; a
// barrier must follow before the sums are read).
template <int TMAX, int VEC, bool COHERENT = false>
__device__ __forceinline__ void warp_squares(const TokenRows& in, float (&partial)[kMatvecWarps][TMAX]) {
  float squares[TMAX];
#pragma unroll
  for (int t = 0; t < TMAX; ++t) squares[t] = 0.0f;
  for (int k = static_cast<int>(threadIdx.x) * VEC; k < in.n_in; k += static_cast<int>(blockDim.x) * VEC) {
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
      if (t < in.tokens) {
        const Bf16Vec<VEC> xv = load_activation<VEC, COHERENT>(in.x + static_cast<size_t>(t) * in.n_in + k);
#pragma unroll
        for (int v = 0; v < VEC; ++v) squares[t] = fmaf(xv[v], xv[v], squares[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TMAX; ++t) {
    const float total = warp_sum(squares[t]);
    if (lane_id() == 0) partial[warp_id()][t] = total;
  }
}

// RMSNorm factor rsqrt(mean(x[t, :]^2) + eps) for t < tokens, computed by the whole block (every
// thread must call it) into scale[t] in shared memory. The matvecs apply it after the dot product,
// so the normalised activations never exist in memory.
template <int TMAX, int VEC, bool COHERENT = false>
__device__ void block_rms_scale(const TokenRows& in, float eps, float* scale) {
  __shared__ float partial[kMatvecWarps][TMAX];
  warp_squares<TMAX, VEC, COHERENT>(in, partial);
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(in.tokens)) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < block_warps(); ++w) total += partial[w][threadIdx.x];
    scale[threadIdx.x] = rms_factor(total, in.n_in, eps);
  }
  __syncthreads();
}

// Launch shape of a row-group kernel: how many warps share a group, the block size and the
// persistent grid.
struct RowGroupGrid {
  int k_split;
  int blocks;
  int warps;  // per block; launch with warps * WARP_SIZE threads
};

// Launch parameters measured by `lithos tune` (FFI attributes k_split, warps_per_block,
// blocks_per_unit); 0 leaves a parameter to the heuristic of row_group_grid.
struct RowGroupLaunch {
  int64_t k_split = 0;          // warps sharing a row group: 1, 2, 4 or 8, at most warps_per_block
  int64_t warps_per_block = 0;  // 1, 2, 4 or 8 (kMatvecWarps by default)
  int64_t blocks_per_unit = 0;  // blocks per SM/CU in the grid (default: as many as fit at once)

  int warps() const { return warps_per_block > 0 ? static_cast<int>(warps_per_block) : kMatvecWarps; }
  int threads() const { return warps() * WARP_SIZE; }
};

// An error that names the bad attribute, or Success.
inline ffi::Error check_launch(const char* op, const RowGroupLaunch& l) {
  auto pow2_upto = [](int64_t v, int64_t most) { return v >= 0 && v <= most && (v & (v - 1)) == 0; };
  if (!pow2_upto(l.warps_per_block, kMatvecWarps) || !pow2_upto(l.k_split, l.warps()) || l.blocks_per_unit < 0 ||
      l.blocks_per_unit > 64)
    return invalid(std::string(op) + ": launch parameters k_split=" + std::to_string(l.k_split) +
                   ", warps_per_block=" + std::to_string(l.warps_per_block) + ", blocks_per_unit=" +
                   std::to_string(l.blocks_per_unit) + " are out of range (warps_per_block 0 or 1, 2, 4, 8; k_split "
                   "0 or a power of two up to warps_per_block; blocks_per_unit 0..64): fix or delete the tuning "
                   "table entry");
  return ffi::Error::Success();
}

// `resident` is how many blocks of `launch.warps_per_block` warps fit on one SM/CU
// (resident_blocks_per_unit): by default the grid is one wave of them, each block striding over row
// groups, so every block pays its prologue (the RMSNorm factor) once and no second wave waits on the
// first. A tuned blocks_per_unit replaces that count (more than fit means more than one wave).
inline RowGroupGrid row_group_grid(int64_t units, int64_t n_in, int resident, const RowGroupLaunch& launch) {
  const int64_t units_per_cu = compute_unit_count();
  const int warps = launch.warps();
  int k_split = 1;
  // Split the input dimension while there are too few groups for the warps wanted, and each share
  // still spans a few full warp-wide chunks.
  while (k_split < warps && units * k_split < units_per_cu * kWarpsWantedPerUnit &&
         n_in >= int64_t{2} * k_split * WARP_SIZE * 8 * 2)
    k_split *= 2;
  if (launch.k_split > 0) k_split = static_cast<int>(launch.k_split);
  const int64_t slots = warps / k_split;
  const int64_t needed = (units + slots - 1) / slots;
  const int64_t full = units_per_cu * (launch.blocks_per_unit > 0 ? launch.blocks_per_unit : resident);
  return {k_split, static_cast<int>(needed < full ? (needed > 0 ? needed : 1) : full), warps};
}

inline RowGroupGrid row_group_grid(int64_t units, int64_t n_in, int resident) {
  return row_group_grid(units, n_in, resident, RowGroupLaunch{});
}

}  // namespace lithos
