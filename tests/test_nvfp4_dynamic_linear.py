"""``nvfp4_dynamic_linear`` (ops/nvfp4.py, fake_impls/nvfp4.py, the Triton
backend in ops/nvfp4_triton.py): ``nvfp4_linear`` with the activation's global
scale computed in the op from amax values, ``gs = 448 * 6 / max(max(x_amax),
1e-30)`` and ``alpha = weight_alpha / gs``.  Its result is defined bit for bit
as ``dynamic_scales`` followed by ``nvfp4_linear``.

CPU: every CPU backend and ``reference_dynamic_linear`` equal the definition
over activation / output / bias dtypes, M in 0, 1, 3, 17, strided rows,
amax vectors of every length the layers pass (per row, one value, empty,
more than the Triton quantizer reduces itself); the scales against a float64
computation; zero activations (the floor), NaN in ``x_amax``; bad inputs name
the argument and the fake agrees; opcheck; torch.compile (fullgraph, dynamic
M, the amax reduced in the graph); selection on the CPU and on a pretend
sm90 (the Triton backend).  The Triton quantizer's dynamic mode runs in the
interpreter in tests/test_nvfp4_triton_quant.py.
GPU (sm90): the op on its selected backend against the composite on the GPU
and the CPU reference, bit for bit; alpha's buffer; CUDA graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import check_rejected_alike, opcheck
from hypothesis import given, settings
from hypothesis import strategies as st
from nvfp4_helpers import LINEAR_OPCHECK_CASES, check_gemm, mm_ref64

import scaledmm
from scaledmm import backends
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_triton as nt

ops = torch.ops.scaledmm
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3 = torch.float8_e4m3fn
RANGE = 448.0 * 6.0
requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm90 GPU")


def _weight(n, k, device="cpu"):
    """``(b, b_scales, weight_alpha)``: a random weight quantized with ``448 *
    6 / amax(w)``; ``weight_alpha`` its inverse, float32 [1]."""
    w = torch.randn(n, k, device=device)
    gsw = (RANGE / w.abs().max()).float().reshape(1)
    b, b_scales = ops.nvfp4_quant(w, gsw, True)
    return b, b_scales, 1 / gsw


def _activation(m, k, dtype, device="cpu", pad=0, scale=3.0):
    wide = torch.randn(m, k + pad, device=device) * scale
    return wide.to(dtype)[:, :k]


def _row_amax(x):
    """The layer's per-row amax of the finite values."""
    return x.float().abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=1)


def _amax_kinds(x):
    """The amax vectors a caller may pass: per row, one value (a tensor-parallel
    all-reduce), none (M = 0) and, for M > 0, 300 values (more than the Triton
    quantizer reduces itself; the extra ones smaller)."""
    per_row = _row_amax(x)
    kinds = {"per_row": per_row, "one": per_row.amax().reshape(1) if per_row.numel() else torch.zeros(1)}
    if per_row.numel():
        kinds["long"] = torch.cat([per_row, torch.rand(300) * float(per_row.min())])
    return kinds


def _definition(x, x_amax, b, sb, wa, out_dtype=BF16, bias=None):
    gs, alpha = nv.dynamic_scales(x_amax, wa)
    return ops.nvfp4_linear(x, b, sb, gs, alpha, out_dtype, bias)


