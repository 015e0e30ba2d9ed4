"""Input checks shared by every op.

Each check raises ``ValueError`` whose message names the argument, what was
expected and what was given, e.g.::

    fp8_block_mm: b: expected dtype torch.float8_e4m3fn, got torch.bfloat16

The checks run in the real implementations and in the fake (meta)
implementations, so a bad call fails at trace time under ``torch.compile`` too.
They only read sizes, strides, dtypes and devices: never tensor values, so they
never synchronize the host with the device.  Size comparisons on symbolic sizes
install guards, as they should.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

__all__ = [
    "fail",
    "check_dtype",
    "check_rank",
    "check_dim",
    "check_shape",
    "check_divisible",
    "check_inner_stride",
    "check_contiguous",
    "check_same_device",
    "check_out_dtype",
    "check_scale_matrix",
    "check_scalar_like",
    "ceil_div",
    "round_up",
]

FLOAT_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF_DTYPES = (torch.bfloat16, torch.float16)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative ints (and SymInts)."""
    return (a + b - 1) // b


def round_up(a, b):
    """Smallest multiple of ``b`` that is ``>= a``."""
    return ceil_div(a, b) * b


def fail(op: str, arg: str, expected: str, got) -> None:
    raise ValueError(f"{op}: {arg}: expected {expected}, got {got}")


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    d = list(dtypes)
    return str(d[0]) if len(d) == 1 else "one of [" + ", ".join(map(str, d)) + "]"


def check_dtype(op: str, arg: str, t: torch.Tensor, dtypes: torch.dtype | Sequence[torch.dtype]) -> None:
    if not isinstance(t, torch.Tensor):
        fail(op, arg, "a Tensor", type(t).__name__)
    allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if t.dtype not in allowed:
        fail(op, arg, f"dtype {_fmt_dtypes(allowed)}", t.dtype)


def check_rank(op: str, arg: str, t: torch.Tensor, rank: int | Sequence[int]) -> None:
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if t.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        fail(op, arg, f"a {want}-D tensor", f"{t.dim()}-D tensor of shape {tuple(t.shape)}")


def check_dim(op: str, arg: str, t: torch.Tensor, dim: int, size, what: str = "") -> None:
    """``t.shape[dim] == size``; ``what`` explains where ``size`` comes from."""
    if t.shape[dim] != size:
        extra = f" ({what})" if what else ""
        fail(op, arg, f"size {size} at dim {dim}{extra}", f"shape {tuple(t.shape)}")


def check_shape(op: str, arg: str, t: torch.Tensor, shape: Sequence, what: str = "") -> None:
    if t.dim() != len(shape) or any(s != e for s, e in zip(t.shape, shape)):
        extra = f" ({what})" if what else ""
        fail(op, arg, f"shape {tuple(shape)}{extra}", f"shape {tuple(t.shape)}")


def check_divisible(op: str, arg: str, value, divisor: int, what: str) -> None:
    if value % divisor != 0:
        fail(op, arg, f"{what} to be a multiple of {divisor}", value)


def check_inner_stride(op: str, arg: str, t: torch.Tensor) -> None:
    """Unit stride along the last dim (rows may be strided views)."""
    # Conditions on the (static) inner sizes and strides come first so that a
    # dynamic M is only guarded on when the layout is already suspicious.
    if t.dim() >= 1 and t.stride(-1) != 1 and t.shape[-1] > 1:
        fail(op, arg, "unit stride along the last dim", f"strides {tuple(t.stride())}")
    if t.dim() == 2 and t.stride(0) < t.shape[1] and t.shape[0] > 1:
        fail(op, arg, f"row stride >= {t.shape[1]} (non-overlapping rows)", f"strides {tuple(t.stride())}")


def check_contiguous(op: str, arg: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        fail(op, arg, "a contiguous tensor", f"strides {tuple(t.stride())} for shape {tuple(t.shape)}")


def check_same_device(op: str, **tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device; returns it."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            fail(op, name, f"device {first.device} (the device of {first_name})", t.device)
    return first.device


def check_out_dtype(op: str, out_dtype: torch.dtype, allowed: Sequence[torch.dtype] = FLOAT_OUT_DTYPES) -> None:
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in allowed:
        fail(op, "out_dtype", _fmt_dtypes(allowed), out_dtype)


def check_scale_matrix(op: str, arg: str, s: torch.Tensor, rows, cols, allow_col_major: bool) -> bool:
    """A float32 ``[rows, cols]`` scale tensor, row-major (rows may be padded:
    ``stride(0) >= cols``) or, optionally, column-major (``stride(0) == 1``,
    ``stride(1) >= rows``, e.g. TMA-aligned).  Returns True when column-major."""
    check_dtype(op, arg, s, torch.float32)
    check_shape(op, arg, s, (rows, cols))
    # Static facts (cols, strides) are tested before anything that guards on rows.
    if (s.stride(1) == 1 or cols <= 1) and (s.stride(0) >= cols or rows <= 1):
        return False
    if allow_col_major and s.stride(0) == 1 and (cols <= 1 or s.stride(1) >= rows):
        return True
    layouts = ("row-major (stride(1) == 1, stride(0) >= cols) or column-major (stride(0) == 1, stride(1) >= rows)"
               if allow_col_major else "row-major (stride(1) == 1, stride(0) >= cols)")
    fail(op, arg, layouts, f"strides {tuple(s.stride())} for shape {tuple(s.shape)}")
    return False  # unreachable


def check_scalar_like(op: str, arg: str, t: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """A single-element tensor (0-D or any shape with one element)."""
    check_dtype(op, arg, t, dtype)
    if t.numel() != 1:
        fail(op, arg, "a tensor with one element", f"shape {tuple(t.shape)}")


def aligned16(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's data starts on a 16-byte boundary (what vector
    loads need); False for fake and meta tensors, which have no address.

    Examples
    --------
    >>> import torch
    >>> aligned16(torch.zeros(8)), aligned16(torch.zeros(8)[1:])
    (True, False)
    """
    try:
        return all(t.data_ptr() % 16 == 0 for t in tensors)
    except Exception:  # FakeTensor / meta: no address
        return False
