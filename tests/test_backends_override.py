"""Explicit backend requests (SCALEDMM_<FAMILY>_BACKEND, use_backend): they
apply to the ops the named backend implements and leave the family's other
ops to automatic selection; an unknown name raises at the op naming its
source; report() says what a request does; use_backend blocks may end in any
order.  The CPU tests check the mechanism with registered stand-in backends;
the GPU test forces every real backend of every family and runs each op and
layer of the family."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn

import scaledmm
from helpers import rel_err, requires_cuda
from scaledmm import backends
from scaledmm.backends import Backend, Family
from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear, SkinnyLinear
from scaledmm.ops import fp8_block as fb
from scaledmm.ops.skinny import MAX_M

# The family's GEMM op: what a GEMM-only backend implements.
GEMM_OP = {Family.FP8_BLOCK: "fp8_block_mm", Family.FP8: "fp8_scaled_mm", Family.NVFP4: "nvfp4_mm",
           Family.SKINNY: "dsv3_fused_a_gemm"}


# --------------------------------------------------------------------------
# Workloads: every op and the layer of each family, inputs built up front
# --------------------------------------------------------------------------


def _fp8_block(m: int, dev: str):
    n, k = 256, 512
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    w, ws = fb.quantize_weight(torch.randn(n, k, device=dev))
    q, s = fb.reference_quant(x, 128, 1e-10, True)
    lin = nn.Linear(k, n, dtype=torch.bfloat16, device=dev)
    bias = lin.bias.detach()
    layer, layer_nb = Fp8BlockLinear.from_float(lin), Fp8BlockLinear.from_float(
        nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=dev))
    o = torch.ops.scaledmm
    return [
        ("per_token_group_quant_fp8", lambda: o.per_token_group_quant_fp8(x, 128, 1e-10, True)),
        ("fp8_block_mm", lambda: o.fp8_block_mm(q, w, s, ws)),
        ("padded_fp8_block_mm", lambda: o.padded_fp8_block_mm(q, w, s, ws)),
        ("dynamic_padded_fp8_block_mm", lambda: o.dynamic_padded_fp8_block_mm(q, w, s, ws)),
        ("scaledmm.fp8_block_mm", lambda: scaledmm.fp8_block_mm(q, w, s, ws)),
        ("fp8_block_linear", lambda: o.fp8_block_linear(x, w, ws, [128, 128], torch.bfloat16, bias)),
        ("Fp8BlockLinear", lambda: layer(x)),
        ("Fp8BlockLinear(bias=False)", lambda: layer_nb(x)),
    ]


def _fp8(m: int, dev: str):
    n, k = 256, 512
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    lin = nn.Linear(k, n, dtype=torch.bfloat16, device=dev)
    per_token = Fp8Linear.from_float(lin, per_channel=True, activation="dynamic_per_token")
    per_tensor = Fp8Linear.from_float(lin)
    o = torch.ops.scaledmm
    return [
        ("quant_fp8", lambda: o.quant_fp8(x, None, True)),
        ("Fp8Linear(per token)", lambda: per_token(x)),
        ("Fp8Linear(per tensor)", lambda: per_tensor(x)),
    ]


def _nvfp4(m: int, dev: str):
    n, k = 256, 512
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    lin = nn.Linear(k, n, dtype=torch.bfloat16, device=dev)
    w4a4 = NvFp4Linear.from_float(lin)
    w4a16 = NvFp4Linear.from_float(lin, use_w4a16=True)
    gs = torch.full((1,), 448.0 * 6 / 4, device=dev)
    return [
        ("nvfp4_quant", lambda: torch.ops.scaledmm.nvfp4_quant(x, gs, True)),
        ("NvFp4Linear", lambda: w4a4(x)),
        ("NvFp4Linear(w4a16)", lambda: w4a16(x)),
    ]


def _skinny(m: int, dev: str):
    n, k = 256, 512
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=dev)
    layer = SkinnyLinear.from_float(lin)
    work = [("SkinnyLinear", lambda: layer(x))]  # any M: the layer falls back to F.linear above MAX_M
    if m <= MAX_M:  # the raw op's contract: at most MAX_M rows
        work.insert(0, ("dsv3_fused_a_gemm", lambda: torch.ops.scaledmm.dsv3_fused_a_gemm(x, layer.weight)))
    return work


WORKLOADS = {Family.FP8_BLOCK: _fp8_block, Family.FP8: _fp8, Family.NVFP4: _nvfp4, Family.SKINNY: _skinny}


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def _same_bits(a, b) -> bool:
    return len(_tensors(a)) == len(_tensors(b)) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8),
                                                                      y.contiguous().view(torch.uint8))
               for x, y in zip(_tensors(a), _tensors(b)))


# --------------------------------------------------------------------------
# CPU: the mechanism, with a stand-in backend implementing only the GEMM op
# --------------------------------------------------------------------------


@pytest.fixture
def gemm_only():
    """Per family a backend ``t_gemm_only`` implementing only the family's
    GEMM op (as the reference computes it), recording its calls."""
    calls: list[str] = []

    def delegate(fam, op):
        ref = backends.get(fam, "reference").impls[op]

        def impl(*args):
            calls.append(op)
            return ref(*args)
        return impl

    for fam, op in GEMM_OP.items():
        backends.register(Backend(fam, "t_gemm_only", {op: delegate(fam, op)}))
    yield calls
    for fam in GEMM_OP:
        backends.unregister(fam, "t_gemm_only")


@pytest.mark.parametrize("source", ["env", "use_backend"])
@pytest.mark.parametrize("fam", list(Family), ids=lambda f: f.value)
def test_forcing_a_gemm_only_backend_keeps_every_op_and_layer_running(gemm_only, monkeypatch, fam, source):
    for f in Family:
        monkeypatch.delenv(f.env_var, raising=False)
    for m in (1, 3, 4):
        work = WORKLOADS[fam](m, "cpu")
        want = [thunk() for _, thunk in work]  # automatic selection (reference on the CPU)
        if source == "env":
            monkeypatch.setenv(fam.env_var, "t_gemm_only")
            forced = contextlib.nullcontext()
        else:
            forced = scaledmm.use_backend(fam, "t_gemm_only")
        with forced, backends.record() as calls:
            got = [thunk() for _, thunk in work]
        monkeypatch.delenv(fam.env_var, raising=False)
        for (label, _), g, w in zip(work, got, want):
            assert _same_bits(g, w), (label, m)
        seen = {(op, name) for op, name, _ in calls}
        for op, name in seen:
            assert name == ("t_gemm_only" if op == GEMM_OP[fam] else
                            "composite" if op in ("fp8_linear", "nvfp4_linear", "nvfp4_dynamic_linear")
                            else "reference"), (op, name, m)
    if fam is Family.FP8_BLOCK:  # the layers of the others call the GEMM op directly
        assert {op for op, _ in seen} >= {"per_token_group_quant_fp8", "fp8_block_mm", "fp8_block_linear"}
    if fam is Family.FP8:  # Fp8Linear's op runs as its two ops (composite) on the CPU
        assert {op for op, _ in seen} >= {"quant_fp8", "fp8_scaled_mm", "fp8_linear"}
    assert GEMM_OP[fam] in gemm_only


def test_padded_ops_with_a_forced_aligned_gemm_only_backend(monkeypatch):
    """The padded ops reach a forced aligned-only GEMM through the padding
    path (the quantizer feeding them is auto-selected)."""
    rows, outs = [], []

    def aligned(a, b, sa, sb, bs, od):
        rows.append(a.shape[0])
        outs.append(fb.reference_mm(a, b, sa, sb, bs, od))
        return outs[-1]

    backends.register(Backend(Family.FP8_BLOCK, "t_al_only", {"fp8_block_mm": aligned}, needs_m_multiple=4,
                              can_implement=lambda p: (p.m % 4 == 0, f"needs M % 4 == 0, got M={p.m}")))
    try:
        monkeypatch.setenv("SCALEDMM_FP8_BLOCK_BACKEND", "t_al_only")
        x = torch.randn(3, 256)
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, True)
        w, ws = fb.quantize_weight(torch.randn(64, 256))
        want = fb.reference_mm(q, w, s, ws, [128, 128], torch.bfloat16)
        for op in (torch.ops.scaledmm.padded_fp8_block_mm, torch.ops.scaledmm.dynamic_padded_fp8_block_mm,
                   scaledmm.fp8_block_mm):
            got = op(q, w, s, ws)
            # the first M rows of what the aligned backend computed, bit for bit; and the unpadded
            # result up to fp32 summation order (a CPU sgemm may block M = 3 and M = 4 differently)
            assert torch.equal(got, outs[-1][:3])
            torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=1e-3)
        assert rows == [4, 4, 4]
        # implemented but cannot run (M = 3 unpadded): raises, never falls back
        with pytest.raises(RuntimeError, match=r"fp8_block/t_al_only was requested but cannot run.*M=3"):
            torch.ops.scaledmm.fp8_block_mm(q, w, s, ws)
    finally:
        backends.unregister("fp8_block", "t_al_only")


def test_unknown_env_name_raises_at_the_op_naming_the_variable(monkeypatch):
    monkeypatch.setenv("SCALEDMM_FP8_BLOCK_BACKEND", "cuBLAS")
    x = torch.randn(2, 128)
    for call in (lambda: torch.ops.scaledmm.per_token_group_quant_fp8(x),
                 lambda: Fp8BlockLinear.from_float(nn.Linear(128, 64))(x.bfloat16())):
        with pytest.raises(ValueError, match=r"SCALEDMM_FP8_BLOCK_BACKEND: expected one of \[.*reference.*\]"
                                             r".*got 'cuBLAS'"):
            call()
    monkeypatch.setenv("SCALEDMM_FP8_BLOCK_BACKEND", " auto ")  # "auto" (spaces ignored): no request
    torch.ops.scaledmm.per_token_group_quant_fp8(x)
    with scaledmm.use_backend("fp8_block", "auto"):  # masks an invalid variable too
        monkeypatch.setenv("SCALEDMM_FP8_BLOCK_BACKEND", "nope")
        torch.ops.scaledmm.per_token_group_quant_fp8(x)


def test_report_says_what_a_request_does_and_shows_an_invalid_value(gemm_only, monkeypatch):
    for f in Family:
        monkeypatch.delenv(f.env_var, raising=False)
    monkeypatch.setenv("SCALEDMM_FP8_BLOCK_BACKEND", "t_gemm_only")
    monkeypatch.setenv("SCALEDMM_NVFP4_BACKEND", "no-such-kernel")
    with scaledmm.use_backend("fp8", "t_gemm_only"):
        text = backends.report(file=None)
    lines = {ln.split(":")[0].strip(): ln for ln in text.splitlines() if ln.startswith("  ") and "auto order" in ln}
    fp8_block = lines["fp8_block"]
    assert "forced to 't_gemm_only' by SCALEDMM_FP8_BLOCK_BACKEND for fp8_block_mm" in fp8_block
    assert "auto-selected for fp8_block_linear, per_token_group_quant_fp8" in fp8_block
    assert "forced to 't_gemm_only' by use_backend for fp8_scaled_mm; auto-selected for fp8_linear, quant_fp8" in lines["fp8"]
    nv = lines["nvfp4"]
    assert "SCALEDMM_NVFP4_BACKEND='no-such-kernel'" in nv and "INVALID" in nv and "reference" in nv
    assert "no request" in lines["skinny"]
    with scaledmm.use_backend("nvfp4", "auto"):  # masks the bad variable; report says so
        text = backends.report(file=None)
    assert "masks SCALEDMM_NVFP4_BACKEND='no-such-kernel'" in text


# --------------------------------------------------------------------------
# use_backend blocks exited out of order
# --------------------------------------------------------------------------


def _forced() -> dict[str, str | None]:
    return {f.value: backends.requested(f) for f in Family}


@pytest.fixture
def no_env(monkeypatch):
    for f in Family:
        monkeypatch.delenv(f.env_var, raising=False)


def test_blocks_of_two_families_exited_out_of_order(no_env):
    a = scaledmm.use_backend("fp8_block", "reference")
    b = scaledmm.use_backend("nvfp4", "reference")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert _forced() == {"fp8_block": None, "fp8": None, "nvfp4": "reference", "skinny": None}
    b.__exit__(None, None, None)
    assert _forced() == {f.value: None for f in Family}


def test_same_family_blocks_exited_out_of_order_innermost_live_wins(gemm_only, no_env):
    outer = scaledmm.use_backend("fp8_block", "reference")
    mid = scaledmm.use_backend("fp8_block", "t_gemm_only")
    inner = scaledmm.use_backend("fp8_block", "auto")
    outer.__enter__(), mid.__enter__(), inner.__enter__()
    assert backends.requested("fp8_block") is None
    mid.__exit__(None, None, None)
    assert backends.requested("fp8_block") is None  # inner ("auto") still live
    inner.__exit__(None, None, None)
    assert backends.requested("fp8_block") == "reference"
    outer.__exit__(None, None, None)
    assert backends.requested("fp8_block") is None


def test_blocks_held_by_generators_closed_out_of_order(no_env):
    def holder(fam):
        with scaledmm.use_backend(fam, "reference"):
            yield

    g1, g2 = holder("fp8"), holder("skinny")
    next(g1), next(g2)
    assert _forced()["fp8"] == _forced()["skinny"] == "reference"
    g1.close()
    assert _forced()["fp8"] is None and _forced()["skinny"] == "reference"
    g2.close()
    assert _forced() == {f.value: None for f in Family}


def test_exit_stack_pop_and_exception_leave_no_request(no_env):
    with contextlib.ExitStack() as stack:
        stack.enter_context(scaledmm.use_backend("fp8_block", "reference"))
        later = contextlib.ExitStack()
        later.enter_context(scaledmm.use_backend("fp8", "reference"))
    # the first stack closed while the second's block is still live
    assert _forced()["fp8_block"] is None and _forced()["fp8"] == "reference"
    later.close()
    with pytest.raises(KeyError):
        with scaledmm.use_backend("nvfp4", "reference"):
            raise KeyError("x")
    assert _forced() == {f.value: None for f in Family}


def test_a_block_is_local_to_its_thread(no_env):
    seen = []
    ready, done = threading.Event(), threading.Event()

    def other():
        ready.wait()
        seen.append(backends.requested("fp8_block"))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with scaledmm.use_backend("fp8_block", "reference"):
        ready.set()
        done.wait(60)
    t.join()
    assert seen == [None]


# --------------------------------------------------------------------------
# GPU: every real backend of every family forced, every op and layer run
# --------------------------------------------------------------------------


def _real_backends():
    if not torch.cuda.is_available():
        return []
    dev = torch.device("cuda")
    return [(f, n) for f in Family for n in backends.names(f)
            if not n.startswith("t_") and backends.get(f, n).is_supported(dev)[0]]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fam,name", _real_backends(), ids=lambda v: getattr(v, "value", v))
def test_gpu_forcing_each_backend_runs_the_whole_family(fam, name):
    """Ops the forced backend implements run on it (or raise its "cannot run"
    reason); the others run on automatic selection; results match the
    reference backend."""
    forced = backends.get(fam, name)
    reached, declined = set(), []
    for m in (1, 3, 16, 128):
        work = WORKLOADS[fam](m, "cuda")
        with scaledmm.use_backend(fam, "reference"):
            want = [thunk() for _, thunk in work]
        for (label, thunk), w in zip(work, want):
            with scaledmm.use_backend(fam, name), backends.record() as calls:
                try:
                    got = thunk()
                except RuntimeError as e:
                    # only an op the forced backend implements may decline
                    assert f"{fam.value}/{name} was requested but cannot run" in str(e), (label, m, e)
                    declined.append((label, m))
                    continue
            for op, chosen, _ in calls:
                if chosen == "composite" and name != "composite":
                    break  # an auto-selected composite runs its inner ops as without a request
                if op in forced.impls:
                    assert chosen == name, (label, m, op, chosen)
                    reached.add(op)
                else:
                    assert chosen != name and op in backends.get(fam, chosen).impls
            for g, r in zip(_tensors(got), _tensors(w)):
                assert g.shape == r.shape, (label, m)
                if g.dtype != torch.uint8:  # packed FP4 codes: shape only
                    err = rel_err(g.float(), r.float())
                    assert err < 3e-2, f"{name} {label} M={m}: rel err {err:.2e}"
    assert reached or declined, f"{fam.value}/{name}: never reached"
