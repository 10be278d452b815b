// Standalone probe (CUDA only, not part of the library): what limits a batch-1 MXFP4 matvec on a
// Hopper GPU. y[r] = sum_i x[i] * w[r, i], w MXFP4 rows (n_in/2 bytes) + E8M0 scales (n_in/32 bytes),
// x bf16, over 8 layers' copies so that nothing is served from L2. Variants: load width per lane, rows
// per warp, decode method, x from global or shared memory; "loads only" is the memory ceiling. The
// `mx_mma` variants put the FMAs on tensor cores (mma.sync bf16, weights decoded by a table in
// shared memory), with k split across warps, occupancy, a tile-major layout and L2 prefetch varied.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o mxfp4_matvec mxfp4_matvec.cu && ./mxfp4_matvec
//   PROFILE=1 ncu --section ComputeWorkloadAnalysis --section WarpStateStats -k regex:mx_matvec ./mxfp4_matvec
// Results and what they decided: lithos/custom_calls/NOTES.md, "Packed weights".
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cstdlib>
#include <algorithm>
#include <cmath>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float2 h2f(uint32_t bits) { __half2 h; memcpy(&h, &bits, 4); return __half22float2(h); }
// PTX prmt: a selector nibble with its msb set replicates the selected byte's sign bit (0x00 here).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s)); return d;
}
__device__ __forceinline__ float e8m0(uint32_t s) { return __uint_as_float(s << 23); }
__device__ __forceinline__ float bf_lo(uint32_t p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float bf_hi(uint32_t p) { return __uint_as_float(p & 0xFFFF0000u); }

// half2 bits of elements (j, j + 4) of a word: high bytes from the lookups, low bytes zero (msb-replicate
// of a table byte < 0x80), signs from the codes.
__device__ __forceinline__ uint32_t pair_bits(uint32_t lo4, uint32_t hi4, uint32_t word, int j) {
  const uint32_t sel = (8u | j) | (uint32_t(j) << 4) | ((12u + j) << 8) | ((4u + j) << 12);
  return prmt(lo4, hi4, sel) | ((word << (12 - 4 * j)) & 0x80008000u);
}

// MODE 0: loads only (weights, scales, x) with a trivial use; 1: fp16-trick decode + cvt + FFMA (as
// packed.h today); 2: PRMT decode to fp16 pairs + HFMA2 per block into fp32 (x as fp16 with a
// per-token power-of-two scale is NOT modelled: x fp16 straight); 3: fp16 trick + HMUL2/HFMA2 chain in
// f16 over 8 elements then to f32; 4: PRMT decode + cvt + FFMA; 5: PRMT decode to exact fp16 pairs,
// products with x in fp16 (exact: a bf16 x has 8 significant bits, an E2M1 code 2, fp16 keeps 11) by
// HMUL2, two products per fp16 sum (one rounding, HFMA2), then f32: MODE 2's speed with MODE 1's
// precision, if the cvt and adds it adds back stay cheap.
template <int BYTES, int ROWS, int UNROLL, int MODE, bool XSMEM>
__global__ void __launch_bounds__(256) mx_matvec(const uint8_t* __restrict__ w, const uint8_t* __restrict__ sc,
                                                 const __nv_bfloat16* __restrict__ x, float* y, int n_out, int n_in,
                                                 size_t layer_bytes, size_t layer_scale_bytes, int layers, int iter) {
  extern __shared__ float xs[];
  constexpr int ELEMS = BYTES * 2;  // per lane per row per step
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int layer = iter % layers;
  w += layer * layer_bytes;
  sc += layer * layer_scale_bytes;
  if (XSMEM) {
    for (int i = threadIdx.x; i < n_in; i += blockDim.x) xs[i] = __bfloat162float(x[i]);
    __syncthreads();
  }
  const int row_bytes = n_in / 2, scale_row = n_in / 32;
  const int groups = n_out / ROWS;
  const int step = 32 * ELEMS;
  for (int g = blockIdx.x * 8 + warp; g < groups; g += gridDim.x * 8) {
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    uint32_t bits = 0;
    for (int base = lane * ELEMS; base < n_in; base += step * UNROLL) {
      uint4 raw[UNROLL][ROWS];
      uint32_t s[UNROLL][ROWS];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (base + u * step >= n_in) { raw[u][r] = make_uint4(0, 0, 0, 0); s[u][r] = 0; continue; }
          const uint8_t* p = w + (size_t)(g * ROWS + r) * row_bytes + (base + u * step) / 2;
          if (BYTES == 16) raw[u][r] = __ldcs(reinterpret_cast<const uint4*>(p));
          else { uint2 v = __ldcs(reinterpret_cast<const uint2*>(p)); raw[u][r] = make_uint4(v.x, v.y, 0, 0); }
          s[u][r] = sc[(size_t)(g * ROWS + r) * scale_row + (base + u * step) / 32];
        }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int k = base + u * step;
        if (k >= n_in) continue;
        float xf[ELEMS];
        if (XSMEM) {
#pragma unroll
          for (int v = 0; v < ELEMS; v += 4) { float4 q = *reinterpret_cast<const float4*>(xs + k + v); xf[v] = q.x; xf[v+1] = q.y; xf[v+2] = q.z; xf[v+3] = q.w; }
        } else {
#pragma unroll
          for (int v = 0; v < ELEMS; v += 8) {
            uint4 q = __ldg(reinterpret_cast<const uint4*>(x + k + v));
            xf[v] = bf_lo(q.x); xf[v+1] = bf_hi(q.x); xf[v+2] = bf_lo(q.y); xf[v+3] = bf_hi(q.y);
            xf[v+4] = bf_lo(q.z); xf[v+5] = bf_hi(q.z); xf[v+6] = bf_lo(q.w); xf[v+7] = bf_hi(q.w);
          }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const uint32_t words[4] = {raw[u][r].x, raw[u][r].y, raw[u][r].z, raw[u][r].w};
          constexpr int NW = BYTES / 4;
          uint32_t lo4[4], hi4[4];
          if (MODE == 2 || MODE == 4 || MODE == 5) {
#pragma unroll
            for (int i = 0; i < NW; ++i) {
              const uint32_t m = words[i] & 0x77777777u;
              lo4[i] = prmt(0x3E3C3800u, 0x46444240u, m);        // fp16 high bytes of nibbles 0..3
              hi4[i] = prmt(0x3E3C3800u, 0x46444240u, m >> 16);  // nibbles 4..7
            }
          }
          if (MODE == 0) {
#pragma unroll
            for (int i = 0; i < NW; ++i) bits ^= words[i];
            bits += s[u][r];
            acc[r] += xf[r % ELEMS];
          } else if (MODE == 1 || MODE == 4) {
            float even = 0.f, odd = 0.f;
#pragma unroll
            for (int i = 0; i < NW; ++i) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                float2 v;
                if (MODE == 1) {
                  const uint32_t t = words[i] >> (4 * j);
                  v = h2f(((t & 0x00070007u) << 9) | ((t & 0x00080008u) << 12));
                } else {
                  v = h2f(pair_bits(lo4[i], hi4[i], words[i], j));
                }
                even = fmaf(v.x, xf[8 * i + j], even);
                odd = fmaf(v.y, xf[8 * i + j + 4], odd);
              }
            }
            acc[r] = fmaf((even + odd) * (MODE == 1 ? 16384.f : 1.f), e8m0(s[u][r]), acc[r]);
          } else if (MODE == 2) {
            // PRMT: 4 magnitudes' fp16 high bytes per lookup; interleave to half2 with signs; HFMA2 in f16
            // over the chunk, then one f32 conversion per chunk.
            __half2 hacc = __float2half2_rn(0.f);
#pragma unroll
            for (int i = 0; i < NW; ++i) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const uint32_t hs = pair_bits(lo4[i], hi4[i], words[i], j);
                __half2 wv, xv;
                memcpy(&wv, &hs, 4);
                xv = __floats2half2_rn(xf[8 * i + j], xf[8 * i + j + 4]);
                hacc = __hfma2(wv, xv, hacc);
              }
            }
            const float2 f = __half22float2(hacc);
            acc[r] = fmaf(f.x + f.y, e8m0(s[u][r]), acc[r]);
          } else if (MODE == 3) {
            __half2 hacc = __float2half2_rn(0.f);
#pragma unroll
            for (int i = 0; i < NW; ++i)
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const uint32_t t = words[i] >> (4 * j);
                const uint32_t hb = ((t & 0x00070007u) << 9) | ((t & 0x00080008u) << 12);
                __half2 wv, xv;
                memcpy(&wv, &hb, 4);
                xv = __floats2half2_rn(xf[8 * i + j], xf[8 * i + j + 4]);
                hacc = __hfma2(wv, xv, hacc);
              }
            const float2 f = __half22float2(hacc);
            acc[r] = fmaf((f.x + f.y) * 16384.f, e8m0(s[u][r]), acc[r]);
          } else if (MODE == 5) {
            float even = 0.f, odd = 0.f;
#pragma unroll
            for (int i = 0; i < NW; ++i)
#pragma unroll
              for (int j = 0; j < 4; j += 2) {
                const uint32_t hs0 = pair_bits(lo4[i], hi4[i], words[i], j);
                const uint32_t hs1 = pair_bits(lo4[i], hi4[i], words[i], j + 1);
                __half2 w0, w1;
                memcpy(&w0, &hs0, 4);
                memcpy(&w1, &hs1, 4);
                const __half2 x0 = __floats2half2_rn(xf[8 * i + j], xf[8 * i + j + 4]);
                const __half2 x1 = __floats2half2_rn(xf[8 * i + j + 1], xf[8 * i + j + 5]);
                const float2 f = __half22float2(__hfma2(w1, x1, __hmul2(w0, x0)));
                even += f.x;
                odd += f.y;
              }
            acc[r] = fmaf(even + odd, e8m0(s[u][r]), acc[r]);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float v = warp_sum(acc[r]) + (float)(bits & 1);
      if (lane == 0) y[g * ROWS + r] = v;
    }
  }
}

