// scaledmm: FP8 block-scaled GEMM (DeepSeek-V3 recipe) on sm90 through CUTLASS 3.x.
//
//   out[m, n] = sum_j a_scales[m, j] * b_scales[n / 128, j] * sum_{k in block j} a[m, k] * b[n, k]
//
// a: e4m3 [M, K] (row stride lda), b: e4m3 [N, K] contiguous, a_scales: fp32 [M, K/128]
// (strides sam, sak), b_scales: fp32 [ceil(N/128), K/128] (row stride sbn, unit inner stride),
// out: [M, N] (row stride ldd).
//
// One shared library = one kernel configuration.  The configuration is chosen at
// compile time with -D defines (the Python side, ops/fp8_block_cutlass.py, owns
// the config table and passes them):
//
//   SMM_TILE_M, SMM_TILE_N   CTA tile in the *CUTLASS* problem (after a swap)
//   SMM_CLUSTER_M/N          thread-block cluster shape
//   SMM_PINGPONG             0: cooperative (2 consumer warp groups on one tile)
//                            1: ping-pong (consumer warp groups alternate tiles)
//   SMM_SWAP_AB              0: CUTLASS computes out = a @ b^T           (problem M x N)
//                            1: CUTLASS computes out^T = b @ a^T          (problem N x M):
//                               the weight fills the 128-row tile, the few
//                               activation rows become the narrow tile N
//   SMM_SFA_STRIDED          0: activation scales must be M-major (column-major
//                               [M, K/128], strides (1, >= M)); CUTLASS loads them
//                               with TMA when a tile holds >= 32 of them
//                            1: any strides (row- or column-major); loaded with
//                               cp.async by the producer's auxiliary warp
//   SMM_STREAMK              0: persistent data-parallel tile scheduler
//                            1: stream-K tile scheduler (needs a workspace)
//   SMM_STAGES               0: as many smem stages as fit, else that many
//   SMM_OUT                  0: bf16, 1: fp16, 2: fp32 output
//
// C ABI (loaded with ctypes; no torch headers): see smm_fp8_block_args below.
// Every entry point returns 0 on success, else a nonzero code and a message in
// the caller's buffer.  Nothing here allocates device memory or synchronizes:
// the workspace comes from the caller (torch's allocator) and the kernel is
// launched on the caller's stream, so the call is CUDA-graph capturable.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

// ---------------------------------------------------------------------------
// Configuration (defaults: the 128x128 cooperative kernel)
// ---------------------------------------------------------------------------

#ifndef SMM_TILE_M
#define SMM_TILE_M 128
#endif
#ifndef SMM_TILE_N
#define SMM_TILE_N 128
#endif
#ifndef SMM_CLUSTER_M
#define SMM_CLUSTER_M 1
#endif
#ifndef SMM_CLUSTER_N
#define SMM_CLUSTER_N 1
#endif
#ifndef SMM_PINGPONG
#define SMM_PINGPONG 0
#endif
#ifndef SMM_SWAP_AB
#define SMM_SWAP_AB 0
#endif
#ifndef SMM_SFA_STRIDED
#define SMM_SFA_STRIDED 0
#endif
#ifndef SMM_STREAMK
#define SMM_STREAMK 0
#endif
#ifndef SMM_STAGES
#define SMM_STAGES 0
#endif
#ifndef SMM_OUT
#define SMM_OUT 0
#endif

#define SMM_ABI_VERSION 2

