"""FP8 GEMM with per-tensor / per-token / per-channel scales in Triton:
``fp8_scaled_mm`` of backend ``triton`` of the ``fp8`` family (SPEC.md "FP8
per-tensor / per-channel GEMM with load-time padding").

The kernel is the fp8_block GEMM (``fp8_block_triton.mm_kernel``) in its
``ROWCOL`` mode: the K loop sums the raw fp8 products in fp32 (each 128-wide
K block's MMA sum added to the fp32 accumulator, as cuBLAS does without fast
accumulation), then the tile is multiplied once by ``sa[m] * sb[n]`` and,
with a bias, ``+ bias`` in fp32 with one rounding to ``out_dtype``.  Split-K
partials are scaled before they are summed (the scaling is linear).  Tile
configs are the fp8_block ones (``fp8_block_triton.default_config`` per M
bucket: swap-AB and split-K at small M, where cuBLAS's row-wise kernel is
slow); K need not be a multiple of 128 (masked last block).

Scales reach the kernel as ``[rows, 1]`` views whose row stride is 0 for a
one-element (per-tensor) scale, so the four combinations of scale kinds are
one kernel with two stride arguments.

Read top to bottom: per-problem check, launcher.  The backend
is registered in ``ops/fp8_triton_quant.py`` (the family has one ``triton``
backend, holding ``quant_fp8`` and this GEMM); the reference is
``ops.fp8.reference_mm``.
"""

from __future__ import annotations

import torch

from scaledmm import validation as V
from scaledmm.backends import Problem
from scaledmm.oplib import FP8_DTYPE

from . import fp8 as base
from . import fp8_block_triton as block_triton

__all__ = ["OP", "can_implement", "mm"]

OP = "fp8_scaled_mm"
SCALE_A_KINDS = (base.TENSOR, base.TOKEN)
SCALE_B_KINDS = (base.TENSOR, base.CHANNEL)

# ----------------------------------------------------------------------------
# Per-problem check
# ----------------------------------------------------------------------------


def can_implement(p: Problem) -> tuple[bool, str]:
    """Whether the Triton GEMM runs ``fp8_scaled_mm`` problem ``p`` (as
    ``ops.fp8.mm_problem`` builds it): any M, row stride and alignment, every
    scale kind, out dtypes bf16 / fp16 / fp32.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.backends import Family, Problem
    >>> p = Problem(Family.FP8, torch.device("cpu"), 3, 48, 144, torch.float8_e4m3fn, torch.bfloat16, 160,
    ...             (("scale_a", "token"), ("scale_b", "channel"), ("bias_dtype", None), ("b_aligned", False)))
    >>> can_implement(p)[0]
    True
    """
    if p.in_dtype != FP8_DTYPE:
        return False, f"needs e4m3 operands, got {p.in_dtype}"
    if p.opt("scale_a") not in SCALE_A_KINDS or p.opt("scale_b") not in SCALE_B_KINDS:
        return False, (f"scale kinds a in {SCALE_A_KINDS}, b in {SCALE_B_KINDS}, "
                       f"got {p.opt('scale_a')!r}, {p.opt('scale_b')!r}")
    if p.out_dtype not in V.FLOAT_OUT_DTYPES:
        return False, f"out_dtype bf16/fp16/fp32, got {p.out_dtype}"
    return True, "any M, row stride and alignment; K, N multiples of 16"


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
       bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
       config: block_triton.MMConfig | None = None) -> torch.Tensor:
    """``fp8_scaled_mm`` on Triton: ``(a * scale_a) @ (b * scale_b).T + bias``.

    Parameters
    ----------
    a : torch.Tensor
        e4m3 ``[M, K]``, ``a.stride(1) == 1`` (any row stride).
    b : torch.Tensor
        e4m3 ``[N, K]``, contiguous.  K and N multiples of 16.
    scale_a, scale_b : torch.Tensor
        float32: ``scale_a`` one element or ``[M, 1]``; ``scale_b`` one
        element, ``[N]`` or ``[1, N]``.
    bias : torch.Tensor, optional
        ``[N]`` bf16 / fp16 / fp32, added in fp32 before the one rounding.
    out_dtype : torch.dtype
        bf16, fp16 or fp32.
    config : MMConfig, optional
        Tile config (must pass ``fp8_block_triton.config_ok``); default: the
        fp8_block chooser's config for ``(M, N, K)``.

    Returns
    -------
    torch.Tensor
        Contiguous ``[M, N]`` of ``out_dtype``.  M, N or K = 0 follow
        ``ops.fp8.reference_mm`` (no launch).

    Examples
    --------
    >>> import torch  # doctest: +SKIP
    >>> a = torch.ones(3, 144, device="cuda").to(torch.float8_e4m3fn)  # doctest: +SKIP
    >>> b = torch.ones(48, 144, device="cuda").to(torch.float8_e4m3fn)  # doctest: +SKIP
    >>> out = mm(a, b, torch.tensor(0.5, device="cuda"), torch.full((48,), 2.0, device="cuda"))  # doctest: +SKIP
    >>> out.shape, out[0, 0].item()  # doctest: +SKIP
    (torch.Size([3, 48]), 144.0)
    """
    kind_a, kind_b = base.check_mm_args(OP, a, b, scale_a, scale_b, bias, out_dtype)
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:  # no GEMM to run: the reference's empty / bias-only result
        return base.reference_mm(a, b, scale_a, scale_b, bias, out_dtype)
    if config is not None:
        ok, why = block_triton.config_ok(config, m, n, k)
        if not ok:
            V.fail(OP, "config", "an MMConfig that passes fp8_block_triton.config_ok", f"{config} ({why})")
    # the kernel's [rows, 1] operands: a one-element scale broadcast with row stride 0
    sa = base._scale_view(scale_a, kind_a, True).expand(m, 1)
    sb = base._scale_view(scale_b, kind_b, True).expand(n, 1)
    if bias is not None:
        bias = bias.contiguous()  # the kernel reads bias[n] at unit stride
    return block_triton.run_mm(a, b, sa, sb, out_dtype, bias, config, quant_a=False, rowcol=True)
