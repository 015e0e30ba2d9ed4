"""``nvfp4_linear`` (ops/nvfp4.py, fake_impls/nvfp4.py): ``nvfp4_quant`` of the
activation with ``global_scale`` (swizzled scales), then ``nvfp4_mm`` with the
weight and ``alpha``, as one op.  Its result is defined bit for bit as that
of the two ops called one after the other.

CPU: the op on every backend implementing it (``composite``, ``reference``)
equals ``reference_linear`` and ``nvfp4_quant`` + ``nvfp4_mm`` bit for bit
over activation / output / bias dtypes, M in 0, 1, 3, 17, strided rows,
static and dynamic global scales, within a float64 bound of the GEMM of the
quantized operands (tests/nvfp4_helpers.py); a zero, a NaN and a saturating
row; ValueErrors naming the argument, the same from the fake impl; opcheck;
torch.compile (fullgraph, dynamic M); the backend chosen on the CPU and its
place in the sm90 policy (a pretend sm90 device); Hypothesis over shapes.
GPU (skipped without an sm90 GPU): the op with ``use_backend("nvfp4",
"cuda_gemv")`` and the one-launch kernel ``nvfp4_gemv.gemv_linear`` (called
directly: it is not a registered backend of the op) equal the composite
(quantizer, then ``cuda_gemv``'s ``nvfp4_mm``) bit for bit on odd and
llama8b shapes, within a float64 bound; zero / huge / strided rows, bias and
output dtypes, M = 0; determinism and CUDA graphs; every candidate config of
the fused kernel against the GEMM kernel with the same config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import check_rejected_alike, opcheck
from hypothesis import given, settings
from hypothesis import strategies as st
from nvfp4_helpers import LINEAR_OPCHECK_CASES, check_f64_bound, check_gemm, deq64, gs_for, mm_ref64

import scaledmm
from scaledmm import backends
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_gemv as gv

ops = torch.ops.scaledmm
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3 = torch.float8_e4m3fn
E2M1_X_E4M3_MAX = 448 * 6  # the usual quantize multiplier is this over amax
LLAMA8B = [(4096, 4096), (6144, 4096)]
requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm90 GPU")


# ----------------------------------------------------------------------------
# Operands and comparisons
# ----------------------------------------------------------------------------


def _weight(n, k, device="cpu"):
    """``(b, b_scales, gsw)``: a random [N, K] weight quantized with its own
    global scale ``gsw = 448 * 6 / amax(w)`` (float32, 0-D, on ``device``)."""
    w = torch.randn(n, k, device=device)
    gsw = (E2M1_X_E4M3_MAX / w.abs().max()).float()
    b, b_scales = ops.nvfp4_quant(w, gsw, True)
    return b, b_scales, gsw


def _activation(m, k, dtype, device="cpu", pad=0, scale=3.0):
    """A random [M, K] activation; with ``pad`` a view of the first K columns of
    an [M, K + pad] tensor (row stride K + pad)."""
    wide = torch.randn(m, k + pad, device=device) * scale
    return wide.to(dtype)[:, :k]


def _static_gs(device="cpu"):
    """A calibrated-looking multiplier (amax 2.5): blocks above it saturate."""
    return torch.tensor([E2M1_X_E4M3_MAX / 2.5], device=device)


def _alpha(gs, gsw):
    """The decode multiplier undoing both global scales, on their device."""
    return ((1 / gs) * (1 / gsw)).float()


def _assert_same(got, want, what=""):
    """Equal as ``torch.equal`` (and NaN where ``want`` is NaN): shape, dtype,
    device and every element."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device, (
        what, got.shape, want.shape, got.dtype, want.dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    diff = (got != want) & ~nan
    assert not diff.any(), (f"{what}: {int(diff.sum())} of {got.numel()} elements differ, first at "
                            f"{diff.nonzero()[0].tolist()}")


def _quant_then_mm(x, b, sb, gs, alpha, out_dtype=BF16, bias=None):
    """The definition: the two ops called one after the other."""
    q, s = ops.nvfp4_quant(x, gs, True)
    return ops.nvfp4_mm(q, b, s, sb, alpha, out_dtype, bias)


