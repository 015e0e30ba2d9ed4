"""NVRTC (``cuda.core``) -> a cubin in the cache, loaded and launched through
the CUDA driver (``cuda.bindings``) on torch's current stream, optionally with
programmatic dependent launch.  ``cuda`` and ``torch`` are imported only when
something is compiled or launched."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import re
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from .core import (CompileError, JitError, _check_arch, _digest, _ensure_entry, _entry_dir, _entry_ok,
                   _file_digests, _FORMAT, _hashable, _normalize_defines, _nvrtc_version, _package_csrc,
                   _PROCESS_LOCK, cuda_include_dirs, nvrtc_available, source_closure)

# ----------------------------------------------------------------------------
# NVRTC -> cubin, loaded and launched through the CUDA driver
# ----------------------------------------------------------------------------


def cuda_driver():
    """The CUDA driver bindings module of cuda-python (``cuda.bindings.driver``).

    Examples
    --------
    >>> hasattr(cuda_driver(), "cuModuleLoadData")  # doctest: +SKIP
    True
    """
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 layout
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


def sm90a_gate(device) -> tuple[bool, str]:
    """Whether an NVRTC-compiled ``sm_90a`` kernel can run on ``device``: an
    sm90 GPU, NVRTC and the CUDA driver bindings.  On success the reason
    names the NVRTC found (callers prefix what their kernel is).

    Examples
    --------
    >>> import torch
    >>> from scaledmm import jit
    >>> jit.sm90a_gate(torch.device("cpu"))
    (False, 'needs a CUDA device')
    """
    from ..device import capability  # the ops' device facts (this gate runs inside scaledmm)
    from .core import nvrtc_available

    if device.type != "cuda":
        return False, "needs a CUDA device"
    cap = capability(device)
    if cap != (9, 0):
        return False, f"kernel is compiled for sm_90a (H100/H200), device is sm{cap[0]}{cap[1]}"
    ok, why = nvrtc_available()
    if not ok:
        return False, why
    try:
        cuda_driver()
    except ImportError as e:
        return False, f"cuda.bindings not importable: {e}"
    return True, why


def _check(result, what: str):
    """Unpack a cuda.bindings ``(err, *values)`` tuple, raising on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise JitError(f"scaledmm.jit: {what} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclasses.dataclass(frozen=True)
class NvrtcKernelSpec:
    """CUDA C++ compiled with NVRTC (``cuda.core.Program``) to a cubin.

    Compile-time specialization goes through ``defines``; the kernels are
    ``extern "C" __global__`` functions, so their names need no mangling.
    Headers are searched next to ``source_file``, in ``include_dirs`` and in
    :func:`cuda_include_dirs` (the CUDA wheels' include folders first, then a
    toolkit's).  Compiling needs no GPU; loading and launching do.

    Parameters
    ----------
    name : str
        The kernel (``extern "C"``) that :meth:`kernel` returns by default;
        also the cache folder's prefix.
    source_file : str or Path
        The ``.cu`` file.
    options : mapping or sequence of (str, value)
        ``cuda.core.ProgramOptions`` fields, e.g. ``{"std": "c++17"}`` or
        ``(("lineinfo", True),)``.
    arch : str
        ``"sm_90a"`` (default).
    defines : mapping or sequence of (name, value)
        Macros (``-D``).
    include_dirs : sequence of str
        Extra header folders.
    kernels : sequence of str
        Other kernels of the same module that callers fetch with :meth:`kernel`.

    Examples
    --------
    >>> from scaledmm import jit
    >>> spec = jit.NvrtcKernelSpec("my_kernel", "csrc/my_kernel.cu",
    ...                            defines={"TILE_N": 64})          # doctest: +SKIP
    >>> k = spec.kernel()                                           # doctest: +SKIP
    >>> k.launch((132,), (128,), (x, out, ctypes.c_int(m)))        # doctest: +SKIP
    """

    name: str
    source_file: str
    options: tuple[tuple[str, Any], ...] = ()
    arch: str = "sm_90a"
    defines: tuple[tuple[str, str], ...] = ()
    include_dirs: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.name):
            raise ValueError(f"name: expected a C identifier (the kernel's name), got {self.name!r}")
        object.__setattr__(self, "source_file", str(Path(self.source_file).resolve()))
        opts = self.options.items() if isinstance(self.options, Mapping) else self.options
        object.__setattr__(self, "options", tuple(sorted((str(k), _hashable(v)) for k, v in opts)))
        object.__setattr__(self, "defines", _normalize_defines(self.defines))
        object.__setattr__(self, "include_dirs", tuple(str(Path(d)) for d in self.include_dirs))
        object.__setattr__(self, "kernels", tuple(self.kernels))
        _check_arch(self.arch)

    @functools.cached_property
    def files(self) -> list[Path]:
        return source_closure([self.source_file], [_package_csrc(), *self.include_dirs])

    @functools.cached_property
    def key(self) -> str:
        """sha256 of source (with own headers), options, defines, arch, NVRTC version."""
        try:
            import cuda.core

            core = getattr(cuda.core, "__version__", "?")
        except Exception:
            core = "missing"
        return _digest({
            "format": _FORMAT, "kind": "nvrtc", "name": self.name, "kernels": self.kernels,
            "files": _file_digests(self.files), "options": self.options, "defines": self.defines,
            "arch": self.arch, "include_dirs": self.include_dirs,
            "toolchain": [_nvrtc_version(), f"cuda.core-{core}"],
        })

    @property
    def path(self) -> Path:
        return _entry_dir("nvrtc", self.name, self.key) / f"{self.name}.cubin"

    def cached(self) -> bool:
        """Whether the cubin is in the cache and matches the size and sha256
        recorded when it was built (builds nothing)."""
        return _entry_ok("nvrtc", self.name, self.key, f"{self.name}.cubin")

    def program_options(self, **overrides: Any):
        """The ``cuda.core.ProgramOptions`` this spec compiles with (``overrides``
        replace fields, e.g. ``ptxas_options="-v"``)."""
        from cuda.core import ProgramOptions

        kw: dict[str, Any] = {"std": "c++17"}
        kw.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in self.options})
        kw.update(overrides)
        includes = [str(Path(self.source_file).parent), *self.include_dirs, *cuda_include_dirs()]
        kw["include_path"] = list(kw.get("include_path") or []) + includes
        macros = [(k, v) for k, v in self.defines]
        if macros:
            kw["define_macro"] = list(kw.get("define_macro") or []) + macros
        return ProgramOptions(name=Path(self.source_file).name, arch=self.arch, **kw)

    def compile(self, logs: Any = None, **overrides: Any) -> bytes:
        """Compile with NVRTC and return the cubin (no cache; no GPU needed).

        ``logs`` (anything with ``write``) receives the compiler's log;
        ``overrides`` go to :meth:`program_options` (``ptxas_options="-v"``
        reports registers and spills)."""
        ok, why = nvrtc_available()
        if not ok:
            raise JitError(f"scaledmm.jit: cannot compile '{self.name}': {why}")
        from cuda.core import Program

        src = Path(self.source_file).read_text(encoding="utf-8")
        try:
            obj = Program(src, "c++", options=self.program_options(**overrides)).compile("cubin", logs=logs)
        except Exception as e:
            raise CompileError(f"scaledmm.jit: NVRTC failed compiling '{self.name}' "
                               f"({self.source_file}, defines {dict(self.defines)}):\n{e}") from e
        return bytes(obj.code)

    def _entry(self, read: bool = False) -> tuple[Path, bytes | None]:
        cubin = f"{self.name}.cubin"

        def build(tmp: Path) -> dict[str, Any]:
            (tmp / cubin).write_bytes(self.compile())
            return {"source": self.source_file, "defines": dict(self.defines),
                    "options": dict(self.options), "toolchain": _nvrtc_version()}

        return _ensure_entry("nvrtc", self.name, self.key, cubin, build, {"arch": self.arch}, read=read)

    def build(self) -> Path:
        """Compile (once, under a file lock) and return the cubin's path.

        A cached cubin whose size or sha256 differs from its record is
        rebuilt (refused with :class:`BuildDisabledError` under
        ``SCALEDMM_JIT_NO_BUILD=1``); an unusable cache folder raises
        :class:`CacheDirError`."""
        return self._entry()[0]

    def load(self) -> "CudaModule":
        """Build if needed; the module (loaded on a device at first launch).

        The driver gets exactly the bytes that were checked against the
        entry's recorded sha256.  Inside :func:`recording` it records this
        spec and raises :class:`SpecRecorded` instead (nothing is built,
        loaded or launched)."""
        recorded = getattr(_RECORDING, "specs", None)
        if recorded is not None:
            recorded.append(self)
            raise SpecRecorded(self)
        mod = MODULES.get(self.key)
        if mod is None:
            path, cubin = self._entry(read=True)
            with _PROCESS_LOCK:
                mod = MODULES.get(self.key)
                if mod is None:
                    mod = MODULES[self.key] = CudaModule(cubin, str(path))
        return mod

    def kernel(self, fn: str | None = None) -> "CudaKernel":
        """The launchable kernel ``fn`` (default: ``name``) of this module."""
        fn = fn or self.name
        if fn != self.name and fn not in self.kernels:
            raise ValueError(f"fn: expected one of {[self.name, *self.kernels]}, got {fn!r}")
        return self.load().kernel(fn)


