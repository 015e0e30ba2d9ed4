"""GPU check and timing of the fused-A skinny GEMM (``dsv3_fused_a_gemm``, backend
``fused_a``) against ``F.linear`` (cuBLAS).  Run from the repository root::

    python benchmarks/device_skinny.py            # ~1.5-2.5 min on one H200
    python benchmarks/device_skinny.py --quick    # fewer configs and points

Stages (each guarded: a failure is printed and the rest still runs):

1. environment, and the device-memory ceiling (1 GiB device-to-device copy);
2. correctness of the tuned config of every shape at M = 1..16, contiguous and
   strided x (rows 8704 wide, offset 512), NaN-poisoned outputs, vs float64;
   PDL on == off bit for bit;
3. config search: the candidate configs (``fused_a.candidate_configs``) of each
   shape and M bucket, timed at the bucket's largest M;
4. the table: tuned config, best searched config, tuned + PDL, and F.linear at
   M in {1, 2, 4, 8, 9, 16}, contiguous and strided;
5. ``compute-sanitizer`` memcheck and racecheck on one small launch (a child
   process without torch).

Timing: cold L2 (each call reads its own copy of the weight; all copies
together exceed twice the L2), one CUDA graph holding one pass over the copies,
replayed many times with events around each replay; per-call time = replay
time / copies; median over replays.  Details go to ``$OUT/skinny.json`` and a
suggested tuning table to ``$OUT/skinny_tuning.py`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = [(2112, 7168), (1536, 7168), (576, 7168), (256, 7168), (24576, 1536)]  # (N, K)
TABLE_M = (1, 2, 4, 8, 9, 16)
STRIDE, OFFSET = 8704, 512
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------
# Sanitizer child: no torch, raw driver calls (fast under compute-sanitizer)
# ----------------------------------------------------------------------------


def sanitizer_child(cubin_path: str, n: int, k: int, m: int, stride: int, grid: str, block: int) -> int:
    import ctypes

    import numpy as np
    from cuda.bindings import driver as drv

    def ok(res):
        err, *vals = res
        if int(err) != 0:
            raise RuntimeError(f"CUDA error {err}")
        return vals[0] if len(vals) == 1 else vals

    ok(drv.cuInit(0))
    dev = ok(drv.cuDeviceGet(0))
    ctx = ok(drv.cuDevicePrimaryCtxRetain(dev))
    ok(drv.cuCtxSetCurrent(ctx))
    mod = ok(drv.cuModuleLoadData(Path(cubin_path).read_bytes()))
    fn = ok(drv.cuModuleGetFunction(mod, b"dsv3_fused_a_gemm"))
    rng = np.random.default_rng(0)

    def bf16(a):
        bits = a.astype(np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)

    xb = bf16(rng.standard_normal((m, stride)))
    wb = bf16(rng.standard_normal((n, k)) / k ** 0.5)
    dx = ok(drv.cuMemAlloc(xb.nbytes))
    dw = ok(drv.cuMemAlloc(wb.nbytes))
    do = ok(drv.cuMemAlloc(m * n * 2))
    ok(drv.cuMemcpyHtoD(dx, xb.ctypes.data, xb.nbytes))
    ok(drv.cuMemcpyHtoD(dw, wb.ctypes.data, wb.nbytes))
    ok(drv.cuMemsetD16(do, 0x7FC0, m * n))  # NaN
    gx, gy = (int(v) for v in grid.split(","))
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes = 0
    cfg.hStream = drv.CUstream(0)
    cfg.numAttrs = 0
    args = ((int(dx), int(dw), int(do), m, stride),
            (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong))
    ok(drv.cuLaunchKernelEx(cfg, fn, args, 0))
    ok(drv.cuCtxSynchronize())
    ob = np.empty((m, n), dtype=np.uint16)
    ok(drv.cuMemcpyDtoH(ob.ctypes.data, do, ob.nbytes))
    out = (ob.astype(np.uint32) << 16).view(np.float32)
    x = (xb[:, :k].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    w = (wb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    ref = x @ w.T
    rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    print(f"child: rel err {rel:.2e}, finite {bool(np.isfinite(out).all())}")
    return 0 if rel < 1e-2 and np.isfinite(out).all() else 1


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def time_graph(calls, reps: int) -> float:
    """Median per-call microseconds of a CUDA graph holding ``calls`` once each."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        g.replay()
        e.record()
    torch.cuda.synchronize()
    per = [s.elapsed_time(e) * 1e3 / len(calls) for s, e in ev]
    del g
    return statistics.median(per)


