"""NVFP4 Triton kernels for any sm80+ GPU, Hopper included: backend ``triton``
of the ``nvfp4`` family (SPEC.md "NVFP4").

Hopper has no FP4 tensor cores, so the GEMMs decode the packed e2m1 codes and
their e4m3 block scales in registers and multiply on fp16/bf16 tensor cores
with fp32 accumulation.  That is exact: every product ``e2m1 * e4m3`` has at
most 6 significant bits and lies in ``[2**-10, 2688]``, so it is representable
in fp16 (and bf16), and the tensor core multiplies representable values exactly.

Read top to bottom:

1. capability checks (``is_supported``, ``can_implement``);
2. the GEMM config space: :class:`GemmConfig`, its one validity predicate
   :func:`config_ok`, the tuned config per shape and M bucket, the
   candidates ``python -m benchmarks sweep --kernel nvfp4_triton`` times;
3. the GEMM kernel (W4A4 and W4A16 share it) and its launcher;
4. backend registration, public functions.

The e2m1 decoders the kernel runs on its register tiles (plain Triton and
inline PTX) and the decode-to-memory passes of the predecode paths
(:func:`~scaledmm.ops.nvfp4_triton_decode.dequant`) live in
``ops/nvfp4_triton_decode.py``.

The quantizer (``nvfp4_quant``, bit-identical to SPEC's rule: its kernel,
:class:`QuantConfig`, :func:`quant_config_ok`, ``DEFAULT_QUANT``,
``QUANT_CANDIDATES`` and :func:`quant`) lives in ``ops/nvfp4_triton_quant.py``;
this module registers it and re-exports those names.

Environment knob: ``SCALEDMM_NVFP4_TRITON_DECODE=triton`` forces the
plain-Triton decoder on the GPU (a fallback should the PTX decoder misbehave).
"""

from __future__ import annotations

import dataclasses
import functools
import torch
import triton
import triton.language as tl

from scaledmm import backends, env, kernel_tuning
from scaledmm import device as _device
from scaledmm.backends import Backend, Family, Problem
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops.nvfp4_triton_decode import DECODERS, _load_fp4_tile, decode_fold, dequant, dequant_fp16
from scaledmm.ops.nvfp4_triton_quant import (  # noqa: F401 - re-exported
    DEFAULT_QUANT,
    SMALL_M_QUANT,
    default_quant_config,
    QUANT_CANDIDATES,
    QuantConfig,
    _hw_e4m3,
    quant,
    quant_config_ok,
    quant_dynamic,
)

FAMILY = Family.NVFP4
NAME = "triton"
BLOCK = nv.BLOCK  # elements per block scale


interpreting = _device.interpreting  # re-exported: nt.interpreting() keeps working


# ----------------------------------------------------------------------------
# 1. Capability checks
# ----------------------------------------------------------------------------


def is_supported(device: torch.device) -> tuple[bool, str]:
    """CUDA with compute capability >= 8.0, or the CPU under ``TRITON_INTERPRET=1``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4_triton import is_supported
    >>> is_supported(torch.device("meta"))[0]
    False
    """
    if device.type == "cpu":
        if interpreting():
            return True, "Triton interpreter on the CPU (TRITON_INTERPRET=1)"
        return False, "CPU runs need TRITON_INTERPRET=1 (the Triton interpreter)"
    if device.type != "cuda":
        return False, f"needs a CUDA device, got {device.type}"
    major, minor = _device.capability(device)
    if major < 8:
        return False, f"needs sm80+ (bf16 tensor cores), device is sm{major}{minor}"
    return True, f"Triton decode-in-registers kernels on sm{major}{minor}"


