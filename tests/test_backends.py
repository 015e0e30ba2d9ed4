"""The backend registry: selection, overrides, errors, report()."""

import pytest
import torch

import scaledmm
from scaledmm import backends
from scaledmm.backends import Backend, Family, Problem
from scaledmm.ops import fp8_block as ops

CPU = torch.device("cpu")


def _problem(m=4, n=32, k=128):
    return Problem(Family.FP8_BLOCK, CPU, m, n, k, torch.float8_e4m3fn, torch.bfloat16, k,
                   (("block_size", (128, 128)),))


@pytest.fixture
def fake_backends():
    calls = []

    def impl(name):
        def f(a, b, sa, sb, bs, od):
            calls.append(name)
            return ops.reference_mm(a, b, sa, sb, bs, od)
        return f

    backends.register(Backend(Family.FP8_BLOCK, "t_aligned", {"fp8_block_mm": impl("t_aligned")},
                              can_implement=lambda p: (p.m % 4 == 0, f"needs M % 4 == 0, got M={p.m}"),
                              needs_m_multiple=4))
    backends.register(Backend(Family.FP8_BLOCK, "t_broken", {"fp8_block_mm": impl("t_broken")},
                              is_supported=lambda d: (False, "this machine lacks the t_broken chip")))
    backends.register(Backend(Family.FP8_BLOCK, "t_raises", {"fp8_block_mm": impl("t_raises")},
                              is_supported=lambda d: 1 / 0))
    with backends.policy_snapshot():  # the shipped policy comes back afterwards
        backends.set_priority("fp8_block", "cpu", ["t_broken", "t_raises", "t_aligned", "reference"])
        yield calls
    for n in ("t_aligned", "t_broken", "t_raises"):
        backends.unregister("fp8_block", n)


def test_auto_walks_priority(fake_backends):
    assert backends.select(_problem(m=4), "fp8_block_mm").name == "t_aligned"
    assert backends.select(_problem(m=3), "fp8_block_mm").name == "reference"
    assert backends.select(_problem(m=3), "per_token_group_quant_fp8").name == "reference"


def test_ops_use_selected_backend(fake_backends):
    a = torch.randn(4, 128).to(torch.float8_e4m3fn)
    b = torch.randn(32, 128).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(4, 1), torch.ones(1, 1)
    torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)
    assert fake_backends == ["t_aligned"]
    # the padded op pads M = 3 to 4 and so reaches the aligned backend
    torch.ops.scaledmm.padded_fp8_block_mm(a[:3], b, sa[:3], sb)
    assert fake_backends == ["t_aligned", "t_aligned"]


