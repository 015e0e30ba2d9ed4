"""``nvcc`` -> a shared library in the cache, loaded with :mod:`ctypes`."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from .core import (ENV_NVCC, CompileError, JitError, _check_arch, _digest, _entry_dir, _entry_ok, _file_digests,
                   _FORMAT, locked_build, _normalize_defines, _nvcc_version, _package_csrc, _PROCESS_LOCK,
                   nvcc_path, source_closure)

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
        """Whether the library is in the cache and matches the size and sha256
        recorded when it was built (builds nothing)."""
        return _entry_ok("nvcc", self.name, self.key, f"lib{self.name}.so")

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
            Not cached, or cached but its size or sha256 differs from the
            record made when it was built, and ``SCALEDMM_JIT_NO_BUILD=1``
            (without it, such an entry is rebuilt).
        CacheDirError
            The cache folder is not a folder, not writable or cannot be created.
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

        return locked_build("nvcc", self.name, self.key, so, build, {"arch": self.arch})

    def load(self) -> ctypes.CDLL:
        """Build if needed and ``ctypes.CDLL`` the library (one handle per process).

        The file is checked against its recorded size and sha256 before
        ``dlopen``: a truncated library would be mapped and fault (SIGBUS)."""
        lib = _CDLLS.get(self.key)
        if lib is None:
            path = str(self.build())
            with _PROCESS_LOCK:
                lib = _CDLLS.get(self.key)
                if lib is None:
                    lib = _CDLLS[self.key] = ctypes.CDLL(path)
        return lib
