// The persistent megakernel: one launch runs a whole batch-1 decode step for 1..16 query positions
// (every decoder layer, then the final norm, LM head and greedy token) as a list of tasks that the
// Python scheduler built (lithos/custom_calls/megakernel/schedule.py) and that its interpreter
// executes as the specification (interpreter.py).
//
// The grid is exactly the blocks that fit on the GPU at once (occupancy API); block b runs tasks
// b, b + grid, b + 2 grid, ... in order. The list is topologically ordered (every task waits only on
// counters signalled by earlier tasks), so the lowest unfinished task always has its inputs and its
// block is at it: no deadlock for any grid size, as long as all blocks are resident. Tasks hand data
// to each other through global memory and counters (mk_common.h; NOTES.md gives the ordering
// argument); one header per task kind:
//   mk_qkv.h        RMSNorm + Q/K/V rows of one KV group + RoPE + cache append
//   mk_attention.h  one length split of one KV head; the last split combines
//   mk_projection.h O projection + residual, down projection + residual
//   mk_tiled_matvec.h  Q/K/V, O or down over MXFP4 fragment tiles (mk_tiles.h: what the tiled tasks share)
//   mk_gate_up.h    RMSNorm + gate/up rows + SiLU (mk_gate_up_tiles.h: over MXFP4 fragment tiles)
//   mk_lm_head.h    final RMSNorm + LM head rows + best token (+ logits); the last task picks
// and the matvec tasks' common parts: mk_matvec.h (the loop), mk_weight_rows.h (which rows a task
// reads) and mk_lane_ring.h (those rows copied into shared memory ahead of the dot products, CUDA).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "ffi_util.h"
#include "mk_attention.h"
#include "mk_common.h"
#include "mk_gate_up.h"
#include "mk_gate_up_tiles.h"
#include "mk_lm_head.h"
#include "mk_projection.h"
#include "mk_qkv.h"
#include "mk_tiled_matvec.h"
#include "portable.h"

#if defined(LITHOS_HIP)
#define gpuMemsetAsync hipMemsetAsync
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuHostAllocMapped(p, n) hipHostMalloc(p, n, hipHostMallocMapped)
#define gpuHostGetDevicePointer hipHostGetDevicePointer
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemcpyToHost(dst, src, n) hipMemcpy(dst, src, n, hipMemcpyDeviceToHost)
#else
#define gpuMemsetAsync cudaMemsetAsync
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuHostAllocMapped(p, n) cudaHostAlloc(p, n, cudaHostAllocMapped)
#define gpuHostGetDevicePointer cudaHostGetDevicePointer
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemcpyToHost(dst, src, n) cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost)
#endif

