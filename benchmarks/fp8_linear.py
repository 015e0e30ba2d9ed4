"""``fp8_linear``: bf16 activation in, dynamic per-token quantization and the
per-channel FP8 GEMM, as the ``Fp8Linear`` layer (format ``"fp8"``) calls it.

Which backend should run the layer: ``cuda_gemv`` (quantize + GEMM in one
launch, M <= 16) or ``composite`` (``quant_fp8``, then ``fp8_scaled_mm`` as
its own rows pick it)?  Providers: ``auto`` and every backend of the ``fp8``
family that implements the op; baselines ``quant_<gemm>`` (the quantize op,
then the GEMM forced onto one backend) and the common GEMM baselines.
"""

from __future__ import annotations

import torch

from .baselines import gemm_baselines, gemm_flops, gemm_inputs, to_f64
from .harness import BASELINE, OpBench, Provider

__all__ = ["benches", "prepare", "reference"]


def prepare(logical):
    """Logical bf16 (x, w) -> the op's arguments: ``x`` as it is, the weight
    quantized per channel (untimed), dynamic per-token activation, no bias."""
    from scaledmm.ops.fp8 import reference_quant

    x, w = logical
    b, sb = reference_quant(w, per_token=True)
    return x, b, sb.reshape(-1), None, True, None, torch.bfloat16


def reference(args) -> torch.Tensor:
    """float64 GEMM of the reference quantization of ``x`` (SPEC.md)."""
    from scaledmm.ops.fp8 import reference_quant

    x, b, sb, scale_x, per_token, _, _ = args
    a, sa = reference_quant(x, scale_x, per_token)
    return (a.double() * sa.double().reshape(-1, 1)) @ (b.double() * sb.double().reshape(-1, 1)).t()


def _problem(args):
    from scaledmm.ops import fp8 as ops

    x, b, sb, scale_x, per_token, bias, out_dtype = args
    kind_b = ops.check_linear_args(x, b, sb, scale_x, per_token, bias, out_dtype)
    return ops.linear_problem(x, b, scale_x, per_token, kind_b, bias, out_dtype)


def _quant_then(name: str) -> Provider:
    """The quantize op (automatic selection), then the GEMM on backend ``name``."""
    import scaledmm

    def call(x, b, sb, scale_x, per_token, bias, out_dtype):
        q, s = torch.ops.scaledmm.quant_fp8(x, scale_x, per_token)
        with scaledmm.use_backend("fp8", name):
            return torch.ops.scaledmm.fp8_scaled_mm(q, b, s, sb, bias, out_dtype)

    return Provider(f"quant_{name}", BASELINE, prepare, call, reference, to_f64, "fp8")


def _baselines(device: torch.device) -> list[Provider]:
    from scaledmm import backends

    out = []
    for name in backends.names("fp8"):
        b = backends.get("fp8", name)
        if name != "reference" and "fp8_scaled_mm" in b.impls and b.is_supported(device)[0]:
            out.append(_quant_then(name))
    return out + gemm_baselines(device)


def benches() -> list[OpBench]:
    return [OpBench(
        family="fp8_linear", op="fp8_linear", registry="fp8",
        make_inputs=gemm_inputs, prepare=prepare, reference=reference, to_f64=to_f64,
        problem=_problem, flops=gemm_flops, baselines=_baselines, default_shapes="llama8b",
        unit="fp8", requires=("quant_fp8", "fp8_scaled_mm"),
    )]
