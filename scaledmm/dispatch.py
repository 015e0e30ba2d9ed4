"""Python entries that choose between ops by size: an alignment choice for
the FP8 block GEMM, an M <= 16 choice for the skinny GEMM.

In eager mode they call the right op directly.  When traced with a dynamic M
(``torch.compile(dynamic=True)``, ``torch.export``) they emit a ``torch.cond``
on the size predicate whose two branches are our custom ops, so the graph stays
whole, the choice is visible in it and no recompile happens when M changes.
With static sizes the trace holds the one branch that applies.

Dynamo specializes sizes 0 and 1 even with ``dynamic=True``; to serve M = 1
(decode) from the same graph as other M, set torch's
``torch.fx.experimental._config.backed_size_oblivious = True`` (scaledmm
never changes torch's configuration itself).
``scaledmm.compile.passes()`` can lower those conds to opaque ops so Inductor
keeps CUDA graphs (SPEC.md, "Compile integration").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import validation as _V
from .ops import fp8_block as _fp8_block
from .ops import skinny as _skinny

__all__ = ["fp8_block_mm", "skinny_linear"]


def fp8_block_mm(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
                 block_size=(128, 128), out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 block-scaled GEMM for any M, choosing the padded op when M % 4 != 0.

    Parameters
    ----------
    a : Tensor
        e4m3 ``[M, K]`` activation, unit inner stride.
    b : Tensor
        e4m3 ``[N, K]`` weight, contiguous.
    a_scales : Tensor
        float32 ``[M, ceil(K / bk)]``, row- or column-major.
    b_scales : Tensor
        float32 ``[ceil(N / bn), ceil(K / bk)]``.
    block_size : (int, int)
        ``[bn, bk]``.
    out_dtype : torch.dtype
        bf16 (default), fp16 or fp32.

    Returns
    -------
    Tensor
        ``[M, N]`` in ``out_dtype``.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(3, 256)
    >>> q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
    >>> w = torch.randn(128, 256).to(torch.float8_e4m3fn)
    >>> ws = torch.ones(1, 2)
    >>> scaledmm.fp8_block_mm(q, w, s, ws).shape
    torch.Size([3, 128])
    """
    # Only what is read here is checked here (the ops validate the rest).
    bs = list(_fp8_block.check_block_size("fp8_block_mm", block_size))
    _V.check_dtype("fp8_block_mm", "a", a, _fp8_block.FP8_DTYPE)
    _V.check_rank("fp8_block_mm", "a", a, 2)
    m = a.shape[0]
    direct = torch.ops.scaledmm.fp8_block_mm
    padded = torch.ops.scaledmm.padded_fp8_block_mm
    if torch.compiler.is_compiling():
        # A dynamic M gives a SymBool predicate and a real cond; a static M a
        # constant one, which Dynamo folds to the single branch that applies.

        def padded_branch(a, b, a_scales, b_scales):
            return padded(a, b, a_scales, b_scales, bs, out_dtype)

        def direct_branch(a, b, a_scales, b_scales):
            return direct(a, b, a_scales, b_scales, bs, out_dtype)

        return torch.cond(m % _fp8_block.ALIGN_M != 0, padded_branch, direct_branch,
                          (a, b, a_scales, b_scales))
    op = padded if m % _fp8_block.ALIGN_M != 0 else direct
    return op(a, b, a_scales, b_scales, bs, out_dtype)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in bf16, through the fused-A skinny kernel when M <= 16.

    The static conditions of the kernel (bf16, 2-D, ``N % 16 == 0``,
    ``K % 128 == 0``, unit inner stride, row stride a multiple of 8, contiguous
    weight) are checked in Python; when they fail this is ``F.linear``.  The
    size condition M <= 16 becomes a ``torch.cond`` when M is dynamic.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(2, 256, dtype=torch.bfloat16)
    >>> w = torch.randn(64, 256, dtype=torch.bfloat16)
    >>> scaledmm.skinny_linear(x, w).shape
    torch.Size([2, 64])
    """
    if not _skinny.static_conditions_hold(x, weight):
        return F.linear(x, weight)
    m = x.shape[0]
    fused = torch.ops.scaledmm.dsv3_fused_a_gemm
    if torch.compiler.is_compiling():

        def skinny_branch(x, weight):
            return fused(x, weight)

        def linear_branch(x, weight):
            return F.linear(x, weight)

        return torch.cond(m <= _skinny.MAX_M, skinny_branch, linear_branch, (x, weight))
    if m <= _skinny.MAX_M:
        return fused(x, weight)
    return F.linear(x, weight)
