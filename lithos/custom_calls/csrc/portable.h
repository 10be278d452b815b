// Portability layer: every kernel source under csrc/ compiles unchanged with nvcc (CUDA) and with
// hipcc (HIP, `-x hip`). Kernels use only the names defined here for anything that differs between
// the two: the stream type, launch checks, the warp/wavefront width, shuffles, cache-hinted 16-byte
// loads, bf16 conversions and atomics.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define LITHOS_HIP 1
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
#define gpuSuccess hipSuccess
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuGetDevice hipGetDevice
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuAttrComputeUnitCount hipDeviceAttributeMultiprocessorCount
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuFuncSetAttribute hipFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#ifndef LITHOS_WARP_SIZE
// CDNA (gfx90a, gfx942, gfx950) runs wave64. RDNA builds would pass -DLITHOS_WARP_SIZE=32.
#define LITHOS_WARP_SIZE 64
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != LITHOS_WARP_SIZE
#error "LITHOS_WARP_SIZE does not match the target's wavefront size"
#endif
#else
#include <cuda_runtime.h>
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
#define gpuSuccess cudaSuccess
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuGetDevice cudaGetDevice
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuAttrComputeUnitCount cudaDevAttrMultiProcessorCount
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuFuncSetAttribute cudaFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define LITHOS_WARP_SIZE 32
#endif

#include "xla/ffi/api/ffi.h"

namespace lithos {

namespace ffi = xla::ffi;

// A compile-time constant on both the host and the device side, so grids and unrolled loops use it.
constexpr int WARP_SIZE = LITHOS_WARP_SIZE;

// bf16 travels as its raw 16 bits: HIP 5.2 ships no __hip_bfloat16 arithmetic, and a shift is all a
// conversion to float needs on either vendor.
using bf16_t = uint16_t;

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) % WARP_SIZE; }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) / WARP_SIZE; }

// ---------------------------------------------------------------------------------------------
// Shuffles and reductions
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float shfl_xor(float v, int mask) {
#if defined(LITHOS_HIP)
  return __shfl_xor(v, mask, WARP_SIZE);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, WARP_SIZE);
#endif
}

__device__ __forceinline__ int shfl_xor(int v, int mask) {
#if defined(LITHOS_HIP)
  return __shfl_xor(v, mask, WARP_SIZE);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, WARP_SIZE);
#endif
}

// The warp's lanes meet: writes to shared memory before it are visible to the warp's lanes after it (with
// __threadfence_block for the order of their own accesses). A wavefront runs in lockstep.
__device__ __forceinline__ void warp_sync() {
#if defined(LITHOS_HIP)
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// Lane `source`'s v, to every lane of the warp.
__device__ __forceinline__ int shfl_from(int v, int source) {
#if defined(LITHOS_HIP)
  return __shfl(v, source, WARP_SIZE);
#else
  return __shfl_sync(0xffffffffu, v, source, WARP_SIZE);
#endif
}

// Sum over aligned groups of WIDTH lanes (WIDTH a power of two <= WARP_SIZE); every lane of a group
// ends with the group's total.
template <int WIDTH = WARP_SIZE>
__device__ __forceinline__ float group_sum(float v) {
  static_assert(WIDTH <= WARP_SIZE && (WIDTH & (WIDTH - 1)) == 0, "WIDTH must be a power of two");
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) v += shfl_xor(v, mask);
  return v;
}

template <int WIDTH = WARP_SIZE>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) v = fmaxf(v, shfl_xor(v, mask));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) { return group_sum<WARP_SIZE>(v); }

__device__ __forceinline__ float atomic_add(float* address, float value) { return atomicAdd(address, value); }

