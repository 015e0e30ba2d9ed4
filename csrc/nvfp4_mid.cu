// Middle-M NVFP4 GEMM for Hopper (tens to ~a hundred activation rows), the
// same math and operands as nvfp4_gemv.cu:
//
//     W4A4:  out[m, n] = alpha * sum_k deq(a)[m, k] * deq(b)[n, k] (+ bias[n])
//     W4A16: out[m, n] = alpha * sum_k a[m, k] * deq(b)[n, k] (+ bias[n])         (P_ACT 1, 2)
//
// (operand layouts, the swizzled e4m3 scales and the exact fp16 decode: see
// nvfp4_gemv.cu's header and nvfp4_decode.cuh).  Compiled at run time with
// NVRTC; one cubin per (N, K, config):
//
//   P_N, P_K     problem size (K % 32 == 0; any N >= 1)
//   P_WARPS      warps per CTA (4 or 8); they split the CTA's weight rows
//   P_NTW        16-row weight tiles per warp (1 or 2): the CTA owns
//                BN = 16 * P_WARPS * P_NTW rows
//   P_SPLIT      CTAs per thread-block cluster along K (1, 2, 4, 8), partial
//                tiles added through distributed shared memory in rank order
//   P_UNROLL     128-wide K units per pipeline step (1 or 2)
//   P_RING       0: each warp requests the next step's weight into registers
//                (one step ahead); 2..4: a ring of that many shared-memory
//                stages filled with cp.async (P_RING - 1 steps ahead, no
//                registers held), each thread reading back only its own
//                chunks (no barrier needed for them)
//   P_MB         activation rows per CTA (32 or 64); larger M runs
//                ceil(M / P_MB) row slices along grid z (the slices of a
//                weight tile meet it in L2)
//   P_OUT_F16, P_BIAS, P_ACT   as G_OUT_F16, G_BIAS, G_ACT of nvfp4_gemv.cu
//
// Design (why not the GEMV kernel: there every CTA decodes the activation of
// its K range for its few weight rows, M / ROWS times the weight's decode
// work, and M rows of accumulators do not fit the registers past ~32):
//  * Warps split N.  Warp w owns weight rows n0 + 16 (w NTW + t) + {g, g + 8}
//    and all P_MB activation rows; it streams its weight straight into
//    registers (ld.global.nc, no L1) and decodes each element once.
//  * The activation of a pipeline step (P_UNROLL units x P_MB rows x 128 k)
//    is decoded once per CTA into shared memory, in decode8's k order (a
//    thread's 32 k of a row, as 4 words of 16 bytes), then every warp reads
//    its B fragments with ld.shared.v4.  Word q of quad thread t of row r
//    sits in 16-byte slot 4 t + (q ^ ((r & 1) << 1 | t >> 1)) of the row's 256
//    bytes: the 8 threads of a quarter warp (rows r, r + 1 x t 0..3) meet 8
//    different bank groups, for the writes and the reads.
//  * Two activation stages: the next step's activation bytes are requested
//    into registers before this step's MMAs, one __syncthreads per step.  The
//    weight: the same one-step register prefetch, or (P_RING) a per-thread
//    cp.async ring in shared memory, P_RING - 1 steps ahead.
//  * Epilogue: the CTA's fp32 tile to shared memory (over the stages), then
//    the split-K CTAs of a cluster add it through DSMEM in rank order and
//    store it coalesced along N.  Deterministic, no workspace, no atomics,
//    CUDA-graph safe.

#ifndef P_N
#error "P_N (output columns) must be defined"
#endif
#ifndef P_K
#error "P_K (reduction length) must be defined"
#endif
#ifndef P_WARPS
#define P_WARPS 8
#endif
#ifndef P_NTW
#define P_NTW 2
#endif
#ifndef P_SPLIT
#define P_SPLIT 1
#endif
#ifndef P_UNROLL
#define P_UNROLL 1
#endif
#ifndef P_MB
#define P_MB 64
#endif
#ifndef P_RING
#define P_RING 0
#endif
#ifndef P_OUT_F16
#define P_OUT_F16 0
#endif
#ifndef P_BIAS
#define P_BIAS 0
#endif
#ifndef P_ACT
#define P_ACT 0
#endif

