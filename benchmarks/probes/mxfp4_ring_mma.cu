// Standalone probe (CUDA only, not part of the library): an MXFP4 matvec whose weights reach the tensor
// cores through shared memory. mxfp4_matvec.cu found that mma.sync fed from registers is no faster than
// the shipped FMA kernel because the fragment layout makes each load instruction read 8 rows x 64 bytes
// (2.3-2.6 TB/s where 512-byte runs reach 3.7). Here the loads keep long runs and the layout change
// happens in shared memory:
// - each lane copies 16 bytes of a row per instruction with cp.async (a warp: CHUNK contiguous bytes of
//   one or two rows), 16 rows per warp and step, into a per-warp ring of STAGES steps; 16-byte chunks are
//   XOR-swizzled by row so that ldmatrix reads 8 rows of one column without bank conflicts;
// - ldmatrix.x4 gives lane (g = lane / 4, t = lane % 4) the codes 8t..8t+7 of one 32-code MX block of
//   rows g and g + 8, for two blocks; each byte becomes a bf16 pair through a table in shared memory
//   (one copy per lane, addressed by one PRMT), exact E2M1 values;
// - two m16n8k16 bf16 mma per block (a dot product may take its k in any order: the lane's codes
//   8t + 4h + {0,1} are logical k (2t, 2t + 1) of mma h, 8t + 4h + {2,3} are (2t + 8, 2t + 9), and x is read
//   in the same order: 4 consecutive elements, one 8-byte load from shared memory), into a zeroed
//   accumulator; the block's power-of-two scale then multiplies it into the row's f32 sum (exact; no
//   scale touches the bf16 operands).
// Variants: CHUNK (bytes per row per step: 256 or 512), STAGES, and MODE 1 (the copies and ldmatrix
// only: this layout's ceiling). The shapes and data are mxfp4_matvec.cu's (gate/up 28672 x 4096, down
// 4096 x 14336, 8 layer copies); each variant is checked against a host f64 sum over rows 0-7.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o mxfp4_ring_mma mxfp4_ring_mma.cu && ./mxfp4_ring_mma
// Results and what they decided: lithos/custom_calls/NOTES.md, "Packed weights".
#include "ring_mma.h"

constexpr int kLutBytes = 256 * 256;  // entry b at bytes [256 b, 256 b + 128): one 4-byte copy per lane

__host__ __device__ inline uint32_t e2m1_bf16_bits(uint32_t c) {
  const uint32_t mag[8] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0};
  return mag[c & 7] | ((c & 8) << 12);
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}
// Shared memory: the table, x (bf16, n_in), then per warp STAGES x (16 rows x CHUNK bytes of codes,
// 16 rows x CHUNK / 16 scale bytes).
template <int CHUNK>
constexpr int kStageBytes = kRows * CHUNK + kRows * (CHUNK / 16);
template <int CHUNK, int STAGES>
size_t smem_bytes(int n_in) {
  return kLutBytes + static_cast<size_t>(n_in) * 2 + kWarps * STAGES * kStageBytes<CHUNK>;
}

