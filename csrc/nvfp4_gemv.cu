// Small-M NVFP4 GEMM ("GEMV") for Hopper, which has no FP4 tensor cores:
//
//     W4A4:  out[m, n] = alpha * sum_k deq(a)[m, k] * deq(b)[n, k] (+ bias[n])    small M
//     W4A16: out[m, n] = alpha * sum_k a[m, k] * deq(b)[n, k] (+ bias[n])         (G_ACT 1, 2)
//
//     a: uint8 [M, K/2] packed e2m1 (low nibble first), rows a_stride bytes apart;
//        W4A16: fp16 / bf16 [M, K], rows a_stride bytes apart (a multiple of 16)
//     b: uint8 [N, K/2] packed e2m1, contiguous
//     a_scales, b_scales: e4m3 block scales (one per 16 k), swizzled 128x4 layout:
//        S[r, c] at ((r / 128) * (C' / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4
//     deq(q)[r, k] = e2m1(q[r, k]) * s[r, k / 16]; alpha: one fp32 on the device.
//
// Compiled at run time with NVRTC (scaledmm/jit); needs no CUDA header.  Every
// size and tile choice is a macro, so one cubin serves one (N, K, config):
//
//   G_N, G_K     problem size (K % 32 == 0; any N >= 1)
//   G_ROWS       weight rows per CTA (16, 32 or 64)
//   G_WARPS      warps per CTA; they split the CTA's K range between them
//   G_SPLIT      CTAs per thread-block cluster along K (1, 2, 4, 8), partial
//                sums added through distributed shared memory in rank order
//   G_UNROLL     128-wide K units per register batch (two batches in flight)
//   G_MB         M bucket: 8, 16 or 32 activation rows (M <= G_MB)
//   G_OUT_F16    1: fp16 output, 0: bf16
//   G_BIAS       0: none, 1: fp32, 2: bf16, 3: fp16 bias
//   G_ACT        0: packed e2m1 activation with its block scales (W4A4),
//                1: fp16 activation, 2: bf16 activation (W4A16; a_scales unused)
//
// Design (the kernel streams the packed weight from HBM once):
//  * Swap-AB mma.sync m16n8k16 f16 x f16 -> f32: A = 16 weight rows x 16 k,
//    B = activation^T (16 k x 8 tokens), D = out^T: one B fragment per 8
//    rows of the M bucket.  Up to 16 rows the whole unit of activation is
//    decoded first; from 32 rows on, one 32-bit word of each fragment at a
//    time, after the weight word it meets (registers stay bounded; the
//    accumulation order is the same).
//  * Each thread loads 16 contiguous bytes (32 k) of weight rows g and g + 8
//    and of activation row g straight into registers with
//    ld.global.nc.L1::no_allocate.v4 (128-wide unit: thread t of a quad owns
//    k = 32 t .. 32 t + 31); no shared memory for the operands.  The
//    reduction order over k is free, so the same register permutation is used
//    for A and B (see decode8).
//  * Decode: the fp16 pattern sign << 15 | mag << 9 is exactly e2m1 * 2^-14
//    (0.5 is fp16's subnormal 2^-15).  One 32-bit word of 8 codes becomes 4
//    fp16x2 registers with 11 integer instructions (one rotate, two lop3
//    merges of sign and magnitude bits, then shift + mask per register).
//  * Block scales: a thread's 32 k are two whole 16-k blocks, while one mma
//    k16 step spreads its k over the 4 threads of a quad, so one mma cannot
//    be confined to one scale block without exchanging data between threads.
//    The scale is applied in the decode instead: one mul.rn.f16x2 by [s : s]
//    per register, exact (e2m1 * e4m3 * 2^-14 is a multiple of 2^-24 below
//    0.17 with at most 7 significant bits: fp16 holds it, subnormals included,
//    no .ftz).  The tensor core's products of two exact fp16 are exact; the
//    2^-28 goes back in the epilogue (a power of two).
//  * Split K across the warps of a CTA (shared-memory sums in warp order) and
//    across the CTAs of a cluster (DSMEM sums in rank order): no workspace,
//    no atomics, no counters, bit-reproducible, CUDA-graph safe.

#ifndef G_N
#error "G_N (output columns) must be defined"
#endif
#ifndef G_K
#error "G_K (reduction length) must be defined"
#endif
#ifndef G_ROWS
#define G_ROWS 16
#endif
#ifndef G_WARPS
#define G_WARPS 4
#endif
#ifndef G_SPLIT
#define G_SPLIT 1
#endif
#ifndef G_UNROLL
#define G_UNROLL 2
#endif
#ifndef G_MB
#define G_MB 8
#endif
#ifndef G_OUT_F16
#define G_OUT_F16 0
#endif
#ifndef G_BIAS
#define G_BIAS 0
#endif
#ifndef G_ACT
#define G_ACT 0
#endif