// Microseconds per launch of `launch(iter)`: 10 launches of warm-up, then the mean of 400 timed by events.
template <class Launch>
double time_launches(Launch launch) {
  for (int i = 0; i < 10; ++i) launch(i);
  CK(cudaDeviceSynchronize());
  const int iters = 400;
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) launch(i);
  cudaEventRecord(b);
  CK(cudaEventSynchronize(b));
  float ms; cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a); cudaEventDestroy(b);
  return ms * 1000 / iters;
}

template <int BYTES, int ROWS, int UNROLL, int MODE, bool XSMEM>
void run(const char* name, const uint8_t* w, const uint8_t* sc, const __nv_bfloat16* x, float* y, int n_out, int n_in,
         int layers, int sms) {
  auto k = mx_matvec<BYTES, ROWS, UNROLL, MODE, XSMEM>;
  size_t smem = XSMEM ? n_in * 4 : 0;
  if (smem > 48 * 1024) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 256, smem));
  const int groups = n_out / ROWS;
  int blocks = std::min(sms * per_sm, (groups + 7) / 8);
  size_t lb = (size_t)n_out * n_in / 2, ls = (size_t)n_out * n_in / 32;
  static const bool profile = getenv("PROFILE") != nullptr;
  if (profile) { k<<<blocks, 256, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, 0); CK(cudaDeviceSynchronize()); printf("profiled %s\n", name); return; }
  const double us = time_launches([&](int i) { k<<<blocks, 256, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, i); });
  const double bytes = lb + ls;
  printf("%-34s out=%6d in=%6d  %7.2f us  %6.0f GB/s  %5.1f elem/clk/SM  (%d blocks/SM)\n", name, n_out, n_in, us,
         bytes / us / 1e3, (double)n_out * n_in / (us * 1e-6) / sms / 1.98e9, per_sm);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core variant: mma.sync m16n8k16 bf16 x bf16 -> f32, weights as the A side (16 rows per
// warp), x as column 0 of B. Lane (g = lane / 4, t = lane % 4) loads 16 bytes (one 32-weight block,
// one scale) of rows g and g + 8 per step: the four lanes of a row read four consecutive blocks. A
// dot product may take its k in any order, so logical k (2t, 2t + 1) of mma j is the lane's byte 2j
// and (2t + 8, 2t + 9) its byte 2j + 1; x supplies the same elements. Decode: byte -> bf16 pair
// (low nibble in the low half) from a table in shared memory with one copy per lane (no bank
// conflicts), addressed by one PRMT (byte << 8 | lane << 2); the block's scale by one bf16x2
// multiply (exact: powers of two). LUT = false decodes by the fp16 trick into bf16 instead (for
// comparison, not exact for every scale).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__host__ __device__ inline uint32_t e2m1_bf16_bits(uint32_t c) {
  const uint32_t mag[8] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0};
  return mag[c & 7] | ((c & 8) << 12);
}
constexpr int kLutWords = 256 * 64;  // entry e at words [64 e, 64 e + 32): one copy per lane

