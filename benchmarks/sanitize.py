"""``compute-sanitizer`` over every GPU kernel scaledmm ships, one small odd
shape per kernel (issues #5-#7: memcheck on every kernel; racecheck and
synccheck on the CUDA C++ ones, CUTLASS fp8_block and fused-A skinny; racecheck
on one Triton case as information).  From the repository root::

    python -m benchmarks sanitize            # < 4 minutes on one H200
    python -m benchmarks sanitize --list     # cases and tools (any machine)
    python -m benchmarks sanitize --only 'skinny*' --tools memcheck,none

This module imports neither torch nor scaledmm (``python -m
benchmarks.sanitize`` runs it without them): it finds ``compute-sanitizer``
(PATH, ``$CUDA_HOME``, next to ``nvcc``, ``/usr/local/cuda/...``), reads its
``--help`` (an option it lacks is not passed) and runs one child per (case,
tool), ``--jobs`` at a time, each as ``compute-sanitizer --tool T
--error-exitcode 9 [...] python -m benchmarks.sanitize --child CASE``
with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (a tensor is an allocation, so an
access past it is caught) and ``SCALEDMM_CACHE_DIR=benchmarks/out/jit-cache``
when unset (the prebuilt CUTLASS libraries).

A child builds its inputs on the CPU (fixed seed), runs the kernel twice (the
first call compiles), compares the second result with a float64 (or exact)
CPU reference, says whether both calls gave the same bits, and prints one
``SANITIZE-CHILD <case> OK|WRONG|SKIP|ERROR: ...`` line.  Past ``--timeout``
(or the total ``--budget``) a child is killed with everything it started.

Result per job: ``clean``; ``ERRORS`` (the summary counts errors besides CUDA
API errors, the "Program hit ..." lines, which are counted apart: ``api``);
``WRONG``; ``ERROR`` (the child raised); ``CRASH`` (no child verdict); ``NO
SUMMARY`` (no sanitizer summary); ``TIMEOUT``; ``skipped``; ``not run
(budget)``.  The table comes last; ``<--out>/sanitize.json`` (default ``$OUT``) holds every job's
command, counts, first error lines and output tail.  Exit status 0 whatever
the cases say; non-zero only if the script itself breaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .sanitize_cases import (  # noqa: F401 - the cases; shapes re-exported for the tests
    CHILD_CASES,
    CUTLASS_CONFIGS,
    CUTLASS_MNK,
    FP8B_LINEAR_MNK,
    FP8B_MNK,
    FP8Q_MK,
    NVFP4_MNK,
    PAD,
    SKINNY_NK,
    W4A16_M,
    Ctx,
    Skip,
)

ROOT = Path(__file__).resolve().parent.parent
T0 = time.perf_counter()
MARK = "SANITIZE-CHILD"
CSRC_TOOLS = ("memcheck", "racecheck", "synccheck")
TOOL_ORDER = ("none", "memcheck", "racecheck", "synccheck")
ERROR_EXITCODE = 9
SKIP_RC = 77
RACECHECK_INFO_CASE = "fp8b_tri_mm_swap"  # racecheck on one Triton kernel, as information


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------
# Cases and jobs
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel at one shape.  ``csrc``: our CUDA C++ (memcheck, racecheck,
    synccheck); else memcheck only.  ``info``: not ours to fix (cuBLAS)."""

    name: str
    what: str
    shape: str
    csrc: bool = False
    info: bool = False
    env: tuple[tuple[str, str], ...] = ()


