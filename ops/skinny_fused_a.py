"""Backend ``fused_a`` of the ``skinny`` family: our CUDA kernel
``csrc/dsv3_fused_a_gemm.cu`` for ``dsv3_fused_a_gemm``, compiled at run time
with NVRTC for the (N, K, tile config, M bucket) it meets, cached on disk
(``scaledmm.jit``), launched on torch's current stream, optionally with
programmatic dependent launch.

Read top to bottom: capability checks, the config space (one frozen dataclass,
one validity predicate shared by dispatch, the tuning table, the benchmark and
the tests), the H200 tuning table, the launcher, backend registration, the
pre-build hook (``python -m scaledmm.jit build --skinny 2112:7168``).

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

import torch

from scaledmm import backends, jit
from scaledmm.backends import Backend, Problem
from scaledmm.ops import skinny

NAME = "fused_a"
KERNEL = "dsv3_fused_a_gemm"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "dsv3_fused_a_gemm.cu"
ARCH = "sm_90a"
M_BUCKETS = (8, 16)

# ----------------------------------------------------------------------------
# Capability checks
# ----------------------------------------------------------------------------


def _source() -> Path:
    """The kernel source, in the repo (editable install) or the installed package."""
    if SOURCE.is_file():
        return SOURCE
    return jit._package_csrc() / "dsv3_fused_a_gemm.cu"


def is_supported(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "needs a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return False, f"kernel is compiled for sm_90a (H100/H200), device is sm{cap[0]}{cap[1]}"
    ok, why = jit.nvrtc_available()
    if not ok:
        return False, why
    try:
        jit._driver()
    except ImportError as e:
        return False, f"cuda.bindings not importable: {e}"
    return True, f"NVRTC-compiled mma.sync kernel ({why})"


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

REGS_PER_SM = 65536
MAX_REGS = 255
SMEM_STATIC = 48 * 1024


@dataclasses.dataclass(frozen=True)
class FusedAConfig:
    """One compile-time tile configuration of the kernel.

    Parameters
    ----------
    rows : int
        Weight rows per CTA (16, 32, 64).
    warps : int
        Warps per CTA; they split the CTA's K range.
    split_k : int
        CTAs of a cluster that split K (1, 2, 4, 8); reduced through DSMEM.
    unroll : int
        32-wide K units each warp loads per step (two steps in flight).
    prefetch : bool
        TMA L2 prefetch of the CTA's weight slice at kernel start.
    """

    rows: int = 16
    warps: int = 8
    split_k: int = 1
    unroll: int = 4
    prefetch: bool = True

    def registers(self, m_bucket: int) -> int:
        """Estimated registers per thread (two register batches + accumulators)."""
        nt, mf = self.rows // 16, m_bucket // 8
        return 2 * self.unroll * (2 * nt + mf) * 4 + nt * mf * 4 + 40

    def ctas_per_sm(self, m_bucket: int) -> int:
        threads = 32 * self.warps
        regs = min(MAX_REGS, (self.registers(m_bucket) + 7) // 8 * 8)
        return max(1, min(REGS_PER_SM // (regs * threads), 2048 // threads, 32))

    def grid(self, n: int) -> tuple[int, int]:
        return (-(-n // self.rows), self.split_k)

    def defines(self, n: int, k: int, m_bucket: int) -> dict[str, int]:
        return {"FA_N": n, "FA_K": k, "FA_ROWS": self.rows, "FA_WARPS": self.warps,
                "FA_SPLIT_K": self.split_k, "FA_UNROLL": self.unroll, "FA_MB": m_bucket,
                "FA_PREFETCH": int(self.prefetch)}

    def short(self) -> str:
        return f"r{self.rows}w{self.warps}s{self.split_k}u{self.unroll}{'p' if self.prefetch else ''}"


def config_valid(cfg: FusedAConfig, n: int, k: int, m_bucket: int) -> tuple[bool, str]:
    """THE validity predicate of a config for a shape (dispatch, tuning table,
    benchmark and tests all use it).  Mirrors the kernel's static_asserts and
    keeps the register estimate below the spill limit."""
    if m_bucket not in M_BUCKETS:
        return False, f"m_bucket must be one of {M_BUCKETS}, got {m_bucket}"
    if cfg.rows not in (16, 32, 64):
        return False, f"rows must be 16, 32 or 64, got {cfg.rows}"
    if cfg.split_k not in (1, 2, 4, 8):
        return False, f"split_k must be 1, 2, 4 or 8, got {cfg.split_k}"
    if not 1 <= cfg.warps <= 16:
        return False, f"warps must be 1..16, got {cfg.warps}"
    if not 1 <= cfg.unroll <= 8:
        return False, f"unroll must be 1..8, got {cfg.unroll}"
    if n <= 0 or n % 16 != 0 or k <= 0 or k % 128 != 0:
        return False, f"needs N % 16 == 0 and K % 128 == 0 (both > 0), got N={n}, K={k}"
    limit = min(MAX_REGS, REGS_PER_SM // (32 * cfg.warps))
    if cfg.registers(m_bucket) > limit:
        return False, f"about {cfg.registers(m_bucket)} registers per thread, over the limit {limit}"
    if cfg.warps * cfg.rows * m_bucket * 4 > SMEM_STATIC:
        return False, "reduction buffer over 48 KiB of shared memory"
    units = k // 32
    if units < cfg.split_k:
        return False, f"split_k {cfg.split_k} exceeds the {units} 32-wide K units"
    return True, "ok"


def m_bucket(m: int) -> int:
    return 8 if m <= 8 else 16


# H200 (132 SMs), picked from benchmarks/device_skinny.py.  Key: (N, K) ->
# {m_bucket: config}.  Shapes not listed use default_config().
TUNING: dict[tuple[int, int], dict[int, FusedAConfig]] = {
    (2112, 7168): {8: FusedAConfig(16, 8, 1, 4, True), 16: FusedAConfig(16, 8, 1, 4, True)},
    (1536, 7168): {8: FusedAConfig(16, 4, 2, 4, True), 16: FusedAConfig(16, 4, 2, 4, True)},
    (576, 7168): {8: FusedAConfig(16, 4, 8, 2, True), 16: FusedAConfig(16, 4, 8, 2, True)},
    (256, 7168): {8: FusedAConfig(16, 8, 8, 2, True), 16: FusedAConfig(16, 8, 8, 2, True)},
    (24576, 1536): {8: FusedAConfig(32, 4, 1, 4, True), 16: FusedAConfig(32, 4, 1, 2, True)},
}

NUM_SMS_H200 = 132


def default_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200) -> FusedAConfig:
    """A reasonable config for an unseen shape: 16-row tiles; when there are
    fewer tiles than SMs, split K (clusters) until about one wave of CTAs fills
    the GPU; the deepest register batch that still gives each warp at least two
    batches, with 8 warps when all CTAs are resident at once, else 4."""
    tiles = -(-n // 16)
    units = k // 32
    split = 1
    while tiles * split < num_sms and split < 8 and units >= 2 * split * 8:
        split *= 2
    ctas = tiles * split
    for warps in (8, 4, 2):
        for unroll in (4, 2, 1):
            cfg = FusedAConfig(16, warps, split, unroll, True)
            if not config_valid(cfg, n, k, m_bucket)[0]:
                continue
            one_wave = ctas <= cfg.ctas_per_sm(m_bucket) * num_sms
            if (one_wave or warps <= 4) and units / split / warps >= 2 * unroll:
                return cfg
    return FusedAConfig(16, 2, split, 1, True)


def choose_config(n: int, k: int, m: int) -> FusedAConfig:
    """The tuned config of (N, K) for M's bucket, else :func:`default_config`."""
    mb = m_bucket(m)
    cfg = TUNING.get((n, k), {}).get(mb)
    if cfg is not None and config_valid(cfg, n, k, mb)[0]:
        return cfg
    return default_config(n, k, mb)


