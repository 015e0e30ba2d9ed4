"""NVFP4 GEMMs: ``nvfp4_mm`` (W4A4: both operands e2m1 with e4m3 block
scales, swizzled) and ``nvfp4_w4a16_mm`` (bf16 activation, NVFP4 weight).

Providers: ``auto`` and every backend of the ``nvfp4`` registry family that
implements the op; baselines: the common GEMM baselines.  Rates are compared
with the bf16 ceiling (on Hopper the kernels run on bf16 tensor cores).
Operands are quantized with the ops module's reference quantizer and a global
scale of ``448 * 6 / amax``, so ``alpha = 1 / (gs_a * gs_b)``.
"""

from __future__ import annotations

import torch

from .baselines import gemm_baselines, gemm_flops, gemm_inputs, to_f64
from .harness import OpBench

__all__ = ["benches", "prepare_mm", "reference_mm", "prepare_w4a16", "reference_w4a16", "global_scale"]


def global_scale(t: torch.Tensor) -> torch.Tensor:
    """Quantize multiplier ``448 * 6 / amax`` as a float32 0-D tensor (on the device)."""
    amax = t.float().abs().amax() if t.numel() else t.new_ones((), dtype=torch.float32)
    return (448.0 * 6.0 / amax.clamp(min=1e-10)).reshape(())


def _quant(t: torch.Tensor):
    from scaledmm.ops.nvfp4 import reference_quant

    gs = global_scale(t)
    q, s = reference_quant(t, gs, True)
    return q, s, gs


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Exact float64 values of packed codes with swizzled block scales."""
    from scaledmm.ops.nvfp4 import dequantize

    return dequantize(q, s).double()  # e2m1 x e4m3 products are exact in float32


def prepare_mm(logical):
    """Logical bf16 (x, w) -> ``(a, b, a_scales, b_scales, alpha, bf16, None)``."""
    x, w = logical
    a, sa, gsa = _quant(x)
    b, sb, gsb = _quant(w)
    return a, b, sa, sb, (1.0 / (gsa * gsb)).reshape(()), torch.bfloat16, None


def reference_mm(args) -> torch.Tensor:
    a, b, sa, sb, alpha, _, _ = args
    return alpha.double() * (_deq(a, sa) @ _deq(b, sb).t())


def prepare_w4a16(logical):
    """Logical bf16 (x, w) -> ``(x, b, b_scales, weight_alpha, bf16, None)``."""
    x, w = logical
    b, sb, gsb = _quant(w)
    return x, b, sb, (1.0 / gsb).reshape(()), torch.bfloat16, None


def reference_w4a16(args) -> torch.Tensor:
    x, b, sb, walpha, _, _ = args
    return x.double() @ (walpha.double() * _deq(b, sb)).t()


def _mm_problem(args):
    from scaledmm.ops import nvfp4 as ops

    a, b, sa, sb, alpha, out_dtype, bias = args
    ops.check_mm_args("nvfp4_mm", a, b, sa, sb, alpha, out_dtype, bias)
    return ops.mm_problem(a, b, out_dtype, bias)


def _w4a16_problem(args):
    from scaledmm.ops import nvfp4 as ops

    x, b, sb, walpha, out_dtype, bias = args
    ops.check_w4a16_args("nvfp4_w4a16_mm", x, b, sb, walpha, out_dtype, bias)
    return ops.w4a16_problem(x, b, out_dtype, bias)


def benches() -> list[OpBench]:
    common = dict(family="nvfp4", registry="nvfp4", make_inputs=gemm_inputs, to_f64=to_f64, flops=gemm_flops,
                  baselines=gemm_baselines, default_shapes="llama8b", unit="bf16")
    return [
        OpBench(op="nvfp4_mm", prepare=prepare_mm, reference=reference_mm, problem=_mm_problem, **common),
        OpBench(op="nvfp4_w4a16_mm", prepare=prepare_w4a16, reference=reference_w4a16, problem=_w4a16_problem,
                **common),
    ]