CASES: tuple[Case, ...] = (
    Case("fp8b_tri_mm_plain", "fp8_block Triton mm_kernel 32x64, no split, row-major a_scales", "M17 N200 K1040"),
    Case("fp8b_tri_mm_splitk", "fp8_block Triton 32x64 split_k=4 (one empty split) + splitk_reduce_kernel",
         "M17 N200 K1040"),
    Case("fp8b_tri_mm_swap", "fp8_block Triton 16x64 swap_ab split_k=2, column-major a_scales", "M17 N200 K1040"),
    Case("fp8b_tri_mm_tma", "fp8_block Triton 64x128 TMA descriptors (out-of-bounds fill)", "M17 N200 K1040"),
    Case("fp8b_tri_mm_tma_ws", "fp8_block Triton 128x128 TMA, persistent, warp-specialized", "M17 N200 K1040"),
    Case("fp8b_tri_linear_fused", "fp8_block_linear Triton, quant in the GEMM (QUANT_A) + bias, default fused cfg",
         "M17 N200 K1152, strided x"),
    Case("fp8b_tri_quant_row", "per_token_group_quant_fp8 Triton (op), bf16, row-major scales",
         "M17 K1152 g128, strided x"),
    Case("fp8b_tri_quant_col", "per_token_group_quant_fp8 Triton (op), fp16, column-major ue8m0 scales",
         "M17 K1152 g128, strided x"),
    Case("fp8b_cutlass_coop", "fp8_block CUTLASS coop128x128_c1x2, column-major a_scales (TMA)", "M20 N336 K1152",
         csrc=True),
    Case("fp8b_cutlass_swap", "fp8_block CUTLASS swap_coop128x32_c1x1_sfs_sk (stream-K), row-major a_scales",
         "M20 N336 K1152, strided a", csrc=True),
    # The racecheck of coop128x128_c1x2 (the M > 256 default) reported hazards
    # inside CUTLASS's blockwise mainloop/epilogue (H200 run 4): the same kernel
    # without clusters, with 2x1, ping-pong and stream-K tell where they come from.
    Case("fp8b_cutlass_coop_c1x1", "fp8_block CUTLASS coop128x128_c1x1 (no cluster)", "M20 N336 K1152", csrc=True),
    Case("fp8b_cutlass_coop_c2x1", "fp8_block CUTLASS coop128x128_c2x1", "M20 N336 K1152", csrc=True),
    Case("fp8b_cutlass_pp", "fp8_block CUTLASS pp64x128_c1x2 (ping-pong)", "M20 N336 K1152", csrc=True),
    Case("fp8b_cutlass_coop_sk", "fp8_block CUTLASS coop128x128_c1x2_sk (stream-K)", "M20 N336 K1152", csrc=True),
    Case("fp8b_cublas", "fp8_block cublas backend (torch._scaled_mm blockwise), through the op", "M20 N336 K1152",
         info=True),
    Case("nvfp4_tri_mm", "nvfp4_mm Triton W4A4 (op, default config: split-K with tile counters)", "M17 N200 K720"),
    Case("nvfp4_tri_w4a16", "nvfp4_w4a16_mm Triton (op) + bias", "M3 N200 K720, strided x"),
    Case("nvfp4_tri_quant", "nvfp4_quant Triton (op), swizzled scales with pad zeros", "M17 K720, strided x"),
    Case("fp8_gemv_token", "fp8_linear cuda_gemv (csrc/fp8_gemv.cu, NVRTC): per-token quantize + GEMM in one launch",
         "M5 N208 K1152, strided x", csrc=True),
    Case("fp8_gemv_block_split", "fp8_block_linear cuda_gemv, K split over a 2-CTA cluster, 16-row bucket, bias",
         "M13 N200 K1152, fp16 x", csrc=True),
    Case("nvfp4_gemv_w4a4", "nvfp4_mm cuda_gemv (csrc/nvfp4_gemv.cu, NVRTC), W4A4", "M5 N200 K736", csrc=True),
    Case("nvfp4_gemv_w4a16", "nvfp4_w4a16_mm cuda_gemv, bf16 activation", "M9 N200 K736, strided x", csrc=True),
    Case("nvfp4_gemv_wide", "nvfp4_mm cuda_gemv, the 32-row bucket (word-at-a-time decode path)",
         "M29 N200 K736, strided a", csrc=True),
    Case("nvfp4_gemv_ring", "nvfp4_mm cuda_gemv, the cp.async shared-memory ring (G_STAGES 3)",
         "M5 N200 K736", csrc=True),
    Case("nvfp4_gemv_ring_w4a16", "nvfp4_w4a16_mm cuda_gemv, the ring (G_STAGES 4), bf16 activation",
         "M9 N200 K736, strided x", csrc=True),
    Case("nvfp4_gemv_linear", "nvfp4_linear cuda_gemv: the activation quantized in the kernel (G_QUANT)",
         "M7 N200 K736, strided x, bias", csrc=True),
    Case("nvfp4_mid_w4a4", "nvfp4_mm cuda_mid (csrc/nvfp4_mid.cu), two 64-row slices",
         "M100 N200 K736, strided a", csrc=True),
    Case("nvfp4_mid_w4a16", "nvfp4_w4a16_mm cuda_mid, bf16 activation, 64-row bucket", "M40 N200 K736, strided x",
         csrc=True),
    Case("nvfp4_mid_ring", "cuda_mid w4t1s2u1r3: cp.async weight ring (not in a table yet), split K, two slices",
         "M100 N200 K736, strided a", csrc=True),
    Case("nvfp4_wgmma_w4a4", "nvfp4_mm cuda_wgmma (csrc/nvfp4_wgmma.cu: TMA ring, producer warp, wgmma), two 64-row "
         "tiles, K split over a 2-CTA cluster", "M100 N200 K768", csrc=True),
    Case("nvfp4_wgmma_w4a16", "nvfp4_w4a16_mm cuda_wgmma, bf16 activation, one 64-row tile, one warpgroup",
         "M40 N200 K768, strided x", csrc=True),
    Case("nvfp4_wgmma_pwg", "nvfp4_mm cuda_wgmma, one 256-row tile over two warpgroups, a producer warpgroup "
         "handing them its registers (setmaxnreg)", "M100 N200 K768", csrc=True),
    Case("nvfp4_wgmma_persistent", "nvfp4_mm cuda_wgmma, persistent grid: 165 tiles of 128 x 64, CTAs taking two, "
         "the ring running on from tile to tile", "M600 N2100 K768", csrc=True),
    Case("fp8_wgmma_split", "fp8_scaled_mm cuda_wgmma (csrc/fp8_wgmma.cu: TMA ring, producer warp, e4m3 wgmma), "
         "two 64-row tiles, one warpgroup, K split over a 2-CTA cluster", "M100 N208 K1040", csrc=True),
    Case("fp8_wgmma_two_wg", "fp8_scaled_mm cuda_wgmma, two 64-row tiles, two warpgroups (two k32 groups a stage)",
         "M100 N208 K1040", csrc=True),
    Case("fp8_wgmma_block_chain", "fp8_block_mm cuda_wgmma (G_BLOCK: cp.async scale copies on the stage barrier), "
         "one warpgroup, four k32 steps chained a stage, K split over a 2-CTA cluster, column-major scales",
         "M100 N208 K1040", csrc=True),
    Case("fp8_wgmma_block_two_wg", "fp8_block_mm cuda_wgmma, two warpgroups, fresh fragments, row-major scales",
         "M100 N208 K1040", csrc=True),
    Case("fp8_wgmma_pwg", "fp8_scaled_mm cuda_wgmma, 128 x 128 tile: a producer warpgroup hands registers "
         "to two consumer warpgroups (setmaxnreg)", "M100 N208 K1040", csrc=True),
    Case("fp8_wgmma_persistent", "fp8_scaled_mm cuda_wgmma, persistent grid: 272 tiles of 64 x 64, CTAs taking two "
         "or more, the ring running on from tile to tile", "M1000 N1040 K1040", csrc=True),
    Case("fp8_wgmma_linear", "fp8_block_linear cuda_wgmma (G_QUANT: bf16 rows by TMA, quantized by the consumers "
         "into the swizzled e4m3 slot, async-proxy fence, named barrier), one warpgroup, K split over 2 CTAs",
         "M100 N208 K1152", csrc=True),
    Case("fp8_wgmma_linear_two_wg", "fp8_block_linear cuda_wgmma, two warpgroups sharing the quantization",
         "M100 N208 K1152", csrc=True),
    Case("fp8_wgmma_tensor", "fp8_scaled_mm cuda_wgmma through the op: per-tensor scales, fp32 out, bf16 bias, "
         "one 16-row tile, two stages", "M5 N208 K1040, strided a", csrc=True),
    Case("nvfp4_decode_cublas", "nvfp4_mm decode_cublas: Triton decodes, cuBLAS fp32 mm, Triton epilogue + bias",
         "M130 N200 K736", env=(("SCALEDMM_NVFP4_CUBLASLT", "0"),)),
    Case("nvfp4_decode_cublaslt", "nvfp4_mm decode_cublas (SCALEDMM_NVFP4_CUBLASLT=1): Triton decodes, one "
         "cuBLASLt GEMM with device alpha and bias epilogue", "M130 N200 K736",
         env=(("SCALEDMM_NVFP4_CUBLASLT", "1"),)),
    Case("fp8_tri_quant", "quant_fp8 Triton (ops/fp8_triton_quant.py, if present): per-token, per-tensor, static",
         "M17 K1000, strided x"),
    Case("skinny_v1", "dsv3_fused_a_gemm register kernel (default), without and with PDL", "M3 N208 K1152, strided x",
         csrc=True, env=(("SCALEDMM_SKINNY_KERNEL", "reg"),)),
    Case("skinny_v2", "dsv3_fused_a_gemm TMA-ring kernel (SCALEDMM_SKINNY_KERNEL=tma), without and with PDL",
         "M9 N208 K1152, strided x", csrc=True, env=(("SCALEDMM_SKINNY_KERNEL", "tma"),)),
)
CASE_BY_NAME = {c.name: c for c in CASES}