#include "nvfp4_decode.cuh"

namespace mid {

using namespace fa_ptx;
using namespace nvfp4_dec;

constexpr int N = P_N;
constexpr int K = P_K;
constexpr int WARPS = P_WARPS;
constexpr int NTW = P_NTW;
constexpr int SPLIT = P_SPLIT;
constexpr int U = P_UNROLL;
constexpr int MB = P_MB;
constexpr int RING = P_RING;
constexpr int MF = MB / 8;
constexpr int ACT = P_ACT;
constexpr int THREADS = WARPS * 32;
constexpr int BN = WARPS * NTW * 16;
constexpr int ROW_BYTES = K / 2;
constexpr int CHUNKS = K / 32;                    // 32-k chunks per row (16 packed bytes each)
constexpr int UNITS = (CHUNKS + 3) / 4;           // 128-k units
constexpr int STEPS = (UNITS + U - 1) / U;        // pipeline steps over K
constexpr int STEPS_PER_SPLIT = (STEPS + SPLIT - 1) / SPLIT;
constexpr int SCALE_C4 = (K / 16 + 3) / 4;
constexpr bool FULL_UNITS = CHUNKS % 4 == 0 && UNITS % U == 0;
constexpr bool FULL_ROWS = N % BN == 0;
constexpr int XV = ACT == 0 ? 1 : 4;              // 16-byte activation loads per (row, quad thread, unit)
constexpr int X_UNIT_BYTES = ACT == 0 ? 64 : 256;
constexpr int ROW_SMEM = 256;                     // one decoded row of one unit: 128 k x 16 bits
constexpr int STAGE_BYTES = U * MB * ROW_SMEM;
constexpr int ITEMS = U * MB * 4;                 // (unit, row, quad thread) items per step
constexpr int ITEMS_PER_THREAD = (ITEMS + THREADS - 1) / THREADS;
constexpr int RED_STRIDE = BN + 4;                // fp32 partial tile row (per activation row), padded
constexpr int RED_BYTES = MB * RED_STRIDE * 4;
constexpr int RING_W_BYTES = U * NTW * 2 * 32 * 16;  // one warp's weight chunks of one step
constexpr int RING_S_BYTES = U * NTW * 2 * 32 * 4;   // their aligned scale words
constexpr int RING_WARP = RING_W_BYTES + RING_S_BYTES;
constexpr int RING_STAGE = WARPS * RING_WARP;
constexpr int RING_MOD = RING > 0 ? RING : 1;      // (no division by zero in the unused path)
constexpr int MAIN_BYTES = 2 * STAGE_BYTES + RING * RING_STAGE;
constexpr int SMEM_BYTES = MAIN_BYTES > RED_BYTES ? MAIN_BYTES : RED_BYTES;
constexpr int TILE4 = MB * BN / 4;                // the fp32 tile in groups of 4 columns
constexpr int PER4 = TILE4 / SPLIT;               // groups each cluster rank adds and stores
constexpr int RED_ITERS = (PER4 + THREADS - 1) / THREADS;

static_assert(K % 32 == 0 && K > 0, "K must be a positive multiple of 32");
static_assert(N > 0, "N must be positive");
static_assert(WARPS == 4 || WARPS == 8, "P_WARPS must be 4 or 8");
static_assert(NTW == 1 || NTW == 2, "P_NTW must be 1 or 2");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4 || SPLIT == 8, "P_SPLIT must be 1, 2, 4 or 8");
static_assert(U == 1 || U == 2, "P_UNROLL must be 1 or 2");
static_assert(MB == 32 || MB == 64, "P_MB must be 32 or 64");
static_assert(RING == 0 || (RING >= 2 && RING <= 4), "P_RING must be 0 or 2..4");
static_assert(ACT >= 0 && ACT <= 2, "P_ACT must be 0 (e2m1), 1 (fp16) or 2 (bf16)");
static_assert(STEPS >= SPLIT, "more split-K CTAs than pipeline steps");
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory over the sm90 limit");
static_assert(TILE4 % SPLIT == 0 && BN % 4 == 0, "the tile splits into whole column groups per rank");

