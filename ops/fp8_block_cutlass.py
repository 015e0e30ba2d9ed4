"""FP8 block-scaled GEMM on sm90 through CUTLASS 3.x: backend ``cutlass`` of
the ``fp8_block`` family.

DeepSeek-V3 recipe (SPEC.md "FP8 block-scaled GEMM"): 1 x 128 activation
scales, 128 x 128 weight scales.  The kernel is CUTLASS's warp-specialized sm90
mainloop with blockwise scaling (``MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8``:
per 128-wide K block, wgmma into a temporary fp32 accumulator, then
``acc += tmp * a_scale[m] * b_scale[n]``), instantiated by our own
``csrc/fp8_block_cutlass.cu``.  No torch extension is compiled: each kernel
configuration is one small shared library with a C ABI (raw device pointers,
sizes, strides, a ``cudaStream_t``; an error code plus message), built with
nvcc at first use through :mod:`scaledmm.jit` (disk cache, file lock) and
called through :mod:`ctypes` on torch's current stream.  CUTLASS's workspace
(stream-K) comes from torch's allocator, so calls are CUDA-graph capturable.

Read top to bottom: capability checks, config space (one frozen dataclass, one
validity predicate, the per-problem table), library build and ABI, argument
preparation (CPU-testable, no launch), launcher, backend registration, public
function, reference.

Pre-building (e.g. to carry a cache to a machine without the CUTLASS headers)::

    SCALEDMM_CACHE_DIR=/path/cache python -m scaledmm.jit build --fp8-block-cutlass table
    # or "all", or a comma list of config names, optionally ":bf16,fp16,fp32"
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import json
import re
import subprocess
import threading
from pathlib import Path

import torch

import scaledmm.csrc as _csrc
from scaledmm import backends, env, jit, kernel_tuning
from scaledmm.device import capability, sm_count
from scaledmm import validation as V
from scaledmm.backends import Backend, Problem

from . import fp8_block as base

BACKEND = "cutlass"
SOURCE = Path(_csrc.__file__).resolve().parent / "fp8_block_cutlass.cu"
ABI_VERSION = 2  # SMM_ABI_VERSION in the .cu
BLOCK = 128  # scale block along K (activation and weight) and along N (weight)
ALIGN_M = base.ALIGN_M
OUT_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ENV_CUTLASS_INCLUDE = env.CUTLASS_INCLUDE
# CUTLASS version assumed for pre-built libraries on a machine without the
# headers (the cache key must be the same as on the machine that built them).
PINNED_CUTLASS_VERSION = "4.2.0"
PINNED_NVCC_RELEASE = "13.0"  # likewise for a machine without nvcc
_MARKER = "cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp"
NVCC_OPTIONS = ("--expt-relaxed-constexpr", "-DNDEBUG")

# ----------------------------------------------------------------------------
# Capability checks
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def cutlass_include(env_value: str | None) -> Path | None:
    """CUTLASS's include folder: ``env_value`` if it has the headers, else the
    ``cutlass_library`` package's, else None.  Cached: call ``cache_clear()``
    after changing what is installed.

    Examples
    --------
    >>> cutlass_include("/nonexistent") is None or cutlass_include("/nonexistent").is_dir()
    True
    """
    cands = [Path(env_value)] if env_value else []
    spec = importlib.util.find_spec("cutlass_library")  # locate without importing it
    if spec is not None and spec.submodule_search_locations:
        cands += [Path(p) / "source" / "include" for p in spec.submodule_search_locations]
    return next((c for c in cands if (c / _MARKER).is_file()), None)


def cutlass_include_dir() -> Path | None:
    """CUTLASS headers: ``$SCALEDMM_CUTLASS_INCLUDE`` or the ``nvidia-cutlass``
    wheel's ``cutlass_library/source/include``; None when absent."""
    return cutlass_include(env.cutlass_include())


