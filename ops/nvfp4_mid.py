"""Backend ``cuda_mid`` of the ``nvfp4`` family: our CUDA kernel for W4A4
``nvfp4_mm`` and W4A16 ``nvfp4_w4a16_mm`` at middle M (tens to ~a hundred
activation rows) on Hopper, ``csrc/nvfp4_mid.cu``, compiled at run time with
NVRTC for the (N, K, config, M bucket, output / bias dtype) it meets, cached
on disk (``scaledmm.jit``), launched on torch's current stream.

Between the small-M kernel (``cuda_gemv``, register streaming: every CTA
decodes the activation for its few weight rows, which stops paying past ~32
rows) and the two-pass ``decode_cublas`` (a full weight decode per call): the
warps of a CTA split its 64-256 weight rows, each streams and decodes its
own weight once in registers (the GEMV's exact fp16 decode), and the
activation of each 128-wide K step is decoded once per CTA into shared memory,
from where every warp feeds ``mma.sync m16n8k16`` (fp32 accumulation, exact
products, one rounding).  Split K over the CTAs of a cluster (DSMEM, rank
order): deterministic, no workspace, CUDA-graph safe.  M beyond 64 runs
64-row slices (grid z) that meet each weight tile in L2: measured faster than
one 128-row CTA (whose accumulators only fit one tile per warp) on every
llama8b shape, and faster than ``decode_cublas`` up to M = 127.  See the .cu
file's header.

Read top to bottom: capability checks, the config space (frozen dataclass,
one validity predicate :func:`config_valid`, :func:`choose_config`), the
launcher, backend registration (after ``cuda_gemv`` in the sm90 selection
policy, ``scaledmm/tuning/nvfp4_sm90.json``; its switch
``SCALEDMM_NVFP4_MID=0`` takes it out of automatic selection), the pre-build
hook.

Examples
--------
>>> from scaledmm.ops import nvfp4_mid as md
>>> cfg = md.choose_config(4096, 4096, 64)
>>> md.config_valid(cfg, 4096, 4096, 64)
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
from scaledmm.device import NUM_SMS_H200, sm_count
from scaledmm.ops import nvfp4_gemv as gv

FAMILY = Family.NVFP4
NAME = "cuda_mid"
OP = "nvfp4_mm"
OP_W4A16 = "nvfp4_w4a16_mm"
SOURCE = "nvfp4_mid.cu"
KERNEL = "nvfp4_mid"
ARCH = "sm_90a"
K_MULTIPLE = gv.K_MULTIPLE
M_BUCKETS = (32, 64)
MAX_M = 127  # from 128 on: decode_cublas (measured, see the notes above tuned())
OUT_DTYPES = gv.OUT_DTYPES
MAX_REGS = 255
REGS_PER_SM = 65536
SMEM_MAX = 227 * 1024

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
    """An sm90 GPU with NVRTC and the CUDA driver bindings (clusters, sm_90a)."""
    ok, why = jit.sm90a_gate(device)
    return (True, f"NVRTC-compiled shared-activation mma.sync kernel ({why})") if ok else (False, why)


def can_implement(p: Problem) -> tuple[bool, str]:
    """``nvfp4_mm`` or ``nvfp4_w4a16_mm`` (fp16 / bf16 activation), M <= 127,
    K % 32 == 0, bf16/fp16 output, activation rows 16-byte aligned."""
    return gv.check_problem(p, MAX_M)


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MidConfig:
    """Compile-time configuration of ``nvfp4_mid``.

    Parameters
    ----------
    warps : int
        Warps per CTA (4 or 8); they split the CTA's weight rows.
    tiles : int
        16-row weight tiles per warp (1 or 2); the CTA owns ``16 * warps * tiles`` rows.
    split_k : int
        CTAs per cluster splitting K (1, 2, 4, 8).
    unroll : int
        128-wide K units per pipeline step (1 or 2).
    ring : int
        0: the next step's weight is requested into registers (one step
        ahead); 2-4: a ring of that many shared-memory stages filled with
        ``cp.async`` (``ring - 1`` steps ahead).  Not yet measured on a GPU:
        only the sweep and the tests use it, no table or default does.
    """

    warps: int = 8
    tiles: int = 2
    split_k: int = 1
    unroll: int = 1
    ring: int = 0

    def rows(self) -> int:
        return 16 * self.warps * self.tiles

    def threads(self) -> int:
        return 32 * self.warps

    def registers(self, m_bucket: int, w4a16: bool = False) -> int:
        """Estimated registers per thread (accumulators, two weight batches,
        the activation items in flight, decoded words, addresses), an upper
        bound of ptxas' count (checked by the tests)."""
        mf = m_bucket // 8
        items = -(-(self.unroll * m_bucket * 4) // self.threads())
        x_regs = 16 if w4a16 else 5
        return (self.tiles * mf * 4 + 2 * self.unroll * self.tiles * 2 * 5 + items * (x_regs + 16)
                + self.tiles * 8 * (2 if w4a16 else 1) + 80)

    def smem_bytes(self, m_bucket: int) -> int:
        """Dynamic shared memory: two activation stages and the weight ring, or
        the fp32 tile."""
        ring = self.ring * self.warps * self.unroll * self.tiles * 2 * 32 * (16 + 4)
        return max(2 * self.unroll * m_bucket * 256 + ring, m_bucket * (self.rows() + 4) * 4)

    def grid(self, n: int, m: int, m_bucket: int) -> tuple[int, int, int]:
        """(weight tiles, split_k, row slices)."""
        return (-(-n // self.rows()), self.split_k, max(1, -(-m // m_bucket)))

    def defines(self, n: int, k: int, m_bucket: int, out_dtype: torch.dtype,
                bias_dtype: torch.dtype | None, act_dtype: torch.dtype = torch.uint8) -> dict[str, int]:
        return {"P_N": n, "P_K": k, "P_WARPS": self.warps, "P_NTW": self.tiles, "P_SPLIT": self.split_k,
                "P_UNROLL": self.unroll, "P_RING": self.ring, "P_MB": m_bucket,
                "P_OUT_F16": int(out_dtype == torch.float16),
                "P_BIAS": gv.BIAS_CODES[bias_dtype], "P_ACT": gv.ACT_CODES[act_dtype]}

    def short(self) -> str:
        return f"w{self.warps}t{self.tiles}s{self.split_k}u{self.unroll}" + (f"r{self.ring}" if self.ring else "")


def config_valid(cfg: MidConfig, n: int, k: int, m_bucket: int, w4a16: bool = False) -> tuple[bool, str]:
    """THE validity predicate of a config for a shape (dispatch, benchmark and
    tests).  Mirrors the kernel's static_asserts and the resource limits."""
    if not isinstance(cfg, MidConfig):
        return False, f"expected a MidConfig, got {type(cfg).__name__}"
    if m_bucket not in M_BUCKETS:
        return False, f"m_bucket must be one of {M_BUCKETS}, got {m_bucket}"
    if n <= 0 or k <= 0 or k % K_MULTIPLE != 0:
        return False, f"needs N > 0 and K a positive multiple of {K_MULTIPLE}, got N={n}, K={k}"
    if cfg.warps not in (4, 8):
        return False, f"warps must be 4 or 8, got {cfg.warps}"
    if cfg.tiles not in (1, 2):
        return False, f"tiles must be 1 or 2, got {cfg.tiles}"
    if cfg.split_k not in (1, 2, 4, 8):
        return False, f"split_k must be 1, 2, 4 or 8, got {cfg.split_k}"
    if cfg.unroll not in (1, 2):
        return False, f"unroll must be 1 or 2, got {cfg.unroll}"
    if cfg.ring not in (0, 2, 3, 4):
        return False, f"ring must be 0, 2, 3 or 4, got {cfg.ring}"
    steps = -(-(-(-k // 128)) // cfg.unroll)
    if steps < cfg.split_k:
        return False, f"split_k {cfg.split_k} exceeds the {steps} pipeline steps of K={k}"
    limit = min(MAX_REGS, REGS_PER_SM // cfg.threads())
    if cfg.registers(m_bucket, w4a16) > limit:
        return False, f"about {cfg.registers(m_bucket, w4a16)} registers per thread, over the limit {limit}"
    if cfg.smem_bytes(m_bucket) > SMEM_MAX:
        return False, f"{cfg.smem_bytes(m_bucket)} bytes of shared memory, over {SMEM_MAX}"
    return True, "ok"


def m_bucket(m: int) -> int:
    """Activation rows per CTA for ``m`` rows (beyond 64: slices of 64).

    Examples
    --------
    >>> m_bucket(20), m_bucket(64), m_bucket(65), m_bucket(300)
    (32, 64, 64, 64)
    """
    return 32 if m <= 32 else 64


# H200 sweep of every valid config at M = 64 (us; Triton kernel and bf16
# F.linear of the same run in parentheses; provenance in benchmarks/NOTES.md).
# Small N wants narrow 4-warp CTAs split in two
# (more CTAs per SM hide the latency), large N the widest tiles unsplit.  The
# same configs serve M 65-127 as 64-row slices (--slices: 4096x4096 M = 96
# 21.4 us against 34.2 for one 128-row CTA and 30.4 for decode_cublas).
# The measured configs: scaledmm/tuning/kernels/nvfp4_mid_sm90.json and
# nvfp4_mid_w4a16_sm90.json (rows per (N, K) and M bucket).


def tuned(n: int, k: int, m_bucket: int, w4a16: bool = False) -> MidConfig | None:
    """The measured config for an ``N x K`` weight and M bucket, or None
    (read once from ``scaledmm/tuning/kernels/nvfp4_mid[_w4a16]_sm90.json``).

    Examples
    --------
    >>> tuned(4096, 4096, 64) is not None, tuned(64, 128, 64)
    (True, None)
    """
    return _table(w4a16).lookup(n, k, m_bucket)


def _table(w4a16: bool) -> kernel_tuning.KernelTable:
    return kernel_tuning.load("nvfp4_mid_w4a16" if w4a16 else "nvfp4_mid", "sm90", MidConfig)


def __getattr__(name: str):
    # TUNING / TUNING_W4A16: the files' rows as {(n, k): {m_bucket: config}}
    if name in ("TUNING", "TUNING_W4A16"):
        return _table(name == "TUNING_W4A16").by_shape()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200, w4a16: bool = False) -> MidConfig:
    """A config for an unseen shape: 8 warps of two tiles, split K until
    every SM has a CTA while each split keeps at least 8 pipeline steps (the
    sweep's short splits lost to their pipeline fill and epilogue).

    Examples
    --------
    >>> default_config(4096, 4096, 64).short(), default_config(28672, 4096, 64).short()
    ('w8t2s4u1', 'w8t2s2u1')
    """
    min_steps = 8
    for tiles in (2, 1):
        cfg = MidConfig(8, tiles, 1, 1)
        units = -(-k // 128)
        ctas = -(-n // cfg.rows())
        split = 1
        while ctas * split < num_sms and split < 8 and units >= min_steps * split * 2:
            split *= 2
        cfg = dataclasses.replace(cfg, split_k=split)
        if config_valid(cfg, n, k, m_bucket, w4a16)[0]:
            return cfg
    return MidConfig(4, 1, 1, 1)


@functools.lru_cache(maxsize=None)  # once per shape: every launch asks
def choose_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200, w4a16: bool = False) -> MidConfig:
    """The measured config (:func:`tuned`) or :func:`default_config`."""
    cfg = tuned(n, k, m_bucket, w4a16)
    if cfg is None or not config_valid(cfg, n, k, m_bucket, w4a16)[0]:
        cfg = default_config(n, k, m_bucket, num_sms, w4a16)
    return cfg


def candidate_configs(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200,
                      w4a16: bool = False) -> list[MidConfig]:
    """The benchmark's sweep: the chosen config first, then every valid
    warps x tiles x split x unroll point with register batches, then those of
    one unit per step with a 3-stage ``cp.async`` weight ring."""
    first = choose_config(n, k, m_bucket, num_sms, w4a16)
    grid = [(w, t, s) for w in (8, 4) for t in (2, 1) for s in (1, 2, 4, 8)]
    found = [MidConfig(w, t, s, u) for w, t, s in grid for u in (1, 2)] + [MidConfig(w, t, s, 1, 3) for w, t, s in grid]
    return [first, *[c for c in found if c != first and config_valid(c, n, k, m_bucket, w4a16)[0]]]


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kernel_spec(n: int, k: int, m_bucket: int, cfg: MidConfig, out_dtype: torch.dtype = torch.bfloat16,
                bias_dtype: torch.dtype | None = None, act_dtype: torch.dtype = torch.uint8) -> jit.NvrtcKernelSpec:
    """The NVRTC spec of one instantiation (validated)."""
    gv.check_spec_dtypes(act_dtype, out_dtype, bias_dtype)
    ok, why = config_valid(cfg, n, k, m_bucket, act_dtype != torch.uint8)
    if not ok:
        raise ValueError(f"cfg: expected a valid config for N={n}, K={k}, M bucket {m_bucket}, got {cfg}: {why}")
    return jit.NvrtcKernelSpec(KERNEL, source_path(), arch=ARCH,
                               defines=cfg.defines(n, k, m_bucket, out_dtype, bias_dtype, act_dtype))


def launch(a, b, a_scales, b_scales, alpha, bias, out: torch.Tensor, cfg: MidConfig | None = None,
           mb: int | None = None) -> torch.Tensor:
    """Run the kernel into ``out`` ([M, N], contiguous) on the current stream.

    Arguments as :func:`scaledmm.ops.nvfp4_gemv.launch` (validated, M >= 1,
    :func:`~scaledmm.ops.nvfp4_gemv.aligned` operands); any M (row slices of
    ``mb`` rows, :func:`m_bucket` by default).
    """
    m = a.shape[0]
    n, k = b.shape[0], 2 * b.shape[1]
    w4a16 = a.dtype != torch.uint8
    mb = mb or m_bucket(m)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    cfg = cfg or choose_config(n, k, mb, sm_count(dev), w4a16)
    if cfg.ring and b_scales.data_ptr() % 4:  # the ring copies aligned 4-byte scale words
        cfg = dataclasses.replace(cfg, ring=0)
    spec = kernel_spec(n, k, mb, cfg, out.dtype, None if bias is None else bias.dtype, a.dtype)
    spec.kernel().launch(cfg.grid(n, m, mb), cfg.threads(),
                         (a, b, a_scales, b_scales, alpha, bias, out, ctypes.c_int(m),
                          ctypes.c_longlong(a.stride(0) * a.element_size())),
                         device=a.device, shared_mem=cfg.smem_bytes(mb))
    return out


def mid_mm(a, b, a_scales, b_scales, alpha, out_dtype=torch.bfloat16, bias=None, cfg: MidConfig | None = None):
    """Backend entry of ``nvfp4_mm``: a fresh ``[M, N]``
    ``alpha * deq(a) @ deq(b).T (+ bias)``; operands must be 16-byte aligned
    (:func:`can_implement` refuses others).

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)    # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                            # doctest: +SKIP
    >>> qa, sa = torch.ops.scaledmm.nvfp4_quant(x, one)                   # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                   # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "cuda_mid"):                   # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, one)
    """
    return gv.run_mm(launch, a, b, a_scales, b_scales, alpha, out_dtype, bias, cfg)


def mid_w4a16(x, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None, cfg: MidConfig | None = None):
    """Backend entry of ``nvfp4_w4a16_mm`` (fp16 / bf16 ``x``).

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)    # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                            # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                   # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "cuda_mid"):                   # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, one)
    """
    return gv.run_w4a16(launch, x, b, b_scales, weight_alpha, out_dtype, bias, cfg)


# ----------------------------------------------------------------------------
# Backend registration (its place in automatic selection: scaledmm/tuning/nvfp4_sm90.json)
# ----------------------------------------------------------------------------


backends.register(Backend(
    FAMILY, NAME,
    impls={OP: mid_mm, OP_W4A16: mid_w4a16},
    is_supported=is_supported,
    can_implement=can_implement,
    description=(f"NVRTC FP4 decode + shared-memory activation + mma.sync, W4A4 and W4A16, M <= {MAX_M} "
                 f"(csrc/{SOURCE})"),
))


# ----------------------------------------------------------------------------
# Pre-build hook: python -m scaledmm.jit build --nvfp4-mid N:K[,N:K...]
# ----------------------------------------------------------------------------


def prebuild_specs(value: str) -> list[jit.NvrtcKernelSpec]:
    """Specs of every M bucket, both output dtypes, W4A4 and bf16 W4A16 (no
    bias) for each ``N:K``."""
    specs: dict[str, jit.NvrtcKernelSpec] = {}
    for n, k in jit.parse_shapes(value, "nvfp4-mid"):
        for act in (torch.uint8, torch.bfloat16):
            for mb in M_BUCKETS:
                for dt in OUT_DTYPES:
                    spec = kernel_spec(n, k, mb, choose_config(n, k, mb, w4a16=act != torch.uint8), dt, None, act)
                    specs.setdefault(spec.key, spec)
    return list(specs.values())


jit.register_prebuild("nvfp4-mid", prebuild_specs,
                      help="N:K[,N:K...] NVFP4 middle-M kernels (every M bucket, bf16 and fp16 outputs, W4A4 and "
                           "bf16 W4A16)")
