"""NVFP4: 4-bit e2m1 codes, one e4m3 scale per 16 elements along K, fp32
global scales (SPEC.md "NVFP4").

Read top to bottom: the format (e2m1 encode/decode, packing, the e4m3
block-scale cast), the swizzled scale layout, shapes and checks (shared with
the fake impls), the reference math, op registration and the registration of
backends ``reference`` and ``composite``.  The kernel backends live in their
own modules and register themselves in the same family: the Triton kernels
(any sm80+ GPU) in ``ops/nvfp4_triton.py``, the sm100 library backends
(``torch`` through ``torch._scaled_mm``, ``flashinfer_cutedsl`` through
FlashInfer) in ``ops/nvfp4_sm100.py``, the sm90 CUDA kernels in
``ops/nvfp4_gemv.py``, ``ops/nvfp4_mid.py`` and ``ops/nvfp4_wgmma.py``, the
decode-then-cuBLAS path in ``ops/nvfp4_cublas.py``.

Conventions of this module:

* ``global_scale`` (quantize multiplier) and ``alpha`` / ``weight_alpha``
  (decode multipliers) are float32 tensors with exactly one element: 0-D or
  any shape such as ``[1]``.  They stay on the device, so nothing syncs.
* ``nvfp4_dynamic_linear`` is ``nvfp4_linear`` with the activation's global
  scale computed in the op from amax values (``x_amax``, e.g. the per-row amax
  its producer reduced): ``gs = 448 * 6 / max(max(x_amax), 1e-30)`` and
  ``alpha = weight_alpha / gs``, each one IEEE float32 operation.
* ``nvfp4_mm``, ``nvfp4_w4a16_mm`` and ``nvfp4_linear`` (``nvfp4_quant`` + ``nvfp4_mm``
  in one op) take block scales only in the swizzled
  layout, with exactly the padded shape ``[round_up(R, 128), round_up(K/16, 4)]``
  that ``nvfp4_quant(..., swizzle=True)`` and :func:`swizzle_block_scales`
  return.
* The :class:`~scaledmm.backends.Problem` of the family: ``m`` = activation
  rows, ``n`` = rows of ``b`` (0 for the quantizer), ``k`` = logical K (twice
  the packed bytes), ``in_dtype`` = activation dtype as given (uint8 for the
  packed W4A4 GEMM), ``a_row_stride`` in logical elements (twice the byte
  stride for packed operands), options ``("swizzle", bool)`` (quantizer) and
  ``("bias", bool)``, ``("w4a16", bool)`` (GEMMs).
"""

from __future__ import annotations

import torch

from scaledmm import backends
from scaledmm import validation as V
from scaledmm.backends import Backend, Family, Problem
from scaledmm.oplib import FP8_DTYPE, FP8_MAX, define, run

FAMILY = Family.NVFP4
BLOCK = 16  # elements per e4m3 block scale
E2M1_MAX = 6.0
SCALE_ROWS = 128  # swizzled scale layout: rows padded to this ...
SCALE_COLS = 4  # ... and scale columns to this
FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)
#: Largest magnitude one global scale maps to: e4m3's largest block scale
#: times e2m1's largest code.  A dynamic global scale is this over the amax.
RANGE = FP8_MAX * E2M1_MAX
#: Floor of a dynamic amax: keeps ``RANGE / amax`` finite (an all-zero
#: activation then gets zero block scales and codes, not ``inf * 0``).
AMAX_FLOOR = 1e-30

__all__ = [
    "E2M1_VALUES", "e2m1_encode", "e2m1_decode", "pack_e2m1", "unpack_e2m1", "e4m3_saturating",
    "swizzle_block_scales", "unswizzle_block_scales", "swizzled_shape", "dequantize",
    "reference_quant", "reference_mm", "reference_w4a16_mm", "reference_linear", "dynamic_scales",
    "reference_dynamic_linear",
]

