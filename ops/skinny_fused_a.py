"""Backend ``fused_a`` of the ``skinny`` family: our CUDA kernels for
``dsv3_fused_a_gemm``, compiled at run time with NVRTC for the (N, K, config,
M bucket) they meet, cached on disk (``scaledmm.jit``), launched on torch's
current stream, optionally with programmatic dependent launch (PDL).

Two kernels, one config class each:

* ``csrc/dsv3_fused_a_gemm.cu`` (:class:`RegConfig`, version 1, the
  default): every warp loads its fragments from global memory straight into
  registers.  Its table ``REG_TUNING`` was measured on the H200 (10.3 us at
  7168->2112, M = 1; ``benchmarks/NOTES.md``).
* ``csrc/dsv3_fused_a_gemm_tma.cu`` (:class:`TmaConfig`, opt-in with
  ``SCALEDMM_SKINNY_KERNEL=tma``): a producer warp streams the weight (and x)
  through a shared-memory ring with TMA bulk copies; consumer warps run
  ``mma.sync`` from shared memory.  Measured at 19.0 us on the same shape
  with its predicted table: to be tuned (``benchmarks/experiments/skinny.py``).

Read top to bottom: capability checks, the config space (two frozen
dataclasses, one validity predicate :func:`config_valid` shared by dispatch,
the tuning tables, the benchmark and the tests), the H200 tuning tables, the
launcher, backend registration, the pre-build hook
(``python -m scaledmm.jit build --skinny 2112:7168``).

Examples
--------
>>> from scaledmm.ops import skinny_fused_a as fa
>>> cfg = fa.choose_config(2112, 7168, m=4)
>>> fa.config_valid(cfg, 2112, 7168, m_bucket=8)
(True, 'ok')
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from pathlib import Path
from typing import Union

import torch

from scaledmm import backends, env, jit, kernel_tuning
from scaledmm.device import NUM_SMS_H200, sm_count
from scaledmm.backends import Backend, Problem
from scaledmm.ops import skinny

NAME = "fused_a"
ARCH = "sm_90a"
M_BUCKETS = (8, 16)

# ----------------------------------------------------------------------------
# Capability checks
# ----------------------------------------------------------------------------


def source_path(file: str) -> Path:
    """A kernel source, in the repo (editable install) or the installed package.

    Examples
    --------
    >>> from scaledmm.ops import skinny_fused_a as fa
    >>> fa.source_path("dsv3_fused_a_gemm.cu").name
    'dsv3_fused_a_gemm.cu'
    """
    return jit._package_csrc() / file


def is_supported(device: torch.device) -> tuple[bool, str]:
    ok, why = jit.sm90a_gate(device)
    return (True, f"NVRTC-compiled TMA + mma.sync kernel ({why})") if ok else (False, why)


def can_implement(p: Problem) -> tuple[bool, str]:
    if p.in_dtype != torch.bfloat16:
        return False, f"needs bf16 x, got {p.in_dtype}"
    if not 1 <= p.m <= skinny.MAX_M:
        return False, f"needs 1 <= M <= {skinny.MAX_M}, got M={p.m}"
    if p.n % 16 != 0 or p.k % 128 != 0 or p.k == 0:
        return False, f"needs N % 16 == 0 and K a positive multiple of 128, got N={p.n}, K={p.k}"
    if p.m > 1 and p.a_row_stride % 8 != 0:
        return False, f"needs a row stride that is a multiple of 8, got {p.a_row_stride}"
    if not p.opt("aligned16", True):
        return False, "needs 16-byte aligned x and weight data pointers"
    return True, "ok"


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------

SMEM_PER_SM = 228 * 1024  # H100 / H200 shared memory per SM
SMEM_PER_CTA = 227 * 1024  # the most one CTA may ask for
SMEM_RESERVED = 1024  # per resident CTA
SMEM_TWO_PER_SM = SMEM_PER_SM // 2 - SMEM_RESERVED  # 115712: two CTAs fit on one SM
REGS_PER_SM = 65536
MAX_REGS = 255
SMEM_STATIC_V1 = 48 * 1024


@dataclasses.dataclass(frozen=True)
class TmaConfig:
    """Compile-time configuration of the TMA-ring kernel (``dsv3_fused_a_gemm_tma``).

    Parameters
    ----------
    rows : int
        Weight rows per tile (16, 32, 48, 64).
    split_k : int
        1: a persistent grid of ``min(tiles, SMs * ctas_per_sm)`` CTAs loops
        over the tiles; 2..8: one tile per thread-block cluster of ``split_k``
        CTAs that split K (partials added through DSMEM).
    chunk : int
        K per pipeline stage (multiple of 64, at most 2048).
    stages : int
        Depth of the shared-memory ring.
    warps : int
        Consumer (MMA) warps; a multiple or a divisor of ``rows // 16``.  One
        more warp issues the copies.
    x_resident : bool
        Copy the CTA's x range into shared memory once (stages carry only
        weight) instead of one x chunk per stage.
    ctas_per_sm : int
        Persistent grid size per SM (``split_k == 1`` only; 1 or 2).
    """

    rows: int = 32
    split_k: int = 2
    chunk: int = 256
    stages: int = 4
    warps: int = 4
    x_resident: bool = False
    ctas_per_sm: int = 1

    kernel = "dsv3_fused_a_gemm_tma"
    source = "dsv3_fused_a_gemm_tma.cu"

    def layout(self, n: int, k: int, m_bucket: int) -> dict[str, int]:
        """The kernel's shared-memory layout in bytes (mirrors the ``constexpr``s
        of the .cu file, which checks the total against ``FA_SMEM_BYTES``)."""
        nt = self.rows // 16
        tg = min(self.warps, nt)
        kw = self.warps // tg
        chunks = -(-k // self.chunk)
        rank_chunks = -(-chunks // self.split_k)
        pitch = self.chunk * 2 + 64
        xpitch = rank_chunks * self.chunk * 2 + 64
        stage_w = self.rows * pitch
        stage = stage_w + (0 if self.x_resident else m_bucket * pitch)
        xres = m_bucket * xpitch if self.x_resident else 0
        tile = self.rows * m_bucket
        red = 2 * kw * tile * 4 if kw > 1 else 0
        inbox = self.split_k * -(-tile // self.split_k) * 4 if self.split_k > 1 else 0
        ring = self.stages * stage
        return {"pitch": pitch, "stage_w": stage_w, "stage": stage, "ring": ring, "xres": xres, "red": red,
                "inbox": inbox, "kgroups": kw, "chunks": chunks,
                "smem": ring + xres + red + inbox + (2 * self.stages + 1) * 8}

    def smem_bytes(self, n: int, k: int, m_bucket: int) -> int:
        return self.layout(n, k, m_bucket)["smem"]

    def weight_in_flight(self, n: int, k: int, m_bucket: int) -> int:
        """Weight bytes one CTA can have requested and not yet consumed."""
        return self.stages * self.rows * self.chunk * 2

    def threads(self) -> int:
        return 32 * (self.warps + 1)

    def tiles(self, n: int) -> int:
        return -(-n // self.rows)

    def grid(self, n: int, num_sms: int = NUM_SMS_H200) -> tuple[int, int]:
        if self.split_k > 1:
            return (self.tiles(n), self.split_k)
        return (min(self.tiles(n), num_sms * self.ctas_per_sm), 1)

    def defines(self, n: int, k: int, m_bucket: int) -> dict[str, int]:
        return {"FA_N": n, "FA_K": k, "FA_ROWS": self.rows, "FA_SPLIT_K": self.split_k, "FA_CHUNK": self.chunk,
                "FA_STAGES": self.stages, "FA_WARPS": self.warps, "FA_MB": m_bucket,
                "FA_XRES": int(self.x_resident), "FA_SMEM_BYTES": self.smem_bytes(n, k, m_bucket)}

    def short(self) -> str:
        s = f"r{self.rows}s{self.split_k}c{self.chunk}x{self.stages}w{self.warps}"
        return s + ("X" if self.x_resident else "") + (f"p{self.ctas_per_sm}" if self.ctas_per_sm != 1 else "")


@dataclasses.dataclass(frozen=True)
class RegConfig:
    """Compile-time configuration of the register kernel (version 1,
    ``dsv3_fused_a_gemm``): ``rows`` weight rows per CTA, ``warps`` splitting
    K, ``split_k`` CTAs per cluster, ``unroll`` 32-wide units per register
    batch (two batches in flight), ``prefetch``: TMA L2 prefetch of the CTA's
    whole slice at start."""

    rows: int = 16
    warps: int = 8
    split_k: int = 1
    unroll: int = 4
    prefetch: bool = False

    kernel = "dsv3_fused_a_gemm"
    source = "dsv3_fused_a_gemm.cu"

    def registers(self, m_bucket: int) -> int:
        """Estimated registers per thread (two register batches + accumulators)."""
        nt, mf = self.rows // 16, m_bucket // 8
        return 2 * self.unroll * (2 * nt + mf) * 4 + nt * mf * 4 + 40

    def smem_bytes(self, n: int, k: int, m_bucket: int) -> int:
        return 0  # static shared memory only

    def weight_in_flight(self, n: int, k: int, m_bucket: int) -> int:
        return 2 * self.unroll * self.rows * 64 * self.warps  # two register batches per warp

    def threads(self) -> int:
        return 32 * self.warps

    def grid(self, n: int, num_sms: int = NUM_SMS_H200) -> tuple[int, int]:
        return (-(-n // self.rows), self.split_k)

    def defines(self, n: int, k: int, m_bucket: int) -> dict[str, int]:
        return {"FA_N": n, "FA_K": k, "FA_ROWS": self.rows, "FA_WARPS": self.warps,
                "FA_SPLIT_K": self.split_k, "FA_UNROLL": self.unroll, "FA_MB": m_bucket,
                "FA_PREFETCH": int(self.prefetch)}

    def short(self) -> str:
        return f"v1:r{self.rows}w{self.warps}s{self.split_k}u{self.unroll}{'p' if self.prefetch else ''}"


Config = Union[TmaConfig, RegConfig]


def config_valid(cfg: Config, n: int, k: int, m_bucket: int) -> tuple[bool, str]:
    """THE validity predicate of a config for a shape (dispatch, tuning tables,
    benchmark and tests all use it).  Mirrors the kernels' static_asserts and
    the resource limits (shared memory; registers for version 1)."""
    if m_bucket not in M_BUCKETS:
        return False, f"m_bucket must be one of {M_BUCKETS}, got {m_bucket}"
    if n <= 0 or n % 16 != 0 or k <= 0 or k % 128 != 0:
        return False, f"needs N % 16 == 0 and K % 128 == 0 (both > 0), got N={n}, K={k}"
    if isinstance(cfg, TmaConfig):
        nt = cfg.rows // 16
        if cfg.rows not in (16, 32, 48, 64):
            return False, f"rows must be 16, 32, 48 or 64, got {cfg.rows}"
        if not 1 <= cfg.split_k <= 8:
            return False, f"split_k must be 1..8, got {cfg.split_k}"
        if cfg.chunk % 64 != 0 or not 64 <= cfg.chunk <= 2048:
            return False, f"chunk must be a multiple of 64 in [64, 2048], got {cfg.chunk}"
        if not 1 <= cfg.stages <= 16:
            return False, f"stages must be 1..16, got {cfg.stages}"
        if not 1 <= cfg.warps <= 8 or (cfg.warps % nt != 0 and nt % cfg.warps != 0):
            return False, f"warps must be 1..8 and a multiple or a divisor of rows/16 = {nt}, got {cfg.warps}"
        if cfg.ctas_per_sm not in (1, 2) or (cfg.ctas_per_sm != 1 and cfg.split_k != 1):
            return False, f"ctas_per_sm must be 1, or 2 with split_k == 1, got {cfg.ctas_per_sm}"
        lay = cfg.layout(n, k, m_bucket)
        if lay["chunks"] < cfg.split_k:
            return False, f"split_k {cfg.split_k} exceeds the {lay['chunks']} K chunks of {cfg.chunk}"
        if (cfg.chunk // 32) > 16 * lay["kgroups"]:
            return False, f"chunk {cfg.chunk} gives over 16 units per warp per stage (code size)"
        smem = lay["smem"]
        if smem > SMEM_PER_CTA:
            return False, f"{smem} bytes of shared memory, over {SMEM_PER_CTA}"
        if cfg.ctas_per_sm * (smem + SMEM_RESERVED) > SMEM_PER_SM:
            return False, f"{cfg.ctas_per_sm} CTAs of {smem} bytes do not fit one SM"
        return True, "ok"
    if isinstance(cfg, RegConfig):
        if cfg.rows not in (16, 32, 64):
            return False, f"rows must be 16, 32 or 64, got {cfg.rows}"
        if cfg.split_k not in (1, 2, 4, 8):
            return False, f"split_k must be 1, 2, 4 or 8, got {cfg.split_k}"
        if not 1 <= cfg.warps <= 16:
            return False, f"warps must be 1..16, got {cfg.warps}"
        if not 1 <= cfg.unroll <= 8:
            return False, f"unroll must be 1..8, got {cfg.unroll}"
        limit = min(MAX_REGS, REGS_PER_SM // (32 * cfg.warps))
        if cfg.registers(m_bucket) > limit:
            return False, f"about {cfg.registers(m_bucket)} registers per thread, over the limit {limit}"
        if cfg.warps * cfg.rows * m_bucket * 4 > SMEM_STATIC_V1:
            return False, "reduction buffer over 48 KiB of shared memory"
        if k // 32 < cfg.split_k:
            return False, f"split_k {cfg.split_k} exceeds the {k // 32} 32-wide K units"
        return True, "ok"
    return False, f"expected a TmaConfig or RegConfig, got {type(cfg).__name__}"


def m_bucket(m: int) -> int:
    return 8 if m <= 8 else 16


# ----------------------------------------------------------------------------
# H200 tables (scaledmm/tuning/kernels/skinny_fused_a[_tma]_sm90.json, read by
# tuned()).  TUNING: the TMA kernel's config per (N, K) and M bucket
# (predictions until benchmarks/experiments/skinny.py has timed them; see
# benchmarks/NOTES.md).  A PDL launch runs pdl_config() of it: the same tiles
# and chunks (so the same summation order: PDL on and off give identical
# bits) with the ring cut to SMEM_TWO_PER_SM, so that the next launch's CTAs
# fit beside this one's and fill their rings while it finishes.
# REG_TUNING: version 1's measured best configs (us with PDL, back-to-back
# graph replay; provenance in benchmarks/NOTES.md).
# ----------------------------------------------------------------------------

def _table(tma: bool) -> kernel_tuning.KernelTable:
    if tma:
        return kernel_tuning.load("skinny_fused_a_tma", "sm90", TmaConfig)
    return kernel_tuning.load("skinny_fused_a", "sm90", RegConfig)


def tuned(n: int, k: int, m_bucket: int, tma: bool = False) -> Config | None:
    """The table's config (version 2's with ``tma``) for an ``N x K`` weight
    and M bucket, or None (read once from
    ``scaledmm/tuning/kernels/skinny_fused_a[_tma]_sm90.json``).

    Examples
    --------
    >>> tuned(2112, 7168, 16), tuned(64, 128, 8)
    (RegConfig(rows=16, warps=8, split_k=2, unroll=2, prefetch=False), None)
    """
    return _table(tma).lookup(n, k, m_bucket)


def __getattr__(name: str):
    # TUNING (version 2) / REG_TUNING (version 1): {(n, k): {m_bucket: config}}
    if name in ("TUNING", "REG_TUNING"):
        return _table(name == "TUNING").by_shape()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tile_shapes(n: int, k: int, m_bucket: int, num_sms: int) -> list[tuple[float, int, int]]:
    """(cost, rows, split_k) of every tile shape, cheapest first.

    The cost (arbitrary units) is the larger of all weight bytes at the
    device's bandwidth and the busiest CTA's bytes at twice its fair share of
    it, plus x traffic from L2 at a sixth of the price and 2 % per extra
    cluster rank.  Split-K grids must fit one wave.
    """
    total = n * k * 2
    out = []
    for rows in (64, 48, 32, 16):
        tiles = -(-n // rows)
        for split in (1, 2, 4, 8):
            if k // 128 < split:
                break
            ctas = min(tiles, num_sms) if split == 1 else tiles * split
            if ctas > num_sms:
                continue
            busiest = (-(-tiles // ctas) if split == 1 else 1) * rows * -(-k // split) * 2
            x_traffic = tiles * split * m_bucket * -(-k // split) * 2
            out.append((max(total, busiest * num_sms / 2) + x_traffic / 6 + 0.02 * total * (split - 1), rows, split))
    return sorted(out)


def _ring_config(rows: int, split: int, chunk: int, n: int, k: int, m_bucket: int, budget: int,
                 num_sms: int = NUM_SMS_H200, ctas_per_sm: int = 1) -> TmaConfig | None:
    """The tile shape with the deepest ring (2..8 stages, at most the chunks
    one CTA streams) within ``budget`` bytes of shared memory, or None.  Four
    consumer warps (rows 48: three; twice rows / 16 when a chunk would give a
    warp over 16 units); x resident for persistent grids when it takes at
    most 64 KiB."""
    nt = rows // 16
    warps = 4 if nt in (1, 2, 4) else nt
    if chunk // 32 > 16 * (warps // min(warps, nt)):
        warps = 2 * nt  # two k-groups (rows 48 / 64 with long chunks)
    tiles = -(-n // rows)
    ctas = tiles * split if split > 1 else min(tiles, num_sms * ctas_per_sm)
    xres = split == 1 and tiles > ctas and m_bucket * (k * 2 + 64) <= 64 * 1024
    cap = -(-(-(-k // chunk)) // split) * -(-tiles // ctas)
    best = None
    for stages in range(2, min(8, max(2, cap)) + 1):
        cfg = TmaConfig(rows, split, chunk, stages, warps, xres, ctas_per_sm)
        if cfg.smem_bytes(n, k, m_bucket) > budget or not config_valid(cfg, n, k, m_bucket)[0]:
            break
        best = cfg
    return best


def default_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200) -> TmaConfig:
    """A config for an unseen shape: the cheapest tile shape of a small cost
    model (:func:`_tile_shapes`) with the deepest ring (<= 8 stages) that fits
    200 KiB of shared memory."""
    budget = 200 * 1024
    for _, rows, split in _tile_shapes(n, k, m_bucket, num_sms):
        cfg = _ring_config(rows, split, 256 if k // split >= 1024 else 128, n, k, m_bucket, budget, num_sms)
        if cfg is not None:
            return cfg
    return TmaConfig(16, 1, 128, 2, 4)


def pdl_config(cfg: Config, n: int, k: int, m_bucket: int) -> Config:
    """The config a PDL launch uses: ``cfg`` with its ring cut (to no fewer
    than two stages) until two CTAs fit one SM; same tiles, same bits."""
    if not isinstance(cfg, TmaConfig):
        return cfg
    while cfg.stages > 2 and cfg.smem_bytes(n, k, m_bucket) > SMEM_TWO_PER_SM:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


def reg_default_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200) -> RegConfig:
    """Version 1's config for an unseen shape: 16-row tiles; split K
    (clusters) until about one wave of CTAs fills the GPU; the deepest
    register batch that still gives each warp two batches."""
    tiles = -(-n // 16)
    units = k // 32
    split = 1
    while tiles * split < num_sms and split < 8 and units >= 2 * split * 8:
        split *= 2
    for warps in (8, 4, 2):
        for unroll in (4, 2, 1):
            cfg = RegConfig(16, warps, split, unroll, False)
            if config_valid(cfg, n, k, m_bucket)[0] and units / split / warps >= 2 * unroll:
                return cfg
    return RegConfig(16, 2, split, 1, False)


# Which kernel serves a call.  On the H200 the TMA-ring kernel (version 2) took
# 19.0 us at 7168->2112, M = 1, against 10.3 us for version 1's best config and
# 13.4 us for F.linear, so version 1 with its measured table is the default;
# SCALEDMM_SKINNY_KERNEL=tma selects version 2 (TUNING / default_config).
KERNEL = env.skinny_kernel()  # read at import


def choose_config(n: int, k: int, m: int, pdl: bool = False, num_sms: int = NUM_SMS_H200) -> Config:
    """The config for (N, K) and M's bucket: version 1's measured table
    (``REG_TUNING``) or its :func:`reg_default_config`; with
    ``SCALEDMM_SKINNY_KERNEL=tma``, version 2's ``TUNING`` or
    :func:`default_config`, and with ``pdl`` its :func:`pdl_config`."""
    mb = m_bucket(m)
    if KERNEL != "tma":
        cfg = tuned(n, k, mb)
        if cfg is None or not config_valid(cfg, n, k, mb)[0]:
            cfg = reg_default_config(n, k, mb, num_sms)
        return cfg
    cfg = tuned(n, k, mb, tma=True)
    if cfg is None or not config_valid(cfg, n, k, mb)[0]:
        cfg = default_config(n, k, mb, num_sms)
    return pdl_config(cfg, n, k, mb) if pdl else cfg


def _half_range_chunk(k: int, split: int) -> int | None:
    """A chunk that cuts one split rank's K range into two stages, if any."""
    if split == 1 or k % (2 * split) != 0 or (k // (2 * split)) % 64 != 0 or k // (2 * split) > 2048:
        return None
    return k // (2 * split)


def candidate_configs(n: int, k: int, m_bucket: int, limit: int = 24, num_sms: int = NUM_SMS_H200) -> list[Config]:
    """Valid configs worth timing for a shape (the benchmark's search space).

    The tuned config, the default and version 1's best come first; then, for
    the six cheapest tile shapes of the cost model (:func:`_tile_shapes`),
    rings filling ``SMEM_TWO_PER_SM`` and 200 KiB with 256-wide chunks, each
    split rank's whole K range in two stages, 512-wide chunks, 128-wide
    chunks, a two-CTAs-per-SM persistent grid where there are enough tiles,
    and 64 KiB rings: breadth first, so a short list still spans the tile
    shapes and ring depths.
    """
    seen: dict[Config, None] = {}
    first = [tuned(n, k, m_bucket, tma=True), default_config(n, k, m_bucket, num_sms), tuned(n, k, m_bucket)]
    for cfg in first:
        if cfg is not None and config_valid(cfg, n, k, m_bucket)[0]:
            seen[cfg] = None
    shapes = [(rows, split) for _, rows, split in _tile_shapes(n, k, m_bucket, num_sms)[:6]]
    rounds = [(SMEM_TWO_PER_SM, 256, 1), (200 * 1024, 256, 1), (200 * 1024, "half", 1), (SMEM_TWO_PER_SM, 512, 1),
              (200 * 1024, 512, 1), (SMEM_TWO_PER_SM, 128, 1), (SMEM_TWO_PER_SM, 256, 2), (64 * 1024, 256, 1)]
    for budget, chunk, per_sm in rounds:
        for rows, split in shapes:
            if per_sm == 2 and (split != 1 or -(-n // rows) < 2 * num_sms):
                continue
            c = _half_range_chunk(k, split) if chunk == "half" else chunk
            cfg = None if c is None else _ring_config(rows, split, c, n, k, m_bucket, budget, num_sms, per_sm)
            if cfg is not None:
                seen.setdefault(cfg, None)
    return list(seen)[:limit]


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kernel_spec(n: int, k: int, m_bucket: int, cfg: Config) -> jit.NvrtcKernelSpec:
    """The NVRTC spec of one instantiation (validated)."""
    ok, why = config_valid(cfg, n, k, m_bucket)
    if not ok:
        raise ValueError(f"cfg: expected a valid config for N={n}, K={k}, M bucket {m_bucket}, got {cfg}: {why}")
    return jit.NvrtcKernelSpec(cfg.kernel, source_path(cfg.source), arch=ARCH, defines=cfg.defines(n, k, m_bucket))


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, enable_pdl: bool = False,
           cfg: Config | None = None) -> torch.Tensor:
    """Run the kernel into ``out`` ([M, N] bf16, contiguous) on the current stream.

    Arguments must already be validated (``skinny.check_args``) with 1 <= M <= 16.
    """
    m, k = x.shape
    n = weight.shape[0]
    mb = m_bucket(m)
    sms = sm_count(x.device)
    cfg = cfg or choose_config(n, k, m, enable_pdl, sms)
    kern = kernel_spec(n, k, mb, cfg).kernel()
    kern.launch(cfg.grid(n, sms), cfg.threads(),
                (x, weight, out, ctypes.c_int(m), ctypes.c_longlong(x.stride(0))),
                device=x.device, shared_mem=cfg.smem_bytes(n, k, mb), pdl=enable_pdl)
    return out


def fused_a_gemm(x: torch.Tensor, weight: torch.Tensor, enable_pdl: bool = False) -> torch.Tensor:
    """Backend entry: a fresh ``[M, N]`` output computed by the kernel."""
    out = skinny.output(x, weight)
    if x.shape[0] == 0 or weight.shape[0] == 0:
        return out
    return launch(x, weight, out, enable_pdl)


backends.register(Backend(
    skinny.FAMILY, NAME,
    impls={skinny.OP: fused_a_gemm},
    is_supported=is_supported,
    can_implement=can_implement,
    description=("NVRTC, mma.sync bf16, split-K over clusters: csrc/dsv3_fused_a_gemm.cu (register "
                 f"kernel, default) or csrc/dsv3_fused_a_gemm_tma.cu (TMA ring, {env.SKINNY_KERNEL}=tma)"),
))


# ----------------------------------------------------------------------------
# Pre-build hook: python -m scaledmm.jit build --skinny N:K[,N:K...]
# ----------------------------------------------------------------------------


def prebuild_specs(value: str) -> list[jit.NvrtcKernelSpec]:
    """Specs of both M buckets, without and with PDL (:func:`pdl_config`),
    for each ``N:K`` of ``value`` (e.g. ``"2112:7168,576:7168"``); each once."""
    specs: dict[str, jit.NvrtcKernelSpec] = {}
    for n, k in jit.parse_shapes(value, "skinny"):
        for mb in M_BUCKETS:
            for pdl in (False, True):
                spec = kernel_spec(n, k, mb, choose_config(n, k, mb, pdl))
                specs.setdefault(spec.key, spec)
    return list(specs.values())


jit.register_prebuild("skinny", prebuild_specs,
                      help="N:K[,N:K...] fused-A kernels (both M buckets, with and without PDL, tuned configs)")
