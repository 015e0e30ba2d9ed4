// FP8 (e4m3) GEMM with per-tensor / per-row / per-column scales for Hopper,
// from one activation row to a few hundred: both operands come by TMA into a
// shared-memory ring and meet on wgmma's e4m3 tensor cores.
//
//     out[m, n] = sum_k a[m, k] b[n, k] * sa[m] * sb[n] (+ bias[n])
//     out[m, n] = sum_kb (sum_{k in kb} a[m, k] b[n, k]) sa[m, kb] sb[n / 128, kb]   (G_BLOCK)
//
// a: e4m3 [m, K] (rows 16-byte aligned); b: e4m3 [N, K] contiguous; sa / sb
// fp32, one element (step 0) or one per row / column (step: the scales'
// stride in elements); with G_BLOCK, DeepSeek-V3's 1 x 128 activation and
// 128 x 128 weight block scales (any strides).  Compiled at
// run time with NVRTC; one cubin per (N, K, config, output / bias dtype):
//
//   G_N, G_K     problem size (K % 16 == 0; any N >= 1)
//   G_BT         activation rows per CTA: the wgmma N (16, 32, 64, 128)
//   G_WG         consumer warpgroups (1 or 2): the CTA owns BN = 64 G_WG
//                weight rows, 64 per warpgroup (the wgmma M)
//   G_ST         pipeline stages of 128 K (2 .. 8)
//   G_SPLIT      CTAs per cluster along K (1, 2, 4); partial tiles added
//                through distributed shared memory in rank order
//   G_CHAIN      k32 steps summed in the tensor core per fp32 promotion:
//                1 (every step a fresh fragment) or 4 (one per 128-K stage)
//   G_BLOCK      0: per-tensor / row / column scales in the epilogue;
//                1: block scales applied at each stage's promotion
//   G_OUT        0: bf16, 1: fp16, 2: fp32 output
//   G_BIAS       0: none, 1: fp32, 2: bf16, 3: fp16 bias (with G_BLOCK only
//                with G_QUANT)
//   G_QUANT      with G_BLOCK, 1: fp8_block_linear: the activation comes as
//                bf16 / fp16 (G_IN 0 / 1) and is quantized per 1 x 128 group
//                in the kernel (K % 128 == 0)
//   G_PWG        1 (with G_WG 2 and G_SPLIT 1, not G_QUANT): the producer is a whole
//                warpgroup that hands registers to the consumers
//                (setmaxnreg: 40 / 232 instead of 168 for all), so a 128 x 128
//                tile with two fp32 fragments a thread fits: the large-M tile
//   G_PERSIST    1 (with G_SPLIT 1, not G_QUANT): a persistent grid of about
//                one CTA per SM slot walks the tiles; the producer loads the
//                next tile's stages while the consumers store this one's
//
// Design:
//  * Swap AB: weight rows are the MMA's M (64 per warpgroup whatever the
//    batch), activation rows its N (16-128 per CTA), so a decode-sized batch
//    wastes no MMA rows and the weight streams through once.
//  * One producer warp (one lane) fills a ring of G_ST stages with TMA: the
//    activation tile and the weight tile, 128 bytes of K per row, both in the
//    128-byte swizzle wgmma reads K-major (8-row groups 1024 bytes apart).
//    Rows past m / N and columns past K arrive as zeros, so K needs no tail
//    code.  Each stage has a full barrier (expect_tx) and an empty one (one
//    arrival per consumer warp, once the MMAs that read the slot retired).
//  * fp32 accumulation across K: chained inside the tensor core the e4m3
//    sums lose bits against fp32 (fp8_gemv.cu found the same for mma.sync),
//    so partial sums are promoted into fp32 accumulators.  G_CHAIN 1: every
//    k32 wgmma writes a fresh fragment (scale-d 0) that is added; the 32
//    products of one step are summed by the tensor core itself, a little
//    short of fp32 (tests/test_fp8_wgmma.py).  A stage's four steps go in one
//    group of four fragments (BT <= 32, or 64 with one warpgroup) or two
//    groups of two.  G_CHAIN 4: the stage's four steps chain into one
//    fragment (the precision of cuBLAS's and DeepGEMM's FP8 GEMMs: one
//    promotion per 128 K), one wait and a quarter of the adds per stage, two
//    fragments' registers instead of five.  Each group is retired with
//    wait_group 0 before it is read: ptxas serializes every wgmma of a loop
//    whose accumulators are read while any wgmma is in flight.  The second
//    warpgroup and the other CTAs of the SM keep the tensor cores busy
//    meanwhile.
//  * G_BLOCK: the promotion is acc += f * (sa[m, kb] sb[nb, kb]); a
//    warpgroup's 64 weight rows lie in one 128-row scale block, so sb is one
//    value per stage and warpgroup (the CTA's K range copied to shared memory
//    once), sa one per activation row the thread holds, read from the stage's
//    slot while the stage's MMAs run.  The producer warp's lanes copy each
//    stage's BT activation scales (any strides: cp.async, 4 bytes each) and
//    arrive on the stage's full barrier when the copies land
//    (cp.async.mbarrier.arrive.noinc): no lane waits on a copy.
//  * G_QUANT (fp8_block_linear in one launch): the producer brings each
//    stage's 16-bit activation tile by TMA (no swizzle) into a staging slot
//    beside the e4m3 one; the consumer threads quantize it, eight threads per
//    row and 16 values each: the group's amax over the eight (shuffles),
//    s = max(amax, 1e-10) / 448 and q = e4m3(clamp(x / s)), x / s correctly
//    rounded from one reciprocal per row (div_by: per_token_group_quant_fp8's
//    bits at a few instructions a value), the codes stored in the 128-byte
//    swizzle wgmma reads and s in the stage's scale slot; then an async-proxy
//    fence and a barrier of the consumer threads before the stage's MMAs.
//    Every CTA of a weight-tile column quantizes the same rows again, on
//    the consumers' per-stage path: so far slower than quantize + GEMM
//    (ops/fp8_wgmma.py block_linear, not a registered backend).
//  * Epilogue from the accumulators: (acc * sa[m]) * sb[n] (+ bias), one
//    rounding to the output dtype.  Split K: each rank's fp32 tile to its
//    shared memory, rank 0 adds ranks 1.. in order.  Deterministic, no
//    workspace, no atomics, CUDA-graph safe (the tensor maps are kernel
//    parameters, captured by value).
//  * G_PWG: nine warps put three on one SM quadrant, so every thread gets at
//    most 168 registers, too few for two warpgroups of m64n128 fragments
//    and their accumulators.  With a producer warpgroup (its first warp
//    loads, the other three only take part in the barriers) the launch
//    gives 168 to each of 384 threads; after the set-up the producers drop
//    to 40 and the consumers rise to 232 (the register file: 128 x 40 +
//    256 x 232 <= 65536).
//  * G_PERSIST: tile t of the (m / BT) x (N / BN) grid is taken by CTA
//    t % gridDim.x.  The ring's slots and phases run on from tile to tile, so
//    the producer fills the next tile's stages while the consumers still
//    promote and store this one (the non-persistent grid leaves the SM's
//    loads idle through each epilogue and each CTA's start).  Tiles go in
//    bands of GROUP_M activation tiles, the weight tiles of a band in turn,
//    so the CTAs running at once read a few panels of each operand through
//    L2 instead of every activation panel.  With G_BLOCK each stage's weight
//    scale rides in its activation-scale slot (the tile's weight block
//    changes from tile to tile); ops/fp8_wgmma.py refuses that form while
//    racecheck reports its scale copies.
//  * Programmatic dependent launch (a no-op without it): after the barrier
//    set-up every thread waits for the previous grid (griddepcontrol.wait)
//    before any TMA load or global access, then lets the next grid launch.

