"""GPU check and timing of the fused-A skinny GEMM (``dsv3_fused_a_gemm``, backend
``fused_a``): the TMA-ring kernel (version 2, ``TmaConfig``), the register
kernel (version 1, ``RegConfig``) and ``F.linear`` (cuBLAS).  Run from the
repository root::

    python -m benchmarks.experiments.skinny            # about 2 minutes on one H200
    python -m benchmarks.experiments.skinny --quick    # fewer configs and points

Stages (each guarded: a failure is printed and the rest still runs):

1. environment; floors: device-to-device copy and a read-only stream kernel
   (1 GiB), an empty kernel and a read of exactly the weight's bytes, both as
   CUDA-graph replays like the GEMMs (the practical floor: launch gap + DRAM
   ramp + bytes); how many clusters of each size fit the GPU at once;
2. every instantiation the later stages launch is built up front, in
   parallel processes (NVRTC), into the jit cache;
3. smoke: the tuned configs (and one of each kind: cluster split-K, persistent,
   resident x) launched from child processes with a timeout (a hang or a
   crash cannot take this process down);
4. correctness vs float64 with NaN-poisoned outputs: tuned (with and without
   PDL: bit-identical) and version 1 at every M = 1..16, contiguous and
   strided x (rows 8704 wide, offset 512); every searched config at M = 1
   (strided) and at its bucket's largest M;
5. config search: the candidates (``fused_a.candidate_configs``) of each shape
   and M bucket, timed at the bucket's largest M without and with PDL (a PDL
   launch runs ``pdl_config``: same tiles, ring cut to fit two CTAs per SM);
6. the table: tuned, tuned + PDL (the op, as a model calls it), best searched
   (without / with PDL), version 1's best, F.linear, floors, at M in
   {1, 2, 4, 8, 9, 16}, contiguous and strided;
7. ``compute-sanitizer`` memcheck, racecheck and synccheck on small launches
   of both kernels (child processes without torch).

Timing: cold L2 (each call reads its own copy of the weight; all copies
together exceed twice the L2), one CUDA graph holding one pass over the
copies, replayed many times with events around each replay; per-call time =
replay time / copies; median over replays.  Prints a compact table and a
``TUNING = {...}`` suggestion (ranked by the mean of the times without and
with PDL); details go to ``$OUT/skinny.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


SHAPES = [(2112, 7168), (1536, 7168), (576, 7168), (256, 7168), (24576, 1536)]  # (N, K)
TABLE_M = (1, 2, 4, 8, 9, 16)
STRIDE, OFFSET = 8704, 512
BUDGET_S = 120.0  # after this the search stops; the table still runs
HARD_STOP_S = 150.0  # after this, remaining table points are skipped
T0 = time.perf_counter()

READ_KERNEL = r"""
struct alignas(16) U4 { unsigned int x, y, z, w; };
__device__ __forceinline__ U4 ld_stream(const U4* p) {
  U4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// Reads n16 16-byte words (8 independent loads in flight per thread); writes
// nothing unless the xor of everything hits a magic value.
extern "C" __global__ void __launch_bounds__(256) read_stream(const U4* __restrict__ p, long long n16,
                                                              unsigned int* sink) {
  unsigned int acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n16; i += 8 * stride) {
    U4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = ld_stream(p + i + j * stride);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n16; i += stride) {
    U4 v = ld_stream(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}
"""


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------
# Child process: one launch through raw driver calls, no torch (fast under
# compute-sanitizer; a hang or crash stays in the child)
# ----------------------------------------------------------------------------


def child_launch(cubin_path: str, kernel: str, n: int, k: int, m: int, stride: int, grid: str, block: int,
                 smem: int) -> int:
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
    fn = ok(drv.cuModuleGetFunction(mod, kernel.encode()))
    if smem > 48 * 1024:
        ok(drv.cuFuncSetAttribute(fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                  smem))
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
    cfg.sharedMemBytes = smem
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


def _build(spec) -> str | None:
    """Process-pool worker: compile one spec into the jit cache."""
    try:
        spec.build()
        return None
    except Exception as e:  # reported by the parent
        return f"{spec.name} {dict(spec.defines)}: {type(e).__name__}: {str(e)[:300]}"


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


def small_cases(fa):
    """Small launches of each kind of config: clusters with a partial tile and
    uneven split ranks; version 1; a persistent grid with resident x; a
    persistent grid with x in the ring."""
    return [(48, 1152, 9, fa.TmaConfig(32, 4, 128, 2, 4)), (48, 1152, 9, fa.RegConfig(32, 4, 4, 2, True)),
            (8448, 512, 13, fa.TmaConfig(16, 1, 256, 3, 4, True)), (2112, 7168, 5, fa.TmaConfig(16, 1, 256, 5, 4))]


def collect_specs(fa, sms: int, n_cand: int):
    """The search space per (N, K, M bucket) and every spec any stage launches
    (each config and its PDL variant), keyed by cache key."""
    search, specs = {}, {}

    def add(n, k, mb, cfg):
        for c in (cfg, fa.pdl_config(cfg, n, k, mb)):
            spec = fa.kernel_spec(n, k, mb, c)
            specs.setdefault(spec.key, spec)

    for n, k in SHAPES:
        for mb in fa.M_BUCKETS:
            cands = fa.candidate_configs(n, k, mb, limit=n_cand, num_sms=sms)
            search[(n, k, mb)] = cands
            for cfg in cands + [fa.choose_config(n, k, mb, num_sms=sms), fa.REG_TUNING[(n, k)][mb]]:
                add(n, k, mb, cfg)
    for n, k, m, cfg in small_cases(fa):
        add(n, k, fa.m_bucket(m), cfg)
    return search, specs


def build_all(specs: dict, report: dict) -> None:
    """Compile the specs missing from the jit cache in parallel processes."""
    import multiprocessing

    t = time.perf_counter()
    workers = max(1, min(16, (os.cpu_count() or 2)))
    todo = [s for s in specs.values() if not s.cached()]
    errs = []
    if todo:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            errs = [e for e in ex.map(_build, todo, chunksize=4) if e]
    for e in errs:
        report["errors"].append("build: " + e)
        log("BUILD FAILED " + e[:400])
    log(f"built {len(todo)} of {len(specs)} instantiations in {time.perf_counter() - t:.1f} s ({workers} processes)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--build-only", action="store_true", help="compile every instantiation into the jit cache (no GPU)")
    ap.add_argument("--child", nargs=9, metavar=("CUBIN", "KERNEL", "N", "K", "M", "STRIDE", "GRID", "BLOCK", "SMEM"))
    args = ap.parse_args()
    if args.child:
        c, kern, n, k, m, s, g, b, sm = args.child
        return child_launch(c, kern, int(n), int(k), int(m), int(s), g, int(b), int(sm))

    import torch
    import torch.nn.functional as F

    import scaledmm  # noqa: F401  (registers the ops)
    from scaledmm import jit
    from scaledmm.ops import skinny_fused_a as fa

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report: dict = {"errors": []}
    reps = 12 if args.quick else 25
    n_cand = 10 if args.quick else 24
    if args.build_only:
        build_all(collect_specs(fa, fa.NUM_SMS_H200, n_cand)[1], report)
        return 1 if report["errors"] else 0

    def guard(stage, fn):
        try:
            return fn()
        except Exception as e:
            msg = f"{stage}: {type(e).__name__}: {e}"
            log("FAILED " + msg)
            traceback.print_exc(limit=6)
            report["errors"].append(msg)
            return None

    # 1. environment and floors ------------------------------------------------
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    sms = props.multi_processor_count
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": props.name, "sms": sms,
           "l2_mb": l2 / 2 ** 20, "cap": torch.cuda.get_device_capability(), "nvrtc": jit.nvrtc_available()[1],
           "fused_a": fa.is_supported(torch.device("cuda")), "cache": str(jit.cache_dir())}
    report["env"] = env
    log(f"env {env}")

    tmp = Path(tempfile.mkdtemp(prefix="skinny-bench-"))
    (tmp / "read_stream.cu").write_text(READ_KERNEL)
    read_spec = jit.NvrtcKernelSpec("read_stream", tmp / "read_stream.cu", arch="sm_90a")
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    import ctypes

    def read_call(t: torch.Tensor, ctas: int):
        kern = read_spec.kernel()
        n16 = ctypes.c_longlong(t.numel() * t.element_size() // 16)
        return lambda: kern.launch(ctas, 256, (t, n16, sink))

    def floors():
        src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
        dst = torch.empty_like(src)
        best_copy, best_read = 1e9, 1e9
        for _ in range(3):
            dst.copy_(src)
            read_call(src, sms * 8)()
        torch.cuda.synchronize()
        for _ in range(8):
            for what in ("copy", "read"):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                dst.copy_(src) if what == "copy" else read_call(src, sms * 8)()
                e.record()
                e.synchronize()
                t = s.elapsed_time(e) * 1e-3
                if what == "copy":
                    best_copy = min(best_copy, t)
                else:
                    best_read = min(best_read, t)
        empty = time_graph([read_call(src[:0], sms) for _ in range(20)], reps)
        del src, dst
        torch.cuda.empty_cache()
        return 2 * (1 << 30) / best_copy / 1e12, (1 << 30) / best_read / 1e12, empty

    res = guard("floors", floors) or (4.1, 4.1, float("nan"))
    bw, read_bw, empty_us = res
    report.update(copy_tb_s=bw, read_tb_s=read_bw, empty_graph_us=empty_us)
    log(f"copy {bw:.2f} TB/s (read + write), read-only stream {read_bw:.2f} TB/s, empty kernel in a graph "
        f"{empty_us:.2f} us; 2112x7168 bytes (30.3 MB) at copy rate {30.28e-6 / bw * 1e6:.2f} us, at read rate "
        f"{30.28e-6 / read_bw * 1e6:.2f} us")

    read_floor: dict = {}

    def read_floors():
        for n, k in SHAPES:
            ops = Operands(n, k, 1, False, copies_for(n, k, l2))
            best = min(time_graph([read_call(w, ctas) for w in ops.ws], reps) for ctas in (sms * 2, sms * 8))
            read_floor[(n, k)] = best
            del ops
        torch.cuda.empty_cache()
        log("read of the weight bytes in a graph (practical floor, us): "
            + ", ".join(f"{n}x{k} {t:.2f}" for (n, k), t in read_floor.items()))

    guard("read floors", read_floors)
    report["read_floor_us"] = {f"{n}x{k}": t for (n, k), t in read_floor.items()}

    # 2. build ------------------------------------------------------------------
    search, specs = collect_specs(fa, sms, n_cand)
    build_all(specs, report)

    # 3. smoke in child processes -------------------------------------------------
    SMALL = small_cases(fa)

    def child_cmd(n, k, m, cfg, tool=None):
        mb = fa.m_bucket(m)
        cubin = fa.kernel_spec(n, k, mb, cfg).build()
        gx, gy = cfg.grid(n, sms)
        cmd = [sys.executable, "-m", "benchmarks.experiments.skinny", "--child", str(cubin), cfg.kernel,
               str(n), str(k), str(m), str(k + 64),
               f"{gx},{gy}", str(cfg.threads()), str(cfg.smem_bytes(n, k, mb))]
        return cmd if tool is None else [tool[0], "--tool", tool[1], "--error-exitcode", "3"] + cmd

    def child_smoke():
        jobs = [(n, k, m, fa.choose_config(n, k, m, num_sms=sms)) for n, k in SHAPES for m in (1, 16)]
        jobs += [(n, k, m, cfg) for n, k, m, cfg in SMALL]
        procs = [(j, subprocess.Popen(child_cmd(*j), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                 for j in jobs]
        ok = True
        for (n, k, m, cfg), p in procs:
            try:
                text, _ = p.communicate(timeout=45)
                tail = " | ".join(text.strip().splitlines()[-2:])
                log(f"child smoke {n}x{k} M={m} {cfg.short()}: rc {p.returncode}: {tail}")
                ok &= p.returncode == 0
            except subprocess.TimeoutExpired:
                p.kill()
                log(f"child smoke {n}x{k} M={m} {cfg.short()}: TIMEOUT (kernel hang?)")
                ok = False
        return ok

    launch_ok = guard("child smoke", child_smoke)
    if not launch_ok:
        report["errors"].append("child smoke failed: skipping the in-process stages")

    # 4. correctness ----------------------------------------------------------------
    bad_cfgs: set = set()

    def make_x(m, k, strided):
        if strided:
            return torch.randn(m, STRIDE, device="cuda").to(torch.bfloat16)[:, OFFSET:OFFSET + k]
        return torch.randn(m, k, device="cuda").to(torch.bfloat16)

    def check(x, w, wd, cfg, pdl=False):
        out = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
        fa.launch(x, w, out, pdl, cfg)
        ref = x.double() @ wd.t()
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        return out, rel < 8e-3 and bool(torch.isfinite(out).all()), rel

    def check_all():
        bad, cases = [], 0
        for n, k in SHAPES:
            w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
            wd = w.double()
            for m in range(1, 17):
                for strided in (False, True):
                    x = make_x(m, k, strided)
                    tuned = fa.choose_config(n, k, m, num_sms=sms)
                    out, good, rel = check(x, w, wd, tuned)
                    pdl = torch.ops.scaledmm.dsv3_fused_a_gemm(x, w, True)
                    same = bool(torch.equal(pdl, out))
                    _, good1, rel1 = check(x, w, wd, fa.REG_TUNING[(n, k)][fa.m_bucket(m)])
                    cases += 3
                    if not (good and same and good1):
                        bad.append((n, k, m, strided, f"{rel:.1e}", same, f"v1 {rel1:.1e}"))
            for mb in fa.M_BUCKETS:
                for cfg in search[(n, k, mb)]:
                    for m, strided in ((1, True), (mb, False)):
                        x = make_x(m, k, strided)
                        try:
                            _, good, rel = check(x, w, wd, cfg)
                            _, goodp, relp = check(x, w, wd, fa.pdl_config(cfg, n, k, mb), True)
                        except Exception as e:  # e.g. a failed build: drop the config
                            good, rel, goodp, relp = False, float("nan"), False, float("nan")
                            report["errors"].append(f"correctness {n}x{k} {cfg.short()}: {type(e).__name__}: {e}")
                        cases += 2
                        if not (good and goodp):
                            bad_cfgs.add((n, k, mb, cfg))
                            bad.append((n, k, m, strided, cfg.short(), f"{rel:.1e} / pdl {relp:.1e}"))
            del w, wd
        for n, k, m, cfg in SMALL:
            w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
            for mm in range(1, 17):
                _, good, rel = check(make_x(mm, k, mm % 2 == 1), w, w.double(), cfg, mm % 3 == 0)
                cases += 1
                if not good:
                    bad.append((n, k, mm, cfg.short(), f"{rel:.1e}"))
        torch.cuda.synchronize()
        log(f"correctness: {cases} cases, {len(bad)} bad {bad[:8]}")
        report["correctness_bad"] = bad
        return not bad

    if launch_ok:
        guard("correctness", check_all)

    # 5. config search -------------------------------------------------------------
    best: dict = {}
    rows_search = []

    def run_search():
        for (n, k, mb), cands in search.items():
            if time.perf_counter() - T0 > BUDGET_S:
                log(f"search budget spent: skipping {n}x{k} M={mb}")
                continue
            ops = Operands(n, k, mb, False, copies_for(n, k, l2))
            idx = range(len(ops.ws))
            results = []
            for cfg in cands:
                if (n, k, mb, cfg) in bad_cfgs:
                    continue
                pcfg = fa.pdl_config(cfg, n, k, mb)
                try:
                    us = time_graph([lambda i=i, c=cfg, o=ops: fa.launch(o.xs[i], o.ws[i], o.outs[i], False, c)
                                     for i in idx], reps)
                    usp = time_graph([lambda i=i, c=pcfg, o=ops: fa.launch(o.xs[i], o.ws[i], o.outs[i], True, c)
                                      for i in idx], reps)
                except Exception as e:
                    report["errors"].append(f"search {n}x{k} mb{mb} {cfg.short()}: {e}")
                    continue
                results.append(((us + usp) / 2, us, usp, cfg))
                rows_search.append({"n": n, "k": k, "mb": mb, "cfg": cfg.short(), "us": us, "pdl_us": usp,
                                    "smem": cfg.smem_bytes(n, k, mb), "pdl_smem": pcfg.smem_bytes(n, k, mb)})
            results.sort(key=lambda r: r[0])
            if results:
                best[(n, k, mb)] = results[0][3]
                log(f"search {n}x{k} M={mb} (no PDL / PDL us): "
                    + ", ".join(f"{c.short()} {u:.2f}/{p:.2f}" for _, u, p, c in results[:7]))
            del ops
            torch.cuda.empty_cache()

    if launch_ok:
        guard("search", run_search)
    report["search"] = rows_search

    # 6. table -----------------------------------------------------------------------
    table = []

    def run_table():
        for n, k in SHAPES:
            floor = n * k * 2 / (bw * 1e12) * 1e6  # weight bytes at the copy's DRAM throughput
            for strided in (False, True):
                for m in (TABLE_M if not args.quick else (1, 8, 9, 16)):
                    if time.perf_counter() - T0 > HARD_STOP_S:
                        report["errors"].append(f"table {n}x{k} M={m}: skipped (time)")
                        continue
                    ops = Operands(n, k, m, strided, copies_for(n, k, l2))
                    idx = range(len(ops.ws))
                    mb = fa.m_bucket(m)
                    tuned = fa.choose_config(n, k, m, num_sms=sms)
                    bcfg = best.get((n, k, mb), tuned)
                    v1 = fa.REG_TUNING[(n, k)][mb]
                    row = {"n": n, "k": k, "m": m, "strided": strided, "tuned_cfg": tuned.short(),
                           "best_cfg": bcfg.short(), "floor_us": floor, "read_us": read_floor.get((n, k), float("nan"))}

                    def calls(cfg, pdl, o=ops):
                        return [lambda i=i: fa.launch(o.xs[i], o.ws[i], o.outs[i], pdl, cfg) for i in idx]

                    variants = {
                        "tuned": calls(tuned, False),
                        "pdl": [lambda i=i, o=ops: torch.ops.scaledmm.dsv3_fused_a_gemm(o.xs[i], o.ws[i], True)
                                for i in idx],
                        "best": calls(bcfg, False),
                        "bestp": calls(fa.pdl_config(bcfg, n, k, mb), True),
                        "v1": calls(v1, False),
                        "linear": [lambda i=i, o=ops: F.linear(o.xs[i], o.ws[i]) for i in idx],
                    }
                    for name, cl in variants.items():
                        try:
                            row[name] = time_graph(cl, reps)
                        except Exception as e:
                            row[name] = float("nan")
                            report["errors"].append(f"table {n}x{k} M={m} {name}: {e}")
                    table.append(row)
                    del ops
            torch.cuda.empty_cache()

    if launch_ok:
        guard("table", run_table)
    report["table"] = table

    # 7. compute-sanitizer ------------------------------------------------------------
    def sanitize():
        san = shutil.which("compute-sanitizer")
        for cand in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
            if not san and Path(cand).exists():
                san = cand
        if not san:
            report["sanitizer"] = "compute-sanitizer not found"
            log("compute-sanitizer: not found")
            return
        res = {}
        jobs = [(tool, j) for j in SMALL[:3] for tool in ("memcheck", "racecheck", "synccheck")]
        procs = [(tool, j, subprocess.Popen(child_cmd(*j, tool=(san, tool)), stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)) for tool, j in jobs]
        for tool, (n, k, m, cfg), p in procs:
            key = f"{tool} {n}x{k} M={m} {cfg.short()}"
            try:
                text, _ = p.communicate(timeout=60)
                tail = text.strip().splitlines()[-3:]
                res[key] = {"rc": p.returncode, "tail": tail}
                log(f"compute-sanitizer {key}: rc {p.returncode}: {' | '.join(tail)}")
            except subprocess.TimeoutExpired:
                p.kill()
                res[key] = {"rc": None, "tail": ["timeout 60 s"]}
                log(f"compute-sanitizer {key}: timeout")
        report["sanitizer"] = res

    guard("sanitizer", sanitize)

    # Report --------------------------------------------------------------------------
    def occupancy():
        """Clusters of each tuned split-K config that fit the GPU at once (vs needed)."""
        from scaledmm.jit import cuda_driver

        drv = cuda_driver()
        lines = []
        for n, k in SHAPES:
            for mb in fa.M_BUCKETS:
                for pdl in (False, True):
                    cfg = best.get((n, k, mb)) or fa.choose_config(n, k, mb, num_sms=sms)
                    cfg = fa.pdl_config(cfg, n, k, mb) if pdl else cfg
                    if not isinstance(cfg, fa.TmaConfig) or cfg.split_k == 1:
                        continue
                    kern = fa.kernel_spec(n, k, mb, cfg).kernel()
                    fn = kern.function(torch.cuda.current_device())
                    lc = drv.CUlaunchConfig()
                    gx, gy = cfg.grid(n, sms)
                    lc.gridDimX, lc.gridDimY, lc.gridDimZ = gx, gy, 1
                    lc.blockDimX, lc.blockDimY, lc.blockDimZ = cfg.threads(), 1, 1
                    lc.sharedMemBytes = cfg.smem_bytes(n, k, mb)
                    lc.numAttrs = 0
                    err, count = drv.cuOccupancyMaxActiveClusters(fn, lc)
                    lines.append(f"{n}x{k} mb{mb} {cfg.short()}{' pdl' if pdl else ''}: {count} clusters of "
                                 f"{cfg.split_k} fit, grid needs {gx} (err {int(err)})")
        for line in lines:
            log("occupancy " + line)
        report["cluster_occupancy"] = lines

    if launch_ok:
        guard("occupancy", occupancy)

    suggestion = {}
    for (n, k, mb), cfg in best.items():
        suggestion.setdefault((n, k), {})[mb] = cfg

    def cfg_src(c):
        if isinstance(c, fa.TmaConfig):
            return (f"T({c.rows}, {c.split_k}, {c.chunk}, {c.stages}, {c.warps}"
                    + (f", {c.x_resident}" if c.x_resident or c.ctas_per_sm != 1 else "")
                    + (f", {c.ctas_per_sm}" if c.ctas_per_sm != 1 else "") + ")")
        return f"RegConfig({c.rows}, {c.warps}, {c.split_k}, {c.unroll}, {c.prefetch})"

    lines = ["TUNING = {"]
    for (n, k), d in suggestion.items():
        items = ", ".join(f"{mb}: {cfg_src(c)}" for mb, c in sorted(d.items()))
        lines.append(f"    ({n}, {k}): {{{items}}},")
    lines.append("}")
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "skinny.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / "skinny_tuning.py").write_text("\n".join(lines) + "\n")

    print(f"\n== dsv3_fused_a_gemm on {env['gpu']} (copy {bw:.2f} TB/s, read {read_bw:.2f} TB/s, empty kernel "
          f"{empty_us:.2f} us; us per call, CUDA graph, cold L2) ==")
    print("floor = weight bytes at the copy rate; read = a read-only kernel of the same bytes in the same graph; "
          "x lin = linear / min(tuned, pdl)")
    print(f"{'N x K':>11} {'M':>2} {'lay':>3} {'tuned':>6} {'pdl':>6} {'best':>6} {'bestp':>6} {'v1':>6} "
          f"{'linear':>6} {'x lin':>6} {'floor':>6} {'read':>6} {'%flr':>5}  tuned / best cfg")
    for r in table:
        fast = min(r["tuned"], r["pdl"])
        print(f"{r['n']:>5}x{r['k']:<5} {r['m']:>2} {'str' if r['strided'] else 'con':>3} {r['tuned']:6.2f} "
              f"{r['pdl']:6.2f} {r['best']:6.2f} {r['bestp']:6.2f} {r['v1']:6.2f} {r['linear']:6.2f} "
              f"{r['linear'] / fast:5.2f}x {r['floor_us']:6.2f} {r['read_us']:6.2f} "
              f"{100 * r['floor_us'] / fast:4.0f}%  {r['tuned_cfg']} / {r['best_cfg']}")
    print("\n".join(lines))
    if report["errors"]:
        print(f"{len(report['errors'])} errors:")
        for e in report["errors"][:12]:
            print("  " + e[:300])
    print(f"total {time.perf_counter() - T0:.0f} s")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
