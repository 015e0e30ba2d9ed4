"""Per-token-group FP8 quantization in Triton: the ``per_token_group_quant_fp8``
op of backend ``triton`` (family ``fp8_block``; registered by
``ops/fp8_block_triton.py``), and the quantization device functions the fused
GEMM of that module shares.

* ``quant_kernel``: ``per_token_group_quant_fp8``, bit-identical to
  ``ops.fp8_block.reference_quant`` (true division, round to nearest even);
  any row stride; row-, column-major or TMA-aligned scales; ue8m0 option.
* ``_quant_rows`` (with ``e4m3_soft``, ``_pow2_ceil``): one group per tile
  row; also ``QUANT_A`` of ``fp8_block_triton.mm_kernel``
  (``fp8_block_linear`` quantizing in registers).
* ``_fp8_mode``, ``_capability``, ``_INTERPRET``, ``bytes_view``,
  ``_device_guard``: how fp8 is encoded and launched on a device, shared with
  the GEMM launchers.

This module also patches Triton's interpreter under ``TRITON_INTERPRET=1``;
``ops/fp8_block_triton.py`` imports it before it defines its kernels, so the
patch is in place before any kernel of either module runs.
Read top to bottom: interpreter patch, capability checks, kernels, launcher.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from scaledmm import validation as V
from scaledmm.device import capability, interpreting, sm_count, triton_pdl
from scaledmm.oplib import FP8_DTYPE

from . import fp8_block as base

__all__ = ["per_token_group_quant"]


# Triton picks interpreter or compiler when a kernel is decorated, i.e. when
# this module is imported: remember which one these kernels got.
_INTERPRET = interpreting()


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns its 1-element scalar arrays into loop
    bounds with ``int(array)``, which NumPy >= 2.4 refuses (any ``range`` over
    runtime values fails).  Interpreter mode only; a no-op on older NumPy."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.array([1]))
    except TypeError:
        orig = interpreter._patch_lang_tensor

        def patched(tensor, scope):
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patched


if _INTERPRET:
    _fix_interpreter_index()

# ----------------------------------------------------------------------------
# Capability checks
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return capability(device)


def _device_gate(device: torch.device) -> tuple[bool, str] | None:
    """The part of ``is_supported`` every Triton fp8 module shares: a verdict
    for the CPU (interpreter or not), non-NVIDIA devices, interpreter-built
    kernels and pre-sm80 GPUs; None for an NVIDIA sm80+ GPU, whose reason each
    module words itself."""
    if device.type == "cpu":
        if _INTERPRET:
            return True, "Triton interpreter (TRITON_INTERPRET=1 at import)"
        return False, "CPU runs only under TRITON_INTERPRET=1 set before triton is imported"
    if device.type != "cuda" or torch.version.hip:
        return False, f"needs an NVIDIA GPU, got {device}"
    if _INTERPRET:
        return False, "kernels were built for the interpreter (TRITON_INTERPRET=1)"
    major, minor = _capability(device)
    if major < 8:
        return False, f"needs sm80+, device is sm{major}{minor}"
    return None


def _fp8_mode(device: torch.device) -> tuple[bool, bool]:
    """(soft_cvt, widen).  soft_cvt: encode fp32 -> e4m3 in integer code, where
    Triton's cast is not round-to-nearest-even (the interpreter; sm89, which
    goes through an fp16 rounded toward zero) or missing (sm80).  widen: no e4m3
    type at all (sm80): operands travel as bytes, the dot runs in fp16."""
    if _INTERPRET:
        return True, False
    cap = _capability(device)
    return cap < (9, 0), cap < (8, 9)


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def e4m3_soft(v):
    """fp32 in [-448, 448] (or NaN) -> e4m3 bits, round to nearest even, as uint8."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23).to(tl.int32) - 127
    mant = mag & 0x7FFFFF
    # normal e4m3 (|v| >= 2**-6): keep 3 mantissa bits, carry may bump the exponent
    base = ((exp + 7) << 3) | (mant >> 20).to(tl.int32)
    rest = mant & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((base & 1) == 1))
    normal = base + up.to(tl.int32)
    # subnormal: multiples of 2**-9, rounded to nearest even by the 2**23 trick
    scaled = tl.abs(v) * 512.0
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(exp >= -6, normal, sub)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _pow2_ceil(s, INTERPRET: tl.constexpr):
    """2 ** ceil(log2(s)) as the reference computes it (log2 in fp32)."""
    if INTERPRET:
        lg = tl.log2(s)
    else:
        lg = tl.extra.cuda.libdevice.log2(s)
    finite = (s == s) & (s < float("inf"))
    e = tl.where(finite, tl.ceil(lg), 0.0)
    e = tl.minimum(tl.maximum(e, -126.0), 127.0).to(tl.int32)
    p = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(finite, p, s)


