// FP4 (e2m1) decode and PTX helpers shared by the NVFP4 CUDA kernels
// (nvfp4_gemv.cu: small M, register streaming; nvfp4_mid.cu: middle M, the
// activation shared through shared memory).  Compiled at run time by NVRTC;
// no CUDA headers needed.  See nvfp4_gemv.cu's header for the decode's
// exactness argument.
//
// The helpers that touch no memory are also __host__ functions, so that
// tests/test_csrc_host.py can compile this file for the CPU (nvcc's host pass)
// and check them against the NVFP4 format.  Where they use a PTX instruction
// or an intrinsic, the host pass (no __CUDA_ARCH__) takes a plain C++ twin
// computing the instruction's result; the bit constants are shared by both
// passes, and the device pass compiles the same instructions as before.
#pragma once

#include "fused_a_ptx.cuh"

namespace nvfp4_dec {

using namespace fa_ptx;

#ifndef __CUDA_ARCH__
// Host twins of the PTX instructions below (round to nearest even, subnormals
// kept; NaN results are the canonical 0x7FFF).
namespace host {

inline u32 f32_bits(float f) {
  u32 u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(u32 u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(u16 h) {
  const u32 sign = (u32)(h >> 15) << 31, e = (h >> 10) & 31u, m = h & 1023u;
  if (e == 31) return bits_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0) return bits_f32(sign | f32_bits((float)m * 5.9604644775390625e-8f));  // m * 2^-24
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

inline u16 f32_to_f16(float f) {
  const u32 u = f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7FFF;
  if (a >= 0x477FF000u) return (u16)(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                // below 2^-14: a multiple of 2^-24
    const float v = bits_f32(a) * 16777216.0f;          // exact
    u32 q = (u32)v;
    const float frac = v - (float)q;
    if (frac > 0.5f || (frac == 0.5f && (q & 1u))) ++q;
    return (u16)(sign | q);
  }
  return (u16)(sign | (((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10)));
}

inline u16 f32_to_bf16(float f) {
  const u32 u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float e4m3_to_f32(u32 b) {
  const u32 e = (b >> 3) & 15u, m = b & 7u;
  if ((b & 0x7Fu) == 0x7Fu) return bits_f32(0x7FFFFFFFu);
  const float mag = e == 0 ? (float)m * 0.001953125f : (float)(8 + m) * bits_f32((e + 117) << 23);
  return (b & 0x80u) ? -mag : mag;
}

// __byte_perm: byte n of the result is byte (s >> 4n) & 7 of {y : x}.
inline u32 byte_perm(u32 x, u32 y, u32 s) {
  const u64 v = ((u64)y << 32) | x;
  u32 r = 0;
  for (int n = 0; n < 4; ++n) r |= (u32)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
}

}  // namespace host
#endif

__host__ __device__ __forceinline__ u32 funnelshift_l(u32 lo, u32 hi, u32 s) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(lo, hi, s);
#else
  s &= 31u;
  return s == 0 ? hi : (hi << s) | (lo >> (32 - s));
#endif
}

__host__ __device__ __forceinline__ u32 funnelshift_r(u32 lo, u32 hi, u32 s) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, s);
#else
  s &= 31u;
  return s == 0 ? lo : (lo >> s) | (hi << (32 - s));
#endif
}

__host__ __device__ __forceinline__ u32 byte_perm(u32 x, u32 y, u32 s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, s);
#else
  return host::byte_perm(x, y, s);
#endif
}

__device__ __forceinline__ V4 load_act(const unsigned char* p) {
  V4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
               : "l"(p));
  return r;
}

// Two e4m3 scales (blocks 2t and 2t + 1 of a unit) as the low 16 bits.
__device__ __forceinline__ u32 load_scale2(const unsigned char* p) {
  u16 h;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(h) : "l"(p));
  return h;
}

// fp16x2 [s1 : s0] of two e4m3 bytes (exact; 0x7F / 0xFF give NaN).
__host__ __device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
#ifdef __CUDA_ARCH__
  u32 d;
  u16 h = (u16)two;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(h));
  return d;
#else
  return host::f32_to_f16(host::e4m3_to_f32(two & 0xFFu)) |
         ((u32)host::f32_to_f16(host::e4m3_to_f32((two >> 8) & 0xFFu)) << 16);
#endif
}

__host__ __device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  // the fp32 product of two fp16 is exact: one rounding, as in the instruction
  const u16 lo = host::f32_to_f16(host::f16_to_f32((u16)a) * host::f16_to_f32((u16)b));
  const u16 hi = host::f32_to_f16(host::f16_to_f32((u16)(a >> 16)) * host::f16_to_f32((u16)(b >> 16)));
  return lo | ((u32)hi << 16);
#endif
}

// bf16x2 [s 2^119 : s 2^119] of the fp16 scale s in the low half of h2: the
// scale operand of decode8_bf16 (exact: an e4m3 value has 4 significant bits
// and s 2^119 <= 448 2^119 stays below bf16's largest finite value).
__host__ __device__ __forceinline__ u32 scale_pair_bf16(u32 h2) {
#ifdef __CUDA_ARCH__
  float f;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.f32.f16 %0, l;\n\t}" : "=f"(f) : "r"(h2));
  f *= 6.6461399789245794e35f;  // 2^119
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(f));
  return d;
