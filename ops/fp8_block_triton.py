"""FP8 block-scaled GEMM in Triton: backend ``triton`` of the ``fp8_block`` family
(DeepSeek-V3 recipe: 1 x 128 activation groups, 128 x 128 weight blocks).

* ``per_token_group_quant_fp8``: the quant kernel and its launcher live in
  ``ops/fp8_block_triton_quant.py`` (``per_token_group_quant`` is re-exported
  here; ``quant_kernel``, ``e4m3_soft``, ``bytes_view`` are that module's).
* ``mm_kernel``: ``fp8_block_mm`` for any M (masks or TMA out-of-bounds fill,
  no padding copies).  Per 128-wide K block: fp32 ``tl.dot`` of the fp8 tiles
  times ``a_scale[m] * b_scale[n]`` into the fp32 accumulator.  One frozen
  :class:`MMConfig` picks split-K (fp32 workspace, fixed-order reduce),
  swap-AB (weight rows on the MMA's M side: small M), TMA, a persistent grid,
  warp specialization; ``QUANT_A`` quantizes a bf16/fp16 activation tile in
  registers (``fp8_block_linear``, the quant module's ``_quant_rows``),
  bit-identical to the quant op + GEMM.  ``ROWCOL`` serves ``fp8_scaled_mm``
  (launcher: ``ops/fp8_triton_mm.py``): raw fp32 sums, times ``sa[m] * sb[n]``
  once after the K loop.
* ``splitk_reduce_kernel`` (``ops/fp8_block_triton_splitk.py``, with the
  one-launch tile counters): sums split-K partials (+ bias), rounds once.
  ``MMConfig.one_launch`` folds that second launch into ``mm_kernel``: the
  last program of each output tile (per-tile counter, release/acquire; the
  counters are zeroed per call) sums the partials in split order,
  bit-identical to the two-launch path.

Devices: sm90 (wgmma, TMA), sm89 and sm100+ (native fp8 dot), sm80 (no e4m3:
bytes widened exactly to fp16, fp16 MMA; e4m3 NaN codes read as numbers),
CPU under ``TRITON_INTERPRET=1`` set before triton is imported (tests; the
quant module, imported first, patches the interpreter).
Read top to bottom: capability checks, config space, kernels, launchers,
backend registration; the references are in ``ops/fp8_block.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton
import triton.language as tl

from scaledmm import backends, kernel_tuning
from scaledmm import validation as V
from scaledmm.backends import Backend, Problem
from scaledmm.oplib import FP8_DTYPE

from . import fp8_block as base
from .fp8_block_triton_quant import (
    _INTERPRET,
    _capability,
    _device_gate,
    _device_guard,
    _fp8_mode,
    _num_sms,
    _quant_rows,
    bytes_view,
    per_token_group_quant,
)
from .fp8_block_triton_splitk import splitk_reduce_kernel, tile_counters

__all__ = [
    "MMConfig",
    "config_ok",
    "default_config",
    "candidate_configs",
    "per_token_group_quant",
    "mm",
    "linear",
    "precompile",
    "is_supported",
    "can_implement",
]

NAME = "triton"
BLOCK_K = 128  # one K step == one scale block
M_BUCKETS = (16, 64, 128, 512, 1024)  # bucket i holds M <= M_BUCKETS[i]; the last holds the rest
# fp8_block_linear quantizes inside the GEMM only up to this M.  0: never by
# default (H200: fused 21-47 us where quant + GEMM took ~3 + 10-16 us);
# ``linear(..., fuse=True)`` still selects it.
FUSE_QUANT_MAX_M = 0

# ----------------------------------------------------------------------------
# Capability checks
# ----------------------------------------------------------------------------


def is_supported(device: torch.device) -> tuple[bool, str]:
    """Whether these kernels run on ``device``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops import fp8_block_triton as T
    >>> T.is_supported(torch.device("cpu"))[0] == T._INTERPRET
    True
    """
    gate = _device_gate(device)
    if gate is not None:
        return gate
    major, minor = _capability(device)
    if (major, minor) < (8, 9):
        return True, f"sm{major}{minor}: e4m3 widened to fp16 in registers, fp16 tensor cores"
    if major == 8:
        return True, "sm89: fp8 mma.sync; e4m3 encoded in integer code (Triton's cast rounds twice here)"
    return True, f"sm{major}{minor}: fp8 {'wgmma, TMA' if major == 9 else 'tensor cores'}"


def can_implement(p: Problem) -> tuple[bool, str]:
    """Per-problem check shared by the quant, GEMM and linear ops."""
    group = p.opt("group_size")
    if group is not None:  # per_token_group_quant_fp8
        if group > 4096:
            return False, f"group_size <= 4096, got {group}"
        return True, "any M, any row stride"
    if p.opt("block_size") != (128, 128):
        return False, f"needs block_size (128, 128), got {p.opt('block_size')}"
    if p.out_dtype not in V.FLOAT_OUT_DTYPES:
        return False, f"out_dtype bf16/fp16/fp32, got {p.out_dtype}"
    return True, "any M, N, K"


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MMConfig:
    """One launch configuration of ``mm_kernel``.

    Parameters
    ----------
    block_m, block_n : int
        Output tile (tokens x weight rows).  ``block_k`` is fixed at 128.
    split_k : int
        K-block ranges computed by separate programs, summed in fixed order.
    swap_ab : bool
        Compute the tile transposed (weight rows on the MMA's M side).
    group_m : int
        Tile-order swizzle (L2 reuse of weight tiles along M).
    num_warps, num_stages : int
        Triton launch options (pipeline depth of the K loop).
    tma : bool
        Load tiles through host-made TMA descriptors (sm90+, aligned operands;
        the launcher falls back to pointer loads where alignment forbids).
    persistent : bool
        One program per SM looping over tiles (split_k must be 1).
    warp_specialize : bool
        Ask Triton to split producer and consumer warps (sm90+).
    one_launch : bool
        Split-K without the reduce launch: the last program to finish an
        output tile sums the partials in split order (+ bias, one rounding),
        so the result equals the two-launch path bit for bit (split_k > 1).
    """

    block_m: int
    block_n: int
    split_k: int = 1
    swap_ab: bool = False
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False
    persistent: bool = False
    warp_specialize: bool = False
    one_launch: bool = False

    def short(self) -> str:
        flags = "".join(f for f, on in (("S", self.swap_ab), ("T", self.tma), ("P", self.persistent),
                                        ("W", self.warp_specialize), ("O", self.one_launch)) if on)
        return (f"{self.block_m}x{self.block_n}k{self.split_k}w{self.num_warps}s{self.num_stages}"
                + (f"-{flags}" if flags else ""))


_POW2 = (16, 32, 64, 128, 256)
_SMEM_LIMIT = 227 * 1024  # sm90 per-block maximum (sm8x defaults stay under 100 KB)


def smem_bytes(cfg: MMConfig, a_bytes: int = 1) -> int:
    """Shared memory of the pipelined operand tiles (what bounds num_stages)."""
    return cfg.num_stages * BLOCK_K * (cfg.block_m * a_bytes + cfg.block_n)


def config_ok(cfg: MMConfig, m: int, n: int, k: int, fused: bool = False) -> tuple[bool, str]:
    """The one validity predicate: dispatch, the sweep and tests all call it.

    ``fused`` says the A tiles are bf16/fp16 (quantized inside the GEMM).

    Examples
    --------
    >>> config_ok(MMConfig(16, 64, split_k=4, swap_ab=True), 1, 2112, 7168)
    (True, 'ok')
    >>> config_ok(MMConfig(16, 64, split_k=99), 1, 2112, 7168)[0]
    False
    """
    kb = V.ceil_div(k, BLOCK_K)
    checks = (
        (cfg.block_m in _POW2 and cfg.block_n in _POW2, f"block_m, block_n in {_POW2}"),
        (cfg.num_warps in (4, 8), "num_warps 4 or 8"),
        # the fp32 accumulator and one fresh dot result per K step live in registers
        (2 * cfg.block_m * cfg.block_n <= 128 * 32 * cfg.num_warps, "<= 128 accumulator registers per thread"),
        (1 <= cfg.num_stages <= 8, "num_stages in [1, 8]"),
        (cfg.group_m >= 1, "group_m >= 1"),
        (1 <= cfg.split_k <= max(1, min(64, kb)), f"split_k in [1, min(64, K blocks = {kb})]"),
        (not cfg.persistent or cfg.split_k == 1, "persistent grid needs split_k == 1"),
        (not cfg.warp_specialize or cfg.persistent, "warp specialization only with the persistent grid"),
        (not cfg.one_launch or (cfg.split_k > 1 and not cfg.persistent), "one_launch only with split_k > 1, "
         "not persistent"),
        (smem_bytes(cfg, 2 if fused else 1) <= _SMEM_LIMIT, f"pipeline within {_SMEM_LIMIT} B of shared memory"),
    )
    for ok, what in checks:
        if not ok:
            return False, f"needs {what}, got {cfg}"
    return True, "ok"


def m_bucket(m: int) -> int:
    """Index of the M bucket (1-16, 17-64, 65-128, 129-512, 513-1024, >1024)."""
    return next((i for i, hi in enumerate(M_BUCKETS) if m <= hi), len(M_BUCKETS))


# Per-bucket base tiles.  sm90 (and sm100) tiles feed wgmma; sm8x's mma.sync
# tiles hold both operands of a 128-wide K step in registers, so they are
# narrower (the fused quantizer needs registers too).  Split-K is derived from
# N, K and the SM count so the weight stream is spread over enough programs.
# Measured sm90 overrides of the unfused GEMM: :func:`tuned`.
_BUCKET_BASE = {
    True: (MMConfig(16, 64, swap_ab=True, num_warps=4, num_stages=6),
           MMConfig(64, 64, swap_ab=True, num_warps=4, num_stages=5),
           MMConfig(64, 128, num_warps=4, num_stages=4),
           MMConfig(128, 128, num_warps=8, num_stages=4),
           MMConfig(128, 128, num_warps=8, num_stages=4, tma=True),
           MMConfig(128, 128, num_warps=8, num_stages=4, tma=True)),
    False: (MMConfig(16, 64, swap_ab=True, num_warps=4, num_stages=6),
            MMConfig(32, 64, swap_ab=True, num_warps=4, num_stages=4),
            MMConfig(64, 128, num_warps=4, num_stages=3),
            MMConfig(64, 128, num_warps=4, num_stages=3),
            MMConfig(64, 128, num_warps=4, num_stages=3),
            MMConfig(64, 128, num_warps=4, num_stages=3)),
}
def tuned(bucket: int, n: int, k: int) -> MMConfig | None:
    """The measured sm90 config of the unfused GEMM for M bucket ``bucket``
    and an ``N x K`` weight, or None (the bucket base rule decides), from
    ``scaledmm/tuning/kernels/fp8_block_triton_sm90.json`` (rows keyed by the
    bucket's largest M; read once).

    Examples
    --------
    >>> tuned(1, 2112, 7168).short(), tuned(0, 2112, 7168)
    ('64x64k8w4s4', None)
    """
    hi = M_BUCKETS[bucket] if bucket < len(M_BUCKETS) else kernel_tuning.LAST_M
    return kernel_tuning.load("fp8_block_triton", "sm90", MMConfig).lookup(n, k, hi)


def m_bucket_max(m: int) -> int:
    """The largest M of ``m``'s bucket: the key of the tuned rows.

    Examples
    --------
    >>> m_bucket_max(1), m_bucket_max(100), m_bucket_max(5000)
    (16, 128, 2147483647)
    """
    b = m_bucket(m)
    return M_BUCKETS[b] if b < len(M_BUCKETS) else kernel_tuning.LAST_M


_WARMED: list = []  # kernels compiled by precompile(), loaded when it ends


def _split_for(m: int, n: int, k: int, bm: int, bn: int, num_sms: int) -> int:
    """Split-K so the weight is streamed by about two programs per SM, each
    with at least 4 K blocks.

    While M is small (<= 256) the programs of one N-tile all read the same
    weight rows (L2 hits), so what spreads the HBM stream is N-tiles x splits,
    not the tile count: 7168x16384 at M = 64 with 32x64 tiles has 224 tiles
    but only 112 weight streams of 1 MB each (measured 81 us, floor 28).

    Examples
    --------
    >>> _split_for(64, 7168, 16384, 32, 64, 132), _split_for(1, 2112, 7168, 16, 64, 132)
    (3, 8)
    """
    n_tiles = V.ceil_div(n, bn)
    streams = n_tiles if m <= 256 else V.ceil_div(max(m, 1), bm) * n_tiles
    if streams >= num_sms:
        return 1
    return max(1, min(V.ceil_div(2 * num_sms, streams), V.ceil_div(k, BLOCK_K) // 4, 16))


def default_config(m: int, n: int, k: int, num_sms: int = 132, fused: bool = False,
                   sm90: bool = True) -> MMConfig:
    """The fixed config for an M bucket, keyed also by N and K (no timing,
    so a first call inside a CUDA-graph capture launches at once).

    Examples
    --------
    >>> default_config(1, 2112, 7168).short()
    '16x64k8w4s6-SO'
    """
    b = m_bucket(m)
    cfg = tuned(b, n, k) if sm90 and not fused else None
    if cfg is None:
        base_cfg = _BUCKET_BASE[sm90][b]
        if fused and not sm90 and b >= 2:
            base_cfg = dataclasses.replace(base_cfg, block_m=32, block_n=64)
        split = _split_for(m, n, k, base_cfg.block_m, base_cfg.block_n, num_sms)
        cfg = dataclasses.replace(base_cfg, split_k=split)
    if sm90 and b == 0 and cfg.split_k > 1 and not cfg.persistent:
        # H200: folding the split-K reduce into the GEMM saves 0.6-1.5 us at M <= 16 on every dsv3 shape timed
        # (2112x7168 M=1 9.9 -> 9.0 us); at M = 64 it lost 2 us with 64x64 tiles.
        cfg = dataclasses.replace(cfg, one_launch=True)
    if not config_ok(cfg, m, n, k, fused)[0]:  # e.g. a tiny K
        cfg = dataclasses.replace(cfg, split_k=1, num_stages=min(cfg.num_stages, 3), one_launch=False)
    return cfg


def candidate_configs(m: int, n: int, k: int, num_sms: int = 132, fused: bool = False) -> list[MMConfig]:
    """A short list per bucket (sm90): what ``python -m benchmarks sweep
    --kernel fp8_block_triton`` times.

    Examples
    --------
    >>> all(config_ok(c, 1, 2112, 7168)[0] for c in candidate_configs(1, 2112, 7168))
    True
    """
    b = m_bucket(m)
    if b <= 1:
        bms = (16,) if b == 0 else (32, 64)
        tiles = [(bm, bn, True) for bm in bms for bn in (64, 128)] + [(bms[-1], 64, False)]
        stages = (4, 6)
    elif b == 2:
        tiles = [(64, 128, False), (128, 128, False), (64, 64, True), (128, 64, True)]
        stages = (3, 4)
    else:
        tiles = [(128, 128, False), (64, 256, False)]
        stages = (3, 4)
    out = []
    for bm, bn, swap in tiles:
        for st in stages:
            warps = 8 if bm * bn >= 128 * 128 else 4
            split = _split_for(m, n, k, bm, bn, num_sms)
            for sk in sorted({split, max(1, split // 2)}):
                out.append(MMConfig(bm, bn, split_k=sk, swap_ab=swap, num_warps=warps, num_stages=st))
    if b <= 1:  # small M: the reduce launch is a large share of the call
        out += [dataclasses.replace(c, one_launch=True) for c in list(out) if c.split_k > 1]
    if b >= 3:
        big = MMConfig(128, 128, num_warps=8, num_stages=4, tma=True)
        out += [big, dataclasses.replace(big, persistent=True),
                dataclasses.replace(big, persistent=True, warp_specialize=True),
                MMConfig(64, 256, num_warps=8, num_stages=4, tma=True, persistent=True)]
    uniq = []
    for c in out:
        if c not in uniq and config_ok(c, m, n, k, fused)[0]:
            uniq.append(c)
    return uniq


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def fp16_from_e4m3(codes):
    """e4m3 bits (uint8) -> fp16 holding value * 2**-8, exactly (sm80 path)."""
    c = codes.to(tl.uint16)
    return (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _mm_tile(a, b, a_s, b_s, M, N, K, off_m, off_n, kb_lo, kb_hi,
             stride_am, stride_bn, stride_asm, stride_ask, stride_bsn, stride_bsk, eps,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SWAP_AB: tl.constexpr, QUANT_A: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
             EVEN_K: tl.constexpr, SOFT_CVT: tl.constexpr, WIDEN: tl.constexpr, INTERPRET: tl.constexpr,
             ROWCOL: tl.constexpr):
    """fp32 accumulator of one output tile over K blocks [kb_lo, kb_hi)
    ([BLOCK_N, BLOCK_M] when SWAP_AB).  ROWCOL: one scale per row of ``a``
    (``a_s[m * stride_asm]``) and of ``b`` (``b_s[n * stride_bsn]``; stride 0:
    per-tensor), applied once to the raw sum (the scaling is linear, so a
    split's partial may be scaled alone)."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if not A_TMA:
        a_rows = a + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    if not B_TMA:
        b_rows = b + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    as_rows = a_s + offs_m * stride_asm
    if BLOCK_N <= 128:  # the tile sits inside one 128-row weight block
        bs_ptr = b_s + (off_n // 128) * stride_bsn
    else:
        bs_ptr = b_s + (offs_n // 128) * stride_bsn
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k0 = kb * BLOCK_K
        if A_TMA:
            a_t = a.load([off_m, k0])
        elif EVEN_K:
            a_t = tl.load(a_rows + k0, mask=m_mask[:, None], other=0.0)
        else:
            a_t = tl.load(a_rows + k0, mask=m_mask[:, None] & (offs_k + k0 < K)[None, :], other=0.0)
        if B_TMA:
            b_t = b.load([off_n, k0])
        elif EVEN_K:
            b_t = tl.load(b_rows + k0, mask=n_mask[:, None], other=0.0)
        else:
            b_t = tl.load(b_rows + k0, mask=n_mask[:, None] & (offs_k + k0 < K)[None, :], other=0.0)
        if QUANT_A:
            a_t, sa = _quant_rows(a_t.to(tl.float32), eps, False, SOFT_CVT, WIDEN, INTERPRET)
        elif not ROWCOL:
            sa = tl.load(as_rows + kb * stride_ask, mask=m_mask, other=0.0)
        if not ROWCOL:
            if BLOCK_N <= 128:
                sb = tl.load(bs_ptr + kb * stride_bsk)
            else:
                sb = tl.load(bs_ptr + kb * stride_bsk, mask=n_mask, other=0.0)
        if WIDEN:  # sm80: fp16 operands hold value * 2**-8 each
            a_t = fp16_from_e4m3(a_t)
            b_t = fp16_from_e4m3(b_t)
            if not ROWCOL:
                sa = sa * 65536.0
        if ROWCOL:
            # sm90's fp8 MMA accumulates with reduced precision: each K block's
            # MMA sum is added to the fp32 acc (as cuBLAS does without fast
            # accumulation); the limit keeps that if Triton folds the add in.
            if SWAP_AB:
                acc += tl.dot(b_t, tl.trans(a_t), max_num_imprecise_acc=BLOCK_K)
            else:
                acc += tl.dot(a_t, tl.trans(b_t), max_num_imprecise_acc=BLOCK_K)
        elif SWAP_AB:
            if BLOCK_N <= 128:
                acc += tl.dot(b_t, tl.trans(a_t)) * (sb * sa)[None, :]
            else:
                acc += tl.dot(b_t, tl.trans(a_t)) * (sb[:, None] * sa[None, :])
        else:
            if BLOCK_N <= 128:
                acc += tl.dot(a_t, tl.trans(b_t)) * (sa * sb)[:, None]
            else:
                acc += tl.dot(a_t, tl.trans(b_t)) * (sa[:, None] * sb[None, :])
    if ROWCOL:
        sa = tl.load(as_rows, mask=m_mask, other=0.0)
        sb = tl.load(b_s + offs_n * stride_bsn, mask=n_mask, other=0.0)
        if WIDEN:
            sa = sa * 65536.0
        if SWAP_AB:
            acc = acc * (sb[:, None] * sa[None, :])
        else:
            acc = acc * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def _out_store(acc, c, bias, rows, cols, mask, N, stride_cm, HAS_BIAS: tl.constexpr):
    """``acc (+ bias)`` in fp32, one rounding to ``c``'s dtype."""
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(c + rows * stride_cm + cols, acc.to(c.dtype.element_ty), mask=mask)


@triton.jit
def _mm_store(acc, c, ws, bias, counters, M, N, off_m, off_n, pid_k, split_k, tile, stride_cm,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr,
              SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if SWAP_AB:
        rows = offs_m.to(tl.int64)[None, :]
        cols = offs_n[:, None]
    else:
        rows = offs_m.to(tl.int64)[:, None]
        cols = offs_n[None, :]
    mask = (rows < M) & (cols < N)
    if SPLIT:
        total = M.to(tl.int64) * N
        part = ws + rows * N + cols
        tl.store(part + pid_k.to(tl.int64) * total, acc, mask=mask)
        if ONE_LAUNCH:
            # Deterministic split-K in one launch: the program that raises the
            # tile's counter to split_k (acq_rel: the partials stored before
            # the barrier by every split are visible) sums them in split order
            # as splitk_reduce_kernel does (the first partial, not 0.0 + it,
            # keeps -0.0).  The counters are this call's own (zeroed per call).
            tl.debug_barrier()
            count = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
            if count == split_k - 1:
                red = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, split_k):
                    red += tl.load(part + s * total, mask=mask, other=0.0, cache_modifier=".cg")
                _out_store(red, c, bias, rows, cols, mask, N, stride_cm, HAS_BIAS)
    else:
        _out_store(acc, c, bias, rows, cols, mask, N, stride_cm, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "stride_asm", "stride_ask", "split_k"])
def mm_kernel(a, b, c, ws, a_s, b_s, bias, counters, M, N, K, split_k,
               stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk, eps,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr, SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr, SWAP_AB: tl.constexpr,
               QUANT_A: tl.constexpr, HAS_BIAS: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
               EVEN_K: tl.constexpr, PERSISTENT: tl.constexpr,
               WARP_SPEC: tl.constexpr, SOFT_CVT: tl.constexpr, WIDEN: tl.constexpr,
               INTERPRET: tl.constexpr, ROWCOL: tl.constexpr = False):
    kb_total = tl.cdiv(K, BLOCK_K)
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True,
                             warp_specialize=WARP_SPEC):
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = _mm_tile(a, b, a_s, b_s, M, N, K, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, kb_total,
                           stride_am, stride_bn, stride_asm, stride_ask, stride_bsn, stride_bsk, eps,
                           BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, QUANT_A, A_TMA, B_TMA, EVEN_K,
                           SOFT_CVT, WIDEN, INTERPRET, ROWCOL)
            _mm_store(acc, c, ws, bias, counters, M, N, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, 1, tile, stride_cm,
                      BLOCK_M, BLOCK_N, SWAP_AB, False, False, HAS_BIAS)
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        pid_k = tl.program_id(1)
        per_split = tl.cdiv(kb_total, split_k)
        kb_lo = pid_k * per_split
        kb_hi = tl.minimum(kb_lo + per_split, kb_total)
        acc = _mm_tile(a, b, a_s, b_s, M, N, K, pid_m * BLOCK_M, pid_n * BLOCK_N, kb_lo, kb_hi,
                       stride_am, stride_bn, stride_asm, stride_ask, stride_bsn, stride_bsk, eps,
                       BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, QUANT_A, A_TMA, B_TMA, EVEN_K,
                       SOFT_CVT, WIDEN, INTERPRET, ROWCOL)
        _mm_store(acc, c, ws, bias, counters, M, N, pid_m * BLOCK_M, pid_n * BLOCK_N, pid_k, split_k,
                  tl.program_id(0), stride_cm, BLOCK_M, BLOCK_N, SWAP_AB, SPLIT, ONE_LAUNCH, HAS_BIAS)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base and row stride, and rows that do not
    overlap (a broadcast row, stride 0, takes the pointer path)."""
    return (t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(-1) == 1
            and t.stride(0) >= t.shape[1])


def _descriptor(t: torch.Tensor, rows: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [rows, BLOCK_K])


def _pick_config(a, b, m, n, k, fused: bool, out_dtype) -> MMConfig:
    num_sms = _num_sms(a.device)
    return _default_cached(m, n, k, num_sms, fused, _capability(a.device) >= (9, 0) or a.device.type == "cpu")


@functools.lru_cache(maxsize=4096)
def _default_cached(m: int, n: int, k: int, num_sms: int, fused: bool, sm90: bool) -> MMConfig:
    """:func:`default_config` once per size (host time per eager call); call
    ``_default_cached.cache_clear()`` after changing the tuned configs."""
    return default_config(m, n, k, num_sms, fused, sm90)


def run_mm(a, b, a_scales, b_scales, out_dtype, bias, cfg: MMConfig | None, quant_a: bool,
            eps: float = 1e-10, warmup: bool = False, rowcol: bool = False) -> torch.Tensor:
    """Launch ``mm_kernel`` (+ the split-K reduce) on checked arguments.

    ``rowcol``: ``a_scales`` ``[M, 1]`` and ``b_scales`` ``[N, 1]`` views, one
    scale per row (row stride 0: one for all), instead of K-block scales
    (``ops/fp8_triton_mm.py``, the ``fp8_scaled_mm`` launcher).

    Examples
    --------
    >>> a = torch.ones(2, 256, device="cuda").to(FP8_DTYPE)  # doctest: +SKIP
    >>> b = torch.ones(128, 256, device="cuda").to(FP8_DTYPE)  # doctest: +SKIP
    >>> run_mm(a, b, torch.ones(2, 2, device="cuda"), torch.ones(1, 2, device="cuda"), torch.bfloat16,
    ...        None, None, quant_a=False)[0, 0].item()  # doctest: +SKIP
    256.0
    """
    m, k = a.shape
    n = b.shape[0]
    out = base.mm_output(a, b, out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.float().expand(m, n))
    dev = a.device
    if cfg is None:
        cfg = _pick_config(a, b, m, n, k, quant_a, out_dtype)
    ok, why = config_ok(cfg, m, n, k, quant_a)
    if not ok:
        V.fail("fp8_block_mm", "config", "a valid MMConfig", f"{cfg} ({why})")
    soft, widen = _fp8_mode(dev)
    hopper_tma = dev.type == "cpu" or _capability(dev) >= (9, 0)
    a_tma = cfg.tma and hopper_tma and tma_ok(a)
    b_tma = cfg.tma and hopper_tma and tma_ok(b)
    a_arg = _descriptor(a, cfg.block_m) if a_tma else bytes_view(a, widen)
    b_arg = _descriptor(b, cfg.block_n) if b_tma else bytes_view(b, widen)
    split = cfg.split_k
    ws = torch.empty((split, m, n), dtype=torch.float32, device=dev) if split > 1 else out
    bias_arg = bias if bias is not None else out
    if quant_a:
        a_s, sa0, sa1 = out, 0, 0
    else:
        a_s, sa0, sa1 = a_scales, a_scales.stride(0), a_scales.stride(1)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if cfg.persistent:
        grid = (min(tiles, _num_sms(dev)), 1)
    else:
        grid = (tiles, split)
    one_launch = cfg.one_launch and split > 1
    counters = tile_counters(dev, tiles) if one_launch else out

    def launch(kernel, grid, *args, **kwargs):  # warmup: compile only (see precompile)
        if warmup:
            _WARMED.append(kernel.warmup(*args, grid=grid, **kwargs))
        else:
            kernel[grid](*args, **kwargs)

    with _device_guard(dev):
        launch(
            mm_kernel, grid, a_arg, b_arg, out, ws, a_s, b_scales, bias_arg, counters, m, n, k, split,
            a.stride(0), b.stride(0), out.stride(0), sa0, sa1, b_scales.stride(0), b_scales.stride(1),
            float(eps),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m,
            SPLIT=split > 1, ONE_LAUNCH=one_launch, SWAP_AB=cfg.swap_ab, QUANT_A=quant_a, HAS_BIAS=bias is not None,
            A_TMA=a_tma, B_TMA=b_tma, EVEN_K=k % BLOCK_K == 0, PERSISTENT=cfg.persistent,
            WARP_SPEC=cfg.warp_specialize,
            SOFT_CVT=soft, WIDEN=widen, INTERPRET=_INTERPRET, ROWCOL=rowcol,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if split > 1 and not one_launch:
            block = 1024
            launch(
                splitk_reduce_kernel, (triton.cdiv(m * n, block),), ws, out, bias_arg, m, n, out.stride(0), split,
                HAS_BIAS=bias is not None,
                BLOCK=block, num_warps=4)
    return out


def mm(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
       out_dtype: torch.dtype = torch.bfloat16, config: MMConfig | None = None) -> torch.Tensor:
    """FP8 block GEMM ``out[m, n] = sum_j a_s[m, j] b_s[n // 128, j] (a_j . b_j)``:
    the op ``fp8_block_mm`` (e4m3 ``a [M, K]``, ``b [N, K]``; fp32 ``a_scales``
    row- or column-major, ``b_scales`` rows possibly padded) with an optional
    explicit ``config`` (must pass :func:`config_ok`; default per M bucket).

    Examples
    --------
    >>> import torch  # doctest: +SKIP
    >>> a = torch.randn(3, 256, device="cuda").to(torch.float8_e4m3fn)  # doctest: +SKIP
    >>> b = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)  # doctest: +SKIP
    >>> mm(a, b, torch.ones(3, 2, device="cuda"), torch.ones(1, 2, device="cuda")).shape  # doctest: +SKIP
    torch.Size([3, 128])
    """
    base.check_mm_args("fp8_block_mm", a, b, a_scales, b_scales, (128, 128), out_dtype)
    return run_mm(a, b, a_scales, b_scales, out_dtype, None, config, quant_a=False)


def linear(x: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
           bias: torch.Tensor | None = None, config: MMConfig | None = None,
           fuse: bool | None = None) -> torch.Tensor:
    """``fp8_block_linear``: quantize ``x`` per 1 x 128 group, block GEMM, + bias
    in fp32, one rounding.

    ``fuse`` (default: ``M <= FUSE_QUANT_MAX_M``) quantizes inside the GEMM;
    otherwise the quant kernel runs first.  Both give the same bits for the
    same ``config``.

    Examples
    --------
    >>> import torch  # doctest: +SKIP
    >>> x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> w = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)  # doctest: +SKIP
    >>> linear(x, w, torch.ones(1, 2, device="cuda")).shape  # doctest: +SKIP
    torch.Size([2, 128])
    """
    base.check_linear_args(x, b, b_scales, (128, 128), out_dtype, bias)
    return _linear(x, b, b_scales, out_dtype, bias, config, fuse)


def _linear(x, b, b_scales, out_dtype, bias, config, fuse):
    if fuse if fuse is not None else x.shape[0] <= FUSE_QUANT_MAX_M:
        return run_mm(x, b, None, b_scales, out_dtype, bias, config, quant_a=True)
    q, s = per_token_group_quant(x, BLOCK_K)
    return run_mm(q, b, s, b_scales, out_dtype, bias, config, quant_a=False)


def precompile(n: int, k: int, device: torch.device, ms=(1, 16, 64, 128, 512, 1024, 4096), fused=(False, True),
               configs: list[MMConfig] | None = None, workers: int = 8) -> int:
    """Compile (in parallel threads) and load the GEMM kernels that calls of
    these sizes launch (default configs, or ``configs``), so that no first call
    compiles inside a CUDA-graph capture.  Returns the launches prepared.

    Examples
    --------
    >>> precompile(2112, 7168, torch.device("cuda"))  # doctest: +SKIP
    12
    """
    from concurrent.futures import ThreadPoolExecutor

    try:
        from triton.runtime._async_compile import AsyncCompileMode
        mode = AsyncCompileMode(ThreadPoolExecutor(workers))
    except ImportError:  # older Triton: compile one after another
        mode = contextlib.nullcontext()
    b = torch.empty(n, k, dtype=FP8_DTYPE, device=device)
    bs = torch.ones(V.ceil_div(n, BLOCK_K), V.ceil_div(k, BLOCK_K), device=device)
    jobs = 0
    _WARMED.clear()
    with mode:
        for m in ms:
            for f in fused:
                a = torch.empty(m, k, dtype=torch.bfloat16 if f else FP8_DTYPE, device=device)
                sa = torch.ones(V.ceil_div(k, BLOCK_K), m, device=device).t()
                for cfg in configs or [None]:
                    if cfg is None or config_ok(cfg, m, n, k, f)[0]:
                        run_mm(a, b, None if f else sa, bs, torch.bfloat16, None, cfg, f, warmup=True)
                        jobs += 1
    for kern in _WARMED:  # load the modules now too: a first launch would load them
        kern = kern.result() if hasattr(kern, "result") else kern
        if hasattr(kern, "_init_handles"):
            kern._init_handles()
    _WARMED.clear()
    return jobs


# ----------------------------------------------------------------------------
# Backend registration
# ----------------------------------------------------------------------------


def _mm_op(a, b, a_scales, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16):
    return run_mm(a, b, a_scales, b_scales, out_dtype, None, None, quant_a=False)


def _linear_op(x, b, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16, bias=None):
    return _linear(x, b, b_scales, out_dtype, bias, None, None)


backends.register(Backend(
    base.FAMILY, NAME,
    impls={
        "per_token_group_quant_fp8": per_token_group_quant,
        "fp8_block_mm": _mm_op,
        "fp8_block_linear": _linear_op,
    },
    is_supported=is_supported,
    can_implement=can_implement,
    needs_m_multiple=1,
    description="Triton: any M, split-K / swap-AB small-M tiles, TMA + persistent large-M, fused act quant",
))
