"""Backend ``cuda_gemv`` of the ``nvfp4`` family: our CUDA kernel for W4A4
``nvfp4_mm`` (M <= 32) and W4A16 ``nvfp4_w4a16_mm`` (M <= 16) on Hopper,
``csrc/nvfp4_gemv.cu``, compiled
at run time with NVRTC for the (N, K, config, M bucket, output / bias dtype)
it meets, cached on disk (``scaledmm.jit``), launched on torch's current stream.

The kernel streams the packed weight straight into registers
(``ld.global.nc.L1::no_allocate.v4``), decodes e2m1 to fp16 with ~1.4 integer
instructions per value, applies the e4m3 block scales exactly in the decode
(one ``mul.rn.f16x2`` per two values) and multiplies on ``mma.sync
m16n8k16`` f16 tensor cores with fp32 accumulation: exact W4A4 products, fp32
sums, one rounding to the output.  W4A16 reads the fp16 / bf16 activation
straight into the MMA's B fragments (bf16: the weight is decoded straight to
bf16 with as many instructions, exactly, and the MMA runs in bf16).  Split K over warps (shared memory) and
over the CTAs of a thread-block cluster (DSMEM), in a fixed order:
deterministic, no workspace, CUDA-graph safe.  M buckets of 8, 16 and 32
activation rows (W4A16: 8 and 16).  The limits are measured (H200):
a 64-row bucket (16-row tiles, the only ones whose accumulators fit the
registers) and row slices of it lost to the Triton kernel on two of the four
llama8b shapes at M = 64 and to ``decode_cublas`` at M = 128; W4A16 at M = 32
lost to Triton on two of four.  Register streaming without shared-memory reuse
is compute-bound past ~32 rows.  See the .cu file's header.

**Default on sm90**: on the H200 every check was bit-deterministic and within
the float64 bound; on llama8b shapes it is 2.2-2.4x as fast as bf16
``F.linear`` at M <= 4 and, at M = 17-32, 1.3-1.5x bf16 and 2.1-2.5x the
Triton kernel.  It is first in the sm90 selection policy
(``scaledmm/tuning/nvfp4_sm90.json``) for the calls it can implement (bf16/fp16
output, M within the limits above, 16-byte aligned operands); the policy's switch
``SCALEDMM_NVFP4_GEMV=0`` takes it out of automatic selection
(``use_backend("nvfp4", "cuda_gemv")`` still reaches it).

``gemv_linear`` runs ``nvfp4_linear`` (bf16 / fp16 activation in) in one
launch: every CTA quantizes its K range of the activation into shared memory
(``csrc/nvfp4_quant.cuh``: ``nvfp4_quant``'s codes and scales bit for bit)
while its first weight batch is in flight.  It is not a registered backend:
that per-CTA work cost more than the quantize launch it saves (NOTES.md).

Read top to bottom: capability checks, the config space (frozen dataclass,
one validity predicate :func:`config_valid`, :func:`choose_config`), the
launcher, backend registration.

Examples
--------
>>> from scaledmm.ops import nvfp4_gemv as gv
>>> cfg = gv.choose_config(4096, 4096, m_bucket=8)
>>> gv.config_valid(cfg, 4096, 4096, 8)
(True, 'ok')
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from pathlib import Path

import torch

from scaledmm import backends, jit, kernel_tuning
from scaledmm.backends import Backend, Family, Problem
from scaledmm.device import NUM_SMS_H200, pdl, sm_count
from scaledmm.ops import nvfp4 as nv

FAMILY = Family.NVFP4
NAME = "cuda_gemv"
OP = "nvfp4_mm"
OP_W4A16 = "nvfp4_w4a16_mm"
SOURCE = "nvfp4_gemv.cu"
KERNEL = "nvfp4_gemv"
ARCH = "sm_90a"
K_MULTIPLE = 32  # one 16-byte load = 32 codes of a row
M_BUCKETS = (8, 16, 32)
MAX_M = {False: 32, True: 16}  # W4A4, W4A16: the measured break-even with the next backend (module docstring)
# gemv_linear (not registered, see its docstring): every CTA quantizes all M
# rows of its K range, so the redundant work grows with M.
MAX_M_LINEAR = 8
OUT_DTYPES = (torch.bfloat16, torch.float16)
BIAS_CODES = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
ACT_CODES = {torch.uint8: 0, torch.float16: 1, torch.bfloat16: 2}  # packed e2m1 (W4A4), W4A16 dtypes
REGS_PER_SM = 65536
MAX_REGS = 255
SMEM_STATIC = 48 * 1024
SMEM_DYNAMIC_MAX = 227 * 1024 - SMEM_STATIC  # sm90's opt-in limit per CTA, less the static reduction buffer
MAX_STAGES = 8
# A ring above this leaves one CTA per SM (the grid's CTAs then run in turns).
RING_BYTES_MAX = 112 * 1024

# ----------------------------------------------------------------------------
# Capability checks
# ----------------------------------------------------------------------------


def source_path() -> Path:
    """The kernel source, in the repo (editable install) or the installed package.

    Examples
    --------
    >>> source_path().suffix
    '.cu'
    """
    return jit._package_csrc() / SOURCE


def is_supported(device: torch.device) -> tuple[bool, str]:
    """An sm90 GPU with NVRTC and the CUDA driver bindings."""
    ok, why = jit.sm90a_gate(device)
    return (True, f"NVRTC-compiled register-streaming mma.sync kernel ({why})") if ok else (False, why)


def can_implement(p: Problem) -> tuple[bool, str]:
    """``nvfp4_mm`` (W4A4) or ``nvfp4_w4a16_mm`` with an fp16 / bf16 activation,
    M <= 32 (W4A16: 16), K % 32 == 0, bf16/fp16 output, operands and activation
    rows 16-byte aligned (any N)."""
    return check_problem(p, MAX_M[bool(p.opt("w4a16"))])


def can_implement_linear(p: Problem) -> tuple[bool, str]:
    """What :func:`gemv_linear` needs of an ``nvfp4_linear`` problem: an fp16 /
    bf16 activation, M <= ``MAX_M_LINEAR``, and as :func:`can_implement`;
    the quantized rows must fit the shared memory."""
    if p.in_dtype not in (torch.float16, torch.bfloat16):
        return False, f"nvfp4_linear: quantizes an fp16 or bf16 activation, got {p.in_dtype}"
    return check_problem(p, MAX_M_LINEAR, linear=True)


def check_problem(p: Problem, max_m: int, linear: bool = False) -> tuple[bool, str]:
    """What the NVFP4 CUDA kernels (this one and ``nvfp4_mid``) need of a
    call, with M <= ``max_m``; ``linear``: a 16-bit activation quantized
    in the kernel."""
    w4a16 = bool(p.opt("w4a16")) or linear  # a 16-bit activation either way
    if w4a16 and p.in_dtype not in (torch.float16, torch.bfloat16):
        return False, f"W4A16 needs an fp16 or bf16 activation, got {p.in_dtype}"
    if p.m > max_m:
        what = " (nvfp4_linear)" if linear else " (W4A16)" if w4a16 else ""
        return False, f"needs M <= {max_m}{what}, got M={p.m}"
    if p.k % K_MULTIPLE != 0 or p.k <= 0:
        return False, f"needs K a positive multiple of {K_MULTIPLE}, got K={p.k}"
    if p.out_dtype not in OUT_DTYPES:
        return False, f"writes bf16 or fp16, got out_dtype={p.out_dtype}"
    per_16_bytes = 8 if w4a16 else K_MULTIPLE  # row stride unit: elements per 16 bytes
    if p.m > 1 and p.a_row_stride % per_16_bytes != 0:
        size = 2 if w4a16 else 0.5
        return False, (f"needs an activation row stride that is a multiple of 16 bytes, "
                       f"got {p.a_row_stride * size:g} bytes")
    if not p.opt("aligned16", True):
        return False, "needs 16-byte aligned activation and weight data pointers (vector loads)"
    if linear and quant_smem(p.k, m_bucket(p.m), 8) > SMEM_DYNAMIC_MAX:  # K split 8 ways at most
        return False, f"the quantized rows of K = {p.k} exceed {SMEM_DYNAMIC_MAX} bytes of shared memory"
    return True, f"M <= {max_m}, K % 32 == 0"


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Compile-time configuration of ``nvfp4_gemv``.

    Parameters
    ----------
    rows : int
        Weight rows per CTA (16, 32 or 64); more rows share one activation decode.
    warps : int
        Warps per CTA; they take 128-wide K units round-robin.
    split_k : int
        CTAs per cluster splitting K (1, 2, 4, 8); partials added through DSMEM.
    unroll : int
        128-wide K units per batch.
    stages : int
        0: two register batches per warp, one in flight while the other is
        multiplied; 2..8: a per-thread shared-memory ring of that many batches
        filled by ``cp.async`` (``stages - 1`` in flight, no registers held).
    """

    rows: int = 32
    warps: int = 4
    split_k: int = 1
    unroll: int = 2
    stages: int = 0

    def registers(self, m_bucket: int, w4a16: bool = False, quant: bool = False) -> int:
        """Estimated registers per thread (two batches of 16-byte loads and
        scales, accumulators, the decoded activation: a whole unit up to 16
        rows, one word per fragment beyond, next to the decoded weight words),
        an upper bound of ptxas' count (checked by the tests).  W4A16 holds
        four 16-byte activation loads per unit instead of one and its scale;
        ``quant`` (``gemv_linear``) adds the prologue's two blocks in flight;
        a ring (``stages``) holds one batch in registers."""
        nt, mf = self.rows // 16, m_bucket // 8
        x_regs = 16 if w4a16 else 5
        decoded = mf * 16 if mf <= 2 else nt * 8 + 4 + 2 * mf
        extra = 56 if w4a16 else 64 if quant else 48
        if self.stages:  # one batch, plus the ring's addresses (the wide path, mf > 2, keeps two's worth)
            return ((1 if mf <= 2 else 2) * self.unroll * (2 * nt * 5 + mf * x_regs) + nt * mf * 4 + decoded
                    + extra + 12)
        return 2 * self.unroll * (2 * nt * 5 + mf * x_regs) + nt * mf * 4 + decoded + extra

    def ring_bytes(self, m_bucket: int, w4a16: bool = False) -> int:
        """Dynamic shared memory of the ring (0 without one): per stage, unit
        and thread the 16-byte copies of two weight rows a tile and the
        activation fragments, and a 4-byte word per scale pair (the kernel's
        R16, R4)."""
        if not self.stages:
            return 0
        nt, mf = self.rows // 16, m_bucket // 8
        r16 = 2 * nt + mf * (4 if w4a16 else 1)
        r4 = 2 * nt + (0 if w4a16 else mf)
        return self.stages * self.unroll * self.threads() * (16 * r16 + 4 * r4)

    def threads(self) -> int:
        return 32 * self.warps

    def grid(self, n: int) -> tuple[int, int]:
        return (-(-n // self.rows), self.split_k)

    def defines(self, n: int, k: int, m_bucket: int, out_dtype: torch.dtype,
                bias_dtype: torch.dtype | None, act_dtype: torch.dtype = torch.uint8,
                quant: bool = False) -> dict[str, int]:
        """The kernel's macros; ``quant``: ``act_dtype`` (fp16 / bf16) is
        quantized to e2m1 in the kernel (W4A4)."""
        d = {"G_N": n, "G_K": k, "G_ROWS": self.rows, "G_WARPS": self.warps, "G_SPLIT": self.split_k,
             "G_UNROLL": self.unroll, "G_MB": m_bucket, "G_OUT_F16": int(out_dtype == torch.float16),
             "G_BIAS": BIAS_CODES[bias_dtype], "G_ACT": 0 if quant else ACT_CODES[act_dtype]}
        if self.stages:
            d["G_STAGES"] = self.stages
        if quant:
            d.update(G_QUANT=1, G_IN_F16=int(act_dtype == torch.float16))
        return d

    def short(self) -> str:
        ring = f"p{self.stages}" if self.stages else ""
        return f"r{self.rows}w{self.warps}s{self.split_k}u{self.unroll}{ring}"


def quant_smem(k: int, m: int, split_k: int) -> int:
    """Dynamic shared memory of an ``nvfp4_linear`` launch with ``m`` rows:
    the codes and scales of each row's K range (the kernel's QPITCH + SPITCH)."""
    units = -(-k // 128)  # 128-k units (the last may be partial)
    per_cta = -(-units // split_k)
    return m * (per_cta * 64 + (64 if per_cta % 2 == 0 else 0) + per_cta * 8)


def config_valid(cfg: GemvConfig, n: int, k: int, m_bucket: int, w4a16: bool = False,
                 quant: bool = False) -> tuple[bool, str]:
    """THE validity predicate of a config for a shape (dispatch, benchmark and
    tests), W4A4 or (``w4a16``) W4A16; ``quant``: ``nvfp4_linear`` (W4A4 that
    quantizes the activation in the kernel).  Mirrors the kernel's
    static_asserts and the resource limits."""
    if quant:
        if w4a16:
            return False, "quant quantizes to e2m1 (W4A4): it excludes w4a16"
        if cfg.stages:
            return False, f"quant needs the shared memory a ring takes: expected stages 0, got {cfg.stages}"
        if m_bucket > MAX_M_LINEAR:
            return False, f"m_bucket {m_bucket} is over the nvfp4_linear limit {MAX_M_LINEAR}"
        if quant_smem(k, m_bucket, cfg.split_k) > SMEM_DYNAMIC_MAX:
            return False, (f"{m_bucket} quantized rows of K / split_k = {k} / {cfg.split_k} exceed "
                           f"{SMEM_DYNAMIC_MAX} bytes of shared memory")
    if not isinstance(cfg, GemvConfig):
        return False, f"expected a GemvConfig, got {type(cfg).__name__}"
    if m_bucket not in M_BUCKETS:
        return False, f"m_bucket must be one of {M_BUCKETS}, got {m_bucket}"
    if m_bucket > MAX_M[bool(w4a16)]:
        return False, f"m_bucket {m_bucket} is over the {'W4A16' if w4a16 else 'W4A4'} limit {MAX_M[bool(w4a16)]}"
    if n <= 0 or k <= 0 or k % K_MULTIPLE != 0:
        return False, f"needs N > 0 and K a positive multiple of {K_MULTIPLE}, got N={n}, K={k}"
    if cfg.rows not in (16, 32, 64):
        return False, f"rows must be 16, 32 or 64, got {cfg.rows}"
    if cfg.split_k not in (1, 2, 4, 8):
        return False, f"split_k must be 1, 2, 4 or 8, got {cfg.split_k}"
    if not 1 <= cfg.warps <= 16:
        return False, f"warps must be 1..16, got {cfg.warps}"
    if not 1 <= cfg.unroll <= 4:
        return False, f"unroll must be 1..4, got {cfg.unroll}"
    if cfg.stages != 0 and not 2 <= cfg.stages <= MAX_STAGES:
        return False, f"stages must be 0 or 2..{MAX_STAGES}, got {cfg.stages}"
    if cfg.ring_bytes(m_bucket, w4a16) > RING_BYTES_MAX:
        return False, (f"a ring of {cfg.ring_bytes(m_bucket, w4a16)} bytes is over the {RING_BYTES_MAX} bytes "
                       f"of shared memory it may take")
    limit = min(MAX_REGS, REGS_PER_SM // cfg.threads())
    regs = cfg.registers(m_bucket, w4a16, quant)
    if regs > limit:
        return False, f"about {regs} registers per thread, over the limit {limit}"
    if cfg.warps * cfg.rows * m_bucket * 4 > SMEM_STATIC:
        return False, "reduction buffer over 48 KiB of shared memory"
    units = -(-k // 128)
    if units < cfg.split_k:
        return False, f"split_k {cfg.split_k} exceeds the {units} 128-wide K units"
    return True, "ok"


def m_bucket(m: int) -> int:
    """The M bucket (activation rows the kernel is compiled for) of ``m`` rows.

    Examples
    --------
    >>> m_bucket(1), m_bucket(9), m_bucket(17)
    (8, 16, 32)
    """
    return 8 if m <= 8 else 16 if m <= 16 else 32


# H200 sweeps (cold L2, graph replay; us against bf16 F.linear in the same
# run; provenance in benchmarks/NOTES.md).  M <= 8: few long
# K streams per SM want 8 warps on 16-row tiles, many tiles 4 warps and, for
# N = 28672, 32 rows.  M 9-16 decodes two activation fragments per unit: 32-row
# tiles share them, and one unit per batch keeps the registers down.  M 17-32
# (measured at M = 32): 32-row tiles, 4 warps, split K
# in two unless there are more than four tiles per SM (4096x4096: 8 warps
# unsplit, 4% ahead of that rule).
# W4A16 (bf16 activation): us at M = 1 / 16, bf16 F.linear in the same run.
# The measured configs: scaledmm/tuning/kernels/nvfp4_gemv_sm90.json and
# nvfp4_gemv_w4a16_sm90.json (rows per (N, K) and M bucket).


def tuned(n: int, k: int, m_bucket: int, w4a16: bool = False) -> GemvConfig | None:
    """The measured config for an ``N x K`` weight and M bucket, or None
    (read once from ``scaledmm/tuning/kernels/nvfp4_gemv[_w4a16]_sm90.json``).

    Examples
    --------
    >>> tuned(4096, 4096, 8) is not None, tuned(64, 128, 8)
    (True, None)
    """
    return _table(w4a16).lookup(n, k, m_bucket)


def _table(w4a16: bool) -> kernel_tuning.KernelTable:
    return kernel_tuning.load("nvfp4_gemv_w4a16" if w4a16 else "nvfp4_gemv", "sm90", GemvConfig)


def __getattr__(name: str):
    # TUNING / TUNING_W4A16: the files' rows as {(n, k): {m_bucket: config}}
    if name in ("TUNING", "TUNING_W4A16"):
        return _table(name == "TUNING_W4A16").by_shape()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200, w4a16: bool = False) -> GemvConfig:
    """A config for an unseen shape, by the rule the tables follow: 16-row
    tiles up to M = 8 (W4A16: unless there are more than four per SM; then
    and for M > 8, 32), split K over clusters until every SM has a CTA, 8 warps while there are at
    most two CTAs per SM (4 beyond), and the deepest register batch (<= 2
    units at M <= 8 in W4A4, 1 otherwise: a W4A16 unit holds 64 activation
    bytes per thread) that still gives each warp two of them.  The 32-row
    bucket: 32-row tiles, 4 warps, K split in two up to four tiles per SM.

    Examples
    --------
    >>> default_config(4096, 4096, 8).short(), default_config(28672, 4096, 8).short()
    ('r16w8s1u2', 'r16w4s1u2')
    >>> default_config(6144, 4096, 32).short(), default_config(28672, 4096, 32).short()
    ('r32w4s2u1', 'r32w4s1u1')
    """
    if m_bucket == 32:
        split = 2 if -(-n // 32) <= 4 * num_sms and -(-k // 128) >= 8 else 1
        for rows in (32, 16):
            cfg = GemvConfig(rows, 4, split, 1)
            if config_valid(cfg, n, k, m_bucket, w4a16)[0]:
                return cfg
    rows = 16 if m_bucket <= 8 and (not w4a16 or -(-n // 16) <= 4 * num_sms) else 32
    tiles = -(-n // rows)
    units = -(-k // 128)
    split = 1
    while tiles * split < num_sms and split < 8 and units >= 4 * split * 2:
        split *= 2
    first = 8 if tiles * split <= 2 * num_sms else 4
    for warps in dict.fromkeys((first, 4, 2, 1)):
        for unroll in (2, 1) if m_bucket <= 8 and not w4a16 else (1,):
            cfg = GemvConfig(rows, warps, split, unroll)
            if config_valid(cfg, n, k, m_bucket, w4a16)[0] and units / split / warps >= 2 * unroll:
                return cfg
    return GemvConfig(rows, 1, split, 1)


@functools.lru_cache(maxsize=None)  # once per shape: every launch asks
def choose_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200, w4a16: bool = False) -> GemvConfig:
    """The measured config (:func:`tuned`) or
    :func:`default_config`."""
    cfg = tuned(n, k, m_bucket, w4a16)
    if cfg is None or not config_valid(cfg, n, k, m_bucket, w4a16)[0]:
        cfg = default_config(n, k, m_bucket, num_sms, w4a16)
    return cfg


@functools.lru_cache(maxsize=None)
def choose_linear_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200) -> GemvConfig:
    """``nvfp4_linear``'s config: the W4A4 GEMM's (the same weight stream),
    with K split further until the quantized rows fit the shared memory."""
    cfg = dataclasses.replace(choose_config(n, k, m_bucket, num_sms), stages=0)  # the prologue needs the smem
    while not config_valid(cfg, n, k, m_bucket, quant=True)[0] and cfg.split_k < 8:
        cfg = dataclasses.replace(cfg, split_k=2 * cfg.split_k)
    return cfg


def candidate_linear_configs(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200) -> list[GemvConfig]:
    """The sweep of ``nvfp4_linear``: :func:`choose_linear_config` first, then
    the W4A4 candidates that are valid with the quantizing prologue."""
    first = choose_linear_config(n, k, m_bucket, num_sms)
    rest = [c for c in candidate_configs(n, k, m_bucket, num_sms)
            if c != first and config_valid(c, n, k, m_bucket, quant=True)[0]]
    return [first, *rest]


RING_STAGES = (3, 4, 6)  # the ring depths a sweep tries


def candidate_configs(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200,
                      w4a16: bool = False) -> list[GemvConfig]:
    """The benchmark's sweep: the chosen config first, then tile x split x
    warps x unroll points that are valid and keep at least one batch per
    warp, nearest to the chosen config first (the benchmark may cut the list)."""
    first = choose_config(n, k, m_bucket, num_sms, w4a16)
    units = -(-k // 128)
    found = []
    for rows in (16, 32, 64):
        for split in (1, 2, 4, 8):
            for warps in (2, 4, 8, 16):
                for unroll in (1, 2, 3, 4):
                    for stages in (0, *RING_STAGES):
                        cfg = GemvConfig(rows, warps, split, unroll, stages)
                        # a ring needs more batches per warp than it holds in flight
                        per_warp = units / split / (warps * unroll)
                        if (cfg != first and config_valid(cfg, n, k, m_bucket, w4a16)[0]
                                and per_warp >= (stages if stages else 1) and (not stages or unroll <= 2)):
                            found.append(cfg)

    def distance(c: GemvConfig) -> int:
        return (abs(c.rows.bit_length() - first.rows.bit_length()) + abs(c.split_k.bit_length() - first.split_k.bit_length())
                + abs(c.warps.bit_length() - first.warps.bit_length()) + abs(c.unroll - first.unroll)
                + (c.stages != first.stages))

    return [first, *sorted(found, key=distance)]


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kernel_spec(n: int, k: int, m_bucket: int, cfg: GemvConfig, out_dtype: torch.dtype = torch.bfloat16,
                bias_dtype: torch.dtype | None = None, act_dtype: torch.dtype = torch.uint8,
                quant: bool = False) -> jit.NvrtcKernelSpec:
    """The NVRTC spec of one instantiation (validated); ``act_dtype`` uint8
    (packed e2m1: W4A4) or fp16 / bf16 (W4A16, or with ``quant`` the
    activation ``nvfp4_linear`` quantizes in the kernel)."""
    check_spec_dtypes(act_dtype, out_dtype, bias_dtype)
    if quant and act_dtype == torch.uint8:
        raise ValueError("act_dtype: expected fp16 or bf16 with quant (the activation the kernel quantizes), "
                         "got uint8")
    ok, why = config_valid(cfg, n, k, m_bucket, act_dtype != torch.uint8 and not quant, quant)
    if not ok:
        raise ValueError(f"cfg: expected a valid config for N={n}, K={k}, M bucket {m_bucket}, got {cfg}: {why}")
    return jit.NvrtcKernelSpec(KERNEL, source_path(), arch=ARCH,
                               defines=cfg.defines(n, k, m_bucket, out_dtype, bias_dtype, act_dtype, quant))


def check_spec_dtypes(act_dtype: torch.dtype, out_dtype: torch.dtype, bias_dtype: torch.dtype | None) -> None:
    """The dtypes an NVFP4 CUDA kernel instantiation can take (raises ValueError)."""
    if act_dtype not in ACT_CODES:
        raise ValueError(f"act_dtype: expected uint8 (packed e2m1), fp16 or bf16, got {act_dtype}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected bf16 or fp16, got {out_dtype}")
    if bias_dtype not in BIAS_CODES:
        raise ValueError(f"bias_dtype: expected None, fp32, bf16 or fp16, got {bias_dtype}")


def aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The 16-byte alignment the kernel's vector loads need (host-side, no sync)."""
    return (a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
            and (a.shape[0] <= 1 or a.stride(0) * a.element_size() % 16 == 0))


def launch(a, b, a_scales, b_scales, alpha, bias, out: torch.Tensor, cfg: GemvConfig | None = None) -> torch.Tensor:
    """Run the kernel into ``out`` ([M, N], contiguous) on the current stream.

    ``a`` packed e2m1 with ``a_scales`` (W4A4) or an fp16 / bf16 activation
    (W4A16; ``a_scales`` is then not read).  Arguments must already be
    validated (``nvfp4.check_mm_args`` / ``check_w4a16_args``), with
    1 <= M <= 32 (W4A16: 16), K % 32 == 0, bf16/fp16 ``out`` and
    :func:`aligned` operands.  With :func:`scaledmm.device.pdl` the launch
    is a programmatic dependent one.
    """
    m = a.shape[0]
    n, k = b.shape[0], 2 * b.shape[1]
    w4a16 = a.dtype != torch.uint8
    mb = m_bucket(m)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    cfg = cfg or choose_config(n, k, mb, sm_count(dev), w4a16)
    if cfg.stages and (b_scales.data_ptr() % 4 or (not w4a16 and a_scales.data_ptr() % 4)):
        cfg = dataclasses.replace(cfg, stages=0)  # the ring copies scale pairs as aligned 4-byte words
    spec = kernel_spec(n, k, mb, cfg, out.dtype, None if bias is None else bias.dtype, a.dtype)
    spec.kernel().launch(cfg.grid(n), cfg.threads(),
                         (a, b, a_scales, b_scales, alpha, bias, out, ctypes.c_int(m),
                          ctypes.c_longlong(a.stride(0) * a.element_size())),
                         device=a.device, shared_mem=cfg.ring_bytes(mb, w4a16), pdl=pdl(a.device))
    return out


def launch_linear(x, b, global_scale, b_scales, alpha, bias, out: torch.Tensor,
                  cfg: GemvConfig | None = None) -> torch.Tensor:
    """Run the quantizing instantiation (``nvfp4_linear``) into ``out`` on the
    current stream: ``x`` fp16 / bf16 ``[M, K]``, 1 <= M <= ``MAX_M_LINEAR``,
    validated and :func:`aligned` as for :func:`launch`; ``global_scale``
    one fp32 element (read by the kernel)."""
    m = x.shape[0]
    n, k = b.shape[0], 2 * b.shape[1]
    mb = m_bucket(m)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    cfg = cfg or choose_linear_config(n, k, mb, sm_count(dev))
    spec = kernel_spec(n, k, mb, cfg, out.dtype, None if bias is None else bias.dtype, x.dtype, True)
    kern = spec.kernel()
    smem = quant_smem(k, m, cfg.split_k)
    if kern.max_active_blocks(cfg.threads(), smem, dev) < 1:  # raises the shared-memory limit first
        raise RuntimeError(f"nvfp4_gemv {cfg.short()}: expected a CTA of {cfg.threads()} threads and {smem} "
                           f"bytes of dynamic shared memory to fit an SM, the driver says none does")
    kern.launch(cfg.grid(n), cfg.threads(),
                (x, b, global_scale, b_scales, alpha, bias, out, ctypes.c_int(m),
                 ctypes.c_longlong(x.stride(0) * x.element_size())),
                device=x.device, shared_mem=smem, pdl=pdl(x.device))
    return out


def require_aligned(a: torch.Tensor, b: torch.Tensor) -> None:
    """Raise ``ValueError`` for operands the kernel's vector loads cannot
    read (selection never sends them: :func:`can_implement` refuses them;
    this guards direct calls)."""
    if not aligned(a, b):
        raise ValueError(f"a, b: expected 16-byte aligned data pointers and activation row stride, got "
                         f"a at {a.data_ptr() % 16} mod 16 with row stride {a.stride(0) * a.element_size()} "
                         f"bytes, b at {b.data_ptr() % 16} mod 16")


def gemv_mm(a, b, a_scales, b_scales, alpha, out_dtype=torch.bfloat16, bias=None, cfg: GemvConfig | None = None):
    """Backend entry: a fresh ``[M, N]`` ``alpha * deq(a) @ deq(b).T (+ bias)``.

    Operands must be 16-byte aligned (:func:`can_implement` refuses others,
    so automatic selection gives them to the next backend of the policy).

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)     # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                            # doctest: +SKIP
    >>> qa, sa = torch.ops.scaledmm.nvfp4_quant(x, one)                   # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                   # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "cuda_gemv"):                  # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, one)
    """
    return run_mm(launch, a, b, a_scales, b_scales, alpha, out_dtype, bias, cfg)


def gemv_w4a16(x, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None, cfg: GemvConfig | None = None):
    """Backend entry of ``nvfp4_w4a16_mm``: a fresh ``[M, N]``
    ``weight_alpha * x @ deq(b).T (+ bias)`` with an fp16 / bf16 ``x``.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)     # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                            # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                   # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "cuda_gemv"):                  # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, one)
    """
    return run_w4a16(launch, x, b, b_scales, weight_alpha, out_dtype, bias, cfg)


def gemv_linear(x, b, b_scales, global_scale, alpha, out_dtype=torch.bfloat16, bias=None,
                cfg: GemvConfig | None = None):
    """``nvfp4_linear`` in one launch: a fresh ``[M, N]``
    ``nvfp4_mm(*nvfp4_quant(x, global_scale), b, ..., b_scales, alpha)``
    (+ bias), bit for bit the two ops with this backend's GEMM, M <= 8.

    Not registered as a backend of the op: every CTA quantizes the whole K
    range of the activation for itself, and on the H100 that redundant work
    cost more than the separate quantize launch it saves (Llama-3-8B layer at
    M = 1: 85.3 us against 79.4 with the composite; benchmarks/NOTES.md).
    Kept, tested and sanitizer-checked as the base of a variant that shares
    the quantized rows across a thread-block cluster.  Raises ``ValueError``
    for a call it cannot run (:func:`can_implement_linear`).

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)     # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                            # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                   # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "cuda_gemv"):                  # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_linear(x, qb, sb, one, one)
    """
    nv.check_linear_args(x, b, b_scales, global_scale, alpha, out_dtype, bias)
    ok, why = is_supported(x.device)
    if ok:
        ok, why = can_implement_linear(nv.linear_problem(x, b, out_dtype, bias))
    if not ok:
        raise ValueError(f"gemv_linear: expected a call the kernel can run, got one it cannot: {why}")
    out = nv.mm_output(x, b, out_dtype)
    if x.shape[0] == 0 or b.shape[0] == 0:
        return out
    require_aligned(x, b)
    gs = global_scale.reshape(1)  # one element, read in place (a view: no copy, graph safe)
    return launch_linear(x, b, gs, b_scales, alpha, bias, out, cfg)


def run_mm(launch_fn, a, b, a_scales, b_scales, alpha, out_dtype, bias, cfg):
    """``nvfp4_mm`` through ``launch_fn`` (this module's :func:`launch` or
    one with its arguments: ``nvfp4_mid``'s, ``nvfp4_wgmma``'s): a fresh output, M = 0 / N = 0 without a launch, operands
    that are not 16-byte aligned refused (:func:`require_aligned`)."""
    out = nv.mm_output(a, b, out_dtype)
    if a.shape[0] == 0 or b.shape[0] == 0:
        return out
    require_aligned(a, b)
    return launch_fn(a, b, a_scales, b_scales, alpha, bias, out, cfg)


def run_w4a16(launch_fn, x, b, b_scales, weight_alpha, out_dtype, bias, cfg):
    """``nvfp4_w4a16_mm`` through ``launch_fn``, as :func:`run_mm`."""
    out = nv.mm_output(x, b, out_dtype)
    if x.shape[0] == 0 or b.shape[0] == 0:
        return out
    require_aligned(x, b)
    return launch_fn(x, b, b_scales, b_scales, weight_alpha, bias, out, cfg)


# ----------------------------------------------------------------------------
# Backend registration (its place in automatic selection: scaledmm/tuning/nvfp4_*.json)
# ----------------------------------------------------------------------------


backends.register(Backend(
    FAMILY, NAME,
    impls={OP: gemv_mm, OP_W4A16: gemv_w4a16},
    is_supported=is_supported,
    can_implement=can_implement,
    description=(f"NVRTC register-streaming FP4 decode + mma.sync, W4A4 M <= {MAX_M[False]}, W4A16 M <= "
                 f"{MAX_M[True]} (csrc/{SOURCE})"),
))


# ----------------------------------------------------------------------------
# Pre-build hook: python -m scaledmm.jit build --nvfp4-gemv N:K[,N:K...]
# ----------------------------------------------------------------------------


def prebuild_specs(value: str) -> list[jit.NvrtcKernelSpec]:
    """Specs of every M bucket, both output dtypes, W4A4 and bf16 W4A16 (no
    bias) for each ``N:K``."""
    specs: dict[str, jit.NvrtcKernelSpec] = {}
    for n, k in jit.parse_shapes(value, "nvfp4-gemv"):
        for act in (torch.uint8, torch.bfloat16):  # W4A4, W4A16 with a bf16 activation
            w4a16 = act != torch.uint8
            for mb in (b for b in M_BUCKETS if b <= MAX_M[w4a16]):
                for dt in OUT_DTYPES:
                    cfg = choose_config(n, k, mb, w4a16=w4a16)
                    spec = kernel_spec(n, k, mb, cfg, dt, None, act)
                    specs.setdefault(spec.key, spec)
    return list(specs.values())


jit.register_prebuild("nvfp4-gemv", prebuild_specs,
                      help="N:K[,N:K...] NVFP4 small-M kernels (every M bucket, bf16 and fp16 outputs, W4A4 and bf16 W4A16)")
