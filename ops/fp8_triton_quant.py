"""FP8 activation quantizer in Triton: ``quant_fp8`` of backend ``triton`` of
the ``fp8`` family (SPEC.md "FP8 per-tensor / per-channel GEMM").

The backend registered here also holds ``fp8_scaled_mm``: the fp8_block
Triton GEMM with per-row / per-column scales (``ops/fp8_triton_mm.py``, which
has its ``can_implement``).  Where it sits against cuBLAS in automatic
selection is the policy data (``scaledmm/tuning/fp8_<arch>.json``).
Every mode is bit-identical to ``ops.fp8.reference_quant``: ``x * (1 / s)``
with the reciprocal an IEEE fp32 division (``div_rn``) once per scale, clamp
to +-448 with NaN kept, round to nearest even e4m3.

* static scale (one element, or ``[M, 1]`` with ``per_token=True``): one
  pass, ``scaled_kernel``; the program(s) holding column 0 also copy the
  scale to the returned tensor.
* dynamic per-token: ``token_kernel``, one program per ``block_m`` rows: the
  row amax (NaN propagates), then the codes.  A row wider than ``block_k``
  is walked twice in chunks (amax, then codes; the second pass reads the rows
  back from L1/L2, not DRAM).
* dynamic per-tensor: ``amax_kernel`` (a persistent grid of at most
  ``AMAX_PROGRAMS`` programs, each writing the amax of the finite ``|x|`` of
  its tiles to a partials buffer), then ``scaled_kernel`` in ``DYNAMIC``
  mode: every program reduces the partials (a max: order-free, so
  deterministic), program 0 writes the scale.  Two launches, no host sync,
  no memset.  The second pass walks the tiles backwards, so it starts on
  the tiles the first pass read last (still in L2).  A small input (a
  decode batch, ``ONE_PROGRAM_ELEMENTS``) takes ``tensor_kernel`` instead:
  one program holds all of x as one tile, so amax, scale and codes come
  from one read and one launch (one CUDA-graph node instead of two).

Read top to bottom: capability checks, config space, kernels, launcher,
backend registration; the reference is ``ops.fp8.reference_quant``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from scaledmm import backends
from scaledmm.backends import Backend, Problem
from scaledmm.device import triton_pdl
from scaledmm.oplib import FP8_MAX

from . import fp8 as base
from . import fp8_triton_mm
# Shared with the fp8_block quantizer: how e4m3 is encoded on a device (and
# the interpreter patch, applied when that module is imported).
from .fp8_block_triton_quant import (
    bytes_view,
    _capability,
    _device_gate,
    _device_guard,
    to_e4m3,
    _fp8_mode,
    _next_pow2,
)

__all__ = [
    "NAME",
    "ONE_PROGRAM_ELEMENTS",
    "QuantConfig",
    "config_ok",
    "default_config",
    "candidate_configs",
    "quant",
    "is_supported",
    "can_implement",
]

NAME = "triton"
STATIC, PER_TOKEN, PER_TENSOR = "static", "per_token", "per_tensor"
MODES = (STATIC, PER_TOKEN, PER_TENSOR)
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Programs (and partial maxima) of the per-tensor amax pass: enough to keep
# every SM of an H200 busy (132 SMs x 4), few enough that each program of the
# second pass reduces the partials from L2 in one 2 KB load.  The second pass
# always loads AMAX_PROGRAMS lanes (masked), so its kernel does not depend on M.
AMAX_PROGRAMS = 512
# Per-tensor inputs whose power-of-two tile next_pow2(M) x next_pow2(K) holds
# at most this many elements (a decode batch: M <= 8 at K = 4096, M <= 2 at
# 14336) take the one-program kernel: the whole input in registers (at most
# 64 elements per thread at 16 warps), one launch instead of two.
ONE_PROGRAM_ELEMENTS = 32768

# ----------------------------------------------------------------------------
# Capability checks
# ----------------------------------------------------------------------------


def is_supported(device: torch.device) -> tuple[bool, str]:
    """Whether these kernels run on ``device``: NVIDIA sm80+, or the CPU when
    Triton was imported with ``TRITON_INTERPRET=1``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops import fp8_triton_quant as Q
    >>> from scaledmm.device import interpreting
    >>> Q.is_supported(torch.device("cpu"))[0] == interpreting()
    True
    """
    gate = _device_gate(device)
    if gate is not None:
        return gate
    major, minor = _capability(device)
    if (major, minor) < (8, 9):
        return True, f"sm{major}{minor}: no e4m3 type, codes encoded in integer code and stored as bytes"
    if major == 8:
        return True, "sm89: e4m3 encoded in integer code (Triton's cast rounds twice here)"
    return True, f"sm{major}{minor}: hardware e4m3 conversion (cvt.rn.satfinite)"


def can_implement(p: Problem) -> tuple[bool, str]:
    """``quant_fp8`` problems (``p.opt("quant")`` names the mode: any M, K and
    row stride); ``fp8_scaled_mm`` problems (no ``quant`` option) answer
    ``fp8_triton_mm.can_implement``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.backends import Family, Problem
    >>> can_implement(Problem(Family.FP8, torch.device("cpu"), 4, 0, 64, torch.bfloat16,
    ...                       torch.float8_e4m3fn, 64, (("quant", "per_token"),)))
    (True, 'per_token: any M, K, row stride')
    """
    mode = p.opt("quant")
    if mode is None:
        return fp8_triton_mm.can_implement(p)
    if mode not in MODES:
        return False, f"quant mode one of {MODES}, got {mode!r}"
    if p.in_dtype not in IN_DTYPES:
        return False, f"quantizes bf16/fp16/fp32, got {p.in_dtype}"
    return True, f"{mode}: any M, K, row stride"


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Tile of one program: ``block_m`` rows x ``block_k`` columns, ``num_warps``.

    Static and per-tensor modes tile ``[M, K]`` with it; per-token mode gives
    each program ``block_m`` whole rows and walks them ``block_k`` columns at
    a time (one pass when ``K <= block_k``)."""

    block_m: int = 8
    block_k: int = 1024
    num_warps: int = 8

    def label(self) -> str:
        return f"{self.block_m}x{self.block_k}w{self.num_warps}"


