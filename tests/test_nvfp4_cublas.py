"""Backend ``decode_cublas`` of nvfp4 (``ops/nvfp4_cublas.py``): exact 16-bit
decode, then one cuBLASLt GEMM with device alpha and bias epilogue (CUDA), or
an fp32-output GEMM and one fused epilogue (the fallback).

* Interpreter tests (``@interp``): the Triton decode and epilogue run in
  Triton's CPU interpreter, which must be switched on before Triton is first
  imported.  Run directly with ``TRITON_INTERPRET=1 python -m pytest
  tests/test_nvfp4_cublas.py``; in the ordinary suite
  :func:`test_interpreter_suite` re-runs this file in such a subprocess.
  Small shapes, M in 0, 1, 17, 33, N and K not powers of two, chunking forced
  by a tiny :data:`CHUNK_BYTES`, poisoned outputs, opcheck, torch.compile; the
  cuBLASLt branch with a CPU stand-in for :func:`scaledmm.cublaslt.gemm_alpha_dev`
  (its chunks, and the fallback when cuBLASLt has no algorithm).
* CPU tests (main process): the chunk plan, the gates, automatic selection on
  a faked sm90 / sm80 device, the environment switches.
* GPU tests (``@requires_cuda``): llama8b shapes at M = 128, 1023, 4096
  against float64 (fp32 output within fp32 accumulation error: the
  exactness claim), chunking, CUDA-graph capture, M = 0 and N = 0; the
  cuBLASLt path (``SCALEDMM_NVFP4_CUBLASLT``, default on) and the
  two-step path both against float64 and within one output ulp of each other.

References: float64 math on operands decoded by ``ops/nvfp4.dequantize``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledmm
from scaledmm import backends, cublaslt, env
from scaledmm.backends import Family, Problem
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_cublas as dc
from scaledmm.ops import nvfp4_triton as nt
from helpers import opcheck, poison_, rel_err, run_under_interpreter

CHILD = nt.interpreting()
interp = pytest.mark.skipif(not CHILD, reason="runs under TRITON_INTERPRET=1 (test_interpreter_suite)")
parent = pytest.mark.skipif(CHILD, reason="main-process test")
# GPU tests run in the main process only (the interpreter would copy every tensor to the host)
requires_cuda = pytest.mark.skipif(CHILD or not torch.cuda.is_available(), reason="needs a CUDA device")
LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
OUT_EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


# ----------------------------------------------------------------------------
# Operands and the float64 check
# ----------------------------------------------------------------------------


def quantized(rows, k, device="cpu", scale=1.0, gs=1.0):
    """Packed codes and swizzled scales of random data (reference quantizer)."""
    x = (torch.randn(rows, k, device=device) * scale).to(torch.bfloat16)
    return nv.reference_quant(x, torch.tensor(gs, device=device), True)


def check(out, xd, wd, alpha, bias=None, k=None, interpreter=False):
    """``out`` against float64 ``alpha * xd @ wd.T (+ bias)``: finite, within
    fp32 accumulation error plus one rounding to ``out.dtype``.  The Triton
    interpreter truncates fp32 -> bf16 (two ulps)."""
    xd, wd = xd.double(), wd.to(xd.device).double()
    a = float(alpha)
    ref = xd @ wd.t() * a
    if bias is not None:
        ref = ref + bias.to(ref.device).double()
    absum = (xd.abs() @ wd.abs().t()) * abs(a)
    k = xd.shape[1] if k is None else k
    eps = OUT_EPS[out.dtype] * (2 if interpreter and out.dtype != torch.float32 else 1)
    bound = ref.abs() * 2 * eps + absum * k * 2.0 ** -24 + 1e-30
    err = (out.double() - ref).abs()
    assert out.shape == ref.shape and out.dtype in OUT_EPS
    assert torch.isfinite(out).all(), "non-finite output (an unwritten poisoned element?)"
    assert (err <= bound).all(), f"worst {float((err / bound).max()):.2f}x the bound"
    if out.dtype == torch.float32 and ref.numel() and ref.norm() > 0:
        assert rel_err(out, ref) < 1e-5
    return ref


def _poison_outputs(monkeypatch):
    real = nv.mm_output
    monkeypatch.setattr(nv, "mm_output", lambda a, b, dt: poison_(real(a, b, dt)))


# ----------------------------------------------------------------------------
# The interpreter subprocess (main process)
# ----------------------------------------------------------------------------


@parent
def test_interpreter_suite():
    run_under_interpreter(__file__, {}, drop=("SCALEDMM_NVFP4_BACKEND",))


# ----------------------------------------------------------------------------
# Interpreter: the backend functions
# ----------------------------------------------------------------------------

# bound -> (N chunks of 128 rows, M chunks of 8 rows) or one chunk
BOUNDS = {"one": None, "chunked": 128 * 4 * 8}


@interp
@pytest.mark.parametrize("bound", BOUNDS, ids=str)
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [0, 1, 17, 33])
def test_w4a4_exact(monkeypatch, bound, bias_dtype, m):
    if BOUNDS[bound] is not None:
        monkeypatch.setattr(dc, "CHUNK_BYTES", BOUNDS[bound])
    _poison_outputs(monkeypatch)
    n, k = 300, 96  # three 128-row scale blocks, K % 64 != 0
    qa, sa = quantized(m, k, scale=3.0, gs=10.0)
    qb, sb = quantized(n, k, scale=0.1, gs=3000.0)
    alpha = torch.tensor(0.37)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    out = dc.mm(qa, qb, sa, sb, alpha, torch.float32, bias)
    assert out.shape == (m, n) and out.dtype == torch.float32
    check(out, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha, bias)


@interp
@pytest.mark.parametrize("bound", BOUNDS, ids=str)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [0, 17, 33])
def test_w4a16_exact_strided_rows(monkeypatch, bound, xdtype, m):
    if BOUNDS[bound] is not None:
        monkeypatch.setattr(dc, "CHUNK_BYTES", BOUNDS[bound])
    _poison_outputs(monkeypatch)
    n, k = 200, 80
    wide = torch.randn(m, k + 48).to(xdtype)
    x = wide[:, 16:16 + k]  # row stride k + 48
    qb, sb = quantized(n, k, scale=0.5, gs=500.0)
    alpha = torch.tensor(1.5)
    out = dc.w4a16_mm(x, qb, sb, alpha, torch.float32, None)
    check(out, x, nv.dequantize(qb, sb), alpha)


@interp
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_half_outputs_one_rounding(monkeypatch, out_dtype, bias_dtype):
    monkeypatch.setattr(dc, "CHUNK_BYTES", BOUNDS["chunked"])
    _poison_outputs(monkeypatch)
    m, n, k = 17, 140, 64
    qa, sa = quantized(m, k)
    qb, sb = quantized(n, k, gs=100.0)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    alpha = torch.tensor(0.01)
    out = dc.mm(qa, qb, sa, sb, alpha, out_dtype, bias)
    assert out.dtype == out_dtype
    check(out, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha, bias, interpreter=True)
    x = torch.randn(m, k).to(out_dtype)
    check(dc.w4a16_mm(x, qb, sb, alpha, out_dtype, bias), x, nv.dequantize(qb, sb), alpha, bias,
          interpreter=True)


@interp
def test_nan_scale_stays_in_its_row():
    qa, sa = quantized(17, 64)
    qb, sb = quantized(40, 64)
    s = nv.unswizzle_block_scales(sa, 17, 4)
    s.view(torch.uint8)[5, 1] = 0x7F  # e4m3 NaN
    out = dc.mm(qa, qb, nv.swizzle_block_scales(s), sb, torch.tensor(1.0), torch.float32)
    assert torch.isnan(out[5]).all()
    assert torch.isfinite(out[torch.arange(17) != 5]).all()


@interp
def test_zero_n():
    qa, sa = quantized(17, 64)
    qb, sb = quantized(0, 64)
    assert dc.mm(qa, qb, sa, sb, torch.tensor(1.0)).shape == (17, 0)
    assert dc.w4a16_mm(torch.randn(17, 64, dtype=torch.bfloat16), qb, sb, torch.tensor(1.0)).shape == (17, 0)


@interp
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 33])
def test_cublaslt_branch_chunks_and_falls_back(monkeypatch, out_dtype, m):
    """The cuBLASLt branch with a CPU stand-in: one call per 128-row weight
    chunk over all M rows, writing the output's column range; when cuBLASLt
    has no algorithm, the two-step path (M chunked for its fp32 accumulator)."""
    monkeypatch.setattr(dc, "CHUNK_BYTES", BOUNDS["chunked"])
    monkeypatch.setattr(dc, "uses_cublaslt", lambda device: True)
    _poison_outputs(monkeypatch)
    calls = []

    def stand_in(x, w, alpha, bias, out):
        calls.append((x.shape[0], w.shape[0], out.shape, out.stride(0)))
        acc = alpha.float() * (x.float() @ w.float().t())
        return out.copy_(acc if bias is None else acc + bias.float())

    def no_algorithm(x, w, alpha, bias, out):
        calls.append("none")
        raise cublaslt.NoAlgorithm("stand-in: no algorithm")

    n, k = 300, 96
    qa, sa = quantized(m, k, scale=3.0, gs=10.0)
    qb, sb = quantized(n, k, scale=0.1, gs=3000.0)
    alpha, bias = torch.tensor(0.37), torch.randn(n).bfloat16()
    monkeypatch.setattr(cublaslt, "gemm_alpha_dev", stand_in)
    out = dc.mm(qa, qb, sa, sb, alpha, out_dtype, bias)
    assert calls == [(m, 128, (m, 128), n), (m, 128, (m, 128), n), (m, 44, (m, 44), n)]
    check(out, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha, bias, interpreter=True)
    calls.clear()
    monkeypatch.setattr(cublaslt, "gemm_alpha_dev", no_algorithm)
    out = dc.mm(qa, qb, sa, sb, alpha, out_dtype, bias)
    assert calls == ["none"] * 3
    check(out, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha, bias, interpreter=True)


@interp
@settings(max_examples=8)
@given(m=st.integers(0, 40), n=st.integers(1, 300), groups=st.integers(1, 9), w4a16=st.booleans(),
       chunked=st.booleans(), log_ws=st.integers(-8, 8), seed=st.integers(0, 2**31 - 1))
def test_hypothesis(m, n, groups, w4a16, chunked, log_ws, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    k = 16 * groups
    old = dc.CHUNK_BYTES
    dc.CHUNK_BYTES = BOUNDS["chunked"] if chunked else old
    try:
        qb, sb = quantized(n, k, scale=2.0 ** log_ws, gs=448 * 6 / 2.0 ** (log_ws + 2))
        alpha = torch.tensor(0.5)
        if w4a16:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            out = dc.w4a16_mm(x, qb, sb, alpha, torch.float32, None)
        else:
            qa, sa = quantized(m, k, scale=3.0, gs=100.0)
            x = nv.dequantize(qa, sa)
            out = dc.mm(qa, qb, sa, sb, alpha, torch.float32, None)
    finally:
        dc.CHUNK_BYTES = old
    check(out, x, nv.dequantize(qb, sb), alpha)


# ----------------------------------------------------------------------------
# Interpreter: through the ops (registry, opcheck, compile, fake tensors)
# ----------------------------------------------------------------------------


def _op_args(m=None, n=40, k=64):
    qa, sa = quantized(dc.MIN_M if m is None else m, k)
    qb, sb = quantized(n, k, gs=50.0)
    return qa, qb, sa, sb, torch.tensor(0.25)


@interp
def test_explicit_request_runs_it_and_small_m_explains():
    qa, qb, sa, sb, alpha = _op_args()
    assert dc.is_supported(torch.device("cpu"))[0]
    with scaledmm.use_backend("nvfp4", dc.NAME), backends.record() as calls:
        out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha, torch.float32)
    assert [c[1] for c in calls] == [dc.NAME]
    check(out, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha)
    qa1, _, sa1, _, _ = _op_args(m=1)
    with scaledmm.use_backend("nvfp4", dc.NAME), pytest.raises(RuntimeError, match=f"M >= {dc.MIN_M}"):
        torch.ops.scaledmm.nvfp4_mm(qa1, qb, sa1, sb, alpha)
    with scaledmm.use_backend("nvfp4", dc.NAME), pytest.raises(ValueError, match="b_scales"):
        torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb[:64], alpha)


@interp
def test_ops_opcheck():
    qa, qb, sa, sb, alpha = _op_args()
    x = torch.randn(dc.MIN_M + 5, 64, dtype=torch.bfloat16)
    with scaledmm.use_backend("nvfp4", dc.NAME):
        opcheck(torch.ops.scaledmm.nvfp4_mm.default, (qa, qb, sa, sb, alpha, torch.bfloat16, torch.randn(40)))
        opcheck(torch.ops.scaledmm.nvfp4_mm.default, (qa, qb, sa, sb, alpha, torch.float32, None))
        opcheck(torch.ops.scaledmm.nvfp4_w4a16_mm.default, (x, qb, sb, alpha, torch.float16, None))


@interp
def test_ops_compile_dynamic_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, qb, _, sb, alpha = _op_args()
    bias = torch.randn(40)

    def f(qa, sa, x, qb, sb, alpha, bias):  # custom ops only: Inductor needs no C++ compiler
        return (torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha, torch.float32, bias),
                torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, alpha, torch.bfloat16, None))

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    with scaledmm.use_backend("nvfp4", dc.NAME), backends.record() as calls:
        for m in (dc.MIN_M, dc.MIN_M + 16, 0):
            qa, sa = quantized(m, 64)
            x = torch.randn(m, 64, dtype=torch.bfloat16)
            got, want = compiled(qa, sa, x, qb, sb, alpha, bias), f(qa, sa, x, qb, sb, alpha, bias)
            for g, w in zip(got, want):
                assert g.shape == (m, 40) and torch.equal(g, w)
    assert {c[1] for c in calls} == {dc.NAME}
    with FakeTensorMode() as mode:
        fa = mode.from_tensor(torch.empty(19, 32, dtype=torch.uint8))
        fsa = mode.from_tensor(torch.empty(128, 4, dtype=torch.float8_e4m3fn))
        out = torch.ops.scaledmm.nvfp4_mm(fa, mode.from_tensor(qb), fsa, mode.from_tensor(sb),
                                          mode.from_tensor(alpha), torch.float16)
        assert out.shape == (19, 40) and out.dtype == torch.float16


# ----------------------------------------------------------------------------
# CPU: chunk plan, gates, automatic selection, the environment switch
# ----------------------------------------------------------------------------


@given(m=st.integers(0, 1 << 20), n=st.integers(0, 1 << 17), groups=st.integers(1, 2048),
       log_bound=st.integers(12, 30))
def test_chunk_plan_bounds(m, n, groups, log_bound):
    k, bound = 16 * groups, 1 << log_bound
    n_rows, m_rows = dc.chunk_rows(m, n, k, bound)
    assert n_rows >= 1 and m_rows >= 1
    if n_rows < max(n, 1):  # several chunks: whole 128-row blocks of the swizzled scales
        assert n_rows % 128 == 0
    else:
        assert n_rows == max(n, 1)
    if n_rows > 128:  # the 128-row floor is the only excess allowed
        assert n_rows * k * 2 <= bound and m_rows * n_rows * 4 <= bound
    if m_rows < max(m, 1):
        assert m_rows * n_rows * 4 <= bound or m_rows == 1
    else:
        assert m_rows == max(m, 1)


@given(m=st.integers(0, 1 << 20), n=st.integers(0, 1 << 17), groups=st.integers(1, 2048),
       log_bound=st.integers(12, 30))
def test_chunk_plan_without_accumulator(m, n, groups, log_bound):
    """The cuBLASLt path has no fp32 accumulator: only the weight chunk is bounded, M is never split."""
    k, bound = 16 * groups, 1 << log_bound
    n_rows, m_rows = dc.chunk_rows(m, n, k, bound, fp32_acc=False)
    assert m_rows == max(m, 1)
    assert n_rows == max(n, 1) or n_rows % 128 == 0
    assert n_rows * k * 2 <= bound or n_rows == min(128, max(n, 1)) or n_rows == 128
    assert n_rows >= dc.chunk_rows(m, n, k, bound)[0]  # never smaller than with the accumulator


def test_chunk_plan_llama8b():
    # one chunk up to 256 MiB each; 28672 rows at M = 4096: two N chunks
    assert dc.chunk_rows(4096, 4096, 4096) == (4096, 4096)
    assert dc.chunk_rows(4096, 28672, 4096) == (16384, 4096)
    assert dc.chunk_rows(128, 28672, 4096) == (28672, 128)
    assert dc.chunk_rows(1 << 20, 4096, 4096) == (128, 1 << 19)
    # the cuBLASLt path bounds the 16-bit weight chunk only
    assert dc.chunk_rows(4096, 28672, 4096, fp32_acc=False) == (28672, 4096)
    assert dc.chunk_rows(1 << 20, 4096, 4096, fp32_acc=False) == (4096, 1 << 20)
    assert dc.chunk_rows(4096, 28672, 14336, fp32_acc=False) == (9344, 4096)


def _problem(m, n=4096, k=4096, out_dtype=torch.bfloat16, w4a16=False, device=("cuda", 0)):
    in_dtype = torch.bfloat16 if w4a16 else torch.uint8
    return Problem(Family.NVFP4, torch.device(*device), m, n, k, in_dtype, out_dtype, k,
                   (("bias", False), ("w4a16", w4a16)))


@pytest.mark.parametrize("p,why", [
    (_problem(16), f"M >= {dc.MIN_M}"),
    (_problem(1, w4a16=True), f"M >= {dc.MIN_M}"),
    (_problem(64, k=40), "multiple of 16"),
    (_problem(64, out_dtype=torch.int8), "bf16/fp16/fp32"),
])
def test_can_implement_says_why(p, why):
    ok, reason = dc.can_implement(p)
    assert not ok and why in reason


def test_can_implement_accepts_and_rejects():
    assert dc.can_implement(_problem(dc.MIN_M))[0]
    assert dc.can_implement(_problem(0))[0]  # nothing to compute
    assert dc.can_implement(_problem(4096, n=1, k=16, out_dtype=torch.float32))[0]
    assert dc.can_implement(_problem(dc.MIN_M + 100, n=6144, k=4112, w4a16=True))[0]
    quant = Problem(Family.NVFP4, torch.device("cuda", 0), 64, 0, 64, torch.bfloat16, torch.uint8, 64,
                    (("swizzle", True),))
    assert not dc.can_implement(quant)[0]
    fp32_x = Problem(Family.NVFP4, torch.device("cuda", 0), 64, 64, 64, torch.float32, torch.bfloat16, 64,
                     (("bias", False), ("w4a16", True)))
    ok, why = dc.can_implement(fp32_x)
    assert not ok and "bf16/fp16 activations" in why


def test_is_supported_gates(monkeypatch):
    assert not dc.is_supported(torch.device("meta"))[0]
    if not CHILD:
        ok, why = dc.is_supported(torch.device("cpu"))
        assert not ok and "TRITON_INTERPRET" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert dc.is_supported(torch.device("cuda", 0))[0]
    monkeypatch.setattr(dc, "has_mm_dtype", lambda: False)
    ok, why = dc.is_supported(torch.device("cuda", 0))
    assert not ok and "mm.dtype" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    ok, why = dc.is_supported(torch.device("cuda", 0))
    assert not ok and "sm80" in why


def test_cublaslt_switch_selects_the_path(monkeypatch):
    """SCALEDMM_NVFP4_CUBLASLT (read at every call; default on): 0 / false / no / empty select the two-step path."""
    cuda0 = torch.device("cuda", 0)
    monkeypatch.delenv(env.NVFP4_CUBLASLT, raising=False)
    monkeypatch.setattr(cublaslt, "available", lambda device=None: (True, "stand-in"))
    assert dc.uses_cublaslt(cuda0) and env.nvfp4_cublaslt()
    for value, on in (("0", False), ("", False), (" False ", False), ("no", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(env.NVFP4_CUBLASLT, value)
        assert dc.uses_cublaslt(cuda0) is on, value
    monkeypatch.setenv(env.NVFP4_CUBLASLT, "1")
    assert not dc.uses_cublaslt(torch.device("cpu")) and not dc.uses_cublaslt(torch.device("meta"))
    monkeypatch.setattr(cublaslt, "available", lambda device=None: (False, "no libcublasLt"))
    assert not dc.uses_cublaslt(cuda0)
    if not CHILD:  # no CUDA here: the real check says no
        monkeypatch.undo()
        assert dc.uses_cublaslt(cuda0) is cublaslt.available(cuda0)[0]


@pytest.fixture(params=[(9, 0), (8, 0)], ids=["sm90", "sm80"])
def fake_gpu(request, monkeypatch):
    """Automatic selection as on an sm90 / sm80 device (no GPU needed), the
    shipped policy with every switch on; policy changes are undone afterwards."""
    major, minor = request.param
    arch = f"sm{major}{minor}"
    monkeypatch.setattr(backends, "arch_key", lambda d: arch if d.type == "cuda" else d.type)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (major, minor))
    monkeypatch.delenv("SCALEDMM_NVFP4_BACKEND", raising=False)
    for var in backends.policy("nvfp4", "sm90").switches.values():
        monkeypatch.delenv(var, raising=False)
    with backends.policy_snapshot():
        backends.invalidate()
        yield arch


def test_shipped_policy(fake_gpu):
    order = backends.priority("nvfp4", torch.device("cuda", 0))
    assert order.count(dc.NAME) == 1
    assert order.index(dc.NAME) < order.index("triton") < order.index("reference")
    expected = ["cuda_gemv", "cuda_wgmma", "cuda_mid"] if fake_gpu == "sm90" else []
    assert order == expected + [dc.NAME, "triton", "composite", "reference"]
    assert backends.policy("nvfp4", torch.device("cuda", 0)).switches[dc.NAME] == "SCALEDMM_NVFP4_DECODE_CUBLAS"


def test_large_m_selects_it_small_m_does_not(fake_gpu, monkeypatch):
    for m in (dc.MIN_M, 128, 1023, 1025, 4096):
        # sm90: the measured rows ('*', an unswept shape) give M 33-1024 to cuda_wgmma
        want = "cuda_wgmma" if fake_gpu == "sm90" and m <= 1024 else dc.NAME
        assert backends.select(_problem(m, n=2048), "nvfp4_mm").name == want
        assert backends.select(_problem(m, n=2048, w4a16=True), "nvfp4_w4a16_mm").name == want
        assert backends.select(_problem(m, out_dtype=torch.float32), "nvfp4_mm").name == dc.NAME
    for m in (1, 8, 16):
        assert backends.select(_problem(m), "nvfp4_mm").name != dc.NAME
        small = backends.select(_problem(m, w4a16=True), "nvfp4_w4a16_mm").name  # cuda_gemv on sm90
        assert small in ("triton", "cuda_gemv") and small != dc.NAME
        assert backends.select(_problem(m, out_dtype=torch.float32), "nvfp4_mm").name == "triton"
    # the quantizer is not ours
    quant = Problem(Family.NVFP4, torch.device("cuda", 0), 4096, 0, 64, torch.bfloat16, torch.uint8, 64,
                    (("swizzle", True),))
    assert backends.select(quant, "nvfp4_quant").name == "triton"
    # switched off (read at selection time): the others take every M
    for value, on in (("0", False), ("", False), ("1", True)):
        monkeypatch.setenv("SCALEDMM_NVFP4_DECODE_CUBLAS", value)
        assert (backends.select(_problem(4096, n=2048), "nvfp4_mm").name == dc.NAME) == on, value
        assert (dc.NAME in backends.priority("nvfp4", torch.device("cuda", 0))) == on, value


@parent
def test_env_switch_in_a_fresh_process():
    """A fresh interpreter with the switch at 0: registered, in no automatic order."""
    code = ("import scaledmm; from scaledmm import backends as b; "
            "print('decode_cublas' in b.names('nvfp4'), "
            "any('decode_cublas' in b.arch_priority('nvfp4', a) for a in ('sm80', 'sm86', 'sm90', 'cuda')))")
    env = dict(os.environ, SCALEDMM_NVFP4_DECODE_CUBLAS="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["True", "False"], r.stdout


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


def _gpu_operands(m, n, k, w4a16=False):
    x = torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    gs_w = 448 * 6 / float(w.abs().max())
    qb, sb = torch.ops.scaledmm.nvfp4_quant(w.bfloat16(), torch.tensor(gs_w, device="cuda"))
    if w4a16:
        return x.bfloat16(), None, qb, sb, torch.tensor(1.0 / gs_w, device="cuda")
    gs_x = 448 * 6 / max(float(x.abs().max()), 1e-6)
    qa, sa = torch.ops.scaledmm.nvfp4_quant(x.bfloat16(), torch.tensor(gs_x, device="cuda"))
    return qa, sa, qb, sb, torch.tensor(1.0 / (gs_x * gs_w), device="cuda")


@pytest.fixture(params=["two_step", "cublaslt"])
def path(request, monkeypatch):
    """Runs a GPU test on each multiply path (SCALEDMM_NVFP4_CUBLASLT off / on)."""
    monkeypatch.setenv(env.NVFP4_CUBLASLT, "1" if request.param == "cublaslt" else "0")
    assert dc.uses_cublaslt(torch.device("cuda")) == (request.param == "cublaslt")
    return request.param


def _nan_allocator(elems):
    torch.full((elems + 1024,), float("nan"), device="cuda")  # freed: NaN in the caching allocator


def _gpu_run(a, sa, qb, sb, alpha, out_dtype=torch.float32, bias=None):
    _nan_allocator(a.shape[0] * qb.shape[0])
    with scaledmm.use_backend("nvfp4", dc.NAME):
        if sa is None:
            return torch.ops.scaledmm.nvfp4_w4a16_mm(a, qb, sb, alpha, out_dtype, bias)
        return torch.ops.scaledmm.nvfp4_mm(a, qb, sa, sb, alpha, out_dtype, bias)


def _gpu_check(out, a, sa, qb, sb, alpha, bias=None):
    xd = a if sa is None else nv.dequantize(a, sa)
    return check(out, xd, nv.dequantize(qb, sb), alpha, bias)


@requires_cuda
@pytest.mark.parametrize("m", [128, 1023, 4096])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (1040, 4112)])
def test_gpu_w4a4_fp32_equals_float64(m, n, k, path):
    a, sa, qb, sb, alpha = _gpu_operands(m, n, k)
    _gpu_check(_gpu_run(a, sa, qb, sb, alpha), a, sa, qb, sb, alpha)


@requires_cuda
@pytest.mark.parametrize("m", [128, 4096])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1040, 4112)])
def test_gpu_w4a16_fp32_equals_float64(m, n, k, path):
    x, _, qb, sb, alpha = _gpu_operands(m, n, k, w4a16=True)
    _gpu_check(_gpu_run(x, None, qb, sb, alpha), x, None, qb, sb, alpha)
    _gpu_check(_gpu_run(x.half(), None, qb, sb, alpha), x.half(), None, qb, sb, alpha)


@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_gpu_half_outputs_and_bias(out_dtype, bias_dtype, path):
    a, sa, qb, sb, alpha = _gpu_operands(300, 6144, 4096)
    bias = None if bias_dtype is None else torch.randn(6144, device="cuda").to(bias_dtype)
    _gpu_check(_gpu_run(a, sa, qb, sb, alpha, out_dtype, bias), a, sa, qb, sb, alpha, bias)


@requires_cuda
def test_gpu_chunked_matches_float64(monkeypatch, path):
    monkeypatch.setattr(dc, "CHUNK_BYTES", 1 << 18)  # 128-row weight chunks, 512-row M chunks
    assert dc.chunk_rows(1023, 1040, 4096) == (128, 512)
    a, sa, qb, sb, alpha = _gpu_operands(1023, 1040, 4096)
    bias = torch.randn(1040, device="cuda")
    _gpu_check(_gpu_run(a, sa, qb, sb, alpha, torch.float32, bias), a, sa, qb, sb, alpha, bias)
    x, _, qb, sb, alpha = _gpu_operands(1023, 1040, 4096, w4a16=True)
    _gpu_check(_gpu_run(x, None, qb, sb, alpha, torch.bfloat16), x, None, qb, sb, alpha)


@requires_cuda
def test_gpu_zero_m_and_n_and_strided_rows(path):
    m = dc.MIN_M + 3
    a, sa, qb, sb, alpha = _gpu_operands(m, 256, 512)
    one = torch.tensor(1.0, device="cuda")
    a0, sa0 = torch.ops.scaledmm.nvfp4_quant(torch.empty(0, 512, dtype=torch.bfloat16, device="cuda"), one)
    assert _gpu_run(a0, sa0, qb, sb, alpha).shape == (0, 256)
    qb0, sb0 = torch.ops.scaledmm.nvfp4_quant(torch.empty(0, 512, dtype=torch.bfloat16, device="cuda"), one)
    assert _gpu_run(a, sa, qb0, sb0, alpha).shape == (m, 0)
    wide = torch.zeros(m, 512, dtype=torch.uint8, device="cuda")
    wide[:, :256] = a
    _gpu_check(_gpu_run(wide[:, :256], sa, qb, sb, alpha), a, sa, qb, sb, alpha)  # row stride 512 bytes


@requires_cuda
def test_gpu_cuda_graph_capture_and_replay(path):
    a, sa, qb, sb, alpha = _gpu_operands(512, 4096, 4096)
    bias = torch.randn(4096, device="cuda")
    first = _gpu_run(a, sa, qb, sb, alpha, torch.bfloat16, bias)
    a2, sa2, _, _, _ = _gpu_operands(512, 4096, 4096)
    with scaledmm.use_backend("nvfp4", dc.NAME):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up (Triton compile, cuBLAS handle) outside capture
            torch.ops.scaledmm.nvfp4_mm(a, qb, sa, sb, alpha, torch.bfloat16, bias)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.scaledmm.nvfp4_mm(a, qb, sa, sb, alpha, torch.bfloat16, bias)
        a.copy_(a2)
        sa.copy_(sa2)
        graph.replay()
        torch.cuda.synchronize()
        again = torch.ops.scaledmm.nvfp4_mm(a, qb, sa, sb, alpha, torch.bfloat16, bias)
    assert torch.equal(captured, again)
    assert not torch.equal(captured, first)
    _gpu_check(captured, a, sa, qb, sb, alpha, bias)


@requires_cuda
def test_gpu_auto_selection_at_large_m():
    a, sa, qb, sb, alpha = _gpu_operands(4096, 1024, 1024)
    p = nv.mm_problem(a, qb, torch.bfloat16, None)
    expect = dc.NAME if dc.NAME in backends.priority("nvfp4", a.device) and backends.arch_key(a.device) in (
        "sm80", "sm86", "sm89", "sm90") else None
    with backends.record() as calls:
        torch.ops.scaledmm.nvfp4_mm(a, qb, sa, sb, alpha)
    if expect:
        assert calls[-1][1] == expect, (calls, p)


@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("w4a16", [False, True], ids=["w4a4", "w4a16"])
def test_gpu_cublaslt_switch_on_and_off(monkeypatch, out_dtype, w4a16):
    """Both paths against float64; 16-bit outputs within one output ulp of each other
    (plus both paths' fp32 accumulation error, which exceeds an ulp only where the sum
    cancels) (W4A4 with an fp16 output decodes to fp16 on the cuBLASLt path)."""
    assert cublaslt.available(torch.device("cuda"))[0]
    a, sa, qb, sb, alpha = _gpu_operands(1023, 6144, 4096, w4a16=w4a16)
    bias = torch.randn(6144, device="cuda").to(out_dtype)
    real, calls, outs = cublaslt.gemm_alpha_dev, [], {}

    def spy(*args):
        out = real(*args)
        calls.append(out.shape)
        return out

    monkeypatch.setattr(cublaslt, "gemm_alpha_dev", spy)
    for value in ("1", "0"):
        monkeypatch.setenv(env.NVFP4_CUBLASLT, value)
        calls.clear()
        outs[value] = _gpu_run(a, sa, qb, sb, alpha, out_dtype, bias)
        # W4A16 with bf16 activations and an fp16 output: no cuBLASLt algorithm, the two-step path
        lt = value == "1" and not (w4a16 and out_dtype == torch.float16)
        assert calls == ([(1023, 6144)] if lt else []), calls
        _gpu_check(outs[value], a, sa, qb, sb, alpha, bias)
    if out_dtype != torch.float32:  # one ulp apart, where the two fp32 sums (other orders) round alike
        on, off = outs["1"].double(), outs["0"].double()
        xd = (a if sa is None else nv.dequantize(a, sa)).double()
        absum = (xd.abs() @ nv.dequantize(qb, sb).double().abs().t()) * float(alpha) + bias.double().abs()
        ulp = 2 * OUT_EPS[out_dtype] * (torch.maximum(on.abs(), off.abs()) + torch.finfo(out_dtype).tiny)
        assert ((on - off).abs() <= ulp + 2 * absum * 4096 * 2.0 ** -24).all()
        assert ((on - off).abs() <= ulp).float().mean() > 0.999  # almost everywhere within one ulp