// Loads as volatile asm keep their place before the (volatile) mma of the previous stage: without it
// the compiler sinks each load to just before its use and a lane has 32 bytes in flight.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_u8(const uint8_t* p) {
  uint16_t v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

// MODE 0: as described; 1: no scale multiply (wrong numbers: what the HMUL2 costs); 2: no table
// either (the raw words as fragments: loads + mma only); 4: the loads alone; 5: MODE 0's arithmetic
// over a tile-major layout (timing only: the probe's data is not repacked).
template <int UNROLL, int MODE = 0, int MINB = 1, int PREFETCH = 0>
__global__ void __launch_bounds__(256, MINB) mx_mma(const uint8_t* __restrict__ w, const uint8_t* __restrict__ sc,
                                              const __nv_bfloat16* __restrict__ x, float* y, int n_out, int n_in,
                                              size_t layer_bytes, size_t layer_scale_bytes, int layers, int iter,
                                              int k_split) {
  extern __shared__ uint32_t lut[];
  for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) {
    const int e = i >> 5;
    lut[e * 64 + (i & 31)] = e2m1_bf16_bits(e & 15) | (e2m1_bf16_bits(e >> 4) << 16);
  }
  // x in shared memory after the table: its loads sit on each step's critical path, and from L2
  // they cost a round trip per step.
  uint4* xs = reinterpret_cast<uint4*>(lut + kLutWords);
  for (int i = threadIdx.x; i < n_in / 8; i += blockDim.x) xs[i] = reinterpret_cast<const uint4*>(x)[i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int layer = iter % layers;
  w += layer * layer_bytes;
  sc += layer * layer_scale_bytes;
  const int row_bytes = n_in / 2, scale_row = n_in / 32;
  const int units = n_out / 16, steps = n_in / 128 / k_split;  // a step: 128 weights of 16 rows
  const uint32_t lane_off = lane * 4;
  struct Stage {
    uint4 q0[UNROLL], q1[UNROLL];
    uint32_t s0[UNROLL], s1[UNROLL];
  };
  for (int work = blockIdx.x * 8 + warp; work < units * k_split; work += gridDim.x * 8) {
    const int unit = work / k_split, part = work % k_split;
    const int r0 = unit * 16 + g, r1 = r0 + 8;
    const uint8_t* p0 = w + (size_t)r0 * row_bytes;
    const uint8_t* p1 = w + (size_t)r1 * row_bytes;
    const uint8_t* s0p = sc + (size_t)r0 * scale_row;
    const uint8_t* s1p = sc + (size_t)r1 * scale_row;
    const int first = part * steps, last = first + steps;
    // MODE 5: a tile-major layout (16 rows x 128 weights = 1 KB per step, lanes in order), as a
    // load-time repack would store it: each load instruction reads 512 contiguous bytes.
    const uint8_t* tile = w + (size_t)unit * 16 * row_bytes + lane * 16;
    const uint8_t* stile = sc + (size_t)unit * 16 * scale_row + lane;
    auto wq = [&](int half, int blk) -> const uint8_t* {
      if (MODE == 5) return tile + (size_t)(blk >> 2) * 1024 + half * 512;
      return (half ? p1 : p0) + blk * 16;
    };
    auto sq = [&](int half, int blk) -> const uint8_t* {
      if (MODE == 5) return stile + (size_t)(blk >> 2) * 64 + half * 32;
      return (half ? s1p : s0p) + blk;
    };
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    // A rolling buffer: slot u holds step s + u; after computing it, it is reloaded with step
    // s + u + UNROLL, so UNROLL - 1 to UNROLL steps per lane stay in flight without a second copy.
    Stage buf;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int blk = min(first + u, last - 1) * 4 + t;
      buf.q0[u] = ld_stream_v4(wq(0, blk));
      buf.q1[u] = ld_stream_v4(wq(1, blk));
      buf.s0[u] = ld_u8(sq(0, blk));
      buf.s1[u] = ld_u8(sq(1, blk));
    }
    for (int step = first; step < last; step += UNROLL) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (step + u >= last) break;
        const int blk = (step + u) * 4 + t;
        const uint4* xp = xs + blk * 4;
        const uint4 xa = xp[0], xb = xp[1], xc = xp[2], xd = xp[3];
        const uint32_t xw[16] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w,
                                 xc.x, xc.y, xc.z, xc.w, xd.x, xd.y, xd.z, xd.w};
        const uint32_t m0 = (buf.s0[u] << 7) | (buf.s0[u] << 23), m1 = (buf.s1[u] << 7) | (buf.s1[u] << 23);
        const uint32_t w0[4] = {buf.q0[u].x, buf.q0[u].y, buf.q0[u].z, buf.q0[u].w};
        const uint32_t w1[4] = {buf.q1[u].x, buf.q1[u].y, buf.q1[u].z, buf.q1[u].w};
        // PREFETCH > 0: the step that far ahead is asked into L2 (no registers held), so that
        // the register loads below only wait for L2.
        if (PREFETCH > 0 && step + u + PREFETCH < last) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(wq(0, blk + PREFETCH * 4)));
          asm volatile("prefetch.global.L2 [%0];" ::"l"(wq(1, blk + PREFETCH * 4)));
        }
        if (step + u + UNROLL < last) {
          const int nb = blk + UNROLL * 4;
          buf.q0[u] = ld_stream_v4(wq(0, nb));
          buf.q1[u] = ld_stream_v4(wq(1, nb));
          buf.s0[u] = ld_u8(sq(0, nb));
          buf.s1[u] = ld_u8(sq(1, nb));
        }
        if (MODE == 4)  // the loads alone, in this access pattern
          d[0] += __uint_as_float((w0[0] ^ w0[1] ^ w0[2] ^ w0[3] ^ w1[0] ^ w1[1] ^ w1[2] ^ w1[3] ^ m0 ^ m1 ^
                                   xw[u]) & 0x3F7FFFFFu);
