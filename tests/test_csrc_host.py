"""The NVFP4 kernels' plain-C++ helpers (``csrc/nvfp4_decode.cuh``,
``csrc/nvfp4_mid.cu``), compiled for the CPU by nvcc from the package's own
sources (``csrc_harness.py``), against models written here from the formats
(SPEC.md "NVFP4"), not from the CUDA code:

* e2m1 code: bit 3 the sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6};
* e4m3: sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2; exponent 0
  is subnormal (m / 8 * 2^-6); S.1111.111 is NaN; no infinities;
* the decoders' fp16 registers hold value * 2^-14 (the kernels undo it in the
  epilogue), weight and activation values of one register at k and k + 4;
* the swizzled scale layout: scale [r, c] at byte
  ((r // 128) * C4 + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4.

Every decoder input that matters is covered: all 65536 scale byte pairs, every
code in every nibble of a word with every e4m3 scale, and random words.  The
PTX instructions and intrinsics inside the helpers run as host twins in this
build (``nvfp4_decode.cuh`` documents them); the last tests check those twins
against NumPy's IEEE arithmetic.  The GPU tests run the device side.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from csrc_harness import build, needs_nvcc

pytestmark = needs_nvcc

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_value(code: np.ndarray) -> np.ndarray:
    mag = E2M1[code & 7]
    return np.where(code & 8, -mag, mag)


def e4m3_value(b: np.ndarray) -> np.ndarray:
    b = np.asarray(b, dtype=np.int64)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag)


def f16_bits(v: np.ndarray) -> np.ndarray:
    """fp16 bit patterns of float64 values that fp16 holds exactly."""
    h = np.asarray(v, dtype=np.float64).astype(np.float16)
    ok = np.isnan(v) | (h.astype(np.float64) == v)
    assert ok.all(), np.asarray(v)[~ok][:5]
    return h.view(np.uint16).astype(np.uint32)


def halves(words: np.ndarray, dtype=np.float16) -> tuple[np.ndarray, np.ndarray]:
    """The (low, high) 16-bit halves of uint32 words as float64 (fp16 or bf16)."""
    lo, hi = (words & 0xFFFF).astype(np.uint32), (words >> 16).astype(np.uint32)
    if dtype == np.float16:
        return tuple(h.astype(np.uint16).view(np.float16).astype(np.float64) for h in (lo, hi))
    return tuple((h << 16).view(np.float32).astype(np.float64) for h in (lo, hi))


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal values with equal signs (zeros included), NaN where NaN."""
    nan = np.isnan(want)
    return bool((np.isnan(got) == nan).all() and (got[~nan] == want[~nan]).all()
                and (np.signbit(got[~nan]) == np.signbit(want[~nan])).all())


@pytest.fixture(scope="module")
def dec(tmp_path_factory):
    return build("nvfp4_decode_host.cu", tmp_path_factory.mktemp("decode"))


def test_e4m3_model_is_torchs():
    b = np.arange(256)
    torch_vals = torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
    assert same(e4m3_value(b), torch_vals)


def test_scale_pairs_every_byte_pair(dec):
    two = np.arange(65536)
    lo, hi = dec("scale_pairs", two).T
    for words, byte in ((lo, two & 0xFF), (hi, two >> 8)):  # words 0-1 of a chunk: block 2t; 2-3: 2t + 1
        a, b = halves(words)
        want = e4m3_value(byte)
        assert same(a, want) and same(b, want)


def _scale_pair(byte: np.ndarray) -> np.ndarray:
    """[s : s] fp16x2 of e4m3 bytes (NaN as fp16's quiet NaN)."""
    v = e4m3_value(byte)
    h = np.where(np.isnan(v), 0x7E00, f16_bits(np.nan_to_num(v)))
    return h | (h << 16)


def _check_decoded(regs: np.ndarray, words: np.ndarray, scales: np.ndarray, dtype=np.float16, pow2=-14):
    """regs [n, 4]: register j = {lo: code j, hi: code j + 4} * scale * 2^pow2."""
    codes = (words[:, None] >> (4 * np.arange(8))) & 15
    want = e2m1_value(codes) * e4m3_value(scales)[:, None] * 2.0 ** pow2
    for j in range(4):
        lo, hi = halves(regs[:, j], dtype)
        assert same(lo, want[:, j]), j
        assert same(hi, want[:, j + 4]), j


