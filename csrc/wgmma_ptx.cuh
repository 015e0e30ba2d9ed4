// PTX helpers shared by the TMA + wgmma kernels (nvfp4_wgmma.cu: FP4 decoded
// into the register operand; fp8_wgmma.cu: both e4m3 operands from shared
// memory): the tensor-map copy, the wgmma fences and waits, the 128-byte
// swizzle descriptor, and the split-K reduction through distributed shared
// memory.  Compiled at run time by NVRTC; no CUDA headers needed.
#pragma once

#include "fused_a_ptx.cuh"

namespace wg_ptx {

using namespace fa_ptx;

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

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma wait.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte
// swizzle: 8-row groups 1024 bytes apart (stride), leading offset unused.
// +2 per 32 bytes along K (addresses stay below 2^18, so the 14-bit field
// never carries).
__device__ __forceinline__ u64 smem_desc(u32 addr) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// The K stages of this CTA's cluster rank (blockIdx.z) when NKB stages are
// split over SPLIT ranks in contiguous runs: the first, and how many (the
// last rank may get fewer; none is left without: the configs' predicate).
template <int NKB, int SPLIT>
__device__ __forceinline__ int stage_range(int& kb0) {
  const int per = (NKB + SPLIT - 1) / SPLIT;
  kb0 = blockIdx.z * per;
  int nk = NKB - kb0 < per ? NKB - kb0 : per;
  return nk < 0 ? 0 : nk;
}

// A persistent grid's tile t -> its origin (m0, n0) in an m x N output of
// BT x BN tiles (tiles_m = ceil(m / BT)).  Bands of GROUP_M activation
// tiles; in a band the activation tiles of one weight tile are consecutive,
// so the CTAs running at once read a few panels of each operand through L2.
constexpr int GROUP_M = 8;

template <int BT, int BN, int N>
__device__ __forceinline__ void tile_origin(int t, int tiles_m, int& m0, int& n0) {
  constexpr int TILES_N = (N + BN - 1) / BN;
  const int band = t / (GROUP_M * TILES_N);
  const int first = band * GROUP_M;
  const int rows = tiles_m - first < GROUP_M ? tiles_m - first : GROUP_M;
  const int r = t - band * GROUP_M * TILES_N;
  m0 = (first + r % rows) * BT;
  n0 = (r / rows) * BN;
}

// The ring's barriers at ``bars``: full[s] (``full_arrivals``: the
// producer's expect_tx, and any copies that arrive on it), then empty[s] (one
// arrival per consumer warp); then the programmatic-dependent-launch wait (no
// global access before it) and trigger, and a CTA barrier.  Every thread
// calls it.
template <int STAGES>
__device__ __forceinline__ void ring_init(u32 bars, u32 consumer_warps, u32 full_arrivals = 1) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8 * s, full_arrivals);
      mbar_init(bars + 8 * (STAGES + s), consumer_warps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  grid_dependency_wait();
  launch_dependents();
  __syncthreads();
}

// Split K over a cluster of SPLIT CTAs: ranks 1.. store their fp32 tile to
// their own shared memory at ``smem`` as [i / 4][thread][4] (one 16-byte store
// / remote load per four accumulators), rank 0 adds them in rank order (a
// fixed order: bit-reproducible).  Every thread of the CTA calls it (it holds
// the CTA and cluster barriers; the pipeline's shared memory is reused);
// ``consumer``: the thread holds accumulators.  Returns whether this CTA
// writes the output (rank 0).
template <int ACC, int THREADS, int SPLIT>
__device__ __forceinline__ bool cluster_reduce(float (&acc)[ACC], u32 smem, int tid, bool consumer) {
  __syncthreads();  // every consumer is done with the pipeline's shared memory
  const u32 rank = cluster_rank();
  if (consumer && rank != 0) {
#pragma unroll
    for (int i = 0; i < ACC; i += 4)
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(smem + (u32)(((i / 4) * THREADS + tid) * 16)),
                   "f"(acc[i]), "f"(acc[i + 1]), "f"(acc[i + 2]), "f"(acc[i + 3])
                   : "memory");
  }
  cluster_sync();
  if (consumer && rank == 0) {
#pragma unroll 1
    for (u32 r = 1; r < SPLIT; ++r) {
      u32 remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem), "r"(r));
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
  return rank == 0;
}

// A producer warpgroup hands registers to two consumer warpgroups (setmaxnreg,
// warpgroup-wide, counts multiples of 8): a 384-thread CTA launches with 168
// each, then the producers drop to 40 and the consumers rise to 232
// (128 x 40 + 256 x 232 <= 65536).
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 65536, "setmaxnreg counts exceed the register file");

__device__ __forceinline__ void producer_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
}

__device__ __forceinline__ void consumer_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
}

}  // namespace wg_ptx
