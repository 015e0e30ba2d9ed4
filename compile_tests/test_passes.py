"""scaledmm.compile.passes(): each rewrite shows in the post-grad graph, leaves
results unchanged, and keeps the FX graph cache working."""

import pytest
import torch

import scaledmm
import scaledmm.compile as sc
from harness import inductor_code, one_graph_for_all_m
from scaledmm.ops import fp8_block as fb


class BlockModel(torch.nn.Module):
    def __init__(self, n=200, k=640):
        super().__init__()
        w, ws = fb.quantize_weight(torch.randn(n, k))
        self.register_buffer("w", w)
        self.register_buffer("ws", ws)

    def forward(self, x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
        return scaledmm.fp8_block_mm(q, self.w, s, self.ws)


def test_uuid_is_stable():
    assert sc.passes().uuid() == sc.passes().uuid()
    assert isinstance(sc.passes().uuid(), (str, bytes))


def test_fp8_block_cond_lowered_and_quant_fused():
    m = BlockModel()
    p = sc.passes()
    x = torch.randn(3, 640, dtype=torch.bfloat16)
    code = inductor_code(m, (x,), post_grad_custom_post_pass=p)
    assert p.stats["size_conds"] == 1 and p.stats["quant_gemm"] == 1
    assert "torch.ops.scaledmm.fp8_block_linear.default" in code
    assert "cond" not in code and "per_token_group_quant_fp8" not in code
    # without the pass: the cond and both branches are in the code
    code0 = inductor_code(m, (x,))
    assert "padded_fp8_block_mm" in code0 and "per_token_group_quant_fp8" in code0


def test_results_unchanged_across_m():
    m = BlockModel()
    torch._dynamo.reset()
    cm = torch.compile(m, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": sc.passes()})
    with one_graph_for_all_m():
        for mm in (1, 3, 4, 17, 64, 0):
            x = torch.randn(mm, 640, dtype=torch.bfloat16)
            # the fused op skips the M padding of the eager path: fp32 sums may
            # round differently (another summation order), by one bf16 ulp
            torch.testing.assert_close(cm(x), m(x))


def test_pass_leaves_other_graphs_alone():
    p = sc.passes()

    def f(x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, False, True)  # ue8m0: not fusable
        return q.float() * s.repeat_interleave(128, 1)

    x = torch.randn(5, 256, dtype=torch.bfloat16)
    code = inductor_code(f, (x,), post_grad_custom_post_pass=p)
    assert p.stats == {"size_conds": 0, "quant_gemm": 0, "nvfp4_epilogue": 0}
    assert "per_token_group_quant_fp8" in code


class OpaqueBlockModel(BlockModel):
    """quant -> dynamic_padded GEMM: no cond (torch 2.11-2.13 never cache a
    graph holding a torch.cond: 'Can't cache HigherOrderOperator: cond')."""

    def forward(self, x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
        return torch.ops.scaledmm.dynamic_padded_fp8_block_mm(q, self.w, s, self.ws)


def test_fx_graph_cache_hits_with_the_pass():
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    m = OpaqueBlockModel()
    counters.clear()
    x = torch.randn(5, 640, dtype=torch.bfloat16)
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            cm = torch.compile(m, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": sc.passes()})
            cm(x)
        assert counters["inductor"]["fxgraph_cache_miss"] >= 1
        assert counters["inductor"]["fxgraph_cache_hit"] >= 1
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    p = sc.passes()
    code = inductor_code(m, (x,), post_grad_custom_post_pass=p)
    assert p.stats["quant_gemm"] == 1 and "fp8_block_linear" in code


def test_skinny_cond_lowered_to_dynamic_op():
    w = torch.randn(64, 256, dtype=torch.bfloat16)

    def f(x):
        return scaledmm.skinny_linear(x, w)

    p = sc.passes()
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    code = inductor_code(f, (x,), post_grad_custom_post_pass=p)
    assert p.stats["size_conds"] == 1
    assert "torch.ops.scaledmm.dynamic_skinny_linear.default" in code and "cond" not in code
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": sc.passes()})
    with one_graph_for_all_m():
        for m in (1, 5, 16, 17, 40, 0):
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            torch.testing.assert_close(cf(x), f(x))
    ref = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.ops.scaledmm.dynamic_skinny_linear(ref, w),
                               torch.ops.scaledmm.dsv3_fused_a_gemm(ref, w), rtol=0, atol=0)
    from helpers import opcheck

    for m in (0, 3, 20):
        opcheck(torch.ops.scaledmm.dynamic_skinny_linear.default, (torch.randn(m, 256, dtype=torch.bfloat16), w))
