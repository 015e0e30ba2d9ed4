"""The NVFP4 ops as torch ops: ValueErrors naming the argument, opcheck,
FakeTensor shapes, torch.compile with dynamic shapes."""

from __future__ import annotations

import pytest
import torch

import scaledmm  # noqa: F401  (registers the ops)
from scaledmm.ops import nvfp4 as N

from helpers import opcheck
from nvfp4_helpers import gs_for, quantized

ops = torch.ops.scaledmm
E4M3 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------
# Bad inputs: ValueError naming the argument
# ----------------------------------------------------------------------------


def _mm_args(m=5, n=16, k=64):
    _, a, sa, ga = quantized(m, k)
    _, b, sb, gb = quantized(n, k)
    return dict(a=a, b=b, a_scales=sa, b_scales=sb, alpha=(1 / ga) * (1 / gb))


def _bad_cases():
    x = torch.randn(5, 64)
    gs = torch.tensor(1.0)
    mm = _mm_args()
    w = dict(x=torch.randn(5, 64, dtype=torch.bfloat16), b=mm["b"], b_scales=mm["b_scales"],
             weight_alpha=torch.tensor(1.0))

    def q(**kw):
        args = dict(x=x, global_scale=gs)
        args.update(kw)
        return lambda: ops.nvfp4_quant(args["x"], args["global_scale"], True)

    def g(**kw):
        args = dict(mm, out_dtype=torch.bfloat16, bias=None)
        args.update(kw)
        return lambda: ops.nvfp4_mm(args["a"], args["b"], args["a_scales"], args["b_scales"], args["alpha"],
                                    args["out_dtype"], args["bias"])

    def h(**kw):
        args = dict(w, out_dtype=torch.bfloat16, bias=None)
        args.update(kw)
        return lambda: ops.nvfp4_w4a16_mm(args["x"], args["b"], args["b_scales"], args["weight_alpha"],
                                          args["out_dtype"], args["bias"])

    lin = N.unswizzle_block_scales(mm["a_scales"], 5, 4)
    return [
        ("x", q(x=x.to(torch.int32))),
        ("x", q(x=torch.randn(2, 5, 64))),
        ("x", q(x=torch.randn(5, 24))),
        ("x", q(x=torch.randn(5, 0))),
        ("x", q(x=torch.randn(64, 5).t())),
        ("global_scale", q(global_scale=torch.tensor(1.0, dtype=torch.float64))),
        ("global_scale", q(global_scale=torch.ones(2))),
        ("global_scale", q(global_scale=torch.tensor(1.0, device="meta"))),
        ("a", g(a=mm["a"].view(E4M3))),
        ("a", g(a=torch.zeros(5, 12, dtype=torch.uint8))),
        ("a", g(a=torch.zeros(64, 5, dtype=torch.uint8).t())),
        ("b", g(b=torch.zeros(32, 16, dtype=torch.uint8).t())),
        ("b", g(b=torch.zeros(16, 24, dtype=torch.uint8))),
        ("a_scales", g(a_scales=lin)),
        ("a_scales", g(a_scales=mm["a_scales"].float())),
        ("b_scales", g(b_scales=torch.zeros(256, 4, dtype=E4M3))),
        ("b_scales", g(b_scales=torch.zeros(4, 128, dtype=E4M3).t())),
        ("alpha", g(alpha=torch.ones(2))),
        ("alpha", g(alpha=torch.tensor(1, dtype=torch.int32))),
        ("out_dtype", g(out_dtype=torch.int32)),
        ("bias", g(bias=torch.zeros(15))),
        ("bias", g(bias=torch.zeros(16, dtype=torch.int64))),
        ("bias", g(bias=torch.zeros(16, device="meta"))),
        ("x", h(x=torch.randn(5, 64))),
        ("b", h(x=torch.randn(5, 80, dtype=torch.bfloat16))),
        ("b_scales", h(b_scales=N.unswizzle_block_scales(mm["b_scales"], 16, 4))),
        ("weight_alpha", h(weight_alpha=torch.ones(3))),
        ("out_dtype", h(out_dtype=torch.float64)),
        ("s", lambda: ops.swizzle_block_scales(torch.zeros(4, dtype=E4M3))),
        ("s", lambda: ops.unswizzle_block_scales(torch.zeros(128, 4, dtype=E4M3), 5, 8)),
        ("s", lambda: ops.unswizzle_block_scales(torch.zeros(4, 128, dtype=E4M3).t(), 5, 4)),
        ("rows", lambda: N.unswizzle_block_scales(torch.zeros(128, 4, dtype=E4M3), -1, 4)),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_inputs_name_the_argument(i):
    arg, fn = _bad_cases()[i]
    with pytest.raises(ValueError, match=rf": {arg}: expected"):
        fn()


# ----------------------------------------------------------------------------
# opcheck, FakeTensor, torch.compile
# ----------------------------------------------------------------------------


def _opcheck_sets():
    sets = []
    for m, k, n, dtype in [(0, 32, 16, torch.bfloat16), (1, 48, 8, torch.float16), (17, 80, 40, torch.float32),
                           (130, 16, 3, torch.bfloat16)]:
        x = torch.randn(m, k).to(dtype)
        gs = gs_for(x)
        sets.append((ops.nvfp4_quant.default, (x, gs), {"swizzle": True}))
        sets.append((ops.nvfp4_quant.default, (x, gs.reshape(1), False), {}))
        a, sa = ops.nvfp4_quant(x, gs, True)
        _, b, sb, gb = quantized(n, k)
        alpha = (1 / gs) * (1 / gb)
        bias = torch.randn(n, dtype=torch.bfloat16)
        sets.append((ops.nvfp4_mm.default, (a, b, sa, sb, alpha), {}))
        sets.append((ops.nvfp4_mm.default, (a, b, sa, sb, alpha.reshape(1), torch.float32, bias), {}))
        xh = x.to(torch.float16)
        sets.append((ops.nvfp4_w4a16_mm.default, (xh, b, sb, 1 / gb), {"bias": bias}))
        sets.append((ops.nvfp4_w4a16_mm.default, (xh, b, sb, (1 / gb).reshape(1), torch.float16), {}))
        sets.append((ops.swizzle_block_scales.default, (N.unswizzle_block_scales(sa, m, k // 16),), {}))
        sets.append((ops.unswizzle_block_scales.default, (sa, m, k // 16), {}))
    return sets


def test_opcheck_every_op():
    seen = set()
    for op, args, kwargs in _opcheck_sets():
        opcheck(op, args, kwargs)
        seen.add(op.name())
    assert seen == {"scaledmm::nvfp4_quant", "scaledmm::nvfp4_mm", "scaledmm::nvfp4_w4a16_mm",
                    "scaledmm::swizzle_block_scales", "scaledmm::unswizzle_block_scales"}


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for m in (0, 1, 3, 129, 300):
            x = torch.empty(m, 80, dtype=torch.bfloat16)
            gs = torch.empty(())
            q, s = ops.nvfp4_quant(x, gs)
            assert q.shape == (m, 40) and q.dtype == torch.uint8
            assert s.shape == ((m + 127) // 128 * 128, 8) and s.dtype == E4M3
            q2, s2 = ops.nvfp4_quant(x, gs, False)
            assert s2.shape == (m, 5)
            b = torch.empty(24, 40, dtype=torch.uint8)
            sb = torch.empty(128, 8, dtype=E4M3)
            out = ops.nvfp4_mm(q, b, s, sb, gs, torch.float16)
            assert out.shape == (m, 24) and out.dtype == torch.float16
            out = ops.nvfp4_w4a16_mm(x, b, sb, gs)
            assert out.shape == (m, 24) and out.dtype == torch.bfloat16
            assert ops.unswizzle_block_scales(s, m, 5).shape == (m, 5)
            assert ops.swizzle_block_scales(s2).shape == s.shape
        with pytest.raises(ValueError, match="a_scales"):
            ops.nvfp4_mm(q, b, s2, sb, gs)


def test_compile_dynamic_one_graph_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    n, k = 24, 80
    _, b, sb, gb = quantized(n, k)
    bias = torch.randn(n, dtype=torch.bfloat16)

    def f(x, gs):
        q, s = ops.nvfp4_quant(x, gs)
        y = ops.nvfp4_mm(q, b, s, sb, (1 / gs) * (1 / gb), torch.bfloat16, bias)
        z = ops.nvfp4_w4a16_mm(x, b, sb, 1 / gb, torch.float32)
        lin = ops.unswizzle_block_scales(s, x.shape[0], k // 16)
        return y.float() + 1.0, z, ops.swizzle_block_scales(lin)

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, backend=cnt, fullgraph=True, dynamic=True)
    for m in (2, 3, 17, 40):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        gs = gs_for(x)
        for got, exp in zip(cf(x, gs), f(x, gs)):
            assert got.shape == exp.shape and got.dtype == exp.dtype
            assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3 else got,
                               exp.view(torch.uint8) if exp.dtype == E4M3 else exp)
    assert cnt.frame_count == 1, f"recompiled: {cnt.frame_count} compiles"
