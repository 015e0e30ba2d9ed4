// The NVFP4 activation quantizer of nvfp4_quant (SPEC.md), one 16-element
// block at a time, for the kernels that quantize inside a GEMM
// (nvfp4_gemv.cu with G_QUANT).  Every step is one fp32 operation in the
// order of ops/nvfp4_triton_quant.py, so codes and scales equal that
// quantizer's (and reference_quant's) bit for bit:
//
//     s    = e4m3(gs * (amax * RN(1/6)))            nearest even, saturating
//     r    = s == 0 ? 0 : 1 / (s * (1 / gs))         IEEE reciprocals
//     code = e2m1 nearest even of x * r, x's sign   (0 where s == 0)
//
// __host__ __device__: the host build (tests/csrc_host) checks it against
// reference_quant on the CPU.  The device side is fp8_quant_ptx.cuh's PTX.
#pragma once

#include "fp8_quant_ptx.cuh"
#include "nvfp4_decode.cuh"

namespace nvfp4_q {

using nvfp4_dec::u32;

__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return fq_ptx::mul_rn(a, b);
#else
  volatile float d = a * b;  // one IEEE product, never contracted
  return d;
#endif
}

__host__ __device__ __forceinline__ float rcp_rn(float a) {
#ifdef __CUDA_ARCH__
  return fq_ptx::rcp_rn(a);
#else
  volatile float d = 1.0f / a;
  return d;
#endif
}

__host__ __device__ __forceinline__ u32 f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  return nvfp4_dec::host::f32_bits(f);
#endif
}

__host__ __device__ __forceinline__ float bits_f32(u32 b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  return nvfp4_dec::host::bits_f32(b);
#endif
}

// The e4m3 byte of v >= 0 (or NaN): nearest even, saturating to 448, NaN -> 0x7F.
__host__ __device__ __forceinline__ u32 e4m3_byte(float v) {
#ifdef __CUDA_ARCH__
  return fq_ptx::e4m3x2(v, 0.f) & 0xFFu;
#else
  if (v != v) return 0x7Fu;
  if (v >= 448.f) return 0x7Eu;
  if (v < 0.015625f) {  // subnormal: multiples of 2^-9 (2^-6 itself is code 8)
    volatile float q = v * 512.f + 12582912.f;  // 1.5 * 2^23: rounds to an integer, ties to even
    return (u32)(q - 12582912.f);
  }
  const u32 b = f32_bits(v);
  const u32 r = (b + 0x7FFFFu + ((b >> 20) & 1u)) & ~0xFFFFFu;  // keep 3 mantissa bits, ties to even
  const u32 code = ((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
  return code > 0x7Eu ? 0x7Eu : code;
#endif
}

// fp32 value of an e4m3 byte (exact).
__host__ __device__ __forceinline__ float e4m3_value(u32 byte) {
  return nvfp4_dec::f16_to_f32((unsigned short)nvfp4_dec::e4m3x2_to_f16x2(byte));
}

// The e2m1 code of x * r: magnitude by a binary search over the midpoints of
// the grid {0, .5, 1, 1.5, 2, 3, 4, 6} (a tie stays on the even code below),
// the sign bit (sign_bit 8 or 0) from x.
__host__ __device__ __forceinline__ u32 e2m1_code(float x, float r, u32 sign_bit) {
  const float y = fabsf(mul_rn(x, r));
  const bool ge4 = y >= 1.75f;
  const bool ge2 = y >= (ge4 ? 3.5f : 0.75f);
  const bool ge1 = y > (ge2 ? (ge4 ? 5.f : 1.25f) : (ge4 ? 2.5f : 0.25f));
  return (ge4 ? 4u : 0u) | (ge2 ? 2u : 0u) | (ge1 ? 1u : 0u) | ((f32_bits(x) >> 28) & sign_bit);
}

// One block: x[16] (the activation's values, exact in fp32), gs and
// rgs = rcp_rn(gs) -> codes[2] (value 2j in the low nibble of byte j) and the
// returned e4m3 scale byte.
__host__ __device__ __forceinline__ u32 quant_block16(const float (&x)[16], float gs, float rgs, u32 (&codes)[2]) {
  u32 amax_bits = 0;  // |x| as integers: same order as the floats, a NaN wins
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const u32 a = f32_bits(x[i]) & 0x7FFFFFFFu;
    amax_bits = a > amax_bits ? a : amax_bits;
  }
  const u32 sbyte = e4m3_byte(mul_rn(gs, mul_rn(bits_f32(amax_bits), 0.16666667163372039794921875f)));
  const float s = e4m3_value(sbyte);
  const bool zero = s == 0.f;
  const float r = zero ? 0.f : rcp_rn(mul_rn(s, rgs));
  const u32 sign_bit = zero ? 0u : 8u;
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    u32 word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) word |= e2m1_code(x[8 * w + j], r, sign_bit) << (4 * j);
    codes[w] = word;
  }
  return sbyte;
}

// The 16 fp32 values of a block from its 32 bytes of fp16 (F16) / bf16 pairs.
template <bool F16>
__host__ __device__ __forceinline__ void unpack_block16(const u32 (&w)[8], float (&x)[16]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (F16) {
      x[2 * i] = nvfp4_dec::f16_to_f32((unsigned short)(w[i] & 0xFFFFu));
      x[2 * i + 1] = nvfp4_dec::f16_to_f32((unsigned short)(w[i] >> 16));
    } else {
      x[2 * i] = bits_f32(w[i] << 16);
      x[2 * i + 1] = bits_f32(w[i] & 0xFFFF0000u);
    }
  }
}

}  // namespace nvfp4_q