def test_padded_op_pads_only_for_backends_that_need_it(fake_backends):
    seen = []
    backends.register(Backend(Family.FP8_BLOCK, "t_any", {"fp8_block_mm": lambda a, b, sa, sb, bs, od: (
        seen.append(a.shape[0]) or ops.reference_mm(a, b, sa, sb, bs, od))}))
    try:
        gen = torch.Generator().manual_seed(15)
        a = torch.randn(3, 256, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(160, 256, generator=gen).to(torch.float8_e4m3fn)
        sa, sb = torch.rand(3, 2, generator=gen) + 0.5, torch.rand(2, 2, generator=gen) + 0.5
        with scaledmm.use_backend("fp8_block", "t_any"):  # any M: no padding copy
            direct = torch.ops.scaledmm.padded_fp8_block_mm(a, b, sa, sb)
        with scaledmm.use_backend("fp8_block", "t_aligned"):  # M % 4: padded to 4
            out = torch.ops.scaledmm.padded_fp8_block_mm(a, b, sa, sb)
        assert seen == [3] and fake_backends == ["t_aligned"] and out.shape == (3, 160)
        # the first 3 rows of the aligned backend's result on the padded operands (zero rows, scale 1),
        # bit for bit; and the unpadded result up to fp32 summation order (a CPU sgemm may block M = 3
        # and M = 4 differently)
        a4 = torch.cat([a, torch.zeros(1, 256, dtype=a.dtype)])
        sa4 = torch.cat([sa, torch.ones(1, 2)])
        assert torch.equal(out, ops.reference_mm(a4, b, sa4, sb)[:3])
        torch.testing.assert_close(out, direct, rtol=2.0 ** -7, atol=1e-3)
        # and the SPEC's block sum in float64: |fp32 sums| <= (K + 4) u sum |terms|, then bf16
        deq = lambda q, s, r: q.double() * s.double()[torch.arange(q.shape[0]) // r][:, torch.arange(256) // 128]
        a64, b64 = deq(a, sa, 1), deq(b, sb, 128)
        ref, mag = a64 @ b64.t(), a64.abs() @ b64.abs().t()
        bound = (256 + 4) * 2.0 ** -24 * mag
        lo, hi = (ref - bound).to(torch.bfloat16).double(), (ref + bound).to(torch.bfloat16).double()
        assert ((out.double() >= lo) & (out.double() <= hi)).all()
    finally:
        backends.unregister("fp8_block", "t_any")


def test_context_manager_and_env(fake_backends, monkeypatch):
    with scaledmm.use_backend("fp8_block", "reference"):
        assert backends.select(_problem(), "fp8_block_mm").name == "reference"
        with scaledmm.use_backend("fp8_block", "auto"):
            assert backends.select(_problem(), "fp8_block_mm").name == "t_aligned"
    monkeypatch.setenv("SCALEDMM_FP8_BLOCK_BACKEND", "reference")
    assert backends.select(_problem(), "fp8_block_mm").name == "reference"
    with scaledmm.use_backend("fp8_block", "t_aligned"):  # context beats env
        assert backends.select(_problem(), "fp8_block_mm").name == "t_aligned"


def test_unknown_name_lists_valid_ones(monkeypatch):
    with pytest.raises(ValueError, match=r"expected one of \[.*reference.*\].*'nope'"):
        with scaledmm.use_backend("fp8_block", "nope"):
            pass
    monkeypatch.setenv("SCALEDMM_NVFP4_BACKEND", "nope")
    with pytest.raises(ValueError, match="reference"):
        backends.select(Problem(Family.NVFP4, CPU, 1, 16, 64, torch.uint8, torch.bfloat16), "nvfp4_mm")
    with pytest.raises(ValueError, match="family"):
        backends.names("fp9")


def test_explicit_backend_that_cannot_run_raises_with_reason(fake_backends):
    with scaledmm.use_backend("fp8_block", "t_broken"):
        with pytest.raises(RuntimeError, match="lacks the t_broken chip"):
            backends.select(_problem(), "fp8_block_mm")
    with scaledmm.use_backend("fp8_block", "t_aligned"):
        with pytest.raises(RuntimeError, match="needs M % 4 == 0, got M=3"):
            backends.select(_problem(m=3), "fp8_block_mm")
    with scaledmm.use_backend("fp8_block", "t_raises"):
        with pytest.raises(RuntimeError, match="support probe failed: ZeroDivisionError"):
            backends.select(_problem(), "fp8_block_mm")
    with scaledmm.use_backend("fp8_block", "t_aligned"):  # not its op: auto-selected, no error
        assert backends.select(_problem(), "per_token_group_quant_fp8").name == "reference"


def test_report_lists_every_backend_and_reason(fake_backends, capsys):
    text = backends.report()
    assert capsys.readouterr().out == text
    for fam in Family:
        assert f"{fam.value}: auto order" in text
    assert "t_broken" in text and "lacks the t_broken chip" in text
    assert "[yes] reference" in text
    assert "support probe failed" in text


def test_every_family_has_reference_on_cpu():
    for fam in Family:
        assert "reference" in backends.names(fam)
        assert backends.priority(fam, "cpu")[-1] == "reference"


def test_cublas_gate_reasons_without_gpu():
    b = backends.get("fp8_block", "cublas")
    ok, why = b.is_supported(CPU)
    assert not ok and "CUDA" in why
    ok, why = b.can_implement(_problem(m=3))
    assert not ok and "M % 4" in why


def test_backend_modules_load_when_their_dependencies_exist():
    import importlib.util

    from scaledmm import ops as ops_pkg

    if importlib.util.find_spec("triton") is not None:
        for mod in ("fp8_block_triton", "nvfp4_triton"):
            assert mod not in ops_pkg.BACKEND_LOAD_ERRORS, ops_pkg.BACKEND_LOAD_ERRORS[mod]
        assert "triton" in backends.names("fp8_block") and "triton" in backends.names("nvfp4")
    if importlib.util.find_spec("cuda.bindings") is not None:
        assert "skinny_fused_a" not in ops_pkg.BACKEND_LOAD_ERRORS, ops_pkg.BACKEND_LOAD_ERRORS
        assert "fused_a" in backends.names("skinny")
    assert "fp8_block_cutlass" not in ops_pkg.BACKEND_LOAD_ERRORS, ops_pkg.BACKEND_LOAD_ERRORS


def test_measured_auto_table_orders_then_falls_back(monkeypatch):
    fam = Family.FP8_BLOCK
    with backends.policy_snapshot():
        backends.set_auto_table(fam, "cpu", {(64, 128): [(16, ["t_x"]), (128, ["composite"])]})
        # a table applies to the devices its policy serves (any device type)
        assert backends.auto_order(_problem(m=4, n=64)) == ["t_x"] + backends.priority(fam, "cpu")
        assert backends.auto_order(_problem(m=4, n=64), table_m=17)[0] == "composite"
        assert backends.auto_order(_problem(m=4, n=64), table_m=129) == backends.priority(fam, "cpu")
    assert backends.auto_order(_problem(m=4, n=64)) == backends.priority(fam, "cpu")  # undone
    monkeypatch.setattr(backends, "arch_key", lambda d: "sm90")
    cuda = torch.device("cuda", 0)
    p = lambda m, n: Problem(fam, cuda, m, n, 128, torch.float8_e4m3fn, torch.bfloat16, 128)
    rows = {(64, 128): [(128, ["triton"]), (16, ["reference", "triton"])]}
    with backends.override_policy(fam, "sm90", order=["cublas", "triton", "reference"], shapes=rows):
        assert backends.auto_order(p(16, 64)) == ["reference", "triton", "cublas"]
        assert backends.auto_order(p(17, 64)) == ["triton", "cublas", "reference"]
        assert backends.auto_order(p(129, 64)) == ["cublas", "triton", "reference"]
        assert backends.auto_order(p(4, 65)) == ["cublas", "triton", "reference"]
    assert backends.policy(fam, cuda).source.endswith("fp8_block_sm90.json")


LAST_M = 2**31 - 1  # a shape's last row covers every larger M


def test_op_rows_rank_one_op_and_leave_the_others_on_the_family_rows(monkeypatch):
    """``op_shapes`` rows serve their op alone: fp8_block_linear takes
    composite where its rows say so while fp8_block_mm keeps the family's
    rows; a shape without op rows falls back to the family's."""
    fam = Family.FP8_BLOCK
    monkeypatch.setattr(backends, "arch_key", lambda d: "sm90")
    pretend = lambda b, d: (True, "pretend")  # noqa: E731
    pretend.cache_clear = lambda: None  # invalidate() clears the real probe cache
    monkeypatch.setattr(backends, "supported_on", pretend)
    cuda = torch.device("cuda", 0)
    opts = (("block_size", (128, 128)), ("a_scales_col_major", False))
    p = lambda m, n: Problem(fam, cuda, m, n, 128, torch.bfloat16, torch.bfloat16, 128, opts)  # noqa: E731
    rows = {(64, 128): [(LAST_M, ["triton", "cublas"])]}
    op_rows = {"fp8_block_linear": {(64, 128): [(16, ["triton"]), (LAST_M, ["composite", "triton"])]}}
    backends.invalidate()
    try:
        with backends.override_policy(fam, "sm90", order=["cublas", "triton", "composite", "reference"],
                                      shapes=rows, op_shapes=op_rows) as pol:
            assert pol.op_shapes["fp8_block_linear"][(64, 128)][1] == (LAST_M, ("composite", "triton"))
            assert backends.auto_order(p(32, 64), op="fp8_block_linear")[:2] == ["composite", "triton"]
            assert backends.auto_order(p(32, 64), op="fp8_block_mm")[:2] == ["triton", "cublas"]
            assert backends.auto_order(p(32, 64))[:2] == ["triton", "cublas"]
            assert backends.auto_order(p(8, 64), op="fp8_block_linear")[0] == "triton"
            assert backends.auto_order(p(32, 96), op="fp8_block_linear")[0] == "cublas"  # no rows: the order
            assert backends.select(p(32, 64), "fp8_block_linear").name == "composite"
            assert backends.select(p(8, 64), "fp8_block_linear").name == "triton"
            assert backends.select(p(32, 64), "fp8_block_mm").name == "triton"
    finally:
        monkeypatch.undo()
        backends.invalidate()


def test_shipped_fp8_block_table_loads():
    import importlib.resources
    import json

    data = json.loads((importlib.resources.files("scaledmm") / "tuning" / "fp8_block_sm90.json").read_text())
    assert data["arch"] == "sm90"
    table = backends.policy("fp8_block", "sm90").shapes
    assert (2112, 7168) in table and all(names for rows in table.values() for _, names in rows)
    assert len(table) == len(data["shapes"])
    for rows in table.values():
        for _, names in rows:
            assert set(names) <= set(backends.names("fp8_block"))


def test_selection_cache_follows_registry_changes(fake_backends):
    p = _problem(m=4)
    assert backends.select(p, "fp8_block_mm").name == "t_aligned"
    assert backends.select(p, "fp8_block_mm").name == "t_aligned"  # cached
    backends.set_priority("fp8_block", "cpu", ["reference", "t_aligned"])
    assert backends.select(p, "fp8_block_mm").name == "reference"
    backends.set_priority("fp8_block", "cpu", ["t_aligned", "reference"])
    assert backends.select(p, "fp8_block_mm").name == "t_aligned"
    backends.register(Backend(Family.FP8_BLOCK, "t_aligned", {"fp8_block_mm": lambda *a: None},
                              is_supported=lambda d: (False, "gone")))
    assert backends.select(p, "fp8_block_mm").name == "reference"
    with scaledmm.use_backend("fp8_block", "reference"):  # the request is part of the key
        assert backends.select(_problem(m=8), "fp8_block_mm").name == "reference"
