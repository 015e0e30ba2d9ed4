// Skinny bf16 GEMM, version 2: the weight streams through a shared-memory ring
// filled by TMA bulk copies, so every SM keeps tens of KB of weight in flight.
//
//     out[m, n] = sum_k x[m, k] * w[n, k]      x: bf16 [M, K], 1 <= M <= 16
//                                              w: bf16 [N, K] row-major, out: bf16 [M, N]
//
// Compiled at run time with NVRTC (scaledmm/jit.py, ops/skinny_fused_a.py);
// needs no CUDA header.  One cubin per (N, K, config, M bucket):
//
//   FA_N, FA_K        problem size (N % 16 == 0, K % 32 == 0)
//   FA_ROWS           weight rows per tile: 16, 32, 48 or 64
//   FA_SPLIT_K        1: persistent grid, each CTA loops over tiles (gridDim.x
//                     CTAs, tile = blockIdx.x + i * gridDim.x); 2..8: one tile
//                     per cluster of FA_SPLIT_K CTAs that split K and add their
//                     partial tiles through distributed shared memory
//   FA_CHUNK          k per pipeline stage (a multiple of 64)
//   FA_STAGES         ring depth
//   FA_WARPS          consumer (MMA) warps; one more warp issues the copies
//   FA_MB             M bucket: 8 (M <= 8) or 16
//   FA_XRES           1: x's K range is copied to shared memory once and stays
//                     there (stages hold weight only); 0: each stage carries
//                     its own x chunk
//   FA_SMEM_BYTES     dynamic shared memory the launcher passes (checked
//                     against the layout below at compile time)
//
// Design (see benchmarks/NOTES.md, "Skinny fused-A"):
//  * Producer (one thread of the last warp): for each chunk of the CTA's
//    work, wait until the ring slot is free, announce the chunk's bytes on the
//    slot's "full" mbarrier (arrive.expect_tx) and issue cp.async.bulk copies
//    of its weight rows (and x rows): one 1-D copy per row, L2 evict-first
//    for the weight.  Under PDL the weight of the first FA_STAGES chunks is requested
//    before griddepcontrol.wait (the weight is not written by the previous
//    kernel), x only after it.
//  * Consumer warps: wait on "full", read 16-byte fragments from shared memory
//    and run mma.sync m16n8k16 (A = 16 weight rows, B = x^T, D = out^T), then
//    arrive on the slot's "empty" mbarrier.  The k order inside a 32-wide unit
//    is permuted identically for w and x (thread (g, t) holds k = 8t .. 8t+7
//    of rows g and g + 8), so plain 16-byte shared loads form the fragments;
//    rows are padded to a pitch = 64 mod 128 bytes, so the loads are free of
//    bank conflicts.
//  * Warps split the tile's 16-row subtiles and, beyond that, the units of
//    each chunk (k-groups); k-group partials are added in shared memory;
//    split-K ranks push their partials into the shared memory of the rank
//    that finishes each part of the tile (DSMEM stores, one cluster barrier),
//    which adds them in rank order: no workspace, no memset, no atomics,
//    bit-reproducible, CUDA-graph safe.
//  * griddepcontrol.launch_dependents right after setup: a PDL-launched
//    successor may then start and stream its own weight while this grid
//    finishes; it still waits (griddepcontrol.wait) for this grid's output.

#ifndef FA_N
#error "FA_N (output columns) must be defined"
#endif
#ifndef FA_K
#error "FA_K (reduction length) must be defined"
#endif
#ifndef FA_ROWS
#define FA_ROWS 32
#endif
#ifndef FA_SPLIT_K
#define FA_SPLIT_K 1
#endif
#ifndef FA_CHUNK
#define FA_CHUNK 256
#endif
#ifndef FA_STAGES
#define FA_STAGES 4
#endif
#ifndef FA_WARPS
#define FA_WARPS 4
#endif
#ifndef FA_MB
#define FA_MB 16
#endif
#ifndef FA_XRES
#define FA_XRES 0
#endif

#include "fused_a_ptx.cuh"

