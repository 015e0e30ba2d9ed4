"""``python -m benchmarks.tune <csv> --kernel NAME [--out JSON]``: a kernel's
tuned configs (``scaledmm/tuning/kernels/<kernel>_<arch>.json``, format in
``scaledmm/kernel_tuning.py``) from a sweep of its configs.

The CSV has one row per timed point: columns ``n``, ``k``, ``m``, one column
per config field of the kernel's file (``config_fields``; values as Python
or JSON write them: ``1``, ``True`` / ``true``, ``streamk``) and
``median_us``; a ``status`` column, when present, keeps only ``ok`` rows.
The same config timed more than once at a point counts with the median of
its times.

* Kernels compiled per M bucket (``match: "bucket"``): each M falls in its
  bucket (the backend's ``m_bucket``); per shape and bucket the config with
  the smallest total time over the bucket's measured M wins (configs not
  timed at every one of them are left out).
* ``match: "max_m"``: per shape and measured M the fastest config wins;
  neighbouring M with the same winner merge into one row, and the last row
  also covers every larger M.

With ``--out`` an existing file, the shapes of the sweep replace their rows;
other rows, ``default`` and ``notes`` stay.  With ``--keep-smaller-m`` a
swept shape keeps its rows that end below the sweep's smallest M of that
shape (a sweep of the large-M points only); the sweep's first row then also
covers the M between.  The result is validated by the
loader (each config built by its dataclass, CUTLASS configs also checked by
``config_valid``) before it is written.

Examples
--------
>>> # python -m benchmarks.tune out/gemv_sweep.csv --kernel nvfp4_gemv --out scaledmm/tuning/kernels/nvfp4_gemv_sm90.json
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import statistics
import sys
import typing
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

__all__ = ["KERNELS", "Kernel", "best_configs", "build_rows", "dump", "tune"]

LAST_M = 2**31 - 1


class Kernel(typing.NamedTuple):
    """Where a kernel's config dataclass lives and how its rows match M."""

    module: str
    config: str
    match: str
    bucket: str | None = None  # module function mapping M to the row key (match "bucket")
    check: str | None = None   # module function (config) -> (ok, reason), run at load

    def load(self) -> tuple[type, Callable[[int], int] | None, Callable | None]:
        mod = importlib.import_module(self.module)
        bucket = getattr(mod, self.bucket) if self.bucket else None
        return getattr(mod, self.config), bucket, getattr(mod, self.check) if self.check else None


KERNELS: dict[str, Kernel] = {
    "fp8_block_cutlass": Kernel("scaledmm.ops.fp8_block_cutlass", "CutlassConfig", "max_m", check="config_valid"),
    "fp8_block_triton": Kernel("scaledmm.ops.fp8_block_triton", "MMConfig", "bucket", "m_bucket_max"),
    "nvfp4_gemv": Kernel("scaledmm.ops.nvfp4_gemv", "GemvConfig", "bucket", "m_bucket"),
    "nvfp4_gemv_w4a16": Kernel("scaledmm.ops.nvfp4_gemv", "GemvConfig", "bucket", "m_bucket"),
    "fp8_gemv": Kernel("scaledmm.ops.fp8_gemv", "GemvConfig", "bucket", "m_bucket"),
    "nvfp4_mid": Kernel("scaledmm.ops.nvfp4_mid", "MidConfig", "bucket", "m_bucket"),
    "nvfp4_mid_w4a16": Kernel("scaledmm.ops.nvfp4_mid", "MidConfig", "bucket", "m_bucket"),
    "skinny_fused_a": Kernel("scaledmm.ops.skinny_fused_a", "RegConfig", "bucket", "m_bucket"),
    "skinny_fused_a_tma": Kernel("scaledmm.ops.skinny_fused_a", "TmaConfig", "bucket", "m_bucket"),
    "nvfp4_triton": Kernel("scaledmm.ops.nvfp4_triton", "GemmConfig", "max_m"),
    "nvfp4_wgmma": Kernel("scaledmm.ops.nvfp4_wgmma", "WgmmaConfig", "max_m"),
    "fp8_wgmma": Kernel("scaledmm.ops.fp8_wgmma", "WgmmaConfig", "max_m"),
    "fp8_wgmma_block": Kernel("scaledmm.ops.fp8_wgmma", "WgmmaConfig", "max_m"),
}

_TRUE, _FALSE = {"1", "true", "True"}, {"0", "false", "False"}


def _value(text: str, kind: Any, field: str) -> Any:
    text = text.strip()
    if kind is bool:
        if text not in _TRUE | _FALSE:
            raise ValueError(f"column {field!r}: expected true/false or 1/0, got {text!r}")
        return text in _TRUE
    if kind is int:
        return int(text)
    return text


