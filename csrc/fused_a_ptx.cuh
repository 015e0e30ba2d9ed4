// PTX helpers shared by the DSV3 fused-A kernels (dsv3_fused_a_gemm.cu, the
// register kernel, and dsv3_fused_a_gemm_tma.cu, the TMA-ring kernel), the
// NVFP4 kernels (nvfp4_gemv.cu, nvfp4_mid.cu, nvfp4_wgmma.cu) and the FP8 one (fp8_gemv.cu),
// and the split-K epilogue of the register-streaming ones.
// Compiled at run time by NVRTC; no CUDA headers needed.
#pragma once

namespace fa_ptx {

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct alignas(16) V4 {
  u32 v[4];
};

// D (16 x 8, fp32) += A (16 x 16, bf16, row) * B (16 x 8, bf16, col)
__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same with fp16 operands.
__device__ __forceinline__ void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes of a weight streamed once: not kept in L1, 256-byte L2 prefetch.
__device__ __forceinline__ V4 load_weight(const unsigned char* p) {
  V4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
               : "l"(p));
  return r;
}

__host__ __device__ __forceinline__ V4 zero4() {
  V4 r;
  r.v[0] = r.v[1] = r.v[2] = r.v[3] = 0u;
  return r;
}

__device__ __forceinline__ u16 to_bf16(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// The FP8 kernels' epilogue (fp8_gemv.cu, fp8_wgmma.cu): bias[n] as fp32
// (BIAS 0: none, 1: fp32, 2: bf16, 3: fp16), and one output element rounded
// once to OUT (0: bf16, 1: fp16, 2: fp32) at out[mm * LDO + n].
template <int BIAS>
__device__ __forceinline__ float bias_at(const void* bias, int n) {
  if (BIAS == 1) return ((const float*)bias)[n];
  if (BIAS == 2) return __uint_as_float((u32)((const unsigned short*)bias)[n] << 16);
  if (BIAS == 3) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(((const unsigned short*)bias)[n]));
    return f;
  }
  return 0.f;
}

template <int OUT, int LDO>
__device__ __forceinline__ void store_out(void* out, float v, int mm, int n) {
  const long long o = (long long)mm * LDO + n;
  if (OUT == 2) {
    ((float*)out)[o] = v;
  } else if (OUT == 1) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    ((unsigned short*)out)[o] = h;
  } else {
    ((unsigned short*)out)[o] = to_bf16(v);
  }
}

// Shared-memory address (32-bit) of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(a) : "l"(p));
  return a;
}

// cp.async of 16 bytes (L2 only; _weight: with a 256-byte L2 prefetch; _act:
// through L1) or 4 bytes into shared memory, zero-filled when !ok (then no
// byte of src is read).  A thread that reads back only its own copies needs
// no barrier: cp.async.wait_group makes them visible to it.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async16_weight(u32 dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async16_act(u32 dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// mbarriers (the TMA / bulk-copy kernels: dsv3_fused_a_gemm_tma.cu, nvfp4_wgmma.cu).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Spin until the phase with parity ``parity`` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Programmatic dependent launch: wait for the previous grid's memory, and let
// the next grid start launching.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Publishes every thread's shared-memory writes cluster-wide.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A float of the shared memory of cluster rank ``rank`` at the address of ``p``
// in this CTA (the split-K partial sums, added in rank order).
__device__ __forceinline__ float load_peer_smem(const float* p, u32 rank) {
  const u32 local = smem_addr(p);
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// One warp's accumulators acc[t][f] (the m16n8k16 D of tile rows
// 16 (tile0 + t) + g (+ 8), activation rows 8 f + 2 t4 (+ 1)) into a partial
// tile laid out red[activation row * stride + tile row].
template <int NT, int MF>
__device__ __forceinline__ void store_partials(float* red, int stride, int tile0, const float (&acc)[NT][MF][4],
                                               int g, int t4) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int f = 0; f < MF; ++f) {
      const int r = (tile0 + t) * 16 + g;
      const int mm = f * 8 + 2 * t4;
      red[mm * stride + r] = acc[t][f][0];
      red[(mm + 1) * stride + r] = acc[t][f][1];
      red[mm * stride + r + 8] = acc[t][f][2];
      red[(mm + 1) * stride + r + 8] = acc[t][f][3];
    }
  }
}

// The split-K epilogue of the kernels whose warps split K: the warps' partial
// tiles red[w][0, TILE) (element e: activation row e / ROWS, tile row
// e % ROWS) are summed in warp order; with SPLIT > 1 the CTAs of the cluster
// then add those sums through DSMEM in rank order, each rank finishing
// 1 / SPLIT of the tile.  store(mm, r, s) writes one finished sum.  A fixed
// order everywhere: bit-reproducible.  Call after a __syncthreads.
template <int WARPS, int TILE, int ROWS, int SPLIT, int THREADS, class Store>
__device__ __forceinline__ void reduce_partials(float (*red)[TILE], Store store) {
  // (each element is read and rewritten by the same thread)
  for (int e = threadIdx.x; e < TILE; e += THREADS) {
    float s = red[0][e];
#pragma unroll
    for (int v = 1; v < WARPS; ++v) s += red[v][e];
    if (SPLIT == 1) {
      store(e / ROWS, e % ROWS, s);
    } else {
      red[0][e] = s;
    }
  }
  if (SPLIT > 1) {
    cluster_sync();
    const int rank = (int)cluster_rank();
    constexpr int PER = (TILE + SPLIT - 1) / SPLIT;
    for (int e = rank * PER + threadIdx.x; e < (rank + 1) * PER && e < TILE; e += THREADS) {
      float s = 0.f;
#pragma unroll
      for (int p = 0; p < SPLIT; ++p) s += load_peer_smem(&red[0][e], (u32)p);
      store(e / ROWS, e % ROWS, s);
    }
    cluster_sync();  // keep every CTA's shared memory alive until its peers have read it
  }
}

}  // namespace fa_ptx