#include "wgmma_ptx.cuh"
#include "fp8_quant_ptx.cuh"

#ifndef G_N
#error "G_N (output columns) must be defined"
#endif
#ifndef G_K
#error "G_K (reduction length) must be defined"
#endif
#ifndef G_BT
#define G_BT 64
#endif
#ifndef G_WG
#define G_WG 2
#endif
#ifndef G_ST
#define G_ST 4
#endif
#ifndef G_SPLIT
#define G_SPLIT 1
#endif
#ifndef G_CHAIN
#define G_CHAIN 1
#endif
#ifndef G_BLOCK
#define G_BLOCK 0
#endif
#ifndef G_OUT
#define G_OUT 0
#endif
#ifndef G_BIAS
#define G_BIAS 0
#endif
#ifndef G_QUANT
#define G_QUANT 0
#endif
#ifndef G_IN
#define G_IN 0
#endif
#ifndef G_PWG
#define G_PWG 0
#endif
#ifndef G_PERSIST
#define G_PERSIST 0
#endif

namespace f8w {

using namespace wg_ptx;
using namespace fq_ptx;

constexpr int N = G_N;
constexpr int K = G_K;
constexpr int BT = G_BT;
constexpr int WGS = G_WG;
constexpr int BN = 64 * WGS;
constexpr int STAGES = G_ST;
constexpr int SPLIT = G_SPLIT;
constexpr int THREADS = 128 * WGS;  // consumer threads
constexpr int THREADS_ALL = THREADS + (G_PWG ? 128 : 32);  // + the producer warp (warpgroup with G_PWG)
constexpr int KB = 128;  // K per stage: one 128-byte swizzle row of e4m3
constexpr int NKB = (K + KB - 1) / KB;
constexpr int TILES_N = (N + BN - 1) / BN;
constexpr int ACC = BT / 2;  // fp32 accumulators per thread (m64 x BT over 128 threads)
constexpr int CHAIN = G_CHAIN;
// Fragments in flight together: with CHAIN 1 each k32 step its own (the
// whole stage where the registers allow, else two groups of two); with
// CHAIN 4 one, the whole stage chained into it.
constexpr int FR = CHAIN == 4 ? 1 : (ACC <= 16 || (ACC == 32 && WGS == 1) ? 4 : 2);
constexpr int GROUPS = CHAIN == 4 ? 1 : 4 / FR;  // wait_group 0 points per stage
constexpr int STEPS = CHAIN == 4 ? 4 : FR;  // k32 steps per group
constexpr int X_BYTES = BT * 128;
constexpr int W_BYTES = BN * 128;
// G_QUANT: the stage's 16-bit activation rows (256 bytes each, unswizzled)
// after the e4m3 ones and the weight.
constexpr int STG_BYTES = G_QUANT ? BT * 256 : 0;
constexpr int STAGE_BYTES = X_BYTES + W_BYTES + STG_BYTES;  // each a multiple of the 1024-byte swizzle atom
constexpr int RED_BYTES = SPLIT > 1 ? ACC * THREADS * 4 : 0;
constexpr int BODY_BYTES = STAGES * STAGE_BYTES > RED_BYTES ? STAGES * STAGE_BYTES : RED_BYTES;
// G_BLOCK: each stage's activation scales (BT fp32, copied by the producer
// warp's cp.async) and the CTA's weight scales of its K range, after the
// barriers; with G_PERSIST each stage's weight scale at [BT] of its slot.
constexpr int BAR_BYTES = 16 * STAGES;
constexpr int SA_SLOT = (BT + (G_PERSIST ? 4 : 0)) * 4;
constexpr int SCALE_BYTES = G_BLOCK ? STAGES * SA_SLOT + (G_PERSIST ? 0 : (NKB + 31) / 32 * 128) : 0;
constexpr int SMEM_BYTES = BODY_BYTES + BAR_BYTES + SCALE_BYTES + 1024;  // + barriers, + base alignment
static_assert(SMEM_BYTES <= 227 * 1024, "the stages (or the split-K tile) exceed the shared memory of an SM");

static_assert(K % 16 == 0 && K > 0, "K must be a positive multiple of 16");
static_assert(BT == 16 || BT == 32 || BT == 64 || BT == 128, "G_BT must be 16, 32, 64 or 128");
static_assert(WGS == 1 || WGS == 2, "G_WG must be 1 or 2");
static_assert(STAGES >= 2 && STAGES <= 8, "G_ST must be 2..8");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4, "G_SPLIT must be 1, 2 or 4");
static_assert(G_OUT >= 0 && G_OUT <= 2 && G_BIAS >= 0 && G_BIAS <= 3, "G_OUT 0..2, G_BIAS 0..3");
static_assert(CHAIN == 1 || CHAIN == 4, "G_CHAIN must be 1 or 4");
static_assert(G_BLOCK == 0 || G_BLOCK == 1, "G_BLOCK must be 0 or 1");
static_assert(G_BLOCK == 0 || G_QUANT == 1 || G_BIAS == 0, "the block-scaled GEMM adds no bias");
static_assert(G_QUANT == 0 || (G_BLOCK == 1 && K % KB == 0), "G_QUANT needs G_BLOCK and K % 128 == 0");
static_assert(G_IN == 0 || G_IN == 1, "G_IN must be 0 (bf16) or 1 (fp16)");
static_assert(G_PWG == 0 || (G_PWG == 1 && WGS == 2 && G_QUANT == 0), "G_PWG 1 needs G_WG 2 and no G_QUANT");
// The split-K reduction's barriers are the consumers' (synccheck: divergent with
// the producers returning early).
static_assert(G_PWG == 0 || SPLIT == 1, "G_PWG 1 needs G_SPLIT 1");
static_assert(G_PERSIST == 0 || (G_PERSIST == 1 && SPLIT == 1 && G_QUANT == 0),
              "G_PERSIST 1 needs G_SPLIT 1 and no G_QUANT");
