"""FP8 GEMM with per-tensor / per-token / per-channel scales (SPEC.md "FP8
per-tensor / per-channel GEMM with load-time padding").

Three ops:

* ``quant_fp8(x, scale=None, per_token=False) -> (q, scale)``: e4m3 codes of a
  ``[M, K]`` activation with a static scale, a dynamic per-tensor scale
  (returned with shape ``[1]``, the convention of other inference engines) or
  dynamic per-token scales (``[M, 1]``).
* ``fp8_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=bf16)``:
  ``out = (a * scale_a) @ (b * scale_b).T + bias`` with ``scale_a`` one
  element or ``[M, 1]`` and ``scale_b`` one element, ``[N]`` or ``[1, N]``.
  K and N must be multiples of 16 (what cuBLAS needs); layers get there by
  padding the weight once at load time (``scaledmm.layers.Fp8Linear``).
* ``fp8_linear(x, b, scale_b, scale_x=None, per_token=False, bias=None,
  out_dtype=bf16)``: ``quant_fp8(x, scale_x, per_token)`` then
  ``fp8_scaled_mm`` in one op (what ``Fp8Linear`` calls), so a backend may do
  both in one launch (``cuda_gemv``, ops/fp8_gemv.py, at small M); the codes
  and scales are the quantizer's, bit for bit.

Read top to bottom: shapes and checks (shared with the fake impls), reference
math (the CPU implementation, a GPU backend too), the cuBLAS backend
(``torch._scaled_mm``), op registration, backend registration.

Examples
--------
>>> import torch, scaledmm
>>> x = torch.randn(3, 64, dtype=torch.bfloat16)
>>> q, s = torch.ops.scaledmm.quant_fp8(x)
>>> w, ws = torch.ops.scaledmm.quant_fp8(torch.randn(32, 64), per_token=True)
>>> out = torch.ops.scaledmm.fp8_scaled_mm(q, w, s, ws.reshape(-1))
>>> tuple(s.shape), tuple(ws.shape), tuple(out.shape), out.dtype
((1,), (32, 1), (3, 32), torch.bfloat16)
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from scaledmm import backends
from scaledmm import validation as V
from scaledmm.backends import Backend, Family, Problem
from scaledmm.device import capability
from scaledmm.oplib import FP8_DTYPE, FP8_MAX, define, run

FAMILY = Family.FP8
ALIGN_K = 16  # cuBLASLt FP8: K and N multiples of 16 (leading dims 16-byte aligned)
ALIGN_N = 16
# Dynamic scales are max(amax, AMAX_FLOOR) / 448: an all-zero tensor (or row)
# gets a tiny positive scale instead of 0 (which would turn 0 / 0 into NaN).
# Same floor as per_token_group_quant_fp8's default eps.
AMAX_FLOOR = 1e-10

TENSOR = "tensor"  # one scale for the whole operand
TOKEN = "token"  # scale_a [M, 1]
CHANNEL = "channel"  # scale_b [N] or [1, N]

# ----------------------------------------------------------------------------
# Shapes and checks (the fake impls call these too)
# ----------------------------------------------------------------------------


def _is_one_element(t: torch.Tensor) -> bool:
    """0-D, [1] or [1, 1]: a per-tensor scale.  A symbolic size counts as 1
    only when it is 1 for every value of its symbols (no guard), so an
    ``[M, 1]`` per-token scale with a dynamic M stays one graph for M = 1 too
    (both kinds compute the same thing when M = 1)."""
    return t.dim() <= 2 and all(statically_known_true(s == 1) for s in t.shape)


def check_quant_args(x: torch.Tensor, scale: torch.Tensor | None, per_token: bool) -> None:
    op = "quant_fp8"
    V.check_dtype(op, "x", x, V.ACT_DTYPES)
    V.check_rank(op, "x", x, 2)
    V.check_inner_stride(op, "x", x)
    if scale is None:
        return
    check_static_scale(op, "scale", scale, x.shape[0], per_token)
    V.check_same_device(op, x=x, scale=scale)


def check_static_scale(op: str, arg: str, scale: torch.Tensor, m, per_token: bool) -> None:
    """A static activation scale: float32, ``[M, 1]`` with ``per_token``, else one element."""
    V.check_dtype(op, arg, scale, torch.float32)
    if per_token:
        V.check_shape(op, arg, scale, (m, 1), "[M, 1] static per-token scale, per_token=True")
    elif not _is_one_element(scale):
        V.fail(op, arg, "a one-element tensor (0-D, [1] or [1, 1]) for a static per-tensor scale "
               "(pass per_token=True for [M, 1])", f"shape {tuple(scale.shape)}")


def quant_outputs(x: torch.Tensor, scale: torch.Tensor | None = None,
                  per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``quant_fp8`` arguments and allocate ``(q, scale_out)``.

    ``q`` is a contiguous e4m3 ``[M, K]``; ``scale_out`` is float32 with the
    shape of the static ``scale`` when one is given, else ``[M, 1]``
    (``per_token``) or ``[1]``.
    """
    check_quant_args(x, scale, per_token)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if scale is not None:
        s_shape = tuple(scale.shape)
    else:
        s_shape = (m, 1) if per_token else (1,)
    return q, torch.empty(s_shape, dtype=torch.float32, device=x.device)