def test_decode8_every_code_in_every_nibble_with_every_scale(dec):
    # every byte value in every byte of the word (so every code in every
    # nibble, next to every neighbour code), times every e4m3 scale byte
    byte = np.arange(256)
    words = np.repeat(byte * 0x01010101, 256)
    scales = np.tile(byte, 256)
    regs = dec("decode8", np.stack([words, _scale_pair(scales)], 1))
    _check_decoded(regs, words, scales)
    # random words (codes independent across nibbles), random scales
    rng = np.random.default_rng()
    words = np.concatenate([rng.integers(0, 2 ** 32, 50000), [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x88888888, 0]])
    scales = rng.integers(0, 256, len(words))
    _check_decoded(dec("decode8", np.stack([words, _scale_pair(scales)], 1)), words, scales)


def _bf16_scale_pair(byte: np.ndarray) -> np.ndarray:
    """[s 2^119 : s 2^119] bf16x2 of e4m3 bytes (exact: 4 significant bits; NaN as 0x7FC0)."""
    v = e4m3_value(byte) * 2.0 ** 119
    h = np.where(np.isnan(v), 0x7FC0, (np.nan_to_num(v).astype(np.float32).view(np.uint32) >> 16))
    assert (np.nan_to_num(v) == (h.astype(np.uint32) << 16).view(np.float32))[~np.isnan(v)].all()
    return h | (h << 16)


def test_decode8_bf16_every_code_in_every_nibble_with_every_scale(dec):
    """The bf16 decoder (decode8's order): e2m1 * s * 2^-7, bit-exact, subnormal 0.5 * 2^-126 kept."""
    byte = np.arange(256)
    words = np.repeat(byte * 0x01010101, 256)
    scales = np.tile(byte, 256)
    _check_decoded(dec("decode8_bf16", np.stack([words, _bf16_scale_pair(scales)], 1)), words, scales, "bf16", -7)
    rng = np.random.default_rng()
    words = np.concatenate([rng.integers(0, 2 ** 32, 50000), [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x88888888, 0]])
    scales = rng.integers(0, 256, len(words))
    _check_decoded(dec("decode8_bf16", np.stack([words, _bf16_scale_pair(scales)], 1)), words, scales, "bf16", -7)


@pytest.mark.parametrize("op,dtype,pow2", [("weight_word_f16", np.float16, -14), ("weight_word_bf16", "bf16", -7)])
def test_weight_word_decodes_its_word_with_its_blocks_scale(dec, op, dtype, pow2):
    """Word q of rows g, g + 8: words 0-1 take the first block's scale pair, 2-3 the second's;
    fp16 e2m1 * s * 2^-14, or straight to bf16 e2m1 * s * 2^-7 (no fp16 step)."""
    rng = np.random.default_rng()
    n = 4000
    w = rng.integers(0, 2 ** 32, (n, 8))
    q = rng.integers(0, 4, n)
    sb = rng.integers(0, 0x7F, (n, 4)) | (rng.integers(0, 2, (n, 4)) << 7)  # finite scales: slo0 slo1 shi0 shi1
    pairs = _scale_pair(sb) if dtype == np.float16 else _bf16_scale_pair(sb)
    regs = dec(op, np.concatenate([w, q[:, None], pairs], 1))
    for row in range(2):
        word = w[np.arange(n), 4 * row + q]
        scale = np.where(q < 2, sb[:, row], sb[:, 2 + row])
        _check_decoded(regs[:, 4 * row:4 * row + 4], word, scale, dtype, pow2)


@pytest.mark.parametrize("dtype", [np.float16, "bf16"])
def test_weight_scale_pairs_every_byte_pair(dec, dtype):
    """Both blocks' pairs in the decoder's format: fp16 [s : s], or bf16 [s 2^119 : s 2^119]; NaN stays NaN."""
    two = np.arange(65536)
    lo, hi = dec("weight_scale_pairs_f16" if dtype == np.float16 else "weight_scale_pairs_bf16", two).T
    scale = 1.0 if dtype == np.float16 else 2.0 ** 119
    for words, byte in ((lo, two & 0xFF), (hi, two >> 8)):
        a, b = halves(words, dtype)
        want = e4m3_value(byte) * scale
        assert same(a, want) and same(b, want)