constexpr float FP8_MAX = 448.0f;
constexpr float GROUP_EPS = 1e-10f;  // per_token_group_quant_fp8's eps in fp8_block_linear

// 4 bytes global -> shared, asynchronous; src_bytes 0 writes zeros.
__device__ __forceinline__ void cp_async_4(u32 dst, const float* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// One arrival on the mbarrier once this thread's cp.asyncs have landed (counted
// in the barrier's arrivals: noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ float in_lo(u32 w) {
  if (G_IN == 1) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w & 0xFFFFu)));
    return f;
  }
  return __uint_as_float(w << 16);
}

__device__ __forceinline__ float in_hi(u32 w) {
  if (G_IN == 1) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(w >> 16)));
    return f;
  }
  return __uint_as_float(w & 0xFFFF0000u);
}

// G_QUANT: the consumer threads quantize one stage's BT x 128 activation
// tile from the staging slot ``stg`` into the e4m3 slot ``xq`` (128-byte
// swizzle: 16-byte chunk c of row r at r * 128 + ((c ^ (r & 7)) << 4)) and
// each row's scale into ``sa_slot``.  Eight consecutive threads share a row,
// 16 values each; rows past m arrive as zeros (their scales are unused).
__device__ __forceinline__ void quantize_stage(u32 stg, u32 xq, float* sa_slot, int tid) {
  constexpr int ROWS_PER_PASS = THREADS / 8;
  const int c = tid & 7;
#pragma unroll
  for (int r0 = 0; r0 < BT; r0 += ROWS_PER_PASS) {
    const int r = r0 + (tid >> 3);
    if (ROWS_PER_PASS <= BT || r < BT) {
      u32 w[8];
      const u32 src = stg + r * 256 + c * 32;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(src));
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(w[4]), "=r"(w[5]), "=r"(w[6]), "=r"(w[7]) : "r"(src + 16));
      float a = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) a = max_nan(a, max_nan(fabsf(in_lo(w[j])), fabsf(in_hi(w[j]))));
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) a = max_nan(a, __shfl_xor_sync(0xffffffffu, a, o));
      const float sc = div_rn(max_nan(a, GROUP_EPS), FP8_MAX);
      const float rc = rcp_rn(sc);
      u32 q[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        q[j] = e4m3x2(div_by(in_lo(w[2 * j]), sc, rc), div_by(in_hi(w[2 * j]), sc, rc)) |
               (e4m3x2(div_by(in_lo(w[2 * j + 1]), sc, rc), div_by(in_hi(w[2 * j + 1]), sc, rc)) << 16);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                   ::"r"(xq + r * 128 + ((c ^ (r & 7)) << 4)), "r"(q[0]), "r"(q[1]), "r"(q[2]), "r"(q[3])
                   : "memory");
      if (c == 0) sa_slot[r] = sc;
    }
  }
  // The codes are read by wgmma (the async proxy); the scales by every consumer.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
}

