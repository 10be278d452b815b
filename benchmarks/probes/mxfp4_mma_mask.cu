// Standalone probe (CUDA only, not part of the library): a batch-1 MXFP4 matvec whose products run on
// tensor cores, over the weights as stored (rows of codes, one E8M0 scale per 32 codes: no repack).
//
// The earlier tensor-core probe (mxfp4_matvec.cu, `mx_mma`) folded each block's scale into the decoded
// weights (one bf16x2 multiply per pair) and fed 16 rows per warp from 64-byte runs of a row; its loads
// alone streamed at 2.3-2.6 TB/s and its table decode went through shared memory. This one:
//
// - Lane (g, t) = (lane / 4, lane % 4) loads one 16-byte MX block per step: block 8 s + 4 (g / 4) + t of
//   row g % 4 of the warp's 4 rows, so 8 lanes read 128 contiguous bytes of each row (a full line).
// - B (16 k x 8 columns): column n is the lane group g = n, i.e. row n % 4, half n / 4 of the step. The
//   lane's 32 codes feed 8 mma: mma j takes codes (8i + q, 8i + q + 4) as b0 and (8i + q + 1, 8i + q + 5)
//   as b1 (i = j / 2, q = 2 (j % 2)), decoded by masks into bf16 bit patterns v * 2^-126 (the E2M1
//   exponent and mantissa at bf16 bits 6..8, the sign at 15: exact, e = 0 codes are bf16 subnormals).
// - A (16 rows x 16 k): row m < 8 is x over the block of lane (m, m % 4) and zero elsewhere, so D[m][n]
//   is the partial dot product of ONE block (lane m % 4's) of column n, valid where m / 4 == n / 4. So a
//   block's scale multiplies its own partial in f32, after the mma: exact for every E8M0 code, including
//   0 (2^-127) and 0xFF (NaN). x enters as x * 2^64 in bf16 (exact), which keeps the products of the
//   subnormal codes normal in f32; the partial is multiplied back by 2^62 before its scale.
// - A's x fragments are staged once per block in shared memory in the order the codes are paired; lanes
//   that supply no A row read a zero region. A rows 8..15 (the quads' a1, a3) are free for a low part of
//   x * norm, as an RMSNorm prologue needs: zero here, and the high part again in one check.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o mxfp4_mma_mask mxfp4_mma_mask.cu && ./mxfp4_mma_mask
// Results and what they decided: lithos/custom_calls/NOTES.md, "Packed weights".
#define main mxfp4_matvec_main
#include "mxfp4_matvec.cu"
#undef main

// E8M0 without branches: s << 23, with the quiet bit set for s = 0 (2^-127) and s = 0xFF (NaN).
__device__ __forceinline__ float e8m0_f(uint32_t s) {
  return __uint_as_float((s << 23) | (((s + 1u) & 0xFEu) == 0u ? 0x00400000u : 0u));
}

// Codes (q, q + 4) of a word of 8 nibbles as a bf16 pair of v * 2^-126.
template <int Q>
__device__ __forceinline__ uint32_t e2m1_pair_bf16(uint32_t w) {
  constexpr int em_shift = 6 - 4 * Q, sign_shift = 12 - 4 * Q;
  const uint32_t em = em_shift >= 0 ? (w << em_shift) : (w >> -em_shift);
  return (em & 0x01C001C0u) | ((w << sign_shift) & 0x80008000u);
}

// The MX block a lane (h = g / 4, t) reads at a step: with RUN = 1, 8 consecutive blocks per step and row (8 lanes,
// 128 bytes); with RUN = r, a lane reads r consecutive blocks over r steps, so r steps cover 8 r blocks (128 r
// bytes) of a row with each lane's bytes contiguous.
template <int RUN>
__host__ __device__ __forceinline__ int block_of(int step, int h, int t) {
  return 8 * RUN * (step / RUN) + RUN * (4 * h + t) + step % RUN;
}

