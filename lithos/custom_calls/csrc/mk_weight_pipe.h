// The megakernel's weight pipeline (CUDA sm_90): each block copies the weights of its matvec tasks
// into a ring of shared-memory stages with bulk copies (TMA), ahead of the warps that compute with
// them, and those warps read every weight from there.
//
// Why: a task's weights do not depend on the step, so they can be in flight while the block waits for
// its inputs, runs its epilogue, signals, or runs an attention task. Streamed through registers
// (the default, and every HIP build) every task starts from an empty pipe and pays a ramp-up and a
// drain of about one memory round trip each (NOTES.md, step traces); staged, the ring is full when
// the inputs arrive. At most kTilesInFlight tiles are in flight per block, so the memory queues stay
// short for the loads on the step's critical path (hand-offs, attention).
//
// The tiles. A matvec task's row groups go in rounds of kMatvecWarps / k_split groups (one per team
// of k_split warps, as in stream_row_groups; by default one team of the whole block, team_warps); a
// round's rows (4 per group) are cut along the input dimension into tiles of tile_columns(k_split)
// columns, kTileElements bf16 in all, so each lane of a team reads whole 16-byte chunks of each of
// its 4 rows per tile. A tile is one bulk copy per row (lane 31 - i of the issuing warp copies row
// i); rows of groups past the task's end are not copied (their results are not used). The copies
// walk the block's tasks in the order the block runs them (block b: tasks b, b + grid, ...), so the
// copies and the compute number the tiles alike.
//
// Who copies: any warp, holding a lock on the cursor (`try_pump_weights`): after each tile it reads,
// while a tile it needs has not landed, and (warp 0) between polls of a hand-off counter;
// `pump_weights` never blocks, it issues what the ring has room for. Issuing a tile costs about 1200
// cycles (measured); when warp 0 alone issued, it read its share of every tile late and paced the
// ring, and sharing the issuing gained 7.5% (NOTES.md, runs 11-12). (A ninth, copying-only warp
// would cost registers: a 288-thread block is allocated registers as 384 threads, 168 each, and
// spills.) No deadlock: a warp waiting for a tile pumps while it waits, the lock is held only for a
// pump (which never waits), and every tile up to the one it waits for gets issued once the warps
// before it in the ring have read their stage; a warp never waits for a tile across a block barrier.
//
// Protocol (PTX mbarriers in shared memory, per stage): `full` (1 arrival + the copy's bytes) says a
// tile landed; `empty` (one arrival per warp) says every warp has read it. Tile j goes to stage
// j % kStages; waits use the parity of phase j / kStages. Tile j is issued once tile j - kStages was
// read (empty) and tile j - kTilesInFlight landed (full). The bulk copy's completion makes the data
// visible to threads that observe the `full` phase; a warp's arrival on `empty` releases its reads
// before the stage is overwritten (the pattern of CUTLASS's TMA pipelines).
#pragma once

#include <cstdint>

#include "mk_common.h"
#include "mk_weight_rows.h"
#include "portable.h"
#include "rowdot.h"

// Off by default: as built so far it streams at about 1.2 TB/s on the H200, against 3.3-3.7 TB/s
// for the same bulk copies in benchmarks/probes/bulk_copy.cu, and the step is 2.4x slower than the
// register path. Measured: issuing a tile (four bulk copies) costs about 1200 cycles, and the ring
// runs at about one tile per 1.1-1.2 us whichever warps issue (NOTES.md, "Weights through shared
// memory", runs 11-14). A build turns it on with LITHOS_KERNEL_DEFINES="LITHOS_MK_STAGED=1" (CUDA
// only).
#ifndef LITHOS_MK_STAGED
#define LITHOS_MK_STAGED 0
#endif
#if LITHOS_MK_STAGED && defined(LITHOS_HIP)
#error "LITHOS_MK_STAGED needs bulk copies (CUDA sm_90); HIP builds stream weights through registers"
#endif
#if LITHOS_MK_STAGED && (LITHOS_MK_ATTENTION_FORMAT != 0 || LITHOS_MK_MLP_FORMAT != 0 || LITHOS_MK_HEAD_FORMAT != 0)
#error "LITHOS_MK_STAGED tiles bf16 rows; packed weights (LITHOS_MK_*_FORMAT) stream through registers"
#endif
// Stages in the ring (a tile each, LITHOS_MK_TILE_KB) and tiles a block keeps in flight; a build may ask for
// others (LITHOS_KERNEL_DEFINES="LITHOS_MK_STAGES=6 LITHOS_MK_IN_FLIGHT=2").
#ifndef LITHOS_MK_STAGES
#define LITHOS_MK_STAGES 8
#endif
#ifndef LITHOS_MK_IN_FLIGHT
#define LITHOS_MK_IN_FLIGHT 3
#endif

