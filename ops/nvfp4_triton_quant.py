"""NVFP4 quantizer Triton kernels: ``nvfp4_quant`` of backend ``triton`` of the
``nvfp4`` family (SPEC.md "NVFP4"), bit-identical to SPEC's rule.

``x -> (packed e2m1 codes, e4m3 block scales)`` in one launch, for any sm80+
GPU or the Triton interpreter.  The backend (its capability checks, the GEMMs
and the registration) lives in ``ops/nvfp4_triton.py``, which registers
:func:`quant` as its ``nvfp4_quant`` and re-exports this module's public names.

Read top to bottom:

1. capability check (``_hw_e4m3``: hardware e4m3 conversions on sm89+; the
   GEMM module's scale decoder uses it too);
2. the config space: :class:`QuantConfig` (tile and kernel ``variant``), its
   one validity predicate :func:`quant_config_ok`, ``DEFAULT_QUANT`` and
   ``QUANT_CANDIDATES``;
3. the kernels: the exact code rule they share, kernel ``split8`` (the first
   one), the ``rows_*`` kernels;
4. the launcher :func:`quant`.

Where the time goes (sm90 SASS, offline compile; ``python
benchmarks/experiments/nvfp4_quant.py --sass`` prints the table).  An H200 SM
partition issues one instruction per clock, but its ALU pipe (integer,
logic, FSETP/FSEL/FMNMX, conversions) takes one every two clocks, while FP32
FMUL/FADD/FFMA (and IMAD) go to the FMA pipes at full rate.  At M=4096,
K=7168 the bytes take ~18 us at copy speed, and every instruction per element
costs ~0.9 us of issue (29.4 M elements / 32 lanes / 528 partitions /
1.98 GHz), every ALU instruction per element ~1.8 us of ALU pipe:

* ``split8`` (32x8 tile, 3-D ``[rows, groups, 8]`` halves): Triton lays the
  threads along *rows* (``threadsPerWarp = [32, 1, 1]``), so one warp load
  touches 32 rows x 16 B (half sectors) and the 4-byte code stores are as
  scattered; 27.2 SASS instructions per element, 20 of them ALU (35 us of
  ALU pipe): the measured 67 us.
* ``rows_*``: a warp takes 32 consecutive blocks of one row (1 KB per load
  instruction pair, 8-byte code stores), one thread per block of 16, rows
  walked in a loop with the next row's loads issued before this row's math;
  the block's codes are packed in fp32 accumulators (4 codes per 16 bits,
  exact integers) and the signs placed by ``IMAD.HI`` (FMA pipe).
  ``rows_pred``: FSETP/FSEL binary search, 18.0 instructions per element,
  9.7 ALU (17 us of ALU pipe); ``rows_fma``: the same search with
  saturating FFMAs (below), 19.1 per element, 5.4 ALU (17 us of issue).
  Per element: 10 FFMA, FMUL by the block's reciprocal, FMNMX (amax), the
  bf16 unpack and half a sign op each; ~5 more per element are the block's
  scale and its IEEE reciprocal (~1 per element), packing, stores and the
  loop.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from scaledmm.device import capability, triton_pdl
from scaledmm.ops import nvfp4 as nv


# ----------------------------------------------------------------------------
# 1. Capability check
# ----------------------------------------------------------------------------


def _hw_e4m3(device: torch.device) -> bool:
    """Use Triton's e4m3 type (sm89+: hardware conversions, nearest-even and
    saturating); elsewhere (sm80, the interpreter) exact integer arithmetic."""
    return device.type == "cuda" and capability(device) >= (8, 9)


# ----------------------------------------------------------------------------
# 2. Config space
# ----------------------------------------------------------------------------

#: Kernel variants (see the module docstring): the first kernel and two
#: row-loop kernels that differ only in how they find the codes.
VARIANTS = ("split8", "rows_pred", "rows_fma")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Tile of one quantizer program: ``block_m`` rows x ``block_g`` blocks of
    16, ``num_warps`` warps, kernel ``variant`` (one of :data:`VARIANTS`).

    ``rows_*`` variants: one thread per block of 16, ``32 * num_warps //
    block_g`` rows per loop step, ``block_m`` rows per program, loads issued
    ``prefetch`` (1 or 2) steps ahead of the math."""

    block_m: int = 32
    block_g: int = 8
    num_warps: int = 4
    variant: str = "split8"
    prefetch: int = 1

    def label(self) -> str:
        tag = "" if self.variant == "split8" else f"-{self.variant}"
        return f"q{self.block_m}x{self.block_g}w{self.num_warps}{tag}" + ("" if self.prefetch == 1 else
                                                                          f"-p{self.prefetch}")

    def rows_per_step(self) -> int:
        return 32 * self.num_warps // self.block_g


