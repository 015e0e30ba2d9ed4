"""Run-time compilation of CUDA code: spec objects, a disk cache, a file lock.

A piece of run-time compiled code is described by a frozen *spec*:

* :class:`NvccLibrarySpec` builds a shared library with ``nvcc`` (static
  cudart, ``-shared -Xcompiler -fPIC``) and loads it with :mod:`ctypes`.  Its C
  ABI functions take raw device pointers and a ``cudaStream_t``.
* :class:`NvrtcKernelSpec` compiles one ``.cu`` file with NVRTC (through
  ``cuda.core``) to a cubin and loads it through the CUDA driver
  (``cuda.bindings``); :meth:`CudaKernel.launch` launches on torch's current
  stream, optionally with programmatic dependent launch (PDL).

Both share the same machinery:

* ``spec.key``: sha256 of everything that changes the binary (source text,
  the text of our own headers it includes, options, defines, target
  architecture, toolchain versions).
* a disk cache under ``~/.cache/scaledmm`` (override with
  ``$SCALEDMM_CACHE_DIR``), one folder per (kind, name, key) holding the
  artifact and a ``meta.json``;
* a file lock (:mod:`filelock`) per entry, so concurrent processes build once;
* an INFO line on the ``"scaledmm"`` logger when a build starts and ends;
* ``SCALEDMM_JIT_NO_BUILD=1`` turns a cache miss into :class:`BuildDisabledError`
  (deployments ship a pre-built cache, see ``python -m scaledmm.jit build``).

Command line::

    python -m scaledmm.jit status                  # what is cached
    python -m scaledmm.jit build --skinny 2112:7168,1536:7168

Kernel families add flags to ``build`` with :func:`register_prebuild`.  This
module is part of the core: it imports no op module (the command line imports
``scaledmm`` when it runs, which is what registers the families' hooks).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = [
    "JitError",
    "CompileError",
    "BuildDisabledError",
    "cache_dir",
    "NvccLibrarySpec",
    "NvrtcKernelSpec",
    "CudaKernel",
    "nvcc_path",
    "nvrtc_available",
    "cuda_include_dirs",
    "register_prebuild",
    "cached_entries",
    "main",
]

log = logging.getLogger("scaledmm")

ENV_CACHE_DIR = "SCALEDMM_CACHE_DIR"
ENV_NO_BUILD = "SCALEDMM_JIT_NO_BUILD"
ENV_NVCC = "SCALEDMM_NVCC"
_FORMAT = 1  # bump to invalidate every cache entry
_LOCK_TIMEOUT_S = 1800.0
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_ARCH_RE = re.compile(r"^sm_(\d+)([af]?)$")


class JitError(RuntimeError):
    """Base class of run-time compilation errors."""


class CompileError(JitError):
    """The compiler rejected the code; the message holds its log."""


class BuildDisabledError(JitError):
    """A cache miss while ``SCALEDMM_JIT_NO_BUILD=1``."""


# ----------------------------------------------------------------------------
# Cache folder, environment
# ----------------------------------------------------------------------------


def cache_dir() -> Path:
    """The root of the disk cache: ``$SCALEDMM_CACHE_DIR`` or ``~/.cache/scaledmm``.

    Read on every call, so tests and tools may change the variable at run time.

    Examples
    --------
    >>> import os
    >>> from scaledmm import jit
    >>> os.environ["SCALEDMM_CACHE_DIR"] = "/tmp/x"; str(jit.cache_dir())
    '/tmp/x'
    >>> del os.environ["SCALEDMM_CACHE_DIR"]
    """
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "scaledmm"


def _no_build() -> bool:
    return os.environ.get(ENV_NO_BUILD, "").strip().lower() not in ("", "0", "false", "no")


def _check_arch(arch: str) -> tuple[str, str]:
    """``"sm_90a"`` -> ``("compute_90a", "sm_90a")``."""
    m = _ARCH_RE.match(arch)
    if not m:
        raise ValueError(f"arch: expected 'sm_<NN>[a|f]' such as 'sm_90a', got {arch!r}")
    return f"compute_{m.group(1)}{m.group(2)}", arch


# ----------------------------------------------------------------------------
# Hashing sources (with our own quoted includes)
# ----------------------------------------------------------------------------


def _package_csrc() -> Path:
    """Folder of our own CUDA sources: ``scaledmm/csrc`` in an installed wheel,
    ``csrc/`` next to ``scaledmm/`` in the repository (editable install)."""
    here = Path(__file__).resolve().parent
    for cand in (here / "csrc", here.parent / "csrc"):
        if cand.is_dir():
            return cand
    return here.parent / "csrc"


def source_closure(sources: Iterable[str | Path], own_dirs: Sequence[str | Path] = ()) -> list[Path]:
    """The files whose text goes into a key: ``sources`` plus, recursively,
    every ``#include "..."`` that resolves next to the including file or in
    ``own_dirs`` (our own headers).  Angle-bracket includes and headers of
    external include folders (CUTLASS, CUDA) are versioned by the toolchain /
    ``extra_key`` instead of by text.

    Examples
    --------
    >>> from scaledmm import jit
    >>> files = jit.source_closure([jit._package_csrc() / "dsv3_fused_a_gemm.cu"])
    >>> files[0].name
    'dsv3_fused_a_gemm.cu'
    """
    own = [Path(d).resolve() for d in own_dirs]
    seen: dict[Path, None] = {}
    stack = [Path(s).resolve() for s in sources]
    for s in stack:
        if not s.is_file():
            raise FileNotFoundError(f"sources: expected an existing file, got {str(s)!r}")
    while stack:
        path = stack.pop(0)
        if path in seen:
            continue
        seen[path] = None
        text = path.read_text(encoding="utf-8", errors="replace")
        for inc in _INCLUDE_RE.findall(text):
            for base in [path.parent, *own]:
                cand = (base / inc).resolve()
                if cand.is_file():
                    stack.append(cand)
                    break
    return list(seen)


def _file_digests(files: Sequence[Path]) -> list[tuple[str, str]]:
    out = []
    for f in files:
        out.append((f.name, hashlib.sha256(f.read_bytes()).hexdigest()))
    return out


def _digest(payload: Mapping[str, Any]) -> str:
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


# ----------------------------------------------------------------------------
# Toolchains
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _find_nvcc(env_value: str | None) -> str | None:
    if env_value:
        return env_value if Path(env_value).is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def nvcc_path() -> str | None:
    """Path of ``nvcc``: ``$SCALEDMM_NVCC``, ``PATH``, ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``."""
    return _find_nvcc(os.environ.get(ENV_NVCC))


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str | None) -> str:
    if nvcc is None:
        return "nvcc-missing"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else f"nvcc-rc{out.returncode}"
    except Exception as e:  # pragma: no cover - broken toolchain
        return f"nvcc-error:{type(e).__name__}"


@functools.lru_cache(maxsize=None)
def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        return f"nvrtc-{major}.{minor}"
    except Exception as e:
        return f"nvrtc-missing:{type(e).__name__}"


def nvrtc_available() -> tuple[bool, str]:
    """Whether NVRTC can be used (``cuda.core`` + an NVRTC library), and why not."""
    try:
        import cuda.core  # noqa: F401
    except Exception as e:
        return False, f"cuda.core not importable: {e}"
    v = _nvrtc_version()
    if v.startswith("nvrtc-missing"):
        return False, f"NVRTC library not loadable ({v})"
    return True, v


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> tuple[str, ...]:
    """Folders with the CUDA runtime headers (``cuda_bf16.h`` ...) for NVRTC.

    The ``nvidia-cuda-runtime`` / ``nvidia-cuda-nvrtc`` wheels' include folders
    first (no CUDA install needed), then the toolkit's (``$CUDA_HOME``,
    ``/usr/local/cuda``).  Only existing folders are returned.
    """
    dirs: list[Path] = []
    for entry in sys.path:
        nv = Path(entry or ".") / "nvidia"
        if not nv.is_dir():
            continue
        for sub in ("cu13/include", "cu12/include", "cuda_runtime/include", "cuda_nvrtc/include"):
            dirs.append(nv / sub)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            dirs.append(Path(home) / "include")
    nvcc = nvcc_path()
    if nvcc:
        dirs.append(Path(nvcc).resolve().parent.parent / "include")
    out: list[str] = []
    for d in dirs:
        if d.is_dir() and str(d.resolve()) not in out:
            out.append(str(d.resolve()))
    return tuple(out)


# ----------------------------------------------------------------------------
# The locked build shared by both kinds
# ----------------------------------------------------------------------------

_PROCESS_LOCK = threading.RLock()  # guards the dicts below (never held while compiling)
_ENTRY_LOCKS: dict[str, threading.Lock] = {}


def _entry_lock(entry: Path) -> threading.Lock:
    """One lock per cache entry for the threads of this process (the file lock
    orders processes); different entries build in parallel."""
    with _PROCESS_LOCK:
        return _ENTRY_LOCKS.setdefault(str(entry), threading.Lock())


def _entry_dir(kind: str, name: str, key: str) -> Path:
    return cache_dir() / kind / f"{name}-{key[:24]}"


def _locked_build(kind: str, name: str, key: str, artifact: str,
                  build: Callable[[Path], dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Return ``<entry>/<artifact>``, building it under a file lock on a miss.

    ``build(tmpdir)`` writes ``tmpdir/artifact`` and returns extra metadata; the
    folder is renamed into place only when complete, so a crash never leaves a
    half-written entry behind.
    """
    entry = _entry_dir(kind, name, key)
    target = entry / artifact
    if target.is_file():
        return target
    if _no_build():
        raise BuildDisabledError(
            f"scaledmm.jit: {kind} '{name}' (key {key[:16]}) is not in the cache {cache_dir()} and "
            f"{ENV_NO_BUILD}=1 forbids building; pre-build it with `python -m scaledmm.jit build ...`"
        )
    from filelock import FileLock

    entry.parent.mkdir(parents=True, exist_ok=True)
    with _entry_lock(entry), FileLock(str(entry) + ".lock", timeout=_LOCK_TIMEOUT_S):
        if target.is_file():  # another process built it while we waited
            return target
        log.info("scaledmm.jit: building %s '%s' (key %s) into %s", kind, name, key[:16], entry)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        try:
            extra = build(tmp)
            info = dict(meta, kind=kind, name=name, key=key, artifact=artifact,
                        built_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                        build_seconds=round(time.perf_counter() - t0, 3), **(extra or {}))
            (tmp / "meta.json").write_text(json.dumps(info, indent=1, sort_keys=True, default=str))
            if entry.exists():  # a stale, incomplete entry (no artifact): replace it
                shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("scaledmm.jit: built %s '%s' in %.1f s", kind, name, time.perf_counter() - t0)
    return target


