"""``python -m benchmarks <family> [options]``: see ``benchmarks/README.md``.

Measures the machine's ceilings, then for each op of the family checks every
provider against a float64 reference and times it over a shape set and an M
sweep.  Writes a markdown report to stdout and ``<out>/<family>.md``, a CSV,
PNG plots and ``<out>/meta.json``; ``--write-results`` also replaces the
family's section of ``benchmarks/RESULTS.md``.

``python -m benchmarks sanitize [--only PATTERN] [--list]`` runs
compute-sanitizer over every kernel instead (``benchmarks/sanitize.py``);
``python -m benchmarks sweep --kernel NAME`` times every candidate config of
one kernel for ``python -m benchmarks.tune --kernel`` (``benchmarks/sweep.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shutil
import sys
from pathlib import Path

import torch

from . import FAMILIES
from . import model as model_family
from .harness import OpBench, Result, providers, run_bench
from .machine import REPO_ROOT, environment, measure_ceilings
from .report import header, markdown, summary, update_results_file, write_csv
from .shapes import CPU_M, DEFAULT_M, QUICK_M, SHAPE_SETS, Shape, parse_ms, parse_shapes
from .timing import TimingConfig

RESULTS_FILE = REPO_ROOT / "benchmarks" / "RESULTS.md"
QUICK_SHAPES = 2  # --quick keeps the first shapes of a family's default set
WORKLOADS = ("model",)  # whole-model families: run on their own, not part of 'all'


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Check and time scaledmm's backends against cuBLAS/torch baselines.",
        epilog=f"shape sets: {', '.join(SHAPE_SETS)}; default M sweep: {','.join(map(str, DEFAULT_M))}.  "
               "'python -m benchmarks sanitize --help': compute-sanitizer over every kernel; "
               "'python -m benchmarks sweep --help': time a kernel's candidate configs.",
    )
    p.add_argument("family", choices=(*FAMILIES, *WORKLOADS, "all"),
                   help="op family to benchmark ('all': every op family; 'model': decoder layers and generate)")
    p.add_argument("--shapes", help="comma list of shape-set names, NxK and K->N items (default: per family)")
    p.add_argument("--m", help="comma list of M values (default: the family's sweep)")
    p.add_argument("--providers", help="comma list of provider names to keep (default: all)")
    p.add_argument("--quick", action="store_true",
                   help=f"first {QUICK_SHAPES} default shapes, M in {','.join(map(str, QUICK_M))}, fewer reps, "
                        "no reference backend on a GPU")
    p.add_argument("--sustain", type=float, default=None, metavar="SECONDS",
                   help="keep each provider busy this long before its point is timed, so clocks and power "
                        "settle as under a sustained load (default: 0.03 s, --quick 0)")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "out"),
                   help="directory for CSV, markdown, plots and meta.json (default: benchmarks/out)")
    p.add_argument("--write-results", action="store_true",
                   help="replace the family's section of benchmarks/RESULTS.md (and copy it to --out)")
    p.add_argument("--results-file", default=str(RESULTS_FILE), help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the GPU when there is one, else a CPU smoke run")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--list", action="store_true", help="list ops and providers on this machine, time nothing")
    model_family.add_arguments(p)
    return p


def _device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shapes(bench: OpBench, given: list[Shape] | None, device: torch.device, quick: bool) -> list[Shape]:
    if given is not None:
        shapes = given
    elif device.type != "cuda":
        shapes = parse_shapes("tiny")
    else:
        shapes = parse_shapes(bench.default_shapes)
        shapes = shapes[:QUICK_SHAPES] if quick else shapes
    if not bench.uses_weight:  # only K matters
        shapes = list(dict.fromkeys(Shape(0, s.k) for s in shapes))
    return shapes


def _ms(bench: OpBench, given: list[int] | None, device: torch.device, quick: bool) -> list[int]:
    if given is not None:
        return given
    cand = CPU_M if device.type != "cuda" else (QUICK_M if quick else (bench.default_m or DEFAULT_M))
    kept = [m for m in cand if bench.default_m is None or m in bench.default_m]
    return kept or list(cand)


def _list(family_modules, device: torch.device) -> None:
    for fam, module in family_modules:
        if hasattr(module, "run_family"):
            print(module.describe(device))
            continue
        print(f"{fam}:")
        for bench in module.benches():
            ok, why = bench.available()
            if not ok:
                print(f"  {bench.op}: skipped: {why}")
                continue
            provs, left_out = providers(bench, device)
            print(f"  {bench.op} (default shapes {bench.default_shapes}): "
                  + ", ".join(f"{p.name} [{p.kind}]" for p in provs))
            for line in left_out:
                print(f"    not usable on {device}: {line}")
            for line in bench.baseline_notes(device):
                print(f"    baseline {line}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sanitize"]:  # a stage of its own: its options are not a family's
        from .sanitize import main as sanitize_main

        return sanitize_main(argv[1:])
    if argv[:1] == ["sweep"]:
        from .sweep import main as sweep_main

        return sweep_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else None
        ms = parse_ms(args.m) if args.m else None
    except ValueError as e:
        parser.error(str(e))
    if args.sustain is not None and not args.sustain >= 0:
        parser.error(f"--sustain: expected seconds >= 0, got {args.sustain}")
    keep = {s.strip() for s in args.providers.split(",") if s.strip()} if args.providers else None
    device = _device(args.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a smoke run on a shared machine: no thread-pool contention
    try:
        return _run(args, shapes, ms, keep, device)
    finally:
        torch.set_num_threads(threads)


def _run(args, shapes, ms, keep, device) -> int:
    import scaledmm  # noqa: F401  (defines the ops, registers the backends)

    families = FAMILIES if args.family == "all" else (args.family,)
    modules = [(f, importlib.import_module(f".{f}", __package__)) for f in families]
    if args.list:
        _list(modules, device)
        return 0

    cfg = TimingConfig.for_device(device, args.quick)
    if args.sustain is not None:
        cfg = dataclasses.replace(cfg, warmup_s=args.sustain)
    env = environment(device)
    print(f"measuring ceilings on {device} ...", file=sys.stderr, flush=True)
    ceil = measure_ceilings(device, args.quick)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_results: list[Result] = []
    for fam, module in modules:
        if hasattr(module, "run_family"):  # a whole-model family runs its own loop and output
            module.run_family(args, device, cfg, env, ceil, out_dir)
            continue
        results: list[Result] = []
        notes: list[str] = []
        for bench in module.benches():
            ok, why = bench.available()
            if not ok:
                notes.append(f"- {bench.op}: SKIPPED: {why}")
                print(f"{fam}: {bench.op} skipped: {why}", file=sys.stderr)
                continue
            provs, left_out = providers(bench, device)
            notes += [f"- {bench.op}: backend {line} (not usable on this device)" for line in left_out]
            notes += [f"- {bench.op}: baseline {line}" for line in bench.baseline_notes(device)]
            if keep is not None:
                provs = [p for p in provs if p.name in keep]
            elif args.quick and device.type == "cuda":  # plain torch math: slow, not a kernel to tune
                provs = [p for p in provs if p.name != "reference"]
                notes.append(f"- {bench.op}: backend reference left out by --quick")
            if not provs:
                notes.append(f"- {bench.op}: no provider left after --providers")
                continue
            results += run_bench(bench, _shapes(bench, shapes, device, args.quick),
                                 _ms(bench, ms, device, args.quick), provs, device, cfg)
        body = header(fam, env, ceil, cfg, args.quick) + "\n"
        if results:
            body += markdown(results, ceil) + "\n"
        if notes:
            body += "Family notes:\n\n" + "\n".join(notes) + "\n"
        print(body, flush=True)
        (out_dir / f"{fam}.md").write_text(body)
        if results:
            write_csv(out_dir / f"{fam}.csv", results, ceil)
            if not args.no_plots:
                from .plots import plot

                _, msg = plot(results, ceil, out_dir)
                print(msg, file=sys.stderr)
        if args.write_results and not results:
            print(f"{fam}: nothing measured; its RESULTS.md section is left as it was", file=sys.stderr)
        elif args.write_results:
            update_results_file(Path(args.results_file), fam, body)
            # A copy in --out as well: on a lent GPU machine only the output folder comes back.
            shutil.copyfile(args.results_file, out_dir / "RESULTS.md")
        all_results += results
    meta = {"args": vars(args), "env": env, "ceilings": dataclasses.asdict(ceil),
            "timing": dataclasses.asdict(cfg)}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    if all_results:
        print("## summary: auto vs baselines\n\n" + summary(all_results))
    print(f"\nfiles in {out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
