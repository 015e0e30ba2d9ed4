"""``dsv3_fused_a_gemm``: bf16 ``x @ weight.T`` for small M (at most
``scaledmm.ops.skinny.MAX_M`` rows; DeepSeek-V3's fused q_a/kv_a projection
and kin).

Providers: ``auto`` and every backend of the ``skinny`` registry family that
implements the op (n/a above the op's M limit); baseline bf16 ``F.linear``
(cuBLAS) on the very same operands.
"""

from __future__ import annotations

from .baselines import bf16_linear, gemm_flops, gemm_inputs, to_f64
from .harness import OpBench

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


def benches() -> list[OpBench]:
    return [OpBench(
        family="skinny", op="dsv3_fused_a_gemm", registry="skinny",
        make_inputs=gemm_inputs, prepare=bf16_linear.prepare, reference=bf16_linear.reference, to_f64=to_f64,
        problem=_problem, flops=gemm_flops, baselines=lambda device: [bf16_linear], default_shapes="fused_a",
        unit="bf16", default_m=(1, 2, 3, 4, 8, 16), valid=_valid,
    )]
