// NVFP4 GEMM for Hopper from tens of activation rows up: the FP4 weight is
// decoded in registers and fed to wgmma as its register operand A; the 16-bit
// activation is operand B in shared memory.
//
//     out[m, n] = alpha * sum_k x[m, k] * deq(b)[n, k] (+ bias[n])
//
// x is the W4A16 activation (fp16 / bf16), or for W4A4 the activation decoded
// once to fp16 by the caller (exact: e2m1 x e4m3 fits fp16).  b: packed e2m1
// [N, K / 2] (element 2i in the low nibble of byte i); its e4m3 block scales
// in the swizzled layout (128-row x 4-column atoms of 512 bytes).  Compiled at
// run time with NVRTC; one cubin per (N, K, config):
//
//   W_N, W_K     problem size (K % 64 == 0; any N >= 1)
//   W_BT         activation rows per CTA: the wgmma N (32, 64, 128)
//   W_WG         consumer warpgroups (1 or 2): the CTA owns BN = 64 W_WG
//                weight rows, 64 per warpgroup (the wgmma M)
//   W_ST         pipeline stages of 64 K (4 .. 8)
//   W_SPLIT      CTAs per cluster along K (1, 2, 4); partial tiles added
//                through distributed shared memory in rank order
//   W_ACT        1: fp16 operands, 2: bf16 operands
//   W_OUT_F16, W_BIAS   output dtype; bias none / fp32 / bf16 / fp16 (0-3)
//
// Design:
//  * Swap AB: weight rows are the MMA's M (64 rows per warpgroup whatever
//    the batch), activation rows its N (32-128 per CTA).  A from registers
//    lets the decode sit between the load and the MMA without a trip through
//    shared memory.
//  * One producer warp (one lane) fills a ring of W_ST stages with TMA: the
//    activation tile in the 128-byte swizzle wgmma reads, the weight's 32
//    bytes per row in the 32-byte swizzle (its 16-byte halves trade places on
//    every other group of four rows: conflict-free reads), the 512-byte scale
//    atom; rows past m / N arrive as zeros.  Each stage has a
//    full barrier (expect_tx) and an empty one (one arrival per consumer
//    warp, once the MMAs that read the slot have retired).  No CTA-wide
//    barrier in the main loop.
//  * A fragment (m16n8k16 layout per warp): thread (g, t) needs codes
//    {2t, 2t + 1} and {2t + 8, 2t + 9} of each 16-K group of rows g, g + 8,
//    i.e. byte t of each 4-byte word of the row.  It reads the row's 32 bytes
//    (the 4 threads of a quad read the same addresses: a broadcast), gathers
//    its bytes with prmt, and turns each byte into one 2 x 16-bit register:
//    fp16: (sign, magnitude) bits placed as e2m1 * 2^-14, times the fp16
//    scale (exact, subnormals kept: mul.rn.f16x2 has no flush); bf16: placed
//    as e2m1 * 2^-126 and one fma.rn.bf16x2 by s * 2^119 (exact; bf16
//    arithmetic keeps subnormal inputs, checked by the GPU tests).  The power
//    of two goes back in the epilogue.  The 16-K scale group is one k16 MMA:
//    the scale is applied in the decode, never after the MMA.
//  * Two A register sets: stage i + 1 is decoded while the wgmmas of stage i
//    run; wgmma.wait_group 1 keeps one stage of MMAs in flight.
//  * Epilogue from the accumulators: alpha * 2^P * acc (+ bias), one
//    rounding.  Split K: each rank's fp32 tile to its shared memory, rank 0
//    adds ranks 1.. in order.  Deterministic, no workspace, no atomics,
//    CUDA-graph safe (the tensor maps are kernel parameters, captured by value).

#include "nvfp4_decode.cuh"

