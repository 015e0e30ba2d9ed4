"""Tests of the fp8 ops: quant_fp8 and fp8_scaled_mm (per-tensor / per-token /
per-channel scales), against float64 references, with opcheck, compile and
FakeTensor checks, bad inputs, and the cuBLAS backend on a GPU."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, strategies as st
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import scaledmm  # noqa: F401  (registers the ops)
from scaledmm import backends
from scaledmm.ops import fp8 as F8

from helpers import requires_cuda
from helpers import FP8, opcheck, poison_

OPS = torch.ops.scaledmm
U = 2.0 ** -24  # float32 unit roundoff
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NOT_POW2 = (48, 80, 96, 144, 208, 336)  # multiples of 16, not powers of two


# ----------------------------------------------------------------------------
# Inputs and float64 references
# ----------------------------------------------------------------------------


def rand_fp8(shape, gen, device="cpu") -> torch.Tensor:
    """Every finite e4m3 code equally likely (zeros, subnormals, up to +-448)."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0  # NaN codes -> +0
    return b.view(FP8).to(device)


def strided_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` as a view into a buffer with ``pad`` extra columns per row."""
    if pad == 0:
        return t
    m, k = t.shape
    buf = torch.empty((m, k + pad), dtype=t.dtype, device=t.device)
    poison_(buf)
    buf[:, :k] = t
    return buf[:, :k]


def _bcast(s: torch.Tensor, rows: bool) -> torch.Tensor:
    s = s.double()
    if s.numel() == 1:
        return s.reshape(1, 1)
    return s.reshape(-1, 1) if rows else s.reshape(1, -1)


def mm_ref64(a, b, sa, sb, bias):
    """float64 value of acc * sa * sb + bias and a bound on what float32
    evaluation of it (any summation order) can differ by."""
    a64, b64 = a.double(), b.double()
    sa64, sb64 = _bcast(sa, True), _bcast(sb, False)
    ref = (a64 @ b64.t()) * sa64 * sb64
    # the contract computes in float32: a scaled product past its range is +-inf
    ref = torch.where(ref.abs() > torch.finfo(torch.float32).max, ref.sign() * math.inf, ref)
    s = (a64.abs() @ b64.abs().t()) * (sa64 * sb64).abs()
    k = a.shape[1]
    bound = (k + 3) * U * s
    if bias is not None:
        bias64 = bias.double()
        ref = ref + bias64
        bound = bound + 2 * U * torch.where(torch.isfinite(bias64), bias64.abs(), 0.0)
    return ref, bound * 1.01 + 2.0 ** -146


def assert_mm_close(out, a, b, sa, sb, bias, out_dtype, acc_slack=0.0):
    """``out`` is the one rounding to ``out_dtype`` of some value within the
    float32 error bound of the exact result; NaN exactly where the exact
    result is NaN.  ``acc_slack`` widens the bound by ``acc_slack * sum|a*b|``
    (GPU tensor-core accumulation)."""
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[0]) and out.is_contiguous()
    ref, bound = mm_ref64(a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), None if bias is None else bias.cpu())
    if acc_slack:
        bound = bound + acc_slack * (a.cpu().double().abs() @ b.cpu().double().abs().t()) * (
            _bcast(sa.cpu(), True) * _bcast(sb.cpu(), False)).abs()
    o = out.cpu().double()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(o), nan), f"NaN pattern differs: {torch.isnan(o).sum()} vs {nan.sum()}"
    lo = (ref - bound).to(out_dtype).double()
    hi = (ref + bound).to(out_dtype).double()
    ok = ((o >= lo) & (o <= hi)) | nan
    if not ok.all():
        i = (~ok).nonzero()[0].tolist()
        raise AssertionError(f"{(~ok).sum()} elements out of bounds; first at {i}: out={o[i[0], i[1]]}, "
                             f"ref={ref[i[0], i[1]]}, bound={bound[i[0], i[1]]}")


def quant_ref(x: torch.Tensor, scale, per_token: bool):
    """Expected float32 scale (exact) and [lo, hi] brackets of the codes."""
    x64 = x.double()
    m, k = x.shape
    if scale is not None:
        s32 = scale.float().clone()
        sv = s32.double().reshape(m, 1) if per_token else s32.double().reshape(1, 1)
    else:
        if per_token:
            amax = x64.abs().amax(dim=1, keepdim=True) if k else x64.new_zeros((m, 1))
        else:
            ax = x64.abs()
            amax = torch.where(torch.isfinite(ax), ax, 0.0).amax().reshape(1) if x.numel() else x64.new_zeros(1)
        s32 = (torch.clamp(amax, min=F8.AMAX_FLOOR) / 448.0).float()
        sv = s32.double().reshape(-1, 1) if per_token else s32.double().reshape(1, 1)
    v = x64 / sv
    # SPEC rounds twice before the e4m3 rounding (fp32 1 / s, then x * that):
    # within 2**-23 (1 + 2**-25) of v, plus an fp32 subnormal's absolute error
    slack = v.abs() * 2.0 ** -22 + 2.0 ** -140
    slack = torch.where(torch.isfinite(slack), slack, 0.0)
    lo = torch.clamp(v - slack, -448, 448).to(FP8).double()
    hi = torch.clamp(v + slack, -448, 448).to(FP8).double()
    return s32, lo, hi, torch.isnan(v)


def assert_quant_ok(x, scale, per_token, q, s):
    s_ref, lo, hi, nan = quant_ref(x.cpu(), None if scale is None else scale.cpu(), per_token)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    torch.testing.assert_close(s.cpu(), s_ref, rtol=0, atol=0, equal_nan=True)
    qd = q.cpu().double()
    assert torch.equal(torch.isnan(qd), nan), "NaN pattern of q"
    ok = ((qd >= lo) & (qd <= hi)) | nan
    assert ok.all(), f"{(~ok).sum()} codes off, first at {(~ok).nonzero()[0].tolist()}"


# ----------------------------------------------------------------------------
# quant_fp8
# ----------------------------------------------------------------------------

M_VALUES = st.one_of(st.sampled_from([0, 1, 3, 4, 17]), st.integers(0, 1100))
_BIG = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}
_TINY = {torch.float32: 1e-38, torch.bfloat16: 1e-38, torch.float16: 6e-8}


def make_x(m, k, dtype, values, gen):
    x = torch.randn((m, k), generator=gen) * 10.0 ** torch.randint(-3, 4, (m, 1), generator=gen)
    if values == "zeros":
        x.zero_()
    elif values == "tiny":
        x = x.sign() * _TINY[dtype]
    elif values == "huge":
        x = x.sign() * _BIG[dtype] * torch.rand((m, k), generator=gen)
    elif values == "nonfinite" and x.numel():
        pick = torch.rand((m, k), generator=gen)
        x[pick < 0.02] = float("nan")
        x[(pick >= 0.02) & (pick < 0.04)] = float("inf")
        x[(pick >= 0.04) & (pick < 0.06)] = -float("inf")
    return x.to(dtype)


@given(m=M_VALUES, k=st.integers(1, 200), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       values=st.sampled_from(["normal", "zeros", "tiny", "huge", "nonfinite"]),
       mode=st.sampled_from(["tensor", "token", "static_tensor", "static_token"]),
       pad=st.sampled_from([0, 3, 16]), seed=st.integers(0, 2 ** 31 - 1))
def test_quant_matches_float64(m, k, dtype, values, mode, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    x = strided_rows(make_x(m, k, dtype, values, gen), pad)
    per_token = mode.endswith("token")
    scale = None
    if mode == "static_tensor":
        scale = torch.rand((), generator=gen) * 2 + 1e-3
    elif mode == "static_token":
        scale = torch.rand((m, 1), generator=gen) * 2 + 1e-3
    q, s = OPS.quant_fp8(x, scale, per_token)
    assert_quant_ok(x, scale, per_token, q, s)
    if scale is not None:
        assert s.data_ptr() != scale.data_ptr() or s.numel() == 0
        assert torch.equal(s, scale)


def test_quant_dynamic_shapes_and_floor():
    q, s = OPS.quant_fp8(torch.randn(5, 7))
    assert s.shape == (1,)
    q, s = OPS.quant_fp8(torch.randn(5, 7), None, True)
    assert s.shape == (5, 1)
    q, s = OPS.quant_fp8(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert s.item() == pytest.approx(F8.AMAX_FLOOR / 448) and torch.isfinite(s).all()
    assert torch.equal(q.view(torch.uint8), torch.zeros(4, 32, dtype=torch.uint8))
    q, s = OPS.quant_fp8(torch.zeros(0, 32))
    assert q.shape == (0, 32) and s.shape == (1,) and torch.isfinite(s).all()
    q, s = OPS.quant_fp8(torch.zeros(0, 32), None, True)
    assert q.shape == (0, 32) and s.shape == (0, 1)


def test_quant_nonfinite_rows_stay_local():
    """Per-tensor: NaN/Inf do not enter the amax; other rows keep their
    codes.  Per-token: only the bad row's scale is non-finite."""
    x = torch.randn(6, 64) * 3
    x[2, 5] = x[4, 9] = 0.0  # the finite amax must not sit where NaN / Inf go in
    ref_q, ref_s = OPS.quant_fp8(x)
    y = x.clone()
    y[2, 5] = float("nan")
    y[4, 9] = float("inf")
    q, s = OPS.quant_fp8(y)
    assert torch.equal(s, ref_s)
    keep = [0, 1, 3, 5]
    assert torch.equal(q[keep].view(torch.uint8), ref_q[keep].view(torch.uint8))
    assert torch.isnan(q[2, 5].float()) and q[4, 9].float() == 448
    q, s = OPS.quant_fp8(y, None, True)
    assert torch.isnan(s[2]).all() and torch.isinf(s[4]).all() and torch.isfinite(s[keep]).all()


def test_quant_static_saturates_and_zero_scale():
    x = torch.tensor([[1000.0, -1000.0, 1.0, 0.0]])
    q, _ = OPS.quant_fp8(x, torch.tensor(1.0))
    assert q.float().tolist() == [[448.0, -448.0, 1.0, 0.0]]
    q, _ = OPS.quant_fp8(x, torch.tensor([0.0]))  # x * (1 / 0): +-inf -> +-448, 0 * inf -> NaN
    v = q.float()[0]
    assert v[:3].tolist() == [448.0, -448.0, 448.0] and torch.isnan(v[3])


# ----------------------------------------------------------------------------
# fp8_scaled_mm numerics
# ----------------------------------------------------------------------------

_SCALE_VALUES = {"normal": None, "tiny": 1e-30, "huge": 1e25, "zero": 0.0}


def make_scale(shape, cls, gen):
    if _SCALE_VALUES[cls] is None:
        return torch.rand(shape, generator=gen) * 2 + 2.0 ** -10
    return torch.full(shape, _SCALE_VALUES[cls])


def scale_a_for(kind, m, cls, gen):
    shape = {"0d": (), "1": (1,), "11": (1, 1), "token": (m, 1)}[kind]
    return make_scale(shape, cls, gen)


def scale_b_for(kind, n, cls, gen):
    shape = {"0d": (), "1": (1,), "11": (1, 1), "n": (n,), "1n": (1, n)}[kind]
    return make_scale(shape, cls, gen)


@given(m=M_VALUES, k=st.sampled_from(NOT_POW2), n=st.sampled_from(NOT_POW2),
       pad=st.sampled_from([0, 16, 5]), out_dtype=st.sampled_from(OUT_DTYPES),
       ka=st.sampled_from(["0d", "1", "11", "token"]), kb=st.sampled_from(["0d", "1", "11", "n", "1n"]),
       ca=st.sampled_from(list(_SCALE_VALUES)), cb=st.sampled_from(list(_SCALE_VALUES)),
       bias=st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32]),
       special=st.sampled_from(["none", "nan_rows", "zero_rows", "inf_bias"]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_mm_matches_float64(m, k, n, pad, out_dtype, ka, kb, ca, cb, bias, special, seed):
    gen = torch.Generator().manual_seed(seed)
    a = rand_fp8((m, k), gen)
    nan_rows = []
    if special == "nan_rows" and m:
        nan_rows = sorted(set(torch.randint(0, m, (3,), generator=gen).tolist()))
        a.view(torch.uint8)[nan_rows, torch.randint(0, k, (1,), generator=gen).item()] = 0x7F
    if special == "zero_rows" and m:
        a.view(torch.uint8)[:: max(1, m // 3)] = 0
    a = strided_rows(a, pad)
    b = rand_fp8((n, k), gen)
    sa = scale_a_for(ka, m, ca, gen)
    sb = scale_b_for(kb, n, cb, gen)
    bt = None
    if bias is not None:
        bt = torch.randn(n, generator=gen) * 100
        if special == "inf_bias":
            bt[0], bt[-1] = float("inf"), -float("inf")
        bt = bt.to(bias)
    out = OPS.fp8_scaled_mm(a, b, sa, sb, bt, out_dtype)
    assert_mm_close(out, a, b, sa, sb, bt, out_dtype)
    if nan_rows:
        rows_nan = torch.isnan(out).any(dim=1).nonzero().flatten().tolist()
        assert rows_nan == nan_rows  # a NaN in a row of a poisons that row only
        assert torch.isnan(out[nan_rows]).all()


def test_mm_k_zero_and_n_zero():
    a = torch.zeros(3, 0, dtype=FP8)
    b = torch.zeros(32, 0, dtype=FP8)
    bias = torch.arange(32, dtype=torch.float32)
    out = OPS.fp8_scaled_mm(a, b, torch.tensor(2.0), torch.tensor(3.0), bias, torch.float32)
    assert torch.equal(out, bias.expand(3, 32))
    out = OPS.fp8_scaled_mm(torch.zeros(3, 48, dtype=FP8), torch.zeros(0, 48, dtype=FP8),
                            torch.tensor(1.0), torch.ones(0))
    assert out.shape == (3, 0)


def test_mm_nan_scales_poison_their_row_or_column():
    gen = torch.Generator().manual_seed(0)
    a, b = rand_fp8((5, 48), gen), rand_fp8((32, 48), gen)
    sa, sb = torch.ones(5, 1), torch.ones(32)
    sa[1], sb[7] = float("nan"), float("nan")
    out = OPS.fp8_scaled_mm(a, b, sa, sb, None, torch.float32)
    nan = torch.isnan(out)
    assert nan[1].all() and nan[:, 7].all() and nan.sum() == 32 + 5 - 1


def test_mm_output_is_fresh():
    gen = torch.Generator().manual_seed(1)
    a, b = rand_fp8((4, 32), gen), rand_fp8((32, 32), gen)
    bias = torch.randn(32)
    out = OPS.fp8_scaled_mm(a, b, torch.tensor(1.0), torch.tensor(1.0), bias, torch.float32)
    assert out.data_ptr() not in (a.data_ptr(), b.data_ptr(), bias.data_ptr())


# ----------------------------------------------------------------------------
# opcheck, compile, FakeTensor
# ----------------------------------------------------------------------------


def _quant_sets(device="cpu"):
    x = torch.randn(5, 48, dtype=torch.bfloat16, device=device)
    wide = torch.randn(5, 64, device=device)[:, :40]
    return [
        (x, None, False),
        (x, None, True),
        (x, torch.tensor([0.02], device=device), False),
        (x.half(), torch.rand(5, 1, device=device) + 0.01, True),
        (wide, None, False),
        (torch.randn(0, 48, device=device), None, True),
    ]


def _mm_sets(device="cpu"):
    gen = torch.Generator().manual_seed(2)
    a = rand_fp8((5, 48), gen, device)
    b = rand_fp8((32, 48), gen, device)
    a_wide = strided_rows(rand_fp8((3, 48), gen, device), 16)
    one = torch.tensor(0.5, device=device)
    return [
        (a, b, one, torch.tensor([2.0], device=device), None, torch.bfloat16),
        (a, b, torch.rand(5, 1, device=device), torch.rand(32, device=device),
         torch.randn(32, dtype=torch.bfloat16, device=device), torch.bfloat16),
        (a, b, one.reshape(1, 1), torch.rand(1, 32, device=device), torch.randn(32, device=device), torch.float16),
        (a_wide, b, torch.rand(3, 1, device=device), one, None, torch.float32),
        (a[:0], b, torch.rand(0, 1, device=device), torch.rand(32, device=device), None, torch.bfloat16),
    ]


@pytest.mark.parametrize("i", range(6))
def test_opcheck_quant(i):
    opcheck(OPS.quant_fp8.default, _quant_sets()[i])


@pytest.mark.parametrize("i", range(5))
def test_opcheck_mm(i):
    opcheck(OPS.fp8_scaled_mm.default, _mm_sets()[i])


def _quant_mm(x, w, ws, bias):
    q, s = OPS.quant_fp8(x, None, True)
    return OPS.fp8_scaled_mm(q, w, s, ws, bias, torch.bfloat16)


def test_compile_fullgraph_dynamic_one_compile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    fn = torch.compile(_quant_mm, fullgraph=True, dynamic=True, backend=cnt)
    gen = torch.Generator().manual_seed(3)
    w = rand_fp8((80, 144), gen)
    ws = torch.rand(80) + 0.01
    bias = torch.randn(80, dtype=torch.bfloat16)
    for m in (3, 17, 64, 1100, 5):
        x = torch.randn(m, 144, dtype=torch.bfloat16)
        assert torch.equal(fn(x, w, ws, bias), _quant_mm(x, w, ws, bias))
    assert cnt.frame_count == 1
    for m in (1, 0):  # 0 and 1 are specialized by dynamo: may recompile, must stay correct
        x = torch.randn(m, 144, dtype=torch.bfloat16)
        assert torch.equal(fn(x, w, ws, bias), _quant_mm(x, w, ws, bias))


def test_fake_tensor_shapes():
    with FakeTensorMode():
        x = torch.empty(7, 40, dtype=torch.float16)
        q, s = OPS.quant_fp8(x)
        assert isinstance(q, FakeTensor) and q.shape == (7, 40) and q.dtype == FP8 and s.shape == (1,)
        q, s = OPS.quant_fp8(x, None, True)
        assert s.shape == (7, 1)
        q, s = OPS.quant_fp8(x, torch.empty(1, 1))
        assert s.shape == (1, 1)
        a = torch.empty(7, 48, dtype=FP8)
        b = torch.empty(32, 48, dtype=FP8)
        out = OPS.fp8_scaled_mm(a, b, torch.empty(7, 1), torch.empty(1, 32), None, torch.float16)
        assert isinstance(out, FakeTensor) and out.shape == (7, 32) and out.dtype == torch.float16
        with pytest.raises(ValueError, match="fp8_scaled_mm: a: .*multiple of 16"):
            OPS.fp8_scaled_mm(torch.empty(7, 40, dtype=FP8), torch.empty(32, 40, dtype=FP8),
                              torch.empty(()), torch.empty(()))


# ----------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------


def _a(m=4, k=48):
    return torch.zeros(m, k, dtype=FP8)


def _b(n=32, k=48):
    return torch.zeros(n, k, dtype=FP8)


S1 = torch.tensor(1.0)
BAD_MM = [
    ("a", lambda: (torch.zeros(4, 48), _b(), S1, S1)),  # dtype
    ("a", lambda: (torch.zeros(2, 4, 48, dtype=FP8), _b(), S1, S1)),  # rank
    ("a", lambda: (_a(48, 4).t(), _b(32, 48), S1, S1)),  # inner stride 4
    ("a", lambda: (_a(4, 40), _b(32, 40), S1, S1)),  # K % 16
    ("b", lambda: (_a(), _b(24, 48), S1, S1)),  # N % 16
    ("b", lambda: (_a(), _b(32, 64), S1, S1)),  # K mismatch
    ("b", lambda: (_a(), torch.zeros(32, 48, dtype=torch.bfloat16), S1, S1)),  # dtype
    ("b", lambda: (_a(), _b(48, 32).t(), S1, S1)),  # not contiguous
    ("scale_a", lambda: (_a(), _b(), torch.ones(4), S1)),  # [M] instead of [M, 1]
    ("scale_a", lambda: (_a(), _b(), torch.ones(3, 1), S1)),  # wrong M
    ("scale_a", lambda: (_a(), _b(), torch.tensor(1.0, dtype=torch.bfloat16), S1)),  # dtype
    ("scale_b", lambda: (_a(), _b(), S1, torch.ones(32, 1))),  # [N, 1] is not accepted by the op
    ("scale_b", lambda: (_a(), _b(), S1, torch.ones(16))),  # wrong N
    ("scale_b", lambda: (_a(), _b(), S1, torch.ones(32, dtype=torch.float64))),
    ("bias", lambda: (_a(), _b(), S1, S1, torch.zeros(16))),
    ("bias", lambda: (_a(), _b(), S1, S1, torch.zeros(32, dtype=torch.int32))),
    ("out_dtype", lambda: (_a(), _b(), S1, S1, None, torch.int8)),
    ("out_dtype", lambda: (_a(), _b(), S1, S1, None, FP8)),
    ("scale_a", lambda: (_a(), _b(), torch.tensor(1.0, device="meta"), S1)),  # device mix
]
BAD_QUANT = [
    ("x", lambda: (torch.zeros(4, 8, dtype=torch.int32),)),
    ("x", lambda: (torch.zeros(4),)),
    ("x", lambda: (torch.zeros(8, 4).t(),)),
    ("x", lambda: (torch.zeros(4, 8, dtype=FP8),)),
    ("scale", lambda: (torch.zeros(4, 8), torch.ones(4, 1))),  # [M, 1] without per_token
    ("scale", lambda: (torch.zeros(4, 8), torch.ones(1), True)),  # one element with per_token
    ("scale", lambda: (torch.zeros(4, 8), torch.ones(1, dtype=torch.float16))),
    ("scale", lambda: (torch.zeros(4, 8), torch.ones(3, 1), True)),
    ("scale", lambda: (torch.zeros(4, 8), torch.ones(1, device="meta"))),
]


@pytest.mark.parametrize("arg,make", BAD_MM, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_MM)])
def test_mm_bad_inputs(arg, make):
    with pytest.raises(ValueError, match=f"^fp8_scaled_mm: {arg}: expected "):
        OPS.fp8_scaled_mm(*make())


@pytest.mark.parametrize("arg,make", BAD_QUANT, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_QUANT)])
def test_quant_bad_inputs(arg, make):
    with pytest.raises(ValueError, match=f"^quant_fp8: {arg}: expected "):
        OPS.quant_fp8(*make())


# ----------------------------------------------------------------------------
# Backend selection (CPU) and the cuBLAS backend (GPU)
# ----------------------------------------------------------------------------


def _problem(kind_a, kind_b, bias_dtype, out_dtype):
    return backends.Problem(backends.Family.FP8, torch.device("cpu"), 5, 32, 48, FP8, out_dtype, 48,
                            (("scale_a", kind_a), ("scale_b", kind_b), ("bias_dtype", bias_dtype),
                             ("b_aligned", True)))


@pytest.mark.parametrize("kind_a,kind_b,bias,out,plan", [
    ("tensor", "tensor", None, torch.float16, F8.PLAN_TENSORWISE),
    ("tensor", "tensor", torch.bfloat16, torch.bfloat16, F8.PLAN_TENSORWISE),
    ("tensor", "tensor", torch.float32, torch.bfloat16, F8.PLAN_F32_EPILOGUE),
    ("tensor", "tensor", torch.float32, torch.float32, F8.PLAN_F32_EPILOGUE),
    ("token", "channel", torch.bfloat16, torch.bfloat16, F8.PLAN_ROWWISE),
    ("tensor", "channel", None, torch.bfloat16, F8.PLAN_ROWWISE),
    ("token", "tensor", None, torch.float16, F8.PLAN_F32_EPILOGUE),
])
def test_cublas_plan(kind_a, kind_b, bias, out, plan):
    got, why = F8.cublas_plan(_problem(kind_a, kind_b, bias, out))
    assert got == plan and why


def test_cpu_selects_reference_and_cublas_reports_why():
    ok, why = backends.get("fp8", "cublas").check(_problem("tensor", "tensor", None, torch.bfloat16))
    assert not ok and "CUDA" in why
    assert backends.select(_problem("tensor", "tensor", None, torch.bfloat16), "fp8_scaled_mm").name == "reference"
    with scaledmm.use_backend("fp8", "cublas"), pytest.raises(RuntimeError, match="cublas"):
        OPS.fp8_scaled_mm(_a(), _b(), S1, S1)


GPU_CASES = [  # (scale_a kind, scale_b kind, bias dtype, out dtype)
    ("0d", "0d", None, torch.bfloat16),
    ("1", "1", torch.bfloat16, torch.bfloat16),
    ("0d", "0d", None, torch.float16),
    ("0d", "0d", torch.float16, torch.float16),
    ("0d", "0d", None, torch.float32),
    ("token", "n", None, torch.bfloat16),
    ("token", "1n", torch.bfloat16, torch.bfloat16),
    ("0d", "n", torch.bfloat16, torch.bfloat16),
    ("token", "0d", None, torch.bfloat16),
    ("token", "n", None, torch.float16),
    ("token", "n", torch.float32, torch.bfloat16),
    ("0d", "0d", torch.float32, torch.float32),
]


@requires_cuda
@pytest.mark.parametrize("ka,kb,bias,out_dtype", GPU_CASES)
@pytest.mark.parametrize("m", [1, 3, 4, 17, 64, 1000])
def test_cublas_matches_reference(ka, kb, bias, out_dtype, m):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs sm89+")
    gen = torch.Generator().manual_seed(m)
    k, n = 1040, 720
    a = strided_rows(rand_fp8((m, k), gen, "cuda"), 16)
    b = rand_fp8((n, k), gen, "cuda")
    sa = scale_a_for(ka, m, "normal", gen).cuda()
    sb = scale_b_for(kb, n, "normal", gen).cuda()
    bt = None if bias is None else (torch.randn(n, generator=gen) * 10).to(bias).cuda()
    with scaledmm.use_backend("fp8", "cublas"):
        out = OPS.fp8_scaled_mm(a, b, sa, sb, bt, out_dtype)
    with scaledmm.use_backend("fp8", "reference"):
        ref = OPS.fp8_scaled_mm(a, b, sa, sb, bt, out_dtype)
    assert_mm_close(out, a, b, sa, sb, bt, out_dtype, acc_slack=2.0 ** -12)
    assert_mm_close(ref, a, b, sa, sb, bt, out_dtype)


@requires_cuda
def test_cublas_m0_unaligned_and_opcheck():
    gen = torch.Generator().manual_seed(5)
    b = rand_fp8((32, 48), gen, "cuda")
    with scaledmm.use_backend("fp8", "cublas"):
        out = OPS.fp8_scaled_mm(rand_fp8((0, 48), gen, "cuda"), b, torch.ones((), device="cuda"),
                                torch.ones(32, device="cuda"))
        assert out.shape == (0, 32)
        a = strided_rows(rand_fp8((5, 48), gen, "cuda"), 5)  # row stride 53: not 16-byte aligned
        sa = torch.rand(5, 1, device="cuda")
        out = OPS.fp8_scaled_mm(a, b, sa, torch.tensor(0.5, device="cuda"))
        assert_mm_close(out, a, b, sa, torch.tensor(0.5), None, torch.bfloat16, acc_slack=2.0 ** -12)
        for args in _mm_sets("cuda"):
            opcheck(OPS.fp8_scaled_mm.default, args)
        for args in _quant_sets("cuda"):
            opcheck(OPS.quant_fp8.default, args)


@requires_cuda
def test_cuda_quant_matches_float64():
    gen = torch.Generator().manual_seed(6)
    for per_token in (False, True):
        x = make_x(37, 300, torch.bfloat16, "nonfinite", gen).cuda()
        q, s = OPS.quant_fp8(x, None, per_token)
        assert_quant_ok(x, None, per_token, q, s)


@pytest.mark.parametrize("ka,kb,bias,out_dtype", GPU_CASES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_cublas_plans_through_cpu_scaled_mm(ka, kb, bias, out_dtype, m):
    """The cuBLAS backend's plumbing (scale expansion, fp32 epilogue, bias
    routing, unaligned activations) run through torch._scaled_mm's CPU kernel."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("no torch._scaled_mm")
    gen = torch.Generator().manual_seed(m)
    k, n = 208, 80
    a = strided_rows(rand_fp8((m, k), gen), 5)
    b = rand_fp8((n, k), gen)
    sa = scale_a_for(ka, m, "normal", gen)
    sb = scale_b_for(kb, n, "normal", gen)
    bt = None if bias is None else (torch.randn(n, generator=gen) * 10).to(bias)
    try:
        out = F8.cublas_mm(a, b, sa, sb, bt, out_dtype)
    except RuntimeError as e:  # a form the CPU kernel lacks: nothing to learn here
        pytest.skip(f"CPU torch._scaled_mm: {str(e).splitlines()[0][:100]}")
    assert_mm_close(out, a, b, sa, sb, bt, out_dtype, acc_slack=2.0 ** -12)


# ----------------------------------------------------------------------------
# fp8_linear: quant_fp8 + fp8_scaled_mm as one op
# ----------------------------------------------------------------------------


def _linear_case(m, k, n, mode, gen, stride=None, dtype=torch.bfloat16):
    x = torch.randn(m, k if stride is None else stride, generator=gen).to(dtype)[:, :k] * 3
    w, ws = F8.reference_quant(torch.randn(n, k, generator=gen), None, mode != "tensor_w")
    ws = ws.reshape(-1) if mode != "tensor_w" else ws
    scale_x = {"static": torch.tensor([0.03]), "static_token": torch.rand(m, 1, generator=gen) * 0.05 + 0.01}.get(mode)
    per_token = mode in ("per_token", "static_token")
    return x, w, ws, scale_x, per_token


@pytest.mark.parametrize("mode", ["per_token", "per_tensor", "static", "static_token", "tensor_w"])
@pytest.mark.parametrize("m,stride", [(0, None), (1, None), (3, 160), (17, None)])
@pytest.mark.parametrize("out_dtype,bias_dtype", [(torch.bfloat16, None), (torch.float16, torch.float32),
                                                  (torch.float32, torch.bfloat16)])
def test_linear_is_quant_then_mm_bit_for_bit(mode, m, stride, out_dtype, bias_dtype):
    """The definition, on every CPU backend implementing the op (reference
    and composite), against the two ops called one after the other."""
    gen = torch.Generator().manual_seed(m * 7 + len(mode))
    x, w, ws, scale_x, per_token = _linear_case(m, 144, 48, mode, gen, stride)
    bias = None if bias_dtype is None else torch.randn(48, generator=gen).to(bias_dtype)
    q, s = OPS.quant_fp8(x, scale_x, per_token)
    want = OPS.fp8_scaled_mm(q, w, s, ws, bias, out_dtype)
    for name in ("reference", "composite"):
        with scaledmm.use_backend("fp8", name):
            got = OPS.fp8_linear(x, w, ws, scale_x, per_token, bias, out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, 48)
        assert torch.equal(got.view(torch.uint8) if got.numel() else got, want.view(torch.uint8) if want.numel()
                           else want), (name, mode)


@pytest.mark.parametrize("mode", ["per_token", "per_tensor", "static", "static_token"])
def test_opcheck_linear(mode):
    gen = torch.Generator().manual_seed(5)
    x, w, ws, scale_x, per_token = _linear_case(5, 144, 48, mode, gen)
    opcheck(OPS.fp8_linear.default, (x, w, ws, scale_x, per_token, torch.randn(48, dtype=torch.bfloat16),
                                      torch.bfloat16))


def test_linear_compile_fullgraph_dynamic_one_compile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    gen = torch.Generator().manual_seed(6)
    _, w, ws, _, _ = _linear_case(1, 144, 80, "per_token", gen)

    def fn(x):
        return OPS.fp8_linear(x, w, ws, None, True)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt)
    for m in (3, 17, 64, 5):
        x = torch.randn(m, 144, generator=gen).to(torch.bfloat16)
        assert torch.equal(compiled(x), fn(x))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("kwargs,arg,expected", [
    ({"x": torch.zeros(3, 144, dtype=torch.int32)}, "x", "expected dtype"),
    ({"x": torch.zeros(3, 136, dtype=torch.bfloat16)}, "b", "K = x.shape[1]"),
    ({"scale_x": torch.ones(3, 1)}, "scale_x", "one-element tensor"),
    ({"scale_x": torch.ones(1), "per_token": True}, "scale_x", "[M, 1] static per-token scale"),
    ({"scale_b": torch.ones(47)}, "scale_b", "a one-element tensor, shape (48,)"),
    ({"bias": torch.ones(47)}, "bias", "expected"),
])
def test_linear_bad_inputs(kwargs, arg, expected):
    gen = torch.Generator().manual_seed(8)
    x, w, ws, _, _ = _linear_case(3, 144, 48, "per_token", gen)
    args = {"x": x, "b": w, "scale_b": ws, "scale_x": None, "per_token": False, "bias": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^fp8_linear: {arg}: .*{re.escape(expected)}"):
        OPS.fp8_linear(args["x"], args["b"], args["scale_b"], args["scale_x"], args["per_token"], args["bias"])
