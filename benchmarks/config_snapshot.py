"""``python -m benchmarks.config_snapshot [--out FILE]``: the kernel config
each backend's chooser returns, for every shape of the dsv3, llama8b and
fused_a sets, every M of the default sweep plus odd M, both 16-bit output
dtypes and each option variant (W4A16, bias, column-major scales, PDL, the
skinny kernel version, fused quantization, sm90 or not).

A change to where tuned numbers are stored must leave this output as it
was: ``tests/test_kernel_tuning.py`` compares it with
``tests/data/kernel_configs.json``.  Pure Python, no GPU: the SM count is
fixed at 132 (an H200) and each chooser is called directly.

Examples
--------
>>> # python -m benchmarks.config_snapshot --out /tmp/kernel_configs.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from typing import Any, Iterator

import torch

from benchmarks.shapes import DEFAULT_M, SHAPE_SETS

__all__ = ["MS", "SHAPES", "collect"]

SHAPES = tuple(dict.fromkeys((s.n, s.k) for name in ("dsv3", "llama8b", "fused_a") for s in SHAPE_SETS[name]))
MS = tuple(sorted(set(DEFAULT_M) | {1, 3, 5, 17, 31, 33, 65, 127, 129, 257, 1025, 4096}))
NUM_SMS = 132
OUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _text(cfg: Any) -> Any:
    """A config as JSON: a dataclass as its repr (every field, one line)."""
    if cfg is None or isinstance(cfg, (int, str)):
        return cfg
    if dataclasses.is_dataclass(cfg) or isinstance(cfg, tuple):
        return repr(cfg)
    raise TypeError(f"unexpected config {cfg!r}")


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _points() -> Iterator[tuple[str, int, int, int]]:
    for n, k in SHAPES:
        for m in MS:
            yield f"{n}x{k} m{m}", n, k, m


def _fp8_block_cutlass() -> dict[str, Any]:
    from scaledmm.backends import Family, Problem
    from scaledmm.ops import fp8_block_cutlass as C

    out = {}
    for key, n, k, m in _points():
        for dname, dt in OUT_DTYPES.items():
            for col in (False, True):
                p = Problem(Family.FP8_BLOCK, torch.device("cuda"), m, n, k, torch.float8_e4m3fn, dt, k,
                            (("block_size", (128, 128)), ("a_scales_col_major", col)))
                out[f"{key} {dname} col={int(col)}"] = _text(C.select_config(p))
    return out


def _fp8_block_triton() -> dict[str, Any]:
    from scaledmm.ops import fp8_block_triton as T

    return {f"{key} fused={int(f)} sm90={int(s)}": _text(T.default_config(m, n, k, NUM_SMS, f, s))
            for key, n, k, m in _points() for f in (False, True) for s in (True, False)}


def _fp8_quant() -> dict[str, Any]:
    from scaledmm.ops import fp8_block_triton_quant as BQ
    from scaledmm.ops import fp8_triton_quant as Q

    out = {}
    with _patched(BQ, "_num_sms", lambda device: NUM_SMS):
        for _, _, k, m in _points():
            for gp in (128,):
                out[f"block_quant K{k} m{m} gp{gp}"] = _text(BQ.quant_tile(m * (k // 128), gp, torch.device("cuda")))
            for mode in (Q.PER_TOKEN, Q.STATIC, Q.PER_TENSOR):
                out[f"quant {mode} K{k} m{m}"] = _text(Q.default_config(mode, m, k))
    return out


def _nvfp4_triton() -> dict[str, Any]:
    from scaledmm.backends import Family, Problem
    from scaledmm.ops import nvfp4_triton as NT
    from scaledmm.ops import nvfp4_triton_quant as NQ

    out = {}
    with _patched(NT, "grid_sms", lambda device: NUM_SMS):
        for key, n, k, m in _points():
            for dname, dt in OUT_DTYPES.items():
                for w4a16 in (False, True):
                    for bias in (False, True):
                        p = Problem(Family.NVFP4, torch.device("cuda"), m, n, k,
                                    torch.bfloat16 if w4a16 else torch.uint8, dt, k,
                                    (("bias", bias), ("w4a16", w4a16)))
                        op = "nvfp4_w4a16_mm" if w4a16 else "nvfp4_mm"
                        out[f"{key} {dname} w4a16={int(w4a16)} bias={int(bias)}"] = _text(NT.select_config(op, p))
    for m in MS:
        out[f"quant m{m}"] = _text(NQ.default_quant_config(m))
    return out


def _nvrtc(module: str) -> dict[str, Any]:
    import importlib

    mod = importlib.import_module(f"scaledmm.ops.{module}")
    return {f"{key} w4a16={int(w)}": _text(mod.choose_config(n, k, mod.m_bucket(m), NUM_SMS, w))
            for key, n, k, m in _points() for w in (False, True)}


def _nvfp4_wgmma() -> dict[str, Any]:
    from scaledmm.ops import nvfp4_wgmma as wg

    # one table for W4A4 and W4A16; K % 64 shapes only
    return {key: _text(wg.choose_config(n, k, m, NUM_SMS)) for key, n, k, m in _points() if k % wg.K_MULTIPLE == 0}


def _fp8_wgmma() -> dict[str, Any]:
    from scaledmm.ops import fp8_wgmma as fw

    return {key: _text(fw.choose_config(n, k, m, NUM_SMS)) for key, n, k, m in _points() if k % 16 == 0}


def _fp8_wgmma_block() -> dict[str, Any]:
    from scaledmm.ops import fp8_wgmma as fw

    return {key: _text(fw.choose_config(n, k, m, NUM_SMS, True)) for key, n, k, m in _points() if k % 16 == 0}


def _skinny() -> dict[str, Any]:
    from scaledmm.ops import skinny_fused_a as S

    out = {}
    for kernel in ("reg", "tma"):
        with _patched(S, "KERNEL", kernel):
            for key, n, k, m in _points():
                if m > 16:
                    continue
                for pdl in (False, True):
                    out[f"{key} {kernel} pdl={int(pdl)}"] = _text(S.choose_config(n, k, m, pdl, NUM_SMS))
    return out


def _nvfp4_cublas() -> dict[str, Any]:
    from scaledmm.ops import nvfp4_cublas as CB

    return {key: _text(CB.chunk_rows(m, n, k)) for key, n, k, m in _points()}


def collect() -> dict[str, dict[str, Any]]:
    """``{kernel: {case: config}}`` for every kernel with a config chooser.

    Examples
    --------
    >>> snap = collect()  # doctest: +SKIP
    >>> snap["nvfp4_gemv"]["4096x4096 m1 w4a16=0"]  # doctest: +SKIP
    'GemvConfig(rows=16, warps=8, split_k=1, unroll=2)'
    """
    return {
        "fp8_block_cutlass": _fp8_block_cutlass(),
        "fp8_block_triton": _fp8_block_triton(),
        "fp8_quant": _fp8_quant(),
        "nvfp4_triton": _nvfp4_triton(),
        "nvfp4_gemv": _nvrtc("nvfp4_gemv"),
        "nvfp4_mid": _nvrtc("nvfp4_mid"),
        "nvfp4_wgmma": _nvfp4_wgmma(),
        "fp8_wgmma": _fp8_wgmma(),
        "fp8_wgmma_block": _fp8_wgmma_block(),
        "skinny_fused_a": _skinny(),
        "nvfp4_cublas": _nvfp4_cublas(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.config_snapshot", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON file to write (default: stdout)")
    args = p.parse_args(argv)
    text = json.dumps(collect(), indent=0, sort_keys=True) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
