// NVFP4 GEMM for Hopper from tens of activation rows up: the FP4 weight is
// decoded in registers and fed to wgmma as its register operand A; the 16-bit
// activation is operand B in shared memory.
//
//     out[m, n] = alpha * sum_k x[m, k] * deq(b)[n, k] (+ bias[n])
//
// x is the W4A16 activation (fp16 / bf16), or for W4A4 the activation decoded
// once to fp16 by the caller (exact: e2m1 x e4m3 fits fp16), in both cases
// with K permuted inside every 64 (see "A fragment" below).  b: packed e2m1
// [N, K / 2] (element 2i in the low nibble of byte i); its e4m3 block scales
// in the swizzled layout (128-row x 4-column atoms of 512 bytes).  Compiled at
// run time with NVRTC; one cubin per (N, K, config):
//
//   W_N, W_K     problem size (K % 64 == 0; any N >= 1)
//   W_BT         activation rows per CTA: the wgmma N (32, 64, 128, 256)
//   W_WG         consumer warpgroups (1 or 2): the CTA owns BN = 64 W_WG
//                weight rows, 64 per warpgroup (the wgmma M)
//   W_ST         pipeline stages of 64 K (4 .. 8)
//   W_PWG        1 (with W_WG 2 and W_SPLIT 1): the producer is a whole warpgroup that
//                hands registers to the consumers (setmaxnreg 40 / 232
//                instead of 168 for all nine warps), so two warpgroups of
//                256-row tiles (128 accumulators each) fit
//   W_SPLIT      CTAs per cluster along K (1, 2, 4); partial tiles added
//                through distributed shared memory in rank order
//   W_PERSIST    1 (with W_SPLIT 1): a persistent grid of about one CTA per
//                SM slot walks the tiles (fp8_wgmma.cu's G_PERSIST)
//   W_ACT        1: fp16 operands, 2: bf16 operands
//   W_OUT_F16, W_BIAS   output dtype; bias none / fp32 / bf16 / fp16 (0-3)
//
// Design:
//  * Swap AB: weight rows are the MMA's M (64 rows per warpgroup whatever
//    the batch), activation rows its N (32-256 per CTA).  A from registers
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
//  * A fragment (m16n8k16 layout per warp): thread (g, t) holds 4 k values
//    of rows g, g + 8 in each k16 group.  Which stage k they are is free as
//    long as the activation (B) has the same order, so the thread takes its
//    own contiguous 8 bytes of each row (one 16-K scale group: one scale per
//    row and stage) and decodes each 4-byte word into four 2 x 16-bit
//    registers {k j, k j + 4} (nvfp4_decode.cuh: decode8 for fp16, e2m1 *
//    2^-14 times the fp16 scale; decode8_bf16 for bf16, e2m1 * 2^-126 times
//    s * 2^119; 15 instructions per 8 values, exact, subnormals kept: the
//    GPU tests check every code x scale bit for bit).  The caller permutes
//    the activation's K within every 64 to match (``permute_k``: fragment k
//    16j + 8h + 2t + e is stage k 16t + 8h + j + 4e).  The power of two goes
//    back in the epilogue.
//  * Two A register sets: stage i + 1 is decoded while the wgmmas of stage i
//    run; wgmma.wait_group 1 keeps one stage of MMAs in flight.
//  * Epilogue from the accumulators: alpha * 2^P * acc (+ bias), one
//    rounding.  Split K: each rank's fp32 tile to its shared memory, rank 0
//    adds ranks 1.. in order.  Deterministic, no workspace, no atomics,
//    CUDA-graph safe (the tensor maps are kernel parameters, captured by value).
//  * W_PERSIST: CTA c takes tiles c, c + gridDim.x, ... in bands that share
//    operand panels in L2 (wgmma_ptx.cuh, tile_origin); the ring's slots
//    and phases run on from tile to tile, so the producer loads the next
//    tile's stages while the consumers finish and store this one.  Each
//    consumer warp releases a tile's last slot once its MMAs have retired.
//  * Programmatic dependent launch (a no-op without it): after the barrier
//    set-up every thread waits for the previous grid (griddepcontrol.wait)
//    before any TMA load or global write, then lets the next grid launch.

