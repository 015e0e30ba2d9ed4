"""``nvfp4_linear``: bf16 activation in, NVFP4 quantization with the
activation's global scale, the W4A4 GEMM: the op ``NvFp4Linear`` (W4A4) calls.

Does quantize + GEMM in one launch (``gemv_linear``: csrc/nvfp4_gemv.cu with
G_QUANT, M <= 8, not a registered backend) beat ``composite``
(``nvfp4_quant``, then ``nvfp4_mm`` as its own rows pick it)?  Providers:
``auto`` and every backend of the ``nvfp4`` family that implements the op;
baselines ``gemv_linear`` (sm90), ``quant_<gemm>`` (the quantize op, then the
GEMM forced onto one backend) and the common GEMM baselines.
"""

from __future__ import annotations

import torch

from .baselines import gemm_baselines, gemm_flops, gemm_inputs, to_f64
from .harness import BASELINE, OpBench, Provider
from .nvfp4 import _deq, _quant, global_scale

__all__ = ["benches", "prepare", "reference"]


def prepare(logical):
    """Logical bf16 (x, w) -> ``(x, b, b_scales, global_scale, alpha, bf16,
    None)``: the weight quantized (untimed), the activation's global scale
    from its amax, as a dynamic-scale layer computes it before the op."""
    x, w = logical
    b, sb, gsb = _quant(w)
    gsa = global_scale(x)
    return x, b, sb, gsa, (1.0 / (gsa * gsb)).reshape(()), torch.bfloat16, None


def reference(args) -> torch.Tensor:
    """float64 GEMM of the reference quantization of ``x`` (SPEC.md)."""
    from scaledmm.ops.nvfp4 import reference_quant

    x, b, sb, gsa, alpha, _, _ = args
    a, sa = reference_quant(x, gsa, True)
    return alpha.double() * (_deq(a, sa) @ _deq(b, sb).t())


def _problem(args):
    from scaledmm.ops import nvfp4 as ops

    x, b, sb, gsa, alpha, out_dtype, bias = args
    ops.check_linear_args(x, b, sb, gsa, alpha, out_dtype, bias)
    return ops.linear_problem(x, b, out_dtype, bias)


def _quant_then(name: str) -> Provider:
    """The quantize op (automatic selection), then the GEMM on backend ``name``."""
    import scaledmm

    def call(x, b, sb, gsa, alpha, out_dtype, bias):
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gsa, True)
        with scaledmm.use_backend("nvfp4", name):
            return torch.ops.scaledmm.nvfp4_mm(q, b, s, sb, alpha, out_dtype, bias)

    return Provider(f"quant_{name}", BASELINE, prepare, call, reference, to_f64, "bf16")


def _gemv_linear() -> Provider:
    from scaledmm.ops import nvfp4_gemv as gv

    def call(x, b, sb, gsa, alpha, out_dtype, bias):
        return gv.gemv_linear(x, b, sb, gsa, alpha, out_dtype, bias)

    return Provider("gemv_linear", BASELINE, prepare, call, reference, to_f64, "bf16")


def _baselines(device: torch.device) -> list[Provider]:
    from scaledmm import backends
    from scaledmm.ops import nvfp4_gemv as gv

    out = [_gemv_linear()] if gv.is_supported(device)[0] else []
    for name in backends.names("nvfp4"):
        b = backends.get("nvfp4", name)
        if name != "reference" and "nvfp4_mm" in b.impls and b.is_supported(device)[0]:
            out.append(_quant_then(name))
    return out + gemm_baselines(device)


def benches() -> list[OpBench]:
    return [OpBench(
        family="nvfp4_linear", op="nvfp4_linear", registry="nvfp4",
        make_inputs=gemm_inputs, prepare=prepare, reference=reference, to_f64=to_f64,
        problem=_problem, flops=gemm_flops, baselines=_baselines, default_shapes="llama8b",
        unit="bf16", requires=("nvfp4_quant", "nvfp4_mm"),
    )]
