"""GPU check and timing of the NVFP4 Triton kernels (backend ``triton``,
``ops/nvfp4_triton.py``) against bf16 ``F.linear`` (cuBLAS).  Run from the
repository root::

    python -m benchmarks.experiments.nvfp4            # < 2 min on one H200
    python -m benchmarks.experiments.nvfp4 --quick    # fewer configs
    python -m benchmarks.experiments.nvfp4 --ms 48,64 --table-only   # one M bucket's sweep
    TRITON_INTERPRET=1 python -m benchmarks.experiments.nvfp4 --smoke   # CPU dry run of the script

Stages (each guarded: a failure is printed and the rest still runs):

1. environment and the copy-bandwidth ceiling (device-to-device copy);
2. compile every kernel the run needs in a pool of processes (Triton's disk
   cache then serves the timing process);
3. correctness: quantizer bit-exact vs ``ops.nvfp4.reference_quant`` (both
   layouts); GEMMs of every decoder (ptx, ptx_direct, triton) x operand type
   (W4A4, W4A16 bf16 / fp16) x split-K vs float64 on the decoded operands,
   tiny (subnormal) block scales included;
4. quantizer bandwidth at M = 4096, K = 7168 vs the copy ceiling;
5. the table: llama8b shapes x M in {1, 4, 16, 128, 1024, 4096}: F.linear,
   the default config of each op, the best of a few candidates per M bucket
   (each checked against float64 on up to 64 rows).

Timing: cold L2 (each call reads its own copy of the weight, all copies
together > 64 MB), one CUDA graph holding one pass over the copies, replayed
with events around each replay; per-call time = replay time / copies; median.
Details go to ``$OUT/nvfp4.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path


SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # llama8b (N, K)
TABLE_M = (1, 4, 16, 128, 1024, 4096)
QUANT_SHAPES = ((4096, 7168), (16, 7168), (4096, 4096))  # (M, K)
DEV = "cuda"  # "cpu" with --smoke (Triton interpreter, tiny shapes, wall-clock "timings")
ROTATE_BYTES = 64 << 20
CHECK_NK = (1000, 4096)  # correctness stage: N not a multiple of 16 or of any tile
TABLE_TOL = 5e-3  # table outputs are bf16 (exactness is checked in fp32 by the correctness stage)
T0 = time.perf_counter()
DEADLINE_S = 105.0  # stop sweeping candidates after this; the table is still printed


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def stage(name):
    def wrap(fn):
        def run(*a, **kw):
            log(f"== {name}")
            try:
                return fn(*a, **kw)
            except Exception:
                log(f"!! {name} failed:\n{traceback.format_exc()}")
                return None
        return run
    return wrap


# ----------------------------------------------------------------------------
# Configs compared
# ----------------------------------------------------------------------------


def candidates(bucket: int, quick: bool):
    """``(op, GemmConfig, split policy)`` tried in an M bucket; policy "auto" is
    the default split-K heuristic, "x2" twice that, "half" half of it."""
    from scaledmm.ops.nvfp4_triton import GemmConfig as G

    if bucket == 0:
        base = [G(64, 16, 128, num_warps=4, num_stages=4), G(64, 16, 256, num_warps=4, num_stages=4),
                G(128, 16, 128, num_warps=8, num_stages=3), G(64, 16, 128, num_warps=4, num_stages=3)]
    elif bucket == 1:  # 17-64: never swept before session 4
        base = [G(64, 64, 128, num_warps=4, num_stages=4), G(128, 64, 64, num_warps=8, num_stages=3),
                G(128, 64, 128, num_warps=8, num_stages=3), G(64, 64, 256, num_warps=4, num_stages=3),
                G(128, 64, 128, num_warps=4, num_stages=4), G(256, 64, 64, num_warps=8, num_stages=3),
                G(64, 32, 128, num_warps=4, num_stages=4), G(32, 64, 256, num_warps=4, num_stages=4)]
    elif bucket == 2:
        base = [G(128, 128, 64, num_warps=8, num_stages=3), G(64, 64, 128, num_warps=4, num_stages=4),
                G(128, 64, 128, num_warps=4, num_stages=4)]
    else:
        base = [G(128, 256, 64, num_warps=8, num_stages=3), G(128, 128, 64, num_warps=8, num_stages=4),
                G(256, 128, 64, num_warps=8, num_stages=3)]
    prew = G(128, 256, 64, predecode_w=True)
    if quick:
        base = base[:2]
    out = []
    for i, cfg in enumerate(base):
        out.append(("mm", cfg, "auto"))
        out.append(("w4a16", cfg, "auto"))
        if i == 0:
            out.append(("w4a16", dataclasses.replace(cfg, decode="ptx_direct"), "auto"))
            if bucket == 1:
                out += [("mm", cfg, "x2"), ("mm", cfg, "half"), ("mm", cfg, "none"),
                        ("mm", dataclasses.replace(cfg, predecode_x=True), "auto"),
                        ("mm", dataclasses.replace(cfg, decode="ptx_direct"), "auto")]
            if bucket == 0:
                out.append(("mm", cfg, "x2"))
                out.append(("mm", cfg, "half"))
                out.append(("w4a16", cfg, "x2"))
                if not quick:
                    out.append(("w4a16", dataclasses.replace(cfg, decode="triton"), "auto"))
            if bucket == 3:
                out.append(("mm", dataclasses.replace(cfg, predecode_x=True), "auto"))
            if bucket >= 2:  # the kernel itself (the bucket-3 default is predecode_w)
                out.append(("mm", cfg, "auto"))
                out.append(("w4a16", cfg, "auto"))
                out.append(("mm", prew, "auto"))
                out.append(("w4a16", prew, "auto"))
    return out


def with_split(cfg, policy: str, m: int, n: int, k: int):
    from scaledmm.ops import nvfp4_triton as nt
    import torch

    auto = nt.split_for(cfg, m, n, k, torch.device(DEV))
    split = {"auto": auto, "x2": min(2 * auto, 16), "half": max(auto // 2, 1), "none": 1}[policy]
    return dataclasses.replace(cfg, split_k=max(1, min(split, math.ceil(k / cfg.block_k))))


def tried_configs(m: int, n: int, k: int, quick: bool):
    """``(op, config, kind)`` timed at one point: the defaults, then the valid candidates."""
    from scaledmm.ops import nvfp4_triton as nt

    out = [("mm", _default_cfg("mm", m, n, k), "default"), ("w4a16", _default_cfg("w4a16", m, n, k), "default")]
    for op, cfg, pol in candidates(nt.m_bucket(m), quick):
        cfg = _on_dev(with_split(cfg, pol, m, n, k))
        if nt.config_ok(cfg, _problem(op, m, n, k))[0] and all((op, cfg) != (o, c) for o, c, _ in out):
            out.append((op, cfg, "cand"))
    return out


def planned_kernels(quick: bool):
    """Every (op, config) the table needs (split-K resolved per shape and M)."""
    jobs = {(op, cfg, "bf16", 256) for n, k in SHAPES for m in TABLE_M
            for op, cfg, _ in tried_configs(m, n, k, quick)}
    return sorted(jobs, key=lambda j: (j[0], j[1].label()))


def _on_dev(cfg):
    """The PTX decoders off the GPU (smoke runs) become the Triton one."""
    return cfg if DEV == "cuda" else dataclasses.replace(cfg, decode="triton")


def _problem(op, m, n, k):
    import torch
    from scaledmm.backends import Family, Problem

    dev = torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device(DEV)
    return Problem(Family.NVFP4, dev, m, n, k,
                   torch.bfloat16 if op == "w4a16" else torch.uint8, torch.bfloat16, k,
                   (("bias", False), ("w4a16", op == "w4a16")))


def _default_cfg(op, m, n, k):
    from scaledmm.ops import nvfp4_triton as nt

    return nt.default_config(_problem(op, m, n, k))


# ----------------------------------------------------------------------------
# Compile pool: every kernel once, small problems of the same specialization
# (N, K multiples of 512, M not specialized), so the disk cache serves later
# ----------------------------------------------------------------------------


def _compile_worker(jobs):
    import torch

    from scaledmm.ops import nvfp4_triton as nt

    torch.cuda.init()
    dev = "cuda"
    k, m = 1024, 16
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=dev)
    sa = torch.full((128, k // 16), 0x30, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    one = torch.ones((), device=dev)
    done = 0
    for op, cfg, out, n in jobs:  # n: N's specialization class (multiple of 16 or not)
        out = {"bf16": torch.bfloat16, "f32": torch.float32}.get(out)
        b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        sb = torch.full((-(-n // 128) * 128, k // 16), 0x30, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        try:
            if op == "mm":
                nt.run_mm(a, b, sa, sb, one, out, None, cfg)
            elif op == "w4a16":
                nt.run_w4a16(x, b, sb, one, out, None, cfg)
            elif op == "w4a16_fp16":
                nt.run_w4a16(x.half(), b, sb, one, out, None, cfg)
            elif op == "quant":
                for qc in nt.QUANT_CANDIDATES:
                    nt.quant(x, one, cfg, qc)
            done += 1
        except Exception as e:  # reported again (with context) by the timing process
            print(f"compile {op} {getattr(cfg, 'label', lambda: cfg)()}: {type(e).__name__}: {e}"[:300], flush=True)
    torch.cuda.synchronize()
    return done


@stage("compile")
def compile_all(quick: bool, workers: int):
    jobs = planned_kernels(quick) + [("quant", True, None, 256), ("quant", False, None, 256)]
    for cfg in correctness_configs():
        jobs += [(op, cfg, "f32", CHECK_NK[0]) for op in ("mm", "w4a16", "w4a16_fp16")]
    jobs = list(dict.fromkeys(jobs))
    log(f"{len(jobs)} kernels over {workers} processes")
    chunks = [jobs[i::workers] for i in range(workers)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        done = sum(pool.map(_compile_worker, chunks))
    log(f"compiled {done}/{len(jobs)}")


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def time_calls(fns, min_reps=5, budget_s=0.05) -> float:
    """Median per-call microseconds of one CUDA-graph replay of ``fns``."""
    import torch

    if DEV != "cuda":  # smoke run: one pass, wall clock
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e6 / len(fns)
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, t_end = [], time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < 200):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del graph
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    return max(2, min(16, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


@stage("environment and copy ceiling")
def environment(res):
    import torch
    import triton

    res["env"] = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        res["env"].update(device=props.name, sms=props.multi_processor_count)
    log(str(res["env"]))
    n = 1 << (29 if DEV == "cuda" else 16)  # 1 GiB of bf16 per side (smaller buffers under-read HBM)
    src = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    us = time_calls([lambda: dst.copy_(src)], min_reps=5)
    res["copy_GBps"] = 2 * src.numel() * 2 / us / 1e3
    log(f"copy: {res['copy_GBps']:.0f} GB/s (read + write)")


# ----------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------


def _operands(m, n, k, seed=0):
    import torch

    from scaledmm.ops import nvfp4_triton as nt

    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g, dtype=torch.float32).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    gsx = (448 * 6 / x.float().abs().amax().clamp(min=1e-6)).reshape(())
    gsw = (448 * 6 / w.float().abs().amax()).reshape(())
    qa, sa = nt.quant(x, gsx, True)
    qb, sb = nt.quant(w, gsw, True)
    alpha = (1.0 / (gsx * gsw)).reshape(())
    return x, w, qa, sa, qb, sb, alpha, gsw


def _deq(q, s):
    from scaledmm.ops.nvfp4 import dequantize

    return dequantize(q, s).double()


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def correctness_configs():
    from scaledmm.ops.nvfp4_triton import GemmConfig as G

    cfgs = [G(64, 16, 256, num_stages=4, decode=dec) for dec in ("ptx", "ptx_direct", "triton")] + \
        [G(128, 64, 64, split_k=2, num_warps=8, decode=dec) for dec in ("ptx", "ptx_direct", "triton")]
    return list(dict.fromkeys(_on_dev(c) for c in cfgs))


@stage("correctness")
def correctness(res):
    import torch

    from scaledmm.ops import nvfp4_triton as nt
    from scaledmm.ops.nvfp4 import reference_quant

    checks = res.setdefault("checks", [])
    for m in (1, 17, 130, 4096 if DEV == "cuda" else 9):
        x = (torch.randn(m, QUANT_SHAPES[0][1], device=DEV) * 3).to(torch.bfloat16)
        gs = torch.tensor(448 * 6 / 9.0, device=DEV)
        for swz in (True, False):
            q, s = nt.quant(x, gs, swz)
            qr, sr = reference_quant(x, gs, swz)
            ok = torch.equal(q, qr) and torch.equal(s.view(torch.uint8), sr.view(torch.uint8))
            checks.append(dict(what=f"quant m={m} swizzle={swz}", ok=bool(ok)))
            if not ok:
                log(f"!! quant mismatch m={m} swizzle={swz}: codes {int((q != qr).sum())}, "
                    f"scales {int((s.view(torch.uint8) != sr.view(torch.uint8)).sum())}")
    n, k = CHECK_NK
    for m in (1, 17, 130):
        x, w, qa, sa, qb, sb, alpha, _ = _operands(m, n, k, seed=m)
        sb_tiny = sb.view(torch.uint8).clone()
        sb_tiny[:64] %= 8  # e4m3 subnormal block scales: products in the fp16/bf16 subnormal range
        sb_tiny = sb_tiny.view(torch.float8_e4m3fn)
        for scales, tag in ((sb, ""), (sb_tiny, " tiny-scales")):
            wd = _deq(qb, scales)
            ref_a4 = (_deq(qa, sa) @ wd.t()) * alpha.double()
            for xdt in (torch.bfloat16, torch.float16):
                ref_a16 = (x.to(xdt).double() @ wd.t()) * alpha.double()
                for cfg in correctness_configs():
                    out = nt.run_w4a16(x.to(xdt), qb, scales, alpha, torch.float32, None, cfg)
                    err = _rel(out, ref_a16)
                    checks.append(dict(what=f"w4a16 {xdt} m={m}{tag} {cfg.label()}", err=err, ok=err < 1e-5))
                    if xdt == torch.bfloat16:
                        out = nt.run_mm(qa, qb, sa, scales, alpha, torch.float32, None, cfg)
                        err = _rel(out, ref_a4)
                        checks.append(dict(what=f"w4a4 m={m}{tag} {cfg.label()}", err=err, ok=err < 1e-5))
    bad = [c for c in checks if not c["ok"]]
    log(f"{len(checks) - len(bad)}/{len(checks)} checks pass")
    for c in bad[:20]:
        log(f"!! FAIL {c}")


# ----------------------------------------------------------------------------
# Quantizer bandwidth
# ----------------------------------------------------------------------------


@stage("quantizer bandwidth")
def quant_bandwidth(res):
    import torch

    from scaledmm.ops import nvfp4_triton as nt

    rows = []
    for m, k in QUANT_SHAPES:
        c = copies_for(m * k * 2)
        xs = [(torch.randn(m, k, device=DEV) * 2).to(torch.bfloat16) for _ in range(c)]
        gs = torch.tensor(300.0, device=DEV)
        moved = m * k * 2 + m * k // 2 + m * k // 16
        ceiling = res.get("copy_GBps") or float("nan")
        for swz in (True, False):
            for qc in nt.QUANT_CANDIDATES if swz else (nt.DEFAULT_QUANT,):
                us = time_calls([lambda x=x, qc=qc: nt.quant(x, gs, swz, qc) for x in xs])
                row = dict(m=m, k=k, swizzle=swz, cfg=qc.label(), default=qc == nt.DEFAULT_QUANT, us=us,
                           GBps=moved / us / 1e3, frac_of_copy=(moved / us / 1e3) / ceiling)
                rows.append(row)
                log(f"quant M={m} K={k} swizzle={swz} {qc.label()}{' (default)' if row['default'] else ''}: "
                    f"{us:.1f} us, {row['GBps']:.0f} GB/s, {100 * row['frac_of_copy']:.0f}% of the 1 GiB copy")
    res["quant"] = rows


# ----------------------------------------------------------------------------
# GEMM table
# ----------------------------------------------------------------------------


@stage("GEMM table")
def gemm_table(res, quick: bool):
    import torch
    import torch.nn.functional as F

    from scaledmm.ops import nvfp4_triton as nt

    table = res.setdefault("table", [])
    for n, k in SHAPES:
        x_all, w, qa_all, sa_all, qb, sb, alpha, gsw = _operands(max(TABLE_M), n, k, seed=n + k)
        wd = _deq(qb, sb)
        c_fp4 = copies_for(qb.numel() + sb.numel())
        c_bf16 = copies_for(w.numel() * 2)
        qbs = [(qb.clone(), sb.clone()) for _ in range(c_fp4)]
        ws = [w.clone() for _ in range(c_bf16)]
        for m in TABLE_M:
            if time.perf_counter() - T0 > DEADLINE_S + 10:
                log(f"deadline: skipping {n}x{k} M={m}")
                continue
            x = x_all[:m].contiguous()
            qa, sa = nt.quant(x, (448 * 6 / x.float().abs().amax()).reshape(()), True)
            alpha_m = (1.0 / ((448 * 6 / x.float().abs().amax()) * gsw)).reshape(())
            rows = min(m, 64)
            ref_a4 = (_deq(qa, sa)[:rows] @ wd.t()) * alpha_m.double()
            ref_a16 = (x[:rows].double() @ wd.t()) / gsw.double()
            entry = dict(n=n, k=k, m=m)
            entry["bf16_us"] = time_calls([lambda w_=w_: F.linear(x, w_) for w_ in ws])
            tried = tried_configs(m, n, k, quick)
            if time.perf_counter() - T0 > DEADLINE_S:
                tried = tried[:2]
            results = []
            for op, cfg, kind in tried:
                try:
                    if op == "mm":
                        fns = [lambda b=b, s=s, cfg=cfg: nt.run_mm(qa, b, sa, s, alpha_m, torch.bfloat16, None, cfg)
                               for b, s in qbs]
                        out = nt.run_mm(qa, qb, sa, sb, alpha_m, torch.bfloat16, None, cfg)
                        err = _rel(out[:rows], ref_a4)
                    else:
                        inv = (1.0 / gsw).reshape(())
                        fns = [lambda b=b, s=s, cfg=cfg: nt.run_w4a16(x, b, s, inv, torch.bfloat16, None, cfg)
                               for b, s in qbs]
                        out = nt.run_w4a16(x, qb, sb, inv, torch.bfloat16, None, cfg)
                        err = _rel(out[:rows], ref_a16)
                    us = time_calls(fns)
                    results.append(dict(op=op, cfg=cfg.label(), kind=kind, us=us, err=err,
                                        speedup=entry["bf16_us"] / us))
                except Exception as e:
                    results.append(dict(op=op, cfg=cfg.label(), kind=kind, error=f"{type(e).__name__}: {e}"[:300]))
            entry["results"] = results
            table.append(entry)
            best = {op: min((r for r in results if r["op"] == op and "us" in r and r["err"] < TABLE_TOL),
                            key=lambda r: r["us"], default=None) for op in ("mm", "w4a16")}
            log(f"{n}x{k} M={m}: bf16 {entry['bf16_us']:.1f} us; "
                + "; ".join(f"{op} best {b['us']:.1f} us ({b['speedup']:.2f}x) {b['cfg']}" for op, b in best.items() if b))
        del qbs, ws
        if DEV == "cuda":
            torch.cuda.empty_cache()


def print_table(res):
    print()
    print("== NVFP4 Triton vs bf16 F.linear (us per call, cold L2, CUDA-graph replay; x = speedup over bf16)")
    hdr = f"{'N x K':>12} {'M':>5} {'bf16':>8} | {'W4A4 dflt':>10} {'x':>5} {'W4A4 best':>10} {'x':>5} {'cfg':<28} | " \
          f"{'W4A16 dflt':>10} {'x':>5} {'W4A16 best':>10} {'x':>5} {'cfg':<28} {'maxerr':>8}"
    print(hdr)
    for e in res.get("table", []):
        rs = [r for r in e["results"] if "us" in r]
        def pick(op, kind=None):
            c = [r for r in rs if r["op"] == op and (kind is None or r["kind"] == kind) and r["err"] < TABLE_TOL]
            return min(c, key=lambda r: r["us"]) if c else None
        cols = []
        for op in ("mm", "w4a16"):
            d, b = pick(op, "default"), pick(op)
            cols.append(f"{d['us'] if d else float('nan'):10.1f} {d['speedup'] if d else float('nan'):5.2f} "
                        f"{b['us'] if b else float('nan'):10.1f} {b['speedup'] if b else float('nan'):5.2f} "
                        f"{(b['cfg'] if b else '-'):<28}")
        errs = [r["err"] for r in rs]
        fails = [r for r in e["results"] if "error" in r or r.get("err", 0) >= TABLE_TOL]
        print(f"{e['n']:>6}x{e['k']:<5} {e['m']:>5} {e['bf16_us']:8.1f} | {cols[0]} | {cols[1]} "
              f"{max(errs) if errs else float('nan'):8.1e}" + (f"  ({len(fails)} failed)" if fails else ""))
    for q in res.get("quant", []):
        print(f"quant M={q['m']} K={q['k']} swizzle={q['swizzle']} {q.get('cfg', '')}"
              f"{'*' if q.get('default') else ''}: {q['us']:.1f} us, {q['GBps']:.0f} GB/s = "
              f"{100 * q['frac_of_copy']:.0f}% of copy ({res.get('copy_GBps', float('nan')):.0f} GB/s)")
    bad = [c for c in res.get("checks", []) if not c["ok"]]
    print(f"correctness: {len(res.get('checks', [])) - len(bad)}/{len(res.get('checks', []))} checks pass"
          + ("".join(f"\n  FAIL {c}" for c in bad[:10])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer candidate configs")
    ap.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--smoke", action="store_true",
                    help="CPU dry run of the script under TRITON_INTERPRET=1 (tiny shapes)")
    ap.add_argument("--ms", default=None, help="comma-separated M values of the table (default 1,4,16,128,1024,4096)")
    ap.add_argument("--table-only", action="store_true", help="skip the correctness and quantizer stages")
    args = ap.parse_args()
    import torch

    global DEV, SHAPES, TABLE_M, QUANT_SHAPES, CHECK_NK, ROTATE_BYTES, DEADLINE_S
    if args.quick:
        DEADLINE_S = 60.0  # --quick must finish in < 90 s
    if args.smoke:
        os.environ["SCALEDMM_NVFP4_TRITON_DECODE"] = "triton"
        DEV, SHAPES, TABLE_M, QUANT_SHAPES = "cpu", [(40, 256)], (1, 17, 300), ((20, 128),)
        CHECK_NK, ROTATE_BYTES = (40, 128), 1 << 14
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke with TRITON_INTERPRET=1)")
        return 1
    if args.ms:
        TABLE_M = tuple(int(v) for v in args.ms.split(","))
    import scaledmm  # noqa: F401  (registers the ops)

    res = {}
    environment(res)
    if not args.smoke:
        compile_all(args.quick, args.workers)
    if not args.table_only:
        correctness(res)
        quant_bandwidth(res)
    gemm_table(res, args.quick)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "nvfp4.json").write_text(json.dumps(res, indent=1, default=str))
    print_table(res)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
