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
  artifact and a ``meta.json`` that records its size and sha256; the first
  use in a process checks both (before the driver or ``dlopen`` sees the
  file) and rebuilds an entry that does not match;
* a file lock (:mod:`filelock`) per entry, so concurrent processes build once;
  a build works in a ``.tmp-<entry>-*`` folder renamed into place when
  complete, and the next build in that folder removes those of killed builds;
* an INFO line on the ``"scaledmm"`` logger when a build starts and ends, a
  WARNING when a damaged entry is rebuilt;
* ``SCALEDMM_JIT_NO_BUILD=1`` turns a cache miss or a damaged entry into
  :class:`BuildDisabledError` (deployments ship a pre-built cache, see
  ``python -m scaledmm.jit build``); a cache folder that is not a folder or
  not writable (when something must be built) raises :class:`CacheDirError`.

Command line::

    python -m scaledmm.jit status                  # what is cached
    python -m scaledmm.jit build --skinny 2112:7168,1536:7168

Kernel families add flags to ``build`` with :func:`register_prebuild`.  This
package is part of the core: it imports no op module (the command line,
:mod:`scaledmm.jit.cli`, imports ``scaledmm`` when it runs, which is what
registers the families' hooks).  Layout: :mod:`.core` (cache, keys,
toolchains, locked build, hooks; standard library only), :mod:`.nvcc`,
:mod:`.nvrtc`, :mod:`.cli`; everything public is re-exported here.
"""

from __future__ import annotations

from .core import (  # noqa: F401  (re-exports; the private names are used by op modules and tests)
    ENV_CACHE_DIR,
    ENV_NO_BUILD,
    ENV_NVCC,
    PREBUILD,
    BuildDisabledError,
    CacheDirError,
    CompileError,
    JitError,
    _nvcc_version,
    _nvrtc_version,
    _package_csrc,
    build_specs,
    cache_dir,
    cached_entries,
    cuda_include_dirs,
    nvcc_path,
    nvrtc_available,
    parse_shapes,
    register_prebuild,
    source_closure,
)
from .nvcc import NvccLibrarySpec  # noqa: F401
from .nvrtc import (  # noqa: F401
    CudaKernel,
    CudaModule,
    NvrtcKernelSpec,
    SpecRecorded,
    cuda_driver,
    recording,
    sm90a_gate,
    tensor_map_2d,
)

__all__ = [
    "JitError",
    "CompileError",
    "BuildDisabledError",
    "CacheDirError",
    "cache_dir",
    "NvccLibrarySpec",
    "NvrtcKernelSpec",
    "CudaKernel",
    "SpecRecorded",
    "recording",
    "build_specs",
    "nvcc_path",
    "nvrtc_available",
    "sm90a_gate",
    "tensor_map_2d",
    "cuda_include_dirs",
    "parse_shapes",
    "register_prebuild",
    "cached_entries",
    "main",
]


def main(argv=None) -> int:
    """``python -m scaledmm.jit {status, build ...}`` (see :mod:`scaledmm.jit.cli`)."""
    from .cli import main as _main

    return _main(argv)