# ----------------------------------------------------------------------------
# Format: e2m1 codes, packing, e4m3 block scales
# ----------------------------------------------------------------------------

#: Value of each 4-bit code: bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Round-to-nearest-even on the magnitude grid {0, .5, 1, 1.5, 2, 3, 4, 6}: the
# index grows by one at each midpoint; a tie goes to the even index, so the
# comparison is strict (">") above an even index and inclusive (">=") above an
# odd one.  (midpoint, inclusive)
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
               (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (ties to even) of each element, as uint8 in [0, 15].

    Magnitudes above 6 saturate to code 7 (callers clamp first, as SPEC's
    quantizer does); the sign bit follows ``torch.signbit`` (so -0.0 and small
    negatives that round to zero give code 8, "-0"); NaN gives a zero
    magnitude (the NaN travels in the block scale instead).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import e2m1_encode
    >>> e2m1_encode(torch.tensor([0.25, 0.75, 2.5, 5.0, -6.0])).tolist()
    [0, 2, 4, 6, 15]
    """
    mag = v.float().abs()
    idx = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, inclusive in _E2M1_STEPS:
        idx += (mag >= mid) if inclusive else (mag > mid)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of each code (uint8 in [0, 15]).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import e2m1_decode
    >>> e2m1_decode(torch.tensor([1, 7, 9], dtype=torch.uint8)).tolist()
    [0.5, 6.0, -0.5]
    """
    # Arithmetic rather than a lookup table: no host-to-device copy, so the
    # reference backend can be captured in a CUDA graph.
    c = codes.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).to(torch.float32)) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[R, K]`` into bytes ``[R, K/2]``: element 2i in the low
    nibble of byte i, element 2i+1 in the high nibble.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import pack_e2m1
    >>> pack_e2m1(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist()
    [[33, 15]]
    """
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: bytes ``[R, K/2]`` -> codes ``[R, K]``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import unpack_e2m1
    >>> unpack_e2m1(torch.tensor([[33, 15]], dtype=torch.uint8)).tolist()
    [[1, 2, 15, 0]]
    """
    return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])


def e4m3_saturating(v: torch.Tensor) -> torch.Tensor:
    """Round float32 to e4m3 (nearest even), saturating at +-448; NaN stays NaN.

    torch's own cast to ``float8_e4m3fn`` turns out-of-range values into NaN,
    so the values are clamped first (``clamp`` propagates NaN).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import e4m3_saturating
    >>> e4m3_saturating(torch.tensor([1e6, 0.3])).float().tolist()
    [448.0, 0.3125]
    """
    return v.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# ----------------------------------------------------------------------------
# Swizzled block-scale layout (cuBLAS / torch._scaled_mm on sm100)
# ----------------------------------------------------------------------------


def swizzled_shape(rows, cols):
    """``(round_up(rows, 128), round_up(cols, 4))``: shape of the swizzled
    layout of a ``[rows, cols]`` scale matrix (``cols`` = K / 16)."""
    return V.round_up(rows, SCALE_ROWS), V.round_up(cols, SCALE_COLS)


def swizzle_output(s: torch.Tensor) -> torch.Tensor:
    """Validate ``swizzle_block_scales``' argument; a zero ``[R', C']`` tensor."""
    if not isinstance(s, torch.Tensor):
        V.fail("swizzle_block_scales", "s", "a Tensor", type(s).__name__)
    V.check_rank("swizzle_block_scales", "s", s, 2)
    return s.new_zeros(swizzled_shape(s.shape[0], s.shape[1]))


