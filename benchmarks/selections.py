"""``python -m benchmarks.selections [--out FILE]``: the backend automatic
selection picks for every op of every family, every shape of the dsv3,
llama8b and llama8b_hf sets and every M of the default sweep (plus unaligned
and edge M).

A change to how the selection policy is stored must leave this output as it
was: run it before and after and diff the two files.  Without ``--real`` (or
without a GPU) the architectures are simulated: ``arch_key`` and the device
capability are patched and every backend counts as supported, so the output
is the policy itself (order, per-shape rows, switches) walked through each
backend's ``can_implement``.  With ``--real`` on a GPU nothing is patched:
the output is what this machine selects.  ``tests/test_policy.py`` compares
the simulated output with ``tests/data/selections.json``.

Each case runs under its own environment (switches and explicit requests):
in a child process on the command line, so that code which read the
environment at import is measured the same way.

Examples
--------
>>> # python -m benchmarks.selections --out /tmp/selections.json
>>> # python -m benchmarks.selections --real --out /tmp/selections_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from typing import Iterator

import torch

__all__ = ["ARCHS", "CASES", "MS", "SHAPES", "collect", "simulated", "problems"]

# Simulated architectures: each policy key, members of a family (sm86, sm89,
# sm103 fall back to sm80 / sm100) and one with no entry of its own (sm120).
ARCHS = ("cpu", "sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120")
# The default sweep, unaligned M and the edges of the backends' M ranges.
MS = (0, 1, 2, 3, 4, 5, 8, 16, 17, 31, 32, 33, 64, 65, 127, 128, 129, 256, 257, 1023, 1024, 1025, 4095,
      4096, 8192)
SHAPE_SET_NAMES = ("dsv3", "llama8b", "llama8b_hf")

# name -> (families recorded, environment).  "default" records every family.
CASES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": (("fp8_block", "fp8", "nvfp4", "skinny"), {}),
    "nvfp4_gemv_off": (("nvfp4",), {"SCALEDMM_NVFP4_GEMV": "0"}),
    "nvfp4_mid_off": (("nvfp4",), {"SCALEDMM_NVFP4_MID": "0"}),
    "nvfp4_decode_cublas_off": (("nvfp4",), {"SCALEDMM_NVFP4_DECODE_CUBLAS": ""}),
    "nvfp4_wgmma_off": (("nvfp4",), {"SCALEDMM_NVFP4_WGMMA": "0"}),
    "nvfp4_all_off": (("nvfp4",), {"SCALEDMM_NVFP4_GEMV": "0", "SCALEDMM_NVFP4_MID": "0",
                                   "SCALEDMM_NVFP4_DECODE_CUBLAS": "0", "SCALEDMM_NVFP4_WGMMA": "0"}),
    "fp8_wgmma_off": (("fp8",), {"SCALEDMM_FP8_WGMMA": "0"}),
    "nvfp4_forced_cuda_gemv": (("nvfp4",), {"SCALEDMM_NVFP4_BACKEND": "cuda_gemv"}),
    "fp8_block_forced_cutlass": (("fp8_block",), {"SCALEDMM_FP8_BLOCK_BACKEND": "cutlass"}),
}
# Variables a case may set: all of them are cleared for the "default" case.
CASE_VARS = sorted({v for _, env in CASES.values() for v in env})


def _shapes() -> list[tuple[int, int]]:
    from benchmarks.shapes import SHAPE_SETS

    out: list[tuple[int, int]] = []
    for name in SHAPE_SET_NAMES:
        for s in SHAPE_SETS[name]:
            if (s.n, s.k) not in out:
                out.append((s.n, s.k))
    return out


SHAPES = tuple(_shapes())


def problems(family: str, device: torch.device, m: int, n: int,
             k: int) -> Iterator[tuple[str, object, str, int | None]]:
    """``(label, problem, op, table_m)`` for every op variant of ``family`` at
    ``(m, n, k)``: the Problems the op modules build for contiguous, aligned
    operands (kept in step with their builders by hand).

    Examples
    --------
    >>> [label for label, *_ in problems("skinny", torch.device("cpu"), 1, 2112, 7168)]
    ['dsv3_fused_a_gemm[bfloat16]']
    """
    from scaledmm.backends import Family, Problem

    bf16, fp16, fp32, fp8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
    if family == "fp8_block":
        fam = Family.FP8_BLOCK
        for col in (True, False):
            yield (f"per_token_group_quant_fp8[{'col' if col else 'row'}]",
                   Problem(fam, device, m, 0, k, bf16, fp8, k,
                           (("group_size", 128), ("column_major_scales", col), ("scale_ue8m0", False))),
                   "per_token_group_quant_fp8", None)

        def mm(rows, out, col):
            return Problem(fam, device, rows, n, k, fp8, out, k,
                           (("block_size", (128, 128)), ("a_scales_col_major", col)))

        for out, col in ((bf16, True), (bf16, False), (fp32, True)):
            tag = f"{str(out)[6:]},{'col' if col else 'row'}"
            yield f"fp8_block_mm[{tag}]", mm(m, out, col), "fp8_block_mm", None
            # padded_fp8_block_mm: checked at the padded M, ranked at the caller's
            yield f"padded_fp8_block_mm[{tag}]", mm(-(-m // 4) * 4, out, col), "fp8_block_mm", m
        yield ("fp8_block_linear[bfloat16]",
               Problem(fam, device, m, n, k, bf16, bf16, k,
                       (("block_size", (128, 128)), ("a_scales_col_major", False), ("aligned16", True))),
               "fp8_block_linear", None)
    elif family == "fp8":
        fam = Family.FP8
        for mode in ("static", "per_token", "per_tensor"):
            yield (f"quant_fp8[{mode}]", Problem(fam, device, m, 0, k, bf16, fp8, k, (("quant", mode),)),
                   "quant_fp8", None)
        for ka, kb, bias, out in (("tensor", "tensor", None, bf16), ("token", "channel", None, bf16),
                                  ("token", "channel", bf16, fp32), ("token", "channel", None, fp16)):
            variant = "tensorwise" if ka == kb == "tensor" else "rowwise"
            opts = (("scale_a", ka), ("scale_b", kb), ("bias_dtype", bias), ("b_aligned", True),
                    ("variant", variant))
            yield (f"fp8_scaled_mm[{ka},{kb},{bias},{out}]", Problem(fam, device, m, n, k, fp8, out, k, opts),
                   "fp8_scaled_mm", None)
        for mode, kb in (("per_token", "channel"), ("per_tensor", "tensor"), ("static", "tensor")):
            variant = "tensorwise" if mode != "per_token" and kb == "tensor" else "rowwise"
            opts = (("quant", mode), ("scale_b", kb), ("bias_dtype", None), ("aligned16", True), ("variant", variant))
            yield (f"fp8_linear[{mode},{kb}]", Problem(fam, device, m, n, k, bf16, bf16, k, opts), "fp8_linear", None)
    elif family == "nvfp4":
        fam = Family.NVFP4
        yield ("nvfp4_quant[bfloat16]", Problem(fam, device, m, 0, k, bf16, torch.uint8, k, (("swizzle", True),)),
               "nvfp4_quant", None)
        for out, bias in ((bf16, False), (fp16, True), (fp32, False)):
            yield (f"nvfp4_mm[{out},{bias}]",
                   Problem(fam, device, m, n, k, torch.uint8, out, k,
                           (("bias", bias), ("w4a16", False), ("aligned16", True))),
                   "nvfp4_mm", None)
        for x, out in ((bf16, bf16), (fp16, fp16), (bf16, fp32)):
            yield (f"nvfp4_w4a16_mm[{x},{out}]",
                   Problem(fam, device, m, n, k, x, out, k, (("bias", False), ("w4a16", True), ("aligned16", True))),
                   "nvfp4_w4a16_mm", None)
    elif family == "skinny":
        fam = Family.SKINNY
        yield ("dsv3_fused_a_gemm[bfloat16]",
               Problem(fam, device, m, n, k, bf16, bf16, k, (("enable_pdl", False), ("aligned16", True))),
               "dsv3_fused_a_gemm", None)
    else:
        raise ValueError(f"family: expected fp8_block, fp8, nvfp4 or skinny, got {family!r}")


def _capability(arch: str) -> tuple[int, int]:
    digits = arch[2:]
    return int(digits[:-1]), int(digits[-1])


@contextlib.contextmanager
def simulated(arch: str) -> Iterator[torch.device]:
    """Selection as on a device of ``arch`` (``"cpu"``, ``"sm90"``, ...) on
    which every backend counts as supported; yields the device to put in
    Problems.  Everything patched is restored on exit.

    Examples
    --------
    >>> from scaledmm import backends
    >>> with simulated("sm90") as dev:
    ...     backends.priority("nvfp4", dev)[0]
    'cuda_gemv'
    """
    from scaledmm import backends, jit

    def supported(backend, device):
        return True, "simulated"

    supported.cache_clear = lambda: None  # backends.invalidate() clears the real cache
    saved = [(backends, "arch_key", backends.arch_key), (backends, "supported_on", backends.supported_on),
             (torch.cuda, "get_device_capability", torch.cuda.get_device_capability),
             (jit, "nvrtc_available", jit.nvrtc_available), (jit, "cuda_driver", jit.cuda_driver)]
    backends.arch_key = lambda d: arch if d.type == "cuda" else d.type
    backends.supported_on = supported
    if arch != "cpu":
        cap = _capability(arch)
        torch.cuda.get_device_capability = lambda d=None: cap
    jit.nvrtc_available = lambda: (True, "simulated")
    jit.cuda_driver = lambda: None
    backends.invalidate()
    try:
        yield torch.device("cpu") if arch == "cpu" else torch.device("cuda", 0)
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        backends.invalidate()


def _runs(names: list[str], ms: tuple[int, ...]) -> str:
    """``"m:name"`` wherever the name changes along ``ms`` (lossless given ``ms``)."""
    out, last = [], None
    for m, name in zip(ms, names):
        if name != last:
            out.append(f"{m}:{name}")
            last = name
    return " ".join(out)


def _pick(problem, op: str, table_m: int | None) -> str:
    from scaledmm import backends

    try:
        return backends.select(problem, op, table_m=table_m).name
    except (RuntimeError, ValueError) as e:
        return f"!{type(e).__name__}"


def _collect_device(families, device: torch.device, shapes=SHAPES, ms=MS) -> dict[str, dict[str, str]]:
    """``{"family/op[variant]": {"NxK": runs}}`` selected on ``device`` as the
    registry stands (no patching); ``{"*": runs}`` when every shape has the
    same runs."""
    table: dict[str, dict[str, list[str]]] = {}
    for fam in families:
        for n, k in shapes:
            for m in ms:
                for label, p, op, table_m in problems(fam, device, m, n, k):
                    table.setdefault(f"{fam}/{label}", {}).setdefault(f"{n}x{k}", []).append(_pick(p, op, table_m))
    out = {}
    for key, rows in table.items():
        runs = {shape: _runs(names, tuple(ms)) for shape, names in rows.items()}
        out[key] = {"*": runs.popitem()[1]} if len(set(runs.values())) == 1 else runs
    return out


@contextlib.contextmanager
def _case_env(case: str) -> Iterator[None]:
    """The environment of ``case`` (every case variable cleared, then set)."""
    saved = {v: os.environ.get(v) for v in CASE_VARS}
    for v in CASE_VARS:
        os.environ.pop(v, None)
    os.environ.update(CASES[case][1])
    try:
        yield
    finally:
        for v, value in saved.items():
            if value is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = value


def collect(case: str = "default", real: bool = False, archs=ARCHS, shapes=SHAPES, ms=MS) -> dict:
    """The selections of ``case`` in this process: ``{arch: {key: {shape: runs}}}``.

    ``real``: on this machine's GPUs (and the CPU), nothing simulated.

    Examples
    --------
    >>> out = collect("default", archs=("cpu",), shapes=((256, 512),), ms=(1, 3))
    >>> out["cpu"]["nvfp4/nvfp4_mm[torch.bfloat16,False]"]["*"]
    '1:reference'
    """
    import scaledmm  # noqa: F401  (registers every backend)

    families = CASES[case][0]
    out: dict[str, dict] = {}
    with _case_env(case):
        if real:
            from scaledmm import backends

            devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
            for dev in devices:
                key = "cpu" if dev.type == "cpu" else f"{dev}:{backends.arch_key(dev)}"
                out[key] = _collect_device(families, dev, shapes, ms)
        else:
            for arch in archs:
                with simulated(arch) as dev:
                    out[arch] = _collect_device(families, dev, shapes, ms)
    return out


def _document(cases: dict[str, dict], real: bool) -> dict:
    """The JSON document: sweep, device description and every case."""
    device = "simulated: arch_key patched, every backend supported"
    if real and torch.cuda.is_available():
        device = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return {"format": 1, "device": device, "shapes": [f"{n}x{k}" for n, k in SHAPES], "ms": list(MS),
            "cases": cases}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.selections", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="-", help="JSON file to write (default: stdout)")
    p.add_argument("--real", action="store_true", help="this machine's devices, nothing simulated (needs a GPU)")
    p.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)  # one case, in this process
    args = p.parse_args(argv)
    if args.real and not torch.cuda.is_available():
        print("--real: no CUDA device; simulating", file=sys.stderr)
        args.real = False
    if args.case:
        cases = {args.case: collect(args.case, args.real)}
    else:
        cases = {}
        for case in CASES:  # a child each, its environment set before import
            env = {k: v for k, v in os.environ.items() if k not in CASE_VARS}
            env.update(CASES[case][1])
            cmd = [sys.executable, "-m", "benchmarks.selections", "--case", case] + (["--real"] if args.real else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stderr)
                return done.returncode
            cases[case] = json.loads(done.stdout)["cases"][case]
    text = json.dumps(_document(cases, args.real), indent=1, sort_keys=True) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}: {len(cases)} cases", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
