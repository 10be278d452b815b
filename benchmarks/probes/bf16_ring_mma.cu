// Standalone probe (CUDA only, not part of the library): a bf16 matvec for 8 query positions (the
// speculative verification of 7 drafts) on tensor cores. The fused and megakernel matvecs spend T FP32
// FMAs per weight (NOTES.md: an 8-token verification round takes about three plain steps); an m16n8k16 mma
// takes 16 rows x 16 inputs x 8 tokens per instruction, so with the tokens as the N side the arithmetic
// all but vanishes and only the stream is left.
// - Per warp and step, 16 weight rows x CHUNK bytes and the 8 tokens' x over the same inputs are copied
//   into a per-warp ring in shared memory with cp.async (each warp instruction covers 256 or 512
//   contiguous bytes), 16-byte chunks XOR-swizzled by row;
// - ldmatrix.x4 gives the A fragment (16 rows x 16 inputs), ldmatrix.x2 the B fragment (16 inputs x 8
//   tokens: x stored token-major is B column-major); one mma per 16 inputs accumulates in f32.
// MODE 1: the copies and ldmatrix only (the layout's ceiling). MODE 2: with an RMSNorm weight, as the
// Q/K/V, gate/up and LM-head matvecs have: its row of CHUNK bytes rides in each stage, and every B
// fragment becomes x * norm_w split into bf16 high and low parts (mma_rowdot.h's scaled_parts), two mma
// instead of one. Shapes: the 8B gate/up (28672 x 4096) and down (4096 x 14336), 4 layer copies so that
// nothing is served from L2; checked against a host f64 sum over rows 0-7 and all 8 tokens.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o bf16_ring_mma bf16_ring_mma.cu && ./bf16_ring_mma
#include "ring_mma.h"

constexpr int kTokens = 8;

// A ring stage: 16 weight rows, then 8 token rows of x, then (MODE 2) the norm weight, CHUNK bytes each.
template <int CHUNK, int MODE>
constexpr int kStageBytes = (kRows + kTokens + (MODE == 2 ? 1 : 0)) * CHUNK;

// x * nw for a bf16 pair as high and low parts, each rounded once (exact: a bf16 product and its
// rounding error are representable).
__device__ __forceinline__ void scaled_pair(uint32_t x, uint32_t nw, uint32_t& hi, uint32_t& lo) {
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(hi) : "r"(x), "r"(nw));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(lo) : "r"(x), "r"(nw), "r"(hi ^ 0x80008000u));
}