def _normalize_defines(defines: Any) -> tuple[tuple[str, str], ...]:
    if defines is None:
        return ()
    items = defines.items() if isinstance(defines, Mapping) else defines
    out = []
    for item in items:
        if isinstance(item, str):
            k, _, v = item.partition("=")
            out.append((k, v or "1"))
        else:
            k, v = item
            out.append((str(k), str(int(v)) if isinstance(v, bool) else str(v)))
    return tuple(out)


def _hashable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    return v


# ----------------------------------------------------------------------------
# nvcc -> shared library, loaded with ctypes
# ----------------------------------------------------------------------------

_CDLLS: dict[str, ctypes.CDLL] = {}


@dataclasses.dataclass(frozen=True)
class NvccLibrarySpec:
    """A shared library built by ``nvcc`` from CUDA C++ sources, loaded with ctypes.

    The library is compiled for one target (``-gencode=arch=compute_90a,code=sm_90a``
    by default) with ``-O3 -std=c++17 -shared -Xcompiler -fPIC -cudart static``
    plus ``options``.  Its exported functions should be ``extern "C"`` and take
    raw device pointers plus a ``cudaStream_t`` (pass
    ``torch.cuda.current_stream().cuda_stream``).

    Parameters
    ----------
    name : str
        Library name (``lib<name>.so``), also the cache folder's prefix.
    sources : sequence of str or Path
        ``.cu`` / ``.cpp`` files, compiled and linked in one ``nvcc`` call.
    options : sequence of str
        Extra ``nvcc`` flags (``"--expt-relaxed-constexpr"``, ``"-lcuda"``, ...).
    arch : str
        ``"sm_90a"`` (default), ``"sm_100a"``, ...
    include_dirs : sequence of str or Path
        ``-I`` folders.  Only their paths enter the key (not their files):
        put the version of an external header package in ``extra_key``.
    defines : mapping or sequence of (name, value)
        ``-D`` macros.
    extra_key : str
        Anything else that should change the key (e.g. ``"cutlass-4.2.0"``).

    Examples
    --------
    >>> from scaledmm import jit
    >>> spec = jit.NvccLibrarySpec("hello", ["/tmp/hello.cu"])   # doctest: +SKIP
    >>> lib = spec.load()                                       # doctest: +SKIP
    >>> lib.my_c_function.restype = ctypes.c_int                # doctest: +SKIP
    """

    name: str
    sources: tuple[str, ...]
    options: tuple[str, ...] = ()
    arch: str = "sm_90a"
    include_dirs: tuple[str, ...] = ()
    defines: tuple[tuple[str, str], ...] = ()
    extra_key: str = ""

    def __post_init__(self) -> None:
        if not re.match(r"^[A-Za-z0-9_.\-]+$", self.name):
            raise ValueError(f"name: expected letters, digits, '_', '-', '.', got {self.name!r}")
        srcs = (self.sources,) if isinstance(self.sources, (str, Path)) else self.sources
        if not srcs:
            raise ValueError("sources: expected at least one source file, got none")
        object.__setattr__(self, "sources", tuple(str(Path(s).resolve()) for s in srcs))
        opts = (self.options,) if isinstance(self.options, str) else self.options
        object.__setattr__(self, "options", tuple(str(o) for o in opts))
        object.__setattr__(self, "include_dirs", tuple(str(Path(d)) for d in self.include_dirs))
        object.__setattr__(self, "defines", _normalize_defines(self.defines))
        _check_arch(self.arch)

    # -- identity ------------------------------------------------------------
    @functools.cached_property
    def files(self) -> list[Path]:
        """Sources plus our own headers they include (what the key hashes)."""
        return source_closure(self.sources, [_package_csrc()])

    @functools.cached_property
    def key(self) -> str:
        """sha256 of sources (with own headers), flags, arch and nvcc version."""
        return _digest({
            "format": _FORMAT, "kind": "nvcc", "name": self.name,
            "files": _file_digests(self.files), "options": self.options, "arch": self.arch,
            "include_dirs": self.include_dirs, "defines": self.defines,
            "extra_key": self.extra_key, "toolchain": _nvcc_version(nvcc_path()),
            "platform": sys.platform,
        })

    @property
    def path(self) -> Path:
        """Where the library is (or will be) in the cache."""
        return _entry_dir("nvcc", self.name, self.key) / f"lib{self.name}.so"

    def cached(self) -> bool:
        """Whether the library is already built in the cache (builds nothing)."""
        return self.path.is_file()

    def command(self, output: str | Path) -> list[str]:
        """The ``nvcc`` command line that builds the library into ``output``."""
        nvcc = nvcc_path()
        if nvcc is None:
            raise JitError(
                f"scaledmm.jit: nvcc not found (looked at ${ENV_NVCC}, PATH, $CUDA_HOME/bin, "
                f"/usr/local/cuda/bin); needed to build '{self.name}'"
            )
        compute, sm = _check_arch(self.arch)
        cmd = [nvcc, f"-gencode=arch={compute},code={sm}", "-O3", "-std=c++17",
               "-shared", "-Xcompiler", "-fPIC", "-cudart", "static"]
        cmd += [f"-I{d}" for d in self.include_dirs]
        cmd += [f"-D{k}={v}" for k, v in self.defines]
        cmd += list(self.options)
        cmd += ["-o", str(output), *self.sources]
        return cmd

    # -- build / load ----------------------------------------------------------
    def build(self) -> Path:
        """Build (once, under a file lock) and return the library's path.

        Raises
        ------
        CompileError
            nvcc failed; the message holds the command and its output.
        BuildDisabledError
            Not cached and ``SCALEDMM_JIT_NO_BUILD=1``.
        """
        so = f"lib{self.name}.so"

        def build(tmp: Path) -> dict[str, Any]:
            cmd = self.command(tmp / so)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
            if proc.returncode != 0 or not (tmp / so).is_file():
                raise CompileError(
                    f"scaledmm.jit: nvcc failed building '{self.name}' (rc {proc.returncode})\n"
                    f"command: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
                )
            return {"command": cmd, "sources": list(self.sources), "toolchain": _nvcc_version(nvcc_path())}

        return _locked_build("nvcc", self.name, self.key, so, build, {"arch": self.arch})

    def load(self) -> ctypes.CDLL:
        """Build if needed and ``ctypes.CDLL`` the library (one handle per process)."""
        lib = _CDLLS.get(self.key)
        if lib is None:
            path = str(self.build())
            with _PROCESS_LOCK:
                lib = _CDLLS.get(self.key)
                if lib is None:
                    lib = _CDLLS[self.key] = ctypes.CDLL(path)
        return lib