def quant_config_ok(cfg: QuantConfig) -> tuple[bool, str]:
    """The one validity predicate of the quantizer configs."""
    if cfg.variant not in VARIANTS:
        return False, f"variant must be one of {VARIANTS}, got {cfg.variant!r}"
    if not all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_g, cfg.num_warps)):
        return False, "block_m, block_g and num_warps must be powers of two"
    if cfg.prefetch not in (1, 2) or (cfg.variant == "split8" and cfg.prefetch != 1):
        return False, "prefetch must be 1 or 2 (rows kernels), 1 (split8)"
    if cfg.variant == "split8":
        if cfg.block_m < 4 or cfg.block_g < 4 or cfg.block_m * cfg.block_g * 16 > 32768:
            return False, "needs block_m, block_g >= 4 and <= 32768 elements per program"
        return True, "ok"
    if cfg.num_warps > 8 or not 8 <= cfg.block_g <= 32 * cfg.num_warps:
        return False, "rows kernels: num_warps <= 8 and 8 <= block_g <= 32 * num_warps (one thread per block)"
    if not cfg.rows_per_step() <= cfg.block_m <= 32:
        # the swizzled scale offset advances by a constant inside 32 rows
        return False, "rows kernels: 32 * num_warps / block_g <= block_m <= 32"
    return True, "ok"


# H200 (K = 7168 bf16, swizzled, every config bit-exact on the device): the
# rows_fma kernel with 16 rows x 32 blocks takes 26.6 us at M = 4096 (2.83 TB/s, 68% of the CLI's 4130 GB/s
# copy ceiling) where the split8 kernel took 67.7 us; 8 rows x 32 blocks is
# the fastest at M = 1 / 16 / 128 (1.6 / 2.2 / 3.3 us, split8 2.6 / 2.9 /
# 4.9) and 27.2 us at 4096.
DEFAULT_QUANT = QuantConfig(16, 32, 4, "rows_fma")
SMALL_M_QUANT = QuantConfig(8, 32, 4, "rows_fma")  # M <= SMALL_M
SMALL_M = 256


def default_quant_config(m: int) -> QuantConfig:
    """The quantizer config for an activation of ``m`` rows (see above)."""
    return SMALL_M_QUANT if m <= SMALL_M else DEFAULT_QUANT
QUANT_CANDIDATES = (DEFAULT_QUANT, SMALL_M_QUANT, QuantConfig(32, 8, 4), QuantConfig(16, 8, 2),
                    QuantConfig(32, 32, 4, "rows_fma"), QuantConfig(32, 64, 4, "rows_fma"),
                    QuantConfig(32, 32, 4, "rows_fma", 2),
                    QuantConfig(32, 32, 4, "rows_pred"))


