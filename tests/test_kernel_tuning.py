"""Kernel configs as data: the files under scaledmm/tuning/kernels, their
loader (scaledmm/kernel_tuning.py) and ``python -m benchmarks.tune --kernel``."""

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from benchmarks import tune, tune_kernel
from scaledmm import kernel_tuning as KT

ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIR = ROOT / "scaledmm" / "tuning" / "kernels"


def test_chosen_configs_match_the_snapshot():
    """Every backend's chooser returns, for every shape / M / variant of the
    snapshot, the config it returned when the tables were code."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCALEDMM_")}
    out = subprocess.run([sys.executable, "-m", "benchmarks.config_snapshot"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    now = json.loads(out)
    saved = json.loads((ROOT / "tests" / "data" / "kernel_configs.json").read_text())
    assert sorted(now) == sorted(saved)
    for kernel in saved:
        diff = {c: (saved[kernel].get(c), now[kernel].get(c)) for c in set(saved[kernel]) | set(now[kernel])
                if saved[kernel].get(c) != now[kernel].get(c)}
        assert not diff, f"{kernel}: {len(diff)} cases changed, e.g. {sorted(diff.items())[:3]}"


def test_every_shipped_file_loads_and_every_kernel_has_one():
    names = sorted(p.name for p in KERNEL_DIR.glob("*.json"))
    assert names == sorted(f"{k}_sm90.json" for k in tune_kernel.KERNELS)
    for kernel, spec in tune_kernel.KERNELS.items():
        cls, _, check = spec.load()
        table = KT.load(kernel, "sm90", cls, check)
        assert table.kernel == kernel and table.match == spec.match
        assert table.shapes or table.default
        for rows in (*table.shapes.values(), table.default):
            assert all(isinstance(cfg, cls) for _, cfg in rows)


@dataclasses.dataclass(frozen=True)
class Cfg:
    tile: int = 16
    swap: bool = False
    mode: str = "a"


def _doc(**over):
    doc = {"kernel": "demo", "arch": "sm90", "match": "max_m", "config_fields": ["tile", "swap", "mode"],
           "default": [{"max_m": 8, "config": {"tile": 8, "swap": True, "mode": "b"}}],
           "rows": [{"n": 64, "k": 128, "max_m": 16, "config": {"tile": 16, "swap": False, "mode": "a"}},
                    {"n": 64, "k": 128, "max_m": KT.LAST_M, "config": {"tile": 64, "swap": False, "mode": "a"}}]}
    doc.update(over)
    return doc


def test_lookup_max_m_rows_then_default():
    t = KT.parse(_doc(), "demo_sm90.json", Cfg)
    assert [t.lookup(64, 128, m).tile for m in (1, 16, 17, 4096)] == [16, 16, 64, 64]
    assert t.lookup(32, 128, 3) == Cfg(8, True, "b")
    assert t.lookup(32, 128, 9) is None  # no row, no default row: the backend's rule


def test_lookup_bucket_matches_only_equal_keys():
    doc = _doc(match="bucket", default=None)
    doc["rows"][1]["max_m"] = 64
    t = KT.parse(doc, "demo_sm90.json", Cfg)
    assert t.lookup(64, 128, 16).tile == 16 and t.lookup(64, 128, 64).tile == 64
    assert t.lookup(64, 128, 8) is None and t.lookup(64, 128, 32) is None


def _row0(**config):
    return {"n": 64, "k": 128, "max_m": 16, "config": {"tile": 16, "swap": False, "mode": "a", **config}}


@pytest.mark.parametrize("over, field", [
    ({"rows": [_row0(tile="16")]}, "rows[0].config.tile: expected an integer"),
    ({"rows": [_row0(swap=1)]}, "rows[0].config.swap: expected true or false"),
    ({"rows": [_row0(mode=3)]}, "rows[0].config.mode: expected a string"),
    ({"rows": [{"n": 64, "k": 128, "max_m": 16, "config": {"tile": 16}}]}, "rows[0].config: expected exactly"),
    ({"rows": [_row0(), _row0()]}, "rows[1].max_m: expected more than the previous"),
    ({"rows": [{**_row0(), "max_m": 0}]}, "rows[0].max_m: expected a positive integer"),
    ({"rows": [{**_row0(), "extra": 1}]}, "rows[0]: expected an object with keys"),
    ({"match": "nearest"}, "match: expected one of"),
    ({"config_fields": ["tile", "depth"]}, "config_fields: expected distinct fields of Cfg"),
    ({"kernel": "other"}, "kernel: expected 'demo'"),
    ({"arch": "sm80"}, "arch: expected 'sm90'"),
    ({"default": [{"max_m": 8, "config": {"tile": 8, "swap": True}}]}, "default[0].config: expected exactly"),
    ({"speed": 1}, "keys: expected only"),
])
def test_malformed_files_name_the_file_and_field(over, field):
    with pytest.raises(KT.TuningError) as err:
        KT.parse(_doc(**over), "demo_sm90.json", Cfg, "demo", "sm90")
    assert str(err.value).startswith("demo_sm90.json: ") and field in str(err.value), str(err.value)


def test_invalid_config_fails_at_load(tmp_path):
    from scaledmm.ops import fp8_block_cutlass as C

    doc = json.loads((KERNEL_DIR / "fp8_block_cutlass_sm90.json").read_text())
    doc["default"][0]["config"]["tile_n"] = 256  # too many accumulator registers
    (tmp_path / "fp8_block_cutlass_sm90.json").write_text(json.dumps(doc))
    with pytest.raises(KT.TuningError, match=r"fp8_block_cutlass_sm90.json: default\[0\].config: expected a valid "
                                             r"CutlassConfig \(accumulators"):
        KT.load("fp8_block_cutlass", "sm90", C.CutlassConfig, C.config_valid, folder=tmp_path)
    with pytest.raises(KT.TuningError, match="nothing_sm90.json: file"):
        KT.load("nothing", "sm90", C.CutlassConfig, folder=tmp_path)


def _sweep_from_file(kernel: str, slower: float = 1.5) -> tuple[list[dict], dict]:
    """A sweep in which each shipped row's config is the fastest of two at
    one M of its bucket (the other: the same config with one field changed)."""
    spec = tune_kernel.KERNELS[kernel]
    cls, bucket, _ = spec.load()
    doc = json.loads((KERNEL_DIR / f"{kernel}_sm90.json").read_text())
    rows = []
    for i, r in enumerate(doc["rows"]):
        m = r["max_m"] if r["max_m"] < 4096 else 4096
        assert bucket(m) == r["max_m"]
        alt = dict(r["config"])
        name = next(f for f in doc["config_fields"] if isinstance(alt[f], int) and not isinstance(alt[f], bool))
        alt[name] += 1
        for cfg, us in ((r["config"], 10.0 + i), (alt, (10.0 + i) * slower)):
            for rep in range(2):  # two timings of one config: their median counts
                rows.append({"n": r["n"], "k": r["k"], "m": m, "median_us": us + rep * 0.01, "status": "ok",
                             **{f: str(v) for f, v in cfg.items()}})
    rows.append({**rows[0], "median_us": "1.0", "status": "error"})  # a failed point never wins
    return rows, doc


@pytest.mark.parametrize("kernel", ["nvfp4_gemv", "nvfp4_mid_w4a16", "fp8_block_triton", "skinny_fused_a_tma"])
def test_tune_kernel_reproduces_a_shipped_file(kernel, tmp_path):
    rows, doc = _sweep_from_file(kernel)
    path = tmp_path / "sweep.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / f"{kernel}_sm90.json"
    out.write_text(json.dumps({**doc, "rows": doc["rows"][:1]}))  # an existing file: notes and default stay
    assert tune.main([str(path), "--kernel", kernel, "--out", str(out), "--source", "H200 test"]) == 0
    new = json.loads(out.read_text())
    strip = [(r["n"], r["k"], r["max_m"], r["config"]) for r in doc["rows"]]
    assert sorted(strip) == sorted((r["n"], r["k"], r["max_m"], r["config"]) for r in new["rows"])
    assert new["notes"] == doc["notes"] and new["default"] == doc["default"]
    assert new["source"] == f"python -m benchmarks.tune sweep.csv --kernel {kernel}; H200 test"
    cls, _, check = tune_kernel.KERNELS[kernel].load()
    assert KT.load(kernel, "sm90", cls, check, folder=tmp_path).by_shape() == \
        KT.load(kernel, "sm90", cls, check).by_shape()


def test_tune_kernel_keeps_a_gained_field_apart(tmp_path):
    """A file written before its config class gained a field (fp8_wgmma's
    producer_wg): the sweep's column keeps two configs that differ only there
    apart, the winner's value is written, and the kept rows take the default."""
    from scaledmm.ops import fp8_wgmma as fw

    old_fields = ["tile_m", "warpgroups", "stages", "split_k", "chain"]
    kept = {"n": 4096, "k": 4096, "max_m": tune_kernel.LAST_M, "config": dict(zip(old_fields, (64, 1, 6, 2, 4))), "us": 9.0}
    old = {"kernel": "fp8_wgmma_block", "arch": "sm90", "match": "max_m", "config_fields": old_fields,
           "source": "old", "default": None, "rows": [kept]}
    rows = []
    for m, pwg_us, plain_us in ((16, 30.0, 20.0), (4096, 700.0, 900.0)):
        for pwg, us in ((1, pwg_us), (0, plain_us)):
            cfg = {"tile_m": 128, "warpgroups": 2, "stages": 4, "split_k": 1, "chain": 4, "producer_wg": pwg}
            rows.append({"n": "7168", "k": "16384", "m": str(m), "median_us": str(us), "status": "ok",
                         **{f: str(v) for f, v in cfg.items()}})
    doc = tune_kernel.tune(rows, "fp8_wgmma_block", "sm90", "test", old)
    assert doc["config_fields"] == old_fields + ["producer_wg"]
    assert doc["rows"][0]["config"] == {**kept["config"], "producer_wg": 0}
    new = [(r["max_m"], r["config"]["producer_wg"]) for r in doc["rows"] if r["n"] == 7168]
    assert new == [(16, 0), (tune_kernel.LAST_M, 1)]
    table = KT.parse(doc, "fp8_wgmma_block_sm90.json", fw.WgmmaConfig, "fp8_wgmma_block", "sm90")
    assert table.lookup(7168, 16384, 4096) == fw.WgmmaConfig(128, 2, 4, 1, 4, 1)
    assert table.lookup(4096, 4096, 1) == fw.WgmmaConfig(64, 1, 6, 2, 4)


