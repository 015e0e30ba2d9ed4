"""Skinny bf16 GEMM: dsv3_fused_a_gemm, dynamic_skinny_linear and the
scaledmm.skinny_linear entry (a torch.cond on M <= 16) under
torch.compile(fullgraph=True, dynamic=True), in Inductor's code and in torch.export."""

import pytest
import torch

import scaledmm
from harness import (DEVICES, M_VALUES, check_dynamic, cond_branches, dynamo_graph, graph_targets,
                     inductor_code)

N, K = 208, 640  # N % 16 == 0, K % 128 == 0, never a tested M
SKINNY_MS = (1, 3, 4, 16, 5, 0)  # the op itself takes M <= 16


def weight(device):
    return torch.randn(N, K, dtype=torch.bfloat16, device=device)


def act(m, device, row_stride=K):
    x = torch.randn(m, row_stride, dtype=torch.bfloat16, device=device)
    return x[:, :K]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row_stride", [K, K + 64])
def test_fused_a_op_dynamic(device, row_stride):
    w = weight(device)

    def f(x):
        return torch.ops.scaledmm.dsv3_fused_a_gemm(x, w)

    check_dynamic(f, lambda m: (act(m, device, row_stride),), ms=SKINNY_MS)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_skinny_linear_op_dynamic(device):
    w = weight(device)

    def f(x):
        return torch.ops.scaledmm.dynamic_skinny_linear(x, w)

    check_dynamic(f, lambda m: (act(m, device),), ms=(1, 3, 4, 16, 17, 64, 1000, 0))


@pytest.mark.parametrize("device", DEVICES)
def test_entry_dynamic(device):
    w = weight(device)

    def f(x):
        return scaledmm.skinny_linear(x, w)

    check_dynamic(f, lambda m: (act(m, device),), ms=(1, 3, 4, 16, 17, 64, 1000, 0))


def test_entry_graph_has_cond_when_dynamic_and_one_branch_when_static():
    w = weight("cpu")

    def f(x):
        return scaledmm.skinny_linear(x, w)

    dyn = dynamo_graph(f, (act(5, "cpu"),), dynamic=True)
    conds = cond_branches(dyn)
    assert len(conds) == 1
    true_branch, false_branch = conds[0]
    assert [t for t in true_branch if t.startswith("scaledmm.")] == ["scaledmm.dsv3_fused_a_gemm"]
    assert not any(t.startswith("scaledmm.") for t in false_branch)
    assert any("linear" in t for t in false_branch)
    small = graph_targets(dynamo_graph(f, (act(5, "cpu"),), dynamic=False))
    assert not any("cond" in t for t in small)
    assert [t for t in small if t.startswith("scaledmm.")] == ["scaledmm.dsv3_fused_a_gemm"]
    big = graph_targets(dynamo_graph(f, (act(40, "cpu"),), dynamic=False))
    assert not any("cond" in t or t.startswith("scaledmm.") for t in big)


def test_entry_without_kernel_conditions_is_plain_linear():
    """fp16 (or K % 128 != 0) never reaches the fused-A op: no cond, one graph."""
    w16 = torch.randn(N, K, dtype=torch.float16)

    def f(x):
        return scaledmm.skinny_linear(x, w16)

    cnt = check_dynamic(f, lambda m: (torch.randn(m, K, dtype=torch.float16),))
    targets = graph_targets(cnt.graphs[0])
    assert not any("cond" in t or t.startswith("scaledmm.") for t in targets)


def test_inductor_calls_our_op_by_name():
    w = weight("cpu")

    def f(x):
        return scaledmm.skinny_linear(x, w), torch.ops.scaledmm.dynamic_skinny_linear(x, w)

    code = inductor_code(f, (act(3, "cpu"),))
    assert "torch.ops.scaledmm.dsv3_fused_a_gemm.default" in code
    assert "torch.ops.scaledmm.dynamic_skinny_linear.default" in code


def test_export_dynamic_batch():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", weight("cpu"))

        def forward(self, x):
            return scaledmm.skinny_linear(x, self.w)

    m = M()
    batch = torch.export.Dim("batch", min=0, max=4096)
    ep = torch.export.export(m, (act(5, "cpu"),), dynamic_shapes=({0: batch},))
    conds = cond_branches(ep.graph_module)
    assert len(conds) == 1 and "scaledmm.dsv3_fused_a_gemm" in conds[0][0]
    for mm in M_VALUES + (16,):
        x = act(mm, "cpu")
        torch.testing.assert_close(ep.module()(x), m(x), rtol=0, atol=0)
