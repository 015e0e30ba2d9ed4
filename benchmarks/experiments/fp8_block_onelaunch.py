"""One-launch split-K of the fp8_block Triton GEMM (``MMConfig.one_launch``)
against the two-launch path (GEMM + ``splitk_reduce_kernel``) on the H200.

1. Bits: for every point, the default config and the same config with
   ``one_launch=True`` must give equal bytes (bf16 out); on 2112x7168 also fp32
   out, bias + fused quant, bias + quant op first; one-launch calls replayed
   from a CUDA graph (3 replays) and run on two streams at once against eager
   two-launch.
2. Time (cold L2: weight copies rotated, > 120 MB in all; CUDA-graph replay
   through ``benchmarks/timing.py``, medians): default (two launches), the same
   config one-launch, cuBLAS blockwise (M % 4 == 0), bf16 ``F.linear``.

``python -m benchmarks.experiments.fp8_block_onelaunch`` (< 60 s); JSON to
``$OUT/fp8_block_onelaunch.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path


import torch
import torch.nn.functional as F

from benchmarks import timing
from scaledmm.ops import fp8_block as base
from scaledmm.ops import fp8_block_triton as T

SHAPES = [(2112, 7168), (576, 7168), (7168, 16384), (4096, 7168)]
MS = (1, 4, 16, 64)
ROTATE_BYTES = 125 << 20  # > 120 MB of weights per rotation
BUDGET_S = 50.0


def configs(m: int, n: int, k: int, sms: int) -> tuple[T.MMConfig, T.MMConfig | None]:
    """The default config and its one-launch twin (None when it does not split K)."""
    dflt = T.default_config(m, n, k, sms)
    one = dataclasses.replace(dflt, one_launch=True)
    return dflt, (one if T.config_ok(one, m, n, k)[0] else None)


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def precompile(dev, sms) -> float:
    """Compile every kernel the run launches (threads), outside the timings."""
    t0 = time.perf_counter()
    for n, k in SHAPES:
        cfgs = {c for m in MS for c in configs(m, n, k, sms) if c is not None}
        T.precompile(n, k, dev, ms=(1,), fused=(False,), configs=sorted(cfgs, key=str))
    return time.perf_counter() - t0


def bit_checks(dev, sms, fails: list[str]) -> None:
    n, k = 2112, 7168
    side, streams = torch.cuda.Stream(dev), [torch.cuda.Stream(dev) for _ in range(2)]
    gen = torch.Generator(device=dev).manual_seed(1)
    b = (torch.randn(n, k, device=dev, generator=gen) * 2).to(torch.float8_e4m3fn)
    bs = torch.rand(math.ceil(n / 128), k // 128, device=dev, generator=gen) + 0.05
    bias = torch.randn(n, device=dev, generator=gen, dtype=torch.bfloat16)
    for m in MS:
        two, one = configs(m, n, k, sms)
        x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16) * 3
        q, s = T.per_token_group_quant(x, 128, column_major_scales=True)
        cases = {
            "mm fp32": lambda c: T.mm(q, b, s, bs, torch.float32, c),
            "linear fused bias": lambda c: T.linear(x, b, bs, torch.bfloat16, bias, c, fuse=True),
            "linear 2-step bias fp16": lambda c: T.linear(x, b, bs, torch.float16, bias, c, fuse=False),
        }
        for name, fn in cases.items():
            if not same_bytes(fn(one), fn(two)):
                fails.append(f"{n}x{k} M={m} {name}: one-launch bits differ")
        # CUDA graph: captured on its own stream, replayed 3 times
        want = T.mm(q, b, s, bs, torch.bfloat16, two)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            T.mm(q, b, s, bs, torch.bfloat16, one)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = T.mm(q, b, s, bs, torch.bfloat16, one)
        for r in range(3):
            got.fill_(float("nan"))
            graph.replay()
            if not same_bytes(got, want):
                fails.append(f"{n}x{k} M={m} graph replay {r}: one-launch bits differ")
        del graph
        # two streams at once (each call has its own counters)
        outs = []
        torch.cuda.synchronize(dev)
        for st in streams:
            with torch.cuda.stream(st):
                outs += [T.mm(q, b, s, bs, torch.bfloat16, one) for _ in range(10)]
        torch.cuda.synchronize(dev)
        if not all(same_bytes(o, want) for o in outs):
            fails.append(f"{n}x{k} M={m} two streams: one-launch bits differ")
    torch.cuda.synchronize(dev)


def main() -> int:
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    sms = T._num_sms(dev)
    tcfg = timing.TimingConfig.for_device(dev, quick=True)
    compile_s = precompile(dev, sms)
    fails: list[str] = []
    bit_checks(dev, sms, fails)
    print(f"compile {compile_s:.1f} s, bit checks {time.perf_counter() - t0 - compile_s:.1f} s", flush=True)
    points = []
    for n, k in SHAPES:
        copies = max(timing.copies_for(n * k, tcfg), math.ceil(ROTATE_BYTES / (n * k)))
        wq = [(torch.randn(n, k, device=dev) * 2).to(torch.float8_e4m3fn) for _ in range(copies)]
        wsc = [torch.rand(math.ceil(n / 128), k // 128, device=dev) + 0.05 for _ in range(copies)]
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
        for m in MS:
            if time.perf_counter() - t0 > BUDGET_S:
                print(f"budget spent: skipping {n}x{k} M={m}", flush=True)
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            q, s = T.per_token_group_quant(x, 128, column_major_scales=True)
            two, one = configs(m, n, k, sms)
            pt = {"n": n, "k": k, "m": m, "cfg": two.short(), "us": {}, "mode": {}}

            def timed(name, fn):
                try:
                    t = timing.measure([lambda i=i: fn(i) for i in range(copies)], dev, tcfg)
                    pt["us"][name], pt["mode"][name] = t.median_us, t.mode
                except Exception as e:  # one provider failing must not stop the table
                    fails.append(f"{n}x{k} M={m} {name}: {type(e).__name__}: {str(e)[:160]}")

            timed("two", lambda i: T.mm(q, wq[i], s, wsc[i], torch.bfloat16, two))
            if one is not None:
                pt["bits_equal"] = same_bytes(T.mm(q, wq[0], s, wsc[0], torch.bfloat16, one),
                                              T.mm(q, wq[0], s, wsc[0], torch.bfloat16, two))
                if not pt["bits_equal"]:
                    fails.append(f"{n}x{k} M={m}: one-launch bits differ")
                timed("one", lambda i: T.mm(q, wq[i], s, wsc[i], torch.bfloat16, one))
            if m % 4 == 0:
                timed("cublas", lambda i: base.cublas_mm(q, wq[i], s, wsc[i], (128, 128), torch.bfloat16))
            timed("bf16", lambda i: F.linear(x, wb[i % len(wb)]))
            points.append(pt)
        del wq, wsc, wb
        torch.cuda.empty_cache()
    torch.cuda.synchronize(dev)

    def f(v):
        return f"{v:7.1f}" if v is not None else "    n/a"

    print(f"\n{'shape':>12} {'M':>3} {'config (default)':>18} {'2-launch':>8} {'1-launch':>8} {'delta':>6} "
          f"{'cuBLAS':>7} {'bf16':>7} bits")
    for p in points:
        us = p["us"]
        d = us["one"] - us["two"] if "one" in us and "two" in us else None
        print(f"{p['n']:>5}x{p['k']:<6} {p['m']:>3} {p['cfg']:>18} {f(us.get('two')):>8} {f(us.get('one')):>8} "
              f"{(f'{d:+6.1f}' if d is not None else '   n/a')} {f(us.get('cublas'))} {f(us.get('bf16'))} "
              f"{'ok' if p.get('bits_equal') else ('-' if 'bits_equal' not in p else 'DIFF')}")
    print("\n".join(["FAILURES:"] + fails) if fails else "all bit checks ok")
    print(f"total {time.perf_counter() - t0:.1f} s")
    dest = os.environ.get("OUT")
    if dest:
        Path(dest, "fp8_block_onelaunch.json").write_text(json.dumps(dict(points=points, failures=fails), indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