namespace lithos {
namespace mk {
namespace {

// Blocks per SM/CU the compiler must leave registers for. 1: one 256-thread block per SM (NOTES.md);
// the occupancy API sizes the grid from whatever the compiler chose. A build may ask for more
// (LITHOS_KERNEL_DEFINES="LITHOS_MK_MIN_BLOCKS=2", lithos/custom_calls/build.py).
#ifndef LITHOS_MK_MIN_BLOCKS
#define LITHOS_MK_MIN_BLOCKS 1
#endif

// A task kind with no form in this build (tiles without tensor cores): the FFI refuses such a launch.
__device__ __forceinline__ bool no_form(const Args& a, int index) {
  if (threadIdx.x == 0) abort_step(a, index);
  return false;
}

// The O and down projections: one inlined copy when their formats agree, in rows or both in tiles. (A second copy of
// the task in the kernel measured 1.7% slower on the 1B step with nothing else changed: NOTES.md.)
template <int TMAX>
__device__ __forceinline__ bool any_projection_task(const Args& a, const Task& task, int index) {
  if constexpr (kDownTiles || kOTiles) {
#if LITHOS_MK_TILE_MMA
    if constexpr (!kDownTiles) {
      if (task.op == kOpDown) return projection_task<kDownFormat, TMAX>(a, task, index);
    } else if constexpr (!kOTiles) {
      if (task.op == kOpOProj) return projection_task<kOFormat, TMAX>(a, task, index);
    }
    return tiled_matvec_task<TMAX, ProjectionTiles>(a, task, index);
#else
    return no_form(a, index);
#endif
  } else if constexpr (kOFormat == kDownFormat) {
    return projection_task<kDownFormat, TMAX>(a, task, index);
  } else {
    return task.op == kOpOProj ? projection_task<kOFormat, TMAX>(a, task, index)
                               : projection_task<kDownFormat, TMAX>(a, task, index);
  }
}

template <int TMAX>
__device__ __forceinline__ bool any_qkv_task(const Args& a, const Task& task, int index) {
  if constexpr (kQkvTiles) {
#if LITHOS_MK_TILE_MMA
    return tiled_matvec_task<TMAX, QkvTiles>(a, task, index);
#else
    return no_form(a, index);
#endif
  } else {
    return qkv_task<TMAX>(a, task, index);
  }
}

template <int TMAX>
__global__ void __launch_bounds__(kMatvecThreads, LITHOS_MK_MIN_BLOCKS) megakernel(Args a) {
  for (int index = blockIdx.x; index < a.n_tasks; index += gridDim.x) {
    const Task task = a.tasks[index];
    trace_mark(a, index, kTraceBegin);
    bool ok = false;
    switch (task.op) {
      case kOpQkv: ok = any_qkv_task<TMAX>(a, task, index); break;
      case kOpAttention: ok = attention_task<TMAX>(a, task, index); break;
      case kOpOProj:
      case kOpDown: ok = any_projection_task<TMAX>(a, task, index); break;
      case kOpGateUp:
        if constexpr (kGateUpTiles) {
          ok = gate_up_tiles_task<TMAX>(a, task, index);
        } else {
          ok = gate_up_task<TMAX>(a, task, index);
        }
        break;
      case kOpHead: ok = head_task<TMAX>(a, task, index); break;
      default:
        if (threadIdx.x == 0) abort_step(a, index);
    }
    if (!ok) return;  // the step aborted: every block leaves (its ring's copies have landed: ring_drain)
    trace_mark(a, index, kTraceEnd);
    // A step at negative positions (a finished sequence's, lithos.decode.FIXED_CHUNK_PATHS) ends after each
    // block's first task. Tasks come in dependency order, so a first task waits only for lower ones, which
    // are other blocks' first tasks: none waits for a task that will not run. The test sits after the loads
    // the first task made: before them it cost 11 us a step (NOTES.md, "An empty step after the first task").
    if (index == static_cast<int>(blockIdx.x) && empty_step(a)) return;
  }
}

// Blocks of megakernel<TMAX> that fit on the GPU at once: the grid, and the scheduler's worker count.
// A kernel with dynamic shared memory (the lane ring's, mk_lane_ring.h) is first allowed it (above the
// default 48 KB).
template <int TMAX>
int grid_capacity() {
  if constexpr (kRingSmemBytes<TMAX> > 0) {
    static const bool allowed = gpuFuncSetAttribute(reinterpret_cast<const void*>(megakernel<TMAX>),
                                                    gpuFuncAttributeMaxDynamicSharedMemorySize,
                                                    kRingSmemBytes<TMAX>) == gpuSuccess;
    if (!allowed) return 0;
  }
  return compute_unit_count() * resident_blocks_per_unit<megakernel<TMAX>>(kMatvecThreads, kRingSmemBytes<TMAX>);
}

// One word of mapped host memory per device: the kernel writes 1 + the index of a task that waited
// too long; the handler reads it at its next call (or right after the launch when
// LITHOS_MEGAKERNEL_SYNC=1) and turns it into an error.
struct HostStatus {
  volatile int32_t* host = nullptr;
  int32_t* device = nullptr;
};

HostStatus host_status() {
  constexpr int kMaxDevices = 64;
  static HostStatus slots[kMaxDevices];
  static std::mutex lock;
  int device = 0;
  if (gpuGetDevice(&device) != gpuSuccess || device < 0 || device >= kMaxDevices) return {};
  std::lock_guard<std::mutex> guard(lock);
  if (slots[device].host == nullptr) {
    void* host = nullptr;
    void* on_device = nullptr;
    if (gpuHostAllocMapped(&host, 64) != gpuSuccess) return {};
    if (gpuHostGetDevicePointer(&on_device, host, 0) != gpuSuccess) return {};
    *static_cast<volatile int32_t*>(host) = 0;
    slots[device] = {static_cast<volatile int32_t*>(host), static_cast<int32_t*>(on_device)};
  }
  return slots[device];
}

ffi::Error timed_out(int32_t task_plus_one) {
  return ffi::Error::Internal(
      "lithos: megakernel task " + std::to_string(task_plus_one - 1) +
      " waited more than a few seconds for its inputs and the step was abandoned (a scheduling bug, or a grid "
      "larger than the GPU holds at once). lithos.custom_calls.megakernel.describe_task(schedule, " +
      std::to_string(task_plus_one - 1) + ") names the task; decode with kernels='fused' meanwhile");
}

// Nanoseconds per trace_clock tick: CUDA's global timer counts ns; HIP's wall clock runs at the
// device's wall-clock rate (kHz; HIP before 5.4 cannot ask, and CDNA's `s_memrealtime` runs at 100 MHz).
double trace_ns_per_tick() {
#if defined(LITHOS_HIP)
  int khz = 100000;
#if HIP_VERSION >= 50400000
  int device = 0;
  if (hipGetDevice(&device) != hipSuccess ||
      hipDeviceGetAttribute(&khz, hipDeviceAttributeWallClockRate, device) != hipSuccess || khz <= 0)
    return 0.0;
#endif
  return 1e6 / khz;
#else
  return 1.0;
#endif
}

// The weights after the fixed arguments, three planes each (packed_weights.py `planes`: data, scales,
// mins), in this order; the formats this build reads them in.
constexpr int kWeights = 8;
constexpr const char* kWeightNames[kWeights] = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"};
constexpr WeightFormat kWeightFormats[kWeights] = {kAttentionFormat, kAttentionFormat, kAttentionFormat, kOFormat,
                                                   kMlpFormat,       kMlpFormat,       kDownFormat,      kHeadFormat};

// LITHOS_MEGAKERNEL_TRACE=path: the step records per task which block ran it, when it began, had its
// inputs and had signalled, and its phase marks (mk_common.h trace_mark, trace_phase); the handler
// waits for the step and writes that record, with the task list and the model's sizes, to `path` as
// JSON, replacing the last step's. lithos.custom_calls.megakernel.trace reads it. A research tool:
// every traced step synchronises with the host.
class StepTrace {
 public:
  explicit StepTrace(const char* path) : path_(path != nullptr ? path : "") {}
  ~StepTrace() {
    if (buffer_ != nullptr) (void)gpuFree(buffer_);
  }
  bool enabled() const { return !path_.empty(); }