#else
  const u32 b = host::f32_to_bf16(host::f16_to_f32((u16)h2) * 6.6461399789245794e35f);
  return b | (b << 16);
#endif
}

__host__ __device__ __forceinline__ u16 to_f16(float f) {
#ifdef __CUDA_ARCH__
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return host::f32_to_f16(f);
#endif
}

__host__ __device__ __forceinline__ float bf16_to_f32(u16 h) {
#ifdef __CUDA_ARCH__
  return __uint_as_float((u32)h << 16);
#else
  return host::bits_f32((u32)h << 16);
#endif
}

__host__ __device__ __forceinline__ float f16_to_f32(u16 h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return host::f16_to_f32(h);
#endif
}

// 8 codes (nibble j = k offset j of the word) -> 4 fp16x2 registers times the
// scale pair s2 = [s : s]: r[j] = {lo: code j, hi: code j + 4} * s * 2^-14.
// The magnitude of code j must land at bits 9..11 (shift 9 - 4j) and its sign
// at bit 15 (shift 12 - 4j).  xe / xo park each sign 6 bits above its
// magnitude (bits 4j + 6, taken from rotl(w, 3)) so one shift places both;
// code 7's sign wraps to bit 2 and the last register uses a rotate.
// (a & ~mask) | (b & mask) in one lop3 (ptxas splits the C form into two).
template <u32 MASK>
__host__ __device__ __forceinline__ u32 select_bits(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xB8;" : "=r"(d) : "r"(a), "n"(MASK), "r"(b));
  return d;
#else
  return (a & ~MASK) | (b & MASK);
#endif
}

constexpr u32 F16_FIELDS = 0x8E008E00u;  // sign + 3 magnitude bits of both halves

__host__ __device__ __forceinline__ void decode8(u32 w, u32 s2, u32* r) {
  const u32 rot = funnelshift_l(w, w, 3);
  const u32 xe = select_bits<0x40404040u>(w, rot);  // codes 0, 2, 4, 6
  const u32 xo = select_bits<0x04040404u>(w, rot);  // codes 1, 3, 5, 7
  r[0] = hmul2((xe << 9) & F16_FIELDS, s2);
  r[1] = hmul2((xo << 5) & F16_FIELDS, s2);
  r[2] = hmul2((xe << 1) & F16_FIELDS, s2);
  r[3] = hmul2(funnelshift_r(xo, xo, 3) & F16_FIELDS, s2);
}

// a * b + (-0) on bf16x2 (= the product, one rounding, subnormal inputs kept).
__host__ __device__ __forceinline__ u32 bf16_mul2(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
#else
  // the fp32 product of two bf16 is exact here (decoded weight x scale): one rounding
  const u16 lo = host::f32_to_bf16(host::bits_f32(a << 16) * host::bits_f32(b << 16));
  const u16 hi = host::f32_to_bf16(host::bits_f32(a & 0xFFFF0000u) * host::bits_f32(b & 0xFFFF0000u));
  return lo | ((u32)hi << 16);
#endif
}
// decode8 for bf16 operands: r[j] = {lo: code j, hi: code j + 4} * s2 with
// s2 = [s 2^119 : s 2^119], i.e. e2m1 * s * 2^-7.  The bf16 pattern
// sign << 15 | mag << 6 is e2m1 * 2^-126 (0.5: bf16's subnormal 2^-127), so
// code j's magnitude goes to bits 6..8 (22..24 for code j + 4) and its sign 9
// bits above.  rotl(w, 6) parks every sign 6 bits up: codes 0, 1, 4, 5 with
// their parked signs (xa) and codes 2, 3, 6, 7 (xb) leave each other's
// fields alone, and one rotation per register places magnitude and sign
// (codes 6 and 7's signs wrap around).  15 instructions per 8 values.
constexpr u32 BF16_FIELDS = 0x81C081C0u;  // sign + 3 magnitude bits of both halves
__host__ __device__ __forceinline__ void decode8_bf16(u32 w, u32 s2, u32* r) {
  const u32 rot = funnelshift_l(w, w, 6);
  const u32 xa = select_bits<0x22002200u>(w, rot);  // codes 0, 1, 4, 5; signs at bits 9, 13, 25, 29
  const u32 xb = select_bits<0x00220022u>(w, rot);  // codes 2, 3, 6, 7; signs at bits 17, 21, 1, 5
  r[0] = bf16_mul2(funnelshift_l(xa, xa, 6) & BF16_FIELDS, s2);
  r[1] = bf16_mul2(funnelshift_l(xa, xa, 2) & BF16_FIELDS, s2);
  r[2] = bf16_mul2(funnelshift_r(xb, xb, 2) & BF16_FIELDS, s2);
  r[3] = bf16_mul2(funnelshift_r(xb, xb, 6) & BF16_FIELDS, s2);
}
// [s : s] pairs of a unit's two blocks: words 0-1 of a chunk use the low scale.
__host__ __device__ __forceinline__ void scale_pairs(u32 two, u32& lo, u32& hi) {
  const u32 d = e4m3x2_to_f16x2(two);
  lo = byte_perm(d, 0, 0x1010);
  hi = byte_perm(d, 0, 0x3232);
}

