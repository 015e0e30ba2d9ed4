"""Baseline GEMMs every quantized family is compared with, on the same logical
problem (a bf16 activation ``x [M, K]`` and weight ``w [N, K]``):

* ``bf16_linear``: ``F.linear`` in bf16 (cuBLAS), what an unquantized layer costs;
* ``scaled_mm_tensor``: ``torch._scaled_mm`` FP8 with per-tensor scales;
* ``scaled_mm_rowwise``: ``torch._scaled_mm`` FP8 with per-row (token) and
  per-column (channel) scales.

Each builds its own operands from the logical inputs (untimed; FP8 operands
through ``scaledmm.ops.fp8.reference_quant``) and carries a float64 reference
of what it computes from them.  A baseline that does not run on the device
(or at this M) is reported as n/a.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import BASELINE, Provider
from .shapes import Shape

__all__ = ["gemm_inputs", "gemm_flops", "bf16_linear", "scaled_mm_tensor", "scaled_mm_rowwise",
           "gemm_baselines", "to_f64"]


def gemm_inputs(m: int, shape: Shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The logical GEMM problem: fresh bf16 ``x [M, K]`` and ``w [N, K]`` (normal(0, 1))."""
    x = torch.randn(m, shape.k, dtype=torch.bfloat16, device=device)
    w = torch.randn(shape.n, shape.k, dtype=torch.bfloat16, device=device)
    return x, w


def gemm_flops(m: int, shape: Shape) -> float:
    return 2.0 * m * shape.n * shape.k


def to_f64(out: torch.Tensor) -> torch.Tensor:
    return out.double()


# -- bf16 F.linear -----------------------------------------------------------


def _bf16_prepare(logical):
    x, w = logical[:2]
    return x.to(torch.bfloat16), w.to(torch.bfloat16).contiguous()


def _bf16_reference(args):
    x, w = args
    return x.double() @ w.double().t()


bf16_linear = Provider("bf16_linear", BASELINE, _bf16_prepare, F.linear, _bf16_reference, to_f64, "bf16")


# -- torch._scaled_mm, per-tensor --------------------------------------------


def _tensor_prepare(logical):
    from scaledmm.ops.fp8 import reference_quant

    x, w = logical[:2]
    qa, sa = reference_quant(x)
    qb, sb = reference_quant(w)
    return qa, qb, sa.reshape(()), sb.reshape(())


def _scaled_mm(a, b, sa, sb):
    return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _scaled_reference(args):
    a, b, sa, sb = args
    sb = sb.double().reshape(-1, 1) if sb.numel() > 1 else sb.double()  # per-channel: one per row of b
    return (a.double() * sa.double()) @ (b.double() * sb).t()


scaled_mm_tensor = Provider("scaled_mm_tensor", BASELINE, _tensor_prepare, _scaled_mm, _scaled_reference,
                            to_f64, "fp8")


# -- torch._scaled_mm, rowwise -------------------------------------------------


def _rowwise_prepare(logical):
    from scaledmm.ops.fp8 import reference_quant

    x, w = logical[:2]
    qa, sa = reference_quant(x, per_token=True)  # [M, 1]
    qb, sb = reference_quant(w, per_token=True)  # [N, 1]
    return qa, qb, sa, sb.reshape(1, -1)


scaled_mm_rowwise = Provider("scaled_mm_rowwise", BASELINE, _rowwise_prepare, _scaled_mm, _scaled_reference,
                             to_f64, "fp8")


def gemm_baselines(device: torch.device) -> list[Provider]:
    """The three GEMM baselines (they report n/a where torch cannot run them)."""
    return [bf16_linear, scaled_mm_tensor, scaled_mm_rowwise]