@dataclasses.dataclass(frozen=True)
class Job:
    case: Case
    tool: str  # memcheck / racecheck / synccheck, or "none" (no sanitizer)

    @property
    def key(self) -> str:
        return f"{self.case.name}:{self.tool}"

    @property
    def info(self) -> bool:
        return self.case.info or (not self.case.csrc and self.tool != "memcheck" and self.tool != "none")


def select_cases(only: str | None) -> list[Case]:
    """Cases whose name matches one of the comma-separated patterns (all if None)."""
    if not only:
        return list(CASES)
    pats = [p.strip() for p in only.split(",") if p.strip()]
    unknown = [p for p in pats if not any(fnmatch.fnmatch(c.name, p) for c in CASES)]
    if unknown:
        raise SystemExit(f"--only: no case matches {unknown}; cases: {', '.join(c.name for c in CASES)}")
    return [c for c in CASES if any(fnmatch.fnmatch(c.name, p) for p in pats)]


def build_jobs(cases: list[Case], tools: set[str] | None = None, plain: bool = False) -> list[Job]:
    """Jobs in start order: plain runs (if asked), required sanitizer runs (CUDA
    C++ first: three tools each), then the informational ones.  ``tools``
    keeps only those tools ("none" among them adds plain runs)."""
    jobs = []
    for c in cases:
        wanted = list(CSRC_TOOLS) if c.csrc else ["memcheck"]
        if c.name == RACECHECK_INFO_CASE and not c.csrc:
            wanted.append("racecheck")
        if plain or (tools is not None and "none" in tools):
            wanted.insert(0, "none")
        jobs += [Job(c, t) for t in wanted if tools is None or t in tools or t == "none"]

    def rank(j: Job):
        return (j.tool != "none", j.info, not j.case.csrc, TOOL_ORDER.index(j.tool), CASES.index(j.case))

    return sorted(jobs, key=rank)