// A weight's scale pairs in the format its decoder takes: fp16 [s : s]
// (decode8), or for a bf16 MMA (ACT 2) bf16 [s 2^119 : s 2^119] (decode8_bf16).
template <int ACT>
__host__ __device__ __forceinline__ void weight_scale_pairs(u32 two, u32& lo, u32& hi) {
  if (ACT == 2) {
    const u32 d = e4m3x2_to_f16x2(two);
    lo = scale_pair_bf16(d);
    hi = scale_pair_bf16(d >> 16);
  } else {
    scale_pairs(two, lo, hi);
  }
}

// 8 fp16 / bf16 activation values (16 bytes: k 8q .. 8q + 7) as the four
// 32-bit pairs {k j, k j + 4} (j = 0..3) of decode8's order.
__host__ __device__ __forceinline__ void act_pairs(const V4& v, u32* r) {
  r[0] = byte_perm(v.v[0], v.v[2], 0x5410);
  r[1] = byte_perm(v.v[0], v.v[2], 0x7632);
  r[2] = byte_perm(v.v[1], v.v[3], 0x5410);
  r[3] = byte_perm(v.v[1], v.v[3], 0x7632);
}

// Word q (k 8q .. 8q + 7 of the thread's 32) of a weight tile's rows g and
// g + 8 (w0, w1: their 16-byte chunks), decoded with their scale pairs
// (weight_scale_pairs<ACT>): fp16 e2m1 * s * 2^-14, or for a bf16 MMA (ACT 2)
// bf16 e2m1 * s * 2^-7.
template <int ACT>
__host__ __device__ __forceinline__ void weight_word(const V4& w0, const V4& w1, int q, const u32 (&slo)[2],
                                            const u32 (&shi)[2], u32 (&r0)[4], u32 (&r1)[4]) {
  if (ACT == 2) {
    decode8_bf16(w0.v[q], q < 2 ? slo[0] : shi[0], r0);
    decode8_bf16(w1.v[q], q < 2 ? slo[1] : shi[1], r1);
  } else {
    decode8(w0.v[q], q < 2 ? slo[0] : shi[0], r0);
    decode8(w1.v[q], q < 2 ? slo[1] : shi[1], r1);
  }
}

// The MMA of an instantiation: f16 operands (W4A4, fp16 activation) or bf16
// (bf16 activation, ACT 2).
template <int ACT>
__device__ __forceinline__ void mma_act(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if (ACT == 2) {
    mma_bf16(d, a0, a1, a2, a3, b0, b1);
  } else {
    mma_f16(d, a0, a1, a2, a3, b0, b1);
  }
}

// out[mm, n] = alpha * pow2 * s (+ bias[n]), one rounding to the output type:
// the power of two undoes the decoders' scaling of the operands (exact).  BIAS
// 0 none, 1 fp32, 2 bf16, 3 fp16; ldo the output row length.
template <int BIAS, bool OUT_F16, int LDO>
__device__ __forceinline__ void store_scaled(u16* out, const void* bias, float pow2, float alpha, int mm, int n,
                                             float s) {
  float v = s * pow2 * alpha;
  if (BIAS == 1) {
    v += ((const float*)bias)[n];
  } else if (BIAS == 2) {
    v += bf16_to_f32(((const u16*)bias)[n]);
  } else if (BIAS == 3) {
    v += f16_to_f32(((const u16*)bias)[n]);
  }
  out[(long long)mm * LDO + n] = OUT_F16 ? to_f16(v) : to_bf16(v);
}

// The GEMV / middle-M kernels' store: 2^28 (W4A4: 2^-14 per decoded operand),
// 2^14 (fp16 activation) or 2^7 (bf16 activation), the weight decoder's scaling.
template <int ACT, int BIAS, bool OUT_F16, int LDO>
__device__ __forceinline__ void store_out(u16* out, const void* bias, float alpha, int mm, int n, float s) {
  store_scaled<BIAS, OUT_F16, LDO>(out, bias, ACT == 0 ? 268435456.0f : ACT == 1 ? 16384.0f : 128.0f, alpha, mm,
                                    n, s);
}

// Byte offset of swizzled scale column 8 * unit0 + 2 t (unit 0) of row r when
// the layout has c4 groups of four columns; unit u adds u * 1024 bytes.
__host__ __device__ __forceinline__ long long scale_offset(int r, int t4, int c4) {
  return ((long long)(r >> 7) * c4 + (t4 >> 1)) * 512 + (r & 31) * 16 + ((r & 127) >> 5) * 4 + 2 * (t4 & 1);
}

}  // namespace nvfp4_dec
