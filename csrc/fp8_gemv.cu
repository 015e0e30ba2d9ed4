// Small-M FP8 linear for Hopper: quantize the activation and multiply by an
// e4m3 weight in one launch.
//
//     out[m, n] = epilogue(sum_k q(x)[m, k] * w[n, k])          1 <= m <= F_MB
//
//     x: bf16 / fp16 [m, K], rows x_stride elements apart (16-byte aligned rows)
//     w: e4m3 [N, K] contiguous
//     q(x): x quantized to e4m3 exactly as the standalone quantizers do
//        (quant_fp8, per_token_group_quant_fp8: SPEC.md), by every CTA for
//        its own K range; the weight stream is the kernel's only HBM traffic.
//
// Compiled at run time with NVRTC (scaledmm/jit); needs no CUDA header.
// Every size and choice is a macro, so one cubin serves one (N, K, config):
//
//   F_N, F_K     problem size (K % 128 == 0; any N >= 1)
//   F_ROWS       weight rows per CTA (16 or 32)
//   F_WARPS      warps per CTA; they take the CTA's 128-wide K units round-robin
//   F_SPLIT      CTAs per thread-block cluster along K (1, 2, 4, 8), partial
//                sums added through distributed shared memory in rank order
//   F_UNROLL     128-wide K units per register batch (two batches in flight)
//   F_MB         activation rows compiled for: 8 or 16 (m <= F_MB)
//   F_ASCALE     activation scale: 0 static per-tensor, 1 static per-token,
//                2 dynamic per-tensor (amax of the finite |x|), 3 dynamic
//                per-token, 4 dynamic per 1x128 group (x / s, the block recipe)
//   F_BSCALE     weight scale: 0 per-tensor, 1 per-channel [N], 2 per 128x128
//                block [ceil(N/128), K/128] (with F_ASCALE 4 only)
//   F_IN_F16     1: fp16 activation, 0: bf16
//   F_OUT        0: bf16, 1: fp16, 2: fp32 output
//   F_BIAS       0: none, 1: fp32, 2: bf16, 3: fp16 bias
//
// Design:
//  * Swap-AB mma.sync m16n8k32 e4m3 x e4m3 -> f32: A = 16 weight rows x 32 k,
//    B = q(x)^T (32 k x 8 tokens), D = out^T.  Each thread streams two 16-byte
//    pieces (bytes 16 t and 64 + 16 t of a 128-k unit: a quad's load covers
//    whole 32-byte sectors) of weight rows g and g + 8 straight into
//    registers (ld.global.nc.L1::no_allocate, two batches of F_UNROLL units
//    in flight per warp): A's words are those bytes as loaded.  The sum over
//    k is order-free, so k-slot j of an MMA step is mapped to the same
//    physical k for A and B: the activation codes are stored in shared
//    memory in that order (unit_slot).
//  * The activation is quantized once per CTA into shared memory (one row
//    per token, a row pitch of K range + 8 bytes: the 8-byte B loads of a
//    half warp then hit 32 distinct banks), before the MMA loop and after
//    the first two weight batches are in flight.  Scales follow the reference
//    bit for bit: s = max(amax, floor) / 448 (div.rn), codes
//    cvt.rn.satfinite.e4m3(x * rcp.rn(s)) or (groups) e4m3(div.rn(x, s));
//    NaN propagates into a per-token / per-group amax, a per-tensor amax
//    skips NaN and Inf.
//  * Block scales (F_BSCALE 2): a 128-k unit is one scale block, so the sum
//    of its four MMAs is added to the total times
//    a_scale[m, unit] * b_scale[n / 128, unit].  Per-tensor / per-channel
//    scales are applied once, in the epilogue (acc * sa * sb + bias, the
//    reference's order).
//  * Each k32 MMA goes into a fresh fragment that is added in fp32: chained
//    over K, the e4m3 MMA's own accumulation measured outside the fp32 bound.
//  * Persistent CTAs: as many as fit at once, each quantizing the activation
//    once (with its first two weight batches already in flight) and then
//    taking row tiles c, c + gridDim.x, ...; a warp's stream of weight
//    batches runs across tile boundaries (the next tile's batches are in
//    flight while a tile's partials are summed).
//  * Split K across the warps of a CTA (shared-memory sums in warp order) and
//    across the CTAs of a cluster (DSMEM sums in rank order): no workspace,
//    no atomics, bit-reproducible, CUDA-graph safe.
//  * Programmatic dependent launch (a no-op without it): every thread waits
//    for the previous grid (griddepcontrol.wait) before its first global
//    read or write, then lets the next grid launch.
//  * q_out / s_out (may be null): CTA column 0 also writes the codes and the
//    scales it computed, the quantizer's outputs (for tests).