#pragma unroll
        for (int j = 0; j < (MODE == 4 ? 0 : 8); ++j) {
          // bytes 2j and 2j + 1: word j / 2, bytes 2 (j % 2) and 2 (j % 2) + 1
          const int wi = j >> 1, b = 2 * (j & 1);
          uint32_t a[4];
          const uint32_t srcs[4] = {w0[wi], w1[wi], w0[wi], w1[wi]};
          const int bytes[4] = {b, b, b + 1, b + 1};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            if (MODE == 2) {
              a[i] = srcs[i] ^ (bytes[i] * 0x01010101u);
              continue;
            }
            // byte offset (code byte << 8) | (lane << 2): byte 1 from the weights, byte 0 from lane_off
            const uint32_t off = prmt(srcs[i], lane_off, 0x5504u | (bytes[i] << 4));
            const uint32_t v = *reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(lut) + off);
            a[i] = MODE == 1 ? v : bf16x2_mul(v, (i & 1) ? m1 : m0);
          }
          mma_bf16(d, a[0], a[1], a[2], a[3], xw[2 * j], xw[2 * j + 1]);
        }
      }
    }
    if (t == 0) {
      if (k_split == 1) { y[r0] = d[0]; y[r1] = d[2]; }
      else { atomicAdd(y + r0, d[0]); atomicAdd(y + r1, d[2]); }
    }
  }
}

