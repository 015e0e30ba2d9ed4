"""The machinery shared by both kinds of run-time compiled code: errors,
environment, cache folder, keys (hashes of sources and our own headers),
toolchain discovery, the locked build into the cache, pre-build hooks.

Standard library only (no torch, no CUDA import at module level)."""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence


def _load_env():
    """``scaledmm/env.py``; by file path when this package was loaded on its
    own (a builder process without ``scaledmm``: it must stay importable with
    the standard library only)."""
    if (__package__ or "").startswith("scaledmm."):
        from .. import env

        return env
    import importlib.util

    name = f"{__package__}._env"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "env.py")
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_env = _load_env()

log = logging.getLogger("scaledmm")

ENV_CACHE_DIR = _env.CACHE_DIR
ENV_NO_BUILD = _env.JIT_NO_BUILD
ENV_NVCC = _env.NVCC
_FORMAT = 1  # bump to invalidate every cache entry
_LOCK_TIMEOUT_S = 1800.0
_META = "meta.json"
_TMP = ".tmp-"  # build folders: .tmp-<entry folder name>-<random, no '-'>
UNNAMED_TMP_AGE_S = 86400.0  # .tmp-<random> folders (no entry name, so no lock to probe) older than this are stale
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_ARCH_RE = re.compile(r"^sm_(\d+)([af]?)$")


class JitError(RuntimeError):
    """Base class of run-time compilation errors."""


class CompileError(JitError):
    """The compiler rejected the code; the message holds its log."""


class BuildDisabledError(JitError):
    """A cache miss, or a damaged entry, while ``SCALEDMM_JIT_NO_BUILD=1``."""


class CacheDirError(JitError):
    """The cache folder cannot be used: not a folder, not writable, cannot be created."""


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
    env = _env.cache_dir()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "scaledmm"


def no_build() -> bool:
    """Whether ``SCALEDMM_JIT_NO_BUILD`` forbids building (read through ``scaledmm.env``).

    Examples
    --------
    >>> isinstance(no_build(), bool)
    True
    """
    return _env.jit_no_build()


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
    return _find_nvcc(_env.nvcc())


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


def _cache_dir_error(e: OSError, doing: str) -> CacheDirError:
    """``e`` (raised on a cache path) as an error naming the cache folder, what
    is wrong with it and the variable that points elsewhere."""
    root = cache_dir()
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        what = "is not a folder (a file is in the way)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = "is not writable"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "has no space left"
    elif e.errno == errno.ENOENT:
        what = "cannot be created"
    else:
        what = f"cannot be used ({e.strerror or e})"
    at = f" [{e.filename}]" if e.filename and str(e.filename) != str(root) else ""
    return CacheDirError(f"scaledmm.jit: the compile cache folder {root} {what}{at} while {doing}; "
                         f"fix it or set {ENV_CACHE_DIR} to a writable folder")


def _check_cache_root(doing: str = "looking for an entry") -> None:
    """Raise :class:`CacheDirError` when the cache folder or its nearest
    existing parent is not a folder (a miss could never be built there)."""
    root = cache_dir()
    for p in (root, *root.parents):
        if os.path.lexists(p):
            if not p.is_dir():
                raise _cache_dir_error(OSError(errno.ENOTDIR, "Not a directory", str(p)), doing)
            return


def _on_cache_path(filename: Any) -> bool:
    """Whether an OSError's file is the cache folder, inside it or one of its
    parents (so the error is about the cache, not, say, the compiler)."""
    if not filename:
        return False
    try:
        path, root = Path(os.fsdecode(filename)).resolve(), cache_dir().resolve()
    except (OSError, TypeError, ValueError):
        return False
    return path.is_relative_to(root) or root.is_relative_to(path)


# Entries verified in this process, by path: (dev, inode, size, mtime, ctime)
# when verified; a file changed since then has another signature and is hashed again.
VERIFIED: dict[str, tuple[int, ...]] = {}