#ifndef F_N
#error "F_N (output columns) must be defined"
#endif
#ifndef F_K
#error "F_K (reduction length) must be defined"
#endif
#ifndef F_ROWS
#define F_ROWS 16
#endif
#ifndef F_WARPS
#define F_WARPS 8
#endif
#ifndef F_SPLIT
#define F_SPLIT 1
#endif
#ifndef F_UNROLL
#define F_UNROLL 2
#endif
#ifndef F_MB
#define F_MB 8
#endif
#ifndef F_ASCALE
#define F_ASCALE 2
#endif
#ifndef F_BSCALE
#define F_BSCALE 0
#endif
#ifndef F_IN_F16
#define F_IN_F16 0
#endif
#ifndef F_OUT
#define F_OUT 0
#endif
#ifndef F_BIAS
#define F_BIAS 0
#endif

#include "fused_a_ptx.cuh"
#include "fp8_quant_ptx.cuh"

namespace fg {

using namespace fa_ptx;
using namespace fq_ptx;

constexpr int N = F_N;
constexpr int K = F_K;
constexpr int ROWS = F_ROWS;
constexpr int NT = ROWS / 16;
constexpr int WARPS = F_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int SPLIT = F_SPLIT;
constexpr int U = F_UNROLL;
constexpr int MB = F_MB;
constexpr int MF = MB / 8;
constexpr int UNITS = K / 128;
constexpr int UNITS_PER_SPLIT = (UNITS + SPLIT - 1) / SPLIT;
constexpr int PITCH = UNITS_PER_SPLIT * 128 + 8;  // smem bytes per activation row (see header)
constexpr int TILE = ROWS * MB;
constexpr int TILES = (N + ROWS - 1) / ROWS;
constexpr int LAST_UNITS = UNITS - (SPLIT - 1) * UNITS_PER_SPLIT;  // the last cluster rank's K units
constexpr int ASCALE = F_ASCALE;
constexpr int BSCALE = F_BSCALE;
constexpr bool GROUPS = ASCALE == 4;
constexpr bool FULL_ROWS = N % ROWS == 0;
constexpr float FP8_MAX = 448.0f;
constexpr float AMAX_FLOOR = 1e-10f;  // dynamic per-tensor / per-token floor (quant_fp8)

static_assert(K % 128 == 0 && K > 0, "K must be a positive multiple of 128");
static_assert(N > 0, "N must be positive");
static_assert(ROWS == 16 || ROWS == 32, "F_ROWS must be 16 or 32");
static_assert(MB == 8 || MB == 16, "F_MB must be 8 or 16");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4 || SPLIT == 8, "F_SPLIT must be 1, 2, 4 or 8");
static_assert(WARPS >= 1 && WARPS <= 16, "F_WARPS must be 1..16");
static_assert(U >= 1 && U <= 4, "F_UNROLL must be 1..4");
static_assert(ASCALE >= 0 && ASCALE <= 4, "F_ASCALE must be 0..4");
static_assert(BSCALE >= 0 && BSCALE <= 2, "F_BSCALE must be 0..2");
static_assert((BSCALE == 2) == GROUPS, "128x128 weight blocks go with 1x128 activation groups, and only they");
static_assert(F_OUT >= 0 && F_OUT <= 2 && F_BIAS >= 0 && F_BIAS <= 3, "F_OUT 0..2, F_BIAS 0..3");
static_assert(LAST_UNITS >= (WARPS - 1) * U + 1, "every warp of every cluster rank needs a batch of each tile");
static_assert(WARPS * TILE * 4 <= 32 * 1024, "reduction buffer exceeds 32 KiB of static shared memory");

