"""The e2m1 / e4m3 decoders of the NVFP4 Triton kernels, and the passes that
decode NVFP4 (or reorder a 16-bit activation) into memory for the other
backends.

Read top to bottom:

1. the e2m1 decoders the GEMM kernel (``ops/nvfp4_triton.py``) runs on its
   register tiles: plain Triton (runs in the interpreter) and inline PTX (GPU
   only, about 2.5 instructions per element), and :func:`_load_fp4_tile`,
   which loads a packed tile with its swizzled scales and decodes it;
2. decode to memory: :func:`dequant` (exact ``e2m1 * s`` in fp16 / bf16 /
   fp32, or times a factor with one rounding: the predecode paths of
   ``triton`` and ``decode_cublas``, the W4A4 activation of ``cuda_wgmma``)
   and :func:`permute_k16`, both able to write K in the order the
   ``cuda_wgmma`` kernel's weight decode meets it
   (:func:`scaledmm.ops.nvfp4_wgmma.permute_k`).

Examples
--------
>>> from scaledmm.ops import nvfp4_triton_decode as nd
>>> nd.DECODERS
('triton', 'ptx', 'ptx_direct')
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scaledmm.ops.nvfp4_triton_quant import _hw_e4m3

# ----------------------------------------------------------------------------
# 1. e2m1 decoders
# ----------------------------------------------------------------------------
#
# Both take packed bytes ``[R, C]`` and the block scales broadcast over their
# 8 bytes (``[R, C]``); :func:`_load_fp4_tile` turns their results into the
# decoded ``[R, 2C]`` tile in K order.
#
# Trick shared by both: the fp16 bit pattern ``sign << 15 | mag << 9`` of a
# code (mag = its 3-bit magnitude index) is exactly ``e2m1(code) * 2**-14``:
# the exponent field holds e2m1's exponent and the top mantissa bit its
# mantissa, and e2m1's subnormal 0.5 lands on fp16's subnormal 2**-15.


@triton.jit
def _decode_triton(packed, scale, DTYPE: tl.constexpr):
    """Plain Triton: ``scale`` is fp32 ``s * 2**14``; returns exact ``e2m1 * s``."""
    b = packed.to(tl.uint16)
    lo = ((b & 0x8) << 12) | ((b & 0x7) << 9)
    hi = ((b & 0x80) << 8) | ((b & 0x70) << 5)
    lo = lo.to(tl.float16, bitcast=True).to(tl.float32) * scale
    hi = hi.to(tl.float16, bitcast=True).to(tl.float32) * scale
    return lo.to(DTYPE), hi.to(DTYPE)


# Inline PTX, elementwise over bytes: int32 output j is the fp16 pair
# [hi(b_j) * s_j : lo(b_j) * s_j] * 2**-14 (K order: one register of a 16-bit
# MMA operand).  $4 = 4 packed bytes, $5..$8 = per-byte [s_j : s_j].  prmt
# places the nibbles, shr + lop3 (mask 0x8E008E00) form the fp16 patterns
# above, mul.rn.f16x2 scales: exact, since e2m1 * s * 2**-14 is a multiple of
# 2**-24 below 0.17 with <= 6 significant bits (no .ftz); the epilogue undoes
# the 2**-14.
_PTX_BYTE = """
    prmt.b32 y, wl, wh, {sel};
    shr.b32 t, y, 3;
    lop3.b32 r, t, y, 0x8E008E00, 0xA8;
    mul.rn.f16x2 ${j}, r, ${s};"""

# bf16: the exact fp16 pair goes through fp32 (cvt.f32.f16 is exact, fp16
# subnormals included) into a bf16 pair, still exact (6 significant bits).
_PTX_TO_BF16 = """
    mov.b32 {{h0, h1}}, ${j};
    cvt.f32.f16 f0, h0;
    cvt.f32.f16 f1, h1;
    cvt.rn.bf16x2.f32 ${j}, f1, f0;"""


# bf16 "direct" (config decode="ptx_direct"): the bf16 pattern sign << 15 |
# mag << 6 is e2m1 * 2**-126 (0.5 becomes the bf16 subnormal 2**-127), and one
# fma.rn.bf16x2 by s * 2**119 gives e2m1 * s * 2**-7, exact and normal.  One
# instruction more per byte than the fp16 path but no conversions; it relies
# on bf16 FMA keeping subnormal inputs, which the GPU tests check.
_PTX_BYTE_BF16 = """
    prmt.b32 y, wl, wh, {sel};
    shr.b32 t, y, 6;
    and.b32 t, t, 0x01C001C0;
    lop3.b32 r, t, y, 0x80008000, 0xF8;
    fma.rn.bf16x2 ${j}, r, ${s}, nz;"""


def _ptx_decoder(kind: str) -> str:
    body = ["{", ".reg .b32 wh, wl, y, t, r, nz;", ".reg .b16 h0, h1;", ".reg .f32 f0, f1;",
            "mov.b32 nz, 0x80008000;",
            "and.b32 wh, $4, 0xF0F0F0F0;", "shl.b32 wl, $4, 4;", "and.b32 wl, wl, 0xF0F0F0F0;"]
    byte = _PTX_BYTE_BF16 if kind == "bf16_direct" else _PTX_BYTE
    for j in range(4):
        body.append(byte.format(sel=hex(((4 + j) << 12) | (j << 8) | (j << 4) | j), j=j, s=5 + j))
    if kind == "bf16":
        body += [_PTX_TO_BF16.format(j=j) for j in range(4)]
    return "\n".join(body + ["}"])


PTX_F16 = tl.constexpr(_ptx_decoder("f16"))
PTX_BF16 = tl.constexpr(_ptx_decoder("bf16"))
PTX_BF16_DIRECT = tl.constexpr(_ptx_decoder("bf16_direct"))

# Decoder selection (constexpr DECODE of the kernels) and the power of two
# each one leaves on a decoded value (undone in the epilogue).
DECODERS = ("triton", "ptx", "ptx_direct")


def decode_fold(decode: str, dtype: torch.dtype) -> float:
    """Factor that undoes the decoder's scaling of one operand."""
    if decode == "triton":
        return 1.0
    if decode == "ptx_direct" and dtype == torch.bfloat16:
        return 2.0 ** 7
    return 2.0 ** 14