# ----------------------------------------------------------------------------
# CPU: the definition, bit for bit, and the float64 bound
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32], ids=str)
def test_linear_is_quant_then_mm_bit_for_bit(x_dtype, out_dtype):
    """Every CPU backend of the op (automatic, ``composite``, ``reference``)
    and ``reference_linear`` against ``nvfp4_quant`` + ``nvfp4_mm``; the output
    within the float64 bound of the GEMM of the quantized operands."""
    n, k = 200, 736
    b, sb, gsw = _weight(n, k)
    B = deq64(b, sb)
    cases = [(m, pad, gs_kind) for m in (0, 1, 3, 17) for pad in (0, 24) for gs_kind in ("static", "dynamic")]
    for i, (m, pad, gs_kind) in enumerate(cases):
        bias_dtype = (None, F32, BF16)[i % 3]
        x = _activation(m, k, x_dtype, pad=pad)
        assert x.stride(0) == k + pad
        gs = _static_gs() if gs_kind == "static" else gs_for(x)
        alpha = _alpha(gs, gsw)
        bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
        what = f"m={m} pad={pad} gs={gs_kind} bias={bias_dtype}"
        want = _quant_then_mm(x, b, sb, gs, alpha, out_dtype, bias)
        got = ops.nvfp4_linear(x, b, sb, gs, alpha, out_dtype, bias)
        assert got.shape == (m, n) and got.dtype == out_dtype
        _assert_same(got, want, what)
        _assert_same(nv.reference_linear(x, b, sb, gs, alpha, out_dtype, bias), want, "reference_linear " + what)
        for name in ("composite", "reference"):
            with scaledmm.use_backend("nvfp4", name):
                _assert_same(ops.nvfp4_linear(x, b, sb, gs, alpha, out_dtype, bias), want, f"{name} {what}")
        if m:
            q, s = ops.nvfp4_quant(x, gs, True)
            ref, bound = mm_ref64(q, b, s, sb, alpha, bias, B)
            check_gemm(got, ref, bound, k, out_dtype)


def test_default_arguments_and_scalar_shapes():
    """``out_dtype`` defaults to bf16 and ``bias`` to None; ``global_scale``
    and ``alpha`` may be 0-D, [1] or [1, 1]."""
    n, k = 40, 96
    b, sb, gsw = _weight(n, k)
    x = _activation(5, k, BF16)
    gs = gs_for(x)
    alpha = _alpha(gs, gsw)
    want = _quant_then_mm(x, b, sb, gs, alpha)
    assert want.dtype == BF16
    _assert_same(ops.nvfp4_linear(x, b, sb, gs, alpha), want)
    for shape in ((1,), (1, 1)):
        _assert_same(ops.nvfp4_linear(x, b, sb, gs.reshape(shape), alpha.reshape(shape)), want, str(shape))


def test_zero_nan_and_saturating_rows():
    """A zero row gives the bias exactly; a NaN makes its row NaN and no
    other; a block with a huge value next to tiny ones (static scale:
    saturating) still equals the definition."""
    n, k = 200, 736
    b, sb, gsw = _weight(n, k)
    bias = torch.randn(n)
    for x_dtype in (BF16, F16, F32):
        x = _activation(6, k, x_dtype)
        x[1] = 0
        x[2, 100] = float("nan")
        x[3, 16:32] = torch.randn(16).to(x_dtype) * 1e-3
        x[3, 20] = 3e3
        for gs in (_static_gs(), gs_for(x)):
            alpha = _alpha(gs, gsw)
            for out_dtype in (BF16, F16, F32):
                got = ops.nvfp4_linear(x, b, sb, gs, alpha, out_dtype, bias)
                _assert_same(got, _quant_then_mm(x, b, sb, gs, alpha, out_dtype, bias), str(x_dtype))
                assert torch.equal(got[1], bias.to(out_dtype))
                assert got[2].isnan().all()
                assert torch.isfinite(got[[0, 1, 3, 4, 5]]).all()


