// Standalone probe (CUDA only, not part of the library): how fast one block per SM streams global
// memory into shared memory with 1D bulk copies (cp.async.bulk + mbarrier), by copy size, tiles in
// flight, and what the issuing thread does between tiles. It decides the megakernel's weight pipeline
// (csrc/mk_weight_pipe.h); results: lithos/custom_calls/NOTES.md, "Weights through shared memory".
//   nvcc -O3 -std=c++17 -arch=sm_90a -o bulk_copy bulk_copy.cu && ./bulk_copy
// Modes: 0 = one warp issues and waits (lane i issues copy i of a tile); 1 = the same, and the
// issuing lane also runs a block-scope fence and a shared atomic after each tile (as the megakernel's
// lane 0 does); 2 = eight warps read every tile (16 bytes per lane) and arrive on an `empty` barrier,
// warp 0 issues (the megakernel's shape without the arithmetic).
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* b, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(n) : "memory"); }
__device__ __forceinline__ bool bar_test(uint64_t* b, int parity) {
  uint32_t d;
  asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(d) : "r"(sa(b)), "r"(parity) : "memory");
  return d != 0;
}
__device__ __forceinline__ void bar_wait(uint64_t* b, int parity) {
  uint32_t d = 0;
  while (!d) asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(d) : "r"(sa(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory"); }
__device__ __forceinline__ void bar_expect(uint64_t* b, uint32_t n) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(n) : "memory"); }
__device__ __forceinline__ void bulk(void* dst, const void* src, uint32_t n, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(dst)), "l"(src), "r"(n), "r"(sa(b)) : "memory");
}

constexpr int kStages = 8, kTile = 16384;

__global__ void stream(const char* src, size_t per_block, int copy_bytes, int in_flight, int mode, float* sink) {
  extern __shared__ __align__(128) char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kTile);
  uint64_t* empty = full + kStages;
  __shared__ int counter;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) { bar_init(&full[s], 1); bar_init(&empty[s], warps); }
    counter = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const char* base = src + blockIdx.x * per_block;
  const int tiles = static_cast<int>(per_block / kTile), copies = kTile / copy_bytes;
  float acc = 0.0f;
  int issued = 0;
  auto pump = [&]() {  // warp 0: issue while the ring has room, never wait
    while (issued < tiles) {
      const int s = issued % kStages, landed = issued - in_flight;
      int room = 1;
      if (lane == 0)
        room = (issued < kStages || bar_test(&empty[s], (issued / kStages - 1) & 1)) &&
               (landed < 0 || bar_test(&full[landed % kStages], (landed / kStages) & 1));
      if (!__shfl_sync(0xffffffffu, room, 0)) return;
      if (lane == 0) bar_expect(&full[s], kTile);
      __syncwarp();
      for (int c = lane; c < copies; c += 32)
        bulk(smem + s * kTile + c * copy_bytes, base + size_t(issued) * kTile + c * copy_bytes, copy_bytes, &full[s]);
      ++issued;
    }
  };
  for (int t = 0; t < tiles; ++t) {
    const int s = t % kStages;
    if (warp == 0) {
      while (!bar_test(&full[s], (t / kStages) & 1)) pump();
    } else {
      bar_wait(&full[s], (t / kStages) & 1);
    }
    const uint4 v = reinterpret_cast<const uint4*>(smem + s * kTile)[(threadIdx.x * 16 % kTile) / 16];
    acc += __uint_as_float(v.x & 0x3f800000u);
    __syncwarp();
    if (lane == 0) {
      if (mode == 1) { __threadfence_block(); atomicAdd(&counter, 1); }
      bar_arrive(&empty[s]);
    }
    if (warp == 0) pump();
  }
  if (acc == 12345.0f) sink[0] = acc;
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t per_block = size_t(24) << 20, total = per_block * sms;  // 24 MB per SM: far past L2
  char* src; float* sink;
  CK(cudaMalloc(&src, total)); CK(cudaMemset(src, 1, total)); CK(cudaMalloc(&sink, 4));
  const int smem = kStages * kTile + 2 * kStages * 8;
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  printf("mode warps copy_bytes in_flight  GB/s  GB/s/SM\n");
  for (int mode : {0, 1, 2})
    for (int copy : {512, 4096, 16384})
      for (int in_flight : {1, 3, 7}) {
        const int threads = mode == 2 ? 256 : 32;
        stream<<<sms, threads, smem>>>(src, per_block, copy, in_flight, mode, sink);  // warm
        CK(cudaEventRecord(a));
        stream<<<sms, threads, smem>>>(src, per_block, copy, in_flight, mode, sink);
        CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b)); CK(cudaGetLastError());
        float ms; CK(cudaEventElapsedTime(&ms, a, b));
        const double gbs = total / (ms * 1e-3) / 1e9;
        printf("%4d %5d %10d %9d %6.0f %8.1f\n", mode, threads / 32, copy, in_flight, gbs, gbs / sms);
      }
  return 0;
}
