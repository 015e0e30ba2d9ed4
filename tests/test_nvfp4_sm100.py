"""The NVFP4 backend registry and the sm100 backends (torch ``_scaled_mm``,
FlashInfer CuTe DSL): argument preparation and gates, on CPU."""

from __future__ import annotations

import inspect
import sys
import types
import typing

import pytest
import torch

import scaledmm  # noqa: F401  (registers the ops)
from scaledmm import backends
from scaledmm.ops import nvfp4 as N
from scaledmm.ops import nvfp4_sm100 as S

from nvfp4_helpers import quantized

ops = torch.ops.scaledmm
E4M3 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------
# Registry, sm100 backends (argument preparation and gates, on CPU)
# ----------------------------------------------------------------------------


def test_backends_registered_with_op_signatures():
    names = backends.names("nvfp4")
    assert {"reference", "torch", "flashinfer_cutedsl"} <= set(names)
    schema_args = {
        "nvfp4_quant": ["x", "global_scale", "swizzle"],
        "nvfp4_mm": ["a", "b", "a_scales", "b_scales", "alpha", "out_dtype", "bias"],
        "nvfp4_w4a16_mm": ["x", "b", "b_scales", "weight_alpha", "out_dtype", "bias"],
        "nvfp4_linear": ["x", "b", "b_scales", "global_scale", "alpha", "out_dtype", "bias"],
        "nvfp4_dynamic_linear": ["x", "x_amax", "b", "b_scales", "weight_alpha", "out_dtype", "bias"],
    }
    for op_name, args in schema_args.items():
        assert [a.name for a in getattr(ops, op_name).default._schema.arguments] == args
    for name in ("reference", "composite", "torch", "flashinfer_cutedsl"):
        for op_name, impl in backends.get("nvfp4", name).impls.items():
            params = list(inspect.signature(impl).parameters)
            assert len(params) == len(schema_args[op_name]), (name, op_name, params)
    assert set(backends.get("nvfp4", "reference").impls) == set(schema_args)
    assert backends.priority("nvfp4", "cpu") == ["composite", "reference"]