  // The device record for n_tasks tasks, zeroed on the stream; nullptr when tracing is off.
  ffi::Error start(int n_tasks, gpuStream_t stream, int64_t** record) {
    *record = nullptr;
    if (!enabled()) return ffi::Error::Success();
    bytes_ = sizeof(int64_t) * kTraceFields * static_cast<size_t>(n_tasks);
    if (gpuMalloc(reinterpret_cast<void**>(&buffer_), bytes_) != gpuSuccess ||
        gpuMemsetAsync(buffer_, 0, bytes_, stream) != gpuSuccess)
      return ffi::Error::Internal("lithos: megakernel trace: no device memory for " + std::to_string(bytes_) +
                                  " bytes of records; unset LITHOS_MEGAKERNEL_TRACE");
    *record = buffer_;
    return ffi::Error::Success();
  }

  ffi::Error write(const Args& a, int64_t layers, int grid, gpuStream_t stream) {
    std::vector<int64_t> record(bytes_ / sizeof(int64_t));
    std::vector<int32_t> tasks(static_cast<size_t>(a.n_tasks) * kFields);
    std::vector<int32_t> positions(a.tokens);
    if (gpuStreamSynchronize(stream) != gpuSuccess || gpuMemcpyToHost(record.data(), buffer_, bytes_) != gpuSuccess ||
        gpuMemcpyToHost(tasks.data(), a.tasks, tasks.size() * sizeof(int32_t)) != gpuSuccess ||
        gpuMemcpyToHost(positions.data(), a.positions, positions.size() * sizeof(int32_t)) != gpuSuccess)
      return launch_status("megakernel (trace read-back)");
    std::ofstream out(path_, std::ios::trunc);
    out << "{\"ns_per_tick\": " << trace_ns_per_tick() << ", \"grid\": " << grid << ", \"layers\": " << layers
        << ", \"tokens\": " << a.tokens << ", \"hidden\": " << a.hidden << ", \"heads\": " << a.heads
        << ", \"kv_heads\": " << a.kv_heads << ", \"head_dim\": " << a.head_dim << ", \"ffn\": " << a.ffn
        << ", \"vocab\": " << a.vocab << ", \"slots\": " << a.slots << ", \"ring\": " << (a.ring ? "true" : "false");
    // The weights' formats (packed_weights.py FORMAT_CODES): the bytes each stage reads (trace.py stage_bytes).
    out << ", \"formats\": {";
    for (int i = 0; i < kWeights; ++i)
      out << (i ? ", " : "") << "\"" << kWeightNames[i] << "\": " << static_cast<int>(kWeightFormats[i]);
    out << "}, \"positions\": [";
    for (int t = 0; t < a.tokens; ++t) out << (t ? ", " : "") << positions[t];
    // The task's fields (mk_common.h Task, tasks.py FIELDS), then its block and times.
    out << "],\n\"fields\": [";
    for (const char* name : kFieldNames) out << "\"" << name << "\", ";
    out << "\"block\", \"begin\", \"ready\", \"end\"";
    for (int p = 0; p < kTracePhases; ++p) out << ", \"phase" << p << "\"";
    out << "],\n\"tasks\": [";
    for (int i = 0; i < a.n_tasks; ++i) {
      out << (i ? ",\n" : "\n") << "[";
      for (int f = 0; f < kFields; ++f) out << tasks[static_cast<size_t>(i) * kFields + f] << ", ";
      const int64_t* times = &record[static_cast<size_t>(i) * kTraceFields];
      out << times[kTraceBlock] << ", " << times[kTraceBegin] << ", " << times[kTraceReady] << ", "
          << times[kTraceEnd];
      for (int p = 0; p < kTracePhases; ++p) out << ", " << times[kTracePhase + p];
      out << "]";
    }
    out << "]}\n";
    out.close();
    if (!out) return ffi::Error::Internal("lithos: megakernel trace: could not write " + path_);
    return ffi::Error::Success();
  }

