"""Skinny bf16 GEMM for DeepSeek-V3's fused q_a / kv_a projection and kin
(SPEC.md "Skinny bf16 GEMM").

``dsv3_fused_a_gemm(x, weight, enable_pdl=False) -> out``: ``out = x @ weight.T``
in bf16 with fp32 accumulation, for few rows (``M <= 16``) and a weight that is
streamed once from memory.  ``x`` is ``[M, K]`` with unit inner stride and a
row stride that is a multiple of 8 (rows of a wider buffer are read in place);
``weight`` is ``[N, K]`` contiguous, ``N % 16 == 0``, ``K % 128 == 0``.

Read top to bottom: shapes and checks (shared with the fake impl and with
``scaledmm.skinny_linear``), the reference math (the CPU implementation, a GPU
backend too), op registration, backend registration.  The CUDA kernel backend
``fused_a`` lives in ``ops/skinny_fused_a.py``.

Examples
--------
>>> import torch, scaledmm
>>> x = torch.randn(3, 256, dtype=torch.bfloat16)
>>> w = torch.randn(64, 256, dtype=torch.bfloat16)
>>> out = torch.ops.scaledmm.dsv3_fused_a_gemm(x, w)
>>> tuple(out.shape), out.dtype
((3, 64), torch.bfloat16)
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from scaledmm import backends
from scaledmm import validation as V
from scaledmm.backends import Backend, Family, Problem
from scaledmm.oplib import define, run

FAMILY = Family.SKINNY
OP = "dsv3_fused_a_gemm"
MAX_M = 16  # rows of x the kernel handles; scaledmm.skinny_linear uses F.linear above
ALIGN_N = 16
ALIGN_K = 128
ROW_STRIDE_ALIGN = 8  # elements: 16-byte aligned rows of x

# ----------------------------------------------------------------------------
# Shapes and checks (the fake impl and scaledmm.skinny_linear call these too)
# ----------------------------------------------------------------------------


def _known(cond) -> bool:
    """True only when ``cond`` holds for every value of its symbols (no guard)."""
    return bool(statically_known_true(cond))


def check_args(x: torch.Tensor, weight: torch.Tensor, enable_pdl: bool = False, op: str = OP) -> None:
    """Validate ``dsv3_fused_a_gemm`` arguments; ``ValueError`` names the argument.

    Conditions on M never guard on a symbolic M: they fail only when known
    to fail (the real op, which sees concrete sizes, decides the rest), so a
    trace with a dynamic M stays valid for every M (one compile).
    """
    V.check_dtype(op, "x", x, torch.bfloat16)
    V.check_dtype(op, "weight", weight, torch.bfloat16)
    V.check_rank(op, "x", x, 2)
    V.check_rank(op, "weight", weight, 2)
    if not isinstance(enable_pdl, bool):
        V.fail(op, "enable_pdl", "a bool", type(enable_pdl).__name__)
    m, k = x.shape
    n = weight.shape[0]
    if _known(m > MAX_M):
        V.fail(op, "x", f"at most {MAX_M} rows (M = x.shape[0]; use F.linear or scaledmm.skinny_linear "
               "for more)", f"shape {tuple(x.shape)}")
    V.check_dim(op, "weight", weight, 1, k, "K = x.shape[1]")
    V.check_divisible(op, "weight", n, ALIGN_N, "N = weight.shape[0]")
    V.check_divisible(op, "x", k, ALIGN_K, "K = x.shape[1]")
    if x.stride(1) != 1:
        V.fail(op, "x", "unit stride along the last dim", f"strides {tuple(x.stride())}")
    rs = x.stride(0)
    if rs % ROW_STRIDE_ALIGN != 0 and _known(m > 1):
        V.fail(op, "x", f"a row stride that is a multiple of {ROW_STRIDE_ALIGN} elements (or M == 1)",
               f"strides {tuple(x.stride())}")
    if rs < k and _known(m > 1):
        V.fail(op, "x", f"row stride >= {k} (non-overlapping rows)", f"strides {tuple(x.stride())}")
    V.check_contiguous(op, "weight", weight)
    V.check_same_device(op, x=x, weight=weight)


def output(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The ``[M, N]`` bf16 output (uninitialized)."""
    return torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16, device=x.device)