// MODE 0: loads only (weights, scales, A fragments); 3: weights and scales only; 1: the matvec. SETS row
// sets of 4 per step share each A fragment (2: 8 rows, two weight blocks per lane and step).
template <int U, int MODE, int MINB, int SETS, int RUN = 1, bool JIT = false, bool LOW = true>
__global__ void __launch_bounds__(256, MINB) mx_mask(const uint8_t* __restrict__ w, const uint8_t* __restrict__ sc,
                                                     const uint32_t* __restrict__ afrag, float* y, int n_out,
                                                     int n_in, size_t layer_bytes, size_t layer_scale_bytes,
                                                     int layers, int iter, int k_split) {
  // [step][8 mma][8 A rows] quads (a0, a1, a2, a3), then one row of zeros for the lanes that supply none.
  extern __shared__ uint4 fr[];
  const int steps_total = n_in / 256;
  const int frag_uint4 = steps_total * 8 * 8;
  for (int i = threadIdx.x; i < frag_uint4; i += blockDim.x) fr[i] = reinterpret_cast<const uint4*>(afrag)[i];
  for (int i = threadIdx.x; i < 8; i += blockDim.x) fr[frag_uint4 + i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int layer = iter % layers;
  w += layer * layer_bytes;
  sc += layer * layer_scale_bytes;
  const int row_bytes = n_in / 2, scale_row = n_in / 32;
  const int units = n_out / (4 * SETS), steps = steps_total / k_split;
  const bool supplies = t == (g & 3);
  const uint4* zeros = fr + frag_uint4;
  const bool valid = (g >> 2) == (t >> 1);
  const int src0 = 8 * t + (g & 3), src1 = src0 + 4;
  for (int work = blockIdx.x * 8 + warp; work < units * k_split; work += gridDim.x * 8) {
    const int unit = work / k_split, part = work % k_split;
    const uint8_t* wp[SETS];
    const uint8_t* sp[SETS];
#pragma unroll
    for (int e = 0; e < SETS; ++e) {
      const int row = unit * 4 * SETS + 4 * e + (g & 3);
      wp[e] = w + (size_t)row * row_bytes;
      sp[e] = sc + (size_t)row * scale_row;
    }
    const int first = part * steps, last = first + steps;
    uint4 q[U][SETS];
    uint32_t s8[U][SETS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int st = min(first + u, last - 1);
#pragma unroll
      for (int e = 0; e < SETS; ++e) {
        const int blk = block_of<RUN>(st, g >> 2, t);
        q[u][e] = ld_stream_v4(wp[e] + (size_t)blk * 16);
        s8[u][e] = ld_u8(sp[e] + blk);
      }
    }
    uint4 a4[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) a4[i] = make_uint4(0, 0, 0, 0);
    float acc[SETS][2];
#pragma unroll
    for (int e = 0; e < SETS; ++e) acc[e][0] = acc[e][1] = 0.f;
    uint32_t junk = 0;
    for (int st = first; st < last; st += U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (st + u >= last) break;
        uint4 cur[SETS];
        uint32_t cur_s[SETS];
#pragma unroll
        for (int e = 0; e < SETS; ++e) {
          cur[e] = q[u][e];
          cur_s[e] = s8[u][e];
        }
        if (st + u + U < last) {
#pragma unroll
          for (int e = 0; e < SETS; ++e) {
            const int blk = block_of<RUN>(st + u + U, g >> 2, t);
            q[u][e] = ld_stream_v4(wp[e] + (size_t)blk * 16);
            s8[u][e] = ld_u8(sp[e] + blk);
          }
        }
        // Only the 8 lanes that supply an A row read shared memory (one wavefront per LDS.128); the
        // others keep the zeros a4 started with. JIT: each quad is read just before its mma (all lanes: the
        // zero row for those that supply none), so that 8 quads are never live at once.
        const uint4* aq_base = supplies ? fr + (st + u) * 64 + g : zeros;
        const int aq_stride = supplies ? 8 : 0;
        if (MODE != 3 && !JIT && supplies) {  // quad i of the 8 rows at consecutive addresses: no bank conflict
          const uint4* ap = fr + (st + u) * 64 + g;
#pragma unroll
          for (int i = 0; i < 8; ++i) a4[i] = ap[8 * i];
        }
        if (MODE == 0 || MODE == 3) {
#pragma unroll
          for (int e = 0; e < SETS; ++e) junk ^= cur[e].x ^ cur[e].y ^ cur[e].z ^ cur[e].w ^ cur_s[e];
#pragma unroll
          for (int i = 0; i < 8; ++i) junk ^= a4[i].x ^ a4[i].y ^ a4[i].z ^ a4[i].w;
          continue;
        }
#pragma unroll
        for (int e = 0; e < SETS; ++e) {
          const uint32_t words[4] = {cur[e].x, cur[e].y, cur[e].z, cur[e].w};
          float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const uint32_t wd = words[j >> 1];
            const uint32_t b0 = (j & 1) ? e2m1_pair_bf16<2>(wd) : e2m1_pair_bf16<0>(wd);
            const uint32_t b1 = (j & 1) ? e2m1_pair_bf16<3>(wd) : e2m1_pair_bf16<1>(wd);
            const uint4 aq = JIT ? aq_base[aq_stride * j] : a4[j];
            if (j & 1) mma_bf16(d1, aq.x, aq.y, aq.z, aq.w, b0, b1);
            else mma_bf16(d0, aq.x, aq.y, aq.z, aq.w, b0, b1);
          }
          // D rows g + 8 hold the low parts' partials when A rows 8..15 carry them (LOW).
          const float p0 = (LOW ? d0[0] + d1[0] + d0[2] + d1[2] : d0[0] + d1[0]) * 4.611686018427388e18f;  // * 2^62
          const float p1 = (LOW ? d0[1] + d1[1] + d0[3] + d1[3] : d0[1] + d1[1]) * 4.611686018427388e18f;
          const uint32_t s0 = __shfl_sync(0xffffffffu, cur_s[e], src0), s1 = __shfl_sync(0xffffffffu, cur_s[e], src1);
          if (valid) {
            acc[e][0] = fmaf(p0, e8m0_f(s0), acc[e][0]);
            acc[e][1] = fmaf(p1, e8m0_f(s1), acc[e][1]);
          }
        }
      }
    }
    if (MODE == 0 || MODE == 3) acc[0][0] = __uint_as_float(junk & 0x3F7FFFFFu);
    // lane (g, t): acc[e][0] is row 4e + (2t) % 4, acc[e][1] row 4e + (2t + 1) % 4; sum over g, then t, t ^ 2.
#pragma unroll
    for (int e = 0; e < SETS; ++e) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        acc[e][0] += __shfl_xor_sync(0xffffffffu, acc[e][0], o);
        acc[e][1] += __shfl_xor_sync(0xffffffffu, acc[e][1], o);
      }
      acc[e][0] += __shfl_xor_sync(0xffffffffu, acc[e][0], 2);
      acc[e][1] += __shfl_xor_sync(0xffffffffu, acc[e][1], 2);
      if (lane < 2) {
        const int r0 = unit * 4 * SETS + 4 * e + 2 * lane;
        if (k_split == 1) { y[r0] = acc[e][0]; y[r0 + 1] = acc[e][1]; }
        else { atomicAdd(y + r0, acc[e][0]); atomicAdd(y + r0 + 1, acc[e][1]); }
      }
    }
  }
}