@triton.jit
def _decode_ptx(packed, scale2, DTYPE: tl.constexpr, DIRECT: tl.constexpr):
    """Inline PTX: ``scale2`` is the int32 pair ``[s : s]`` (fp16 ``s``, or bf16
    ``s * 2**119`` for the direct bf16 decoder); returns the decoded values
    (exact, times ``2**-14`` or ``2**-7``) in K order, ``[R, 2C]``.

    ``is_pure=False`` keeps Triton from hoisting the dot-operand layout
    conversion above the decoder (it would then gather single bytes)."""
    if DTYPE == tl.bfloat16:
        if DIRECT:
            pair = tl.inline_asm_elementwise(PTX_BF16_DIRECT, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale2],
                                             dtype=tl.int32, is_pure=False, pack=4)
        else:
            pair = tl.inline_asm_elementwise(PTX_BF16, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale2],
                                             dtype=tl.int32, is_pure=False, pack=4)
    else:
        pair = tl.inline_asm_elementwise(PTX_F16, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale2],
                                         dtype=tl.int32, is_pure=False, pack=4)
    lo = (pair & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    return tl.interleave(lo, hi)


@triton.jit
def _e4m3_to_f32(b, HW_FP8: tl.constexpr):
    """fp32 value of e4m3 bytes: the hardware conversion on sm89+, else the
    fp16 pattern ``(b & 0x7F) << 7`` (exponent and mantissa in place, the
    subnormals included) times 2**8; 0x7F/0xFF are NaN."""
    if HW_FP8:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    h = ((b.to(tl.int16) & 0x7F) << 7).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    h = tl.where((b & 0x80) != 0, -h, h)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), h)


