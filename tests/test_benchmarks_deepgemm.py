"""The optional ``deepgemm`` baseline of ``python -m benchmarks fp8_block`` on the
CPU, against a stand-in ``deep_gemm`` module injected into ``sys.modules``: it
implements DeepGEMM's call convention with torch math and asserts the operand
layouts the real one needs (dtypes, shapes, strides).  Without ``deep_gemm``
the baseline is listed as unavailable and the rest of the run is unchanged."""

from __future__ import annotations

import csv
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import __main__ as cli  # noqa: E402
from benchmarks import deepgemm, harness  # noqa: E402

E4M3 = torch.float8_e4m3fn
ARGS = ["--m", "1,3,4,17", "--quick", "--no-plots", "--device", "cpu",
        "--providers", "auto,deepgemm,scaled_mm_blockwise"]


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _fake_gemm(seen: list, fail_at_m=None, rows_written=None):
    """DeepGEMM's ``fn((a, a_scales), (b, b_scales), out)``: checks the layouts,
    writes ``out`` in place (only its first ``rows_written(M)`` rows if given)."""

    def gemm(lhs, rhs, out):
        (a, sa), (b, sb) = lhs, rhs
        m, k = a.shape
        n = b.shape[0]
        g, nb = -(-k // 128), -(-n // 128)
        assert a.dtype == E4M3 and b.dtype == E4M3, (a.dtype, b.dtype)
        assert sa.dtype == torch.float32 and sb.dtype == torch.float32, (sa.dtype, sb.dtype)
        assert out.dtype == torch.bfloat16 and tuple(out.shape) == (m, n), (out.dtype, out.shape)
        assert b.shape[1] == k
        assert a.stride(1) == 1 and b.stride(1) == 1 and out.stride(1) == 1
        assert a.stride(0) % 16 == 0 and b.stride(0) % 16 == 0 and out.stride(0) % 8 == 0
        assert tuple(sa.shape) == (m, g) and sa.stride() == (1, -(-m // 4) * 4), (sa.shape, sa.stride())
        assert tuple(sb.shape) == (nb, g) and sb.is_contiguous(), (sb.shape, sb.stride())
        if fail_at_m is not None and m == fail_at_m:
            raise AssertionError(f"fake deep_gemm: M = {m} not supported")
        xa = a.float() * sa.repeat_interleave(128, dim=1)[:, :k]
        xb = b.float() * sb.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
        rows = m if rows_written is None else rows_written(m)
        out[:rows].copy_((xa @ xb.t())[:rows])
        seen.append((m, n, k, sa.stride()))

    return gemm


def _install(monkeypatch, api: str, gemm) -> None:
    module = types.ModuleType("deep_gemm")
    setattr(module, api, gemm)
    monkeypatch.setitem(sys.modules, "deep_gemm", module)


@pytest.mark.parametrize("api", deepgemm.API_NAMES)
def test_deepgemm_is_checked_timed_and_reported(tmp_path, capsys, monkeypatch, api):
    seen: list = []
    _install(monkeypatch, api, _fake_gemm(seen))
    # 264: a partial last block of N (264 % 128 != 0, 264 % 8 == 0); 260: N % 8 != 0.
    rc = cli.main(["fp8_block", "--shapes", "264x256,260x384", *ARGS, "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    rows = _rows(tmp_path / "fp8_block.csv")
    dg = [r for r in rows if r["provider"] == "deepgemm"]
    assert {r["provider"] for r in rows} == {"auto", "deepgemm", "scaled_mm_blockwise"}
    assert len(dg) == 2 * 4 and all(r["kind"] == "baseline" for r in dg)
    for r in dg:
        if r["n"] == "264":
            assert r["status"] == "ok", r
            assert float(r["error"]) < 1e-2 and float(r["median_us"]) > 0
        else:
            assert r["status"] == "n/a" and "N % 8 == 0" in r["note"], r
    # Every M reached DeepGEMM with its own TMA-aligned scale stride (check call, then timed calls).
    assert {(m, s) for m, n, k, s in seen} == {(1, (1, 4)), (3, (1, 4)), (4, (1, 4)), (17, (1, 20))}
    assert all(n == 264 for _, n, _, _ in seen)
    # "DeepGEMM time / ours": the vs_deepgemm column, and auto's ratio in the markdown.
    autos = [r for r in rows if r["provider"] == "auto" and r["n"] == "264"]
    assert autos and all(float(r["vs_deepgemm"]) > 0 for r in autos)
    assert "auto vs deepgemm" in out
    assert "baseline deepgemm: deep_gemm " in out and api in out


def test_deepgemm_output_not_fully_written_is_wrong(tmp_path, capsys, monkeypatch):
    seen: list = []
    _install(monkeypatch, "gemm_fp8_fp8_bf16_nt", _fake_gemm(seen, rows_written=lambda m: m - 1))
    assert cli.main(["fp8_block", "--shapes", "256x256", *ARGS, "--out", str(tmp_path)]) == 0
    dg = [r for r in _rows(tmp_path / "fp8_block.csv") if r["provider"] == "deepgemm"]
    assert len(dg) == 4
    for r in dg:  # the untouched last row is still the NaN the output was prepared with
        assert r["status"] == "wrong" and "non-finite" in r["note"] and r["median_us"] == "", r


def test_deepgemm_failure_at_one_m_is_na_with_the_reason(tmp_path, capsys, monkeypatch):
    seen: list = []
    _install(monkeypatch, "fp8_gemm_nt", _fake_gemm(seen, fail_at_m=3))
    assert cli.main(["fp8_block", "--shapes", "256x256", *ARGS, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    dg = {int(r["m"]): r for r in _rows(tmp_path / "fp8_block.csv") if r["provider"] == "deepgemm"}
    assert dg[3]["status"] == "n/a" and "M = 3 not supported" in dg[3]["note"]
    assert all(dg[m]["status"] == "ok" for m in (1, 4, 17)), dg
    assert "deepgemm: n/a at M=3: AssertionError: fake deep_gemm: M = 3 not supported" in out


def test_without_deep_gemm_it_is_listed_unavailable(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # makes `import deep_gemm` raise
    import benchmarks.fp8_block as fam

    bench = fam.benches()[0]
    provs, _ = harness.providers(bench, torch.device("cpu"))
    assert "deepgemm" not in {p.name for p in provs}
    rc = cli.main(["fp8_block", "--shapes", "256x256", *ARGS, "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    rows = _rows(tmp_path / "fp8_block.csv")
    assert {r["provider"] for r in rows} == {"auto", "scaled_mm_blockwise"}
    assert all(r["status"] == "ok" for r in rows if r["provider"] == "auto")
    assert "vs_deepgemm" not in rows[0]
    assert "baseline deepgemm: not available: deep_gemm is not importable (ModuleNotFoundError" in out


def test_module_without_a_known_api_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    import benchmarks.fp8_block as fam

    assert deepgemm.provider(fam.prepare, fam.reference, [128, 128], fam.to_f64) is None
    (line,) = deepgemm.notes()
    assert line.startswith("deepgemm: not available:") and all(n in line for n in deepgemm.API_NAMES)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 40), g=st.integers(1, 5), column_major=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_mn_major_scales(m, g, column_major, seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.rand((g, m) if column_major else (m, g), generator=gen)
    s = src.t() if column_major else src
    t = deepgemm.mn_major_scales(s)
    ld = -(-m // 4) * 4
    assert t.shape == s.shape and torch.equal(t, s)
    if m > 0:
        assert t.stride() == (1, ld)
    assert (t is s) == (column_major and m % 4 == 0 and m > 0)


def test_mn_major_scales_rejects_non_float32():
    with pytest.raises(ValueError, match="s must be a 2-D float32"):
        deepgemm.mn_major_scales(torch.zeros(3, 2, dtype=torch.float64))
