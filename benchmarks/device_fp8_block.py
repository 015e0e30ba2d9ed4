"""GPU check and timing of the Triton fp8_block backend (ops/fp8_block_triton.py)
against cuBLAS blockwise (``torch._scaled_mm``, backend ``cublas``), the padded
op (M % 4 != 0 through cuBLAS) and bf16 ``F.linear``.  Run from the repository
root::

    python benchmarks/device_fp8_block.py            # about 2 minutes
    python benchmarks/device_fp8_block.py --quick    # M in {1, 16, 128, 4096}
    TRITON_INTERPRET=1 python benchmarks/device_fp8_block.py --smoke  # CPU, tiny shapes: script check

Stages (each guarded: a failure is printed and the rest still runs):

1. environment, device-to-device copy bandwidth (the byte ceiling);
2. ``per_token_group_quant_fp8`` at M=4096, K=7168 (bf16): bit-exactness
   against the reference on the device, then achieved bandwidth (bytes read +
   written) for rows-per-program 8/16/32, row/column-major and ue8m0 scales,
   as a fraction of the copy bandwidth;
3. every kernel the later stages launch is compiled up front, in parallel
   (``fp8_block_triton.precompile``);
4. DeepSeek-V3 shapes x M in {1, 4, 16, 64, 128, 512, 4096}: bf16 F.linear,
   cuBLAS (the padded op when M % 4 != 0), Triton with its default config and
   a few alternatives per M bucket, and ``fp8_block_linear`` fused (quantize
   inside the GEMM) vs quantize-then-GEMM.  Each output is checked against
   float64 (float32 without TF32 above M = 512): rel. error < 8e-3, no NaN.

Timing (benchmarks/timing.py): cold L2 (weight copies rotating, > 2x L2 in
all), CUDA events, median; calls under 100 us as CUDA-graph replay.  Floors:
bytes (weight + activation + scales + output, once) over the measured copy
bandwidth, and FLOPs over 1979 TFLOP/s (H200 dense FP8).  Prints a compact
table at the end (times in us) plus the best Triton config per (M bucket, N,
K) as ``_TUNED`` lines; details to ``$OUT/fp8_block_triton.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (576, 7168)]
MS = (1, 4, 16, 64, 128, 512, 4096)
QUICK_MS = MS  # --quick: every bucket, but only the default, the run-2 default ("old") and one alternative
TOL = 8e-3
FP8_PEAK = 1979e12
BUDGET_S = 110.0  # after this, only defaults and baselines are timed
HARD_STOP_S = 135.0  # after this, remaining points are skipped (the report still prints)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def old_default(m: int, n: int, k: int, sms: int):
    """The run-2 default (bucket base, split-K from the tile count, no _TUNED),
    timed next to the new default so one run shows the change."""
    from scaledmm.ops import fp8_block_triton as T

    base_cfg = T._BUCKET_BASE[True][T.m_bucket(m)]
    tiles = math.ceil(m / base_cfg.block_m) * math.ceil(n / base_cfg.block_n)
    split = 1 if tiles >= sms else max(1, min(math.ceil(2 * sms / tiles), math.ceil(k / 128) // 4, 16))
    cfg = dataclasses.replace(base_cfg, split_k=split)
    return cfg if T.config_ok(cfg, m, n, k)[0] else dataclasses.replace(cfg, split_k=1, num_stages=3)


def alternatives(m: int, n: int, k: int, sms: int, quick: bool = False):
    """The default config of M's bucket first, then the run-2 default, then a
    few others worth a look (one with ``quick``)."""
    from scaledmm.ops import fp8_block_triton as T

    d = T.default_config(m, n, k, sms)
    split = lambda bm, bn: T._split_for(m, n, k, bm, bn, sms)  # noqa: E731
    b = T.m_bucket(m)
    C = T.MMConfig
    if b == 0:
        alts = [C(16, 128, split(16, 128), True, num_stages=6), C(16, 64, max(1, d.split_k // 2), True, num_stages=4),
                C(16, 64, split(16, 64), False, num_stages=6)]
    elif b == 1:
        alts = [C(32, 64, split(32, 64), True, num_stages=6), C(64, 128, split(64, 128), False, num_stages=4),
                C(64, 64, split(64, 64), False, num_stages=4)]
    elif b == 2:
        alts = [C(128, 128, split(128, 128), num_warps=8, num_stages=4),
                C(128, 64, split(128, 64), True, num_warps=8, num_stages=4), C(64, 64, split(64, 64), True, num_stages=5)]
    elif b == 3:
        alts = [C(128, 128, num_warps=8, num_stages=4, tma=True),
                C(128, 128, num_warps=8, num_stages=4, tma=True, persistent=True),
                C(64, 128, split(64, 128), num_stages=4)]
    else:
        alts = [C(128, 128, num_warps=8, num_stages=4, tma=True, persistent=True),
                C(128, 128, num_warps=8, num_stages=4, tma=True, persistent=True, warp_specialize=True),
                C(128, 128, num_warps=8, num_stages=3), C(64, 256, num_warps=8, num_stages=4, tma=True, persistent=True)]
    out = [d]
    alts = [old_default(m, n, k, sms)] + alts[:1 if quick else None]
    for c in alts:
        if c not in out and T.config_ok(c, m, n, k)[0]:
            out.append(c)
    return out


def measure(timing, fns, dev, tcfg):
    """timing.measure with the Python GC off: a collection during a capture can
    free CUDA objects of an earlier failed capture and break this one."""
    gc.collect()
    gc.disable()
    try:
        return timing.measure(fns, dev, tcfg)
    finally:
        gc.enable()


def bench_shape(dev, n, k, ms, sms, copy_bw, tcfg, report, quick=False) -> None:
    import torch
    import torch.nn.functional as F

    import scaledmm
    from benchmarks import timing
    from scaledmm.ops import fp8_block as base
    from scaledmm.ops import fp8_block_triton as T

    kb, nb = k // 128, math.ceil(n / 128)
    gen = torch.Generator(device=dev).manual_seed(n + k)
    w_bytes = n * k
    copies = timing.copies_for(w_bytes, tcfg)
    ws = [((torch.randn(n, k, device=dev, generator=gen) * 2).to(torch.float8_e4m3fn),
           torch.rand(nb, kb, device=dev, generator=gen) + 0.05) for _ in range(copies)]
    wb = [(w.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)).to(torch.bfloat16)
          for w, s in ws[:timing.copies_for(2 * w_bytes, tcfg)]]
    w64 = ws[0][0].double() * ws[0][1].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    for m in ms:
        if time.perf_counter() - T0 > HARD_STOP_S:
            report["skipped"].append(f"{n}x{k} M={m}")
            continue
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        q, s = T.per_token_group_quant(x, 128, column_major_scales=True)
        ref_dtype = torch.float64 if m <= 512 else torch.float32
        ref = (q.to(ref_dtype) * s.to(ref_dtype).repeat_interleave(128, 1)) @ w64.to(ref_dtype).t()
        lin_ref = base.reference_linear(x, ws[0][0], ws[0][1], (128, 128), torch.float32).double()
        bf16_ref = x.to(ref_dtype) @ w64.to(ref_dtype).t()  # F.linear sees the unquantized activation
        nbytes = n * k + nb * kb * 4 + m * k + m * kb * 4 + m * n * 2
        floor_us = max(nbytes / copy_bw, 2.0 * m * n * k / FP8_PEAK) * 1e6
        point = {"n": n, "k": k, "m": m, "floor_us": floor_us, "us": {}, "err": {}, "cfg": {}, "mode": {},
                 "note": {}}

        def run(name, fn_for_copy, check_ref, cfg=None):
            if time.perf_counter() - T0 > BUDGET_S and cfg is not None and name.startswith("alt"):
                return
            try:
                out = fn_for_copy(0)
                err = float((out.double() - check_ref).norm() / check_ref.norm())
                bad = bool(out.isnan().any()) or not err < TOL
                point["err"][name] = err
                if bad:
                    report["errors"].append(f"{n}x{k} M={m} {name}: rel err {err:.2e}, NaN {out.isnan().any()}")
                t = measure(timing, [lambda i=i: fn_for_copy(i) for i in range(copies)], dev, tcfg)
                point["us"][name] = t.median_us
                point["mode"][name] = t.mode
                if t.note:
                    point["note"][name] = t.note
                    report["notes"].append(f"{n}x{k} M={m} {name}: {t.note}")
                if cfg is not None:
                    point["cfg"][name] = cfg.short()
            except Exception as e:  # one provider failing must not stop the table
                report["errors"].append(f"{n}x{k} M={m} {name}: {type(e).__name__}: {str(e)[:200]}")

        run("bf16", lambda i: F.linear(x, wb[i % len(wb)]), bf16_ref)
        if m % 4 == 0:
            run("cublas", lambda i: base.cublas_mm(q, ws[i][0], s, ws[i][1], (128, 128), torch.bfloat16), ref)
        else:
            def padded(i):
                with scaledmm.use_backend("fp8_block", "cublas"):
                    return torch.ops.scaledmm.padded_fp8_block_mm(q, ws[i][0], s, ws[i][1])
            run("padded", padded, ref)
        for j, cfg in enumerate(alternatives(m, n, k, sms, quick)):
            run("triton" if j == 0 else ("old" if cfg == old_default(m, n, k, sms) else f"alt{j}"),
                lambda i, c=cfg: T.mm(q, ws[i][0], s, ws[i][1], torch.bfloat16, c), ref, cfg)
        if m <= 128:
            run("lin_fused", lambda i: T.linear(x, ws[i][0], ws[i][1], fuse=True), lin_ref)
            run("lin_2step", lambda i: T.linear(x, ws[i][0], ws[i][1], fuse=False), lin_ref)
            with scaledmm.use_backend("fp8_block", "triton"):  # the op as users call it (default choice)
                run("lin_op", lambda i: torch.ops.scaledmm.fp8_block_linear(x, ws[i][0], ws[i][1]), lin_ref)
        report["points"].append(point)
        us = point["us"]
        tri = [v for kk, v in us.items() if kk in ("triton", "old") or kk.startswith("alt")]
        log(f"{n:>5}x{k:<5} M={m:<4} floor {floor_us:7.1f} bf16 {us.get('bf16', math.nan):7.1f} "
            f"cublas {us.get('cublas', us.get('padded', math.nan)):7.1f} triton {us.get('triton', math.nan):7.1f} "
            f"best {min(tri) if tri else math.nan:7.1f} fused {us.get('lin_fused', math.nan):7.1f} "
            f"2step {us.get('lin_2step', math.nan):7.1f}")


def capture_check(dev, report) -> None:
    """Every op path captured alone in a CUDA graph, replayed, compared bit for
    bit with its eager result (fresh inputs written in place before the
    replay), plus the host time of one eager call.  A path that cannot be
    captured is an error (SPEC: every op is CUDA-graph capturable), with the
    exception text, so a failed capture can never hide behind event timing."""
    import torch

    import scaledmm
    from scaledmm.ops import fp8_block_triton as T

    n, k = 2112, 7168
    gen = torch.Generator(device=dev).manual_seed(7)
    b = torch.randn(n, k, device=dev, generator=gen).to(torch.float8_e4m3fn)
    bs = torch.rand(math.ceil(n / 128), k // 128, device=dev, generator=gen) + 0.5
    ops = torch.ops.scaledmm

    def paths(x, q, s):
        yield "quant_op", "triton", lambda: ops.per_token_group_quant_fp8(x, 128, 1e-10, True)
        yield "mm_op", "triton", lambda: ops.fp8_block_mm(q, b, s, bs)
        yield "padded_op", "cublas", lambda: ops.padded_fp8_block_mm(q, b, s, bs)
        yield "dyn_padded_op", "triton", lambda: ops.dynamic_padded_fp8_block_mm(q, b, s, bs)
        yield "linear_op", "triton", lambda: ops.fp8_block_linear(x, b, bs)
        yield "linear_fused", "triton", lambda: T.linear(x, b, bs, fuse=True)
        yield "linear_2step", "triton", lambda: T.linear(x, b, bs, fuse=False)

    for m in (1, 3, 4, 64):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        q, s = T.per_token_group_quant(x, 128, column_major_scales=True)
        for name, backend, fn in paths(x, q, s):
            tag = f"capture {name:<16} ({backend}) M={m}"
            try:
                with scaledmm.use_backend("fp8_block", backend):
                    fn()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn()
                    host_us = (time.perf_counter() - t0) / 20 * 1e6
                    torch.cuda.synchronize()
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        fn()
                    torch.cuda.current_stream().wait_stream(side)
                    gc.collect()
                    gc.disable()
                    try:
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            out_g = fn()
                    finally:
                        gc.enable()
                    x.copy_(torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen))
                    q2, s2 = T.per_token_group_quant(x, 128, column_major_scales=True)
                    q.copy_(q2)
                    s.copy_(s2)
                    g.replay()
                    eager = fn()
                    torch.cuda.synchronize()
                outs_g = out_g if isinstance(out_g, tuple) else (out_g,)
                outs_e = eager if isinstance(eager, tuple) else (eager,)
                same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                       e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e)
                           for a, e in zip(outs_g, outs_e))
                report["capture"].append(dict(path=name, backend=backend, m=m, ok=same, host_us=host_us))
                log(f"{tag}: {'ok' if same else 'REPLAY DIFFERS'}  eager host {host_us:6.1f} us/call")
                if not same:
                    report["errors"].append(f"{tag}: graph replay differs from eager")
                del g
            except Exception as e:  # the point of this stage: say exactly why
                last = traceback.extract_tb(e.__traceback__)[-1]
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''} " \
                      f"(at {Path(last.filename).name}:{last.lineno})"
                report["capture"].append(dict(path=name, backend=backend, m=m, ok=False, why=why))
                report["errors"].append(f"{tag}: {why}")
                log(f"{tag}: FAILED {why}")
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass


def copy_bandwidth(torch, timing, dev, tcfg) -> float:
    src = torch.empty(1 << (29 if dev.type == "cuda" else 22), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timing.measure([lambda: dst.copy_(src)], dev, tcfg)
    return 2 * src.numel() / (t.median_us * 1e-6)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    args = ap.parse_args()
    import torch

    import scaledmm
    from benchmarks import timing
    from scaledmm.ops import fp8_block as base
    from scaledmm.ops import fp8_block_triton as T

    import triton

    shapes, ms = SHAPES, (QUICK_MS if args.quick else MS)
    qm, qk = 4096, 7168
    if args.smoke:
        dev, name, sms, l2 = torch.device("cpu"), "cpu", 4, 0
        shapes, ms, qm, qk = [(256, 512), (200, 384)], (1, 3, 64, 130), 33, 512
    else:
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        name, sms, l2 = props.name, props.multi_processor_count, getattr(props, "L2_cache_size", 0)
    log(f"torch {torch.__version__}, triton {triton.__version__}, {name}, {sms} SMs, "
        f"L2 {l2 >> 20} MB; backends {scaledmm.backends.names('fp8_block')}")
    tcfg = timing.TimingConfig.for_device(dev, quick=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"device": name, "points": [], "quant": [], "errors": [], "skipped": [], "notes": [], "capture": []}

    # 1. copy bandwidth ---------------------------------------------------
    copy_bw = copy_bandwidth(torch, timing, dev, tcfg)
    report["copy_bw"] = copy_bw
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")

    # 2. quant kernel -----------------------------------------------------
    try:
        x = torch.randn(qm, qk, device=dev, dtype=torch.bfloat16) * 3
        for col, ue8m0 in ((False, False), (True, False), (True, True)):
            # CPU reference: on CUDA, ATen computes `amax / 448.0` as amax * fl(1/448)
            qr, sr = base.reference_quant(x.cpu(), 128, 1e-10, col, ue8m0)
            for rows in (8, 16, 32):
                q, s = T.per_token_group_quant(x, 128, 1e-10, col, ue8m0, block_rows=rows)
                exact = torch.equal(q.view(torch.uint8).cpu(), qr.view(torch.uint8)) and torch.equal(s.cpu(), sr)
                xs = [torch.randn_like(x) for _ in range(2)]
                t = timing.measure([lambda xi=xi: T.per_token_group_quant(xi, 128, 1e-10, col, ue8m0, block_rows=rows)
                                    for xi in xs], dev, tcfg)
                nbytes = x.numel() * 2 + x.numel() + s.numel() * 4
                bw = nbytes / (t.median_us * 1e-6)
                rec = dict(col=col, ue8m0=ue8m0, rows=rows, exact=exact, us=t.median_us, bw=bw, frac=bw / copy_bw)
                report["quant"].append(rec)
                log(f"quant M={qm} K={qk} col={col:d} ue8m0={ue8m0:d} rows={rows:2d}: exact={exact} {t.median_us:7.1f} us "
                    f"{bw / 1e12:.2f} TB/s = {100 * bw / copy_bw:.0f}% of copy")
        del x, xs, q, s, qr, sr
    except Exception as e:  # keep going: the GEMMs matter more
        report["errors"].append(f"quant: {e!r}")
        traceback.print_exc()

    # 2b. CUDA-graph capture of every op path -----------------------------
    if dev.type == "cuda":
        try:
            capture_check(dev, report)
        except Exception as e:
            report["errors"].append(f"capture stage: {e!r}")
            traceback.print_exc()

    # 3. precompile -------------------------------------------------------
    t_pc = time.perf_counter()
    jobs = 0
    for n, k in shapes if dev.type == "cuda" else []:
        cfgs = sorted({c for m in ms for c in alternatives(m, n, k, sms, args.quick)}, key=str)
        jobs += T.precompile(n, k, dev, ms=ms, fused=(False,), configs=cfgs, workers=16)
        jobs += T.precompile(n, k, dev, ms=[m for m in ms if m <= 128], fused=(True,), workers=16)
    log(f"precompiled {jobs} launches in {time.perf_counter() - t_pc:.1f}s")

    # 4. GEMMs ------------------------------------------------------------
    for n, k in shapes:
        bench_shape(dev, n, k, ms, sms, copy_bw, tcfg, report, args.quick)

    # report --------------------------------------------------------------
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "fp8_block_triton.json").write_text(json.dumps(report, indent=1))
    print("\n== fp8_block Triton (us, median, cold L2; floor = max(bytes/copy BW, FLOP/1979T)) ==")
    print(f"{'N x K':>12} {'M':>5} {'floor':>7} {'bf16':>7} {'cuBLAS':>7} {'triton':>7} {'best':>7} "
          f"{'best cfg':<20} {'fused':>7} {'2step':>7} {'lin_op':>7} {'old':>7} {'TF/s':>6} modes")
    tuned = {}
    for p in report["points"]:
        us = p["us"]
        tri = {kk: v for kk, v in us.items() if kk in ("triton", "old") or kk.startswith("alt")}
        best = min(tri, key=tri.get) if tri else None
        tf = 2 * p["m"] * p["n"] * p["k"] / (tri[best] * 1e-6) / 1e12 if best else math.nan
        print(f"{p['n']:>6}x{p['k']:<5} {p['m']:>5} {p['floor_us']:7.1f} {us.get('bf16', math.nan):7.1f} "
              f"{us.get('cublas', us.get('padded', math.nan)):7.1f} {us.get('triton', math.nan):7.1f} "
              f"{tri.get(best, math.nan):7.1f} {p['cfg'].get(best, '-'):<20} {us.get('lin_fused', math.nan):7.1f} "
              f"{us.get('lin_2step', math.nan):7.1f} {us.get('lin_op', math.nan):7.1f} "
              f"{us.get('old', us.get('triton', math.nan)):7.1f} {tf:6.0f} "
              + "".join(p["mode"].get(kk, "-")[0] for kk in us))
        if best and best not in ("triton", "old"):
            tuned[(T.m_bucket(p["m"]), p["n"], p["k"])] = p["cfg"][best]
    q_ok = [r for r in report["quant"] if r["exact"]]
    if report["quant"]:
        bq = max(report["quant"], key=lambda r: r["frac"])
        print(f"quant M={qm} K={qk}: best {bq['us']:.1f} us = {100 * bq['frac']:.0f}% of copy BW "
              f"(rows={bq['rows']}, col={bq['col']}, ue8m0={bq['ue8m0']}); bit-exact {len(q_ok)}/{len(report['quant'])}")
    print("configs that beat the default (bucket, N, K): config  -> candidates for _TUNED")
    for key, c in sorted(tuned.items()):
        print(f"  {key}: {c}")
    print("modes: one letter per timed provider in row order (bf16, cuBLAS, triton, old, alts..., fused, 2step, "
          "lin_op): g = CUDA-graph replay, e = events (capture failed: see notes), w = wall clock")
    ok_cap = [c for c in report["capture"] if c["ok"]]
    print(f"capture: {len(ok_cap)}/{len(report['capture'])} op paths captured and replayed bit-exact")
    for note in report["notes"][:15]:
        print("  note " + note)
    if report["skipped"]:
        print(f"skipped (time budget): {', '.join(report['skipped'])}")
    print(f"errors: {len(report['errors'])}")
    for e in report["errors"][:20]:
        print("  " + e)
    log("done")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