def _assert_same(got, want, what=""):
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device, (
        what, got.shape, want.shape, got.dtype, want.dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    diff = (got != want) & ~nan
    assert not diff.any(), f"{what}: {int(diff.sum())} of {got.numel()} elements differ"


# ----------------------------------------------------------------------------
# CPU: the scales, the definition, the float64 bound
# ----------------------------------------------------------------------------


def test_dynamic_scales_against_float64():
    """``gs`` and ``alpha`` are the float32 roundings of the exact quotients
    (one IEEE division each), the amax floored at 1e-30, NaN propagated."""
    torch.manual_seed(0)
    for n in (0, 1, 5, 300):
        a = torch.rand(n) * 10.0 ** torch.randint(-6, 6, (n,)).float()
        wa = torch.rand(1) * 1e-3
        gs, alpha = nv.dynamic_scales(a, wa)
        amax = max(float(a.max()) if n else 0.0, float(torch.tensor(1e-30)))  # the floor as float32
        assert gs.shape == (1,) and gs.dtype == F32 and alpha.shape == (1,) and alpha.dtype == F32
        assert gs.item() == float(torch.tensor(RANGE / amax, dtype=torch.float64).float())
        assert alpha.item() == float(torch.tensor(float(wa) / gs.item(), dtype=torch.float64).float())
    gs, alpha = nv.dynamic_scales(torch.zeros(4), torch.ones(()))  # all-zero: the floor, finite
    assert torch.isfinite(gs).all() and gs.item() == float(torch.tensor(RANGE) / torch.tensor(1e-30))
    gs, alpha = nv.dynamic_scales(torch.tensor([1.0, float("nan"), 2.0]), torch.ones(1))
    assert gs.isnan().all() and alpha.isnan().all()


@pytest.mark.parametrize("x_dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32], ids=str)
def test_op_is_scales_then_linear_bit_for_bit(x_dtype, out_dtype):
    """Every CPU backend of the op and ``reference_dynamic_linear`` against
    ``dynamic_scales`` + ``nvfp4_linear``; within the float64 bound of the
    GEMM of the quantized operands."""
    n, k = 200, 736
    b, sb, wa = _weight(n, k)
    for i, (m, pad) in enumerate((m, pad) for m in (0, 1, 3, 17) for pad in (0, 24)):
        x = _activation(m, k, x_dtype, pad=pad)
        bias = None if i % 3 == 0 else torch.randn(n).to((F32, BF16)[i % 2])
        for kind, x_amax in _amax_kinds(x).items():
            what = f"m={m} pad={pad} amax={kind}"
            want = _definition(x, x_amax, b, sb, wa, out_dtype, bias)
            got = ops.nvfp4_dynamic_linear(x, x_amax, b, sb, wa, out_dtype, bias)
            assert got.shape == (m, n) and got.dtype == out_dtype
            _assert_same(got, want, what)
            _assert_same(nv.reference_dynamic_linear(x, x_amax, b, sb, wa, out_dtype, bias), want, what)
            for name in ("composite", "reference"):
                with scaledmm.use_backend("nvfp4", name):
                    _assert_same(ops.nvfp4_dynamic_linear(x, x_amax, b, sb, wa, out_dtype, bias), want,
                                 f"{name} {what}")
            if m:
                gs, alpha = nv.dynamic_scales(x_amax, wa)
                q, s = ops.nvfp4_quant(x, gs, True)
                check_gemm(got, *mm_ref64(q, b, s, sb, alpha, bias), k, out_dtype)


def test_zero_activation_and_nan_amax():
    """An all-zero activation takes the floor: the output is the bias
    exactly.  A NaN in ``x_amax`` makes every output NaN (the caller's
    per-row amax of finite values never holds one)."""
    n, k = 64, 128
    b, sb, wa = _weight(n, k)
    bias = torch.randn(n)
    x = torch.zeros(3, k, dtype=BF16)
    out = ops.nvfp4_dynamic_linear(x, _row_amax(x), b, sb, wa, F32, bias)
    assert torch.equal(out, bias.expand(3, n))
    x = _activation(3, k, BF16)
    out = ops.nvfp4_dynamic_linear(x, torch.tensor([1.0, float("nan"), 2.0]), b, sb, wa, F32, None)
    assert out.isnan().all()


def test_a_nan_row_leaves_the_other_rows_scaled_by_their_amax():
    """The layer's per-row amax of finite values: a row with NaN / Inf turns
    NaN (its blocks' scales) without changing the global scale of the rest."""
    n, k = 64, 128
    b, sb, wa = _weight(n, k)
    x = _activation(4, k, BF16)
    clean = ops.nvfp4_dynamic_linear(x, _row_amax(x), b, sb, wa, F32)
    x[2, 5] = float("nan")
    x[2, 7] = float("inf")
    x[2, 9] = 0.0  # the finite rest of row 2 may hold the amax
    dirty = ops.nvfp4_dynamic_linear(x, _row_amax(x), b, sb, wa, F32)
    assert dirty[2].isnan().all()
    if _row_amax(x)[2] <= _row_amax(x)[[0, 1, 3]].max():
        assert torch.equal(dirty[[0, 1, 3]], clean[[0, 1, 3]])
    assert torch.isfinite(dirty[[0, 1, 3]]).all()


# ----------------------------------------------------------------------------
# CPU: bad inputs, fake impl, opcheck, compile
# ----------------------------------------------------------------------------


def _good_args(m=5, n=48, k=64):
    b, sb, wa = _weight(n, k)
    x = _activation(m, k, BF16)
    return dict(x=x, x_amax=_row_amax(x), b=b, b_scales=sb, weight_alpha=wa, out_dtype=BF16, bias=None)


def _bad_cases():
    g = _good_args()
    b, sb = g["b"], g["b_scales"]
    return [
        ("x", dict(x=g["x"].to(torch.int32))),
        ("x", dict(x=g["x"].reshape(1, 5, 64))),
        ("x", dict(x=torch.randn(5, 72, dtype=BF16))),  # K % 16
        ("x", dict(x=torch.randn(64, 5, dtype=BF16).t())),  # inner stride
        ("x_amax", dict(x_amax=g["x_amax"].double())),
        ("x_amax", dict(x_amax=g["x_amax"].to(BF16))),
        ("x_amax", dict(x_amax=g["x_amax"].reshape(5, 1))),  # must be 1-D
        ("x_amax", dict(x_amax=torch.tensor(1.0))),
        ("x_amax", dict(x_amax=torch.rand(10)[::2])),  # not contiguous
        ("x_amax", dict(x_amax=torch.rand(5, device="meta"))),
        ("b", dict(b=b.view(torch.int8))),
        ("b", dict(x=torch.randn(5, 80, dtype=BF16), x_amax=torch.rand(5))),  # K of x vs b
        ("b_scales", dict(b_scales=nv.unswizzle_block_scales(sb, 48, 4))),
        ("weight_alpha", dict(weight_alpha=torch.ones(2))),
        ("weight_alpha", dict(weight_alpha=torch.ones(1, dtype=torch.float64))),
        ("out_dtype", dict(out_dtype=torch.int32)),
        ("bias", dict(bias=torch.zeros(47))),
        ("bias", dict(bias=torch.zeros(48, device="meta"))),
    ]


def _call(a):
    return ops.nvfp4_dynamic_linear(a["x"], a["x_amax"], a["b"], a["b_scales"], a["weight_alpha"], a["out_dtype"],
                                    a["bias"])


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_inputs_name_the_argument_and_fake_agrees(i):
    arg, repl = _bad_cases()[i]
    check_rejected_alike(_call, dict(_good_args(), **repl), "nvfp4_dynamic_linear", arg)


def test_fake_and_meta_shapes():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    n, k = 200, 736
    b = torch.empty(n, k // 2, dtype=torch.uint8)
    sb = torch.empty(nv.swizzled_shape(n, k // 16), dtype=E4M3)
    for m in (0, 1, 3, 17, 300):
        with FakeTensorMode() as mode:
            x = torch.empty(m, k + 32, dtype=F16)[:, :k]
            out = ops.nvfp4_dynamic_linear(x, torch.empty(m), mode.from_tensor(b), mode.from_tensor(sb),
                                           torch.ones(1), F32, torch.empty(n, dtype=BF16))
            assert isinstance(out, FakeTensor) and out.shape == (m, n) and out.dtype == F32 and out.is_contiguous()
        meta = torch.device("meta")
        out = ops.nvfp4_dynamic_linear(torch.empty(m, k, dtype=BF16, device=meta), torch.empty(1, device=meta),
                                       b.to(meta), sb.to(meta), torch.ones((), device=meta))
        assert out.device.type == "meta" and out.shape == (m, n) and out.dtype == BF16


def _opcheck_sets():
    sets = []
    for m, n, k, x_dtype, out_dtype, bias_dtype, pad in LINEAR_OPCHECK_CASES:
        b, sb, wa = _weight(n, k)
        x = _activation(m, k, x_dtype, pad=pad)
        bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
        sets.append((x, _row_amax(x), b, sb, wa, out_dtype, bias))
    return sets


@pytest.mark.parametrize("i", range(len(_opcheck_sets())))
def test_opcheck(i):
    opcheck(ops.nvfp4_dynamic_linear.default, _opcheck_sets()[i])


def test_compile_fullgraph_dynamic_one_compile():
    """The per-row amax reduced in the graph, the op after it: one graph for
    every M but the 1 dynamo specializes, equal to eager bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    n, k = 200, 736
    b, sb, wa = _weight(n, k)
    bias = torch.randn(n, dtype=BF16)

    def f(x):
        h = x * 2.0  # a producer the amax can fuse into
        return ops.nvfp4_dynamic_linear(h, _row_amax(h), b, sb, wa, F16, bias)

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, fullgraph=True, dynamic=True, backend=cnt)
    for m in (3, 17, 5):
        x = _activation(m, k, BF16)
        _assert_same(cf(x), f(x), f"m={m}")
    assert cnt.frame_count == 1, f"recompiled: {cnt.frame_count} compiles"
    x = _activation(1, k, BF16)
    _assert_same(cf(x), f(x), "m=1")
    assert cnt.frame_count <= 2


# ----------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------


def test_cpu_selects_composite():
    """On the CPU: ``composite`` (its scales, then ``nvfp4_linear`` as
    selected alone), for the ``nvfp4_linear`` Problem of the activation."""
    g = _good_args(3)
    x = _activation(3, 64, F16, pad=32)
    with backends.record() as calls:
        ops.nvfp4_dynamic_linear(x, _row_amax(x), g["b"], g["b_scales"], g["weight_alpha"], F32, None)
    op, name, p = calls[0]
    assert (op, name) == ("nvfp4_dynamic_linear", "composite")
    assert [c[:2] for c in calls[1:]] == [("nvfp4_linear", "composite"), ("nvfp4_quant", "reference"),
                                          ("nvfp4_mm", "reference")]
    assert p == nv.linear_problem(x, g["b"], F32, None)


def test_sm90_selects_the_triton_quantizer(fake_sm90):
    """On sm90 the op goes to the Triton backend (its quantizer computes the
    scales; the GEMM is then selected alone) for every M: no GEMM backend
    ahead of it implements the op."""
    for m in (1, 8, 17, 300, 4096):
        x = torch.empty(m, 4096, dtype=BF16)
        b = torch.empty(4096, 2048, dtype=torch.uint8)
        p = dataclasses.replace(nv.linear_problem(x, b, BF16, None), device=torch.device("cuda", 0))
        assert backends.select(p, "nvfp4_dynamic_linear").name == "triton", m


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 20), st.integers(1, 64), st.integers(1, 16), st.sampled_from([0, 8, 40]),
       st.sampled_from([1.0, 1e-3, 1e3]), st.booleans(), st.integers(0, 2**31 - 1))
def test_hypothesis_op_is_scales_then_linear(m, n, k16, pad, scale, with_bias, seed):
    torch.manual_seed(seed)
    k = 16 * k16
    b, sb, wa = _weight(n, k)
    x = _activation(m, k, BF16, pad=pad, scale=scale)
    bias = torch.randn(n) if with_bias else None
    x_amax = _row_amax(x)
    _assert_same(ops.nvfp4_dynamic_linear(x, x_amax, b, sb, wa, F32, bias),
                 _definition(x, x_amax, b, sb, wa, F32, bias))


# ----------------------------------------------------------------------------
# GPU: the Triton quantizer's scales, then the selected GEMM
# ----------------------------------------------------------------------------


@requires_sm90
@pytest.mark.parametrize("x_dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("n,k", [(200, 736), (4096, 4096), (6144, 4096)])
@pytest.mark.parametrize("m", [0, 1, 3, 8, 17, 64, 300])
def test_gpu_equals_the_definition_bit_for_bit(m, n, k, x_dtype):
    b, sb, wa = _weight(n, k, "cuda")
    x = _activation(m, k, x_dtype, "cuda", pad=8 if m % 2 else 0)
    bias = torch.randn(n, device="cuda", dtype=BF16) if x_dtype == F16 else None
    for kind, x_amax in _amax_kinds(x.cpu()).items():
        x_amax = x_amax.cuda()
        torch.full((max(m, 1) * n + 1024,), float("nan"), device="cuda")  # freed: the output may reuse it
        with backends.record() as calls:
            got = ops.nvfp4_dynamic_linear(x, x_amax, b, sb, wa, BF16, bias)
        assert calls[0][:2] == ("nvfp4_dynamic_linear", "triton"), calls[0][:2]
        want = _definition(x, x_amax, b, sb, wa, BF16, bias)  # torch scales on the GPU
        _assert_same(got, want, f"amax={kind}")
        if m:  # the quantized activation is the CPU reference's
            gs, alpha = nv.dynamic_scales(x_amax.cpu(), wa.cpu())
            q, s, a = nt.quant_dynamic(x, x_amax, wa)
            rq, rs = nv.reference_quant(x.cpu(), gs, True)
            assert torch.equal(q.cpu(), rq) and torch.equal(s.cpu().view(torch.uint8), rs.view(torch.uint8))
            assert torch.equal(a.cpu(), alpha)


@requires_sm90
def test_gpu_cuda_graph_replays_new_scales():
    """Captured with one activation, replayed on another of a different
    amax: the replay equals eager on the new values (the scales are computed
    on the device on every replay)."""
    n, k, m = 6144, 4096, 8
    b, sb, wa = _weight(n, k, "cuda")

    def f(x):
        return ops.nvfp4_dynamic_linear(x, _row_amax(x), b, sb, wa, BF16, None)

    x = _activation(m, k, BF16, "cuda")
    first = f(x)
    assert torch.equal(first, f(x))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(x)
    x.copy_(_activation(m, k, BF16, "cuda", scale=100.0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, f(x))
    assert not torch.equal(captured, first)