// Work: 16 rows x a share of n_in (k_split shares), `steps` steps of CHUNK bytes per row each.
template <int CHUNK, int STAGES, int MODE>
__global__ void __launch_bounds__(kThreads, 1)
    mx_ring_mma(const uint8_t* __restrict__ w, const uint8_t* __restrict__ sc, const __nv_bfloat16* __restrict__ x,
                float* y, int n_out, int n_in, size_t layer_bytes, size_t layer_scale_bytes, int layers, int iter,
                int k_split) {
  constexpr int kBlocks = CHUNK / 16;           // 32-code MX blocks per row and step
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  for (int i = threadIdx.x; i < 256 * 32; i += kThreads) {
    const int b = i >> 5;
    reinterpret_cast<uint32_t*>(smem)[b * 64 + (i & 31)] =
        e2m1_bf16_bits(b & 15) | (e2m1_bf16_bits(b >> 4) << 16);
  }
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + kLutBytes);
  for (int i = threadIdx.x; i < n_in / 8; i += kThreads) reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
  __syncthreads();
  unsigned char* ring = smem + kLutBytes + static_cast<size_t>(n_in) * 2 +
                        static_cast<size_t>(warp) * STAGES * kStageBytes<CHUNK>;
  const uint32_t ring_at = smem_address(ring);

  const int layer = iter % layers;
  w += layer * layer_bytes;
  sc += layer * layer_scale_bytes;
  const int row_bytes = n_in / 2, scale_row = n_in / 32;
  const int steps = row_bytes / CHUNK / k_split;
  const int works = n_out / kRows * k_split, warps = gridDim.x * kWarps;
  const int first_work = blockIdx.x * kWarps + warp;
  const int my_works = first_work < works ? (works - first_work + warps - 1) / warps : 0;
  const int total = my_works * steps;  // this warp's stream of steps over its works
  const uint32_t lane_off = lane * 4;

  // Step s of the stream into ring stage s % STAGES (an empty group past the end keeps the counts).
  auto issue = [&](int s) {
    if (s < total) {
      const int work = first_work + (s / steps) * warps, part = work % k_split, unit = work / k_split;
      const int step = part * steps + s % steps;
      const uint32_t stage = ring_at + (s % STAGES) * kStageBytes<CHUNK>;
      copy_rows<CHUNK>(stage, 0, kRows, w + static_cast<size_t>(unit) * kRows * row_bytes + step * CHUNK, row_bytes,
                       lane);
      // Scales: 16 rows x kBlocks bytes, 16 bytes a lane.
      constexpr int kScaleCopies = kRows * kBlocks / 16;
      if (lane < kScaleCopies) {
        const int r = lane / (kBlocks / 16), part16 = lane % (kBlocks / 16);
        const uint8_t* from = sc + static_cast<size_t>(unit * kRows + r) * scale_row + step * kBlocks + part16 * 16;
        cp_async16(stage + kRows * CHUNK + r * kBlocks + part16 * 16, from);
      }
    }
    cp_commit();
  };

  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  float row_g = 0.0f, row_g8 = 0.0f;
  uint32_t sink = 0;
  for (int s = 0; s < total; ++s) {
    __syncwarp();  // every lane is done with the stage the next copy overwrites
    issue(s + STAGES - 1);
    cp_wait<STAGES - 1>();
    __syncwarp();  // the lanes' copies of stage s are visible to the whole warp
    const uint32_t stage = ring_at + (s % STAGES) * kStageBytes<CHUNK>;
    const unsigned char* scales = ring + (s % STAGES) * kStageBytes<CHUNK> + kRows * CHUNK;
    const int work = first_work + (s / steps) * warps, part = work % k_split;
    const int k0 = (part * steps + s % steps) * CHUNK * 2;  // the step's first code of each row
    // ldmatrix.x4: lane l gives the address of row (l / 8 & 1) * 8 + l % 8 of column c + l / 16.
    const int lr = ((lane >> 3) & 1) * 8 + (lane & 7), lc = lane >> 4;
#pragma unroll 4
    for (int c = 0; c < kBlocks; c += 2) {
      uint32_t q[4];  // q[0] rows g, q[1] rows g + 8 of block c; q[2], q[3] of block c + 1
      ldmatrix_x4(q, stage + lr * CHUNK + (((c + lc) ^ (lr & 7)) * 16));
      if (MODE == 1) sink ^= q[0] ^ q[1] ^ q[2] ^ q[3];
#pragma unroll
      for (int half_block = 0; half_block < (MODE == 1 ? 0 : 2); ++half_block) {
        const int block = c + half_block;
        const uint32_t gw = q[2 * half_block], g8w = q[2 * half_block + 1];
        float block_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t a[4];
          const uint32_t words[4] = {gw, g8w, gw, g8w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int byte = 2 * h + (i >> 1);  // codes 8t + 4h + {0,1}: byte 2h; {2,3}: byte 2h + 1
            const uint32_t off = prmt(words[i], lane_off, 0x5504u | (byte << 4));
            a[i] = *reinterpret_cast<const uint32_t*>(smem + off);
          }
          const uint2 xv = *reinterpret_cast<const uint2*>(xs + k0 + block * 32 + 8 * t + 4 * h);
          mma_bf16(block_sum, a, xv.x, xv.y);
        }
        const float scale_g = __uint_as_float(static_cast<uint32_t>(scales[g * kBlocks + block]) << 23);
        const float scale_g8 = __uint_as_float(static_cast<uint32_t>(scales[(g + 8) * kBlocks + block]) << 23);
        row_g = fmaf(block_sum[0], scale_g, row_g);
        row_g8 = fmaf(block_sum[2], scale_g8, row_g8);
      }
    }
    if (s % steps == steps - 1) {  // the work's last step: column 0 (lanes t == 0) holds its rows
      const int unit = work / k_split;
      if (MODE == 1) row_g = __uint_as_float(sink & 0x3F7FFFFFu);
      if (t == 0) {
        float* out = y + unit * kRows;
        if (k_split == 1) {
          out[g] = row_g;
          out[g + 8] = row_g8;
        } else {
          atomicAdd(out + g, row_g);
          atomicAdd(out + g + 8, row_g8);
        }
      }
      row_g = row_g8 = 0.0f;
    }
  }
  cp_wait<0>();
}