def can_implement(p: Problem) -> tuple[bool, str]:
    """Any M, any N, any K that is a multiple of 16 (the op's own rule).

    The kernels mask every edge, so there is no alignment requirement; rows
    whose byte stride is a multiple of 16 load faster (vectorized)."""
    if p.k % BLOCK != 0:
        return False, f"needs K % {BLOCK} == 0, got K={p.k}"
    if p.opt("w4a16") is None:  # the quantizer (GEMM problems say w4a16=True/False)
        if p.in_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"quantizes bf16/fp16/fp32, got {p.in_dtype}"
        return True, "any M, K % 16 == 0"
    if p.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False, f"writes bf16/fp16/fp32, got out_dtype={p.out_dtype}"
    if p.opt("w4a16") and p.in_dtype not in (torch.bfloat16, torch.float16):
        return False, f"W4A16 takes bf16/fp16 activations, got {p.in_dtype}"
    return True, "any M and N, K % 16 == 0"


# ----------------------------------------------------------------------------
# 2. GEMM configs
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One point of the GEMM config space.

    The kernel computes ``out.T`` tiles: ``block_n`` weight rows (the MMA's M
    side, decoded in registers) by ``block_m`` activation rows (the MMA's N
    side), ``block_k`` elements of K per step.

    Parameters
    ----------
    block_n, block_m, block_k : int
        Tile sizes (powers of two; ``block_n, block_m >= 16``, ``block_k >= 64``).
    split_k : int
        Programs sharing one output tile along K; the last one to finish adds
        the fp32 partials in a fixed order (deterministic) and writes the tile.
    num_warps, num_stages : int
        Triton launch parameters.
    group_n : int
        Weight tiles per raster group (L2 reuse when there are many M tiles).
    decode : str
        ``"ptx"`` (inline PTX, GPU only, default), ``"ptx_direct"`` (same, but
        bf16 operands decoded with bf16 arithmetic: fewer instructions, needs
        bf16 subnormal inputs kept) or ``"triton"`` (plain Triton; the
        interpreter's and the fallback).
    predecode_x : bool
        W4A4 only: decode the activation to fp16 once (its own launch), then
        run the W4A16 kernel; pays off when many weight tiles reuse it.
    predecode_w : bool
        Large M: a transient 16-bit copy of ``alpha * deq(b)`` (one Triton
        pass over the weight, freed after the call; ``deq(a)`` too for W4A4,
        exact) fed to cuBLAS ``F.linear``.  The weight stays FP4 in memory.
        One extra rounding (the scaled weight to 16 bits, as a bf16 layer
        holds its weight), so only for 16-bit outputs; the tile fields are
        unused.
    """

    block_n: int
    block_m: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_n: int = 8
    decode: str = "ptx"
    predecode_x: bool = False
    predecode_w: bool = False

    def label(self) -> str:
        flags = {"ptx": "ptx", "ptx_direct": "ptxd", "triton": "tt"}.get(self.decode, self.decode)
        flags += "+pre" if self.predecode_x else ""
        flags += "+prew" if self.predecode_w else ""
        return (f"n{self.block_n}m{self.block_m}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}st{self.num_stages}{flags}")


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


SMEM_BYTES = 220 * 1024  # per-block shared memory assumed when the device cannot be asked


@functools.lru_cache(maxsize=None)
def _smem_limit(device: torch.device) -> int:
    if not torch.cuda.is_available():
        return SMEM_BYTES
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", SMEM_BYTES) - 4096  # Triton's own scratch


def smem_estimate(cfg: GemmConfig, w4a16: bool) -> int:
    """Shared memory of the software pipeline: packed weights + scales per
    stage, the activation tile per stage (dense) or packed, and one decoded
    weight tile."""
    x_fp4 = not (w4a16 or cfg.predecode_x)
    w_stage = cfg.block_n * cfg.block_k // 2 + cfg.block_n * cfg.block_k // 16
    x_stage = (cfg.block_m * (cfg.block_k // 2 + cfg.block_k // 16) if x_fp4
               else cfg.block_m * cfg.block_k * 2)
    return cfg.num_stages * (w_stage + x_stage) + 2 * cfg.block_k * (cfg.block_n + cfg.block_m)


def config_ok(cfg: GemmConfig, p: Problem, device: torch.device | None = None) -> tuple[bool, str]:
    """The one validity predicate of the config space (dispatch, the sweep and
    tests all use it)."""
    w4a16 = bool(p.opt("w4a16"))
    dev = device if device is not None else p.device
    if not all(_pow2(v) for v in (cfg.block_n, cfg.block_m, cfg.block_k, cfg.num_warps)):
        return False, "block sizes and num_warps must be powers of two"
    if cfg.block_n < 16 or cfg.block_m < 16 or cfg.block_k < 64:
        return False, "needs block_n >= 16, block_m >= 16, block_k >= 64"
    if cfg.block_n > 256 or cfg.block_m > 256 or cfg.block_k > 512:
        return False, "needs block_n, block_m <= 256 and block_k <= 512"
    if cfg.split_k < 1 or cfg.split_k > max(1, triton.cdiv(p.k, cfg.block_k)):
        return False, f"split_k must be in [1, cdiv(K, block_k)], got {cfg.split_k}"
    if cfg.num_stages < 1 or cfg.group_n < 1:
        return False, "num_stages and group_n must be >= 1"
    if cfg.predecode_x and w4a16:
        return False, "predecode_x applies to W4A4 only"
    if cfg.predecode_w and cfg.predecode_x:
        return False, "predecode_w and predecode_x exclude each other"
    if cfg.predecode_w and p.out_dtype not in (torch.bfloat16, torch.float16):
        return False, f"predecode_w writes bf16/fp16 only (one extra rounding), got {p.out_dtype}"
    if cfg.decode not in DECODERS:
        return False, f"decode must be one of {DECODERS}, got {cfg.decode!r}"
    if cfg.decode != "triton" and dev.type != "cuda":
        return False, "the PTX decoders need a CUDA device"
    if dev.type == "cuda" and smem_estimate(cfg, w4a16) > _smem_limit(dev):
        return False, f"needs about {smem_estimate(cfg, w4a16)} bytes of shared memory"
    return True, "ok"


def m_bucket(m: int) -> int:
    """Index of M's bucket: 1-16, 17-64, 65-256, > 256."""
    return 0 if m <= 16 else 1 if m <= 64 else 2 if m <= 256 else 3


# Defaults per M bucket (and tuned rows per shape) in
# scaledmm/tuning/kernels/nvfp4_triton_sm90.json.
# Small M streams the weight and is bound by issue latency, not bytes:
# block_k=256 (154 registers) fits one 4-warp CTA per SM, so every dependent
# instruction waits; block_k=128 needs 91 registers (sm90 SASS): 4-5 CTAs per
# SM, and split-K (below) makes enough of them.  Large M:
# decode+MMA serialize in the Triton kernel (0.5x bf16 measured).  The
# transient 16-bit weight + cuBLAS path (predecode_w) may win there, but it
# allocates a 16-bit copy of the weight per call and adds a rounding (not the
# exact W4A4 numerics), so it stays opt-in (SCALEDMM_NVFP4_PREDECODE_W=1) until
# a measurement shows it wins.  See benchmarks/NOTES.md.
_PREDECODE_W = env.nvfp4_predecode_w()  # read at import


def bucket_config(p: Problem) -> GemmConfig:
    """The tuned config of ``p``'s shape and M (its bucket's row of
    ``scaledmm/tuning/kernels/nvfp4_triton_sm90.json``, read once), before
    the split-K and decoder rules of :func:`default_config`.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.backends import Family
    >>> bucket_config(Problem(Family.NVFP4, torch.device("cpu"), 1, 64, 128, torch.uint8, torch.bfloat16, 128)).block_m
    16
    """
    cfg = kernel_tuning.load("nvfp4_triton", "sm90", GemmConfig).lookup(p.n, p.k, p.m)
    if m_bucket(p.m) == 3 and _PREDECODE_W:
        cfg = dataclasses.replace(cfg, predecode_w=True)
    return cfg


def __getattr__(name: str):
    # DEFAULT_CONFIGS: the file's bucket rows as {bucket index: config}
    if name == "DEFAULT_CONFIGS":
        rows = kernel_tuning.load("nvfp4_triton", "sm90", GemmConfig).default
        return {b: dataclasses.replace(cfg, predecode_w=_PREDECODE_W) if b == 3 and _PREDECODE_W else cfg
                for b, (_, cfg) in enumerate(rows)}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Split-K fills this many CTAs per SM (small output grids), keeping at least
# MIN_STEPS_PER_SPLIT K steps per CTA; MAX_SPLIT bounds the fp32 workspace.
CTAS_PER_SM = 4
MIN_STEPS_PER_SPLIT = 2
MAX_SPLIT = 16


def grid_sms(device: torch.device) -> int:
    """The SM count the split-K rule sizes grids for: the device's, 8 on the
    CPU (small interpreter grids).

    Examples
    --------
    >>> grid_sms(torch.device("cpu"))
    8
    """
    return _device.sm_count(device, cpu=8)


AUTO_SPLIT = 0  # a tuning-file row's split_k that asks default_config's rule for it


def split_for(cfg: GemmConfig, m: int, n: int, k: int, device: torch.device,
              ctas_per_sm: int = CTAS_PER_SM) -> int:
    """Deterministic split-K: double it while the grid has fewer than
    ``ctas_per_sm`` CTAs per SM and each split keeps >= MIN_STEPS_PER_SPLIT
    K steps (small M is latency bound: it needs many resident warps).

    Examples
    --------
    >>> split_for(GemmConfig(16, 16, 64), 1, 64, 4096, torch.device("cpu")) >= 1
    True
    """
    if cfg.predecode_w:
        return 1
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(max(m, 1), cfg.block_m)
    steps = triton.cdiv(k, cfg.block_k)
    split = 1
    while (tiles * split < ctas_per_sm * grid_sms(device)
           and steps // (split * 2) >= MIN_STEPS_PER_SPLIT and split < MAX_SPLIT):
        split *= 2
    return split


def _portable(cfg: GemmConfig, p: Problem) -> GemmConfig:
    """The decoder this device runs: ``SCALEDMM_NVFP4_TRITON_DECODE`` when set,
    plain Triton off the GPU."""
    decode = env.nvfp4_triton_decode(cfg.decode)
    if p.device.type != "cuda" or decode not in DECODERS:
        decode = "triton"
    return dataclasses.replace(cfg, decode=decode)


def default_config(p: Problem) -> GemmConfig:
    """The config of ``p``'s shape and M: a tuned per-shape row as measured, or
    its M bucket's default row with split-K and the activation pre-decode set
    by rule (the default rows say ``split_k: 0``, :data:`AUTO_SPLIT`)."""
    cfg = _portable(bucket_config(p), p)
    if cfg.predecode_w and not config_ok(cfg, p)[0]:  # fp32 output: the kernel
        cfg = dataclasses.replace(cfg, predecode_w=False)
    if cfg.split_k == AUTO_SPLIT:
        cfg = _rule_split(cfg, p)
    ok, why = config_ok(cfg, p)
    if not ok:  # keep dispatch total: fall back to the smallest config, unsplit
        smallest = kernel_tuning.load("nvfp4_triton", "sm90", GemmConfig).default[0][1]
        cfg = dataclasses.replace(_portable(smallest, p), split_k=1)
    return cfg


def _rule_split(cfg: GemmConfig, p: Problem) -> GemmConfig:
    split = split_for(cfg, p.m, p.n, p.k, p.device)
    if m_bucket(p.m) == 1 and not p.opt("w4a16"):
        # Measured on the H200 (llama8b): half the split (>= 2) is 10-20 %
        # faster at M 33-64, and with >= 2 weight tiles per SM decoding the
        # activation once (predecode_x) another 13 %
        split = split // 2 if split >= 4 else split
        if -(-p.n // cfg.block_n) >= 2 * grid_sms(p.device):
            cfg = dataclasses.replace(cfg, predecode_x=True)
    return dataclasses.replace(cfg, split_k=split)


def candidate_configs(p: Problem) -> list[GemmConfig]:
    """The configs ``python -m benchmarks sweep --kernel nvfp4_triton`` times
    for ``p`` (all valid under :func:`config_ok`)."""
    b = m_bucket(p.m)
    bm = (16, 64, 128, 256)[b]
    out = []
    for bn, bk, w, st in ((64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3), (64, 128, 4, 5),
                          (128, 64, 8, 4), (32, 512, 4, 3), (256, 64, 8, 3)):
        for split in sorted({1, split_for(GemmConfig(bn, bm, bk), p.m, p.n, p.k, p.device)}):
            out.append(_portable(GemmConfig(bn, bm, bk, split, w, st), p))
    if not p.opt("w4a16") and b >= 2:
        out += [dataclasses.replace(c, predecode_x=True) for c in list(out)]
    if b >= 2:
        out.append(_portable(GemmConfig(128, bm, 64, predecode_w=True), p))
    uniq = list(dict.fromkeys(out))
    return [c for c in uniq if config_ok(c, p)[0]]


def select_config(op: str, p: Problem) -> GemmConfig:
    """The config of one ``op`` call (``"nvfp4_mm"`` or ``"nvfp4_w4a16_mm"``;
    both read the same tuned file): :func:`default_config`.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.backends import Family
    >>> select_config("nvfp4_mm", Problem(Family.NVFP4, torch.device("cpu"), 1, 64, 128, torch.uint8,
    ...                                   torch.bfloat16, 128)).decode
    'triton'
    """
    return default_config(p)


# ----------------------------------------------------------------------------
# 3. GEMM kernel: out[m, n] = alpha * sum_k x[m, k] * w[n, k] (+ bias[n])
# ----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])  # one compile serves every M
def _gemm_kernel(w_ptr, ws_ptr, x_ptr, xs_ptr, out_ptr, bias_ptr, alpha_ptr, part_ptr, lock_ptr,
                 M, N, K, stride_xm, stride_om, ws_c4, xs_c4, fold,
                 X_FP4: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr,
                 DECODE: tl.constexpr, EVEN_K: tl.constexpr, HW_FP8: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, GROUP_N: tl.constexpr):
    # raster: groups of GROUP_N weight tiles, all M tiles of a group in turn
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_N * num_m
    first_n = (pid // per_group) * GROUP_N
    group = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group
    pid_m = (pid % per_group) // group

    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(kt0, kt1):
        w = _load_fp4_tile(w_ptr, ws_ptr, rn, N, K // 2, K // 2, ws_c4, kt, BLOCK_N, BLOCK_K, EVEN_K,
                           DECODE, DTYPE, HW_FP8)
        if X_FP4:
            x = _load_fp4_tile(x_ptr, xs_ptr, rm, M, stride_xm, K // 2, xs_c4, kt, BLOCK_M, BLOCK_K,
                               EVEN_K, DECODE, DTYPE, HW_FP8)
        else:
            rk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN_K:
                xmask = (rm < M)[:, None]
            else:
                xmask = (rm < M)[:, None] & (rk < K)[None, :]
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=xmask, other=0.0)
            x = x.to(DTYPE)
        acc = tl.dot(w, tl.trans(x), acc)

    o_off = rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    o_mask = (rm < M)[None, :] & (rn < N)[:, None]
    if SPLIT_K > 1:
        # deterministic split-K: partials to a workspace, the last program of
        # the tile (release/acquire counter, zeroed per call) adds them in
        # split order
        tile_elems = M.to(tl.int64) * N
        p_off = rm[None, :].to(tl.int64) * N + rn[:, None]
        tl.store(part_ptr + pid_k * tile_elems + p_off, acc, mask=o_mask)
        tl.debug_barrier()
        lock = lock_ptr + pid_n * num_m + pid_m
        count = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if count == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptr + s * tile_elems + p_off, mask=o_mask, other=0.0,
                               cache_modifier=".cg")
            _epilogue(acc, out_ptr, o_off, o_mask, rn, N, bias_ptr, alpha_ptr, fold, HAS_BIAS)
    else:
        _epilogue(acc, out_ptr, o_off, o_mask, rn, N, bias_ptr, alpha_ptr, fold, HAS_BIAS)


@triton.jit
def _epilogue(acc, out_ptr, o_off, o_mask, rn, N, bias_ptr, alpha_ptr, fold, HAS_BIAS: tl.constexpr):
    """``alpha * acc (+ bias)`` in fp32, one rounding to the output dtype.
    ``fold`` (a power of two) undoes the decoders' scaling exactly."""
    alpha = tl.load(alpha_ptr).to(tl.float32) * fold
    out = acc * alpha
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _predecoded_linear(x16: torch.Tensor, w, w_s, factor, bias, out_dtype) -> torch.Tensor:
    """The ``predecode_w`` path: ``F.linear(x16, 16-bit factor * deq(w)) (+ bias)``
    on cuBLAS; the 16-bit weight is a temporary of this call."""
    if x16.shape[0] == 0 or w.shape[0] == 0:
        return nv.mm_output(x16, w, out_dtype)
    wd = dequant(w, w_s, x16.dtype, factor)
    y = torch.nn.functional.linear(x16, wd, None if bias is None else bias.to(x16.dtype))
    return y if y.dtype == out_dtype else y.to(out_dtype)


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 split-K counters, one per output tile, for one launch.

    Fresh per call (a memset; a memset node under CUDA-graph capture), never
    cached: memory an op kept would come from a CUDA-graph pool when its first
    call is Inductor's warm-up, and a cached buffer would be shared by every
    graph that captured it, racing when two of them replay at once.

    Examples
    --------
    >>> tile_counters(torch.device("cpu"), 3).tolist()
    [0, 0, 0]
    """
    return torch.zeros(tiles, dtype=torch.int32, device=device)


def _launch(w, w_s, x, x_s, alpha, bias, out_dtype, cfg: GemmConfig, x_fp4: bool) -> torch.Tensor:
    """One GEMM launch (plus the split-K workspace); ``x`` is packed when ``x_fp4``."""
    m = x.shape[0]
    n = w.shape[0]
    k = 2 * w.shape[1]
    out = nv.mm_output(x, w, out_dtype)
    if m == 0 or n == 0:
        return out
    if x_fp4:
        dtype = torch.float16  # exact for e2m1 * e4m3 on both sides
    else:
        dtype = x.dtype
    if interpreting():
        dtype = torch.float32  # numpy's matmul has no bf16; fp32 products are exact too
    fold = decode_fold(cfg.decode, dtype)
    if x_fp4:
        fold *= decode_fold(cfg.decode, dtype)
    split = cfg.split_k
    num_m = triton.cdiv(m, cfg.block_m)
    num_n = triton.cdiv(n, cfg.block_n)
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=w.device)
        lock = tile_counters(w.device, num_n * num_m)
    else:
        part = lock = out  # unused
    _gemm_kernel[(num_n * num_m, split)](
        w, w_s.view(torch.uint8), x, x_s.view(torch.uint8) if x_fp4 else x, out,
        bias if bias is not None else out, alpha, part, lock,
        m, n, k, x.stride(0), out.stride(0), w_s.shape[1] // 4,
        x_s.shape[1] // 4 if x_fp4 else 0, fold,
        X_FP4=x_fp4, HAS_BIAS=bias is not None, DTYPE=_TL_DTYPE[dtype],
        DECODE=DECODERS.index(cfg.decode),
        EVEN_K=k % cfg.block_k == 0, HW_FP8=_hw_e4m3(w.device), BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k, SPLIT_K=split, GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def run_mm(a, b, a_scales, b_scales, alpha, out_dtype, bias, cfg: GemmConfig) -> torch.Tensor:
    """``nvfp4_mm`` with an explicit config (benchmarks and tests)."""
    if cfg.predecode_w:  # deq(a) exact in 16 bits, alpha folded into the weight
        return _predecoded_linear(dequant(a, a_scales, out_dtype), b, b_scales, alpha, bias, out_dtype)
    if cfg.predecode_x:
        xa = dequant_fp16(a, a_scales)
        return _launch(b, b_scales, xa, None, alpha, bias, out_dtype, cfg, x_fp4=False)
    return _launch(b, b_scales, a, a_scales, alpha, bias, out_dtype, cfg, x_fp4=True)


def run_w4a16(x, b, b_scales, weight_alpha, out_dtype, bias, cfg: GemmConfig) -> torch.Tensor:
    """``nvfp4_w4a16_mm`` with an explicit config (benchmarks and tests)."""
    if cfg.predecode_w:
        return _predecoded_linear(x, b, b_scales, weight_alpha, bias, out_dtype)
    return _launch(b, b_scales, x, None, weight_alpha, bias, out_dtype, cfg, x_fp4=False)


# ----------------------------------------------------------------------------
# 4. Backend registration and public functions
# ----------------------------------------------------------------------------


def mm(a, b, a_scales, b_scales, alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_mm`` on the Triton kernel: ``alpha * (deq(a) @ deq(b).T) (+ bias)``.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)    # doctest: +SKIP
    >>> w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                          # doctest: +SKIP
    >>> qa, sa = torch.ops.scaledmm.nvfp4_quant(x, one)                 # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                 # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "triton"):                   # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, one)
    """
    p = nv.mm_problem(a, b, out_dtype, bias)
    cfg = select_config("nvfp4_mm", p)
    return run_mm(a, b, a_scales, b_scales, alpha, out_dtype, bias, cfg)


def w4a16_mm(x, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_w4a16_mm`` on the Triton kernel: ``x @ (weight_alpha * deq(b)).T (+ bias)``.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)    # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(x, torch.tensor(1.0, device="cuda"))  # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "triton"):                   # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, torch.tensor(1.0, device="cuda"))
    """
    p = nv.w4a16_problem(x, b, out_dtype, bias)
    cfg = select_config("nvfp4_w4a16_mm", p)
    return run_w4a16(x, b, b_scales, weight_alpha, out_dtype, bias, cfg)


def dynamic_linear(x, x_amax, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_dynamic_linear``: :func:`quant_dynamic` (the global scale and
    alpha computed in the quantizer's launch), then ``nvfp4_mm`` as selected.

    Examples
    --------
    >>> import torch, scaledmm
    >>> w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, torch.tensor(10.0, device="cuda"))  # doctest: +SKIP
    >>> x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)    # doctest: +SKIP
    >>> amax = x.float().abs().amax(dim=1)                              # doctest: +SKIP
    >>> out = torch.ops.scaledmm.nvfp4_dynamic_linear(x, amax, qb, sb, torch.tensor(0.1, device="cuda"))  # doctest: +SKIP
    """
    q, s, alpha = quant_dynamic(x, x_amax, weight_alpha)
    return torch.ops.scaledmm.nvfp4_mm(q, b, s, b_scales, alpha, out_dtype, bias)


backends.register(Backend(
    FAMILY, NAME,
    impls={"nvfp4_quant": quant, "nvfp4_mm": mm, "nvfp4_w4a16_mm": w4a16_mm,
           "nvfp4_dynamic_linear": dynamic_linear},
    is_supported=is_supported,
    can_implement=can_implement,
    description="Triton: exact FP4 decode in registers + fp16/bf16 tensor cores (sm80+, Hopper)",
))