class Operands:
    """Rotating weight / activation / output copies for one (N, K, M, layout)."""

    def __init__(self, n: int, k: int, m: int, strided: bool, copies: int):
        import torch

        self.n, self.k, self.m = n, k, m
        self.ws = [(torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
        if strided:
            bufs = [torch.randn(m, max(STRIDE, k + OFFSET), device="cuda").to(torch.bfloat16) for _ in range(copies)]
            self.xs = [b[:, OFFSET:OFFSET + k] for b in bufs]
        else:
            self.xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        self.outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]


def copies_for(n: int, k: int, l2_bytes: int) -> int:
    return max(3, min(64, -(-2 * l2_bytes // (n * k * 2)) + 1))


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize-child", nargs=7, metavar=("CUBIN", "N", "K", "M", "STRIDE", "GRID", "BLOCK"))
    args = ap.parse_args()
    if args.sanitize_child:
        c, n, k, m, s, g, b = args.sanitize_child
        return sanitizer_child(c, int(n), int(k), int(m), int(s), g, int(b))

    import torch
    import torch.nn.functional as F

    import scaledmm  # noqa: F401  (registers the ops)
    from scaledmm import jit
    from scaledmm.ops import skinny_fused_a as fa

    # clusters of 4 (DSMEM reduction), a partial 32-row tile (N = 48), partial
    # unit batches (36 units / 4 CTAs = 9 per CTA, batches of 2), L2 prefetch
    SMALL_CFG = fa.FusedAConfig(32, 4, 4, 2, True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report: dict = {"errors": []}
    reps = 10 if args.quick else 25
    n_cand = 6 if args.quick else 10

    def guard(stage, fn):
        try:
            return fn()
        except Exception as e:
            msg = f"{stage}: {type(e).__name__}: {e}"
            log("FAILED " + msg)
            traceback.print_exc(limit=6)
            report["errors"].append(msg)
            return None

    # 1. environment -----------------------------------------------------------
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": props.name,
           "sms": props.multi_processor_count, "l2_mb": l2 / 2 ** 20, "cap": torch.cuda.get_device_capability(),
           "nvrtc": jit.nvrtc_available()[1], "fused_a": fa.is_supported(torch.device("cuda")),
           "cache": str(jit.cache_dir())}
    report["env"] = env
    log(f"env {env}")

    def copy_bw():
        src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e) * 1e-3)
        return 2 * src.numel() * 2 / best / 1e12

    bw = guard("copy bandwidth", copy_bw) or 4.2
    report["copy_tb_s"] = bw
    log(f"device-to-device copy: {bw:.2f} TB/s (read + write); floor(30.3 MB) = {30.3e-6 / bw * 1e6:.2f} us")

    # Smoke 1: raw-driver launches in a child process with a timeout (a hung
    # or crashing kernel cannot take this process down with it).
    def child_smoke():
        ok = True
        for n, k, m, cfg in [(2112, 7168, 16, fa.choose_config(2112, 7168, 16)),
                             (2112, 7168, 1, fa.choose_config(2112, 7168, 1)),
                             (48, 1152, 9, SMALL_CFG)]:
            cubin = fa.kernel_spec(n, k, fa.m_bucket(m), cfg).build()
            gx, gy = cfg.grid(n)
            cmd = [sys.executable, __file__, "--sanitize-child", str(cubin), str(n), str(k), str(m), str(k + 64),
                   f"{gx},{gy}", str(32 * cfg.warps)]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
                tail = " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
                log(f"child smoke {n}x{k} M={m} {cfg.short()}: rc {p.returncode}: {tail}")
                ok &= p.returncode == 0
            except subprocess.TimeoutExpired:
                log(f"child smoke {n}x{k} M={m} {cfg.short()}: TIMEOUT (kernel hang?)")
                ok = False
        return ok

    launch_ok = guard("child smoke", child_smoke)
    if not launch_ok:
        report["errors"].append("child smoke failed: skipping the in-process stages")

    # Smoke 2: one launch through torch with a clear error if the launch path is broken.
    def smoke():
        x = torch.randn(3, 1024, device="cuda").to(torch.bfloat16)
        w = torch.randn(256, 1024, device="cuda").to(torch.bfloat16)
        out = torch.full((3, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
        fa.launch(x, w, out)
        torch.cuda.synchronize()
        rel = ((out.double() - x.double() @ w.double().t()).norm() / (x.double() @ w.double().t()).norm()).item()
        log(f"smoke launch rel err {rel:.2e}")
        assert rel < 1e-2, rel

    if launch_ok:
        guard("smoke", smoke)

    # Compile every spec we will use, in parallel threads (NVRTC), into the cache.
    search: dict = {}
    specs = []
    for n, k in SHAPES:
        for mb in fa.M_BUCKETS:
            cands = fa.candidate_configs(n, k, mb, limit=n_cand)
            search[(n, k, mb)] = cands
            specs += [fa.kernel_spec(n, k, mb, c) for c in cands]
            specs.append(fa.kernel_spec(n, k, mb, fa.choose_config(n, k, mb)))
    t = time.perf_counter()

    def build(spec):
        try:
            spec.build()
            return None
        except Exception as e:
            return f"{spec.name} {dict(spec.defines)}: {e}"

    with ThreadPoolExecutor(max(1, min(16, (os.cpu_count() or 2)))) as ex:
        errs = [e for e in ex.map(build, list(dict.fromkeys(specs))) if e]
    for e in errs:
        report["errors"].append("build: " + e)
        log("BUILD FAILED " + e[:400])
    log(f"built {len(set(specs))} instantiations in {time.perf_counter() - t:.1f} s")

    # 2. correctness -------------------------------------------------------------
    def check_all():
        bad = []
        for n, k in SHAPES:
            w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
            for m in range(1, 17):
                for strided in (False, True):
                    if strided:
                        x = torch.randn(m, STRIDE, device="cuda").to(torch.bfloat16)[:, OFFSET:OFFSET + k]
                    else:
                        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    fa.launch(x, w, out)
                    ref = x.double() @ w.double().t()
                    rel = ((out.double() - ref).norm() / ref.norm()).item()
                    finite = bool(torch.isfinite(out).all())
                    pdl = torch.ops.scaledmm.dsv3_fused_a_gemm(x, w, True)
                    same = bool(torch.equal(pdl, out))
                    if not (rel < 8e-3 and finite and same):
                        bad.append((n, k, m, strided, rel, finite, same))
        torch.cuda.synchronize()
        log(f"correctness: {len(SHAPES) * 32} cases, {len(bad)} bad {bad[:6]}")
        report["correctness_bad"] = bad
        return not bad

    if launch_ok:
        guard("correctness", check_all)

    # 3. config search ----------------------------------------------------------
    best: dict = {}
    rows_search = []

    def run_search():
        for (n, k, mb), cands in search.items():
            ops = Operands(n, k, mb, False, copies_for(n, k, l2))
            results = []
            for cfg in cands:
                try:
                    us = time_graph([lambda i=i, cfg=cfg, o=ops: fa.launch(o.xs[i], o.ws[i], o.outs[i], False, cfg)
                                     for i in range(len(ops.ws))], reps)
                except Exception as e:
                    report["errors"].append(f"search {n}x{k} mb{mb} {cfg.short()}: {e}")
                    continue
                results.append((us, cfg))
                rows_search.append({"n": n, "k": k, "mb": mb, "cfg": cfg.short(), "us": us})
            results.sort(key=lambda r: r[0])
            if results:
                best[(n, k, mb)] = results[0][1]
                log(f"search {n}x{k} M={mb}: " + ", ".join(f"{c.short()} {u:.2f}" for u, c in results[:6]))
            del ops
            torch.cuda.empty_cache()

    if launch_ok:
        guard("search", run_search)
    report["search"] = rows_search

    # 4. table -------------------------------------------------------------------
    table = []

    def run_table():
        for n, k in SHAPES:
            floor = n * k * 2 / (bw * 1e12) * 1e6  # weight bytes at the copy's DRAM throughput
            for strided in (False, True):
                ms = TABLE_M if not args.quick else (1, 8, 9, 16)
                for m in ms:
                    ops = Operands(n, k, m, strided, copies_for(n, k, l2))
                    idx = range(len(ops.ws))
                    tuned = fa.choose_config(n, k, m)
                    bcfg = best.get((n, k, fa.m_bucket(m)), tuned)
                    row = {"n": n, "k": k, "m": m, "strided": strided, "tuned_cfg": tuned.short(),
                           "best_cfg": bcfg.short(), "floor_us": floor}
                    variants = {
                        "tuned": [lambda i=i, o=ops, c=tuned: fa.launch(o.xs[i], o.ws[i], o.outs[i], False, c)
                                  for i in idx],
                        "best": [lambda i=i, o=ops, c=bcfg: fa.launch(o.xs[i], o.ws[i], o.outs[i], False, c)
                                 for i in idx],
                        "pdl": [lambda i=i, o=ops: torch.ops.scaledmm.dsv3_fused_a_gemm(o.xs[i], o.ws[i], True)
                                for i in idx],
                        "linear": [lambda i=i, o=ops: F.linear(o.xs[i], o.ws[i]) for i in idx],
                    }
                    for name, calls in variants.items():
                        try:
                            row[name] = time_graph(calls, reps)
                        except Exception as e:
                            row[name] = float("nan")
                            report["errors"].append(f"table {n}x{k} M={m} {name}: {e}")
                    table.append(row)
                    del ops
            torch.cuda.empty_cache()

    if launch_ok:
        guard("table", run_table)
    report["table"] = table

    # 5. compute-sanitizer --------------------------------------------------------
    def sanitize():
        san = shutil.which("compute-sanitizer")
        for cand in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
            if not san and Path(cand).exists():
                san = cand
        if not san:
            report["sanitizer"] = "compute-sanitizer not found"
            log("compute-sanitizer: not found")
            return
        n, k, m = 48, 1152, 9
        cfg = SMALL_CFG
        spec = fa.kernel_spec(n, k, fa.m_bucket(m), cfg)
        cubin = spec.build()
        gx, gy = cfg.grid(n)
        res = {}
        for tool in ("memcheck", "racecheck"):
            cmd = [san, "--tool", tool, "--error-exitcode", "3", sys.executable, __file__, "--sanitize-child",
                   str(cubin), str(n), str(k), str(m), str(k + 64), f"{gx},{gy}", str(32 * cfg.warps)]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=40)
                tail = (p.stdout + p.stderr).strip().splitlines()[-4:]
                res[tool] = {"rc": p.returncode, "tail": tail}
                log(f"compute-sanitizer {tool}: rc {p.returncode}: {' | '.join(tail)}")
            except subprocess.TimeoutExpired:
                res[tool] = {"rc": None, "tail": ["timeout 40 s"]}
                log(f"compute-sanitizer {tool}: timeout")
        report["sanitizer"] = res

    guard("sanitizer", sanitize)

    # Report ----------------------------------------------------------------------
    suggestion = {}
    for (n, k, mb), cfg in best.items():
        suggestion.setdefault((n, k), {})[mb] = cfg
    lines = ["TUNING = {"]
    for (n, k), d in suggestion.items():
        items = ", ".join(f"{mb}: FusedAConfig({c.rows}, {c.warps}, {c.split_k}, {c.unroll}, {c.prefetch})"
                          for mb, c in sorted(d.items()))
        lines.append(f"    ({n}, {k}): {{{items}}},")
    lines.append("}")
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "skinny.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / "skinny_tuning.py").write_text("\n".join(lines) + "\n")

    print("\n== dsv3_fused_a_gemm on", env["gpu"], f"(copy {bw:.2f} TB/s; us, median per call, "
          "CUDA graph, cold L2) ==")
    print(f"{'N x K':>11} {'M':>2} {'lay':>4} {'tuned':>6} {'best':>6} {'pdl':>6} {'linear':>7} "
          f"{'x lin':>6} {'floor':>6} {'TB/s':>5}  tuned / best cfg")
    for r in table:
        tb = r["n"] * r["k"] * 2 / (r["tuned"] * 1e-6) / 1e12 if r["tuned"] == r["tuned"] else float("nan")
        print(f"{r['n']:>5}x{r['k']:<5} {r['m']:>2} {'str' if r['strided'] else 'con':>4} {r['tuned']:6.2f} "
              f"{r['best']:6.2f} {r['pdl']:6.2f} {r['linear']:7.2f} {r['linear'] / r['tuned']:5.2f}x "
              f"{r['floor_us']:6.2f} {tb:5.2f}  {r['tuned_cfg']} / {r['best_cfg']}")
    print("\n".join(lines))
    if report["errors"]:
        print(f"{len(report['errors'])} errors:")
        for e in report["errors"][:12]:
            print("  " + e[:300])
    print(f"total {time.perf_counter() - T0:.0f} s")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
