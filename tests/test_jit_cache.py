"""scaledmm.jit's disk cache never serves a damaged entry: size and sha256 are
recorded at build time and checked on first use per process; a damaged entry
is rebuilt (refused under SCALEDMM_JIT_NO_BUILD=1); an unusable cache folder
gives CacheDirError naming it; killed builds' folders are cleaned up.  Real
NVRTC cubins and nvcc libraries, built on the CPU (no GPU needed)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from scaledmm import jit
from scaledmm.jit import core

needs_nvcc = pytest.mark.skipif(jit.nvcc_path() is None, reason="nvcc not found")
needs_nvrtc = pytest.mark.skipif(not jit.nvrtc_available()[0], reason=jit.nvrtc_available()[1])

KERNEL_SOURCE = textwrap.dedent("""
    extern "C" __global__ void tiny_fill(float* out, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) out[i] = 2.0f * SCALE;
    }
""")
LIB_SOURCE = 'extern "C" int scaledmm_test_add(int a, int b) { return a + b + OFFSET; }\n'

# Loads the scaledmm.jit package alone (no torch: fast), then runs one action.
_CHILD_PRELUDE = textwrap.dedent("""
    import ctypes, importlib.util, logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    init = Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("scaledmm_jit_alone", init,
                                                  submodule_search_locations=[str(init.parent)])
    jit = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jit)
""")

_LOAD_LIB = _CHILD_PRELUDE + textwrap.dedent("""
    lib_spec = jit.NvccLibrarySpec("scaledmm_test_cache", [sys.argv[2]], defines={"OFFSET": 100})
    try:
        lib = lib_spec.load()
    except jit.JitError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(3)
    lib.scaledmm_test_add.restype = ctypes.c_int
    print("SUM", lib.scaledmm_test_add(2, 3))