# ----------------------------------------------------------------------------
# compute-sanitizer: finding it, its options, reading its output
# ----------------------------------------------------------------------------


def find_sanitizer(env=None, which=shutil.which, is_file=os.path.isfile) -> str | None:
    """``compute-sanitizer`` from PATH, ``$CUDA_HOME``, next to ``nvcc`` or the
    usual CUDA folders; None when there is none."""
    env = os.environ if env is None else env
    found = which("compute-sanitizer")
    if found:
        return found
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            cands += [os.path.join(env[var], "bin", "compute-sanitizer"),
                      os.path.join(env[var], "compute-sanitizer", "compute-sanitizer")]
    nvcc = which("nvcc")
    if nvcc:
        cands.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "compute-sanitizer"))
    cands += ["/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"]
    return next((c for c in cands if is_file(c)), None)


def tool_args(tool: str, help_text: str, padding: int = 1024) -> list[str]:
    """Options for one tool.  Optional ones only when ``--help`` lists them (an
    unknown option would fail every job).  ``padding``: memcheck's bytes after
    each allocation (0: none)."""
    args = ["--tool", tool, "--error-exitcode", str(ERROR_EXITCODE)]

    def opt(flag: str, *value: str) -> None:
        if flag in help_text:
            args.extend((flag, *value))

    opt("--target-processes", "application-only")  # not Triton's ptxas / gcc children
    opt("--show-backtrace", "device")  # host backtraces of Python are long and say little
    opt("--print-limit", "20")
    if tool == "memcheck":
        opt("--leak-check", "no")
        if padding:
            opt("--padding", str(padding))  # an overrun into a neighbouring allocation is caught too
    return args


