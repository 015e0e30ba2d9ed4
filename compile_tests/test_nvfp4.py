"""NVFP4 ops (nvfp4_quant, swizzle / unswizzle_block_scales, nvfp4_mm,
nvfp4_w4a16_mm) under torch.compile(fullgraph=True, dynamic=True), in
Inductor's code and in torch.export."""

import pytest
import torch

import scaledmm  # noqa: F401  (registers the ops)
from harness import DEVICES, check_dynamic, dynamo_graph, graph_targets, inductor_code

N, K = 200, 640  # never a tested M; K / 16 = 40 scale columns
RANGE = 448.0 * 6.0


def weights(device):
    """Packed weight, swizzled scales and its decode multiplier.  One-element
    tensors are 0-D: tensors a test closes over get dynamic sizes, and a size
    1 would be duck-sized with M = 1 (layer buffers have static sizes)."""
    w = torch.randn(N, K, device=device)
    gs_w = (RANGE / w.abs().amax()).reshape(())
    q, s = torch.ops.scaledmm.nvfp4_quant(w, gs_w, True)
    return q, s, (1.0 / gs_w).reshape(())


def act(m, device, dtype=torch.bfloat16):
    return torch.randn(m, K, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("swizzle", [True, False])
def test_quant_dynamic(device, swizzle):
    gs = torch.tensor(RANGE / 4.0, device=device)

    def f(x):
        return torch.ops.scaledmm.nvfp4_quant(x, gs, swizzle)

    check_dynamic(f, lambda m: (act(m, device),))


@pytest.mark.parametrize("device", DEVICES)
def test_swizzle_roundtrip_dynamic(device):
    """unswizzle takes SymInt rows / cols: M stays symbolic through both layout ops."""
    gs = torch.tensor(RANGE / 4.0, device=device)

    def f(x):
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gs, True)
        lin = torch.ops.scaledmm.unswizzle_block_scales(s, x.shape[0], x.shape[1] // 16)
        return q, lin, torch.ops.scaledmm.swizzle_block_scales(lin)

    cnt = check_dynamic(f, lambda m: (act(m, device),))
    targets = graph_targets(cnt.graphs[0])
    assert "scaledmm.unswizzle_block_scales" in targets and "scaledmm.swizzle_block_scales" in targets
    # and the round trip is the identity on the swizzled scales
    x = act(17, device)
    q, lin, s2 = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)(x)
    assert torch.equal(s2.view(torch.uint8), torch.ops.scaledmm.nvfp4_quant(x, gs, True)[1].view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype,with_bias", [(torch.bfloat16, True), (torch.float32, False),
                                                 (torch.float16, True)])
def test_mm_dynamic(device, out_dtype, with_bias):
    qw, sw, alpha_w = weights(device)
    gs = torch.tensor(RANGE / 4.0, device=device)
    alpha = (alpha_w / gs).reshape(())
    bias = torch.randn(N, dtype=torch.bfloat16, device=device) if with_bias else None

    def f(x):
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gs, True)
        return torch.ops.scaledmm.nvfp4_mm(q, qw, s, sw, alpha, out_dtype, bias)

    check_dynamic(f, lambda m: (act(m, device),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_dynamic(device, dtype):
    qw, sw, alpha_w = weights(device)
    bias = torch.randn(N, dtype=dtype, device=device)

    def f(x):
        return torch.ops.scaledmm.nvfp4_w4a16_mm(x, qw, sw, alpha_w, dtype, bias)

    check_dynamic(f, lambda m: (act(m, device, dtype),))


def test_graph_holds_our_ops():
    qw, sw, alpha_w = weights("cpu")
    gs = torch.tensor(RANGE / 4.0)

    def f(x):
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gs, True)
        return torch.ops.scaledmm.nvfp4_mm(q, qw, s, sw, alpha_w / gs)

    targets = graph_targets(dynamo_graph(f, (act(5, "cpu"),), dynamic=True))
    assert [t for t in targets if t.startswith("scaledmm.")] == ["scaledmm.nvfp4_quant", "scaledmm.nvfp4_mm"]


def test_inductor_calls_our_ops_by_name():
    qw, sw, alpha_w = weights("cpu")
    gs = torch.tensor(RANGE / 4.0)
    alpha = (alpha_w / gs).reshape(())

    def f(x):
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gs, True)
        return (torch.ops.scaledmm.nvfp4_mm(q, qw, s, sw, alpha),
                torch.ops.scaledmm.nvfp4_w4a16_mm(x, qw, sw, alpha_w))

    code = inductor_code(f, (act(3, "cpu"),))
    for op in ("nvfp4_quant", "nvfp4_mm", "nvfp4_w4a16_mm"):
        assert f"torch.ops.scaledmm.{op}.default" in code, op


def test_export_dynamic_batch():
    qw, sw, alpha_w = weights("cpu")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("qw", qw)
            self.register_buffer("sw", sw)
            self.register_buffer("gs", torch.tensor([RANGE / 4.0]))
            self.register_buffer("alpha", alpha_w.reshape(1) / self.gs)

        def forward(self, x):
            q, s = torch.ops.scaledmm.nvfp4_quant(x, self.gs, True)
            return torch.ops.scaledmm.nvfp4_mm(q, self.qw, s, self.sw, self.alpha)

    m = M()
    batch = torch.export.Dim("batch", min=0, max=4096)
    ep = torch.export.export(m, (act(5, "cpu"),), dynamic_shapes=({0: batch},))
    targets = graph_targets(ep.graph_module)
    assert "scaledmm.nvfp4_quant" in targets and "scaledmm.nvfp4_mm" in targets
    for mm in (0, 1, 3, 4, 17, 130):
        x = act(mm, "cpu")
        torch.testing.assert_close(ep.module()(x), m(x), rtol=0, atol=0)