__device__ __forceinline__ void mma_act(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  nvfp4_dec::mma_act<ACT>(d, a0, a1, a2, a3, b0, b1);
}

__device__ __forceinline__ void st_shared_v4(u32 addr, const u32* v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

__device__ __forceinline__ void ld_shared_v4(u32 addr, u32* v) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(addr)
               : "memory");
}

// Four floats at shared address ``addr`` (this CTA's view) of cluster rank ``rank``.
__device__ __forceinline__ void load_peer_v4(u32 addr, u32 rank, float (&v)[4]) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
               : "r"(remote)
               : "memory");
}

// Byte offset of word q of quad thread t4 of row r within a unit's rows
// (also a host function: tests/test_csrc_host.py checks the slots).
__host__ __device__ __forceinline__ u32 slot_offset(int r, int t4, int q) {
  return (u32)(r * ROW_SMEM + (t4 * 4 + (q ^ (((r & 1) << 1) | (t4 >> 1)))) * 16);
}

// -- the activation of one step: global -> registers -> decoded -> shared -----

struct ActRegs {
  V4 x[ITEMS_PER_THREAD][XV];
  u32 xs[ITEMS_PER_THREAD];  // W4A4 scale pairs
};

__device__ __forceinline__ void load_act_step(ActRegs& ar, const unsigned char* a, const unsigned char* a_scales,
                                              int m, int m0, long long a_stride, int step, int tid) {
#pragma unroll
  for (int j = 0; j < ITEMS_PER_THREAD; ++j) {
    const int it = tid + j * THREADS;
    const int i = it / (MB * 4);
    const int r = (it % (MB * 4)) >> 2;
    const int t4 = it & 3;
    const int unit = step * U + i;
    const int row = m0 + r;
    const bool ok = (ITEMS % THREADS == 0 || it < ITEMS) && row < m &&
                    (FULL_UNITS || (unit < UNITS && unit * 4 + t4 < CHUNKS));
    const unsigned char* p = a + (long long)row * a_stride + (long long)unit * X_UNIT_BYTES + t4 * (X_UNIT_BYTES / 4);
#pragma unroll
    for (int v = 0; v < XV; ++v) ar.x[j][v] = ok ? load_act(p + 16 * v) : zero4();
    if (ACT == 0) {
      ar.xs[j] = ok ? load_scale2(a_scales + scale_offset(row, t4, SCALE_C4) + (long long)unit * 1024) : 0u;
    }
  }
}

__device__ __forceinline__ void store_act_step(const ActRegs& ar, u32 stage, int tid) {
#pragma unroll
  for (int j = 0; j < ITEMS_PER_THREAD; ++j) {
    const int it = tid + j * THREADS;
    if (ITEMS % THREADS != 0 && it >= ITEMS) break;
    const int i = it / (MB * 4);
    const int r = (it % (MB * 4)) >> 2;
    const int t4 = it & 3;
    u32 d[16];
    if (ACT == 0) {
      u32 lo, hi;
      scale_pairs(ar.xs[j], lo, hi);
#pragma unroll
      for (int q = 0; q < 4; ++q) decode8(ar.x[j][0].v[q], q < 2 ? lo : hi, &d[4 * q]);
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) act_pairs(ar.x[j][q], &d[4 * q]);
    }
    const u32 base = stage + (u32)(i * MB * ROW_SMEM);
#pragma unroll
    for (int q = 0; q < 4; ++q) st_shared_v4(base + slot_offset(r, t4, q), &d[4 * q]);
  }
}