// -- PTX helpers -------------------------------------------------------------

// A plain load: the compiler may issue several before their first use.
__device__ __forceinline__ V4 load_x(const unsigned short* __restrict__ p) {
  return *reinterpret_cast<const V4*>(p);
}

// D (16 x 8, fp32) += A (16 x 32, e4m3, row) * B (32 x 8, e4m3, col)
__device__ __forceinline__ void mma_e4m3(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where the 8 codes at byte p (a multiple of 8) of a 128-k unit sit in shared
// memory: thread quad t's words for MMA step s at 32 t + 8 s, the order its
// B loads read.  Its weight bytes are p = 64 (s / 2) + 16 t + 8 (s % 2): each
// 16-byte weight load of a quad then covers two whole 32-byte sectors.
__host__ __device__ __forceinline__ int unit_slot(int p) {
  return 32 * ((p >> 4) & 3) + 8 * (2 * (p >> 6) + ((p >> 3) & 1));
}

__device__ __forceinline__ float in_lo(u32 w) {
  if (F_IN_F16) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w & 0xFFFFu)));
    return f;
  }
  return __uint_as_float(w << 16);
}

__device__ __forceinline__ float in_hi(u32 w) {
  if (F_IN_F16) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w >> 16)));
    return f;
  }
  return __uint_as_float(w & 0xFFFF0000u);
}

__device__ __forceinline__ float warp_max(float v, bool nan_wins, int width) {
#pragma unroll
  for (int o = 1; o < width; o <<= 1) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = nan_wins ? max_nan(v, other) : fmaxf(v, other);
  }
  return v;
}

// -- the activation prologue ---------------------------------------------------

struct Act {
  float s[MB];            // per-token (or the one per-tensor) scale
  float inv[MB];          // its fp32 reciprocal
  float part[WARPS][MB];  // per-warp partial maxima of each row
};

// Pass 1: scales.  Every thread takes 16-byte chunks of each row (all warps
// on one row at a time, loads batched), per-warp maxima, then one thread per
// row combines them.  Per-group scales (one half warp per group) go to
// sgrp[row * UNITS_PER_SPLIT + unit - u0].
__device__ __forceinline__ void act_scales(const unsigned short* __restrict__ x, long long x_stride, int m,
                                           const float* __restrict__ x_scale, Act& act, float* sgrp,
                                           int u0, int u1, float eps, int warp, int lane) {
  if (ASCALE == 0 || ASCALE == 1) {
    for (int r = threadIdx.x; r < m; r += THREADS) {
      const float s = ASCALE == 0 ? x_scale[0] : x_scale[r];
      act.s[r] = s;
      act.inv[r] = rcp_rn(s);
    }
    return;
  }
  if (GROUPS) {
    // groups (row, unit) in order; lanes 0-15 take group gg, lanes 16-31
    // group gg + 1: the warp steps together (the shuffles need every lane)
    const int units = u1 - u0;
    const int groups = m * units;
    for (int gg = 2 * warp; gg < groups; gg += 2 * WARPS) {
      const int gi = gg + (lane >> 4);
      const int r = gi / units, u = u0 + gi % units;
      const V4 v = gi < groups ? load_x(x + (long long)r * x_stride + u * 128 + (lane & 15) * 8) : zero4();
      float a = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) a = max_nan(a, max_nan(fabsf(in_lo(v.v[j])), fabsf(in_hi(v.v[j]))));
      a = warp_max(a, true, 16);
      if ((lane & 15) == 0 && gi < groups) sgrp[r * UNITS_PER_SPLIT + (u - u0)] = div_rn(max_nan(a, eps), FP8_MAX);
    }
    return;
  }
  const float INF = __int_as_float(0x7F800000);
  for (int r = 0; r < m; ++r) {
    const unsigned short* row = x + (long long)r * x_stride;
    float a = 0.f;
#pragma unroll 4
    for (int c = threadIdx.x; c < K / 8; c += THREADS) {
      const V4 v = load_x(row + c * 8);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float lo = fabsf(in_lo(v.v[j])), hi = fabsf(in_hi(v.v[j]));
        if (ASCALE == 3) {
          a = max_nan(a, max_nan(lo, hi));
        } else {  // finite values only: NaN < Inf and Inf < Inf are false
          a = fmaxf(a, fmaxf(lo < INF ? lo : 0.f, hi < INF ? hi : 0.f));
        }
      }
    }
    a = warp_max(a, ASCALE == 3, 32);
    if (lane == 0) act.part[warp][r] = a;
  }
  __syncthreads();
  if (ASCALE == 3) {
    for (int r = threadIdx.x; r < m; r += THREADS) {
      float a = act.part[0][r];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) a = max_nan(a, act.part[w][r]);
      const float s = div_rn(max_nan(a, AMAX_FLOOR), FP8_MAX);
      act.s[r] = s;
      act.inv[r] = rcp_rn(s);
    }
  } else if (threadIdx.x == 0) {
    float a = 0.f;
    for (int r = 0; r < m; ++r)
      for (int w = 0; w < WARPS; ++w) a = fmaxf(a, act.part[w][r]);
    const float s = div_rn(fmaxf(a, AMAX_FLOOR), FP8_MAX);
    act.s[0] = s;
    act.inv[0] = rcp_rn(s);
  }
}

