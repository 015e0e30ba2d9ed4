"""H200 check of the small-M NVFP4 CUDA kernel (backend ``cuda_gemv``,
ops/nvfp4_gemv.py): correctness against the float64 reference, then the new
kernel vs the Triton default vs bf16 ``F.linear`` at M in 1, 4, 16 on the
llama8b shapes (cold L2: weight copies rotated past 2x L2; CUDA-graph replay;
medians), and a config sweep printing the best config per point.

    python -m benchmarks.experiments.nvfp4_gemv [--quick] [--part w4a4|w4a16|all] [--ms 32,64,128] [--sweep N]

``--part w4a16`` times ``nvfp4_w4a16_mm`` instead (bf16 activation; the
kernel vs the Triton W4A16 kernel vs bf16 ``F.linear``, a short sweep).
``--ms`` picks the M values (default 1,4,16); at M >= 64 the exact
``decode_cublas`` backend is timed too (its M >= 128 gate bypassed), the
break-even that sets ``MAX_M``.  ``--sweep`` caps the configs per point;
``--act fp16`` runs the W4A16 part with an fp16 activation (no bf16
conversion of the decoded weight: what that conversion costs).

Prints a compact table; with ``$OUT`` set, writes ``nvfp4_gemv.json`` there.
Budget: about 2 minutes on the H200 (40 configs per shape at M = 1 and 16; --quick: 8).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F


import scaledmm  # noqa: F401
from benchmarks import timing
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_cublas as dc
from scaledmm.ops import nvfp4_gemv as gv
from scaledmm.ops import nvfp4_triton as tr

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = (1, 4, 16)


def quantized(n, k, m, copies, dev):
    """``copies`` weight copies (packed + scales), one activation, alpha."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    one = torch.tensor(1.0, device=dev)
    gs_x = (448 * 6 / x.float().abs().amax()).reshape(())
    qa, sa = torch.ops.scaledmm.nvfp4_quant(x, gs_x)
    ws = []
    for _ in range(copies):
        w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
        gs_w = (448 * 6 / w.float().abs().amax()).reshape(())
        qb, sb = torch.ops.scaledmm.nvfp4_quant(w, gs_w)
        ws.append((qb, sb, w))
    alpha = (1.0 / (gs_x * 448 * 6)).float() * one
    return x, qa, sa, ws, alpha