# ----------------------------------------------------------------------------
# NVRTC -> cubin, loaded and launched through the CUDA driver
# ----------------------------------------------------------------------------


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 layout
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


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
        """Whether the cubin is already in the cache (builds nothing)."""
        return self.path.is_file()

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

    def build(self) -> Path:
        """Compile (once, under a file lock) and return the cubin's path."""
        cubin = f"{self.name}.cubin"

        def build(tmp: Path) -> dict[str, Any]:
            (tmp / cubin).write_bytes(self.compile())
            return {"source": self.source_file, "defines": dict(self.defines),
                    "options": dict(self.options), "toolchain": _nvrtc_version()}

        return _locked_build("nvrtc", self.name, self.key, cubin, build, {"arch": self.arch})

    def load(self) -> "CudaModule":
        """Build if needed; the module (loaded on a device at first launch)."""
        mod = _MODULES.get(self.key)
        if mod is None:
            path = self.build()
            with _PROCESS_LOCK:
                mod = _MODULES.get(self.key)
                if mod is None:
                    mod = _MODULES[self.key] = CudaModule(path.read_bytes(), str(path))
        return mod

    def kernel(self, fn: str | None = None) -> "CudaKernel":
        """The launchable kernel ``fn`` (default: ``name``) of this module."""
        fn = fn or self.name
        if fn != self.name and fn not in self.kernels:
            raise ValueError(f"fn: expected one of {[self.name, *self.kernels]}, got {fn!r}")
        return self.load().kernel(fn)


