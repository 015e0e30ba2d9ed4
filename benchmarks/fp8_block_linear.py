"""``fp8_block_linear``: bf16 activation in, 1x128 group quantization and the
128x128 block-scaled GEMM, as the ``Fp8BlockLinear`` layer calls it.

Which backend should run the layer: ``triton`` (its quantizer, then its own
GEMM) or ``composite`` (the quantize op, then ``fp8_block_mm`` as the
measured table picks it: cuBLAS / CUTLASS at large M)?  Providers: ``auto``
and every backend of the ``fp8_block`` family that implements the op;
baselines ``quant_<gemm>`` (the quantize op, then the GEMM forced onto one
backend, for every GEMM backend this device runs), ``triton_fused`` (the
quantization inside the Triton GEMM's tile loads, ``fuse=True``),
``wgmma_fused`` (``fp8_wgmma.block_linear``: one launch, the consumer
warpgroups quantize each stage before its MMAs; not a registered backend)
and the common GEMM baselines.
"""

from __future__ import annotations

import torch

from .baselines import gemm_baselines, gemm_flops, gemm_inputs, to_f64
from .fp8_block import BLOCK
from .fp8_block import reference as mm_reference
from .harness import BASELINE, OpBench, Provider

__all__ = ["benches", "prepare", "reference"]


def prepare(logical):
    """Logical bf16 (x, w) -> the op's arguments: ``x`` as it is, the weight
    quantized per 128 x 128 block (untimed), no bias."""
    from scaledmm.ops.fp8_block import quantize_weight

    x, w = logical
    b, b_s = quantize_weight(w, BLOCK)
    return x, b, b_s, list(BLOCK), torch.bfloat16, None


def reference(args) -> torch.Tensor:
    """float64 GEMM of the reference quantization of ``x`` (SPEC.md)."""
    from scaledmm.ops.fp8_block import reference_quant

    x, b, b_s, block, out_dtype, _ = args
    a, a_s = reference_quant(x, block[1])
    return mm_reference((a, b, a_s, b_s, block, out_dtype))


def _problem(args):
    from scaledmm.ops import fp8_block as ops

    x, b, b_s, block, out_dtype, bias = args
    ops.check_linear_args(x, b, b_s, block, out_dtype, bias)
    return ops.linear_problem(x, b, block, out_dtype)


def _quant_then(name: str) -> Provider:
    """The quantize op (automatic selection), then the GEMM on backend ``name``."""
    import scaledmm

    def call(x, b, b_s, block, out_dtype, bias):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, block[1], 1e-10, True)
        with scaledmm.use_backend("fp8_block", name):
            return torch.ops.scaledmm.dynamic_padded_fp8_block_mm(q, b, s, b_s, block, out_dtype)

    return Provider(f"quant_{name}", BASELINE, prepare, call, reference, to_f64, "fp8")


def _triton_fused(x, b, b_s, block, out_dtype, bias):
    from scaledmm.ops import fp8_block_triton

    return fp8_block_triton.linear(x, b, b_s, out_dtype, bias, fuse=True)


def _wgmma_fused(x, b, b_s, block, out_dtype, bias):
    from scaledmm.ops import fp8_wgmma

    return fp8_wgmma.block_linear(x, b, b_s, block, out_dtype, bias)


def _baselines(device: torch.device) -> list[Provider]:
    from scaledmm import backends

    out = []
    wgmma = backends.get("fp8_block", "cuda_wgmma") if "cuda_wgmma" in backends.names("fp8_block") else None
    if wgmma is not None and wgmma.is_supported(device)[0]:
        # The one-launch kernel (the GEMM quantizes its activation tiles), not a registered backend.
        out.append(Provider("wgmma_fused", BASELINE, prepare, _wgmma_fused, reference, to_f64, "fp8"))
    for name in backends.names("fp8_block"):
        b = backends.get("fp8_block", name)
        if name != "reference" and "fp8_block_mm" in b.impls and b.is_supported(device)[0]:
            out.append(_quant_then(name))
    if "triton" in backends.names("fp8_block") and backends.get("fp8_block", "triton").is_supported(device)[0]:
        out.append(Provider("triton_fused", BASELINE, prepare, _triton_fused, reference, to_f64, "fp8"))
    return out + gemm_baselines(device)


def benches() -> list[OpBench]:
    return [OpBench(
        family="fp8_block_linear", op="fp8_block_linear", registry="fp8_block",
        make_inputs=gemm_inputs, prepare=prepare, reference=reference, to_f64=to_f64,
        problem=_problem, flops=gemm_flops, baselines=_baselines, default_shapes="dsv3",
        unit="fp8", requires=("per_token_group_quant_fp8", "dynamic_padded_fp8_block_mm"),
    )]
