"""Where the time of the NVFP4 wgmma kernel (csrc/nvfp4_wgmma.cu) goes: the
kernel as shipped, the same pipeline with the decode left out (raw weight
words into the MMA: loads + MMA), and with the MMA left out (loads +
decode), at a few (shape, M, config) points, next to bf16 ``F.linear``.
Cold L2 (weight copies past 2x L2), CUDA-graph replay, medians.

    python -m benchmarks.experiments.nvfp4_wgmma [--points 28672x4096:64,4096x4096:64]

Prints one line per point; with ``$OUT`` set, writes ``nvfp4_wgmma.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import scaledmm  # noqa: F401
from benchmarks import timing
from scaledmm import jit
from scaledmm.ops import nvfp4_wgmma as wg

POINTS = [((28672, 4096), 128), ((28672, 4096), 512), ((28672, 4096), 4096), ((4096, 4096), 64),
          ((4096, 14336), 512)]
TILES = (64, 128)
VARIANTS = {0: "full", 1: "no decode", 2: "no mma"}


def spec(n, k, cfg, profile):
    defines = cfg.defines(n, k, torch.bfloat16, None, torch.bfloat16)
    defines["W_PROFILE"] = profile
    return jit.NvrtcKernelSpec(wg.KERNEL, wg.source_path(), arch=wg.ARCH, defines=defines)


def _points(spec: str) -> list:
    out = []
    for item in spec.split(","):
        shape, m = item.split(":")
        n, k = shape.split("x")
        out.append(((int(n), int(k)), int(m)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", help="comma list of NxK:M (default: the module's POINTS)")
    args = p.parse_args()
    dev = torch.device("cuda")
    tcfg = timing.TimingConfig.for_device(dev, quick=True)
    rows = []
    for (n, k), m in (_points(args.points) if args.points else POINTS):
        copies = timing.copies_for(n * k * 9 // 16, tcfg)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        one = torch.tensor(1.0, device=dev)
        ws = []
        for _ in range(copies):
            w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
            ws.append(torch.ops.scaledmm.nvfp4_quant(w, one))
        wbf = [(torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
               for _ in range(timing.copies_for(n * k * 2, tcfg))]
        bf = timing.measure([lambda w=w: F.linear(x, w) for w in wbf], dev, tcfg).median_us
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        cfgs = [wg.choose_config(n, k, m)] + [wg.WgmmaConfig(t, 2, 4, 1) for t in TILES if t <= max(64, 2 * m)]
        for cfg in dict.fromkeys(cfgs):
            for prof, name in VARIANTS.items():
                kern = spec(n, k, cfg, prof).kernel()

                def call(c, cfg=cfg, kern=kern):
                    x_map = jit.tensor_map_2d(x.data_ptr(), 3, k, m, k * 2, wg.K_MULTIPLE, cfg.tile_m, 128)
                    w_map = jit.tensor_map_2d(c[0].data_ptr(), 1, k // 2, n, k // 2, wg.K_MULTIPLE // 2,
                                              cfg.rows(), 32)
                    s_map = jit.tensor_map_2d(c[1].data_ptr(), 1, 256, c[1].numel() // 256, 256, 256, 2, 0)
                    kern.launch(cfg.grid(n, m), cfg.threads(), (x_map, w_map, s_map, one, None, out, ctypes.c_int(m)),
                                device=dev, shared_mem=cfg.smem_bytes())
                us = timing.measure([lambda c=c: call(c) for c in ws], dev, tcfg).median_us
                row = {"n": n, "k": k, "m": m, "cfg": cfg.short(), "variant": name, "us": round(us, 2),
                       "bf16_us": round(bf, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "nvfp4_wgmma.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