#ifndef W_N
#error "W_N (output columns) must be defined"
#endif
#ifndef W_K
#error "W_K (reduction length) must be defined"
#endif
#ifndef W_BT
#define W_BT 128
#endif
#ifndef W_WG
#define W_WG 2
#endif
#ifndef W_ST
#define W_ST 4
#endif
#ifndef W_SPLIT
#define W_SPLIT 1
#endif
#ifndef W_ACT
#define W_ACT 2
#endif
#ifndef W_OUT_F16
#define W_OUT_F16 0
#endif
#ifndef W_BIAS
#define W_BIAS 0
#endif

// Experiments only (benchmarks/experiments/nvfp4_wgmma.py): 1 feeds the raw
// weight words to the MMA (no decode), 2 decodes but issues no MMA.
#ifndef W_PROFILE
#define W_PROFILE 0
#endif

#if W_ACT == 2
#define W_TYPE "bf16"
#else
#define W_TYPE "f16"
#endif

namespace wg {

using namespace nvfp4_dec;

constexpr int N = W_N;
constexpr int K = W_K;
constexpr int BT = W_BT;
constexpr int WGS = W_WG;
constexpr int BN = 64 * WGS;
constexpr int STAGES = W_ST;
constexpr int SPLIT = W_SPLIT;
constexpr int THREADS = 128 * WGS;     // consumer threads
// + the producer warp.  (Warps are pinned to SM quadrants: nine warps put
// three on one, which caps every thread at 168 registers: no 256-row tile.)
constexpr int THREADS_ALL = THREADS + 32;
static_assert(THREADS_ALL % 32 == 0, "whole warps");
constexpr int KB = 64;              // K per stage: one 128-byte swizzle row of 16-bit activation
constexpr int NKB = K / KB;
constexpr int ACC = BT / 2;         // fp32 accumulators per thread (m64 x BT over 128 threads)
constexpr int X_BYTES = BT * 128;
constexpr int W_BYTES = BN * 32;
constexpr int S_BYTES = 512;
constexpr int STAGE_BYTES = (X_BYTES + W_BYTES + S_BYTES + 1023) / 1024 * 1024;
constexpr int RED_BYTES = SPLIT > 1 ? ACC * THREADS * 4 : 0;
constexpr int BODY_BYTES = STAGES * STAGE_BYTES > RED_BYTES ? STAGES * STAGE_BYTES : RED_BYTES;
constexpr int STAGE_TX = X_BYTES + W_BYTES + S_BYTES;  // bytes a stage's copies deliver
constexpr int SMEM_BYTES = BODY_BYTES + 16 * STAGES + 1024;  // + barriers, + aligning the base to 1024
static_assert(SMEM_BYTES <= 227 * 1024, "the stages (or the split-K tile) exceed the shared memory of an SM");
// The decode's power of two, undone in the epilogue.
constexpr float DECODE_POW = W_ACT == 2 ? 128.0f : 16384.0f;

static_assert(K % KB == 0, "K must be a multiple of 64");
static_assert(BT == 32 || BT == 64 || BT == 128, "W_BT must be 32, 64 or 128");
static_assert(WGS == 1 || WGS == 2, "W_WG must be 1 or 2");
static_assert(STAGES >= 4 && STAGES <= 8, "W_ST must be 4..8");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4, "W_SPLIT must be 1, 2 or 4");

// A CUtensorMap, passed by value (__grid_constant__) and read by the TMA unit.
struct alignas(64) TmaMap {
  unsigned long long v[16];
};

// 2-D tile of a tensor map -> shared memory, completing on ``bar``.
__device__ __forceinline__ void tma_2d(u32 dst, const TmaMap* map, int c0, int c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ V4 lds128(u32 addr) {
  V4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
               : "r"(addr));
  return r;
}

__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr));
  return r;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma wait.