@functools.lru_cache(maxsize=None)
def header_version(include: Path | None) -> str:
    """The CUTLASS version ``include/cutlass/version.h`` declares (the pinned
    one without headers).

    Examples
    --------
    >>> header_version(None) == PINNED_CUTLASS_VERSION
    True
    """
    if include is None:
        return PINNED_CUTLASS_VERSION
    text = (include / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


def cutlass_version() -> str:
    """Version of the CUTLASS headers the libraries are (or were) built with."""
    return header_version(cutlass_include_dir())


def _is_supported(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "needs a CUDA device"
    major, minor = capability(device)
    if (major, minor) != (9, 0):
        return False, f"sm_90a kernels run on sm90 only, device is sm{major}{minor}"
    if jit.nvcc_path() is None or cutlass_include_dir() is None:
        missing = [spec.name for spec in table_specs() if not spec.cached()]
        if missing:
            why = "nvcc not found" if jit.nvcc_path() is None else "CUTLASS headers not found"
            return False, f"{why} and {len(missing)} table libraries are not pre-built in {jit.cache_dir()}"
    return True, f"CUTLASS {cutlass_version()} sm90 blockwise kernels (nvcc-built, cache {jit.cache_dir()})"


# ----------------------------------------------------------------------------
# Config space
# ----------------------------------------------------------------------------

_RASTER = {"heuristic": 0, "m": 1, "n": 2}
_DECOMPOSITION = {"heuristic": 0, "data_parallel": 1, "splitk": 2, "streamk": 3}
_BUILD_FIELDS = ("tile_m", "tile_n", "cluster_m", "cluster_n", "pingpong", "swap_ab", "sfa_strided",
                 "streamk", "stages")


@dataclasses.dataclass(frozen=True)
class CutlassConfig:
    """One kernel configuration: build fields (one library each) and launch knobs.

    Parameters
    ----------
    tile_m, tile_n : int
        CTA tile of the CUTLASS problem.  Without ``swap_ab`` that is
        (activation rows, weight rows); with it, (weight rows, activation rows).
        The K tile is always 128 (one scale block).
    cluster_m, cluster_n : int
        Thread-block cluster (TMA multicast of the shared operand).
    pingpong : bool
        Ping-pong schedule (two consumer warp groups alternate tiles) instead of
        cooperative (both work on one tile).
    swap_ab : bool
        Compute ``out^T = b @ a^T``: the weight fills the 128-row MMA side and the
        few activation rows the narrow side (small M).
    sfa_strided : bool
        Activation scales of any layout, loaded with cp.async (no copy).  Else
        the kernel wants column-major scales (TMA loads) and the launcher copies
        row-major ones: ``M * K/128 * 4`` bytes read and written, one extra
        kernel.
    streamk : bool
        Stream-K tile scheduler (splits K across CTAs when tiles < SMs; needs
        a workspace) instead of the persistent data-parallel one.
    stages : int
        Shared-memory pipeline stages; 0 = as many as fit.
    swizzle, raster, splits, decomposition
        Launch knobs (no rebuild): tile-scheduler swizzle (1, 2, 4, 8), raster
        order ("heuristic", "m", "n" along the CUTLASS problem), and for
        stream-K the split count (> 1 forces split-K) and decomposition
        ("heuristic", "data_parallel", "splitk", "streamk").
    """

    tile_m: int = 128
    tile_n: int = 128
    cluster_m: int = 1
    cluster_n: int = 1
    pingpong: bool = False
    swap_ab: bool = False
    sfa_strided: bool = False
    streamk: bool = False
    stages: int = 0
    swizzle: int = 1
    raster: str = "heuristic"
    splits: int = 1
    decomposition: str = "heuristic"

    @property
    def name(self) -> str:
        """Short unique name, e.g. ``coop128x128_c1x2`` or ``swap_coop128x32_sfs_sk``."""
        s = ("swap_" if self.swap_ab else "") + ("pp" if self.pingpong else "coop")
        s += f"{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}"
        s += "_sfs" if self.sfa_strided else ""
        s += "_sk" if self.streamk else ""
        s += f"_st{self.stages}" if self.stages else ""
        knobs = [f"sw{self.swizzle}" if self.swizzle != 1 else "",
                 f"r{self.raster}" if self.raster != "heuristic" else "",
                 f"sp{self.splits}" if self.splits != 1 else "",
                 f"d{self.decomposition}" if self.decomposition != "heuristic" else ""]
        return s + "".join("@" + k for k in knobs if k)

    @property
    def build(self) -> "CutlassConfig":
        """The config with default launch knobs: what identifies the library."""
        return CutlassConfig(**{f: getattr(self, f) for f in _BUILD_FIELDS})

    @property
    def consumer_rows(self) -> int:
        """Rows of the CUTLASS tile one consumer warp group accumulates."""
        return self.tile_m if self.pingpong else self.tile_m // 2

    @property
    def scales_by_tma(self) -> bool:
        """Whether CUTLASS loads the activation scales with TMA (M-major layout
        and >= 32 of them per tile)."""
        act_rows = self.tile_n if self.swap_ab else self.tile_m
        return not self.sfa_strided and act_rows >= 32

    def defines(self, out_dtype: torch.dtype) -> dict[str, int]:
        return {"SMM_TILE_M": self.tile_m, "SMM_TILE_N": self.tile_n, "SMM_CLUSTER_M": self.cluster_m,
                "SMM_CLUSTER_N": self.cluster_n, "SMM_PINGPONG": int(self.pingpong),
                "SMM_SWAP_AB": int(self.swap_ab), "SMM_SFA_STRIDED": int(self.sfa_strided),
                "SMM_STREAMK": int(self.streamk), "SMM_STAGES": self.stages, "SMM_OUT": OUT_DTYPES[out_dtype]}


# fp32 registers per consumer thread: the accumulator and the per-block
# temporary (2 x rows x cols / 128 threads) must leave room for addresses etc.
_MAX_ACC_REGS = 160


def config_valid(cfg: CutlassConfig, problem: Problem | None = None) -> tuple[bool, str]:
    """THE validity predicate (dispatch, table, prebuild and tests use it).

    Without ``problem``: can the config be built and run at all.  With it:
    can it compute that problem.  Returns ``(ok, reason)``.

    Examples
    --------
    >>> from scaledmm.ops.fp8_block_cutlass import CutlassConfig, config_valid
    >>> config_valid(CutlassConfig(128, 128))[0]
    True
    >>> config_valid(CutlassConfig(128, 256))
    (False, 'accumulators need 256 fp32 registers per thread (> 160): smaller tile')
    """
    weight_tile = cfg.tile_m if cfg.swap_ab else cfg.tile_n
    act_tile = cfg.tile_n if cfg.swap_ab else cfg.tile_m
    if weight_tile % BLOCK:
        return False, f"the weight side of the tile must be a multiple of {BLOCK} (one scale block), got {weight_tile}"
    if cfg.tile_m % (64 if cfg.pingpong else 128):
        return False, f"tile_m must be a multiple of {64 if cfg.pingpong else 128} for this schedule, got {cfg.tile_m}"
    if act_tile % 8 or not 8 <= act_tile <= 256:
        return False, f"the activation side of the tile must be a multiple of 8 in [8, 256], got {act_tile}"
    regs = 2 * cfg.consumer_rows * cfg.tile_n // 128
    if regs > _MAX_ACC_REGS:
        return False, f"accumulators need {regs} fp32 registers per thread (> {_MAX_ACC_REGS}): smaller tile"
    if cfg.cluster_m not in (1, 2) or cfg.cluster_n not in (1, 2) or cfg.cluster_m * cfg.cluster_n > 2:
        return False, f"cluster must be 1x1, 1x2 or 2x1, got {cfg.cluster_m}x{cfg.cluster_n}"
    if cfg.streamk and cfg.pingpong:
        return False, "CUTLASS's ping-pong kernel has no stream-K scheduler"
    if not cfg.sfa_strided and act_tile < 32:
        return False, "column-major scales only pay off with TMA (>= 32 activation rows per tile): use sfa_strided"
    if cfg.stages and not 2 <= cfg.stages <= 12:
        return False, f"stages must be 0 (auto) or 2..12, got {cfg.stages}"
    if cfg.swizzle not in (1, 2, 4, 8):
        return False, f"swizzle must be 1, 2, 4 or 8, got {cfg.swizzle}"
    if cfg.raster not in _RASTER or cfg.decomposition not in _DECOMPOSITION:
        return False, f"raster / decomposition: unknown {cfg.raster!r} / {cfg.decomposition!r}"
    if not cfg.streamk and (cfg.splits != 1 or cfg.decomposition != "heuristic"):
        return False, "splits / decomposition apply to stream-K configs only"
    if cfg.splits < 1:
        return False, f"splits must be >= 1, got {cfg.splits}"
    if problem is None:
        return True, "valid"
    p = problem
    if p.m % ALIGN_M:
        return False, f"needs M % {ALIGN_M} == 0 (TMA-aligned scale rows), got M={p.m}"
    if p.opt("block_size") != (BLOCK, BLOCK):
        return False, f"needs block_size ({BLOCK}, {BLOCK}), got {p.opt('block_size')}"
    if p.k % BLOCK or p.k == 0:
        return False, f"needs K % {BLOCK} == 0 and K > 0, got K={p.k}"
    if p.n % 16 or p.n == 0:
        return False, f"needs N % 16 == 0 and N > 0 (16-byte output rows), got N={p.n}"
    if p.out_dtype not in OUT_DTYPES:
        return False, f"out_dtype must be bf16, fp16 or fp32, got {p.out_dtype}"
    if p.m > 1 and p.a_row_stride % 16:
        return False, f"needs a row stride that is a multiple of 16 (TMA), got {p.a_row_stride}"
    if p.m * (p.k // BLOCK) >= 2**31 or p.n >= 2**31:
        return False, "sizes must fit the kernel's 32-bit problem shape and scale strides"
    return True, "valid"


def _cfg(tile_m, tile_n, **kw) -> CutlassConfig:
    cfg = CutlassConfig(tile_m, tile_n, **kw)
    ok, why = config_valid(cfg)
    assert ok, f"{cfg.name}: {why}"
    return cfg


# Every config the benchmark compares (all valid; names are unique).
CONFIGS: dict[str, CutlassConfig] = {c.name: c for c in (
    # large M: activation rows on the 128 / 64-row side, TMA-loaded scales
    _cfg(128, 128),
    _cfg(128, 128, cluster_n=2),
    _cfg(128, 128, cluster_m=2),
    _cfg(128, 128, cluster_n=2, sfa_strided=True),
    _cfg(128, 128, cluster_n=2, streamk=True),
    _cfg(64, 128, pingpong=True),
    _cfg(64, 128, pingpong=True, cluster_n=2),
    # small M: swap A/B, the tokens on the narrow side, stream-K for few tiles
    _cfg(128, 16, swap_ab=True, sfa_strided=True, streamk=True),
    _cfg(128, 32, swap_ab=True, sfa_strided=True, streamk=True),
    _cfg(128, 64, swap_ab=True, sfa_strided=True, streamk=True),
    _cfg(128, 64, swap_ab=True, sfa_strided=True),
    _cfg(128, 128, swap_ab=True, sfa_strided=True, streamk=True),
)}


@dataclasses.dataclass(frozen=True)
class TableRow:
    """Problems with ``M <= max_m`` (first matching row) run ``config``."""

    max_m: int
    config: CutlassConfig


def table() -> tuple[TableRow, ...]:
    """The config per M, from ``scaledmm/tuning/kernels/fp8_block_cutlass_sm90.json``
    (its ``default`` rows: every shape; read once, each config checked by
    :func:`config_valid`).  Also available as the module attribute ``TABLE``.

    Examples
    --------
    >>> from scaledmm.ops.fp8_block_cutlass import table
    >>> table()[-1].config.name
    'coop128x128_c1x1'
    """
    t = kernel_tuning.load("fp8_block_cutlass", "sm90", CutlassConfig, config_valid)
    return tuple(TableRow(max_m, cfg) for max_m, cfg in t.default)


def __getattr__(name: str):
    if name == "TABLE":
        return table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=4096)
def select_config(problem: Problem) -> CutlassConfig | None:
    """The table's config for ``problem`` (None when no valid row applies);
    a row's config is valid for the problem by construction.  Cached per
    Problem: :func:`can_implement` and the launch ask the same question."""
    for row in table():
        if problem.m <= row.max_m and config_valid(row.config, problem)[0]:
            return row.config
    return None


# ----------------------------------------------------------------------------
# Library build and C ABI
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def nvcc_release(nvcc: str | None) -> str:
    """``"13.0"`` from ``nvcc --version``; the pinned release without nvcc.

    Examples
    --------
    >>> nvcc_release(None) == PINNED_NVCC_RELEASE
    True
    """
    if nvcc is None:
        return PINNED_NVCC_RELEASE
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else out.strip().splitlines()[-1]


@dataclasses.dataclass(frozen=True)
class _PortableSpec(jit.NvccLibrarySpec):
    """An nvcc library whose cache key depends on the sources (text), options,
    defines, target, the CUTLASS version and nvcc's release (major.minor) only:
    not on the headers' path, on whether they are installed, or on nvcc's
    build string, so a cache built on one machine is found on another."""

    @functools.cached_property
    def key(self) -> str:
        payload = {
            "format": 1, "kind": "nvcc-portable", "name": self.name, "arch": self.arch,
            "files": [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in self.files],
            "options": list(self.options), "defines": [list(d) for d in self.defines],
            "extra_key": self.extra_key, "nvcc": nvcc_release(jit.nvcc_path()),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def library_spec(cfg: CutlassConfig, out_dtype: torch.dtype = torch.bfloat16) -> jit.NvccLibrarySpec:
    """The build spec of ``cfg``'s library for ``out_dtype`` (builds nothing)."""
    include = cutlass_include_dir()
    return _library_spec(cfg.build, out_dtype, None if include is None else str(include), cutlass_version())


@functools.lru_cache(maxsize=None)
def _library_spec(cfg: CutlassConfig, out_dtype: torch.dtype, include: str | None,
                  version: str) -> jit.NvccLibrarySpec:
    return _PortableSpec(
        name=f"fp8_block_cutlass_{cfg.name}_{_DTYPE_NAMES[out_dtype]}",
        sources=(str(SOURCE),), options=NVCC_OPTIONS, arch="sm_90a",
        include_dirs=(include,) if include is not None else (),
        defines=tuple(cfg.defines(out_dtype).items()), extra_key=f"cutlass-{version}",
    )


def table_specs(out_dtypes=(torch.bfloat16,)) -> list[jit.NvccLibrarySpec]:
    return [library_spec(row.config, dt) for row in table() for dt in out_dtypes]


class Args(ctypes.Structure):
    """Mirror of ``smm_fp8_block_args`` in csrc/fp8_block_cutlass.cu."""

    _fields_ = [
        ("abi_version", ctypes.c_int32), ("device", ctypes.c_int32), ("sm_count", ctypes.c_int32),
        ("m", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
        ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("a_scales", ctypes.c_void_p),
        ("b_scales", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("lda", ctypes.c_int64), ("ldd", ctypes.c_int64), ("sam", ctypes.c_int64),
        ("sak", ctypes.c_int64), ("sbn", ctypes.c_int64),
        ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_int64), ("stream", ctypes.c_void_p),
        ("swizzle", ctypes.c_int32), ("raster", ctypes.c_int32), ("splits", ctypes.c_int32),
        ("decomposition", ctypes.c_int32),
    ]


def args_layout() -> list[int]:
    """``[sizeof, offsets...]`` of :class:`Args` (compare with the library's)."""
    return [ctypes.sizeof(Args)] + [getattr(Args, f).offset for f, _ in Args._fields_]


_ERR_LEN = 512


class CutlassLibrary:
    """A loaded config library: ``describe``, ``prepare``, ``workspace_size``, ``run``."""

    def __init__(self, cdll: ctypes.CDLL, name: str) -> None:
        self.name = name
        self.cdll = cdll
        cdll.smm_abi_version.restype = ctypes.c_int
        cdll.smm_describe.argtypes = [ctypes.c_char_p, ctypes.c_int]
        cdll.smm_prepare.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        cdll.smm_workspace_size.argtypes = [ctypes.POINTER(Args), ctypes.c_char_p, ctypes.c_int]
        cdll.smm_workspace_size.restype = ctypes.c_int64
        cdll.smm_run.argtypes = [ctypes.POINTER(Args), ctypes.c_char_p, ctypes.c_int]
        cdll.smm_args_layout.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        version = cdll.smm_abi_version()
        if version != ABI_VERSION:
            raise RuntimeError(f"{name}: library ABI {version}, expected {ABI_VERSION} (stale cache entry?)")
        if self.args_layout() != args_layout():
            raise RuntimeError(f"{name}: smm_fp8_block_args layout {self.args_layout()} differs from the "
                               f"ctypes mirror {args_layout()}")
        self._prepared: set[int] = set()
        self._lock = threading.Lock()

    def args_layout(self) -> list[int]:
        """``[sizeof, offsets...]`` of the C argument struct (no CUDA call)."""
        buf = (ctypes.c_int64 * 64)()
        count = self.cdll.smm_args_layout(buf, 64)
        return list(buf[:count])

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(_ERR_LEN)
        self.cdll.smm_describe(buf, _ERR_LEN)
        return buf.value.decode()

    def prepare(self, device_index: int) -> None:
        """Load the kernel on the device once (before any graph capture)."""
        if device_index in self._prepared:
            return
        with self._lock:
            if device_index not in self._prepared:
                buf = ctypes.create_string_buffer(_ERR_LEN)
                self._check(self.cdll.smm_prepare(device_index, buf, _ERR_LEN), "smm_prepare", buf)
                self._prepared.add(device_index)

    def workspace_size(self, args: Args) -> int:
        buf = ctypes.create_string_buffer(_ERR_LEN)
        size = self.cdll.smm_workspace_size(ctypes.byref(args), buf, _ERR_LEN)
        if size < 0:
            raise RuntimeError(f"{self.name}: smm_workspace_size: {buf.value.decode()}")
        return size

    def run(self, args: Args) -> None:
        buf = ctypes.create_string_buffer(_ERR_LEN)
        self._check(self.cdll.smm_run(ctypes.byref(args), buf, _ERR_LEN), "smm_run", buf)

    def _check(self, rc: int, what: str, buf=None) -> None:
        if rc != 0:
            msg = buf.value.decode() if buf is not None else ""
            raise RuntimeError(f"{self.name}: {what} failed (code {rc}): {msg}")


_LIBS: dict[tuple[CutlassConfig, torch.dtype], CutlassLibrary] = {}  # per process, loaded once
_LIBS_LOCK = threading.Lock()


def load_library(cfg: CutlassConfig, out_dtype: torch.dtype = torch.bfloat16) -> CutlassLibrary:
    """Build (first use, cached on disk) and load ``cfg``'s library."""
    lib = _LIBS.get((cfg, out_dtype))
    if lib is None:
        spec = library_spec(cfg, out_dtype)
        if cutlass_include_dir() is None and not spec.cached():
            raise RuntimeError(f"{spec.name}: CUTLASS headers not found (pip install nvidia-cutlass or set "
                               f"{ENV_CUTLASS_INCLUDE}) and no pre-built library in {jit.cache_dir()}")
        cdll = spec.load()
        with _LIBS_LOCK:
            lib = _LIBS.setdefault((cfg, out_dtype), CutlassLibrary(cdll, spec.name))
    return lib


def _prebuild_specs(value: str) -> list[jit.NvccLibrarySpec]:
    """``--fp8-block-cutlass table|all|name,name[:bf16,fp16,fp32]``."""
    which, _, dts = value.partition(":")
    names = {v: k for k, v in _DTYPE_NAMES.items()}
    dtypes = [names[d] for d in dts.split(",") if d] if dts else [torch.bfloat16]
    if which == "table":
        cfgs = list(dict.fromkeys(row.config for row in table()))
    elif which == "all":
        cfgs = list(CONFIGS.values())
    else:
        cfgs = [CONFIGS[n] for n in which.split(",") if n]
    return [library_spec(c, dt) for c in cfgs for dt in dtypes]


jit.register_prebuild("fp8-block-cutlass", _prebuild_specs,
                      help="CUTLASS fp8_block libraries: 'table', 'all' or config names, [:bf16,fp16,fp32]")

# ----------------------------------------------------------------------------
# Argument preparation (no launch; runs on CPU tensors in tests)
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class PreparedCall:
    """Operands as the kernel reads them, plus the strides it is given.

    ``copies`` says what had to be copied and why (empty on the fast path).
    """

    config: CutlassConfig
    a: torch.Tensor
    b: torch.Tensor
    a_scales: torch.Tensor
    b_scales: torch.Tensor
    out: torch.Tensor
    lda: int
    ldd: int
    sam: int
    sak: int
    sbn: int
    copies: tuple[str, ...] = ()

    def args(self, device_index: int, sm_count: int, stream: int) -> Args:
        m, k = self.a.shape
        cfg = self.config
        return Args(
            ABI_VERSION, device_index, sm_count, m, self.b.shape[0], k,
            self.a.data_ptr(), self.b.data_ptr(), self.a_scales.data_ptr(), self.b_scales.data_ptr(),
            self.out.data_ptr(), self.lda, self.ldd, self.sam, self.sak, self.sbn, None, 0, stream,
            cfg.swizzle, _RASTER[cfg.raster], cfg.splits, _DECOMPOSITION[cfg.decomposition],
        )


def _aligned(t: torch.Tensor, nbytes: int = 16) -> bool:
    return t.data_ptr() % nbytes == 0


def prepare(cfg: CutlassConfig, a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor,
            b_scales: torch.Tensor, out_dtype: torch.dtype) -> PreparedCall:
    """Bring already validated operands into the layouts ``cfg`` reads and
    allocate the output.  Copies only what the kernel cannot read in place."""
    m, k = a.shape
    kb = a_scales.shape[1]
    copies = []
    if not _aligned(a) or (m > 1 and a.stride(0) % 16):
        a = a.clone(memory_format=torch.contiguous_format)
        copies.append("a: base address / row stride not 16-byte aligned (TMA) -> contiguous copy")
    if not _aligned(b):
        b = b.clone()
        copies.append("b: base address not 16-byte aligned (TMA) -> copy")
    lda = a.stride(0) if m > 1 else k
    sam, sak = a_scales.stride()
    if not cfg.sfa_strided:
        # M-major, TMA: unit stride along M, 16-byte aligned columns and base.
        sak = sak if kb > 1 else V.round_up(max(m, 1), 4)
        if not ((sam == 1 or m <= 1) and sak % 4 == 0 and sak >= m and _aligned(a_scales)):
            a_scales = a_scales.t().contiguous().t() if m > 1 else a_scales.contiguous()
            sam, sak = 1, m
            copies.append(f"a_scales: row-major -> column-major for TMA ({m * kb * 4} bytes read + written)")
        sam = 1
    elif m <= 1:
        sam = kb
    sbn = b_scales.stride(0) if b_scales.shape[0] > 1 else kb
    out = base.mm_output(a, b, out_dtype)
    return PreparedCall(cfg, a, b, a_scales, b_scales, out, lda, b.shape[0], sam, sak, sbn, tuple(copies))


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def launch(prep: PreparedCall, lib: CutlassLibrary) -> torch.Tensor:
    """Run a prepared call on torch's current stream; returns ``prep.out``."""
    dev = prep.out.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    with torch.cuda.device(idx):
        lib.prepare(idx)
        args = prep.args(idx, sm_count(idx), torch.cuda.current_stream(idx).cuda_stream)
        ws_bytes = lib.workspace_size(args)
        workspace = None
        if ws_bytes > 0:
            workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
            args.workspace, args.workspace_bytes = workspace.data_ptr(), ws_bytes
        lib.run(args)
    return prep.out


def cutlass_mm(a, b, a_scales, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16,
               config: CutlassConfig | None = None, *, problem: Problem | None = None) -> torch.Tensor:
    """Backend implementation of ``fp8_block_mm`` (arguments already validated
    by the op).  ``problem``: the Problem the registry selected this backend
    for (its :func:`can_implement` held), passed by ``Backend.run``; the
    table's config for it is the one ``can_implement`` found.  A direct call
    without it, or with an explicit ``config``, is checked here."""
    p = problem
    if p is None:
        col = a_scales.stride(0) == 1 and a_scales.shape[1] > 1
        p = base.problem(a, b, block_size, out_dtype, col)
    cfg = config or select_config(p)
    if cfg is None:
        raise RuntimeError(f"fp8_block/{BACKEND}: no config for {p}")
    if config is not None:
        ok, why = config_valid(cfg, p)
        if not ok:
            raise RuntimeError(f"fp8_block/{BACKEND}: config {cfg.name} cannot run this problem: {why}")
    if a.shape[0] == 0:
        return base.mm_output(a, b, out_dtype)
    lib = load_library(cfg, out_dtype)
    return launch(prepare(cfg, a, b, a_scales, b_scales, out_dtype), lib)


# ----------------------------------------------------------------------------
# Backend registration
# ----------------------------------------------------------------------------


def can_implement(problem: Problem) -> tuple[bool, str]:
    """Backend predicate: a table config is valid for ``problem``."""
    cfg = select_config(problem)
    if cfg is None:
        last = table()[-1].config
        return False, config_valid(last, problem)[1]
    return True, f"config {cfg.name}"


backends.register(Backend(
    base.FAMILY, BACKEND,
    impls={"fp8_block_mm": cutlass_mm},
    is_supported=_is_supported,
    can_implement=can_implement,
    needs_m_multiple=ALIGN_M,
    description="CUTLASS 3.x sm90 warp-specialized FP8 blockwise GEMM (csrc/fp8_block_cutlass.cu, nvcc)",
))

# ----------------------------------------------------------------------------
# Public function and reference
# ----------------------------------------------------------------------------


def fp8_block_mm_cutlass(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
                         out_dtype: torch.dtype = torch.bfloat16,
                         config: CutlassConfig | str | None = None) -> torch.Tensor:
    """``fp8_block_mm`` on the CUTLASS kernel, optionally with a given config.

    Parameters
    ----------
    a : Tensor
        e4m3 ``[M, K]``, M % 4 == 0, K % 128 == 0, row stride % 16 == 0.
    b : Tensor
        e4m3 ``[N, K]`` contiguous, N % 16 == 0.
    a_scales : Tensor
        float32 ``[M, K/128]``, row- or column-major.
    b_scales : Tensor
        float32 ``[ceil(N/128), K/128]``, row-major.
    out_dtype : torch.dtype
        bf16, fp16 or fp32.
    config : CutlassConfig or str, optional
        A config (or a name in :data:`CONFIGS`); default: the table's choice.

    Returns
    -------
    Tensor
        ``[M, N]`` in ``out_dtype``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.fp8_block import quantize_weight, reference_quant
    >>> from scaledmm.ops.fp8_block_cutlass import fp8_block_mm_cutlass
    >>> a, sa = reference_quant(torch.randn(64, 512, device="cuda"))     # doctest: +SKIP
    >>> b, sb = quantize_weight(torch.randn(256, 512, device="cuda"))    # doctest: +SKIP
    >>> fp8_block_mm_cutlass(a, b, sa, sb).shape                         # doctest: +SKIP
    torch.Size([64, 256])
    """
    block = [BLOCK, BLOCK]
    base.check_mm_args("fp8_block_mm_cutlass", a, b, a_scales, b_scales, block, out_dtype)
    cfg = CONFIGS[config] if isinstance(config, str) else config
    return cutlass_mm(a, b, a_scales, b_scales, block, out_dtype, cfg)


reference_mm = base.reference_mm
