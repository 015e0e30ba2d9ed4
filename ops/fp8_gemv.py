"""Backend ``cuda_gemv`` of the ``fp8`` and ``fp8_block`` families: our CUDA
kernel for the small-M FP8 linear ops, ``fp8_linear`` (per-tensor / per-token
/ static activation scales, per-tensor / per-channel weight scales) and
``fp8_block_linear`` (1x128 activation groups, 128x128 weight blocks), on
Hopper.  ``csrc/fp8_gemv.cu``, compiled at run time with NVRTC for the (N, K,
config, M bucket, scale modes, dtypes) it meets, cached on disk
(``scaledmm.jit``), launched on torch's current stream.

One launch per linear: every CTA quantizes the activation for its own K range
into shared memory (the codes and scales of ``quant_fp8`` /
``per_token_group_quant_fp8``, bit for bit) while its first weight loads are
in flight, then streams the e4m3 weight straight into registers and
multiplies on ``mma.sync m16n8k32`` e4m3 tensor cores with fp32
accumulation.  At decode sizes the separate quantize launch and its graph
node cost as much as a fifth of the GEMM (RESULTS.md "quant": 1.4-2.7 us per
call, 4 per Llama layer).  Split K over warps (shared memory) and over the
CTAs of a thread-block cluster (DSMEM), in a fixed order: deterministic, no
workspace, CUDA-graph safe.  Each CTA reads the whole activation (the
dynamic scales need whole rows), so the kernel is for M <= 16; where it
stops paying is measured (``scaledmm/tuning/fp8_sm90.json``,
``fp8_block_sm90.json``).

Read top to bottom: capability checks, the config space (frozen dataclass,
one validity predicate :func:`config_valid`, the measured table and the rule
behind :func:`choose_config`), the launcher, the backend entries,
registration.

Examples
--------
>>> from scaledmm.ops import fp8_gemv as fg
>>> cfg = fg.choose_config(4096, 4096, 8)
>>> fg.config_valid(cfg, 4096, 4096, 8)
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
from scaledmm.oplib import FP8_DTYPE
from scaledmm.ops import fp8 as f8

NAME = "cuda_gemv"
SOURCE = "fp8_gemv.cu"
KERNEL = "fp8_gemv"
ARCH = "sm_90a"
K_MULTIPLE = 128  # one unit: 32 bytes per thread of a quad
M_BUCKETS = (8, 16)
MAX_M = 16
IN_DTYPES = (torch.bfloat16, torch.float16)
OUT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
BIAS_CODES = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# F_ASCALE: the activation's scale, as quant_fp8's mode names it (or the 1x128 groups)
ASCALE_CODES = {"static": 0, "static_token": 1, "per_tensor": 2, "per_token": 3, "group": 4}
BSCALE_CODES = {f8.TENSOR: 0, f8.CHANNEL: 1, "block": 2}
REGS_PER_SM = 65536
MAX_REGS = 255
SMEM_STATIC_MAX = 32 * 1024  # the reduction buffer (the kernel's static_assert)
SMEM_DYNAMIC_MAX = 227 * 1024 - SMEM_STATIC_MAX

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
    return (True, f"NVRTC-compiled quantize + e4m3 mma.sync kernel ({why})") if ok else (False, why)


def _check_common(p: Problem) -> tuple[bool, str]:
    if p.in_dtype not in IN_DTYPES:
        return False, f"quantizes a bf16 or fp16 activation, got {p.in_dtype}"
    if p.m > MAX_M:
        return False, f"needs M <= {MAX_M}, got M={p.m}"
    if p.k % K_MULTIPLE != 0 or p.k <= 0:
        return False, f"needs K a positive multiple of {K_MULTIPLE}, got K={p.k}"
    if p.out_dtype not in OUT_CODES:
        return False, f"writes bf16, fp16 or fp32, got out_dtype={p.out_dtype}"
    if p.m > 1 and p.a_row_stride % 8 != 0:
        return False, f"needs an activation row stride that is a multiple of 16 bytes, got {2 * p.a_row_stride} bytes"
    if not p.opt("aligned16", True):
        return False, "needs 16-byte aligned activation and weight data pointers (vector loads)"
    for m in M_BUCKETS:
        if p.m <= m:
            ok, why = config_valid(choose_config(p.n, p.k, m), p.n, p.k, m)
            return (True, f"M <= {MAX_M}, K % {K_MULTIPLE} == 0") if ok else (False, why)
    return False, "unreachable"


def can_implement(p: Problem) -> tuple[bool, str]:
    """``fp8_linear`` (family ``fp8``) or ``fp8_block_linear`` with 128x128
    blocks (family ``fp8_block``): bf16 / fp16 activation, M <= 16,
    K % 128 == 0, 16-byte aligned operands and activation rows."""
    if p.family == Family.FP8_BLOCK and p.opt("block_size") != (128, 128):
        return False, f"needs block_size (128, 128), got {p.opt('block_size')}"
    return _check_common(p)


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Compile-time configuration of ``fp8_gemv``.

    Parameters
    ----------
    rows : int
        Weight rows per CTA (16 or 32).
    warps : int
        Warps per CTA; they take 128-wide K units round-robin.
    split_k : int
        CTAs per cluster splitting K (1, 2, 4, 8); partials added through DSMEM.
    unroll : int
        128-wide K units per register batch (two batches in flight per warp).
    """

    rows: int = 16
    warps: int = 8
    split_k: int = 1
    unroll: int = 2

    def registers(self, m_bucket: int) -> int:
        """Estimated registers per thread: two batches of 32-byte loads per
        weight row half, the accumulators, one unit of activation words, the
        addressing, and (1x128 groups) a fresh fragment per unit and its
        scales: an upper bound of ptxas' count for every scale mode (checked
        by the tests)."""
        nt, mf = self.rows // 16, m_bucket // 8
        return 2 * self.unroll * nt * 16 + 2 * nt * mf * 8 + mf * 12 + 80

    def threads(self) -> int:
        return 32 * self.warps

    def pitch(self, k: int) -> int:
        """Shared-memory bytes per activation row (the kernel's PITCH)."""
        return -(-(k // 128) // self.split_k) * 128 + 8

    def smem(self, k: int, m: int, groups: bool) -> int:
        """Dynamic shared memory of a launch with ``m`` rows: the codes, and
        the group scales (1x128 groups)."""
        units = -(-(k // 128) // self.split_k)
        return m * self.pitch(k) + (m * units * 4 if groups else 0)

    def short(self) -> str:
        return f"r{self.rows}w{self.warps}s{self.split_k}u{self.unroll}"


def config_valid(cfg: GemvConfig, n: int, k: int, m_bucket: int) -> tuple[bool, str]:
    """THE validity predicate of a config for a shape (dispatch, benchmark and
    tests).  Mirrors the kernel's static_asserts and the resource limits."""
    if not isinstance(cfg, GemvConfig):
        return False, f"expected a GemvConfig, got {type(cfg).__name__}"
    if m_bucket not in M_BUCKETS:
        return False, f"m_bucket must be one of {M_BUCKETS}, got {m_bucket}"
    if n <= 0 or k <= 0 or k % K_MULTIPLE != 0:
        return False, f"needs N > 0 and K a positive multiple of {K_MULTIPLE}, got N={n}, K={k}"
    if cfg.rows not in (16, 32):
        return False, f"rows must be 16 or 32, got {cfg.rows}"
    if cfg.split_k not in (1, 2, 4, 8):
        return False, f"split_k must be 1, 2, 4 or 8, got {cfg.split_k}"
    if not 1 <= cfg.warps <= 16:
        return False, f"warps must be 1..16, got {cfg.warps}"
    if not 1 <= cfg.unroll <= 4:
        return False, f"unroll must be 1..4, got {cfg.unroll}"
    limit = min(MAX_REGS, REGS_PER_SM // cfg.threads())
    if cfg.registers(m_bucket) > limit:
        return False, f"about {cfg.registers(m_bucket)} registers per thread, over the limit {limit}"
    if cfg.warps * cfg.rows * m_bucket * 4 > SMEM_STATIC_MAX:
        return False, f"reduction buffer over {SMEM_STATIC_MAX // 1024} KiB of shared memory"
    if cfg.smem(k, m_bucket, True) > SMEM_DYNAMIC_MAX:
        return False, (f"{m_bucket} activation rows of {cfg.pitch(k)} bytes (K / split_k) exceed "
                       f"{SMEM_DYNAMIC_MAX} bytes of shared memory: split K further")
    if k // 128 < cfg.split_k:
        return False, f"split_k {cfg.split_k} exceeds the {k // 128} 128-wide K units"
    units = k // 128
    last = units - (cfg.split_k - 1) * -(-units // cfg.split_k)
    if last < (cfg.warps - 1) * cfg.unroll + 1:
        return False, (f"{cfg.warps} warps x {cfg.unroll} units leave a warp without a batch of the last "
                       f"cluster rank's {last} K units")
    return True, "ok"


def m_bucket(m: int) -> int:
    """The M bucket (activation rows the kernel is compiled for) of ``m`` rows.

    Examples
    --------
    >>> m_bucket(1), m_bucket(8), m_bucket(9)
    (8, 8, 16)
    """
    return 8 if m <= 8 else 16


def default_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200) -> GemvConfig:
    """A config by rule: 16-row tiles (32 when there are more than four per
    SM), K split over a cluster until the CTAs cover every SM twice (each CTA
    keeping at least four units per warp), 8 warps while that gives each warp
    two register batches (fewer otherwise), two units per batch.

    Examples
    --------
    >>> default_config(4096, 4096, 8).short(), default_config(28672, 4096, 8).short()
    ('r16w8s2u1', 'r32w8s1u2')
    """
    rows = 16 if -(-n // 16) <= 4 * num_sms else 32
    tiles = -(-n // rows)
    units = k // 128
    split = 1
    while tiles * split < 2 * num_sms and split < 8 and units // (2 * split) >= 8:
        split *= 2
    while split < 8 and GemvConfig(rows, 1, split, 1).smem(k, m_bucket, True) > SMEM_DYNAMIC_MAX:
        split *= 2  # the activation rows must fit the shared memory
    per_cta = units // split
    for warps in (8, 4, 2, 1):
        for unroll in (2, 1):
            cfg = GemvConfig(rows, warps, split, unroll)
            if config_valid(cfg, n, k, m_bucket)[0] and per_cta >= 2 * warps * unroll:
                return cfg
    return GemvConfig(rows, 1, split, 1)


def tuned(n: int, k: int, m_bucket: int) -> GemvConfig | None:
    """The measured config for an ``N x K`` weight and M bucket, or None
    (read once from ``scaledmm/tuning/kernels/fp8_gemv_sm90.json``, written by
    ``python -m benchmarks.tune <sweep.csv> --kernel fp8_gemv``).

    Examples
    --------
    >>> tuned(4096, 4096, 8) is not None, tuned(64, 128, 8)
    (True, None)
    """
    return kernel_tuning.load("fp8_gemv", "sm90", GemvConfig).lookup(n, k, m_bucket)


@functools.lru_cache(maxsize=None)  # once per shape: every launch asks
def choose_config(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200) -> GemvConfig:
    """The measured config (:func:`tuned`) when it is valid, else :func:`default_config`."""
    cfg = tuned(n, k, m_bucket)
    if cfg is None or not config_valid(cfg, n, k, m_bucket)[0]:
        cfg = default_config(n, k, m_bucket, num_sms)
    return cfg


def candidate_configs(n: int, k: int, m_bucket: int, num_sms: int = NUM_SMS_H200) -> list[GemvConfig]:
    """The benchmark's sweep: the chosen config first, then tile x split x
    warps x unroll points that are valid and keep at least one batch per
    warp, nearest to the chosen config first."""
    first = choose_config(n, k, m_bucket, num_sms)
    units = k // 128
    found = []
    for rows in (16, 32):
        for split in (1, 2, 4, 8):
            for warps in (2, 4, 8, 16):
                for unroll in (1, 2, 4):
                    cfg = GemvConfig(rows, warps, split, unroll)
                    if (cfg != first and config_valid(cfg, n, k, m_bucket)[0]
                            and units / split >= warps * unroll):
                        found.append(cfg)

    def distance(c: GemvConfig) -> int:
        return (abs(c.rows.bit_length() - first.rows.bit_length())
                + abs(c.split_k.bit_length() - first.split_k.bit_length())
                + abs(c.warps.bit_length() - first.warps.bit_length()) + abs(c.unroll - first.unroll))

    return [first, *sorted(found, key=distance)]


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kernel_spec(n: int, k: int, mb: int, cfg: GemvConfig, ascale: str, bscale: str,
                in_dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.bfloat16,
                bias_dtype: torch.dtype | None = None) -> jit.NvrtcKernelSpec:
    """The NVRTC spec of one instantiation (validated)."""
    if ascale not in ASCALE_CODES:
        raise ValueError(f"ascale: expected one of {sorted(ASCALE_CODES)}, got {ascale!r}")
    if bscale not in BSCALE_CODES:
        raise ValueError(f"bscale: expected one of {sorted(BSCALE_CODES)}, got {bscale!r}")
    if (ascale == "group") != (bscale == "block"):
        raise ValueError(f"ascale, bscale: 1x128 groups go with 128x128 blocks and only they, got "
                         f"{ascale!r}, {bscale!r}")
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"in_dtype: expected bf16 or fp16, got {in_dtype}")
    if out_dtype not in OUT_CODES:
        raise ValueError(f"out_dtype: expected bf16, fp16 or fp32, got {out_dtype}")
    if bias_dtype not in BIAS_CODES:
        raise ValueError(f"bias_dtype: expected None, fp32, bf16 or fp16, got {bias_dtype}")
    ok, why = config_valid(cfg, n, k, mb)
    if not ok:
        raise ValueError(f"cfg: expected a valid config for N={n}, K={k}, M bucket {mb}, got {cfg}: {why}")
    defines = {"F_N": n, "F_K": k, "F_ROWS": cfg.rows, "F_WARPS": cfg.warps, "F_SPLIT": cfg.split_k,
               "F_UNROLL": cfg.unroll, "F_MB": mb, "F_ASCALE": ASCALE_CODES[ascale],
               "F_BSCALE": BSCALE_CODES[bscale], "F_IN_F16": int(in_dtype == torch.float16),
               "F_OUT": OUT_CODES[out_dtype], "F_BIAS": BIAS_CODES[bias_dtype]}
    return jit.NvrtcKernelSpec(KERNEL, source_path(), arch=ARCH, defines=defines)


def persistent_grid(cfg: GemvConfig, n: int, resident: int) -> tuple[int, int]:
    """The launch grid: as many CTA columns as fit at once (``resident`` CTAs
    on the GPU, ``split_k`` per column), with the row tiles dealt evenly (each
    column takes the same count, the last ones one fewer at most).

    Examples
    --------
    >>> persistent_grid(GemvConfig(16, 8, 1, 2), 28672, 264)  # 1792 tiles, 7 each
    (256, 1)
    >>> persistent_grid(GemvConfig(16, 8, 2, 1), 4096, 264)   # 256 tiles, 2 CTAs each
    (128, 2)
    """
    tiles = -(-n // cfg.rows)
    columns = max(1, resident // cfg.split_k)
    per = -(-tiles // columns)
    return -(-tiles // per), cfg.split_k


def aligned(x: torch.Tensor, b: torch.Tensor) -> bool:
    """The 16-byte alignment the kernel's vector loads need (host-side, no sync)."""
    return (x.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
            and (x.shape[0] <= 1 or x.stride(0) * x.element_size() % 16 == 0))


def require_aligned(x: torch.Tensor, b: torch.Tensor) -> None:
    """Raise ``ValueError`` for operands the vector loads cannot read
    (automatic selection never sends them; this guards direct calls)."""
    if not aligned(x, b):
        raise ValueError(f"x, b: expected 16-byte aligned data pointers and activation row stride, got "
                         f"x at {x.data_ptr() % 16} mod 16 with row stride {x.stride(0) * x.element_size()} "
                         f"bytes, b at {b.data_ptr() % 16} mod 16")


def launch(x: torch.Tensor, b: torch.Tensor, scale_x: torch.Tensor | None, scale_b: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, ascale: str, bscale: str, eps: float = 1e-10,
           cfg: GemvConfig | None = None, q_out: torch.Tensor | None = None,
           s_out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel into ``out`` ([M, N], contiguous) on the current stream.

    Arguments must already be validated (``fp8.check_linear_args`` /
    ``fp8_block.check_linear_args``), with 1 <= M <= 16, K % 128 == 0 and
    :func:`aligned` operands.  ``q_out`` / ``s_out`` (contiguous, optional):
    also write the codes ``[M, K]`` and the scales the kernel computed (the
    quantizer's outputs: ``[1]``, ``[M]`` or ``[M, K / 128]``).  With
    :func:`scaledmm.device.pdl` the launch is a programmatic dependent one.
    """
    m = x.shape[0]
    n, k = b.shape
    mb = m_bucket(m)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    num_sms = sm_count(dev)
    cfg = cfg or choose_config(n, k, mb, num_sms)
    use_pdl = pdl(x.device)
    spec = kernel_spec(n, k, mb, cfg, ascale, bscale, x.dtype, out.dtype, None if bias is None else bias.dtype)
    kern = spec.kernel()
    smem = cfg.smem(k, m, ascale == "group")
    per_sm = kern.max_active_blocks(cfg.threads(), smem, dev)  # raises the shared-memory limit first
    if per_sm < 1:
        raise RuntimeError(f"fp8_gemv {cfg.short()}: expected a CTA of {cfg.threads()} threads and {smem} bytes "
                           f"of dynamic shared memory to fit an SM, the driver says none does")
    kern.launch(persistent_grid(cfg, n, per_sm * num_sms), cfg.threads(),
                (x, ctypes.c_longlong(x.stride(0)), b, scale_x, scale_b, bias, out, ctypes.c_int(m),
                 ctypes.c_float(eps), q_out, s_out),
                device=x.device, shared_mem=smem, pdl=use_pdl)
    return out


# ----------------------------------------------------------------------------
# Backend entries
# ----------------------------------------------------------------------------


def gemv_linear(x, b, scale_b, scale_x=None, per_token=False, bias=None, out_dtype=torch.bfloat16,
                cfg: GemvConfig | None = None):
    """Backend entry of ``fp8_linear``: a fresh ``[M, N]``
    ``quant_fp8(x, scale_x, per_token)`` times ``b`` with ``scale_b``, + bias.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)             # doctest: +SKIP
    >>> w, ws = torch.ops.scaledmm.quant_fp8(torch.randn(4096, 4096, device="cuda"), None, True)  # doctest: +SKIP
    >>> with scaledmm.use_backend("fp8", "cuda_gemv"):                            # doctest: +SKIP
    ...     out = torch.ops.scaledmm.fp8_linear(x, w, ws.reshape(-1), None, True)
    """
    kind_b = f8.scale_b_kind("fp8_linear", scale_b, b.shape[0])
    out = torch.empty((x.shape[0], b.shape[0]), dtype=out_dtype, device=x.device)
    if x.shape[0] == 0 or b.shape[0] == 0:
        return out
    require_aligned(x, b)
    sx = None if scale_x is None else scale_x.reshape(-1).contiguous()
    return launch(x, b, sx, scale_b.reshape(-1).contiguous(), bias, out, f8.quant_mode(scale_x, per_token),
                  kind_b, cfg=cfg)


def gemv_block_linear(x, b, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16, bias=None,
                      cfg: GemvConfig | None = None):
    """Backend entry of ``fp8_block_linear`` (128x128 blocks): a fresh
    ``[M, N]`` ``per_token_group_quant_fp8(x, 128)`` times ``b`` with its block
    scales, + bias.

    Examples
    --------
    >>> import torch, scaledmm
    >>> from scaledmm.ops.fp8_block import quantize_weight
    >>> x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)             # doctest: +SKIP
    >>> w, ws = quantize_weight(torch.randn(4096, 4096, device="cuda"))           # doctest: +SKIP
    >>> with scaledmm.use_backend("fp8_block", "cuda_gemv"):                      # doctest: +SKIP
    ...     out = torch.ops.scaledmm.fp8_block_linear(x, w, ws)
    """
    if tuple(int(v) for v in block_size) != (128, 128):
        raise ValueError(f"block_size: expected [128, 128] (the kernel's blocks), got {list(block_size)}")
    out = torch.empty((x.shape[0], b.shape[0]), dtype=out_dtype, device=x.device)
    if x.shape[0] == 0 or b.shape[0] == 0:
        return out
    require_aligned(x, b)
    return launch(x, b, None, b_scales.contiguous(), bias, out, "group", "block", cfg=cfg)


def quantize_and_linear(x, b, scale_b, ascale: str, bscale: str, scale_x=None, bias=None,
                        out_dtype=torch.bfloat16, cfg: GemvConfig | None = None):
    """``(q, s, out)``: the codes and scales the kernel computed (the
    quantizer's outputs, for the tests' bit-for-bit check) and its output.

    Examples
    --------
    >>> import torch
    >>> x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)             # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn)        # doctest: +SKIP
    >>> one = torch.ones(1, device="cuda")                                        # doctest: +SKIP
    >>> q, s, out = quantize_and_linear(x, w, one, "per_token", "tensor")         # doctest: +SKIP
    """
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, k // 128) if ascale == "group" else (m,), dtype=torch.float32, device=x.device)
    out = torch.empty((m, b.shape[0]), dtype=out_dtype, device=x.device)
    require_aligned(x, b)
    sx = None if scale_x is None else scale_x.reshape(-1).contiguous()
    launch(x, b, sx, scale_b.contiguous(), bias, out, ascale, bscale, cfg=cfg, q_out=q.view(torch.uint8),
           s_out=s)
    return q, s, out


# ----------------------------------------------------------------------------
# Backend registration (its place in automatic selection: scaledmm/tuning/fp8*_sm90.json)
# ----------------------------------------------------------------------------


backends.register(Backend(
    Family.FP8, NAME,
    impls={"fp8_linear": gemv_linear},
    is_supported=is_supported,
    can_implement=can_implement,
    description=f"NVRTC quantize + e4m3 mma.sync in one launch, M <= {MAX_M} (csrc/{SOURCE})",
))
backends.register(Backend(
    Family.FP8_BLOCK, NAME,
    impls={"fp8_block_linear": gemv_block_linear},
    is_supported=is_supported,
    can_implement=can_implement,
    description=f"NVRTC 1x128 quantize + 128x128 block e4m3 mma.sync in one launch, M <= {MAX_M} (csrc/{SOURCE})",
))


# ----------------------------------------------------------------------------
# Pre-build hook: python -m scaledmm.jit build --fp8-gemv N:K[,N:K...]
# ----------------------------------------------------------------------------


def prebuild_specs(value: str) -> list[jit.NvrtcKernelSpec]:
    """Specs of both M buckets with bf16 activations and outputs, no bias, for
    the three layer formats (per-token x per-channel, per-tensor, blocks) of
    each ``N:K``."""
    specs: dict[str, jit.NvrtcKernelSpec] = {}
    for n, k in jit.parse_shapes(value, "fp8-gemv"):
        for mb in M_BUCKETS:
            for ascale, bscale in (("per_token", f8.CHANNEL), ("per_tensor", f8.TENSOR), ("group", "block")):
                spec = kernel_spec(n, k, mb, choose_config(n, k, mb), ascale, bscale)
                specs.setdefault(spec.key, spec)
    return list(specs.values())


jit.register_prebuild("fp8-gemv", prebuild_specs,
                      help="N:K[,N:K...] FP8 small-M linear kernels (both M buckets, the three layer formats)")

__all__ = ["GemvConfig", "can_implement", "candidate_configs", "choose_config", "config_valid", "default_config",
           "gemv_block_linear", "gemv_linear", "is_supported", "kernel_spec", "launch", "m_bucket",
           "persistent_grid", "prebuild_specs", "quantize_and_linear", "tuned"]