template <int CHUNK, int STAGES, int MODE>
void run(const char* name, const uint8_t* w, const uint8_t* sc, const __nv_bfloat16* x, float* y, int n_out, int n_in,
         int layers, int sms, int k_split, const std::vector<double>& ref) {
  if ((n_in / 2) % (CHUNK * k_split) != 0) return;
  auto k = mx_ring_mma<CHUNK, STAGES, MODE>;
  const size_t smem = smem_bytes<CHUNK, STAGES>(n_in);
  if (!allow_shared_memory(k, smem, name)) return;
  const int blocks = ring_blocks(sms, n_out / kRows * k_split);
  const size_t lb = static_cast<size_t>(n_out) * n_in / 2, ls = static_cast<size_t>(n_out) * n_in / 32;
  // Correctness first: one launch on layer 0 against the host's rows 0-7.
  CK(cudaMemset(y, 0, n_out * 4));
  k<<<blocks, kThreads, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, 0, k_split);
  CK(cudaDeviceSynchronize());
  float hy[8];
  CK(cudaMemcpy(hy, y, sizeof hy, cudaMemcpyDeviceToHost));
  double err = 0;
  for (int r = 0; r < 8; ++r) err = std::max(err, std::fabs(hy[r] - ref[r]) / (std::fabs(ref[r]) + 1e-3));
  const double us = launch_us(
      [&](int i) { k<<<blocks, kThreads, smem>>>(w, sc, x, y, n_out, n_in, lb, ls, layers, i, k_split); }, 400);
  const double bytes = lb + ls;
  printf("%-40s out=%6d in=%6d  %7.2f us  %6.0f GB/s  k_split %d  rel err rows 0-7 %.1e%s\n", name, n_out, n_in, us,
         bytes / us / 1e3, k_split, err, MODE == 1 ? " (no arithmetic)" : "");
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[2][2] = {{28672, 4096}, {4096, 14336}};
  for (auto& sh : shapes) {
    const int n_out = sh[0], n_in = sh[1], layers = 8;
    const size_t lb = static_cast<size_t>(n_out) * n_in / 2, ls = static_cast<size_t>(n_out) * n_in / 32;
    std::vector<uint8_t> hw(lb), hs(ls);
    uint32_t st = 12345;  // mxfp4_matvec.cu's data
    for (auto& v : hw) { st = st * 1664525u + 1013904223u; v = st >> 24; }
    for (auto& v : hs) { st = st * 1664525u + 1013904223u; v = 118 + (st >> 29); }
    std::vector<__nv_bfloat16> hx(n_in);
    for (int i = 0; i < n_in; ++i) {
      st = st * 1664525u + 1013904223u;
      hx[i] = __float2bfloat16(((st >> 8) / 16777216.0f - 0.5f) * 4);
    }
    const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    std::vector<double> ref(8);
    for (int r = 0; r < 8; ++r) {
      double s = 0;
      for (int i = 0; i < n_in; ++i) {
        const uint8_t b = hw[static_cast<size_t>(r) * n_in / 2 + i / 2];
        const int c = (i & 1) ? b >> 4 : b & 15;
        const double v = e2m1[c & 7] * ((c & 8) ? -1 : 1) * std::ldexp(1.0, hs[static_cast<size_t>(r) * n_in / 32 + i / 32] - 127);
        s += v * __bfloat162float(hx[i]);
      }
      ref[r] = s;
    }
    uint8_t *w, *sc;
    __nv_bfloat16* x;
    float* y;
    CK(cudaMalloc(&w, lb * layers));
    CK(cudaMalloc(&sc, ls * layers));
    CK(cudaMalloc(&x, n_in * 2));
    CK(cudaMalloc(&y, n_out * 4));
    for (int l = 0; l < layers; ++l) {
      CK(cudaMemcpy(w + l * lb, hw.data(), lb, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sc + l * ls, hs.data(), ls, cudaMemcpyHostToDevice));
    }
    CK(cudaMemcpy(x, hx.data(), n_in * 2, cudaMemcpyHostToDevice));
    printf("floor at 4.3 TB/s: %.1f us\n", (lb + ls) / 4.3e6);
    for (int ks : {1, 2, 4, 7}) {
      run<256, 2, 1>("ring 256 B x2, copies + ldmatrix only", w, sc, x, y, n_out, n_in, layers, sms, ks, ref);
      run<256, 4, 1>("ring 256 B x4, copies + ldmatrix only", w, sc, x, y, n_out, n_in, layers, sms, ks, ref);
      run<512, 2, 1>("ring 512 B x2, copies + ldmatrix only", w, sc, x, y, n_out, n_in, layers, sms, ks, ref);
      run<256, 2, 0>("ring 256 B x2, table + mma", w, sc, x, y, n_out, n_in, layers, sms, ks, ref);
      run<256, 3, 0>("ring 256 B x3, table + mma", w, sc, x, y, n_out, n_in, layers, sms, ks, ref);
      run<256, 4, 0>("ring 256 B x4, table + mma", w, sc, x, y, n_out, n_in, layers, sms, ks, ref);
      run<512, 2, 0>("ring 512 B x2, table + mma", w, sc, x, y, n_out, n_in, layers, sms, ks, ref);
    }
    CK(cudaFree(w));
    CK(cudaFree(sc));
    CK(cudaFree(x));
    CK(cudaFree(y));
  }
  return 0;
}