// -- the warp's weight of one step: registers --------------------------------

struct WRegs {
  V4 w[U][NTW][2];
  u32 ws[U][NTW][2];
};

struct WRows {
  const unsigned char* row[NTW][2];    // rows g, g + 8 of each tile, at chunk t4 of unit 0
  const unsigned char* scale[NTW][2];  // their scale pairs of unit 0
  bool ok[NTW][2];
  int t4;
};

__device__ __forceinline__ void load_w_step(WRegs& wr, const WRows& rows, int step) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int unit = step * U + i;
    const bool ok = FULL_UNITS || (unit < UNITS && unit * 4 + rows.t4 < CHUNKS);
#pragma unroll
    for (int t = 0; t < NTW; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool rok = ok && (FULL_ROWS || rows.ok[t][h]);
        wr.w[i][t][h] = rok ? load_weight(rows.row[t][h] + (long long)unit * 64) : zero4();
        wr.ws[i][t][h] = rok ? load_scale2(rows.scale[t][h] + (long long)unit * 1024) : 0u;
      }
    }
  }
}

// -- P_RING > 0: the warp's weight through a cp.async ring (fused_a_ptx.cuh's copies) --

__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// Request step ``step``'s weight chunks and scale words of this thread into the
// ring slot at ``slot`` (this warp's part).  Out-of-range chunks are zero-filled
// (source size 0, the source a valid base address).  A scale pair is fetched
// as the aligned 4-byte word that holds it.
__device__ __forceinline__ void ring_issue(const WRows& rows, int step, u32 slot, int lane,
                                           const unsigned char* b, const unsigned char* b_scales) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int unit = step * U + i;
    const bool ok = FULL_UNITS || (unit < UNITS && unit * 4 + rows.t4 < CHUNKS);
#pragma unroll
    for (int t = 0; t < NTW; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool rok = ok && (FULL_ROWS || rows.ok[t][h]);
        const int idx = ((i * NTW + t) * 2 + h) * 32 + lane;
        cp_async16(slot + (u32)(idx * 16), rok ? rows.row[t][h] + (long long)unit * 64 : b, rok);
        cp_async4(slot + (u32)(RING_W_BYTES + idx * 4),
                  rok ? rows.scale[t][h] - 2 * (rows.t4 & 1) + (long long)unit * 1024 : b_scales, rok);
      }
    }
  }
}

__device__ __forceinline__ void ring_read(WRegs& wr, u32 slot, int lane, int t4) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
#pragma unroll
    for (int t = 0; t < NTW; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int idx = ((i * NTW + t) * 2 + h) * 32 + lane;
        ld_shared_v4(slot + (u32)(idx * 16), wr.w[i][t][h].v);
        wr.ws[i][t][h] = (ld_shared_u32(slot + (u32)(RING_W_BYTES + idx * 4)) >> (16 * (t4 & 1))) & 0xFFFFu;
      }
    }
  }
}

// -- the MMAs of one step ------------------------------------------------------

__device__ __forceinline__ void mma_step(float (&acc)[NTW][MF][4], const WRegs& wr, u32 stage, int g, int t4) {
  const u32 row0 = (u32)(g * ROW_SMEM + t4 * 64);  // this thread's row g of fragment 0, slot group t4
  const int flip = ((g & 1) << 1) | (t4 >> 1);     // rows f * 8 + g share g's parity
#pragma unroll
  for (int i = 0; i < U; ++i) {
    u32 slo[NTW][2], shi[NTW][2];
#pragma unroll
    for (int t = 0; t < NTW; ++t) {
      weight_scale_pairs<ACT>(wr.ws[i][t][0], slo[t][0], shi[t][0]);
      weight_scale_pairs<ACT>(wr.ws[i][t][1], slo[t][1], shi[t][1]);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      u32 r0[NTW][4], r1[NTW][4];  // rows g and g + 8 of each tile, k 8q .. 8q + 7 of the thread's 32
#pragma unroll
      for (int t = 0; t < NTW; ++t) weight_word<ACT>(wr.w[i][t][0], wr.w[i][t][1], q, slo[t], shi[t], r0[t], r1[t]);
      const u32 word = stage + (u32)(i * MB * ROW_SMEM) + row0 + (u32)((q ^ flip) * 16);
#pragma unroll
      for (int f = 0; f < MF; ++f) {
        u32 xq[4];
        ld_shared_v4(word + (u32)(f * 8 * ROW_SMEM), xq);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
#pragma unroll
          for (int t = 0; t < NTW; ++t) {
            mma_act(acc[t][f], r0[t][2 * s], r1[t][2 * s], r0[t][2 * s + 1], r1[t][2 * s + 1], xq[2 * s],
                    xq[2 * s + 1]);
          }
        }
      }
    }
  }
}

