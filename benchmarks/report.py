"""Reporting: derived metrics, the markdown tables, the CSV, and the
``benchmarks/RESULTS.md`` section of a family.

Every timed result is also given as TFLOP/s and GB/s, as a percentage of the
measured ceilings (the roofline floor ``max(flops / rate, bytes / bandwidth)``
over the measured time), and as a speed ratio to each baseline
(``baseline time / provider time``: above 1 means faster than the baseline).
"""

from __future__ import annotations

import csv
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from .harness import BASELINE, OURS, Result
from .machine import Ceilings
from .timing import TimingConfig

__all__ = ["FIELDS", "metrics", "baseline_names", "write_csv", "markdown", "summary", "header",
           "update_results_file"]

FIELDS = ["family", "op", "shape", "n", "k", "m", "provider", "kind", "backend", "status", "error", "median_us",
          "p20_us", "p80_us", "reps", "mode", "copies", "rotation_mb", "flops", "bytes", "tflops", "gbps",
          "pct_compute", "pct_bandwidth", "floor_us", "pct_roofline", "note"]


def metrics(r: Result, ceil: Ceilings) -> dict:
    """Rates, percentages of the ceilings and the roofline floor of one result
    (empty for results that were not timed)."""
    if r.timing is None or not r.timing.median_us > 0:
        return {}
    t = r.timing.median_us * 1e-6
    rate = ceil.rate(r.unit) if r.flops else None
    out = {"tflops": r.flops / t * 1e-12, "gbps": r.nbytes / t * 1e-9}
    out["pct_bandwidth"] = 100.0 * out["gbps"] / ceil.copy_gbps
    floor = r.nbytes / (ceil.copy_gbps * 1e9)
    if rate:
        out["pct_compute"] = 100.0 * out["tflops"] / rate
        floor = max(floor, r.flops / (rate * 1e12))
    out["floor_us"] = floor * 1e6
    out["pct_roofline"] = 100.0 * floor / t
    return out


def baseline_names(results: Iterable[Result]) -> list[str]:
    names: list[str] = []
    for r in results:
        if r.kind == BASELINE and r.provider not in names:
            names.append(r.provider)
    return names


def _index(results: Sequence[Result]) -> dict:
    return {(r.op, r.shape, r.m, r.provider): r for r in results}


def _ratio(base: Result | None, r: Result) -> float | None:
    if base is None or base.timing is None or r.timing is None:
        return None
    return base.timing.median_us / r.timing.median_us


def _fmt(v, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def write_csv(path: Path, results: Sequence[Result], ceil: Ceilings) -> None:
    """One row per (op, shape, M, provider); ``vs_<baseline>`` columns hold
    the speed ratio to each baseline at the same point."""
    bases = baseline_names(results)
    idx = _index(results)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS + [f"vs_{b}" for b in bases])
        for r in results:
            t = r.timing
            row = {
                "family": r.family, "op": r.op, "shape": r.shape.label, "n": r.shape.n, "k": r.shape.k,
                "m": r.m, "provider": r.provider, "kind": r.kind, "backend": r.backend, "status": r.status,
                "error": r.error,
                "median_us": t.median_us if t else None, "p20_us": t.p20_us if t else None,
                "p80_us": t.p80_us if t else None, "reps": t.reps if t else None, "mode": t.mode if t else "",
                "copies": r.copies, "rotation_mb": r.rotation_bytes / 1e6, "flops": r.flops, "bytes": r.nbytes,
                "note": r.note,
            }
            row.update(metrics(r, ceil))
            ratios = [_ratio(idx.get((r.op, r.shape, r.m, b)), r) for b in bases]
            w.writerow([_fmt(row.get(k), 6) for k in FIELDS] + [_fmt(x, 4) for x in ratios])


# ----------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------

_CELL = {"wrong": "WRONG", "n/a": "n/a", "error": "ERROR"}


def _cell(r: Result | None) -> str:
    if r is None:
        return ""
    if r.timing is not None:
        return f"{r.timing.median_us:.1f}"
    return _CELL.get(r.status, r.status)


def _ms_list(ms: list[int]) -> str:
    return ",".join(str(m) for m in ms) if len(ms) <= 6 else f"{ms[0]}..{ms[-1]} ({len(ms)} values)"


def _notes(rs: Sequence[Result]) -> list[str]:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for r in rs:
        if r.status != "ok" or r.note:
            groups[(r.provider, r.status, r.note)].append(r.m)
    lines = []
    for (prov, status, note), ms in groups.items():
        err = ""
        if status == "wrong":
            err = " (caught by the correctness check, not timed)"
        lines.append(f"- {prov}: {status.upper() if status in ('wrong', 'error') else status}"
                     f"{err} at M={_ms_list(ms)}: {note}")
    return lines