template <int UNROLL, int MODE = 0, int MINB = 1, int PREFETCH = 0>
void run_mma(const char* name, const uint8_t* w, const uint8_t* sc, const __nv_bfloat16* x, float* y, int n_out,
             int n_in, int layers, int sms, int k_split, bool check_only = false) {
  auto k = mx_mma<UNROLL, MODE, MINB, PREFETCH>;
  const size_t smem = kLutWords * 4 + n_in * 2;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 256, smem));
  const int works = n_out / 16 * k_split;
  const int blocks = std::min(sms * per_sm, (works + 7) / 8);
  const size_t lb = (size_t)n_out * n_in / 2, ls = (size_t)n_out * n_in / 32;
  if (check_only) {
    CK(cudaMemset(y, 0, n_out * 4));
    k<<<blocks, 256, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, 0, k_split);
    CK(cudaDeviceSynchronize());
    return;
  }
  const double us =
      time_launches([&](int i) { k<<<blocks, 256, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, i, k_split); });
  const double bytes = lb + ls;
  printf("%-34s out=%6d in=%6d  %7.2f us  %6.0f GB/s  %5.1f elem/clk/SM  (%d blocks/SM, k_split %d)\n", name, n_out,
         n_in, us, bytes / us / 1e3, (double)n_out * n_in / (us * 1e-6) / sms / 1.98e9, per_sm, k_split);
}

