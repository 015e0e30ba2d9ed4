// Small-M NVFP4 GEMM ("GEMV") for Hopper, which has no FP4 tensor cores:
//
//     W4A4:  out[m, n] = alpha * sum_k deq(a)[m, k] * deq(b)[n, k] (+ bias[n])    small M
//     W4A16: out[m, n] = alpha * sum_k a[m, k] * deq(b)[n, k] (+ bias[n])         (G_ACT 1, 2)
//     W4A4 from a 16-bit activation (G_QUANT 1): a = nvfp4_quant(x, *gs) inside the kernel
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
//   G_QUANT      1 (with G_ACT 0): a is the bf16 (G_IN_F16 0) / fp16 activation
//                x [m, K], a_scales points at its fp32 global scale gs, and
//                every CTA quantizes its K range of x into shared memory
//                (nvfp4_quant's codes and scales bit for bit, nvfp4_quant.cuh)
//                before its MMA loop, while its first weight batch is in flight
//   G_STAGES     0: two register batches per warp (one in flight while the
//                other is multiplied); 2..8: a per-thread ring of that many
//                batches in dynamic shared memory filled by cp.async, so
//                STAGES - 1 batches are in flight without holding registers
//                (not with G_QUANT)
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
//    2^-28 goes back in the epilogue (a power of two).  With a bf16
//    activation (G_ACT 2) the weight goes straight to bf16 (decode8_bf16:
//    e2m1 * s * 2^-7, as many instructions as the fp16 decoder) instead of
//    being decoded to fp16 and converted.
//  * Split K across the warps of a CTA (shared-memory sums in warp order) and
//    across the CTAs of a cluster (DSMEM sums in rank order): no workspace,
//    no atomics, no counters, bit-reproducible, CUDA-graph safe.
//  * Programmatic dependent launch (a no-op without it): every thread waits
//    for the previous grid (griddepcontrol.wait) before its first global
//    read or write, then lets the next grid launch.  (Even the weight waits:
//    a PDL quantizer of ours may be writing it, e.g. right after from_float.)

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
#ifndef G_QUANT
#define G_QUANT 0
#endif
#ifndef G_IN_F16
#define G_IN_F16 0
#endif
#ifndef G_STAGES
#define G_STAGES 0
#endif

#include "nvfp4_decode.cuh"
#include "nvfp4_quant.cuh"

namespace gv {

using namespace fa_ptx;
using namespace nvfp4_dec;

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
constexpr bool QUANT = G_QUANT != 0;
// G_QUANT's shared memory, per activation row: the codes of the CTA's K range
// (a pitch = 64 mod 128 bytes: a quarter warp's 16-byte loads of rows g and
// g + 1 then fall in distinct banks), then its scale bytes.
constexpr int QPITCH = UNITS_PER_SPLIT * 64 + (UNITS_PER_SPLIT % 2 == 0 ? 64 : 0);
constexpr int SPITCH = UNITS_PER_SPLIT * 8;
// G_STAGES ring, per thread and unit: 16-byte copies (weight rows g, g + 8 of
// each tile, then each fragment's activation) and 4-byte words holding the
// 2-byte scale pairs (weights, then W4A4's activation).  Slot j of unit i of
// stage s for thread tid sits at ((s U + i) R16 + j) THREADS + tid: a warp's
// copies are contiguous, so its reads are conflict-free.
constexpr int STAGES = G_STAGES;
constexpr bool RING = STAGES > 0;
constexpr int R16 = NT * 2 + MF * XV;
constexpr int R4 = NT * 2 + (ACT == 0 ? MF : 0);
constexpr int RING16_BYTES = STAGES * U * R16 * THREADS * 16;
constexpr int QBLOCKS = UNITS_PER_SPLIT * 8;  // 16-k blocks of a row in the CTA's K range

static_assert(K % 32 == 0 && K > 0, "K must be a positive multiple of 32");
static_assert(N > 0, "N must be positive");
static_assert(ROWS == 16 || ROWS == 32 || ROWS == 64, "G_ROWS must be 16, 32 or 64");
static_assert(MB == 8 || MB == 16 || MB == 32, "G_MB must be 8, 16 or 32");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4 || SPLIT == 8, "G_SPLIT must be 1, 2, 4 or 8");
static_assert(WARPS >= 1 && WARPS <= 16, "G_WARPS must be 1..16");
static_assert(U >= 1 && U <= 4, "G_UNROLL must be 1..4");
static_assert(ACT >= 0 && ACT <= 2, "G_ACT must be 0 (e2m1), 1 (fp16) or 2 (bf16)");
static_assert(G_QUANT == 0 || (G_QUANT == 1 && ACT == 0), "G_QUANT 1 quantizes to e2m1: it needs G_ACT 0");
static_assert(WARPS * TILE * 4 <= 48 * 1024, "reduction buffer exceeds 48 KiB of static shared memory");
static_assert(STAGES == 0 || (STAGES >= 2 && STAGES <= 8), "G_STAGES must be 0 or 2..8");
static_assert(!(RING && QUANT), "G_STAGES and G_QUANT both need the dynamic shared memory");

