"""Command line of :mod:`scaledmm.jit`::

    python -m scaledmm.jit status                  # what is cached
    python -m scaledmm.jit build --skinny 2112:7168,1536:7168

``build`` takes one flag per kernel family that registered a pre-build hook
(:func:`scaledmm.jit.register_prebuild`); importing :mod:`scaledmm` registers
them."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from .core import _env as env
from .core import (PREBUILD, ENV_CACHE_DIR, ENV_NO_BUILD, JitError, _nvcc_version, build_specs,
                   cache_dir, cached_entries, nvcc_path, nvrtc_available)


def _cmd_status(args) -> int:
    """List the entries; 1 when the cache folder is unusable or an entry is damaged."""
    root = cache_dir()
    entries = cached_entries()
    where = "" if root.is_dir() else "  (not created yet)"
    if root.is_dir() and not os.access(root, os.W_OK):
        where = "  (read-only: entries load, a miss or a damaged entry cannot be built)"
    print(f"scaledmm jit cache: {root}  ({len(entries)} entries, "
          f"{sum(e['bytes'] for e in entries) / 1e6:.2f} MB){where}")
    print(f"  nvcc: {nvcc_path() or 'not found'} ({_nvcc_version(nvcc_path())}); "
          f"NVRTC: {nvrtc_available()[1]}; {ENV_NO_BUILD}={env.get(ENV_NO_BUILD) or ''!r}")
    for e in entries:
        extra = e.get("defines") or ""
        state = "" if e["state"] == "ok" else f"  DAMAGED: {e['problem']}"
        print(f"  {e.get('kind', '?'):<6} {e.get('name', '?'):<28} {str(e.get('key', '?'))[:16]}  "
              f"{e['bytes'] / 1e3:9.1f} kB  {e.get('arch', '')}  {extra}{state}")
    damaged = [e for e in entries if e["state"] != "ok"]
    if damaged:
        print(f"{len(damaged)} damaged entries: each is rebuilt on its next use (refused under {ENV_NO_BUILD}=1), "
              f"or now with `python -m scaledmm.jit build ...`", file=sys.stderr)
        return 1
    return 0


def _cmd_build(args) -> int:
    specs = []
    for flag in PREBUILD:
        value = getattr(args, flag.replace("-", "_"), None)
        if value:
            try:
                specs += list(PREBUILD[flag][0](value))
            except (ValueError, KeyError) as e:
                what = e if isinstance(e, ValueError) else f"unknown name {e}"
                print(f"python -m scaledmm.jit build: --{flag} {value!r}: {what}", file=sys.stderr)
                return 2
    if not specs:
        print("nothing to build: pass one of " + ", ".join(f"--{f}" for f in PREBUILD), file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"python -m scaledmm.jit build: --jobs: expected a positive integer, got {args.jobs}", file=sys.stderr)
        return 2

    def report(spec, result, seconds: float, was_cached: bool) -> None:
        if isinstance(result, JitError):
            print(f"  {spec.name:<28} FAILED: {result}", file=sys.stderr, flush=True)
            return
        state = "cached" if was_cached else f"built in {seconds:.1f} s"
        print(f"  {spec.name:<28} {spec.key[:16]}  {state}  {result}", flush=True)

    failed = build_specs(specs, args.jobs, report)
    return 0 if not failed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m scaledmm.jit {status, build ...}``; errors are printed
    (no traceback) and give a nonzero exit status."""
    import scaledmm  # noqa: F401  (registers the kernel families' prebuild hooks)

    parser = argparse.ArgumentParser(prog="python -m scaledmm.jit",
                                     description="Inspect and pre-build scaledmm's run-time compiled kernels.",
                                     epilog=f"The cache folder is ${ENV_CACHE_DIR} or ~/.cache/scaledmm.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="list cache entries (kind, name, key, size, damaged ones); exit 1 if any is damaged")
    b = sub.add_parser("build", help="pre-build kernels into the cache (damaged entries are rebuilt)")
    for flag, (_, help_) in PREBUILD.items():
        b.add_argument(f"--{flag}", metavar="SPEC", help=help_)
    b.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="builds at a time (default 1; a CUTLASS build takes ~1-2 GB of memory)")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return _cmd_status(args) if args.cmd == "status" else _cmd_build(args)
    except JitError as e:
        print(f"python -m scaledmm.jit {args.cmd}: {e}", file=sys.stderr)
        return 1