// Reference check of a decode mode against a host computation (first layer).
int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[2][2] = {{28672, 4096}, {4096, 14336}};
  for (auto& sh : shapes) {
    const int n_out = sh[0], n_in = sh[1];
    const int layers = 8;
    size_t lb = (size_t)n_out * n_in / 2, ls = (size_t)n_out * n_in / 32;
    std::vector<uint8_t> hw(lb), hs(ls);
    uint32_t st = 12345;
    for (auto& v : hw) { st = st * 1664525u + 1013904223u; v = st >> 24; }
    for (auto& v : hs) { st = st * 1664525u + 1013904223u; v = 118 + (st >> 29); }
    std::vector<__nv_bfloat16> hx(n_in);
    for (int i = 0; i < n_in; ++i) { st = st * 1664525u + 1013904223u; hx[i] = __float2bfloat16(((st >> 8) / 16777216.0f - 0.5f) * 4); }
    uint8_t *w, *sc; __nv_bfloat16* x; float* y;
    CK(cudaMalloc(&w, lb * layers)); CK(cudaMalloc(&sc, ls * layers)); CK(cudaMalloc(&x, n_in * 2)); CK(cudaMalloc(&y, n_out * 4));
    for (int l = 0; l < layers; ++l) { CK(cudaMemcpy(w + l * lb, hw.data(), lb, cudaMemcpyHostToDevice)); CK(cudaMemcpy(sc + l * ls, hs.data(), ls, cudaMemcpyHostToDevice)); }
    CK(cudaMemcpy(x, hx.data(), n_in * 2, cudaMemcpyHostToDevice));
    // host reference for row 0..3 (magnitudes table)
    const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    std::vector<double> ref(8);
    for (int r = 0; r < 8; ++r) {
      double s = 0;
      for (int i = 0; i < n_in; ++i) {
        uint8_t b = hw[(size_t)r * n_in / 2 + i / 2]; int c = (i & 1) ? b >> 4 : b & 15;
        float v = e2m1[c & 7] * ((c & 8) ? -1 : 1) * ldexpf(1.f, hs[(size_t)r * n_in / 32 + i / 32] - 127);
        s += v * __bfloat162float(hx[i]);
      }
      ref[r] = s;
    }
    auto check = [&](const char* name) {
      float hy[8]; CK(cudaMemcpy(hy, y, 32, cudaMemcpyDeviceToHost));
      double err = 0; for (int r = 0; r < 8; ++r) err = std::max(err, fabs(hy[r] - ref[r]) / (fabs(ref[r]) + 1e-3));
      printf("   %s rel err rows 0-7: %.2e\n", name, err);
    };
    // Run with iter=0 layout: every launch covers layer (iter % layers); check after a single launch on layer 0.
    auto once = [&](auto kernel, size_t smem) { kernel<<<sms, 256, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, 0); CK(cudaDeviceSynchronize()); };
    run<16, 4, 2, 0, false>("loads only 16B x4 rows u2", w, sc, x, y, n_out, n_in, layers, sms);
    run<16, 4, 4, 0, false>("loads only 16B x4 rows u4", w, sc, x, y, n_out, n_in, layers, sms);
    run<8, 4, 4, 0, false>("loads only 8B x4 rows u4", w, sc, x, y, n_out, n_in, layers, sms);
    run<16, 8, 2, 0, false>("loads only 16B x8 rows u2", w, sc, x, y, n_out, n_in, layers, sms);
    run<8, 4, 4, 1, false>("today: 8B x4 u4 fp16trick+cvt", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<8, 4, 4, 1, false>, 0); check("today");
    run<16, 4, 2, 1, false>("16B x4 u2 fp16trick+cvt", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<16, 4, 2, 1, false>, 0); check("16B fp16trick");
    run<16, 4, 2, 4, false>("16B x4 u2 prmt+cvt", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<16, 4, 2, 4, false>, 0); check("16B prmt+cvt");
    run<16, 4, 2, 2, false>("16B x4 u2 prmt+hfma2", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<16, 4, 2, 2, false>, 0); check("16B prmt+hfma2");
    run<16, 4, 2, 3, false>("16B x4 u2 fp16trick+hfma2", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<16, 4, 2, 3, false>, 0); check("16B trick+hfma2");
    run<16, 4, 2, 5, false>("16B x4 u2 prmt+hmul2 pairs", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<16, 4, 2, 5, false>, 0); check("16B prmt+hmul2 pairs");
    run<8, 4, 4, 5, false>("8B x4 u4 prmt+hmul2 pairs", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<8, 4, 4, 5, false>, 0); check("8B prmt+hmul2 pairs");
    run<16, 8, 2, 1, false>("16B x8 u2 fp16trick+cvt", w, sc, x, y, n_out, n_in, layers, sms);
    run<16, 8, 2, 4, false>("16B x8 u2 prmt+cvt", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<16, 8, 2, 4, false>, 0); check("16B x8 prmt+cvt");
    run<16, 4, 2, 1, true>("16B x4 u2 fp16trick+cvt xsmem", w, sc, x, y, n_out, n_in, layers, sms);
    run<16, 8, 2, 4, true>("16B x8 u2 prmt+cvt xsmem", w, sc, x, y, n_out, n_in, layers, sms);
    for (int ks : {1, 2, 4, 7}) {
      if ((n_in / 128) % ks) continue;
      if (n_out < 10000 && ks < 4) continue;
      char name[64];
      snprintf(name, sizeof name, "mma lut u4 ks%d minb2", ks);
      run_mma<4, 0, 2>(name, w, sc, x, y, n_out, n_in, layers, sms, ks);
      snprintf(name, sizeof name, "mma lut u4 ks%d minb2 pf8", ks);
      run_mma<4, 0, 2, 8>(name, w, sc, x, y, n_out, n_in, layers, sms, ks);
      run_mma<4, 0, 2, 8>(name, w, sc, x, y, n_out, n_in, layers, sms, ks, true);
      check(name);
      snprintf(name, sizeof name, "mma lut u4 ks%d minb2 pf16", ks);
      run_mma<4, 0, 2, 16>(name, w, sc, x, y, n_out, n_in, layers, sms, ks);
      snprintf(name, sizeof name, "mma lut u2 ks%d minb3 pf8", ks);
      run_mma<2, 0, 3, 8>(name, w, sc, x, y, n_out, n_in, layers, sms, ks);
      snprintf(name, sizeof name, "mma u4 ks%d minb2 loads only pf8", ks);
      run_mma<4, 4, 2, 8>(name, w, sc, x, y, n_out, n_in, layers, sms, ks);
      snprintf(name, sizeof name, "mma lut u4 ks%d minb2 tiled pf8", ks);
      run_mma<4, 5, 2, 8>(name, w, sc, x, y, n_out, n_in, layers, sms, ks);
      snprintf(name, sizeof name, "mma lut u4 ks%d minb2 tiled pf16", ks);
      run_mma<4, 5, 2, 16>(name, w, sc, x, y, n_out, n_in, layers, sms, ks);
    }
    CK(cudaFree(w)); CK(cudaFree(sc)); CK(cudaFree(x)); CK(cudaFree(y));
  }
  return 0;
}
