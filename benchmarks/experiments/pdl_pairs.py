"""What a programmatic-dependent-launch successor costs a cuBLAS GEMM: the
question behind Inductor's PDL (``triton.enable_pdl``) moving the
Llama-3-8B layer both ways at M = 512-4096 while it saves 2-5 us at M = 1-8
(benchmarks/RESULTS.md, "Inductor's PDL by default").

    python -m benchmarks.experiments.pdl_pairs

For bf16 ``torch.mm`` and FP8 row-wise ``torch._scaled_mm`` (both cuBLAS) on
the layer's four projection shapes at M = 8 and 512, graph-replayed per-call
medians (``benchmarks.timing``: cold L2 over weight copies) of

* ``gemm``: the GEMM alone;
* ``next``: the successor alone, an elementwise kernel over the GEMM's output
  (``y = 2 out``: the shape of the layer's residual adds and SiLU-muls);
* ``plain``: the GEMM, then the successor launched as usual;
* ``pdl``: the GEMM, then the successor launched as Inductor launches its
  kernels under ``triton.enable_pdl``: ``launch_pdl``, ``gdc_wait`` before
  its load, ``gdc_launch_dependents`` after it.

``pdl - plain`` above zero by more than the spread means the GEMM lets its
dependents launch before it ends and their waiting CTAs slow it (or the edge
itself costs); below zero, the overlap of the successor's launch pays.  The
successor's output is checked equal in both launches.  About a minute.  With
``$OUT`` set, writes ``pdl_pairs.json`` there.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks import timing

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = (8, 512)
BLOCK = 1024


@triton.jit
def _twice(src, dst, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        gdc_wait()
    v = tl.load(src + i, mask=i < n)
    if PDL:
        gdc_launch_dependents()
    tl.store(dst + i, v * 2, mask=i < n)


def _next(out: torch.Tensor, dst: torch.Tensor, pdl: bool) -> None:
    n = out.numel()
    kw = {"launch_pdl": True} if pdl else {}
    _twice[(triton.cdiv(n, BLOCK),)](out, dst, n, BLOCK=BLOCK, PDL=pdl, **kw)


def _gemms(m: int, n: int, k: int, copies: int, dev: torch.device):
    """name -> (weight copies, gemm(w) -> out), one activation of M rows."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    xq = x.to(torch.float8_e4m3fn)
    wq = [w.to(torch.float8_e4m3fn) for w in ws]
    sa = torch.ones(m, 1, device=dev)
    sb = torch.ones(1, n, device=dev)
    return {
        "bf16 mm": (ws, lambda w: torch.mm(x, w.t())),
        "fp8 row-wise": (wq, lambda w: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb,
                                                         out_dtype=torch.bfloat16)),
    }


def main() -> None:
    dev = torch.device("cuda")
    cfg = timing.TimingConfig.for_device(dev, quick=True)
    rows = []
    for n, k in SHAPES:
        copies = timing.copies_for(n * k * 2, cfg)
        for m in MS:
            for name, (ws, gemm) in _gemms(m, n, k, copies, dev).items():
                outs = [gemm(w) for w in ws]
                dst = torch.empty_like(outs[0])
                ref = torch.empty_like(dst)
                _next(outs[0], ref, False)
                dst.fill_(float("nan"))
                _next(outs[0], dst, True)
                torch.cuda.synchronize()
                assert torch.equal(dst, ref), "the PDL launch of the successor changed its output"

                def pair(w, pdl):
                    _next(gemm(w), dst, pdl)

                t = {
                    "gemm": timing.measure([lambda w=w: gemm(w) for w in ws], dev, cfg),
                    "next": timing.measure([lambda o=o: _next(o, dst, False) for o in outs], dev, cfg),
                    "plain": timing.measure([lambda w=w: pair(w, False) for w in ws], dev, cfg),
                    "pdl": timing.measure([lambda w=w: pair(w, True) for w in ws], dev, cfg),
                }
                row = {"gemm": name, "n": n, "k": k, "m": m,
                       **{key: [round(v.median_us, 2), round(v.p20_us, 2), round(v.p80_us, 2)] for key, v in t.items()}}
                rows.append(row)
                print(f"{name:13s} {n:5d}x{k:<5d} M={m:<4d} " + "  ".join(
                    f"{key} {v.median_us:7.1f} [{v.p20_us:.1f}-{v.p80_us:.1f}]" for key, v in t.items())
                    + f"  pdl-plain {t['pdl'].median_us - t['plain'].median_us:+.1f}", flush=True)
                del outs
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pdl_pairs.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
