"""H200 check of the fused-A skinny GEMM's launch overlap (issue 7): version 1
(``RegConfig``, the default kernel) with and without programmatic dependent
launch, with and without the L2 prefetch of each CTA's weight slice before
the PDL wait, on every ``fused_a`` shape, against bf16 ``F.linear`` measured
in the same run, plus the strided activation (rows K + 1536 wide, offset 512)
and a read-only floor (``torch.sum`` is not one: we time a copy of the same
bytes as a sanity line).

    python -m benchmarks.experiments.skinny_pdl

Timing: ``benchmarks.timing.measure`` (one CUDA graph holding one pass over
weight copies that together exceed twice the L2, replayed; per-call median).
Back-to-back calls in that graph are what a PDL launch overlaps with.  Every
variant is first checked against float64 with a NaN-poisoned output, and PDL
on/off must give identical bits.  Budget: about a minute.  With ``$OUT`` set,
writes ``skinny_pdl.json`` there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F


import scaledmm  # noqa: F401
from benchmarks import timing
from scaledmm.ops import skinny_fused_a as fa

SHAPES = [(2112, 7168), (1536, 7168), (576, 7168), (256, 7168), (24576, 1536)]
MS = (1, 4, 16)


def main() -> None:
    dev = torch.device("cuda")
    tcfg = timing.TimingConfig.for_device(dev, quick=True)
    t0 = time.time()
    rows, fails = [], 0
    for n, k in SHAPES:
        copies = timing.copies_for(n * k * 2, tcfg)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            wide = torch.zeros(m, k + 1536, device=dev, dtype=torch.bfloat16)
            wide[:, 512:512 + k] = x
            xs = wide[:, 512:512 + k]
            base = fa.choose_config(n, k, m)
            variants = {"v1": (base, False), "v1_pdl": (base, True)}
            if isinstance(base, fa.RegConfig):
                pre = dataclasses.replace(base, prefetch=not base.prefetch)
                variants["v1_pdl_pf" if pre.prefetch else "v1_pdl_nopf"] = (pre, True)
                variants["v1_pf" if pre.prefetch else "v1_nopf"] = (pre, False)
            ref = (x.double() @ ws[0].double().t())
            bits = {}
            for name, (cfg, pdl) in variants.items():
                for inp, tag in ((x, ""), (xs, "_strided")):
                    out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    fa.launch(inp, ws[0], out, pdl, cfg)
                    torch.cuda.synchronize()
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    ok = bool(torch.isfinite(out).all()) and err < 1e-2
                    bits[(cfg, tag)] = bits.get((cfg, tag), out)
                    same = torch.equal(bits[(cfg, tag)], out)
                    if not (ok and same):
                        fails += 1
                        print(f"FAIL {n}x{k} m={m} {name}{tag}: err {err:.2e} same-bits {same}", flush=True)
            res = {}
            for name, (cfg, pdl) in variants.items():
                res[name] = timing.measure(
                    [(lambda w, c=cfg, p=pdl: lambda: fa.launch(x, w, torch.empty(m, n, device=dev,
                                                                                   dtype=torch.bfloat16), p, c))(w)
                     for w in ws], dev, tcfg).median_us
            if m in (1, 16):  # a small v1 sweep under PDL (two CTAs per SM need fewer registers x threads)
                sweep = []
                for rows_ in (16, 32):
                    for warps in (4, 8):
                        for split in (1, 2, 4, 8):
                            for unroll in (2, 4):
                                c = fa.RegConfig(rows_, warps, split, unroll)
                                if c == base or not fa.config_valid(c, n, k, fa.m_bucket(m))[0]:
                                    continue
                                if -(-n // rows_) * split > 2 * 132:
                                    continue
                                try:
                                    us = timing.measure(
                                        [(lambda w, c=c: lambda: fa.launch(x, w, torch.empty(
                                            m, n, device=dev, dtype=torch.bfloat16), True, c))(w) for w in ws],
                                        dev, tcfg).median_us
                                except Exception as e:  # noqa: BLE001 - reported, not fatal
                                    print(f"  {c.short()}: {type(e).__name__}: {e}"[:160])
                                    continue
                                sweep.append((us, c.short()))
                sweep.sort()
                res["sweep_pdl_best"] = sweep[0][0] if sweep else float("nan")
                print("  PDL sweep: " + "  ".join(f"{c} {u:.2f}" for u, c in sweep[:6]), flush=True)
            res["op_pdl_strided"] = timing.measure(
                [(lambda w: lambda: torch.ops.scaledmm.dsv3_fused_a_gemm(xs, w, True))(w) for w in ws],
                dev, tcfg).median_us
            res["op"] = timing.measure(
                [(lambda w: lambda: torch.ops.scaledmm.dsv3_fused_a_gemm(x, w))(w) for w in ws], dev, tcfg).median_us
            res["linear"] = timing.measure([(lambda w: lambda: F.linear(x, w))(w) for w in ws], dev, tcfg).median_us
            res["copy"] = timing.measure([(lambda w: lambda: w.clone())(w) for w in ws[: max(2, copies // 2)]],
                                         dev, tcfg).median_us
            floor = n * k * 2 / 4.12e6  # us at the measured 4.12 TB/s copy rate
            rows.append(dict(n=n, k=k, m=m, cfg=base.short(), floor_us=floor, **res))
            print(f"{n}x{k} m={m:2d} {base.short():>16}  " + "  ".join(f"{kk} {v:.2f}" for kk, v in res.items())
                  + f"  floor {floor:.2f}  ({time.time() - t0:.0f}s)", flush=True)
        del ws
        torch.cuda.empty_cache()
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("n", "k", "m", "cfg", "floor_us")))
    print("\n| N x K | M | cfg | " + " | ".join(keys) + " | floor | linear / best |")
    print("|---|---|---|" + "---|" * (len(keys) + 2))
    for r in rows:
        best = min(r[k] for k in keys if k in r and k.startswith(("v1", "op", "sweep")))
        print(f"| {r['n']}x{r['k']} | {r['m']} | {r['cfg']} | "
              + " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in keys)
              + f" | {r['floor_us']:.2f} | {r['linear'] / best:.2f}x |")
    print(f"\n{fails} failures; {time.time() - t0:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "skinny_pdl.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