# ----------------------------------------------------------------------------
# CPU: bad inputs (the op and its fake impl), opcheck, FakeTensor, compile
# ----------------------------------------------------------------------------


def _good_args(m=5, n=48, k=64):
    b, sb, gsw = _weight(n, k)
    x = _activation(m, k, BF16)
    gs = gs_for(x)
    return dict(x=x, b=b, b_scales=sb, global_scale=gs, alpha=_alpha(gs, gsw), out_dtype=BF16, bias=None)


def _bad_cases():
    """(argument the message must name, replacements of the good arguments)."""
    g = _good_args()
    b, sb = g["b"], g["b_scales"]
    return [
        ("x", dict(x=g["x"].to(torch.int32))),
        ("x", dict(x=g["x"].to(E4M3))),
        ("x", dict(x=g["x"].reshape(1, 5, 64))),
        ("x", dict(x=torch.randn(5, 72, dtype=BF16))),  # K % 16
        ("x", dict(x=torch.randn(64, 5, dtype=BF16).t())),  # inner stride
        ("b", dict(b=b.view(torch.int8))),  # dtype
        ("b", dict(b=b.view(E4M3))),
        ("b", dict(x=torch.randn(5, 80, dtype=BF16))),  # K of x vs b
        ("b", dict(b=torch.zeros(64, 48, dtype=torch.uint8).t())),  # not contiguous
        ("b_scales", dict(b_scales=nv.unswizzle_block_scales(sb, 48, 4))),  # linear layout
        ("b_scales", dict(b_scales=sb.float())),
        ("global_scale", dict(global_scale=torch.ones(2))),
        ("global_scale", dict(global_scale=torch.ones(5, 1))),  # a per-row scale is not accepted
        ("global_scale", dict(global_scale=torch.tensor(1.0, dtype=torch.float64))),
        ("global_scale", dict(global_scale=torch.tensor(1.0, device="meta"))),
        ("alpha", dict(alpha=torch.ones(3))),
        ("alpha", dict(alpha=torch.tensor(1, dtype=torch.int32))),
        ("out_dtype", dict(out_dtype=torch.int32)),
        ("out_dtype", dict(out_dtype=E4M3)),
        ("bias", dict(bias=torch.zeros(47))),
        ("bias", dict(bias=torch.zeros(1, 48))),
        ("bias", dict(bias=torch.zeros(48, dtype=torch.int64))),
        ("bias", dict(bias=torch.zeros(48, device="meta"))),
    ]


def _call(a):
    return ops.nvfp4_linear(a["x"], a["b"], a["b_scales"], a["global_scale"], a["alpha"], a["out_dtype"], a["bias"])


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_inputs_name_the_argument_and_fake_agrees(i):
    arg, repl = _bad_cases()[i]
    check_rejected_alike(_call, dict(_good_args(), **repl), "nvfp4_linear", arg)