def test_act_pairs_match_the_decoder_order(dec):
    """16-bit activations k 0..7 (two per word) -> register j = {k j, k j + 4}."""
    rng = np.random.default_rng()
    k = rng.integers(0, 2 ** 16, (5000, 8))
    v = k[:, 0::2] | (k[:, 1::2] << 16)
    regs = dec("act_pairs", v)
    for j in range(4):
        np.testing.assert_array_equal(regs[:, j] & 0xFFFF, k[:, j])
        np.testing.assert_array_equal(regs[:, j] >> 16, k[:, j + 4])


def spec_scale_offset(r, c, c4):
    return ((r // 128) * c4 + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def test_scale_offset_is_the_swizzled_layout(dec):
    r, t4, c4 = (a.ravel() for a in np.meshgrid(np.arange(600), np.arange(4), np.array([1, 2, 3, 8]), indexing="ij"))
    got = dec("scale_offset", np.stack([r, t4, c4], 1))
    off = got[:, 0].astype(np.int64) | (got[:, 1].astype(np.int64) << 32)
    np.testing.assert_array_equal(off, spec_scale_offset(r, 2 * t4, c4))  # unit 0: blocks 2 t, 2 t + 1
    np.testing.assert_array_equal(off + 1, spec_scale_offset(r, 2 * t4 + 1, c4))  # the pair's second byte
    for u in range(c4.max() // 2):  # unit u: 1024 bytes on (8 scale columns)
        sel = c4 >= 2 * (u + 1)
        np.testing.assert_array_equal(off[sel] + 1024 * u, spec_scale_offset(r[sel], 8 * u + 2 * t4[sel], c4[sel]))


@pytest.mark.parametrize("defines", [dict(P_N=1040, P_K=736), dict(P_N=1040, P_K=4096, P_MB=32, P_UNROLL=2)],
                         ids=["mb64", "mb32u2"])
def test_mid_slots_are_a_bijection_and_quarter_warps_conflict_free(tmp_path, defines):
    """slot_offset: word q of quad thread t of row r; every 16-byte slot of a
    unit's rows once, and the 8 lanes of a quarter warp (rows 2p, 2p + 1 (+ 8 f)
    x t 0..3) in 8 different 16-byte bank groups, for every word q."""
    mid = build("nvfp4_mid_host.cu", tmp_path, defines)
    c = mid.consts()
    rows = c["MB"]
    r, t, q = (a.ravel() for a in np.meshgrid(np.arange(rows), np.arange(4), np.arange(4), indexing="ij"))
    off = mid.ints("slot_offset", np.stack([r, t, q], 1))[:, 0]
    assert sorted(off) == list(range(0, rows * c["ROW_SMEM"], 16))
    slot = {(a, b, d): o for a, b, d, o in zip(r, t, q, off)}
    for qq in range(4):
        for f in range(rows // 8):
            for quarter in range(4):
                lanes = range(8 * quarter, 8 * quarter + 8)
                groups = {(slot[(f * 8 + 2 * quarter + (ln & 7) // 4, ln & 3, qq)] // 16) % 8 for ln in lanes}
                assert len(groups) == 8, (qq, f, quarter, groups)


# ----------------------------------------------------------------------------
# The host twins of the PTX instructions, against IEEE arithmetic
# ----------------------------------------------------------------------------


def test_host_e4m3x2_to_f16x2(dec):
    two = np.arange(65536)
    lo, hi = halves(dec("e4m3x2_to_f16x2", two)[:, 0])
    assert same(lo, e4m3_value(two & 0xFF)) and same(hi, e4m3_value(two >> 8))


def test_host_hmul2_rounds_like_ieee_fp16(dec):
    rng = np.random.default_rng()
    a = rng.integers(0, 2 ** 32, 100000)
    b = rng.integers(0, 2 ** 32, 100000)
    got = halves(dec("hmul2", np.stack([a, b], 1))[:, 0])
    for g, x, y in zip(got, halves(a), halves(b)):
        with np.errstate(all="ignore"):
            want = (x.astype(np.float16) * y.astype(np.float16)).astype(np.float64)  # one fp16 rounding
        assert same(g, want)


def test_host_scale_pair_bf16_rounds_like_torch(dec):
    """Every fp16 pattern in the low half (the high half ignored): bf16(f32(h) * 2^119) in both halves."""
    h = np.arange(65536)
    words = h | (np.random.default_rng().integers(0, 65536, h.size) << 16)
    got = dec("scale_pair_bf16", words)[:, 0]
    src = torch.from_numpy(h.astype(np.uint16).view(np.float16)).float()
    with np.errstate(all="ignore"):
        want = (src * 2.0 ** 119).bfloat16().double().numpy()
    for g in halves(got, "bf16"):
        assert same(g, want)


# ----------------------------------------------------------------------------
# The in-kernel activation quantizer (nvfp4_quant.cuh) against reference_quant
# ----------------------------------------------------------------------------


def _random_blocks(rng, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 16] values spread over many binades per block, with zeros,
    negative zeros, repeated values, values at e2m1 midpoints of their block
    scale, and whole-zero blocks."""
    mag = torch.from_numpy(np.exp2(rng.uniform(-20, 12, (rows, 16))) * rng.choice([-1.0, 1.0], (rows, 16)))
    spread = torch.from_numpy(np.exp2(rng.integers(-6, 7, (rows, 1)).astype(np.float64)))
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0],
                        dtype=torch.float64)
    ties = grid[torch.from_numpy(rng.integers(0, len(grid), (rows, 16)))] * spread
    x = torch.where(torch.from_numpy(rng.random((rows, 1)) < 0.3), ties, mag)
    x[torch.from_numpy(rng.random((rows, 16)) < 0.05)] = 0.0
    x[torch.from_numpy(rng.random((rows, 16)) < 0.02)] = -0.0
    x[: rows // 50] = 0.0
    return x.to(dtype)


def _pairs(x: torch.Tensor) -> np.ndarray:
    """[rows, 16] fp16 / bf16 -> [rows, 8] uint32 words of (even, odd) pairs."""
    return x.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32).reshape(-1, 8, 2) @ \
        np.array([1, 1 << 16], dtype=np.uint32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_block16_is_reference_quant(dec, dtype):
    """Codes and scale byte of every block equal ``reference_quant``'s (SPEC's
    recipe with IEEE reciprocals), for global scales from 2688 / amax and
    extreme ones (scales saturating at 448, scales flushing to 0)."""
    from scaledmm.ops.nvfp4 import reference_quant

    rng = np.random.default_rng()
    op = "quant_block16_f16" if dtype == torch.float16 else "quant_block16_bf16"
    for trial in range(6):
        x = _random_blocks(rng, 4000, dtype)
        if dtype == torch.float16:
            x = x.float().clamp(-60000, 60000).half()
        amax = x.float().abs().max().item()
        gs = [448 * 6 / max(amax, 1e-30), float(np.exp2(rng.uniform(-30, 30))), 1.0, 3.0e-5, 1.7e8, 2688.0][trial]
        gs32 = torch.tensor(gs, dtype=torch.float32)
        q, s = reference_quant(x, gs32, swizzle=False)
        words = _pairs(x)
        got = dec(op, np.concatenate([words, np.full((len(words), 1), gs32.view(torch.int32).item() & 0xFFFFFFFF)], 1))
        want_codes = q.view(torch.int32).numpy().view(np.uint32).reshape(-1, 2)
        want_scale = s.view(torch.uint8).numpy().astype(np.uint32).reshape(-1)
        bad = np.nonzero((got[:, :2] != want_codes).any(1) | (got[:, 2] != want_scale))[0]
        assert bad.size == 0, (trial, gs, x[bad[:3]].tolist(), got[bad[:3]].tolist(),
                               want_codes[bad[:3]].tolist(), want_scale[bad[:3]].tolist())


def test_e4m3_byte_rounds_and_saturates_like_the_reference(dec):
    """Non-negative fp32 values (ties, subnormals, the saturation edge at 448,
    above it and inf) -> the byte of ``e4m3_saturating``; NaN -> 0x7F."""
    from scaledmm.ops.nvfp4 import e4m3_saturating

    rng = np.random.default_rng()
    e4 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    mids = ((e4[1:] + e4[:-1]) / 2).float()
    v = torch.cat([torch.from_numpy(np.exp2(rng.uniform(-12, 10, 200000))).float(), mids,
                   torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9)),
                   torch.tensor([0.0, 448.0, 463.9, 464.0, 465.0, 1e30, float("inf"), 2.0 ** -10, 2.0 ** -9])])
    got = dec("e4m3_byte", v.view(torch.int32).numpy().view(np.uint32))[:, 0]
    want = e4m3_saturating(v).view(torch.uint8).numpy()
    assert (got == want).all(), v[torch.from_numpy(got != want)][:5]
    assert dec("e4m3_byte", np.array([0x7FC00000]))[0, 0] == 0x7F
