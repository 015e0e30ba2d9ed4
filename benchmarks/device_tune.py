"""Device step of the auto-table regeneration (issue 5, item 6).

Run by ``benchmarks/device_all.sh`` right after a sweep stage
``bench:fp8_block --shapes dsv3 --providers ...`` (which leaves
``$OUT/bench/fp8_block.csv``): keeps that CSV as ``$OUT/sweep_fp8_block.csv``,
writes ``scaledmm/tuning/fp8_block_sm90.json`` from it (so that a following
``bench:fp8_block ... --write-results`` stage measures ``auto`` with the new
table) and a copy of the JSON to ``$OUT``.  Bring the JSON back into the repo
and commit it with the RESULTS.md of the same run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "scaledmm" / "tuning" / "fp8_block_sm90.json"


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/scaledmm-out"))
    csv = out / "bench" / "fp8_block.csv"
    if not csv.exists():
        print(f"{csv}: missing (run the sweep stage first)")
        return 1
    kept = out / "sweep_fp8_block.csv"
    shutil.copyfile(csv, kept)
    shutil.copyfile(out / "bench" / "meta.json", out / "sweep_meta.json")
    shutil.copyfile(out / "bench" / "meta.json", kept.with_name("meta.json"))
    rc = subprocess.call([sys.executable, "-m", "benchmarks.tune", str(kept), "--out", str(TABLE)], cwd=ROOT)
    if rc == 0:
        shutil.copyfile(TABLE, out / TABLE.name)
        print(TABLE.read_text())
    return rc


if __name__ == "__main__":
    sys.exit(main())
