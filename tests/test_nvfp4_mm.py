"""``nvfp4_mm`` and ``nvfp4_w4a16_mm`` against float64 references on the
decoded operands: odd M, strided rows, NaN rows, Hypothesis shapes and values;
on CPU and (``gpu``) CUDA with the auto-selected backend."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import scaledmm  # noqa: F401  (registers the ops)

from helpers import requires_cuda
from nvfp4_helpers import check_gemm, check_quant, deq64, gs_for, mm_ref64, quantized, ref_quant

ops = torch.ops.scaledmm
HALF = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------
# GEMMs
# ----------------------------------------------------------------------------

MM_M = [0, 1, 3, 17, 129]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_nvfp4_mm_vs_float64(out_dtype, with_bias):
    n, k = 40, 208
    _, b, sb, gb = quantized(n, k)
    for m in MM_M:
        _, a, sa, ga = quantized(m, k, scale=4.0)
        alpha = (1 / ga) * (1 / gb)
        bias = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
        out = ops.nvfp4_mm(a, b, sa, sb, alpha, out_dtype, bias)
        assert out.dtype == out_dtype and out.shape == (m, n)
        ref, bound = mm_ref64(a, b, sa, sb, alpha, bias)
        check_gemm(out, ref, bound, k, out_dtype)


def test_nvfp4_mm_strided_a_and_alpha_shapes():
    m, n, k = 9, 24, 80
    _, b, sb, gb = quantized(n, k)
    x = torch.randn(m, k)
    q, sa = ops.nvfp4_quant(x, gs_for(x), True)
    wide = torch.zeros(m, 64, dtype=torch.uint8)
    wide[:, :40] = q
    a = wide[:, :40]  # row stride 64 bytes
    for alpha in (torch.tensor(0.37), torch.tensor([0.37]), torch.tensor([[0.37]])):
        out = ops.nvfp4_mm(a, b, sa, sb, alpha, torch.float32)
        ref, bound = mm_ref64(a, b, sa, sb, alpha)
        check_gemm(out, ref, bound, k, torch.float32)
        assert torch.equal(out, ops.nvfp4_mm(q, b, sa, sb, alpha, torch.float32))


@pytest.mark.parametrize("xdtype", HALF)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w4a16_vs_float64(xdtype, out_dtype):
    n, k = 24, 144
    _, b, sb, gb = quantized(n, k)
    walpha = 1 / gb
    for m in MM_M:
        x = torch.randn(m, k).to(xdtype)
        bias = torch.randn(n) if m % 2 else None
        out = ops.nvfp4_w4a16_mm(x, b, sb, walpha, out_dtype, bias)
        assert out.dtype == out_dtype and out.shape == (m, n)
        B = deq64(b, sb)
        X = x.double()
        ref = float(walpha) * (X @ B.t()) + (bias.double() if bias is not None else 0)
        bound = float(walpha) * (X.abs() @ B.abs().t())
        check_gemm(out, ref, bound, k, out_dtype)


def test_nan_scale_poisons_only_its_row():
    m, n, k = 6, 16, 64
    _, b, sb, gb = quantized(n, k)
    x = torch.randn(m, k)
    x[2, 33] = float("nan")
    x[4, 0] = float("inf")
    gs = gs_for(x)
    a, sa = ops.nvfp4_quant(x, gs, True)
    out = ops.nvfp4_mm(a, b, sa, sb, (1 / gs) * (1 / gb), torch.bfloat16)
    ref, bound = mm_ref64(a, b, sa, sb, (1 / gs) * (1 / gb))
    nan_rows = torch.zeros(m, dtype=torch.bool)
    nan_rows[2] = True
    check_gemm(out, ref, bound, k, torch.bfloat16, nan_rows)


# ----------------------------------------------------------------------------
# Hypothesis: shapes, strides, values
# ----------------------------------------------------------------------------

K_VALUES = [16, 48, 80, 112, 144, 208, 272, 336]  # multiples of 16, mostly not powers of two


@st.composite
def quant_case(draw):
    m = draw(st.one_of(st.sampled_from([0, 1, 3, 17, 129]), st.integers(0, 300)))
    k = draw(st.sampled_from(K_VALUES))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    kind = draw(st.sampled_from(["normal", "zeros", "tiny", "huge", "nan", "inf", "mixed"]))
    pad = draw(st.sampled_from([0, 0, 16, 40]))
    mult = draw(st.sampled_from([1.0, 1.0, 1e3, 1e-3]))
    return m, k, dtype, kind, pad, mult


def make_values(m, k, dtype, kind, pad):
    big = {torch.float16: 6e4, torch.bfloat16: 1e37, torch.float32: 1e37}[dtype]
    tiny = {torch.float16: 1e-7, torch.bfloat16: 1e-37, torch.float32: 1e-37}[dtype]
    x = torch.randn(m, k + pad)
    if kind == "zeros":
        x.zero_()
    elif kind == "tiny":
        x *= tiny
    elif kind == "huge":
        x = x.clamp(-1, 1) * big
    elif kind == "mixed" and m:
        x *= torch.exp(torch.randn(m, 1) * 6).clamp(max=1e4)
    if kind in ("nan", "inf", "mixed") and m:
        rows = torch.randint(0, m, (max(1, m // 4),))
        cols = torch.randint(0, k, rows.shape)
        val = {"nan": float("nan"), "inf": float("inf"), "mixed": float("-inf")}[kind]
        x[rows, cols] = val
    x = x.to(dtype)
    return x[:, :k]  # row stride k + pad


@given(quant_case(), st.integers(0, 2**31 - 1))
def test_hypothesis_quant_and_gemm(case, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    m, k, dtype, kind, pad, mult = case
    x = make_values(m, k, dtype, kind, pad)
    gs = gs_for(x, mult)
    for swizzle in (False, True):  # the swizzled (q, s) feed the GEMM below
        q, s = ops.nvfp4_quant(x, gs, swizzle)
        check_quant(x, gs, q, s, swizzle)
    # W4A4 GEMM on the quantized activation: NaN blocks poison exactly their rows
    n = 16
    _, b, sb, gb = quantized(n, k)
    alpha = (1 / gs) * (1 / gb)
    out = ops.nvfp4_mm(q, b, s, sb, alpha, torch.float32)
    ref, bound = mm_ref64(q, b, s, sb, alpha)
    nan_rows = ref_quant(x, gs)[1].isnan().any(dim=1)
    check_gemm(out, ref, bound, k, torch.float32, nan_rows)


@given(st.integers(0, 300), st.sampled_from(K_VALUES), st.sampled_from([1, 8, 17, 32]),
       st.sampled_from(HALF), st.booleans(), st.integers(0, 2**31 - 1))
def test_hypothesis_w4a16(m, k, n, xdtype, with_bias, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    _, b, sb, gb = quantized(n, k)
    x = torch.randn(m, k).to(xdtype)
    bias = torch.randn(n) if with_bias else None
    out = ops.nvfp4_w4a16_mm(x, b, sb, 1 / gb, torch.float32, bias)
    B = deq64(b, sb)
    ref = float(1 / gb) * (x.double() @ B.t()) + (bias.double() if with_bias else 0)
    check_gemm(out, ref, float(1 / gb) * (x.double().abs() @ B.abs().t()), k, torch.float32)


# ----------------------------------------------------------------------------
# GPU: the same numerics with the auto-selected backend
# ----------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_mm_and_w4a16_vs_float64(out_dtype):
    for n, k, ms in ((96, 256, (0, 1, 3, 17, 129, 300)), (40, 208, (1, 5, 130)), (4096, 4096, (1, 17, 129))):
        _, b, sb, gb = quantized(n, k, device="cuda")
        B = deq64(b, sb)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x, a, sa, ga = quantized(m, k, device="cuda", dtype=torch.bfloat16, scale=2.0)
            if m > 2:
                x[1, 3] = float("nan")
                a, sa = ops.nvfp4_quant(x, ga, True)
            alpha = (1 / ga) * (1 / gb)
            out = ops.nvfp4_mm(a, b, sa, sb, alpha, out_dtype, bias)
            ref, bound = mm_ref64(a, b, sa, sb, alpha.cpu(), bias, B)
            nan_rows = torch.zeros(m, dtype=torch.bool)
            if m > 2:
                nan_rows[1] = True
            check_gemm(out, ref, bound, k, out_dtype, nan_rows)
            xh = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = ops.nvfp4_w4a16_mm(xh, b, sb, 1 / gb, out_dtype, bias)
            X = xh.double().cpu()
            wa = float(1 / gb)
            check_gemm(out, wa * (X @ B.t()) + bias.double().cpu(), wa * (X.abs() @ B.abs().t()), k, out_dtype)


@requires_cuda
def test_cuda_graph_capture_and_replay():
    n, k = 256, 512
    _, b, sb, gb = quantized(n, k, device="cuda")
    x = torch.randn(7, k, device="cuda", dtype=torch.bfloat16)
    gs = gs_for(x).cuda()
    alpha = (1 / gs) * (1 / gb)

    def f():
        q, s = ops.nvfp4_quant(x, gs)
        return ops.nvfp4_mm(q, b, s, sb, alpha, torch.bfloat16)

    f()  # warm up (compilation, autotuning) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f()
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, f())