__device__ __forceinline__ void mma_act(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  nvfp4_dec::mma_act<ACT>(d, a0, a1, a2, a3, b0, b1);
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

__device__ __forceinline__ bool unit_ok(const Operands& op, int unit) {
  return FULL_UNITS || (unit < op.u_end && unit * 4 + op.t4 < CHUNKS);
}

// Unit i of a batch: its weight rows and scales (WEIGHTS), then (ACTS) its
// activation: from global memory, or (G_QUANT) from the CTA's quantized
// rows in shared memory (offsets within the CTA's K range).
template <bool WEIGHTS, bool ACTS>
__device__ __forceinline__ void load_unit(Batch& b, const Operands& op, int batch, int i) {
  const int unit = op.u_begin + batch * U + i;
  const bool ok = unit_ok(op, unit);
  const long long so = (long long)unit * 1024;  // scale bytes per unit (two column groups)
  if (WEIGHTS) {
    const long long wo = (long long)unit * 64;  // bytes of a weight row per unit
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool rok = ok && (FULL_ROWS || op.w_ok[t][h]);
        b.w[i][t][h] = rok ? load_weight(op.w_row[t][h] + wo) : zero4();
        b.ws[i][t][h] = rok ? load_scale2(op.ws_row[t][h] + so) : 0u;
      }
    }
  }
  if (!ACTS) return;
  const long long xo = (long long)unit * X_UNIT_BYTES;
  const int lu = unit - op.u_begin;
#pragma unroll
  for (int f = 0; f < MF; ++f) {
    const bool rok = ok && op.x_ok[f];
    if (QUANT) {
      b.x[i][f][0] = rok ? *reinterpret_cast<const V4*>(op.x_row[f] + lu * 64) : zero4();
      b.xs[i][f] = rok ? (u32) * reinterpret_cast<const u16*>(op.xs_row[f] + lu * 8) : 0u;
    } else {
#pragma unroll
      for (int v = 0; v < XV; ++v) b.x[i][f][v] = rok ? load_act(op.x_row[f] + xo + 16 * v) : zero4();
      if (ACT == 0) b.xs[i][f] = rok ? load_scale2(op.xs_row[f] + so) : 0u;
    }
  }
}

template <bool WEIGHTS = true, bool ACTS = true>
__device__ __forceinline__ void load_batch(Batch& b, const Operands& op, int batch) {
#pragma unroll
  for (int i = 0; i < U; ++i) load_unit<WEIGHTS, ACTS>(b, op, batch, i);
}

// G_STAGES: batch `batch` of the warp into ring stage `slot` (cp.async; the
// caller commits the group).  A scale pair is copied as the aligned 4-byte
// word that holds it (the launcher passes 4-byte aligned scale tensors; a
// pair's offset in its word is 2 (t4 & 1) bytes).  `any`: a valid address for
// the zero-filled copies, which read nothing.
__device__ __forceinline__ const void* word_of(const unsigned char* p) {
  return reinterpret_cast<const void*>(reinterpret_cast<unsigned long long>(p) & ~3ull);
}