// A fragments on the host, [step][mma][A row] quads: for step s and A row m (block 8 s + 4 (m / 4) + m % 4), mma j's quad (a0, a1, a2,
// a3): a0 = (x[8i+q], x[8i+q+4]), a2 = (x[8i+q+1], x[8i+q+5]) of the block (i = j / 2, q = 2 (j % 2)), as bf16
// of x * 2^64; a1, a3 (rows m + 8) zero, or with `low` the same as a0, a2 (the check of A rows 8..15: twice the sum).
template <int RUN>
static std::vector<uint32_t> a_fragments(const std::vector<__nv_bfloat16>& hx, int n_in, bool low) {
  const int steps = n_in / 256;
  std::vector<uint32_t> out((size_t)steps * 8 * 32, 0u);
  auto bits = [&](int i) -> uint32_t {
    const float v = __bfloat162float(hx[i]) * 18446744073709551616.0f;  // 2^64, exact
    __nv_bfloat16 b = __float2bfloat16(v);
    uint16_t u; memcpy(&u, &b, 2); return u;
  };
  for (int s = 0; s < steps; ++s)
    for (int m = 0; m < 8; ++m) {
      const int blk = block_of<RUN>(s, m / 4, m % 4), base = blk * 32;
      for (int j = 0; j < 8; ++j) {
        uint32_t* o = out.data() + (((size_t)s * 8 + j) * 8 + m) * 4;
        const int i = j / 2, q = 2 * (j % 2), c = base + 8 * i + q;
        o[0] = bits(c) | (bits(c + 4) << 16);
        o[2] = bits(c + 1) | (bits(c + 5) << 16);
        if (low) { o[1] = o[0]; o[3] = o[2]; }
      }
    }
  return out;
}