namespace smm {

using namespace cute;

constexpr int kBlock = 128;  // scale block along K, and along N for the weight

#if SMM_OUT == 0
using ElementOut = cutlass::bfloat16_t;
#elif SMM_OUT == 1
using ElementOut = cutlass::half_t;
#elif SMM_OUT == 2
using ElementOut = float;
#else
#error "SMM_OUT must be 0 (bf16), 1 (fp16) or 2 (fp32)"
#endif

using ElementFp8 = cutlass::float_e4m3_t;
using ElementAcc = float;
constexpr int kAlignFp8 = 16;                                    // 16 bytes for TMA
constexpr int kAlignOut = 16 / static_cast<int>(sizeof(ElementOut));

using TileShape = Shape<Int<SMM_TILE_M>, Int<SMM_TILE_N>, Int<kBlock>>;
using ClusterShape = Shape<Int<SMM_CLUSTER_M>, Int<SMM_CLUSTER_N>, _1>;

#if SMM_PINGPONG
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

#if SMM_STREAMK
using TileScheduler = cutlass::gemm::StreamKScheduler;
#else
using TileScheduler = cutlass::gemm::PersistentScheduler;
#endif

// Scale layouts, shape ((granularity, count) along M or N, (128, K blocks), L).
// Weight scales: one per 128 x 128 block, K-major (row-major [N/128, K/128]).
using WeightScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
    kBlock, kBlock, kBlock, cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutWeightScale = decltype(WeightScaleConfig::deduce_layoutSFA());

// Activation scales: one per row and 128-column group.
#if SMM_SFA_STRIDED
// Both strides at run time: CUTLASS sees a non-M-major layout and loads the
// scales with cp.async, so row- and column-major scales work without a copy.
using LayoutActScale = Layout<Shape<Shape<_1, int32_t>, Shape<Int<kBlock>, int32_t>, int32_t>,
                              Stride<Stride<_0, int32_t>, Stride<_0, int32_t>, int32_t>>;
#else
// M-major with a static unit stride along M: CUTLASS loads a tile's scales with
// one TMA (when the tile holds >= 32 of them), which needs M % 4 == 0.
using ActScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
    1, 1, kBlock, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
using LayoutActScale = decltype(ActScaleConfig::deduce_layoutSFA());
#endif

#if SMM_SWAP_AB
// CUTLASS problem (N, M, K): operand A = weight, operand B = activation, D = out^T.
using LayoutSFA = LayoutWeightScale;
using LayoutSFB = LayoutActScale;
using LayoutDTag = cutlass::layout::ColumnMajor;
#else
using LayoutSFA = LayoutActScale;
using LayoutSFB = LayoutWeightScale;
using LayoutDTag = cutlass::layout::RowMajor;
#endif
using LayoutATag = cutlass::layout::RowMajor;     // [rows, K], K contiguous
using LayoutBTag = cutlass::layout::ColumnMajor;  // [cols, K], K contiguous

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
    void, LayoutDTag, kAlignOut,  // no source tensor C
    ElementOut, LayoutDTag, kAlignOut, EpilogueSchedule>::CollectiveOp;

#if SMM_STAGES > 0
using StageCount = cutlass::gemm::collective::StageCount<SMM_STAGES>;
#else
using StageCount = cutlass::gemm::collective::StageCountAutoCarveout<
    static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>;
#endif

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementFp8, cute::tuple<LayoutATag, LayoutSFA>, kAlignFp8,
    ElementFp8, cute::tuple<LayoutBTag, LayoutSFB>, kAlignFp8,
    ElementAcc, TileShape, ClusterShape, StageCount, MainloopSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, TileScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideA = typename Gemm::GemmKernel::StrideA;
using StrideB = typename Gemm::GemmKernel::StrideB;
using StrideD = typename Gemm::GemmKernel::StrideD;

}  // namespace smm

// ---------------------------------------------------------------------------
// C ABI
// ---------------------------------------------------------------------------

