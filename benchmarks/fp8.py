"""``fp8_scaled_mm``: FP8 GEMM with per-token activation and per-channel
weight scales (``scale_a [M, 1]``, ``scale_b [N]``), bf16 out.

Providers: ``auto`` and every backend of the ``fp8`` registry family that
implements ``fp8_scaled_mm``; baselines: the common GEMM baselines (bf16
``F.linear``, ``torch._scaled_mm`` per-tensor and row-wise).
"""

from __future__ import annotations

import torch

from .baselines import gemm_baselines, gemm_flops, gemm_inputs, to_f64
from .harness import OpBench

__all__ = ["benches", "prepare", "reference"]


def prepare(logical):
    """Logical bf16 (x, w) -> ``(a, b, scale_a [M, 1], scale_b [N], None, bf16)``."""
    from scaledmm.ops.fp8 import reference_quant

    x, w = logical
    a, sa = reference_quant(x, per_token=True)
    b, sb = reference_quant(w, per_token=True)
    return a, b, sa, sb.reshape(-1), None, torch.bfloat16


def reference(args) -> torch.Tensor:
    """float64 ``(a * scale_a) @ (b * scale_b).T``."""
    a, b, sa, sb, _, _ = args
    return (a.double() * sa.double().reshape(-1, 1)) @ (b.double() * sb.double().reshape(-1, 1)).t()


def _problem(args):
    from scaledmm.ops import fp8 as ops

    a, b, sa, sb, bias, out_dtype = args
    kind_a, kind_b = ops.check_mm_args("fp8_scaled_mm", a, b, sa, sb, bias, out_dtype)
    return ops.mm_problem(a, b, kind_a, kind_b, bias, out_dtype)


def benches() -> list[OpBench]:
    return [OpBench(
        family="fp8", op="fp8_scaled_mm", registry="fp8",
        make_inputs=gemm_inputs, prepare=prepare, reference=reference, to_f64=to_f64,
        problem=_problem, flops=gemm_flops, baselines=gemm_baselines, default_shapes="llama8b", unit="fp8",
    )]
