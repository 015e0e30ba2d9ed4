// Host harness of csrc/nvfp4_decode.cuh and csrc/nvfp4_quant.cuh (see
// tests/test_csrc_host.py): the headers' __host__ __device__ helpers, compiled
// for the CPU.
#include "nvfp4_decode.cuh"
#include "nvfp4_quant.cuh"

#include "harness.h"

using namespace nvfp4_dec;

static void op_decode8(const word* in, std::vector<word>& out) {  // (w, s2) -> r[4]
  u32 r[4];
  decode8(in[0], in[1], r);
  out.insert(out.end(), r, r + 4);
}

static void op_decode8_bf16(const word* in, std::vector<word>& out) {  // (w, s2) -> r[4]
  u32 r[4];
  decode8_bf16(in[0], in[1], r);
  out.insert(out.end(), r, r + 4);
}

static void op_scale_pairs(const word* in, std::vector<word>& out) {  // two -> (lo, hi)
  u32 lo, hi;
  scale_pairs(in[0], lo, hi);
  out.push_back(lo);
  out.push_back(hi);
}

static void op_act_pairs(const word* in, std::vector<word>& out) {  // V4 -> r[4]
  V4 v;
  for (int i = 0; i < 4; ++i) v.v[i] = in[i];
  u32 r[4];
  act_pairs(v, r);
  out.insert(out.end(), r, r + 4);
}

// (w0[4], w1[4], q, slo[2], shi[2]) -> (r0[4], r1[4])
template <int ACT>
static void op_weight_word(const word* in, std::vector<word>& out) {
  V4 w0, w1;
  for (int i = 0; i < 4; ++i) {
    w0.v[i] = in[i];
    w1.v[i] = in[4 + i];
  }
  const u32 slo[2] = {in[9], in[10]}, shi[2] = {in[11], in[12]};
  u32 r0[4], r1[4];
  weight_word<ACT>(w0, w1, (int)in[8], slo, shi, r0, r1);
  out.insert(out.end(), r0, r0 + 4);
  out.insert(out.end(), r1, r1 + 4);
}

static void op_scale_offset(const word* in, std::vector<word>& out) {  // (r, t4, c4) -> offset
  const long long o = scale_offset((int)in[0], (int)in[1], (int)in[2]);
  out.push_back((word)o);
  out.push_back((word)(o >> 32));
}

static void op_e4m3x2_to_f16x2(const word* in, std::vector<word>& out) { out.push_back(e4m3x2_to_f16x2(in[0])); }

static void op_hmul2(const word* in, std::vector<word>& out) { out.push_back(hmul2(in[0], in[1])); }

static void op_scale_pair_bf16(const word* in, std::vector<word>& out) { out.push_back(scale_pair_bf16(in[0])); }

template <int ACT>
static void op_weight_scale_pairs(const word* in, std::vector<word>& out) {  // two -> (lo, hi)
  u32 lo, hi;
  weight_scale_pairs<ACT>(in[0], lo, hi);
  out.push_back(lo);
  out.push_back(hi);
}

// (w[8]: 16 fp16 / bf16 values as pairs, gs bits) -> (codes[2], scale byte)
template <bool F16>
static void op_quant_block16(const word* in, std::vector<word>& out) {
  const u32 w[8] = {in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7]};
  float x[16];
  nvfp4_q::unpack_block16<F16>(w, x);
  const float gs = nvfp4_q::bits_f32(in[8]);
  u32 codes[2];
  const u32 s = nvfp4_q::quant_block16(x, gs, nvfp4_q::rcp_rn(gs), codes);
  out.push_back(codes[0]);
  out.push_back(codes[1]);
  out.push_back(s);
}

static void op_e4m3_byte(const word* in, std::vector<word>& out) {  // fp32 bits -> e4m3 byte
  out.push_back(nvfp4_q::e4m3_byte(nvfp4_q::bits_f32(in[0])));
}

int main(int argc, char** argv) {
  static const Op ops[] = {
      {"decode8", 2, op_decode8},
      {"decode8_bf16", 2, op_decode8_bf16},
      {"scale_pairs", 1, op_scale_pairs},
      {"act_pairs", 4, op_act_pairs},
      {"weight_word_f16", 13, op_weight_word<0>},
      {"weight_word_bf16", 13, op_weight_word<2>},
      {"scale_offset", 3, op_scale_offset},
      {"e4m3x2_to_f16x2", 1, op_e4m3x2_to_f16x2},
      {"hmul2", 2, op_hmul2},
      {"scale_pair_bf16", 1, op_scale_pair_bf16},
      {"weight_scale_pairs_f16", 1, op_weight_scale_pairs<0>},
      {"weight_scale_pairs_bf16", 1, op_weight_scale_pairs<2>},
      {"quant_block16_bf16", 9, op_quant_block16<false>},
      {"quant_block16_f16", 9, op_quant_block16<true>},
      {"e4m3_byte", 1, op_e4m3_byte},
  };
  return run_harness(argc, argv, ops, sizeof(ops) / sizeof(ops[0]));
}
