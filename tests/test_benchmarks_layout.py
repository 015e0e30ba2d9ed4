"""The layout of ``benchmarks/``: the CLI core, ``experiments/`` (each one
module that runs on its own and has a README line), no raw device logs in the
tree, and every stage of ``benchmarks/device_all.sh`` naming a module that
exists.  Structure only: nothing here needs a GPU."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
EXPERIMENTS = sorted(p.stem for p in (BENCH / "experiments").glob("*.py") if p.stem != "__init__")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names += [f"{base}.{a.name}" if base else a.name for a in node.names]
            if node.level:  # relative: resolve against the file's package
                pkg = ".".join(path.relative_to(REPO).with_suffix("").parts[:-node.level])
                names[-len(node.names):] = [f"{pkg}.{n}" for n in names[-len(node.names):]]
    return names


def test_experiments_are_listed_in_their_readme():
    readme = (BENCH / "experiments" / "README.md").read_text()
    listed = re.findall(r"^- `(\w+)\.py`: \S", readme, re.M)
    assert sorted(listed) == EXPERIMENTS, "one README line per module, and no line without its module"


@pytest.mark.parametrize("path", sorted(BENCH.rglob("*.py")), ids=lambda p: str(p.relative_to(BENCH)))
def test_no_path_hacks_and_no_experiment_imports_another(path):
    src = path.read_text()
    assert "sys.path.insert" not in src and "sys.path.append" not in src
    mods = _imports(path)
    assert not any(m.startswith("benchmarks.device_") for m in mods), mods
    if path.parent.name == "experiments":
        assert not [m for m in mods if m.startswith("benchmarks.experiments")], mods


def test_device_all_stages_name_existing_modules():
    script = (BENCH / "device_all.sh").read_text()
    mods = set(re.findall(r'python3 -m "?([\w.$]+)', script)) - {"pip", "pytest"}
    assert {"benchmarks", "benchmarks.tune", "benchmarks.experiments.$stage"} <= mods, mods
    for mod in mods:
        names = [mod.replace("$stage", e) for e in EXPERIMENTS] if "$stage" in mod else [mod]
        for name in names:
            assert importlib.util.find_spec(name) is not None, name
    assert not re.search(r"benchmarks/device_(?!all\.sh)", script), "a stage names a removed device_ script"
    # the stage names the docs use resolve to an experiment module
    docs = (BENCH / "README.md").read_text() + (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for cmd in re.findall(r"bash benchmarks/device_all\.sh ([^`\n]+(?:\n  [^`\n]+)*)", docs):
        for stage in re.findall(r'"[^"]*"|\S+', cmd):
            if stage.startswith('"') or ":" in stage or stage in ("tests", "sanitize", "tune", "..."):
                continue
            assert stage in EXPERIMENTS, stage


def test_raw_device_logs_stay_out_of_the_tree():
    assert not (BENCH / "device_results").exists() or "benchmarks/device_results/" in (
        REPO / ".gitignore").read_text().splitlines()
    assert "benchmarks/device_results/" in (REPO / ".gitignore").read_text().splitlines()
    assert not list(BENCH.glob("*.log")) and not list(BENCH.glob("device_*.py"))
    data = list((BENCH / "data").glob("*"))
    assert sum(p.stat().st_size for p in data) < 250_000
    cited = (BENCH / "RESULTS.md").read_text() + (BENCH / "NOTES.md").read_text()
    for p in data:  # only what the results cite is kept
        assert f"benchmarks/data/{p.name}" in cited, p.name


def test_sanitize_is_a_cli_stage():
    from benchmarks import __main__ as cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["sanitize", "--list", "--only", "skinny*"])
    lines = buf.getvalue().splitlines()
    assert rc == 0 and [ln.split()[0] for ln in lines[:-1]] == ["skinny_v1", "skinny_v2"]
    assert lines[-1] == "6 jobs"  # memcheck, racecheck, synccheck each
