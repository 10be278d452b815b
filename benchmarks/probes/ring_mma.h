// What the two ring probes share (mxfp4_ring_mma.cu, bf16_ring_mma.cu): per-lane asynchronous copies
// of 16-byte chunks into a per-warp ring in shared memory, ldmatrix, the bf16 m16n8k16 mma, and the
// timing of a kernel's launches. CUDA (sm_80 and later) only, as the probes are.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                        \
  do {                                               \
    cudaError_t e = (x);                             \
    if (e != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e)); \
      exit(1);                                       \
    }                                                \
  } while (0)

constexpr int kWarps = 8, kThreads = kWarps * 32, kRows = 16;  // a warp's step covers 16 weight rows

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t to, const void* from) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(to), "l"(from) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copies `rows` rows of CHUNK bytes (row r from base + r * row_stride) into a ring stage at rows
// first_row.. of CHUNK bytes each, a warp instruction covering 512 contiguous bytes of one or two
// rows; 16-byte chunk j of row r lands at j ^ (r & 7), so ldmatrix reads 8 rows of a column without
// bank conflicts.
template <int CHUNK>
__device__ __forceinline__ void copy_rows(uint32_t stage, int first_row, int rows, const unsigned char* base,
                                          size_t row_stride, int lane) {
  constexpr int kRowsPerCopy = 512 / CHUNK, kLanesPerRow = 32 / kRowsPerCopy;
  const int chunk = lane % kLanesPerRow;
  for (int i = 0; i < rows / kRowsPerCopy; ++i) {
    const int r = i * kRowsPerCopy + lane / kLanesPerRow;
    cp_async16(stage + (first_row + r) * CHUNK + ((chunk ^ (r & 7)) * 16), base + r * row_stride + chunk * 16);
  }
}

// Lets `kernel` use `smem` bytes of dynamic shared memory; false, and a line naming the variant, when the
// GPU offers a block fewer.
template <class Kernel>
bool allow_shared_memory(Kernel kernel, size_t smem, const char* name) {
  int max_smem = 0;
  CK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  if (smem > static_cast<size_t>(max_smem)) {
    printf("%-40s skipped: %zu bytes of shared memory\n", name, smem);
    return false;
  }
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  return true;
}

// Blocks for `works` 16-row works of one warp each: one block of kWarps warps per SM at most.
inline int ring_blocks(int sms, int works) { return std::min(sms, (works + kWarps - 1) / kWarps); }

// Microseconds per launch of `launch(i)` (i: the launch's index), after 10 warm-up launches.
template <class Launch>
double launch_us(Launch launch, int iters) {
  for (int i = 0; i < 10; ++i) launch(i);
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) launch(i);
  cudaEventRecord(b);
  CK(cudaEventSynchronize(b));
  float ms;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms * 1000.0 / iters;
}