# Elements per thread of one tile: >= 8 gives 16-byte bf16 loads; <= 64 keeps
# the tile (and the per-token running max) in registers.
MIN_PER_THREAD, MAX_PER_THREAD = 1, 64


def config_ok(cfg: QuantConfig) -> tuple[bool, str]:
    """The one validity predicate of the configs (dispatch, benchmark, tests).

    Examples
    --------
    >>> from scaledmm.ops.fp8_triton_quant import QuantConfig, config_ok
    >>> config_ok(QuantConfig(8, 1024, 8))[0], config_ok(QuantConfig(3, 1024, 8))[0]
    (True, False)
    """
    vals = (cfg.block_m, cfg.block_k, cfg.num_warps)
    if not all(isinstance(v, int) and v > 0 and v & (v - 1) == 0 for v in vals):
        return False, f"block_m, block_k, num_warps must be powers of two, got {cfg.label()}"
    if cfg.num_warps > 16 or cfg.block_k < 16:
        return False, f"needs num_warps <= 16 and block_k >= 16, got {cfg.label()}"
    per_thread = cfg.block_m * cfg.block_k / (32 * cfg.num_warps)
    if not MIN_PER_THREAD <= per_thread <= MAX_PER_THREAD:
        return False, (f"needs {MIN_PER_THREAD}..{MAX_PER_THREAD} elements per thread "
                       f"(block_m * block_k / (32 * num_warps)), got {per_thread:g} for {cfg.label()}")
    return True, "ok"