// Work: 16 rows x a share of n_in (k_split shares), `steps` steps of CHUNK bytes per row each.
template <int CHUNK, int STAGES, int MODE>
__global__ void __launch_bounds__(kThreads, 1)
    bf16_ring_mma(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                  const __nv_bfloat16* __restrict__ nw, float* y, int n_out, int n_in, size_t layer_elements,
                  int layers, int iter, int k_split) {
  constexpr int kChunks = CHUNK / 16;  // 16-byte chunks (8 inputs) per row and step
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const uint32_t ring_at = smem_address(smem) + warp * STAGES * kStageBytes<CHUNK, MODE>;
  w += (iter % layers) * layer_elements;
  const size_t row_bytes = static_cast<size_t>(n_in) * 2;
  const int steps = static_cast<int>(row_bytes / CHUNK) / k_split;
  const int works = n_out / kRows * k_split, warps = gridDim.x * kWarps;
  const int first_work = blockIdx.x * kWarps + warp;
  const int my_works = first_work < works ? (works - first_work + warps - 1) / warps : 0;
  const int total = my_works * steps;

  auto issue = [&](int s) {
    if (s < total) {
      const int work = first_work + (s / steps) * warps, part = work % k_split, unit = work / k_split;
      const size_t offset = static_cast<size_t>(part * steps + s % steps) * CHUNK;  // bytes into a row
      const uint32_t stage = ring_at + (s % STAGES) * kStageBytes<CHUNK, MODE>;
      copy_rows<CHUNK>(stage, 0, kRows,
                       reinterpret_cast<const unsigned char*>(w) + static_cast<size_t>(unit) * kRows * row_bytes + offset,
                       row_bytes, lane);
      copy_rows<CHUNK>(stage, kRows, kTokens, reinterpret_cast<const unsigned char*>(x) + offset, row_bytes, lane);
      // Row kRows + kTokens (24, unswizzled: 24 & 7 = 0): chunk `lane` of the norm weight.
      if (MODE == 2 && lane < kChunks)
        cp_async16(stage + (kRows + kTokens) * CHUNK + lane * 16,
                   reinterpret_cast<const unsigned char*>(nw) + offset + lane * 16);
    }
    cp_commit();
  };

  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  uint32_t sink = 0;
  // ldmatrix addresses: A, lane l gives row l % 16 of chunk pair member l / 16; B (x2), lane l < 16 gives
  // token l % 8 of chunk pair member l / 8.
  const int a_row = lane & 15, a_col = lane >> 4, b_row = lane & 7, b_col = (lane >> 3) & 1;
  for (int s = 0; s < total; ++s) {
    __syncwarp();
    issue(s + STAGES - 1);
    cp_wait<STAGES - 1>();
    __syncwarp();
    const uint32_t stage = ring_at + (s % STAGES) * kStageBytes<CHUNK, MODE>;
#pragma unroll 4
    for (int c = 0; c < kChunks; c += 2) {
      uint32_t a[4], b[2];
      ldmatrix_x4(a, stage + a_row * CHUNK + (((c + a_col) ^ (a_row & 7)) * 16));
      ldmatrix_x2(b, stage + (kRows + b_row) * CHUNK + (((c + b_col) ^ (b_row & 7)) * 16));
      if (MODE == 1) {
        sink ^= a[0] ^ a[1] ^ a[2] ^ a[3] ^ b[0] ^ b[1];
      } else if (MODE == 2) {
        // b[j] holds inputs (c + j) * 8 + 2t, + 1 of token g: the norm weight pair at the same inputs.
        const uint32_t nw_at = stage + (kRows + kTokens) * CHUNK + 4 * t;
        uint32_t n0, n1, hi0, lo0, hi1, lo1;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(n0) : "r"(nw_at + c * 16));
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(n1) : "r"(nw_at + (c + 1) * 16));
        scaled_pair(b[0], n0, hi0, lo0);
        scaled_pair(b[1], n1, hi1, lo1);
        mma_bf16(d, a, hi0, hi1);
        mma_bf16(d, a, lo0, lo1);
      } else {
        mma_bf16(d, a, b[0], b[1]);
      }
    }
    if (s % steps == steps - 1) {  // the work's last step: lane (g, t) holds rows g, g + 8, tokens 2t, 2t + 1
      const int work = first_work + (s / steps) * warps, unit = work / k_split;
      if (MODE == 1) d[0] = __uint_as_float(sink & 0x3F7FFFFFu);
      const int row = unit * kRows + g;
      float* out[4] = {y + static_cast<size_t>(2 * t) * n_out + row, y + static_cast<size_t>(2 * t + 1) * n_out + row,
                       y + static_cast<size_t>(2 * t) * n_out + row + 8,
                       y + static_cast<size_t>(2 * t + 1) * n_out + row + 8};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (k_split == 1)
          *out[i] = d[i];
        else
          atomicAdd(out[i], d[i]);
        d[i] = 0.0f;
      }
    }
  }
  cp_wait<0>();
}

