"""``fp8_scaled_mm`` with per-tensor scales on both operands (one element
each, the ``Fp8Linear`` format ``"fp8_tensor"``), bf16 out: the op's
``tensorwise`` variant, whose selection rows are its own
(``op_shapes['fp8_scaled_mm:tensorwise']``: cuBLAS's per-tensor kernel is a
different kernel from its row-wise one).
Providers: ``auto`` and every backend of the ``fp8`` registry family that
implements ``fp8_scaled_mm``; baselines: the common GEMM baselines.  Rows for
the policy: ``python -m benchmarks.tune fp8_tensorwise.csv --family fp8 --op
fp8_scaled_mm --op-rows --variant tensorwise``.
"""

from __future__ import annotations

import torch

from . import fp8
from .baselines import gemm_baselines, gemm_flops, gemm_inputs, to_f64
from .harness import OpBench

__all__ = ["benches", "prepare"]


def prepare(logical):
    """Logical bf16 (x, w) -> ``(a, b, scale_a [1], scale_b [1], None, bf16)``."""
    from scaledmm.ops.fp8 import reference_quant

    x, w = logical
    a, sa = reference_quant(x)
    b, sb = reference_quant(w)
    return a, b, sa, sb, None, torch.bfloat16


def benches() -> list[OpBench]:
    return [OpBench(
        family="fp8_tensorwise", op="fp8_scaled_mm", registry="fp8",
        make_inputs=gemm_inputs, prepare=prepare, reference=fp8.reference, to_f64=to_f64,
        problem=fp8._problem, flops=gemm_flops, baselines=gemm_baselines, default_shapes="llama8b", unit="fp8",
    )]
