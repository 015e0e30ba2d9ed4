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

// x / s rounded to nearest even, as div_rn, from r = rcp_rn(s) (one per
// scale): q0 = x r, then two remainder corrections (Markstein: once q is
// within an ulp the remainder x - q s is exact in one FMA and q + rem r
// rounds to the correctly rounded quotient; the first step brings q0 there).
// About six instructions instead of div.rn's sequence; zeros, tiny, huge and
// non-finite operands take div_rn (or, for zeros, x r: the signed zero, or
// NaN with a NaN scale).
__device__ __forceinline__ float div_by(float x, float s, float r) {
  const float q0 = mul_rn(x, r);
  if (fabsf(x) >= 1e-30f && fabsf(q0) >= 1e-30f && fabsf(q0) <= 1e30f) {
    const float q1 = __fmaf_rn(__fmaf_rn(-q0, s, x), r, q0);
    return __fmaf_rn(__fmaf_rn(-q1, s, x), r, q1);
  }
  return x == 0.f ? q0 : div_rn(x, s);
}

// Two e4m3 codes, lo in the low byte; saturating (+-Inf -> +-448), NaN -> NaN.
__device__ __forceinline__ unsigned int e4m3x2(float lo, float hi) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

}  // namespace fq_ptx