def default_config(mode: str, m: int, k: int) -> QuantConfig:
    """The config ``quant`` uses for ``mode`` and an ``[m, k]`` input.

    Measured on the H200 (``benchmarks/experiments/fp8_quant.py``, bf16, K = 7168
    and 16384; NOTES.md "quant_fp8"): static scales 1 x 1024 tiles up to
    M = 256 (many programs across K), 4 x 1024 beyond (26.0 us at 4096 x
    7168 = 82% of copy); per-token dynamic whole rows of up to 8192 (16
    warps) up to M = 256 or K = 4096, then 1024-wide chunks (the row read
    twice, the second time from L2: 34 us against 45 us one-pass at 4096 x
    7168), 4096 for K > 8192; per-tensor dynamic 1 x 1024 up to M = 64, 2 x 1024 up to
    512, 8 x 1024 beyond.

    Examples
    --------
    >>> from scaledmm.ops.fp8_triton_quant import default_config
    >>> default_config("per_token", 4096, 7168).label(), default_config("static", 1, 7168).label()
    ('1x1024w4', '1x1024w4')
    """
    if mode == PER_TOKEN:
        if m <= 256 or k <= 4096:
            bk = min(max(_next_pow2(k), 256), 8192)
            bm = max(1, min(8, 2048 // bk, _next_pow2(m)))
            return QuantConfig(bm, bk, 16 if bk == 8192 else max(1, min(8, bm * bk // 1024)))
        return QuantConfig(1, 1024, 4) if k <= 8192 else QuantConfig(1, 4096, 8)
    if mode == STATIC:
        return QuantConfig(1, 1024, 4) if m <= 256 else QuantConfig(4, 1024, 4)
    if m <= 64:
        return QuantConfig(1, 1024, 4)
    if m <= 512:
        return QuantConfig(2, 1024, 4)
    return QuantConfig(8, 1024, 8)


CANDIDATES = (
    QuantConfig(1, 512, 2), QuantConfig(1, 1024, 4), QuantConfig(2, 1024, 4), QuantConfig(4, 1024, 4),
    QuantConfig(8, 1024, 8), QuantConfig(4, 2048, 8), QuantConfig(16, 512, 8), QuantConfig(1, 2048, 8),
    QuantConfig(1, 4096, 8), QuantConfig(1, 8192, 8), QuantConfig(2, 4096, 8), QuantConfig(1, 8192, 16),
    QuantConfig(1, 16384, 16),
)


def candidate_configs(mode: str, m: int, k: int) -> list[QuantConfig]:
    """The configs worth timing for ``mode`` at ``[m, k]`` (all valid; tiles
    no taller than M, no wider than K needs), the default first."""
    out = [default_config(mode, m, k)]
    for c in CANDIDATES:
        if c in out or c.block_m > _next_pow2(max(m, 1)) or c.block_k > max(_next_pow2(k), 512):
            continue
        out.append(c)
    return [c for c in out if config_ok(c)[0]]


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _scale_of(amax, floor):
    """max(amax, floor) / 448 in fp32 (NaN propagates)."""
    return tl.math.div_rn(tl.maximum(amax, floor, propagate_nan=tl.PropagateNan.ALL), 448.0)


@triton.jit(do_not_specialize=["M", "tiles_k", "n_tiles", "n_part", "stride_sm"])
def scaled_kernel(x_ptr, q_ptr, s_ptr, so_ptr, part_ptr, M, K, stride_xm, stride_sm, tiles_k, n_tiles, n_part,
                   floor, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_SCALE: tl.constexpr,
                   DYNAMIC: tl.constexpr, NP: tl.constexpr, REVERSE: tl.constexpr,
                   SOFT_CVT: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr = False):
    """One ``[BLOCK_M, BLOCK_K]`` tile with a known scale: the static one
    (``s_ptr``: one element, or a row's at ``stride_sm`` with ROW_SCALE), or
    (DYNAMIC) the per-tensor one from the ``n_part`` partial maxima."""
    if PDL:  # scaledmm.device.pdl
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    tile = n_tiles - 1 - pid if REVERSE else pid
    pid_m = tile // tiles_k
    pid_k = tile % tiles_k
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < M
    mask = rmask[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if DYNAMIC:
        p = tl.load(part_ptr + tl.arange(0, NP), mask=tl.arange(0, NP) < n_part, other=0.0)
        s = _scale_of(tl.max(p, 0), floor)
        if pid == 0:
            tl.store(so_ptr, s)
        q = to_e4m3(x.to(tl.float32), s, SOFT_CVT, WIDEN, True)
    elif ROW_SCALE:
        s = tl.load(s_ptr + rows64 * stride_sm, mask=rmask, other=1.0)
        if pid_k == 0:
            tl.store(so_ptr + rows, s, mask=rmask)
        q = to_e4m3(x.to(tl.float32), s[:, None], SOFT_CVT, WIDEN, True)
    else:
        s = tl.load(s_ptr)
        if pid == 0:
            tl.store(so_ptr, s)
        q = to_e4m3(x.to(tl.float32), s, SOFT_CVT, WIDEN, True)
    tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q, mask=mask)


@triton.jit(do_not_specialize=["M", "tiles_k", "n_tiles"])
def amax_kernel(x_ptr, part_ptr, M, K, stride_xm, tiles_k, n_tiles,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Per-tensor pass 1: program p writes max |x| over the finite elements
    of tiles p, p + P, p + 2P, ... (P programs) to ``part_ptr[p]``."""
    if PDL:  # scaledmm.device.pdl
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        rows = (tile // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        ax = tl.abs(x.to(tl.float32))
        acc = tl.maximum(acc, tl.where(ax < float("inf"), ax, 0.0))  # NaN < inf is false: left out too
    tl.store(part_ptr + pid, tl.max(tl.max(acc, 1), 0))


@triton.jit(do_not_specialize=["M"])
def tensor_kernel(x_ptr, q_ptr, so_ptr, M, K, stride_xm, floor, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  SOFT_CVT: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr = False):
    """Dynamic per-tensor in one program holding the whole ``[M, K]`` input
    as one tile: the amax of its finite ``|x|``, the scale, the codes (x is
    read once)."""
    if PDL:  # scaledmm.device.pdl
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    s = _scale_of(tl.max(tl.max(tl.where(ax < float("inf"), ax, 0.0), 1), 0), floor)  # NaN < inf is false
    tl.store(so_ptr, s)
    tl.store(q_ptr + rows64[:, None] * K + cols[None, :], to_e4m3(x, s, SOFT_CVT, WIDEN, True), mask=mask)


@triton.jit
def _row_amax(ax):
    """Max of each row of a non-negative tile, NaN if the row holds one (the
    hardware max ignores NaN: add it back)."""
    amax = tl.max(ax, 1)
    return tl.where(tl.max((ax != ax).to(tl.int32), 1) > 0, float("nan"), amax)


@triton.jit(do_not_specialize=["M"])
def token_kernel(x_ptr, q_ptr, so_ptr, M, K, stride_xm, floor, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  ONE_PASS: tl.constexpr, SOFT_CVT: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr = False):
    """Dynamic per-token: rows ``[pid * BLOCK_M, +BLOCK_M)``, their scales
    ``max(amax, floor) / 448`` and codes."""
    if PDL:  # scaledmm.device.pdl
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # the whole row is one tile: read x once
        mask = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = _scale_of(_row_amax(tl.abs(x)), floor)
        tl.store(q_rows + cols[None, :], to_e4m3(x, s[:, None], SOFT_CVT, WIDEN, True), mask=mask)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = rmask[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_rows + (k0 + cols)[None, :], mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)), propagate_nan=tl.PropagateNan.ALL)
        s = _scale_of(_row_amax(acc), floor)
        for k0 in range(0, K, BLOCK_K):
            mask = rmask[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_rows + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + (k0 + cols)[None, :], to_e4m3(x, s[:, None], SOFT_CVT, WIDEN, True), mask=mask)
    tl.store(so_ptr + rows, s, mask=rmask)


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def quant_mode(scale: torch.Tensor | None, per_token: bool) -> str:
    """The quantization mode of a ``quant_fp8`` call: ``static`` when a scale
    is given, else ``per_token`` or ``per_tensor``.

    Examples
    --------
    >>> quant_mode(None, per_token=True)
    'per_token'
    """
    return STATIC if scale is not None else (PER_TOKEN if per_token else PER_TENSOR)


def quant(x: torch.Tensor, scale: torch.Tensor | None = None, per_token: bool = False,
          config: QuantConfig | None = None, reverse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_fp8`` on Triton: e4m3 codes of ``x`` (bf16/fp16/fp32 ``[M, K]``,
    any row stride) and the scale that decodes them, bit-identical to
    ``ops.fp8.reference_quant``.

    Parameters
    ----------
    x : torch.Tensor
        Activation ``[M, K]`` with ``x.stride(1) == 1``.
    scale : torch.Tensor, optional
        Static scale: one element, or ``[M, 1]`` with ``per_token=True``.
    per_token : bool
        Without ``scale``: dynamic per-token (``[M, 1]``) instead of per-tensor (``[1]``).
    config : QuantConfig, optional
        Tile config (default: :func:`default_config`); must pass :func:`config_ok`.
        Given for per-tensor mode, it always takes the two-launch kernels.
    reverse : bool
        Per-tensor mode above ``ONE_PROGRAM_ELEMENTS``: walk the tiles
        backwards in the second pass (a tuning knob).

    Returns
    -------
    (q, scale) : contiguous e4m3 ``[M, K]`` and float32 scales shaped as
    ``ops.fp8.quant_outputs`` allocates them.

    Examples
    --------
    >>> import torch  # doctest: +SKIP
    >>> from scaledmm.ops.fp8_triton_quant import quant  # doctest: +SKIP
    >>> q, s = quant(torch.randn(3, 7168, device="cuda", dtype=torch.bfloat16), per_token=True)  # doctest: +SKIP
    >>> tuple(q.shape), tuple(s.shape)  # doctest: +SKIP
    ((3, 7168), (3, 1))
    """
    q, s_out = base.quant_outputs(x, scale, per_token)
    m, k = x.shape
    if m == 0 or k == 0:  # nothing to encode; the scale still follows the reference (torch ops, no sync)
        return base.reference_quant(x, scale, per_token)
    mode = quant_mode(scale, per_token)
    cfg = config or default_config(mode, m, k)
    ok, why = config_ok(cfg)
    if not ok:
        raise ValueError(f"quant_fp8: config: expected a valid QuantConfig, got {cfg.label()} ({why})")
    soft, widen = _fp8_mode(x.device)
    qv = bytes_view(q, widen)
    bm, bk, nw = cfg.block_m, cfg.block_k, cfg.num_warps
    floor = float(base.AMAX_FLOOR)
    pdl = triton_pdl(x.device)
    with _device_guard(x.device):
        if mode == PER_TOKEN:
            token_kernel[(triton.cdiv(m, bm),)](
                x, qv, s_out, m, k, x.stride(0), floor, BLOCK_M=bm, BLOCK_K=bk, ONE_PASS=k <= bk,
                SOFT_CVT=soft, WIDEN=widen, num_warps=nw, **pdl)
            return q, s_out
        tiles_k = triton.cdiv(k, bk)
        n_tiles = triton.cdiv(m, bm) * tiles_k
        if mode == STATIC:
            row = bool(per_token)
            scaled_kernel[(n_tiles,)](
                x, qv, scale, s_out, s_out, m, k, x.stride(0), scale.stride(0) if row else 0, tiles_k, n_tiles, 0,
                floor, BLOCK_M=bm, BLOCK_K=bk, ROW_SCALE=row, DYNAMIC=False, NP=1, REVERSE=False,
                SOFT_CVT=soft, WIDEN=widen, num_warps=nw, **pdl)
            return q, s_out
        tile_m, tile_k = _next_pow2(m), _next_pow2(k)
        if config is None and tile_m * tile_k <= ONE_PROGRAM_ELEMENTS:
            tensor_kernel[(1,)](x, qv, s_out, m, k, x.stride(0), floor, BLOCK_M=tile_m, BLOCK_K=tile_k,
                                SOFT_CVT=soft, WIDEN=widen, num_warps=max(4, min(16, tile_m * tile_k // 2048)),
                                **pdl)
            return q, s_out
        n_part = min(n_tiles, AMAX_PROGRAMS)
        part = torch.empty(n_part, dtype=torch.float32, device=x.device)
        amax_kernel[(n_part,)](x, part, m, k, x.stride(0), tiles_k, n_tiles, BLOCK_M=bm, BLOCK_K=bk,
                                num_warps=nw, **pdl)
        scaled_kernel[(n_tiles,)](
            x, qv, s_out, s_out, part, m, k, x.stride(0), 0, tiles_k, n_tiles, n_part, floor,
            BLOCK_M=bm, BLOCK_K=bk, ROW_SCALE=False, DYNAMIC=True, NP=_next_pow2(AMAX_PROGRAMS),
            REVERSE=bool(reverse),
            SOFT_CVT=soft, WIDEN=widen, num_warps=nw, **pdl)
    return q, s_out


def _quant_op(x: torch.Tensor, scale: torch.Tensor | None = None, per_token: bool = False):
    return quant(x, scale, per_token)


# ----------------------------------------------------------------------------
# Backend registration (the reference is ops.fp8.reference_quant)
# ----------------------------------------------------------------------------

assert FP8_MAX == 448.0  # the kernels hard-code e4m3's largest finite value

backends.register(Backend(
    base.FAMILY, NAME,
    impls={"quant_fp8": _quant_op, "fp8_scaled_mm": fp8_triton_mm.mm},
    is_supported=is_supported,
    can_implement=can_implement,
    description="Triton quant_fp8 (static / per-token / per-tensor) and fp8_scaled_mm (fp8_block GEMM, "
                "row/column scales after the K loop; any M, split-K / swap-AB small-M tiles)",
))