extern "C" {

// Mirrors ops/fp8_block_cutlass.py:Args (ctypes.Structure); keep in sync and
// bump SMM_ABI_VERSION on any change.
struct smm_fp8_block_args {
  int32_t abi_version;
  int32_t device;
  int32_t sm_count;
  int32_t m, n, k;          // logical GEMM: out[M, N] = a[M, K] @ b[N, K]^T
  const void* a;            // e4m3 [M, K], row stride lda (elements)
  const void* b;            // e4m3 [N, K], contiguous
  const float* a_scales;    // fp32 [M, K/128], strides (sam, sak) (elements)
  const float* b_scales;    // fp32 [ceil(N/128), K/128], strides (sbn, 1) (elements)
  void* out;                // [M, N], row stride ldd (elements)
  int64_t lda, ldd, sam, sak, sbn;
  void* workspace;          // >= smm_workspace_size() bytes, or null when that is 0
  int64_t workspace_bytes;
  void* stream;             // cudaStream_t
  int32_t swizzle;          // tile-scheduler swizzle (1, 2, 4, 8)
  int32_t raster;           // 0 heuristic, 1 along M, 2 along N (CUTLASS problem axes)
  int32_t splits;           // stream-K only: > 1 forces split-K with that many splits
  int32_t decomposition;    // stream-K only: 0 heuristic, 1 data-parallel, 2 split-K, 3 stream-K
};

int smm_abi_version() { return SMM_ABI_VERSION; }

// sizeof(smm_fp8_block_args) then the offset of each field, in declaration
// order (the Python mirror checks its ctypes layout against this).  Returns
// how many values it wrote.
int smm_args_layout(int64_t* out, int n) {
  const int64_t v[] = {
      sizeof(smm_fp8_block_args),
      offsetof(smm_fp8_block_args, abi_version), offsetof(smm_fp8_block_args, device),
      offsetof(smm_fp8_block_args, sm_count), offsetof(smm_fp8_block_args, m),
      offsetof(smm_fp8_block_args, n), offsetof(smm_fp8_block_args, k),
      offsetof(smm_fp8_block_args, a), offsetof(smm_fp8_block_args, b),
      offsetof(smm_fp8_block_args, a_scales), offsetof(smm_fp8_block_args, b_scales),
      offsetof(smm_fp8_block_args, out), offsetof(smm_fp8_block_args, lda),
      offsetof(smm_fp8_block_args, ldd), offsetof(smm_fp8_block_args, sam),
      offsetof(smm_fp8_block_args, sak), offsetof(smm_fp8_block_args, sbn),
      offsetof(smm_fp8_block_args, workspace), offsetof(smm_fp8_block_args, workspace_bytes),
      offsetof(smm_fp8_block_args, stream), offsetof(smm_fp8_block_args, swizzle),
      offsetof(smm_fp8_block_args, raster), offsetof(smm_fp8_block_args, splits),
      offsetof(smm_fp8_block_args, decomposition)};
  const int count = static_cast<int>(sizeof(v) / sizeof(v[0]));
  for (int i = 0; i < count && i < n; ++i) out[i] = v[i];
  return count;
}

// "key=value ..." description of the compiled configuration.
int smm_describe(char* buf, int len) {
  std::snprintf(buf, len,
                "tile=%dx%dx%d cluster=%dx%d schedule=%s swap_ab=%d sfa=%s scheduler=%s "
                "stages=%d out=%s smem=%d threads=%d abi=%d",
                SMM_TILE_M, SMM_TILE_N, smm::kBlock, SMM_CLUSTER_M, SMM_CLUSTER_N,
                SMM_PINGPONG ? "pingpong" : "cooperative", SMM_SWAP_AB,
                SMM_SFA_STRIDED ? "strided" : "mmajor", SMM_STREAMK ? "streamk" : "persistent",
                static_cast<int>(smm::CollectiveMainloop::DispatchPolicy::Stages),
                SMM_OUT == 0 ? "bf16" : (SMM_OUT == 1 ? "fp16" : "fp32"),
                static_cast<int>(smm::GemmKernel::SharedStorageSize),
                static_cast<int>(smm::GemmKernel::MaxThreadsPerBlock), SMM_ABI_VERSION);
  return 0;
}

}  // extern "C"

namespace smm {

static int fail(char* err, int len, int code, const char* fmt, const char* detail) {
  if (err && len > 0) std::snprintf(err, len, fmt, detail);
  return code;
}

static typename Gemm::Arguments make_arguments(smm_fp8_block_args const& p) {
  const int M = p.m, N = p.n, K = p.k;
  const int kb = (K + kBlock - 1) / kBlock;
  const int nb = (N + kBlock - 1) / kBlock;

  // Weight scales [nb, kb] row-major (K-major), row stride sbn >= kb.
  LayoutWeightScale layout_w = make_layout(
      make_shape(make_shape(Int<kBlock>{}, nb), make_shape(Int<kBlock>{}, kb), 1),
      make_stride(make_stride(_0{}, static_cast<int32_t>(p.sbn)), make_stride(_0{}, _1{}),
                  static_cast<int32_t>(p.sbn) * nb));
  // Batch strides are never stepped (L = 1) but TMA wants a nonzero, aligned one.
  const int32_t batch_x = static_cast<int32_t>(p.sam > p.sak ? p.sam * M : p.sak * kb);
#if SMM_SFA_STRIDED
  LayoutActScale layout_x = make_layout(
      make_shape(make_shape(_1{}, M), make_shape(Int<kBlock>{}, kb), 1),
      make_stride(make_stride(_0{}, static_cast<int32_t>(p.sam)),
                  make_stride(_0{}, static_cast<int32_t>(p.sak)), batch_x));
#else
  LayoutActScale layout_x = make_layout(
      make_shape(make_shape(_1{}, M), make_shape(Int<kBlock>{}, kb), 1),
      make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, static_cast<int32_t>(p.sak)), batch_x));
#endif

  auto const* a = static_cast<ElementFp8 const*>(p.a);
  auto const* b = static_cast<ElementFp8 const*>(p.b);
  auto* out = static_cast<ElementOut*>(p.out);

#if SMM_SWAP_AB
  // CUTLASS: D'[N, M] = b[N, K] . a[M, K]^T, D' column-major == out row-major.
  auto problem = make_shape(N, M, K, 1);
  StrideA stride_a = make_stride(static_cast<int64_t>(K), _1{}, static_cast<int64_t>(N) * K);
  StrideB stride_b = make_stride(p.lda, _1{}, p.lda * M);
  StrideD stride_d = make_stride(_1{}, p.ldd, p.ldd * M);
  typename CollectiveMainloop::Arguments mainloop{b, stride_a, a, stride_b,
                                                  p.b_scales, layout_w, p.a_scales, layout_x};