def check(qa, sa, qb, sb, alpha, out):
    ref = nv.dequantize(qa, sa).double() @ nv.dequantize(qb, sb).double().t() * alpha.double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())).max().item()
    return torch.isfinite(out).all().item() and err < 2 ** -7, err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", choices=("w4a4", "w4a16", "all"), default="w4a4")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    ap.add_argument("--sweep", type=int, default=None, help="configs per point (default 40, --quick 8)")
    ap.add_argument("--act", choices=("bf16", "fp16"), default="bf16", help="W4A16 activation dtype")
    args = ap.parse_args()
    ms = tuple(int(v) for v in args.ms.split(","))
    sweep_n = args.sweep if args.sweep is not None else 8 if args.quick else 40
    if args.part in ("w4a16", "all"):
        w4a16_part(args.quick, ms, args.sweep, torch.float16 if args.act == "fp16" else torch.bfloat16)
    if args.part == "w4a16":
        return
    dev = torch.device("cuda")
    cfg_t = timing.TimingConfig.for_device(dev, quick=True)
    t_start = time.time()
    rows, fails = [], 0
    for n, k in SHAPES:
        bf16_bytes = n * k * 2
        copies = timing.copies_for(n * k * 9 // 16, cfg_t)
        bf_copies = timing.copies_for(bf16_bytes, cfg_t)
        for m in ms:
            x, qa, sa, ws, alpha = quantized(n, k, m, max(copies, bf_copies) if m == 1 else copies, dev)
            mb = gv.m_bucket(m)
            qb, sb, _ = ws[0]
            out = gv.gemv_mm(qa, qb, sa, sb, alpha)
            ok, err = check(qa, sa, qb, sb, alpha, out)
            det = torch.equal(out, gv.gemv_mm(qa, qb, sa, sb, alpha))
            fails += (not ok) + (not det)

            def t(fn_for):
                return timing.measure([fn_for(c) for c in ws[:copies]], dev, cfg_t).median_us

            us_new = t(lambda c: lambda: gv.gemv_mm(qa, c[0], sa, c[1], alpha))
            us_tri = t(lambda c: lambda: tr.mm(qa, c[0], sa, c[1], alpha))
            us_dc = t(lambda c: lambda: dc.mm(qa, c[0], sa, c[1], alpha)) if m >= 64 else float("nan")
            wbf = [c[2] for c in ws[:bf_copies]] if m == 1 else None
            if wbf is None:
                wbf = [(torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16) for _ in range(bf_copies)]
            us_bf = timing.measure([(lambda w: lambda: F.linear(x, w))(w) for w in wbf], dev, cfg_t).median_us
            del wbf
            sweep = []
            budget = 0 if m == 4 else sweep_n  # M = 4 shares M = 1's bucket
            for cfg in gv.candidate_configs(n, k, mb)[:budget]:
                try:
                    us = t(lambda c, cfg=cfg: lambda: gv.launch(qa, c[0], sa, c[1], alpha, None,
                                                                nv.mm_output(qa, c[0], torch.bfloat16), cfg))
                except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
                    print(f"  {n}x{k} m={m} {cfg.short()}: {type(e).__name__}: {e}"[:200])
                    continue
                sweep.append((us, cfg.short()))
            best = min(sweep) if sweep else (float("nan"), "-")
            rows.append(dict(n=n, k=k, m=m, ok=bool(ok), det=det, err=err, gemv_us=us_new, triton_us=us_tri,
                             decode_cublas_us=us_dc, bf16_us=us_bf, default=gv.choose_config(n, k, mb).short(), best=best[1],
                             best_us=best[0], sweep=sweep))
            print(f"{n}x{k} m={m}: ok={ok} det={det} gemv {us_new:.1f} triton {us_tri:.1f} dc {us_dc:.1f} bf16 {us_bf:.1f} "
                  f"best {best[1]} {best[0]:.1f}  ({time.time() - t_start:.0f}s)", flush=True)
            del ws
            torch.cuda.empty_cache()
    report(rows, "", fails, t_start, "nvfp4_gemv.json")


def report(rows: list[dict], label: str, fails: int, t_start: float, fname: str) -> None:
    """The markdown table of ``rows``, the failure count, ``$OUT/fname``."""
    print(f"\n| {label}N x K | M | ok | gemv us | triton us | decode_cublas us | bf16 us | bf16/gemv | default | "
          "best cfg | best us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']}x{r['k']} | {r['m']} | {'y' if r['ok'] and r['det'] else 'NO'} | {r['gemv_us']:.1f} | "
              f"{r['triton_us']:.1f} | {r.get('decode_cublas_us', float('nan')):.1f} | {r['bf16_us']:.1f} | "
              f"{r['bf16_us'] / r['gemv_us']:.2f}x | {r['default']} | {r['best']} | {r['best_us']:.1f} |")
    print(f"\n{label}{fails} correctness/determinism failures; {time.time() - t_start:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], fname).write_text(json.dumps(rows, indent=1))


def w4a16_part(quick: bool, ms: tuple[int, ...] = MS, sweep_n: int | None = None,
               act: torch.dtype = torch.bfloat16) -> None:
    """W4A16 (``act`` activation): correctness, the kernel vs Triton vs bf16."""
    dev = torch.device("cuda")
    cfg_t = timing.TimingConfig.for_device(dev, quick=True)
    t_start, rows, fails = time.time(), [], 0
    for n, k in SHAPES:
        copies = timing.copies_for(n * k * 9 // 16, cfg_t)
        bf_copies = timing.copies_for(n * k * 2, cfg_t)
        one = torch.tensor(1.0, device=dev)
        ws = []
        for _ in range(copies):
            w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
            gs_w = (448 * 6 / w.float().abs().amax()).reshape(())
            qb, sb = torch.ops.scaledmm.nvfp4_quant(w, gs_w)
            ws.append((qb, sb, (1.0 / gs_w).float() * one))
        wbf = [(torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16) for _ in range(bf_copies)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=act)
            mb = gv.m_bucket(m)
            qb, sb, wa = ws[0]
            out = gv.gemv_w4a16(x, qb, sb, wa)
            ref = x.double() @ nv.dequantize(qb, sb).double().t() * wa.double()
            err = ((out.double() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())).max().item()
            ok = bool(torch.isfinite(out).all()) and err < 2 ** -7
            det = torch.equal(out, gv.gemv_w4a16(x, qb, sb, wa))
            fails += (not ok) + (not det)

            def t(fn_for, c_list):
                return timing.measure([fn_for(c) for c in c_list], dev, cfg_t).median_us

            us_new = t(lambda c: lambda: gv.gemv_w4a16(x, c[0], c[1], c[2]), ws)
            us_tri = t(lambda c: lambda: tr.w4a16_mm(x, c[0], c[1], c[2]), ws)
            us_dc = t(lambda c: lambda: dc.w4a16_mm(x, c[0], c[1], c[2]), ws) if m >= 64 else float("nan")
            xb = x.to(torch.bfloat16)
            us_bf = t(lambda w: lambda: F.linear(xb, w), wbf)
            sweep = []
            budget = 0 if m == 4 else sweep_n if sweep_n is not None else 6 if quick else 16
            for cfg in gv.candidate_configs(n, k, mb, w4a16=True)[:budget]:
                try:
                    us = t(lambda c, cfg=cfg: lambda: gv.launch(x, c[0], c[1], c[1], c[2], None,
                                                                nv.mm_output(x, c[0], torch.bfloat16), cfg), ws)
                except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
                    print(f"  {n}x{k} m={m} {cfg.short()}: {type(e).__name__}: {e}"[:200])
                    continue
                sweep.append((us, cfg.short()))
            best = min(sweep) if sweep else (float("nan"), "-")
            rows.append(dict(n=n, k=k, m=m, ok=ok, det=det, err=err, gemv_us=us_new, triton_us=us_tri,
                             decode_cublas_us=us_dc, bf16_us=us_bf, default=gv.choose_config(n, k, mb, w4a16=True).short(),
                             best=best[1], best_us=best[0], sweep=sweep))
            print(f"W4A16 {n}x{k} m={m}: ok={ok} det={det} err={err:.1e} gemv {us_new:.1f} triton {us_tri:.1f} "
                  f"bf16 {us_bf:.1f} best {best[1]} {best[0]:.1f}  ({time.time() - t_start:.0f}s)", flush=True)
        del ws, wbf
        torch.cuda.empty_cache()
    report(rows, "W4A16 ", fails, t_start, "nvfp4_gemv_w4a16.json")


if __name__ == "__main__":
    main()
