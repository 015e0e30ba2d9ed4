"""scaledmm.jit: keys, disk cache, file lock, SCALEDMM_JIT_NO_BUILD, nvcc
libraries, NVRTC cubins (no GPU needed), the command line (scaledmm.jit.cli)."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scaledmm import jit

needs_nvcc = pytest.mark.skipif(jit.nvcc_path() is None, reason="nvcc not found")
needs_nvrtc = pytest.mark.skipif(not jit.nvrtc_available()[0], reason=jit.nvrtc_available()[1])

C_SOURCE = textwrap.dedent("""
    #include <cuda_runtime.h>
    #include "answer.h"
    __global__ void fill_kernel(int* p, int v) { p[threadIdx.x] = v; }
    extern "C" int scaledmm_test_add(int a, int b) { return a + b + ANSWER_OFFSET; }
    extern "C" int scaledmm_test_fill(void* p, int v, cudaStream_t s) {
        fill_kernel<<<1, 32, 0, s>>>(static_cast<int*>(p), v);
        return static_cast<int>(cudaGetLastError());
    }
""")

KERNEL_SOURCE = textwrap.dedent("""
    #include "tiny.cuh"
    extern "C" __global__ void tiny_fill(float* out, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) out[i] = TINY_VALUE * SCALE;
    }
""")


@pytest.fixture
def kernel_src(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cuh").write_text("#pragma once\n#define TINY_VALUE 2.0f\n")
    (src / "tiny.cu").write_text(KERNEL_SOURCE)
    return src


def _spec(src: Path, **kw) -> jit.NvrtcKernelSpec:
    kw.setdefault("defines", {"SCALE": 3})
    return jit.NvrtcKernelSpec("tiny_fill", src / "tiny.cu", **kw)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(jit.ENV_CACHE_DIR, str(tmp_path / "c"))
    assert jit.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(jit.ENV_CACHE_DIR)
    assert jit.cache_dir() == Path.home() / ".cache" / "scaledmm"


def test_key_depends_on_everything_that_changes_the_binary(kernel_src):
    base = _spec(kernel_src)
    assert base.key == _spec(kernel_src).key  # deterministic
    assert len(base.key) == 64
    others = [
        _spec(kernel_src, defines={"SCALE": 4}),
        _spec(kernel_src, options={"lineinfo": True}),
        _spec(kernel_src, arch="sm_100a"),
        _spec(kernel_src, kernels=("other",)),
    ]
    assert len({base.key, *(o.key for o in others)}) == 1 + len(others)
    # own header (quoted include) is part of the key
    (kernel_src / "tiny.cuh").write_text("#pragma once\n#define TINY_VALUE 5.0f\n")
    assert _spec(kernel_src).key != base.key
    (kernel_src / "tiny.cuh").write_text("#pragma once\n#define TINY_VALUE 2.0f\n")
    assert _spec(kernel_src).key == base.key
    # the source text itself
    (kernel_src / "tiny.cu").write_text(KERNEL_SOURCE + "\n// changed\n")
    assert _spec(kernel_src).key != base.key


def test_spec_arguments_validated(kernel_src):
    with pytest.raises(ValueError, match="arch"):
        _spec(kernel_src, arch="hopper")
    with pytest.raises(ValueError, match="name"):
        jit.NvrtcKernelSpec("not a name", kernel_src / "tiny.cu")
    with pytest.raises(ValueError, match="sources"):
        jit.NvccLibrarySpec("x", [])
    with pytest.raises(FileNotFoundError, match="sources"):
        jit.NvrtcKernelSpec("k", kernel_src / "missing.cu").key


@needs_nvrtc
def test_nvrtc_build_cache_and_no_build(cache, kernel_src, monkeypatch, caplog):
    spec = _spec(kernel_src)
    monkeypatch.setenv(jit.ENV_NO_BUILD, "1")
    assert not spec.cached()
    with pytest.raises(jit.BuildDisabledError, match="SCALEDMM_JIT_NO_BUILD"):
        spec.build()
    assert not spec.cached()
    monkeypatch.delenv(jit.ENV_NO_BUILD)
    with caplog.at_level(logging.INFO, logger="scaledmm"):
        path = spec.build()
    assert [r for r in caplog.records if "building" in r.getMessage()], "first build logs a line"
    assert path.is_file() and path.read_bytes()[:4] == b"\x7fELF"  # a cubin is an ELF file
    assert spec.cached() and path.parent.parent.parent == cache
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="scaledmm"):
        monkeypatch.setenv(jit.ENV_NO_BUILD, "1")  # a hit needs no build
        assert spec.build() == path
    assert not [r for r in caplog.records if "building" in r.getMessage()]
    entries = jit.cached_entries()
    assert [e["key"] for e in entries] == [spec.key]
    assert entries[0]["bytes"] == path.stat().st_size


@needs_nvrtc
def test_nvrtc_compile_error_has_log(kernel_src, cache):
    (kernel_src / "bad.cu").write_text('extern "C" __global__ void bad(int* p) { p[0] = undefined_name; }\n')
    spec = jit.NvrtcKernelSpec("bad", kernel_src / "bad.cu")
    with pytest.raises(jit.CompileError, match="undefined_name"):
        spec.build()
    assert not spec.cached()
    assert not list(cache.glob("nvrtc/.tmp-*")), "a failed build leaves no temporary folder"


_BUILDER = textwrap.dedent("""
    import importlib.util, logging, os, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    # the scaledmm.jit package alone (no scaledmm, no torch): it needs only the
    # standard library until something is compiled
    init = Path(sys.argv[3])
    spec = importlib.util.spec_from_file_location("scaledmm_jit_alone", init,
                                                  submodule_search_locations=[str(init.parent)])
    jit = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jit)
    assert "torch" not in sys.modules and "scaledmm" not in sys.modules
    spec = jit.NvrtcKernelSpec("tiny_fill", sys.argv[1], defines={"SCALE": 7})
    spec.key
    print("READY", flush=True)  # past import and key: the parent releases both builders at once
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.01)
    print("PATH", spec.build())