def test_fake_and_meta_shapes():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    n, k = 200, 736
    b = torch.empty(n, k // 2, dtype=torch.uint8)
    sb = torch.empty(nv.swizzled_shape(n, k // 16), dtype=E4M3)
    one = torch.ones(())
    for m in (0, 1, 3, 17, 300):
        with FakeTensorMode() as mode:
            x = torch.empty(m, k + 32, dtype=F16)[:, :k]
            out = ops.nvfp4_linear(x, mode.from_tensor(b), mode.from_tensor(sb), torch.ones(1), torch.ones(()),
                                   F32, torch.empty(n, dtype=BF16))
            assert isinstance(out, FakeTensor) and out.shape == (m, n) and out.dtype == F32
            assert out.is_contiguous()
        x = torch.empty(m, k, dtype=BF16, device="meta")
        out = ops.nvfp4_linear(x, b.to("meta"), sb.to("meta"), one.to("meta"), one.to("meta"))
        assert out.device.type == "meta" and out.shape == (m, n) and out.dtype == BF16


def _opcheck_sets():
    sets = []
    for m, n, k, x_dtype, out_dtype, bias_dtype, pad in LINEAR_OPCHECK_CASES:
        b, sb, gsw = _weight(n, k)
        x = _activation(m, k, x_dtype, pad=pad)
        gs = gs_for(x) if m else _static_gs()
        bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
        sets.append((x, b, sb, gs, _alpha(gs, gsw), out_dtype, bias))
    return sets


@pytest.mark.parametrize("i", range(len(_opcheck_sets())))
def test_opcheck(i):
    opcheck(ops.nvfp4_linear.default, _opcheck_sets()[i])


def test_compile_fullgraph_dynamic_one_compile():
    """One graph for every M but the 0 and 1 dynamo specializes; the global
    scale computed in the graph; equal to eager bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    n, k = 200, 736
    b, sb, gsw = _weight(n, k)
    bias = torch.randn(n, dtype=BF16)

    def f(x):
        gs = E2M1_X_E4M3_MAX / x.float().abs().amax()
        return ops.nvfp4_linear(x, b, sb, gs, _alpha(gs, gsw), torch.float16, bias)

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, fullgraph=True, dynamic=True, backend=cnt)
    for m in (3, 17, 5):
        x = _activation(m, k, BF16)
        _assert_same(cf(x), f(x), f"m={m}")
    assert cnt.frame_count == 1, f"recompiled: {cnt.frame_count} compiles"
    x = _activation(1, k, BF16)  # 1 is specialized by dynamo: may recompile once, must stay correct
    _assert_same(cf(x), f(x), "m=1")
    compiles = cnt.frame_count
    assert compiles <= 2
    for m in (1, 3, 17, 9):
        x = _activation(m, k, BF16)
        _assert_same(cf(x), f(x), f"m={m} again")
    assert cnt.frame_count == compiles, f"recompiled: {cnt.frame_count} compiles"
    # strided rows: dynamo guards on the layout (one more graph at most), then no recompiles
    for m in (3, 17, 9):
        x = _activation(m, k, BF16, pad=16 * m)
        _assert_same(cf(x), f(x), f"m={m} strided")
    assert cnt.frame_count <= compiles + 1, f"recompiled: {cnt.frame_count} compiles"


# ----------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------


def test_cpu_selects_composite_or_reference():
    """On the CPU the op runs on ``composite`` (its quantizer and GEMM then
    selected as if called alone) or ``reference``; the Problem it is selected
    for is the activation's (dtype, row stride), W4A4."""
    order = backends.priority("nvfp4", "cpu")
    assert "composite" in order and "reference" in order and order.index("composite") < order.index("reference")
    n, k = 200, 736
    b, sb, gsw = _weight(n, k)
    x = _activation(3, k, F16, pad=32)
    gs = gs_for(x)
    bias = torch.randn(n)
    with backends.record() as calls:
        ops.nvfp4_linear(x, b, sb, gs, _alpha(gs, gsw), F32, bias)
    op, name, p = calls[0]
    assert (op, name) == ("nvfp4_linear", order[0]) and name in ("composite", "reference")
    if name == "composite":
        assert [c[:2] for c in calls[1:]] == [("nvfp4_quant", "reference"), ("nvfp4_mm", "reference")]
    else:
        assert len(calls) == 1
    assert (p.m, p.n, p.k, p.in_dtype, p.out_dtype, p.a_row_stride) == (3, n, k, F16, F32, k + 32)
    assert p.opt("w4a16") is False and p.opt("bias") is True and p.device == x.device
    assert p == nv.linear_problem(x, b, F32, bias)
    assert backends.select(p, "nvfp4_linear").name == name
    for forced in ("composite", "reference"):
        with scaledmm.use_backend("nvfp4", forced), backends.record() as calls:
            ops.nvfp4_linear(x, b, sb, gs, _alpha(gs, gsw), F32, bias)
        assert calls[0][:2] == ("nvfp4_linear", forced)
        assert len(calls) == (3 if forced == "composite" else 1)


def test_explicit_cuda_gemv_request_on_cpu_explains():
    """Forcing ``cuda_gemv`` reaches the op (or, while it has no fused
    kernel, the composite's GEMM): refused with the reason on the CPU."""
    g = _good_args()
    with scaledmm.use_backend("nvfp4", gv.NAME), pytest.raises(RuntimeError, match="CUDA device"):
        _call(g)


def _sm90_problem(m, n=4096, k=4096, out_dtype=BF16, x_dtype=BF16, pad=0, bias=False):
    """``nvfp4.linear_problem`` of CPU operands, moved to a pretend ``cuda:0``."""
    x = torch.empty(m, k + pad, dtype=x_dtype)[:, :k]
    b = torch.empty(n, k // 2, dtype=torch.uint8)
    p = nv.linear_problem(x, b, out_dtype, torch.empty(n) if bias else None)
    return dataclasses.replace(p, device=torch.device("cuda", 0))


def test_sm90_policy_order(fake_sm90):
    """On sm90: ``cuda_gemv`` first, ``composite`` before ``reference`` (in the
    family's order and in the order tried for the op); every problem goes to
    ``composite`` (no one-launch kernel is registered for the op)."""
    order = backends.priority("nvfp4", torch.device("cuda", 0))
    assert order[0] == gv.NAME
    assert "composite" in order and "reference" in order and order.index("composite") < order.index("reference")
    for p in (_sm90_problem(1), _sm90_problem(17, 200, 736), _sm90_problem(300), _sm90_problem(4, out_dtype=F32)):
        tried = backends.auto_order(p, op="nvfp4_linear")
        assert tried.index("composite") < tried.index("reference"), tried
        assert backends.select(p, "nvfp4_linear").name == "composite", p


def test_forcing_cuda_gemv_leaves_the_op_to_the_composite_on_sm90(fake_sm90):
    """``gemv_linear`` is not a registered backend of the op (it lost to the
    composite, benchmarks/NOTES.md): a request for cuda_gemv applies to the
    GEMM the composite calls, not to the op."""
    assert "nvfp4_linear" not in backends.get("nvfp4", gv.NAME).impls
    with scaledmm.use_backend("nvfp4", gv.NAME):
        assert backends.select(_sm90_problem(1), "nvfp4_linear").name == "composite"


# ----------------------------------------------------------------------------
# Hypothesis
# ----------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 20), st.integers(1, 64), st.integers(1, 16), st.sampled_from([0, 0, 8, 40]),
       st.sampled_from([1.0, 1.0, 1e-3, 1e3]), st.booleans(), st.integers(0, 2**31 - 1))
def test_hypothesis_linear_is_quant_then_mm(m, n, k16, pad, scale, with_bias, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    k = 16 * k16
    b, sb, gsw = _weight(n, k)
    x = _activation(m, k, BF16, pad=pad, scale=scale)
    gs = gs_for(x)
    alpha = _alpha(gs, gsw)
    bias = torch.randn(n) if with_bias else None
    got = ops.nvfp4_linear(x, b, sb, gs, alpha, F32, bias)
    _assert_same(got, _quant_then_mm(x, b, sb, gs, alpha, F32, bias))
    if m:
        q, s = ops.nvfp4_quant(x, gs, True)
        check_gemm(got, *mm_ref64(q, b, s, sb, alpha, bias), k, F32)


# ----------------------------------------------------------------------------
# GPU: the fused kernel (use_backend cuda_gemv, gemv_linear) against the composite
# ----------------------------------------------------------------------------


def _gpu_composite(x, b, sb, gs, alpha, out_dtype, bias, cfg=None):
    """The definition on the GPU: the automatically selected quantizer (outside
    the request), then ``cuda_gemv``'s ``nvfp4_mm`` (or its launcher with
    ``cfg``)."""
    q, s = ops.nvfp4_quant(x, gs, True)
    if cfg is not None:
        return gv.gemv_mm(q, b, s, sb, alpha, out_dtype, bias, cfg=cfg)
    with scaledmm.use_backend("nvfp4", gv.NAME):
        return ops.nvfp4_mm(q, b, s, sb, alpha, out_dtype, bias)


def _nan_in_allocator(m, n):
    torch.full((max(m, 1) * n + 1024,), float("nan"), device="cuda")  # freed: the next output reuses it


def _gpu_fused(x, b, sb, gs, alpha, out_dtype=BF16, bias=None):
    """``[(what, output)]``: the op with ``cuda_gemv`` requested (its fused
    kernel where it implements the op; else the composite with its GEMM), and
    ``gemv_linear`` called directly where M is within its limit."""
    m, n = x.shape[0], b.shape[0]
    _nan_in_allocator(m, n)
    with scaledmm.use_backend("nvfp4", gv.NAME):
        outs = [("op", ops.nvfp4_linear(x, b, sb, gs, alpha, out_dtype, bias))]
    if m <= gv.MAX_M_LINEAR:
        _nan_in_allocator(m, n)
        outs.append(("gemv_linear", gv.gemv_linear(x, b, sb, gs, alpha, out_dtype, bias)))
    else:
        with pytest.raises(ValueError, match=f"M <= {gv.MAX_M_LINEAR}"):  # refused with the reason
            gv.gemv_linear(x, b, sb, gs, alpha, out_dtype, bias)
    return outs


def _check_gpu(out, x, b, sb, gs, alpha, bias=None):
    """The activation quantized on the GPU equals the CPU reference bit for
    bit; ``out`` within the float64 bound of the GEMM of the quantized
    operands (the gemv tests' bound)."""
    q, s = ops.nvfp4_quant(x, gs, True)
    rq, rs = nv.reference_quant(x.cpu(), gs.cpu(), True)
    assert torch.equal(q.cpu(), rq) and torch.equal(s.cpu().view(torch.uint8), rs.view(torch.uint8))
    xd, wd = nv.dequantize(rq, rs), nv.dequantize(b.cpu(), sb.cpu())
    check_f64_bound(out.cpu(), xd, wd, alpha.cpu(), None if bias is None else bias.cpu())


@requires_sm90
@pytest.mark.parametrize("x_dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("n,k", [(200, 736)] + LLAMA8B)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_gpu_equals_composite_bit_for_bit(m, n, k, x_dtype):
    b, sb, gsw = _weight(n, k, "cuda")
    x = _activation(m, k, x_dtype, "cuda")
    gs = (E2M1_X_E4M3_MAX / x.float().abs().amax()).float()
    alpha = _alpha(gs, gsw)
    out_dtype, bias = (BF16, None) if x_dtype == BF16 else (F16, torch.randn(n, device="cuda"))
    want = _gpu_composite(x, b, sb, gs, alpha, out_dtype, bias)
    for what, out in _gpu_fused(x, b, sb, gs, alpha, out_dtype, bias):
        _assert_same(out, want, what)
    _check_gpu(want, x, b, sb, gs, alpha, bias)
    # against reference_linear (float32 on the CPU): two output roundings and two float32 sums apart
    ref = nv.reference_linear(x.cpu(), b.cpu(), sb.cpu(), gs.cpu(), alpha.cpu(), out_dtype,
                              None if bias is None else bias.cpu()).double()
    xd = nv.dequantize(*nv.reference_quant(x.cpu(), gs.cpu(), True)).double()
    absum = xd.abs() @ nv.dequantize(b.cpu(), sb.cpu()).double().abs().t() * float(alpha)
    eps = 2.0 ** -8 if out_dtype == BF16 else 2.0 ** -11
    err = (want.cpu().double() - ref).abs()
    assert (err <= 2 * eps * ref.abs() + absum * 2.0 ** -19 + 1e-30).all()


@requires_sm90
@pytest.mark.parametrize("x_dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("out_dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("bias_dtype", [None, F32, BF16], ids=str)
@pytest.mark.parametrize("gs_kind", ["static", "dynamic"])
def test_gpu_special_rows_strided_bias(gs_kind, bias_dtype, out_dtype, x_dtype):
    """A zero row (gives the bias exactly), a block with a huge value next to
    tiny ones, rows read through a stride of K + 8 elements (16 bytes for
    fp16 / bf16), bias and output dtypes, static and dynamic global scales."""
    n, k = 1040, 2048
    b, sb, gsw = _weight(n, k, "cuda")
    bias = None if bias_dtype is None else torch.randn(n, device="cuda").to(bias_dtype)
    for m in (1, 5, 8, 16):
        for pad in (0, 8, 64):
            x = _activation(m, k, x_dtype, "cuda", pad=pad)
            if m > 2:
                x[1] = 0
                x[2, 32:48] = torch.randn(16, device="cuda").to(x_dtype) * 1e-3
                x[2, 40] = 3e3
            gs = _static_gs("cuda") if gs_kind == "static" else (E2M1_X_E4M3_MAX / x.float().abs().amax()).float()
            alpha = _alpha(gs, gsw)
            want = _gpu_composite(x, b, sb, gs, alpha, out_dtype, bias)
            for what, out in _gpu_fused(x, b, sb, gs, alpha, out_dtype, bias):
                _assert_same(out, want, f"{what} m={m} pad={pad}")
            _check_gpu(want, x, b, sb, gs, alpha, bias)
            if m > 2:
                zero = torch.zeros(n, device="cuda") if bias is None else bias.float()
                assert torch.equal(want[1], zero.to(out_dtype))


@requires_sm90
@pytest.mark.parametrize("out_dtype", [BF16, F16], ids=str)
def test_gpu_m0_returns_empty(out_dtype):
    b, sb, gsw = _weight(200, 736, "cuda")
    gs = _static_gs("cuda")
    x = torch.empty(0, 736, dtype=BF16, device="cuda")
    outs = _gpu_fused(x, b, sb, gs, _alpha(gs, gsw), out_dtype)
    assert len(outs) == 2
    for what, out in outs:
        assert out.shape == (0, 200) and out.dtype == out_dtype and out.device.type == "cuda", what


@requires_sm90
@pytest.mark.parametrize("path", ["op", "gemv_linear"])
def test_gpu_deterministic_and_cuda_graph(path):
    """Two calls bit-identical; a captured graph (global scale computed on the
    device, no sync) replayed on new values copied into its input equals the
    eager result on them."""
    n, k, m = 6144, 4096, gv.MAX_M_LINEAR
    b, sb, gsw = _weight(n, k, "cuda")
    bias = torch.randn(n, device="cuda", dtype=BF16)
    linear = ops.nvfp4_linear if path == "op" else gv.gemv_linear

    def f(x):
        gs = (E2M1_X_E4M3_MAX / x.float().abs().amax()).float()
        return linear(x, b, sb, gs, _alpha(gs, gsw), BF16, bias)

    x = _activation(m, k, BF16, "cuda")
    with scaledmm.use_backend("nvfp4", gv.NAME):
        first = f(x)  # compile + load outside the capture
        assert torch.equal(first, f(x))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = f(x)
        x.copy_(_activation(m, k, BF16, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        again = f(x)
    assert torch.equal(captured, again)
    assert not torch.equal(captured, first)


@requires_sm90
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("n,k", [(200, 736), (6144, 4096)])
def test_gpu_every_candidate_config(m, n, k):
    """The fused kernel with each valid candidate config equals the GEMM
    kernel with the same config on the quantized activation."""
    b, sb, gsw = _weight(n, k, "cuda")
    x = _activation(m, k, BF16, "cuda")
    gs = (E2M1_X_E4M3_MAX / x.float().abs().amax()).float()
    alpha = _alpha(gs, gsw)
    mb = gv.m_bucket(m)
    tried = 0
    for cfg in gv.candidate_linear_configs(n, k, mb)[:12]:
        assert gv.config_valid(cfg, n, k, mb, quant=True)[0], cfg
        _nan_in_allocator(m, n)
        out = gv.gemv_linear(x, b, sb, gs, alpha, BF16, None, cfg=cfg)
        _assert_same(out, _gpu_composite(x, b, sb, gs, alpha, BF16, None, cfg=cfg), cfg.short())
        tried += 1
    assert tried, "no candidate config is valid for the fused kernel"