def markdown(results: Sequence[Result], ceil: Ceilings) -> str:
    """Per op and shape: a table of median microseconds (rows M, columns
    providers), the backend ``auto`` selected, the best of our backends,
    ``auto``'s rate and roofline share,
    and ``auto``'s speed ratio to each baseline; notes on untimed providers."""
    out: list[str] = []
    by_shape: dict[tuple, list[Result]] = defaultdict(list)
    for r in results:
        by_shape[(r.op, r.shape)].append(r)
    for (op, shape), rs in by_shape.items():
        provs: list[str] = []
        for r in rs:
            if r.provider not in provs:
                provs.append(r.provider)
        ours_backends = [p for p in provs if p != "auto" and any(r.kind == OURS and r.provider == p for r in rs)]
        bases = baseline_names(rs)
        ms = sorted({r.m for r in rs})
        idx = _index(rs)
        compute = any(r.flops for r in rs)
        what = f"N x K = {shape.n} x {shape.k}" if shape.n else f"[M, {shape.k}]"
        out.append(f"### {op}, {what}\n")
        out.append("Median µs per call (p20/p80, rates and all ratios in the CSV).\n")
        cols = ["M"] + provs + ["auto picks", "best ours", "auto TFLOP/s" if compute else "auto GB/s",
                                "auto % roofline"]
        cols += [f"auto vs {b}" for b in bases]
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for m in ms:
            row = [str(m)] + [_cell(idx.get((op, shape, m, p))) for p in provs]
            timed = [idx[(op, shape, m, p)] for p in ours_backends
                     if (op, shape, m, p) in idx and idx[(op, shape, m, p)].timing]
            best = min(timed, key=lambda r: r.timing.median_us, default=None)
            auto = idx.get((op, shape, m, "auto"))
            row.append(auto.backend if auto else "")
            row.append(f"{best.provider} {best.timing.median_us:.1f}" if best else "")
            met = metrics(auto, ceil) if auto else {}
            row.append(_fmt(met.get("tflops" if compute else "gbps"), 4))
            row.append(_fmt(met.get("pct_roofline"), 3))
            for b in bases:
                x = _ratio(idx.get((op, shape, m, b)), auto) if auto else None
                row.append(f"{x:.2f}x" if x else "")
            out.append("| " + " | ".join(row) + " |")
        notes = _notes(rs)
        if notes:
            out.append("\nNot timed or noted:\n")
            out.extend(notes)
        out.append("")
    return "\n".join(out)


def summary(results: Sequence[Result]) -> str:
    """Compact tables, one per op: per shape, ``auto``'s geometric-mean speed
    ratio to each baseline over M (with the min and max and their M), and the
    providers found wrong or failing."""
    out = []
    for op in dict.fromkeys(r.op for r in results):
        rs = [r for r in results if r.op == op]
        bases = baseline_names(rs)
        idx = _index(rs)
        cols = ["shape"] + [f"auto vs {b}" for b in bases] + ["wrong/error"]
        lines = [f"{op} (geomean over M, min@M..max@M):", "",
                 "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for shape in dict.fromkeys(r.shape for r in rs):
            ms = sorted({r.m for r in rs if r.shape == shape})
            cells = [shape.label]
            for b in bases:
                xs = [(x, m) for m in ms
                      if (auto := idx.get((op, shape, m, "auto"))) is not None
                      and (x := _ratio(idx.get((op, shape, m, b)), auto))]
                if not xs:
                    cells.append("")
                    continue
                gm = math.exp(sum(math.log(x) for x, _ in xs) / len(xs))
                lo, hi = min(xs), max(xs)
                cells.append(f"{gm:.2f}x ({lo[0]:.2f}@{lo[1]}..{hi[0]:.2f}@{hi[1]})")
            bad = {f"{r.provider}:{r.status}" for r in rs if r.shape == shape and r.status in ("wrong", "error")}
            cells.append(", ".join(sorted(bad)) or "none")
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def header(title: str, env: dict, ceil: Ceilings, cfg: TimingConfig, quick: bool) -> str:
    """Date, device, versions, commit, ceilings and method, as markdown bullets."""
    lines = [f"## {title}", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines.append(f"- ceilings: {ceil.describe()}")
    if cfg.rotate_bytes:
        method = (f"CUDA events; calls under {cfg.graph_below_us:.0f} µs timed as CUDA-graph replay; "
                  f"inputs rotated over >= {cfg.rotate_bytes / 2**20:.0f} MiB of copies (cold L2, at most "
                  f"{cfg.max_copies} copies); ")
    else:
        method = "wall clock (CPU smoke run: numbers are not GPU performance); "
    if cfg.warmup_s:
        method += f"{cfg.warmup_s:g} s of continuous calls before each timed point; "
    method += (f"median of {cfg.min_reps}-{cfg.max_reps} reps; each provider checked against a float64 "
               f"reference before it is timed" + ("; --quick" if quick else ""))
    lines.append(f"- method: {method}")
    return "\n".join(lines) + "\n"


_SECTION = re.compile(r"<!-- BEGIN (?P<name>[\w-]+) -->.*?<!-- END (?P=name) -->\n?", re.S)
_PREAMBLE = ("# Benchmark results\n\nGenerated by `python -m benchmarks <family> --write-results`"
             " (see `benchmarks/README.md`). Each family's section is replaced by its latest run;"
             " the other sections are kept.\n\n")


def update_results_file(path: Path, family: str, body: str) -> None:
    """Replace (or append) the ``family`` section of ``path``, keeping the others.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "R.md"
    >>> update_results_file(p, "fp8", "old"); update_results_file(p, "quant", "q")
    >>> update_results_file(p, "fp8", "new")
    >>> t = p.read_text(); ("new" in t, "old" in t, "q" in t)
    (True, False, True)
    """
    text = path.read_text() if path.exists() else _PREAMBLE
    section = f"<!-- BEGIN {family} -->\n{body.rstrip()}\n<!-- END {family} -->\n"
    for match in _SECTION.finditer(text):
        if match["name"] == family:
            text = text[:match.start()] + section + text[match.end():]
            break
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