@triton.jit
def _load_fp4_tile(q_ptr, s_ptr, rows, R, row_stride, row_bytes, s_c4, kt,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   DECODE: tl.constexpr, DTYPE: tl.constexpr, HW_FP8: tl.constexpr):
    """Decoded ``[BLOCK_R, BLOCK_K]`` tile (K-tile ``kt``) of a packed operand
    (``row_bytes = K / 2`` bytes per row, rows ``row_stride`` bytes apart) with
    swizzled scales; rows >= R and columns >= K read as zeros."""
    KB: tl.constexpr = BLOCK_K // 2
    KG: tl.constexpr = BLOCK_K // 16
    cb = kt * KB + tl.arange(0, KB)
    rmask = rows < R
    if EVEN_K:
        bmask = rmask[:, None]
    else:
        bmask = rmask[:, None] & (cb < row_bytes)[None, :]
    packed = tl.load(q_ptr + rows[:, None].to(tl.int64) * row_stride + cb[None, :], mask=bmask, other=0)
    # scale columns kt*KG .. kt*KG + KG - 1, as KG/4 runs of 4 contiguous bytes
    g = tl.arange(0, KG // 4)
    j = tl.arange(0, 4)
    row_off = (rows // 128) * (s_c4 * 512) + (rows % 32) * 16 + ((rows % 128) // 32) * 4
    col_off = (kt * (KG // 4) + g) * 512
    s_ptrs = s_ptr + row_off[:, None, None] + col_off[None, :, None] + j[None, None, :]
    smask = rmask[:, None, None]
    if not EVEN_K:
        smask = smask & (((kt * (KG // 4) + g) * 4)[None, :, None] + j[None, None, :] < row_bytes // 8)
    sc = _e4m3_to_f32(tl.reshape(tl.load(s_ptrs, mask=smask, other=0), (BLOCK_R, KG)), HW_FP8)
    if DECODE > 0:
        # [s : s] as one int32 per block, broadcast to its 8 bytes for free
        if DECODE == 2 and DTYPE == tl.bfloat16:
            s16 = (sc * 6.646139978924579e35).to(tl.bfloat16)  # s * 2**119, exact
        else:
            s16 = sc.to(tl.float16)  # exact
        s16 = s16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        s2 = tl.reshape(tl.broadcast_to((s16 | (s16 << 16))[:, :, None], (BLOCK_R, KG, 8)), (BLOCK_R, KB))
        return _decode_ptx(packed, s2, DTYPE, DECODE == 2)
    sc = sc * 16384.0
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_R, KG, 8)), (BLOCK_R, KB))
    lo, hi = _decode_triton(packed, sc, DTYPE)
    return tl.interleave(lo, hi)

# ----------------------------------------------------------------------------
# 2. Decode to memory
# ----------------------------------------------------------------------------


@triton.jit
def _permute64(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Column 16 t + 8 h + 4 e + j of every 64 of a [BLOCK_M, BLOCK_K] tile
    moved to 16 j + 8 h + 2 t + e (``nvfp4_wgmma.permute_k``), in registers,
    so the stores stay contiguous (scattered 2-byte stores cost W4A4 up to
    2x the kernel's time)."""
    x = tl.reshape(x, (BLOCK_M, BLOCK_K // 64, 4, 2, 2, 4))  # (t, h, e, j) of each 64
    return tl.reshape(tl.permute(x, (0, 1, 5, 3, 2, 4)), (BLOCK_M, BLOCK_K))  # (j, h, t, e)


@triton.jit(do_not_specialize=["M"])
def _permute_k_kernel(x_ptr, out_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (rk < K)[None, :]  # whole 64s: K % 64 == 0
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=mask)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + rk[None, :], _permute64(x, BLOCK_M, BLOCK_K), mask=mask)


def permute_k16(x: torch.Tensor) -> torch.Tensor:
    """A 16-bit [M, K] activation (K % 64 == 0, unit column stride) in
    ``nvfp4_wgmma.permute_k``'s K order, one Triton pass (a fresh tensor)."""
    m, k = x.shape
    if k % 64 or x.stride(1) != 1:
        raise ValueError(f"x: expected K % 64 == 0 and unit column stride, got shape {tuple(x.shape)}, "
                         f"strides {tuple(x.stride())}")
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m:
        bm, bk = 16, 256
        _permute_k_kernel[(triton.cdiv(m, bm), triton.cdiv(k, bk))](x, out, m, k, x.stride(0),
                                                                   BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
    return out


@triton.jit(do_not_specialize=["M"])
def _dequant_kernel(q_ptr, s_ptr, out_ptr, factor_ptr, M, K, stride_qm, s_c4,
                    HAS_FACTOR: tl.constexpr, HW_FP8: tl.constexpr, PERMUTE_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[factor *] deq(q)`` in ``out_ptr``'s dtype (the predecode paths):
    exact fp32 decode, one multiply, one rounding.  PERMUTE_K: column
    ``16 t + 8 h + 4 e + j`` of every 64 is stored at ``16 j + 8 h + 2 t + e``
    (``nvfp4_wgmma.permute_k``'s order)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kt = tl.program_id(1)
    x = _load_fp4_tile(q_ptr, s_ptr, rows, M, stride_qm, K // 2, s_c4, kt, BLOCK_M, BLOCK_K, False,
                       0, tl.float32, HW_FP8)
    if HAS_FACTOR:
        x = x * tl.load(factor_ptr).to(tl.float32)
    x = x.to(out_ptr.dtype.element_ty)
    if PERMUTE_K:
        x = _permute64(x, BLOCK_M, BLOCK_K)
    rk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + rk[None, :], x,
             mask=(rows < M)[:, None] & (rk < K)[None, :])


def dequant(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float16,
            factor: torch.Tensor | None = None, permute_k: bool = False) -> torch.Tensor:
    """``[R, K]`` values ``factor * e2m1 * s`` in ``dtype`` (one rounding; exact
    without ``factor`` for fp16/bf16/fp32) of packed ``q`` with swizzled ``s``;
    with ``permute_k`` (K % 64 == 0) in the K order of
    :func:`scaledmm.ops.nvfp4_wgmma.permute_k`."""
    rows, k = q.shape[0], 2 * q.shape[1]
    if permute_k and k % 64:
        raise ValueError(f"permute_k: expected K % 64 == 0, got K = {k}")
    out = torch.empty((rows, k), dtype=dtype, device=q.device)
    if rows == 0:
        return out
    bm, bk = 32, 256
    _dequant_kernel[(triton.cdiv(rows, bm), triton.cdiv(k, bk))](
        q, s.view(torch.uint8), out, factor if factor is not None else out, rows, k, q.stride(0),
        s.shape[1] // 4, HAS_FACTOR=factor is not None, HW_FP8=_hw_e4m3(q.device), PERMUTE_K=permute_k,
        BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
    return out


def dequant_fp16(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp16 ``[R, K]`` values ``e2m1 * s`` (exact) of packed ``q`` with swizzled ``s``."""
    return dequant(q, s, torch.float16)