MODULES: dict[str, "CudaModule"] = {}
_RECORDING = threading.local()


class SpecRecorded(Exception):
    """Raised by :meth:`NvrtcKernelSpec.load` inside :func:`recording`: the
    call that was about to load (and launch) ``spec`` stops there."""

    def __init__(self, spec: NvrtcKernelSpec):
        super().__init__(f"recorded {spec.name} ({spec.key[:16]})")
        self.spec = spec


@contextlib.contextmanager
def recording() -> Iterator[list[NvrtcKernelSpec]]:
    """Within the block (this thread only), any spec's load of its module
    appends the spec to the yielded list and raises :class:`SpecRecorded`:
    a way to learn which kernel a launch path would compile, from the path
    itself, without compiling or launching it.

    Examples
    --------
    >>> from scaledmm import jit
    >>> with jit.recording() as specs:                     # doctest: +SKIP
    ...     try:
    ...         launch_something(cfg)
    ...     except jit.SpecRecorded:
    ...         pass
    >>> jit.build_specs(specs, jobs=16)                    # doctest: +SKIP
    """
    if getattr(_RECORDING, "specs", None) is not None:
        raise RuntimeError("jit.recording(): already recording in this thread")
    _RECORDING.specs = specs = []
    try:
        yield specs
    finally:
        _RECORDING.specs = None