// ---------------------------------------------------------------------------------------------
// bf16 <-> float
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float bf16_to_float(bf16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

// Round to nearest even, as XLA does; NaN stays NaN.
__device__ __forceinline__ bf16_t float_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

// `f` rounded to bf16 and back: a value as a bf16 array holds it.
__device__ __forceinline__ float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// The gated MLPs' activation, g * sigmoid(g), in f32 (every gate/up kernel's, the megakernel's too).
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// Element i of two bf16 packed in a 32-bit word (element 0 is at the lower address: the low half).
__device__ __forceinline__ float bf16_pair_at(uint32_t pair, int i) {
  return __uint_as_float(i == 0 ? pair << 16 : pair & 0xffff0000u);
}

// ---------------------------------------------------------------------------------------------
// Vector loads: VEC consecutive bf16 in one access (16 bytes for VEC = 8)
// ---------------------------------------------------------------------------------------------

template <int VEC>
struct Bf16Vec;

template <>
struct Bf16Vec<8> {
  uint32_t pair[4];
  __device__ __forceinline__ float operator[](int i) const { return bf16_pair_at(pair[i / 2], i % 2); }
};

template <>
struct Bf16Vec<1> {
  bf16_t value;
  __device__ __forceinline__ float operator[](int) const { return bf16_to_float(value); }
};

#if defined(LITHOS_HIP)
typedef uint32_t u32x4_t __attribute__((ext_vector_type(4)));
#endif

// Weights are streamed: read once per step, so keep them from evicting activations out of L1.
template <int VEC>
__device__ __forceinline__ Bf16Vec<VEC> load_streaming(const bf16_t* p);

template <>
__device__ __forceinline__ Bf16Vec<8> load_streaming<8>(const bf16_t* p) {
  Bf16Vec<8> out;
#if defined(LITHOS_HIP)
  u32x4_t v = __builtin_nontemporal_load(reinterpret_cast<const u32x4_t*>(p));
  out.pair[0] = v.x; out.pair[1] = v.y; out.pair[2] = v.z; out.pair[3] = v.w;
#else
  uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
  out.pair[0] = v.x; out.pair[1] = v.y; out.pair[2] = v.z; out.pair[3] = v.w;
#endif
  return out;
}

template <>
__device__ __forceinline__ Bf16Vec<1> load_streaming<1>(const bf16_t* p) {
  return Bf16Vec<1>{*p};
}

// Activations and cache rows are re-read by other warps of the block: default (cached) loads.
template <int VEC>
__device__ __forceinline__ Bf16Vec<VEC> load_cached(const bf16_t* p);

template <>
__device__ __forceinline__ Bf16Vec<8> load_cached<8>(const bf16_t* p) {
  Bf16Vec<8> out;
#if defined(LITHOS_HIP)
  u32x4_t v = *reinterpret_cast<const u32x4_t*>(p);
  out.pair[0] = v.x; out.pair[1] = v.y; out.pair[2] = v.z; out.pair[3] = v.w;
#else
  uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  out.pair[0] = v.x; out.pair[1] = v.y; out.pair[2] = v.z; out.pair[3] = v.w;
#endif
  return out;
}

template <>
__device__ __forceinline__ Bf16Vec<1> load_cached<1>(const bf16_t* p) {
  return Bf16Vec<1>{*p};
}

// ---------------------------------------------------------------------------------------------
// Host side: launches and device facts
// ---------------------------------------------------------------------------------------------

// Call right after a launch: turns a launch failure into an FFI error that names the kernel.
inline ffi::Error launch_status(const char* kernel) {
  gpuError_t err = gpuGetLastError();
  if (err == gpuSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("lithos: launching ") + kernel + " failed: " + gpuGetErrorString(err));
}

// Streaming multiprocessors (CUDA) or compute units (ROCm) of the current device, read once per device.
inline int compute_unit_count() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {0};
  int device = 0;
  if (gpuGetDevice(&device) != gpuSuccess || device < 0 || device >= kMaxDevices) return 132;
  if (cached[device] == 0) {
    int count = 0;
    if (gpuDeviceGetAttribute(&count, gpuAttrComputeUnitCount, device) != gpuSuccess || count <= 0) count = 132;
    cached[device] = count;
  }
  return cached[device];
}

// Blocks of `Kernel` (launched with `threads` threads and `dynamic_smem` bytes of dynamic shared
// memory, fixed per kernel) that fit on one SM/CU at once, read once per kernel and block size: a
// persistent grid of exactly that many per SM/CU runs in one wave.
template <auto Kernel>
inline int resident_blocks_per_unit(int threads, size_t dynamic_smem = 0) {
  // One slot per block size in warps; 0 = not read yet. Racing first readers store the same value.
  static std::atomic<int> cached[1024 / WARP_SIZE + 1];
  const int slot = std::min(std::max(threads / WARP_SIZE, 0), 1024 / WARP_SIZE);
  int n = cached[slot].load(std::memory_order_relaxed);
  if (n == 0) {
    if (gpuOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, dynamic_smem) != gpuSuccess || n < 1) n = 1;
    cached[slot].store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace lithos
