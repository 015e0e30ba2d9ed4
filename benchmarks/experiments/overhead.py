"""Host overhead of scaledmm's eager entries (issue 4).  CPU or GPU, < 60 s::

    python -m benchmarks.experiments.overhead             # cuda when present, else cpu
    python -m benchmarks.experiments.overhead --device cpu --calls 500

For every public entry (each op through ``torch.ops.scaledmm``, the Python
entries ``scaledmm.fp8_block_mm`` / ``scaledmm.skinny_linear``, each layer's
forward) on tiny tensors it measures

* ``entry``: the per-call host time of the entry (``time.perf_counter_ns``
  around one call; median of ``--calls`` calls after a warm-up);
* ``bare``: the same for the backend implementations the entry ends up
  running, called directly with the same arguments (found by recording, during
  one call of the entry, each ``backends.select(...).run(op, problem, *args)`` call
  that is not nested in another), below the autograd dispatch keys as the
  dispatcher runs them;
* ``overhead = entry - bare``: the dispatcher, validation, ``Problem``
  building, backend selection, and (for entries above the ops) the Python and
  torch work between the ops.

On a GPU nothing is synchronized inside the timed calls (kernels on tiny
tensors finish long before the host issues the next call; the device is
synchronized every 64 calls, outside the timings), so the times are the host
cost of issuing the work.  Then cProfile shows where the time of
``torch.ops.scaledmm.fp8_block_mm`` goes.  Prints a compact table; writes
``overhead.json`` and ``overhead_profile.txt`` to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable


import torch

import scaledmm
from scaledmm import backends
from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear, SkinnyLinear
from scaledmm.ops import fp8_block as fb
from scaledmm.ops import nvfp4 as nv

BF16 = torch.bfloat16
M, M_ODD, N, K = 4, 3, 256, 256  # tiny: the host cost dominates
SYNC_EVERY = 64


# ----------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def recording_backend_calls(calls: list):
    """Record ``(impl, args)`` of every top-level backend call (``oplib.run``
    goes through ``backends.select``) made inside the block."""
    orig = backends.select
    depth = [0]

    def select(problem, op, table_m=None):
        backend = orig(problem, op, table_m=table_m)
        impl = backend.impls[op]

        def recorded(*args, **kwargs):
            if depth[0] == 0:
                calls.append((impl, args, kwargs))
            depth[0] += 1
            try:
                return impl(*args, **kwargs)
            finally:
                depth[0] -= 1

        class Proxy:
            name = backend.name
            needs_m_multiple = backend.needs_m_multiple
            impls = {op: recorded}

            @staticmethod
            def run(op_, problem_, *args):  # as Backend.run: the Problem to an impl that takes it
                return recorded(*args, **({"problem": problem_} if backends._takes_problem(impl) else {}))

        return Proxy

    backends.select = select
    try:
        yield calls
    finally:
        backends.select = orig


def bare_of(entry: Callable) -> tuple[Callable, list[str]]:
    """The backend calls ``entry`` makes, as one callable, and their names."""
    calls: list = []
    with recording_backend_calls(calls):
        entry()
    if not calls:
        raise RuntimeError("entry made no backend call")

    def bare():
        # the dispatcher runs an op's kernel below the autograd keys; so do we
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for impl, args, kwargs in calls:
                impl(*args, **kwargs)

    names = [getattr(impl, "__qualname__", str(impl)) for impl, _, _ in calls]
    return bare, names


def per_call_ns(*fns: Callable, calls: int, cuda: bool, budget_s: float = 1.0) -> list[float]:
    """Median host time of one call of each of ``fns``, in ns.  The functions
    are called in turn (a, b, a, b, ...) so that drifts of the machine (other
    processes, clocks) hit all of them alike.  At most ``calls`` rounds, fewer
    (at least 50) when a round is slow enough that they would take more than
    ``budget_s`` (the CPU reference backends)."""
    t0 = time.perf_counter()
    for _ in range(20):
        for fn in fns:
            fn()
    if cuda:
        torch.cuda.synchronize()
    per_round = (time.perf_counter() - t0) / 20
    calls = max(50, min(calls, int(budget_s / max(per_round, 1e-9))))
    samples: list[list[int]] = [[] for _ in fns]
    for i in range(calls):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t0)
        if cuda and i % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.synchronize()
    if cuda:
        torch.cuda.synchronize()
    return [statistics.median(x) for x in samples]


# ----------------------------------------------------------------------------
# the entries
# ----------------------------------------------------------------------------


def entries(device: torch.device) -> list[tuple[str, Callable, Callable | None]]:
    """(name, entry, explicit bare or None = recorded backend calls)."""
    ops = torch.ops.scaledmm

    def act(m, dtype=BF16):
        return torch.randn(m, K, dtype=dtype, device=device)

    x4, x3 = act(M), act(M_ODD)
    w, ws = fb.quantize_weight(torch.randn(N, K, device=device))
    q4, s4 = ops.per_token_group_quant_fp8(x4)
    q3, s3 = ops.per_token_group_quant_fp8(x3)
    bias = torch.randn(N, dtype=BF16, device=device)
    w8, ws8 = ops.quant_fp8(torch.randn(N, K, device=device), None, True)
    ws8 = ws8.reshape(-1).contiguous()
    f8q, f8s = ops.quant_fp8(x4, None, True)
    gw = torch.randn(N, K, device=device)
    gs_w = (448.0 * 6.0 / gw.abs().amax()).reshape(1)
    qw, sw = ops.nvfp4_quant(gw, gs_w, True)
    gs = torch.tensor([448.0 * 6.0 / 4.0], device=device)
    alpha = 1.0 / (gs * gs_w)
    nq, ns = ops.nvfp4_quant(x4, gs, True)
    _, ns_lin = ops.nvfp4_quant(x4, gs, False)
    wb = torch.randn(N, K, dtype=BF16, device=device) / K ** 0.5
    bs = [128, 128]

    def lin(bias_=False):
        return torch.nn.Linear(K, N, bias=bias_, dtype=BF16, device=device)

    l_block = Fp8BlockLinear.from_float(lin())
    l_fp8 = Fp8Linear.from_float(lin(), per_channel=True)
    l_nv = NvFp4Linear.from_float(lin(), input_amax=4.0)
    l_nv_dyn = NvFp4Linear.from_float(lin())
    l_skinny = SkinnyLinear.from_float(lin())

    return [
        ("ops.per_token_group_quant_fp8", lambda: ops.per_token_group_quant_fp8(x4, 128, 1e-10, False, False), None),
        ("ops.fp8_block_mm (M=4)", lambda: ops.fp8_block_mm(q4, w, s4, ws, bs, BF16), None),
        ("ops.padded_fp8_block_mm (M=3)", lambda: ops.padded_fp8_block_mm(q3, w, s3, ws, bs, BF16), None),
        ("ops.dynamic_padded_fp8_block_mm (M=3)",
         lambda: ops.dynamic_padded_fp8_block_mm(q3, w, s3, ws, bs, BF16), None),
        ("ops.fp8_block_linear", lambda: ops.fp8_block_linear(x4, w, ws, bs, BF16, bias), None),
        ("scaledmm.fp8_block_mm (M=4)", lambda: scaledmm.fp8_block_mm(q4, w, s4, ws), None),
        ("scaledmm.fp8_block_mm (M=3)", lambda: scaledmm.fp8_block_mm(q3, w, s3, ws), None),
        ("ops.quant_fp8 (per-token)", lambda: ops.quant_fp8(x4, None, True), None),
        ("ops.fp8_scaled_mm", lambda: ops.fp8_scaled_mm(f8q, w8, f8s, ws8, bias, BF16), None),
        ("ops.nvfp4_quant", lambda: ops.nvfp4_quant(x4, gs, True), None),
        ("ops.nvfp4_mm", lambda: ops.nvfp4_mm(nq, qw, ns, sw, alpha, BF16, bias), None),
        ("ops.nvfp4_w4a16_mm", lambda: ops.nvfp4_w4a16_mm(x4, qw, sw, gs_w, BF16, bias), None),
        ("ops.swizzle_block_scales", lambda: ops.swizzle_block_scales(ns_lin),
         lambda: nv.swizzle_block_scales(ns_lin)),
        ("ops.dsv3_fused_a_gemm", lambda: ops.dsv3_fused_a_gemm(x4, wb, False), None),
        ("ops.dynamic_skinny_linear", lambda: ops.dynamic_skinny_linear(x4, wb), None),
        ("scaledmm.skinny_linear", lambda: scaledmm.skinny_linear(x4, wb), None),
        ("Fp8BlockLinear.forward", lambda: l_block(x4), None),
        ("Fp8Linear.forward", lambda: l_fp8(x4), None),
        ("NvFp4Linear.forward (static scale)", lambda: l_nv(x4), None),
        ("NvFp4Linear.forward (dynamic scale)", lambda: l_nv_dyn(x4), None),
        ("SkinnyLinear.forward", lambda: l_skinny(x4), None),
    ]


def torch_floor(device: torch.device) -> list[tuple[str, Callable]]:
    """Reference points: what a tiny aten op and an F.linear cost here."""
    x = torch.randn(M, K, dtype=BF16, device=device)
    wb = torch.randn(N, K, dtype=BF16, device=device)
    return [("torch: x.add(1) (one aten op)", lambda: x.add(1)),
            ("torch: F.linear", lambda: torch.nn.functional.linear(x, wb))]


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------


def profile_fp8_block_mm(device: torch.device, calls: int, top: int) -> str:
    ops = torch.ops.scaledmm
    x = torch.randn(M, K, dtype=BF16, device=device)
    w, ws = fb.quantize_weight(torch.randn(N, K, device=device))
    q, s = ops.per_token_group_quant_fp8(x)
    bs = [128, 128]
    for _ in range(50):
        ops.fp8_block_mm(q, w, s, ws, bs, BF16)
    prof = cProfile.Profile()
    deadline = time.perf_counter() + 5.0  # the CPU reference is slow: at most ~5 s
    prof.enable()
    for _ in range(calls):
        ops.fp8_block_mm(q, w, s, ws, bs, BF16)
        if time.perf_counter() > deadline:
            break
    prof.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per entry (median)")
    p.add_argument("--budget-s", type=float, default=1.0, help="time limit of one entry's timed calls")
    p.add_argument("--profile-calls", type=int, default=3000)
    p.add_argument("--top", type=int, default=15, help="cProfile rows")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    t_start = time.time()
    torch.manual_seed(0)
    print(f"scaledmm {scaledmm.__version__} | torch {torch.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if cuda else "")
          + f" | M={M} (odd {M_ODD}), N={N}, K={K} | {args.calls} calls per entry")
    rows = []
    with torch.inference_mode():
        for name, fn in torch_floor(device):
            (t,) = per_call_ns(fn, calls=args.calls, cuda=cuda, budget_s=args.budget_s)
            rows.append({"entry": name, "entry_us": t / 1e3, "bare_us": None, "backends": []})
        for name, entry, bare in entries(device):
            try:
                if bare is None:
                    bare, impls = bare_of(entry)
                else:
                    impls = [getattr(bare, "__qualname__", "python")]
                with backends.record() as chosen:
                    entry()
                e_ns, b_ns = per_call_ns(entry, bare, calls=args.calls, cuda=cuda, budget_s=args.budget_s)
                rows.append({"entry": name, "entry_us": e_ns / 1e3, "bare_us": b_ns / 1e3,
                             "backends": sorted({f"{op}:{b}" for op, b, _ in chosen}), "impls": impls})
            except Exception as e:  # noqa: BLE001 - one broken entry must not hide the others
                traceback.print_exc()
                rows.append({"entry": name, "error": f"{type(e).__name__}: {e}"})
        profile = profile_fp8_block_mm(device, args.profile_calls, args.top)
    print("\ncProfile of torch.ops.scaledmm.fp8_block_mm "
          f"(up to {args.profile_calls} calls, M={M}; top {args.top} by tottime, then by cumulative):")
    print(profile)

    print(f"{'entry':<42} {'entry us':>9} {'bare us':>9} {'overhead us':>12}  backends")
    for r in rows:
        if "error" in r:
            print(f"{r['entry']:<42} ERROR {r['error']}")
            continue
        bare = "" if r["bare_us"] is None else f"{r['bare_us']:9.1f}"
        over = "" if r["bare_us"] is None else f"{r['entry_us'] - r['bare_us']:12.1f}"
        print(f"{r['entry']:<42} {r['entry_us']:9.1f} {bare:>9} {over:>12}  {', '.join(r['backends'])}")
    print(f"(median host time per call; overhead = entry - bare backend calls; {time.time() - t_start:.0f} s)")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "overhead.json").write_text(json.dumps(
            {"device": str(device), "torch": torch.__version__, "calls": args.calls, "rows": rows}, indent=1))
        (out_dir / "overhead_profile.txt").write_text(profile)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
