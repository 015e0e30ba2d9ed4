"""``python -m benchmarks sweep --kernel NAME [--shapes ...] [--m ...] [--out DIR]``:
time every candidate config of one kernel, the input of
``python -m benchmarks.tune --kernel NAME``.

Per (shape, M) point each of the kernel's candidate configs (its module's
``candidate_configs``, the config the backend picks today first) becomes one
provider of the family benchmark's op, called with that config explicitly.
The harness checks it against the float64 reference on fresh random inputs
and times it like any provider (input copies past the L2, CUDA-graph replay,
medians; ``benchmarks/harness.py``, ``benchmarks/timing.py``); a config that
is wrong or fails to compile gets its status and no time.

Writes ``<out>/<kernel>_sweep.csv``: columns ``n, k, m``, every field of the
kernel's config dataclass, ``median_us`` and ``status`` (what
``benchmarks/tune_kernel.py`` reads), then ``op``, ``config``, ``error`` and
``note``; and ``<out>/meta.json`` (the machine, for the file's ``source``).
For the NVRTC kernels every candidate's cubin is compiled first, ``--jobs``
at a time (:func:`prebuild`), so the timed loop finds them in the cache::

    python -m benchmarks sweep --kernel nvfp4_gemv --shapes llama8b --m 1,2,4,8
    python -m benchmarks.tune benchmarks/out/nvfp4_gemv_sweep.csv --kernel nvfp4_gemv \\
        --out scaledmm/tuning/kernels/nvfp4_gemv_sm90.json
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any, Callable

import torch

from .harness import OURS, OpBench, Provider, Result, run_point
from .machine import REPO_ROOT, environment
from .shapes import Shape, parse_ms, parse_shapes
from .timing import TimingConfig

__all__ = ["SweepKernel", "KERNELS", "candidates", "prebuild", "sweep", "write_csv", "main"]


class SweepKernel(typing.NamedTuple):
    """How one kernel's configs are enumerated and launched.

    ``family``/``op``: the benchmark whose inputs, reference and tolerance
    the sweep reuses; ``configs(args, device)``: the candidates of a point
    (args are the op's prepared arguments); ``call(cfg)``: the op's
    arguments -> the kernel's output with ``cfg``; ``config``: the
    ``module.Class`` of the config dataclass; ``default_shapes``: shape set
    used without ``--shapes`` on a GPU; ``default_m``: M sweep without ``--m``;
    ``nvrtc``: the call compiles an :class:`scaledmm.jit.NvrtcKernelSpec`
    (:func:`prebuild` can compile its candidates up front).
    """

    family: str
    op: str
    config: str
    configs: Callable[[tuple, torch.device], list]
    call: Callable[[Any], Callable[..., torch.Tensor]]
    supported: Callable[[torch.device], tuple[bool, str]]
    default_shapes: str
    default_m: tuple[int, ...]
    nvrtc: bool = False


def _fp8_triton():
    from scaledmm.ops import fp8_block_triton as ft

    return ft


def _nvfp4_triton():
    from scaledmm.ops import nvfp4_triton as nt

    return nt


def _fp8_block_triton_configs(args, device):
    ft = _fp8_triton()
    a, b = args[0], args[1]
    m, k, n = a.shape[0], a.shape[1], b.shape[0]
    sms = ft._num_sms(device)
    sm90 = device.type == "cpu" or ft._capability(device) >= (9, 0)
    return [ft.default_config(m, n, k, sms, False, sm90), *ft.candidate_configs(m, n, k, sms)]


def _fp8_block_triton_call(cfg):
    ft = _fp8_triton()
    return lambda a, b, a_s, b_s, block, out_dtype: ft.mm(a, b, a_s, b_s, out_dtype, config=cfg)


def _nvfp4_triton_configs(args, device):
    from scaledmm.ops import nvfp4 as nv

    nt = _nvfp4_triton()
    a, b, _, _, _, out_dtype, bias = args
    p = nv.mm_problem(a, b, out_dtype, bias)
    return [nt.default_config(p), *nt.candidate_configs(p)]


def _nvfp4_triton_call(cfg):
    nt = _nvfp4_triton()
    return lambda a, b, sa, sb, alpha, out_dtype, bias: nt.run_mm(a, b, sa, sb, alpha, out_dtype, bias, cfg)


def _cuda_configs(module: str, w4a16: bool):
    def configs(args, device):
        mod = importlib.import_module(module)
        m, n = args[0].shape[0], args[1].shape[0]
        k = args[1].shape[1] * 2  # packed e2m1: two codes a byte
        return mod.candidate_configs(n, k, mod.m_bucket(m), w4a16=w4a16)
    return configs


def _wgmma_configs(args, device):
    from scaledmm.ops import nvfp4_wgmma as wg

    m, n, k = args[0].shape[0], args[1].shape[0], args[1].shape[1] * 2
    return wg.candidate_configs(n, k, m)


def _cuda_call(module: str, fn: str):
    def call(cfg):
        launch = getattr(importlib.import_module(module), fn)
        return lambda *args: launch(*args, cfg=cfg)
    return call


def _gate(module: str):
    def supported(device):
        return importlib.import_module(module).is_supported(device)
    return supported


def _always(device):
    return True, ""


def _fp8_gemv_configs(args, device):
    from scaledmm.ops import fp8_gemv as fg

    x, b = args[0], args[1]
    return fg.candidate_configs(b.shape[0], b.shape[1], fg.m_bucket(x.shape[0]))


def _fp8_wgmma_configs(args, device):
    from scaledmm.ops import fp8_wgmma as fw

    a, b = args[0], args[1]
    return fw.candidate_configs(b.shape[0], b.shape[1], a.shape[0])


def _fp8_wgmma_block_configs(args, device):
    from scaledmm.ops import fp8_wgmma as fw

    a, b = args[0], args[1]
    return fw.candidate_configs(b.shape[0], b.shape[1], a.shape[0], block=True)


_GEMV, _MID, _FP8_GEMV = "scaledmm.ops.nvfp4_gemv", "scaledmm.ops.nvfp4_mid", "scaledmm.ops.fp8_gemv"
_WGMMA, _FP8_WGMMA = "scaledmm.ops.nvfp4_wgmma", "scaledmm.ops.fp8_wgmma"
KERNELS: dict[str, SweepKernel] = {
    "fp8_block_triton": SweepKernel("fp8_block", "fp8_block_mm", "scaledmm.ops.fp8_block_triton.MMConfig",
                                    _fp8_block_triton_configs, _fp8_block_triton_call, _always, "dsv3",
                                    (1, 16, 64, 128, 512, 1024, 4096)),
    # One file serves both nvfp4 ops; the W4A4 GEMM is the one swept.
    "nvfp4_triton": SweepKernel("nvfp4", "nvfp4_mm", "scaledmm.ops.nvfp4_triton.GemmConfig",
                                _nvfp4_triton_configs, _nvfp4_triton_call, _always, "llama8b",
                                (16, 64, 256, 1024, 4096)),
    "nvfp4_gemv": SweepKernel("nvfp4", "nvfp4_mm", f"{_GEMV}.GemvConfig", _cuda_configs(_GEMV, False),
                              _cuda_call(_GEMV, "gemv_mm"), _gate(_GEMV), "llama8b", (1, 2, 4, 8, 16, 32),
                              nvrtc=True),
    "nvfp4_gemv_w4a16": SweepKernel("nvfp4", "nvfp4_w4a16_mm", f"{_GEMV}.GemvConfig", _cuda_configs(_GEMV, True),
                                    _cuda_call(_GEMV, "gemv_w4a16"), _gate(_GEMV), "llama8b", (1, 2, 4, 8, 16),
                                    nvrtc=True),
    "fp8_gemv": SweepKernel("fp8_linear", "fp8_linear", f"{_FP8_GEMV}.GemvConfig", _fp8_gemv_configs,
                            _cuda_call(_FP8_GEMV, "gemv_linear"), _gate(_FP8_GEMV), "llama8b", (1, 2, 4, 8, 16),
                            nvrtc=True),
    "nvfp4_mid": SweepKernel("nvfp4", "nvfp4_mm", f"{_MID}.MidConfig", _cuda_configs(_MID, False),
                             _cuda_call(_MID, "mid_mm"), _gate(_MID), "llama8b", (32, 64, 128, 256), nvrtc=True),
    "nvfp4_mid_w4a16": SweepKernel("nvfp4", "nvfp4_w4a16_mm", f"{_MID}.MidConfig", _cuda_configs(_MID, True),
                                   _cuda_call(_MID, "mid_w4a16"), _gate(_MID), "llama8b", (32, 64, 128, 256),
                                   nvrtc=True),
    # One table serves both ops (the W4A4 call is the W4A16 kernel after an fp16 activation decode).
    "nvfp4_wgmma": SweepKernel("nvfp4", "nvfp4_w4a16_mm", f"{_WGMMA}.WgmmaConfig", _wgmma_configs,
                               _cuda_call(_WGMMA, "wgmma_w4a16"), _gate(_WGMMA), "llama8b",
                               (64, 128, 256, 512, 1024, 4096), nvrtc=True),
    "fp8_wgmma": SweepKernel("fp8", "fp8_scaled_mm", f"{_FP8_WGMMA}.WgmmaConfig", _fp8_wgmma_configs,
                             _cuda_call(_FP8_WGMMA, "wgmma_mm"), _gate(_FP8_WGMMA), "llama8b",
                             (8, 16, 32, 64, 128, 256), nvrtc=True),
    # To M = 4096, the range its large-M tiles compete in.
    "fp8_wgmma_block": SweepKernel("fp8_block", "fp8_block_mm", f"{_FP8_WGMMA}.WgmmaConfig", _fp8_wgmma_block_configs,
                                   _cuda_call(_FP8_WGMMA, "block_mm"), _gate(_FP8_WGMMA), "llama8b",
                                   (1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), nvrtc=True),
}


def config_class(spec: SweepKernel) -> type:
    """The config dataclass of a sweep kernel (what its CSV columns name).

    Examples
    --------
    >>> from benchmarks import sweep
    >>> sweep.config_class(sweep.KERNELS["nvfp4_gemv"]).__name__
    'GemvConfig'
    """
    module, cls = spec.config.rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)


def _bench(spec: SweepKernel) -> OpBench:
    family = importlib.import_module(f".{spec.family}", __package__)
    return next(b for b in family.benches() if b.op == spec.op)


def _label(cfg: Any) -> str:
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg) if f.init)


def candidates(spec: SweepKernel, bench: OpBench, shape: Shape, m: int, device: torch.device,
               limit: int | None = None) -> list:
    """The distinct configs of ``spec`` at one point (at most ``limit``).

    Examples
    --------
    >>> spec = KERNELS["fp8_block_triton"]                                         # doctest: +SKIP
    >>> candidates(spec, _bench(spec), Shape(256, 512), 1, torch.device("cpu"), 2)  # doctest: +SKIP
    [MMConfig(block_m=16, ...), MMConfig(...)]
    """
    args = bench.prepare(bench.make_inputs(m, shape, device))
    found = list(dict.fromkeys(spec.configs(args, device)))
    return found[:limit] if limit else found


def prebuild(kernel: str, shapes: list[Shape], ms: list[int], device: torch.device, limit: int | None = None,
             jobs: int = 1, log=sys.stderr) -> tuple[int, int, int]:
    """Compile the cubin of every candidate config of an NVRTC kernel's
    sweep, ``jobs`` at a time; returns (kernels recorded, failed builds,
    calls that stopped before loading a kernel).

    Each candidate's call runs once on a point's inputs under
    :func:`scaledmm.jit.recording`, so the kernel it records is exactly
    the one its launch path loads; nothing is launched.  A failure here
    costs nothing but time: the timed sweep meets (and reports) it again.

    Examples
    --------
    >>> prebuild("nvfp4_gemv", [Shape(4096, 4096)], [1, 8], torch.device("cuda"), jobs=16)  # doctest: +SKIP
    (148, 0, 0)
    """
    from scaledmm import jit

    spec = KERNELS[kernel]
    bench = _bench(spec)
    specs: dict[str, Any] = {}
    missed = 0
    for shape in shapes:
        for m in ms:
            args = bench.prepare(bench.make_inputs(m, shape, device))
            for c in candidates(spec, bench, shape, m, device, limit):
                with jit.recording() as found:
                    try:
                        spec.call(c)(*args)
                    except Exception:  # noqa: BLE001  (jit.SpecRecorded, or a failure the timed run reports)
                        pass
                missed += not found
                specs.update((s.key, s) for s in found)
    failed = jit.build_specs(specs.values(), jobs)
    print(f"[{kernel}] prebuilt {len(specs)} kernels, {jobs} at a time: {failed} failed, {missed} calls recorded none",
          file=log, flush=True)
    return len(specs), failed, missed


def sweep(kernel: str, shapes: list[Shape], ms: list[int], device: torch.device, cfg: TimingConfig,
          limit: int | None = None, log=sys.stderr, jobs: int = 1) -> list[tuple[Any, Result]]:
    """``(config, result)`` of every candidate config at every (shape, M):
    checked against the float64 reference, then timed (``benchmarks.harness``).
    An NVRTC kernel's candidates are compiled first, ``jobs`` at a time
    (:func:`prebuild`).

    Examples
    --------
    >>> cpu = torch.device("cpu")  # TRITON_INTERPRET=1 set before triton is imported  # doctest: +SKIP
    >>> rows = sweep("fp8_block_triton", [Shape(256, 512)], [1], cpu,
    ...              TimingConfig.for_device(cpu, True), limit=2)  # doctest: +SKIP
    >>> [r.status for _, r in rows]  # doctest: +SKIP
    ['ok', 'ok']
    """
    if kernel not in KERNELS:
        raise ValueError(f"--kernel: expected one of {sorted(KERNELS)}, got {kernel!r}")
    spec = KERNELS[kernel]
    ok, why = spec.supported(device)
    if not ok:
        raise ValueError(f"--kernel {kernel}: not runnable on {device}: {why}")
    import scaledmm  # noqa: F401  (defines the ops)

    bench = _bench(spec)
    if spec.nvrtc:
        prebuild(kernel, shapes, ms, device, limit, jobs, log)
    out: list[tuple[Any, Result]] = []
    for shape in shapes:
        for m in ms:
            configs = candidates(spec, bench, shape, m, device, limit)
            provs = [Provider(_label(c), OURS, bench.prepare, spec.call(c), bench.reference, bench.to_f64,
                              bench.unit, tol=bench.tol, error=bench.error) for c in configs]
            results = run_point(bench, shape, m, provs, device, cfg)
            out += list(zip(configs, results))
            best = min((r.timing.median_us for r in results if r.timing), default=float("nan"))
            bad = sum(r.status != "ok" for r in results)
            print(f"[{kernel} {shape.label} M={m}] {len(configs)} configs, best {best:.1f} us, {bad} not ok",
                  file=log, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def write_csv(path: Path, kernel: str, rows: list[tuple[Any, Result]]) -> None:
    """The sweep CSV ``benchmarks/tune_kernel.py`` reads (one row per config and point)."""
    fields = [f.name for f in dataclasses.fields(config_class(KERNELS[kernel])) if f.init]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["n", "k", "m", *fields, "median_us", "status", "op", "config", "error", "note"])
        for cfg, r in rows:
            us = f"{r.timing.median_us:.4f}" if r.timing else "nan"
            w.writerow([r.shape.n, r.shape.k, r.m, *(getattr(cfg, name) for name in fields), us, r.status,
                        r.op, _label(cfg), "" if r.error is None else f"{r.error:.3g}", r.note])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks sweep",
        description="Check and time every candidate config of one kernel; "
                    "'python -m benchmarks.tune <csv> --kernel NAME' turns the CSV into its tuning file.")
    p.add_argument("--kernel", required=True, choices=sorted(KERNELS))
    p.add_argument("--shapes", help="comma list of shape-set names, NxK and K->N items "
                                    "(default: the kernel's set on a GPU, 'tiny' on the CPU)")
    p.add_argument("--m", help="comma list of M values (default: the kernel's sweep; 1,17 on the CPU)")
    p.add_argument("--limit", type=int, help="time at most this many configs per point (the current one first)")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "out"),
                   help="directory for <kernel>_sweep.csv and meta.json (default: benchmarks/out)")
    p.add_argument("--quick", action="store_true", help="fewer timing reps")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="NVRTC kernels: candidates compiled at a time before timing (default: the CPU count)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks sweep ...``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    spec = KERNELS[args.kernel]
    try:
        shapes = parse_shapes(args.shapes or (spec.default_shapes if use_cuda else "tiny"))
        ms = parse_ms(args.m) if args.m else list(spec.default_m if use_cuda else (1, 17))
        if args.jobs < 1:
            raise ValueError(f"--jobs: expected a positive integer, got {args.jobs}")
        rows = sweep(args.kernel, shapes, ms, device, TimingConfig.for_device(device, args.quick), args.limit,
                     jobs=args.jobs)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.kernel}_sweep.csv"
    write_csv(path, args.kernel, rows)
    meta = {"args": vars(args), "env": environment(device)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    ok = sum(r.status == "ok" for _, r in rows)
    print(f"wrote {path}: {len(rows)} rows, {ok} timed; next: python -m benchmarks.tune {path} "
          f"--kernel {args.kernel} --out scaledmm/tuning/kernels/{args.kernel}_<arch>.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