#include "nvfp4_decode.cuh"
#include "wgmma_ptx.cuh"

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
#ifndef W_PWG
#define W_PWG 0
#endif
#ifndef W_PERSIST
#define W_PERSIST 0
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
using namespace wg_ptx;

constexpr int N = W_N;
constexpr int K = W_K;
constexpr int BT = W_BT;
constexpr int WGS = W_WG;
constexpr int BN = 64 * WGS;
constexpr int STAGES = W_ST;
constexpr int SPLIT = W_SPLIT;
constexpr int THREADS = 128 * WGS;     // consumer threads
// + the producer warp.  (Warps are pinned to SM quadrants: nine warps put
// three on one, which caps every thread at 168 registers: too few for two
// warpgroups of 256-row tiles; W_PWG makes the producer a warpgroup that
// gives its registers to the consumers.)
constexpr int THREADS_ALL = THREADS + (W_PWG ? 128 : 32);
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
static_assert(BT == 32 || BT == 64 || BT == 128 || BT == 256, "W_BT must be 32, 64, 128 or 256");
static_assert(W_PWG == 0 || (W_PWG == 1 && WGS == 2), "W_PWG 1 needs W_WG 2");
// The split-K reduction's barriers are the consumers' (synccheck: divergent with
// the producers returning early).
static_assert(W_PWG == 0 || SPLIT == 1, "W_PWG 1 needs W_SPLIT 1");
static_assert(WGS == 1 || WGS == 2, "W_WG must be 1 or 2");
static_assert(STAGES >= 4 && STAGES <= 8, "W_ST must be 4..8");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4, "W_SPLIT must be 1, 2 or 4");
static_assert(W_PERSIST == 0 || (W_PERSIST == 1 && SPLIT == 1), "W_PERSIST 1 needs W_SPLIT 1");

__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr));
  return r;
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

__device__ __forceinline__ void wgmma_rs(float (&d)[128], const u32 (&a)[4], u64 desc) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." W_TYPE "." W_TYPE " {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
               "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
               "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
               "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
               "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
               "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
               "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
               "}, {%128,%129,%130,%131}, %132, p, 1, 1, 0;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
                 "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
                 "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
                 "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                 "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),
                 "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
                 "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),
                 "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),
                 "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),
                 "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]),
                 "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]),
                 "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                 "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]),
                 "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// The scale multiplier of one row's 16-K group from its e4m3 byte, given
// twice in the low two bytes of ``pair``: fp16 [s : s], or bf16
// [s 2^119 : s 2^119] (exact: 4 significant bits).
__device__ __forceinline__ u32 scale_reg(u32 pair) {
  const u32 h2 = e4m3x2_to_f16x2(pair);
#if W_ACT == 2
  return scale_pair_bf16(h2);
#else
  return h2;
#endif
}

__device__ __forceinline__ void decode_word(u32 w, u32 s2, u32 (&r)[4]) {
#if W_ACT == 2
  decode8_bf16(w, s2, r);
#else
  decode8(w, s2, r);
#endif
}

__device__ __forceinline__ uint2 lds64(u32 addr) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(addr));
  return r;
}

// The A fragments of one stage (four k16 groups) for a thread's rows g and
// g + 8 of its warp.  Thread t of a quad decodes the 8 bytes (16 codes, one
// scale group) 8t .. 8t + 7 of each row's 32: words 0 and 1, each as four
// registers in decode8's order {k 8h + j, k 8h + j + 4} (h the word).  They
// fill the fragment as a[j] = {row g word 0 reg j, row g + 8 word 0 reg j,
// row g word 1 reg j, row g + 8 word 1 reg j}: fragment k 16j + 8h + 2t + e
// holds stage k 16t + 8h + j + 4e, and the activation comes in that order
// (ops/nvfp4_wgmma.py, ``permute_k``).  w_row*: the thread's 8 bytes of the
// row; s_row*: the row's 4 scale bytes; sel: byte t of them.
__device__ __forceinline__ void decode_stage(u32 w_row0, u32 w_row1, u32 s_row0, u32 s_row1, u32 sel,
                                             u32 (&a)[4][4]) {
  const u32 rows[2] = {w_row0, w_row1};
  const u32 srows[2] = {s_row0, s_row1};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint2 w = lds64(rows[r]);
    if (W_PROFILE == 1) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        a[j][r] = w.x;
        a[j][2 + r] = w.y;
      }
      continue;
    }
    const u32 s2 = scale_reg(byte_perm(lds32(srows[r]), 0, sel));
    u32 d0[4], d1[4];
    decode_word(w.x, s2, d0);
    decode_word(w.y, s2, d1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a[j][r] = d0[j];
      a[j][2 + r] = d1[j];
    }
  }
}