def candidate_configs(n: int, k: int, m_bucket: int, limit: int = 16) -> list[FusedAConfig]:
    """Valid configs worth timing for a shape (the benchmark's search space).

    The tuned config, its prefetch toggle and the default come first; then one
    config per (rows, split_k) group in turn (deepest batches and most warps
    first), so that a short list still spans the CTA-count choices.  Groups
    launch between 0.7 and 12 waves' worth of CTAs and are resident in at most
    two waves.
    """
    seen: dict[FusedAConfig, None] = {}
    tuned = TUNING.get((n, k), {}).get(m_bucket)
    first = [tuned, dataclasses.replace(tuned, prefetch=not tuned.prefetch)] if tuned else []
    for cfg in first + [default_config(n, k, m_bucket)]:
        if config_valid(cfg, n, k, m_bucket)[0]:
            seen[cfg] = None
    groups = []
    for rows in (16, 32, 64):
        for split in (1, 2, 4, 8):
            ctas = -(-n // rows) * split
            if not NUM_SMS_H200 * 0.7 <= ctas <= NUM_SMS_H200 * 12:
                continue
            group = []
            for prefetch in (True, False):
                for unroll in (4, 2):
                    for warps in (8, 4):
                        cfg = FusedAConfig(rows, warps, split, unroll, prefetch)
                        if (config_valid(cfg, n, k, m_bucket)[0]
                                and cfg.ctas_per_sm(m_bucket) * NUM_SMS_H200 * 2 >= ctas):
                            group.append(cfg)
            if group:
                groups.append(group)
    for i in range(max((len(g) for g in groups), default=0)):
        for group in groups:
            if i < len(group):
                seen.setdefault(group[i], None)
    return list(seen)[:limit]


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kernel_spec(n: int, k: int, m_bucket: int, cfg: FusedAConfig) -> jit.NvrtcKernelSpec:
    """The NVRTC spec of one instantiation (validated)."""
    ok, why = config_valid(cfg, n, k, m_bucket)
    if not ok:
        raise ValueError(f"cfg: expected a valid config for N={n}, K={k}, M bucket {m_bucket}, got {cfg}: {why}")
    return jit.NvrtcKernelSpec(KERNEL, _source(), arch=ARCH, defines=cfg.defines(n, k, m_bucket))


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, enable_pdl: bool = False,
           cfg: FusedAConfig | None = None) -> torch.Tensor:
    """Run the kernel into ``out`` ([M, N] bf16, contiguous) on the current stream.

    Arguments must already be validated (``skinny.check_args``) with 1 <= M <= 16.
    """
    m, k = x.shape
    n = weight.shape[0]
    mb = m_bucket(m)
    cfg = cfg or choose_config(n, k, m)
    kern = kernel_spec(n, k, mb, cfg).kernel()
    kern.launch(cfg.grid(n), 32 * cfg.warps,
                (x, weight, out, ctypes.c_int(m), ctypes.c_longlong(x.stride(0))),
                device=x.device, pdl=enable_pdl)
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
    description="csrc/dsv3_fused_a_gemm.cu: NVRTC, mma.sync bf16, split-K over warps and clusters",
))


# ----------------------------------------------------------------------------
# Pre-build hook: python -m scaledmm.jit build --skinny N:K[,N:K...]
# ----------------------------------------------------------------------------


def prebuild_specs(value: str) -> list[jit.NvrtcKernelSpec]:
    """Specs of both M buckets for each ``N:K`` of ``value`` (e.g. ``"2112:7168,576:7168"``)."""
    specs = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            n, k = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"--skinny: expected N:K pairs such as 2112:7168, got {item!r}") from None
        for mb in M_BUCKETS:
            specs.append(kernel_spec(n, k, mb, choose_config(n, k, mb)))
    return specs


jit.register_prebuild("skinny", prebuild_specs,
                      help="N:K[,N:K...] fused-A kernels (both M buckets, tuned configs)")
