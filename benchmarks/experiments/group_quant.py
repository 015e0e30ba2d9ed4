"""GPU check + sweep of ``per_token_group_quant_fp8`` (Triton) tile choices.

``python -m benchmarks.experiments.group_quant`` on the H200 (device tool):
bit-exactness of the default and of each (groups per program, warps) tile
against ``ops.fp8_block.reference_quant`` at K = 7168 and 1536, then times at
M = 1, 3, 16, 128, 4096 (cold L2 by rotating input copies, CUDA-graph replay
for small calls, medians) against the device-to-device copy bandwidth and a
plain ``x.to(e4m3)`` cast measured in the same run.  Prints one table; JSON
to ``$OUT/group_quant.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


import torch

from benchmarks import timing
from scaledmm.ops import fp8_block as base
from scaledmm.ops import fp8_block_triton_quant as Q

TILES = [(8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8)]
MS = (1, 3, 16, 128, 4096)


def main() -> int:
    dev = torch.device("cuda")
    tcfg = timing.TimingConfig.for_device(dev, quick=True)
    src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timing.measure([lambda: dst.copy_(src)], dev, tcfg)
    copy_bw = 2 * src.numel() / (t.median_us * 1e-6)
    del src, dst
    print(f"copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows, bad = [], []
    for k in (7168, 1536):
        for m in MS + (4095, 17):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 3
            x[0, :128] = 0  # an all-zero group
            for col, ue in ((False, False), (True, False), (True, True)):
                qr, sr = base.reference_quant(x.cpu(), 128, 1e-10, col, ue)
                for tile in [None] + TILES:
                    for order in (True, False):
                        kw = {} if tile is None else dict(block_rows=tile[0], num_warps=tile[1])
                        q, s = Q.per_token_group_quant(x, 128, 1e-10, col, ue, token_minor=order, **kw)
                        if not (torch.equal(q.view(torch.uint8).cpu(), qr.view(torch.uint8))
                                and torch.equal(s.cpu(), sr)):
                            bad.append(f"M={m} K={k} col={col} ue8m0={ue} tile={tile} token_minor={order}")
        for m in MS:
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(timing.copies_for(m * k * 3, tcfg))]
            nbytes = m * k * 3 + m * (k // 128) * 4
            cast = timing.measure([lambda xi=xi: xi.to(torch.float8_e4m3fn) for xi in xs], dev, tcfg).median_us
            default = Q.quant_tile(m * (k // 128), 128, dev)
            for tile in [None] + TILES:
                for order in (True, False):  # column-major scales: token-minor (default) or group-minor walk
                    kw = {} if tile is None else dict(block_rows=tile[0], num_warps=tile[1])
                    us = timing.measure([lambda xi=xi: Q.per_token_group_quant(xi, 128, 1e-10, True, token_minor=order,
                                                                               **kw) for xi in xs],
                                        dev, tcfg).median_us
                    bw = nbytes / (us * 1e-6)
                    label = str(tile or f"default{default}") + (" tok" if order else " grp")
                    rows.append(dict(m=m, k=k, tile=label, us=us, cast_us=cast, pct_copy=100 * bw / copy_bw))
            del xs
    print(f"\n{'M':>5} {'K':>5} {'tile':>18} {'us':>8} {'cast us':>8} {'% copy':>7}")
    for r in rows:
        print(f"{r['m']:5d} {r['k']:5d} {r['tile']:>18} {r['us']:8.1f} {r['cast_us']:8.1f} {r['pct_copy']:7.1f}")
    print("bit-exact: all" if not bad else "NOT bit-exact: " + "; ".join(bad[:20]))
    out = os.environ.get("OUT")
    if out:
        Path(out, "group_quant.json").write_text(json.dumps(dict(copy_bw=copy_bw, rows=rows, bad=bad), indent=1))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
