"""FP8 block-scaled GEMM, DeepSeek-V3 recipe: 1x128 activation scales, 128x128
weight scales (SPEC.md "FP8 block-scaled GEMM").

Read top to bottom: shapes and checks (shared with the fake impls), the
reference math, the thin cuBLAS backend, op registration, padding ops.  The
fast kernels (Triton, CUTLASS) live in their own modules and register
themselves as backends of the ``fp8_block`` family.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from scaledmm import backends
from scaledmm import validation as V
from scaledmm.backends import Backend, Family, Problem
from scaledmm.device import capability
from scaledmm.oplib import FP8_DTYPE, FP8_MAX, define, run

FAMILY = Family.FP8_BLOCK
ALIGN_M = 4  # what the cutlass and cublas backends need

# ----------------------------------------------------------------------------
# Shapes and checks (the fake impls call these too)
# ----------------------------------------------------------------------------


def quant_outputs(x: torch.Tensor, group_size: int, eps: float, column_major_scales: bool,
                  scale_ue8m0: bool, row_capacity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``per_token_group_quant_fp8`` arguments and allocate (q, s).

    ``row_capacity`` (real kernels, not fakes: same shape and strides): ``q``
    is the first M rows of a buffer of ``round_up(M, ALIGN_M)`` rows, so
    ``padded_fp8_block_mm`` can hand an aligned-only backend the padded
    activation as a view (:func:`rows_view`) instead of copying it."""
    op = "per_token_group_quant_fp8"
    V.check_dtype(op, "x", x, V.ACT_DTYPES)
    V.check_rank(op, "x", x, 2)
    V.check_inner_stride(op, "x", x)
    if group_size <= 0:
        V.fail(op, "group_size", "a positive integer", group_size)
    V.check_divisible(op, "x", x.shape[1], group_size, "K = x.shape[1]")
    if not eps > 0:
        V.fail(op, "eps", "a positive float", eps)
    m, k = x.shape
    if row_capacity:
        q = torch.empty((V.round_up(m, ALIGN_M), k), dtype=FP8_DTYPE, device=x.device)[:m]
    else:
        q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    g = k // group_size
    if column_major_scales:
        s = torch.empty((g, m), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    return q, s


def check_block_size(op: str, block_size) -> tuple[int, int]:
    """``block_size`` as ``(bn, bk)``: two positive ints, else ``ValueError``."""
    vals = None
    try:
        if len(block_size) == 2 and not any(isinstance(v, bool) for v in block_size):
            vals = tuple(v if isinstance(v, torch.SymInt) else operator.index(v) for v in block_size)
    except TypeError:  # not a sequence, or a non-integer entry
        vals = None
    if vals is None or not all(v > 0 for v in vals):
        V.fail(op, "block_size", "two positive ints [bn, bk]", block_size)
    return vals


def check_mm_args(op: str, a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor,
                  b_scales: torch.Tensor, block_size: list[int], out_dtype: torch.dtype) -> bool:
    """Validate ``fp8_block_mm``-schema arguments.  Returns whether
    ``a_scales`` is column-major."""
    V.check_dtype(op, "a", a, FP8_DTYPE)
    V.check_dtype(op, "b", b, FP8_DTYPE)
    V.check_rank(op, "a", a, 2)
    V.check_rank(op, "b", b, 2)
    V.check_inner_stride(op, "a", a)
    V.check_contiguous(op, "b", b)
    bn, bk = check_block_size(op, block_size)
    V.check_dim(op, "b", b, 1, a.shape[1], "K = a.shape[1]")
    m, k = a.shape
    n = b.shape[0]
    kb = V.ceil_div(k, bk)
    col = V.check_scale_matrix(op, "a_scales", a_scales, m, kb, allow_col_major=True)
    V.check_scale_matrix(op, "b_scales", b_scales, V.ceil_div(n, bn), kb, allow_col_major=False)
    V.check_out_dtype(op, out_dtype)
    V.check_same_device(op, a=a, b=b, a_scales=a_scales, b_scales=b_scales)
    return col


def mm_output(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``[M, N]`` output every fp8_block GEMM op returns."""
    return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)


def check_linear_args(x, b, b_scales, block_size, out_dtype, bias) -> None:
    op = "fp8_block_linear"
    V.check_dtype(op, "x", x, V.HALF_DTYPES)
    V.check_rank(op, "x", x, 2)
    V.check_inner_stride(op, "x", x)
    V.check_dtype(op, "b", b, FP8_DTYPE)
    V.check_rank(op, "b", b, 2)
    V.check_contiguous(op, "b", b)
    bn, bk = check_block_size(op, block_size)
    V.check_dim(op, "b", b, 1, x.shape[1], "K = x.shape[1]")
    V.check_divisible(op, "x", x.shape[1], bk, "K = x.shape[1] (activation groups of bk)")
    n, k = b.shape
    V.check_scale_matrix(op, "b_scales", b_scales, V.ceil_div(n, bn), k // bk, allow_col_major=False)
    V.check_out_dtype(op, out_dtype)
    if bias is not None:
        V.check_dtype(op, "bias", bias, V.FLOAT_OUT_DTYPES)
        V.check_shape(op, "bias", bias, (n,))
    V.check_same_device(op, x=x, b=b, b_scales=b_scales, bias=bias)


def problem(a: torch.Tensor, b: torch.Tensor, block_size, out_dtype, col_major: bool,
            m: int | None = None) -> Problem:
    return Problem(
        FAMILY, a.device, a.shape[0] if m is None else m, b.shape[0], a.shape[1], a.dtype, out_dtype,
        a.stride(0) if a.dim() == 2 else 0,
        (("block_size", (int(block_size[0]), int(block_size[1]))), ("a_scales_col_major", col_major)),
    )


def linear_problem(x: torch.Tensor, b: torch.Tensor, block_size, out_dtype) -> Problem:
    """The ``fp8_block_linear`` Problem: the GEMM's, and whether the vector
    loads of a one-launch kernel can read ``x`` and ``b`` (``aligned16``)."""
    p = problem(x, b, block_size, out_dtype, False)
    return dataclasses.replace(p, options=p.options + (("aligned16", V.aligned16(x, b)),))


# ----------------------------------------------------------------------------
# Reference math (the CPU implementation; also a GPU backend)
# ----------------------------------------------------------------------------


def reference_quant(x: torch.Tensor, group_size: int = 128, eps: float = 1e-10,
                    column_major_scales: bool = False, scale_ue8m0: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC math: s = max(amax, eps) / 448 (ue8m0: 2**ceil(log2 s)); q = e4m3(clamp(x / s))."""
    q, s = quant_outputs(x, group_size, eps, column_major_scales, scale_ue8m0, row_capacity=True)
    m, k = x.shape
    xg = x.float().reshape(m, k // group_size, group_size)
    amax = xg.abs().amax(dim=-1) if k else xg.new_zeros((m, 0))
    # a true division: on CUDA, "t / 448.0" is computed as "t * fl(1/448)";
    # new_full fills on the device (no host copy: CUDA-graph capturable)
    scale = torch.clamp(amax, min=eps) / amax.new_full((), FP8_MAX)
    if scale_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    qv = torch.clamp(xg / scale.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q.copy_(qv.reshape(m, k))
    s.copy_(scale)
    return q, s


def quantize_weight(w: torch.Tensor, block_size=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float ``[N, K]`` weight to e4m3 with one scale per
    ``bn x bk`` block (DeepSeek-V3 ``weight_scale_inv`` convention: the scale
    multiplies the codes).  Partial edge blocks are fine.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.fp8_block import quantize_weight
    >>> q, s = quantize_weight(torch.randn(300, 256))
    >>> q.dtype, tuple(s.shape)
    (torch.float8_e4m3fn, (3, 2))
    """
    bn, bk = check_block_size("quantize_weight", block_size)
    n, k = w.shape
    nb, kb = V.ceil_div(n, bn), V.ceil_div(k, bk)
    # A block larger than the weight is one block of the weight's size: the
    # same scales, without allocating the whole block.
    bn, bk = min(bn, max(n, 1)), min(bk, max(k, 1))
    wp = w.float().new_zeros((nb * bn, kb * bk))
    wp[:n, :k] = w.float()
    blocks = wp.reshape(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.clamp(amax, min=1e-12) / FP8_MAX
    q = torch.clamp(blocks / scale[:, None, :, None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(nb * bn, kb * bk)[:n, :k].clone(), scale


def _expand_block_scales(s: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    """``s[i // br, j // bc]`` as a dense ``[rows, cols]`` float32 tensor.

    Gathered by index, so nothing larger than ``[rows, cols]`` is allocated
    whatever the block size (repeating each scale ``br`` times first would
    allocate ``ceil(rows / br) * br`` rows: unbounded for a huge block)."""
    ri = torch.arange(rows, device=s.device) // br
    ci = torch.arange(cols, device=s.device) // bc
    return s.index_select(0, ri).index_select(1, ci)


def reference_mm(a, b, a_scales, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16):
    """Dequantize both operands in fp32 and multiply with fp32 accumulation."""
    check_mm_args("fp8_block_mm", a, b, a_scales, b_scales, block_size, out_dtype)
    return reference_mm_f32(a, b, a_scales, b_scales, block_size).to(out_dtype)


def reference_mm_f32(a, b, a_scales, b_scales, block_size):
    """``a @ b.T`` of the dequantized operands in fp32, unrounded (what every
    backend's output rounds).

    Examples
    --------
    >>> a = torch.ones(2, 128).to(torch.float8_e4m3fn)
    >>> b = torch.ones(3, 128).to(torch.float8_e4m3fn)
    >>> reference_mm_f32(a, b, torch.ones(2, 1), torch.full((1, 1), 0.5), (128, 128)).tolist()[0]
    [64.0, 64.0, 64.0]
    """
    bn, bk = block_size
    m, k = a.shape
    n = b.shape[0]
    a_deq = a.float() * _expand_block_scales(a_scales, m, k, 1, bk)
    b_deq = b.float() * _expand_block_scales(b_scales, n, k, bn, bk)
    return a_deq @ b_deq.t()


def reference_linear(x, b, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16, bias=None):
    """Quantize ``x`` per 1 x bk group, block GEMM in fp32, bias added in fp32."""
    q, s = reference_quant(x, block_size[1])
    out = reference_mm_f32(q, b, s, b_scales, block_size)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# ----------------------------------------------------------------------------
# cuBLAS backend: torch._scaled_mm blockwise (sm90+), M % 4 == 0
# ----------------------------------------------------------------------------


def _cublas_supported(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "needs a CUDA device"
    major, _ = capability(device)
    if major < 9:
        return False, f"torch._scaled_mm blockwise needs sm90+, device is sm{major}x"
    return True, "torch._scaled_mm blockwise scaling (cuBLASLt)"


def cublas_can_implement(p: Problem) -> tuple[bool, str]:
    """Whether the blockwise cuBLASLt backend can run ``p``, and why not.

    Examples
    --------
    >>> a = torch.empty(6, 256, dtype=torch.float8_e4m3fn)
    >>> b = torch.empty(128, 256, dtype=torch.float8_e4m3fn)
    >>> cublas_can_implement(problem(a, b, (128, 128), torch.bfloat16, True))
    (False, 'needs M % 4 == 0, got M=6')
    """
    if p.m % ALIGN_M != 0:
        return False, f"needs M % {ALIGN_M} == 0, got M={p.m}"
    if p.opt("block_size") != (128, 128):
        return False, f"needs block_size (128, 128), got {p.opt('block_size')}"
    if p.k % 128 != 0 or p.n % 16 != 0:
        return False, f"needs K % 128 == 0 and N % 16 == 0, got N={p.n}, K={p.k}"
    if p.out_dtype != torch.bfloat16:
        return False, f"blockwise cuBLASLt writes bf16 only, got out_dtype={p.out_dtype}"
    if p.a_row_stride % 16 != 0:
        return False, f"needs a row stride that is a multiple of 16, got {p.a_row_stride}"
    if not _cublas_v1_scales_ok(V.ceil_div(p.n, 128), p.k // 128) and scaled_mm_v2() is None:
        return False, (f"K/128 = {p.k // 128} is not a multiple of 4: needs torch.nn.functional.scaled_mm "
                       "(padded 128x128 scales), absent in this torch")
    return True, "aligned"


# torch._scaled_mm (v1) picks the recipe from the scale shapes and checks
# strides exactly (aten/src/ATen/native/cuda/ScaledBlas.cpp,
# is_blockwise_1x128_scaling / is_blockwise_128x128_scaling):
#   a [M, K] row-major, scale_a [M, K/128] with strides (1, M);
#   b.t() [K, N] column-major, scale_b.t() [N/128, K/128] contiguous, i.e. a
#   row stride of exactly K/128 (size-1 dims exempt).
# cuBLASLt reads 128x128 scales with a row stride of L4 = round_up(K/128, 4)
# (pytorch#166752), so v1 is right only when K/128 % 4 == 0 or N <= 128.  The
# other shapes go through scaled_mm_v2 / F.scaled_mm, whose 1x128 x 128x128
# recipe takes scale_b as [L4, N/128] with strides (1, L4).


def _cublas_v1_scales_ok(nb: int, kb: int) -> bool:
    return kb % 4 == 0 or nb <= 1


def scaled_mm_v2():
    """``torch.nn.functional.scaled_mm`` and its ScalingType, or None.

    Examples
    --------
    >>> scaled_mm_v2() is None or callable(scaled_mm_v2()[0])
    True
    """
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    st = getattr(torch.nn.functional, "ScalingType", None)
    return (fn, st) if fn is not None and st is not None else None


def cublas_a_scales(a_scales: torch.Tensor) -> torch.Tensor:
    """1x128 scales outer-dim-major: ``[M, K/128]`` with strides exactly ``(1, M)``."""
    m, kb = a_scales.shape
    if (m <= 1 or a_scales.stride(0) == 1) and (kb <= 1 or a_scales.stride(1) == m):
        return a_scales
    return a_scales.t().contiguous().t()


def cublas_b_scales(b_scales: torch.Tensor) -> torch.Tensor:
    """128x128 scales ``[N/128, K/128]`` as ``torch._scaled_mm`` (v1) takes them
    for ``b.t()`` (pass ``.t()`` of the result): contiguous, row stride exactly
    K/128.  A row-padded layout (``pad_scale_rows``) with K/128 % 4 == 0 is
    already that; otherwise this is a small copy.  Correct in cuBLASLt only
    when K/128 % 4 == 0 or N <= 128 (see above); ``cublas_mm`` routes the rest
    through ``cublas_b_scales_l4``."""
    return b_scales if b_scales.is_contiguous() else b_scales.contiguous()


def cublas_b_scales_l4(b_scales: torch.Tensor) -> torch.Tensor:
    """128x128 scales as cuBLASLt reads them: ``[L4, N/128]`` with strides
    ``(1, L4)``, L4 = round_up(K/128, 4) (the ``scale_b`` of F.scaled_mm's
    1x128 x 128x128 recipe).  A ``pad_scale_rows`` layout is reused in place."""
    nb, kb = b_scales.shape
    l4 = V.round_up(kb, 4)
    storage_end = b_scales.storage_offset() + nb * l4
    if (b_scales.stride(1) == 1 or kb <= 1) and (b_scales.stride(0) == l4 or nb <= 1) \
            and b_scales.untyped_storage().nbytes() >= storage_end * b_scales.element_size():
        return b_scales.as_strided((nb, l4), (l4, 1)).t()
    padded = b_scales.new_zeros((nb, l4))
    padded[:, :kb] = b_scales
    return padded.t()


def pad_scale_rows(b_scales: torch.Tensor, multiple: int = 4) -> torch.Tensor:
    """``b_scales`` as a ``[nb, kb]`` view into a zero-padded ``[nb,
    round_up(kb, multiple)]`` buffer (the row stride cuBLASLt wants).  Every
    backend reads this layout; layers store weight scales this way once."""
    nb, kb = b_scales.shape
    padded = b_scales.new_zeros((nb, V.round_up(kb, multiple)))
    padded[:, :kb] = b_scales
    return padded[:, :kb]


def cublas_mm(a, b, a_scales, b_scales, block_size, out_dtype):
    m = a.shape[0]
    if m == 0:
        return mm_output(a, b, out_dtype)
    sa = cublas_a_scales(a_scales)
    if _cublas_v1_scales_ok(*b_scales.shape):
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=cublas_b_scales(b_scales).t(),
                                out_dtype=out_dtype)
    scaled_mm, st = scaled_mm_v2()
    return scaled_mm(a, b.t(), sa, st.BlockWise1x128, cublas_b_scales_l4(b_scales), st.BlockWise128x128,
                     output_dtype=out_dtype)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _quant_impl(x, group_size=128, eps=1e-10, column_major_scales=False, scale_ue8m0=False):
    quant_outputs(x, group_size, eps, column_major_scales, scale_ue8m0)
    p = Problem(FAMILY, x.device, x.shape[0], 0, x.shape[1], x.dtype, FP8_DTYPE, x.stride(0),
                (("group_size", group_size), ("column_major_scales", column_major_scales),
                 ("scale_ue8m0", scale_ue8m0)))
    return run(p, "per_token_group_quant_fp8", x, group_size, eps, column_major_scales, scale_ue8m0)


def _mm_impl(a, b, a_scales, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16):
    col = check_mm_args("fp8_block_mm", a, b, a_scales, b_scales, block_size, out_dtype)
    return _direct_mm(a, b, a_scales, b_scales, block_size, out_dtype, col)


def _direct_mm(a, b, a_scales, b_scales, block_size, out_dtype, col):
    return run(problem(a, b, block_size, out_dtype, col), "fp8_block_mm",
               a, b, a_scales, b_scales, block_size, out_dtype)


def rows_view(a: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``a`` seen with ``rows`` rows (same strides) when its storage holds
    them, else None.  The rows past ``a.shape[0]`` hold whatever the buffer
    holds; a GEMM keeps rows apart, so they only reach output rows that the
    padded op drops."""
    if a.dim() != 2 or a.stride(1) != 1 or rows <= a.shape[0]:
        return None
    needed = a.storage_offset() + (rows - 1) * a.stride(0) + a.shape[1]
    if needed * a.element_size() > a.untyped_storage().nbytes():
        return None
    return a.as_strided((rows, a.shape[1]), a.stride())


def pad_rows(a: torch.Tensor, a_scales: torch.Tensor, multiple: int = ALIGN_M):
    """``a`` and ``a_scales`` with M rounded up to ``multiple`` rows: the
    activation as a view when its buffer has the rows (what our quantizers
    allocate), else a copy whose added rows are zero; scale rows added as
    1.0, in the layout given (column-major stays column-major)."""
    m = a.shape[0]
    mp = V.round_up(m, multiple)
    a_p = rows_view(a, mp)
    if a_p is None:
        a_p = a.new_empty((mp, a.shape[1]))
        a_p[:m] = a
        a_p[m:].zero_()
    if a_scales.stride(0) == 1 and a_scales.stride(1) != 1:  # column-major stays column-major
        s_p = a_scales.new_empty((a_scales.shape[1], mp)).t()
    else:
        s_p = a_scales.new_empty((mp, a_scales.shape[1]))
    s_p[:m] = a_scales
    s_p[m:] = 1.0
    return a_p, s_p


def _padded_mm_impl(a, b, a_scales, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16):
    """Select the backend for the padded problem (M rounded up to 4); pad
    only when that backend needs it.  A backend that takes any M (Triton,
    when the measured auto table ranks it first) reads the original rows: no
    copy, same result."""
    col = check_mm_args("padded_fp8_block_mm", a, b, a_scales, b_scales, block_size, out_dtype)
    return _padded_mm(a, b, a_scales, b_scales, block_size, out_dtype, col)


def _padded_mm(a, b, a_scales, b_scales, block_size, out_dtype, col):
    m = a.shape[0]
    mp = V.round_up(m, ALIGN_M)
    # Backends are checked at the padded M but ranked at the real one: the
    # measured table's rows for M % 4 != 0 include the cost of padding.
    p = problem(a, b, block_size, out_dtype, col, m=mp)
    backend = backends.select(p, "fp8_block_mm", table_m=m)
    if mp == m or backend.needs_m_multiple == 1:
        p_run = p if mp == m else dataclasses.replace(p, m=m)
        return backend.run("fp8_block_mm", p_run, a, b, a_scales, b_scales, block_size, out_dtype)
    a_p, s_p = pad_rows(a, a_scales, backend.needs_m_multiple)
    p_run = p if a_p.shape[0] == mp else dataclasses.replace(p, m=a_p.shape[0])
    return backend.run("fp8_block_mm", p_run, a_p, b, s_p, b_scales, block_size, out_dtype)[:m]


def _dynamic_padded_mm_impl(a, b, a_scales, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16):
    col = check_mm_args("dynamic_padded_fp8_block_mm", a, b, a_scales, b_scales, block_size, out_dtype)
    if a.shape[0] % ALIGN_M == 0:
        return _direct_mm(a, b, a_scales, b_scales, block_size, out_dtype, col)
    return _padded_mm(a, b, a_scales, b_scales, block_size, out_dtype, col)


def _linear_impl(x, b, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16, bias=None):
    check_linear_args(x, b, b_scales, block_size, out_dtype, bias)
    p = linear_problem(x, b, block_size, out_dtype)
    return run(p, "fp8_block_linear", x, b, b_scales, block_size, out_dtype, bias)


def composite_linear(x, b, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16, bias=None):
    """fp8_block_linear as two ops (quantize, then GEMM in fp32 + bias)."""
    # Each inner op selects its own backend, so a forced GEMM backend
    # (use_backend, env) also runs the GEMM here.
    # column-major scales: what cuBLASLt and CUTLASS read (Triton reads both)
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, block_size[1], 1e-10, True)
    # M % 4 != 0: the padded op, which views q's spare rows (no copy) for an
    # aligned-only backend when the table ranks one first.
    mm = torch.ops.scaledmm.dynamic_padded_fp8_block_mm
    if bias is None:
        return mm(q, b, s, b_scales, block_size, out_dtype)
    out = mm(q, b, s, b_scales, block_size, torch.float32)
    return (out + bias.float()).to(out_dtype)


_MM_SCHEMA = ("(Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, int[] block_size=[128,128], "
              "ScalarType out_dtype=15) -> Tensor")

per_token_group_quant_fp8 = define(
    "per_token_group_quant_fp8",
    "(Tensor x, int group_size=128, float eps=1e-10, bool column_major_scales=False, "
    "bool scale_ue8m0=False) -> (Tensor q, Tensor s)",
    _quant_impl,
)
fp8_block_mm = define("fp8_block_mm", _MM_SCHEMA, _mm_impl)
padded_fp8_block_mm = define("padded_fp8_block_mm", _MM_SCHEMA, _padded_mm_impl)
dynamic_padded_fp8_block_mm = define("dynamic_padded_fp8_block_mm", _MM_SCHEMA, _dynamic_padded_mm_impl)
fp8_block_linear = define(
    "fp8_block_linear",
    "(Tensor x, Tensor b, Tensor b_scales, int[] block_size=[128,128], ScalarType out_dtype=15, "
    "Tensor? bias=None) -> Tensor",
    _linear_impl,
)

def _reference_mm_backend(a, b, a_scales, b_scales, block_size, out_dtype):
    return reference_mm_f32(a, b, a_scales, b_scales, block_size).to(out_dtype)


backends.register(Backend(
    FAMILY, "reference",
    impls={
        "per_token_group_quant_fp8": reference_quant,
        "fp8_block_mm": _reference_mm_backend,
        "fp8_block_linear": reference_linear,
    },
    description="plain torch math (dequantize, fp32 matmul); any device",
))
backends.register(Backend(
    FAMILY, "composite",
    impls={"fp8_block_linear": composite_linear},
    is_supported=lambda d: (d.type == "cuda", "quantize op + GEMM op" if d.type == "cuda" else "GPU only"),
    description="fp8_block_linear as per_token_group_quant_fp8 + fp8_block_mm, each selected as if called alone",
))
backends.register(Backend(
    FAMILY, "cublas",
    impls={"fp8_block_mm": cublas_mm},
    is_supported=_cublas_supported,
    can_implement=cublas_can_implement,
    needs_m_multiple=ALIGN_M,
    description="torch._scaled_mm with 1x128 / 128x128 blockwise scales",
))
