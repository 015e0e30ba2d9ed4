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
import time
from typing import Sequence

from .core import (_PREBUILD, ENV_NO_BUILD, JitError, _nvcc_version, cache_dir, cached_entries, nvcc_path,
                   nvrtc_available)


def _cmd_status(args) -> int:
    entries = cached_entries()
    print(f"scaledmm jit cache: {cache_dir()}  ({len(entries)} entries, "
          f"{sum(e['bytes'] for e in entries) / 1e6:.2f} MB)")
    print(f"  nvcc: {nvcc_path() or 'not found'} ({_nvcc_version(nvcc_path())}); "
          f"NVRTC: {nvrtc_available()[1]}; {ENV_NO_BUILD}={os.environ.get(ENV_NO_BUILD, '')!r}")
    for e in entries:
        extra = e.get("defines") or ""
        print(f"  {e.get('kind', '?'):<6} {e.get('name', '?'):<28} {str(e.get('key', '?'))[:16]}  "
              f"{e['bytes'] / 1e3:9.1f} kB  {e.get('arch', '')}  {extra}")
    return 0


def _cmd_build(args) -> int:
    specs = []
    for flag in _PREBUILD:
        value = getattr(args, flag.replace("-", "_"), None)
        if value:
            specs += list(_PREBUILD[flag][0](value))
    if not specs:
        print("nothing to build: pass one of " + ", ".join(f"--{f}" for f in _PREBUILD), file=sys.stderr)
        return 2
    failed = 0
    for spec in specs:
        t0 = time.perf_counter()
        try:
            was = spec.cached()
            path = spec.build()
            state = "cached" if was else f"built in {time.perf_counter() - t0:.1f} s"
            print(f"  {spec.name:<28} {spec.key[:16]}  {state}  {path}")
        except JitError as e:
            failed += 1
            print(f"  {spec.name:<28} FAILED: {e}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m scaledmm.jit {status, build ...}``."""
    import scaledmm  # noqa: F401  (registers the kernel families' prebuild hooks)

    parser = argparse.ArgumentParser(prog="python -m scaledmm.jit",
                                     description="Inspect and pre-build scaledmm's run-time compiled kernels.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="list cache entries (kind, name, key, size)")
    b = sub.add_parser("build", help="pre-build kernels into the cache")
    for flag, (_, help_) in _PREBUILD.items():
        b.add_argument(f"--{flag}", metavar="SPEC", help=help_)
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    return _cmd_status(args) if args.cmd == "status" else _cmd_build(args)