""")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _truncate_half(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _zero_length(p: Path) -> None:
    p.write_bytes(b"")


def _garbage_same_length(p: Path) -> None:
    n = p.stat().st_size
    p.write_bytes(bytes((i * 131 + 7) % 256 for i in range(n)))


def _no_meta(p: Path) -> None:
    (p.parent / "meta.json").unlink()


def _meta_without_record(p: Path) -> None:  # an entry built before sizes and hashes were recorded
    meta = p.parent / "meta.json"
    info = json.loads(meta.read_text())
    del info["artifact_sha256"], info["artifact_bytes"]
    meta.write_text(json.dumps(info))


def _meta_not_json(p: Path) -> None:
    (p.parent / "meta.json").write_text('{"artifact": ')


def _artifact_missing(p: Path) -> None:
    p.unlink()


DAMAGES = {f.__name__.lstrip("_"): f for f in (_truncate_half, _zero_length, _garbage_same_length, _no_meta,
                                               _meta_without_record, _meta_not_json, _artifact_missing)}


@pytest.fixture
def new_process(monkeypatch):
    """Forget what this process verified and loaded, as a fresh process would."""
    from scaledmm.jit import nvrtc

    def reset():
        monkeypatch.setattr(core, "VERIFIED", {})
        monkeypatch.setattr(nvrtc, "MODULES", {})

    reset()
    return reset


def _kernel_spec(folder: Path, scale: int = 3) -> jit.NvrtcKernelSpec:
    src = folder / "tiny.cu"
    if not src.exists():
        folder.mkdir(parents=True, exist_ok=True)
        src.write_text(KERNEL_SOURCE)
    return jit.NvrtcKernelSpec("tiny_fill", src, defines={"SCALE": scale})


def _no_tmp_left(kind_dir: Path) -> list[str]:
    return [p.name for p in kind_dir.iterdir() if p.name.startswith(".tmp-")]


# ----------------------------------------------------------------------------
# Damaged entries
# ----------------------------------------------------------------------------


@needs_nvrtc
def test_build_records_size_and_hash(cache, tmp_path):
    spec = _kernel_spec(tmp_path / "src")
    path = spec.build()
    meta = json.loads((path.parent / "meta.json").read_text())
    data = path.read_bytes()
    assert meta["artifact"] == path.name and meta["key"] == spec.key
    assert meta["artifact_bytes"] == len(data) > 0 and meta["artifact_sha256"] == _sha(data)
    assert not _no_tmp_left(path.parent.parent)


@needs_nvrtc
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_nvrtc_damaged_entry_is_refused_then_rebuilt(cache, tmp_path, monkeypatch, new_process, caplog, damage):
    spec = _kernel_spec(tmp_path / "src")
    path = spec.build()
    good = path.read_bytes()
    DAMAGES[damage](path)
    new_process()
    assert not spec.cached()

    monkeypatch.setenv(jit.ENV_NO_BUILD, "1")
    with pytest.raises(jit.BuildDisabledError, match="damaged") as err:
        spec.load()
    msg = str(err.value)
    assert str(path.parent) in msg and "python -m scaledmm.jit build" in msg and jit.ENV_NO_BUILD in msg

    monkeypatch.delenv(jit.ENV_NO_BUILD)
    with caplog.at_level(logging.INFO, logger="scaledmm"):
        mod = spec.load()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "damaged" in warnings[0] and str(path.parent) in warnings[0], warnings
    meta = json.loads((path.parent / "meta.json").read_text())
    assert mod.cubin == path.read_bytes() and mod.cubin[:4] == b"\x7fELF"
    assert meta["artifact_bytes"] == len(mod.cubin) and meta["artifact_sha256"] == _sha(mod.cubin)
    assert len(mod.cubin) == len(good)  # the same kernel again
    assert spec.cached() and not _no_tmp_left(path.parent.parent)
    # a verified entry loads without building, also where building is forbidden
    new_process()
    monkeypatch.setenv(jit.ENV_NO_BUILD, "1")
    assert spec.load().cubin == mod.cubin


@needs_nvrtc
def test_entry_is_hashed_once_per_process_until_it_changes(cache, tmp_path, monkeypatch, new_process):
    spec = _kernel_spec(tmp_path / "src")
    path = spec.build()
    new_process()
    calls = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, name: calls.append(name) or real(f, name))
    assert spec.cached() and spec.cached() and spec.build() == path
    assert len(calls) == 1
    _truncate_half(path)  # a new size: checked again
    assert not spec.cached()


@needs_nvcc
def test_nvcc_damaged_library_is_rebuilt_without_crashing(cache, tmp_path):
    """A truncated library mapped by dlopen faults (SIGBUS) when touched, so
    every load runs in a child process: a crash shows as a negative exit
    status instead of killing the test run."""
    src = tmp_path / "lib.cu"
    src.write_text(LIB_SOURCE)
    env = dict(os.environ, **{jit.ENV_CACHE_DIR: str(cache)})
    env.pop(jit.ENV_NO_BUILD, None)

    def load(no_build: bool = False) -> subprocess.CompletedProcess:
        e = dict(env, **{jit.ENV_NO_BUILD: "1"}) if no_build else env
        return subprocess.run([sys.executable, "-c", _LOAD_LIB, jit.__file__, str(src)],
                              capture_output=True, text=True, env=e, timeout=300)

    first = load()
    assert first.returncode == 0 and "SUM 105" in first.stdout, first
    (path,) = cache.glob("nvcc/scaledmm_test_cache-*/libscaledmm_test_cache.so")
    for damage in ("truncate_half", "zero_length", "garbage_same_length", "no_meta"):
        DAMAGES[damage](path)
        refused = load(no_build=True)
        assert refused.returncode == 3, (damage, refused)
        assert "BuildDisabledError" in refused.stderr and "damaged" in refused.stderr, (damage, refused.stderr)
        assert str(path.parent) in refused.stderr
        again = load()
        assert again.returncode == 0 and "SUM 105" in again.stdout, (damage, again)
        assert "damaged" in again.stdout and "rebuilding" in again.stdout, (damage, again.stdout)
        meta = json.loads((path.parent / "meta.json").read_text())
        assert meta["artifact_sha256"] == _sha(path.read_bytes()), damage
    assert not _no_tmp_left(path.parent.parent)


@needs_nvrtc
def test_status_reports_damaged_entries(cache, tmp_path, new_process, capsys):
    ok = _kernel_spec(tmp_path / "src", scale=3)
    bad = _kernel_spec(tmp_path / "src", scale=4)
    ok.build()
    _garbage_same_length(bad.build())
    new_process()
    states = {e["key"]: (e["state"], e["problem"]) for e in jit.cached_entries()}
    assert states[ok.key] == ("ok", "")
    assert states[bad.key][0] == "damaged" and "sha256" in states[bad.key][1]
    assert jit.main(["status"]) == 1
    out = capsys.readouterr()
    assert out.out.count("DAMAGED") == 1 and "1 damaged" in out.err
    # `build` reports the damaged entry as built, not as cached
    jit.register_prebuild("test-family", lambda value: [ok, bad])
    try:
        assert jit.main(["build", "--test-family", "x"]) == 0
    finally:
        del jit.PREBUILD["test-family"]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines if "tiny_fill" in line] == ["cached", "built"], lines
    assert jit.main(["status"]) == 0


# ----------------------------------------------------------------------------
# Unusable cache folders
# ----------------------------------------------------------------------------


def _blocked_paths(tmp_path: Path) -> dict[str, Path]:
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    return {"is_a_file": f, "under_a_file": f / "cache"}


@needs_nvrtc
@pytest.mark.parametrize("where", ["is_a_file", "under_a_file"])
@pytest.mark.parametrize("no_build", [False, True])
def test_not_a_folder_cache_gives_cache_dir_error(tmp_path, monkeypatch, where, no_build):
    root = _blocked_paths(tmp_path)[where]
    monkeypatch.setenv(jit.ENV_CACHE_DIR, str(root))
    if no_build:
        monkeypatch.setenv(jit.ENV_NO_BUILD, "1")
    else:
        monkeypatch.delenv(jit.ENV_NO_BUILD, raising=False)
    spec = _kernel_spec(tmp_path / "src")
    assert not spec.cached()
    for call in (spec.build, spec.load, jit.cached_entries):
        with pytest.raises(jit.CacheDirError, match="is not a folder") as err:
            call()
        assert str(root) in str(err.value) and jit.ENV_CACHE_DIR in str(err.value)


@needs_nvrtc
def test_cache_that_cannot_be_created_gives_cache_dir_error(tmp_path, monkeypatch):
    root = Path("/proc/scaledmm-test-cache")
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux /proc (a folder in which nothing can be created)")
    monkeypatch.setenv(jit.ENV_CACHE_DIR, str(root))
    monkeypatch.delenv(jit.ENV_NO_BUILD, raising=False)
    spec = _kernel_spec(tmp_path / "src")
    with pytest.raises(jit.CacheDirError, match="cannot be created|not writable") as err:
        spec.build()
    assert str(root) in str(err.value) and jit.ENV_CACHE_DIR in str(err.value)


_READ_ONLY_CHILD = _CHILD_PRELUDE + textwrap.dedent("""
    src = sys.argv[2]
    hit = jit.NvrtcKernelSpec("tiny_fill", src, defines={"SCALE": 3})
    assert hit.load().cubin[:4] == b"\\x7fELF"  # a read-only cache serves what it holds
    print("HIT OK")
    for scale in (5, 4):  # a miss; a damaged entry
        try:
            jit.NvrtcKernelSpec("tiny_fill", src, defines={"SCALE": scale}).build()
        except jit.CacheDirError as e:
            print("CacheDirError:", e)
