"""GPU check and timing of the fp8 family (``quant_fp8``, ``fp8_scaled_mm``,
``Fp8Linear``): ``python -m benchmarks.experiments.fp8`` from the repo root.

1. Probe: which ``torch._scaled_mm`` call forms this torch + GPU accepts and
   gets right (row-wise with fp16 / fp32 output, bias dtypes), to set
   ``ops.fp8.ROWWISE_OUT_DTYPES`` from a measurement.
2. Correctness: the ``cublas`` backend against float64 for every plan, M in
   {1, 3, 17, 64, 1000}, strided and unaligned activations.
3. Timing (cold L2: weight copies rotated past 2x the L2 size; CUDA events;
   CUDA-graph replay below 100 us; median): bf16 ``F.linear`` baseline, raw
   ``torch._scaled_mm`` (tensorwise, row-wise), the op per cuBLAS plan,
   ``quant_fp8`` (dynamic per-tensor / per-token), and ``Fp8Linear`` forward
   on an unaligned shape (load-time padding) against its aligned twin.

Prints a compact table at the end; writes JSON details to ``$OUT/device_fp8.json``
when ``$OUT`` is set.  Runs in well under 2 minutes on one H200.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F


import scaledmm
from benchmarks.timing import TimingConfig, copies_for, measure
from scaledmm.layers import Fp8Linear
from scaledmm.ops import fp8 as F8

OPS = torch.ops.scaledmm
FP8 = torch.float8_e4m3fn
DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 128, 1024, 4096)
RESULTS: dict = {"probe": [], "correctness": [], "timing": []}
T0 = time.perf_counter()


def rand_fp8(shape):
    b = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV)
    b[(b & 0x7F) == 0x7F] = 0
    return b.view(FP8)


def rel64(out, a, b, sa, sb, bias):
    """max |out - exact| / max |exact| in float64 (the exact value with the
    scales applied after the dot product, as the contract says)."""
    sa64 = sa.double().reshape(-1, 1) if sa.numel() > 1 else sa.double().reshape(1, 1)
    sb64 = sb.double().reshape(1, -1) if sb.numel() > 1 else sb.double().reshape(1, 1)
    ref = (a.double() @ b.double().t()) * sa64 * sb64
    if bias is not None:
        ref = ref + bias.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------
# 1. probe torch._scaled_mm call forms
# ----------------------------------------------------------------------------


def probe():
    m, k, n = 64, 1024, 512
    a, b = rand_fp8((m, k)), rand_fp8((n, k))
    st, sv_a, sv_b = torch.tensor(0.01, device=DEV), torch.rand(m, 1, device=DEV) / 50, torch.rand(1, n, device=DEV) / 50
    forms = []
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for bias_dtype in (None, torch.bfloat16, torch.float16, torch.float32):
            for name, sa, sb in (("tensorwise", st, st), ("rowwise", sv_a, sv_b)):
                forms.append((name, out_dtype, bias_dtype, sa, sb))
    for name, out_dtype, bias_dtype, sa, sb in forms:
        bias = None if bias_dtype is None else torch.randn(n, device=DEV).to(bias_dtype)
        rec = {"form": name, "out": str(out_dtype), "bias": str(bias_dtype)}
        try:
            out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
            torch.cuda.synchronize()
            rec["rel_err"] = rel64(out, a, b, sa, sb, bias)
            rec["ok"] = rec["rel_err"] < 2e-2
        except Exception as e:  # the point of the probe
            rec["ok"] = False
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
        RESULTS["probe"].append(rec)


# ----------------------------------------------------------------------------
# 2. correctness of the cublas backend
# ----------------------------------------------------------------------------


def correctness():
    k, n = 1040, 720
    b = rand_fp8((n, k))
    cases = [  # (scale_a shape, scale_b shape, bias dtype, out dtype)
        ((), (), None, torch.bfloat16), ((1,), (1,), torch.bfloat16, torch.bfloat16),
        ((), (), torch.float16, torch.float16), ((), (), None, torch.float32),
        ("m1", (n,), None, torch.bfloat16), ("m1", (1, n), torch.bfloat16, torch.bfloat16),
        ((), (n,), torch.bfloat16, torch.bfloat16), ("m1", (), None, torch.bfloat16),
        ("m1", (n,), None, torch.float16), ("m1", (n,), torch.float32, torch.bfloat16),
        ((), (), torch.float32, torch.float32),
    ]
    for m in (1, 3, 17, 64, 1000):
        for pad in (0, 16, 5):
            buf = rand_fp8((m, k + pad))
            a = buf[:, :k]
            for sa_shape, sb_shape, bias_dtype, out_dtype in cases:
                sa = torch.rand((m, 1) if sa_shape == "m1" else sa_shape, device=DEV) / 50 + 1e-3
                sb = torch.rand(sb_shape, device=DEV) / 50 + 1e-3
                bias = None if bias_dtype is None else torch.randn(n, device=DEV).to(bias_dtype)
                kinds = F8.check_mm_args("fp8_scaled_mm", a, b, sa, sb, bias, out_dtype)
                plan = F8.cublas_plan(F8.mm_problem(a, b, *kinds, bias, out_dtype))[0]
                rec = {"m": m, "pad": pad, "scale_a": str(sa_shape), "scale_b": str(sb_shape),
                       "bias": str(bias_dtype), "out": str(out_dtype), "plan": plan}
                try:
                    out = torch.full((1,), float("nan"), device=DEV)
                    with scaledmm.use_backend("fp8", "cublas"):
                        out = OPS.fp8_scaled_mm(a, b, sa, sb, bias, out_dtype)
                    rec["rel_err"] = rel64(out, a, b, sa, sb, bias)
                    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-3}[out_dtype]
                    rec["ok"] = bool(torch.isfinite(out).all()) and rec["rel_err"] < tol
                except Exception as e:
                    rec["ok"] = False
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
                RESULTS["correctness"].append(rec)
    # quant_fp8 on the GPU against the CPU (same torch math)
    x = torch.randn(257, 4100, dtype=torch.bfloat16, device=DEV) * 3
    for per_token in (False, True):
        q, s = OPS.quant_fp8(x, None, per_token)
        qc, sc = OPS.quant_fp8(x.cpu(), None, per_token)
        same = torch.equal(q.cpu().view(torch.uint8), qc.view(torch.uint8)) and torch.equal(s.cpu(), sc)
        RESULTS["correctness"].append({"m": 257, "op": f"quant_fp8 per_token={per_token}", "ok": same})


# ----------------------------------------------------------------------------
# 3. timing
# ----------------------------------------------------------------------------


def timed(label, shape_name, m, make_fns, cfg, note=""):
    try:
        t = measure(make_fns(), DEV, cfg)
        rec = {"label": label, "shape": shape_name, "m": m, "us": t.median_us, "p20": t.p20_us, "p80": t.p80_us,
               "mode": t.mode, "note": t.note or note}
    except Exception as e:
        rec = {"label": label, "shape": shape_name, "m": m, "us": float("nan"),
               "note": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    RESULTS["timing"].append(rec)


def timing():
    cfg = TimingConfig.for_device(DEV, quick=True)
    for sname, (n, k) in SHAPES.items():
        ncopy = copies_for(n * k, cfg)  # fp8 weight bytes per copy
        ws = [rand_fp8((n, k)) for _ in range(ncopy)]
        wbf = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies_for(2 * n * k, cfg))]
        sb_vec = torch.rand(n, device=DEV) / 50
        sb_row = sb_vec.reshape(1, n)
        one = torch.tensor(0.01, device=DEV)
        for m in MS:
            a = rand_fp8((m, k))
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            sa_vec = torch.rand(m, 1, device=DEV) / 50
            timed("bf16 F.linear (baseline)", sname, m, lambda: [lambda w=w: F.linear(x, w) for w in wbf], cfg)
            timed("_scaled_mm tensorwise", sname, m,
                  lambda: [lambda w=w: torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.bfloat16) for w in ws], cfg)
            timed("_scaled_mm rowwise", sname, m,
                  lambda: [lambda w=w: torch._scaled_mm(a, w.t(), sa_vec, sb_row, out_dtype=torch.bfloat16)
                           for w in ws], cfg)
            with scaledmm.use_backend("fp8", "cublas"):
                timed("op tensorwise bf16", sname, m,
                      lambda: [lambda w=w: OPS.fp8_scaled_mm(a, w, one, one) for w in ws], cfg)
                timed("op rowwise bf16", sname, m,
                      lambda: [lambda w=w: OPS.fp8_scaled_mm(a, w, sa_vec, sb_vec) for w in ws], cfg)
                timed("op rowwise fp16 (f32_epilogue)", sname, m,
                      lambda: [lambda w=w: OPS.fp8_scaled_mm(a, w, sa_vec, sb_vec, None, torch.float16)
                               for w in ws], cfg)
                timed("quant_fp8 dynamic per-tensor", sname, m, lambda: [lambda: OPS.quant_fp8(x)], cfg)
                timed("quant_fp8 dynamic per-token", sname, m, lambda: [lambda: OPS.quant_fp8(x, None, True)], cfg)
        del ws, wbf
        torch.cuda.empty_cache()
    # Fp8Linear: unaligned K, N (padded at load) against the aligned twin
    for (n, k) in ((4100, 4100), (4096, 4096)):
        lin = torch.nn.Linear(k, n, dtype=torch.bfloat16, device=DEV)
        ncopy = copies_for(n * k, cfg)
        layers = [Fp8Linear.from_float(lin, per_channel=True, activation="dynamic_per_token") for _ in range(ncopy)]
        for m in (1, 16, 1024):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            with scaledmm.use_backend("fp8", "cublas"):
                timed("Fp8Linear forward (per-token x per-channel)", f"{n}x{k}", m,
                      lambda: [lambda L=L: L(x) for L in layers], cfg)
        del layers
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------


def main():
    if not torch.cuda.is_available():
        print("device_fp8: needs a CUDA device")
        return 1
    RESULTS["device"] = torch.cuda.get_device_name(DEV)
    RESULTS["torch"] = torch.__version__
    RESULTS["cuda"] = torch.version.cuda
    RESULTS["backends"] = scaledmm.backends.report(file=open(os.devnull, "w"))
    for step in (probe, correctness, timing):
        try:
            step()
        except Exception:
            RESULTS.setdefault("errors", []).append(traceback.format_exc())
        torch.cuda.synchronize()
    RESULTS["wall_s"] = time.perf_counter() - T0
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "device_fp8.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)

    print(f"== device_fp8 on {RESULTS['device']}, torch {RESULTS['torch']}, CUDA {RESULTS['cuda']}, "
          f"{RESULTS['wall_s']:.0f} s")
    print("-- torch._scaled_mm forms (probe)")
    for r in RESULTS["probe"]:
        err = r.get("error") or f"rel_err {r.get('rel_err', float('nan')):.1e}"
        print(f"  {'ok ' if r['ok'] else 'NO '} {r['form']:<10} out={r['out']:<15} bias={r['bias']:<15} {err}")
    bad = [r for r in RESULTS["correctness"] if not r["ok"]]
    plans = sorted({r.get("plan", "") for r in RESULTS["correctness"]} - {""})
    print(f"-- correctness: {len(RESULTS['correctness']) - len(bad)}/{len(RESULTS['correctness'])} ok "
          f"(plans exercised: {plans})")
    for r in bad[:15]:
        print("  FAIL", r)
    print("-- timing, median us (cold L2)")
    labels = list(dict.fromkeys(r["label"] for r in RESULTS["timing"]))
    keys = list(dict.fromkeys((r["shape"], r["m"]) for r in RESULTS["timing"]))
    by = {(r["label"], r["shape"], r["m"]): r for r in RESULTS["timing"]}
    for label in labels:
        cells = []
        for shape, m in keys:
            r = by.get((label, shape, m))
            if r is not None:
                cells.append(f"{shape}/{m}:{r['us']:.1f}")
        print(f"  {label}")
        print("    " + "  ".join(cells))
    notes = {r["note"] for r in RESULTS["timing"] if r.get("note")}
    for n_ in sorted(notes)[:5]:
        print("  note:", n_)
    for e in RESULTS.get("errors", []):
        print("ERROR", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