# ----------------------------------------------------------------------------
# 3. Kernels: x -> (packed e2m1 codes, e4m3 block scales)
# ----------------------------------------------------------------------------
#
# SPEC's recipe, per block, every step one fp32 operation in the production
# quantizers' order: s = e4m3(gs * (amax * RN(1/6))), r = 1 / (s * (1 / gs)),
# code = e2m1 nearest-even of y = x * r.  The reciprocals are IEEE (div_rn), not
# rcp.approx: on the H200 that instruction misses the nearest fp32 for 13% of
# inputs, which moved 1e-4 of bf16 codes off the reference those projects test
# against (measured; it does round 1/6 correctly).  The code steps up at fixed midpoints of
# y: strictly above 0.25, 1.25, 2.5 and 5 (a tie stays on the even code below),
# at or above 0.75, 1.75 and 3.5; 3 compares per element (binary search).
#
# rows_fma does the compares in the FMA pipe: with A = 2**40, sat(A * (T - |y|))
# is exactly [|y| < T] and sat(A * (|y| - T)) exactly [|y| > T] (one FFMA.SAT
# each): A * |y| is exact, and an fp32 |y| != T is at least 2**-26 from T (the
# spacing below 0.25), so the rounded result is 0, <= -2**14 or >= 2**14.  The code bits
# are then added into an fp32 accumulator holding 4 codes as an exact integer.
# Every product is exact, so the interpreter (fma = mul, then add) agrees.

_MAGIC = tl.constexpr(8388608.0)            # 2**23
_A = tl.constexpr(1099511627776.0)          # 2**40 (see "rows_fma" above)
_RCP6 = tl.constexpr(0.16666666666666666)   # SPEC's (1/6): its fp32 value


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


# ---- kernel "split8": [BLOCK_M, BLOCK_G, 8] halves, one thread per block ----