// Pass 2: the codes of the CTA's K range [u0, u1) into xq (row r at r * PITCH),
// every thread on 16-byte chunks of one row at a time.
__device__ __forceinline__ void act_codes(const unsigned short* __restrict__ x, long long x_stride, int m,
                                          const Act& act, const float* sgrp, unsigned char* xq, int u0, int u1) {
  const int chunks = (u1 - u0) * 16;  // 8 elements each
  for (int r = 0; r < m; ++r) {
    const unsigned short* row = x + (long long)r * x_stride + u0 * 128;
    const float inv = act.inv[ASCALE == 0 || ASCALE == 2 ? 0 : r];
#pragma unroll 4
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
      const V4 v = load_x(row + c * 8);
      u32 w[2];
      if (GROUPS) {
        const float s = sgrp[r * UNITS_PER_SPLIT + (c >> 4)];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          w[j] = e4m3x2(div_rn(in_lo(v.v[2 * j]), s), div_rn(in_hi(v.v[2 * j]), s)) |
                 (e4m3x2(div_rn(in_lo(v.v[2 * j + 1]), s), div_rn(in_hi(v.v[2 * j + 1]), s)) << 16);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          w[j] = e4m3x2(mul_rn(in_lo(v.v[2 * j]), inv), mul_rn(in_hi(v.v[2 * j]), inv)) |
                 (e4m3x2(mul_rn(in_lo(v.v[2 * j + 1]), inv), mul_rn(in_hi(v.v[2 * j + 1]), inv)) << 16);
        }
      }
      *reinterpret_cast<unsigned long long*>(xq + r * PITCH + (c >> 4) * 128 + unit_slot((c & 15) * 8)) =
          (unsigned long long)w[0] | ((unsigned long long)w[1] << 32);
    }
  }
}

// -- the weight stream -----------------------------------------------------------

struct Batch {
  V4 w[U][NT][2][2];  // unit, tile, row half (g, g + 8), 16-byte half of the thread's 32 bytes
  float bs[U];        // 128x128 block scale of the unit (F_BSCALE 2)
};

// The CTA's K range [u0, u1) of every tile; batch b of a tile is units u0 + b U ...
struct Span {
  int u0, u1;
};

__device__ __forceinline__ void load_batch(Batch& b, const unsigned char* __restrict__ w,
                                           const float* __restrict__ w_scale, int n0, const Span& sp, int batch,
                                           int g, int t4) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int unit = sp.u0 + batch * U + i;
    const bool ok = unit < sp.u1;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = n0 + t * 16 + g + 8 * h;
        const bool rok = ok && (FULL_ROWS || row < N);
        const unsigned char* p = w + (long long)row * K + unit * 128 + 16 * t4;
#pragma unroll
        for (int q = 0; q < 2; ++q) b.w[i][t][h][q] = rok ? load_weight(p + 64 * q) : zero4();
      }
    }
    if (BSCALE == 2) b.bs[i] = ok ? w_scale[(long long)(n0 / 128) * UNITS + unit] : 0.f;
  }
}

