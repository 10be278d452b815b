// Standalone probe (CUDA only, not part of the library): what limits a batch-1 MXFP4 matvec on a
// Hopper GPU. y[r] = sum_i x[i] * w[r, i], w MXFP4 rows (n_in/2 bytes) + E8M0 scales (n_in/32 bytes),
// x bf16, over 8 layers' copies so that nothing is served from L2. Variants: load width per lane, rows
// per warp, decode method, x from global or shared memory; "loads only" is the memory ceiling.
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
// f16 over 8 elements then to f32; 4: PRMT decode + cvt + FFMA.
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
          if (MODE == 2 || MODE == 4) {
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
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  static const bool profile = getenv("PROFILE") != nullptr;
  if (profile) { k<<<blocks, 256, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, 0); CK(cudaDeviceSynchronize()); printf("profiled %s\n", name); return; }
  for (int i = 0; i < 10; ++i) k<<<blocks, 256, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, i);
  CK(cudaDeviceSynchronize());
  const int iters = 400;
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) k<<<blocks, 256, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, i);
  cudaEventRecord(b);
  CK(cudaEventSynchronize(b));
  float ms; cudaEventElapsedTime(&ms, a, b);
  const double us = ms * 1000 / iters, bytes = lb + ls;
  printf("%-34s out=%6d in=%6d  %7.2f us  %6.0f GB/s  %5.1f elem/clk/SM  (%d blocks/SM)\n", name, n_out, n_in, us,
         bytes / us / 1e3, (double)n_out * n_in / (us * 1e-6) / sms / 1.98e9, per_sm);
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
    run<16, 8, 2, 1, false>("16B x8 u2 fp16trick+cvt", w, sc, x, y, n_out, n_in, layers, sms);
    run<16, 8, 2, 4, false>("16B x8 u2 prmt+cvt", w, sc, x, y, n_out, n_in, layers, sms);
    once(mx_matvec<16, 8, 2, 4, false>, 0); check("16B x8 prmt+cvt");
    run<16, 4, 2, 1, true>("16B x4 u2 fp16trick+cvt xsmem", w, sc, x, y, n_out, n_in, layers, sms);
    run<16, 8, 2, 4, true>("16B x8 u2 prmt+cvt xsmem", w, sc, x, y, n_out, n_in, layers, sms);
    CK(cudaFree(w)); CK(cudaFree(sc)); CK(cudaFree(x)); CK(cudaFree(y));
  }
  return 0;
}