// x_desc: the descriptor of the stage's activation tile; +2 per k16 group
// (32 bytes; addresses stay below 2^18, so the 14-bit field never carries).
__device__ __forceinline__ void mma_stage(float (&acc)[ACC], const u32 (&a)[4][4], u64 x_desc) {
  if (W_PROFILE == 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" ::"r"(a[j][0]), "r"(a[j][1]), "r"(a[j][2]), "r"(a[j][3]));
    return;
  }
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < 4; ++j) wgmma_rs(acc, a[j], x_desc + 2 * j);
  wgmma_commit();
}

}  // namespace wg

#if W_SPLIT > 1
#define W_CLUSTER __cluster_dims__(1, 1, W_SPLIT)
#else
#define W_CLUSTER
#endif

// grid (ceil(m / BT), ceil(N / BN), SPLIT) (W_PERSIST: (CTAs, 1, 1), any number),
// block 128 * WG + 32 (W_PWG: + 128), dynamic shared memory wg::SMEM_BYTES,
// clusters of (1, 1, SPLIT).  tmap_x: the
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
#if W_PWG
  const bool producer = tid >= THREADS;  // the warpgroup after the consumer warpgroups; its first lane loads
#else
  const bool producer = warp_all == 4 * WGS;  // the warp after the consumer warpgroups
#endif
#if W_PERSIST
  const int tiles_m = (m + BT - 1) / BT;
  const int tiles = tiles_m * ((N + BN - 1) / BN);
#else
  const int m0 = blockIdx.x * BT;
  const int n0 = blockIdx.y * BN;
#endif

  int kb0;
  const int nk = stage_range<NKB, SPLIT>(kb0);
  ring_init<STAGES>(bars, 4 * WGS);

  // One tile's output from its accumulators: alpha 2^P acc (+ bias).
  auto store_tile = [&](const float (&tacc)[ACC], int tm0, int tn0) {
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int wgi = tid >> 7;
    const int warp = (tid >> 5) & 3;
    const float alpha = *alpha_ptr;
#pragma unroll
    for (int i = 0; i < ACC; ++i) {
      const int n = tn0 + wgi * 64 + warp * 16 + g + ((i >> 1) & 1) * 8;
      const int mm = tm0 + (i >> 2) * 8 + 2 * t4 + (i & 1);
      if (n < N && mm < m) store_scaled<W_BIAS, W_OUT_F16 != 0, N>(out, bias, DECODE_POW, alpha, mm, n, tacc[i]);
    }
  };

  // With W_PWG the producers return after their loop (their 40 registers
  // must not hold the accumulators) and the consumers' branch follows it;
  // without, the two are one if / else (the SASS of the measured configs).
#if W_PWG
  if (producer) {
    producer_registers();
#else
#if !W_PERSIST
  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
#endif

  if (producer) {
#endif
    if (tid == 4 * WGS * 32) {
#if W_PERSIST
      int slot = 0;
      u32 parity = 1;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int m0, n0;
        tile_origin<BT, BN, N>(t, tiles_m, m0, n0);
#endif
      const int atom0 = (n0 >> 7) * NKB + kb0;  // the stage's 512-byte scale atom: rows 2a, 2a + 1 of tmap_s
      for (int i = 0; i < nk; ++i) {
#if W_PERSIST
        mbar_wait(bars + 8 * (STAGES + slot), parity);  // the slot's last readers are done
#else
        const int slot = i % STAGES;
        mbar_wait(bars + 8 * (STAGES + slot), ((i / STAGES) & 1) ^ 1);  // the slot's last readers are done
#endif
        const u32 full = bars + 8 * slot, base = smem0 + slot * STAGE_BYTES;
        mbar_expect_tx(full, STAGE_TX);
        tma_2d(base, &tmap_x, (kb0 + i) * KB, m0, full);
        tma_2d(base + X_BYTES, &tmap_w, (kb0 + i) * (KB / 2), n0, full);
        tma_2d(base + X_BYTES + W_BYTES, &tmap_s, 0, 2 * (atom0 + i), full);
#if W_PERSIST
        slot = slot + 1 == STAGES ? 0 : slot + 1;
        parity ^= slot == 0;
#endif
      }
#if W_PERSIST
      }
#endif
    }
    __syncwarp();
#if W_PWG
    return;
  }
  consumer_registers();