def best_configs(rows: list[dict], cls: type, fields: list[str],
                 bucket: Callable[[int], int] | None) -> dict[tuple[int, int], dict[int, tuple[dict, float]]]:
    """``{(n, k): {key: (config fields, us)}}``: the winning config per shape
    and M (``bucket`` None) or per shape and ``bucket(M)``."""
    hints = typing.get_type_hints(cls)
    missing = [c for c in ("n", "k", "m", "median_us", *fields) if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"sweep CSV: expected columns n, k, m, median_us and {fields}, missing {missing}")
    times: dict[tuple[int, int, int], dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("status", "ok") != "ok":
            continue
        try:
            t = float(r["median_us"])
        except ValueError:
            continue
        if math.isnan(t):
            continue
        cfg = tuple(_value(r[f], hints.get(f), f) for f in fields)
        times[(int(r["n"]), int(r["k"]), int(r["m"]))][cfg].append(t)
    per_key: dict[tuple[int, int, int], dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (n, k, m), by_cfg in times.items():
        key = bucket(m) if bucket else m
        for cfg, ts in by_cfg.items():
            per_key[(n, k, key)][cfg].append(statistics.median(ts))
    out: dict[tuple[int, int], dict[int, tuple[dict, float]]] = defaultdict(dict)
    for (n, k, key), by_cfg in sorted(per_key.items()):
        points = max(len(ts) for ts in by_cfg.values())
        full = {cfg: sum(ts) for cfg, ts in by_cfg.items() if len(ts) == points}
        cfg, us = min(full.items(), key=lambda ct: (ct[1], repr(ct[0])))
        out[(n, k)][key] = (dict(zip(fields, cfg)), us)
    return dict(out)


def build_rows(best: dict[tuple[int, int], dict[int, tuple[dict, float]]], match: str) -> list[dict]:
    """File rows from :func:`best_configs`; with ``match`` ``"max_m"``,
    neighbouring M with the same winner merge and the last row covers every
    larger M.

    Examples
    --------
    >>> best = {(64, 128): {1: ({"t": 16}, 2.0), 4: ({"t": 16}, 2.5), 64: ({"t": 64}, 9.0)}}
    >>> [(r["max_m"], r["config"]) for r in build_rows(best, "max_m")]
    [(4, {'t': 16}), (2147483647, {'t': 64})]
    """
    rows: list[dict] = []
    for (n, k), points in sorted(best.items()):
        mine: list[dict] = []
        for key, (cfg, us) in sorted(points.items()):
            if match == "max_m" and mine and mine[-1]["config"] == cfg:
                mine[-1]["max_m"] = key
                continue
            mine.append({"n": n, "k": k, "max_m": key, "config": cfg, "us": round(us, 2)})
        if match == "max_m":
            mine[-1]["max_m"] = LAST_M
        rows += mine
    return rows


def dump(data: dict) -> str:
    """The file text: one key per line, one row per line."""
    def value(v: Any) -> str:
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return "[\n" + ",\n".join("  " + json.dumps(r) for r in v) + "\n ]"
        return json.dumps(v)
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(v)}" for k, v in data.items()) + "\n}\n"


def tune(rows: list[dict], kernel: str, arch: str, source: str, old: dict | None = None,
         keep_smaller_m: bool = False) -> dict:
    """The kernel config document of ``kernel`` from sweep ``rows`` (CSV
    dicts), merged into ``old`` (an existing file's document) when given;
    with ``keep_smaller_m`` a swept shape keeps its old rows ending below
    the sweep's smallest M (bucket) for it.  Validated by
    :func:`scaledmm.kernel_tuning.parse`."""
    from scaledmm import kernel_tuning

    if kernel not in KERNELS:
        raise ValueError(f"--kernel: expected one of {sorted(KERNELS)}, got {kernel!r}")
    spec = KERNELS[kernel]
    cls, bucket, check = spec.load()
    known = [f for f in dataclasses.fields(cls) if f.init]
    fields = list(old["config_fields"]) if old else [f.name for f in known]
    # Fields the config class gained after the file was written (a new kernel
    # option with a default): taken from the sweep so that configs differing
    # only there stay apart; the file's kept rows get the default.
    gained = {f.name: f.default for f in known if f.name not in fields and f.default is not dataclasses.MISSING
              and rows and f.name in rows[0]}
    fields += list(gained)
    best = best_configs(rows, cls, fields, bucket)
    if not best:
        raise ValueError(f"sweep CSV: no timed point of {kernel}")
    new_rows = build_rows(best, old.get("match", spec.match) if old else spec.match)
    data = dict(old) if old else {"kernel": kernel, "arch": arch, "match": spec.match,
                                  "config_fields": fields, "default": None, "rows": []}
    first = {nk: min(points) for nk, points in best.items()}
    kept = [{**r, "config": {**r["config"], **gained}} for r in data["rows"]
            if (r["n"], r["k"]) not in best or keep_smaller_m and r["max_m"] < first[(r["n"], r["k"])]]
    if gained:
        data["config_fields"] = fields
        if data.get("default"):
            data["default"] = [{**r, "config": {**r["config"], **gained}} for r in data["default"]]
    data["source"] = source
    data["rows"] = kept + new_rows  # a shape's kept rows end below its new ones: ascending per shape
    kernel_tuning.parse(data, f"{kernel}_{arch}.json", cls, kernel, arch, check)
    return data


def main(args: Any, rows: list[dict], source: str) -> int:
    """``tune.main``'s ``--kernel`` mode."""
    out = Path(args.out) if args.out else None
    old = json.loads(out.read_text()) if out and out.exists() else None
    data = tune(rows, args.kernel, args.arch, source, old, getattr(args, "keep_smaller_m", False))
    text = dump(data)
    if out:
        out.write_text(text)
        print(f"wrote {out}: {len(data['rows'])} rows", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
