"""Tests of the NVFP4 Triton backend (``ops/nvfp4_triton.py``).

Three groups:

* Interpreter tests (``@interp``): the kernels run in Triton's CPU interpreter.
  ``TRITON_INTERPRET`` must be set before Triton is first imported, and other
  test files import Triton in compiled mode, so these tests never run in the
  main pytest process: :func:`test_interpreter_suite` re-runs this file in a
  subprocess with ``TRITON_INTERPRET=1`` (and ``SCALEDMM_NVFP4_INTERP_CHILD=1``),
  where only they run.  Small shapes; the subprocess takes about a minute.
* CPU tests of the GPU-only pieces: the inline-PTX decoders run on a small
  PTX emulator over every byte value and every e4m3 scale; the config space.
* GPU tests (``@requires_cuda``): full llama8b shapes, every decoder, odd M,
  split-K, CUDA-graph capture and replay, torch.compile, opcheck.

References are written here from SPEC.md, independently of ``ops/nvfp4.py``:
the quantizer in float32 exactly as SPEC states it, with the e2m1 rounding done
as a nearest-value search in float64 (ties to the even code); the GEMMs in
float64 on the decoded operands.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledmm
from scaledmm.backends import Family, Problem
from scaledmm.ops import nvfp4_triton as nt
from scaledmm.ops import nvfp4_triton_quant as ntq
from helpers import opcheck, poison_, rel_err, run_under_interpreter

CHILD = os.environ.get("SCALEDMM_NVFP4_INTERP_CHILD") == "1"
# GPU tests run in the main process only (the interpreter child would run them
# on the interpreter, copying every tensor to the host)
requires_cuda = pytest.mark.skipif(CHILD or not torch.cuda.is_available(), reason="needs a CUDA device")
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter subprocess (test_interpreter_suite)")
parent = pytest.mark.skipif(CHILD, reason="main-process test")
FP8 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ----------------------------------------------------------------------------
# SPEC references
# ----------------------------------------------------------------------------


def swz_offsets(rows: int, cols: int, device="cpu") -> torch.Tensor:
    """SPEC's flat offset of S[r, c] in the swizzled layout, ``[R', C']`` int64."""
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    r = torch.arange(rp, device=device).view(-1, 1)
    c = torch.arange(cp, device=device).view(1, -1)
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle(s: torch.Tensor) -> torch.Tensor:
    rows, cols = s.shape
    off = swz_offsets(rows, cols, s.device)
    flat = torch.zeros(off.numel(), dtype=torch.uint8, device=s.device)
    padded = torch.zeros(off.shape, dtype=torch.uint8, device=s.device)
    padded[:rows, :cols] = s.view(torch.uint8)
    flat[off.flatten()] = padded.flatten()
    return flat.view(off.shape).view(FP8)