 private:
  std::string path_;
  int64_t* buffer_ = nullptr;
  size_t bytes_ = 0;
};

bool same_elements(const ffi::Buffer<ffi::BF16>& buffer, int64_t expected) {
  return static_cast<int64_t>(buffer.element_count()) == expected;
}

// Weight i's planes, checked against this build's format for it, as a PackedWeight over n_in inputs
// (stacked [layers, out, in / elements per byte]; the head [1, vocab, ...]).
ffi::Error weight_planes(const ffi::RemainingArgs& planes, int i, int64_t n_in, PackedWeight& w) {
  const std::string op = std::string("megakernel: ") + kWeightNames[i];
  auto data = planes.get<ffi::AnyBuffer>(3 * i);
  auto scales = planes.get<ffi::AnyBuffer>(3 * i + 1);
  auto mins = planes.get<ffi::AnyBuffer>(3 * i + 2);
  if (!data.has_value() || !scales.has_value() || !mins.has_value())
    return invalid("megakernel: expected three planes (data, scales, mins) for each of " +
                   std::to_string(kWeights) + " weights after the fixed arguments");
  return packed_weight(op, static_cast<int32_t>(kWeightFormats[i]), *data, *scales, *mins, 1, n_in, w);
}

ffi::Error megakernel_impl(
    gpuStream_t stream, ffi::Buffer<ffi::BF16> h0, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
    ffi::Buffer<ffi::BF16> attn_norm, ffi::Buffer<ffi::BF16> mlp_norm, ffi::Buffer<ffi::BF16> final_norm,
    ffi::Buffer<ffi::S32> tasks, ffi::Buffer<ffi::BF16> /*k_cache_in*/, ffi::Buffer<ffi::BF16> /*v_cache_in*/,
    ffi::RemainingArgs weight_args, ffi::Result<ffi::Buffer<ffi::BF16>> k_cache,
    ffi::Result<ffi::Buffer<ffi::BF16>> v_cache, ffi::Result<ffi::Buffer<ffi::BF16>> residual,
    ffi::Result<ffi::Buffer<ffi::S32>> tokens_out, ffi::Result<ffi::Buffer<ffi::F32>> logits,
    ffi::Result<ffi::Buffer<ffi::BF16>> q, ffi::Result<ffi::Buffer<ffi::BF16>> attn,
    ffi::Result<ffi::Buffer<ffi::BF16>> gated, ffi::Result<ffi::Buffer<ffi::F32>> part_out,
    ffi::Result<ffi::Buffer<ffi::F32>> part_lse, ffi::Result<ffi::Buffer<ffi::F32>> best_value,
    ffi::Result<ffi::Buffer<ffi::S32>> best_index, ffi::Result<ffi::Buffer<ffi::S32>> counters, float eps,
    int64_t window, bool ring, int64_t max_splits, int64_t n_counters) {
  const HostStatus status = host_status();
  if (status.host == nullptr) return ffi::Error::Internal("lithos: megakernel: mapped host memory is unavailable");
  if (const int32_t failed = *status.host; failed != 0) {  // an earlier step timed out
    *status.host = 0;
    return timed_out(failed);
  }

  auto hd = h0.dimensions();
  auto cd = k_cache->dimensions();
  if (hd.size() != 2 || cd.size() != 5)
    return invalid("megakernel: expected h0 [tokens, hidden] and caches [layers, batch, kv_heads, slots, head_dim]; "
                   "got h0 " + shape_string(hd) + ", cache " + shape_string(cd));
  if (cd[1] != 1)
    return invalid("megakernel: decodes batch 1, the cache has batch " + std::to_string(cd[1]));
  if (weight_args.size() != 3 * kWeights)
    return invalid("megakernel: expected " + std::to_string(3 * kWeights) + " weight planes, got " +
                   std::to_string(weight_args.size()));
  Args a{};
  a.tokens = static_cast<int>(hd[0]);
  a.hidden = static_cast<int>(hd[1]);
  const int64_t layers = cd[0];
  a.kv_heads = static_cast<int>(cd[2]);
  a.slots = static_cast<int>(cd[3]);
  a.head_dim = static_cast<int>(cd[4]);
  const int64_t D = a.hidden, KD = int64_t{a.kv_heads} * a.head_dim;
  // Q, gate and the head give the sizes the others must match (their rows are read over D inputs).
  for (const auto& [i, w] : {std::pair<int, PackedWeight*>{0, &a.wq}, {1, &a.wk}, {2, &a.wv}, {4, &a.w_gate},
                             {5, &a.w_up}, {7, &a.lm_head}})
    if (const ffi::Error err = weight_planes(weight_args, i, D, *w); err.failure()) return err;
  a.heads = a.head_dim > 0 ? static_cast<int>(a.wq.n_out / a.head_dim) : 0;
  a.ffn = a.w_gate.n_out;
  a.vocab = a.lm_head.n_out;
  const int64_t F = a.ffn, QD = int64_t{a.heads} * a.head_dim;
  if (const ffi::Error err = weight_planes(weight_args, 3, QD, a.wo); err.failure()) return err;
  if (const ffi::Error err = weight_planes(weight_args, 6, F, a.w_down); err.failure()) return err;
  if (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256)
    return invalid("megakernel: head_dim " + std::to_string(a.head_dim) + " has no kernel (64, 128, 256); use "
                   "kernels='reference'");
  if (a.kv_heads <= 0 || a.heads % a.kv_heads != 0 || int64_t{a.heads} * a.head_dim != a.wq.n_out)
    return invalid("megakernel: wq's " + std::to_string(a.wq.n_out) + " rows do not hold whole heads of " +
                   std::to_string(a.head_dim) + " for " + std::to_string(a.kv_heads) + " KV heads");
  if (a.hidden % 8 != 0 || a.ffn % 8 != 0)
    return invalid("megakernel: hidden " + std::to_string(a.hidden) + " and ffn " + std::to_string(a.ffn) +
                   " must be multiples of 8 (16-byte rows); use kernels='fused'");
  if ((kDownTiles || kOTiles || kQkvTiles) && !LITHOS_MK_TILE_MMA)
    return invalid("megakernel: Q/K/V, O and down in fragment tiles need CUDA tensor cores; keep them in rows "
                   "(LITHOS_TILES)");
  if (kDownTiles && (a.ffn % kTileInputs != 0 || a.hidden % kTileRows != 0))
    return invalid("megakernel: down in fragment tiles needs ffn a multiple of 64 and hidden of 16 (got " +
                   std::to_string(a.ffn) + " and " + std::to_string(a.hidden) + "); keep it in rows");
  if (kOTiles && (QD % kTileInputs != 0 || a.hidden % kTileRows != 0))
    return invalid("megakernel: O in fragment tiles needs heads x head_dim a multiple of 64 and hidden of 16 (got " +
                   std::to_string(QD) + " and " + std::to_string(a.hidden) + "); keep it in rows");
  if (kQkvTiles && a.hidden % kTileInputs != 0)
    return invalid("megakernel: Q/K/V in fragment tiles needs hidden a multiple of 64, got " +
                   std::to_string(a.hidden) + "; keep them in rows");
  if (kGateUpTiles && (a.hidden % kTileInputs != 0 || a.ffn % kTileRows != 0))
    return invalid("megakernel: gate and up in fragment tiles need hidden a multiple of 64 and ffn of 16, got " +
                   std::to_string(a.hidden) + " and " + std::to_string(a.ffn) + "; keep them in rows");
  // Weight i has `rows` rows in each of its matrices: `layers` of them (the head: one).
  auto fits = [&](int i, const PackedWeight& w, int64_t rows) {
    return w.n_out == rows && weight_args.get<ffi::AnyBuffer>(3 * i)->dimensions()[0] == (i == 7 ? 1 : layers);
  };
  if (!fits(0, a.wq, QD) || !fits(1, a.wk, KD) || !fits(2, a.wv, KD) || !fits(3, a.wo, D) || !fits(4, a.w_gate, F) ||
      !fits(5, a.w_up, F) || !fits(6, a.w_down, D) || !fits(7, a.lm_head, a.vocab) ||
      !same_elements(attn_norm, layers * D) || !same_elements(mlp_norm, layers * D) || !same_elements(final_norm, D))
    return invalid("megakernel: the weights do not fit " + std::to_string(layers) + " layers of hidden " +
                   std::to_string(D) + ", " + std::to_string(a.heads) + "/" + std::to_string(a.kv_heads) +
                   " heads of " + std::to_string(a.head_dim) + ", ffn " + std::to_string(F));
  if (positions.element_count() != static_cast<size_t>(a.tokens) ||
      inv_freq.element_count() != static_cast<size_t>(a.head_dim / 2))
    return invalid("megakernel: positions must be [tokens] and inv_freq [head_dim / 2]");
  auto td = tasks.dimensions();
  if (td.size() != 2 || td[1] != kFields)
    return invalid("megakernel: tasks must be [n, " + std::to_string(kFields) + "], got " + shape_string(td));
  const int64_t rows = int64_t{a.tokens} * (a.heads / a.kv_heads);
  if (max_splits < 1 || part_lse->element_count() != static_cast<size_t>(a.kv_heads * max_splits * rows) ||
      part_out->element_count() != part_lse->element_count() * a.head_dim)
    return invalid("megakernel: attention scratch must be [kv_heads, max_splits, tokens * group(, head_dim)]");
  if (n_counters < 1 || counters->element_count() != static_cast<size_t>(n_counters + kStatusWords))
    return invalid("megakernel: counters must hold n_counters + " + std::to_string(kStatusWords) + " words");
  if (best_value->dimensions().size() != 2 || best_value->dimensions()[1] != a.tokens ||
      best_index->element_count() != best_value->element_count())
    return invalid("megakernel: head scratch must be [head tasks, tokens]");
  if (logits->element_count() != 0 && logits->element_count() != static_cast<size_t>(int64_t{a.tokens} * a.vocab))
    return invalid("megakernel: logits must be [tokens, vocab] or empty");
  if (residual->element_count() != static_cast<size_t>(2 * a.tokens * D) ||
      attn->element_count() != static_cast<size_t>(a.tokens * QD) || q->element_count() != attn->element_count() ||
      gated->element_count() != static_cast<size_t>(a.tokens * F))
    return invalid("megakernel: activation scratch has the wrong size");

  a.tasks = reinterpret_cast<const Task*>(tasks.typed_data());
  a.n_tasks = static_cast<int>(td[0]);
  a.h0 = h0.typed_data();
  a.positions = positions.typed_data();
  a.inv_freq = inv_freq.typed_data();
  a.attn_norm = attn_norm.typed_data();
  a.mlp_norm = mlp_norm.typed_data();
  a.final_norm = final_norm.typed_data();
  a.k_cache = k_cache->typed_data();
  a.v_cache = v_cache->typed_data();
  a.residual = residual->typed_data();
  a.q = q->typed_data();
  a.attn = attn->typed_data();
  a.gated = gated->typed_data();
  a.part_out = part_out->typed_data();
  a.part_lse = part_lse->typed_data();
  a.best_value = best_value->typed_data();
  a.best_index = best_index->typed_data();
  a.tokens_out = tokens_out->typed_data();
  a.logits = logits->element_count() ? logits->typed_data() : nullptr;
  a.counters = counters->typed_data();
  a.host_status = status.device;
  a.window = static_cast<int>(window);
  a.ring = ring;
  if (ring && (window < 1 || window + a.tokens - 1 > a.slots))
    return invalid("megakernel: a ring cache of " + std::to_string(a.slots) + " slots holds the newest " +
                   std::to_string(a.slots) + " positions only; " + std::to_string(a.tokens) + " queries need a window "
                   "W >= 1 with W + tokens - 1 <= slots, got " + std::to_string(window));
  a.max_splits = static_cast<int>(max_splits);
  a.n_counters = static_cast<int>(n_counters);
  a.eps = eps;
  a.scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(a.head_dim)));
  for (const void* p : {static_cast<const void*>(a.h0), static_cast<const void*>(a.attn_norm),
                        static_cast<const void*>(a.mlp_norm), static_cast<const void*>(a.final_norm),
                        static_cast<const void*>(a.k_cache), static_cast<const void*>(a.v_cache),
                        static_cast<const void*>(a.q), static_cast<const void*>(a.attn),
                        static_cast<const void*>(a.gated), static_cast<const void*>(a.residual)})
    if (!aligned16(p)) return invalid("megakernel: every weight and activation buffer must be 16-byte aligned");
  for (const PackedWeight* w : {&a.wq, &a.wk, &a.wv, &a.wo, &a.w_gate, &a.w_up, &a.w_down, &a.lm_head})
    if (!packed_aligned(*w)) return invalid("megakernel: every weight and activation buffer must be 16-byte aligned");