#include "fused_a_ptx.cuh"

namespace gv {

using namespace fa_ptx;

constexpr int N = G_N;
constexpr int K = G_K;
constexpr int ROWS = G_ROWS;
constexpr int NT = ROWS / 16;
constexpr int WARPS = G_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int SPLIT = G_SPLIT;
constexpr int U = G_UNROLL;
constexpr int MB = G_MB;
constexpr int MF = MB / 8;
constexpr int ROW_BYTES = K / 2;
constexpr int CHUNKS = K / 32;                 // 32-k chunks per row (16 bytes each)
constexpr int UNITS = (CHUNKS + 3) / 4;        // 128-k units (4 chunks, one per thread of a quad)
constexpr int UNITS_PER_SPLIT = (UNITS + SPLIT - 1) / SPLIT;
constexpr int SCALE_C4 = ((K / 16 + 3) / 4);   // swizzled scale column groups of 4
constexpr bool FULL_UNITS = CHUNKS % 4 == 0 && UNITS % (SPLIT * U) == 0;
constexpr bool FULL_ROWS = N % 16 == 0;        // every 16-row tile is whole or absent
constexpr int TILE = ROWS * MB;
constexpr int ACT = G_ACT;
constexpr int XV = ACT == 0 ? 1 : 4;           // 16-byte activation loads per thread and unit
constexpr int X_UNIT_BYTES = ACT == 0 ? 64 : 256;  // bytes of an activation row per 128-k unit

static_assert(K % 32 == 0 && K > 0, "K must be a positive multiple of 32");
static_assert(N > 0, "N must be positive");
static_assert(ROWS == 16 || ROWS == 32 || ROWS == 64, "G_ROWS must be 16, 32 or 64");
static_assert(MB == 8 || MB == 16 || MB == 32, "G_MB must be 8, 16 or 32");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4 || SPLIT == 8, "G_SPLIT must be 1, 2, 4 or 8");
static_assert(WARPS >= 1 && WARPS <= 16, "G_WARPS must be 1..16");
static_assert(U >= 1 && U <= 4, "G_UNROLL must be 1..4");
static_assert(ACT >= 0 && ACT <= 2, "G_ACT must be 0 (e2m1), 1 (fp16) or 2 (bf16)");
static_assert(WARPS * TILE * 4 <= 48 * 1024, "reduction buffer exceeds 48 KiB of static shared memory");

// -- PTX helpers ---------------------------------------------------------------

__device__ __forceinline__ V4 load_weight(const unsigned char* p) {
  V4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
               : "l"(p));
  return r;
}

__device__ __forceinline__ V4 load_act(const unsigned char* p) {
  V4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
               : "l"(p));
  return r;
}

// Two e4m3 scales (blocks 2t and 2t + 1 of a unit) as the low 16 bits.
__device__ __forceinline__ u32 load_scale2(const unsigned char* p) {
  u16 h;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(h) : "l"(p));
  return h;
}

__device__ __forceinline__ V4 zero4() {
  V4 r;
  r.v[0] = r.v[1] = r.v[2] = r.v[3] = 0u;
  return r;
}

// fp16x2 [s1 : s0] of two e4m3 bytes (exact; 0x7F / 0xFF give NaN).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
  u32 d;
  u16 h = (u16)two;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(h));
  return d;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// fp16x2 -> bf16x2, exact for the decoded weights (<= 7 significant bits, >= 2^-24).
__device__ __forceinline__ u32 f16x2_to_bf16x2(u32 h2) {
  float lo, hi;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi) : "r"(h2));
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// The MMA of this instantiation: f16 (W4A4, fp16 activation) or bf16 operands.
__device__ __forceinline__ void mma_act(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if (ACT == 2) {
    mma_bf16(d, a0, a1, a2, a3, b0, b1);
  } else {
    mma_f16(d, a0, a1, a2, a3, b0, b1);
  }
}

__device__ __forceinline__ u16 to_f16(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// 8 codes (nibble j = k offset j of the word) -> 4 fp16x2 registers times the
// scale pair s2 = [s : s]: r[j] = {lo: code j, hi: code j + 4} * s * 2^-14.
// The magnitude of code j must land at bits 9..11 (shift 9 - 4j) and its sign
// at bit 15 (shift 12 - 4j).  xe / xo park each sign 6 bits above its
// magnitude (bits 4j + 6, taken from rotl(w, 3)) so one shift places both;
// code 7's sign wraps to bit 2 and the last register uses a rotate.
// (a & ~mask) | (b & mask) in one lop3 (ptxas splits the C form into two).
template <u32 MASK>
__device__ __forceinline__ u32 select_bits(u32 a, u32 b) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xB8;" : "=r"(d) : "r"(a), "n"(MASK), "r"(b));
  return d;
}

