"""NVFP4 GEMM backends of the sm100 family that call a library:
``torch`` (``torch._scaled_mm`` on ``float4_e2m1fn_x2``, cuBLASLt) and
``flashinfer_cutedsl`` (``flashinfer.mm_fp4(backend="cute-dsl")``).  Both take
``nvfp4_mm``'s swizzled scales as they are (views, no copies).  The format, the
checks and the ops live in ``ops/nvfp4.py``; this module registers the two
backends of the ``nvfp4`` family.

Read top to bottom: backend ``torch`` (gate, argument views, the call), backend
``flashinfer_cutedsl`` (gate, the call), registration.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from scaledmm import backends
from scaledmm import validation as V
from scaledmm.backends import Backend, Problem
from scaledmm.device import capability
from scaledmm.oplib import FP8_DTYPE
from scaledmm.ops.nvfp4 import BLOCK, FAMILY, FP4_DTYPE, mm_output

__all__ = ["torch_backend_args", "torch_mm", "flashinfer_cutedsl_mm"]


# ----------------------------------------------------------------------------
# Backend "torch": torch._scaled_mm with float4_e2m1fn_x2 (cuBLASLt, sm100 family)
# ----------------------------------------------------------------------------


def _cuda_version() -> tuple[int, ...] | None:
    ver = torch.version.cuda
    if not ver:
        return None
    return tuple(int(p) for p in ver.split(".")[:2])


def _torch_supported(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "needs a CUDA device (cuBLASLt block-scaled FP4)"
    if FP4_DTYPE is None:
        return False, f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype"
    cuda = _cuda_version()
    if cuda is None or cuda < (12, 8):
        return False, f"needs torch built with CUDA >= 12.8 (cuBLASLt FP4), got {torch.version.cuda}"
    major, minor = capability(device)
    if major not in (10, 12):
        return False, f"cuBLASLt NVFP4 needs an sm100/sm120-family GPU, device is sm{major}{minor}"
    return True, "torch._scaled_mm with float4_e2m1fn_x2 and 1x16 e4m3 block scales (cuBLASLt)"


def _torch_can_implement(p: Problem) -> tuple[bool, str]:
    if p.opt("w4a16"):
        return False, "W4A4 only"
    if p.k % 32 != 0 or p.n % 16 != 0:
        return False, f"needs K % 32 == 0 and N % 16 == 0 (cuBLASLt FP4 alignment), got N={p.n}, K={p.k}"
    if p.m > 1 and p.a_row_stride % 32 != 0:
        return False, f"needs a row stride that is a multiple of 32 elements (16 bytes), got {p.a_row_stride}"
    return True, "aligned"


def torch_backend_args(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor
                       ) -> tuple[tuple[torch.Tensor, ...], dict]:
    """Positional and keyword arguments of ``torch._scaled_mm`` for ``nvfp4_mm``.

    Views only, no copies: ``a`` as ``float4_e2m1fn_x2`` ``[M, K/2]`` (row-major),
    ``b`` as ``float4_e2m1fn_x2`` viewed transposed ``[K/2, N]`` (column-major),
    the swizzled scales flattened to 1-D e4m3 (torch checks their element count
    ``round_up(rows, 128) * round_up(K/16, 4)`` and contiguity only), float32
    output so that alpha and bias are applied once, in float32, afterwards.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4_sm100 import torch_backend_args
    >>> a = torch.zeros(3, 32, dtype=torch.uint8); b = torch.zeros(16, 32, dtype=torch.uint8)
    >>> sa = torch.zeros(128, 4, dtype=torch.float8_e4m3fn); sb = torch.zeros(128, 4, dtype=torch.float8_e4m3fn)
    >>> args, kwargs = torch_backend_args(a, b, sa, sb)
    >>> [tuple(t.shape) for t in args], kwargs
    ([(3, 32), (32, 16), (512,), (512,)], {'out_dtype': torch.float32})
    """
    return (
        a.view(FP4_DTYPE),
        b.view(FP4_DTYPE).t(),
        a_scales.view(FP8_DTYPE).view(-1),
        b_scales.view(FP8_DTYPE).view(-1),
    ), {"out_dtype": torch.float32}


def torch_mm(a, b, a_scales, b_scales, alpha, out_dtype, bias):
    args, kwargs = torch_backend_args(a, b, a_scales, b_scales)
    acc = torch._scaled_mm(*args, **kwargs)
    acc.mul_(alpha.reshape(()))
    if bias is not None:
        acc.add_(bias)
    return acc.to(out_dtype)


# ----------------------------------------------------------------------------
# Backend "flashinfer_cutedsl": flashinfer.mm_fp4(..., backend="cute-dsl") (sm100)
# ----------------------------------------------------------------------------

FLASHINFER_BACKEND = "cute-dsl"


def _flashinfer_supported(device: torch.device) -> tuple[bool, str]:
    try:
        flashinfer = importlib.import_module("flashinfer")
    except Exception as e:  # ImportError, or a broken install
        return False, f"flashinfer is not installed ({type(e).__name__}: {e})"
    mm_fp4 = getattr(flashinfer, "mm_fp4", None)
    if mm_fp4 is None:
        return False, "this flashinfer has no mm_fp4"
    try:
        backend_param = inspect.signature(mm_fp4).parameters.get("backend")
    except (TypeError, ValueError):
        backend_param = None
    if backend_param is None or FLASHINFER_BACKEND not in str(backend_param.annotation):
        return False, f"this flashinfer's mm_fp4 has no {FLASHINFER_BACKEND!r} backend"
    if device.type != "cuda":
        return False, "needs a CUDA device"
    major, minor = capability(device)
    if major != 10:
        return False, f"FlashInfer CuTe-DSL FP4 GEMM needs an sm100-family GPU, device is sm{major}{minor}"
    return True, f"flashinfer.mm_fp4(backend={FLASHINFER_BACKEND!r})"


def _flashinfer_can_implement(p: Problem) -> tuple[bool, str]:
    if p.opt("w4a16"):
        return False, "W4A4 only"
    if p.out_dtype not in V.HALF_DTYPES:
        return False, f"mm_fp4 writes bf16 or fp16 only, got out_dtype={p.out_dtype}"
    if p.k % 32 != 0 or p.n % 16 != 0:
        return False, f"needs K % 32 == 0 and N % 16 == 0, got N={p.n}, K={p.k}"
    if p.m > 1 and p.a_row_stride != p.k:
        return False, f"needs contiguous activation rows, got row stride {p.a_row_stride} for K={p.k}"
    return True, "aligned"


def flashinfer_cutedsl_mm(a, b, a_scales, b_scales, alpha, out_dtype, bias):
    """mm_fp4 applies alpha in its epilogue and rounds to ``out_dtype``; a bias
    is added to that result (one more rounding)."""
    if a.shape[0] == 0:
        return mm_output(a, b, out_dtype)
    import flashinfer

    out = flashinfer.mm_fp4(a, b.t(), a_scales, b_scales.t(), alpha.reshape(1), out_dtype,
                            block_size=BLOCK, backend=FLASHINFER_BACKEND)
    if bias is not None:
        out.add_(bias)
    return out


# ----------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------

backends.register(Backend(
    FAMILY, "torch",
    impls={"nvfp4_mm": torch_mm},
    is_supported=_torch_supported,
    can_implement=_torch_can_implement,
    description="torch._scaled_mm on float4_e2m1fn_x2 with swizzled e4m3 block scales (sm100/sm120)",
))
backends.register(Backend(
    FAMILY, "flashinfer_cutedsl",
    impls={"nvfp4_mm": flashinfer_cutedsl_mm},
    is_supported=_flashinfer_supported,
    can_implement=_flashinfer_can_implement,
    description="flashinfer.mm_fp4(backend='cute-dsl') (sm100, when flashinfer is installed)",
))