""")


@pytest.fixture
def shared_tmp():
    """A folder that another user can enter (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="scaledmm-ro-"))
    d.chmod(0o755)
    yield d
    for p in (d, *d.rglob("*")):
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    shutil.rmtree(d, ignore_errors=True)


@needs_nvrtc
def test_read_only_cache_serves_hits_and_names_the_folder_otherwise(shared_tmp, monkeypatch):
    """Root writes through permission bits, so as root the check runs in a
    child process with the uid of ``nobody`` (setpriv); skipped if neither."""
    if os.geteuid() != 0:
        prefix = []
    elif shutil.which("setpriv"):
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        pytest.skip("running as root, where permission bits do not stop writes, and setpriv is not there")
    probe = subprocess.run([*prefix, sys.executable, "-c", "import sys, cuda.core; open(sys.argv[1]).read()",
                            jit.__file__], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot run this Python with scaledmm.jit and cuda.core: {probe.stderr[-300:]}")
    cache = shared_tmp / "cache"
    monkeypatch.setenv(jit.ENV_CACHE_DIR, str(cache))
    monkeypatch.delenv(jit.ENV_NO_BUILD, raising=False)
    src = shared_tmp / "src"
    _kernel_spec(src, scale=3).build()
    _garbage_same_length(_kernel_spec(src, scale=4).build())
    for p in (cache, *cache.rglob("*")):
        p.chmod(0o555 if p.is_dir() else 0o444)
    env = dict(os.environ, **{jit.ENV_CACHE_DIR: str(cache)})
    proc = subprocess.run([*prefix, sys.executable, "-c", _READ_ONLY_CHILD, jit.__file__, str(src / "tiny.cu")],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc
    errors = [line for line in proc.stdout.splitlines() if line.startswith("CacheDirError")]
    assert "HIT OK" in proc.stdout and len(errors) == 2, proc.stdout
    for line in errors:
        assert "is not writable" in line and str(cache) in line and jit.ENV_CACHE_DIR in line


def test_cli_with_unusable_cache_exits_nonzero_without_traceback(tmp_path):
    root = _blocked_paths(tmp_path)["under_a_file"]
    env = dict(os.environ, **{jit.ENV_CACHE_DIR: str(root)})
    env.pop(jit.ENV_NO_BUILD, None)
    for args in (["build", "--skinny", "2112:7168"], ["status"]):
        proc = subprocess.run([sys.executable, "-m", "scaledmm.jit", *args], capture_output=True, text=True,
                              env=env, timeout=240)
        assert proc.returncode == 1, (args, proc)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert str(root) in proc.stderr and "is not a folder" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "scaledmm.jit", "build", "--skinny", "2112"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 2 and "--skinny" in proc.stderr and "Traceback" not in proc.stderr, proc


# ----------------------------------------------------------------------------
# Folders of killed builds
# ----------------------------------------------------------------------------

_SLOW_BUILD = _CHILD_PRELUDE + textwrap.dedent("""
    import time
    ready = Path(sys.argv[2])
    def build(tmp):
        (tmp / "a.bin").write_bytes(b"partial")
        ready.write_text(str(tmp))
        time.sleep(600)
    jit.core.locked_build("test", "slow", "1" * 64, "a.bin", build, {})
""")


def _quick(tmp: Path) -> dict:
    (tmp / "a.bin").write_bytes(b"built")
    return {}


def test_killed_builds_folders_are_removed_by_the_next_build(cache, tmp_path):
    ready = tmp_path / "ready"
    env = dict(os.environ, **{jit.ENV_CACHE_DIR: str(cache)})
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, jit.__file__, str(ready)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "child never started building"
        live = Path(ready.read_text())
        kind = live.parent
        unnamed_old, unnamed_new = kind / ".tmp-abcd1234", kind / ".tmp-efgh5678"
        for d in (unnamed_old, unnamed_new):
            d.mkdir()
            (d / "a.bin").write_bytes(b"x")
        day_ago = time.time() - 2 * core.UNNAMED_TMP_AGE_S
        os.utime(unnamed_old, (day_ago, day_ago))

        assert core.locked_build("test", "quick", "2" * 64, "a.bin", _quick, {}).read_bytes() == b"built"
        assert live.is_dir(), "the folder of a build in progress is kept"
        assert unnamed_new.is_dir() and not unnamed_old.exists()
    finally:
        proc.kill()
        proc.wait(timeout=60)
    core.locked_build("test", "other", "3" * 64, "a.bin", _quick, {})
    assert not live.exists(), "the killed build's folder is removed by the next build"
    assert _no_tmp_left(kind) == [unnamed_new.name]
    # the killed build's entry was never published; a later build makes it whole
    path = core.locked_build("test", "slow", "1" * 64, "a.bin", _quick, {})
    assert path.read_bytes() == b"built"