def scale_a_kind(op: str, scale_a: torch.Tensor, m) -> str:
    """``TENSOR`` for one element, ``TOKEN`` for ``[M, 1]``; else ValueError."""
    V.check_dtype(op, "scale_a", scale_a, torch.float32)
    if _is_one_element(scale_a):
        return TENSOR
    if scale_a.dim() == 2 and scale_a.shape[0] == m and scale_a.shape[1] == 1:
        return TOKEN
    V.fail(op, "scale_a", f"a one-element tensor or shape ({m}, 1) (M = a.shape[0])", f"shape {tuple(scale_a.shape)}")
    return ""  # unreachable


def scale_b_kind(op: str, scale_b: torch.Tensor, n) -> str:
    """``TENSOR`` for one element, ``CHANNEL`` for ``[N]`` / ``[1, N]``; else ValueError."""
    V.check_dtype(op, "scale_b", scale_b, torch.float32)
    if _is_one_element(scale_b):
        return TENSOR
    if (scale_b.dim() == 1 and scale_b.shape[0] == n) or (
            scale_b.dim() == 2 and scale_b.shape[0] == 1 and scale_b.shape[1] == n):
        return CHANNEL
    V.fail(op, "scale_b", f"a one-element tensor, shape ({n},) or (1, {n}) (N = b.shape[0])",
           f"shape {tuple(scale_b.shape)}")
    return ""  # unreachable


