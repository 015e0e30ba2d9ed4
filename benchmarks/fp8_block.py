"""``fp8_block_mm``: FP8 GEMM with 1x128 activation and 128x128 weight scales.

Providers: ``auto`` and every backend of the ``fp8_block`` registry family
that implements ``fp8_block_mm``; baselines ``pad4`` (``padded_fp8_block_mm``:
always pad M to a multiple of 4, then the aligned auto choice),
``scaled_mm_blockwise`` (``torch._scaled_mm`` with blockwise scales, called
directly), ``deepgemm`` where ``deep_gemm`` imports (``benchmarks/deepgemm.py``),
and the common GEMM baselines.  Activation scales are passed
column-major (strides ``(1, M)``), as ``per_token_group_quant_fp8(...,
column_major_scales=True)`` produces them for the GEMM.
"""

from __future__ import annotations

import torch

from . import deepgemm
from .baselines import gemm_baselines, gemm_flops, gemm_inputs, to_f64
from .harness import BASELINE, OpBench, Provider, forced

__all__ = ["benches", "prepare", "reference"]

BLOCK = (128, 128)  # [bn, bk]


def prepare(logical):
    """Logical bf16 (x, w) -> the op's arguments: activation quantized per 1 x 128
    group with column-major scales, weight per 128 x 128 block (the ops
    module's reference quantizers; untimed)."""
    from scaledmm.ops.fp8_block import quantize_weight, reference_quant

    x, w = logical
    a, a_s = reference_quant(x, BLOCK[1], column_major_scales=True)
    b, b_s = quantize_weight(w, BLOCK)
    return a, b, a_s, b_s, list(BLOCK), torch.bfloat16


def reference(args) -> torch.Tensor:
    """float64: sum over k-blocks of a_scales * b_scales * (a . b) (SPEC.md)."""
    a, b, a_s, b_s, (bn, bk), _ = args
    m, k = a.shape
    n = b.shape[0]
    sa = a_s.double().repeat_interleave(bk, dim=1)[:, :k]
    sb = b_s.double().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (a.double() * sa) @ (b.double() * sb).t()


def _problem(args):
    from scaledmm.ops import fp8_block as ops

    a, b, a_s, b_s, block, out_dtype = args
    col = ops.check_mm_args("fp8_block_mm", a, b, a_s, b_s, block, out_dtype)
    return ops.problem(a, b, block, out_dtype, col)


def _scaled_mm_blockwise(a, b, a_s, b_s, block, out_dtype):
    from scaledmm.ops.fp8_block import cublas_a_scales, cublas_b_scales

    # No-ops for the column-major activation scales and K/128 % 4 == 0 given here.
    return torch._scaled_mm(a, b.t(), scale_a=cublas_a_scales(a_s), scale_b=cublas_b_scales(b_s).t(),
                            out_dtype=out_dtype)


def _padded(name: str) -> Provider:
    """``padded_fp8_block_mm`` with backend ``name`` forced (``auto``: the
    aligned auto choice).  ``pad4_<backend>`` measures what padding really
    costs for an aligned-only backend: the auto-table generator
    (``python -m benchmarks.tune``) ranks it against the unpadded backends at
    every M that is not a multiple of 4."""
    label = "pad4" if name == "auto" else f"pad4_{name}"
    return Provider(label, BASELINE, prepare, forced(torch.ops.scaledmm.padded_fp8_block_mm, "fp8_block", name),
                    reference, to_f64, "fp8")


def _aligned_only(device: torch.device) -> list[str]:
    """Backends of the registry that need M % 4 == 0 and run on ``device``."""
    from scaledmm import backends

    out = []
    for name in backends.names("fp8_block"):
        b = backends.get("fp8_block", name)
        if b.needs_m_multiple > 1 and "fp8_block_mm" in b.impls and b.is_supported(device)[0]:
            out.append(name)
    return out


def _baselines(device: torch.device) -> list[Provider]:
    blockwise = Provider("scaled_mm_blockwise", BASELINE, prepare, _scaled_mm_blockwise, reference,
                         to_f64, "fp8")
    pads = [_padded(name) for name in ("auto", *_aligned_only(device))]
    peer = deepgemm.provider(prepare, reference, list(BLOCK), to_f64)  # None unless deep_gemm imports
    return pads + [blockwise] + ([peer] if peer else []) + gemm_baselines(device)


def benches() -> list[OpBench]:
    return [OpBench(
        family="fp8_block", op="fp8_block_mm", registry="fp8_block",
        make_inputs=gemm_inputs, prepare=prepare, reference=reference, to_f64=to_f64,
        problem=_problem, flops=gemm_flops, baselines=_baselines, default_shapes="dsv3",
        unit="fp8", requires=("padded_fp8_block_mm",), baseline_notes=deepgemm.notes,
    )]
