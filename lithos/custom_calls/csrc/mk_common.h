// The megakernel's shared parts: its instruction format (the task list the Python scheduler builds,
// lithos/custom_calls/megakernel/tasks.py), its arguments, and the hand-offs between its blocks.
//
// Hand-off protocol (NOTES.md, "Megakernel: memory ordering"): a producer block writes its outputs,
// meets at a block barrier, and one thread adds 1 to a counter in global memory with release
// semantics at device scope; a consumer's thread 0 polls the counter with acquire loads until it
// reaches the task's target and releases its block with a barrier. Every wait is bounded: a task
// that waits too long raises the abort flag, records itself, and every block leaves, so a scheduling
// bug ends in an error instead of a hung GPU.
#pragma once

#include <cstdint>

#include "ffi_util.h"
#include "packed.h"
#include "portable.h"
#include "rowdot.h"

namespace lithos {
namespace mk {

// Instruction fields, int32 each, in this order (tasks.py FIELDS).
struct Task {
  int32_t op;
  int32_t layer;
  int32_t first;           // first row group (matvec tasks) or KV head (attention)
  int32_t count;           // row groups (matvec tasks) or split index (attention)
  int32_t k_split;         // warps sharing a row group
  int32_t wait_counter;    // -1: no input to wait for
  int32_t wait_target;     // the task may start once counters[wait_counter] >= wait_target
  int32_t signal_counter;  // counter this task adds 1 to when its outputs are written
  int32_t arrivals;        // > 0: the task that brings signal_counter to this count reduces (attention, head)
  int32_t aux;             // attention: counter signalled after the combine; head: this task's slot
};
constexpr int kFields = sizeof(Task) / sizeof(int32_t);
static_assert(kFields == 10, "tasks.py FIELDS must match");
// The fields' names, for the trace (megakernel.cu StepTrace), in tasks.py FIELDS order.
constexpr const char* kFieldNames[kFields] = {"op",           "layer",       "first",          "count",    "k_split",
                                              "wait_counter", "wait_target", "signal_counter", "arrivals", "aux"};

enum Op : int32_t {
  kOpQkv = 1,        // RMSNorm + Q/K/V rows + RoPE + cache append, row groups of one KV group
  kOpAttention = 2,  // one split of one KV head's keys; the last split of the head combines
  kOpOProj = 3,      // O projection + residual
  kOpGateUp = 4,     // RMSNorm + gate/up rows + SiLU
  kOpDown = 5,       // down projection + residual
  kOpHead = 6,       // final RMSNorm + LM head rows (+ logits) + best token; the last task picks
};

// Status words after the counters: [abort flag, 1 + the failing task's index].
constexpr int kStatusWords = 2;

// Polls of one counter before a wait gives up: about 2-4 s at one L2 round trip (plus a short sleep)
// per poll, orders of magnitude above any real wait (a 1M-token attention stage takes milliseconds).
constexpr int64_t kMaxPolls = int64_t{1} << 22;

// The weights' formats (packed_decode.h WeightFormat codes), one build per combination: the attention
// matrices (Q, K, V, O), the MLP's (gate, up, down) and the LM head each have one. A format is a
// compile-time constant so that each task's dot products are the one loop its format needs (the
// kernel's registers are those of its hungriest path). lithos/custom_calls/megakernel/kernel.py
// picks the build from the weights it is given.
#ifndef LITHOS_MK_ATTENTION_FORMAT
#define LITHOS_MK_ATTENTION_FORMAT 0
#endif
#ifndef LITHOS_MK_MLP_FORMAT
#define LITHOS_MK_MLP_FORMAT 0
#endif
#ifndef LITHOS_MK_HEAD_FORMAT
#define LITHOS_MK_HEAD_FORMAT 0
#endif
constexpr WeightFormat kAttentionFormat = static_cast<WeightFormat>(LITHOS_MK_ATTENTION_FORMAT);
constexpr WeightFormat kMlpFormat = static_cast<WeightFormat>(LITHOS_MK_MLP_FORMAT);
constexpr WeightFormat kHeadFormat = static_cast<WeightFormat>(LITHOS_MK_HEAD_FORMAT);
// The O and down projections' formats where they differ from their group's (Q/K/V, gate/up): a Q4_K_M file keeps O
// and gate/up in Q4_K where its V and down mix Q4_K with Q6_K layers (read as K_MIX).
#ifndef LITHOS_MK_O_FORMAT
#define LITHOS_MK_O_FORMAT LITHOS_MK_ATTENTION_FORMAT
#endif
#ifndef LITHOS_MK_DOWN_FORMAT
#define LITHOS_MK_DOWN_FORMAT LITHOS_MK_MLP_FORMAT
#endif
constexpr WeightFormat kOFormat = static_cast<WeightFormat>(LITHOS_MK_O_FORMAT);
constexpr WeightFormat kDownFormat = static_cast<WeightFormat>(LITHOS_MK_DOWN_FORMAT);
static_assert(LITHOS_MK_ATTENTION_FORMAT >= 0 && LITHOS_MK_ATTENTION_FORMAT <= kLastWeightFormat &&
                  LITHOS_MK_MLP_FORMAT >= 0 && LITHOS_MK_MLP_FORMAT <= kLastWeightFormat &&
                  LITHOS_MK_HEAD_FORMAT >= 0 && LITHOS_MK_HEAD_FORMAT <= kLastWeightFormat &&
                  LITHOS_MK_O_FORMAT >= 0 && LITHOS_MK_O_FORMAT <= kLastWeightFormat &&
                  LITHOS_MK_DOWN_FORMAT >= 0 && LITHOS_MK_DOWN_FORMAT <= kLastWeightFormat,
              "LITHOS_MK_*_FORMAT must be a WeightFormat code (packed_decode.h)");

// The MLP's gate and up matrices in MXFP4 fragment tiles (lithos/quant/tiles.py, mk_gate_up_tiles.h), a build
// of its own: kernel.py asks for it when the weights it is given are laid out so.
#ifndef LITHOS_MK_GATE_UP_TILES
#define LITHOS_MK_GATE_UP_TILES 0
#endif
constexpr bool kGateUpTiles = LITHOS_MK_GATE_UP_TILES != 0;
static_assert(!kGateUpTiles || LITHOS_MK_MLP_FORMAT == 1, "fragment tiles hold MXFP4 gate and up rows");
// The MLP's down matrix, the O projection's and the Q/K/V matrices (in rotary tiles) in MXFP4 fragment tiles too
// (mk_tiled_matvec.h; CUDA: tensor cores), each a build of its own.
#ifndef LITHOS_MK_DOWN_TILES
#define LITHOS_MK_DOWN_TILES 0
#endif
#ifndef LITHOS_MK_O_TILES
#define LITHOS_MK_O_TILES 0
#endif
#ifndef LITHOS_MK_QKV_TILES
#define LITHOS_MK_QKV_TILES 0
#endif
constexpr bool kDownTiles = LITHOS_MK_DOWN_TILES != 0;
constexpr bool kOTiles = LITHOS_MK_O_TILES != 0;
constexpr bool kQkvTiles = LITHOS_MK_QKV_TILES != 0;
static_assert(!kDownTiles || LITHOS_MK_DOWN_FORMAT == 1, "fragment tiles hold MXFP4 down rows");
static_assert(!kOTiles || LITHOS_MK_O_FORMAT == 1, "fragment tiles hold MXFP4 O rows");
static_assert(!kQkvTiles || LITHOS_MK_ATTENTION_FORMAT == 1, "fragment tiles hold MXFP4 Q/K/V rows");

struct Args {
  const Task* tasks;
  int n_tasks;
  const bf16_t* h0;          // [tokens, hidden]: the embedded input tokens
  const int32_t* positions;  // [tokens]
  const float* inv_freq;     // [head_dim / 2]
  const bf16_t* attn_norm;   // [layers, hidden]
  const bf16_t* mlp_norm;    // [layers, hidden]
  const bf16_t* final_norm;  // [hidden]
  // Weights, bf16 or packed (kAttentionFormat for Q/K/V, kOFormat, kMlpFormat for gate/up, kDownFormat,
  // kHeadFormat), as planes stacked by layer:
  PackedWeight wq;           // [layers, heads * head_dim, hidden]
  PackedWeight wk;           // [layers, kv_heads * head_dim, hidden]
  PackedWeight wv;
  PackedWeight wo;           // [layers, hidden, heads * head_dim]
  PackedWeight w_gate;       // [layers, ffn, hidden]
  PackedWeight w_up;
  PackedWeight w_down;       // [layers, hidden, ffn]
  PackedWeight lm_head;      // [1, vocab, hidden]
  bf16_t* k_cache;           // [layers, 1, kv_heads, slots, head_dim], aliased
  bf16_t* v_cache;
  bf16_t* residual;          // [2, tokens, hidden]: after attention, after the MLP
  bf16_t* q;                 // [tokens, heads, head_dim]
  bf16_t* attn;              // [tokens, heads * head_dim]
  bf16_t* gated;             // [tokens, ffn]
  float* part_out;           // [kv_heads, max_splits, tokens * group, head_dim]: normalised split outputs
  float* part_lse;           // [kv_heads, max_splits, tokens * group]: their log2-sum-exp2
  float* best_value;         // [head tasks, tokens]
  int32_t* best_index;
  int32_t* tokens_out;       // [tokens]
  float* logits;             // [tokens, vocab] or nullptr
  int32_t* counters;         // [n_counters + kStatusWords]
  int64_t* trace;            // nullptr, or [n_tasks, kTraceFields] (LITHOS_MEGAKERNEL_TRACE, megakernel.cu)
  volatile int32_t* host_status;  // mapped host memory: 1 + the failing task, seen by the handler
  int tokens, hidden, heads, kv_heads, head_dim, ffn, vocab, slots, window, max_splits, n_counters;
  bool ring;                 // slot = position % slots (lithos/kv_cache.py; else slot = position)
  float eps;
  float scale_log2;          // log2(e) / sqrt(head_dim)
};

// A traced step records, per task: the block that ran it, when the block reached it, when its
// inputs were ready (the wait ended), when it had signalled, and up to five marks inside the task that
// say where its time goes (trace_clock ticks; 0 where a task has no such phase). The phases, as
// trace.py MATVEC_PHASES, TILED_MATVEC_PHASES and ATTENTION_PHASES name them:
// - matvec tasks (phases 0-2): inputs staged; warp 0's last dot products done; warp 0's epilogues done;
// - matvec tasks in fragment tiles, whose epilogue is the block's (0-3): inputs staged; warp 0's last dot
//   products done; the block's barrier passed (its slowest warp done); the epilogues done;
// - attention (0-4): warp 0's queries and first keys landed; its key loop done; its keys scored
//   (lanes merged); the split's partial written; its arrival counted (the last split of a head to
//   arrive then combines the head before its end).
constexpr int kTracePhases = 5;
enum TraceField { kTraceBlock = 0, kTraceBegin = 1, kTraceReady = 2, kTraceEnd = 3, kTracePhase = 4 };
constexpr int kTraceFields = kTracePhase + kTracePhases;

// A clock every SM/CU reads alike, so times of different blocks compare: CUDA's global timer (ns),
// CDNA's constant-rate real-time counter (`s_memrealtime`; the host converts its ticks).
__device__ __forceinline__ int64_t trace_clock() {
#if defined(LITHOS_HIP)
  return static_cast<int64_t>(__builtin_amdgcn_s_memrealtime());
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<int64_t>(t);
#endif
}

// Thread 0 of a traced step stamps `field` of task `task_index` with the time (kTraceBegin also
// names the block).
__device__ __forceinline__ void trace_mark(const Args& a, int task_index, int field) {
  if (a.trace == nullptr || threadIdx.x != 0) return;
  int64_t* record = a.trace + static_cast<size_t>(task_index) * kTraceFields;
  record[field] = trace_clock();
  if (field == kTraceBegin) record[kTraceBlock] = blockIdx.x;
}
// Thread 0 of a traced step marks the end of phase `phase` (< kTracePhases) of task `task_index`.
__device__ __forceinline__ void trace_phase(const Args& a, int task_index, int phase) {
  trace_mark(a, task_index, kTracePhase + phase);
}
// The same once `landed` (a value computed from loaded data) is in thread 0's registers: the branch on
// it makes the warp wait for those loads before it reads the clock, so a phase can end where data
// arrives rather than where its loads were issued.
__device__ __forceinline__ void trace_phase_when(const Args& a, int task_index, int phase, float landed) {
  if (a.trace == nullptr || threadIdx.x != 0) return;
  if (__float_as_uint(landed) == 0xffffffffu) return;  // never taken (no arithmetic makes this NaN)
  trace_phase(a, task_index, phase);
}

// ---------------------------------------------------------------------------------------------
// Device-scope synchronisation (CUDA: PTX acquire/release at .gpu scope; HIP: agent scope)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ int load_acquire(const int32_t* p) {
#if defined(LITHOS_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
#else
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Adds 1 with release and acquire semantics at device scope; returns the previous value.
__device__ __forceinline__ int fetch_add_acq_rel(int32_t* p) {
#if defined(LITHOS_HIP)
  return __hip_atomic_fetch_add(p, 1, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
#else
  int32_t old;
  asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
#endif
}

// Adds 1 with release semantics at device scope, without waiting for the old value.
__device__ __forceinline__ void add_release(int32_t* p) {
#if defined(LITHOS_HIP)
  (void)__hip_atomic_fetch_add(p, 1, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);  // no-return atomic
#else
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(p) : "memory");
#endif
}

__device__ __forceinline__ void pause_briefly() {
#if defined(LITHOS_HIP)
  __builtin_amdgcn_s_sleep(1);  // 64 clocks
#else
  __nanosleep(32);
#endif
}

// Raise the abort flag and record the first failing task for the host.
__device__ inline void abort_step(const Args& a, int task_index) {
  int32_t* status = a.counters + a.n_counters;
  atomicExch(status, 1);
  if (atomicCAS(status + 1, 0, task_index + 1) == 0 && a.host_status != nullptr) {
    *a.host_status = task_index + 1;
    __threadfence_system();
  }
}

__device__ __forceinline__ bool aborted(const Args& a) { return load_acquire(a.counters + a.n_counters) != 0; }

// Wait (warp 0 polls, the block meets at a barrier) until the task's input counter reaches its
// target. False when the step aborted. Every thread of the block calls it.
__device__ inline bool block_wait(const Args& a, const Task& task, int task_index) {
  __shared__ int ready;
  if (task.wait_counter < 0) {
    trace_mark(a, task_index, kTraceReady);
    return true;
  }
  const int32_t* counter = a.counters + task.wait_counter;
  if (warp_id() == 0) {
    int outcome = 0;
    for (int64_t poll = 0; outcome == 0; ++poll) {
      if (lane_id() == 0) {
        if (load_acquire(counter) >= task.wait_target) {
          outcome = 1;
        } else if ((poll & 255) == 255 && aborted(a)) {
          outcome = -1;
        } else if (poll >= kMaxPolls) {
          abort_step(a, task_index);
          outcome = -1;
        }
      }
      outcome = shfl_from(outcome, 0);
      if (outcome == 0) pause_briefly();
    }
    // The acquire load orders thread 0's later reads (and invalidates the SM's L1: `CCTL.IVALL` after
    // the load in SASS); the barrier below extends that to every thread of the block. No fence: a
    // seq_cst one (`__threadfence()`, MEMBAR.SC) on every hand-off cost time and ordered nothing more.
    if (lane_id() == 0) ready = outcome;
  }
  __syncthreads();
  const bool ok = ready == 1;
  __syncthreads();  // everyone has read `ready` before a later wait rewrites it
  trace_mark(a, task_index, kTraceReady);
  return ok;
}

// Publish this task's outputs: add 1 to `counter` after every thread's writes. Returns the previous
// value to every thread (the arrival order, for the reductions done by the last task to arrive).
__device__ inline int block_signal(const Args& a, int counter) {
  __shared__ int previous;
  __syncthreads();  // every thread's writes precede thread 0's release
  if (threadIdx.x == 0) {
    // The add's release half publishes the block's writes (cumulative over the barrier, as in
    // block_release); its acquire half orders the last arrival's reads of what the others wrote.
    previous = fetch_add_acq_rel(a.counters + counter);
  }
  __syncthreads();
  const int result = previous;
  __syncthreads();
  return result;
}

// Publish this task's outputs when no one needs the arrival order: a release reduction that thread 0
// does not wait for, so the block goes on to its next task while the signal travels. The barrier
// orders the block's writes before the release (cumulativity, NOTES.md).
__device__ inline void block_release(const Args& a, int counter) {
  __syncthreads();
  if (threadIdx.x == 0) add_release(a.counters + counter);
}

// A step whose every position is negative holds no token (a finished sequence's, in lithos.decode's
// fixed-length chunks): its writes to the caches are dropped (cache_slot), and the kernel ends such a step
// after each block's first task (megakernel.cu). One load in the common case: the first position is not
// negative.
__device__ __forceinline__ bool empty_step(const Args& a) {
  for (int t = 0; t < a.tokens; ++t)
    if (a.positions[t] >= 0) return false;
  return true;
}

// The residual stream: after layer l's attention half (slot 0) and after its MLP (slot 1); layer 0
// reads the embedded tokens.
__device__ __forceinline__ const bf16_t* layer_input(const Args& a, int layer) {
  return layer == 0 ? a.h0 : a.residual + static_cast<size_t>(a.tokens) * a.hidden;
}
__device__ __forceinline__ bf16_t* after_attention(const Args& a) { return a.residual; }
__device__ __forceinline__ bf16_t* after_mlp(const Args& a) {
  return a.residual + static_cast<size_t>(a.tokens) * a.hidden;
}

}  // namespace mk
}  // namespace lithos
