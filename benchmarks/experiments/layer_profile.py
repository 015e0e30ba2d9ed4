"""Where one decoder layer's time goes: the kernels of the compiled layer of
``benchmarks model`` per format and M, under ``torch.profiler``.  GPU, ~2 min::

    python -m benchmarks.experiments.layer_profile --formats nvfp4,nvfp4_w4a16 --m 1,8,64

For bf16 and each format: the layer of ``benchmarks.model`` (same weights,
same ``quantize_``, same compile: Inductor with our passes, fullgraph), run
eagerly (no CUDA graph) ``--reps`` times under the profiler after two warm-up
calls.  Per call: the sum of the device durations of its kernels (and
memcpy / memset), the number of device events, and each kernel name's time
and count.  The layer's ``benchmarks model`` time (graph replay, cold L2)
minus this sum is what the launches between kernels cost inside the graph;
the kernel list says which ops the format adds (quantizers, pads, casts).
Warm L2: the weights of one layer copy are re-read every call, so the big
GEMMs read less from HBM than in the cold-L2 table.  Inductor's PDL is on
as in ``benchmarks model`` (``--no-inductor-pdl``: off): a kernel's
duration then includes the time its early-launched CTAs wait, and a kernel
that overlaps waiting successors shows what they cost it.  Writes
``layer_profile.json`` to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch
import torch._inductor.config as inductor_config

import scaledmm.compile
from benchmarks.model import BASE, _layer_base, compiler, quantize, release


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(name: str, fmt: str, ms: list[int], reps: int, device: torch.device,
            fuse_quant: bool = False) -> list[dict]:
    release(device)
    mod = _layer_base(name, device)
    if fmt != BASE:
        quantize(mod, fmt)
    call = compiler("inductor", fuse_quant)(mod)
    hidden = mod.o_proj.out_features
    rows = []
    with torch.no_grad():
        for m in ms:
            x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
            if m > 1:
                torch._dynamo.maybe_mark_dynamic(x, 0)
            call(x)
            call(x)
            sync(device)
            acts = [torch.profiler.ProfilerActivity.CPU]
            acts += [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(reps):
                    call(x)
                sync(device)
            per_name: collections.Counter = collections.Counter()
            count: collections.Counter = collections.Counter()
            total = 0.0
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    total += e.device_time
                    per_name[e.name[:100]] += e.device_time
                    count[e.name[:100]] += 1
            rows.append({"model": name, "format": fmt, "m": m, "device_us": total / reps,
                         "events": sum(count.values()) / reps,
                         "kernels": [[k, round(v / reps, 2), count[k] / reps] for k, v in per_name.most_common()]})
    del call, mod
    release(device)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama8b", help="llama8b, or tiny_llama for a CPU smoke run")
    p.add_argument("--formats", default="nvfp4,nvfp4_w4a16")
    p.add_argument("--m", default="1,8,64")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--inductor-pdl", action=argparse.BooleanOptionalAction, default=True,
                   help="Inductor's PDL (triton.enable_pdl), on by default as in benchmarks model")
    p.add_argument("--fuse-quant", action="store_true", help="as benchmarks model --fuse-quant")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ms = [int(v) for v in args.m.split(",")]
    numerics = scaledmm.compile.numerics() if args.fuse_quant else {}
    with inductor_config.patch({"triton.enable_pdl": bool(args.inductor_pdl), **numerics}):
        results = [r for fmt in (BASE, *[f for f in args.formats.split(",") if f])
                   for r in profile(args.model, fmt, ms, args.reps, device, args.fuse_quant)]
    for r in results:
        print(f"{r['format']} M={r['m']}: device {r['device_us']:.1f} us/call, {r['events']:.0f} events")
        for k, us, n in r["kernels"]:
            print(f"    {us:8.2f} us x{n:g}  {k}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "layer_profile.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