def swizzle_block_scales(s: torch.Tensor) -> torch.Tensor:
    """Lay out ``[R, C]`` block scales the way cuBLAS reads them.

    Returns a new contiguous ``[R', C']`` tensor (``R' = round_up(R, 128)``,
    ``C' = round_up(C, 4)``, padding zeros) whose flat element
    ``((r // 128) * (C' / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``
    is ``s[r, c]``.  Plain torch, any device and dtype; traceable.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import swizzle_block_scales
    >>> s = torch.arange(6.0).reshape(2, 3)
    >>> z = swizzle_block_scales(s)
    >>> z.shape, z.flatten()[[0, 1, 2, 16, 17]].tolist()
    (torch.Size([128, 4]), [0.0, 1.0, 2.0, 3.0, 4.0])
    """
    padded = swizzle_output(s)
    r, c = s.shape
    rp, cp = padded.shape
    padded[:r, :c] = s
    # row r = (rb, i, j) with r = rb*128 + i*32 + j; column c = (cb, l) with c = cb*4 + l;
    # memory order of the layout: rb, cb, j, i, l.
    tiles = padded.view(rp // SCALE_ROWS, 4, 32, cp // SCALE_COLS, SCALE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(rp, cp)


def check_swizzled(op: str, arg: str, s: torch.Tensor, rows, cols) -> None:
    """``s`` is an e4m3 contiguous ``swizzled_shape(rows, cols)`` tensor."""
    V.check_dtype(op, arg, s, FP8_DTYPE)
    V.check_shape(op, arg, s, swizzled_shape(rows, cols),
                  f"swizzled: [round_up({rows}, 128), round_up({cols}, 4)]")
    V.check_contiguous(op, arg, s)


def unswizzle_output(s: torch.Tensor, rows, cols) -> torch.Tensor:
    """Validate ``unswizzle_block_scales``' arguments; an empty ``[rows, cols]`` tensor."""
    op = "unswizzle_block_scales"
    if not isinstance(s, torch.Tensor):
        V.fail(op, "s", "a Tensor", type(s).__name__)
    if rows < 0 or cols < 0:
        V.fail(op, "rows", "rows >= 0 and cols >= 0", (rows, cols))
    V.check_rank(op, "s", s, 2)
    V.check_shape(op, "s", s, swizzled_shape(rows, cols),
                  f"[round_up(rows={rows}, 128), round_up(cols={cols}, 4)]")
    V.check_contiguous(op, "s", s)
    return s.new_empty((rows, cols))


def unswizzle_block_scales(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_block_scales`: the logical ``[rows, cols]``
    scales (a new contiguous tensor) of a swizzled ``[R', C']`` tensor.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import swizzle_block_scales, unswizzle_block_scales
    >>> s = torch.rand(5, 3)
    >>> torch.equal(unswizzle_block_scales(swizzle_block_scales(s), 5, 3), s)
    True
    """
    out = unswizzle_output(s, rows, cols)
    rp, cp = s.shape
    tiles = s.view(rp // SCALE_ROWS, cp // SCALE_COLS, 32, 4, SCALE_COLS)
    linear = tiles.permute(0, 3, 2, 1, 4).reshape(rp, cp)
    out.copy_(linear[:rows, :cols])
    return out


# ----------------------------------------------------------------------------
# Shapes and checks (the fake impls call these too)
# ----------------------------------------------------------------------------


def _check_k(op: str, arg: str, k, what: str) -> None:
    if k % BLOCK != 0 or k <= 0:
        V.fail(op, arg, f"{what} to be a positive multiple of {BLOCK}", k)


def check_quant_args(x: torch.Tensor, global_scale: torch.Tensor, swizzle: bool) -> None:
    """Validate ``nvfp4_quant`` arguments."""
    op = "nvfp4_quant"
    V.check_dtype(op, "x", x, V.ACT_DTYPES)
    V.check_rank(op, "x", x, 2)
    V.check_inner_stride(op, "x", x)
    _check_k(op, "x", x.shape[1], "K = x.shape[1]")
    V.check_scalar_like(op, "global_scale", global_scale)
    if not isinstance(swizzle, bool):
        V.fail(op, "swizzle", "a bool", type(swizzle).__name__)
    V.check_same_device(op, x=x, global_scale=global_scale)


def quant_outputs(x: torch.Tensor, global_scale: torch.Tensor, swizzle: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``nvfp4_quant`` arguments and allocate ``(q, s)``: uint8
    ``[M, K/2]`` and e4m3 ``[M, K/16]`` (or its swizzled padded shape)."""
    check_quant_args(x, global_scale, swizzle)
    m, k = x.shape
    q = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    s_shape = swizzled_shape(m, k // BLOCK) if swizzle else (m, k // BLOCK)
    s = torch.empty(s_shape, dtype=FP8_DTYPE, device=x.device)
    return q, s


def _check_weight(op: str, b: torch.Tensor, b_scales: torch.Tensor, k) -> None:
    V.check_dtype(op, "b", b, torch.uint8)
    V.check_rank(op, "b", b, 2)
    V.check_contiguous(op, "b", b)
    V.check_dim(op, "b", b, 1, k // 2, f"K/2 packed bytes for K = {k}")
    check_swizzled(op, "b_scales", b_scales, b.shape[0], k // BLOCK)


def _check_epilogue(op: str, alpha_name: str, alpha: torch.Tensor, out_dtype, bias, n) -> None:
    V.check_scalar_like(op, alpha_name, alpha)
    V.check_out_dtype(op, out_dtype)
    if bias is not None:
        V.check_dtype(op, "bias", bias, V.FLOAT_OUT_DTYPES)
        V.check_shape(op, "bias", bias, (n,), "N = b.shape[0]")
        V.check_inner_stride(op, "bias", bias)


def check_mm_args(op: str, a, b, a_scales, b_scales, alpha, out_dtype, bias) -> None:
    """Validate ``nvfp4_mm``-schema arguments."""
    V.check_dtype(op, "a", a, torch.uint8)
    V.check_rank(op, "a", a, 2)
    V.check_inner_stride(op, "a", a)
    k = 2 * a.shape[1]
    _check_k(op, "a", k, "K = 2 * a.shape[1]")
    _check_weight(op, b, b_scales, k)
    check_swizzled(op, "a_scales", a_scales, a.shape[0], k // BLOCK)
    _check_epilogue(op, "alpha", alpha, out_dtype, bias, b.shape[0])
    V.check_same_device(op, a=a, b=b, a_scales=a_scales, b_scales=b_scales, alpha=alpha, bias=bias)


def check_w4a16_args(op: str, x, b, b_scales, weight_alpha, out_dtype, bias) -> None:
    """Validate ``nvfp4_w4a16_mm``-schema arguments."""
    V.check_dtype(op, "x", x, V.HALF_DTYPES)
    V.check_rank(op, "x", x, 2)
    V.check_inner_stride(op, "x", x)
    k = x.shape[1]
    _check_k(op, "x", k, "K = x.shape[1]")
    _check_weight(op, b, b_scales, k)
    _check_epilogue(op, "weight_alpha", weight_alpha, out_dtype, bias, b.shape[0])
    V.check_same_device(op, x=x, b=b, b_scales=b_scales, weight_alpha=weight_alpha, bias=bias)


def _check_linear_x(op: str, x: torch.Tensor) -> int:
    """The unquantized activation of the linear ops; returns its K."""
    V.check_dtype(op, "x", x, V.ACT_DTYPES)
    V.check_rank(op, "x", x, 2)
    V.check_inner_stride(op, "x", x)
    _check_k(op, "x", x.shape[1], "K = x.shape[1]")
    return x.shape[1]


def check_linear_args(x, b, b_scales, global_scale, alpha, out_dtype, bias) -> None:
    """Validate ``nvfp4_linear``-schema arguments."""
    op = "nvfp4_linear"
    _check_weight(op, b, b_scales, _check_linear_x(op, x))
    V.check_scalar_like(op, "global_scale", global_scale)
    _check_epilogue(op, "alpha", alpha, out_dtype, bias, b.shape[0])
    V.check_same_device(op, x=x, b=b, b_scales=b_scales, global_scale=global_scale, alpha=alpha, bias=bias)


def check_dynamic_linear_args(x, x_amax, b, b_scales, weight_alpha, out_dtype, bias) -> None:
    """Validate ``nvfp4_dynamic_linear``-schema arguments."""
    op = "nvfp4_dynamic_linear"
    k = _check_linear_x(op, x)
    V.check_dtype(op, "x_amax", x_amax, torch.float32)
    V.check_rank(op, "x_amax", x_amax, 1)
    V.check_contiguous(op, "x_amax", x_amax)
    _check_weight(op, b, b_scales, k)
    _check_epilogue(op, "weight_alpha", weight_alpha, out_dtype, bias, b.shape[0])
    V.check_same_device(op, x=x, x_amax=x_amax, b=b, b_scales=b_scales, weight_alpha=weight_alpha, bias=bias)


def mm_output(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``[M, N]`` output of both NVFP4 GEMMs."""
    return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)


def quant_problem(x: torch.Tensor, swizzle: bool) -> Problem:
    return Problem(FAMILY, x.device, x.shape[0], 0, x.shape[1], x.dtype, torch.uint8, x.stride(0),
                   (("swizzle", bool(swizzle)),))


def mm_problem(a: torch.Tensor, b: torch.Tensor, out_dtype, bias) -> Problem:
    return Problem(FAMILY, a.device, a.shape[0], b.shape[0], 2 * a.shape[1], a.dtype, out_dtype,
                   2 * a.stride(0),
                   (("bias", bias is not None), ("w4a16", False), ("aligned16", V.aligned16(a, b))))


def w4a16_problem(x: torch.Tensor, b: torch.Tensor, out_dtype, bias) -> Problem:
    return Problem(FAMILY, x.device, x.shape[0], b.shape[0], x.shape[1], x.dtype, out_dtype,
                   x.stride(0),
                   (("bias", bias is not None), ("w4a16", True), ("aligned16", V.aligned16(x, b))))


def linear_problem(x: torch.Tensor, b: torch.Tensor, out_dtype, bias) -> Problem:
    """The ``nvfp4_linear`` Problem: W4A4 (``w4a16`` False) with the
    activation's own dtype and row stride (not yet packed)."""
    return Problem(FAMILY, x.device, x.shape[0], b.shape[0], x.shape[1], x.dtype, out_dtype, x.stride(0),
                   (("bias", bias is not None), ("w4a16", False), ("aligned16", V.aligned16(x, b))))


# ----------------------------------------------------------------------------
# Reference math (the CPU implementation; also a GPU backend)
# ----------------------------------------------------------------------------


def _quantize_linear(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC's recipe in float32: codes ``[M, K]`` and linear e4m3 scales ``[M, K/16]``.

    Every step is one fp32 operation in the order of the production quantizers
    (vLLM, TensorRT-LLM, FlashInfer), each ``1/v`` an IEEE reciprocal
    (``torch.reciprocal``, also on CUDA), so their codes and scales are ours."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    gs = global_scale.float().reshape(())
    amax = xb.abs().amax(dim=-1)  # NaN propagates
    s = e4m3_saturating(gs * (amax * amax.new_full((), 1.0 / E2M1_MAX)))
    sf = s.float().unsqueeze(-1)
    r = torch.reciprocal(sf * torch.reciprocal(gs))
    mag = e2m1_encode((xb * r).abs().clamp(max=E2M1_MAX))
    codes = torch.where(sf == 0, 0, mag | (torch.signbit(xb).to(torch.uint8) << 3)).to(torch.uint8)
    return codes.reshape(m, k), s


def reference_quant(x: torch.Tensor, global_scale: torch.Tensor, swizzle: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC's recipe, per 16-element block, in float32:
    ``s = e4m3(global_scale * (amax * (1/6)))`` (nearest even, saturating) and
    codes = e2m1 nearest-even of ``x * (1 / (s * (1 / global_scale)))`` clamped
    to +-6, each ``1/v`` an IEEE fp32 reciprocal; codes 0 where ``s == 0``.  A
    code's sign bit is ``x``'s.  Codes are unspecified in a block whose scaled
    values include a NaN (a NaN in ``x``, or ``0 * inf`` at an extreme
    ``global_scale``).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import reference_quant
    >>> x = torch.full((1, 16), 1.734375)
    >>> q, s = reference_quant(x, torch.tensor(581.189208984375), swizzle=False)
    >>> s.float().item(), q[0, 0].item()   # 581.19 * (1.734375 * (1/6)) == 168: a tie, to even
    (160.0, 119)
    """
    q, s = quant_outputs(x, global_scale, swizzle)
    codes, s_lin = _quantize_linear(x, global_scale)
    q.copy_(pack_e2m1(codes))
    s.copy_(swizzle_block_scales(s_lin) if swizzle else s_lin)
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor, global_scale: torch.Tensor | None = None,
               *, swizzled: bool = True) -> torch.Tensor:
    """float32 ``[R, K]`` values of packed codes ``q`` ``[R, K/2]`` with block
    scales ``s`` (swizzled padded layout, or linear ``[R, K/16]`` when
    ``swizzled=False``), divided by ``global_scale`` when given.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import dequantize
    >>> x = torch.tensor([[1.0, -2.0] * 8])
    >>> gs = torch.tensor(448 * 6 / 2.0)
    >>> q, s = torch.ops.scaledmm.nvfp4_quant(x, gs)
    >>> dequantize(q, s, gs)[0, :4].tolist()
    [1.0, -2.0, 1.0, -2.0]
    """
    rows, k = q.shape[0], 2 * q.shape[1]
    if swizzled:
        s = unswizzle_block_scales(s, rows, k // BLOCK)
    out = e2m1_decode(unpack_e2m1(q)) * s.float().repeat_interleave(BLOCK, dim=1)
    if global_scale is not None:
        out = out / global_scale.float().reshape(())
    return out


def _epilogue(acc: torch.Tensor, alpha: torch.Tensor, out_dtype, bias) -> torch.Tensor:
    """``alpha * acc (+ bias)`` in float32, then one rounding to ``out_dtype``."""
    acc = acc * alpha.float().reshape(())
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def reference_mm(a, b, a_scales, b_scales, alpha, out_dtype=torch.bfloat16, bias=None):
    """``alpha * (deq(a) @ deq(b).T) (+ bias)``: operands decoded exactly in
    float32, float32 matmul and epilogue."""
    acc = dequantize(a, a_scales) @ dequantize(b, b_scales).t()
    return _epilogue(acc, alpha, out_dtype, bias)


def reference_w4a16_mm(x, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    """``x @ (weight_alpha * deq(b)).T (+ bias)`` in float32."""
    acc = x.float() @ dequantize(b, b_scales).t()
    return _epilogue(acc, weight_alpha, out_dtype, bias)


def reference_linear(x, b, b_scales, global_scale, alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_linear`` by definition: :func:`reference_quant` of ``x`` with
    ``global_scale``, then :func:`reference_mm` with ``alpha``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import reference_linear, reference_quant
    >>> gs = torch.tensor(448 * 6.0)  # amax 1: every 1.0 is exact
    >>> qb, sb = reference_quant(torch.ones(8, 32), gs)
    >>> reference_linear(torch.ones(2, 32), qb, sb, gs, 1 / (gs * gs))[0, :2].tolist()
    [32.0, 32.0]
    """
    q, s = reference_quant(x, global_scale, True)
    return reference_mm(q, b, s, b_scales, alpha, out_dtype, bias)


def composite_linear(x, b, b_scales, global_scale, alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_linear`` as its two ops, ``nvfp4_quant`` and ``nvfp4_mm``,
    each selected as if called alone.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import composite_linear, reference_quant
    >>> one = torch.tensor(1.0)
    >>> qb, sb = reference_quant(torch.ones(8, 32), one)
    >>> composite_linear(torch.ones(2, 32), qb, sb, one, one).shape
    torch.Size([2, 8])
    """
    q, s = torch.ops.scaledmm.nvfp4_quant(x, global_scale, True)
    return torch.ops.scaledmm.nvfp4_mm(q, b, s, b_scales, alpha, out_dtype, bias)


def dynamic_scales(x_amax: torch.Tensor, weight_alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(global_scale, alpha)`` of ``nvfp4_dynamic_linear``, float32 ``[1]``:
    ``amax = max(max(x_amax), AMAX_FLOOR)`` (a NaN in ``x_amax`` propagates;
    empty ``x_amax``: the floor), ``global_scale = RANGE / amax``, ``alpha =
    weight_alpha / global_scale``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import dynamic_scales
    >>> gs, alpha = dynamic_scales(torch.tensor([1.0, 4.0]), torch.tensor(2.0))
    >>> gs.item(), alpha.item()
    (672.0, 0.0029761905316263437)
    """
    amax = x_amax.new_full((1,), AMAX_FLOOR)
    if x_amax.numel():
        amax = torch.maximum(x_amax.amax().reshape(1), amax)
    gs = amax.new_full((1,), RANGE) / amax
    return gs, weight_alpha.float().reshape(1) / gs


def reference_dynamic_linear(x, x_amax, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_dynamic_linear`` by definition: :func:`dynamic_scales`, then
    :func:`reference_linear` with them.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import reference_dynamic_linear, reference_quant, RANGE
    >>> qb, sb = reference_quant(torch.ones(8, 32), torch.tensor(RANGE))   # weight amax 1
    >>> x = torch.ones(2, 32)
    >>> reference_dynamic_linear(x, x.amax(dim=1), qb, sb, torch.tensor(1 / RANGE))[0, :2].tolist()
    [32.0, 32.0]
    """
    gs, alpha = dynamic_scales(x_amax, weight_alpha)
    return reference_linear(x, b, b_scales, gs, alpha, out_dtype, bias)


def composite_dynamic_linear(x, x_amax, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_dynamic_linear`` as :func:`dynamic_scales` (torch ops) and
    ``nvfp4_linear`` (selected as if called alone).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4 import composite_dynamic_linear, reference_quant
    >>> qb, sb = reference_quant(torch.ones(8, 32), torch.tensor(1.0))
    >>> x = torch.ones(2, 32)
    >>> composite_dynamic_linear(x, x.amax(dim=1), qb, sb, torch.tensor(1.0)).shape
    torch.Size([2, 8])
    """
    gs, alpha = dynamic_scales(x_amax, weight_alpha)
    return torch.ops.scaledmm.nvfp4_linear(x, b, b_scales, gs, alpha, out_dtype, bias)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _quant_impl(x, global_scale, swizzle=True):
    check_quant_args(x, global_scale, swizzle)
    return run(quant_problem(x, swizzle), "nvfp4_quant", x, global_scale, swizzle)


def _mm_impl(a, b, a_scales, b_scales, alpha, out_dtype=torch.bfloat16, bias=None):
    check_mm_args("nvfp4_mm", a, b, a_scales, b_scales, alpha, out_dtype, bias)
    return run(mm_problem(a, b, out_dtype, bias), "nvfp4_mm",
               a, b, a_scales, b_scales, alpha, out_dtype, bias)


def _w4a16_impl(x, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    check_w4a16_args("nvfp4_w4a16_mm", x, b, b_scales, weight_alpha, out_dtype, bias)
    return run(w4a16_problem(x, b, out_dtype, bias), "nvfp4_w4a16_mm",
               x, b, b_scales, weight_alpha, out_dtype, bias)


def _linear_impl(x, b, b_scales, global_scale, alpha, out_dtype=torch.bfloat16, bias=None):
    check_linear_args(x, b, b_scales, global_scale, alpha, out_dtype, bias)
    return run(linear_problem(x, b, out_dtype, bias), "nvfp4_linear",
               x, b, b_scales, global_scale, alpha, out_dtype, bias)


def _dynamic_linear_impl(x, x_amax, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    check_dynamic_linear_args(x, x_amax, b, b_scales, weight_alpha, out_dtype, bias)
    return run(linear_problem(x, b, out_dtype, bias), "nvfp4_dynamic_linear",
               x, x_amax, b, b_scales, weight_alpha, out_dtype, bias)


def _swizzle_impl(s):
    return swizzle_block_scales(s)


def _unswizzle_impl(s, rows, cols):
    return unswizzle_block_scales(s, rows, cols)


nvfp4_quant = define(
    "nvfp4_quant",
    "(Tensor x, Tensor global_scale, bool swizzle=True) -> (Tensor q, Tensor s)",
    _quant_impl,
)
nvfp4_mm = define(
    "nvfp4_mm",
    "(Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, Tensor alpha, ScalarType out_dtype=15, "
    "Tensor? bias=None) -> Tensor",
    _mm_impl,
)
nvfp4_w4a16_mm = define(
    "nvfp4_w4a16_mm",
    "(Tensor x, Tensor b, Tensor b_scales, Tensor weight_alpha, ScalarType out_dtype=15, "
    "Tensor? bias=None) -> Tensor",
    _w4a16_impl,
)
nvfp4_linear = define(
    "nvfp4_linear",
    "(Tensor x, Tensor b, Tensor b_scales, Tensor global_scale, Tensor alpha, ScalarType out_dtype=15, "
    "Tensor? bias=None) -> Tensor",
    _linear_impl,
)
nvfp4_dynamic_linear = define(
    "nvfp4_dynamic_linear",
    "(Tensor x, Tensor x_amax, Tensor b, Tensor b_scales, Tensor weight_alpha, ScalarType out_dtype=15, "
    "Tensor? bias=None) -> Tensor",
    _dynamic_linear_impl,
)
# Layout ops: plain torch on any device, no backend registry.  rows/cols are
# SymInts so a dynamic M stays symbolic under torch.compile.
swizzle_block_scales_op = define("swizzle_block_scales", "(Tensor s) -> Tensor", _swizzle_impl)
unswizzle_block_scales_op = define(
    "unswizzle_block_scales", "(Tensor s, SymInt rows, SymInt cols) -> Tensor", _unswizzle_impl)


def _reference_mm_backend(a, b, a_scales, b_scales, alpha, out_dtype, bias):
    return reference_mm(a, b, a_scales, b_scales, alpha, out_dtype, bias)


def _reference_w4a16_backend(x, b, b_scales, weight_alpha, out_dtype, bias):
    return reference_w4a16_mm(x, b, b_scales, weight_alpha, out_dtype, bias)


backends.register(Backend(
    FAMILY, "reference",
    impls={
        "nvfp4_quant": reference_quant,
        "nvfp4_mm": _reference_mm_backend,
        "nvfp4_w4a16_mm": _reference_w4a16_backend,
        "nvfp4_linear": reference_linear,
        "nvfp4_dynamic_linear": reference_dynamic_linear,
    },
    description="plain torch math (decode to float32, float32 matmul); any device",
))
backends.register(Backend(
    FAMILY, "composite",
    impls={"nvfp4_linear": composite_linear, "nvfp4_dynamic_linear": composite_dynamic_linear},
    description="nvfp4_linear as nvfp4_quant + nvfp4_mm, each selected as if called alone; "
                "nvfp4_dynamic_linear as its scales (torch ops) + nvfp4_linear",
))