def unswizzle(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    off = swz_offsets(rows, cols, s.device)
    return s.view(torch.uint8).flatten()[off.flatten()].view(off.shape)[:rows, :cols].view(FP8)


def e2m1_nearest(v: torch.Tensor) -> torch.Tensor:
    """Code (sign << 3 | index) of the nearest e2m1 value to ``v`` (|v| <= 6),
    a tie going to the even index: a float64 nearest-value search."""
    a = v.double().abs().unsqueeze(-1)
    d = (a - E2M1.to(v.device)).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best)
    even = cand & (torch.arange(8, device=v.device) % 2 == 0)
    idx = torch.where(even.any(-1), even.int().argmax(-1), cand.int().argmax(-1))
    return idx.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def spec_quant(x: torch.Tensor, gs: torch.Tensor, swz: bool):
    """SPEC's recipe: fp32 arithmetic in the order written, s = e4m3(gs * (amax
    * (1/6))) and codes of x * (1 / (s * (1 / gs))) with IEEE reciprocals
    (``torch.reciprocal``, on the GPU too), torch's e4m3 cast (nearest even)
    after clamping (saturation), nearest-even e2m1; on x's device."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 16, 16)
    g = gs.to(x.device).float().reshape(())
    amax = xb.abs().amax(-1)
    sixth = torch.reciprocal(amax.new_full((), 6.0))
    s8 = (g * (amax * sixth)).clamp(max=448.0).to(FP8)
    sf = s8.float().unsqueeze(-1)
    v = (xb * torch.reciprocal(sf * torch.reciprocal(g))).clamp(-6.0, 6.0)
    codes = torch.where(sf == 0, torch.zeros_like(v, dtype=torch.uint8), e2m1_nearest(v)).reshape(m, k)
    q = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return q, (swizzle(s8) if swz else s8)


def decode(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 ``[R, K]`` values of packed codes with swizzled scales, on q's device."""
    rows, k = q.shape[0], 2 * q.shape[1]
    codes = torch.stack((q & 15, q >> 4), -1).reshape(rows, k).long()
    val = E2M1.to(q.device)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    return val * unswizzle(s, rows, k // 16).double().repeat_interleave(16, dim=1)


def ref_mm(xa: torch.Tensor, wb: torch.Tensor, alpha, bias) -> torch.Tensor:
    """float64 ``alpha * xa @ wb.T (+ bias)`` on ``xa``'s device."""
    out = (xa.double() @ wb.to(xa.device).double().t()) * float(alpha)
    if bias is not None:
        out = out + bias.to(out.device).double()
    return out


def quantized(rows: int, k: int, device, scale: float = 1.0, gs: float = 1.0, dtype=torch.float32):
    x = (torch.randn(rows, k) * scale).to(dtype).to(device)
    g = torch.tensor(gs, device=device)
    q, s = spec_quant(x, g, True)
    return q.to(device), s.to(device)


# ----------------------------------------------------------------------------
# The interpreter subprocess (main process)
# ----------------------------------------------------------------------------


@parent
def test_interpreter_suite():
    run_under_interpreter(__file__, {"SCALEDMM_NVFP4_INTERP_CHILD": "1"})


# ----------------------------------------------------------------------------
# Interpreter: quantizer
# ----------------------------------------------------------------------------


def _poison_quant_outputs(monkeypatch):
    real = nt.nv.quant_outputs

    def poisoned(x, g, swz):
        q, s = real(x, g, swz)
        poison_(q)
        poison_(s)
        return q, s

    monkeypatch.setattr(nt.nv, "quant_outputs", poisoned)


def _same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check_quant(x, gs, swz, cfg):
    q, s = nt.quant(x, gs, swz, cfg)
    q_ref, s_ref = spec_quant(x, gs, swz)
    assert _same(q, q_ref), (cfg.label(), int((q != q_ref).sum()))
    assert _same(s, s_ref), (cfg.label(), int((s.view(torch.uint8) != s_ref.view(torch.uint8)).sum()))
    return q, s


# every kernel variant; the rows_* ones once with one loop step per program
# (fast in the interpreter) and once with several (the prefetch path)
Q = nt.QuantConfig
QCFGS = [nt.DEFAULT_QUANT, Q(32, 8, 8, "rows_fma"), Q(32, 8, 8, "rows_pred")]
QCFGS_STEPS = [Q(16, 8, 1, "rows_fma"), Q(8, 8, 1, "rows_pred"), Q(32, 16, 2, "rows_fma", 2)]


@interp
@pytest.mark.parametrize("cfg", QCFGS, ids=lambda c: c.label())
def test_quant_exact_odd_shapes(monkeypatch, cfg):
    _poison_quant_outputs(monkeypatch)  # the kernel must write every byte, pads included
    for m in (0, 1, 3, 17, 130):
        for k in (16, 48, 400):
            x = (torch.randn(m, k) * 3).to(torch.bfloat16)
            for swz in (True, False):
                q, s = _check_quant(x, torch.tensor(448 * 6 / 7.0), swz, cfg)
                if swz and m:
                    assert s.shape == (-(-m // 128) * 128, -(-k // 64) * 4)
                    assert not s.view(torch.uint8).flatten()[swz_offsets(m, k // 16)[m:].flatten()].any()


@interp
@pytest.mark.parametrize("cfg", QCFGS_STEPS, ids=lambda c: c.label())
def test_quant_exact_loop_steps(monkeypatch, cfg):
    _poison_quant_outputs(monkeypatch)
    for m, k in ((17, 48), (130, 32), (5, 400)):
        x = (torch.randn(m, k) * 3).to(torch.bfloat16)
        for swz in (True, False):
            _check_quant(x, torch.tensor(300.0), swz, cfg)


@interp
@pytest.mark.parametrize("cfg", QCFGS + QCFGS_STEPS[:1], ids=lambda c: c.label())
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_quant_dtypes_and_strided_rows(cfg, dtype):
    even, odd = torch.randn(5, 80, dtype=dtype), torch.randn(5, 81, dtype=dtype)
    for x in (even[:, 8:72], odd[:, 8:72], even[:, 1:65]):  # row stride > K = 64, odd, unaligned start
        _check_quant(x, torch.tensor(37.5), True, cfg)


def _special_rows():
    """gs = 1: row 0 has amax 6, so s = 1 and every e2m1 midpoint is hit exactly."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5,
                         -3.5, -5.0, -6.0])
    return torch.stack([mids,
                        torch.zeros(16),                                    # s = 0 -> all codes 0
                        torch.full((16,), 1e-30),                           # s underflows to 0
                        torch.tensor([1e30] + [1.0] * 15),                  # saturates at 448
                        torch.tensor([3e-2] + [-1e-2] * 15),                # e4m3 subnormal scale
                        torch.tensor([float("inf")] + [2.0] * 15),
                        torch.tensor([-0.0] * 8 + [1.0] * 8),               # -0 keeps its sign bit
                        torch.tensor([-float("inf")] + [-0.0] * 15),
                        torch.tensor([6.0] + [-1e-30] * 15)])               # tiny negatives: code 8


@interp
@pytest.mark.parametrize("cfg", QCFGS, ids=lambda c: c.label())
def test_quant_ties_and_special_values(cfg):
    x = _special_rows()
    gs = torch.tensor(1.0)
    _, s = _check_quant(x, gs, False, cfg)
    assert s[0].float().item() == 1.0 and s[1].float().item() == 0.0 and s[3].float().item() == 448.0
    # NaN: its block's scale is NaN, the other blocks and rows are untouched
    xn = x.clone()
    xn[2, 3] = float("nan")
    xn = torch.cat([xn, torch.randn(x.shape[0], 16)], 1)  # K = 32: a second block per row
    qn, sn = nt.quant(xn, gs, False, cfg)
    qr, sr = spec_quant(xn, gs, False)
    assert torch.isnan(sn[2, 0].float())
    keep = torch.ones(xn.shape, dtype=torch.bool)
    keep[2, :16] = False
    assert torch.equal(sn.view(torch.uint8)[keep[:, ::16]], sr.view(torch.uint8)[keep[:, ::16]])
    assert torch.equal(qn[keep[:, ::2]], qr[keep[:, ::2]])
    # gs = 0 and gs = inf (an all-zero activation's 448 * 6 / amax); codes are
    # unspecified in blocks with a NaN scale or a NaN product (0 * inf)
    for g in (0.0, float("inf")):
        qz, sz = nt.quant(x, torch.tensor(g), False, cfg)
        qzr, szr = spec_quant(x, torch.tensor(g), False)
        nan = torch.isnan(szr.float()).squeeze(1)
        ok = ~(nan | torch.isnan(x * g).any(1))
        assert torch.equal(torch.isnan(sz.float()).squeeze(1), nan)  # NaN of either sign
        assert torch.equal(sz.view(torch.uint8)[~nan], szr.view(torch.uint8)[~nan])
        assert torch.equal(qz[ok], qzr[ok]) and ok.sum() >= 3


@interp
@pytest.mark.parametrize("cfg", QCFGS, ids=lambda c: c.label())
def test_quant_every_scale_at_every_midpoint(cfg):
    """Every finite e4m3 block scale s > 0 (gs = 1, amax 6 s), with fp32 inputs
    whose scaled values y = x * (1 / s) land on each e2m1 midpoint T or next
    to it: x = T * s, T / (1 / s) and their fp32 neighbours."""
    s = torch.arange(1, 127, dtype=torch.int32).to(torch.uint8).view(FP8).float()   # 2**-9 .. 448
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    base = torch.cat([s[:, None] * mids, mids / torch.reciprocal(s)[:, None]], 1)   # fp32, [126, 14]
    vals = torch.cat([base, torch.nextafter(base, torch.tensor(0.0)), torch.nextafter(base, torch.tensor(1e9))], 1)
    vals = vals * torch.where(torch.arange(42) % 2 == 0, 1.0, -1.0)
    a = (6 * s)[:, None]                                                             # amax 6 s: scale s
    x = torch.cat([a, vals[:, :15], a, vals[:, 15:30], a, vals[:, 30:], torch.zeros(len(s), 3)], 1)
    _check_quant(x, torch.tensor(1.0), True, cfg)


@interp
@settings(max_examples=12)
@given(m=st.integers(0, 40), groups=st.integers(1, 10), log_scale=st.integers(-12, 12),
       log_gs=st.integers(-4, 12), swz=st.booleans(), pad=st.integers(0, 3),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       cfg=st.sampled_from(QCFGS + QCFGS_STEPS))
def test_quant_hypothesis(m, groups, log_scale, log_gs, swz, pad, dtype, cfg):
    k = 16 * groups
    wide = (torch.randn(m, k + 16 * pad) * 2.0 ** log_scale).to(dtype)
    x = wide[:, :k]
    gs = torch.tensor(2.0 ** log_gs * 1.37)
    _check_quant(x, gs, swz, cfg)


@interp
def test_quant_matches_op_reference():
    x = torch.randn(9, 128)
    gs = torch.tensor(200.0)
    for cfg in QCFGS:
        q, s = nt.quant(x, gs, True, cfg)
        q2, s2 = nt.nv.reference_quant(x, gs, True)
        assert _same(q, q2) and _same(s, s2)


@parent
def test_saturating_fma_compares_are_exact():
    """rows_fma: for each e2m1 midpoint T, A * (T - |y|) with A = 2**40 is 0 or
    at least 1 in magnitude for the fp32 |y| next to T (farther ones only make
    it larger), so FFMA.SAT returns exactly [|y| < T] (float64 is exact here)."""
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    ys = [t.float()]
    for direction in (0.0, 1e9):
        y = t.float()
        for _ in range(3):
            y = torch.nextafter(y, torch.tensor(direction))
            ys.append(y)
    for y in ys:
        d = (t - y.double()) * 2.0 ** 40
        assert ((d == 0) | (d.abs() >= 1)).all()


@interp
def test_e4m3_scale_decode_all_codes():
    """Every e4m3 code as a block scale (1.0 codes): the integer e4m3 decoder
    of sm80 / the interpreter gives each value exactly, NaN for 0x7F."""
    codes = torch.arange(128, dtype=torch.int32).to(torch.uint8)
    q = torch.full((128, 8), 0x22, dtype=torch.uint8)  # e2m1 1.0 in both nibbles
    s = swizzle(codes.view(FP8).reshape(128, 1))
    out = nt.dequant_fp16(q, s).float()
    want = codes.view(FP8).float()
    assert torch.equal(out[:127], want[:127].unsqueeze(1).expand(127, 16))
    assert out[127].isnan().all()


# ----------------------------------------------------------------------------
# Interpreter: GEMMs
# ----------------------------------------------------------------------------


def _poison_mm_output(monkeypatch):
    real = nt.nv.mm_output
    monkeypatch.setattr(nt.nv, "mm_output", lambda a, b, dt: poison_(real(a, b, dt)))


TT = "triton"
INTERP_CONFIGS = [
    nt.GemmConfig(16, 16, 64, decode=TT),
    nt.GemmConfig(32, 16, 128, split_k=2, decode=TT),
    nt.GemmConfig(16, 32, 64, split_k=3, group_n=2, decode=TT),
]


@interp
@pytest.mark.parametrize("cfg", INTERP_CONFIGS + [nt.GemmConfig(16, 16, 64, decode=TT, predecode_x=True)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("m", [0, 1, 3, 17])
def test_w4a4_exact(monkeypatch, cfg, m):
    _poison_mm_output(monkeypatch)
    n, k = 40, 160  # N, K not multiples of the tiles; K % 64 != 0
    qa, sa = quantized(m, k, "cpu", scale=3.0, gs=10.0)
    qb, sb = quantized(n, k, "cpu", scale=0.1, gs=3000.0)
    alpha = torch.tensor(0.37)
    bias = torch.randn(n)
    out = nt.run_mm(qa, qb, sa, sb, alpha, torch.float32, bias, cfg)
    ref = ref_mm(decode(qa, sa), decode(qb, sb), alpha, bias)
    assert out.shape == (m, n) and not out.isnan().any()
    if m:
        assert rel_err(out, ref) < 1e-5


@interp
@pytest.mark.parametrize("cfg", INTERP_CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
def test_w4a16_exact(monkeypatch, cfg, xdtype):
    _poison_mm_output(monkeypatch)
    m, n, k = 17, 24, 96
    wide = torch.randn(m, k + 32).to(xdtype)
    x = wide[:, 16:16 + k]  # strided rows
    qb, sb = quantized(n, k, "cpu", scale=0.5, gs=500.0)
    alpha = torch.tensor(1.5)
    out = nt.run_w4a16(x, qb, sb, alpha, torch.float32, None, cfg)
    ref = ref_mm(x.double(), decode(qb, sb), alpha, None)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5


@interp
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [0, 1, 19])
def test_predecode_w_paths(out_dtype, m):
    """predecode_w: transient 16-bit ``alpha * deq(b)`` + F.linear; one extra
    rounding of the scaled weight, so bf16-level agreement with float64."""
    n, k = 40, 160
    cfg = nt.GemmConfig(128, 256, 64, predecode_w=True, decode=TT)
    qa, sa = quantized(m, k, "cpu", scale=3.0, gs=10.0)
    qb, sb = quantized(n, k, "cpu", scale=0.1, gs=3000.0)
    alpha, bias = torch.tensor(3.7e-4), torch.randn(n)  # fp16 outputs stay finite
    out = nt.run_mm(qa, qb, sa, sb, alpha, out_dtype, bias, cfg)
    assert out.shape == (m, n) and out.dtype == out_dtype
    x = torch.randn(m, k).to(out_dtype)
    out16 = nt.run_w4a16(x, qb, sb, alpha, out_dtype, None, cfg)
    assert out16.shape == (m, n) and out16.dtype == out_dtype
    if m:
        assert rel_err(out, ref_mm(decode(qa, sa), decode(qb, sb), alpha, bias)) < 1e-2
        assert rel_err(out16, ref_mm(x.double(), decode(qb, sb), alpha, None)) < 1e-2
    # weight scaling is exact without a factor and a plain product with one
    wd = nt.dequant(qb, sb, torch.float32, alpha)
    assert rel_err(wd, decode(qb, sb) * 3.7e-4) < 1e-6


def test_predecode_w_only_for_16_bit_outputs():
    cfg = nt.GemmConfig(128, 256, 64, predecode_w=True, decode="triton")
    assert nt.config_ok(cfg, _problem(4096))[0]
    p32 = Problem(Family.NVFP4, torch.device("cpu"), 4096, 4096, 4096, torch.uint8, torch.float32, 4096,
                  (("bias", False), ("w4a16", False)))
    assert not nt.config_ok(cfg, p32)[0]
    assert not nt.default_config(p32).predecode_w
    # opt-in only (a transient 16-bit weight copy per call, one more rounding)
    assert nt.default_config(_problem(4096)).predecode_w == (os.environ.get("SCALEDMM_NVFP4_PREDECODE_W") == "1")
    assert not nt.config_ok(dataclasses.replace(cfg, predecode_x=True), _problem(4096))[0]


def test_split_fills_the_sms():
    p = _problem(1)
    cfg = nt.default_config(p)
    tiles = -(-p.n // cfg.block_n)
    assert tiles * cfg.split_k >= nt.CTAS_PER_SM * nt._sm_count(p.device) or \
        (p.k // cfg.block_k) // (2 * cfg.split_k) < nt.MIN_STEPS_PER_SPLIT


def test_mid_m_defaults_follow_the_measured_rule(monkeypatch):
    monkeypatch.setattr(nt, "_sm_count", lambda device: 132)
    for n, k, split, pre in ((6144, 4096, 4, False), (4096, 4096, 8, False), (28672, 4096, 2, True),
                             (4096, 14336, 8, False)):
        cfg = nt.default_config(_problem(64, n, k))
        auto = nt._split_for(cfg, 64, n, k, torch.device("cpu"))
        assert (cfg.split_k, cfg.predecode_x) == (split, pre), (n, cfg)
        assert auto in (2 * split, split)
        assert nt.config_ok(cfg, _problem(64, n, k))[0]
    w16 = nt.default_config(_problem(64, 6144, 4096, w4a16=True))  # W4A16: the plain rule
    assert w16.split_k == nt._split_for(w16, 64, 6144, 4096, torch.device("cpu")) and not w16.predecode_x
    assert nt.default_config(_problem(16, 6144, 4096)).split_k == 8  # other buckets unchanged


def test_quant_configs():
    assert nt.quant_config_ok(nt.DEFAULT_QUANT)[0]
    assert all(nt.quant_config_ok(c)[0] for c in nt.QUANT_CANDIDATES + tuple(QCFGS + QCFGS_STEPS))
    assert {c.variant for c in nt.QUANT_CANDIDATES} == set(ntq.VARIANTS)
    Q = nt.QuantConfig
    bad = [Q(24, 8, 4), Q(32, 8, 4, "nope"), Q(64, 32, 4, "rows_fma"),  # > 32 rows per program
           Q(2, 32, 4, "rows_fma"),                                    # < one loop step (4 rows)
           Q(32, 256, 4, "rows_pred"), Q(32, 4, 1, "rows_fma"), Q(32, 32, 16, "rows_fma"),
           Q(32, 32, 4, "rows_fma", 3), Q(32, 8, 4, prefetch=2)]
    for cfg in bad:
        assert not nt.quant_config_ok(cfg)[0], cfg
    assert Q(32, 32, 4, "rows_fma").rows_per_step() == 4 and len({c.label() for c in nt.QUANT_CANDIDATES}) == \
        len(nt.QUANT_CANDIDATES)


@interp
def test_split_k_counters_are_per_call(monkeypatch):
    """Every split-K launch gets its own zeroed counters, one per output tile,
    and the module keeps none (a buffer kept across calls would land in a
    CUDA-graph pool and be shared by every graph that captured it).  Non-zero
    counters leave the output unwritten, so the reference checks can fail."""
    handed = []
    real = nt._tile_counters

    def spy(device, tiles):
        t = real(device, tiles)
        handed.append((tiles, t.dtype, t.clone()))
        return t

    monkeypatch.setattr(nt, "_tile_counters", spy)
    qa, sa = quantized(5, 256, "cpu")
    qb, sb = quantized(40, 256, "cpu", gs=20.0)
    ref = ref_mm(decode(qa, sa), decode(qb, sb), 1.0, None)
    cfgs = (nt.GemmConfig(16, 16, 64, split_k=4, decode=TT), nt.GemmConfig(32, 16, 64, split_k=3, decode=TT))
    for cfg in cfgs:
        for _ in range(2):
            out = nt.run_mm(qa, qb, sa, sb, torch.tensor(1.0), torch.float32, None, cfg)
            assert rel_err(out, ref) < 1e-5
    assert [(n, dt) for n, dt, _ in handed] == [(3, torch.int32)] * 2 + [(2, torch.int32)] * 2
    assert all(not c.any() for _, _, c in handed)
    held = [n for n, v in vars(nt).items() if isinstance(v, torch.Tensor)
            or (isinstance(v, dict) and any(isinstance(x, torch.Tensor) for x in v.values()))]
    assert not held, held
    monkeypatch.setattr(nt, "_tile_counters", lambda device, tiles: torch.full((tiles,), 9, dtype=torch.int32))
    out = poison_(torch.empty(5, 40))
    monkeypatch.setattr(nt.nv, "mm_output", lambda *a: out)
    nt.run_mm(qa, qb, sa, sb, torch.tensor(1.0), torch.float32, None, cfgs[0])
    assert out.isnan().all()


@interp
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_mm_half_outputs_and_bias_dtypes(out_dtype):
    m, n, k = 5, 48, 64
    qa, sa = quantized(m, k, "cpu")
    qb, sb = quantized(n, k, "cpu", gs=100.0)
    bias = torch.randn(n).to(out_dtype)
    out = nt.run_mm(qa, qb, sa, sb, torch.tensor(0.01), out_dtype, bias, INTERP_CONFIGS[0])
    ref = ref_mm(decode(qa, sa), decode(qb, sb), 0.01, bias)
    assert out.dtype == out_dtype
    # one rounding to out_dtype (the interpreter truncates bf16: 2 ulps)
    assert ((out.double() - ref).abs() <= 2 * 2.0 ** -7 * ref.abs() + 1e-6).all()


@interp
@settings(max_examples=8)
@given(m=st.integers(1, 20), n=st.integers(1, 40), groups=st.integers(1, 9), w4a16=st.booleans(),
       cfg=st.sampled_from(INTERP_CONFIGS), log_ws=st.integers(-8, 8))
def test_mm_hypothesis(m, n, groups, w4a16, cfg, log_ws):
    k = 16 * groups
    qb, sb = quantized(n, k, "cpu", scale=2.0 ** log_ws, gs=448 * 6 / 2.0 ** (log_ws + 2))
    alpha = torch.tensor(0.5)
    if w4a16:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        out = nt.run_w4a16(x, qb, sb, alpha, torch.float32, None, cfg)
        ref = ref_mm(x.double(), decode(qb, sb), alpha, None)
    else:
        qa, sa = quantized(m, k, "cpu", scale=3.0, gs=100.0)
        out = nt.run_mm(qa, qb, sa, sb, alpha, torch.float32, None, cfg)
        ref = ref_mm(decode(qa, sa), decode(qb, sb), alpha, None)
    assert rel_err(out, ref) < 1e-5


# ----------------------------------------------------------------------------
# Interpreter: through the ops (registry, opcheck, compile, fake tensors, errors)
# ----------------------------------------------------------------------------


def _op_args(m=3, n=32, k=64, device="cpu"):
    qa, sa = quantized(m, k, device)
    qb, sb = quantized(n, k, device, gs=50.0)
    return qa, qb, sa, sb, torch.tensor(0.25, device=device)


@interp
def test_backend_is_selected_and_supported():
    dev = torch.device("cpu")
    assert nt.is_supported(dev)[0]
    p = Problem(Family.NVFP4, dev, 3, 32, 64, torch.uint8, torch.bfloat16, 64, (("bias", False), ("w4a16", False)))
    assert scaledmm.backends.get("nvfp4", "triton").check(p)[0]
    with scaledmm.use_backend("nvfp4", "triton") as b:
        assert b.name == "triton"
        qa, qb, sa, sb, alpha = _op_args()
        out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha, torch.float32)
    assert rel_err(out, ref_mm(decode(qa, sa), decode(qb, sb), alpha, None)) < 1e-5


@interp
def test_ops_opcheck():
    qa, qb, sa, sb, alpha = _op_args()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with scaledmm.use_backend("nvfp4", "triton"):
        opcheck(torch.ops.scaledmm.nvfp4_quant.default, (x, torch.tensor(30.0), True))
        opcheck(torch.ops.scaledmm.nvfp4_quant.default, (x, torch.tensor(30.0), False))
        opcheck(torch.ops.scaledmm.nvfp4_mm.default, (qa, qb, sa, sb, alpha, torch.bfloat16, torch.randn(32)))
        opcheck(torch.ops.scaledmm.nvfp4_w4a16_mm.default, (x, qb, sb, alpha, torch.float16, None))


@interp
def test_ops_compile_dynamic_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    qa, qb, sa, sb, alpha = _op_args(m=5)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    gs = torch.tensor(4.0)

    def f(x, gs, qb, sb, alpha):  # custom ops only: Inductor needs no C++ compiler
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gs)
        return torch.ops.scaledmm.nvfp4_mm(q, qb, s, sb, alpha, torch.float32)

    with scaledmm.use_backend("nvfp4", "triton"):
        eager = f(x, gs, qb, sb, alpha)
        compiled = torch.compile(f, fullgraph=True, dynamic=True)
        for m in (5, 3, 0):
            xm = x[:m].contiguous()
            assert torch.equal(compiled(xm, gs, qb, sb, alpha), f(xm, gs, qb, sb, alpha))
    assert eager.shape == (5, 32)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.empty(7, 64, dtype=torch.bfloat16))
        q, s = torch.ops.scaledmm.nvfp4_quant(fx, mode.from_tensor(alpha))
        assert q.shape == (7, 32) and s.shape == (128, 4) and s.dtype == FP8


@interp
def test_ops_bad_inputs_raise():
    qa, qb, sa, sb, alpha = _op_args()
    with scaledmm.use_backend("nvfp4", "triton"):
        with pytest.raises(ValueError, match="b_scales"):
            torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb[:64], alpha)
        with pytest.raises(ValueError, match="x"):
            torch.ops.scaledmm.nvfp4_quant(torch.randn(2, 24), alpha, True)
        with pytest.raises(ValueError, match="alpha"):
            torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, torch.ones(2))


# ----------------------------------------------------------------------------
# CPU: the inline-PTX decoders on a PTX emulator, the config space
# ----------------------------------------------------------------------------


def _f16(bits):
    return np.asarray(bits, dtype=np.uint16).view(np.float16)


def _to_bf16_bits(v):
    return torch.from_numpy(np.asarray(v, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy() \
        .astype(np.uint32) & 0xFFFF


def _bf16_f64(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def _emulate(asm: str, regs: dict) -> dict:
    """Vectorized emulation (uint32 numpy arrays) of the PTX the decoders use."""
    env = dict(regs)

    def val(t):
        t = t.strip()
        return np.uint32(int(t, 16)) if t.startswith("0x") else env[t]

    for line in asm.split("\n"):
        line = line.strip().rstrip(";")
        if not line or line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if rest.startswith("{"):  # mov.b32 {h0, h1}, src
            lo_hi, src = rest.split("},")
            h0, h1 = (t.strip() for t in lo_hi.strip("{ ").split(","))
            env[h0], env[h1] = val(src) & 0xFFFF, val(src) >> 16
            continue
        a = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            env[a[0]] = val(a[1]) + np.zeros_like(env["$4"])
        elif op == "and.b32":
            env[a[0]] = val(a[1]) & val(a[2])
        elif op == "shl.b32":
            env[a[0]] = (val(a[1]) << np.uint32(int(a[2]))) & np.uint32(0xFFFFFFFF)
        elif op == "shr.b32":
            env[a[0]] = val(a[1]) >> np.uint32(int(a[2]))
        elif op == "prmt.b32":  # default mode: selector nibble i picks byte i
            x, y, sel = val(a[1]), val(a[2]), int(a[3], 16)
            pool = [(x >> np.uint32(8 * i)) & 0xFF for i in range(4)] + [(y >> np.uint32(8 * i)) & 0xFF for i in range(4)]
            out = np.zeros_like(x)
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                byte = pool[nib & 7]
                if nib & 8:
                    byte = np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0))
                out |= byte << np.uint32(8 * i)
            env[a[0]] = out
        elif op == "lop3.b32":
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), int(a[4], 16)
            out = np.zeros_like(x)
            for idx in range(8):
                if lut >> idx & 1:
                    fx = x if idx & 4 else ~x
                    fy = y if idx & 2 else ~y
                    fz = z if idx & 1 else ~z
                    out |= fx & fy & fz
            env[a[0]] = out
        elif op == "mul.rn.f16x2":  # fp16 x fp16 is exact in fp32, one rounding to fp16
            x, y = val(a[1]), val(a[2])
            lo = (_f16(x & 0xFFFF).astype(np.float32) * _f16(y & 0xFFFF).astype(np.float32)).astype(np.float16)
            hi = (_f16(x >> 16).astype(np.float32) * _f16(y >> 16).astype(np.float32)).astype(np.float16)
            env[a[0]] = lo.view(np.uint16).astype(np.uint32) | (hi.view(np.uint16).astype(np.uint32) << 16)
        elif op == "fma.rn.bf16x2":  # exact in float64, one rounding to bf16
            x, y, z = val(a[1]), val(a[2]), val(a[3])
            halves = [_bf16_f64((x >> s) & 0xFFFF) * _bf16_f64((y >> s) & 0xFFFF) + _bf16_f64((z >> s) & 0xFFFF)
                      for s in (np.uint32(0), np.uint32(16))]
            env[a[0]] = _to_bf16_bits(halves[0]) | (_to_bf16_bits(halves[1]) << 16)
        elif op == "cvt.f32.f16":
            env[a[0]] = _f16(val(a[1])).astype(np.float32)
        elif op == "cvt.rn.bf16x2.f32":
            env[a[0]] = _to_bf16_bits(env[a[2]]) | (_to_bf16_bits(env[a[1]]) << 16)
        else:
            raise AssertionError(f"emulator lacks {op}")
    return env


@parent
@pytest.mark.parametrize("kind", ["f16", "bf16", "bf16_direct"])
def test_ptx_decoders_on_emulator(kind):
    """Every byte value with every finite e4m3 scale: the PTX gives the fp16 /
    bf16 pair [hi * s : lo * s] * 2**-fold of byte j, bit for bit (signs too)."""
    asm = {"f16": nt._PTX_F16, "bf16": nt._PTX_BF16, "bf16_direct": nt._PTX_BF16_DIRECT}[kind].value
    scales = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(FP8).double()  # 0 .. 448
    byte = np.repeat(np.arange(256, dtype=np.uint32), len(scales))
    sc = np.tile(scales.numpy(), 256)
    rng = np.random.default_rng(0)
    other = rng.integers(0, 256, (3, byte.size), dtype=np.uint32)
    regs = {}
    for j in range(4):  # put the byte under test at every position j
        pos = [other[(j + i) % 3] for i in range(3)]
        bytes4 = pos[:j] + [byte] + pos[j:]
        regs[j] = bytes4[0] | (bytes4[1] << 8) | (bytes4[2] << 16) | (bytes4[3] << 24)
    if kind == "bf16_direct":
        s_bits = _to_bf16_bits(sc * 2.0 ** 119)
        fold = 2.0 ** 7
    else:
        s_bits = np.asarray(sc, np.float16).view(np.uint16).astype(np.uint32)
        fold = 2.0 ** 14
    s_pair = s_bits | (s_bits << 16)
    codes = torch.from_numpy(byte.astype(np.int64))
    lo_c, hi_c = codes & 15, codes >> 4
    val = lambda c: (E2M1[c & 7] * torch.where(c >= 8, -1.0, 1.0).double()).numpy()  # noqa: E731
    want_lo, want_hi = val(lo_c) * sc, val(hi_c) * sc
    for j in range(4):
        env = _emulate(asm, {"$4": regs[j], "$5": s_pair, "$6": s_pair, "$7": s_pair, "$8": s_pair})
        out = env[f"${j}"]
        if kind == "f16":
            lo, hi = _f16(out & 0xFFFF).astype(np.float64), _f16(out >> 16).astype(np.float64)
        else:
            lo, hi = _bf16_f64(out & 0xFFFF), _bf16_f64(out >> 16)
        np.testing.assert_array_equal(lo * fold, want_lo)
        np.testing.assert_array_equal(hi * fold, want_hi)
        np.testing.assert_array_equal(np.signbit(lo), np.signbit(want_lo))
        np.testing.assert_array_equal(np.signbit(hi), np.signbit(want_hi))


def _problem(m, n=4096, k=4096, w4a16=False, device="cpu"):
    return Problem(Family.NVFP4, torch.device(device), m, n, k, torch.bfloat16 if w4a16 else torch.uint8,
                   torch.bfloat16, k, (("bias", False), ("w4a16", w4a16)))


def test_config_predicate():
    p = _problem(16)
    assert nt.config_ok(nt.GemmConfig(64, 16, 256, decode="triton"), p)[0]
    bad = [nt.GemmConfig(48, 16, 256, decode="triton"),           # not a power of two
           nt.GemmConfig(64, 8, 256, decode="triton"),            # block_m < 16
           nt.GemmConfig(64, 16, 32, decode="triton"),            # block_k < 64
           nt.GemmConfig(64, 16, 256, split_k=17, decode="triton"),
           nt.GemmConfig(64, 16, 256),                            # PTX decoder on the CPU
           nt.GemmConfig(64, 16, 256, decode="nope")]
    for cfg in bad:
        assert not nt.config_ok(cfg, p)[0], cfg
    assert not nt.config_ok(nt.GemmConfig(64, 16, 256, decode="triton", predecode_x=True),
                            _problem(16, w4a16=True))[0]
    big = nt.GemmConfig(256, 256, 512, num_stages=8)
    assert not nt.config_ok(big, _problem(4096, device="cuda"), torch.device("cuda"))[0]  # shared memory


def test_default_and_candidate_configs_are_valid():
    for m in (1, 16, 17, 64, 65, 256, 257, 4096):
        for w4a16 in (False, True):
            p = _problem(m, w4a16=w4a16)
            cfg = nt.default_config(p)
            assert nt.config_ok(cfg, p)[0] and cfg.decode == "triton"
            assert all(nt.config_ok(c, p)[0] for c in nt.candidate_configs(p))
    for m, b in ((1, 0), (16, 0), (17, 1), (64, 1), (65, 2), (256, 2), (257, 3)):
        assert nt.m_bucket(m) == b
    for b, cfg in nt.DEFAULT_CONFIGS.items():
        for w4a16 in (False, True):
            ok, why = nt.config_ok(cfg, _problem(16, w4a16=w4a16, device="cuda"), torch.device("cuda"))
            assert ok, (b, why)


@parent
def test_not_supported_on_cpu_without_interpreter():
    if nt.interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process")
    ok, why = nt.is_supported(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET" in why


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------

LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
GPU_DECODES = ["ptx", "ptx_direct", "triton"]


@requires_cuda
@pytest.mark.parametrize("cfg", nt.QUANT_CANDIDATES, ids=lambda c: c.label())
@pytest.mark.parametrize("m", [1, 3, 17, 130, 1000])
@pytest.mark.parametrize("swz", [True, False])
def test_gpu_quant_exact(cfg, m, swz):
    x = (torch.randn(m, 7168, device="cuda") * 4).to(torch.bfloat16)
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # ties (s = 1)
    gs = torch.tensor(1.0, device="cuda")
    q, s = nt.quant(x, gs, swz, cfg)
    q_ref, s_ref = spec_quant(x.cpu(), gs.cpu(), swz)
    assert _same(q.cpu(), q_ref) and _same(s.cpu(), s_ref)


@requires_cuda
@pytest.mark.parametrize("cfg", [c for c in nt.QUANT_CANDIDATES if c.variant != "split8"], ids=lambda c: c.label())
def test_gpu_quant_special_values_and_dtypes(cfg):
    x = _special_rows()
    xs = torch.cat([x, -x, x * 1e-3, x * 7.0], 1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for g in (1.0, 0.37, 3000.0):
            q, s = nt.quant(xs.to(dtype).cuda(), torch.tensor(g, device="cuda"), False, cfg)
            qr, sr = spec_quant(xs.to(dtype), torch.tensor(g), False)
            ok = ~torch.isnan(sr.float()).repeat_interleave(8, 1)
            assert _same(s.cpu(), sr) and torch.equal(q.cpu()[ok], qr[ok]), (dtype, g)


def _gpu_case(m, n, k, seed=0):
    """Quantized operands (the op module's reference quantizer, on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qa, sa = nt.nv.reference_quant(torch.randn(m, k, generator=g, device="cuda") * 2,
                                   torch.tensor(300.0, device="cuda"), True)
    qb, sb = nt.nv.reference_quant(torch.randn(n, k, generator=g, device="cuda") * 0.02,
                                   torch.tensor(40000.0, device="cuda"), True)
    return qa, sa, qb, sb


@requires_cuda
@pytest.mark.parametrize("n,k", LLAMA8B)
@pytest.mark.parametrize("m", [1, 16, 17, 130])
def test_gpu_w4a4_default_config(monkeypatch, n, k, m):
    _poison_mm_output(monkeypatch)
    qa, sa, qb, sb = _gpu_case(m, n, k)
    alpha = torch.tensor(1 / (300.0 * 40000.0), device="cuda")
    bias = torch.randn(n, device="cuda")
    with scaledmm.use_backend("nvfp4", "triton"):
        out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha, torch.float32, bias)
    ref = ref_mm(decode(qa, sa), decode(qb, sb), alpha.item(), bias)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5


@requires_cuda
@pytest.mark.parametrize("decode_mode", GPU_DECODES)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_gpu_w4a16_decoders(decode_mode, xdtype, m):
    n, k = 1000, 1536
    _, _, qb, sb = _gpu_case(1, n, k, seed=m)
    # tiny block scales too: products land in the fp16 / bf16 subnormal range
    sb_tiny = sb.view(torch.uint8).clone()
    sb_tiny[:64] = (sb_tiny[:64] % 8)  # e4m3 subnormal scales
    sb_tiny = sb_tiny.view(FP8)
    x = torch.randn(m, k, device="cuda").to(xdtype)
    for scales in (sb, sb_tiny):
        ref = ref_mm(x.double(), decode(qb, scales), 2.0, None)
        for cfg in (nt.GemmConfig(64, 16, 256, decode=decode_mode, num_stages=4),
                    nt.GemmConfig(128, 64, 64, split_k=2, decode=decode_mode, num_warps=8),
                    nt.GemmConfig(64, 32, 128, split_k=3, decode=decode_mode)):
            out = nt.run_w4a16(x, qb, scales, torch.tensor(2.0, device="cuda"), torch.float32, None, cfg)
            assert rel_err(out, ref) < 1e-5, (cfg.label(), rel_err(out, ref))


@requires_cuda
@pytest.mark.parametrize("cfg", [nt.GemmConfig(64, 16, 256, num_stages=4),
                                 nt.GemmConfig(128, 128, 64, num_warps=8),
                                 nt.GemmConfig(128, 256, 64, num_warps=8, predecode_x=True),
                                 nt.GemmConfig(64, 16, 128, split_k=4),
                                 nt.GemmConfig(64, 32, 128, decode="triton")], ids=lambda c: c.label())
@pytest.mark.parametrize("m", [1, 3, 129, 1000])
def test_gpu_w4a4_configs(cfg, m):
    n, k = 520, 2080  # N % 64 != 0, K % 64 != 0
    qa, sa, qb, sb = _gpu_case(m, n, k, seed=m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = nt.run_mm(qa, qb, sa, sb, torch.tensor(1e-4, device="cuda"), torch.float32, bias, cfg)
    ref = ref_mm(decode(qa, sa), decode(qb, sb), 1e-4, bias)
    assert rel_err(out, ref) < 1e-5


@requires_cuda
def test_gpu_strided_and_zero_rows():
    n, k = 256, 512
    qa, sa, qb, sb = _gpu_case(7, n, k)
    wide = torch.zeros(7, k // 2 + 64, dtype=torch.uint8, device="cuda")
    wide[:, 32:32 + k // 2] = qa
    alpha = torch.tensor(1.0, device="cuda")
    with scaledmm.use_backend("nvfp4", "triton"):
        out = torch.ops.scaledmm.nvfp4_mm(wide[:, 32:32 + k // 2], qb, sa, sb, alpha, torch.float32)
        empty = torch.ops.scaledmm.nvfp4_mm(qa[:0], qb, sa[:0], sb, alpha, torch.float32)
    assert empty.shape == (0, n)
    assert rel_err(out, ref_mm(decode(qa, sa), decode(qb, sb), 1.0, None)) < 1e-5


@requires_cuda
def test_gpu_cuda_graph_capture_and_replay():
    n, k = 4096, 4096
    qa, sa, qb, sb = _gpu_case(16, n, k)
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    gs = torch.tensor(100.0, device="cuda")
    alpha = torch.tensor(1e-3, device="cuda")

    def step():
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gs)
        return (torch.ops.scaledmm.nvfp4_mm(q, qb, s, sb, alpha),
                torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, alpha))

    with scaledmm.use_backend("nvfp4", "triton"):
        eager = step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        again = step()
    for a, b in zip(captured, again):
        assert torch.equal(a, b)
    assert not torch.equal(captured[0], eager[0])


@requires_cuda
def test_gpu_autotune(monkeypatch):
    monkeypatch.setenv("SCALEDMM_NVFP4_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(nt, "_TUNED", {})
    real = nt.candidate_configs
    monkeypatch.setattr(nt, "candidate_configs", lambda p: real(p)[:3])  # keep compile time short
    qa, sa, qb, sb = _gpu_case(8, 512, 1024)
    alpha = torch.tensor(1e-4, device="cuda")
    out = nt.mm(qa, qb, sa, sb, alpha, torch.float32, None)
    assert len(nt._TUNED) == 1
    cfg = next(iter(nt._TUNED.values()))
    assert nt.config_ok(cfg, nt.nv.mm_problem(qa, qb, torch.float32, None))[0]
    assert rel_err(out, ref_mm(decode(qa, sa), decode(qb, sb), 1e-4, None)) < 1e-5


@requires_cuda
def test_gpu_ops_opcheck_and_compile():
    qa, sa, qb, sb = _gpu_case(5, 256, 256)
    alpha = torch.tensor(0.5, device="cuda")
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    with scaledmm.use_backend("nvfp4", "triton"):
        opcheck(torch.ops.scaledmm.nvfp4_quant.default, (x, torch.tensor(9.0, device="cuda"), True))
        opcheck(torch.ops.scaledmm.nvfp4_mm.default, (qa, qb, sa, sb, alpha, torch.bfloat16, None))
        opcheck(torch.ops.scaledmm.nvfp4_w4a16_mm.default, (x, qb, sb, alpha, torch.float16, None))
        f = torch.compile(lambda x: torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, alpha), fullgraph=True,
                          dynamic=True)
        for m in (5, 1, 3):
            assert torch.equal(f(x[:m]), torch.ops.scaledmm.nvfp4_w4a16_mm(x[:m], qb, sb, alpha))