namespace fat {

using namespace fa_ptx;

constexpr int N = FA_N;
constexpr int K = FA_K;
constexpr int ROWS = FA_ROWS;
constexpr int NT = ROWS / 16;  // 16-row subtiles per tile
constexpr int SPLIT = FA_SPLIT_K;
constexpr int CHUNK = FA_CHUNK;
constexpr int STAGES = FA_STAGES;
constexpr int CW = FA_WARPS;  // consumer warps
constexpr int THREADS = (CW + 1) * 32;
constexpr int MB = FA_MB;
constexpr int MF = MB / 8;  // 8-row x fragments
constexpr bool XRES = FA_XRES != 0;

constexpr int TG = CW < NT ? CW : NT;  // warps of one k-group (each owns WT subtiles)
constexpr int WT = NT / TG;            // subtiles per warp
constexpr int KW = CW / TG;            // k-groups (split each chunk's units)
constexpr int TILES = (N + ROWS - 1) / ROWS;
constexpr bool FULL_ROWS = N % ROWS == 0;
constexpr int CHUNKS = (K + CHUNK - 1) / CHUNK;
constexpr bool FULL_CHUNKS = K % CHUNK == 0;
constexpr int RANK_CHUNKS = (CHUNKS + SPLIT - 1) / SPLIT;  // most chunks of one split rank
constexpr int UNITS = CHUNK / 32;                          // 32-wide k units of a full chunk
constexpr int UPW = (UNITS + KW - 1) / KW;                 // units per warp per chunk (at most)
constexpr bool EVEN_UNITS = FULL_CHUNKS && UNITS % KW == 0;

// Shared memory layout (bytes): ring | resident x | k-group partials | split-K inbox | mbarriers.
constexpr int PITCH = CHUNK * 2 + 64;  // = 64 (mod 128) bytes: rows g, g+1 hit disjoint banks
constexpr int XPITCH = RANK_CHUNKS * CHUNK * 2 + 64;
constexpr int STAGE_W = ROWS * PITCH;
constexpr int STAGE_BYTES = STAGE_W + (XRES ? 0 : MB * PITCH);
constexpr int RING_BYTES = STAGES * STAGE_BYTES;
constexpr int XRES_BYTES = XRES ? MB * XPITCH : 0;
constexpr int TILE = ROWS * MB;               // fp32 partials of one tile, [mm][row]
constexpr int PER = (TILE + SPLIT - 1) / SPLIT;  // elements of a tile each split rank finishes
constexpr int RED_BYTES = KW > 1 ? 2 * KW * TILE * 4 : 0;    // k-group partials, double-buffered across tiles
constexpr int INBOX_BYTES = SPLIT > 1 ? SPLIT * PER * 4 : 0;  // split-K partials pushed by the ranks
constexpr int BAR_OFF = RING_BYTES + XRES_BYTES + RED_BYTES + INBOX_BYTES;
constexpr int SMEM = BAR_OFF + (2 * STAGES + 1) * 8;

static_assert(N % 16 == 0, "N must be a multiple of 16");
static_assert(K % 32 == 0, "K must be a multiple of 32");
static_assert(ROWS == 16 || ROWS == 32 || ROWS == 48 || ROWS == 64, "FA_ROWS must be 16, 32, 48 or 64");
static_assert(MB == 8 || MB == 16, "FA_MB must be 8 or 16");
static_assert(SPLIT >= 1 && SPLIT <= 8, "FA_SPLIT_K must be 1..8");
static_assert(CHUNK % 64 == 0 && CHUNK <= 2048, "FA_CHUNK must be a multiple of 64, at most 2048");
static_assert(STAGES >= 1 && STAGES <= 16, "FA_STAGES must be 1..16");
static_assert(CW >= 1 && CW <= 8, "FA_WARPS must be 1..8");
static_assert(CW % NT == 0 || NT % CW == 0, "FA_WARPS must be a multiple or a divisor of FA_ROWS / 16");
static_assert(CHUNKS >= SPLIT, "every split rank needs at least one chunk");
static_assert(SMEM == FA_SMEM_BYTES, "FA_SMEM_BYTES disagrees with the kernel's shared-memory layout");
static_assert(SMEM <= 227 * 1024, "shared memory over 227 KiB");

// -- PTX helpers ---------------------------------------------------------------

__device__ __forceinline__ u64 evict_first_policy() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// 1-D bulk copy global -> this CTA's shared memory, completing on mbarrier `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Plain C++ loads from shared memory (LDS.128): ordered after mbar_wait by its
// "memory" clobber, otherwise free for the compiler to schedule.
__device__ __forceinline__ V4 lds128(const unsigned char* p) { return *reinterpret_cast<const V4*>(p); }

__device__ __forceinline__ void consumer_sync() {  // the consumer warps only (barrier 1)
  asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
}

// Split phase of a cluster barrier: arrive at start, wait before the first
// access to a peer's shared memory (which must have started running).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// Store into the shared memory of cluster rank `rank` at the address `local_addr` has here.
__device__ __forceinline__ void store_peer(u32 local_addr, u32 rank, float v) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// -- index math ------------------------------------------------------------------
// Plain C++, also compiled for the host: tests/test_skinny_tma_model.py runs
// the kernel's data movement on the CPU through these functions.

// The CTA's work: tiles tile0, tile0 + step, ...; chunks [c_begin, c_begin + cpt) of each.
struct Work {
  int tile0, step, ntile;
  int c_begin, cpt;  // first chunk and chunks per tile
  int total;         // ntile * cpt: chunks in the CTA's sequence

