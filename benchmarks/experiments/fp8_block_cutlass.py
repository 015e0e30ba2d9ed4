"""GPU check and timing of the CUTLASS sm90 FP8 blockwise backend (``fp8_block``
backend ``cutlass``, ops/fp8_block_cutlass.py) against cuBLAS blockwise
(``torch._scaled_mm`` through the ``cublas`` backend) and bf16 ``F.linear``.
Run from the repository root with the pre-built libraries::

    SCALEDMM_CACHE_DIR=benchmarks/out/jit-cache python -m benchmarks.experiments.fp8_block_cutlass
    ... --quick          # fewer M, no knob sweep
    ... --allow-build    # compile libraries missing from the cache (about a minute each)

Stages (each guarded: a failure is printed and the rest still runs):

1. environment; which config libraries load from the cache (no build unless
   ``--allow-build``: a missing one is reported and skipped);
2. for each DeepSeek-V3 shape and M in {4, 16, 64, 128, 512, 4096}: every
   relevant config (swap-A/B configs for M <= 512, the others for M >= 64),
   the table's choice through the op (``table``: ``fp8_block_mm`` with the
   backend forced to ``cutlass``; ``table_rowscales``: the same fed row-major
   scales, M >= 512), cuBLAS blockwise and bf16
   F.linear; each output checked against float64 (rel. error < 8e-3, no NaN),
   then timed;
3. launch knobs (swizzle x raster) of the large-M configs at M = 4096;
4. ``compute-sanitizer --tool memcheck`` on small launches of two configs (a
   child process that allocates with the CUDA driver, not torch).

Timing (benchmarks/timing.py, quick settings): cold L2 (operand copies
rotating, > 2x L2 in all), one CUDA graph per pass over the copies replayed
between CUDA events, median per call.
Activation scales are column-major (what cuBLAS and the TMA configs read).
Prints a compact table at the end; details to ``$OUT/fp8_block_cutlass.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path


SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (576, 7168)]
MS = (4, 16, 64, 128, 512, 4096)
QUICK_MS = (16, 128, 4096)
TOL = 8e-3
BUDGET_S = 115.0  # stop timing new points after this (the sanitizer and report follow)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------
# Sanitizer child: CUDA driver allocations, our library through ctypes
# ----------------------------------------------------------------------------


def sanitizer_child(lib_path: str, cfg_name: str, m: int, n: int, k: int) -> int:
    import ctypes

    import torch  # CPU only here: data and the float64 reference
    from cuda.bindings import driver as drv

    from scaledmm.ops import fp8_block_cutlass as C

    def ok(res):
        err, *vals = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA error {err}")
        return vals[0] if len(vals) == 1 else (vals or None)

    ok(drv.cuInit(0))
    ctx = ok(drv.cuDevicePrimaryCtxRetain(ok(drv.cuDeviceGet(0))))
    ok(drv.cuCtxSetCurrent(ctx))
    lib = C.CutlassLibrary(ctypes.CDLL(lib_path), cfg_name)
    lib.prepare(0)
    kb, nb = k // 128, math.ceil(n / 128)
    a = torch.randn(m, k).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa = (torch.rand(m, kb) + 0.05).t().contiguous()  # column-major [m, kb]: stored [kb, m]
    sb = torch.rand(nb, kb) + 0.05

    def upload(t):
        ptr = ok(drv.cuMemAlloc(t.numel() * t.element_size()))
        ok(drv.cuMemcpyHtoD(ptr, t.data_ptr(), t.numel() * t.element_size()))
        return ptr

    da, db, dsa, dsb = upload(a), upload(b), upload(sa), upload(sb)
    dout = ok(drv.cuMemAlloc(m * n * 2))
    ok(drv.cuMemsetD16(dout, 0x7FC0, m * n))  # NaN
    args = C.Args(C.ABI_VERSION, 0, 132, m, n, k, int(da), int(db), int(dsa), int(dsb), int(dout),
                   k, n, 1, m, kb, None, 0, None, 1, 0, 1, 0)
    args.sm_count = ok(drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ok(drv.cuDeviceGet(0))))
    ws = lib.workspace_size(args)
    if ws:
        args.workspace, args.workspace_bytes = int(ok(drv.cuMemAlloc(ws))), ws
    lib.run(args)
    ok(drv.cuCtxSynchronize())
    out16 = torch.empty(m, n, dtype=torch.int16)
    ok(drv.cuMemcpyDtoH(out16.data_ptr(), dout, m * n * 2))
    out = out16.view(torch.bfloat16).double()
    sa64 = sa.t().double().repeat_interleave(128, 1)
    sb64 = sb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    ref = (a.double() * sa64) @ (b.double() * sb64).t()
    rel = float((out - ref).norm() / ref.norm())
    finite = bool(torch.isfinite(out).all())
    print(f"child {cfg_name} M={m} N={n} K={k}: rel err {rel:.2e}, finite {finite}, workspace {ws} B")
    return 0 if rel < TOL and finite else 1


def run_sanitizer(libs: dict, timeout_s: float) -> dict:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        from scaledmm import jit

        nvcc = jit.nvcc_path()
        cand = Path(nvcc).resolve().parent / "compute-sanitizer" if nvcc else None
        tool = str(cand) if cand and cand.is_file() else None
    if tool is None:
        return {"status": "skipped: compute-sanitizer not found"}
    res = {}
    cases = [("swap_coop128x16_c1x1_sfs_sk", 8, 576, 512), ("coop128x128_c1x2", 132, 384, 640)]
    for name, m, n, k in cases:
        if name not in libs:
            res[name] = "skipped: library not loaded"
            continue
        cmd = [tool, "--tool", "memcheck", "--error-exitcode", "9",
               sys.executable, "-m", "benchmarks.experiments.fp8_block_cutlass",
               "--sanitize-child", libs[name], name, str(m), str(n), str(k)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, timeout_s / len(cases)))
            tail = (p.stdout + p.stderr).strip().splitlines()[-4:]
            res[name] = f"rc={p.returncode}: " + " | ".join(tail)
        except subprocess.TimeoutExpired:
            res[name] = "timeout"
    return res


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--allow-build", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run of the script's flow (kernels fail)")
    ap.add_argument("--sanitize-child", nargs=5, metavar=("LIB", "CONFIG", "M", "N", "K"))
    args = ap.parse_args()
    if args.sanitize_child:
        lib, name, m, n, k = args.sanitize_child
        return sanitizer_child(lib, name, int(m), int(n), int(k))
    if not args.allow_build:
        os.environ.setdefault("SCALEDMM_JIT_NO_BUILD", "1")

    import torch
    import torch.nn.functional as F

    import scaledmm
    from benchmarks.timing import TimingConfig, copies_for, measure
    from scaledmm import jit
    from scaledmm.ops import fp8_block as base
    from scaledmm.ops import fp8_block_cutlass as C

    dev = torch.device("cpu" if args.smoke else "cuda")
    shapes = [(384, 512)] if args.smoke else SHAPES
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report: dict = {"errors": [], "notes": [], "points": [], "knobs": []}

    def guard(stage, fn):
        try:
            return fn()
        except Exception as e:
            msg = f"{stage}: {type(e).__name__}: {str(e)[:400]}"
            log("ERROR " + msg)
            report["errors"].append(msg + "\n" + traceback.format_exc()[-1500:])
            return None

    # 1. environment and libraries
    props = torch.cuda.get_device_properties(dev) if dev.type == "cuda" else None
    env = {"device": getattr(props, "name", "cpu"), "sm": props and torch.cuda.get_device_capability(),
           "sms": getattr(props, "multi_processor_count", 0), "torch": torch.__version__, "cuda": torch.version.cuda, "cache": str(jit.cache_dir()),
           "cutlass": C.cutlass_version(), "headers": str(C.cutlass_include_dir()),
           "backend": C._is_supported(dev)}
    report["env"] = env
    log(f"env: {env}")
    libs, lib_paths = {}, {}

    def load_by_name(cfg):
        """Fallback when the exact key misses (e.g. another nvcc build string on
        this machine): the newest cache entry of the same library name."""
        spec = C.library_spec(cfg)
        hits = sorted(jit.cache_dir().glob(f"nvcc/{spec.name}-*/lib{spec.name}.so"), key=lambda p: p.stat().st_mtime)
        if not hits:
            raise FileNotFoundError(f"{spec.name}: not in {jit.cache_dir()} (run with --allow-build)")
        lib = C.CutlassLibrary(ctypes.CDLL(str(hits[-1])), spec.name)
        C._LIBS[(cfg, torch.bfloat16)] = lib  # the op and cutlass_mm find it there
        report["notes"].append(f"{spec.name} loaded by name from {hits[-1].parent.name} "
                                f"(key {spec.key[:16]} missed: toolchain or sources differ)")
        return lib, str(hits[-1])

    for name, cfg in C.CONFIGS.items():
        def load(cfg=cfg, name=name):
            try:
                libs[name] = C.load_library(cfg)
                lib_paths[name] = str(C.library_spec(cfg).path)
            except jit.BuildDisabledError:
                libs[name], lib_paths[name] = load_by_name(cfg)
            return libs[name].describe()
        desc = guard(f"load {name}", load)
        if desc:
            log(f"  {name:<32} {desc}")
    report["libraries"] = {n: lib_paths.get(n, "missing") for n in C.CONFIGS}

    # 2. correctness + timing
    tcfg = TimingConfig.for_device(dev, quick=True)
    ms = (4, 64, 512) if args.smoke else QUICK_MS if args.quick else MS
    block = [128, 128]

    def cfg_relevant(cfg, m):
        return m <= 512 if cfg.swap_ab else m >= 64

    def table_op(a, b, sa, sb):
        """The op as users call it, the backend forced to cutlass (its table picks the config)."""
        with scaledmm.use_backend("fp8_block", "cutlass"):
            return torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)

    def rand_fp8(shape):
        return torch.randn(shape, device=dev).clamp(-448, 448).to(torch.float8_e4m3fn)

    for n, k in shapes:
        for m in ms:
            if time.perf_counter() - T0 > BUDGET_S:
                report["errors"].append(f"time budget: skipped {n}x{k} M={m}")
                continue
            kb, nb = k // 128, math.ceil(n / 128)
            fp8_bytes = m * k + n * k + 4 * (m * kb + nb * kb)
            copies = copies_for(fp8_bytes, tcfg)
            ops = [(rand_fp8((m, k)), rand_fp8((n, k)), (torch.rand(kb, m, device=dev) + 0.05).t(),
                    torch.rand(nb, kb, device=dev) + 0.05) for _ in range(copies)]
            a, b, sa, sb = ops[0]
            sa64 = sa.double().repeat_interleave(128, 1)
            sb64 = sb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
            ref = (a.double() * sa64) @ (b.double() * sb64).t()
            del sa64, sb64
            providers = {
                "cublas": lambda a, b, sa, sb: base.cublas_mm(a, b, sa, sb, block, torch.bfloat16),
                "table": table_op,
            }
            if m >= 512:  # the table's choice fed row-major scales (a layout copy for TMA configs)
                providers["table_rowscales"] = table_op
            for name, cfg in C.CONFIGS.items():
                if name in libs and cfg_relevant(cfg, m):
                    providers[name] = (lambda cfg: lambda a, b, sa, sb:
                                       C.cutlass_mm(a, b, sa, sb, block, torch.bfloat16, cfg))(cfg)
            point = {"n": n, "k": k, "m": m, "copies": copies, "us": {}, "err": {}, "notes": {}}
            for pname, fn in providers.items():
                def one(pname=pname, fn=fn):
                    use = ops
                    if pname == "table_rowscales":
                        use = [(x, w, s.contiguous(), t) for x, w, s, t in ops]
                    out = fn(*use[0])
                    err = float((out.double() - ref).norm() / ref.norm())
                    point["err"][pname] = err
                    if not (err < TOL) or torch.isnan(out).any():
                        raise AssertionError(f"{pname} {n}x{k} M={m}: rel err {err:.3e} (or NaN)")
                    t = measure([lambda o=o: fn(*o) for o in use], dev, tcfg)
                    point["us"][pname] = t.median_us
                    if t.note:
                        point["notes"][pname] = t.note
                guard(f"{pname} {n}x{k} M={m}", one)
            ops = a = b = sa = sb = ref = None  # free before the next point
            # bf16 F.linear on its own (bf16) copies
            def bf16():
                bc = copies_for(2 * (m * k + n * k), tcfg)
                xs = [(torch.randn(m, k, device=dev, dtype=torch.bfloat16),
                       torch.randn(n, k, device=dev, dtype=torch.bfloat16)) for _ in range(bc)]
                point["us"]["bf16"] = measure([lambda x=x, w=w: F.linear(x, w) for x, w in xs], dev, tcfg).median_us
            guard(f"bf16 {n}x{k} M={m}", bf16)
            report["points"].append(point)
            best = min(((v, p) for p, v in point["us"].items() if p in C.CONFIGS), default=(math.nan, "-"))
            log(f"{n:>6}x{k:<6} M={m:<5} cublas {point['us'].get('cublas', math.nan):8.1f} us  "
                f"table {point['us'].get('table', math.nan):8.1f}  best {best[1]} {best[0]:8.1f}  "
                f"bf16 {point['us'].get('bf16', math.nan):8.1f}")
            torch.cuda.empty_cache()

    # 3. launch knobs at M = 4096 for the large-M configs
    if not (args.quick or args.smoke):
        for n, k in [(7168, 16384), (4096, 7168), (24576, 1536)]:
            if time.perf_counter() - T0 > BUDGET_S + 10:
                break
            m = 4096
            kb, nb = k // 128, math.ceil(n / 128)
            copies = copies_for(m * k + n * k, tcfg)
            ops = [(rand_fp8((m, k)), rand_fp8((n, k)), (torch.rand(kb, m, device=dev) + 0.05).t(),
                    torch.rand(nb, kb, device=dev) + 0.05) for _ in range(copies)]
            for name in ("coop128x128_c1x2", "coop128x128_c2x1", "pp64x128_c1x2"):
                if name not in libs:
                    continue
                for sw in (1, 2, 4, 8):
                    for raster in ("heuristic", "m", "n"):
                        cfg = dataclasses.replace(C.CONFIGS[name], swizzle=sw, raster=raster)

                        def knob(cfg=cfg):
                            t = measure([lambda o=o: C.cutlass_mm(*o, block, torch.bfloat16, cfg) for o in ops],
                                        dev, tcfg)
                            report["knobs"].append({"n": n, "k": k, "m": m, "config": cfg.name,
                                                    "us": t.median_us})
                        guard(f"knob {cfg.name}", knob)
            ops = None
            torch.cuda.empty_cache()

    # 4. compute-sanitizer
    left = 150.0 - (time.perf_counter() - T0) - 5
    if not args.smoke:
        report["sanitizer"] = guard("sanitizer", lambda: run_sanitizer(lib_paths, max(left, 20.0)))
    log(f"sanitizer: {report.get('sanitizer')}")

    # report
    lines = ["", "FP8 block CUTLASS (us, cold L2; TF = TFLOP/s; x = cuBLAS us / ours):",
             f"{'N x K':>13} {'M':>5} {'cuBLAS':>8} {'bf16':>8} {'table':>8} {'x':>5} "
             f"{'best config':<30} {'us':>8} {'TF':>6} {'x':>5}"]
    for p in report["points"]:
        us = p["us"]
        cands = [(v, name) for name, v in us.items() if name in C.CONFIGS]
        bv, bn = min(cands) if cands else (math.nan, "-")
        cb, auto = us.get("cublas", math.nan), us.get("table", math.nan)
        tf = 2 * p["m"] * p["n"] * p["k"] / (bv * 1e-6) / 1e12 if cands else math.nan
        lines.append(f"{p['n']:>6}x{p['k']:<6} {p['m']:>5} {cb:8.1f} {us.get('bf16', math.nan):8.1f} "
                     f"{auto:8.1f} {cb / auto:5.2f} {bn:<30} {bv:8.1f} {tf:6.0f} {cb / bv:5.2f}")
    at4k = [p for p in report["points"] if p["m"] == 4096]
    if at4k:
        lines += ["", "TFLOP/s at M = 4096 per config:",
                  f"{'config':<32}" + "".join(f"{p['n']}x{p['k']:>6}".rjust(12) for p in at4k)]
        names = sorted({nm for p in at4k for nm in p["us"] if nm in C.CONFIGS or nm in ("cublas", "table", "table_rowscales")})
        for nm in names:
            row = "".join(f"{2 * 4096 * p['n'] * p['k'] / (p['us'][nm] * 1e-6) / 1e12:12.0f}"
                          if nm in p["us"] else f"{'-':>12}" for p in at4k)
            lines.append(f"{nm:<32}{row}")
    if report["knobs"]:
        lines += ["", "Launch knobs at M = 4096 (best 3 per shape):"]
        for n, k in sorted({(r["n"], r["k"]) for r in report["knobs"]}):
            rows = sorted((r["us"], r["config"]) for r in report["knobs"] if (r["n"], r["k"]) == (n, k))[:3]
            lines.append(f"  {n}x{k}: " + ", ".join(f"{c} {u:.1f} us" for u, c in rows))
    # suggested table: per M, the config with the best geometric-mean speedup over cuBLAS
    lines += ["", "Suggested TABLE (geo-mean speedup vs cuBLAS over the shapes):"]
    for m in ms:
        pts = [p for p in report["points"] if p["m"] == m and "cublas" in p["us"]]
        scores = {}
        for nm in C.CONFIGS:
            vals = [p["us"]["cublas"] / p["us"][nm] for p in pts if nm in p["us"]]
            if vals and len(vals) == len(pts):
                scores[nm] = math.exp(sum(map(math.log, vals)) / len(vals))
        if scores:
            top = sorted(scores.items(), key=lambda kv: -kv[1])[:3]
            lines.append(f"  M={m:<5} " + ", ".join(f"{nm} {s:.2f}x" for nm, s in top))
    lines += [f"note: {t}" for t in report["notes"]]
    lines.append(f"errors: {len(report['errors'])}" + "".join(f"\n  {e.splitlines()[0]}" for e in report["errors"]))
    text = "\n".join(lines)
    print(text)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "fp8_block_cutlass.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / "fp8_block_cutlass.txt").write_text(text + "\n")
    log("done")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