__device__ __forceinline__ void store_out(u16* out, const void* bias, float alpha, int mm, int n, float s) {
  nvfp4_dec::store_out<ACT, P_BIAS, P_OUT_F16 != 0, N>(out, bias, alpha, mm, n, s);
}

}  // namespace mid

#if P_SPLIT > 1
#define P_CLUSTER __cluster_dims__(1, P_SPLIT, 1)
#else
#define P_CLUSTER
#endif

// grid (ceil(N / BN), SPLIT, ceil(m / MB)), block (32 * WARPS), dynamic shared
// memory mid::SMEM_BYTES; clusters of (1, SPLIT, 1).  a_stride: bytes between
// rows of a (a multiple of 16).
extern "C" __global__ void P_CLUSTER __launch_bounds__(mid::THREADS)
nvfp4_mid(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
          const unsigned char* __restrict__ a_scales, const unsigned char* __restrict__ b_scales,
          const float* __restrict__ alpha_ptr, const void* __restrict__ bias, unsigned short* __restrict__ out,
          int m, long long a_stride) {
  using namespace mid;
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int n0 = blockIdx.x * BN;
  const int m0 = blockIdx.z * MB;
  const u32 stage0 = smem_addr(smem);
  const u32 stage1 = stage0 + STAGE_BYTES;

  WRows rows;
  rows.t4 = t4;
#pragma unroll
  for (int t = 0; t < NTW; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = n0 + (warp * NTW + t) * 16 + g + 8 * h;
      rows.ok[t][h] = row < N;
      rows.row[t][h] = b + (long long)row * ROW_BYTES + t4 * 16;
      rows.scale[t][h] = b_scales + scale_offset(row, t4, SCALE_C4);
    }
  }

  float acc[NTW][MF][4];
