"""The benchmark CLI (``python -m benchmarks``) on the CPU: shape parsing, the
CSV and markdown it writes, the correctness gate (a planted wrong backend is
reported and not timed), RESULTS.md sections, skipped families, metrics."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from scaledmm import backends

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import __main__ as cli  # noqa: E402
from benchmarks import harness, report, shapes, timing  # noqa: E402
from benchmarks.machine import Ceilings  # noqa: E402

TINY = ["--shapes", "256x256,128x384", "--m", "1,3", "--quick", "--no-plots", "--device", "cpu"]


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------


def test_shape_sets_parse_to_the_issue_lists():
    assert [s.label for s in shapes.parse_shapes("dsv3")] == [
        "2112x7168", "24576x1536", "32768x512", "7168x16384", "4096x7168", "7168x2048", "576x7168"]
    assert [s.label for s in shapes.parse_shapes("llama8b")] == [
        "6144x4096", "4096x4096", "28672x4096", "4096x14336"]
    # fused_a is written K -> N: 7168 -> 2112 is N=2112, K=7168
    assert [(s.n, s.k) for s in shapes.parse_shapes("fused_a")] == [
        (2112, 7168), (1536, 7168), (576, 7168), (256, 7168), (24576, 1536)]


def test_shapes_mix_sets_and_items_without_duplicates():
    got = shapes.parse_shapes(" 4096x7168 , 7168->2112,dsv3")
    assert got[:2] == [shapes.Shape(4096, 7168), shapes.Shape(2112, 7168)]
    assert len(got) == 7  # both items are also in dsv3
    assert shapes.parse_ms("1, 4,16,4,0") == [1, 4, 16, 0]


@pytest.mark.parametrize("spec", ["4096x", "x7168", "4096*7168", "nosuchset", "0x128", ",", "7168->"])
def test_bad_shapes_name_the_option(spec):
    with pytest.raises(ValueError, match="--shapes"):
        shapes.parse_shapes(spec)


@pytest.mark.parametrize("spec", ["1,a", "-1", "1.5", ","])
def test_bad_ms_name_the_option(spec):
    with pytest.raises(ValueError, match="--m"):
        shapes.parse_ms(spec)


@given(st.lists(st.tuples(st.integers(1, 1 << 16), st.integers(1, 1 << 16)), min_size=1, max_size=6),
       st.lists(st.booleans(), min_size=6, max_size=6))
def test_shape_items_round_trip(pairs, arrows):
    items = [f"{k}->{n}" if arrow else f"{n}x{k}" for (n, k), arrow in zip(pairs, arrows)]
    want = list(dict.fromkeys(shapes.Shape(n, k) for n, k in pairs))
    assert shapes.parse_shapes(",".join(items)) == want


# ----------------------------------------------------------------------------
# Method pieces
# ----------------------------------------------------------------------------


@given(st.integers(1, 1 << 32), st.integers(0, 1 << 30))
def test_rotation_copies_exceed_the_target(set_bytes, target):
    cfg = timing.TimingConfig(0.1, 0.0, 3, 10, 100.0, target, 128)
    c = timing.copies_for(set_bytes, cfg)
    assert 1 <= c <= 128
    if target and c < 128:
        assert c >= 2 and c * set_bytes >= target


def test_wall_clock_statistics_are_ordered():
    cfg = timing.TimingConfig.for_device(torch.device("cpu"), quick=True)
    x = torch.randn(64, 64)
    t = timing.measure([lambda: x @ x, lambda: x @ x.t()], torch.device("cpu"), cfg)
    assert t.mode == "wall" and cfg.min_reps <= t.reps <= cfg.max_reps
    assert 0 < t.p20_us <= t.median_us <= t.p80_us


def test_metrics_against_ceilings():
    ceil = Ceilings(copy_gbps=1000.0, tflops={"fp8": 1000.0}, gemm_size=8192, copy_bytes=1 << 30)
    r = harness.Result("f", "op", shapes.Shape(8, 8), 8, "auto", harness.OURS, "fp8", "ok",
                       timing=timing.Timing(10_000.0, 9_000.0, 11_000.0, 10, "events"),
                       flops=2e12, nbytes=int(1e9))
    m = report.metrics(r, ceil)
    assert math.isclose(m["tflops"], 200.0) and math.isclose(m["gbps"], 100.0)
    assert math.isclose(m["pct_compute"], 20.0) and math.isclose(m["pct_bandwidth"], 10.0)
    assert math.isclose(m["floor_us"], 2000.0) and math.isclose(m["pct_roofline"], 20.0)
    assert report.metrics(harness.Result("f", "op", shapes.Shape(8, 8), 8, "x", harness.OURS, None, "wrong"),
                          ceil) == {}


def test_mismatch_fraction_accepts_any_candidate():
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    alt = torch.tensor([1.0, 2.5, 3.0, 4.0], dtype=torch.float64)
    got = torch.tensor([1.0, 2.5, 3.0, 5.0])
    assert harness.mismatch_fraction(got, (ref, alt)) == pytest.approx(0.25)
    assert harness.mismatch_fraction(got, ref) == pytest.approx(0.5)
    assert harness.mismatch_fraction(torch.full((4,), float("nan")), ref) == 1.0


def test_results_file_keeps_other_sections(tmp_path):
    path = tmp_path / "RESULTS.md"
    report.update_results_file(path, "fp8", "## fp8\nold fp8")
    report.update_results_file(path, "quant", "## quant\nquant body")
    report.update_results_file(path, "fp8", "## fp8\nnew fp8")
    text = path.read_text()
    assert "new fp8" in text and "old fp8" not in text and "quant body" in text
    assert text.count("<!-- BEGIN fp8 -->") == 1 and text.index("BEGIN fp8") < text.index("BEGIN quant")


# ----------------------------------------------------------------------------
# The CLI
# ----------------------------------------------------------------------------


def test_cli_writes_csv_and_markdown(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "fp8_block", *TINY, "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for key in ("- device:", "- torch:", "- triton:", "- cuda-python:", "- commit:", "- ceilings:"):
        assert key in out
    assert "### fp8_block_mm, N x K = 256 x 256" in out and "### fp8_block_mm, N x K = 128 x 384" in out
    assert "| M | auto | reference |" in out and "auto vs bf16_linear" in out
    assert (tmp_path / "fp8_block.md").read_text().strip() in out
    rows = _rows(tmp_path / "fp8_block.csv")
    with open(tmp_path / "fp8_block.csv") as f:
        columns = next(csv.reader(f))
    bases = ["pad4", "scaled_mm_blockwise", "bf16_linear", "scaled_mm_tensor", "scaled_mm_rowwise"]
    assert columns == report.FIELDS + [f"vs_{b}" for b in bases]
    provs = {r["provider"] for r in rows}
    assert {"auto", "reference", *bases} <= provs
    assert len(rows) == 2 * 2 * len(provs)  # shapes x M x providers
    for r in rows:
        if r["provider"] in ("auto", "reference", "bf16_linear", "pad4"):
            assert r["status"] == "ok", r
            assert float(r["error"]) < 1e-2
            assert 0 < float(r["p20_us"]) <= float(r["median_us"]) <= float(r["p80_us"])
            assert float(r["gbps"]) > 0 and float(r["tflops"]) > 0 and r["mode"] == "wall"
            assert float(r["vs_bf16_linear"]) > 0
        if r["provider"] == "bf16_linear":
            assert float(r["vs_bf16_linear"]) == 1.0 and r["backend"] == ""
        if r["provider"] in ("auto", "reference", "pad4"):
            assert r["backend"] == "reference"  # what the registry selected on the CPU


def _broken_mm(a, b, a_scales, b_scales, block_size, out_dtype):
    from scaledmm.ops.fp8_block import reference_mm

    return (reference_mm(a, b, a_scales, b_scales, block_size, torch.float32) * 1.5).to(out_dtype)


def _nan_mm(a, b, a_scales, b_scales, block_size, out_dtype):
    return torch.full((a.shape[0], b.shape[0]), float("nan"), dtype=out_dtype, device=a.device)


def test_wrong_backend_is_reported_not_timed(tmp_path, capsys):
    planted = {"broken_scale_test": _broken_mm, "broken_nan_test": _nan_mm}
    for name, fn in planted.items():
        backends.register(backends.Backend(backends.Family.FP8_BLOCK, name, impls={"fp8_block_mm": fn}))
    try:
        rc = cli.main(["fp8_block", *TINY, "--out", str(tmp_path),
                       "--providers", "auto,reference,broken_scale_test,broken_nan_test,bf16_linear"])
    finally:
        for name in planted:
            backends.unregister("fp8_block", name)
    assert rc == 0
    assert not any(n in backends.names("fp8_block") for n in planted)
    out = capsys.readouterr().out
    rows = _rows(tmp_path / "fp8_block.csv")
    assert {r["provider"] for r in rows} == {"auto", "reference", "broken_scale_test", "broken_nan_test",
                                             "bf16_linear"}
    for r in rows:
        if r["provider"] in planted:
            assert r["status"] == "wrong" and r["median_us"] == "" and r["reps"] == "", r
            assert r["backend"] == r["provider"]
            if r["provider"] == "broken_scale_test":
                assert float(r["error"]) > 0.3
            else:
                assert "non-finite" in r["note"]
        else:
            assert r["status"] == "ok" and float(r["median_us"]) > 0
    assert "WRONG" in out and "broken_scale_test: WRONG (caught by the correctness check, not timed)" in out
    assert "broken_scale_test:wrong" in out  # in the summary too


def test_write_results_replaces_only_its_section(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n<!-- BEGIN skinny -->\nkeep me\n<!-- END skinny -->\n")
    args = ["quant", "--shapes", "128x256", "--m", "2", "--quick", "--no-plots", "--device", "cpu",
            "--out", str(tmp_path / "out"), "--write-results", "--results-file", str(results)]
    assert cli.main(args) == 0
    assert cli.main(args) == 0
    text = results.read_text()
    assert "keep me" in text and text.count("<!-- BEGIN quant -->") == 1
    assert (tmp_path / "out" / "RESULTS.md").read_text() == text
    assert "### per_token_group_quant_fp8, [M, 256]" in text and "- commit:" in text
    rows = _rows(tmp_path / "out" / "quant.csv")
    assert {r["op"] for r in rows} == {"per_token_group_quant_fp8", "quant_fp8", "nvfp4_quant"}
    assert all(r["status"] == "ok" and r["n"] == "0" for r in rows), rows


def test_family_without_its_op_is_skipped(tmp_path, capsys, monkeypatch):
    import benchmarks.fp8 as fam

    real = fam.benches()[0]
    missing = harness.OpBench(**{**real.__dict__, "op": "no_such_op_yet"})
    monkeypatch.setattr(fam, "benches", lambda: [missing])
    assert cli.main(["fp8", *TINY, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no_such_op_yet: SKIPPED: torch.ops.scaledmm.no_such_op_yet is not defined" in out
    assert not (tmp_path / "fp8.csv").exists()


def test_providers_come_from_the_registry():
    import benchmarks.fp8_block as fam

    bench = fam.benches()[0]
    backends.register(backends.Backend(backends.Family.FP8_BLOCK, "new_test", impls={"fp8_block_mm": _nan_mm}))
    try:
        provs, left_out = harness.providers(bench, torch.device("cpu"))
        want = {n for n in backends.names("fp8_block") if "fp8_block_mm" in backends.get("fp8_block", n).impls}
    finally:
        backends.unregister("fp8_block", "new_test")
    names = [p.name for p in provs]
    assert names[0] == "auto" and "new_test" in names and "reference" in names
    ours = {p.name for p in provs if p.kind == harness.OURS}
    skipped = {line.split(":")[0] for line in left_out}
    assert ours | skipped == {"auto"} | want and not ours & skipped
    assert "cublas" in skipped  # no CUDA here


def test_every_family_runs_and_its_reference_passes_the_gate(tmp_path, capsys):
    assert cli.main(["all", "--shapes", "128x256", "--m", "1,3", "--quick", "--no-plots", "--device", "cpu",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "## summary: auto vs baselines" in out
    seen = set()
    for fam in ("fp8_block", "fp8_block_linear", "fp8", "fp8_tensorwise", "nvfp4", "skinny", "quant"):
        path = tmp_path / f"{fam}.csv"
        if not path.exists():  # op not written yet: skipped with a message
            assert f"## {fam}" in out and "SKIPPED" in (tmp_path / f"{fam}.md").read_text()
            continue
        for r in _rows(path):
            seen.add(r["op"])
            assert r["status"] in ("ok", "n/a"), r
            if r["provider"] in ("auto", "reference"):
                assert r["status"] == "ok" and float(r["median_us"]) > 0, r
    assert {"fp8_block_mm", "fp8_block_linear", "per_token_group_quant_fp8"} <= seen


# ----------------------------------------------------------------------------
# benchmarks.tune: the auto-table generator
# ----------------------------------------------------------------------------


def _tune_rows(points):
    """CSV-like rows from ``{(m, provider): us}`` (nan: status n/a)."""
    rows = []
    for (m, prov), us in points.items():
        kind = "baseline" if prov.startswith("pad4") or prov == "bf16_linear" else "ours"
        rows.append({"op": "fp8_block_mm", "n": "2112", "k": "7168", "m": str(m), "provider": prov,
                     "kind": kind, "status": "n/a" if math.isnan(us) else "ok",
                     "median_us": "" if math.isnan(us) else str(us)})
    return rows


def test_tune_ranks_padded_backends_by_their_padded_time():
    from benchmarks import tune

    nan = math.nan
    rows = _tune_rows({
        (3, "triton"): 10.0, (3, "cublas"): nan, (3, "pad4_cublas"): 12.0, (3, "auto"): 1.0,
        (3, "bf16_linear"): 2.0, (3, "reference"): 0.5,
        (1023, "triton"): 60.0, (1023, "cublas"): nan, (1023, "pad4_cublas"): 41.0,
        (1024, "triton"): 58.0, (1024, "cublas"): 40.0, (1024, "pad4_cublas"): 40.5,
    })
    ranked = tune.rank_points(rows, "fp8_block_mm")
    assert ranked[(2112, 7168)][3] == [("triton", 10.0), ("cublas", 12.0)]  # auto/reference/baselines excluded
    assert ranked[(2112, 7168)][1023] == [("cublas", 41.0), ("triton", 60.0)]  # the pad is paid
    assert ranked[(2112, 7168)][1024] == [("cublas", 40.0), ("triton", 58.0)]  # own time, not pad4's


def test_tune_merges_buckets_and_covers_larger_m(tmp_path):
    from benchmarks import tune

    pts = {}
    for m, (t, c) in {1: (9, 20), 2: (9, 20), 4: (10, 15), 16: (11, 15.2), 64: (20, 19.8),
                      128: (30, 22), 4096: (170, 110)}.items():
        pts[(m, "triton")], pts[(m, "cublas")] = t, c
    table = tune.build_table(tune.rank_points(_tune_rows(pts), "fp8_block_mm"), tolerance=0.03)
    # 64: cublas 19.8 vs triton 20.0 is within 3%: the triton-first bucket goes on.
    assert table == {"2112x7168": [[64, ["triton", "cublas"]], [tune.LAST_M, ["cublas", "triton"]]]}
    # The registry reads what the generator writes, and orders by it.
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"family": "fp8_block", "arch": "sm00", "shapes": table}))
    with backends.policy_snapshot():
        backends.load_auto_table("fp8_block", path)
        rows = backends.policy("fp8_block", "sm00").shapes[(2112, 7168)]
        assert rows[0] == (64, ("triton", "cublas")) and rows[-1][0] == tune.LAST_M


def test_tune_cli_writes_json(tmp_path):
    from benchmarks import tune

    path = tmp_path / "fp8_block.csv"
    rows = _tune_rows({(1, "triton"): 9.0, (1, "cublas"): math.nan, (1, "pad4_cublas"): 20.0})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "table.json"
    assert tune.main([str(path), "--out", str(out), "--source", "unit test"]) == 0
    data = json.loads(out.read_text())
    assert data["arch"] == "sm90" and data["shapes"] == {"2112x7168": [[tune.LAST_M, ["triton", "cublas"]]]}
    assert "unit test" in data["source"]
    empty = tmp_path / "empty.csv"
    empty.write_text("op,n,k,m,provider,kind,status,median_us\n")
    assert tune.main([str(empty)]) == 1


def test_tune_op_rows_go_to_op_shapes_and_keep_the_family_rows(tmp_path):
    from benchmarks import tune

    path = tmp_path / "fp8_block_linear.csv"
    rows = [{"op": "fp8_block_linear", "n": "2112", "k": "7168", "m": str(m), "provider": prov, "kind": "ours",
             "status": "ok", "median_us": str(us)}
            for m, prov, us in ((16, "triton", 10.0), (16, "composite", 12.0),
                                (512, "triton", 90.0), (512, "composite", 60.0), (512, "auto", 1.0))]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "fp8_block_sm90.json"
    shipped = {"family": "fp8_block", "arch": "sm90", "order": ["cublas", "triton", "composite", "reference"],
               "shapes": {"2112x7168": [[tune.LAST_M, ["cublas", "triton"]]]}}
    out.write_text(json.dumps(shipped))
    assert tune.main([str(path), "--op", "fp8_block_linear", "--op-rows", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["shapes"] == shipped["shapes"] and data["order"] == shipped["order"]
    assert data["op_shapes"] == {"fp8_block_linear": {"2112x7168": [[16, ["triton", "composite"]],
                                                                    [tune.LAST_M, ["composite", "triton"]]]}}
    assert "--op fp8_block_linear --op-rows" in data["source"]


@pytest.mark.parametrize("op_rows", [True, False])
def test_tune_keep_smaller_m_merges_a_large_m_sweep(tmp_path, op_rows):
    """--keep-smaller-m: a sweep of M >= 512 replaces the swept shape's rows
    from there on and keeps those ending below 512, for the shape and for
    '*' (--any-shape); a shape the sweep lacks keeps all.  The op's own rows
    (--op-rows) or the family's."""
    from benchmarks import tune

    path = tmp_path / "fp8_block.csv"
    rows = [{"op": "fp8_block_mm", "n": str(n), "k": str(k), "m": str(m), "provider": prov, "kind": "ours",
             "status": "ok", "median_us": str(us)}
            for n, k in ((2112, 7168), (7168, 2048))
            for m, prov, us in ((512, "cuda_wgmma", 50.0), (512, "cublas", 60.0),
                                (4096, "cuda_wgmma", 400.0), (4096, "cublas", 300.0))]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "fp8_block_sm90.json"
    small = [[16, ["cuda_wgmma", "cublas"]], [256, ["triton", "cublas"]], [1024, ["triton", "cublas"]],
             [tune.LAST_M, ["cublas", "triton"]]]
    shipped = {"family": "fp8_block", "arch": "sm90", "order": ["cuda_wgmma", "cublas", "triton", "reference"],
               "shapes": {"2112x7168": small, "*": small, "576x7168": small}}
    if op_rows:
        shipped["op_shapes"] = {"fp8_block_mm": shipped.pop("shapes")}
    out.write_text(json.dumps(shipped))
    flags = ["--op-rows"] if op_rows else []
    assert tune.main([str(path), *flags, "--any-shape", "--keep-smaller-m", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    data = doc["op_shapes"]["fp8_block_mm"] if op_rows else doc["shapes"]
    merged = small[:2] + [[512, ["cuda_wgmma", "cublas"]], [tune.LAST_M, ["cublas", "cuda_wgmma"]]]
    assert data["2112x7168"] == data["*"] == merged
    assert data["7168x2048"] == merged[2:] and data["576x7168"] == small
    assert "--keep-smaller-m" in doc["source"]


def test_tune_unaligned_points_get_their_own_rows_only_where_they_differ():
    from benchmarks import tune

    pts = {}
    # aligned: cublas wins from 1024 on; 4095: padding cublas costs more than triton unpadded;
    # 1023: padding is cheap, the aligned order holds.
    for m, (t, c, pc) in {256: (20, 25, None), 1023: (60, None, 41), 1024: (58, 40, None),
                          4095: (150, None, 160), 4096: (148, 110, None)}.items():
        pts[(m, "triton")] = t
        pts[(m, "cublas")] = math.nan if c is None else c
        if pc is not None:
            pts[(m, "pad4_cublas")] = pc
    table = tune.build_table(tune.rank_points(_tune_rows(pts), "fp8_block_mm"), tolerance=0.03)
    assert table == {"2112x7168": [[256, ["triton", "cublas"]], [4094, ["cublas", "triton"]],
                                   [4095, ["triton", "cublas"]], [tune.LAST_M, ["cublas", "triton"]]]}


def test_sustain_sets_the_warm_up_and_the_report_says_so(tmp_path, capsys, monkeypatch):
    import benchmarks.harness as h

    seen = []
    real = h.run_bench

    def spy(bench, shapes, ms, provs, device, cfg, *a, **kw):
        seen.append(cfg.warmup_s)
        return real(bench, shapes, ms, provs, device, cfg, *a, **kw)

    monkeypatch.setattr(cli, "run_bench", spy)
    assert cli.main(["fp8", *TINY, "--sustain", "0.25", "--out", str(tmp_path)]) == 0
    assert seen and set(seen) == {0.25}
    assert "0.25 s of continuous calls before each timed point" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["fp8", *TINY, "--sustain", "-1", "--out", str(tmp_path)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sustained_timing_notes_the_clocks():
    """A warm-up of a second or more reads the SM clock around the timed reps
    (into the note, where the driver answers); a short one leaves the note alone."""
    from benchmarks import timing

    dev = torch.device("cuda")
    x = torch.randn(1024, 1024, device=dev)
    cfg = timing.TimingConfig.for_device(dev, quick=True)
    short = timing.measure([lambda: x @ x], dev, dataclasses.replace(cfg, warmup_s=0.0))
    assert "SM clock" not in short.note
    long = timing.measure([lambda: x @ x], dev, dataclasses.replace(cfg, warmup_s=1.0))
    clock = timing.sm_clock_mhz(dev)
    assert long.median_us > 0 and (clock is None or clock > 0)
    assert ("SM clock" in long.note) == (clock is not None)