__device__ __forceinline__ void pin(float (&d)[ACC]) {
#pragma unroll
  for (int i = 0; i < ACC; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte
// swizzle: 8-row groups 1024 bytes apart (stride), leading offset unused.
__device__ __forceinline__ u64 smem_desc(u32 addr) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// The wgmma instructions (m64 x BT x k16, A from registers, B K-major in
// shared memory, fp32 accumulators); one per activation-tile width.
__device__ __forceinline__ void wgmma_rs(float (&d)[16], const u32 (&a)[4], u64 desc) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." W_TYPE "." W_TYPE " {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
               "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                 "+f"(d[15])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wgmma_rs(float (&d)[32], const u32 (&a)[4], u64 desc) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." W_TYPE "." W_TYPE " {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
               "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 desc) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." W_TYPE "." W_TYPE " {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
               "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
               "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
               "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
                 "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
                 "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
                 "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// Scale multipliers of the four 16-K groups of a stage for one row, from the
// row's scale word (4 e4m3): fp16 [s : s], or bf16 [s 2^119 : s 2^119].
__device__ __forceinline__ void scale_regs(u32 word, u32 (&s)[4]) {
  const u32 lo = e4m3x2_to_f16x2(word & 0xFFFFu), hi = e4m3x2_to_f16x2(word >> 16);
#if W_ACT == 2
  const u32 h[4] = {lo & 0xFFFFu, lo >> 16, hi & 0xFFFFu, hi >> 16};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float f = f16_to_f32((u16)h[j]) * 6.6461399789245794e35f;  // 2^119, exact
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(s[j]) : "f"(f));
  }
#else
  s[0] = byte_perm(lo, 0, 0x1010);
  s[1] = byte_perm(lo, 0, 0x3232);
  s[2] = byte_perm(hi, 0, 0x1010);
  s[3] = byte_perm(hi, 0, 0x3232);
#endif
}

// Byte b of a gathered word (lo: wl = its low nibbles moved to bits 4..7 of
// each byte, hi: wh = its high nibbles in place) as the 16-bit pair
// {low code, high code} times the scale pair s2.  After the prmt the low
// code sits in bits 12..15 and the high one in 28..31: the signs are in
// place, the magnitudes move down to the 16-bit format's exponent / mantissa
// boundary (fp16: 3, bf16: 6).
__device__ __forceinline__ u32 decode_byte(u32 wl, u32 wh, int b, u32 s2) {
  const u32 y = byte_perm(wl, wh, ((4u + b) << 12) | ((u32)b << 8) | ((u32)b << 4) | (u32)b);
#if W_ACT == 2
  const u32 r = select_bits<0x80008000u>((y >> 6) & 0x01C001C0u, y);
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(r), "r"(s2), "r"(0x80008000u));
  return d;
#else
  return hmul2(select_bits<0x80008000u>((y >> 3) & 0x0E000E00u, y), s2);
#endif
}

// The A fragments of one stage (four k16 groups) for a thread's rows g and
// g + 8 of its warp: a[j] = {row g k 2t.., row g+8 k 2t.., row g k 2t+8..,
// row g+8 k 2t+8..} of group j.
__device__ __forceinline__ void decode_stage(u32 w_row0, u32 w_row1, u32 s_row0, u32 s_row1, u32 sel,
                                             u32 (&a)[4][4]) {
  u32 gw[2][2];  // [row][half]: bytes t of words 4h .. 4h + 3
  u32 sc[2][4];
  const u32 rows[2] = {w_row0, w_row1};
  const u32 srows[2] = {s_row0, s_row1};
  if (W_PROFILE == 1) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const V4 h0 = lds128(rows[r]), h1 = lds128(rows[r] ^ 16u);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        a[q][r] = h0.v[q];
        a[q][2 + r] = h1.v[q];
      }
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // the row's two 16-byte halves; which slot holds which is the writer's swizzle
    const V4 h0 = lds128(rows[r]);
    const V4 h1 = lds128(rows[r] ^ 16u);
    gw[r][0] = byte_perm(byte_perm(h0.v[0], h0.v[1], sel), byte_perm(h0.v[2], h0.v[3], sel), 0x5410);
    gw[r][1] = byte_perm(byte_perm(h1.v[0], h1.v[1], sel), byte_perm(h1.v[2], h1.v[3], sel), 0x5410);
    scale_regs(lds32(srows[r]), sc[r]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 wl = (gw[r][h] << 4) & 0xF0F0F0F0u, wh = gw[r][h] & 0xF0F0F0F0u;
#pragma unroll
      for (int q = 0; q < 2; ++q) {  // group j = 2h + q: bytes 2q (k 2t..) and 2q + 1 (k 2t + 8..)
        a[2 * h + q][r] = decode_byte(wl, wh, 2 * q, sc[r][2 * h + q]);
        a[2 * h + q][2 + r] = decode_byte(wl, wh, 2 * q + 1, sc[r][2 * h + q]);
      }
    }
  }
}

