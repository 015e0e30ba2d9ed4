"""Where a decode step of HF ``generate`` goes: GPU time vs host time, per
format (the ``model-generate`` table's step times, explained).  GPU, ~3 min::

    python -m benchmarks.experiments.decode_profile --formats fp8_tensor,nvfp4_w4a16

For bf16 and each format: the Llama-3-8B-shaped random model of
``benchmarks.model_generate``, compiled and driven the same way (static
cache, greedy, Inductor with CUDA graphs and our passes), two warm-up
generates, then

* ``wall``: the decode step as the benchmark times it, (t(prompt + N) -
  t(prompt + 1)) / (N - 1), median of ``--reps`` pairs;
* under ``torch.profiler`` one ``generate`` of N tokens: ``gpu``, the sum of
  the kernel and memcpy/memset durations per decode step (prefill left out:
  the same profile of a 1-token generate is subtracted), kernels per step,
  and the ten largest kernel names by time per step; the host self time
  per step of the CPU ops the profiler sees (inflated by the profiler) and
  the ten largest.

``wall`` well above ``gpu`` means the step waits on the host (HF's Python
per step, the CUDA-graph replay's checks), which a faster GEMM cannot
shorten.  Writes ``decode_profile.json`` to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics

import torch

from benchmarks.model import BASE, SEED, quantize, release
from benchmarks.model_generate import _compile_config, _generate, _timed, build_causal_lm


def _device_us(prof) -> tuple[float, int, collections.Counter, collections.Counter]:
    """Total device-side time (kernels, memcpy, memset), event count, device
    time per name, host self time per name (CPU ops)."""
    per_name: collections.Counter = collections.Counter()
    host: collections.Counter = collections.Counter()
    total, count = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.device_time
            count += 1
            per_name[e.name[:90]] += e.device_time
        else:
            host[e.name[:90]] += e.self_cpu_time_total
    return total, count, per_name, host


def profile(fmt: str, n: int, reps: int, prompt: int, device: torch.device, model_name: str) -> dict:
    from transformers import StaticCache

    release(device)
    model = build_causal_lm(model_name, device)
    if fmt != BASE:
        quantize(model, fmt)
    gen = torch.Generator().manual_seed(SEED + 2)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=gen).to(device)
    cache = StaticCache(config=model.config, max_cache_len=prompt + n)
    cc = _compile_config("inductor", device)
    run = lambda k: _generate(model, ids, cache, cc, k)  # noqa: E731
    run(n)
    run(n)
    steps = []
    for _ in range(reps):
        t1 = _timed(lambda: run(1), device)
        tn = _timed(lambda: run(n), device)
        steps.append((tn - t1) / (n - 1) * 1e6)
    profs = {}
    for k in (1, n):
        _timed(lambda: None, device)
        kinds = [torch.profiler.ProfilerActivity.CPU]
        kinds += [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
        with torch.profiler.profile(activities=kinds) as prof:
            _timed(lambda: run(k), device)
        profs[k] = _device_us(prof)
    (g1, c1, n1, h1), (gn, cn, nn_, hn) = profs[1], profs[n]
    top = collections.Counter({k: (v - n1.get(k, 0.0)) / (n - 1) for k, v in nn_.items()})
    host = collections.Counter({k: (v - h1.get(k, 0.0)) / (n - 1) for k, v in hn.items()})
    out = {"format": fmt, "wall_us": statistics.median(steps), "wall_all_us": steps,
           "gpu_us": (gn - g1) / (n - 1), "events_per_step": (cn - c1) / (n - 1),
           "top": [[name, round(us, 2)] for name, us in top.most_common(10)],
           "host_us": sum(host.values()),
           "host_top": [[name, round(us, 2)] for name, us in host.most_common(10)]}
    del model, cache
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp8_tensor,nvfp4_w4a16")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--model", default="llama8b", help="llama8b, or tiny_llama for a CPU smoke run")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for fmt in (BASE, *[f for f in args.formats.split(",") if f]):
        r = profile(fmt, args.tokens, args.reps, args.prompt, device, args.model)
        results.append(r)
        print(f"{fmt}: wall {r['wall_us']:.0f} us/step, gpu {r['gpu_us']:.0f} us/step, "
              f"{r['events_per_step']:.0f} device events/step", flush=True)
        for name, us in r["top"]:
            print(f"    {us:9.1f} us  {name}")
        print(f"  host self time under the profiler {r['host_us']:.0f} us/step, largest:")
        for name, us in r["host_top"]:
            print(f"    {us:9.1f} us  {name}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_profile.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