@pytest.mark.skipif(N.FP4_DTYPE is None, reason="torch without float4_e2m1fn_x2")
@pytest.mark.parametrize("m,pad", [(0, 0), (1, 0), (3, 16), (130, 0)])
def test_torch_backend_args_are_views(m, pad):
    n, k = 48, 96
    base = torch.randint(0, 256, (m, k // 2 + pad), dtype=torch.uint8)
    a = base[:, : k // 2]
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    sa = torch.zeros(N.swizzled_shape(m, k // 16), dtype=E4M3)
    sb = torch.zeros(N.swizzled_shape(n, k // 16), dtype=E4M3)
    args, kwargs = S.torch_backend_args(a, b, sa, sb)
    a4, b4, s_a, s_b = args
    assert kwargs == {"out_dtype": torch.float32}
    assert a4.dtype == torch.float4_e2m1fn_x2 and a4.shape == (m, k // 2) and a4.stride() == a.stride()
    assert b4.dtype == torch.float4_e2m1fn_x2 and b4.shape == (k // 2, n) and b4.stride() == (1, k // 2)
    assert s_a.dtype == E4M3 and s_a.dim() == 1 and s_a.numel() == sa.numel()
    assert s_b.dtype == E4M3 and s_b.dim() == 1 and s_b.numel() == sb.numel()
    for view, src in ((a4, a), (b4, b), (s_a, sa), (s_b, sb)):
        assert view.data_ptr() == src.data_ptr(), "argument preparation must not copy"
    # torch's own shape/layout checks for _scaled_mm (the meta kernel applies the CUDA rules)
    metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (a, b, sa, sb)]
    margs, mkw = S.torch_backend_args(*metas)
    out = torch._scaled_mm(*margs, **mkw)
    assert out.shape == (m, n) and out.dtype == torch.float32
    with pytest.raises(RuntimeError):  # the same check rejects scales of the wrong size
        torch._scaled_mm(margs[0], margs[1], margs[2], margs[3][:-4], **mkw)


def _fake_scaled_mm(a4, b4, scale_a, scale_b, out_dtype=None):
    """What cuBLASLt computes for the NVFP4 recipe, from torch's argument layout."""
    a = a4.view(torch.uint8)
    b = b4.t().view(torch.uint8)
    k16 = 2 * a.shape[1] // 16
    sa = scale_a.view(N.swizzled_shape(a.shape[0], k16))
    sb = scale_b.view(N.swizzled_shape(b.shape[0], k16))
    return (N.dequantize(a, sa) @ N.dequantize(b, sb).t()).to(out_dtype)


@pytest.mark.skipif(N.FP4_DTYPE is None, reason="torch without float4_e2m1fn_x2")
def test_torch_backend_epilogue_with_emulated_scaled_mm(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm)
    m, n, k = 5, 32, 64
    _, a, sa, ga = quantized(m, k)
    _, b, sb, gb = quantized(n, k)
    alpha = (1 / ga) * (1 / gb)
    bias = torch.randn(n, dtype=torch.bfloat16)
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = S.torch_mm(a, b, sa, sb, alpha, out_dtype, bias)
        exp = N.reference_mm(a, b, sa, sb, alpha, out_dtype, bias)
        assert got.dtype == out_dtype and torch.equal(got, exp)


def test_torch_backend_gate_reasons(monkeypatch):
    be = backends.get("nvfp4", "torch")
    ok, why = be.is_supported(torch.device("cpu"))
    assert not ok and "CUDA device" in why
    if N.FP4_DTYPE is None:
        return
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    for cap, want in (((9, 0), False), ((8, 9), False), ((10, 0), True), ((10, 3), True), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        ok, why = be.is_supported(cuda)
        assert ok == want, (cap, why)
        if not ok:
            assert f"sm{cap[0]}{cap[1]}" in why
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    ok, why = be.is_supported(cuda)
    assert not ok and "12.8" in why
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not be.is_supported(cuda)[0]


def _problem(m=8, n=32, k=64, stride=None, out_dtype=torch.bfloat16, w4a16=False):
    return backends.Problem(backends.Family.NVFP4, torch.device("cuda", 0), m, n, k,
                            torch.bfloat16 if w4a16 else torch.uint8, out_dtype,
                            k if stride is None else stride, (("bias", False), ("w4a16", w4a16)))


@pytest.mark.parametrize("name", ["torch", "flashinfer_cutedsl"])
def test_sm100_backends_can_implement(name):
    ci = backends.get("nvfp4", name).can_implement
    assert ci(_problem())[0]
    assert ci(_problem(m=0))[0] and ci(_problem(m=3))[0]
    ok, why = ci(_problem(k=48))
    assert not ok and "K % 32" in why
    ok, why = ci(_problem(n=24))
    assert not ok and "N % 16" in why
    ok, why = ci(_problem(w4a16=True))
    assert not ok and "W4A4" in why
    ok, why = ci(_problem(stride=80))
    assert not ok and "stride" in why
    if name == "flashinfer_cutedsl":
        ok, why = ci(_problem(out_dtype=torch.float32))
        assert not ok and "out_dtype" in why
    else:
        assert ci(_problem(out_dtype=torch.float32))[0] and ci(_problem(stride=128))[0]


def _fake_flashinfer(with_cute_dsl=True, calls=None):
    mod = types.ModuleType("flashinfer")
    lit = typing.Literal["cudnn", "trtllm", "cutlass", "cute-dsl", "auto"] if with_cute_dsl else \
        typing.Literal["cudnn", "trtllm", "cutlass", "auto"]

    def mm_fp4(a, b, a_descale, b_descale, alpha=None, out_dtype=torch.bfloat16, out=None,
               block_size=16, use_8x4_sf_layout=False, backend: lit = "auto", use_nvfp4=True):
        # FlashInfer's documented layout: b is (K/2, N) column-major, b_descale
        # the transposed swizzled (N', K/16') scales; alpha a one-element fp32.
        assert b.stride(0) == 1 and b_descale.stride(0) == 1 and alpha.numel() == 1
        if calls is not None:
            calls.append(backend)
        acc = N.dequantize(a, a_descale) @ N.dequantize(b.t(), b_descale.t()).t()
        return (acc * alpha).to(out_dtype)

    mm_fp4.__annotations__["backend"] = lit
    mod.mm_fp4 = mm_fp4
    return mod


def test_flashinfer_gate_reasons(monkeypatch):
    be = backends.get("nvfp4", "flashinfer_cutedsl")
    try:
        import flashinfer  # noqa: F401
        has_flashinfer = True
    except Exception:
        has_flashinfer = False
    ok, why = be.is_supported(torch.device("cpu"))
    assert not ok
    if not has_flashinfer:
        assert "flashinfer is not installed" in why
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(with_cute_dsl=False))
    ok, why = be.is_supported(torch.device("cpu"))
    assert not ok and "cute-dsl" in why
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    ok, why = be.is_supported(torch.device("cpu"))
    assert not ok and "CUDA device" in why
    cuda = torch.device("cuda", 0)
    for cap, want in (((9, 0), False), ((12, 0), False), ((10, 0), True), ((10, 3), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        ok, why = be.is_supported(cuda)
        assert ok == want, (cap, why)
        if not ok:
            assert f"sm{cap[0]}{cap[1]}" in why


def test_flashinfer_backend_call_with_emulated_mm_fp4(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(calls=calls))
    m, n, k = 5, 32, 64
    _, a, sa, ga = quantized(m, k)
    _, b, sb, gb = quantized(n, k)
    alpha = (1 / ga) * (1 / gb)
    bias = torch.randn(n, dtype=torch.bfloat16)
    got = S.flashinfer_cutedsl_mm(a, b, sa, sb, alpha, torch.bfloat16, bias)
    exp = N.reference_mm(a, b, sa, sb, alpha, torch.float32)
    assert calls == ["cute-dsl"]
    assert torch.equal(got, (exp.bfloat16().float() + bias.float()).bfloat16())
    assert S.flashinfer_cutedsl_mm(a[:0], b, sa[:0], sb, alpha, torch.float16, None).shape == (0, n)
