"""Optional ``fp8_block`` baseline ``deepgemm``: DeepGEMM's FP8 GEMM with 1x128
activation and 128x128 weight scales, the strongest Hopper peer of
``fp8_block_mm``.

It is used only where ``import deep_gemm`` works; it is never a dependency of
the package, and elsewhere the family notes list it as unavailable with the
import error.  Both generations of DeepGEMM's Python API are recognised by
name, each called as ``fn((a, a_scales), (b, b_scales), out)``:
``gemm_fp8_fp8_bf16_nt`` (the pure-Python JIT releases) and ``fp8_gemm_nt``
(the later C++ JIT releases).

Our operands are converted to the layouts DeepGEMM expects once, untimed:
``a [M, K]`` and ``b [N, K]`` e4m3 with unit inner stride, ``b_scales [N/128,
K/128]`` float32 contiguous, ``a_scales [M, K/128]`` float32 MN-major with the
M stride rounded up to 16 bytes (strides ``(1, round_up(M, 4))``: a TMA
operand; our column-major scales already are at M % 4 == 0), and a
preallocated bf16 ``out [M, N]`` filled with NaN, so an output the kernel does
not fully write fails the float64 check.  The timed call is DeepGEMM's
function alone.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Any, Callable

import torch

from .harness import BASELINE, Provider

__all__ = ["NAME", "API_NAMES", "load", "gemm_function", "mn_major_scales", "provider", "notes"]

NAME = "deepgemm"
# Newest first; the first one the installed module defines is used.
API_NAMES = ("fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt")
_TMA_BYTES = 16  # TMA global strides are multiples of 16 bytes
_ENV = ("DG_JIT_USE_NVRTC", "DG_JIT_CACHE_DIR", "DG_JIT_NVCC_COMPILER")


def load() -> tuple[Any, str]:
    """``(deep_gemm module, "")``, or ``(None, why)`` when it does not import.

    Examples
    --------
    >>> module, why = load()
    >>> (module is None) == bool(why)
    True
    """
    try:
        return importlib.import_module("deep_gemm"), ""
    except Exception as e:  # a broken install (missing CUDA, JIT headers) as much as a missing one
        first = str(e).strip().splitlines()
        return None, f"deep_gemm is not importable ({type(e).__name__}: {first[0][:200] if first else ''})"


def gemm_function(module: Any) -> tuple[str, Callable[..., Any]] | None:
    """The first of :data:`API_NAMES` that ``module`` defines, as ``(name, fn)``.

    Examples
    --------
    >>> import types
    >>> gemm_function(types.SimpleNamespace(gemm_fp8_fp8_bf16_nt=print))[0]
    'gemm_fp8_fp8_bf16_nt'
    >>> gemm_function(types.SimpleNamespace()) is None
    True
    """
    for name in API_NAMES:
        fn = getattr(module, name, None)
        if callable(fn):
            return name, fn
    return None


def mn_major_scales(s: torch.Tensor) -> torch.Tensor:
    """``s [M, G]`` float32 as an MN-major view with strides ``(1, round_up(M, 4))``
    (the M stride a multiple of 16 bytes); ``s`` itself when it already is.

    Examples
    --------
    >>> import torch
    >>> s = torch.arange(6.0).reshape(3, 2)
    >>> t = mn_major_scales(s)
    >>> t.stride(), bool(torch.equal(t, s))
    ((1, 4), True)
    """
    if s.dtype != torch.float32 or s.dim() != 2:
        raise ValueError(f"mn_major_scales: s must be a 2-D float32 tensor, got {s.dtype} with shape "
                         f"{tuple(s.shape)}")
    m, g = s.shape
    align = _TMA_BYTES // s.element_size()
    ld = -(-m // align) * align
    if s.stride(0) == 1 and s.stride(1) == ld:  # exact: DeepGEMM would re-layout anything else per call
        return s
    out = torch.empty((g, ld), dtype=s.dtype, device=s.device).t()[:m]
    out.copy_(s)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class _Out:
    """The preallocated output.  Kept out of the argument tuple's tensors so the
    harness neither rotates it as an input nor counts its bytes twice (it also
    counts the returned output)."""

    tensor: torch.Tensor


def _convert(op_prepare: Callable, logical) -> tuple:
    a, b, a_s, b_s, _block, _dtype = op_prepare(logical)
    out = torch.full((a.shape[0], b.shape[0]), float("nan"), dtype=torch.bfloat16, device=a.device)
    return a.contiguous(), mn_major_scales(a_s), b.contiguous(), b_s.contiguous(), _Out(out)


def _reference(op_reference: Callable, block: list[int], args) -> torch.Tensor:
    lhs, lhs_s, rhs, rhs_s, _ = args
    return op_reference((lhs, rhs, lhs_s, rhs_s, block, torch.bfloat16))


def _call(fn: Callable, lhs, lhs_s, rhs, rhs_s, out: _Out) -> torch.Tensor:
    fn((lhs, lhs_s), (rhs, rhs_s), out.tensor)
    return out.tensor


def _applies(args) -> tuple[bool, str]:
    lhs, _, rhs, _, _ = args
    n, k = rhs.shape
    if n % 8:
        return False, f"deepgemm needs N % 8 == 0 (16-byte bf16 output rows for TMA), got N = {n}"
    if k % 128:
        return False, f"deepgemm needs K % 128 == 0 (one scale per 128 of K), got K = {k}"
    return True, ""


def provider(op_prepare: Callable, op_reference: Callable, block: list[int],
             to_f64: Callable[[Any], torch.Tensor]) -> Provider | None:
    """The ``deepgemm`` baseline over the family's inputs (``op_prepare``:
    logical -> ``(a, b, a_scales, b_scales, block, out_dtype)``), or None where
    DeepGEMM does not import or defines none of :data:`API_NAMES`.

    Examples
    --------
    >>> from benchmarks import fp8_block
    >>> p = provider(fp8_block.prepare, fp8_block.reference, [128, 128], fp8_block.to_f64)
    >>> p is None or p.name == "deepgemm"
    True
    """
    module, _ = load()
    found = gemm_function(module) if module is not None else None
    if found is None:
        return None
    return Provider(NAME, BASELINE, functools.partial(_convert, op_prepare),
                    functools.partial(_call, found[1]), functools.partial(_reference, op_reference, block),
                    to_f64, "fp8", _applies)


def _version(module: Any) -> str:
    try:
        from importlib.metadata import version

        return version("deep_gemm")
    except Exception:
        return str(getattr(module, "__version__", "unknown version"))


def notes(device: torch.device | None = None) -> list[str]:
    """One line on the baseline for the family notes: what is called (module
    version, API name, DeepGEMM's JIT settings) or why it is not available.

    Examples
    --------
    >>> notes()[0].startswith("deepgemm: ")
    True
    """
    module, why = load()
    if module is None:
        return [f"{NAME}: not available: {why}"]
    found = gemm_function(module)
    if found is None:
        return [f"{NAME}: not available: deep_gemm {_version(module)} defines none of {', '.join(API_NAMES)}"]
    env = ", ".join(f"{k}={os.environ[k]}" for k in _ENV if k in os.environ) or "no DG_JIT_* settings"
    return [f"{NAME}: deep_gemm {_version(module)}, {found[0]} ({env})"]