#pragma unroll
  for (int t = 0; t < NTW; ++t)
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][f][e] = 0.f;

  const int s_begin = blockIdx.y * STEPS_PER_SPLIT;
  const int s_end = s_begin + STEPS_PER_SPLIT < STEPS ? s_begin + STEPS_PER_SPLIT : STEPS;
  ActRegs ar;
  if (RING > 0) {
    // Weight: RING - 1 steps in flight through the ring; activation as below.
    const u32 ring0 = stage0 + 2 * STAGE_BYTES + (u32)(warp * RING_WARP);
    WRegs w;
#pragma unroll
    for (int p = 0; p < (RING > 0 ? RING - 1 : 0); ++p) {
      if (s_begin + p < s_end) ring_issue(rows, s_begin + p, ring0 + (u32)(p * RING_STAGE), lane, b, b_scales);
      cp_async_commit();
    }
    if (s_begin < s_end) load_act_step(ar, a, a_scales, m, m0, a_stride, s_begin, tid);
    for (int st = s_begin; st < s_end; ++st) {
      const int j = st - s_begin;
      if (st + RING - 1 < s_end) {
        ring_issue(rows, st + RING - 1, ring0 + (u32)(((j + RING - 1) % RING_MOD) * RING_STAGE), lane, b, b_scales);
      }
      cp_async_commit();  // (empty past the end: the wait below counts groups)
      const u32 stage = (j & 1) ? stage1 : stage0;
      store_act_step(ar, stage, tid);
      if (st + 1 < s_end) load_act_step(ar, a, a_scales, m, m0, a_stride, st + 1, tid);
      cp_async_wait<(RING > 0 ? RING - 1 : 0)>();  // this thread's copies of step st have landed
      ring_read(w, ring0 + (u32)((j % RING_MOD) * RING_STAGE), lane, t4);
      __syncthreads();
      mma_step(acc, w, stage, g, t4);
    }
  }
  WRegs w0, w1;
  int st = RING > 0 ? s_end : s_begin;
  if (st < s_end) {
    load_w_step(w0, rows, st);
    load_act_step(ar, a, a_scales, m, m0, a_stride, st, tid);
  }
  while (st < s_end) {  // two steps per trip: stage / weight registers 0, then 1
    store_act_step(ar, stage0, tid);
    if (st + 1 < s_end) {
      load_w_step(w1, rows, st + 1);
      load_act_step(ar, a, a_scales, m, m0, a_stride, st + 1, tid);
    }
    __syncthreads();
    mma_step(acc, w0, stage0, g, t4);
    if (++st >= s_end) break;
    store_act_step(ar, stage1, tid);
    if (st + 1 < s_end) {
      load_w_step(w0, rows, st + 1);
      load_act_step(ar, a, a_scales, m, m0, a_stride, st + 1, tid);
    }
    __syncthreads();
    mma_step(acc, w1, stage1, g, t4);
    ++st;
  }

  // The CTA's partial tile over the stages: red[mm * RED_STRIDE + row].
  // acc[t][f] = D of rows (warp NTW + t) 16 + g (+8), columns f 8 + 2 t4 (+1).
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);
  store_partials(red, RED_STRIDE, warp * NTW, acc, g, t4);
  const float alpha = *alpha_ptr;
  constexpr int TILE = MB * BN;
  if (SPLIT == 1) {
    __syncthreads();
    for (int e = tid; e < TILE; e += THREADS) {
      const int mm = e / BN;
      const int col = e % BN;
      if (m0 + mm < m && n0 + col < N) store_out(out, bias, alpha, m0 + mm, n0 + col, red[mm * RED_STRIDE + col]);
    }
  } else {
    // Rank r adds column groups [r PER4, (r + 1) PER4) of every peer's tile:
    // all remote loads first (four floats each, independent), then the sums
    // in rank order.
    cluster_sync();
    const int rank = (int)cluster_rank();
    const u32 red_base = smem_addr(red);
    float v[RED_ITERS][SPLIT][4];
#pragma unroll
    for (int it = 0; it < RED_ITERS; ++it) {
      const int e4 = rank * PER4 + tid + it * THREADS;
      if (PER4 % THREADS == 0 || tid + it * THREADS < PER4) {
        const int e = 4 * e4;
        const u32 addr = red_base + (u32)(((e / BN) * RED_STRIDE + e % BN) * 4);
#pragma unroll
        for (int p = 0; p < SPLIT; ++p) load_peer_v4(addr, (u32)p, v[it][p]);
      }
    }
#pragma unroll
    for (int it = 0; it < RED_ITERS; ++it) {
      const int e4 = rank * PER4 + tid + it * THREADS;
      if (PER4 % THREADS == 0 || tid + it * THREADS < PER4) {
        const int mm = (4 * e4) / BN;
        const int col = (4 * e4) % BN;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float s = v[it][0][c];
#pragma unroll
          for (int p = 1; p < SPLIT; ++p) s += v[it][p][c];
          if (m0 + mm < m && n0 + col + c < N) store_out(out, bias, alpha, m0 + mm, n0 + col + c, s);
        }
      }
    }
    cluster_sync();  // keep every CTA's shared memory alive until its peers have read it
  }
}
