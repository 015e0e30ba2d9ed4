"""H200 check and timing of the NVFP4 backend ``decode_cublas``
(ops/nvfp4_cublas.py: exact 16-bit decode, then cuBLAS fp32-output mm + Triton
epilogue, or with ``SCALEDMM_NVFP4_CUBLASLT=1`` one cuBLASLt GEMM that reads
alpha on the device) against the ``triton`` backend's default and bf16 ``F.linear``.

    python -m benchmarks.experiments.nvfp4_cublas [--quick]
    TRITON_INTERPRET=1 python -m benchmarks.experiments.nvfp4_cublas --smoke   # CPU dry run, tiny shapes

Stages:

1. compile the Triton backend's default GEMM configs of every table point in
   a pool of processes (``_compile_worker``; the disk cache then
   serves the timing process);
2. correctness against float64 on the decoded operands: fp32 outputs within
   fp32 accumulation error (rel < 1e-5: the exactness claim), bf16 outputs
   within one rounding, bias, K = 4112, forced chunking;
3. the table: llama8b shapes x M in (17, 64, 128, 256, 1024, 4096), W4A4 and
   W4A16: decode_cublas (both multiply paths where cuBLASLt loads: ``dc`` /
   ``lt``) vs triton default vs bf16 F.linear (bf16 weight);
   at M >= 1024 also decode_cublas with 16 / 64 MiB chunks (accumulator
   chunks that may stay in L2 for the epilogue);
4. where the time goes at M = 4096, 4096x4096: decode W, decode A, mm with
   fp32 output (and with bf16 output, for the cost of fp32), epilogue.

Timing (benchmarks/timing.py): cold L2 (weight copies rotated, > 120 MB in
all), CUDA-graph replay of every call (eager event timings of the
4-launch path were host-bound, session 3), medians.
Prints a compact table and the suggested MIN_M (smallest table M from which
decode_cublas beats triton on all four shapes); with ``$OUT`` set, writes
``nvfp4_cublas.json`` there.  Budget: < 90 s on the H200.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F


import scaledmm  # noqa: F401
from benchmarks import timing
from scaledmm import cublaslt, env
from scaledmm.backends import Family, Problem
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_cublas as dc
from scaledmm.ops import nvfp4_triton as tr

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = (17, 64, 128, 256, 1024, 4096)
CHUNK_VARIANTS = (16 << 20, 64 << 20)
ROTATE_BYTES = 120 << 20
DEV = "cuda"  # "cpu" with --smoke
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


@contextlib.contextmanager
def cublaslt_path(on: bool):
    """decode_cublas's multiply path for the block: SCALEDMM_NVFP4_CUBLASLT on / off."""
    old = os.environ.get(env.NVFP4_CUBLASLT)
    os.environ[env.NVFP4_CUBLASLT] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[env.NVFP4_CUBLASLT]
        else:
            os.environ[env.NVFP4_CUBLASLT] = old


@contextlib.contextmanager
def chunk_bytes(nbytes: int | None):
    old = dc.CHUNK_BYTES
    dc.CHUNK_BYTES = old if nbytes is None else nbytes
    try:
        yield
    finally:
        dc.CHUNK_BYTES = old


def quantize(x: torch.Tensor):
    """``(q, s, decode multiplier)`` of a bf16 matrix, scaled to the full range."""
    gs = (448 * 6 / x.float().abs().amax().clamp_min(1e-6)).reshape(())
    q, s = torch.ops.scaledmm.nvfp4_quant(x, gs)
    return q, s, (1.0 / gs).float()


# ----------------------------------------------------------------------------
# 1. Compile pool (Triton backend defaults; our kernels compile on first use)
# ----------------------------------------------------------------------------


def _triton_jobs():
    dev = torch.device("cuda", torch.cuda.current_device())
    jobs = []
    for n, k in SHAPES:
        for m in MS:
            for op, w4a16 in (("mm", False), ("w4a16", True)):
                p = Problem(Family.NVFP4, dev, m, n, k, torch.bfloat16 if w4a16 else torch.uint8, torch.bfloat16,
                            k, (("bias", False), ("w4a16", w4a16)))
                jobs.append((op, tr.default_config(p), "bf16", 256))
    return list(dict.fromkeys(jobs))