__device__ __forceinline__ void mma_batch(float (&acc)[NT][MF][4], const Batch& b, const Span& sp, int batch,
                                          const unsigned char* xq, const float* sgrp, int m, int g, int t4) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int unit = sp.u0 + batch * U + i;
    if (unit >= sp.u1) break;
    const int lu = unit - sp.u0;
    u32 xb[MF][8];  // B words: the thread's 32 bytes of token f * 8 + g in this unit
#pragma unroll
    for (int f = 0; f < MF; ++f) {
      const int r = f * 8 + g;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        unsigned long long v = 0ull;
        if (r < m) v = *reinterpret_cast<const unsigned long long*>(xq + r * PITCH + lu * 128 + 32 * t4 + 8 * s);
        xb[f][2 * s] = (u32)v;
        xb[f][2 * s + 1] = (u32)(v >> 32);
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int f = 0; f < MF; ++f) {
        // one k32 MMA per fresh fragment, summed in fp32 (see the header)
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const V4& w0 = b.w[i][t][0][s >> 1];
          const V4& w1 = b.w[i][t][1][s >> 1];
          const int e = 2 * (s & 1);
          float p[4] = {0.f, 0.f, 0.f, 0.f};
          mma_e4m3(p, w0.v[e], w1.v[e], w0.v[e + 1], w1.v[e + 1], xb[f][2 * s], xb[f][2 * s + 1]);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            if (GROUPS) {
              d[q] += p[q];
            } else {
              acc[t][f][q] += p[q];
            }
          }
        }
        if (GROUPS) {
          // D columns are tokens f * 8 + 2 t4 (+1); a row past m has scale 0 (never stored)
          const int r0 = f * 8 + 2 * t4;
          const float sa0 = r0 < m ? sgrp[r0 * UNITS_PER_SPLIT + lu] : 0.f;
          const float sa1 = r0 + 1 < m ? sgrp[(r0 + 1) * UNITS_PER_SPLIT + lu] : 0.f;
          const float c0 = sa0 * b.bs[i], c1 = sa1 * b.bs[i];
          acc[t][f][0] = fmaf(d[0], c0, acc[t][f][0]);
          acc[t][f][1] = fmaf(d[1], c1, acc[t][f][1]);
          acc[t][f][2] = fmaf(d[2], c0, acc[t][f][2]);
          acc[t][f][3] = fmaf(d[3], c1, acc[t][f][3]);
        }
      }
    }
  }
}

__device__ __forceinline__ void zero_acc(float (&acc)[NT][MF][4]) {
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][f][e] = 0.f;
}

}  // namespace fg

#if F_SPLIT > 1
#define F_CLUSTER __cluster_dims__(1, F_SPLIT, 1)
#else
#define F_CLUSTER
#endif