__device__ __forceinline__ void ring_issue(u32 ring, const Operands& op, int batch, int slot, int tid,
                                           const void* any) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int unit = op.u_begin + batch * U + i;
    const bool ok = unit_ok(op, unit);
    const long long so = (long long)unit * 1024;
    const long long wo = (long long)unit * 64;
    const long long xo = (long long)unit * X_UNIT_BYTES;
    const u32 s16 = ring + (u32)(((slot * U + i) * R16) * THREADS + tid) * 16u;
    const u32 s4 = ring + RING16_BYTES + (u32)(((slot * U + i) * R4) * THREADS + tid) * 4u;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool rok = ok && (FULL_ROWS || op.w_ok[t][h]);
        const int j = 2 * t + h;
        cp_async16_weight(s16 + j * THREADS * 16, rok ? (const void*)(op.w_row[t][h] + wo) : any, rok);
        cp_async4(s4 + j * THREADS * 4, rok ? word_of(op.ws_row[t][h] + so) : any, rok);
      }
    }
#pragma unroll
    for (int f = 0; f < MF; ++f) {
      const bool rok = ok && op.x_ok[f];
#pragma unroll
      for (int v = 0; v < XV; ++v) {
        cp_async16_act(s16 + (NT * 2 + f * XV + v) * THREADS * 16,
                       rok ? (const void*)(op.x_row[f] + xo + 16 * v) : any, rok);
      }
      if (ACT == 0) cp_async4(s4 + (NT * 2 + f) * THREADS * 4, rok ? word_of(op.xs_row[f] + so) : any, rok);
    }
  }
}

// Ring stage `slot` into a register batch (this thread's own copies).
__device__ __forceinline__ void ring_read(Batch& b, const unsigned char* ring, int slot, int tid, int shift) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const V4* s16 = reinterpret_cast<const V4*>(ring) + ((slot * U + i) * R16) * THREADS + tid;
    const u32* s4 = reinterpret_cast<const u32*>(ring + RING16_BYTES) + ((slot * U + i) * R4) * THREADS + tid;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        b.w[i][t][h] = s16[(2 * t + h) * THREADS];
        b.ws[i][t][h] = (s4[(2 * t + h) * THREADS] >> shift) & 0xFFFFu;
      }
    }
#pragma unroll
    for (int f = 0; f < MF; ++f) {
#pragma unroll
      for (int v = 0; v < XV; ++v) b.x[i][f][v] = s16[(NT * 2 + f * XV + v) * THREADS];
      if (ACT == 0) b.xs[i][f] = (s4[(NT * 2 + f) * THREADS] >> shift) & 0xFFFFu;
    }
  }
}

// G_QUANT: the codes and scales of x's rows [0, m), 16-k blocks
// [8 u_begin, 8 u_end) into xq (row r at r * QPITCH) and xs (r * SPITCH);
// blocks past K are zero.  A thread takes QB blocks at a time, all their loads
// issued before the first is quantized (one L2 latency per QB blocks).
constexpr int QB = 2;

