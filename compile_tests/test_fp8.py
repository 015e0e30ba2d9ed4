"""fp8 per-tensor / per-channel ops (quant_fp8, fp8_scaled_mm) under
torch.compile(fullgraph=True, dynamic=True), in Inductor's code and in torch.export."""

import pytest
import torch

import scaledmm  # noqa: F401  (registers the ops)

from harness import DEVICES, check_dynamic, dynamo_graph, graph_targets, inductor_code

N, K = 208, 640  # N, K multiples of 16 (the op's contract) and never a tested M
# Tensors a test function closes over become graph inputs with dynamic sizes;
# one-element scales are 0-D here so that no size 1 is duck-sized with M = 1
# (module parameters, as in the layers, have static sizes).


def weights(device, per_channel=True):
    w, ws = torch.ops.scaledmm.quant_fp8(torch.randn(N, K, device=device), None, per_channel)
    return w, (ws.reshape(-1) if per_channel else ws.reshape(())).clone()  # not a view of a size-1 dim


def act(m, device, dtype=torch.bfloat16):
    return torch.randn(m, K, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["per_tensor", "per_token", "static"])
def test_quant_dynamic(device, mode):
    static = torch.tensor(0.02, device=device)

    def f(x):
        if mode == "static":
            return torch.ops.scaledmm.quant_fp8(x, static)
        return torch.ops.scaledmm.quant_fp8(x, None, mode == "per_token")

    check_dynamic(f, lambda m: (act(m, device),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_token,per_channel,bias_dtype,out_dtype", [
    (True, True, torch.bfloat16, torch.bfloat16),
    (False, False, None, torch.float16),
    (True, False, torch.float32, torch.float32),
])
def test_scaled_mm_dynamic(device, per_token, per_channel, bias_dtype, out_dtype):
    w, ws = weights(device, per_channel)
    bias = None if bias_dtype is None else torch.randn(N, dtype=bias_dtype, device=device)

    def f(x):
        q, s = torch.ops.scaledmm.quant_fp8(x, None, per_token)
        return torch.ops.scaledmm.fp8_scaled_mm(q, w, s, ws, bias, out_dtype)

    check_dynamic(f, lambda m: (act(m, device),))


def test_strided_rows_dynamic():
    """A row stride wider than K (a view into a wider buffer) stays one graph."""
    w, ws = weights("cpu")

    def f(q, s):
        return torch.ops.scaledmm.fp8_scaled_mm(q, w, s, ws)

    def inputs(m):
        q, s = torch.ops.scaledmm.quant_fp8(torch.randn(m, K + 32), None, True)
        return q[:, :K], s

    # M = 3 first: the [M, 1] scale input's size-1 dim is not duck-sized with M
    check_dynamic(f, inputs, ms=(3, 1, 4, 17, 64, 1000, 0))


def test_graph_holds_our_ops():
    w, ws = weights("cpu")

    def f(x):
        q, s = torch.ops.scaledmm.quant_fp8(x, None, True)
        return torch.ops.scaledmm.fp8_scaled_mm(q, w, s, ws)

    targets = graph_targets(dynamo_graph(f, (act(5, "cpu"),), dynamic=True))
    assert [t for t in targets if t.startswith("scaledmm.")] == ["scaledmm.quant_fp8", "scaledmm.fp8_scaled_mm"]


def test_inductor_calls_our_ops_by_name():
    w, ws = weights("cpu")
    bias = torch.randn(N, dtype=torch.bfloat16)

    def f(x):
        q, s = torch.ops.scaledmm.quant_fp8(x)
        return torch.ops.scaledmm.fp8_scaled_mm(q, w, s, ws, bias)

    code = inductor_code(f, (act(3, "cpu"),))
    assert "torch.ops.scaledmm.quant_fp8.default" in code
    assert "torch.ops.scaledmm.fp8_scaled_mm.default" in code


def test_export_dynamic_batch():
    w, ws = weights("cpu")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", w)
            self.register_buffer("ws", ws)

        def forward(self, x):
            q, s = torch.ops.scaledmm.quant_fp8(x, None, True)
            return torch.ops.scaledmm.fp8_scaled_mm(q, self.w, s, self.ws)

    m = M()
    batch = torch.export.Dim("batch", min=0, max=4096)
    ep = torch.export.export(m, (act(5, "cpu"),), dynamic_shapes=({0: batch},))
    targets = graph_targets(ep.graph_module)
    assert "scaledmm.quant_fp8" in targets and "scaledmm.fp8_scaled_mm" in targets
    for mm in (0, 1, 3, 4, 17, 64):
        x = act(mm, "cpu")
        torch.testing.assert_close(ep.module()(x), m(x), rtol=0, atol=0)