  // Counters start at zero every step; the memset runs on the stream, before the kernel.
  if (gpuMemsetAsync(a.counters, 0, sizeof(int32_t) * (n_counters + kStatusWords), stream) != gpuSuccess)
    return launch_status("megakernel (counter reset)");
  StepTrace trace(std::getenv("LITHOS_MEGAKERNEL_TRACE"));
  if (const ffi::Error started = trace.start(a.n_tasks, stream, &a.trace); started.failure()) return started;
  int grid = 0;
  const ffi::Error launched = with_token_bucket(a.tokens, [&](auto tmax) {
    constexpr int kTmax = decltype(tmax)::value;
    const int capacity = grid_capacity<kTmax>();
    if (capacity <= 0)
      return invalid("megakernel: this GPU cannot hold a block with " +
                     std::to_string(kRingSmemBytes<kTmax> / 1024) +
                     " KB of dynamic shared memory for its weight streaming; decode with kernels='fused', or rebuild "
                     "with a smaller lane ring (LITHOS_KERNEL_DEFINES=\"LITHOS_MK_LANE_RING=3 LITHOS_MK_RING_INPUT_KB=32\", "
                     "or LITHOS_MK_LANE_RING=0 for none)");
    grid = std::min(capacity, std::max(a.n_tasks, 1));
    megakernel<kTmax><<<grid, kMatvecThreads, kRingSmemBytes<kTmax>, stream>>>(a);
    return launch_status("megakernel");
  });
  if (launched.failure()) return launched;
  if (trace.enabled())
    if (const ffi::Error written = trace.write(a, layers, grid, stream); written.failure()) return written;
  const char* sync = std::getenv("LITHOS_MEGAKERNEL_SYNC");
  if (sync != nullptr && sync[0] == '1') {
    if (gpuStreamSynchronize(stream) != gpuSuccess) return launch_status("megakernel (synchronised check)");
    if (const int32_t failed = *status.host; failed != 0) {
      *status.host = 0;
      return timed_out(failed);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mk
}  // namespace lithos

// Blocks of the megakernel for `tokens` query positions that fit on the current GPU at once (the
// scheduler sizes its tasks for that many workers); negative when `tokens` is out of range. The scheduler
// asks before any step runs, so the one-time setup (the kernel's shared-memory attribute, the mapped status
// word) happens here, outside any command buffer XLA may be recording.
extern "C" int LithosMegakernelBlocks(int tokens) {
  (void)lithos::mk::host_status();
  int blocks = -1;
  const auto status = lithos::with_token_bucket(tokens, [&](auto tmax) {
    blocks = lithos::mk::grid_capacity<decltype(tmax)::value>();
    return lithos::ffi::Error::Success();
  });
  return status.failure() ? -1 : blocks;
}

namespace ffi = xla::ffi;

namespace lithos {
namespace mk {
namespace {

// The handler's arguments, results and attributes, in kernel.py's call order.
auto megakernel_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<gpuStream_t>>()
      .Arg<ffi::Buffer<ffi::BF16>>()  // h0: embedded tokens
      .Arg<ffi::Buffer<ffi::S32>>()   // positions
      .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq
      .Arg<ffi::Buffer<ffi::BF16>>()  // attention norms
      .Arg<ffi::Buffer<ffi::BF16>>()  // MLP norms
      .Arg<ffi::Buffer<ffi::BF16>>()  // final norm
      .Arg<ffi::Buffer<ffi::S32>>()   // tasks [n, 10]
      .Arg<ffi::Buffer<ffi::BF16>>()  // k cache (aliased to output 0)
      .Arg<ffi::Buffer<ffi::BF16>>()  // v cache (aliased to output 1)
      .RemainingArgs()                // weight planes (kWeightNames, 3 each)
      .Ret<ffi::Buffer<ffi::BF16>>()  // k cache
      .Ret<ffi::Buffer<ffi::BF16>>()  // v cache
      .Ret<ffi::Buffer<ffi::BF16>>()  // residual stream [2, tokens, hidden]
      .Ret<ffi::Buffer<ffi::S32>>()   // greedy tokens
      .Ret<ffi::Buffer<ffi::F32>>()   // logits or empty
      .Ret<ffi::Buffer<ffi::BF16>>()  // scratch: q
      .Ret<ffi::Buffer<ffi::BF16>>()  // scratch: attention output
      .Ret<ffi::Buffer<ffi::BF16>>()  // scratch: gated MLP activations
      .Ret<ffi::Buffer<ffi::F32>>()   // scratch: attention split outputs
      .Ret<ffi::Buffer<ffi::F32>>()   // scratch: their log2-sum-exp2
      .Ret<ffi::Buffer<ffi::F32>>()   // scratch: head bests (value)
      .Ret<ffi::Buffer<ffi::S32>>()   // scratch: head bests (id)
      .Ret<ffi::Buffer<ffi::S32>>()   // counters + status
      .Attr<float>("eps")
      .Attr<int64_t>("window")
      .Attr<bool>("ring")  // slot = position % slots
      .Attr<int64_t>("max_splits")
      .Attr<int64_t>("n_counters");
}

}  // namespace
}  // namespace mk
}  // namespace lithos

// Not command-buffer compatible: the handler reads the previous step's timeout status on each call, which a
// recorded command buffer (a CUDA graph) would not repeat. Declaring it compatible, so that XLA could record a
// whole decode loop with its condition on the device, made the engine's loop slower (NOTES.md, run 72).
XLA_FFI_DEFINE_HANDLER_SYMBOL(LithosMegakernel, lithos::mk::megakernel_impl, lithos::mk::megakernel_binding());