__device__ __forceinline__ void quantize_rows(const unsigned char* __restrict__ x, long long x_stride, int m,
                                              float gs, int u_begin, int u_end, unsigned char* xq,
                                              unsigned char* xs) {
  const float rgs = nvfp4_q::rcp_rn(gs);
  const int kb_end = (u_end * 8 < K / 16 ? u_end * 8 : K / 16) - u_begin * 8;
  const int total = m * QBLOCKS;
  for (int base = threadIdx.x; base < total; base += QB * THREADS) {
    V4 v[QB][2];
#pragma unroll
    for (int j = 0; j < QB; ++j) {
      const int idx = base + j * THREADS;
      const int r = idx / QBLOCKS, kb = idx - r * QBLOCKS;
      const V4* p = reinterpret_cast<const V4*>(x + r * x_stride + (long long)(u_begin * 8 + kb) * 32);
      const bool live = idx < total && kb < kb_end;
      v[j][0] = live ? p[0] : zero4();
      v[j][1] = live ? p[1] : zero4();
    }
#pragma unroll
    for (int j = 0; j < QB; ++j) {
      const int idx = base + j * THREADS;
      if (idx < total) {
        const int r = idx / QBLOCKS, kb = idx - r * QBLOCKS;
        const u32 w[8] = {v[j][0].v[0], v[j][0].v[1], v[j][0].v[2], v[j][0].v[3],
                          v[j][1].v[0], v[j][1].v[1], v[j][1].v[2], v[j][1].v[3]};
        float f[16];
        nvfp4_q::unpack_block16<G_IN_F16 != 0>(w, f);
        u32 codes[2];
        const u32 sbyte = nvfp4_q::quant_block16(f, gs, rgs, codes);  // zeros give code 0, scale 0
        *reinterpret_cast<unsigned long long*>(xq + r * QPITCH + kb * 8) =
            (unsigned long long)codes[0] | ((unsigned long long)codes[1] << 32);
        xs[r * SPITCH + kb] = (unsigned char)sbyte;
      }
    }
  }
}

// The activation word q (k 8q .. 8q + 7 of the thread's 32) of fragment f,
// in decode8's order; xlo / xhi: the fragment's W4A4 scale pairs.
__device__ __forceinline__ void act_word(const Batch& b, int i, int f, int q, u32 xlo, u32 xhi, u32* r) {
  if (ACT == 0) {
    decode8(b.x[i][f][0].v[q], q < 2 ? xlo : xhi, r);
  } else {
    act_pairs(b.x[i][f][q], r);
  }
}

// MB == 32: per weight word, every fragment's activation word (decoded once).
__device__ __forceinline__ void mma_batch_wide(float (&acc)[NT][MF][4], const Batch& b) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    u32 slo[NT][2], shi[NT][2];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      weight_scale_pairs<ACT>(b.ws[i][t][0], slo[t][0], shi[t][0]);
      weight_scale_pairs<ACT>(b.ws[i][t][1], slo[t][1], shi[t][1]);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      u32 r0[NT][4], r1[NT][4];
#pragma unroll
      for (int t = 0; t < NT; ++t) weight_word<ACT>(b.w[i][t][0], b.w[i][t][1], q, slo[t], shi[t], r0[t], r1[t]);
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
      weight_scale_pairs<ACT>(b.ws[i][t][0], slo[0], shi[0]);
      weight_scale_pairs<ACT>(b.ws[i][t][1], slo[1], shi[1]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        u32 r0[4], r1[4];  // rows g and g + 8, k offsets 8q .. 8q + 7 of the chunk
        weight_word<ACT>(b.w[i][t][0], b.w[i][t][1], q, slo, shi, r0, r1);
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
__device__ __forceinline__ long long scale_offset(int r, int t4) { return nvfp4_dec::scale_offset(r, t4, SCALE_C4); }

__device__ __forceinline__ void store_out(u16* out, const void* bias, float alpha, int mm, int n, float s) {
  nvfp4_dec::store_out<ACT, G_BIAS, G_OUT_F16 != 0, N>(out, bias, alpha, mm, n, s);
}

}  // namespace gv

#if G_SPLIT > 1
#define G_CLUSTER __cluster_dims__(1, G_SPLIT, 1)
#else
#define G_CLUSTER
#endif

// grid (ceil(N / ROWS), SPLIT), block (32 * WARPS); clusters of (1, SPLIT, 1).
// m <= MB; a_stride: bytes between rows of a (a multiple of 16, or anything
// when m == 1).  G_QUANT: m * (QPITCH + SPITCH) bytes of dynamic shared memory;
// G_STAGES: STAGES * U * THREADS * (16 R16 + 4 R4) bytes, and 4-byte aligned
// scale tensors.
// G_QUANT asks for one resident CTA per SM, so ptxas may use up to
// 65536 / THREADS registers: its default for 512-thread CTAs, 64, spills the
// prologue's blocks (which sit next to the first weight batch).
#if G_QUANT
#define G_BOUNDS __launch_bounds__(gv::THREADS, 1)
#else
#define G_BOUNDS __launch_bounds__(gv::THREADS)
#endif

