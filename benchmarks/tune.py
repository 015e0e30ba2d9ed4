"""``python -m benchmarks.tune <csv> [--out JSON]``: the measured auto-selection
table of a registry family, from a benchmark CSV.

The CSV comes from ``python -m benchmarks fp8_block --shapes dsv3`` run on the
GPU the table is for (the default M sweep).  For every shape and every
measured M, the family's backends are ranked by their median time:

* a backend that computed the point unpadded counts with its own time;
* a backend that needs M % 4 == 0 counts, at an M that is not a multiple of 4,
  with the time of its ``pad4_<backend>`` provider (``padded_fp8_block_mm``
  forced onto it): the padding copy is paid in the measurement, so auto never
  ranks a padded path above an unpadded one that was faster.

Rows come from the M that are multiples of 4: neighbouring M whose ranking
is the same (or whose winner is within ``--tolerance`` of the previous
winner, which keeps timing noise from splitting buckets) merge into one
``[max_m, order]`` row; the last row also covers every larger M, and an M
between two measured values uses the row of the next larger one.  A measured
M that is not a multiple of 4 gets a row of its own only where its ranking
(padding included) differs.  ``padded_fp8_block_mm`` reads the table at the
caller's M (``scaledmm.backends.select(..., table_m=M)``).

``--out`` an existing policy file (``scaledmm/tuning/<family>_<arch>.json``)
replaces the rows of the swept shapes and its ``source`` and keeps the rest
(other shapes' rows, order, switches, notes; a dsv3 sweep leaves the llama8b
rows alone); the result is validated like a shipped file.  A new file holds the
rows alone: ``scaledmm.backends.load_auto_table`` installs them in a process.
``--op-rows`` writes the rows as ``--op``'s own (``op_shapes``), e.g. from
``python -m benchmarks fp8_block_linear``: ``--op fp8_block_linear
--op-rows`` ranks ``triton`` against ``composite`` for the layer's op and
leaves the GEMM's rows as they are.  ``--variant V`` (with ``--op-rows``)
writes them as the rows of one variant of the op's problems
(``op_shapes["OP:V"]``): ``python -m benchmarks fp8`` times row-wise scales,
so its rows are ``--op fp8_scaled_mm --variant rowwise``.  ``--any-shape``
adds the rows of key ``"*"`` for the shapes a sweep lacks (a Hugging Face
Llama runs q/k/v and gate/up unfused; the model benchmark, fused): per M,
the backends ranked by the geometric mean over the swept shapes of their
time over each shape's best.

Examples
--------
>>> # on the H200 (device tool), then here:
>>> # python -m benchmarks fp8_block --shapes dsv3 --out out/sweep
>>> # python -m benchmarks.tune out/sweep/fp8_block.csv --out scaledmm/tuning/fp8_block_sm90.json

``--kernel NAME`` writes a kernel's tuned configs instead
(``scaledmm/tuning/kernels/<kernel>_<arch>.json``) from a sweep of its
configs; see ``benchmarks/tune_kernel.py``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

__all__ = ["rank_points", "any_shape_points", "build_table", "main"]

LAST_M = 2**31 - 1  # the last row of a shape covers every larger M
# Providers of our op that are not candidates: auto is what the table drives,
# reference is plain torch math (never a speed choice on a GPU).
NOT_CANDIDATES = frozenset({"auto", "reference"})


def _time(row: dict) -> float:
    if row.get("status") != "ok":
        return math.nan
    try:
        return float(row["median_us"])
    except (KeyError, ValueError):
        return math.nan


def rank_points(rows: list[dict], op: str) -> dict[tuple[int, int], dict[int, list[tuple[str, float]]]]:
    """``{(n, k): {m: [(backend, us), ...] fastest first}}`` for ``op``.

    Candidates are our providers (``kind == "ours"``) other than ``auto`` and
    ``reference``; ``pad4_<backend>`` stands in for ``<backend>`` where the
    backend itself did not run (M not a multiple of 4)."""
    times: dict[tuple[int, int, int], dict[str, float]] = defaultdict(dict)
    padded: dict[tuple[int, int, int], dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r.get("op") != op:
            continue
        key = (int(r["n"]), int(r["k"]), int(r["m"]))
        t = _time(r)
        name = r["provider"]
        if r.get("kind") == "ours" and name not in NOT_CANDIDATES:
            times[key].setdefault(name, math.nan)
            if not math.isnan(t):
                times[key][name] = t
        elif name.startswith("pad4_") and not math.isnan(t):
            padded[key][name[len("pad4_"):]] = t
    out: dict[tuple[int, int], dict[int, list[tuple[str, float]]]] = defaultdict(dict)
    for key in sorted(set(times) | set(padded)):
        n, k, m = key
        cand = {b: t for b, t in times.get(key, {}).items() if not math.isnan(t)}
        for b, t in padded.get(key, {}).items():
            cand.setdefault(b, t)
        if cand:
            out[(n, k)][m] = sorted(cand.items(), key=lambda bt: (bt[1], bt[0]))
    return dict(out)


def _merge(points: dict[int, list[tuple[str, float]]], ms: list[int], tolerance: float) -> list[list]:
    """``[max_m, order]`` rows over the measured ``ms`` (ascending), merging
    neighbours whose ranking agrees (or whose previous winner is within
    ``tolerance`` of the point's best); the last row covers every larger M."""
    rows: list[list] = []
    for m in ms:
        order = [b for b, _ in points[m]]
        best = points[m][0][1]
        if rows:
            prev = rows[-1][1]
            t_prev = dict(points[m]).get(prev[0])
            same = [b for b in prev if b in order] == order
            if same or (t_prev is not None and t_prev <= best * (1 + tolerance)):
                rows[-1][0] = m
                # Backends not seen in the previous row keep their place at the end.
                rows[-1][1] = prev + [b for b in order if b not in prev]
                continue
        rows.append([m, order])
    if rows:
        rows[-1][0] = LAST_M
    return rows


def any_shape_points(ranked: dict[tuple[int, int], dict[int, list[tuple[str, float]]]]
                     ) -> dict[int, list[tuple[str, float]]]:
    """Per M measured at every shape: the backends timed at every shape,
    ranked by the geometric mean over shapes of their time over the
    shape's best (1.0: fastest everywhere); the ``"*"`` rows' input."""
    shapes = list(ranked.values())
    out: dict[int, list[tuple[str, float]]] = {}
    for m in sorted(set.intersection(*(set(p) for p in shapes))) if shapes else ():
        per = [dict(p[m]) for p in shapes]
        common = set.intersection(*(set(d) for d in per))
        score = {b: math.exp(sum(math.log(d[b] / min(d.values())) for d in per) / len(per)) for b in common}
        if score:
            out[m] = sorted(score.items(), key=lambda bt: (bt[1], bt[0]))
    return out


def build_table(ranked: dict[tuple[int, int], dict[int, list[tuple[str, float]]]],
                tolerance: float = 0.03, align: int = 4) -> dict[str, list[list]]:
    """Per-M rankings -> ``{"NxK": [[max_m, [names]], ...]}`` rows.

    The rows come from the M that are multiples of ``align``; an M that is not
    (where the ranking carries the cost of padding) gets a row of its own when
    its winner is more than ``tolerance`` faster than the order of the row it
    falls in, so the unmeasured M around it keep the aligned ranking.  With
    no aligned M measured, all points merge alike."""
    table: dict[str, list[list]] = {}
    for (n, k), points in sorted(ranked.items()):
        aligned = [m for m in sorted(points) if m % align == 0]
        if not aligned:
            rows = _merge(points, sorted(points), tolerance)
        else:
            rows = _merge(points, aligned, tolerance)
            for u in sorted(m for m in points if m % align):
                i = next(j for j, (max_m, _) in enumerate(rows) if u <= max_m)
                lo = rows[i - 1][0] if i else 0
                order = rows[i][1]
                times = dict(points[u])
                best_name, best = points[u][0]
                t_row = next((times[b] for b in order if b in times), None)
                if t_row is not None and t_row <= best * (1 + tolerance):
                    continue
                own = [b for b, _ in points[u]] + [b for b in order if b not in times]
                rows[i:i] = ([[u - 1, order]] if u - 1 > lo else []) + [[u, own]]
        merged: list[list] = []
        for max_m, order in rows:  # neighbours that ended up with the same order
            if merged and merged[-1][1] == order:
                merged[-1][0] = max_m
            else:
                merged.append([max_m, order])
        if merged:
            table[f"{n}x{k}"] = merged
    return table


def keep_smaller_rows(old: dict[str, list], new: dict[str, list],
                      ranked: dict[tuple[int, int], dict[int, list[tuple[str, float]]]]) -> dict[str, list]:
    """``new``'s rows, each shape's preceded by its ``old`` rows that end
    below the smallest M swept for it (``"*"``: swept for any shape), so a
    sweep of large M leaves the small-M rows of the table in place.

    Examples
    --------
    >>> old = {"64x128": [[16, ["a"]], [256, ["b"]], [4096, ["b"]]]}
    >>> keep_smaller_rows(old, {"64x128": [[2147483647, ["c"]]]}, {(64, 128): {512: [], 4096: []}})
    {'64x128': [[16, ['a']], [256, ['b']], [2147483647, ['c']]]}
    """
    smallest = {f"{n}x{k}": min(points) for (n, k), points in ranked.items()}
    smallest["*"] = min(smallest.values(), default=0)
    out = {}
    for shape, rows in new.items():
        below = [r for r in old.get(shape, []) if r[0] < smallest.get(shape, 0)]
        out[shape] = below + [r for r in rows if not below or r[0] > below[-1][0]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="benchmark CSV (python -m benchmarks <family> ... writes <out>/<family>.csv)")
    p.add_argument("--op", default="fp8_block_mm", help="op whose providers are ranked (default fp8_block_mm)")
    p.add_argument("--family", default="fp8_block", help="registry family (default fp8_block)")
    p.add_argument("--arch", default="sm90", help="architecture key of the table (default sm90)")
    p.add_argument("--tolerance", type=float, default=0.03, help="relative noise margin (default 0.03)")
    p.add_argument("--source", default="", help="provenance line stored in the JSON (GPU, date, commit)")
    p.add_argument("--out", help="JSON file to write (default: stdout)")
    p.add_argument("--op-rows", action="store_true",
                   help="write the rows as --op's own (op_shapes[OP]) instead of the family's shapes")
    p.add_argument("--any-shape", action="store_true",
                   help="also write rows for every shape the sweep lacks (key '*'), ranked by the geometric "
                        "mean over the swept shapes of each backend's time over the shape's best")
    p.add_argument("--variant", help="with --op-rows: the rows of one variant of the op's problems "
                   "(op_shapes['OP:VARIANT'], e.g. --op fp8_scaled_mm --variant rowwise)")
    p.add_argument("--kernel", help="write a kernel's tuned configs instead (scaledmm/tuning/kernels/"
                   "<kernel>_<arch>.json) from a sweep of its configs: see benchmarks/tune_kernel.py")
    p.add_argument("--keep-smaller-m", action="store_true",
                   help="a swept shape keeps its rows that end below the sweep's smallest M (a large-M "
                        "sweep merged into the table)")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    source = args.source
    meta = Path(args.csv).with_name("meta.json")
    if not source and meta.exists():
        env = json.loads(meta.read_text()).get("env", {})
        source = ", ".join(f"{k}: {env[k]}" for k in ("device", "date", "torch", "triton", "commit") if k in env)
    if args.kernel:
        from benchmarks import tune_kernel

        flags = " --keep-smaller-m" if args.keep_smaller_m else ""
        line = f"python -m benchmarks.tune {Path(args.csv).name} --kernel {args.kernel}{flags}; {source}".rstrip("; ")
        return tune_kernel.main(args, rows, line)
    if args.variant and not args.op_rows:
        p.error("--variant needs --op-rows")
    key = f"{args.op}:{args.variant}" if args.variant else args.op
    ranked = rank_points(rows, args.op)
    if not ranked:
        print(f"{args.csv}: no timed {args.op} point of our backends", file=sys.stderr)
        return 1
    table = build_table(ranked, args.tolerance)
    if args.any_shape:
        if len(ranked) < 2:
            p.error(f"--any-shape needs a sweep of at least 2 shapes, {args.csv} has {len(ranked)}")
        table["*"] = build_table({(0, 0): any_shape_points(ranked)}, args.tolerance)["0x0"]
    flags = f" --op {args.op} --op-rows" if args.op_rows else ""
    flags += f" --variant {args.variant}" if args.variant else ""
    flags += " --any-shape" if args.any_shape else ""
    flags += " --keep-smaller-m" if args.keep_smaller_m else ""
    line = f"python -m benchmarks.tune {Path(args.csv).name}{flags}; {source}"
    data = {"family": args.family, "arch": args.arch, "source": line.rstrip("; ")}
    data.update({"op_shapes": {key: table}} if args.op_rows else {"shapes": table})
    if args.out and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        # The swept shapes (and "*" with --any-shape) replace their rows; other shapes keep theirs.
        if args.op_rows:
            ops = old.get("op_shapes", {})
            if args.keep_smaller_m:
                table = keep_smaller_rows(ops.get(key, {}), table, ranked)
            data = {**old, "source": data["source"], "op_shapes": {**ops, key: {**ops.get(key, {}), **table}}}
        else:
            if args.keep_smaller_m:
                table = keep_smaller_rows(old.get("shapes", {}), table, ranked)
            data = {**old, "source": data["source"], "shapes": {**old.get("shapes", {}), **table}}
        if "order" in data:  # a policy file: rows naming a backend its order lacks fail here
            from scaledmm import policy

            policy.parse(data, args.out)
    text = json.dumps(data, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        what = f"op_shapes[{key!r}]" if args.op_rows else "shapes"
        print(f"wrote {args.out}: {len(table)} shapes in {what}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