constexpr u32 F16_FIELDS = 0x8E008E00u;  // sign + 3 magnitude bits of both halves

__device__ __forceinline__ void decode8(u32 w, u32 s2, u32* r) {
  const u32 rot = __funnelshift_l(w, w, 3);
  const u32 xe = select_bits<0x40404040u>(w, rot);  // codes 0, 2, 4, 6
  const u32 xo = select_bits<0x04040404u>(w, rot);  // codes 1, 3, 5, 7
  r[0] = hmul2((xe << 9) & F16_FIELDS, s2);
  r[1] = hmul2((xo << 5) & F16_FIELDS, s2);
  r[2] = hmul2((xe << 1) & F16_FIELDS, s2);
  r[3] = hmul2(__funnelshift_r(xo, xo, 3) & F16_FIELDS, s2);
}

// [s : s] pairs of a unit's two blocks: words 0-1 of a chunk use the low scale.
__device__ __forceinline__ void scale_pairs(u32 two, u32& lo, u32& hi) {
  const u32 d = e4m3x2_to_f16x2(two);
  lo = __byte_perm(d, 0, 0x1010);
  hi = __byte_perm(d, 0, 0x3232);
}

// -- one warp's register batch: U units x (NT tiles x 2 row halves) of b, U x MF of a

struct Batch {
  V4 w[U][NT][2];
  u32 ws[U][NT][2];
  V4 x[U][MF][XV];
  u32 xs[U][MF];  // W4A4 only
};

struct Operands {
  const unsigned char* w_row[NT][2];  // weight rows g, g + 8 of each tile, at chunk t of unit 0
  const unsigned char* ws_row[NT][2]; // their scale pairs of unit 0
  bool w_ok[NT][2];
  const unsigned char* x_row[MF];
  const unsigned char* xs_row[MF];
  bool x_ok[MF];
  int u_begin, u_end;
  int t4;
};

__device__ __forceinline__ void load_batch(Batch& b, const Operands& op, int batch) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int unit = op.u_begin + batch * U + i;
    const bool ok = FULL_UNITS || (unit < op.u_end && unit * 4 + op.t4 < CHUNKS);
    const long long wo = (long long)unit * 64;   // bytes of a weight row per unit
    const long long xo = (long long)unit * X_UNIT_BYTES;
    const long long so = (long long)unit * 1024;  // scale bytes per unit (two column groups)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool rok = ok && (FULL_ROWS || op.w_ok[t][h]);
        b.w[i][t][h] = rok ? load_weight(op.w_row[t][h] + wo) : zero4();
        b.ws[i][t][h] = rok ? load_scale2(op.ws_row[t][h] + so) : 0u;
      }
    }
#pragma unroll
    for (int f = 0; f < MF; ++f) {
      const bool rok = ok && op.x_ok[f];
#pragma unroll
      for (int v = 0; v < XV; ++v) b.x[i][f][v] = rok ? load_act(op.x_row[f] + xo + 16 * v) : zero4();
      if (ACT == 0) b.xs[i][f] = rok ? load_scale2(op.xs_row[f] + so) : 0u;
    }
  }
}

// The activation word q (k 8q .. 8q + 7 of the thread's 32) of fragment f,
// in decode8's order; xlo / xhi: the fragment's W4A4 scale pairs.
__device__ __forceinline__ void act_word(const Batch& b, int i, int f, int q, u32 xlo, u32 xhi, u32* r) {
  if (ACT == 0) {
    decode8(b.x[i][f][0].v[q], q < 2 ? xlo : xhi, r);
  } else {  // 16 bytes = k 8q .. 8q + 7 as pairs (0 1)(2 3)(4 5)(6 7)
    const V4& v = b.x[i][f][q];
    r[0] = __byte_perm(v.v[0], v.v[2], 0x5410);
    r[1] = __byte_perm(v.v[0], v.v[2], 0x7632);
    r[2] = __byte_perm(v.v[1], v.v[3], 0x5410);
    r[3] = __byte_perm(v.v[1], v.v[3], 0x7632);
  }
}

