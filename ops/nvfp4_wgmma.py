"""Backend ``cuda_wgmma`` of the ``nvfp4`` family: our Hopper GEMM for W4A4
``nvfp4_mm`` and W4A16 ``nvfp4_w4a16_mm`` from tens of activation rows up,
``csrc/nvfp4_wgmma.cu``, compiled at run time with NVRTC for the (N, K,
config, output / bias dtype) it meets, cached on disk (``scaledmm.jit``),
launched on torch's current stream.

The FP4 weight is decoded in registers (exact: an e2m1 code times its e4m3
scale fits fp16 and bf16) and fed to ``wgmma`` as the register operand; the
16-bit activation is the shared-memory operand, brought by TMA a few 64-wide
K stages ahead.  Weight rows are the MMA's M side (64 per warpgroup),
activation rows its N side (32-256 per CTA), so one kernel serves M from a
few tens to thousands (256-row tiles with two warpgroups take a producer
warpgroup that hands them its registers: ``producer_wg``; no measured table
row uses them yet).  Each thread decodes contiguous weight bytes; the
activation's K runs in the matching order inside every 64 (:func:`permute_k`,
a copy per call for W4A16).  W4A4 decodes the activation once per call to
fp16, exactly and already in that order
(:func:`scaledmm.ops.nvfp4_triton_decode.dequant` with ``permute_k``), and runs the
same kernel.  Split K over the CTAs of a cluster (DSMEM, rank order):
deterministic, no workspace, CUDA-graph safe.  See the .cu file's header for
the design.

Read top to bottom: capability checks, the config space (frozen dataclass,
one validity predicate :func:`config_valid`, :func:`choose_config` from the
measured table ``scaledmm/tuning/kernels/nvfp4_wgmma_sm90.json`` or a rule),
the launcher, backend registration (its place in the sm90 selection policy:
``scaledmm/tuning/nvfp4_sm90.json``; switch ``SCALEDMM_NVFP4_WGMMA=0``), the
pre-build hook.

Examples
--------
>>> from scaledmm.ops import nvfp4_wgmma as wg
>>> cfg = wg.choose_config(4096, 4096, 512)
>>> wg.config_valid(cfg, 4096, 4096)
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
from scaledmm.ops import nvfp4_gemv as gv

FAMILY = Family.NVFP4
NAME = "cuda_wgmma"
OP = "nvfp4_mm"
OP_W4A16 = "nvfp4_w4a16_mm"
SOURCE = "nvfp4_wgmma.cu"
KERNEL = "nvfp4_wgmma"
ARCH = "sm_90a"
K_MULTIPLE = 64  # one pipeline stage: a 128-byte row of 16-bit activation
OUT_DTYPES = gv.OUT_DTYPES
W4A4_ACT = torch.float16  # the activation decode of W4A4 (exact)
MAX_REGS = 255
SMEM_MAX = 227 * 1024
TILES = (32, 64, 128, 256)
# Registers a thread gets when nine warps share the SM (three on one quadrant),
# and what setmaxnreg gives the consumers with a producer warpgroup (CONSUMER_REGS in csrc/wgmma_ptx.cuh).
REG_LIMIT_9_WARPS = 168
PWG_REG_LIMIT = 232

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
    """An sm90 GPU with NVRTC and the CUDA driver bindings (wgmma, clusters: sm_90a)."""
    ok, why = jit.sm90a_gate(device)
    return (True, f"NVRTC-compiled register-decode wgmma kernel ({why})") if ok else (False, why)


def can_implement(p: Problem) -> tuple[bool, str]:
    """``nvfp4_mm`` or ``nvfp4_w4a16_mm`` (fp16 / bf16 activation), any M,
    K % 64 == 0, bf16/fp16 output, operands and activation rows 16-byte aligned."""
    ok, why = gv.check_problem(p, max_m=1 << 62)
    if not ok:
        return ok, why
    if p.k % K_MULTIPLE != 0:
        return False, f"needs K a positive multiple of {K_MULTIPLE}, got K={p.k}"
    return True, f"K % {K_MULTIPLE} == 0"


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    """Compile-time configuration of ``nvfp4_wgmma``.

    Parameters
    ----------
    tile_m : int
        Activation rows per CTA, the wgmma N (32, 64, 128, 256).
    warpgroups : int
        Consumer warpgroups (1 or 2); the CTA owns ``64 * warpgroups`` weight rows.
    stages : int
        TMA ring stages of 64 K (4-8); the producer runs up to ``stages - 1`` ahead.
    split_k : int
        CTAs per cluster splitting K (1, 2, 4); partial tiles added through DSMEM.
    producer_wg : int
        1 (two warpgroups only): the producer is a warpgroup that hands its
        registers to the consumers (setmaxnreg; :data:`PWG_REG_LIMIT`
        each), so two warpgroups of 256-row tiles fit; 0: one producer warp.
    persistent : int
        1 (``split_k`` 1): a grid of as many CTAs as fit the SMs at once walks
        the tiles, the producer loading the next tile's stages while the
        consumers store this one's; 0: one CTA per tile.
    """

    tile_m: int = 128
    warpgroups: int = 2
    stages: int = 4
    split_k: int = 1
    producer_wg: int = 0
    persistent: int = 0

    def rows(self) -> int:
        return 64 * self.warpgroups

    def threads(self) -> int:
        """The consumer warpgroups and the producer warp (warpgroup)."""
        return 128 * self.warpgroups + (128 if self.producer_wg else 32)

    def register_limit(self) -> int:
        """Registers a consumer thread may hold: the instruction's limit with
        one warpgroup, the per-quadrant share of nine warps with two, what
        setmaxnreg gives with ``producer_wg``."""
        if self.producer_wg:
            return PWG_REG_LIMIT
        return MAX_REGS if self.warpgroups == 1 else REG_LIMIT_9_WARPS

    def registers(self) -> int:
        """Estimated registers per thread (accumulators, two A fragment sets,
        a stage of weight words, addresses, the split-K reduce): an upper
        bound of ptxas' count up to 128-row tiles, what a 256-row tile needs
        without spills under a producer warpgroup's 232 (with one
        warpgroup ptxas spends up to 255 on it); checked by the tests."""
        return self.tile_m // 2 + 100

    def stage_bytes(self) -> int:
        return -(-(self.tile_m * 128 + self.rows() * 32 + 512) // 1024) * 1024

    def smem_bytes(self) -> int:
        """Dynamic shared memory: the stages (or the split-K partial tile),
        their two barriers each, and 1 KiB to align the base for the 128-byte
        swizzle."""
        red = self.tile_m * self.rows() * 4 if self.split_k > 1 else 0
        return max(self.stages * self.stage_bytes(), red) + 16 * self.stages + 1024

    def tiles(self, n: int, m: int) -> int:
        """Output tiles of an ``m x n`` product."""
        return -(-m // self.tile_m) * -(-n // self.rows())

    def grid(self, n: int, m: int, resident: int = 0) -> tuple[int, int, int]:
        """(activation tiles, weight tiles, split_k): the activation tiles of a
        weight tile run side by side and meet it in L2.  Persistent: (CTAs, 1,
        1), one per tile up to ``resident``, the CTAs that fit the GPU at once."""
        if self.persistent:
            return (max(1, min(self.tiles(n, m), resident)), 1, 1)
        return (-(-m // self.tile_m), -(-n // self.rows()), self.split_k)

    def defines(self, n: int, k: int, out_dtype: torch.dtype, bias_dtype: torch.dtype | None,
                act_dtype: torch.dtype) -> dict[str, int]:
        d = {"W_N": n, "W_K": k, "W_BT": self.tile_m, "W_WG": self.warpgroups, "W_ST": self.stages,
             "W_SPLIT": self.split_k, "W_ACT": gv.ACT_CODES[act_dtype],
             "W_OUT_F16": int(out_dtype == torch.float16), "W_BIAS": gv.BIAS_CODES[bias_dtype]}
        if self.producer_wg:
            d["W_PWG"] = 1
        if self.persistent:
            d["W_PERSIST"] = 1
        return d

    def short(self) -> str:
        return (f"m{self.tile_m}g{self.warpgroups}s{self.stages}k{self.split_k}" + ("p" if self.producer_wg else "")
                + ("r" if self.persistent else ""))


def config_valid(cfg: WgmmaConfig, n: int, k: int) -> tuple[bool, str]:
    """THE validity predicate of a config for a shape (dispatch, benchmark and
    tests).  Mirrors the kernel's static_asserts and the resource limits."""
    if not isinstance(cfg, WgmmaConfig):
        return False, f"expected a WgmmaConfig, got {type(cfg).__name__}"
    if n <= 0 or k <= 0 or k % K_MULTIPLE != 0:
        return False, f"needs N > 0 and K a positive multiple of {K_MULTIPLE}, got N={n}, K={k}"
    if cfg.tile_m not in TILES:
        return False, f"tile_m must be one of {TILES}, got {cfg.tile_m}"
    if cfg.warpgroups not in (1, 2):
        return False, f"warpgroups must be 1 or 2, got {cfg.warpgroups}"
    if not 4 <= cfg.stages <= 8:
        return False, f"stages must be 4..8, got {cfg.stages}"
    if cfg.split_k not in (1, 2, 4):
        return False, f"split_k must be 1, 2 or 4, got {cfg.split_k}"
    if cfg.producer_wg not in (0, 1):
        return False, f"producer_wg must be 0 or 1, got {cfg.producer_wg}"
    if cfg.persistent not in (0, 1):
        return False, f"persistent must be 0 or 1, got {cfg.persistent}"
    if cfg.persistent and cfg.split_k != 1:
        return False, f"persistent needs split_k 1, got split_k={cfg.split_k}"
    # compute-sanitizer on the GPU: synccheck finds divergent threads at the
    # split-K reduction's barrier under a producer warpgroup (benchmarks/NOTES.md);
    # out until cleared.
    if cfg.producer_wg and cfg.split_k != 1:
        return False, f"producer_wg needs split_k 1 (not sanitizer-clean otherwise), got split_k={cfg.split_k}"
    if cfg.producer_wg and cfg.warpgroups != 2:
        return False, f"producer_wg needs two consumer warpgroups, got warpgroups={cfg.warpgroups}"
    if (cfg.split_k - 1) * -(-(k // K_MULTIPLE) // cfg.split_k) >= k // K_MULTIPLE:
        return False, f"split_k {cfg.split_k} leaves a cluster rank without any of the {k // K_MULTIPLE} K stages"
    if cfg.registers() > cfg.register_limit():
        return False, (f"about {cfg.registers()} registers per thread, over the limit {cfg.register_limit()} "
                       f"of {cfg.threads()} threads")
    if cfg.smem_bytes() > SMEM_MAX:
        return False, f"{cfg.smem_bytes()} bytes of shared memory, over {SMEM_MAX}"
    return True, "ok"


def tuned(n: int, k: int, m: int) -> WgmmaConfig | None:
    """The measured config for an ``N x K`` weight at ``m`` rows, or None
    (read once from ``scaledmm/tuning/kernels/nvfp4_wgmma_sm90.json``; one
    table for W4A4 and W4A16: the kernel is the same).

    Examples
    --------
    >>> tuned(64, 128, 64) is None
    True
    """
    return _table().lookup(n, k, m)


def _table() -> kernel_tuning.KernelTable:
    return kernel_tuning.load("nvfp4_wgmma", "sm90", WgmmaConfig)


def __getattr__(name: str):
    # TUNING: the file's rows as {(n, k): {max_m: config}}
    if name == "TUNING":
        return _table().by_shape()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_config(n: int, k: int, m: int, num_sms: int = NUM_SMS_H200) -> WgmmaConfig:
    """A config for an unseen shape: the activation tile that covers M in
    the fewest 32-row steps up to 128, two warpgroups, split K until every SM
    has a CTA while each split keeps at least 16 stages.

    Examples
    --------
    >>> default_config(4096, 4096, 64).short(), default_config(28672, 4096, 512).short()
    ('m64g2s6k4', 'm128g2s4k1')
    """
    tile = 32 if m <= 32 else 64 if m <= 64 else 128
    stages = 6 if tile <= 64 else 4
    cfg = WgmmaConfig(tile, 2, stages, 1)
    tiles = cfg.grid(n, m)[0] * cfg.grid(n, m)[1]
    split, stages_k = 1, k // K_MULTIPLE
    while tiles * split < num_sms and split < 4 and stages_k >= 16 * split * 2:
        split *= 2
    cfg = dataclasses.replace(cfg, split_k=split)
    return cfg if config_valid(cfg, n, k)[0] else WgmmaConfig(tile, 2, 4, 1)


@functools.lru_cache(maxsize=4096)  # once per shape and M: every launch asks
def choose_config(n: int, k: int, m: int, num_sms: int = NUM_SMS_H200) -> WgmmaConfig:
    """The measured config (:func:`tuned`) or :func:`default_config`."""
    cfg = tuned(n, k, m)
    if cfg is None or not config_valid(cfg, n, k)[0]:
        cfg = default_config(n, k, m, num_sms)
    return cfg


def candidate_configs(n: int, k: int, m: int, num_sms: int = NUM_SMS_H200) -> list[WgmmaConfig]:
    """The benchmark's sweep: the chosen config first, then every valid
    tile x warpgroups x stages x split point (with two warpgroups at tile
    256 a producer warpgroup too; unsplit tiles of 128 rows and more also
    persistent) with one of the two largest tiles up to 2 M."""
    first = choose_config(n, k, m, num_sms)
    tiles = [t for t in TILES if t <= max(32, 2 * m)][-2:]
    found = [WgmmaConfig(t, g, s, sk, p, r) for t in reversed(tiles) for g in (2, 1) for s in (4, 6)
             for sk in (1, 2, 4) for p in ((0, 1) if g == 2 and t == 256 else (0,))
             for r in ((0, 1) if sk == 1 and t >= 128 else (0,))]
    return [first, *[c for c in found if c != first and config_valid(c, n, k)[0]]]


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kernel_spec(n: int, k: int, cfg: WgmmaConfig, out_dtype: torch.dtype = torch.bfloat16,
                bias_dtype: torch.dtype | None = None, act_dtype: torch.dtype = torch.bfloat16) -> jit.NvrtcKernelSpec:
    """The NVRTC spec of one instantiation (validated); ``act_dtype`` is the
    16-bit operand type (fp16 for W4A4)."""
    gv.check_spec_dtypes(act_dtype, out_dtype, bias_dtype)
    if act_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"act_dtype: expected fp16 or bf16 (W4A4 runs on its fp16 decode), got {act_dtype}")
    ok, why = config_valid(cfg, n, k)
    if not ok:
        raise ValueError(f"cfg: expected a valid config for N={n}, K={k}, got {cfg}: {why}")
    return jit.NvrtcKernelSpec(KERNEL, source_path(), arch=ARCH,
                               defines=cfg.defines(n, k, out_dtype, bias_dtype, act_dtype))


def launch(x: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, alpha: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, cfg: WgmmaConfig | None = None) -> torch.Tensor:
    """Run the kernel into ``out`` ([M, N], contiguous) on the current stream.

    ``x`` a 16-bit activation [M, K] (rows 16-byte aligned) in
    :func:`permute_k` order, ``b`` packed e2m1 [N, K / 2] with swizzled
    ``b_scales``; validated arguments, M >= 1.  With
    :func:`scaledmm.device.pdl` the launch is a programmatic dependent one.
    """
    m = x.shape[0]
    n, k = b.shape[0], 2 * b.shape[1]
    if b_scales.data_ptr() % 16 or not b_scales.is_contiguous():
        raise ValueError(f"b_scales: expected a contiguous swizzled tensor at a 16-byte aligned address, got "
                         f"strides {tuple(b_scales.stride())} at {b_scales.data_ptr() % 16} mod 16")
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    cfg = cfg or choose_config(n, k, m, sm_count(dev))
    use_pdl = pdl(x.device)
    spec = kernel_spec(n, k, cfg, out.dtype, None if bias is None else bias.dtype, x.dtype)
    x_map = jit.tensor_map_2d(x.data_ptr(), 2 if x.dtype == torch.float16 else 3, k, m,
                              x.stride(0) * x.element_size(), K_MULTIPLE, cfg.tile_m, 128)
    w_map = jit.tensor_map_2d(b.data_ptr(), 1, k // 2, n, b.stride(0), K_MULTIPLE // 2, cfg.rows(), 32)
    s_map = jit.tensor_map_2d(b_scales.data_ptr(), 1, 256, b_scales.numel() // 256, 256, 256, 2, 0)
    kern, smem = spec.kernel(), cfg.smem_bytes()
    grid = cfg.grid(n, m)
    if cfg.persistent:
        per_sm = kern.max_active_blocks(cfg.threads(), smem, dev)  # raises the shared-memory limit first
        if per_sm < 1:
            raise RuntimeError(f"nvfp4_wgmma {cfg.short()}: expected a CTA of {cfg.threads()} threads and {smem} "
                               f"bytes of dynamic shared memory to fit an SM, the driver says none does")
        grid = cfg.grid(n, m, per_sm * sm_count(dev))
    kern.launch(grid, cfg.threads(), (x_map, w_map, s_map, alpha, bias, out, ctypes.c_int(m)),
                device=x.device, shared_mem=smem, pdl=use_pdl)
    return out


def permute_k(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] (K % 64 == 0, unit column stride) with K reordered inside
    every 64 the way the kernel's weight decode meets it: column ``16 j + 8 h
    + 2 t + e`` of a 64 takes column ``16 t + 8 h + 4 e + j`` (t, j < 4; h, e
    < 2).  A fresh contiguous tensor (a temporary of the call); on a GPU one
    Triton pass (:func:`scaledmm.ops.nvfp4_triton_decode.permute_k16`).

    Examples
    --------
    >>> permute_k(torch.arange(64.0).reshape(1, 64))[0, :8].tolist()
    [0.0, 4.0, 16.0, 20.0, 32.0, 36.0, 48.0, 52.0]
    """
    if x.is_cuda:
        from scaledmm.ops import nvfp4_triton_decode as nd

        return nd.permute_k16(x)
    m, k = x.shape
    return x.view(m, k // 64, 4, 2, 2, 4).permute(0, 1, 5, 3, 2, 4).reshape(m, k)


def _launch_w4a4(a, b, a_scales, b_scales, alpha, bias, out, cfg):
    from scaledmm.ops import nvfp4_triton_decode as nd

    return launch(nd.dequant(a, a_scales, W4A4_ACT, permute_k=True), b, b_scales, alpha, bias, out, cfg)


def _launch_w4a16(x, b, _unused, b_scales, alpha, bias, out, cfg):
    return launch(permute_k(x), b, b_scales, alpha, bias, out, cfg)


def wgmma_mm(a, b, a_scales, b_scales, alpha, out_dtype=torch.bfloat16, bias=None, cfg: WgmmaConfig | None = None):
    """Backend entry of ``nvfp4_mm``: the activation decoded to fp16 once
    (exact), then the kernel; a fresh ``[M, N]`` ``alpha * deq(a) @ deq(b).T (+ bias)``.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                            # doctest: +SKIP
    >>> qa, sa = torch.ops.scaledmm.nvfp4_quant(x, one)                   # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                   # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "cuda_wgmma"):                 # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, one)
    """
    return gv.run_mm(_launch_w4a4, a, b, a_scales, b_scales, alpha, out_dtype, bias, cfg)


def wgmma_w4a16(x, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None, cfg: WgmmaConfig | None = None):
    """Backend entry of ``nvfp4_w4a16_mm`` (fp16 / bf16 ``x``).

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                            # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                   # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "cuda_wgmma"):                 # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, one)
    """
    return gv.run_w4a16(_launch_w4a16, x, b, b_scales, weight_alpha, out_dtype, bias, cfg)


# ----------------------------------------------------------------------------
# Backend registration (its place in automatic selection: scaledmm/tuning/nvfp4_sm90.json)
# ----------------------------------------------------------------------------


backends.register(Backend(
    FAMILY, NAME,
    impls={OP: wgmma_mm, OP_W4A16: wgmma_w4a16},
    is_supported=is_supported,
    can_implement=can_implement,
    description=f"NVRTC FP4 decode in registers + wgmma, W4A4 and W4A16, any M, K % 64 == 0 (csrc/{SOURCE})",
))


# ----------------------------------------------------------------------------
# Pre-build hook: python -m scaledmm.jit build --nvfp4-wgmma N:K[,N:K...]
# ----------------------------------------------------------------------------

PREBUILD_M = (64, 128, 512, 4096)


def prebuild_specs(value: str) -> list[jit.NvrtcKernelSpec]:
    """Specs of the configs chosen at M = 64, 128, 512 and 4096, both output
    dtypes, fp16 (W4A4, fp16 W4A16) and bf16 operands (no bias) for each ``N:K``."""
    specs: dict[str, jit.NvrtcKernelSpec] = {}
    for n, k in jit.parse_shapes(value, "nvfp4-wgmma"):
        for act in (torch.float16, torch.bfloat16):
            for m in PREBUILD_M:
                for dt in OUT_DTYPES:
                    spec = kernel_spec(n, k, choose_config(n, k, m), dt, None, act)
                    specs.setdefault(spec.key, spec)
    return list(specs.values())


jit.register_prebuild("nvfp4-wgmma", prebuild_specs,
                      help="N:K[,N:K...] NVFP4 wgmma kernels (the configs of M = 64, 128, 512, 4096; bf16 and fp16 "
                           "outputs and operands)")