template <int CHUNK, int STAGES, int MODE>
void run(const char* name, const __nv_bfloat16* w, const __nv_bfloat16* x, const __nv_bfloat16* nw, float* y,
         int n_out, int n_in, int layers, int sms, int k_split, const std::vector<double>& ref) {
  if ((n_in * 2) % (CHUNK * k_split) != 0) return;
  auto k = bf16_ring_mma<CHUNK, STAGES, MODE>;
  const size_t smem = static_cast<size_t>(kWarps) * STAGES * kStageBytes<CHUNK, MODE>;
  if (!allow_shared_memory(k, smem, name)) return;
  const int blocks = ring_blocks(sms, n_out / kRows * k_split);
  const size_t le = static_cast<size_t>(n_out) * n_in;
  CK(cudaMemset(y, 0, static_cast<size_t>(kTokens) * n_out * 4));
  k<<<blocks, kThreads, smem>>>(w, x, nw, y, n_out, n_in, le, layers, 0, k_split);
  CK(cudaDeviceSynchronize());
  double err = 0;
  for (int token = 0; token < kTokens; ++token) {
    float hy[8];
    CK(cudaMemcpy(hy, y + static_cast<size_t>(token) * n_out, sizeof hy, cudaMemcpyDeviceToHost));
    for (int r = 0; r < 8; ++r)
      err = std::max(err, std::fabs(hy[r] - ref[token * 8 + r]) / (std::fabs(ref[token * 8 + r]) + 1e-3));
  }
  const double us =
      launch_us([&](int i) { k<<<blocks, kThreads, smem>>>(w, x, nw, y, n_out, n_in, le, layers, i, k_split); }, 200);
  const double bytes = le * 2.0;
  printf("%-40s out=%6d in=%6d  %7.2f us  %6.0f GB/s  k_split %d  rel err rows 0-7 x 8 tokens %.1e%s\n", name, n_out,
         n_in, us, bytes / us / 1e3, k_split, err, MODE == 1 ? " (no arithmetic)" : "");
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[2][2] = {{28672, 4096}, {4096, 14336}};
  for (auto& sh : shapes) {
    const int n_out = sh[0], n_in = sh[1], layers = 4;
    const size_t le = static_cast<size_t>(n_out) * n_in;
    std::vector<__nv_bfloat16> hw(le), hx(static_cast<size_t>(kTokens) * n_in), hnw(n_in);
    uint32_t st = 12345;
    auto next = [&] {
      st = st * 1664525u + 1013904223u;
      return ((st >> 8) / 16777216.0f - 0.5f);
    };
    for (auto& v : hw) v = __float2bfloat16(next() * 0.1f);
    for (auto& v : hx) v = __float2bfloat16(next() * 4);
    for (auto& v : hnw) v = __float2bfloat16(1.0f + next());
    std::vector<double> ref(kTokens * 8), ref_normed(kTokens * 8);
    for (int token = 0; token < kTokens; ++token)
      for (int r = 0; r < 8; ++r) {
        double s = 0, sn = 0;
        for (int i = 0; i < n_in; ++i) {
          const double p = static_cast<double>(__bfloat162float(hw[static_cast<size_t>(r) * n_in + i])) *
                           __bfloat162float(hx[static_cast<size_t>(token) * n_in + i]);
          s += p;
          sn += p * __bfloat162float(hnw[i]);
        }
        ref[token * 8 + r] = s;
        ref_normed[token * 8 + r] = sn;
      }
    __nv_bfloat16 *w, *x, *nw;
    float* y;
    CK(cudaMalloc(&w, le * 2 * layers));
    CK(cudaMalloc(&x, hx.size() * 2));
    CK(cudaMalloc(&nw, hnw.size() * 2));
    CK(cudaMalloc(&y, static_cast<size_t>(kTokens) * n_out * 4));
    for (int l = 0; l < layers; ++l) CK(cudaMemcpy(w + l * le, hw.data(), le * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(nw, hnw.data(), hnw.size() * 2, cudaMemcpyHostToDevice));
    printf("floor at 4.3 TB/s: %.1f us\n", le * 2 / 4.3e6);
    for (int ks : {1, 2, 4, 7}) {
      // A stage is 24 rows x CHUNK bytes per warp (25 normed): 512 B x 2 and 256 B x 4 stages fill 192 KB
      // (200 KB normed).
      run<512, 2, 1>("ring 512 B x2, copies + ldmatrix only", w, x, nw, y, n_out, n_in, layers, sms, ks, ref);
      run<256, 4, 1>("ring 256 B x4, copies + ldmatrix only", w, x, nw, y, n_out, n_in, layers, sms, ks, ref);
      run<512, 2, 0>("ring 512 B x2, mma", w, x, nw, y, n_out, n_in, layers, sms, ks, ref);
      run<256, 3, 0>("ring 256 B x3, mma", w, x, nw, y, n_out, n_in, layers, sms, ks, ref);
      run<256, 4, 0>("ring 256 B x4, mma", w, x, nw, y, n_out, n_in, layers, sms, ks, ref);
      run<512, 2, 2>("ring 512 B x2, mma, normed", w, x, nw, y, n_out, n_in, layers, sms, ks, ref_normed);
      run<256, 4, 2>("ring 256 B x4, mma, normed", w, x, nw, y, n_out, n_in, layers, sms, ks, ref_normed);
    }
    CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(nw));
    CK(cudaFree(y));
  }
  return 0;
}