__device__ __forceinline__ void mma_stage(float (&acc)[ACC], const u32 (&a)[4][4], u32 x_tile) {
  if (W_PROFILE == 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" ::"r"(a[j][0]), "r"(a[j][1]), "r"(a[j][2]), "r"(a[j][3]));
    return;
  }
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < 4; ++j) wgmma_rs(acc, a[j], smem_desc(x_tile + 32 * j));
  wgmma_commit();
}

}  // namespace wg

#if W_SPLIT > 1
#define W_CLUSTER __cluster_dims__(1, 1, W_SPLIT)
#else
#define W_CLUSTER
#endif

// grid (ceil(m / BT), ceil(N / BN), SPLIT), block 128 * WG + 32, dynamic
// shared memory wg::SMEM_BYTES, clusters of (1, 1, SPLIT).  tmap_x: the
// activation [m, K] (16-bit, box 64 x BT, 128-byte swizzle); tmap_w: the
// packed weight [N, K / 2] (bytes, box 32 x BN, 32-byte swizzle); both
// zero-fill rows past m / N; tmap_s: the swizzled scales as rows of 256 bytes
// (box 256 x 2: one 512-byte atom).  out: [m, N] contiguous.
extern "C" __global__ void W_CLUSTER __launch_bounds__(wg::THREADS_ALL, 1)
nvfp4_wgmma(const __grid_constant__ wg::TmaMap tmap_x, const __grid_constant__ wg::TmaMap tmap_w,
            const __grid_constant__ wg::TmaMap tmap_s, const float* __restrict__ alpha_ptr,
            const void* __restrict__ bias, unsigned short* __restrict__ out, int m) {
  using namespace wg;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 smem0 = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const u32 bars = smem0 + BODY_BYTES;  // full[STAGES], then empty[STAGES]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp_all = tid >> 5;
  const bool producer = warp_all == 4 * WGS;  // the warp after the consumer warpgroups
  const int m0 = blockIdx.x * BT;
  const int n0 = blockIdx.y * BN;

  const int per = (NKB + SPLIT - 1) / SPLIT;
  const int kb0 = blockIdx.z * per;
  int nk = NKB - kb0 < per ? NKB - kb0 : per;
  if (nk < 0) nk = 0;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8 * s, 1);                      // the producer's expect_tx
      mbar_init(bars + 8 * (STAGES + s), 4 * WGS);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;

  if (producer) {
    if (tid == 4 * WGS * 32) {
      const int atom0 = (n0 >> 7) * NKB + kb0;  // the stage's 512-byte scale atom: rows 2a, 2a + 1 of tmap_s
      for (int i = 0; i < nk; ++i) {
        const int slot = i % STAGES;
        mbar_wait(bars + 8 * (STAGES + slot), ((i / STAGES) & 1) ^ 1);  // the slot's last readers are done
        const u32 full = bars + 8 * slot, base = smem0 + slot * STAGE_BYTES;
        mbar_expect_tx(full, STAGE_TX);
        tma_2d(base, &tmap_x, (kb0 + i) * KB, m0, full);
        tma_2d(base + X_BYTES, &tmap_w, (kb0 + i) * (KB / 2), n0, full);
        tma_2d(base + X_BYTES + W_BYTES, &tmap_s, 0, 2 * (atom0 + i), full);
      }
    }
    __syncwarp();
  } else {
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int wgi = tid >> 7;
    const int warp = (tid >> 5) & 3;
    // this thread's weight rows (CTA-local) and their addresses inside a stage
    const int r0 = wgi * 64 + warp * 16 + g, r1 = r0 + 8;
    const u32 w_off0 = X_BYTES + r0 * 32 + ((((u32)r0 >> 2) & 1u) << 4);
    const u32 w_off1 = X_BYTES + r1 * 32 + ((((u32)r1 >> 2) & 1u) << 4);
    const int ar0 = (n0 + r0) & 127, ar1 = (n0 + r1) & 127;
    const u32 s_off0 = X_BYTES + W_BYTES + ((ar0 & 31) << 4) + ((ar0 >> 5) << 2);
    const u32 s_off1 = X_BYTES + W_BYTES + ((ar1 & 31) << 4) + ((ar1 >> 5) << 2);
    const u32 sel = (u32)t4 | ((u32)(t4 + 4) << 4) | ((u32)t4 << 8) | ((u32)(t4 + 4) << 12);

    u32 a0[4][4], a1[4][4];
    for (int it = 0; it < nk; it += 2) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = it + half;
        if (i < nk) {
          const int slot = i % STAGES;
          mbar_wait(bars + 8 * slot, (i / STAGES) & 1);
          const u32 base = smem0 + slot * STAGE_BYTES;
          if (half == 0) {
            decode_stage(base + w_off0, base + w_off1, base + s_off0, base + s_off1, sel, a0);
            mma_stage(acc, a0, base);
          } else {
            decode_stage(base + w_off0, base + w_off1, base + s_off0, base + s_off1, sel, a1);
            mma_stage(acc, a1, base);
          }
          wgmma_wait<1>();  // the MMAs of stage i - 1 are done: its slot is free
          __syncwarp();
          if (i > 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + (i - 1) % STAGES));
        }
      }
    }
    wgmma_wait<0>();
    pin(acc);
  }

