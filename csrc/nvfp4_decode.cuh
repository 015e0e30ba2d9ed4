// FP4 (e2m1) decode and PTX helpers shared by the NVFP4 CUDA kernels
// (nvfp4_gemv.cu: small M, register streaming; nvfp4_mid.cu: middle M, the
// activation shared through shared memory).  Compiled at run time by NVRTC;
// no CUDA headers needed.  See nvfp4_gemv.cu's header for the decode's
// exactness argument.
#pragma once

#include "fused_a_ptx.cuh"

namespace nvfp4_dec {

using namespace fa_ptx;

__device__ __forceinline__ V4 load_weight(const unsigned char* p) {
  V4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
               : "l"(p));
  return r;
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

__device__ __forceinline__ V4 zero4() {
  V4 r;
  r.v[0] = r.v[1] = r.v[2] = r.v[3] = 0u;
  return r;
}

// fp16x2 [s1 : s0] of two e4m3 bytes (exact; 0x7F / 0xFF give NaN).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
  u32 d;
  u16 h = (u16)two;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(h));
  return d;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// fp16x2 -> bf16x2, exact for the decoded weights (<= 7 significant bits, >= 2^-24).
__device__ __forceinline__ u32 f16x2_to_bf16x2(u32 h2) {
  float lo, hi;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi) : "r"(h2));
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ u16 to_f16(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// 8 codes (nibble j = k offset j of the word) -> 4 fp16x2 registers times the
// scale pair s2 = [s : s]: r[j] = {lo: code j, hi: code j + 4} * s * 2^-14.
// The magnitude of code j must land at bits 9..11 (shift 9 - 4j) and its sign
// at bit 15 (shift 12 - 4j).  xe / xo park each sign 6 bits above its
// magnitude (bits 4j + 6, taken from rotl(w, 3)) so one shift places both;
// code 7's sign wraps to bit 2 and the last register uses a rotate.
// (a & ~mask) | (b & mask) in one lop3 (ptxas splits the C form into two).
template <u32 MASK>
__device__ __forceinline__ u32 select_bits(u32 a, u32 b) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xB8;" : "=r"(d) : "r"(a), "n"(MASK), "r"(b));
  return d;
}

constexpr u32 F16_FIELDS = 0x8E008E00u;  // sign + 3 magnitude bits of both halves

__device__ __forceinline__ void decode8(u32 w, u32 s2, u32* r) {
  const u32 rot = __funnelshift_l(w, w, 3);
  const u32 xe = select_bits<0x40404040u>(w, rot);  // codes 0, 2, 4, 6
  const u32 xo = select_bits<0x04040404u>(w, rot);  // codes 1, 3, 5, 7
  r[0] = hmul2((xe << 9) & F16_FIELDS, s2);
  r[1] = hmul2((xo << 5) & F16_FIELDS, s2);
  r[2] = hmul2((xe << 1) & F16_FIELDS, s2);
  r[3] = hmul2(__funnelshift_r(xo, xo, 3) & F16_FIELDS, s2);
}

// [s : s] pairs of a unit's two blocks: words 0-1 of a chunk use the low scale.
__device__ __forceinline__ void scale_pairs(u32 two, u32& lo, u32& hi) {
  const u32 d = e4m3x2_to_f16x2(two);
  lo = __byte_perm(d, 0, 0x1010);
  hi = __byte_perm(d, 0, 0x3232);
}

// 8 fp16 / bf16 activation values (16 bytes: k 8q .. 8q + 7) as the four
// 32-bit pairs {k j, k j + 4} (j = 0..3) of decode8's order.
__device__ __forceinline__ void act_pairs(const V4& v, u32* r) {
  r[0] = __byte_perm(v.v[0], v.v[2], 0x5410);
  r[1] = __byte_perm(v.v[0], v.v[2], 0x7632);
  r[2] = __byte_perm(v.v[1], v.v[3], 0x5410);
  r[3] = __byte_perm(v.v[1], v.v[3], 0x7632);
}

// Word q (k 8q .. 8q + 7 of the thread's 32) of a weight tile's rows g and
// g + 8 (w0, w1: their 16-byte chunks), decoded with their scale pairs; for a
// bf16 MMA (ACT 2) converted to bf16, exactly.
template <int ACT>
__device__ __forceinline__ void weight_word(const V4& w0, const V4& w1, int q, const u32 (&slo)[2],
                                            const u32 (&shi)[2], u32 (&r0)[4], u32 (&r1)[4]) {
  decode8(w0.v[q], q < 2 ? slo[0] : shi[0], r0);
  decode8(w1.v[q], q < 2 ? slo[1] : shi[1], r1);
  if (ACT == 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      r0[j] = f16x2_to_bf16x2(r0[j]);
      r1[j] = f16x2_to_bf16x2(r1[j]);
    }
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

// out[mm, n] = alpha * 2^28 (W4A4) or 2^14 (W4A16) * s (+ bias[n]), one
// rounding to the output type: the power of two undoes the decoders' 2^-14
// per decoded operand (exact).  BIAS 0 none, 1 fp32, 2 bf16, 3 fp16; ldo the
// output row length.
template <int ACT, int BIAS, bool OUT_F16, int LDO>
__device__ __forceinline__ void store_out(u16* out, const void* bias, float alpha, int mm, int n, float s) {
  float v = s * (ACT == 0 ? 268435456.0f : 16384.0f) * alpha;
  if (BIAS == 1) {
    v += ((const float*)bias)[n];
  } else if (BIAS == 2) {
    v += bf16_to_f32(((const u16*)bias)[n]);
  } else if (BIAS == 3) {
    v += f16_to_f32(((const u16*)bias)[n]);
  }
  out[(long long)mm * LDO + n] = OUT_F16 ? to_f16(v) : to_bf16(v);
}

// Byte offset of swizzled scale column 8 * unit0 + 2 t (unit 0) of row r when
// the layout has c4 groups of four columns; unit u adds u * 1024 bytes.
__device__ __forceinline__ long long scale_offset(int r, int t4, int c4) {
  return ((long long)(r >> 7) * c4 + (t4 >> 1)) * 512 + (r & 31) * 16 + ((r & 127) >> 5) * 4 + 2 * (t4 & 1);
}

}  // namespace nvfp4_dec
