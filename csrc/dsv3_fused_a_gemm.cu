// Skinny bf16 GEMM for DeepSeek-V3's fused q_a / kv_a projection and kin:
//
//     out[m, n] = sum_k x[m, k] * w[n, k]      x: bf16 [M, K], 1 <= M <= 16
//                                              w: bf16 [N, K] row-major, out: bf16 [M, N]
//
// Compiled at run time with NVRTC (scaledmm/jit.py); needs no CUDA header.
// Every size and tile choice is a macro, so one cubin serves one (N, K, config):
//
//   FA_N, FA_K      problem size (N % 16 == 0, K % 32 == 0)
//   FA_ROWS         weight rows per CTA (16, 32 or 64)
//   FA_WARPS        warps per CTA; they split the CTA's K range between them
//   FA_SPLIT_K      CTAs per thread-block cluster along K (1, 2, 4, 8); their
//                   partial sums are added through distributed shared memory
//   FA_UNROLL       32-wide K units each warp loads per step (register batch)
//   FA_MB           M bucket: 8 (M <= 8) or 16 (9 <= M <= 16)
//   FA_PREFETCH     1: each CTA first asks the TMA unit to prefetch its weight
//                   slice into L2 (cp.async.bulk.prefetch; allowed before the
//                   PDL wait because it only warms a coherent cache)
//
// Design: the kernel is bound by streaming the weight from HBM once.
//  * Tensor cores with A and B swapped: A = 16 weight rows x 16 k, B = x^T
//    (16 k x 8 rows of x), D = out^T (16 n x 8 m), mma.sync m16n8k16 bf16 with
//    fp32 accumulation.  M <= 8 wastes nothing; 9..16 uses two B fragments.
//  * The reduction order over k is free, so each thread loads 16 contiguous
//    bytes (8 k) of a weight row and of an x row straight from global memory
//    into registers and uses them as its fragment elements of two mma k-steps
//    (thread lane = 4 * g + t holds rows g and g + 8, k = 8 t .. 8 t + 7 of each
//    32-wide unit; the same permutation is applied to x).  No shared-memory
//    staging, no ldmatrix; loads are double-buffered in registers.
//  * Split-K inside the CTA across warps (shared-memory reduction) and, for
//    narrow N, across the CTAs of a cluster (DSMEM reduction, fixed order).
//    The output is fully written by every launch from registers: no workspace,
//    no memset, no atomics, bit-reproducible run to run, CUDA-graph safe.
//  * PDL: the first register batch of w is requested, then
//    griddepcontrol.wait (before any load of x or store of out), then
//    griddepcontrol.launch_dependents at once.  Both are no-ops
//    when the launch does not enable programmatic stream serialization.

#ifndef FA_N
#error "FA_N (output columns) must be defined"
#endif
#ifndef FA_K
#error "FA_K (reduction length) must be defined"
#endif
#ifndef FA_ROWS
#define FA_ROWS 16
#endif
#ifndef FA_WARPS
#define FA_WARPS 8
#endif
#ifndef FA_SPLIT_K
#define FA_SPLIT_K 1
#endif
#ifndef FA_UNROLL
#define FA_UNROLL 4
#endif
#ifndef FA_MB
#define FA_MB 16
#endif
#ifndef FA_PREFETCH
#define FA_PREFETCH 0
#endif

#include "fused_a_ptx.cuh"

namespace fa {

using namespace fa_ptx;

constexpr int N = FA_N;
constexpr int K = FA_K;
constexpr int ROWS = FA_ROWS;
constexpr int NT = ROWS / 16;         // 16-row mma tiles per CTA
constexpr int WARPS = FA_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int SPLIT = FA_SPLIT_K;
constexpr int U = FA_UNROLL;
constexpr int MB = FA_MB;
constexpr int MF = MB / 8;            // x fragments (8 rows each)
constexpr int UNITS = K / 32;         // 32-wide K units
constexpr int UNITS_PER_SPLIT = (UNITS + SPLIT - 1) / SPLIT;
constexpr bool FULL_UNITS = UNITS % (SPLIT * U) == 0;  // no partial batch anywhere
constexpr bool FULL_ROWS = N % ROWS == 0;              // no partial CTA row tile
constexpr int TILE = ROWS * MB;                       // fp32 partials per CTA

static_assert(N % 16 == 0, "N must be a multiple of 16");
static_assert(K % 32 == 0, "K must be a multiple of 32");
static_assert(ROWS == 16 || ROWS == 32 || ROWS == 64, "FA_ROWS must be 16, 32 or 64");
static_assert(MB == 8 || MB == 16, "FA_MB must be 8 or 16");
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4 || SPLIT == 8, "FA_SPLIT_K must be 1, 2, 4 or 8");
static_assert(WARPS >= 1 && WARPS <= 16, "FA_WARPS must be 1..16");
static_assert(U >= 1 && U <= 8, "FA_UNROLL must be 1..8");
static_assert(WARPS * TILE * 4 <= 48 * 1024, "reduction buffer exceeds 48 KiB of static shared memory");

// -- PTX helpers ---------------------------------------------------------------

__device__ __forceinline__ V4 load_weight(const u16* p) {
  return fa_ptx::load_weight(reinterpret_cast<const unsigned char*>(p));
}

__device__ __forceinline__ V4 load_act(const u16* p) {
  V4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
               : "l"(p));
  return r;
}

