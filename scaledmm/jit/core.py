"""The machinery shared by both kinds of run-time compiled code: errors,
environment, cache folder, keys (hashes of sources and our own headers),
toolchain discovery, the locked build into the cache, pre-build hooks.

Standard library only (no torch, no CUDA import at module level)."""

from __future__ import annotations

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
    pkg = Path(__file__).resolve().parent.parent  # scaledmm/
    for cand in (pkg / "csrc", pkg.parent / "csrc"):
        if cand.is_dir():
            return cand
    return pkg.parent / "csrc"


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
# Pre-build hooks and cache entries (used by the command line, scaledmm.jit.cli)
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


def parse_shapes(value: str, flag: str) -> list[tuple[int, int]]:
    """The ``N:K`` pairs of a pre-build flag's value (``"2112:7168, 576:7168"``).

    Examples
    --------
    >>> from scaledmm import jit
    >>> jit.parse_shapes("2112:7168, 576:7168,", "skinny")
    [(2112, 7168), (576, 7168)]
    """
    out = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            n, k = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"--{flag}: expected N:K pairs such as 4096:4096, got {item!r}") from None
        out.append((n, k))
    return out


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