@triton.jit
def _quant_rows(x, eps, UE8M0: tl.constexpr, SOFT_CVT: tl.constexpr, WIDEN: tl.constexpr,
                INTERPRET: tl.constexpr):
    """Quantize each row of an fp32 tile as one group (padding lanes must be 0).

    Returns (codes, scales): codes are e4m3 (uint8 bits when WIDEN)."""
    ax = tl.abs(x)
    amax = tl.max(ax, 1)  # (NaN-blind on the GPU: add the NaN back explicitly)
    amax = tl.where(tl.max((ax != ax).to(tl.int32), 1) > 0, float("nan"), amax)
    s = tl.math.div_rn(tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL), 448.0)
    if UE8M0:
        s = _pow2_ceil(s, INTERPRET)
    return to_e4m3(x, s[:, None], SOFT_CVT, WIDEN, False), s


@triton.jit
def to_e4m3(x, s, SOFT_CVT: tl.constexpr, WIDEN: tl.constexpr, RECIPROCAL: tl.constexpr):
    """e4m3(clamp(v, -448, 448)), v in SPEC's order for each op: ``x / s``
    (true fp32 division; ``per_token_group_quant_fp8``) or, with RECIPROCAL,
    ``x * (1 / s)`` (an IEEE fp32 reciprocal; ``quant_fp8``).  NaN stays NaN.
    Codes are e4m3 (uint8 bits when WIDEN)."""
    if RECIPROCAL:
        v = x * tl.math.div_rn(1.0, s)
    else:
        v = tl.math.div_rn(x, s)
    y = tl.clamp(v, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if SOFT_CVT:
        q = e4m3_soft(y)
        if not WIDEN:
            q = q.to(tl.float8e4nv, bitcast=True)
    else:
        q = y.to(tl.float8e4nv)
    return q


@triton.jit(do_not_specialize=["M", "stride_sm", "stride_sg"])
def quant_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, stride_sm, stride_sg, eps,
                  GROUP: tl.constexpr, GP: tl.constexpr, NUM_GROUPS: tl.constexpr, ROWS: tl.constexpr,
                  TOKEN_MINOR: tl.constexpr, UE8M0: tl.constexpr, SOFT_CVT: tl.constexpr, WIDEN: tl.constexpr,
                  INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # scaledmm.device.pdl
        gdc_wait()
        gdc_launch_dependents()
    # One tile row = one (token, group) pair of the flattened M x NUM_GROUPS
    # grid of groups, so a program has ROWS groups whatever M is: M = 1 still
    # spreads K / GROUP groups over many programs, large M gets wide tiles.
    # TOKEN_MINOR: consecutive tile rows are consecutive tokens of one group
    # (column-major scales then store contiguously).  Measured slower on the
    # H200 (4096 x 7168, column-major scales: 31.6 us against 27.8 us for the
    # group-minor walk, which reads each token's row in order), so off by default.
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tmask = t < M * NUM_GROUPS
    if TOKEN_MINOR:
        row = (t % M).to(tl.int64)
        g = t // M
    else:
        row = (t // NUM_GROUPS).to(tl.int64)
        g = t % NUM_GROUPS
    cols = tl.arange(0, GP)
    mask = tmask[:, None] & (cols < GROUP)[None, :]
    k = (g * GROUP)[:, None] + cols[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_xm + k, mask=mask, other=0.0)
    q, s = _quant_rows(x.to(tl.float32), eps, UE8M0, SOFT_CVT, WIDEN, INTERPRET)
    tl.store(q_ptr + row[:, None] * stride_qm + k, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, s, mask=tmask)


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


# Groups per program at most (8 x 128 bf16 = 2 KiB per program),
# and the programs to aim for before tiles grow: 4 per SM.
MAX_TILE_GROUPS = 8  # H200, M=4096 K=7168: 8 groups / 2 warps 28.0 us, 32 / 8 30.6 us
PROGRAMS_PER_SM = 4


def quant_tile(num_groups: int, gp: int, device: torch.device) -> tuple[int, int]:
    """``(groups per program, num_warps)`` for ``num_groups`` groups of ``gp``
    (padded) elements: tiles grow up to ``MAX_TILE_GROUPS`` only once there
    are ``PROGRAMS_PER_SM`` programs per SM, so small M keeps every SM busy
    and large M moves wide tiles; about 16 elements per thread."""
    sms = _num_sms(device)
    rows = _next_pow2(max(1, num_groups // (PROGRAMS_PER_SM * sms)))
    rows = max(1, min(rows, MAX_TILE_GROUPS, max(1, 4096 // gp)))
    warps = max(1, min(8, rows * gp // 512))
    return rows, warps


def _num_sms(device: torch.device) -> int:
    """SM count (4 for interpreter runs on the CPU: small grids, several tiles)."""
    return sm_count(device, cpu=4)


def _device_guard(device: torch.device):
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def bytes_view(t: torch.Tensor, widen: bool) -> torch.Tensor:
    """fp8 tensors travel as bytes where Triton has no e4m3 type (sm80)."""
    return t.view(torch.uint8) if widen and t.dtype == FP8_DTYPE else t


def per_token_group_quant(x: torch.Tensor, group_size: int = 128, eps: float = 1e-10,
                          column_major_scales: bool = False, scale_ue8m0: bool = False,
                          tma_aligned: bool = False, block_rows: int | None = None,
                          num_warps: int | None = None, token_minor: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (bf16/fp16/fp32 ``[M, K]``, any row stride) per 1 x
    ``group_size`` group to e4m3 codes ``[M, K]`` and fp32 scales ``[M, K /
    group_size]``: the op ``per_token_group_quant_fp8``, plus ``tma_aligned``
    (with ``column_major_scales``: scale strides ``(1, round_up(M, 4))``) and
    the tuning knobs ``block_rows`` (groups per program, a power of two),
    ``num_warps`` (default: :func:`quant_tile`) and ``token_minor`` (walk
    tokens fastest; measured slower, see the kernel).

    Examples
    --------
    >>> import torch  # doctest: +SKIP
    >>> q, s = per_token_group_quant(torch.randn(3, 256, device="cuda"), 128)  # doctest: +SKIP
    >>> tuple(s.shape)  # doctest: +SKIP
    (3, 2)
    """
    q, s = base.quant_outputs(x, group_size, eps, column_major_scales, scale_ue8m0, row_capacity=True)
    m, k = x.shape
    g = k // group_size
    if tma_aligned and column_major_scales:
        s = torch.empty((g, V.round_up(m, 4)), dtype=torch.float32, device=x.device)[:, :m].t()
    if m == 0 or g == 0:
        return q, s
    soft, widen = _fp8_mode(x.device)
    gp = _next_pow2(group_size)
    rows, warps = quant_tile(m * g, gp, x.device) if block_rows is None else (block_rows, num_warps or 4)
    grid = (triton.cdiv(m * g, rows),)
    with _device_guard(x.device):
        quant_kernel[grid](
            x, bytes_view(q, widen), s, m, x.stride(0), q.stride(0), s.stride(0), s.stride(1), float(eps),
            GROUP=group_size, GP=gp, NUM_GROUPS=g, ROWS=rows,
            TOKEN_MINOR=bool(token_minor), UE8M0=bool(scale_ue8m0), SOFT_CVT=soft, WIDEN=widen,
            INTERPRET=_INTERPRET, num_warps=num_warps or warps, **triton_pdl(x.device))
    return q, s