__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// -- one warp's register batch: U units x (NT tiles x 2 row halves) of w, U x MF of x

struct Batch {
  V4 w[U][NT][2];
  V4 x[U][MF];
};

struct Operands {
  const u16* w_row[NT][2];  // row g and g + 8 of each 16-row tile, at k = 8 t
  bool w_ok[NT];
  const u16* x_row[MF];     // x row g and g + 8, at k = 8 t
  bool x_ok[MF];
  int u_begin, u_end;
};

// WEIGHT / ACT select the halves of a batch: the first batch loads its weight
// before the PDL wait (the weight is never written by a preceding kernel) and
// its x after it.
template <bool WEIGHT = true, bool ACT = true>
__device__ __forceinline__ void load_batch(Batch& b, const Operands& op, int batch) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int unit = op.u_begin + batch * U + i;
    const bool unit_ok = FULL_UNITS || unit < op.u_end;
    const long long k0 = (long long)unit * 32;
    if (WEIGHT) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          b.w[i][t][h] = (unit_ok && (FULL_ROWS || op.w_ok[t])) ? load_weight(op.w_row[t][h] + k0) : zero4();
        }
      }
    }
    if (ACT) {
#pragma unroll
      for (int f = 0; f < MF; ++f) {
        b.x[i][f] = (unit_ok && op.x_ok[f]) ? load_act(op.x_row[f] + k0) : zero4();
      }
    }
  }
}

__device__ __forceinline__ void mma_batch(float (&acc)[NT][MF][4], const Batch& b) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // two k16 steps per 32-wide unit
#pragma unroll
      for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int f = 0; f < MF; ++f) {
          mma_bf16(acc[t][f], b.w[i][t][0].v[2 * j], b.w[i][t][1].v[2 * j], b.w[i][t][0].v[2 * j + 1],
                   b.w[i][t][1].v[2 * j + 1], b.x[i][f].v[2 * j], b.x[i][f].v[2 * j + 1]);
        }
      }
    }
  }
}

}  // namespace fa

#if FA_SPLIT_K > 1
#define FA_CLUSTER __cluster_dims__(1, FA_SPLIT_K, 1)
#else
#define FA_CLUSTER
#endif

// grid (ceil(N / ROWS), SPLIT_K), block (32 * WARPS); clusters of (1, SPLIT_K, 1).
// x_stride: elements between rows of x (a multiple of 8, or anything when m == 1).
extern "C" __global__ void FA_CLUSTER __launch_bounds__(fa::THREADS, 1)
dsv3_fused_a_gemm(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                  unsigned short* __restrict__ out, int m, long long x_stride) {
  using namespace fa;
  __shared__ float red[WARPS][TILE];  // red[warp][mm * ROWS + row]

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int n0 = blockIdx.x * ROWS;

  Operands op;
  op.u_begin = blockIdx.y * UNITS_PER_SPLIT;
  op.u_end = op.u_begin + UNITS_PER_SPLIT < UNITS ? op.u_begin + UNITS_PER_SPLIT : UNITS;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    op.w_ok[t] = n0 + t * 16 < N;
    const u64 row = (u64)(n0 + t * 16 + g);
    op.w_row[t][0] = w + row * K + t4 * 8;
    op.w_row[t][1] = w + (row + 8) * K + t4 * 8;
  }
#pragma unroll
  for (int f = 0; f < MF; ++f) {
    op.x_ok[f] = f * 8 + g < m;
    op.x_row[f] = x + (long long)(f * 8 + g) * x_stride + t4 * 8;
  }

  if (FA_PREFETCH && (int)threadIdx.x < ROWS && n0 + (int)threadIdx.x < N && op.u_end > op.u_begin) {
    prefetch_l2(w + (u64)(n0 + threadIdx.x) * K + (u64)op.u_begin * 32, (u32)(op.u_end - op.u_begin) * 64u);
  }

  float acc[NT][MF][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int f = 0; f < MF; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][f][e] = 0.f;

  // Warps take batches of U units round-robin; two register batches in flight.
  // The first batch's weight is requested before the PDL wait; the trigger
  // follows the wait at once, so a PDL successor is scheduled while this grid
  // streams and can request its own weight early too (its wait still holds
  // until this grid has finished and its writes are visible).
  const int nbatch = (op.u_end - op.u_begin + U - 1) / U;
  Batch b0, b1;
  int b = warp;
  if (b < nbatch) load_batch<true, false>(b0, op, b);
  grid_dependency_wait();
  launch_dependents();
  if (b < nbatch) load_batch<false, true>(b0, op, b);
  while (b < nbatch) {
    if (b + WARPS < nbatch) load_batch(b1, op, b + WARPS);
    mma_batch(acc, b0);
    b += WARPS;
    if (b >= nbatch) break;
    if (b + WARPS < nbatch) load_batch(b0, op, b + WARPS);
    mma_batch(acc, b1);
    b += WARPS;
  }

  // Warp partials -> shared memory, summed over warps and the cluster.
  store_partials(red[warp], ROWS, 0, acc, g, t4);
  __syncthreads();
  reduce_partials<WARPS, TILE, ROWS, SPLIT, THREADS>(red, [&](int mm, int r, float s) {
    const int n = n0 + r;
    if (mm < m && (FULL_ROWS || n < N)) out[(long long)mm * N + n] = to_bf16(s);
  });
}