// grid (persistent CTAs <= ceil(N / ROWS), SPLIT), block (32 * WARPS),
// clusters of (1, SPLIT, 1); CTA column c takes row tiles c, c + gridDim.x,
// ... (its quantized activation serves them all).  Dynamic shared memory
// m * PITCH bytes (+ m * UNITS_PER_SPLIT floats with F_ASCALE 4).  x_scale:
// the static scale (F_ASCALE 0, 1); w_scale: the weight's scales; eps: the
// group floor (F_ASCALE 4).
extern "C" __global__ void F_CLUSTER __launch_bounds__(fg::THREADS)
fp8_gemv(const unsigned short* __restrict__ x, long long x_stride, const unsigned char* __restrict__ w,
         const float* __restrict__ x_scale, const float* __restrict__ w_scale, const void* __restrict__ bias,
         void* __restrict__ out, int m, float eps, unsigned char* __restrict__ q_out, float* __restrict__ s_out) {
  using namespace fg;
  __shared__ float red[WARPS][TILE];  // red[warp][mm * ROWS + row]
  __shared__ Act act;
  extern __shared__ __align__(16) unsigned char dyn[];
  unsigned char* xq = dyn;
  float* sgrp = reinterpret_cast<float*>(dyn + m * PITCH);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t4 = lane & 3;

  Span sp;
  sp.u0 = blockIdx.y * UNITS_PER_SPLIT;
  sp.u1 = sp.u0 + UNITS_PER_SPLIT < UNITS ? sp.u0 + UNITS_PER_SPLIT : UNITS;
  // This warp's batches per tile (>= 1: the host's config predicate) and the
  // CTA's tiles; the warp's j-th batch is batch bi(j) of tile tile(j).
  const int nbatch = (sp.u1 - sp.u0 + U - 1) / U;
  const int cw = (nbatch - warp + WARPS - 1) / WARPS;
  const int my_tiles = (int)blockIdx.x < TILES ? (TILES - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
  const int jobs = cw * my_tiles;
  auto tile_of = [&](int j) { return (int)blockIdx.x + (j / cw) * (int)gridDim.x; };
  auto batch_of = [&](int j) { return warp + (j % cw) * WARPS; };

  grid_dependency_wait();
  launch_dependents();

  // The first two weight batches go out before the activation work.
  Batch b0, b1;
  if (jobs > 0) load_batch(b0, w, w_scale, tile_of(0) * ROWS, sp, batch_of(0), g, t4);
  if (jobs > 1) load_batch(b1, w, w_scale, tile_of(1) * ROWS, sp, batch_of(1), g, t4);

  act_scales(x, x_stride, m, x_scale, act, sgrp, sp.u0, sp.u1, eps, warp, lane);
  __syncthreads();
  act_codes(x, x_stride, m, act, sgrp, xq, sp.u0, sp.u1);
  __syncthreads();
  if (q_out != nullptr && blockIdx.x == 0) {
    const int bytes = (sp.u1 - sp.u0) * 128;
    for (int r = 0; r < m; ++r)
      for (int c = threadIdx.x; c < bytes / 8; c += THREADS)
        *reinterpret_cast<unsigned long long*>(q_out + (long long)r * K + sp.u0 * 128 + c * 8) =
            *reinterpret_cast<const unsigned long long*>(xq + r * PITCH + (c >> 4) * 128 + unit_slot((c & 15) * 8));
    for (int r = threadIdx.x; r < m; r += THREADS) {
      if (GROUPS) {
        for (int u = sp.u0; u < sp.u1; ++u) s_out[r * UNITS + u] = sgrp[r * UNITS_PER_SPLIT + (u - sp.u0)];
      } else if (blockIdx.y == 0 && (ASCALE == 1 || ASCALE == 3 || r == 0)) {
        s_out[r] = act.s[r];
      }
    }
  }

  float acc[NT][MF][4];
  zero_acc(acc);

  // One batch per step, the next one (of this tile or the next) in flight;
  // a consumed buffer is refilled at once, and a tile's end (one place,
  // every warp in the same tile order) sums the warps' and the cluster's
  // partials.
  for (int j = 0; j < jobs; ++j) {
    if (j & 1) {
      mma_batch(acc, b1, sp, batch_of(j), xq, sgrp, m, g, t4);
      if (j + 2 < jobs) load_batch(b1, w, w_scale, tile_of(j + 2) * ROWS, sp, batch_of(j + 2), g, t4);
    } else {
      mma_batch(acc, b0, sp, batch_of(j), xq, sgrp, m, g, t4);
      if (j + 2 < jobs) load_batch(b0, w, w_scale, tile_of(j + 2) * ROWS, sp, batch_of(j + 2), g, t4);
    }
    if ((j + 1) % cw == 0) {
      const int n0 = tile_of(j) * ROWS;
      store_partials(red[warp], ROWS, 0, acc, g, t4);
      __syncthreads();
      reduce_partials<WARPS, TILE, ROWS, SPLIT, THREADS>(red, [&](int mm, int r, float s) {
        const int n = n0 + r;
        if (mm < m && n < N) {
          float v = s;
          if (!GROUPS) {
            v = v * act.s[ASCALE == 0 || ASCALE == 2 ? 0 : mm];
            v = v * w_scale[BSCALE == 1 ? n : 0];
          }
          if (F_BIAS != 0) v = v + bias_at<F_BIAS>(bias, n);
          store_out<F_OUT, N>(out, v, mm, n);
        }
      });
      __syncthreads();  // red is rewritten by the next tile
      zero_acc(acc);
    }
  }
}
