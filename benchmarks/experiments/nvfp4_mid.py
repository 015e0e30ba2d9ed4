"""H200 check of the middle-M NVFP4 CUDA kernel (backend ``cuda_mid``,
ops/nvfp4_mid.py): correctness against the float64 reference (and bit
determinism), then the kernel's default config vs the Triton default vs
``decode_cublas`` vs bf16 ``F.linear`` on the llama8b shapes (cold L2: weight
copies rotated past 2x L2; CUDA-graph replay; medians), and a short config
sweep per point.

    python -m benchmarks.experiments.nvfp4_mid [--part w4a4|w4a16|all] [--sweep N]
    python -m benchmarks.experiments.nvfp4_mid --slices    # M 65-127: 64-row slices vs the 128-row bucket

W4A4 at M = 48, 64, 128 (M <= 32 belongs to ``cuda_gemv``), W4A16 (bf16
activation) at M = 24, 64, 128.  Prints a table per part; with ``$OUT`` set,
writes ``nvfp4_mid.json`` there.  Budget: about 3 minutes on the H200.
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
from scaledmm.ops import nvfp4_mid as md
from scaledmm.ops import nvfp4_triton as tr

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


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


MS = {"w4a4": (48, 64, 128), "w4a16": (24, 64, 128)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())).max().item()


def run_part(part: str, sweep_n: int) -> tuple[list[dict], int]:
    dev = torch.device("cuda")
    cfg_t = timing.TimingConfig.for_device(dev, quick=True)
    w4a16 = part == "w4a16"
    rows, fails, t0 = [], 0, time.time()
    for n, k in SHAPES:
        copies = timing.copies_for(n * k * 9 // 16, cfg_t)
        bf_copies = timing.copies_for(n * k * 2, cfg_t)
        wbf = [(torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16) for _ in range(bf_copies)]
        for m in MS[part]:
            x, qa, sa, ws, alpha = quantized(n, k, m, copies, dev)
            mb = md.m_bucket(m)
            qb, sb, _ = ws[0]
            wd = nv.dequantize(qb, sb).double()
            if w4a16:
                def call(c, cfg=None):
                    return md.mid_w4a16(x, c[0], c[1], alpha, cfg=cfg)
                ref = x.double() @ wd.t() * alpha.double()
                others = {"triton": lambda c: tr.w4a16_mm(x, c[0], c[1], alpha),
                          "decode_cublas": lambda c: dc.w4a16_mm(x, c[0], c[1], alpha)}
            else:
                def call(c, cfg=None):
                    return md.mid_mm(qa, c[0], sa, c[1], alpha, cfg=cfg)
                ref = nv.dequantize(qa, sa).double() @ wd.t() * alpha.double()
                others = {"triton": lambda c: tr.mm(qa, c[0], sa, c[1], alpha),
                          "decode_cublas": lambda c: dc.mm(qa, c[0], sa, c[1], alpha)}
            out = call(ws[0])
            err = rel_err(out, ref)
            ok = bool(torch.isfinite(out).all()) and err < 2 ** -7
            det = torch.equal(out, call(ws[0]))
            fails += (not ok) + (not det)

            def t(fn):
                return timing.measure([(lambda c: lambda: fn(c))(c) for c in ws], dev, cfg_t).median_us

            row = dict(n=n, k=k, m=m, ok=ok, det=det, err=err, mid_us=t(call),
                       default=md.choose_config(n, k, mb, w4a16=w4a16).short())
            for name, fn in others.items():
                row[f"{name}_us"] = t(fn)
            row["bf16_us"] = timing.measure([(lambda w: lambda: F.linear(x, w))(w) for w in wbf], dev, cfg_t).median_us
            sweep = []
            budget = sweep_n if m != 48 and m != 24 else 0
            for cfg in md.candidate_configs(n, k, mb, w4a16=w4a16)[:budget]:
                try:
                    o = call(ws[0], cfg)
                    good = rel_err(o, ref) < 2 ** -7 and bool(torch.isfinite(o).all())
                    us = t(lambda c, cfg=cfg: call(c, cfg))
                except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
                    print(f"  {n}x{k} m={m} {cfg.short()}: {type(e).__name__}: {e}"[:300])
                    fails += 1
                    continue
                fails += not good
                sweep.append((us, cfg.short(), good))
            best = min(sweep) if sweep else (float("nan"), "-", True)
            row.update(best=best[1], best_us=best[0], sweep=sweep)
            rows.append(row)
            print(f"{part} {n}x{k} m={m}: ok={ok} det={det} err={err:.1e} mid {row['mid_us']:.1f} "
                  f"triton {row['triton_us']:.1f} dc {row['decode_cublas_us']:.1f} bf16 {row['bf16_us']:.1f} "
                  f"best {best[1]} {best[0]:.1f}  ({time.time() - t0:.0f}s)", flush=True)
            del ws
        del wbf
        torch.cuda.empty_cache()
    return rows, fails


def slices() -> None:
    """W4A4 at M = 80, 96, 127: the default (one 128-row slice) against two
    64-row slices with the 64-row table's config, decode_cublas for scale."""
    dev = torch.device("cuda")
    cfg_t = timing.TimingConfig.for_device(dev, quick=True)
    print("| N x K | M | 128-row bucket us | 64-row slices us | decode_cublas us | slices ok |")
    print("|---|---|---|---|---|---|")
    for n, k in SHAPES:
        copies = timing.copies_for(n * k * 9 // 16, cfg_t)
        for m in (80, 96, 127):
            x, qa, sa, ws, alpha = quantized(n, k, m, copies, dev)
            cfg64 = md.choose_config(n, k, 64)

            def sliced(c):
                return md.launch(qa, c[0], sa, c[1], alpha, None, nv.mm_output(qa, c[0], torch.bfloat16), cfg64, mb=64)

            ok = torch.equal(sliced(ws[0])[:64], md.launch(qa[:64], ws[0][0], sa, ws[0][1], alpha, None,
                                                           nv.mm_output(qa[:64], ws[0][0], torch.bfloat16), cfg64))

            def t(fn):
                return timing.measure([(lambda c: lambda: fn(c))(c) for c in ws], dev, cfg_t).median_us

            print(f"| {n}x{k} | {m} | {t(lambda c: md.mid_mm(qa, c[0], sa, c[1], alpha)):.1f} | {t(sliced):.1f} | "
                  f"{t(lambda c: dc.mm(qa, c[0], sa, c[1], alpha)):.1f} | {ok} |", flush=True)
            del ws
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("w4a4", "w4a16", "all"), default="all")
    ap.add_argument("--sweep", type=int, default=10, help="configs per point (M 64 and 128)")
    ap.add_argument("--slices", action="store_true", help="only the M 65-127 slicing comparison")
    args = ap.parse_args()
    if args.slices:
        slices()
        return
    t0, res, fails = time.time(), {}, 0
    for part in ("w4a4", "w4a16") if args.part == "all" else (args.part,):
        res[part], f = run_part(part, args.sweep)
        fails += f
    for part, rows in res.items():
        print(f"\n| {part} N x K | M | ok | mid us | triton us | decode_cublas us | bf16 us | bf16/mid | "
              "default | best cfg | best us |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['n']}x{r['k']} | {r['m']} | {'y' if r['ok'] and r['det'] else 'NO'} | {r['mid_us']:.1f} | "
                  f"{r['triton_us']:.1f} | {r['decode_cublas_us']:.1f} | {r['bf16_us']:.1f} | "
                  f"{r['bf16_us'] / r['mid_us']:.2f}x | {r['default']} | {r['best']} | {r['best_us']:.1f} |")
    print(f"\n{fails} correctness/determinism failures; {time.time() - t0:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "nvfp4_mid.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