@triton.jit
def _quant_codes(x, r, sign_mask):
    """Packed codes of ``x`` (fp32) scaled by the block's ``r``: binary search
    over the 7 midpoints of ``y = x * r``, the sign bit from ``x``."""
    ay = tl.abs(x * r)
    ge4 = ay >= 1.75
    ge2 = ay >= tl.where(ge4, 3.5, 0.75)
    ge1 = ay > tl.where(ge2, tl.where(ge4, 5.0, 1.25), tl.where(ge4, 2.5, 0.25))
    mag = tl.where(ge4, 4, 0) | tl.where(ge2, 2, 0) | tl.where(ge1, 1, 0)
    code = mag | ((x.to(tl.int32, bitcast=True) >> 28) & sign_mask)
    lo, hi = tl.split(tl.reshape(code, (code.shape[0], code.shape[1], code.shape[2] // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit(do_not_specialize=["M", "s_rows"])
def _quant_kernel(x_ptr, gs_ptr, q_ptr, s_ptr, M, K, stride_xm, s_rows, s_cols, s_c4,
                  SWIZZLE: tl.constexpr, HW_E4M3: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # scaledmm.device.pdl
        gdc_wait()
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    G = K // 16
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    groups = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
    rows3 = rows[:, None, None]
    groups3 = groups[None, :, None]
    inb = (rows3 < M) & (groups3 < G)
    # each block of 16 as two halves of 8: a thread owns whole blocks, so the
    # per-block work (scale, reciprocal) is not repeated across threads
    x_ptrs = x_ptr + rows3.to(tl.int64) * stride_xm + groups3 * 16 + tl.arange(0, 8)[None, None, :]
    xa = tl.load(x_ptrs, mask=inb, other=0.0).to(tl.float32)
    xb = tl.load(x_ptrs + 8, mask=inb, other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr).to(tl.float32)
    # amax as an integer max of the |x| bit patterns: same order as the floats,
    # and any NaN (above inf) wins, so NaN propagates to the block scale
    amax = tl.maximum(tl.max(tl.abs(xa).to(tl.int32, bitcast=True), axis=2),
                      tl.max(tl.abs(xb).to(tl.int32, bitcast=True), axis=2)).to(tl.float32, bitcast=True)
    v = tl.minimum(gs * (amax * _RCP6), 448.0, propagate_nan=tl.PropagateNan.ALL)
    if HW_E4M3:  # sm89+: cvt.rn.satfinite.e4m3x2.f32 is exactly this rounding
        s8 = v.to(tl.float8e4nv)
        s_code = s8.to(tl.uint8, bitcast=True)
        s = s8.to(tl.float32)
    else:
        s_code, s = _e4m3_round(v)
    # s == 0: r = 0 and no sign, so every code is 0
    zero = s == 0
    r = tl.where(zero, 0.0, tl.div_rn(1.0, s * tl.div_rn(1.0, gs)))[:, :, None]
    sign_mask = tl.where(zero, 0, 8)[:, :, None]
    qa = _quant_codes(xa, r, sign_mask)
    qb = _quant_codes(xb, r, sign_mask)
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


# ---- kernels "rows_*": one thread per block, a loop over rows ----
#
# Inputs (INPUT): 0 = bf16 read as int32 words (two 16-B loads per block;
# lo = w << 16, hi = w & 0xFFFF0000), 1 = any 16-bit dtype at any alignment,
# 2 = fp32 (four 16-B loads).  A block is handled as 4 quads of 4 elements,
# each quad's 4 codes as one 16-bit integer built in an fp32 accumulator that
# starts at 2**23 (so its low 16 mantissa bits are the integer).  Signs: the
# sign bits of an element pair (bits 15 and 31 of a bf16 word) go to nibble
# bits 3 and 7 (or 11 and 15) with one IMAD.HI by 2**20 + 2**8 (2**28 +
# 2**16); the stray bits land above bit 15 and are dropped.



@triton.jit
def _rows_load(x_p, mask, INPUT: tl.constexpr):
    """The block of 16 at each pointer of ``x_p``: two chunks, raw."""
    m = mask[:, None]  # masked blocks read as zeros: scale 0 (the pads), codes not stored
    if INPUT == 0:
        p = x_p.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 4)[None, :]
        a = tl.load(p, mask=m, other=0)
        b = tl.load(p + 4, mask=m, other=0)
    elif INPUT == 1:
        p = x_p[:, None] + tl.arange(0, 8)[None, :]
        a = tl.load(p, mask=m, other=0.0)
        b = tl.load(p + 8, mask=m, other=0.0)
    else:
        p = x_p[:, None] + tl.arange(0, 4)[None, :]
        a = tl.join(tl.load(p, mask=m, other=0.0), tl.load(p + 4, mask=m, other=0.0))
        b = tl.join(tl.load(p + 8, mask=m, other=0.0), tl.load(p + 12, mask=m, other=0.0))
    return a, b


@triton.jit
def _cols(t):
    """The 4 columns of a ``[N, 4]`` tensor (in-thread: no data movement)."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@triton.jit
def _sign_word(lo, hi):
    """Sign bits of an element pair at bits 15 and 31 (a bf16 word's)."""
    return (((lo.to(tl.uint32, bitcast=True) >> 16) & 0x8000)
            | (hi.to(tl.uint32, bitcast=True) & 0x80000000))


@triton.jit
def _unpack(c, INPUT: tl.constexpr):
    """One chunk (8 elements) -> (lo_k, hi_k, sign word_k) for its 4 pairs,
    elements 2k and 2k + 1 as fp32."""
    if INPUT == 0:
        w0, w1, w2, w3 = _cols(c.to(tl.uint32, bitcast=True))
        l0 = (w0 << 16).to(tl.float32, bitcast=True)
        l1 = (w1 << 16).to(tl.float32, bitcast=True)
        l2 = (w2 << 16).to(tl.float32, bitcast=True)
        l3 = (w3 << 16).to(tl.float32, bitcast=True)
        h0 = (w0 & 0xFFFF0000).to(tl.float32, bitcast=True)
        h1 = (w1 & 0xFFFF0000).to(tl.float32, bitcast=True)
        h2 = (w2 & 0xFFFF0000).to(tl.float32, bitcast=True)
        h3 = (w3 & 0xFFFF0000).to(tl.float32, bitcast=True)
        s0, s1, s2, s3 = w0 & 0x80008000, w1 & 0x80008000, w2 & 0x80008000, w3 & 0x80008000
    else:
        if INPUT == 1:
            lo, hi = tl.split(tl.reshape(c.to(tl.float32), (c.shape[0], 4, 2)))
            l0, l1, l2, l3 = _cols(lo)
            h0, h1, h2, h3 = _cols(hi)
        else:  # [N, 4, 2]: elements 0-3, elements 4-7
            a, b = tl.split(c)
            l0, h0, l1, h1 = _cols(a)
            l2, h2, l3, h3 = _cols(b)
        s0, s1, s2, s3 = _sign_word(l0, h0), _sign_word(l1, h1), _sign_word(l2, h2), _sign_word(l3, h3)
    return l0, h0, s0, l1, h1, s1, l2, h2, s2, l3, h3, s3


@triton.jit
def _nanmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax8(p):
    """NaN-propagating max of |x| over one unpacked chunk."""
    l0, h0, _s0, l1, h1, _s1, l2, h2, _s2, l3, h3, _s3 = p
    m0 = _nanmax(_nanmax(tl.abs(l0), tl.abs(h0)), _nanmax(tl.abs(l1), tl.abs(h1)))
    m1 = _nanmax(_nanmax(tl.abs(l2), tl.abs(h2)), _nanmax(tl.abs(l3), tl.abs(h3)))
    return _nanmax(m0, m1)


@triton.jit
def _code_pred(y, acc, W: tl.constexpr):
    """Adds ``W * code(y)`` (magnitude) to ``acc``: FSETP/FSEL binary search."""
    ay = tl.abs(y)
    ge4 = ay >= 1.75
    ge2 = ay >= tl.where(ge4, 3.5, 0.75)
    gt1 = ay > tl.where(ge2, tl.where(ge4, 5.0, 1.25), tl.where(ge4, 2.5, 0.25))
    acc = tl.where(ge4, acc + 4.0 * W, acc)
    acc = tl.where(ge2, acc + 2.0 * W, acc)
    return tl.where(gt1, acc + W, acc)


@triton.jit
def _code_fma(y, acc, W: tl.constexpr):
    """Adds ``W * (code(y) - 6)`` (magnitude) to ``acc``: the same search with
    FFMA.SAT compares (midpoints scaled by A; see the comment above)."""
    ay = tl.abs(y)
    lt4 = tl.clamp(tl.fma(ay, -_A, 1.75 * _A), 0.0, 1.0)                             # |y| < 1.75
    lt2 = tl.clamp(tl.fma(ay, -_A, tl.fma(lt4, -2.75 * _A, 3.5 * _A)), 0.0, 1.0)     # < 0.75 or 3.5
    nt3 = tl.fma(lt4, tl.fma(lt2, -1.5 * _A, 3.75 * _A), tl.fma(lt2, 2.5 * _A, -5.0 * _A))  # -(0.25 .. 5)
    gt1 = tl.clamp(tl.fma(ay, _A, nt3), 0.0, 1.0)                                    # |y| > that
    return tl.fma(gt1, W, tl.fma(lt4, -4.0 * W, tl.fma(lt2, -2.0 * W, acc)))


@triton.jit
def _quad(x0, x1, x2, x3, sw0, sw1, r, CODES: tl.constexpr):
    """The 4 codes of elements x0..x3 (fp32 x, sign words of the pairs), scaled
    by the block's ``r``, as the low 16 bits of a uint32."""
    if CODES == 0:
        acc = tl.full(x0.shape, _MAGIC, tl.float32)
        acc = _code_pred(x0 * r, acc, 1.0)
        acc = _code_pred(x1 * r, acc, 16.0)
        acc = _code_pred(x2 * r, acc, 256.0)
        acc = _code_pred(x3 * r, acc, 4096.0)
    else:
        acc = tl.full(x0.shape, _MAGIC + 6.0 * 4369.0, tl.float32)  # + 6 per code (see _code_fma)
        acc = _code_fma(x0 * r, acc, 1.0)
        acc = _code_fma(x1 * r, acc, 16.0)
        acc = _code_fma(x2 * r, acc, 256.0)
        acc = _code_fma(x3 * r, acc, 4096.0)
    return tl.umulhi(sw1, 0x10010000) + (tl.umulhi(sw0, 0x00100100) + acc.to(tl.uint32, bitcast=True))


@triton.jit
def _rows_block(ca, cb, gs, rgs, HW_E4M3: tl.constexpr, INPUT: tl.constexpr, CODES: tl.constexpr):
    """One block of 16 per thread -> (two code words, e4m3 scale code);
    ``rgs`` = 1 / gs."""
    pa = _unpack(ca, INPUT)
    pb = _unpack(cb, INPUT)
    amax = _nanmax(_amax8(pa), _amax8(pb))  # a NaN anywhere wins
    v = tl.minimum(gs * (amax * _RCP6), 448.0, propagate_nan=tl.PropagateNan.ALL)
    if HW_E4M3:
        s8 = v.to(tl.float8e4nv)
        s_code = s8.to(tl.uint8, bitcast=True)
        s = s8.to(tl.float32)
    else:
        s_code, s = _e4m3_round(v)
        s_code = s_code.to(tl.uint8)
    keep = tl.where(s == 0, 0, -1).to(tl.uint32)  # s == 0: all codes 0 (whatever r = inf gives)
    r = tl.div_rn(1.0, s * rgs)
    a0, a1, as0, a2, a3, as1, a4, a5, as2, a6, a7, as3 = pa
    b0, b1, bs0, b2, b3, bs1, b4, b5, bs2, b6, b7, bs3 = pb
    r0 = _quad(a0, a1, a2, a3, as0, as1, r, CODES)
    r1 = _quad(a4, a5, a6, a7, as2, as3, r, CODES)
    r2 = _quad(b0, b1, b2, b3, bs0, bs1, r, CODES)
    r3 = _quad(b4, b5, b6, b7, bs2, bs3, r, CODES)
    wa = ((r0 & 0xFFFF) | (r1 << 16)) & keep
    wb = ((r2 & 0xFFFF) | (r3 << 16)) & keep
    return wa, wb, s_code


_RANGE = tl.constexpr(nv.RANGE)            # 448 * 6
_AMAX_FLOOR = tl.constexpr(nv.AMAX_FLOOR)


@triton.jit
def _dynamic_gs(amax_ptr, n_amax, AMAX_BLOCK: tl.constexpr):
    """``RANGE / max(max(amax[0:n_amax]), AMAX_FLOOR)`` (NaN propagates), IEEE."""
    i = tl.arange(0, AMAX_BLOCK)
    acc = tl.full([AMAX_BLOCK], _AMAX_FLOOR, tl.float32)
    for j in range(0, n_amax, AMAX_BLOCK):
        acc = _nanmax(acc, tl.load(amax_ptr + j + i, mask=j + i < n_amax, other=_AMAX_FLOOR))
    return tl.div_rn(_RANGE, tl.reduce(acc, 0, _nanmax))


@triton.jit(do_not_specialize=["M", "s_rows", "n_amax"])
def _rows_kernel(x_ptr, gs_ptr, q_ptr, s_ptr, M, K, stride_xm, s_rows, s_cols, s_c4,
                 amax_ptr, n_amax, wa_ptr, alpha_ptr,
                 SWIZZLE: tl.constexpr, HW_E4M3: tl.constexpr,
                 INPUT: tl.constexpr, CODES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, RPS: tl.constexpr, PREFETCH: tl.constexpr,
                 DYN: tl.constexpr = False, AMAX_BLOCK: tl.constexpr = 1, PDL: tl.constexpr = False):
    if PDL:  # scaledmm.device.pdl
        gdc_wait()
        gdc_launch_dependents()
    # DYN: the global scale from amax values (nvfp4_dynamic_linear); program
    # (0, 0) also writes the GEMM's alpha = weight_alpha / gs
    # program: BLOCK_M rows x BLOCK_G blocks, RPS rows per step (one thread per
    # block: a warp reads 32 consecutive blocks of a row, 1 KB of bf16); the
    # loads run PREFETCH steps ahead of the math
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    G = K // 16
    i = tl.arange(0, RPS * BLOCK_G)
    groups = pid_g * BLOCK_G + i % BLOCK_G
    row0 = pid_m * BLOCK_M
    rows = row0 + i // BLOCK_G
    g_in = groups < G
    x_p = x_ptr + rows.to(tl.int64) * stride_xm + groups * 16
    q_p = q_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64) * (K // 8) + groups * 2
    if SWIZZLE:  # rows stay inside one 32-row slice: the offset moves by 16 B a row
        s_off = ((rows // 128) * s_c4 + groups // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4 \
            + groups % 4
        s_step = RPS * 16
    else:
        s_off = rows * s_cols + groups
        s_step = RPS * s_cols
    s_p = s_ptr + s_off.to(tl.int64)
    s_in = groups < s_cols
    if DYN:
        gs = _dynamic_gs(amax_ptr, n_amax, AMAX_BLOCK)
        if (pid_m == 0) & (pid_g == 0):
            tl.store(alpha_ptr, tl.div_rn(tl.load(wa_ptr).to(tl.float32), gs))
    else:
        gs = tl.load(gs_ptr).to(tl.float32)
    rgs = tl.div_rn(1.0, gs)
    steps = tl.cdiv(tl.minimum(M - row0, BLOCK_M), RPS)  # steps with data rows (<= 0: none)
    ca, cb = _rows_load(x_p, g_in & (rows < M), INPUT)
    na, nb = ca, cb
    if PREFETCH == 2:
        x_p += RPS * stride_xm
        na, nb = _rows_load(x_p, g_in & (rows + RPS < M), INPUT)
    for it in range(BLOCK_M // RPS):
        if it < steps:
            # the loads PREFETCH steps ahead first, so they are in flight during this math
            x_p += RPS * stride_xm
            fa, fb = _rows_load(x_p, g_in & (rows + PREFETCH * RPS < M), INPUT)
            wa, wb, s_code = _rows_block(ca, cb, gs, rgs, HW_E4M3, INPUT, CODES)
            ok = g_in & (rows < M)
            tl.store(q_p[:, None] + tl.arange(0, 2)[None, :], tl.join(wa, wb).to(tl.int32, bitcast=True),
                     mask=ok[:, None])
            tl.store(s_p, s_code, mask=s_in & (rows < s_rows))  # zeros for the pads
            if PREFETCH == 2:
                ca, cb = na, nb
                na, nb = fa, fb
            else:
                ca, cb = fa, fb
        else:  # pad rows of the swizzled layout only
            tl.store(s_p, tl.zeros([RPS * BLOCK_G], tl.uint8), mask=s_in & (rows < s_rows))
        q_p += RPS * (K // 8)
        s_p += s_step
        rows += RPS


# ----------------------------------------------------------------------------
# 4. Launcher
# ----------------------------------------------------------------------------


def _rows_input(x: torch.Tensor) -> int:
    """INPUT of the rows kernels: int32 words need 4-byte aligned rows."""
    if x.dtype == torch.float32:
        return 2
    if x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0 and (x.stride(0) % 2 == 0 or x.shape[0] <= 1):
        return 0
    return 1


def quant(x: torch.Tensor, global_scale: torch.Tensor, swizzle: bool = True,
          cfg: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4_quant`` in one Triton launch (also writes the layout's pad zeros).

    ``global_scale`` must be positive (or zero: all codes and scales 0).

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
    _launch(x, global_scale, q, s, swizzle, cfg)
    return q, s


def _launch(x, global_scale, q, s, swizzle, cfg, dynamic=None):
    """One quantizer launch into ``(q, s)``; ``dynamic`` = ``(x_amax,
    weight_alpha, alpha)``: the global scale from ``x_amax`` (rows kernels)."""
    m, k = x.shape
    s_rows, s_cols = s.shape
    if s_rows == 0:
        return
    cfg = cfg or default_quant_config(m)
    grid = (triton.cdiv(s_rows, cfg.block_m), triton.cdiv(s_cols, cfg.block_g))
    args = (x, global_scale, q, s.view(torch.uint8), m, k, x.stride(0), s_rows, s_cols, s_cols // 4)
    if cfg.variant == "split8":
        if dynamic is not None:
            raise ValueError(f"nvfp4 dynamic quantizer: expected a rows_* config, got {cfg.label()}")
        _quant_kernel[grid](*args, SWIZZLE=bool(swizzle), HW_E4M3=_hw_e4m3(x.device),
                            BLOCK_M=cfg.block_m, BLOCK_G=cfg.block_g, num_warps=cfg.num_warps,
                            **triton_pdl(x.device))
    else:
        amax, wa, alpha = dynamic or (global_scale,) * 3  # unread without DYN
        _rows_kernel[grid](*args, amax, amax.numel(), wa, alpha, SWIZZLE=bool(swizzle), HW_E4M3=_hw_e4m3(x.device),
                           INPUT=_rows_input(x),
                           CODES=VARIANTS.index(cfg.variant) - 1, BLOCK_M=cfg.block_m,
                           BLOCK_G=cfg.block_g, RPS=cfg.rows_per_step(), PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
                           DYN=dynamic is not None, AMAX_BLOCK=_amax_block(amax.numel()), enable_fp_fusion=False,
                           **triton_pdl(x.device))


def _amax_block(n: int) -> int:
    """Lanes of the dynamic scale's reduction: the next power of two of ``n``
    up to ``DYNAMIC_MAX_AMAX`` (at decode, one value needs no cross-warp sum)."""
    return min(triton.next_power_of_2(max(n, 1)), DYNAMIC_MAX_AMAX)


#: Most amax values each quantizer program reduces itself; more are first
#: reduced to one by torch (a program re-reads them all: 4 KB here).  The
#: compile pass's partial maxima (one per 2048 values) of a 14336-wide row
#: stay under it up to M = 146.
DYNAMIC_MAX_AMAX = 1024


def quant_dynamic(x: torch.Tensor, x_amax: torch.Tensor, weight_alpha: torch.Tensor, swizzle: bool = True,
                  cfg: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``nvfp4_dynamic_linear``'s quantizer in one launch: ``(q, s, alpha)``,
    ``x`` quantized with ``gs = RANGE / max(max(x_amax), AMAX_FLOOR)`` (every
    program reduces ``x_amax`` itself) and float32 ``[1]`` ``alpha =
    weight_alpha / gs``: bit for bit :func:`~scaledmm.ops.nvfp4.dynamic_scales`
    then ``nvfp4_quant``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops import nvfp4_triton as nt
    >>> x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)          # doctest: +SKIP
    >>> amax = x.float().abs().amax(dim=1)                                   # doctest: +SKIP
    >>> q, s, alpha = nt.quant_dynamic(x, amax, torch.ones(1, device="cuda"))  # doctest: +SKIP
    >>> q.shape, alpha.shape                                                 # doctest: +SKIP
    (torch.Size([3, 32]), torch.Size([1]))
    """
    if cfg is None or cfg.variant == "split8":
        cfg = default_quant_config(x.shape[0])
    if x_amax.numel() > DYNAMIC_MAX_AMAX:
        x_amax = x_amax.amax().reshape(1)
    alpha = torch.empty(1, dtype=torch.float32, device=x.device)
    q, s = nv.quant_outputs(x, alpha, swizzle)
    if s.shape[0] == 0:  # M = 0: no launch; alpha from the same math
        alpha.copy_(nv.dynamic_scales(x_amax, weight_alpha)[1])
        return q, s, alpha
    _launch(x, alpha, q, s, swizzle, cfg, (x_amax, weight_alpha, alpha))
    return q, s, alpha