__device__ __forceinline__ void add(float (&acc)[ACC], const float (&d)[ACC]) {
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] += d[i];
}

// D (+)= A (64 x 32, K-major, a_desc) * B (BT x 32, K-major, b_desc), e4m3
// in, fp32 out; D is read only when CH (scale-d), so a fragment starts
// fresh at each promotion.
template <int CH>
__device__ __forceinline__ void wgmma_ss(float (&d)[8], u64 a_desc, u64 b_desc) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %10, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {"
               "%0,%1,%2,%3,%4,%5,%6,%7"
               "}, %8, %9, p, 1, 1;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "l"(a_desc), "l"(b_desc), "n"(CH));
}

template <int CH>
__device__ __forceinline__ void wgmma_ss(float (&d)[16], u64 a_desc, u64 b_desc) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %18, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
               "}, %16, %17, p, 1, 1;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(a_desc), "l"(b_desc), "n"(CH));
}

template <int CH>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], u64 a_desc, u64 b_desc) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"
               "%26,%27,%28,%29,%30,%31"
               "}, %32, %33, p, 1, 1;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "l"(a_desc), "l"(b_desc), "n"(CH));
}

template <int CH>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 a_desc, u64 b_desc) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"
               "%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,"
               "%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
               "}, %64, %65, p, 1, 1;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
                 "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
                 "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
                 "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "l"(a_desc), "l"(b_desc), "n"(CH));
}

}  // namespace f8w

