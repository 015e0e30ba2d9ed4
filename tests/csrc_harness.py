"""Build and run the host harnesses of ``tests/csrc_host/``: the plain-C++
helpers of ``csrc/`` (``__host__ __device__``), compiled for the CPU by nvcc
from the package's own sources, so tests check the code the kernels run rather
than Python copies of it.

A harness is run as ``harness <op> <in> <out>``: it maps the uint32 records of
file ``<in>`` through one helper and writes uint32 words (see
``csrc_host/harness.h``); op ``consts`` prints ``NAME=value`` lines instead.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

import scaledmm.csrc
from scaledmm import jit

CSRC = Path(scaledmm.csrc.__file__).resolve().parent
HOST = Path(__file__).resolve().parent / "csrc_host"
NVCC = jit.nvcc_path()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (SCALEDMM_NVCC, PATH, CUDA_HOME)")


class Harness:
    """One compiled harness executable."""

    def __init__(self, exe: Path):
        self.exe = exe
        self._n = 0

    def __call__(self, op: str, records) -> np.ndarray:
        """``op`` over ``records`` (``[n, width]`` ints, or 1-D for width 1):
        ``[n, out_width]`` uint32 (int64 view for signed helpers: use ``.astype``)."""
        rec = np.asarray(records, dtype=np.int64)
        rec = rec.reshape(len(rec), -1) if rec.ndim == 1 else rec
        assert ((rec >= -2 ** 31) & (rec < 2 ** 32)).all()
        self._n += 1
        src, dst = self.exe.with_name(f"in{self._n}.bin"), self.exe.with_name(f"out{self._n}.bin")
        (rec & 0xFFFFFFFF).astype(np.uint32).tofile(src)
        r = subprocess.run([str(self.exe), op, str(src), str(dst)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{self.exe.name} {op}: {r.stderr}"
        out = np.fromfile(dst, dtype=np.uint32)
        src.unlink()
        dst.unlink()
        return out.reshape(len(rec), -1) if len(rec) else out.reshape(0, 0)

    def ints(self, op: str, records) -> np.ndarray:
        """``op``'s results as signed 32-bit ints."""
        return self(op, records).view(np.int32).astype(np.int64)

    def consts(self) -> dict[str, int]:
        r = subprocess.run([str(self.exe), "consts", "-", "-"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return {k: int(v) for k, v in (line.split("=") for line in r.stdout.split())}


def build(source: str, out_dir: Path, defines: dict | None = None) -> Harness:
    """Compile ``tests/csrc_host/<source>`` for the host (its device code to PTX
    only) with ``-D`` ``defines``; an nvcc error fails the test with its log."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    tag = "_".join(f"{k}{v}" for k, v in sorted((defines or {}).items()))
    exe = Path(out_dir) / (Path(source).stem + (f"_{tag}" if tag else ""))
    cmd = [NVCC, "-std=c++17", "-O1", "-gencode", "arch=compute_90a,code=compute_90a",
           "-I", str(CSRC), "-I", str(HOST), *(f"-D{k}={v}" for k, v in (defines or {}).items()),
           "-o", str(exe), str(HOST / source)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    return Harness(exe)
