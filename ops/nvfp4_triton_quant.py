"""NVFP4 quantizer Triton kernel: ``nvfp4_quant`` of backend ``triton`` of the
``nvfp4`` family (SPEC.md "NVFP4"), bit-identical to SPEC's rule.

``x -> (packed e2m1 codes, e4m3 block scales)`` in one launch, for any sm80+
GPU or the Triton interpreter.  The backend (its capability checks, the GEMMs
and the registration) lives in ``ops/nvfp4_triton.py``, which registers
:func:`quant` as its ``nvfp4_quant`` and re-exports this module's public names.

Read top to bottom:

1. capability check (``_hw_e4m3``: hardware e4m3 conversions on sm89+; the
   GEMM module's scale decoder uses it too);
2. the config space: :class:`QuantConfig`, its one validity predicate
   :func:`quant_config_ok`, ``DEFAULT_QUANT`` and ``QUANT_CANDIDATES``;
3. the quantizer kernel;
4. its launcher :func:`quant`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from scaledmm.ops import nvfp4 as nv


# ----------------------------------------------------------------------------
# 1. Capability check
# ----------------------------------------------------------------------------


def _hw_e4m3(device: torch.device) -> bool:
    """Use Triton's e4m3 type (sm89+: hardware conversions, nearest-even and
    saturating); elsewhere (sm80, the interpreter) exact integer arithmetic."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# ----------------------------------------------------------------------------