#if G_SPLIT > 1
#define G_CLUSTER __cluster_dims__(1, 1, G_SPLIT)
#else
#define G_CLUSTER
#endif

// grid (ceil(m / BT), ceil(N / BN), SPLIT) (G_PERSIST: (CTAs, 1, 1), any number),
// block 128 * WG + 32 (G_PWG: + 128), dynamic shared memory f8w::SMEM_BYTES,
// clusters of (1, 1, SPLIT).  tmap_a: the
// activation [m, K] (bytes, box 128 x BT, 128-byte swizzle); tmap_b: the
// weight [N, K] (bytes, box 128 x BN, 128-byte swizzle); both zero-fill past
// the tensor.  sa[mm * sa_step], sb[n * sb_step]: the scales.  G_BLOCK:
// sa[mm * sa_m + kb * sa_k], sb[(n / 128) * sb_n + kb * sb_k] (any strides).
// G_QUANT: tmap_a is the 16-bit activation [m, K] (box 128 x BT, no
// swizzle); sa is unused.  out: [m, N] contiguous.
extern "C" __global__ void G_CLUSTER __launch_bounds__(f8w::THREADS_ALL, 1)
fp8_wgmma(const __grid_constant__ f8w::TmaMap tmap_a, const __grid_constant__ f8w::TmaMap tmap_b,
#if G_QUANT
          const float* __restrict__ sb, int sb_n, int sb_k, const void* __restrict__ bias,
#elif G_BLOCK
          const float* __restrict__ sa, int sa_m, int sa_k, const float* __restrict__ sb, int sb_n, int sb_k,
#else
          const float* __restrict__ sa, int sa_step, const float* __restrict__ sb, int sb_step,
          const void* __restrict__ bias,
#endif
          void* __restrict__ out, int m) {
  using namespace f8w;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 smem0 = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const u32 bars = smem0 + BODY_BYTES;  // full[STAGES], then empty[STAGES]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
#if G_PWG
  const bool producer = tid >= THREADS;  // the warpgroup after the consumer warpgroups
  const bool loader = (tid >> 5) == 4 * WGS;  // its first warp loads
#else
  const bool producer = (tid >> 5) == 4 * WGS;  // the warp after the consumer warpgroups
  constexpr bool loader = true;
#endif
#if G_PERSIST
  const int tiles_m = (m + BT - 1) / BT;
  const int tiles = tiles_m * TILES_N;
#else
  const int m0 = blockIdx.x * BT;
  const int n0 = blockIdx.y * BN;
#endif

  int kb0;
  const int nk = stage_range<NKB, SPLIT>(kb0);
  // G_BLOCK: a stage is full after the TMA bytes and the 32 producer lanes'
  // scale copies (G_QUANT: the TMA bytes; its consumers write the scales).
  ring_init<STAGES>(bars, 4 * WGS, G_BLOCK && !G_QUANT ? 33 : 1);
#if G_BLOCK
  const u32 sa_smem = bars + BAR_BYTES;
#if !G_PERSIST
  float* sw_smem = reinterpret_cast<float*>(smem_raw + (sa_smem + STAGES * SA_SLOT - smem_addr(smem_raw)));
  // The CTA's weight scales (one 128-row block: BN <= 128 and n0 % BN == 0).
  for (int i = tid; i < nk; i += THREADS_ALL) sw_smem[i] = sb[(n0 / 128) * sb_n + (kb0 + i) * sb_k];
  __syncthreads();
#endif
#endif

  // Stage i of the tile at (tm0, tn0) into ring slot ``slot`` once its last
  // readers are done (``parity``: the empty barrier's phase to wait for).
  auto load_stage = [&](int slot, u32 parity, int i, int tm0, int tn0) {
    mbar_wait(bars + 8 * (STAGES + slot), parity);
    const u32 full = bars + 8 * slot, base = smem0 + slot * STAGE_BYTES;
    if (lane == 0) {
      mbar_expect_tx(full, STAGE_BYTES - (G_QUANT ? X_BYTES : 0));
      // G_QUANT: the 16-bit rows to the staging slot (K coordinates in elements)
      tma_2d(G_QUANT ? base + X_BYTES + W_BYTES : base, &tmap_a, (kb0 + i) * KB, tm0, full);
      tma_2d(base + X_BYTES, &tmap_b, (kb0 + i) * KB, tn0, full);
    }
#if G_BLOCK && !G_QUANT
    // Rows past m read nothing and land as zeros.
    for (int r = lane; r < BT; r += 32) {
      const int mm = tm0 + r < m ? tm0 + r : 0;
      cp_async_4(sa_smem + slot * SA_SLOT + 4 * r, sa + (long long)mm * sa_m + (long long)(kb0 + i) * sa_k,
                 tm0 + r < m ? 4 : 0);
    }
#if G_PERSIST
    // The tile's weight scale of this stage (one 128-row block: BN <= 128, tn0 % BN == 0).
    if (lane == 0) cp_async_4(sa_smem + slot * SA_SLOT + 4 * BT, sb + (tn0 / 128) * sb_n + (kb0 + i) * sb_k, 4);
#endif
    cp_async_arrive_noinc(full);
#endif
  };

  // One tile's output from its accumulators.  D fragment of m64nBT: thread
  // (warp, g, t4) holds weight rows 16 warp + g (+ 8) and activation rows
  // 8 c + 2 t4 (+ 1), c < BT / 8.
  auto store_tile = [&](const float (&tacc)[ACC], int tm0, int tn0) {
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int wgi = tid >> 7;
    const int warp = (tid >> 5) & 3;
#pragma unroll
    for (int i = 0; i < ACC; ++i) {
      const int n = tn0 + wgi * 64 + warp * 16 + g + ((i >> 1) & 1) * 8;
      const int mm = tm0 + (i >> 2) * 8 + 2 * t4 + (i & 1);
      if (n < N && mm < m) {
#if G_QUANT
        store_out<G_OUT, N>(out, G_BIAS != 0 ? __fadd_rn(tacc[i], bias_at<G_BIAS>(bias, n)) : tacc[i], mm, n);
#elif G_BLOCK
        store_out<G_OUT, N>(out, tacc[i], mm, n);
#else
        float v = __fmul_rn(__fmul_rn(tacc[i], sa[mm * sa_step]), sb[n * sb_step]);
        if (G_BIAS != 0) v = __fadd_rn(v, bias_at<G_BIAS>(bias, n));
        store_out<G_OUT, N>(out, v, mm, n);
#endif
      }
    }
  };

  // With G_PWG the producers return after their loop (their 40 registers
  // must not hold the accumulators) and the consumers' branch follows it;
  // without, the two are one if / else (the SASS of the measured configs).
#if G_PWG
  if (producer) {
    producer_registers();
#else
#if !G_PERSIST
  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
#endif

  if (producer) {
#endif
    if (loader && ((G_BLOCK && !G_QUANT) || lane == 0)) {
#if G_PERSIST
      int slot = 0;
      u32 parity = 1;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int tm0, tn0;
        tile_origin<BT, BN, N>(t, tiles_m, tm0, tn0);
        for (int i = 0; i < nk; ++i) {
          load_stage(slot, parity, i, tm0, tn0);
          slot = slot + 1 == STAGES ? 0 : slot + 1;
          parity ^= slot == 0;
        }
      }
#else
      for (int i = 0; i < nk; ++i) load_stage(i % STAGES, ((i / STAGES) & 1) ^ 1, i, m0, n0);
#endif
    }
    __syncwarp();
#if G_PWG
    return;
  }
  consumer_registers();
#if !G_PERSIST
  float acc[ACC];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
#endif
  {
#else
  } else {
#endif
    const int wgi = tid >> 7;
    const u64 a_desc0 = smem_desc(smem0 + X_BYTES + wgi * 64 * 128);  // this warpgroup's 64 weight rows
    const u64 b_desc0 = smem_desc(smem0);
    float f[FR][ACC];  // the fragments of one group
    u32 slot = 0, phase = 0;  // run on from tile to tile (G_PERSIST)
#if G_PERSIST
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      int tm0, tn0;
      tile_origin<BT, BN, N>(t, tiles_m, tm0, tn0);
      float acc[ACC];
#pragma unroll
      for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
#endif
    for (int i = 0; i < nk; ++i) {
      mbar_wait(bars + 8 * slot, phase);
#if G_QUANT
      quantize_stage(smem0 + slot * STAGE_BYTES + X_BYTES + W_BYTES, smem0 + slot * STAGE_BYTES,
                     reinterpret_cast<float*>(smem_raw + (sa_smem + slot * SA_SLOT - smem_addr(smem_raw))), tid);
#endif
      const u64 off = (u64)((slot * STAGE_BYTES) >> 4);
#pragma unroll
      for (int q = 0; q < GROUPS; ++q) {
        wgmma_fence();
#pragma unroll
        for (int r = 0; r < STEPS; ++r) {
          const int j = q * STEPS + r;
          if (CHAIN == 4 && r > 0) {
            wgmma_ss<1>(f[0], a_desc0 + off + 2 * j, b_desc0 + off + 2 * j);
          } else {
            wgmma_ss<0>(f[CHAIN == 4 ? 0 : r], a_desc0 + off + 2 * j, b_desc0 + off + 2 * j);
          }
        }
        wgmma_commit();
#if G_BLOCK
        // This stage's scales, read while its MMAs run: D fragment column
        // 8 c + 2 t4 + e (activation row) -> sc[2 c + e].
        float sc[BT / 4];
        {
#if G_PERSIST
          const float w = reinterpret_cast<const float*>(smem_raw + (sa_smem + slot * SA_SLOT - smem_addr(smem_raw)))[BT];
#else
          const float w = sw_smem[i];
#endif
          const float* sa_s = reinterpret_cast<const float*>(
              smem_raw + (sa_smem + slot * SA_SLOT - smem_addr(smem_raw))) + 2 * (lane & 3);
#pragma unroll
          for (int c = 0; c < BT / 8; ++c) {
            const float2 v = *reinterpret_cast<const float2*>(sa_s + 8 * c);
            sc[2 * c] = v.x * w;
            sc[2 * c + 1] = v.y * w;
          }
        }
#endif
        wgmma_wait<0>();
#pragma unroll
        for (int r = 0; r < FR; ++r) {
          pin(f[r]);
#if G_BLOCK
#pragma unroll
          for (int e = 0; e < ACC; ++e) acc[e] = __fmaf_rn(f[r][e], sc[((e >> 2) << 1) | (e & 1)], acc[e]);
#else
          add(acc, f[r]);
#endif
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(bars + 8 * (STAGES + slot));  // the slot's MMAs have retired
      slot = slot + 1 == STAGES ? 0 : slot + 1;
      phase ^= slot == 0;
    }
#if G_PERSIST
      store_tile(acc, tm0, tn0);
    }
    return;
#endif
  }

#if !G_PERSIST
#if G_SPLIT > 1
  if (!cluster_reduce<ACC, THREADS, SPLIT>(acc, smem0, tid, !producer)) return;
#endif
#if !G_PWG
  if (producer) return;
#endif
  store_tile(acc, m0, n0);
#endif
}