def check_mm_args(op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[str, str]:
    """Validate ``fp8_scaled_mm`` arguments; returns the kinds of ``scale_a``
    and ``scale_b``."""
    V.check_dtype(op, "a", a, FP8_DTYPE)
    V.check_rank(op, "a", a, 2)
    V.check_inner_stride(op, "a", a)
    n = _check_weight(op, "a", a, b)
    kind_a = scale_a_kind(op, scale_a, a.shape[0])
    kind_b = scale_b_kind(op, scale_b, n)
    _check_bias_and_out(op, bias, n, out_dtype)
    V.check_same_device(op, a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    return kind_a, kind_b


def _check_weight(op: str, act_arg: str, act: torch.Tensor, b: torch.Tensor) -> int:
    """The e4m3 ``[N, K]`` weight of a GEMM with the 2-D activation ``act``
    (argument ``act_arg``): contiguous, K and N multiples of 16.  Returns N."""
    V.check_dtype(op, "b", b, FP8_DTYPE)
    V.check_rank(op, "b", b, 2)
    V.check_contiguous(op, "b", b)
    what = f"K = {act_arg}.shape[1]"
    V.check_dim(op, "b", b, 1, act.shape[1], what)
    V.check_divisible(op, act_arg, act.shape[1], ALIGN_K, what)
    V.check_divisible(op, "b", b.shape[0], ALIGN_N, "N = b.shape[0]")
    return b.shape[0]


def _check_bias_and_out(op: str, bias: torch.Tensor | None, n, out_dtype: torch.dtype) -> None:
    if bias is not None:
        V.check_dtype(op, "bias", bias, V.FLOAT_OUT_DTYPES)
        V.check_shape(op, "bias", bias, (n,), "N = b.shape[0]")
    V.check_out_dtype(op, out_dtype)


def mm_output(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The contiguous ``[M, N]`` output of ``fp8_scaled_mm``."""
    return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)


def quant_mode(scale: torch.Tensor | None, per_token: bool) -> str:
    """``quant_fp8``'s mode: ``static``, ``static_token``, ``per_token`` or ``per_tensor``."""
    if scale is not None:
        return "static_token" if per_token else "static"
    return "per_token" if per_token else "per_tensor"


def check_linear_args(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, scale_x: torch.Tensor | None,
                      per_token: bool, bias: torch.Tensor | None, out_dtype: torch.dtype) -> str:
    """Validate ``fp8_linear`` arguments (those of ``quant_fp8`` on ``x`` and
    of ``fp8_scaled_mm`` on the codes); returns the kind of ``scale_b``."""
    op = "fp8_linear"
    V.check_dtype(op, "x", x, V.ACT_DTYPES)
    V.check_rank(op, "x", x, 2)
    V.check_inner_stride(op, "x", x)
    n = _check_weight(op, "x", x, b)
    if scale_x is not None:
        check_static_scale(op, "scale_x", scale_x, x.shape[0], per_token)
    kind_b = scale_b_kind(op, scale_b, n)
    _check_bias_and_out(op, bias, n, out_dtype)
    V.check_same_device(op, x=x, b=b, scale_b=scale_b, scale_x=scale_x, bias=bias)
    return kind_b


def linear_problem(x, b, scale_x, per_token, kind_b: str, bias, out_dtype) -> Problem:
    """The ``fp8_linear`` Problem; its policy variant is the GEMM's (as
    :func:`mm_problem` names it for the codes' scale)."""
    mode = quant_mode(scale_x, per_token)
    kind_a = TOKEN if mode in ("per_token", "static_token") else TENSOR
    variant = "tensorwise" if kind_a == TENSOR and kind_b == TENSOR else "rowwise"
    return Problem(
        FAMILY, x.device, x.shape[0], b.shape[0], x.shape[1], x.dtype, out_dtype, x.stride(0),
        (("quant", mode), ("scale_b", kind_b), ("bias_dtype", None if bias is None else bias.dtype),
         ("aligned16", V.aligned16(x, b)), ("variant", variant)),
    )


def mm_problem(a, b, kind_a: str, kind_b: str, bias, out_dtype) -> Problem:
    # The policy variant: per-tensor and row-wise scales have different winners
    # (cuBLAS's per-tensor kernel is fast where its row-wise one is not).
    variant = "tensorwise" if kind_a == TENSOR and kind_b == TENSOR else "rowwise"
    return Problem(
        FAMILY, a.device, a.shape[0], b.shape[0], a.shape[1], a.dtype, out_dtype, a.stride(0),
        (("scale_a", kind_a), ("scale_b", kind_b), ("bias_dtype", None if bias is None else bias.dtype),
         ("b_aligned", V.aligned16(b)), ("variant", variant)),
    )


# ----------------------------------------------------------------------------
# Reference math (the CPU implementation; also a GPU backend)
# ----------------------------------------------------------------------------


def reference_quant(x: torch.Tensor, scale: torch.Tensor | None = None,
                    per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of ``x`` and the scale that decodes them (``x ~ q * scale``).

    * static ``scale``: ``q = e4m3(clamp(x * (1 / scale), -448, 448))``, the
      reciprocal taken once in float32 (the order of vLLM's quantization
      kernels, so ties round as theirs do); the scale returned is a copy of
      the one given.
    * dynamic per-token: ``scale[m] = max(amax|x[m, :]|, 1e-10) / 448``.  A
      NaN or Inf in a row makes that row's scale non-finite: only that row is
      affected.
    * dynamic per-tensor (``[1]``): the same over the finite values of ``x``;
      NaN and Inf are left out of the amax so one bad row cannot change the
      scale of the others.  A NaN stays NaN (e4m3 NaN) and ±Inf saturates to
      ±448, as with a static scale (e4m3fn has no infinity).

    Dynamic scales quantize the same way, ``x * (1 / scale)``.  Rounding is to
    nearest even, in float32.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.fp8 import reference_quant
    >>> q, s = reference_quant(torch.tensor([[1.0, -2.0], [0.5, 4.0]]))
    >>> s, (q.float() * s).tolist()
    (tensor([0.0089]), [[1.0, -2.0], [0.5, 4.0]])
    """
    q, s = quant_outputs(x, scale, per_token)
    m, k = x.shape
    xf = x.float()
    if scale is not None:
        sv = scale.reshape(m, 1) if per_token else scale.reshape(1, 1)
        s.copy_(scale)
    elif per_token:
        amax = xf.abs().amax(dim=1, keepdim=True) if k else xf.new_zeros((m, 1))
        sv = torch.clamp(amax, min=AMAX_FLOOR) / amax.new_full((), FP8_MAX)  # true division on CUDA too
        s.copy_(sv)
    else:
        ax = xf.abs()
        amax = torch.where(torch.isfinite(ax), ax, 0.0).amax() if x.numel() else xf.new_zeros(())
        sv = (torch.clamp(amax, min=AMAX_FLOOR) / amax.new_full((), FP8_MAX)).reshape(1, 1)
        s.copy_(sv.reshape(1))
    q.copy_(torch.clamp(xf * torch.reciprocal(sv), -FP8_MAX, FP8_MAX))  # IEEE fp32 1/s, CUDA too
    return q, s


def _scale_view(scale: torch.Tensor, kind: str, rows: bool) -> torch.Tensor:
    """A scale as a tensor that broadcasts against ``[M, N]``."""
    if kind == TENSOR:
        return scale.reshape(1, 1)
    return scale.reshape(-1, 1) if rows else scale.reshape(1, -1)


def _epilogue(acc: torch.Tensor, sa: torch.Tensor | None, sb: torch.Tensor | None,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``acc * sa * sb + bias`` in float32, one rounding to ``out_dtype``."""
    out = acc
    if sa is not None:
        out = out * sa
    if sb is not None:
        out = out * sb
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def reference_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b).T + bias`` the way cuBLAS computes it:
    float32 accumulation of the exact fp8 products, then ``* scale_a *
    scale_b``, then ``+ bias`` in float32, one rounding to ``out_dtype``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.fp8 import reference_mm
    >>> a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    >>> b = torch.ones(16, 16).to(torch.float8_e4m3fn)
    >>> reference_mm(a, b, torch.tensor(0.5), torch.tensor(2.0))[0, :3]
    tensor([16., 16., 16.], dtype=torch.bfloat16)
    """
    kind_a, kind_b = check_mm_args("fp8_scaled_mm", a, b, scale_a, scale_b, bias, out_dtype)
    out = mm_output(a, b, out_dtype)
    if out.numel() == 0:  # M == 0 or N == 0: touch nothing
        return out
    acc = a.float() @ b.float().t()
    out.copy_(_epilogue(acc, _scale_view(scale_a, kind_a, True), _scale_view(scale_b, kind_b, False),
                        bias, out_dtype))
    return out


def reference_linear(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, scale_x: torch.Tensor | None = None,
                     per_token: bool = False, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``fp8_linear`` by its definition: :func:`reference_quant`, then
    :func:`reference_mm`.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.fp8 import reference_linear, reference_quant
    >>> w, ws = reference_quant(torch.randn(32, 64), per_token=True)
    >>> reference_linear(torch.randn(3, 64), w, ws.reshape(-1), per_token=True).shape
    torch.Size([3, 32])
    """
    check_linear_args(x, b, scale_b, scale_x, per_token, bias, out_dtype)
    q, s = reference_quant(x, scale_x, per_token)
    return reference_mm(q, b, s, scale_b, bias, out_dtype)


def composite_linear(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, scale_x: torch.Tensor | None = None,
                     per_token: bool = False, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``fp8_linear`` as the two ops, each selected as if called alone.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.fp8 import composite_linear, reference_quant
    >>> w, ws = reference_quant(torch.randn(32, 64), per_token=True)
    >>> composite_linear(torch.randn(3, 64), w, ws.reshape(-1), per_token=True).dtype
    torch.bfloat16
    """
    q, s = torch.ops.scaledmm.quant_fp8(x, scale_x, per_token)
    return torch.ops.scaledmm.fp8_scaled_mm(q, b, s, scale_b, bias, out_dtype)


# ----------------------------------------------------------------------------
# cuBLAS backend: torch._scaled_mm (cuBLASLt; sm89+)
# ----------------------------------------------------------------------------

# Output dtypes torch._scaled_mm's row-wise path (scale_a [M, 1], scale_b
# [1, N]) is relied on for.  torch <= 2.9 documents bf16 only; newer builds
# with cuBLAS >= 12.9 may take more (benchmarks/experiments/fp8.py probes it).
# Other dtypes take the unit-scale path below: still one cuBLAS GEMM.
ROWWISE_OUT_DTYPES = (torch.bfloat16,)

# Plans of the cuBLAS backend, one per way of calling torch._scaled_mm.
PLAN_TENSORWISE = "tensorwise"  # both scales one element, bias (if any) fused
PLAN_ROWWISE = "rowwise"  # scale_a [M, 1], scale_b [1, N] (scalars expanded), bias fused
PLAN_F32_EPILOGUE = "f32_epilogue"  # GEMM to float32, scales/bias in float32 afterwards


def cublas_plan(p: Problem) -> tuple[str, str]:
    """How the cuBLAS backend computes problem ``p``: ``(plan, reason)``.

    cuBLASLt fuses a bias only in the output dtype (bf16 or fp16, never with a
    float32 output); the row-wise scaled GEMM writes the dtypes in
    ``ROWWISE_OUT_DTYPES``.  Everything else runs the GEMM with float32 output
    and applies what cuBLAS could not fuse in float32, which keeps the
    reference math (one rounding to ``out_dtype``).
    """
    bias_dtype = p.opt("bias_dtype")
    fused_bias = bias_dtype is None or (bias_dtype == p.out_dtype and p.out_dtype != torch.float32)
    per_tensor = p.opt("scale_a") == TENSOR and p.opt("scale_b") == TENSOR
    if not fused_bias:
        why = (f"bias {bias_dtype} with out_dtype {p.out_dtype}: cuBLASLt fuses a bias only in a "
               f"bf16/fp16 output dtype; float32 GEMM output, bias added in float32")
        return PLAN_F32_EPILOGUE, why
    if per_tensor:
        return PLAN_TENSORWISE, "per-tensor scales (cuBLASLt alpha)"
    if p.out_dtype in ROWWISE_OUT_DTYPES:
        return PLAN_ROWWISE, "row-wise scales ([M, 1] x [1, N], one-element scales expanded)"
    return PLAN_F32_EPILOGUE, (f"row-wise scaled GEMM writes {[str(d) for d in ROWWISE_OUT_DTYPES]}, "
                               f"got out_dtype {p.out_dtype}: float32 GEMM output, scales applied in float32")


def _cublas_supported(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "needs a CUDA device"
    if not hasattr(torch, "_scaled_mm"):
        return False, "this torch has no torch._scaled_mm"
    major, minor = capability(device)
    if (major, minor) < (8, 9):
        return False, f"torch._scaled_mm with e4m3 needs sm89+, device is sm{major}{minor}"
    return True, "torch._scaled_mm (cuBLASLt) with per-tensor or row-wise scales"


def _cublas_can_implement(p: Problem) -> tuple[bool, str]:
    if p.k % ALIGN_K != 0 or p.n % ALIGN_N != 0:
        return False, f"needs K % {ALIGN_K} == 0 and N % {ALIGN_N} == 0, got N={p.n}, K={p.k}"
    if not p.opt("b_aligned", True):
        return False, "needs the weight b to start on a 16-byte boundary (it is never copied)"
    plan, why = cublas_plan(p)
    return True, f"{plan}: {why}"


def cublas_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``fp8_scaled_mm`` on ``torch._scaled_mm``; reads the weight in place
    (``b.t()`` is the column-major operand cuBLASLt wants), copies at most the
    activation (when its rows are not 16-byte aligned) and vectors of M or N
    scales."""
    kind_a, kind_b = check_mm_args("fp8_scaled_mm", a, b, scale_a, scale_b, bias, out_dtype)
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:  # no GEMM to run (cuBLAS would also drop the bias for K == 0)
        return reference_mm(a, b, scale_a, scale_b, bias, out_dtype)
    plan, _ = cublas_plan(mm_problem(a, b, kind_a, kind_b, bias, out_dtype))
    if a.stride(0) < k or a.stride(0) % 16 != 0 or a.data_ptr() % 16 != 0:
        a = a.clone(memory_format=torch.contiguous_format)  # cuBLASLt: 16-byte aligned rows
    bt = b.t()
    if bias is not None:
        bias = bias.contiguous()
    if plan == PLAN_TENSORWISE:
        return torch._scaled_mm(a, bt, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=False)
    if plan == PLAN_ROWWISE:
        sa = scale_a.reshape(1, 1).expand(m, 1) if kind_a == TENSOR else scale_a
        sb = scale_b.reshape(1, 1).expand(1, n) if kind_b == TENSOR else scale_b.reshape(1, n)
        return torch._scaled_mm(a, bt, scale_a=sa.contiguous(), scale_b=sb.contiguous(), bias=bias,
                                out_dtype=out_dtype, use_fast_accum=False)
    # PLAN_F32_EPILOGUE
    if kind_a == TENSOR and kind_b == TENSOR:
        acc = torch._scaled_mm(a, bt, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32,
                               use_fast_accum=False)
        return _epilogue(acc, None, None, bias, out_dtype)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    acc = torch._scaled_mm(a, bt, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=False)
    return _epilogue(acc, _scale_view(scale_a, kind_a, True), _scale_view(scale_b, kind_b, False), bias, out_dtype)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _quant_impl(x, scale=None, per_token=False):
    check_quant_args(x, scale, per_token)
    mode = "static" if scale is not None else ("per_token" if per_token else "per_tensor")
    p = Problem(FAMILY, x.device, x.shape[0], 0, x.shape[1], x.dtype, FP8_DTYPE, x.stride(0),
                (("quant", mode),))
    return run(p, "quant_fp8", x, scale, per_token)


def _mm_impl(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    kind_a, kind_b = check_mm_args("fp8_scaled_mm", a, b, scale_a, scale_b, bias, out_dtype)
    return run(mm_problem(a, b, kind_a, kind_b, bias, out_dtype), "fp8_scaled_mm",
               a, b, scale_a, scale_b, bias, out_dtype)


def _linear_impl(x, b, scale_b, scale_x=None, per_token=False, bias=None, out_dtype=torch.bfloat16):
    kind_b = check_linear_args(x, b, scale_b, scale_x, per_token, bias, out_dtype)
    return run(linear_problem(x, b, scale_x, per_token, kind_b, bias, out_dtype), "fp8_linear",
               x, b, scale_b, scale_x, per_token, bias, out_dtype)


quant_fp8 = define(
    "quant_fp8",
    "(Tensor x, Tensor? scale=None, bool per_token=False) -> (Tensor q, Tensor scale)",
    _quant_impl,
)
fp8_scaled_mm = define(
    "fp8_scaled_mm",
    "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, ScalarType out_dtype=15) -> Tensor",
    _mm_impl,
)

fp8_linear = define(
    "fp8_linear",
    "(Tensor x, Tensor b, Tensor scale_b, Tensor? scale_x=None, bool per_token=False, Tensor? bias=None, "
    "ScalarType out_dtype=15) -> Tensor",
    _linear_impl,
)

backends.register(Backend(
    FAMILY, "reference",
    impls={"quant_fp8": reference_quant, "fp8_scaled_mm": reference_mm, "fp8_linear": reference_linear},
    description="plain torch math (fp32 matmul of the fp8 values, then scales); any device",
))
backends.register(Backend(
    FAMILY, "cublas",
    # no quantize kernel: forcing "cublas" leaves quant_fp8 to automatic selection
    impls={"fp8_scaled_mm": cublas_mm},
    is_supported=_cublas_supported,
    can_implement=_cublas_can_implement,
    description="torch._scaled_mm: per-tensor or row-wise scales, bias fused when cuBLASLt can",
))
backends.register(Backend(
    FAMILY, "composite",
    impls={"fp8_linear": composite_linear},
    description="fp8_linear as quant_fp8 + fp8_scaled_mm, each selected as if called alone",
))
