"""The machine: its ceilings (copy bandwidth, GEMM rates) and its software.

Ceilings are measured, not read off a datasheet: a large device-to-device copy
(bytes read plus bytes written) and 8192^3 GEMMs on random data through
cuBLAS, bf16 (``torch.mm``) and FP8 (``torch._scaled_mm``, per-tensor scales).
Every result is reported against them.  On the CPU the same measurements run
at small sizes so the smoke run exercises the code.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from scaledmm import device as scaledmm_device

from .timing import percentile, synchronize

__all__ = ["Ceilings", "measure_ceilings", "environment", "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Measured peak rates of the machine.

    Parameters
    ----------
    copy_gbps : float
        Device-to-device copy, (bytes read + bytes written) / time, in GB/s.
    tflops : dict
        Math unit (``"bf16"``, ``"fp8"``) -> dense GEMM rate in TFLOP/s.
        A unit that could not be measured is absent.
    gemm_size : int
        The cube edge of the GEMMs measured.
    copy_bytes : int
        Size of the copied buffer.
    """

    copy_gbps: float
    tflops: dict
    gemm_size: int
    copy_bytes: int

    def rate(self, unit: str | None) -> float | None:
        """TFLOP/s of ``unit``; None when unknown or ``unit`` is None."""
        return self.tflops.get(unit) if unit else None

    def describe(self) -> str:
        rates = ", ".join(f"{u} GEMM {self.gemm_size}^3 {r:.4g} TFLOP/s" for u, r in self.tflops.items())
        return (f"copy {self.copy_gbps:.0f} GB/s (read+write, {self.copy_bytes >> 20} MiB); "
                + (rates or "no GEMM rate measured"))


def _time_us(fn, device: torch.device, reps: int, warmup_s: float) -> float:
    """Median microseconds of ``fn`` (events on a GPU, wall clock on the CPU)."""
    fn()
    synchronize(device)
    t_end = time.perf_counter() + warmup_s
    while time.perf_counter() < t_end:
        fn()
        synchronize(device)  # never queue more device work than warmup_s
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            samples.append(s.elapsed_time(e) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return percentile(samples, 50)


def measure_ceilings(device: torch.device, quick: bool = False) -> Ceilings:
    """Measure copy bandwidth and bf16 / FP8 GEMM rates on ``device``.

    Examples
    --------
    >>> measure_ceilings(torch.device("cpu"), quick=True).copy_gbps > 0
    True
    """
    gpu = device.type == "cuda"
    nbytes = (1 << 30 if not quick else 512 << 20) if gpu else 32 << 20
    size = 8192 if gpu else 256
    reps = (10 if quick else 20) if gpu else 3
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _time_us(lambda: dst.copy_(src), device, reps, 0.05 if gpu else 0.0)
    copy_gbps = 2 * nbytes / t * 1e-3
    del src, dst

    tflops: dict[str, float] = {}
    flops = 2.0 * size ** 3
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    # The first GEMMs also bring the clocks up.
    t = _time_us(lambda: torch.mm(a, b), device, reps, (0.2 if quick else 0.5) if gpu else 0.0)
    tflops["bf16"] = flops / t * 1e-6
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=device)
    try:
        t = _time_us(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                     device, reps, 0.05 if gpu else 0.0)
        tflops["fp8"] = flops / t * 1e-6
    except Exception:  # no FP8 GEMM on this device: no FP8 ceiling
        pass
    return Ceilings(copy_gbps, tflops, size, nbytes)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _driver() -> str:
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0]
    try:
        from cuda.bindings import driver as cu

        cu.cuInit(0)
        err, v = cu.cuDriverGetVersion()
        if int(err) == 0:
            return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:
        pass
    return "unknown"


def _commit() -> str:
    # Set by benchmarks/device_all.sh: the device tool copies the working tree,
    # whose .git may still name an older HEAD.
    if os.environ.get("SCALEDMM_COMMIT"):
        return os.environ["SCALEDMM_COMMIT"]
    sha = _run(["git", "rev-parse", "--short=12", "HEAD"])
    if not sha:
        return os.environ.get("SCALEDMM_COMMIT", "unknown (no git checkout)")
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return sha + (" (with uncommitted changes)" if dirty else "")


def environment(device: torch.device) -> dict[str, str]:
    """Date, device, driver, library versions, git commit and whether our
    kernels launch with PDL (:func:`scaledmm.device.pdl`), for report headers.

    Examples
    --------
    >>> env = environment(torch.device("cpu"))
    >>> sorted(env)[:3]
    ['commit', 'cuda-python', 'date']
    """
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        l2 = getattr(p, "L2_cache_size", 0)
        dev = (f"{p.name} (sm{p.major}{p.minor}, {p.multi_processor_count} SMs, "
               f"{p.total_memory / 2**30:.0f} GiB, L2 {l2 / 2**20:.0f} MiB)")
    else:
        dev = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores; wall-clock smoke run)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": dev,
        "driver": _driver() if device.type == "cuda" else "n/a",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "triton": _version("triton"),
        "cuda-python": (f"{_version('cuda-python')} (cuda-bindings {_version('cuda-bindings')}, "
                        f"cuda-core {_version('cuda-core')})"),
        "python": platform.python_version(),
        "commit": _commit(),
        "pdl": ("our kernels launch with programmatic dependent launch (SCALEDMM_PDL=0: off)"
                if scaledmm_device.pdl(device) else "off"),
    }