namespace lithos {
namespace mk {

constexpr bool kStaged = LITHOS_MK_STAGED;
constexpr int kStages = LITHOS_MK_STAGES;
constexpr int kTilesInFlight = LITHOS_MK_IN_FLIGHT;
static_assert(kTilesInFlight >= 1 && kTilesInFlight < kStages, "tiles in flight must be fewer than the stages");
#ifndef LITHOS_MK_TILE_KB
#define LITHOS_MK_TILE_KB 16
#endif
constexpr int kTileElements = LITHOS_MK_TILE_KB * 512;  // bf16 per tile
// A task's activations (and its RMSNorm weight) are copied to shared memory when they fit in this.
constexpr int kInputBytes = 40 * 1024;

// Warps that share a row group (a team). Staged, the whole block by default: a round is then one row
// group, and a 16 KB tile is its 4 rows x 2048 columns, four bulk copies of 4 KB instead of 32 of 512
// bytes: the copy engine pays per copy (NOTES.md). A build may keep the schedule's teams
// (LITHOS_KERNEL_DEFINES="LITHOS_MK_BLOCK_TEAMS=0").
#ifndef LITHOS_MK_BLOCK_TEAMS
#define LITHOS_MK_BLOCK_TEAMS 1
#endif
__device__ __forceinline__ int team_warps(int scheduled_k_split) {
  return kStaged && LITHOS_MK_BLOCK_TEAMS ? kMatvecWarps : scheduled_k_split;
}

// Columns of a tile for teams of k_split warps: a round has kRowsPerWarp * kMatvecWarps / k_split rows.
__host__ __device__ constexpr int tile_columns(int k_split) {
  return kTileElements / (kRowsPerWarp * (kMatvecWarps / k_split));
}
static_assert(tile_columns(1) % (WARP_SIZE * 8) == 0 || !kStaged, "a tile row is whole 16-byte chunks per lane");
static_assert(kRowsPerWarp * kMatvecWarps <= WARP_SIZE || !kStaged, "one copying lane per row of a round");

// Where the copies are: the next tile to issue, in the block's task order (in shared memory, read and
// written by the warp holding the pump lock).
// The task's fields are kept here, so that a pump reads no global memory within a task.
struct CopyCursor {
  int index;  // the task (its index in the list); >= n_tasks when every tile is issued
  int base;   // its round's first row group; -1 before the task's fields are read
  int k0;     // the tile's first column
  int tile;   // tiles issued so far
  int op, layer, end, k_split, n_in;  // the task's: kind, layer, row groups' end, team size, input size
};

// Dynamic shared memory of a block: the stages, the staged inputs, the barriers and the cursor.
struct PipeLayout {
  static constexpr int kStagesBytes = kStages * kTileElements * 2;
  static constexpr int kInputsOffset = kStagesBytes;
  static constexpr int kBarriersOffset = kInputsOffset + kInputBytes;
  static constexpr int kCursorOffset = kBarriersOffset + 2 * kStages * 8;
  static constexpr int kLockOffset = kCursorOffset + static_cast<int>(sizeof(CopyCursor));
  static constexpr int kBytes = kStaged ? kLockOffset + static_cast<int>(sizeof(int)) : 0;
};
constexpr int kDynamicSmemBytes = PipeLayout::kBytes;
// A block can have at most 227 KB of shared memory (sm_90); a GPU with less is caught at run time
// (grid_capacity is 0, and lithos.custom_calls.megakernel.kernel.resident_blocks says what to change).
static_assert(kDynamicSmemBytes <= 227 * 1024,
              "the weight pipeline's stages and staged inputs exceed the 227 KB of shared memory a block can "
              "have: use fewer or smaller stages (LITHOS_MK_STAGES, LITHOS_MK_TILE_KB)");

// One thread's view of its block's pipeline. `tile` is the next tile the thread's warp reads.
struct WeightPipe {
  bf16_t* stages;      // [kStages][kTileElements]
  bf16_t* inputs;      // kInputBytes: the running task's activations, then its RMSNorm weight
  uint64_t* full;      // [kStages]
  uint64_t* empty;     // [kStages]
  CopyCursor* cursor;  // guarded by lock
  int* lock;           // 1 while a warp pumps
  int tile;
};

#if LITHOS_MK_STAGED

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
}

// True once the phase with this parity has completed (the hardware may suspend the thread briefly).
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, int parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(shared_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// The same without waiting.
__device__ __forceinline__ bool mbarrier_test_wait(uint64_t* bar, int parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(shared_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

// Arrive and expect `bytes` more from bulk copies before the phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

// Weights are read once per step: evict them first from L2, before activations and the cache.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory; the
// copy completes `bytes` of the barrier's expected transfer.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar)), "l"(policy)
      : "memory");
}

#endif  // LITHOS_MK_STAGED

// The block's pipeline over its dynamic shared memory; thread 0 initialises the barriers and the
// block meets before anyone uses them.
__device__ inline WeightPipe weight_pipe() {
  WeightPipe pipe{};
#if LITHOS_MK_STAGED
  extern __shared__ __align__(128) unsigned char pipe_memory[];
  pipe.stages = reinterpret_cast<bf16_t*>(pipe_memory);
  pipe.inputs = reinterpret_cast<bf16_t*>(pipe_memory + PipeLayout::kInputsOffset);
  pipe.full = reinterpret_cast<uint64_t*>(pipe_memory + PipeLayout::kBarriersOffset);
  pipe.empty = pipe.full + kStages;
  pipe.cursor = reinterpret_cast<CopyCursor*>(pipe_memory + PipeLayout::kCursorOffset);
  pipe.lock = reinterpret_cast<int*>(pipe_memory + PipeLayout::kLockOffset);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&pipe.full[s], 1);
      mbarrier_init(&pipe.empty[s], kMatvecWarps);
    }
    *pipe.cursor = CopyCursor{static_cast<int>(blockIdx.x), -1, 0, 0, 0, 0, 0, 1, 0};
    *pipe.lock = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#endif
  return pipe;
}