# 2. Config space
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Tile of one quantizer program: ``block_m`` rows x ``block_g`` blocks of 16."""

    block_m: int = 32
    block_g: int = 8
    num_warps: int = 4

    def label(self) -> str:
        return f"q{self.block_m}x{self.block_g}w{self.num_warps}"


def quant_config_ok(cfg: QuantConfig) -> tuple[bool, str]:
    """The one validity predicate of the quantizer configs."""
    if not all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_g, cfg.num_warps)):
        return False, "block_m, block_g and num_warps must be powers of two"
    if cfg.block_m < 4 or cfg.block_g < 4 or cfg.block_m * cfg.block_g * 16 > 32768:
        return False, "needs block_m, block_g >= 4 and <= 32768 elements per program"
    return True, "ok"


# 32 rows x 8 blocks, 4 warps: 32 elements (64 B of bf16) per thread, 92
# registers.  The first H200 run gave 29% of copy bandwidth: the kernel is
# issue bound (~26 SASS instructions per element, ~23 us of issue at M=4096,
# K=7168 before stalls); 64x8 with 4 warps needs 230 registers (worse).  The
# benchmark sweeps QUANT_CANDIDATES; the real fix is fewer instructions.
DEFAULT_QUANT = QuantConfig(32, 8, 4)
QUANT_CANDIDATES = (QuantConfig(32, 8, 4), QuantConfig(64, 8, 8), QuantConfig(16, 8, 2),
                    QuantConfig(32, 4, 4))


# ----------------------------------------------------------------------------
# 3. Quantizer kernel: x -> (packed e2m1 codes, e4m3 block scales)
# ----------------------------------------------------------------------------
#
# SPEC: s = e4m3(gs * amax / 6) saturating; code = RNE_e2m1(clamp(v, -6, 6))
# with v = fl(fl(x * gs) / s) in fp32.  The kernel computes s exactly so (one
# fp32 division per block, then nearest-even e4m3), but finds the codes
# without dividing.  The code steps up at the e2m1 midpoints T = 0.25, 0.75,
# ..., 5: at v > T for the strict ones (0.25, 1.25, 2.5, 5: a tie stays on the
# even code below) and at v >= T for the inclusive ones (0.75, 1.75, 3.5).
# With y = fl(x * gs) and q = y / s the exact quotient, fl(q) >= T iff
# q >= T - ulp/2 and fl(q) > T iff q > T + ulp/2 (each T has an even last
# bit, so fp32 ties land on T).  P = T * s is exact in fp32 (<= 7 significant
# bits) and (ulp(T) / 2) * s lies strictly between 0 and the fp32 spacing
# around P (P is never a power of two for the inclusive T), so for fp32 y:
#     v >= T  <=>  y >= P          and          v > T  <=>  y >= nextup(P).
# Bit-identical codes to the division, found with 3 compares per element.


@triton.jit
def _nextup(p):
    """Next fp32 above a positive finite ``p``."""
    return (p.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_round(v):
    """Nearest-even e4m3 of ``v`` (>= 0, <= 448, or NaN): (code, value as fp32)."""
    bits = v.to(tl.int32, bitcast=True)
    # normal range (v >= 2**-6): keep 3 of the 23 mantissa bits, ties to even
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # ~0xFFFFF
    code_n = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    val_n = r.to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2**-9, rounded with the 1.5 * 2**23 trick
    q = (v * 512.0 + 12582912.0) - 12582912.0
    code_s = q.to(tl.int32)
    val_s = q * 0.001953125
    small = v < 0.015625
    code = tl.where(small, code_s, code_n)
    val = tl.where(small, val_s, val_n)
    nan = v != v
    return tl.where(nan, 0x7F, code), tl.where(nan, v, val)


@triton.jit
def _quant_codes(y, g1, p2, g3, p4, g5, p6, g7, sign_mask):
    """Codes of ``y = fl(x * gs)`` given the block's thresholds (binary search
    over the 7 midpoints; see the comment above)."""
    ay = tl.abs(y)
    ge4 = ay >= p4
    ge2 = ay >= tl.where(ge4, p6, p2)
    ge1 = ay >= tl.where(ge2, tl.where(ge4, g7, g3), tl.where(ge4, g5, g1))
    mag = tl.where(ge4, 4, 0) | tl.where(ge2, 2, 0) | tl.where(ge1, 1, 0)
    code = mag | ((y.to(tl.int32, bitcast=True) >> 28) & sign_mask)
    lo, hi = tl.split(tl.reshape(code, (code.shape[0], code.shape[1], code.shape[2] // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit(do_not_specialize=["M", "s_rows"])
def _quant_kernel(x_ptr, gs_ptr, q_ptr, s_ptr, M, K, stride_xm, s_rows, s_cols, s_c4,
                  SWIZZLE: tl.constexpr, HW_E4M3: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    G = K // 16
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    groups = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
    rows3 = rows[:, None, None]
    groups3 = groups[None, :, None]
    inb = (rows3 < M) & (groups3 < G)
    # each block of 16 as two halves of 8: a thread owns whole blocks, so the
    # per-block work (scale, thresholds) is not repeated across threads
    x_ptrs = x_ptr + rows3.to(tl.int64) * stride_xm + groups3 * 16 + tl.arange(0, 8)[None, None, :]
    xa = tl.load(x_ptrs, mask=inb, other=0.0).to(tl.float32)
    xb = tl.load(x_ptrs + 8, mask=inb, other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr).to(tl.float32)
    # amax as an integer max of the |x| bit patterns: same order as the floats,
    # and any NaN (above inf) wins, so NaN propagates to the block scale
    amax = tl.maximum(tl.max(tl.abs(xa).to(tl.int32, bitcast=True), axis=2),
                      tl.max(tl.abs(xb).to(tl.int32, bitcast=True), axis=2)).to(tl.float32, bitcast=True)
    v = tl.div_rn(gs * amax, 6.0)                   # fl(fl(gs * amax) / 6)
    v = tl.minimum(v, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if HW_E4M3:  # sm89+: cvt.rn.satfinite.e4m3x2.f32 is exactly this rounding
        s8 = v.to(tl.float8e4nv)
        s_code = s8.to(tl.uint8, bitcast=True)
        s = s8.to(tl.float32)
    else:
        s_code, s = _e4m3_round(v)
    # thresholds: P = T * s (exact) for the inclusive midpoints, nextup(P) for
    # the strict ones; s == 0 gives code 0 (infinite thresholds, no sign)
    zero = s == 0
    s = tl.where(zero, float("inf"), s)
    g1 = _nextup(0.25 * s)[:, :, None]
    p2 = (0.75 * s)[:, :, None]
    g3 = _nextup(1.25 * s)[:, :, None]
    p4 = (1.75 * s)[:, :, None]
    g5 = _nextup(2.5 * s)[:, :, None]
    p6 = (3.5 * s)[:, :, None]
    g7 = _nextup(5.0 * s)[:, :, None]
    sign_mask = tl.where(zero, 0, 8)[:, :, None]
    qa = _quant_codes(xa * gs, g1, p2, g3, p4, g5, p6, g7, sign_mask)
    qb = _quant_codes(xb * gs, g1, p2, g3, p4, g5, p6, g7, sign_mask)
    q_ptrs = q_ptr + rows3.to(tl.int64) * (K // 2) + groups3 * 8 + tl.arange(0, 4)[None, None, :]
    tl.store(q_ptrs, qa, mask=inb)
    tl.store(q_ptrs + 4, qb, mask=inb)
    # block scales; rows >= M and groups >= G of the padded layout get zeros
    r2 = rows[:, None]
    g2 = groups[None, :]
    if SWIZZLE:
        s_off = ((r2 // 128) * s_c4 + g2 // 4) * 512 + (r2 % 32) * 16 + ((r2 % 128) // 32) * 4 + g2 % 4
    else:
        s_off = r2 * s_cols + g2
    tl.store(s_ptr + s_off.to(tl.int64), s_code.to(tl.uint8), mask=(r2 < s_rows) & (g2 < s_cols))


# ----------------------------------------------------------------------------
# 4. Launcher
# ----------------------------------------------------------------------------


def quant(x: torch.Tensor, global_scale: torch.Tensor, swizzle: bool = True,
          cfg: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4_quant`` in one Triton launch (also writes the layout's pad zeros).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops import nvfp4_triton as nt
    >>> x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
    >>> q, s = nt.quant(x, torch.tensor(100.0, device="cuda"))        # doctest: +SKIP
    >>> q.shape, s.shape                                              # doctest: +SKIP
    (torch.Size([3, 32]), torch.Size([128, 4]))
    """
    q, s = nv.quant_outputs(x, global_scale, swizzle)
    m, k = x.shape
    s_rows, s_cols = s.shape
    if s_rows == 0:
        return q, s
    cfg = cfg or DEFAULT_QUANT
    grid = (triton.cdiv(s_rows, cfg.block_m), triton.cdiv(s_cols, cfg.block_g))
    _quant_kernel[grid](x, global_scale, q, s.view(torch.uint8), m, k, x.stride(0),
                        s_rows, s_cols, s_cols // 4, SWIZZLE=bool(swizzle),
                        HW_E4M3=_hw_e4m3(x.device),
                        BLOCK_M=cfg.block_m, BLOCK_G=cfg.block_g, num_warps=cfg.num_warps)
    return q, s