extern "C" __global__ void G_CLUSTER G_BOUNDS
nvfp4_gemv(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
           const unsigned char* __restrict__ a_scales, const unsigned char* __restrict__ b_scales,
           const float* __restrict__ alpha_ptr, const void* __restrict__ bias, unsigned short* __restrict__ out,
           int m, long long a_stride) {
  using namespace gv;
  __shared__ float red[WARPS][TILE];  // red[warp][mm * ROWS + row]
  extern __shared__ __align__(16) unsigned char dyn[];  // G_QUANT's rows or G_STAGES' ring

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
    if (QUANT) {
      op.x_row[f] = dyn + row * QPITCH + t4 * 16;
      op.xs_row[f] = dyn + m * QPITCH + row * SPITCH + t4 * 2;
    } else {
      op.x_row[f] = a + (long long)row * a_stride + t4 * (X_UNIT_BYTES / 4);
      op.xs_row[f] = ACT == 0 ? a_scales + scale_offset(row, t4) : a_scales;
    }
  }

  float acc[NT][MF][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][f][e] = 0.f;

  // Warps take batches of U units round-robin: batches warp, warp + WARPS, ...
  const int nbatch = (op.u_end - op.u_begin + U - 1) / U;
  if constexpr (RING) {
    const int nloc = warp < nbatch ? (nbatch - 1 - warp) / WARPS + 1 : 0;
    const u32 ring = smem_addr(dyn);
    const int tid = threadIdx.x;
    const int shift = 16 * (t4 & 1);
    grid_dependency_wait();
    launch_dependents();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nloc) ring_issue(ring, op, warp + s * WARPS, s, tid, b);
      cp_async_commit();
    }
    Batch cur;
    for (int j = 0; j < nloc; ++j) {
      cp_async_wait<STAGES - 2>();  // this thread's group j has landed
      ring_read(cur, dyn, j % STAGES, tid, shift);
      // Refill the stage read in iteration j - 1: its values fed that
      // iteration's MMAs, which were issued before this copy.
      const int nj = j + STAGES - 1;
      if (nj < nloc) ring_issue(ring, op, warp + nj * WARPS, nj % STAGES, tid, b);
      cp_async_commit();
      mma_batch(acc, cur);
    }
    cp_async_wait<0>();
  } else {
    Batch b0, b1;  // two register batches in flight
    int bi = warp;
    if (QUANT) {
      grid_dependency_wait();
      launch_dependents();
      if (bi < nbatch) load_batch<true, false>(b0, op, bi);
      quantize_rows(a, a_stride, m, *reinterpret_cast<const float*>(a_scales), op.u_begin, op.u_end, dyn,
                    dyn + m * QPITCH);
      __syncthreads();
      if (bi < nbatch) load_batch<false, true>(b0, op, bi);
    } else {
      grid_dependency_wait();
      launch_dependents();
      if (bi < nbatch) load_batch(b0, op, bi);
    }
    while (bi < nbatch) {
      if (bi + WARPS < nbatch) load_batch(b1, op, bi + WARPS);
      mma_batch(acc, b0);
      bi += WARPS;
      if (bi >= nbatch) break;
      if (bi + WARPS < nbatch) load_batch(b0, op, bi + WARPS);
      mma_batch(acc, b1);
      bi += WARPS;
    }
  }

  // Warp partials -> shared memory, summed over warps and the cluster.
  store_partials(red[warp], ROWS, 0, acc, g, t4);
  __syncthreads();
  const float alpha = *alpha_ptr;
  reduce_partials<WARPS, TILE, ROWS, SPLIT, THREADS>(red, [&](int mm, int r, float s) {
    const int n = n0 + r;
    if (mm < m && n < N) store_out(out, bias, alpha, mm, n, s);
  });
}