#if LITHOS_MK_STAGED

// A warp holding the lock (all lanes): issue the next tiles while the ring has room; never waits.
__device__ inline void pump_weights(const Args& a, WeightPipe& pipe) {
  CopyCursor c = *pipe.cursor;
  while (c.index < a.n_tasks) {
    if (c.base < 0) {  // a new task: read its fields once
      const Task task = a.tasks[c.index];
      c.op = task.op;
      c.layer = task.layer;
      c.end = task.first + task.count;
      c.k_split = team_warps(task.k_split);
      c.n_in = task_weight_columns(a, task.op);
      c.base = task.first;
      c.k0 = 0;
    }
    if (c.n_in == 0 || c.base >= c.end) {  // a task without weights, or one whose tiles are all issued
      c.index += gridDim.x;
      c.base = -1;
      continue;
    }
    const int stage = c.tile % kStages;
    int room = 1;
    if (lane_id() == 0) {
      const int landed = c.tile - kTilesInFlight;
      room = (c.tile < kStages || mbarrier_test_wait(&pipe.empty[stage], (c.tile / kStages - 1) & 1)) &&
             (landed < 0 || mbarrier_test_wait(&pipe.full[landed % kStages], (landed / kStages) & 1));
    }
    if (!shfl_from(room, 0)) break;
    const int slots = kMatvecWarps / c.k_split, columns = tile_columns(c.k_split);
    const int rows_copied = min(slots, c.end - c.base) * kRowsPerWarp;
    const uint32_t row_bytes = static_cast<uint32_t>(min(columns, c.n_in - c.k0)) * 2;
    // The copies go out from the warp's last lanes (row i from lane 31 - i), away from lane 0, which
    // arrives and fences for the warp's own tile reads and team sums.
    const int row = WARP_SIZE - 1 - lane_id();
    if (row == 0) mbarrier_arrive_expect(&pipe.full[stage], row_bytes * rows_copied);
    __syncwarp();  // the expected bytes are set before any copy can complete them
    if (row < rows_copied) {
      const bf16_t* source = reinterpret_cast<const bf16_t*>(
          task_weight_row(a, c.op, c.layer, c.base + row / kRowsPerWarp, row % kRowsPerWarp).data);
      bulk_copy(pipe.stages + stage * kTileElements + row * columns, source + c.k0, row_bytes, &pipe.full[stage],
                evict_first_policy());
    }
    ++c.tile;
    c.k0 += columns;
    if (c.k0 >= c.n_in) {
      c.k0 = 0;
      c.base += slots;
    }
  }
  __syncwarp();  // every lane has read the cursor before lane 0 rewrites it
  if (lane_id() == 0) *pipe.cursor = c;
  __syncwarp();
}

// A warp (all lanes): pump unless another warp is pumping; never waits. The lock's acquire and
// release (shared-memory atomics with block fences) order one holder's cursor update before the
// next holder's read.
__device__ inline void try_pump_weights(const Args& a, WeightPipe& pipe) {
  int mine = 0;
  if (lane_id() == 0 && atomicCAS(pipe.lock, 0, 1) == 0) {
    __threadfence_block();
    mine = 1;
  }
  if (!shfl_from(mine, 0)) return;  // the shuffle also orders the other lanes' reads after the acquire
  pump_weights(a, pipe);
  if (lane_id() == 0) {
    __threadfence_block();
    atomicExch(pipe.lock, 0);
  }
}