def _inspect(entry: Path, artifact: str, key: str | None = None,
             read: bool = False) -> tuple[str, str, bytes | None]:
    """``(state, why, data)`` of an entry: ``state`` is ``"ok"``, ``"missing"``
    (no entry folder) or ``"damaged"`` (``why`` says how).  ``ok`` means the
    artifact has the size and sha256 that ``meta.json`` recorded when it was
    built.  With ``read``, ``data`` holds the artifact's bytes (those hashed),
    so nothing can change them between the check and their use."""
    target = entry / artifact
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        if os.path.lexists(entry):
            return "damaged", f"{artifact} is missing", None
        return "missing", "not built", None
    except OSError as e:
        raise _cache_dir_error(e, f"reading {target}") from e
    sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if not read and VERIFIED.get(str(target)) == sig:
        return "ok", "", None
    try:
        meta = json.loads((entry / _META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "damaged", f"{_META} (its size and hash record) is missing", None
    except (ValueError, UnicodeDecodeError):
        return "damaged", f"{_META} is not valid JSON", None
    except OSError as e:
        raise _cache_dir_error(e, f"reading {entry / _META}") from e
    size = meta.get("artifact_bytes") if isinstance(meta, dict) else None
    digest = meta.get("artifact_sha256") if isinstance(meta, dict) else None
    if not isinstance(size, int) or not isinstance(digest, str):
        return "damaged", f"{_META} records no size and sha256 (built by an older scaledmm)", None
    if key is not None and meta.get("key") != key:
        return "damaged", f"{_META} records another key", None
    if st.st_size != size:
        return "damaged", f"{artifact} has {st.st_size} bytes, {size} were recorded when it was built", None
    data = None
    try:
        if read:
            data = target.read_bytes()
            got, got_size = hashlib.sha256(data).hexdigest(), len(data)
        else:
            with open(target, "rb") as f:
                got, got_size = hashlib.file_digest(f, "sha256").hexdigest(), os.fstat(f.fileno()).st_size
    except FileNotFoundError:  # replaced under us by a concurrent rebuild
        return "damaged", f"{artifact} vanished while being read", None
    except OSError as e:
        raise _cache_dir_error(e, f"reading {target}") from e
    if got_size != size or got != digest:
        return "damaged", f"sha256 of {artifact} differs from the one recorded when it was built", None
    VERIFIED[str(target)] = sig
    return "ok", "", data


def _entry_ok(kind: str, name: str, key: str, artifact: str) -> bool:
    """Whether the entry is built and matches its record (builds nothing)."""
    try:
        return _inspect(_entry_dir(kind, name, key), artifact, key)[0] == "ok"
    except CacheDirError:
        return False


def _fsync_path(path: Path) -> None:
    """fsync a file or folder; folders on file systems that refuse it are skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def _remove_stale_tmp(entry: Path) -> None:
    """Remove the build folders of killed builds next to ``entry``.

    A build holds its entry's file lock for as long as its ``.tmp-<entry>-*``
    folder exists, so a folder whose entry lock can be taken now is stale
    (the caller holds ``entry``'s own lock).  A folder without an entry name
    has no lock to probe and is removed once it is a day old.
    """
    from filelock import FileLock, Timeout

    try:
        names = os.listdir(entry.parent)
    except OSError:
        return
    for n in names:
        if not n.startswith(_TMP):
            continue
        path = entry.parent / n
        owner = n[len(_TMP):].rpartition("-")[0]
        try:
            if owner == entry.name:
                _remove(path)
            elif owner:
                with FileLock(str(entry.parent / owner) + ".lock", timeout=0):
                    _remove(path)
            elif time.time() - path.lstat().st_mtime > UNNAMED_TMP_AGE_S:
                _remove(path)
        except (Timeout, OSError):  # a live build (or a folder we cannot lock): leave it
            continue


def _build_into(entry: Path, kind: str, name: str, key: str, artifact: str,
                build: Callable[[Path], dict[str, Any]], meta: dict[str, Any]) -> None:
    """Build in a temporary folder next to ``entry``, record the artifact's
    size and sha256 in ``meta.json``, fsync, and rename the folder into place
    (a damaged entry is first renamed aside).  The caller holds the locks."""
    doing = f"building {kind} '{name}'"
    t0 = time.perf_counter()
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP}{entry.name}-", dir=entry.parent))
    except OSError as e:
        raise _cache_dir_error(e, doing) from e
    old = entry.parent / f"{_TMP}{entry.name}-{secrets.token_hex(4)}"
    try:
        try:
            extra = build(tmp)
        except OSError as e:
            if _on_cache_path(e.filename):
                raise _cache_dir_error(e, doing) from e
            raise
        art = tmp / artifact
        if not art.is_file():
            raise JitError(f"scaledmm.jit: {doing} wrote no {artifact}")
        try:
            with open(art, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
                size = os.fstat(f.fileno()).st_size
                os.fsync(f.fileno())
            info = dict(meta, kind=kind, name=name, key=key, artifact=artifact,
                        artifact_bytes=size, artifact_sha256=digest,
                        built_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                        build_seconds=round(time.perf_counter() - t0, 3), **(extra or {}))
            with open(tmp / _META, "w", encoding="utf-8") as f:
                f.write(json.dumps(info, indent=1, sort_keys=True, default=str))
                f.flush()
                os.fsync(f.fileno())
            _fsync_path(tmp)
            if os.path.lexists(entry):  # damaged or incomplete: out of the way in one rename
                os.replace(entry, old)
            os.replace(tmp, entry)
            _fsync_path(entry.parent)
        except OSError as e:
            raise _cache_dir_error(e, doing) from e
    finally:
        for path in (tmp, old):
            if os.path.lexists(path):
                _remove(path)


def _ensure_entry(kind: str, name: str, key: str, artifact: str, build: Callable[[Path], dict[str, Any]],
                  meta: dict[str, Any], read: bool = False) -> tuple[Path, bytes | None]:
    """``(<entry>/<artifact>, its bytes if read)``: verified against the size
    and sha256 recorded when it was built, (re)built under a file lock when
    missing or damaged.

    ``build(tmpdir)`` writes ``tmpdir/artifact`` and returns extra metadata.
    Verification is once per process per file unless the file changes.
    """
    entry = _entry_dir(kind, name, key)
    target = entry / artifact
    state, why, data = _inspect(entry, artifact, key, read)
    if state == "ok":
        return target, data
    _check_cache_root()
    if no_build():
        if state == "missing":
            raise BuildDisabledError(
                f"scaledmm.jit: {kind} '{name}' (key {key[:16]}) is not in the cache {cache_dir()} and "
                f"{ENV_NO_BUILD}=1 forbids building; pre-build it with `python -m scaledmm.jit build ...`")
        raise BuildDisabledError(
            f"scaledmm.jit: {kind} '{name}' (key {key[:16]}) in the cache is damaged: {why} ({entry}); "
            f"{ENV_NO_BUILD}=1 forbids rebuilding it; rebuild it with `python -m scaledmm.jit build ...` "
            f"({ENV_NO_BUILD} unset), or delete {entry} and pre-build again")
    from filelock import FileLock, Timeout

    lock_path = str(entry) + ".lock"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with _entry_lock(entry), FileLock(lock_path, timeout=_LOCK_TIMEOUT_S):
            state, why, data = _inspect(entry, artifact, key, read)
            if state == "ok":  # another process built it while we waited
                return target, data
            if state == "damaged":
                log.warning("scaledmm.jit: cache entry %s is damaged (%s); rebuilding", entry, why)
            log.info("scaledmm.jit: building %s '%s' (key %s) into %s", kind, name, key[:16], entry)
            t0 = time.perf_counter()
            _remove_stale_tmp(entry)
            _build_into(entry, kind, name, key, artifact, build, meta)
            log.info("scaledmm.jit: built %s '%s' in %.1f s", kind, name, time.perf_counter() - t0)
            state, why, data = _inspect(entry, artifact, key, read)
    except Timeout as e:
        raise JitError(f"scaledmm.jit: waited {_LOCK_TIMEOUT_S:.0f} s for {lock_path} "
                       f"(another process building {kind} '{name}'?)") from e
    except OSError as e:
        if _on_cache_path(e.filename):  # creating the folders or the lock file
            raise _cache_dir_error(e, f"building {kind} '{name}'") from e
        raise
    if state != "ok":
        raise JitError(f"scaledmm.jit: {kind} '{name}' does not match its record right after building ({why}); "
                       f"is something else writing to {entry}?")
    return target, data


def locked_build(kind: str, name: str, key: str, artifact: str,
                  build: Callable[[Path], dict[str, Any]], meta: dict[str, Any]) -> Path:
    """``<entry>/<artifact>``, verified or (re)built (see :func:`_ensure_entry`):
    one builder per entry across processes (a file lock), ``build(folder)``
    writes the artifact into a fresh folder and returns extra meta fields.

    Examples
    --------
    >>> def build(folder):
    ...     (folder / "a.bin").write_bytes(b"built")
    ...     return {}
    >>> locked_build("demo", "one", "0" * 64, "a.bin", build, {}).read_bytes()  # doctest: +SKIP
    b'built'
    """
    return _ensure_entry(kind, name, key, artifact, build, meta)[0]


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

def build_specs(specs: Iterable[Any], jobs: int = 1,
                on_done: Callable[[Any, Any, float, bool], None] | None = None) -> int:
    """Build ``specs`` (NVRTC or nvcc) into the cache, ``jobs`` at a time
    (threads: each build is a locked cache entry, so a repeated spec waits
    and finds it built, and the compilers run without the GIL); returns how
    many failed.
    ``on_done(spec, result, seconds, was_cached)`` follows each build:
    ``result`` is what ``spec.build()`` returned (the artifact's path) or
    the :class:`JitError` it raised; an unusable cache folder
    (:class:`CacheDirError`) is raised, not counted.

    Examples
    --------
    >>> from scaledmm import jit
    >>> jit.build_specs([], jobs=4)
    0
    """
    if jobs < 1:
        raise ValueError(f"jobs: expected a positive integer, got {jobs}")

    def one(spec) -> bool:
        t0 = time.perf_counter()
        try:
            was = spec.cached()
            result = spec.build()
        except CacheDirError:
            raise
        except JitError as e:
            was, result = False, e
        if on_done:
            on_done(spec, result, time.perf_counter() - t0, was)
        return not isinstance(result, JitError)

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return sum(not ok for ok in pool.map(one, list(specs)))


PREBUILD: dict[str, tuple[Callable[[str], list[Any]], str]] = {}


def register_prebuild(flag: str, specs_for: Callable[[str], list[Any]], help: str = "") -> None:
    """Add ``--<flag> VALUE`` to ``python -m scaledmm.jit build``.

    ``specs_for(VALUE)`` returns the specs (anything with ``build()``) to build.

    Examples
    --------
    >>> from scaledmm import jit
    >>> jit.register_prebuild("mine", lambda v: [], help="N:K list")
    >>> "mine" in jit.PREBUILD
    True
    >>> del jit.PREBUILD["mine"]
    """
    if not re.match(r"^[a-z][a-z0-9_\-]*$", flag):
        raise ValueError(f"flag: expected a lower-case option name, got {flag!r}")
    PREBUILD[flag] = (specs_for, help)


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
    """Every entry of the cache: its ``meta.json`` plus ``path``, ``bytes``
    (the artifact's size), ``state`` (``"ok"`` or ``"damaged"``) and
    ``problem`` (why it is damaged, else ``""``).  Hashes every artifact.

    Raises
    ------
    CacheDirError
        The cache folder exists but cannot be listed or is not a folder.

    Examples
    --------
    >>> from scaledmm import jit
    >>> [e["name"] for e in jit.cached_entries() if e["state"] == "damaged"]  # doctest: +SKIP
    []
    """
    root = cache_dir()
    _check_cache_root("listing entries")
    out: list[dict[str, Any]] = []
    try:
        kinds = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")) if root.is_dir() else []
        folders = [e for d in kinds for e in sorted(d.iterdir()) if e.is_dir() and not e.name.startswith(".")]
    except OSError as e:
        raise _cache_dir_error(e, "listing entries") from e
    for entry in folders:
        try:
            info = json.loads((entry / _META).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            info = None
        if not isinstance(info, dict):
            info = {}
        name, _, key = entry.name.rpartition("-")
        info.setdefault("kind", entry.parent.name)
        info.setdefault("name", name)
        info.setdefault("key", key)
        artifact = info.get("artifact")
        if not isinstance(artifact, str):
            files = [f.name for f in entry.iterdir() if f.name != _META]
            artifact = files[0] if len(files) == 1 else ""
        art = entry / artifact
        info["path"] = str(entry)
        info["bytes"] = art.stat().st_size if artifact and art.is_file() else 0
        if artifact:
            state, why, _ = _inspect(entry, artifact)
        else:
            state, why = "damaged", f"no {_META} and no single artifact"
        info["state"], info["problem"] = ("ok", "") if state == "ok" else ("damaged", why)
        out.append(info)
    return out