def test_tune_kernel_keep_smaller_m_merges_a_large_m_sweep(tmp_path):
    """--keep-smaller-m: a sweep of M >= 256 keeps the shape's rows that end
    below 256 and replaces the rest; without it the shape's rows go."""
    from scaledmm.ops import fp8_wgmma as fw

    fields = ["tile_m", "warpgroups", "stages", "split_k", "chain", "producer_wg"]
    old_rows = [{"n": 7168, "k": 16384, "max_m": mm, "config": dict(zip(fields, cfg)), "us": 1.0}
                for mm, cfg in ((16, (16, 1, 8, 2, 4, 0)), (128, (64, 1, 6, 1, 4, 0)),
                                (tune_kernel.LAST_M, (64, 2, 6, 1, 4, 0)))]
    old = {"kernel": "fp8_wgmma_block", "arch": "sm90", "match": "max_m", "config_fields": fields,
           "source": "old", "default": None, "rows": old_rows}
    rows = [{"n": "7168", "k": "16384", "m": str(m), "median_us": str(us), "status": "ok",
             **dict(zip(fields, map(str, (128, 2, 4, 1, 4, 1))))} for m, us in ((256, 60.0), (4096, 800.0))]
    sweep, out = tmp_path / "sweep.csv", tmp_path / "fp8_wgmma_block_sm90.json"
    with open(sweep, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out.write_text(json.dumps(old))
    assert tune.main([str(sweep), "--kernel", "fp8_wgmma_block", "--out", str(out), "--keep-smaller-m",
                      "--source", "test"]) == 0
    doc = json.loads(out.read_text())
    assert [r["max_m"] for r in doc["rows"]] == [16, 128, tune_kernel.LAST_M]
    assert "--keep-smaller-m" in doc["source"]
    table = KT.parse(doc, "fp8_wgmma_block_sm90.json", fw.WgmmaConfig, "fp8_wgmma_block", "sm90")
    assert table.lookup(7168, 16384, 100) == fw.WgmmaConfig(64, 1, 6, 1, 4)
    assert table.lookup(7168, 16384, 200) == table.lookup(7168, 16384, 4096) == fw.WgmmaConfig(128, 2, 4, 1, 4, 1)
    replaced = tune_kernel.tune(rows, "fp8_wgmma_block", "sm90", "test", old)
    assert [r["max_m"] for r in replaced["rows"]] == [tune_kernel.LAST_M]


def test_tune_kernel_unknown_kernel_and_missing_columns():
    with pytest.raises(ValueError, match="--kernel: expected one of"):
        tune_kernel.tune([], "nope", "sm90", "")
    with pytest.raises(ValueError, match=r"missing \['median_us'"):
        tune_kernel.tune([{"n": "1", "k": "1", "m": "1"}], "nvfp4_gemv", "sm90", "")


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_max_m_rows_pick_the_fastest_config_at_every_measured_m(data):
    """build_rows (match "max_m") + lookup: each measured M gets its winner;
    any larger M the last winner."""
    ms = sorted(data.draw(st.sets(st.integers(1, 5000), min_size=1, max_size=8)))
    tiles = (16, 32, 64)
    rows = []
    for m in ms:
        for tile in tiles:
            rows.append({"n": "64", "k": "128", "m": str(m), "tile": str(tile), "swap": "False", "mode": "a",
                         "median_us": str(data.draw(st.floats(1, 100)))})
    best = tune_kernel.best_configs(rows, Cfg, ["tile", "swap", "mode"], None)
    doc = _doc(rows=tune_kernel.build_rows(best, "max_m"), default=None)
    table = KT.parse(doc, "demo_sm90.json", Cfg)
    for m in ms:
        times = {int(r["tile"]): float(r["median_us"]) for r in rows if int(r["m"]) == m}
        fastest = min(times.values())
        assert times[table.lookup(64, 128, m).tile] == fastest, (m, times)
    assert table.lookup(64, 128, 10**6) == table.lookup(64, 128, ms[-1])
