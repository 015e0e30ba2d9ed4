"""Mid-M sweep of the fp8_block Triton kernel (issue 5): M = 128..1024, where
cuBLAS blockwise is flat (~23 us at 2112x7168 for M = 128..256) and the
Triton defaults launch too few programs (34 tiles of 128x128 at M = 256,
N = 2112).  Tries tile x stages x split-K (workspace traffic grows with
split x M x N, so the best split falls as M grows) and prints, per (shape, M),
the default, the best config and cuBLAS in the same run (cold L2: weight
copies rotated; medians).  JSON to ``$OUT/fp8_block_mid.json``.

``python -m benchmarks.experiments.fp8_block_mid`` on the H200 (device tool).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path


import torch

from benchmarks import timing
from scaledmm.ops import fp8_block as base
from scaledmm.ops import fp8_block_triton as T

SHAPES = [(2112, 7168), (576, 7168), (4096, 7168), (7168, 2048), (24576, 1536), (32768, 512), (7168, 16384)]
MS = (128, 256, 512, 1024)
TILES = [(64, 128, 4), (128, 128, 8), (128, 64, 4)]
SPLITS = (1, 2, 3, 4, 6)
STAGES = (3, 4)
BUDGET_S = 240.0


def main() -> int:
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    tcfg = timing.TimingConfig.for_device(dev, quick=True)
    out, rows = [], []
    for n, k in SHAPES:
        wbytes = n * k
        copies = max(2, min(16, (240 << 20) // wbytes))
        bs_ = [(torch.randn(n, k, device=dev) * 2).to(torch.float8_e4m3fn) for _ in range(copies)]
        bss = [torch.rand((n + 127) // 128, (k + 127) // 128, device=dev) + 0.05 for _ in range(copies)]
        for m in MS:
            if time.perf_counter() - t0 > BUDGET_S:
                print(f"budget spent: skipping {n}x{k} M={m}")
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            a, sa = base.reference_quant(x, 128, 1e-10, True)
            ref = base.reference_mm(a, bs_[0], sa, bss[0], [128, 128], torch.float32)

            def t_of(fn):
                return timing.measure([lambda i=i: fn(bs_[i], bss[i]) for i in range(copies)], dev, tcfg).median_us

            res = {"n": n, "k": k, "m": m}
            res["cublas"] = t_of(lambda b, s: torch.ops.scaledmm.fp8_block_mm(a, b, sa, s)) \
                if m % 4 == 0 else None
            dflt = T.default_config(m, n, k, T._num_sms(dev))
            res["default"] = (dflt.short(), t_of(lambda b, s: T.mm(a, b, sa, s, config=dflt)))
            best = None
            for bm, bn, w in TILES:
                for st in STAGES:
                    for sk in SPLITS:
                        cfg = T.MMConfig(bm, bn, split_k=sk, num_warps=w, num_stages=st)
                        if not T.config_ok(cfg, m, n, k)[0]:
                            continue
                        try:
                            got = T.mm(a, bs_[0], sa, bss[0], config=cfg).float()
                            err = ((got - ref).norm() / ref.norm()).item()
                            if not err < 1e-2:
                                res.setdefault("wrong", []).append((cfg.short(), err))
                                continue
                            us = t_of(lambda b, s, cfg=cfg: T.mm(a, b, sa, s, config=cfg))
                        except Exception as e:  # a config that does not compile or fit
                            res.setdefault("failed", []).append((cfg.short(), repr(e)[:120]))
                            continue
                        rows.append(dict(n=n, k=k, m=m, cfg=dataclasses.asdict(cfg), short=cfg.short(), us=us))
                        if best is None or us < best[1]:
                            best = (cfg.short(), us, dataclasses.asdict(cfg))
            res["best"] = best
            out.append(res)
            cb = f"{res['cublas']:.1f}" if res["cublas"] else "n/a"
            print(f"{n:6d}x{k:<6d} M={m:5d}  cublas {cb:>7}  default {res['default'][0]:>18} "
                  f"{res['default'][1]:7.1f}  best {best[0] if best else '-':>18} {best[1] if best else 0:7.1f}",
                  flush=True)
        del bs_, bss
        torch.cuda.empty_cache()
    dest = os.environ.get("OUT")
    if dest:
        Path(dest, "fp8_block_mid.json").write_text(json.dumps(dict(points=out, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
