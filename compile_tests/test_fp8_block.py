"""fp8_block ops and the scaledmm.fp8_block_mm entry under torch.compile / export."""

import pytest
import torch

import scaledmm
from harness import DEVICES, check_dynamic, dynamo_graph, graph_targets, inductor_code
from scaledmm.ops import fp8_block as ops

FP8 = torch.float8_e4m3fn


def weights(device, n=200, k=640):
    return ops.quantize_weight(torch.randn(n, k, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_quant_dynamic(device):
    def f(x):
        return torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, True)

    check_dynamic(f, lambda m: (torch.randn(m, 640, dtype=torch.bfloat16, device=device),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["fp8_block_mm", "padded_fp8_block_mm", "dynamic_padded_fp8_block_mm"])
def test_block_mm_ops_dynamic(device, op):
    w, ws = weights(device)
    f_op = getattr(torch.ops.scaledmm, op)

    def f(q, s):
        return f_op(q, w, s, ws)

    def inputs(m):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(torch.randn(m, 640, device=device))
        return q, s

    check_dynamic(f, inputs, ms=(3, 4, 17, 64, 1000, 1, 0) if op != "fp8_block_mm" else (4, 64, 1000, 8, 0))


@pytest.mark.parametrize("device", DEVICES)
def test_entry_and_linear_dynamic(device):
    w, ws = weights(device)
    bias = torch.randn(200, dtype=torch.bfloat16, device=device)

    def f(x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
        y = scaledmm.fp8_block_mm(q, w, s, ws)
        return y, torch.ops.scaledmm.fp8_block_linear(x, w, ws, [128, 128], torch.bfloat16, bias)

    check_dynamic(f, lambda m: (torch.randn(m, 640, dtype=torch.bfloat16, device=device),))


def test_entry_graph_has_cond_when_dynamic_and_one_branch_when_static():
    w, ws = weights("cpu")
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(torch.randn(5, 640))

    def f(q, s):
        return scaledmm.fp8_block_mm(q, w, s, ws)

    dyn = graph_targets(dynamo_graph(f, (q, s), dynamic=True))
    assert "cond" in " ".join(dyn)
    assert "scaledmm.padded_fp8_block_mm" in dyn and "scaledmm.fp8_block_mm" in dyn
    static = graph_targets(dynamo_graph(f, (q, s), dynamic=False))
    assert not any("cond" in t for t in static)
    assert [t for t in static if t.startswith("scaledmm.")] == ["scaledmm.padded_fp8_block_mm"]
    q4, s4 = torch.ops.scaledmm.per_token_group_quant_fp8(torch.randn(8, 640))
    static4 = graph_targets(dynamo_graph(f, (q4, s4), dynamic=False))
    assert [t for t in static4 if t.startswith("scaledmm.")] == ["scaledmm.fp8_block_mm"]


def test_inductor_calls_our_ops_by_name():
    w, ws = weights("cpu")

    def f(x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
        return scaledmm.fp8_block_mm(q, w, s, ws)

    code = inductor_code(f, (torch.randn(3, 640, dtype=torch.bfloat16),))
    assert "torch.ops.scaledmm.per_token_group_quant_fp8.default" in code
    assert "scaledmm.padded_fp8_block_mm.default" in code and "scaledmm.fp8_block_mm.default" in code


def test_export_dynamic_batch():
    w, ws = weights("cpu")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", w)
            self.register_buffer("ws", ws)

        def forward(self, x):
            q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
            return scaledmm.fp8_block_mm(q, self.w, s, self.ws)

    m = M()
    batch = torch.export.Dim("batch", min=0, max=4096)
    ep = torch.export.export(m, (torch.randn(5, 640, dtype=torch.bfloat16),), dynamic_shapes=({0: batch},))
    targets = graph_targets(ep.graph_module)
    assert any("cond" in t for t in targets)
    for mm in (1, 3, 4, 17, 64):
        x = torch.randn(mm, 640, dtype=torch.bfloat16)
        torch.testing.assert_close(ep.module()(x), m(x), rtol=0, atol=0)
