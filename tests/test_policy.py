"""The selection policy as data (scaledmm/policy.py, scaledmm/tuning/*.json).

* The selections automatic choice makes at every (shape, M) of the dsv3,
  llama8b and llama8b_hf (unfused) shapes, on simulated sm80 / sm86 / sm89 /
  sm90 / sm100 / sm103 / sm120 and the CPU, with the switches off and with explicit requests, equal
  the ones recorded in tests/data/selections.json (``python -m
  benchmarks.selections``; first recorded before the policy moved into data,
  re-recorded with each measured change of a policy file, so the diff of that
  file is the review of what the change does to selection).
* The shipped files validate; malformed ones raise naming the file and field.
* No module changes or reads the policy when it is imported.
* A switch turns its backend off at selection time; explicit requests still
  reach it.
* Backends receive the Problem they were selected for.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest
import torch

import scaledmm
from benchmarks import selections
from scaledmm import backends, policy
from scaledmm.backends import Backend, Family, Problem

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "selections.json"
TUNING = ROOT / "scaledmm" / "tuning"


def _first_differences(want: dict, got: dict, limit: int = 8) -> list[str]:
    out = []
    for arch in sorted(set(want) | set(got)):
        w, g = want.get(arch, {}), got.get(arch, {})
        for key in sorted(set(w) | set(g)):
            if w.get(key) != g.get(key):
                out.append(f"{arch} {key}: recorded {w.get(key)} now {g.get(key)}")
    return out[:limit]


@pytest.mark.parametrize("case", sorted(selections.CASES))
def test_selections_equal_the_recorded_ones(case):
    fixture = json.loads(FIXTURE.read_text())
    shapes = [tuple(int(v) for v in s.split("x")) for s in fixture["shapes"]]
    want = fixture["cases"][case]
    got = selections.collect(case, archs=tuple(want), shapes=shapes, ms=tuple(fixture["ms"]))
    assert got == want, "\n".join(_first_differences(want, got))


def test_fixture_covers_the_sweeps():
    from benchmarks.shapes import DEFAULT_M, SHAPE_SETS

    fixture = json.loads(FIXTURE.read_text())
    shapes = {f"{s.n}x{s.k}" for name in ("dsv3", "llama8b") for s in SHAPE_SETS[name]}
    assert shapes <= set(fixture["shapes"])
    assert set(DEFAULT_M) | {0, 1, 3, 5, 17, 1023} <= set(fixture["ms"])
    assert set(fixture["cases"]) == set(selections.CASES)
    for case in fixture["cases"].values():
        assert set(case) == set(selections.ARCHS)


# ----------------------------------------------------------------------------
# The files
# ----------------------------------------------------------------------------


def test_shipped_files_validate_and_name_registered_backends():
    loaded = policy.load(f.value for f in Family)
    for fam in Family:
        archs = loaded[fam.value]
        assert {"cpu", "cuda"} <= set(archs), fam
        # off a GPU: the reference, and fp8_linear / nvfp4_linear as their two ops (composite)
        assert archs["cpu"].order == (("composite", "reference") if fam in ("fp8", "nvfp4") else ("reference",)), fam
        registered = set(backends.names(fam))
        for arch, pol in archs.items():
            assert pol.order[-1] == "reference", (fam, arch)
            named = set(pol.order) | set(pol.switches) | {b for rows in pol.shapes.values() for _, n in rows
                                                          for b in n}
            assert named <= registered, (fam, arch, named - registered)
    assert set(loaded["nvfp4"]["sm90"].switches.values()) == {
        "SCALEDMM_NVFP4_GEMV", "SCALEDMM_NVFP4_MID", "SCALEDMM_NVFP4_DECODE_CUBLAS", "SCALEDMM_NVFP4_WGMMA"}
    assert len(list(TUNING.glob("*.json"))) == sum(len(v) for v in loaded.values())


def _doc(**kw):
    doc = {"family": "nvfp4", "arch": "sm90", "order": ["cuda_gemv", "triton", "reference"]}
    doc.update(kw)
    return doc


@pytest.mark.parametrize("doc,field", [
    ([], "document"),
    (_doc(oder=["triton"]), "keys"),
    ({"family": "nvfp4", "arch": "sm90"}, "order"),
    (_doc(family="fp8"), "family"),
    (_doc(arch="sm80"), "arch"),
    (_doc(order=[]), "order"),
    (_doc(order=["triton", "triton"]), "order"),
    (_doc(switches={"cuda_mid": "SCALEDMM_NVFP4_MID"}), "switches['cuda_mid']"),
    (_doc(switches={"cuda_gemv": "NVFP4_GEMV"}), "switches['cuda_gemv']"),
    (_doc(shapes={"4096": [[16, ["triton"]]]}), "shapes key"),
    (_doc(shapes={"4096x4096": [[16, ["trition"]]]}), "row 16"),
    (_doc(shapes={"4096x4096": [[32, ["triton"]], [16, ["reference"]]]}), "ascending"),
    (_doc(shapes={"4096x4096": [[-1, ["triton"]]]}), "max_m"),
    (_doc(shapes={"4096x4096": []}), "rows"),
    (_doc(notes=3), "notes"),
])
def test_malformed_policy_raises_naming_file_and_field(doc, field):
    with pytest.raises(policy.PolicyError) as info:
        policy.parse(doc, "scaledmm/tuning/nvfp4_sm90.json", "nvfp4", "sm90")
    msg = str(info.value)
    assert msg.startswith("scaledmm/tuning/nvfp4_sm90.json: ") and field in msg and "expected" in msg, msg


def test_load_names_the_bad_file(tmp_path):
    (tmp_path / "fp8_cpu.json").write_text(json.dumps({"family": "fp8", "arch": "cpu", "order": ["reference"]}))
    assert policy.load(["fp8"], tmp_path)["fp8"]["cpu"].order == ("reference",)
    (tmp_path / "fp8_sm90.json").write_text("{not json")
    with pytest.raises(policy.PolicyError, match=r"fp8_sm90\.json: not valid JSON"):
        policy.load(["fp8"], tmp_path)
    (tmp_path / "fp8_sm90.json").write_text(json.dumps({"family": "fp8", "arch": "sm80", "order": ["reference"]}))
    with pytest.raises(policy.PolicyError, match=r"fp8_sm90\.json: arch: expected 'sm90', got 'sm80'"):
        policy.load(["fp8"], tmp_path)
    (tmp_path / "fp8_sm90.json").unlink()
    (tmp_path / "fp9_sm90.json").write_text("{}")
    with pytest.raises(policy.PolicyError, match=r"fp9_sm90\.json: file name"):
        policy.load(["fp8"], tmp_path)


def test_devices_use_their_arch_family_then_cuda(monkeypatch):
    for arch, file in (("sm90", "nvfp4_sm90"), ("sm86", "nvfp4_sm80"), ("sm89", "nvfp4_sm80"),
                       ("sm103", "nvfp4_sm100"), ("sm120", "nvfp4_cuda"), ("sm75", "nvfp4_cuda")):
        assert backends.policy("nvfp4", arch).source == f"scaledmm/tuning/{file}.json", arch
        monkeypatch.setattr(backends, "arch_key", lambda d, arch=arch: arch if d.type == "cuda" else d.type)
        assert backends.policy("nvfp4", torch.device("cuda", 0)).source.endswith(f"{file}.json")
    assert backends.policy("nvfp4", "cpu").source.endswith("nvfp4_cpu.json")
    assert backends.policy("nvfp4", "meta").source.endswith("nvfp4_cpu.json")  # any non-CUDA device


# ----------------------------------------------------------------------------
# Nothing at import
# ----------------------------------------------------------------------------


def test_no_module_reads_or_changes_the_policy_at_import():
    code = ("import scaledmm, scaledmm.policy as P, scaledmm.backends as b; "
            "print(P._TABLE is None, b._SELECTIONS == {})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["True", "True"], r.stdout
    # and no module outside the core can: the hooks are for tests and tools
    hooks = ("set_priority(", "set_auto_table(", "load_auto_table(", "override_policy(", "policy_snapshot(")
    for folder in ("ops", "fake_impls", "scaledmm"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name in ("backends.py", "policy.py", "policy_edits.py"):
                continue
            text = path.read_text()
            assert not any(h in text for h in hooks), path
    # the switches live in the policy files only
    for path in (ROOT / "ops").glob("*.py"):
        text = path.read_text()
        for var in ("SCALEDMM_NVFP4_GEMV", "SCALEDMM_NVFP4_MID", "SCALEDMM_NVFP4_DECODE_CUBLAS"):
            assert f'"{var}"' not in text, (path, var)


# ----------------------------------------------------------------------------
# Switches and explicit requests
# ----------------------------------------------------------------------------


def _nvfp4(m, device=torch.device("cuda", 0)):
    return Problem(Family.NVFP4, device, m, 4096, 4096, torch.uint8, torch.bfloat16, 4096,
                   (("bias", False), ("w4a16", False)))


def test_switch_is_read_at_selection_time(fake_sm90, monkeypatch):
    p = _nvfp4(4)
    assert backends.select(p, "nvfp4_mm").name == "cuda_gemv"
    monkeypatch.setenv("SCALEDMM_NVFP4_GEMV", "0")  # after the first (cached) selection
    assert backends.select(p, "nvfp4_mm").name == "cuda_mid"
    assert "cuda_gemv OFF (SCALEDMM_NVFP4_GEMV='0')" in backends.switch_line(backends.policy("nvfp4", "sm90"))
    with scaledmm.use_backend("nvfp4", "cuda_gemv"):  # an explicit request is not switched off
        assert backends.select(p, "nvfp4_mm").name == "cuda_gemv"
    monkeypatch.setenv("SCALEDMM_NVFP4_BACKEND", "cuda_gemv")
    assert backends.select(p, "nvfp4_mm").name == "cuda_gemv"
    monkeypatch.delenv("SCALEDMM_NVFP4_BACKEND")
    monkeypatch.setenv("SCALEDMM_NVFP4_GEMV", "1")
    assert backends.select(p, "nvfp4_mm").name == "cuda_gemv"


def test_switch_leaves_shape_rows_too(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(backends, "arch_key", lambda d: "sm90" if d.type == "cuda" else d.type)
    rows = {(4096, 4096): [(64, ["triton", "cuda_gemv"])]}
    with backends.override_policy("nvfp4", "sm90", shapes=rows,
                                  switches={"triton": "SCALEDMM_TEST_TRITON"}):
        assert backends.auto_order(_nvfp4(4, cuda))[:2] == ["triton", "cuda_gemv"]
        monkeypatch.setenv("SCALEDMM_TEST_TRITON", "0")
        assert "triton" not in backends.auto_order(_nvfp4(4, cuda))
        assert backends.auto_order(_nvfp4(4, cuda))[0] == "cuda_gemv"
    assert backends.policy("nvfp4", "sm90").source.endswith("nvfp4_sm90.json")  # restored


def test_report_names_the_policy_and_switches(capsys, monkeypatch):
    text = backends.report()
    for fam in Family:
        assert f"{fam.value}: auto order {backends.priority(fam, 'cpu')} ({backends.policy(fam, 'cpu').source})" in text
    capsys.readouterr()
    monkeypatch.setenv("SCALEDMM_NVFP4_MID", "0")
    line = backends.switch_line(backends.policy("nvfp4", "sm90"))
    assert "cuda_gemv on (SCALEDMM_NVFP4_GEMV=" in line and "cuda_mid OFF (SCALEDMM_NVFP4_MID='0')" in line


# ----------------------------------------------------------------------------
# Backends get their Problem
# ----------------------------------------------------------------------------


def test_backends_receive_the_problem_they_were_selected_for():
    from scaledmm.ops import fp8_block as fb

    got = []

    def with_problem(a, b, sa, sb, bs, od, *, problem):
        got.append(problem)
        return fb.reference_mm(a, b, sa, sb, bs, od)

    def without(a, b, sa, sb, bs, od):
        got.append(None)
        return fb.reference_mm(a, b, sa, sb, bs, od)

    backends.register(Backend(Family.FP8_BLOCK, "t_prob", {"fp8_block_mm": with_problem}, needs_m_multiple=4,
                              can_implement=lambda p: (p.m % 4 == 0, "M % 4")))
    backends.register(Backend(Family.FP8_BLOCK, "t_plain", {"fp8_block_mm": without}))
    try:
        a = torch.randn(3, 128).to(torch.float8_e4m3fn)
        b = torch.randn(32, 128).to(torch.float8_e4m3fn)
        sa, sb = torch.ones(3, 1), torch.ones(1, 1)
        with scaledmm.use_backend("fp8_block", "t_prob"), backends.record() as calls:
            torch.ops.scaledmm.fp8_block_mm(a[:0], b, sa[:0], sb)
            torch.ops.scaledmm.padded_fp8_block_mm(a, b, sa, sb)  # selected and run at M = 4
        assert [p for _, _, p in calls] == got and got[0].m == 0 and got[1].m == 4
        assert got[0] is calls[0][2]
        got.clear()
        with scaledmm.use_backend("fp8_block", "t_plain"):
            torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)
        assert got == [None]
    finally:
        backends.unregister("fp8_block", "t_prob")
        backends.unregister("fp8_block", "t_plain")


def test_cutlass_uses_the_selected_problem_and_its_config(monkeypatch):
    """The CUTLASS backend runs the config its can_implement found for the
    selected Problem: no rebuilt Problem, no second table walk."""
    from scaledmm.ops import fp8_block as fb
    from scaledmm.ops import fp8_block_cutlass as C

    seen = []
    real = C.select_config

    def spy(problem):
        seen.append(problem)
        return real(problem)

    launched = []
    monkeypatch.setattr(C, "select_config", spy)
    monkeypatch.setattr(C, "load_library", lambda cfg, dt: "lib")
    monkeypatch.setattr(C, "launch", lambda prep, lib: launched.append(prep.config) or prep.out)
    a, sa = fb.reference_quant(torch.randn(8, 256), 128, column_major_scales=True)
    b, sb = fb.quantize_weight(torch.randn(128, 256))
    with selections.simulated("sm90"), scaledmm.use_backend("fp8_block", "cutlass"), backends.record() as calls:
        torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)
    p = calls[-1][2]
    assert calls[-1][1] == "cutlass" and all(s is p for s in seen) and len(seen) == 2  # can_implement + run
    assert launched == [real(p)]


def test_tune_replaces_the_rows_of_a_policy_file_and_keeps_the_rest(tmp_path):
    from benchmarks import tune

    csv_path = tmp_path / "fp8_block.csv"
    header = "op,n,k,m,provider,kind,status,median_us\n"
    csv_path.write_text(header + "fp8_block_mm,2112,7168,4,triton,ours,ok,9.0\n"
                        "fp8_block_mm,2112,7168,4,cublas,ours,ok,12.0\n")
    out = tmp_path / "fp8_block_sm90.json"
    shipped = json.loads((TUNING / "fp8_block_sm90.json").read_text())
    out.write_text(json.dumps(shipped))
    assert tune.main([str(csv_path), "--out", str(out), "--source", "unit test"]) == 0
    data = json.loads(out.read_text())
    assert data["order"] == shipped["order"] and data["notes"] == shipped["notes"]
    assert data["shapes"]["2112x7168"] == [[tune.LAST_M, ["triton", "cublas"]]] and "unit test" in data["source"]
    assert {s: r for s, r in data["shapes"].items() if s != "2112x7168"} == \
        {s: r for s, r in shipped["shapes"].items() if s != "2112x7168"}  # the shapes not swept keep their rows
    csv_path.write_text(header + "fp8_block_mm,2112,7168,4,t_new,ours,ok,1.0\n")
    with pytest.raises(policy.PolicyError, match=r"row 2147483647: expected backends of order"):
        tune.main([str(csv_path), "--out", str(out)])


def test_op_shapes_are_validated_like_shapes():
    base = {"family": "fp8_block", "arch": "sm90", "order": ["triton", "composite"]}
    ok = policy.parse({**base, "op_shapes": {"fp8_block_linear": {"64x128": [[16, ["composite"]]]}}}, "f.json")
    assert ok.op_shapes == {"fp8_block_linear": {(64, 128): ((16, ("composite",)),)}}
    bad = [
        ({"op_shapes": []}, "op_shapes: expected an object"),
        ({"op_shapes": {"Bad-Op": {}}}, "op_shapes key 'Bad-Op': expected an op name"),
        ({"op_shapes": {"fp8_block_linear": {"64x0": [[1, ["triton"]]]}}}, "positive N and K"),
        ({"op_shapes": {"fp8_block_linear": {"64x128": [[1, ["cutlass"]]]}}}, "backends of order"),
        ({"op_shapes": {"fp8_block_linear": {"64x128": [[8, ["triton"]], [4, ["composite"]]]}}},
         "strictly ascending"),
        ({"op_shapes": {"fp8_block_linear:": {}}}, "expected an op name"),
        ({"op_shapes": {"fp8_block_linear:a:b": {}}}, "expected an op name"),
    ]
    for extra, msg in bad:
        with pytest.raises(policy.PolicyError, match=msg):
            policy.parse({**base, **extra}, "f.json")


def test_replace_keeps_op_shapes():
    base = policy.parse({"family": "fp8", "arch": "sm00", "order": ["reference"],
                         "op_shapes": {"quant_fp8": {"8x16": [[4, ["reference"]]]}}}, "f.json")
    saved = policy.snapshot()
    try:
        new = policy.replace("fp8", "sm00", base, order=["reference"])
        assert new.op_shapes == base.op_shapes
    finally:
        policy.restore(saved)


def test_variant_rows_come_before_the_ops_own_rows():
    """``op:variant`` rows serve only problems that declare that variant; an
    op's plain rows and the family's serve the rest."""
    p = policy.parse({"family": "fp8", "arch": "sm90", "order": ["cublas", "triton"],
                      "shapes": {"64x128": [[2**31 - 1, ["cublas"]]]},
                      "op_shapes": {"fp8_scaled_mm:rowwise": {"64x128": [[16, ["triton"]]]},
                                    "fp8_scaled_mm": {"64x128": [[8, ["triton"]]]}}}, "f.json")
    mm = "fp8_scaled_mm"
    assert p.auto_order(64, 128, 16, op=mm, variant="rowwise") == ["triton", "cublas"]
    assert p.auto_order(64, 128, 17, op=mm, variant="rowwise") == ["cublas", "triton"]  # past its rows: order
    assert p.auto_order(64, 128, 16, op=mm, variant="tensorwise") == ["cublas", "triton"]  # the op's own: M > 8
    assert p.auto_order(64, 128, 8, op=mm, variant="tensorwise") == ["triton", "cublas"]
    assert p.auto_order(64, 128, 8, variant="rowwise") == ["cublas", "triton"]  # no op: the family's rows
    assert p.auto_order(32, 128, 1, op=mm, variant="rowwise") == ["cublas", "triton"]  # no row for the shape


@pytest.mark.parametrize("scales, variant", [(("tensor", "tensor"), "tensorwise"), (("token", "channel"), "rowwise"),
                                             (("tensor", "channel"), "rowwise"), (("token", "tensor"), "rowwise")])
def test_fp8_scaled_mm_declares_its_variant_and_dispatch_reads_its_rows(scales, variant):
    """The fp8 GEMM's Problem names its variant from the scale shapes, and an
    ``op:variant`` row of the live policy decides its backend (the row names
    ``reference``, which the CPU order also holds)."""
    from scaledmm.ops import fp8 as F

    m, n, k = 3, 32, 64
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn)
    sa = torch.rand(1) + 0.5 if scales[0] == "tensor" else torch.rand(m, 1) + 0.5
    sb = torch.rand(1) + 0.5 if scales[1] == "tensor" else torch.rand(n) + 0.5
    kinds = F.check_mm_args("fp8_scaled_mm", a, b, sa, sb, None, torch.bfloat16)
    problem = F.mm_problem(a, b, *kinds, None, torch.bfloat16)
    assert problem.opt("variant") == variant
    other = "tensorwise" if variant == "rowwise" else "rowwise"
    rows = {f"fp8_scaled_mm:{other}": {(n, k): [(64, ["nope"])]},
            f"fp8_scaled_mm:{variant}": {(n, k): [(64, ["reference"])]}}
    with backends.override_policy("fp8", "cpu", order=["reference"], op_shapes=rows):
        assert backends.auto_order(problem, op="fp8_scaled_mm") == ["reference"]
        other_problem = dataclasses.replace(problem, options=tuple(
            (key, other if key == "variant" else v) for key, v in problem.options))
        assert backends.auto_order(other_problem, op="fp8_scaled_mm") == ["nope", "reference"]
        with backends.record() as calls:
            torch.ops.scaledmm.fp8_scaled_mm(a, b, sa, sb, None, torch.bfloat16)
        assert calls[-1][:2] == ("fp8_scaled_mm", "reference") and calls[-1][2].opt("variant") == variant


def test_tune_writes_variant_rows(tmp_path):
    from benchmarks import tune

    csv_path = tmp_path / "fp8.csv"
    csv_path.write_text("op,n,k,m,provider,kind,status,median_us\n"
                        "fp8_scaled_mm,64,128,4,triton,ours,ok,9.0\n"
                        "fp8_scaled_mm,64,128,4,cublas,ours,ok,12.0\n")
    out = tmp_path / "fp8_sm90.json"
    out.write_text(json.dumps({"family": "fp8", "arch": "sm90", "order": ["cublas", "triton"]}))
    args = [str(csv_path), "--family", "fp8", "--op", "fp8_scaled_mm", "--out", str(out)]
    assert tune.main(args + ["--op-rows", "--variant", "rowwise"]) == 0
    data = json.loads(out.read_text())
    assert data["op_shapes"] == {"fp8_scaled_mm:rowwise": {"64x128": [[tune.LAST_M, ["triton", "cublas"]]]}}
    assert "--variant rowwise" in data["source"] and "shapes" not in data
    data["op_shapes"]["fp8_scaled_mm:rowwise"]["32x256"] = [[4, ["cublas"]]]  # a shape this sweep lacks
    out.write_text(json.dumps(data))
    assert tune.main(args + ["--op-rows", "--variant", "rowwise"]) == 0
    assert json.loads(out.read_text())["op_shapes"]["fp8_scaled_mm:rowwise"]["32x256"] == [[4, ["cublas"]]]
    with pytest.raises(SystemExit):
        tune.main(args + ["--variant", "rowwise"])  # a variant names op rows


def test_any_shape_rows_serve_the_shapes_without_rows():
    """``"*"`` rows: parsed from and written back to the file form, read for a
    shape without rows of its own at the same level (before the levels below)."""
    doc = {"family": "fp8", "arch": "sm90", "order": ["cublas", "triton"],
           "shapes": {"*": [[4, ["triton"]]]},
           "op_shapes": {"fp8_scaled_mm:rowwise": {"64x128": [[8, ["cublas"]]], "*": [[32, ["triton"]]]}}}
    p = policy.parse(doc, "f.json")
    mm = "fp8_scaled_mm"
    assert p.auto_order(64, 128, 8, op=mm, variant="rowwise") == ["cublas", "triton"]  # its own row
    assert p.auto_order(32, 128, 32, op=mm, variant="rowwise") == ["triton", "cublas"]  # "*" of the variant
    assert p.auto_order(32, 128, 33, op=mm, variant="rowwise") == ["cublas", "triton"]  # past "*": order
    assert p.auto_order(32, 128, 4, op=mm, variant="tensorwise") == ["triton", "cublas"]  # the family's "*"
    assert p.auto_order(32, 128, 5, op=mm, variant="tensorwise") == ["cublas", "triton"]
    saved = policy.snapshot()
    try:
        again = policy.replace("fp8", "sm00", p)
        assert again.shapes == p.shapes and again.op_shapes == p.op_shapes
        with backends.override_policy("fp8", "sm00", shapes={"*": [(2, ["triton"])]}) as q:
            assert q.auto_order(8, 8, 2) == ["triton", "cublas"]
    finally:
        policy.restore(saved)
    with pytest.raises(policy.PolicyError, match="'NxK' with positive N and K, or '\\*'"):
        policy.parse({**doc, "shapes": {"**": [[4, ["triton"]]]}}, "f.json")


def test_tune_any_shape_ranks_by_the_geometric_mean_over_shapes(tmp_path):
    """At M = 4 triton wins one shape by 2x and loses the other by 10%: it
    ranks first; at M = 8 it loses both; the unswept shapes get those rows."""
    from benchmarks import tune

    lines = ["op,n,k,m,provider,kind,status,median_us"]
    for m, (t1, c1, t2, c2) in {4: (5.0, 10.0, 11.0, 10.0), 8: (12.0, 10.0, 11.0, 10.0)}.items():
        lines += [f"fp8_scaled_mm,64,128,{m},triton,ours,ok,{t1}", f"fp8_scaled_mm,64,128,{m},cublas,ours,ok,{c1}",
                  f"fp8_scaled_mm,32,256,{m},triton,ours,ok,{t2}", f"fp8_scaled_mm,32,256,{m},cublas,ours,ok,{c2}"]
    csv_path = tmp_path / "fp8.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "fp8_sm90.json"
    out.write_text(json.dumps({"family": "fp8", "arch": "sm90", "order": ["cublas", "triton"]}))
    args = [str(csv_path), "--family", "fp8", "--op", "fp8_scaled_mm", "--op-rows", "--out", str(out)]
    assert tune.main(args + ["--any-shape"]) == 0
    rows = json.loads(out.read_text())["op_shapes"]["fp8_scaled_mm"]
    assert rows["*"] == [[4, ["triton", "cublas"]], [tune.LAST_M, ["cublas", "triton"]]]
    assert rows["32x256"] == [[tune.LAST_M, ["cublas", "triton"]]]
    points = tune.any_shape_points(tune.rank_points([dict(zip(lines[0].split(","), r.split(",")))
                                                     for r in lines[1:]], "fp8_scaled_mm"))
    assert points[4][0][0] == "triton" and points[4][0][1] == pytest.approx((1.0 * 1.1) ** 0.5)
