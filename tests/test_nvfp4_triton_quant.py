"""The NVFP4 Triton quantizer (``ops/nvfp4_triton_quant.py``) against the SPEC
reference, bit for bit: every kernel variant, odd shapes, dtypes, strided rows,
ties and special values.

Interpreter tests (``@interp``) run the kernels in Triton's CPU interpreter.
``TRITON_INTERPRET`` must be set before Triton is first imported, and other
test files import Triton in compiled mode, so these tests never run in the
main pytest process: :func:`test_interpreter_suite` re-runs this file in a
subprocess with ``TRITON_INTERPRET=1`` (and ``SCALEDMM_NVFP4_INTERP_CHILD=1``),
where only they run.  Small shapes.

References (``nvfp4_triton_helpers``) are written from SPEC.md, independently
of ``ops/nvfp4.py``.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledmm.ops import nvfp4_triton as nt
from scaledmm.ops import nvfp4_triton_quant as nt_quant
from scaledmm.ops import nvfp4_triton_decode as nd
from helpers import poison_
from nvfp4_triton_helpers import (
    CHILD, interp, parent, QCFGS, QCFGS_STEPS, run_interpreter_child, same_bits, spec_quant, special_rows,
    swizzle, swz_offsets,
)

FP8 = torch.float8_e4m3fn
RANGE = 448.0 * 6.0


# ----------------------------------------------------------------------------
# The interpreter subprocess (main process)
# ----------------------------------------------------------------------------


@parent
def test_interpreter_suite():
    run_interpreter_child(__file__)


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


def _check_quant(x, gs, swz, cfg):
    q, s = nt.quant(x, gs, swz, cfg)
    q_ref, s_ref = spec_quant(x, gs, swz)
    assert same_bits(q, q_ref), (cfg.label(), int((q != q_ref).sum()))
    assert same_bits(s, s_ref), (cfg.label(), int((s.view(torch.uint8) != s_ref.view(torch.uint8)).sum()))
    return q, s


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


@interp
@pytest.mark.parametrize("cfg", QCFGS, ids=lambda c: c.label())
def test_quant_ties_and_special_values(cfg):
    x = special_rows()
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
       cfg=st.sampled_from(QCFGS + QCFGS_STEPS), seed=st.integers(0, 2**31 - 1))
def test_quant_hypothesis(m, groups, log_scale, log_gs, swz, pad, dtype, cfg, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
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
        assert same_bits(q, q2) and same_bits(s, s2)


def _dynamic_ref(x, x_amax, wa, swz):
    """SPEC's quantizer with the scales of ``nvfp4_dynamic_linear``, computed
    in float64 and rounded once (the kernel's IEEE divisions)."""
    amax = max([1e-30] + [float(v) for v in x_amax])
    amax = float(torch.tensor(amax, dtype=torch.float32))
    gs = torch.tensor(RANGE / amax, dtype=torch.float64).float()
    alpha = torch.tensor(float(wa) / float(gs), dtype=torch.float64).float().reshape(1)
    return spec_quant(x, gs, swz) + (alpha,)


@interp
@pytest.mark.parametrize("cfg", QCFGS + QCFGS_STEPS[:1], ids=lambda c: c.label())
def test_quant_dynamic_exact(monkeypatch, cfg):
    """``quant_dynamic``: the global scale from amax vectors of every length
    (per row; one; 300 more; more than a program reduces itself, which are
    reduced first; one above the rows' maximum) and alpha = weight_alpha / gs, against a float64 computation and
    SPEC's quantizer; poisoned outputs, odd shapes, strided rows."""
    _poison_quant_outputs(monkeypatch)
    for m, k in ((1, 16), (3, 48), (17, 400), (130, 32)):
        wide = (torch.randn(m, k + 8) * 3).to(torch.bfloat16)
        for x in (wide[:, :k], wide[:, 8:]):
            per_row = x.float().abs().amax(dim=1)
            def more(n):  # per_row after n smaller values
                return torch.cat([torch.rand(n) * 0.1, per_row])

            for x_amax in (per_row, per_row.amax().reshape(1), more(300), more(nt_quant.DYNAMIC_MAX_AMAX + 77)):
                wa = torch.rand(1) * 1e-2
                q, s, alpha = nt.quant_dynamic(x, x_amax, wa, True, cfg)
                q_ref, s_ref, a_ref = _dynamic_ref(x, x_amax, wa, True)
                assert same_bits(q, q_ref) and same_bits(s, s_ref), (m, k, x_amax.numel())
                assert alpha.shape == (1,) and alpha.dtype == torch.float32 and torch.equal(alpha, a_ref)
            if m == 130:  # a partial maximum above every row's decides (the compile pass's per-2048 maxima)
                x_amax = torch.cat([per_row, per_row.amax().reshape(1) * 1.5, per_row])
                _, _, alpha = nt.quant_dynamic(x, x_amax, wa, True, cfg)
                assert torch.equal(alpha, _dynamic_ref(x, x_amax, wa, True)[2])


@interp
def test_quant_dynamic_floor_nan_and_empty():
    """All-zero activation: the floor (every code and scale 0); a NaN amax
    gives NaN scales and alpha; M = 0: no launch, alpha still written;
    a split8 config is replaced by the rows kernel the dynamic mode needs."""
    wa = torch.tensor(0.5)
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    q, s, alpha = nt.quant_dynamic(x, torch.zeros(4), wa, False)
    assert not q.any() and not s.view(torch.uint8).any()
    assert torch.equal(alpha, _dynamic_ref(x, torch.zeros(4), wa, False)[2]) and torch.isfinite(alpha).all()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    q, s, alpha = nt.quant_dynamic(x, torch.tensor([1.0, float("nan")]), wa, False)
    assert torch.isnan(s.float()).all() and alpha.isnan().all()
    q, s, alpha = nt.quant_dynamic(torch.empty(0, 32, dtype=torch.bfloat16), torch.empty(0), wa)
    assert q.shape == (0, 16) and s.shape == (0, 4) and torch.equal(alpha, _dynamic_ref(x, [], wa, True)[2])
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    got = nt.quant_dynamic(x, x.float().abs().amax(dim=1), wa, True, nt.QuantConfig(32, 8, 4))
    want = _dynamic_ref(x, x.float().abs().amax(dim=1), wa, True)
    assert all(same_bits(a, b) for a, b in zip(got, want))


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
    out = nd.dequant_fp16(q, s).float()
    want = codes.view(FP8).float()
    assert torch.equal(out[:127], want[:127].unsqueeze(1).expand(127, 16))
    assert out[127].isnan().all()