_TMA_DTYPES = {1: "CU_TENSOR_MAP_DATA_TYPE_UINT8", 2: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
               3: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"}
_TMA_SWIZZLE = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
                128: "CU_TENSOR_MAP_SWIZZLE_128B"}


@functools.lru_cache(maxsize=1024)  # pure function of its arguments: the map of the same tensor is reused
def tensor_map_2d(ptr: int, kind: int, cols: int, rows: int, row_bytes: int, box_cols: int, box_rows: int,
                  swizzle: int):
    """A TMA descriptor (``CUtensorMap``) of a row-major 2-D tensor at device
    address ``ptr``: ``rows`` x ``cols`` elements of ``kind`` (1 uint8, 2 fp16,
    3 bf16), rows ``row_bytes`` apart; tiles of ``box_rows`` x ``box_cols``
    with a ``swizzle``-byte shared-memory swizzle (0, 32, 64, 128); reads past
    the tensor fill zeros.  Pass it to :meth:`CudaKernel.launch` for a
    ``const __grid_constant__`` 128-byte parameter.

    Examples
    --------
    >>> m = tensor_map_2d(x.data_ptr(), 3, 4096, 64, 8192, 64, 128, 128)  # doctest: +SKIP
    """
    if kind not in _TMA_DTYPES or swizzle not in _TMA_SWIZZLE:
        raise ValueError(f"kind, swizzle: expected one of {sorted(_TMA_DTYPES)} and {sorted(_TMA_SWIZZLE)}, "
                         f"got {kind}, {swizzle}")
    if ptr % 16 or row_bytes % 16 or rows < 1 or cols < 1:
        raise ValueError(f"expected a 16-byte aligned address and row stride and a non-empty tensor, got address "
                         f"{ptr % 16} mod 16, row stride {row_bytes} bytes, {rows} x {cols}")
    drv = cuda_driver()
    _check(drv.cuInit(0), "cuInit")  # (a host-side encode: no context needed)
    return _check(drv.cuTensorMapEncodeTiled(
        getattr(drv.CUtensorMapDataType, _TMA_DTYPES[kind]), 2, ptr,
        [drv.cuuint64_t(cols), drv.cuuint64_t(rows)], [drv.cuuint64_t(row_bytes)],
        [drv.cuuint32_t(box_cols), drv.cuuint32_t(box_rows)], [drv.cuuint32_t(1), drv.cuuint32_t(1)],
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(drv.CUtensorMapSwizzle, _TMA_SWIZZLE[swizzle]),
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")


def _ensure_context(device_index: int) -> None:
    """Make the primary context of ``device_index`` current on this thread
    (the one torch uses), without changing torch's current device."""
    drv = cuda_driver()
    ctx = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is not None and int(ctx) != 0:
        dev = _check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
        if int(dev) == device_index:
            return
    _check(drv.cuInit(0), "cuInit")
    dev = _check(drv.cuDeviceGet(device_index), "cuDeviceGet")
    ctx = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class CudaModule:
    """A cubin, loaded per device on first use (``cuModuleLoadData``)."""

    def __init__(self, cubin: bytes, origin: str = "") -> None:
        self.cubin = cubin
        self.origin = origin
        self._per_device: dict[int, Any] = {}
        self._kernels: dict[str, CudaKernel] = {}
        self._lock = threading.Lock()

    def handle(self, device_index: int):
        mod = self._per_device.get(device_index)
        if mod is None:
            with self._lock:
                mod = self._per_device.get(device_index)
                if mod is None:
                    _ensure_context(device_index)
                    mod = _check(cuda_driver().cuModuleLoadData(self.cubin), f"cuModuleLoadData({self.origin})")
                    self._per_device[device_index] = mod
        return mod

    def kernel(self, fn: str) -> "CudaKernel":
        k = self._kernels.get(fn)
        if k is None:
            k = self._kernels[fn] = CudaKernel(self, fn)
        return k


class CudaKernel:
    """One ``extern "C"`` kernel of a :class:`CudaModule`; see :meth:`launch`."""

    def __init__(self, module: CudaModule, fn: str) -> None:
        self.module = module
        self.fn = fn
        self._funcs: dict[int, Any] = {}
        self._smem_set: dict[int, int] = {}
        self._occupancy: dict[tuple[int, int, int], int] = {}

    def function(self, device_index: int):
        f = self._funcs.get(device_index)
        if f is None:
            mod = self.module.handle(device_index)
            f = _check(cuda_driver().cuModuleGetFunction(mod, self.fn.encode()), f"cuModuleGetFunction({self.fn})")
            self._funcs[device_index] = f
        return f

    def _allow_smem(self, idx: int, func: Any, shared_mem: int) -> None:
        """Raise the kernel's dynamic shared-memory limit when its static and
        dynamic shared memory together pass the default 48 KiB (checked once per
        device and size: launches pay a dict lookup)."""
        if shared_mem <= 0 or self._smem_set.get(idx, 0) >= shared_mem:
            return
        drv = cuda_driver()
        static = int(_check(drv.cuFuncGetAttribute(
            drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func), "cuFuncGetAttribute(static shared)"))
        if static + shared_mem > 48 * 1024:
            _check(drv.cuFuncSetAttribute(
                func, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem),
                "cuFuncSetAttribute(max dynamic shared memory)")
        self._smem_set[idx] = shared_mem

    def max_active_blocks(self, block: int, shared_mem: int, device_index: int) -> int:
        """CTAs of ``block`` threads and ``shared_mem`` dynamic bytes that fit on
        one SM at once (the driver's occupancy calculator; cached)."""
        key = (device_index, int(block), int(shared_mem))
        n = self._occupancy.get(key)
        if n is None:
            _ensure_context(device_index)
            func = self.function(device_index)
            self._allow_smem(device_index, func, shared_mem)
            n = int(_check(cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(func, int(block), int(shared_mem)),
                           f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.fn})"))
            self._occupancy[key] = n
        return n

    def launch(self, grid: Sequence[int] | int, block: Sequence[int] | int, args: Sequence[Any], *,
               device: Any = None, shared_mem: int = 0, stream: Any = None, pdl: bool = False) -> None:
        """Launch on ``stream`` (default: torch's current stream of ``device``).

        Parameters
        ----------
        grid, block : int or up to three ints
        args : sequence
            Kernel arguments in order: a ``torch.Tensor`` passes its data
            pointer, ``None`` a null pointer, ctypes scalars (``ctypes.c_int(3)``)
            and driver structs (:func:`tensor_map_2d`) pass by value.
        device : torch.device or int, optional
            Defaults to the device of the first tensor argument.
        shared_mem : int
            Dynamic shared memory in bytes (above 48 KiB the kernel's limit is
            raised once).
        stream : torch.cuda.Stream or int, optional
        pdl : bool
            Programmatic dependent launch: the kernel may start before the
            previous kernel of the stream ends; it must ``griddepcontrol.wait``
            before reading what that kernel writes.
        """
        import torch

        values, types = [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                if device is None:
                    device = a.device
                values.append(a.data_ptr())
                types.append(ctypes.c_void_p)
            elif a is None:
                values.append(0)
                types.append(ctypes.c_void_p)
            elif isinstance(a, ctypes._SimpleCData):
                values.append(a)
                types.append(type(a))
            elif callable(getattr(a, "getPtr", None)):  # a driver struct passed by value (CUtensorMap)
                values.append(a)
                types.append(None)
            else:
                raise TypeError(f"args: expected tensors, None, ctypes scalars or driver structs, "
                                f"got {type(a).__name__}")
        if device is None:
            idx = torch.cuda.current_device()
        elif isinstance(device, int):
            idx = device
        else:
            dev = torch.device(device)
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
        if idx != torch.cuda.current_device():  # launch with torch's device guard, like its own kernels
            with torch.cuda.device(idx):
                return self.launch(grid, block, args, device=idx, shared_mem=shared_mem, stream=stream, pdl=pdl)
        if stream is None:
            stream = torch.cuda.current_stream(idx)
        handle = stream.cuda_stream if hasattr(stream, "cuda_stream") else int(stream)
        _ensure_context(idx)
        drv = cuda_driver()
        func = self.function(idx)
        self._allow_smem(idx, func, shared_mem)
        g = (grid,) if isinstance(grid, int) else tuple(grid)
        b = (block,) if isinstance(block, int) else tuple(block)
        g = g + (1,) * (3 - len(g))
        b = b + (1,) * (3 - len(b))
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in g)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(v) for v in b)
        cfg.sharedMemBytes = int(shared_mem)
        cfg.hStream = drv.CUstream(handle)
        if pdl:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
        else:
            cfg.numAttrs = 0
        _check(drv.cuLaunchKernelEx(cfg, func, (tuple(values), tuple(types)), 0), f"cuLaunchKernelEx({self.fn})")
