"""``nvfp4_quant`` against the float64 model of SPEC.md: every dtype, odd M,
strided rows, special values, error bounds; on CPU and (``gpu``) CUDA."""

from __future__ import annotations

import pytest
import torch

import scaledmm  # noqa: F401  (registers the ops)
from scaledmm.ops import nvfp4 as N

from helpers import requires_cuda
from nvfp4_helpers import check_quant, gs_for, ref_scaled, ref_unpack

ops = torch.ops.scaledmm


# ----------------------------------------------------------------------------
# Quantizer
# ----------------------------------------------------------------------------


QUANT_M = [0, 1, 3, 17, 129]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("swizzle", [True, False])
def test_quant_matches_spec(dtype, swizzle):
    for m in QUANT_M:
        for k in (16, 48, 208):
            x = (torch.randn(m, k) * 3).to(dtype)
            gs = gs_for(x)
            q, s = ops.nvfp4_quant(x, gs, swizzle)
            check_quant(x, gs, q, s, swizzle)


def test_quant_strided_rows_and_scale_shapes():
    base = torch.randn(7, 112, dtype=torch.bfloat16)
    x = base[:, :80]  # row stride 112
    gs = gs_for(x)
    q, s = ops.nvfp4_quant(x, gs.reshape(1, 1), True)  # any one-element shape
    check_quant(x, gs, q, s, True)
    q2, s2 = ops.nvfp4_quant(x.contiguous(), gs, True)
    assert torch.equal(q, q2) and torch.equal(s.view(torch.uint8), s2.view(torch.uint8))


def test_quant_special_values():
    x = torch.randn(6, 64)
    x[1, 3] = float("nan")
    x[2, 20] = float("inf")
    x[3, :16] = 0.0
    x[4, 16:32] = 1e-30
    x[5, 40] = -1e30
    gs = torch.tensor(10.0)
    q, s = ops.nvfp4_quant(x, gs, False)
    check_quant(x, gs, q, s, False)
    sf = s.float()
    assert sf[1, 0].isnan() and not sf[1, 1:].isnan().any()  # only the NaN's block
    assert sf[2, 1] == 448.0 and ref_unpack(q)[2, 20] == 7  # Inf saturates
    assert sf[3, 0] == 0 and (ref_unpack(q)[3, :16] == 0).all()  # zero block: s = 0, codes 0
    assert sf[4, 1] == 0 and (ref_unpack(q)[4, 16:32] == 0).all()  # underflows to s = 0
    assert sf[5, 2] == 448.0 and ref_unpack(q)[5, 40] == 15


def test_quant_dequant_error_bounds():
    x = torch.randn(33, 272) * torch.exp(torch.randn(33, 1))
    gs = gs_for(x)
    q, s = ops.nvfp4_quant(x, gs, True)
    s_lin = N.unswizzle_block_scales(s, 33, 17).float().repeat_interleave(16, dim=1)
    v = ref_scaled(x, gs, s_lin[:, ::16]).clamp(-6, 6)  # the scaled value the code approximates
    vq = N.e2m1_decode(N.unpack_e2m1(q))
    half_gap = torch.where(v.abs() <= 2, 0.25, torch.where(v.abs() <= 4, 0.5, 1.0))
    assert ((vq - v).abs() <= half_gap).all()
    deq = N.dequantize(q, s, gs)
    assert torch.allclose(deq, vq * s_lin / gs, rtol=1e-6, atol=0)
    # scale rounding keeps x / (s / gs) <= 6 * (1 + 2^-4), so clamping costs < 0.375 step
    assert ((deq - x).abs() <= s_lin / gs * 1.0 + 1e-30).all()
    rel = ((deq - x).norm() / x.norm()).item()
    assert rel < 0.12, rel


# ----------------------------------------------------------------------------
# GPU: the same numerics with the auto-selected backend
# ----------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("swizzle", [True, False])
def test_cuda_quant_matches_spec(dtype, swizzle):
    for m in (0, 1, 3, 17, 129, 300):
        for k in (64, 208, 4096):
            x = (torch.randn(m, k, device="cuda") * 3).to(dtype)
            if m > 2:
                x[1, 5] = float("nan")
                x[2, 7] = float("inf")
            gs = gs_for(x).cuda()
            q, s = ops.nvfp4_quant(x, gs, swizzle)
            assert q.is_cuda and s.is_cuda
            check_quant(x, gs, q, s, swizzle)
