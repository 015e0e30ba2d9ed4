"""HF ``generate`` decode speed for the model family (``python -m benchmarks
model``, section ``model-generate``): a full-size Llama-3-8B-shaped random
model in bf16 and in each ``scaledmm.quantize_`` format, in the same run.

Method: greedy ``generate`` with one static cache reused across calls (its
tensors keep their addresses, so the CUDA graphs of the compiled decode step
replay without re-recording), the decode step compiled by ``transformers``'
auto-compile with our ``CompileConfig`` (fullgraph, Inductor with CUDA graphs
and ``scaledmm.compile.passes()``).  Two warm-up generates (compilation, graph
recording), then pairs of timed calls: time per decode step =
(t(prompt + N new tokens) - t(prompt + 1 new token)) / (N - 1), which leaves
out prefill, cache setup and the host work around the loop.  On a GPU the
same difference of one profiled pair gives the GPU time per step (the sum of
the kernel, memcpy and memset durations, ``torch.profiler`` with CUDA
activity only): HF syncs every step, so the wall time is that plus the host
work per step (Python, Dynamo's guards, the graph launch), and the GPU column
is the part a kernel can change.  Each format is also compared with bf16 on
the last-position logits of the prompt.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from .harness import rel_err
from .model import BASE, MODELS, SEED, backend_names, first_line, module_bytes, quantize, release
from .timing import Timing, percentile, synchronize

__all__ = ["GenResult", "GEN_FIELDS", "build_causal_lm", "device_time_us", "run_generate", "write_gen_csv",
           "gen_markdown"]


@dataclasses.dataclass(frozen=True)
class GenResult:
    """One (format, batch) generate measurement; ``decode`` is per decode step."""

    model: str
    fmt: str
    batch: int
    prompt: int
    new_tokens: int
    status: str
    decode: Timing | None = None
    prefill_ms: float = math.nan
    logits_err: float = math.nan
    weight_bytes: int = 0
    backend: str = ""
    note: str = ""
    gpu_step_us: float = math.nan  # GPU time per decode step (profiled pair); NaN off a GPU

    @property
    def tokens_per_s(self) -> float:
        return self.batch / (self.decode.median_us * 1e-6) if self.decode else math.nan


GEN_FIELDS = ["model", "format", "batch", "prompt_tokens", "new_tokens", "status", "decode_ms", "decode_p20_ms",
              "decode_p80_ms", "reps", "tokens_per_s", "vs_bf16", "gpu_ms_per_step", "vs_bf16_gpu", "prefill_ms",
              "logits_rel_err", "weights_gb", "backend", "note"]


def build_causal_lm(name: str, device: torch.device) -> nn.Module:
    """A random bf16 ``LlamaForCausalLM`` of config ``name``, built on ``device``
    (same seed, same weights on every call)."""
    from transformers import LlamaForCausalLM

    config = MODELS[name][1]()
    torch.manual_seed(SEED)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def _compile_config(mode: str, device: torch.device):
    if mode == "off":
        return None
    from transformers import CompileConfig

    if mode == "inductor":
        import scaledmm.compile

        opts = {"triton.cudagraphs": device.type == "cuda",
                "post_grad_custom_post_pass": scaledmm.compile.passes()}
        cc = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode=None, options=opts)
    else:
        cc = CompileConfig(fullgraph=True, dynamic=False, backend=mode, mode=None)
    cc._compile_all_devices = True  # also on the CPU (smoke runs)
    return cc


def _generate(model, ids, cache, cc, n: int) -> torch.Tensor:
    cache.reset()  # same tensors every call: CUDA graphs keep their static addresses
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache)
    if cc is None:
        kw["disable_compile"] = True
    else:
        kw["compile_config"] = cc
    with warnings.catch_warnings():
        # `past_key_values` is renamed `cache` in newer transformers; the old name works in all 5.x.
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)


def device_time_us(fn, device: torch.device) -> float:
    """Microseconds of GPU work ``fn`` issues: the sum of the kernel, memcpy
    and memset durations ``torch.profiler`` records (CUDA activity only, so
    the host is barely slowed); NaN off a GPU."""
    if device.type != "cuda":
        return math.nan
    synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _timed(fn, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def run_generate(formats: Sequence[str], device: torch.device, *, model_name: str, batches: Sequence[int],
                 prompt: int, new_tokens: int, reps: int, compile_mode: str, log=sys.stderr) -> list[GenResult]:
    """Greedy generate, bf16 then each format, on a freshly built model each."""
    if new_tokens < 2 or prompt < 1 or reps < 1:
        raise ValueError(f"--gen-tokens/--gen-prompt/--gen-reps: expected >= 2, >= 1, >= 1, "
                         f"got {new_tokens}, {prompt}, {reps}")
    vocab = MODELS[model_name][1]().vocab_size
    gen = torch.Generator().manual_seed(SEED + 2)
    prompts = {b: torch.randint(0, vocab, (b, prompt), generator=gen).to(device) for b in batches}
    ref_logits: dict[int, torch.Tensor] = {}
    results: list[GenResult] = []
    for fmt in (BASE, *formats):
        release(device)
        common = dict(model=model_name, fmt=fmt, prompt=prompt, new_tokens=new_tokens)
        try:
            model = build_causal_lm(model_name, device)
            if fmt != BASE:
                quantize(model, fmt)
        except Exception as e:
            results += [GenResult(batch=b, status="error", note=f"build/quantize_ failed: {first_line(e)}",
                                  **common) for b in batches]
            continue
        wbytes = module_bytes(model)
        cc = _compile_config(compile_mode, device)
        for b in batches:
            r = _gen_point(model, prompts[b], cc, reps, ref_logits, device,
                           dict(common, batch=b, weight_bytes=wbytes), compile_mode)
            results.append(r)
            what = f"{r.tokens_per_s:.1f} tok/s" if r.decode else f"{r.status} {r.note}"
            print(f"[generate {model_name} {fmt} batch={b}] {what} logits_err={r.logits_err:.3g}",
                  file=log, flush=True)
        del model, cc
    release(device)
    return results


def _gen_point(model, ids: torch.Tensor, cc, reps: int, ref_logits: dict, device: torch.device, base: dict,
               compile_mode: str) -> GenResult:
    from scaledmm import backends
    from transformers import StaticCache

    n, b = base["new_tokens"], base["batch"]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1).logits[:, -1]
        logits = logits.double()
        if base["fmt"] == BASE:
            ref_logits[b] = logits
        ref = ref_logits.get(b)
        base["logits_err"] = rel_err(logits, ref) if ref is not None else math.nan
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + n)
        run = functools.partial(_generate, model, ids, cache, cc)
        skips = counters["inductor"]["cudagraph_skips"]
        with backends.record() as log:
            out = run(n)  # compiles the decode step
        base["backend"] = backend_names(log)
        if tuple(out.shape) != (b, ids.shape[1] + n):
            return GenResult(status="wrong", note=f"generate returned {tuple(out.shape)}, expected "
                                                  f"{(b, ids.shape[1] + n)}", **base)
        run(n)  # CUDA-graph recording
        if compile_mode != "off" and not hasattr(model, "_compiled_call"):
            base["note"] = "transformers did not compile the decode step; "
        if counters["inductor"]["cudagraph_skips"] > skips:  # Inductor logs why
            base["note"] = base.get("note", "") + "Inductor skipped CUDA graphs for the decode step; "
        firsts, steps = [], []
        for _ in range(reps):
            t1 = _timed(lambda: run(1), device)
            tn = _timed(lambda: run(n), device)
            firsts.append(t1 * 1e3)
            steps.append(max(tn - t1, 0.0) / (n - 1) * 1e6)
        gpu_n, gpu_1 = device_time_us(lambda: run(n), device), device_time_us(lambda: run(1), device)
        base["gpu_step_us"] = (gpu_n - gpu_1) / (n - 1)
    except Exception as e:
        base["note"] = base.get("note", "") + first_line(e)
        return GenResult(status="error", **base)
    decode = Timing(percentile(steps, 50), percentile(steps, 20), percentile(steps, 80), len(steps), "wall")
    base["note"] = base.get("note", "").rstrip("; ")
    return GenResult(status="ok", decode=decode, prefill_ms=percentile(firsts, 50), **base)


def _gen_ratio(r: GenResult, results: Sequence[GenResult], gpu: bool = False) -> float | None:
    base = next((x for x in results if x.fmt == BASE and x.batch == r.batch and x.decode), None)
    if base is None or r.decode is None:
        return None
    if gpu:
        ok = base.gpu_step_us > 0 and r.gpu_step_us > 0  # False for NaN
        return base.gpu_step_us / r.gpu_step_us if ok else None
    return base.decode.median_us / r.decode.median_us


def write_gen_csv(path: Path, results: Sequence[GenResult]) -> None:
    """One row per (format, batch)."""
    def f(v, d=6):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        return f"{v:.{d}g}" if isinstance(v, float) else v

    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(GEN_FIELDS)
        for r in results:
            t = r.decode
            w.writerow([r.model, r.fmt, r.batch, r.prompt, r.new_tokens, r.status,
                        f(t.median_us / 1e3 if t else None), f(t.p20_us / 1e3 if t else None),
                        f(t.p80_us / 1e3 if t else None), t.reps if t else "", f(r.tokens_per_s),
                        f(_gen_ratio(r, results), 4), f(r.gpu_step_us / 1e3), f(_gen_ratio(r, results, gpu=True), 4),
                        f(r.prefill_ms), f(r.logits_err),
                        f(r.weight_bytes / 1e9), r.backend, r.note])


def gen_markdown(results: Sequence[GenResult]) -> str:
    """Decode ms per step [p20-p80], tokens/s and the speed ratio to bf16."""
    if not results:
        return ""
    r0 = results[0]
    out = [f"### generate: {MODELS[r0.model][0]}-shaped random model ({r0.model}), greedy, static cache, "
           f"prompt {r0.prompt}, {r0.new_tokens} new tokens\n",
           "Decode ms per step = per generated token of each sequence; tokens/s = batch / decode time per step; "
           "**vs bf16** = bf16 time / format time; GPU ms/step = the GPU work of a step (kernels, copies), the "
           "rest of a step being host work that does not overlap it.\n",
           "| format | batch | decode ms/step [p20-p80] | tokens/s | vs bf16 | GPU ms/step | GPU vs bf16 | "
           "prompt + 1st token ms | last-logits rel. error vs bf16 | weights GB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r.decode
        step = f"{t.median_us / 1e3:.3f} [{t.p20_us / 1e3:.3f}-{t.p80_us / 1e3:.3f}]" if t else r.status.upper()
        ratio, gpu_ratio = _gen_ratio(r, results), _gen_ratio(r, results, gpu=True)
        gpu = "" if math.isnan(r.gpu_step_us) else f"{r.gpu_step_us / 1e3:.3f}"
        out.append(f"| {r.fmt} | {r.batch} | {step} | {'' if t is None else f'{r.tokens_per_s:.1f}'} | "
                   f"{'' if ratio is None else f'**{ratio:.2f}x**'} | {gpu} | "
                   f"{'' if gpu_ratio is None else f'{gpu_ratio:.2f}x'} | "
                   f"{'' if math.isnan(r.prefill_ms) else f'{r.prefill_ms:.1f}'} | "
                   f"{'' if math.isnan(r.logits_err) else f'{r.logits_err:.3g}'} | {r.weight_bytes / 1e9:.3g} |")
    notes = [f"- {r.fmt} batch {r.batch}: {r.status.upper()}: {r.note}" for r in results if r.status != "ok" or r.note]
    backends = [f"- {r.fmt}: {r.backend}" for r in results if r.backend and r.batch == r0.batch]
    if notes:
        out += ["\nNot timed or noted:\n", *notes]
    if backends:
        out += ["\nBackends selected (prefill and decode):\n", *backends]
    return "\n".join(out) + "\n"