""")


@needs_nvrtc
def test_two_processes_build_once(cache, kernel_src, tmp_path):
    go = tmp_path / "go"
    env = dict(os.environ, **{jit.ENV_CACHE_DIR: str(cache)})
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(kernel_src / "tiny.cu"), str(go), jit.__file__],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    heads = []
    for p in procs:  # wait for each builder's READY line (or its exit)
        head = ""
        for line in p.stdout:
            head += line
            if line.startswith("READY"):
                break
        heads.append(head)
    go.write_text("")
    outs = [(head + o, e) for head, (o, e) in zip(heads, (p.communicate(timeout=240) for p in procs))]
    assert all(p.returncode == 0 for p in procs), outs
    text = "".join(o for o, _ in outs)
    assert text.count("building") == 1, text
    paths = {line for line in text.splitlines() if line.startswith("PATH")}
    assert len(paths) == 1, text


@needs_nvcc
def test_nvcc_library_build_and_load(cache, tmp_path, monkeypatch):
    src = tmp_path / "lib"
    src.mkdir()
    (src / "answer.h").write_text("#define ANSWER_OFFSET 100\n")
    (src / "answer.cu").write_text(C_SOURCE)
    spec = jit.NvccLibrarySpec("scaledmm_test_answer", [src / "answer.cu"])
    assert not spec.cached()
    path = spec.build()
    assert spec.cached() and path == spec.path and path.name == "libscaledmm_test_answer.so"
    lib = spec.load()
    assert isinstance(lib, ctypes.CDLL)
    lib.scaledmm_test_add.restype = ctypes.c_int
    lib.scaledmm_test_add.argtypes = [ctypes.c_int, ctypes.c_int]
    assert lib.scaledmm_test_add(2, 3) == 105
    assert spec.load() is lib  # one handle per process
    # own header and options enter the key; defines too
    key = spec.key
    assert jit.NvccLibrarySpec("scaledmm_test_answer", [src / "answer.cu"], options=("-lineinfo",)).key != key
    assert jit.NvccLibrarySpec("scaledmm_test_answer", [src / "answer.cu"], defines={"X": 1}).key != key
    (src / "answer.h").write_text("#define ANSWER_OFFSET 200\n")
    spec2 = jit.NvccLibrarySpec("scaledmm_test_answer", [src / "answer.cu"])
    assert spec2.key != key and not spec2.cached()
    # deployment mode: a miss is an error, a hit loads
    monkeypatch.setenv(jit.ENV_NO_BUILD, "1")
    with pytest.raises(jit.BuildDisabledError):
        spec2.load()
    assert spec.build() == path


@needs_nvcc
def test_nvcc_compile_error(cache, tmp_path):
    (tmp_path / "bad.cu").write_text('extern "C" int f() { return not_declared; }\n')
    with pytest.raises(jit.CompileError, match="not_declared"):
        jit.NvccLibrarySpec("scaledmm_test_bad", [tmp_path / "bad.cu"]).build()


def test_nvcc_command_has_the_required_flags(tmp_path):
    if jit.nvcc_path() is None:
        pytest.skip("nvcc not found")
    (tmp_path / "a.cu").write_text("")
    cmd = jit.NvccLibrarySpec("x", [tmp_path / "a.cu"], include_dirs=["/inc"], options=("-lcuda",)).command("out.so")
    for flag in ("-gencode=arch=compute_90a,code=sm_90a", "-shared", "-fPIC", "-I/inc", "-lcuda"):
        assert flag in cmd
    assert cmd[cmd.index("-cudart") + 1] == "static"


def test_cli_status_and_prebuild_hook(cache, capsys):
    built = []

    class Fake:
        name, key = "fake", "0" * 64

        def cached(self):
            return False

        def build(self):
            built.append(1)
            return Path("/nowhere")

    jit.register_prebuild("fake-family", lambda value: [Fake() for _ in value.split(",")], help="a,b")
    try:
        assert jit.main(["build", "--fake-family", "a,b"]) == 0
        assert len(built) == 2
        assert jit.main(["build"]) == 2  # nothing requested
    finally:
        del jit.PREBUILD["fake-family"]
    assert jit.main(["status"]) == 0
    assert str(cache) in capsys.readouterr().out


def test_cli_build_jobs_run_at_once_and_report_failures(cache, capsys):
    """``--jobs 2`` runs two builds at the same time (each waits for the
    other at a barrier); a failed build is reported and the others finish."""
    import threading

    barrier = threading.Barrier(2, timeout=30)
    built = []

    class Fake:
        key = "0" * 64

        def __init__(self, name):
            self.name = name

        def cached(self):
            return False

        def build(self):
            if self.name == "bad":
                raise jit.JitError("planted failure")
            barrier.wait()  # BrokenBarrierError (a test failure) unless both run at once
            built.append(self.name)
            return Path("/nowhere")

    jit.register_prebuild("fake-family", lambda value: [Fake(v) for v in value.split(",")], help="a,b")
    try:
        assert jit.main(["build", "--fake-family", "a,b", "--jobs", "2"]) == 0
        assert sorted(built) == ["a", "b"]
        barrier.reset()
        assert jit.main(["build", "--fake-family", "a,bad,b", "--jobs", "2"]) == 1
        assert sorted(built) == ["a", "a", "b", "b"]
        assert jit.main(["build", "--fake-family", "a", "--jobs", "0"]) == 2
    finally:
        del jit.PREBUILD["fake-family"]
    err = capsys.readouterr().err
    assert "bad" in err and "FAILED: planted failure" in err and "--jobs: expected a positive integer, got 0" in err


def test_cli_module_runs_without_warnings(cache):
    """``python -m scaledmm.jit`` runs the package's ``__main__`` (no runpy
    RuntimeWarning about a module imported twice) and builds through the
    families' hooks."""
    env = dict(os.environ, **{jit.ENV_CACHE_DIR: str(cache)})
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "scaledmm.jit", "status"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr and str(cache) in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "scaledmm.jit", "build"], capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 2 and "--skinny" in proc.stderr


def test_tensor_map_2d_checks_its_arguments_before_the_driver():
    with pytest.raises(ValueError, match="kind, swizzle"):
        jit.tensor_map_2d(0, 1, 64, 1, 64, 64, 1, 16)
    with pytest.raises(ValueError, match="kind, swizzle"):
        jit.tensor_map_2d(0, 4, 64, 1, 64, 64, 1, 0)
    with pytest.raises(ValueError, match="16-byte aligned"):
        jit.tensor_map_2d(8, 1, 64, 1, 64, 64, 1, 0)
    with pytest.raises(ValueError, match="non-empty"):
        jit.tensor_map_2d(16, 1, 64, 0, 64, 64, 1, 0)
