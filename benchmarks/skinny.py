"""``dsv3_fused_a_gemm``: bf16 ``x @ weight.T`` for small M (at most
``scaledmm.ops.skinny.MAX_M`` rows; DeepSeek-V3's fused q_a/kv_a projection
and kin).

Providers: ``auto`` and every backend of the ``skinny`` registry family that
implements the op (n/a above the op's M limit); ``auto_pdl``, the op with
``enable_pdl=True`` (how DeepSeek-V3 calls it: in a CUDA-graph replay each call
may start while the previous kernel finishes); ``auto_strided``, the op on an
activation that is a row-strided view (rows K + 1536 wide, offset 512, as a
slice of a fused buffer); baseline bf16 ``F.linear`` (cuBLAS) on the very same
operands.
"""

from __future__ import annotations

import torch

from .baselines import bf16_linear, gemm_flops, gemm_inputs, to_f64
from .harness import OURS, OpBench, Provider

__all__ = ["benches"]


def _valid(args) -> tuple[bool, str]:
    from scaledmm.ops.skinny import MAX_M

    m = args[0].shape[0]
    if m > MAX_M:
        return False, f"dsv3_fused_a_gemm takes M <= {MAX_M}, got M={m}"
    return True, ""


def _problem(args):
    from scaledmm.ops import skinny as ops

    x, w = args
    ops.check_args(x, w)
    return ops.problem(x, w, False)


STRIDE_EXTRA, STRIDE_OFFSET = 1536, 512  # the strided view: rows K + 1536 wide, starting at column 512


def _strided_prepare(logical):
    x, w = bf16_linear.prepare(logical)
    k = x.shape[1]
    wide = torch.zeros(x.shape[0], k + STRIDE_EXTRA, dtype=x.dtype, device=x.device)
    wide[:, STRIDE_OFFSET:STRIDE_OFFSET + k] = x
    return wide[:, STRIDE_OFFSET:STRIDE_OFFSET + k], w


def _op(x, w, enable_pdl=False):
    return torch.ops.scaledmm.dsv3_fused_a_gemm(x, w, enable_pdl)


def _variants(device: torch.device) -> list[Provider]:
    """The op with PDL, the op on a strided activation, then bf16 ``F.linear``."""
    pdl = Provider("auto_pdl", OURS, bf16_linear.prepare, lambda x, w: _op(x, w, True), bf16_linear.reference,
                   to_f64, "bf16", _valid)
    strided = Provider("auto_strided", OURS, _strided_prepare, _op, bf16_linear.reference, to_f64, "bf16", _valid)
    return [pdl, strided, bf16_linear]


def benches() -> list[OpBench]:
    return [OpBench(
        family="skinny", op="dsv3_fused_a_gemm", registry="skinny",
        make_inputs=gemm_inputs, prepare=bf16_linear.prepare, reference=bf16_linear.reference, to_f64=to_f64,
        problem=_problem, flops=gemm_flops, baselines=_variants, default_shapes="fused_a",
        unit="bf16", default_m=(1, 2, 3, 4, 8, 16), valid=_valid,
    )]