def job_command(job: Job, sanitizer: str | None, help_text: str, python: str = sys.executable,
                padding: int = 1024) -> list[str]:
    child = [python, "-m", "benchmarks.sanitize", "--child", job.case.name]  # run in ROOT
    if job.tool == "none":
        return child
    return [sanitizer or "compute-sanitizer", *tool_args(job.tool, help_text, padding), *child]


def child_env(case: Case, base=None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    cache = ROOT / "benchmarks" / "out" / "jit-cache"
    if not env.get("SCALEDMM_CACHE_DIR") and cache.is_dir():
        env["SCALEDMM_CACHE_DIR"] = str(cache)
    env.update(dict(case.env))
    return env


_ERR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
_RACE_SUMMARY = re.compile(
    r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
_CHILD = re.compile(rf"^{MARK} (\S+) (OK|WRONG|SKIP|ERROR): ?(.*)$")
_NOT_FINDINGS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY",
                 "Target application returned an error", "process didn't terminate successfully")


def parse_output(text: str) -> dict:
    """Counts and the child's verdict from one job's output.

    ``errors``: the summary's count (racecheck: its errors), None without a
    summary; ``api``: "Program hit ..." (CUDA API error) reports;
    ``kernel_errors``: errors other than those; ``warnings``: racecheck's;
    ``child``/``message``: the last ``SANITIZE-CHILD`` line; ``first_error``:
    up to 12 report lines from the first finding on.
    """
    lines = text.splitlines()
    errs = [int(m.group(1)) for m in _ERR_SUMMARY.finditer(text)]
    races = [m.groups() for m in _RACE_SUMMARY.finditer(text)]
    api = sum(1 for ln in lines if "Program hit" in ln)
    out = {"errors": None, "api": api, "kernel_errors": None, "warnings": None, "child": None, "message": "",
           "first_error": []}
    if races:
        _, e, w = (int(v) for v in races[-1])
        out.update(errors=e, kernel_errors=e, warnings=w)
    elif errs:
        out.update(errors=errs[-1], kernel_errors=max(0, errs[-1] - api))
    for ln in lines:
        m = _CHILD.match(ln.strip())
        if m:
            out["child"], out["message"] = m.group(2), m.group(3)
    first = next((i for i, ln in enumerate(lines) if ln.startswith("=========") and ln.strip("= ")
                  and not any(s in ln for s in _NOT_FINDINGS)), None)
    if first is not None:
        out["first_error"] = [ln for ln in lines[first:first + 40] if ln.startswith("=========")][:12]
    return out


def verdict(tool: str, parsed: dict, timed_out: bool = False) -> str:
    """One word (or ``skipped: why``) per job; see the module docstring."""
    if timed_out:
        return "TIMEOUT"
    if parsed["child"] == "SKIP":
        return "skipped: " + parsed["message"]
    if parsed["kernel_errors"]:
        return "ERRORS"
    if parsed["child"] is None:
        return "CRASH" if tool == "none" or parsed["errors"] is not None else "NO SUMMARY"
    if parsed["child"] in ("ERROR", "WRONG"):
        return parsed["child"]
    if tool != "none" and parsed["errors"] is None:
        return "NO SUMMARY"
    return "ok" if tool == "none" else "clean"


# ----------------------------------------------------------------------------
# Running the jobs
# ----------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a job we started: its process group, and any descendant that
    left the group (listed before the kill, while they are still its children)."""
    below = _descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in below:
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_jobs(jobs: list[Job], command, env_for, parallel: int, timeout_s: float, budget_s: float,
             log_dir: Path, on_done=None) -> list[dict]:
    """Run ``command(job)`` for every job, ``parallel`` at a time, each in its own
    process group with output to a file; kill a job after ``timeout_s`` or
    when ``budget_s`` (from now) is spent; jobs not started by then are
    reported "not run (budget)".  Returns one dict per job, in ``jobs`` order."""
    deadline = time.monotonic() + budget_s
    min_start = min(20.0, timeout_s / 2)  # do not start a job that cannot get this long
    pending = list(jobs)
    running: dict[str, tuple] = {}
    results: dict[str, dict] = {}

    def start(job: Job, now: float) -> None:
        if deadline - now < min_start:
            results[job.key] = {"job": job, "rc": None, "seconds": 0.0, "timed_out": False, "text": "",
                                "not_run": True, "cmd": []}
            return
        cmd = command(job)
        path = log_dir / f"{job.case.name}__{job.tool}.log"
        fh = open(path, "w")
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env_for(job), cwd=ROOT,
                                start_new_session=True)
        running[job.key] = (job, proc, now, fh, path, cmd)

    def reap(key: str, now: float) -> None:
        job, proc, started, fh, path, cmd = running[key]
        rc = proc.poll()
        timed_out = rc is None and now > min(started + timeout_s, deadline)
        if rc is None and not timed_out:
            return
        if timed_out:
            kill_tree(proc.pid)
            rc = proc.wait()
        fh.close()
        del running[key]
        results[key] = res = {"job": job, "rc": rc, "seconds": time.monotonic() - started, "timed_out": timed_out,
                              "text": path.read_text(errors="replace"), "not_run": False, "cmd": cmd,
                              "log": str(path)}
        if on_done:
            on_done(res)

    try:
        while pending or running:
            now = time.monotonic()
            while pending and len(running) < parallel:
                start(pending.pop(0), now)
            for key in list(running):
                reap(key, now)
            if running or pending:
                time.sleep(0.1)
    finally:  # interrupted (SIGTERM from a wrapper's timeout, Ctrl-C): take our children down with us
        for _job, proc, *_ in running.values():
            kill_tree(proc.pid)
            proc.wait()
    return [results[j.key] for j in jobs]


def summarize(res: dict) -> dict:
    """The JSON row of one finished job (counts, verdict, first error, tail)."""
    job = res["job"]
    if res.get("not_run"):
        return {"case": job.case.name, "tool": job.tool, "info": job.info, "result": "not run (budget)", "rc": None,
                "errors": None, "api": 0, "warnings": None, "seconds": 0.0, "message": "", "first_error": [],
                "tail": [], "cmd": []}
    parsed = parse_output(res["text"])
    return {"case": job.case.name, "tool": job.tool, "info": job.info,
            "result": verdict(job.tool, parsed, res["timed_out"]), "rc": res["rc"],
            "errors": parsed["kernel_errors"], "api": parsed["api"], "warnings": parsed["warnings"],
            "seconds": round(res["seconds"], 1), "message": parsed["message"], "first_error": parsed["first_error"],
            "tail": res["text"].splitlines()[-80:], "cmd": res["cmd"]}


def format_table(rows: list[dict]) -> str:
    """The compact end-of-run table: one line per job (the child's message, or
    the end of its output), plus the first report lines of an ``ERRORS`` job."""
    def cell(v):
        return "-" if v is None else str(v)

    head = f"{'case':<22} {'tool':<9} {'result':<11} {'rc':>4} {'err':>4} {'api':>4} {'warn':>4} {'sec':>6}  child says"
    out = [head, "-" * len(head)]
    for r in rows:
        word = ("not run" if r["result"].startswith("not run") else r["result"].split(":")[0]) \
            + (" (i)" if r["info"] else "")
        note = r["result"].partition(": ")[2] if r["result"].startswith("skipped") else r["message"]
        if not note and r["result"] not in ("clean", "ok", "not run (budget)"):
            note = " | ".join(ln.strip() for ln in r["tail"][-2:])
        out.append(f"{r['case']:<22} {r['tool']:<9} {word[:11]:<11} {cell(r['rc']):>4} {cell(r['errors']):>4} "
                   f"{cell(r['api']):>4} {cell(r['warnings']):>4} {r['seconds']:6.1f}  {note[:100]}")
        for ln in r["first_error"][:4] if r["result"] == "ERRORS" else []:
            out.append(f"{'':<33}{ln.strip()[:110]}")
    return "\n".join(out)


def run_child(name: str, device: str) -> int:
    """Run one case; print its ``SANITIZE-CHILD`` line; return the exit status."""
    try:
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            raise Skip("no CUDA device")
        ok, msg = CHILD_CASES[name](Ctx(name, device))
        status, rc = ("OK", 0) if ok else ("WRONG", 1)
    except Skip as e:
        status, rc, msg = "SKIP", SKIP_RC, str(e)
    except Exception as e:  # noqa: BLE001 - reported, the traceback goes to the log
        traceback.print_exc()
        status, rc, msg = "ERROR", 3, f"{type(e).__name__}: {str(e)[:300]}"
    print(f"{MARK} {name} {status}: {msg}", flush=True)
    return rc


def child_main(names: list[str], device: str) -> int:
    """Run the cases in this process (one per sanitizer job; several in the CPU
    test); the worst status wins, a skip counts as success."""
    for name in names:
        for key, value in CASE_BY_NAME[name].env:
            os.environ.setdefault(key, value)  # before scaledmm is imported (read at import)
    import scaledmm  # noqa: F401  (registers ops and backends)

    codes = [run_child(name, device) for name in names]
    bad = [c for c in codes if c not in (0, SKIP_RC)]
    return max(bad) if bad else (SKIP_RC if all(c == SKIP_RC for c in codes) else 0)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def _probe(sanitizer: str) -> tuple[str, str]:
    """(help text, version line) of the sanitizer, or ("", reason)."""
    try:
        h = subprocess.run([sanitizer, "--help"], capture_output=True, text=True, timeout=30)
        help_text = h.stdout + h.stderr
        ver = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, timeout=30).stdout
        return help_text, " ".join(ver.split())[-120:]
    except (OSError, subprocess.SubprocessError) as e:
        return "", f"probe failed: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks sanitize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the cases and jobs, run nothing")
    ap.add_argument("--child", help="(internal) run these comma-separated cases in this process")
    ap.add_argument("--device", default="cuda", help="(with --child) cuda, or cpu under TRITON_INTERPRET=1")
    ap.add_argument("--only", help="comma-separated case names or patterns (fnmatch)")
    ap.add_argument("--tools", help="keep only these tools (memcheck,racecheck,synccheck; none = no sanitizer)")
    ap.add_argument("--plain", action="store_true", help="also run every case without a sanitizer")
    ap.add_argument("--jobs", type=int, default=8, help="children at a time (default 8)")
    ap.add_argument("--timeout", type=float, default=100.0, help="seconds per child before it is killed")
    ap.add_argument("--budget", type=float, default=215.0, help="seconds for all children together")
    ap.add_argument("--padding", type=int, default=1024, help="memcheck --padding bytes (0: off)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for sanitize.json (default: $OUT)")
    args = ap.parse_args(argv)

    if args.child:
        names = [n for n in args.child.split(",") if n]
        unknown = [n for n in names if n not in CHILD_CASES]
        if unknown:
            raise SystemExit(f"--child: unknown cases {unknown}")
        return child_main(names, args.device)

    cases = select_cases(args.only)
    tools = {t.strip() for t in args.tools.split(",") if t.strip()} if args.tools else None
    jobs = build_jobs(cases, tools, args.plain)
    if args.list:
        for c in cases:
            ts = [j.tool + (" (info)" if j.info else "") for j in jobs if j.case is c]
            env = " ".join(f"{k}={v}" for k, v in c.env)
            print(f"{c.name:<22} {c.shape:<28} {', '.join(ts):<32} {c.what}{'  [' + env + ']' if env else ''}")
        print(f"{len(jobs)} jobs")
        return 0

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_jobs then kills the children it started
    sanitizer = find_sanitizer()
    help_text, version = _probe(sanitizer) if sanitizer else ("", "not found")
    log(f"compute-sanitizer: {sanitizer or 'NOT FOUND'} ({version}); python {sys.executable}")
    if not sanitizer:
        jobs = [j for j in build_jobs(cases, {"none"}, True) if j.tool == "none"]
        log("no compute-sanitizer: running the children without it (correctness only)")
    out_dir = Path(args.out) if args.out else None
    log_dir = Path(tempfile.mkdtemp(prefix="scaledmm-sanitize-"))
    log(f"{len(jobs)} jobs, {args.jobs} at a time, timeout {args.timeout:.0f} s each, budget {args.budget:.0f} s; "
        f"logs in {log_dir}")

    def on_done(res):
        r = summarize(res)
        log(f"{r['tool']:<9} {r['case']:<22} {r['result']:<12} rc {r['rc']}, errors {r['errors']}, api {r['api']}, "
            f"{r['seconds']:.1f} s: {(r['message'] or ' | '.join(r['tail'][-2:]))[:160]}")

    results = run_jobs(jobs, lambda j: job_command(j, sanitizer, help_text, padding=args.padding),
                       lambda j: child_env(j.case),
                       args.jobs, args.timeout, args.budget, log_dir, on_done)
    rows = [summarize(r) for r in results]
    rows.sort(key=lambda r: (CASES.index(CASE_BY_NAME[r["case"]]), TOOL_ORDER.index(r["tool"])))
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        report = {"sanitizer": sanitizer, "version": version, "jobs_at_a_time": args.jobs,
                  "timeout_s": args.timeout, "budget_s": args.budget, "total_s": time.perf_counter() - T0,
                  "options": {t: tool_args(t, help_text, args.padding) for t in CSRC_TOOLS},
                  "cases": [dataclasses.asdict(c) for c in cases], "jobs": rows}
        (out_dir / "sanitize.json").write_text(json.dumps(report, indent=1, default=str))
    required = [r for r in rows if not r["info"]]
    clean = sum(r["result"] in ("clean", "ok") for r in required)
    skipped = sum(r["result"].startswith("skipped") for r in required)
    print(f"\n== compute-sanitizer over scaledmm's kernels ({sanitizer or 'no sanitizer'}; err = kernel errors, "
          "api = CUDA API error reports, warn = racecheck warnings) ==")
    print(format_table(rows))
    print(f"required jobs: {clean} clean, {skipped} skipped, {len(required) - clean - skipped} not clean "
          f"(of {len(required)}); informational: {len(rows) - len(required)}; total "
          f"{time.perf_counter() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