def _compile_worker(jobs) -> int:
    """Compile each ``(op, cfg, out, n)`` job's Triton kernel on dummy inputs
    of the same specialization (Triton's disk cache then serves the parent)."""
    torch.cuda.init()
    k, m = 1024, 16
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device="cuda")
    sa = torch.full((128, k // 16), 0x30, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    one = torch.ones((), device="cuda")
    done = 0
    for op, cfg, _, n in jobs:
        b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        sb = torch.full((-(-n // 128) * 128, k // 16), 0x30, dtype=torch.uint8, device="cuda")
        sb = sb.view(torch.float8_e4m3fn)
        try:
            if op == "mm":
                tr.run_mm(a, b, sa, sb, one, torch.bfloat16, None, cfg)
            else:
                tr.run_w4a16(x, b, sb, one, torch.bfloat16, None, cfg)
            done += 1
        except Exception as e:  # the timing process reports it again, with context
            print(f"compile {op} {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
    torch.cuda.synchronize()
    return done


def compile_pool() -> None:
    jobs = _triton_jobs()
    workers = max(1, min(8, (os.cpu_count() or 2) - 1, len(jobs)))
    with mp.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_compile_worker, [jobs[i::workers] for i in range(workers)]))
    log(f"compiled {done}/{len(jobs)} Triton GEMM configs over {workers} processes")


# ----------------------------------------------------------------------------
# 2. Correctness
# ----------------------------------------------------------------------------


def check(out, xd, wd, alpha, bias=None) -> tuple[bool, float]:
    """fp32: rel (norm) < 1e-5 and every element within fp32 accumulation
    error; 16-bit: within one rounding plus that.  Returns (ok, rel error)."""
    xd, wd = xd.double(), wd.double()
    ref = xd @ wd.t() * alpha.double()
    if bias is not None:
        ref = ref + bias.double()
    absum = (xd.abs() @ wd.abs().t()) * alpha.double().abs()
    eps = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[out.dtype]
    bound = ref.abs() * 2 * eps + absum * xd.shape[1] * 2.0 ** -24 + 1e-30
    err = (out.double() - ref).abs()
    rel = float((err.norm() / ref.norm().clamp_min(1e-300)).item())
    ok = bool(torch.isfinite(out).all().item()) and bool((err <= bound).all().item())
    if out.dtype == torch.float32:
        ok = ok and rel < 1e-5
    return ok, rel


def correctness() -> list[dict]:
    dev = DEV
    points = [  # (label, m, n, k, w4a16, out dtype, bias dtype, chunk bytes)
        ("w4a4 fp32", 4096, 4096, 4096, False, torch.float32, None, None),
        ("w4a4 fp32 K=4112", 300, 1040, 4112, False, torch.float32, torch.float32, None),
        ("w4a4 bf16 bias", 128, 28672, 4096, False, torch.bfloat16, torch.bfloat16, None),
        ("w4a4 fp32 chunked", 1023, 1040, 4096, False, torch.float32, torch.float32, 1 << 20),
        ("w4a16 fp32", 1023, 6144, 4096, True, torch.float32, None, None),
        ("w4a16 fp16 x, fp32 chunked", 512, 1040, 4096, True, torch.float32, None, 1 << 20),
    ]
    if DEV != "cuda":  # smoke: the same points, small
        points = [(p[0], min(p[1], 33), min(p[2], 300), min(p[3], 4112 if p[3] % 64 else 128)) + p[4:] for p in points]
    res = []
    for label, m, n, k, w4a16, out_dtype, bias_dtype, chunk in points:
        x = (torch.randn(m, k, device=dev) * torch.rand(m, 1, device=dev) * 4).bfloat16()
        qb, sb, wa = quantize((torch.randn(n, k, device=dev) / k ** 0.5).bfloat16())
        bias = None if bias_dtype is None else torch.randn(n, device=dev).to(bias_dtype)
        torch.full((m * n + 1024,), float("nan"), device=dev)  # NaN in the caching allocator
        with chunk_bytes(chunk if DEV == "cuda" or chunk is None else 4096):
            if w4a16:
                xin = x.half() if "fp16" in label else x
                out = dc.w4a16_mm(xin, qb, sb, wa, out_dtype, bias)
                ok, rel = check(out, xin, nv.dequantize(qb, sb), wa, bias)
            else:
                qa, sa, xa = quantize(x)
                alpha = xa * wa
                out = dc.mm(qa, qb, sa, sb, alpha, out_dtype, bias)
                ok, rel = check(out, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha, bias)
        res.append(dict(label=label, m=m, n=n, k=k, ok=ok, rel=rel))
        log(f"check {label} M={m} {n}x{k}: {'ok' if ok else 'FAIL'} rel {rel:.2e}")
    return res


# ----------------------------------------------------------------------------
# 3. Table
# ----------------------------------------------------------------------------


def table(cfg: timing.TimingConfig, quick: bool) -> list[dict]:
    dev = torch.device(DEV)
    rows = []
    for n, k in SHAPES:
        fp4 = [quantize((torch.randn(n, k, device=dev) / k ** 0.5).bfloat16())
               for _ in range(timing.copies_for(n * k * 9 // 16, cfg))]
        bf = [(torch.randn(n, k, device=dev) / k ** 0.5).bfloat16() for _ in range(timing.copies_for(n * k * 2, cfg))]
        for m in MS:
            x = torch.randn(m, k, device=dev).bfloat16()
            qa, sa, xa = quantize(x)
            ops = [(q, s, xa * wa, wa) for q, s, wa in fp4]  # alpha per copy, outside the timed call

            def t(make, copies=ops):
                return timing.measure([make(c) for c in copies], dev, cfg).median_us

            r = dict(n=n, k=k, m=m)
            r["bf16"] = t(lambda w: lambda: F.linear(x, w), bf)
            with cublaslt_path(False):
                r["dc"] = t(lambda c: lambda: dc.mm(qa, c[0], sa, c[1], c[2]))
                r["dc16"] = t(lambda c: lambda: dc.w4a16_mm(x, c[0], c[1], c[3]))
            if cublaslt.available(dev)[0]:
                with cublaslt_path(True):
                    r["lt"] = t(lambda c: lambda: dc.mm(qa, c[0], sa, c[1], c[2]))
                    r["lt16"] = t(lambda c: lambda: dc.w4a16_mm(x, c[0], c[1], c[3]))
            r["triton"] = t(lambda c: lambda: tr.mm(qa, c[0], sa, c[1], c[2]))
            r["triton16"] = t(lambda c: lambda: tr.w4a16_mm(x, c[0], c[1], c[3]))
            if m >= 1024 and not quick:
                for nb in CHUNK_VARIANTS:
                    with chunk_bytes(nb), cublaslt_path(False):
                        r[f"dc_chunk{nb >> 20}"] = t(lambda c: lambda: dc.mm(qa, c[0], sa, c[1], c[2]))
            rows.append(r)
            extra = " ".join(f"{key} {v:.1f}" for key, v in r.items() if key.startswith(("dc_chunk", "lt")))
            log(f"{n}x{k} M={m}: bf16 {r['bf16']:.1f} | W4A4 dc {r['dc']:.1f} triton {r['triton']:.1f} | "
                f"W4A16 dc {r['dc16']:.1f} triton {r['triton16']:.1f} {extra}")
        del fp4, bf, ops
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------
# 4. Where the time goes (M = 4096, 4096x4096)
# ----------------------------------------------------------------------------


def split(cfg: timing.TimingConfig, m=4096, n=4096, k=4096) -> dict:
    dev = torch.device(DEV)
    fp4 = [quantize((torch.randn(n, k, device=dev) / k ** 0.5).bfloat16())
           for _ in range(timing.copies_for(n * k * 9 // 16, cfg))]
    x = torch.randn(m, k, device=dev).bfloat16()
    qa, sa, xa = quantize(x)
    xd = tr.dequant(qa, sa, dc.W4A4_DTYPE)
    wds = [tr.dequant(c[0], c[1], dc.W4A4_DTYPE) for c in fp4[:timing.copies_for(n * k * 2, cfg)]]
    accs = [dc.mm_f32(xd, wds[i]) for i in range(2)]
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    alpha = xa * fp4[0][2]

    def t(fns):
        return timing.measure(fns, dev, cfg).median_us

    s = dict(m=m, n=n, k=k)
    s["decode_w"] = t([(lambda c: lambda: tr.dequant(c[0], c[1], dc.W4A4_DTYPE))(c) for c in fp4])
    s["decode_a"] = t([lambda: tr.dequant(qa, sa, dc.W4A4_DTYPE)])
    s["mm_fp32"] = t([(lambda w: lambda: dc.mm_f32(xd, w))(w) for w in wds])
    s["mm_bf16"] = t([(lambda w: lambda: torch.mm(xd, w.t()))(w) for w in wds])
    s["epilogue"] = t([(lambda a: lambda: dc.epilogue(a, alpha, None, out))(a) for a in accs])
    alphas = [xa * c[2] for c in fp4]
    with cublaslt_path(False):
        s["total"] = t([(lambda c, al: lambda: dc.mm(qa, c[0], sa, c[1], al))(c, al) for c, al in zip(fp4, alphas)])
    if cublaslt.available(dev)[0]:
        s["mm_lt"] = t([(lambda w: lambda: cublaslt.gemm_alpha_dev(xd, w, alpha, None, out))(w) for w in wds])
        with cublaslt_path(True):
            s["total_lt"] = t([(lambda c, al: lambda: dc.mm(qa, c[0], sa, c[1], al))(c, al)
                               for c, al in zip(fp4, alphas)])
    log(f"split at M={m} {n}x{k} (us): " + ", ".join(f"{key} {v:.1f}" for key, v in s.items() if key not in ("m", "n", "k")))
    return s


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------


def suggested_min_m(rows, new: str, old: str):
    """Smallest table M from which ``new`` beats ``old`` on every shape at
    that M and every larger one (None if it never does)."""
    wins = {m: all(r[new] < r[old] for r in rows if r["m"] == m) for m in MS}
    best = None
    for m in reversed(MS):
        if not wins[m]:
            break
        best = m
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="no chunk variants")
    ap.add_argument("--no-pool", action="store_true", help="compile in this process")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run (TRITON_INTERPRET=1), tiny shapes")
    args = ap.parse_args()
    global DEV, SHAPES, MS
    if args.smoke:
        DEV, SHAPES, MS = "cpu", [(300, 128), (256, 144)], (17, 33)
    cfg = dataclasses.replace(timing.TimingConfig.for_device(torch.device(DEV), quick=True),
                              graph_below_us=20000.0)  # graph replay throughout: eager timings here are host-bound
    if DEV == "cuda":
        cfg = dataclasses.replace(cfg, rotate_bytes=max(cfg.rotate_bytes, ROTATE_BYTES))
        log(f"{torch.cuda.get_device_name()} torch {torch.__version__}; rotate {cfg.rotate_bytes >> 20} MB")
    res: dict = {}
    if not args.no_pool and DEV == "cuda":
        try:
            compile_pool()
        except Exception as e:  # noqa: BLE001 - the timing process compiles instead
            log(f"compile pool failed ({type(e).__name__}: {e}); compiling on first use")
    res["correctness"] = correctness()
    res["split"] = split(cfg) if DEV == "cuda" else split(cfg, 33, 256, 128)
    rows = res["rows"] = table(cfg, args.quick)

    print("\n| N x K | M | bf16 us | W4A4 dc | triton | bf16/dc | bf16/tri | W4A16 dc | triton | bf16/dc | bf16/tri |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["bf16"]
        print(f"| {r['n']}x{r['k']} | {r['m']} | {b:.1f} | {r['dc']:.1f} | {r['triton']:.1f} | {b / r['dc']:.2f}x | "
              f"{b / r['triton']:.2f}x | {r['dc16']:.1f} | {r['triton16']:.1f} | {b / r['dc16']:.2f}x | "
              f"{b / r['triton16']:.2f}x |")
    chunked = [r for r in rows if any(key.startswith("dc_chunk") for key in r)]
    if chunked:
        print("\nchunk variants (W4A4 us): " + "; ".join(
            f"{r['n']}x{r['k']} M={r['m']}: default {r['dc']:.1f} "
            + " ".join(f"{key[3:]} {v:.1f}" for key, v in r.items() if key.startswith("dc_chunk")) for r in chunked))
    s = res["split"]
    print(f"\nsplit M={s['m']} {s['n']}x{s['k']} (us): decode W {s['decode_w']:.1f}, decode A {s['decode_a']:.1f}, "
          f"mm fp32-out {s['mm_fp32']:.1f} (bf16-out {s['mm_bf16']:.1f}), epilogue {s['epilogue']:.1f}; "
          f"sum {s['decode_w'] + s['decode_a'] + s['mm_fp32'] + s['epilogue']:.1f}, measured total {s['total']:.1f}"
          + (f"; cuBLASLt mm {s['mm_lt']:.1f}, total {s['total_lt']:.1f}" if "mm_lt" in s else ""))
    res["min_m_w4a4"] = suggested_min_m(rows, "dc", "triton")
    res["min_m_w4a16"] = suggested_min_m(rows, "dc16", "triton16")
    fails = sum(not c["ok"] for c in res["correctness"])
    print(f"suggested MIN_M: W4A4 {res['min_m_w4a4']}, W4A16 {res['min_m_w4a16']} (module: {dc.MIN_M})")
    print(f"{fails} correctness failures of {len(res['correctness'])}; {time.perf_counter() - T0:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "nvfp4_cublas.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
