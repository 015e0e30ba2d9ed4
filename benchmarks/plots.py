"""PNG plots: per op and shape, TFLOP/s (GEMMs) or GB/s (quantizers) against
M, one line per provider.  matplotlib is optional; without it no plot is drawn
and the CLI says so."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

from .harness import BASELINE, Result
from .machine import Ceilings
from .report import metrics

__all__ = ["plot"]


def plot(results: Sequence[Result], ceil: Ceilings, out_dir: Path) -> tuple[list[Path], str]:
    """Write one PNG per (op, shape).  Returns the files and a message."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib not installed: no plots (pip install matplotlib)"
    by_shape: dict[tuple, list[Result]] = defaultdict(list)
    for r in results:
        by_shape[(r.op, r.shape)].append(r)
    files = []
    for (op, shape), rs in by_shape.items():
        compute = any(r.flops for r in rs)
        key, label = ("tflops", "TFLOP/s") if compute else ("gbps", "GB/s")
        lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
        kinds = {}
        for r in rs:
            met = metrics(r, ceil)
            if key in met and r.m > 0:
                lines[r.provider].append((r.m, met[key]))
                kinds[r.provider] = r.kind
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        for prov, pts in lines.items():
            pts.sort()
            style = "--" if kinds[prov] == BASELINE else "-"
            ax.plot([m for m, _ in pts], [v for _, v in pts], style, marker="o", markersize=3, label=prov)
        ceiling = None
        if compute:
            units = {r.unit for r in rs if r.unit}
            ceiling = max((ceil.rate(u) or 0.0 for u in units), default=0.0) or None
        else:
            ceiling = ceil.copy_gbps
        if ceiling:
            ax.axhline(ceiling, color="gray", linewidth=0.8, linestyle=":", label="measured ceiling")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("M")
        ax.set_ylabel(label)
        ax.set_title(f"{op} {shape.label}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        path = out_dir / f"{op}_{shape.label}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files, f"{len(files)} plot(s) in {out_dir}"