#if !W_PERSIST
  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
#endif
  {
#else
  } else {
#endif
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int wgi = tid >> 7;
    const int warp = (tid >> 5) & 3;
    // this thread's weight rows (CTA-local) and their addresses inside a stage
    const int r0 = wgi * 64 + warp * 16 + g, r1 = r0 + 8;
    // bytes 8 t4 .. 8 t4 + 7 of the row: 16-byte half t4 / 2, which the
    // 32-byte swizzle swaps on every other group of four rows
    const u32 w_off0 = X_BYTES + r0 * 32 + (((((u32)r0 >> 2) & 1u) ^ ((u32)t4 >> 1)) << 4) + (((u32)t4 & 1u) << 3);
    const u32 w_off1 = X_BYTES + r1 * 32 + (((((u32)r1 >> 2) & 1u) ^ ((u32)t4 >> 1)) << 4) + (((u32)t4 & 1u) << 3);
#if W_PERSIST
    u32 slot = 0, phase = 0, prev = STAGES - 1;  // run on from tile to tile
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      int m0, n0;
      tile_origin<BT, BN, N>(t, tiles_m, m0, n0);
      float acc[ACC];
#pragma unroll
      for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
#endif
    const int ar0 = (n0 + r0) & 127, ar1 = (n0 + r1) & 127;
    const u32 s_off0 = X_BYTES + W_BYTES + ((ar0 & 31) << 4) + ((ar0 >> 5) << 2);
    const u32 s_off1 = X_BYTES + W_BYTES + ((ar1 & 31) << 4) + ((ar1 >> 5) << 2);
    const u32 sel = (u32)t4 | ((u32)t4 << 4);  // scale byte t4 in the low two bytes

    // Two stages per iteration (the two A register sets); the ring slot and
    // its phase are running values (no division by STAGES per stage).
    const u32 w0 = smem0 + w_off0, w1 = smem0 + w_off1, s0 = smem0 + s_off0, s1 = smem0 + s_off1;
    const u64 desc0 = smem_desc(smem0);
    u32 a0[4][4], a1[4][4];
#if !W_PERSIST
    u32 slot = 0, phase = 0, prev = STAGES - 1;
#endif
    for (int it = 0; it < nk; it += 2) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = it + half;
        if (i < nk) {
          const u32 off = slot * STAGE_BYTES;
          mbar_wait(bars + 8 * slot, phase);
          if (half == 0) {
            decode_stage(w0 + off, w1 + off, s0 + off, s1 + off, sel, a0);
            mma_stage(acc, a0, desc0 + (off >> 4));
          } else {
            decode_stage(w0 + off, w1 + off, s0 + off, s1 + off, sel, a1);
            mma_stage(acc, a1, desc0 + (off >> 4));
          }
          wgmma_wait<1>();  // the MMAs of stage i - 1 are done: its slot is free
          __syncwarp();
          if (i > 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + prev));
          prev = slot;
          slot = slot + 1 == STAGES ? 0 : slot + 1;
          phase ^= slot == 0;
        }
      }
    }
    wgmma_wait<0>();
    pin(acc);
#if W_PERSIST
      __syncwarp();
      if (lane == 0) mbar_arrive(bars + 8 * (STAGES + prev));  // the tile's last slot has retired
      store_tile(acc, m0, n0);
    }
    return;
#endif
  }

#if !W_PERSIST
#if W_SPLIT > 1
  if (!cluster_reduce<ACC, THREADS, SPLIT>(acc, smem0, tid, !producer)) return;
#endif
#if !W_PWG
  if (producer) return;
#endif
  store_tile(acc, m0, n0);
#endif
}