// Before a block leaves an abandoned step (all its warps past a block barrier, so none is pumping):
// let its copies in flight land (they write its shared memory).
__device__ inline void drain_weights(const WeightPipe& pipe) {
  if (threadIdx.x != 0) return;
  const int issued = pipe.cursor->tile;
  for (int j = max(issued - kStages, 0); j < issued; ++j)
    while (!mbarrier_try_wait(&pipe.full[j % kStages], (j / kStages) & 1)) {
    }
}

// acc[r][t] = the dot product of the warp's 4 rows of the tiles with token t's inputs, over the input
// dimension, reading every tile of one round (the warp's team is `slot`, its share `part` of
// k_split); the warps keep the copies going. `in` may point at shared memory (stage_inputs) or at
// global memory. Every lane ends with every sum.
template <int TMAX>
__device__ __forceinline__ void warp_tiles_dot(const Args& a, WeightPipe& pipe, const TokenRows& in, int slot,
                                               int part, int k_split, float (&acc)[kRowsPerWarp][TMAX]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t) acc[r][t] = 0.0f;
  const int columns = tile_columns(k_split);
  const int chunk = (part * WARP_SIZE + lane_id()) * 8;  // this lane's columns within a tile
  for (int k0 = 0; k0 < in.n_in; k0 += columns, ++pipe.tile) {
    const int stage = pipe.tile % kStages;
    // Not try_wait's sleep: the tile may not be issued yet, and this warp may be the one to issue it.
    while (!mbarrier_test_wait(&pipe.full[stage], (pipe.tile / kStages) & 1)) try_pump_weights(a, pipe);
    for (int c = chunk; c < columns && k0 + c < in.n_in; c += k_split * WARP_SIZE * 8) {
      const int k = k0 + c;
      const bf16_t* rows = pipe.stages + stage * kTileElements + slot * kRowsPerWarp * columns + c;
      Bf16Vec<8> w[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) w[r] = load_activation<8, true>(rows + r * columns);
      float norm[8];
#pragma unroll
      for (int v = 0; v < 8; ++v) norm[v] = 1.0f;
      if (in.norm_w != nullptr) {
        const Bf16Vec<8> nw = load_activation<8, true>(in.norm_w + k);
#pragma unroll
        for (int v = 0; v < 8; ++v) norm[v] = nw[v];
      }
#pragma unroll
      for (int t = 0; t < TMAX; ++t) {
        if (t < in.tokens) {
          const Bf16Vec<8> xv = load_activation<8, true>(in.x + static_cast<size_t>(t) * in.n_in + k);
#pragma unroll
          for (int v = 0; v < 8; ++v) {
            const float xf = xv[v] * norm[v];
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r) acc[r][t] = fmaf(w[r][v], xf, acc[r][t]);
          }
        }
      }
    }
    __syncwarp();  // every lane has read the stage
    if (lane_id() == 0) mbarrier_arrive(&pipe.empty[stage]);
    try_pump_weights(a, pipe);
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < TMAX; ++t)
      if (t < in.tokens) acc[r][t] = warp_sum(acc[r][t]);
}

// After the task's wait: copy its activations (and RMSNorm weight) into shared memory
// when they fit, so that no tile waits on a load from L2; returns where to read them. Every
// thread calls it; the next task's copy comes after this task's last barrier (block_release).
__device__ inline TokenRows stage_inputs(const WeightPipe& pipe, const TokenRows& in) {
  const int x_elements = in.tokens * in.n_in, norm_elements = in.norm_w != nullptr ? in.n_in : 0;
  if ((x_elements + norm_elements) * 2 > kInputBytes) return in;
  // All loads first, then all stores: one memory round trip, not one per chunk.
  constexpr int kChunksPerThread = kInputBytes / (kMatvecThreads * 16);
  const int elements = x_elements + norm_elements;
  Bf16Vec<8> chunk[kChunksPerThread];
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const int i = (static_cast<int>(threadIdx.x) + j * kMatvecThreads) * 8;
    if (i < x_elements) chunk[j] = load_activation<8, true>(in.x + i);
    else if (i < elements) chunk[j] = load_cached<8>(in.norm_w + (i - x_elements));
  }
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const int i = (static_cast<int>(threadIdx.x) + j * kMatvecThreads) * 8;
    if (i < elements)
      *reinterpret_cast<uint4*>(pipe.inputs + i) = make_uint4(chunk[j].pair[0], chunk[j].pair[1], chunk[j].pair[2], chunk[j].pair[3]);
  }
  __syncthreads();
  return TokenRows{pipe.inputs, norm_elements > 0 ? pipe.inputs + x_elements : nullptr, in.tokens, in.n_in};
}

#else

__device__ __forceinline__ void try_pump_weights(const Args&, WeightPipe&) {}
__device__ __forceinline__ void drain_weights(const WeightPipe&) {}

#endif  // LITHOS_MK_STAGED

}  // namespace mk
}  // namespace lithos