  __host__ __device__ __forceinline__ int tile(int g) const { return tile0 + (g / cpt) * step; }
  __host__ __device__ __forceinline__ int chunk(int g) const { return c_begin + g % cpt; }
  __host__ __device__ __forceinline__ int x_k0() const { return c_begin * CHUNK; }  // the rank's K range
  __host__ __device__ __forceinline__ int x_len() const {
    return ((c_begin + cpt) * CHUNK < K ? (c_begin + cpt) * CHUNK : K) - x_k0();
  }
};

// CTA tile0 of a grid of step CTAs along x, cluster rank ``rank`` along y.
__host__ __device__ __forceinline__ Work make_work(int tile0, int step, int rank) {
  Work wk;
  wk.tile0 = tile0;
  wk.step = step;
  wk.ntile = (TILES - wk.tile0 + wk.step - 1) / wk.step;
  wk.c_begin = rank * CHUNKS / SPLIT;
  wk.cpt = (rank + 1) * CHUNKS / SPLIT - wk.c_begin;
  wk.total = wk.ntile * wk.cpt;
  return wk;
}

__host__ __device__ __forceinline__ int tile_rows(int tile) {
  return FULL_ROWS ? ROWS : (N - tile * ROWS < ROWS ? N - tile * ROWS : ROWS);
}

__host__ __device__ __forceinline__ int chunk_len(int c) {
  return FULL_CHUNKS ? CHUNK : (K - c * CHUNK < CHUNK ? K - c * CHUNK : CHUNK);
}

// Shared-memory byte offsets (the producer's and the consumers' views).  Chunk
// g's stage: weight row r at stage_w(g) + r * PITCH, x row r (XRES 0) at
// stage_w(g) + STAGE_W + r * PITCH; resident x row r at RING_BYTES + r * XPITCH.
// The kernel adds these terms in the order the functions are split into.  The
// FAT_* macros are terms the kernel spells as macros: written as inline
// functions, NVVM orders the kernel's address arithmetic differently (other
// SASS).  (No namespace-scope constants here: each is a global in the cubin.)
#define FAT_STAGE_W(g) ((u32)((g) % STAGES) * STAGE_BYTES)
#define FAT_LANE_W(g8, t4) ((g8) * PITCH + (t4) * 16)
#define FAT_LANE_X(g8, t4) ((g8) * (XRES ? XPITCH : PITCH) + (t4) * 16)
#define FAT_ROW_W0(st) ((st) * 16 * PITCH)
#define FAT_ROW_W1(st) (((st) * 16 + 8) * PITCH)
#define FAT_INBOX_BASE(rank) ((rank) * PER)

__host__ __device__ __forceinline__ u32 stage_w(int g) { return FAT_STAGE_W(g); }

// Consumer lane (g8, t4) reads the 16 bytes (k 8 t4 .. 8 t4 + 7 of a unit) of
// weight rows 16 st + g8 (+ 8) and of x rows 8 f + g8.
__host__ __device__ __forceinline__ int lane_w(int g8, int t4) { return FAT_LANE_W(g8, t4); }
__host__ __device__ __forceinline__ int lane_x(int g8, int t4) { return FAT_LANE_X(g8, t4); }
// Stage s (step j of the tile) as the consumers read it: weight, x.
__host__ __device__ __forceinline__ int read_w(int s) { return s * STAGE_BYTES; }
__host__ __device__ __forceinline__ int read_x(int s, int j) {
  return XRES ? RING_BYTES + j * CHUNK * 2 : s * STAGE_BYTES + STAGE_W;
}
__host__ __device__ __forceinline__ int row_w(int st, int h) { return h ? FAT_ROW_W1(st) : FAT_ROW_W0(st); }
__host__ __device__ __forceinline__ int row_x(int f) { return f * 8 * (XRES ? XPITCH : PITCH); }
__host__ __device__ __forceinline__ int unit_off(int u) { return u * 64; }

// Warp w: subtiles tg * WT .. tg * WT + WT - 1, units kg, kg + KW, ... of each chunk.
__host__ __device__ __forceinline__ int warp_tg(int warp) { return warp % TG; }
__host__ __device__ __forceinline__ int warp_kg(int warp) { return warp / TG; }
__host__ __device__ __forceinline__ int subtile(int tg, int a) { return tg * WT + a; }
__host__ __device__ __forceinline__ int unit_of(int kg, int q) { return kg + q * KW; }

// acc[a][f] (the m16n8k16 D fragment of lane (g8, t4)) holds weight row
// acc_row(st, g8) (+ 8 for elements 2, 3) and x row acc_mm(f, t4) (+ 1 for
// elements 1, 3); tile element elem(mm, r) is out[mm, tile row r].
__host__ __device__ __forceinline__ int acc_row(int st, int g8) { return st * 16 + g8; }
__host__ __device__ __forceinline__ int acc_mm(int f, int t4) { return f * 8 + 2 * t4; }
__host__ __device__ __forceinline__ int elem(int mm, int r) { return mm * ROWS + r; }
__host__ __device__ __forceinline__ int elem_mm(int e) { return e / ROWS; }
__host__ __device__ __forceinline__ int elem_r(int e) { return e % ROWS; }

// Split-K: element e is finished by rank owner_of(e), which reads it from
// inbox slot inbox_base(pushing rank) + inbox_index(e).
__host__ __device__ __forceinline__ int owner_of(int e) { return e / PER; }
__host__ __device__ __forceinline__ int inbox_base(int rank) { return FAT_INBOX_BASE(rank); }
__host__ __device__ __forceinline__ int inbox_index(int e) { return e - owner_of(e) * PER; }

}  // namespace fat