#else
  auto problem = make_shape(M, N, K, 1);
  StrideA stride_a = make_stride(p.lda, _1{}, p.lda * M);
  StrideB stride_b = make_stride(static_cast<int64_t>(K), _1{}, static_cast<int64_t>(N) * K);
  StrideD stride_d = make_stride(p.ldd, _1{}, p.ldd * M);
  typename CollectiveMainloop::Arguments mainloop{a, stride_a, b, stride_b,
                                                  p.a_scales, layout_x, p.b_scales, layout_w};
#endif

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = problem;
  args.mainloop = mainloop;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = stride_d;
  args.epilogue.ptr_D = out;
  args.epilogue.dD = stride_d;
  args.hw_info.device_id = p.device;
  args.hw_info.sm_count = p.sm_count;

  using RO = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.max_swizzle_size = p.swizzle > 0 ? p.swizzle : 1;
  args.scheduler.raster_order = p.raster == 1 ? RO::AlongM : (p.raster == 2 ? RO::AlongN : RO::Heuristic);
#if SMM_STREAMK
  using DM = cutlass::gemm::kernel::detail::DecompositionMode;
  args.scheduler.splits = p.splits > 0 ? p.splits : 1;
  args.scheduler.decomposition_mode =
      p.decomposition == 1 ? DM::DataParallel
      : p.decomposition == 2 ? DM::SplitK
      : p.decomposition == 3 ? DM::StreamK : DM::Heuristic;
#endif
  return args;
}

static int check_args(smm_fp8_block_args const* p, char* err, int len) {
  if (p == nullptr) return fail(err, len, 1, "%s", "args: null pointer");
  if (p->abi_version != SMM_ABI_VERSION)
    return fail(err, len, 1, "%s", "args: ABI version mismatch (stale library in the cache?)");
  if (p->m <= 0 || p->n <= 0 || p->k <= 0)
    return fail(err, len, 1, "%s", "args: expected M, N, K > 0 (the caller handles empty problems)");
  return 0;
}

}  // namespace smm

extern "C" {

// Bytes of workspace the kernel needs for this problem (0 for most configs).
// Returns -1 on bad arguments (message in err).
int64_t smm_workspace_size(const smm_fp8_block_args* p, char* err, int len) {
  if (smm::check_args(p, err, len) != 0) return -1;
  auto args = smm::make_arguments(*p);
  return static_cast<int64_t>(smm::Gemm::get_workspace_size(args));
}

// Load the kernel on `device` and raise its shared-memory limit, so that the
// first smm_run (possibly inside CUDA-graph capture) does no module loading.
int smm_prepare(int device, char* err, int len) {
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess || cur != device) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return smm::fail(err, len, 5, "cudaSetDevice: %s", cudaGetErrorString(e));
  }
  auto kernel = cutlass::device_kernel<smm::GemmKernel>;
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smm::GemmKernel::SharedStorageSize));
  if (e != cudaSuccess) return smm::fail(err, len, 5, "loading the kernel: %s", cudaGetErrorString(e));
  return 0;
}

// Launch the GEMM on p->stream.  Returns 0, or: 1 bad arguments, 2 CUTLASS
// cannot implement the problem, 3 workspace too small, 4 initialization
// failed, 5 launch failed (CUDA error text in err).
int smm_run(const smm_fp8_block_args* p, char* err, int len) {
  if (int rc = smm::check_args(p, err, len)) return rc;
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess || cur != p->device) {
    cudaError_t e = cudaSetDevice(p->device);
    if (e != cudaSuccess) return smm::fail(err, len, 5, "cudaSetDevice: %s", cudaGetErrorString(e));
  }
  auto args = smm::make_arguments(*p);
  smm::Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    return smm::fail(err, len, 2, "CUTLASS cannot implement this problem: %s",
                     cutlassGetStatusString(st));
  size_t need = smm::Gemm::get_workspace_size(args);
  if (need > 0 && (p->workspace == nullptr || static_cast<int64_t>(need) > p->workspace_bytes))
    return smm::fail(err, len, 3, "%s", "workspace: too small for this problem");
  auto stream = static_cast<cudaStream_t>(p->stream);
  st = gemm.initialize(args, p->workspace, stream);
  if (st != cutlass::Status::kSuccess)
    return smm::fail(err, len, 4, "CUTLASS initialize failed: %s", cutlassGetStatusString(st));
  st = gemm.run(stream);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return smm::fail(err, len, 5, "kernel launch: %s", cudaGetErrorString(e));
  if (st != cutlass::Status::kSuccess)
    return smm::fail(err, len, 5, "CUTLASS run failed: %s", cutlassGetStatusString(st));
  return 0;
}

}  // extern "C"