_MODULES: dict[str, "CudaModule"] = {}


def _ensure_context(device_index: int) -> None:
    """Make the primary context of ``device_index`` current on this thread
    (the one torch uses), without changing torch's current device."""
    drv = _driver()
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
                    mod = _check(_driver().cuModuleLoadData(self.cubin), f"cuModuleLoadData({self.origin})")
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

    def function(self, device_index: int):
        f = self._funcs.get(device_index)
        if f is None:
            mod = self.module.handle(device_index)
            f = _check(_driver().cuModuleGetFunction(mod, self.fn.encode()), f"cuModuleGetFunction({self.fn})")
            self._funcs[device_index] = f
        return f

    def launch(self, grid: Sequence[int] | int, block: Sequence[int] | int, args: Sequence[Any], *,
               device: Any = None, shared_mem: int = 0, stream: Any = None, pdl: bool = False) -> None:
        """Launch on ``stream`` (default: torch's current stream of ``device``).

        Parameters
        ----------
        grid, block : int or up to three ints
        args : sequence
            Kernel arguments in order: a ``torch.Tensor`` passes its data
            pointer, ``None`` a null pointer, ctypes scalars (``ctypes.c_int(3)``)
            pass by value.
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
            else:
                raise TypeError(f"args: expected tensors, None or ctypes scalars, got {type(a).__name__}")
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
        drv = _driver()
        func = self.function(idx)
        if shared_mem > 48 * 1024 and self._smem_set.get(idx, 0) < shared_mem:
            _check(drv.cuFuncSetAttribute(
                func, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem),
                "cuFuncSetAttribute(max dynamic shared memory)")
            self._smem_set[idx] = shared_mem
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


# ----------------------------------------------------------------------------
# Pre-building and inspecting the cache (command line)
# ----------------------------------------------------------------------------

_PREBUILD: dict[str, tuple[Callable[[str], list[Any]], str]] = {}


def register_prebuild(flag: str, specs_for: Callable[[str], list[Any]], help: str = "") -> None:
    """Add ``--<flag> VALUE`` to ``python -m scaledmm.jit build``.

    ``specs_for(VALUE)`` returns the specs (anything with ``build()``) to build.

    Examples
    --------
    >>> from scaledmm import jit
    >>> jit.register_prebuild("mine", lambda v: [], help="N:K list")
    >>> "mine" in jit._PREBUILD
    True
    >>> del jit._PREBUILD["mine"]
    """
    if not re.match(r"^[a-z][a-z0-9_\-]*$", flag):
        raise ValueError(f"flag: expected a lower-case option name, got {flag!r}")
    _PREBUILD[flag] = (specs_for, help)


def cached_entries() -> list[dict[str, Any]]:
    """Every complete entry of the cache: its ``meta.json`` plus path and size."""
    root = cache_dir()
    out = []
    for meta in sorted(root.glob("*/*/meta.json")):
        if meta.parent.name.startswith(".tmp-"):
            continue
        try:
            info = json.loads(meta.read_text())
        except Exception:
            info = {"kind": meta.parent.parent.name, "name": meta.parent.name, "key": "?", "artifact": "?"}
        art = meta.parent / str(info.get("artifact", ""))
        info["path"] = str(meta.parent)
        info["bytes"] = art.stat().st_size if art.is_file() else 0
        out.append(info)
    return out


def _cmd_status(args) -> int:
    entries = cached_entries()
    print(f"scaledmm jit cache: {cache_dir()}  ({len(entries)} entries, "
          f"{sum(e['bytes'] for e in entries) / 1e6:.2f} MB)")
    print(f"  nvcc: {nvcc_path() or 'not found'} ({_nvcc_version(nvcc_path())}); "
          f"NVRTC: {nvrtc_available()[1]}; {ENV_NO_BUILD}={os.environ.get(ENV_NO_BUILD, '')!r}")
    for e in entries:
        extra = e.get("defines") or ""
        print(f"  {e.get('kind', '?'):<6} {e.get('name', '?'):<28} {str(e.get('key', '?'))[:16]}  "
              f"{e['bytes'] / 1e3:9.1f} kB  {e.get('arch', '')}  {extra}")
    return 0


def _cmd_build(args) -> int:
    specs = []
    for flag in _PREBUILD:
        value = getattr(args, flag.replace("-", "_"), None)
        if value:
            specs += list(_PREBUILD[flag][0](value))
    if not specs:
        print("nothing to build: pass one of " + ", ".join(f"--{f}" for f in _PREBUILD), file=sys.stderr)
        return 2
    failed = 0
    for spec in specs:
        t0 = time.perf_counter()
        try:
            was = spec.cached()
            path = spec.build()
            state = "cached" if was else f"built in {time.perf_counter() - t0:.1f} s"
            print(f"  {spec.name:<28} {spec.key[:16]}  {state}  {path}")
        except JitError as e:
            failed += 1
            print(f"  {spec.name:<28} FAILED: {e}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m scaledmm.jit {status, build ...}``."""
    import scaledmm  # noqa: F401  (registers the kernel families' prebuild hooks)

    parser = argparse.ArgumentParser(prog="python -m scaledmm.jit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="list cache entries (kind, name, key, size)")
    b = sub.add_parser("build", help="pre-build kernels into the cache")
    for flag, (_, help_) in _PREBUILD.items():
        b.add_argument(f"--{flag}", metavar="SPEC", help=help_)
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    return _cmd_status(args) if args.cmd == "status" else _cmd_build(args)


if __name__ == "__main__":
    from scaledmm import jit as _jit  # the package's module object holds the registered hooks

    sys.exit(_jit.main())
