"""Backend ``cuda_wgmma`` of the ``fp8`` and ``fp8_block`` families: our
Hopper GEMM for ``fp8_scaled_mm`` (per-tensor / per-token activation scales,
per-tensor / per-channel weight scales) and ``fp8_block_mm`` (DeepSeek-V3's
1 x 128 / 128 x 128 block scales) from one activation row to a few hundred,
``csrc/fp8_wgmma.cu``, compiled at run time with NVRTC for the (N, K,
config, output / bias dtype) it meets, cached on disk (``scaledmm.jit``),
launched on torch's current stream.

Both e4m3 operands come by TMA, 128 K per stage, into a shared-memory ring
that a producer warp keeps a few stages ahead; consumer warpgroups multiply
on ``wgmma`` e4m3 tensor cores with the weight rows as the MMA's M side (64
per warpgroup) and the activation rows as its N side (16-128 per CTA), so a
batch of a few rows wastes no MMA rows.  Partial sums are promoted into fp32
accumulators (the contract's fp32 accumulation across K; a long chain of
e4m3 MMAs does not keep fp32): each k32 step (``chain`` 1) or each 128-K
stage of four chained steps (``chain`` 4, the accumulation of cuBLAS's and
DeepGEMM's FP8 GEMMs); inside the tensor core the sums have somewhat less
than fp32 precision, as cuBLAS's and Triton's FP8 GEMMs on sm90 have.  The
per-tensor / row / column scales and bias are applied once in the epilogue
with one rounding; block scales at each stage's promotion (the producer warp
copies each stage's activation scales, any strides).  Split K over the CTAs
of a cluster (DSMEM, rank order): deterministic, no workspace, CUDA-graph
safe.  Two warpgroups of 128-row tiles with the block scales need more
registers than nine warps leave a thread: ``producer_wg`` makes the
producer a warpgroup that hands its registers to the consumers (the
large-M tile).  ``persistent`` launches only the CTAs that fit the GPU at
once; each walks tiles in bands that share operand panels in L2, its
producer loading the next tile while the consumers store this one.  Where it runs instead of
cuBLAS, CUTLASS or the Triton GEMMs is measured
(``scaledmm/tuning/fp8_sm90.json``, ``fp8_block_sm90.json``);
``fp8_linear`` / ``fp8_block_linear`` reach it through their composites
(quantize, then the GEMM).  :func:`block_linear` runs ``fp8_block_linear`` in
one launch (the bf16 / fp16 activation by TMA, each stage's 1 x 128 groups
quantized in shared memory by the consumer warpgroups, bit for bit
``per_token_group_quant_fp8``); it is not registered: on the measured shapes
the quantization on the consumers' critical path makes it slower than the
composite (benchmarks/NOTES.md).

Read top to bottom: capability checks, the config space (frozen dataclass,
one validity predicate :func:`config_valid`, :func:`choose_config` from the
measured tables ``scaledmm/tuning/kernels/fp8_wgmma[_block]_sm90.json`` or a rule),
the launcher, backend registration (switch ``SCALEDMM_FP8_WGMMA=0``), the
pre-build hook.

Examples
--------
>>> from scaledmm.ops import fp8_wgmma as fw
>>> cfg = fw.choose_config(4096, 4096, 64)
>>> fw.config_valid(cfg, 4096, 4096)
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
from scaledmm.ops import fp8_block as fb

FAMILY = Family.FP8
NAME = "cuda_wgmma"
OP = "fp8_scaled_mm"
SOURCE = "fp8_wgmma.cu"
KERNEL = "fp8_wgmma"
ARCH = "sm_90a"
KB = 128  # K per pipeline stage: one 128-byte swizzle row of e4m3
OUT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
BIAS_CODES = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
IN_CODES = {torch.bfloat16: 0, torch.float16: 1}  # fp8_block_linear's activation, quantized in the kernel
TILES = (16, 32, 64, 128)
# Registers per thread: nine warps put three on one SM quadrant (16384 / 96,
# rounded down to 8); five warps leave the instruction's limit.
REG_LIMIT = {1: 255, 2: 168}
# With a producer warpgroup (``producer_wg``) the consumers raise theirs with
# setmaxnreg to this (CONSUMER_REGS in csrc/wgmma_ptx.cuh).
PWG_REG_LIMIT = 232
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
    """An sm90 GPU with NVRTC and the CUDA driver bindings (wgmma, TMA, clusters: sm_90a)."""
    ok, why = jit.sm90a_gate(device)
    return (True, f"NVRTC-compiled TMA + e4m3 wgmma kernel ({why})") if ok else (False, why)


def _dtypes_why(p: Problem) -> str:
    """Why the operand / output dtypes do not fit either kernel ('' if they do)."""
    if p.in_dtype != FP8_DTYPE:
        return f"needs e4m3 operands, got {p.in_dtype}"
    if p.out_dtype not in OUT_CODES:
        return f"writes bf16, fp16 or fp32, got out_dtype={p.out_dtype}"
    return ""


def can_implement(p: Problem) -> tuple[bool, str]:
    """``fp8_scaled_mm`` with e4m3 operands, any scale kinds, bf16 / fp16 /
    fp32 output, any M and activation row stride (rows that are not 16-byte
    aligned are copied), a weight at a 16-byte aligned address (read in place
    by TMA).

    Examples
    --------
    >>> import torch
    >>> p = Problem(Family.FP8, torch.device("cpu"), 64, 4096, 4096, torch.float8_e4m3fn, torch.bfloat16, 4096,
    ...             (("scale_a", "token"), ("scale_b", "channel"), ("bias_dtype", None), ("b_aligned", True)))
    >>> can_implement(p)
    (True, 'any M; K % 16 == 0 (TMA zero-fills the last stage)')
    """
    why = _dtypes_why(p)
    if why:
        return False, why
    if p.opt("bias_dtype") not in BIAS_CODES:
        return False, f"adds an fp32, bf16 or fp16 bias, got {p.opt('bias_dtype')}"
    if not p.opt("b_aligned", True):
        return False, "needs the weight b at a 16-byte aligned address (TMA reads it in place)"
    if p.k % 16 != 0 or p.k <= 0:
        return False, f"needs K a positive multiple of 16, got K={p.k}"
    return True, "any M; K % 16 == 0 (TMA zero-fills the last stage)"


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    """Compile-time configuration of ``fp8_wgmma``.

    Parameters
    ----------
    tile_m : int
        Activation rows per CTA, the wgmma N (16, 32, 64, 128).
    warpgroups : int
        Consumer warpgroups (1 or 2); the CTA owns ``64 * warpgroups`` weight rows.
    stages : int
        TMA ring stages of 128 K (2-8); the producer runs up to ``stages - 1`` ahead.
    split_k : int
        CTAs per cluster splitting K (1, 2, 4); partial tiles added through DSMEM.
    chain : int
        k32 steps summed inside the tensor core per fp32 promotion: 1 (each
        step a fresh fragment) or 4 (one promotion per 128-K stage).
    producer_wg : int
        1 (two warpgroups only): the producer is a warpgroup that hands its
        registers to the consumers (setmaxnreg; :data:`PWG_REG_LIMIT` each),
        so the 128 x 128 tile of large M fits; 0: one producer warp.
    persistent : int
        1 (``split_k`` 1): a grid of as many CTAs as fit the SMs at once walks
        the tiles, the producer loading the next tile's stages while the
        consumers store this one's; 0: one CTA per tile.
    """

    tile_m: int = 64
    warpgroups: int = 2
    stages: int = 6
    split_k: int = 1
    chain: int = 1
    producer_wg: int = 0
    persistent: int = 0

    def rows(self) -> int:
        return 64 * self.warpgroups

    def threads(self) -> int:
        """The consumer warpgroups and the producer warp (warpgroup)."""
        return 128 * self.warpgroups + (128 if self.producer_wg else 32)

    def register_limit(self) -> int:
        """Registers a consumer thread may hold: the launch's share of the
        register file, or what setmaxnreg gives it with ``producer_wg``."""
        return PWG_REG_LIMIT if self.producer_wg else REG_LIMIT.get(self.warpgroups, 0)

    def fragments(self) -> int:
        """Fragments in flight together (the kernel's FR): one per k32 step
        of a group with ``chain`` 1, one per stage with ``chain`` 4."""
        if self.chain == 4:
            return 1
        return 4 if self.tile_m <= 32 or (self.tile_m == 64 and self.warpgroups == 1) else 2

    def registers(self, block: bool = False, quant: bool = False) -> int:
        """Estimated registers per thread (the accumulators, the fragments,
        with ``block`` the stage's scales, with ``quant`` the 16 activation
        values a thread quantizes, descriptors and addresses), an upper bound
        of ptxas' count (checked by the tests)."""
        return ((self.fragments() + 1) * self.tile_m // 2 + 32 + (self.tile_m // 4 if block else 0)
                + (16 if quant else 0))

    def stage_bytes(self, quant: bool = False) -> int:
        """One ring stage: the e4m3 activation and weight tiles, with
        ``quant`` the 16-bit activation rows they are quantized from."""
        return (self.tile_m * (3 if quant else 1) + self.rows()) * KB

    def smem_bytes(self, k: int = 0, block: bool = False, quant: bool = False) -> int:
        """Dynamic shared memory: the stages (or the split-K partial tile),
        their two barriers each, with ``block`` each stage's activation scales
        and the CTA's weight scales (``k`` the reduction length; persistent: each
        stage's weight scale in its slot), and 1 KiB to align the base for the
        128-byte swizzle."""
        red = self.tile_m * self.rows() * 4 if self.split_k > 1 else 0
        if self.persistent:
            scales = self.stages * (self.tile_m + 4) * 4 if block or quant else 0
        else:
            scales = self.stages * self.tile_m * 4 + (-(-k // KB) + 31) // 32 * 128 if block or quant else 0
        return max(self.stages * self.stage_bytes(quant), red) + 16 * self.stages + scales + 1024

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
                block: bool = False, in_dtype: torch.dtype | None = None) -> dict[str, int]:
        """The kernel's macros; ``in_dtype`` (bf16 / fp16, with ``block``): the
        activation is quantized in the kernel (``fp8_block_linear``)."""
        d = {"G_N": n, "G_K": k, "G_BT": self.tile_m, "G_WG": self.warpgroups, "G_ST": self.stages,
             "G_SPLIT": self.split_k, "G_CHAIN": self.chain, "G_BLOCK": int(block),
             "G_OUT": OUT_CODES[out_dtype], "G_BIAS": BIAS_CODES[bias_dtype]}
        if self.producer_wg:
            d["G_PWG"] = 1
        if self.persistent:
            d["G_PERSIST"] = 1
        if in_dtype is not None:
            d.update(G_QUANT=1, G_IN=IN_CODES[in_dtype])
        return d

    def short(self) -> str:
        return (f"m{self.tile_m}g{self.warpgroups}s{self.stages}k{self.split_k}" + ("c4" if self.chain == 4 else "")
                + ("p" if self.producer_wg else "") + ("r" if self.persistent else ""))


def config_valid(cfg: WgmmaConfig, n: int, k: int, block: bool = False, quant: bool = False) -> tuple[bool, str]:
    """THE validity predicate of a config for a shape (dispatch, benchmark and
    tests), of the block-scaled kernel with ``block``, of the one that also
    quantizes the activation (``fp8_block_linear``) with ``quant``.  Mirrors
    the kernel's static_asserts and the resource limits."""
    if not isinstance(cfg, WgmmaConfig):
        return False, f"expected a WgmmaConfig, got {type(cfg).__name__}"
    if n <= 0 or k <= 0 or k % 16 != 0:
        return False, f"needs N > 0 and K a positive multiple of 16, got N={n}, K={k}"
    if cfg.tile_m not in TILES:
        return False, f"tile_m must be one of {TILES}, got {cfg.tile_m}"
    if cfg.warpgroups not in (1, 2):
        return False, f"warpgroups must be 1 or 2, got {cfg.warpgroups}"
    if not 2 <= cfg.stages <= 8:
        return False, f"stages must be 2..8, got {cfg.stages}"
    if cfg.split_k not in (1, 2, 4):
        return False, f"split_k must be 1, 2 or 4, got {cfg.split_k}"
    if cfg.chain not in (1, 4):
        return False, f"chain must be 1 or 4, got {cfg.chain}"
    if cfg.producer_wg not in (0, 1):
        return False, f"producer_wg must be 0 or 1, got {cfg.producer_wg}"
    if cfg.persistent not in (0, 1):
        return False, f"persistent must be 0 or 1, got {cfg.persistent}"
    if cfg.persistent and (cfg.split_k != 1 or quant):
        return False, (f"persistent needs split_k 1 and a kernel that does not quantize, got split_k={cfg.split_k}, "
                       f"quant={quant}")
    if cfg.producer_wg and (cfg.warpgroups != 2 or quant):
        return False, (f"producer_wg needs two consumer warpgroups and a kernel that does not quantize, got "
                       f"warpgroups={cfg.warpgroups}, quant={quant}")
    # compute-sanitizer on the GPU: synccheck finds divergent threads at the
    # split-K reduction's barrier under a producer warpgroup, and racecheck
    # the block-scaled kernel's cp.async scale copies racing the consumers'
    # reads, with a producer warpgroup or a persistent grid (benchmarks/NOTES.md);
    # all are out until cleared.
    if cfg.producer_wg and (cfg.split_k != 1 or block):
        return False, (f"producer_wg needs split_k 1 and per-tensor / row / column scales (not sanitizer-clean "
                       f"otherwise), got split_k={cfg.split_k}, block={block}")
    if cfg.persistent and block:
        return False, "persistent needs per-tensor / row / column scales (not sanitizer-clean with block scales)"
    if quant and k % KB:
        return False, f"quantizing in the kernel needs K % {KB} == 0 (whole 1 x {KB} groups), got K={k}"
    nkb = -(-k // KB)
    if (cfg.split_k - 1) * -(-nkb // cfg.split_k) >= nkb:
        return False, f"split_k {cfg.split_k} leaves a cluster rank without any of the {nkb} K stages"
    limit = cfg.register_limit()
    if cfg.registers(block or quant, quant) > limit:
        return False, (f"about {cfg.registers(block or quant, quant)} registers per thread, over the limit {limit} "
                       f"of {cfg.threads()} threads")
    if cfg.smem_bytes(k, block, quant) > SMEM_MAX:
        return False, f"{cfg.smem_bytes(k, block, quant)} bytes of shared memory, over {SMEM_MAX}"
    return True, "ok"


def tuned(n: int, k: int, m: int, block: bool = False) -> WgmmaConfig | None:
    """The measured config for an ``N x K`` weight at ``m`` rows, or None
    (read once from ``scaledmm/tuning/kernels/fp8_wgmma_sm90.json``, with
    ``block`` ``fp8_wgmma_block_sm90.json``, written by
    ``python -m benchmarks.tune <sweep.csv> --kernel fp8_wgmma[_block]``).

    Examples
    --------
    >>> tuned(64, 128, 64) is None
    True
    """
    return _table(block).lookup(n, k, m)


def _table(block: bool) -> kernel_tuning.KernelTable:
    return kernel_tuning.load("fp8_wgmma_block" if block else "fp8_wgmma", "sm90", WgmmaConfig)


def default_config(n: int, k: int, m: int, num_sms: int = NUM_SMS_H200, block: bool = False) -> WgmmaConfig:
    """A config for an unseen shape, the pattern of the measured table: the
    smallest activation tile that covers M (64 above 32 rows: more tiles
    share each weight tile through L2), one warpgroup, eight stages, K split
    in two when the tiles leave SMs idle and each half keeps 8 stages; the
    block-scaled kernel promotes once per stage (its scales multiply there).

    Examples
    --------
    >>> default_config(4096, 4096, 8).short(), default_config(28672, 4096, 64).short()
    ('m16g1s8k2', 'm64g1s8k1')
    >>> default_config(2112, 7168, 8, block=True).short()
    'm16g1s8k2c4'
    """
    tile = next(t for t in TILES[:3] if t >= min(m, 64))
    cfg = WgmmaConfig(tile, 1, 8, 1, 4 if block else 1)
    grid = cfg.grid(n, m)
    if grid[0] * grid[1] < num_sms and -(-k // KB) >= 16:
        cfg = dataclasses.replace(cfg, split_k=2)
    return cfg if config_valid(cfg, n, k, block)[0] else dataclasses.replace(cfg, stages=4, split_k=1)


@functools.lru_cache(maxsize=4096)  # once per shape and M: every launch asks
def choose_config(n: int, k: int, m: int, num_sms: int = NUM_SMS_H200, block: bool = False,
                  quant: bool = False) -> WgmmaConfig:
    """The measured config (:func:`tuned`) or :func:`default_config`; with
    ``quant`` (the kernel quantizes the activation: its 16-bit rows take
    shared memory too) the block-scaled kernel's with as many stages as fit.

    Examples
    --------
    >>> choose_config(4096, 4096, 64, block=True, quant=True).stages <= choose_config(4096, 4096, 64, block=True).stages
    True
    """
    cfg = tuned(n, k, m, block or quant)
    if cfg is None or not config_valid(cfg, n, k, block or quant)[0]:
        cfg = default_config(n, k, m, num_sms, block or quant)
    if quant:
        if cfg.producer_wg or cfg.persistent:  # the quantizing kernel: one producer warp, one CTA a tile
            cfg = default_config(n, k, m, num_sms, True)
        fits = [c for c in (dataclasses.replace(cfg, stages=s) for s in range(cfg.stages, 1, -1))
                if config_valid(c, n, k, True, True)[0]]
        if not fits:
            raise ValueError(f"no config quantizes in the kernel for N={n}, K={k}, M={m} (from {cfg})")
        cfg = fits[0]
    return cfg


def candidate_configs(n: int, k: int, m: int, num_sms: int = NUM_SMS_H200, block: bool = False,
                      quant: bool = False) -> list[WgmmaConfig]:
    """The benchmark's sweep: the chosen config first, then every valid
    tile x warpgroups x stages x split x chain (x producer warpgroup, with
    two warpgroups of 128-row tiles; x persistent, unsplit tiles of 64 rows
    and more) point with one of two tiles: the two smallest that cover M, or
    the largest two where at most one does."""
    first = choose_config(n, k, m, num_sms, block, quant)
    covering = [t for t in TILES if t >= m][:2]
    covering = covering if len(covering) == 2 else list(TILES[-2:])
    found = [WgmmaConfig(t, g, s, sk, c, p, r) for c in (1, 4) for t in covering for g in (2, 1) for s in (4, 6, 8)
             for sk in (1, 2, 4) for p in ((0, 1) if g == 2 and t == 128 else (0,))
             for r in ((0, 1) if sk == 1 and t >= 64 else (0,))]
    return [first, *[c for c in found if c != first and config_valid(c, n, k, block or quant, quant)[0]]]


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kernel_spec(n: int, k: int, cfg: WgmmaConfig, out_dtype: torch.dtype = torch.bfloat16,
                bias_dtype: torch.dtype | None = None, block: bool = False,
                in_dtype: torch.dtype | None = None) -> jit.NvrtcKernelSpec:
    """The NVRTC spec of one instantiation (validated); ``block``: the
    block-scaled kernel of ``fp8_block_mm``; ``in_dtype`` (bf16 / fp16): the
    one of ``fp8_block_linear`` that quantizes that activation itself."""
    quant = in_dtype is not None
    if out_dtype not in OUT_CODES:
        raise ValueError(f"out_dtype: expected bf16, fp16 or fp32, got {out_dtype}")
    if quant and (not block or in_dtype not in IN_CODES):
        raise ValueError(f"in_dtype: expected bf16 or fp16 with block=True, got {in_dtype} (block={block})")
    if bias_dtype not in BIAS_CODES or (block and not quant and bias_dtype is not None):
        raise ValueError(f"bias_dtype: expected None{'' if block and not quant else ', fp32, bf16 or fp16'}, "
                         f"got {bias_dtype}")
    ok, why = config_valid(cfg, n, k, block, quant)
    if not ok:
        what = " (block, quantizing)" if quant else " (block)" if block else ""
        raise ValueError(f"cfg: expected a valid config for N={n}, K={k}{what}, got {cfg}: {why}")
    return jit.NvrtcKernelSpec(KERNEL, source_path(), arch=ARCH,
                               defines=cfg.defines(n, k, out_dtype, bias_dtype, block, in_dtype))


def _grid(kern: jit.CudaKernel, cfg: WgmmaConfig, n: int, m: int, smem: int, dev: int) -> tuple[int, int, int]:
    """The launch grid; a persistent config's holds the CTAs that fit the
    GPU at once (the driver's occupancy calculator, cached per config)."""
    if not cfg.persistent:
        return cfg.grid(n, m)
    per_sm = kern.max_active_blocks(cfg.threads(), smem, dev)  # raises the shared-memory limit first
    if per_sm < 1:
        raise RuntimeError(f"fp8_wgmma {cfg.short()}: expected a CTA of {cfg.threads()} threads and {smem} bytes "
                           f"of dynamic shared memory to fit an SM, the driver says none does")
    return cfg.grid(n, m, per_sm * sm_count(dev))


def _scale_step(scale: torch.Tensor, kind: str) -> int:
    """Elements between consecutive row / column scales (0: one for all)."""
    return 0 if kind == f8.TENSOR else int(scale.stride(0) if scale.dim() == 1 or kind == f8.TOKEN
                                              else scale.stride(1))


def launch(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, cfg: WgmmaConfig | None = None) -> torch.Tensor:
    """Run the kernel into ``out`` ([M, N], contiguous) on the current stream.

    Validated ``fp8_scaled_mm`` arguments with M >= 1, ``a``'s rows and ``b``
    16-byte aligned.  With :func:`scaledmm.device.pdl` the launch is a
    programmatic dependent one.
    """
    m, k = a.shape
    n = b.shape[0]
    kind_a = f8.scale_a_kind(OP, scale_a, m)
    kind_b = f8.scale_b_kind(OP, scale_b, n)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    cfg = cfg or choose_config(n, k, m, sm_count(dev))
    spec = kernel_spec(n, k, cfg, out.dtype, None if bias is None else bias.dtype)
    a_map = jit.tensor_map_2d(a.data_ptr(), 1, k, m, a.stride(0), KB, cfg.tile_m, 128)
    b_map = jit.tensor_map_2d(b.data_ptr(), 1, k, n, b.stride(0), KB, cfg.rows(), 128)
    kern, smem = spec.kernel(), cfg.smem_bytes()
    kern.launch(_grid(kern, cfg, n, m, smem, dev), cfg.threads(),
                (a_map, b_map, scale_a, ctypes.c_int(_scale_step(scale_a, kind_a)),
                 scale_b, ctypes.c_int(_scale_step(scale_b, kind_b)), bias, out, ctypes.c_int(m)),
                device=a.device, shared_mem=smem, pdl=pdl(a.device))
    return out


def _tma_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` as TMA reads it: 16-byte aligned rows (copied if not); one row
    gets a K-element stride (its stride is never used)."""
    m, k = a.shape
    if a.data_ptr() % 16 or (m > 1 and a.stride(0) * a.element_size() % 16):
        return a.clone(memory_format=torch.contiguous_format)
    return a.as_strided((1, k), (k, 1)) if m == 1 else a


def wgmma_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, cfg: WgmmaConfig | None = None):
    """Backend entry of ``fp8_scaled_mm``: a fresh ``[M, N]``
    ``(a * scale_a) @ (b * scale_b).T (+ bias)``.  An activation whose rows
    are not 16-byte aligned is copied first (TMA reads 16-byte aligned rows).

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)        # doctest: +SKIP
    >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)      # doctest: +SKIP
    >>> a, sa = torch.ops.scaledmm.quant_fp8(x, None, True)                   # doctest: +SKIP
    >>> b, sb = torch.ops.scaledmm.quant_fp8(w, None, True)                   # doctest: +SKIP
    >>> with scaledmm.use_backend("fp8", "cuda_wgmma"):                       # doctest: +SKIP
    ...     out = torch.ops.scaledmm.fp8_scaled_mm(a, b, sa, sb.reshape(-1))
    """
    f8.check_mm_args(OP, a, b, scale_a, scale_b, bias, out_dtype)
    if a.shape[0] == 0 or b.shape[0] == 0:
        return f8.reference_mm(a, b, scale_a, scale_b, bias, out_dtype)
    if b.data_ptr() % 16:
        raise ValueError(f"b: expected a weight at a 16-byte aligned address (TMA), got {b.data_ptr() % 16} mod 16")
    if bias is not None:
        bias = bias.contiguous()
    return launch(_tma_rows(a), b, scale_a, scale_b, bias, f8.mm_output(a, b, out_dtype), cfg)


def launch_block(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
                 out: torch.Tensor, cfg: WgmmaConfig | None = None) -> torch.Tensor:
    """Run the block-scaled kernel into ``out`` ([M, N], contiguous) on the
    current stream: validated ``fp8_block_mm`` arguments with 128 x 128
    blocks, M >= 1, ``a``'s rows and ``b`` 16-byte aligned; the scales are read
    in place with any strides."""
    m, k = a.shape
    n = b.shape[0]
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    cfg = cfg or choose_config(n, k, m, sm_count(dev), True)
    spec = kernel_spec(n, k, cfg, out.dtype, None, True)
    a_map = jit.tensor_map_2d(a.data_ptr(), 1, k, m, a.stride(0), KB, cfg.tile_m, 128)
    b_map = jit.tensor_map_2d(b.data_ptr(), 1, k, n, b.stride(0), KB, cfg.rows(), 128)
    kern, smem = spec.kernel(), cfg.smem_bytes(k, True)
    kern.launch(_grid(kern, cfg, n, m, smem, dev), cfg.threads(),
                (a_map, b_map, a_scales, ctypes.c_int(a_scales.stride(0)), ctypes.c_int(a_scales.stride(1)),
                 b_scales, ctypes.c_int(b_scales.stride(0)), ctypes.c_int(b_scales.stride(1)), out, ctypes.c_int(m)),
                device=a.device, shared_mem=smem, pdl=pdl(a.device))
    return out


def block_can_implement(p: Problem) -> tuple[bool, str]:
    """``fp8_block_mm`` with 128 x 128 blocks (DeepSeek-V3's 1 x 128
    activation and 128 x 128 weight scales), bf16 / fp16 / fp32 output, any M,
    K % 16 == 0.

    Examples
    --------
    >>> import torch
    >>> p = Problem(Family.FP8_BLOCK, torch.device("cpu"), 5, 2112, 7168, torch.float8_e4m3fn, torch.bfloat16,
    ...             7168, (("block_size", (128, 128)), ("a_scales_col_major", True)))
    >>> block_can_implement(p)
    (True, 'any M; 128 x 128 blocks, K % 16 == 0')
    """
    why = _dtypes_why(p)
    if why:
        return False, why
    if tuple(p.opt("block_size", (128, 128))) != (KB, KB):
        return False, f"needs block_size (128, 128), got {p.opt('block_size')}"
    if p.k % 16 != 0 or p.k <= 0:
        return False, f"needs K a positive multiple of 16, got K={p.k}"
    return True, "any M; 128 x 128 blocks, K % 16 == 0"


def block_mm(a, b, a_scales, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16,
             cfg: WgmmaConfig | None = None):
    """Backend entry of ``fp8_block_mm`` (validated arguments): a fresh
    ``[M, N]`` block-scaled product.  An activation whose rows are not 16-byte
    aligned, or a weight that is not, is copied first (TMA).

    Examples
    --------
    >>> import torch, scaledmm
    >>> from scaledmm.ops.fp8_block import quantize_weight
    >>> x = torch.randn(8, 7168, device="cuda", dtype=torch.bfloat16)                    # doctest: +SKIP
    >>> b, sb = quantize_weight(torch.randn(2112, 7168, device="cuda"))                 # doctest: +SKIP
    >>> a, sa = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, True)       # doctest: +SKIP
    >>> with scaledmm.use_backend("fp8_block", "cuda_wgmma"):                           # doctest: +SKIP
    ...     out = torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)
    """
    if tuple(int(v) for v in block_size) != (KB, KB):
        raise ValueError(f"block_size: expected (128, 128), got {tuple(block_size)}")
    out = fb.mm_output(a, b, out_dtype)
    if out.numel() == 0:
        return out
    if b.data_ptr() % 16:
        b = b.clone()
    return launch_block(_tma_rows(a), b, a_scales, b_scales, out, cfg)


def launch_linear(x: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor, cfg: WgmmaConfig | None = None) -> torch.Tensor:
    """Run the kernel that quantizes ``x`` (bf16 / fp16, 16-byte aligned
    rows) per 1 x 128 group itself into ``out`` ([M, N], contiguous):
    validated ``fp8_block_linear`` arguments with 128 x 128 blocks, M >= 1,
    ``b`` 16-byte aligned, ``bias`` contiguous or None."""
    m, k = x.shape
    n = b.shape[0]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    cfg = cfg or choose_config(n, k, m, sm_count(dev), True, True)
    spec = kernel_spec(n, k, cfg, out.dtype, None if bias is None else bias.dtype, True, x.dtype)
    x_map = jit.tensor_map_2d(x.data_ptr(), 3 if x.dtype == torch.bfloat16 else 2, k, m, x.stride(0) * 2, KB,
                              cfg.tile_m, 0)
    b_map = jit.tensor_map_2d(b.data_ptr(), 1, k, n, b.stride(0), KB, cfg.rows(), 128)
    spec.kernel().launch(cfg.grid(n, m), cfg.threads(),
                         (x_map, b_map, b_scales, ctypes.c_int(b_scales.stride(0)), ctypes.c_int(b_scales.stride(1)),
                          bias, out, ctypes.c_int(m)),
                         device=x.device, shared_mem=cfg.smem_bytes(k, True, True), pdl=pdl(x.device))
    return out


def block_linear(x, b, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16, bias=None,
                 cfg: WgmmaConfig | None = None):
    """``fp8_block_linear``'s arguments (validated here) -> a fresh ``[M, N]``
    ``x @ b.T`` with ``x`` quantized per 1 x 128 group inside the GEMM, in
    one launch (not a registered backend: see the module docstring).  The
    codes and scales are ``per_token_group_quant_fp8``'s bit for bit, so the
    result is the composite's (quantize, then :func:`block_mm` with the same
    config) bit for bit; the bias is added in fp32 before the one rounding.  Rows of ``x``
    that are not 16-byte aligned are copied first (TMA).

    Examples
    --------
    >>> import torch, scaledmm
    >>> from scaledmm.ops.fp8_block import quantize_weight
    >>> x = torch.randn(8, 7168, device="cuda", dtype=torch.bfloat16)                    # doctest: +SKIP
    >>> b, sb = quantize_weight(torch.randn(2112, 7168, device="cuda"))                 # doctest: +SKIP
    >>> out = block_linear(x, b, sb)                                                    # doctest: +SKIP
    """
    fb.check_linear_args(x, b, b_scales, block_size, out_dtype, bias)
    if tuple(int(v) for v in block_size) != (KB, KB):
        raise ValueError(f"block_size: expected (128, 128), got {tuple(block_size)}")
    out = fb.mm_output(x, b, out_dtype)
    if out.numel() == 0:
        return out
    if b.data_ptr() % 16:
        b = b.clone()
    return launch_linear(_tma_rows(x), b, b_scales, None if bias is None else bias.contiguous(), out, cfg)


# ----------------------------------------------------------------------------
# Backend registration (its place in automatic selection: scaledmm/tuning/fp8_sm90.json
# and fp8_block_sm90.json)
# ----------------------------------------------------------------------------


backends.register(Backend(
    FAMILY, NAME,
    impls={OP: wgmma_mm},
    is_supported=is_supported,
    can_implement=can_implement,
    description=f"NVRTC TMA + e4m3 wgmma (swap AB, fp32 accumulation, split K), any M, K % 16 == 0 (csrc/{SOURCE})",
))
backends.register(Backend(
    Family.FP8_BLOCK, NAME,
    # block_linear is not registered for fp8_block_linear: slower than the
    # composite (quantize, then block_mm) at every point measured, and a
    # family-wide request of this backend would route the op to it.
    impls={"fp8_block_mm": block_mm},
    is_supported=is_supported,
    can_implement=block_can_implement,
    description=(f"NVRTC TMA + e4m3 wgmma with 1x128 / 128x128 block scales at each 128-K promotion, any M, "
                 f"K % 16 == 0 (csrc/{SOURCE})"),
))


# ----------------------------------------------------------------------------
# Pre-build hook: python -m scaledmm.jit build --fp8-wgmma N:K[,N:K...]
# ----------------------------------------------------------------------------

PREBUILD_M = (8, 16, 32, 64, 128, 256)


def prebuild_specs(value: str, block: bool = False) -> list[jit.NvrtcKernelSpec]:
    """Specs of the configs chosen at M = 8 .. 256 with bf16 output, no bias,
    for each ``N:K`` (``block``: of the block-scaled kernel)."""
    specs: dict[str, jit.NvrtcKernelSpec] = {}
    for n, k in jit.parse_shapes(value, "fp8-wgmma-block" if block else "fp8-wgmma"):
        for m in PREBUILD_M:
            spec = kernel_spec(n, k, choose_config(n, k, m, block=block), block=block)
            specs.setdefault(spec.key, spec)
    return list(specs.values())


jit.register_prebuild("fp8-wgmma", prebuild_specs,
                      help="N:K[,N:K...] FP8 wgmma kernels (the configs of M = 8 .. 256, bf16 output)")
jit.register_prebuild("fp8-wgmma-block", functools.partial(prebuild_specs, block=True),
                      help="N:K[,N:K...] block-scaled FP8 wgmma kernels (fp8_block_mm; M = 8 .. 256, bf16 output)")

__all__ = ["WgmmaConfig", "block_can_implement", "block_linear", "block_mm", "can_implement", "candidate_configs",
           "choose_config", "config_valid", "default_config", "is_supported", "kernel_spec", "launch", "launch_block",
           "launch_linear", "prebuild_specs", "tuned", "wgmma_mm"]
