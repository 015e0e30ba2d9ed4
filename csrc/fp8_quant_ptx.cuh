// The arithmetic of our FP8 activation quantizers, bit for bit (the Triton
// quantizers and ops/fp8*.py's references): NaN-propagating max, IEEE
// division and reciprocal, and the saturating round-to-nearest-even e4m3
// conversion.  Shared by the kernels that quantize inside a GEMM
// (fp8_gemv.cu, fp8_wgmma.cu with G_QUANT).  Compiled at run time by NVRTC.
#pragma once

namespace fq_ptx {

__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ float div_rn(float a, float b) {
  float d;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ float rcp_rn(float a) {
  float d;
  asm("rcp.rn.f32 %0, %1;" : "=f"(d) : "f"(a));
  return d;
}

__device__ __forceinline__ float mul_rn(float a, float b) {
  float d;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Two e4m3 codes, lo in the low byte; saturating (+-Inf -> +-448), NaN -> NaN.
__device__ __forceinline__ unsigned int e4m3x2(float lo, float hi) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

}  // namespace fq_ptx