def static_conditions_hold(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``dsv3_fused_a_gemm`` accepts ``(x, weight)`` whatever M is
    (dtypes, ranks, N and K alignment, strides, devices).  ``skinny_linear``
    adds the ``M <= MAX_M`` condition (a ``torch.cond`` when M is dynamic).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops import skinny
    >>> w = torch.zeros(64, 256, dtype=torch.bfloat16)
    >>> skinny.static_conditions_hold(torch.zeros(40, 256, dtype=torch.bfloat16), w)
    True
    >>> skinny.static_conditions_hold(torch.zeros(4, 256), w)
    False
    """
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return False
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or weight.dim() != 2:
        return False
    if x.device != weight.device:
        return False
    k = x.shape[1]
    n = weight.shape[0]
    if weight.shape[1] != k or n % ALIGN_N != 0 or k % ALIGN_K != 0:
        return False
    if x.stride(1) != 1 or x.stride(0) % ROW_STRIDE_ALIGN != 0 or x.stride(0) < k:
        return False
    return bool(weight.is_contiguous())


def problem(x: torch.Tensor, weight: torch.Tensor, enable_pdl: bool) -> Problem:
    """What the backends see.  ``options`` carries the 16-byte alignment of the
    two data pointers (a view at an odd offset cannot use vector loads)."""
    aligned = x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
    return Problem(FAMILY, x.device, x.shape[0], weight.shape[0], x.shape[1], x.dtype, torch.bfloat16,
                   x.stride(0), (("enable_pdl", bool(enable_pdl)), ("aligned16", aligned)))


# ----------------------------------------------------------------------------
# Reference math (the CPU implementation; also a GPU backend)
# ----------------------------------------------------------------------------


def reference(x: torch.Tensor, weight: torch.Tensor, enable_pdl: bool = False) -> torch.Tensor:
    """``x @ weight.T`` as an fp32 matmul rounded once to bf16 (any device)."""
    out = output(x, weight)
    out.copy_(x.float() @ weight.float().t())
    return out


# ----------------------------------------------------------------------------
# Op
# ----------------------------------------------------------------------------


def _impl(x, weight, enable_pdl=False):
    check_args(x, weight, enable_pdl)
    if x.shape[0] == 0 or weight.shape[0] == 0:
        return output(x, weight)  # nothing to compute (SPEC: M = 0 is accepted)
    return run(problem(x, weight, enable_pdl), OP, x, weight, enable_pdl)


def linear_output(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The ``[M, N]`` output of ``dynamic_skinny_linear`` (x's dtype)."""
    return torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)


def check_linear_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    op = "dynamic_skinny_linear"
    V.check_dtype(op, "x", x, V.ACT_DTYPES)
    V.check_dtype(op, "weight", weight, x.dtype)
    V.check_rank(op, "x", x, 2)
    V.check_rank(op, "weight", weight, 2)
    V.check_dim(op, "weight", weight, 1, x.shape[1], "K = x.shape[1]")
    V.check_same_device(op, x=x, weight=weight)


def _dynamic_linear_impl(x, weight):
    check_linear_args(x, weight)
    if x.shape[0] <= MAX_M and static_conditions_hold(x, weight):
        return _impl(x, weight)
    return torch.nn.functional.linear(x, weight)


dsv3_fused_a_gemm = define(OP, "(Tensor x, Tensor weight, bool enable_pdl=False) -> Tensor", _impl)
# What scaledmm.compile.passes() turns the `torch.cond(M <= 16, ...)` of
# scaledmm.skinny_linear into: the same choice, made at run time, opaque to
# Inductor (so CUDA graphs are kept).
dynamic_skinny_linear = define("dynamic_skinny_linear", "(Tensor x, Tensor weight) -> Tensor",
                               _dynamic_linear_impl)

backends.register(Backend(
    FAMILY, "reference",
    impls={OP: reference},
    description="fp32 torch matmul rounded to bf16; any device",
))