template <int U, int MODE, int MINB, int SETS, int RUN = 1, bool JIT = false, bool LOW = true>
void run_mask(const char* name, const uint8_t* w, const uint8_t* sc, const uint32_t* af, float* y, int n_out,
              int n_in, int layers, int sms, int k_split, bool check_only = false) {
  auto k = mx_mask<U, MODE, MINB, SETS, RUN, JIT, LOW>;
  const size_t smem = ((size_t)(n_in / 256) * 8 * 32 + 32) * 4;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 256, smem));
  const int works = n_out / (4 * SETS) * k_split;
  const int blocks = std::min(sms * per_sm, (works + 7) / 8);
  const size_t lb = (size_t)n_out * n_in / 2, ls = (size_t)n_out * n_in / 32;
  if (check_only) {
    CK(cudaMemset(y, 0, n_out * 4));
    k<<<blocks, 256, smem>>>(w, sc, af, y, n_out, n_in, lb, ls, layers, 0, k_split);
    CK(cudaDeviceSynchronize());
    return;
  }
  const double us =
      time_launches([&](int i) { k<<<blocks, 256, smem>>>(w, sc, af, y, n_out, n_in, lb, ls, layers, i, k_split); });
  const double bytes = lb + ls;
  printf("%-34s out=%6d in=%6d  %7.2f us  %6.0f GB/s  (%d blocks/SM, k_split %d)\n", name, n_out, n_in, us,
         bytes / us / 1e3, per_sm, k_split);
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[2][2] = {{28672, 4096}, {4096, 14336}};
  for (auto& sh : shapes) {
    const int n_out = sh[0], n_in = sh[1], layers = 8;
    const size_t lb = (size_t)n_out * n_in / 2, ls = (size_t)n_out * n_in / 32;
    std::vector<uint8_t> hw(lb), hs(ls);
    uint32_t st = 12345;
    for (auto& v : hw) { st = st * 1664525u + 1013904223u; v = st >> 24; }
    for (auto& v : hs) { st = st * 1664525u + 1013904223u; v = 118 + (st >> 29); }
    // Edge scales: row 1's first block 2^73 (it dominates the row), row 2 all 2^-127 (the smallest code:
    // the whole row near f32's subnormals).
    hs[(size_t)1 * n_in / 32] = 200;
    for (int b = 0; b < n_in / 32; ++b) hs[(size_t)2 * n_in / 32 + b] = 0;
    std::vector<__nv_bfloat16> hx(n_in);
    for (int i = 0; i < n_in; ++i) { st = st * 1664525u + 1013904223u; hx[i] = __float2bfloat16(((st >> 8) / 16777216.0f - 0.5f) * 4); }
    uint8_t *w, *sc; __nv_bfloat16* x; float* y; uint32_t *af, *af_lo;
    CK(cudaMalloc(&w, lb * layers)); CK(cudaMalloc(&sc, ls * layers)); CK(cudaMalloc(&x, n_in * 2)); CK(cudaMalloc(&y, n_out * 4));
    for (int l = 0; l < layers; ++l) { CK(cudaMemcpy(w + l * lb, hw.data(), lb, cudaMemcpyHostToDevice)); CK(cudaMemcpy(sc + l * ls, hs.data(), ls, cudaMemcpyHostToDevice)); }
    CK(cudaMemcpy(x, hx.data(), n_in * 2, cudaMemcpyHostToDevice));
    const std::vector<uint32_t> hf = a_fragments<1>(hx, n_in, false), hf_lo = a_fragments<1>(hx, n_in, true),
                                hf4 = a_fragments<4>(hx, n_in, false);
    uint32_t* af4;
    CK(cudaMalloc(&af, hf.size() * 4)); CK(cudaMalloc(&af_lo, hf_lo.size() * 4)); CK(cudaMalloc(&af4, hf4.size() * 4));
    CK(cudaMemcpy(af, hf.data(), hf.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(af_lo, hf_lo.data(), hf_lo.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(af4, hf4.data(), hf4.size() * 4, cudaMemcpyHostToDevice));
    const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    std::vector<double> ref(8), mag(8);
    for (int r = 0; r < 8; ++r) {
      double s = 0, m = 0;
      for (int i = 0; i < n_in; ++i) {
        uint8_t b = hw[(size_t)r * n_in / 2 + i / 2]; int c = (i & 1) ? b >> 4 : b & 15;
        double v = e2m1[c & 7] * ((c & 8) ? -1 : 1) * ldexp(1.0, hs[(size_t)r * n_in / 32 + i / 32] - 127);
        s += v * __bfloat162float(hx[i]);
        m += fabs(v * __bfloat162float(hx[i]));
      }
      ref[r] = s; mag[r] = m;
    }
    auto check = [&](const char* name, double factor) {
      float hy[8]; CK(cudaMemcpy(hy, y, 32, cudaMemcpyDeviceToHost));
      double err = 0;
      for (int r = 0; r < 8; ++r) err = std::max(err, fabs(hy[r] - factor * ref[r]) / (factor * mag[r]));
      printf("   %s: worst |y - ref| / sum|terms| over rows 0-7: %.2e (row 1 %.6e vs %.6e, row 2 %.6e vs %.6e)\n",
             name, err, hy[1], factor * ref[1], hy[2], factor * ref[2]);
    };
    // Baselines in the same call: the 16-byte loads-only ceiling and the shipped decode.
    run<16, 4, 2, 0, false>("loads only 16B x4 rows u2", w, sc, x, y, n_out, n_in, layers, sms);
    run<8, 4, 4, 1, false>("shipped: 8B x4 u4 fp16trick+cvt", w, sc, x, y, n_out, n_in, layers, sms);
    for (int ks : {1, 2, 4, 7}) {
      if ((n_in / 256) % ks) continue;
      if (n_out > 10000 && ks > 2) continue;
      if (n_out < 10000 && ks < 2) continue;
      char name[64];
#define RUN(U, MODE, MINB, SETS, R, JIT, LOW)                                                          \
  snprintf(name, sizeof name, "mask %s u%d minb%d rows%d run%d%s%s ks%d", MODE == 1 ? "mma" : MODE == 0 ? "loads" : "wloads", U, MINB, 4 * SETS, R, JIT ? " jit" : "", LOW ? "" : " nolow", ks); \
  run_mask<U, MODE, MINB, SETS, R, JIT, LOW>(name, w, sc, R == 1 ? af : af4, y, n_out, n_in, layers, sms, ks)
      if ((n_in / 256) % (4 * ks) == 0) {
        RUN(2, 1, 2, 2, 1, false, true);
        RUN(4, 1, 3, 1, 4, false, true);
        RUN(4, 1, 3, 1, 4, false, false);
        RUN(4, 1, 3, 1, 4, true, false);
        RUN(4, 1, 4, 1, 4, true, false);
        RUN(2, 1, 4, 1, 4, true, false);
        RUN(4, 1, 2, 1, 4, true, false);
        RUN(2, 1, 2, 2, 4, true, false);
        RUN(2, 1, 3, 2, 4, true, false);
        RUN(4, 1, 2, 2, 4, true, false);
        RUN(2, 1, 2, 2, 1, true, false);
      }
#undef RUN
      if ((n_in / 256) % (4 * ks) == 0) {
        run_mask<4, 1, 2, 1, 4>(name, w, sc, af4, y, n_out, n_in, layers, sms, ks, true);
        snprintf(name, sizeof name, "check rows4 run4 ks%d", ks);
        check(name, 1.0);
        run_mask<2, 1, 2, 2, 4, true, false>(name, w, sc, af4, y, n_out, n_in, layers, sms, ks, true);
        snprintf(name, sizeof name, "check rows8 run4 jit nolow ks%d", ks);
        check(name, 1.0);
      }
      run_mask<4, 1, 2, 1>(name, w, sc, af, y, n_out, n_in, layers, sms, ks, true);
      snprintf(name, sizeof name, "check rows4 ks%d", ks);
      check(name, 1.0);
      run_mask<4, 1, 2, 2>(name, w, sc, af, y, n_out, n_in, layers, sms, ks, true);
      snprintf(name, sizeof name, "check rows8 ks%d", ks);
      check(name, 1.0);
      run_mask<4, 1, 2, 2>(name, w, sc, af_lo, y, n_out, n_in, layers, sms, ks, true);
      snprintf(name, sizeof name, "check rows8 with A rows 8-15 ks%d", ks);
      check(name, 2.0);
    }
    CK(cudaFree(w)); CK(cudaFree(sc)); CK(cudaFree(x)); CK(cudaFree(y)); CK(cudaFree(af)); CK(cudaFree(af_lo)); CK(cudaFree(af4));
  }
  return 0;
}