// The weight word q of both row halves of tile t, decoded (bf16 for G_ACT 2).
__device__ __forceinline__ void weight_word(const Batch& b, int i, int t, int q, const u32 (&slo)[2],
                                            const u32 (&shi)[2], u32 (&r0)[4], u32 (&r1)[4]) {
  decode8(b.w[i][t][0].v[q], q < 2 ? slo[0] : shi[0], r0);
  decode8(b.w[i][t][1].v[q], q < 2 ? slo[1] : shi[1], r1);
  if (ACT == 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      r0[j] = f16x2_to_bf16x2(r0[j]);
      r1[j] = f16x2_to_bf16x2(r1[j]);
    }
  }
}

// MB == 32: per weight word, every fragment's activation word (decoded once).
__device__ __forceinline__ void mma_batch_wide(float (&acc)[NT][MF][4], const Batch& b) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    u32 slo[NT][2], shi[NT][2];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      scale_pairs(b.ws[i][t][0], slo[t][0], shi[t][0]);
      scale_pairs(b.ws[i][t][1], slo[t][1], shi[t][1]);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      u32 r0[NT][4], r1[NT][4];
#pragma unroll
      for (int t = 0; t < NT; ++t) weight_word(b, i, t, q, slo[t], shi[t], r0[t], r1[t]);
#pragma unroll
      for (int f = 0; f < MF; ++f) {
        u32 xlo = 0u, xhi = 0u, xq[4];
        if (ACT == 0) scale_pairs(b.xs[i][f], xlo, xhi);
        act_word(b, i, f, q, xlo, xhi, xq);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            mma_act(acc[t][f], r0[t][2 * s], r1[t][2 * s], r0[t][2 * s + 1], r1[t][2 * s + 1], xq[2 * s],
                    xq[2 * s + 1]);
          }
        }
      }
    }
  }
}

__device__ __forceinline__ void mma_batch(float (&acc)[NT][MF][4], const Batch& b) {
  if (MF > 2) {
    mma_batch_wide(acc, b);
    return;
  }
#pragma unroll
  for (int i = 0; i < U; ++i) {
    u32 xd[MF][16];  // the thread's 32 k in decode8's order: xd[4q + j] = {k 8q + j, k 8q + j + 4}
#pragma unroll
    for (int f = 0; f < MF; ++f) {
      if (ACT == 0) {
        u32 lo, hi;
        scale_pairs(b.xs[i][f], lo, hi);
#pragma unroll
        for (int q = 0; q < 4; ++q) decode8(b.x[i][f][0].v[q], q < 2 ? lo : hi, &xd[f][4 * q]);
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) act_word(b, i, f, q, 0u, 0u, &xd[f][4 * q]);
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      u32 slo[2], shi[2];
      scale_pairs(b.ws[i][t][0], slo[0], shi[0]);
      scale_pairs(b.ws[i][t][1], slo[1], shi[1]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        u32 r0[4], r1[4];  // rows g and g + 8, k offsets 8q .. 8q + 7 of the chunk
        weight_word(b, i, t, q, slo, shi, r0, r1);
#pragma unroll
        for (int s = 0; s < 2; ++s) {  // two k16 steps per word
#pragma unroll
          for (int f = 0; f < MF; ++f) {
            mma_act(acc[t][f], r0[2 * s], r1[2 * s], r0[2 * s + 1], r1[2 * s + 1], xd[f][4 * q + 2 * s],
                    xd[f][4 * q + 2 * s + 1]);
          }
        }
      }
    }
  }
}

// Byte offset of scale column 8 * unit0 + 2 t (unit 0) of row r in the swizzled layout.
__device__ __forceinline__ long long scale_offset(int r, int t4) {
  return ((long long)(r >> 7) * SCALE_C4 + (t4 >> 1)) * 512 + (r & 31) * 16 + ((r & 127) >> 5) * 4 + 2 * (t4 & 1);
}

// alpha * 2^28 * acc (+ bias), one rounding to the output type.
__device__ __forceinline__ void store_out(u16* out, const void* bias, float alpha, int mm, int n, float s) {
  // 2^28 (W4A4) / 2^14 (W4A16) undoes the decoders' 2^-14 per decoded operand (exact)
  float v = s * (ACT == 0 ? 268435456.0f : 16384.0f) * alpha;
#if G_BIAS == 1
  v += ((const float*)bias)[n];
#elif G_BIAS == 2
  v += bf16_to_f32(((const u16*)bias)[n]);
#elif G_BIAS == 3
  v += f16_to_f32(((const u16*)bias)[n]);
#endif
#if G_OUT_F16
  out[(long long)mm * N + n] = to_f16(v);
#else
  out[(long long)mm * N + n] = to_bf16(v);
#endif
}

}  // namespace gv

