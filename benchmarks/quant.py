"""Activation quantizers (memory-bound; reported in GB/s against the copy
ceiling): ``per_token_group_quant_fp8`` (1 x 128 groups, column-major scales
as the block GEMM wants them), ``quant_fp8`` (dynamic per-token) and
``nvfp4_quant`` (16-element blocks, swizzled scales).

Providers: ``auto`` and every backend of the op's registry family
(``fp8_block``, ``fp8``, ``nvfp4``) that implements it.  Baseline for the FP8
quantizers: ``cast_fp8``, a plain ``x.to(float8_e4m3fn)`` (one read, one
one-byte write: the least a quantizer can cost).  Outputs are compared after
dequantization with SPEC.md's formula: scales in float32 (as the ops return
them), values ``x / s`` in float64, each evaluated a few fp32 ulps either side
(SPEC.md lets a code differ where fp32 rounding meets a code boundary).  The
check is the fraction of elements matching none of those candidates.
"""

from __future__ import annotations

import torch

from scaledmm.oplib import FP8_DTYPE as FP8, FP8_MAX

from .harness import BASELINE, OpBench, Provider, mismatch_fraction
from .shapes import Shape

__all__ = ["benches"]

GROUP = 128
TOL = 1e-4  # largest fraction of elements matching no candidate


def _inputs(m: int, shape: Shape, device: torch.device) -> tuple[torch.Tensor]:
    return (torch.randn(m, shape.k, dtype=torch.bfloat16, device=device),)


def _no_flops(m: int, shape: Shape) -> float:
    return 0.0


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 value of e4m3 round-to-nearest-even of ``v`` (saturating)."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8).double()


# SPEC.md lets a code differ where fp32 rounding meets a code boundary: each
# reference lists the formula's results for values nudged this much either way.
BAND = 2.0 ** -21  # 8 fp32 ulps


def _either_side(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return v * (1 - BAND), v * (1 + BAND)


# -- per_token_group_quant_fp8 -------------------------------------------------


def _group_prepare(logical):
    return logical[0], GROUP, 1e-10, True, False


def _group_reference(args) -> tuple[torch.Tensor, ...]:
    """``s * e4m3(x / s)`` with ``s = max(amax, eps) / 448`` in float32."""
    x, g, eps, _, ue8m0 = args
    m, k = x.shape
    xg = x.double().reshape(m, k // g, g)
    s = (xg.abs().amax(dim=-1).float().clamp(min=eps) / FP8_MAX).double()
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    s = s.unsqueeze(-1)
    return tuple((_e4m3(v) * s).reshape(m, k) for v in _either_side(xg / s))


def _group_to_f64(out) -> torch.Tensor:
    q, s = out
    g = q.shape[1] // max(1, s.shape[1])
    return q.double() * s.double().repeat_interleave(g, dim=1)


# -- quant_fp8 (dynamic per-token) ------------------------------------------


def _token_prepare(logical):
    return logical[0], None, True


def _token_reference(args) -> tuple[torch.Tensor, ...]:
    x = args[0].double()
    s = (x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-10) / FP8_MAX).double()
    return tuple(_e4m3(v) * s for v in _either_side(x / s))


def _token_to_f64(out) -> torch.Tensor:
    q, s = out
    return q.double() * s.double()


# -- nvfp4_quant ---------------------------------------------------------------


def _nvfp4_prepare(logical):
    from .nvfp4 import global_scale

    x = logical[0]
    return x, global_scale(x), True


def _nvfp4_reference(args) -> tuple[torch.Tensor, ...]:
    """``s * e2m1(x * gs / s)`` per 16-element block with ``s = e4m3(gs * amax
    / 6)`` (not divided by gs); the scale and the value both either side."""
    from scaledmm.ops.nvfp4 import e2m1_decode, e2m1_encode

    x, gs, _ = args
    m, k = x.shape
    xb = x.double().reshape(m, k // 16, 16)
    scaled_amax = (gs.float() * xb.abs().amax(dim=-1).float() / 6.0).double()
    out = []
    for t in _either_side(scaled_amax):
        s = _e4m3(t).unsqueeze(-1)
        for v in _either_side((xb * gs.double() / s).clamp(-6.0, 6.0)):
            vals = torch.where(s == 0, 0.0, e2m1_decode(e2m1_encode(v)).double())
            out.append((vals * s).reshape(m, k))
    return tuple(out)


def _nvfp4_to_f64(out) -> torch.Tensor:
    from scaledmm.ops.nvfp4 import dequantize

    q, s = out
    return dequantize(q, s).double()


def _problem(registry: str, out_dtype: torch.dtype, options=()):
    def problem(args):
        from scaledmm.backends import Family, Problem

        x = args[0]
        return Problem(Family.parse(registry), x.device, x.shape[0], 0, x.shape[1], x.dtype, out_dtype,
                       x.stride(0), options)

    return problem


# -- baseline ------------------------------------------------------------------


def _x_only(logical):
    return (logical[0],)


def _cast(x: torch.Tensor) -> torch.Tensor:
    return x.to(FP8)


cast_fp8 = Provider("cast_fp8", BASELINE, _x_only, _cast, lambda args: _e4m3(args[0].double()),
                    lambda out: out.double(), None, tol=0.0, error=mismatch_fraction)


def benches() -> list[OpBench]:
    common = dict(family="quant", make_inputs=_inputs, flops=_no_flops, default_shapes="dsv3", tol=TOL,
                  error=mismatch_fraction, uses_weight=False)
    return [
        OpBench(op="per_token_group_quant_fp8", registry="fp8_block", prepare=_group_prepare,
                reference=_group_reference, to_f64=_group_to_f64,
                problem=_problem("fp8_block", FP8, (("group_size", GROUP), ("column_major_scales", True),
                                                    ("scale_ue8m0", False))),
                baselines=lambda device: [cast_fp8], **common),
        OpBench(op="quant_fp8", registry="fp8", prepare=_token_prepare, reference=_token_reference,
                to_f64=_token_to_f64, problem=_problem("fp8", FP8, (("quant", "per_token"),)),
                baselines=lambda device: [cast_fp8], **common),
        OpBench(op="nvfp4_quant", registry="nvfp4", prepare=_nvfp4_prepare, reference=_nvfp4_reference,
                to_f64=_nvfp4_to_f64, problem=_problem("nvfp4", torch.uint8, (("swizzle", True),)),
                baselines=lambda device: [], **common),
    ]