#if W_SPLIT > 1
  __syncthreads();  // every consumer is done with the pipeline's shared memory
  // partial tile as [i / 4][thread][4]: one 16-byte store / remote load per four accumulators
  const u32 rank = cluster_rank();
  if (!producer && rank != 0) {
#pragma unroll
    for (int i = 0; i < ACC; i += 4)
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(smem0 + (u32)(((i / 4) * THREADS + tid) * 16)),
                   "f"(acc[i]), "f"(acc[i + 1]), "f"(acc[i + 2]), "f"(acc[i + 3])
                   : "memory");
  }
  cluster_sync();
  if (!producer && rank == 0) {
#pragma unroll 1
    for (u32 r = 1; r < SPLIT; ++r) {
      u32 remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem0), "r"(r));
#pragma unroll
      for (int i = 0; i < ACC; i += 4) {
        float v0, v1, v2, v3;
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(v0), "=f"(v1), "=f"(v2), "=f"(v3)
                     : "r"(remote + (u32)(((i / 4) * THREADS + tid) * 16))
                     : "memory");
        acc[i] += v0;
        acc[i + 1] += v1;
        acc[i + 2] += v2;
        acc[i + 3] += v3;
      }
    }
  }
  cluster_sync();  // peers keep their shared memory until rank 0 has read it
  if (rank != 0) return;
#endif
  if (producer) return;

  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int wgi = tid >> 7;
  const int warp = (tid >> 5) & 3;
  const float alpha = *alpha_ptr;
#pragma unroll
  for (int i = 0; i < ACC; ++i) {
    const int n = n0 + wgi * 64 + warp * 16 + g + ((i >> 1) & 1) * 8;
    const int mm = m0 + (i >> 2) * 8 + 2 * t4 + (i & 1);
    if (n < N && mm < m) store_scaled<W_BIAS, W_OUT_F16 != 0, N>(out, bias, DECODE_POW, alpha, mm, n, acc[i]);
  }
}