#if G_SPLIT > 1
#define G_CLUSTER __cluster_dims__(1, G_SPLIT, 1)
#else
#define G_CLUSTER
#endif

// grid (ceil(N / ROWS), SPLIT), block (32 * WARPS); clusters of (1, SPLIT, 1).
// m <= MB; a_stride: bytes between rows of a (a multiple of 16, or anything
// when m == 1).
extern "C" __global__ void G_CLUSTER __launch_bounds__(gv::THREADS)
nvfp4_gemv(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
           const unsigned char* __restrict__ a_scales, const unsigned char* __restrict__ b_scales,
           const float* __restrict__ alpha_ptr, const void* __restrict__ bias, unsigned short* __restrict__ out,
           int m, long long a_stride) {
  using namespace gv;
  __shared__ float red[WARPS][TILE];  // red[warp][mm * ROWS + row]

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int n0 = blockIdx.x * ROWS;

  Operands op;
  op.t4 = t4;
  op.u_begin = blockIdx.y * UNITS_PER_SPLIT;
  op.u_end = op.u_begin + UNITS_PER_SPLIT < UNITS ? op.u_begin + UNITS_PER_SPLIT : UNITS;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = n0 + t * 16 + g + 8 * h;
      op.w_ok[t][h] = row < N;
      op.w_row[t][h] = b + (long long)row * ROW_BYTES + t4 * 16;
      op.ws_row[t][h] = b_scales + scale_offset(row, t4);
    }
  }
#pragma unroll
  for (int f = 0; f < MF; ++f) {
    const int row = f * 8 + g;
    op.x_ok[f] = row < m;
    op.x_row[f] = a + (long long)row * a_stride + t4 * (X_UNIT_BYTES / 4);
    op.xs_row[f] = ACT == 0 ? a_scales + scale_offset(row, t4) : a_scales;
  }

  float acc[NT][MF][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][f][e] = 0.f;

  // Warps take batches of U units round-robin; two register batches in flight.
  const int nbatch = (op.u_end - op.u_begin + U - 1) / U;
  Batch b0, b1;
  int bi = warp;
  if (bi < nbatch) load_batch(b0, op, bi);
  while (bi < nbatch) {
    if (bi + WARPS < nbatch) load_batch(b1, op, bi + WARPS);
    mma_batch(acc, b0);
    bi += WARPS;
    if (bi >= nbatch) break;
    if (bi + WARPS < nbatch) load_batch(b0, op, bi + WARPS);
    mma_batch(acc, b1);
    bi += WARPS;
  }

  // Warp partials -> shared memory.  acc[t][f] = D of rows t*16 + g (+8),
  // columns mm = f*8 + 2*t4 (+1).
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int f = 0; f < MF; ++f) {
      const int r = t * 16 + g;
      const int mm = f * 8 + 2 * t4;
      red[warp][mm * ROWS + r] = acc[t][f][0];
      red[warp][(mm + 1) * ROWS + r] = acc[t][f][1];
      red[warp][mm * ROWS + r + 8] = acc[t][f][2];
      red[warp][(mm + 1) * ROWS + r + 8] = acc[t][f][3];
    }
  }
  __syncthreads();
  const float alpha = *alpha_ptr;

  // Sum over warps in a fixed order; red[0] then holds the CTA's partial.
  for (int e = threadIdx.x; e < TILE; e += THREADS) {
    float s = red[0][e];
#pragma unroll
    for (int v = 1; v < WARPS; ++v) s += red[v][e];
    if (SPLIT == 1) {
      const int mm = e / ROWS;
      const int n = n0 + e % ROWS;
      if (mm < m && n < N) store_out(out, bias, alpha, mm, n, s);
    } else {
      red[0][e] = s;
    }
  }

  if (SPLIT > 1) {
    // Sum over the cluster's CTAs (ranks in a fixed order) through DSMEM; each
    // CTA writes 1/SPLIT of the tile.
    cluster_sync();
    const int rank = (int)cluster_rank();
    constexpr int PER = (TILE + SPLIT - 1) / SPLIT;
    for (int e = rank * PER + threadIdx.x; e < (rank + 1) * PER && e < TILE; e += THREADS) {
      float s = 0.f;
#pragma unroll
      for (int p = 0; p < SPLIT; ++p) s += load_peer_smem(&red[0][e], (u32)p);
      const int mm = e / ROWS;
      const int n = n0 + e % ROWS;
      if (mm < m && n < N) store_out(out, bias, alpha, mm, n, s);
    }
    cluster_sync();  // keep every CTA's shared memory alive until its peers have read it
  }
}