#if FA_SPLIT_K > 1
#define FA_CLUSTER __cluster_dims__(1, FA_SPLIT_K, 1)
#else
#define FA_CLUSTER
#endif

// grid: SPLIT_K == 1: (CTAs <= tiles, 1) persistent; else (tiles, SPLIT_K) in
// clusters of (1, SPLIT_K, 1).  block: 32 * (FA_WARPS + 1).  Dynamic shared
// memory: FA_SMEM_BYTES.  x_stride: elements between rows of x (a multiple of
// 8, or anything when m == 1); x and w 16-byte aligned.
extern "C" __global__ void FA_CLUSTER __launch_bounds__(fat::THREADS, 1)
dsv3_fused_a_gemm_tma(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                      unsigned short* __restrict__ out, int m, long long x_stride) {
  using namespace fat;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 s_base = smem_addr(smem);
  const u32 s_ring = s_base;
  const u32 s_xres = s_base + RING_BYTES;
  float* red = reinterpret_cast<float*>(smem + RING_BYTES + XRES_BYTES);
  float* inbox = reinterpret_cast<float*>(smem + RING_BYTES + XRES_BYTES + RED_BYTES);  // [rank][PER]
  const u32 bar_full = s_base + BAR_OFF;       // full[s] at bar_full + 8 s
  const u32 bar_empty = bar_full + 8 * STAGES;  // empty[s]
  const u32 bar_x = bar_empty + 8 * STAGES;     // resident x

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int mv = m < MB ? m : MB;

  const int rank = SPLIT > 1 ? (int)cluster_rank() : 0;
  const Work wk = make_work(blockIdx.x, gridDim.x, rank);
  const int x_k0 = wk.x_k0();  // the rank's K range (resident x)
  const int x_len = wk.x_len();

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_full + 8 * s, 1);  // the producer thread's arrive.expect_tx
      mbar_init(bar_empty + 8 * s, CW);  // lane 0 of every consumer warp
    }
    mbar_init(bar_x, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  launch_dependents();
  if (SPLIT > 1) cluster_arrive_relaxed();  // "this CTA runs"; waited on before the DSMEM stores

  if (warp == CW) {
    // ---------------------------------------------------------------- producer
    // One thread issues every copy: its loop counters are warp-uniform, so the
    // addresses stay in uniform registers and each copy is a few instructions.
    if (lane == 0) {
      const u64 policy = evict_first_policy();
      auto issue_w = [&](int g, u32 full) {
        const int tile = wk.tile(g), c = wk.chunk(g);
        const int rows = tile_rows(tile);
        const u32 bytes = (u32)chunk_len(c) * 2;
        const u32 dst = s_ring + FAT_STAGE_W(g);
        const unsigned short* src = w + (u64)tile * ROWS * K + (u64)c * CHUNK;
        for (int r = 0; r < rows; ++r) bulk_copy(dst + r * PITCH, src + (u64)r * K, bytes, full, policy);
      };
      auto issue_x = [&](int g, u32 full) {
        const int c = wk.chunk(g);
        const u32 bytes = (u32)chunk_len(c) * 2;
        const u32 dst = s_ring + FAT_STAGE_W(g) + STAGE_W;
        for (int r = 0; r < mv; ++r) bulk_copy(dst + r * PITCH, x + r * x_stride + (long long)c * CHUNK, bytes, full);
      };
      auto expect = [&](int g, u32 full) {  // weight rows (+ x rows) of chunk g
        const int copies = tile_rows(wk.tile(g)) + (XRES ? 0 : mv);
        mbar_expect_tx(full, (u32)(copies * chunk_len(wk.chunk(g)) * 2));
      };

      const int pro = wk.total < STAGES ? wk.total : STAGES;
      for (int g = 0; g < pro; ++g) {  // weight first: the previous grid does not write it
        expect(g, bar_full + 8 * g);
        issue_w(g, bar_full + 8 * g);
      }
      grid_dependency_wait();
      if (XRES) {
        mbar_expect_tx(bar_x, (u32)(mv * x_len * 2));
        for (int r = 0; r < mv; ++r) bulk_copy(s_xres + r * XPITCH, x + r * x_stride + x_k0, (u32)x_len * 2, bar_x);
      } else {
        for (int g = 0; g < pro; ++g) issue_x(g, bar_full + 8 * g);
      }
      for (int g = pro; g < wk.total; ++g) {
        const int s = g % STAGES;
        mbar_wait(bar_empty + 8 * s, (u32)((g / STAGES) - 1) & 1u);
        expect(g, bar_full + 8 * s);
        issue_w(g, bar_full + 8 * s);
        if (!XRES) issue_x(g, bar_full + 8 * s);
      }
    }
    __syncwarp();
    if (SPLIT > 1) cluster_wait();
  } else {
    // ---------------------------------------------------------------- consumers
    grid_dependency_wait();  // before any write of out (its memory may be the previous grid's)
    const int g8 = lane >> 2, t4 = lane & 3;
    const int tg = warp_tg(warp), kg = warp_kg(warp);
    const int frag = FAT_LANE_W(g8, t4);  // this thread's 16 bytes of row g8, unit 0
    const int xfrag = FAT_LANE_X(g8, t4);
    if (XRES) mbar_wait(bar_x, 0);

    int g = 0;
    for (int i = 0; i < wk.ntile; ++i) {
      const int tile = wk.tile0 + i * wk.step;
      const int rows = tile_rows(tile);
      float acc[WT][MF][4];
#pragma unroll
      for (int a = 0; a < WT; ++a)
#pragma unroll
        for (int f = 0; f < MF; ++f)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[a][f][e] = 0.f;

      for (int j = 0; j < wk.cpt; ++j, ++g) {
        const int s = g % STAGES;
        mbar_wait(bar_full + 8 * s, (u32)(g / STAGES) & 1u);
        const int units = EVEN_UNITS ? UNITS : chunk_len(wk.c_begin + j) / 32;
        const unsigned char* sw = smem + read_w(s) + frag;
        const unsigned char* sx = smem + read_x(s, j) + xfrag;
#pragma unroll 4  // (full unrolling lets ptxas hoist every unit's loads: spills at 16 units)
        for (int q = 0; q < UPW; ++q) {
          const int u = unit_of(kg, q);
          if (!EVEN_UNITS && u >= units) break;
          V4 xf[MF];
#pragma unroll
          for (int f = 0; f < MF; ++f) xf[f] = lds128(sx + row_x(f) + unit_off(u));
#pragma unroll
          for (int a = 0; a < WT; ++a) {
            const int st = subtile(tg, a);
            if (!FULL_ROWS && st * 16 >= rows) continue;
            const V4 lo = lds128(sw + FAT_ROW_W0(st) + unit_off(u));
            const V4 hi = lds128(sw + FAT_ROW_W1(st) + unit_off(u));
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int f = 0; f < MF; ++f)
                mma_bf16(acc[a][f], lo.v[2 * h], hi.v[2 * h], lo.v[2 * h + 1], hi.v[2 * h + 1], xf[f].v[2 * h],
                         xf[f].v[2 * h + 1]);
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_empty + 8 * s);
      }

      // acc[a][f] = D of weight rows st*16 + g8 (+8), x rows f*8 + 2*t4 (+1).
      const int n_base = tile * ROWS;
      // Where tile element e = mm * ROWS + r goes: out (SPLIT == 1), or the
      // inbox of the rank that finishes it, slot [this rank][e % PER].
      auto emit = [&](int e, float v) {
        const int mm = elem_mm(e), r = elem_r(e);
        if (mm >= mv || (!FULL_ROWS && r >= rows)) return;
        if (SPLIT == 1) {
          out[(long long)mm * N + n_base + r] = to_bf16(v);
        } else {
          const int owner = owner_of(e);
          store_peer(smem_addr(inbox + inbox_base(rank) + inbox_index(e)), (u32)owner, v);
        }
      };
      if (SPLIT > 1) {  // every peer runs (one tile per CTA: once)
        __syncwarp();
        cluster_wait();
      }
      if (KW == 1) {
#pragma unroll
        for (int a = 0; a < WT; ++a) {
          const int r = acc_row(subtile(tg, a), g8);
#pragma unroll
          for (int f = 0; f < MF; ++f) {
            const int mm = acc_mm(f, t4);
            emit(elem(mm, r), acc[a][f][0]);
            emit(elem(mm + 1, r), acc[a][f][1]);
            emit(elem(mm, r) + 8, acc[a][f][2]);
            emit(elem(mm + 1, r) + 8, acc[a][f][3]);
          }
        }
      } else {
        float* buf = red + (i & 1) * KW * TILE;  // [kg][mm * ROWS + row]
#pragma unroll
        for (int a = 0; a < WT; ++a) {
          const int r = acc_row(subtile(tg, a), g8);
#pragma unroll
          for (int f = 0; f < MF; ++f) {
            const int mm = acc_mm(f, t4);
            float* p = buf + kg * TILE;
            p[elem(mm, r)] = acc[a][f][0];
            p[elem(mm + 1, r)] = acc[a][f][1];
            p[elem(mm, r) + 8] = acc[a][f][2];
            p[elem(mm + 1, r) + 8] = acc[a][f][3];
          }
        }
        consumer_sync();
        // Sum the k-groups in a fixed order.  The buffer alternates between
        // tiles, so the next tile's writes cannot meet this tile's reads.
        for (int e = threadIdx.x; e < TILE; e += CW * 32) {
          float v = buf[e];
#pragma unroll
          for (int q = 1; q < KW; ++q) v += buf[q * TILE + e];
          emit(e, v);
        }
      }
    }
  }

  if (SPLIT > 1) {
    // One tile per cluster.  Every rank has pushed its partials into the
    // owners' inboxes; after the barrier each rank adds its PER elements over
    // the ranks in a fixed order, locally.  No shared memory of a peer is
    // touched after the barrier, so a CTA may exit as soon as it is done.
    __syncwarp();
    cluster_sync();
    const int tile = wk.tile0;
    const int rows = tile_rows(tile);
    for (int j = threadIdx.x; j < PER && FAT_INBOX_BASE(rank) + j < TILE; j += THREADS) {
      float v = inbox[j];
#pragma unroll
      for (int p = 1; p < SPLIT; ++p) v += inbox[FAT_INBOX_BASE(p) + j];
      const int e = FAT_INBOX_BASE(rank) + j;
      const int mm = elem_mm(e), r = elem_r(e);
      if (mm < mv && (FULL_ROWS || r < rows)) out[(long long)mm * N + tile * ROWS + r] = to_bf16(v);
    }
  }
}
