"""Fp8BlockLinear: accuracy vs the float layer, checkpoint round trip, load-time layout."""

import pytest
import torch

from helpers import rel_err
from scaledmm.layers import Fp8BlockLinear
from scaledmm.ops import fp8_block as ops

DEV = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("k,n", [(256, 192), (300, 200), (128, 17)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float_layer(device, k, n, bias):
    lin = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16, device=device)
    layer = Fp8BlockLinear.from_float(lin)
    for shape in [(0, k), (1, k), (3, k), (2, 5, k)]:
        x = torch.randn(*shape, dtype=torch.bfloat16, device=device)
        y = layer(x)
        assert y.shape == (*shape[:-1], n) and y.dtype == torch.bfloat16
        if x.numel():
            # two e4m3 roundings (weight, activation): ~3.5% RMS; a wrong scale
            # or block index gives O(100%)
            assert rel_err(y, lin(x)) < (0.06 if y.numel() >= 512 else 0.12)
    # exact against the op math on the quantized operands
    x = torch.randn(7, k, dtype=torch.bfloat16, device=device)
    xp = torch.nn.functional.pad(x, (0, layer._k_pad))
    ref = ops.reference_linear(xp, layer.weight, layer.weight_scale_inv, (128, 128), torch.bfloat16,
                               layer.bias)
    # the reference math, bit for bit on the CPU; other kernels on a GPU
    tol = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(layer(x), ref, **tol)


def test_checkpoint_round_trip_and_layout():
    lin = torch.nn.Linear(384, 256, dtype=torch.bfloat16)
    q, s = ops.quantize_weight(lin.weight.detach())
    layer = Fp8BlockLinear.from_checkpoint({"weight": q, "weight_scale_inv": s, "bias": lin.bias.detach()})
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, s)
    # scale rows padded to a multiple of 4 (what cuBLASLt reads), as a view
    assert layer.weight_scale_inv.stride() == (4, 1)
    ptr = layer.weight_scale_inv.data_ptr()
    layer.process_weights_after_loading()  # idempotent: no new copy
    assert layer.weight_scale_inv.data_ptr() == ptr
    sd = layer.state_dict()
    assert set(sd) == {"weight", "weight_scale_inv", "bias"}


def test_checkpoint_errors_name_the_tensor():
    q = torch.randn(64, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        Fp8BlockLinear.from_checkpoint({"weight": q})
    with pytest.raises(ValueError, match="weight_scale_inv"):
        Fp8BlockLinear.from_checkpoint({"weight": q, "weight_scale_inv": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="weight:"):
        Fp8BlockLinear.from_checkpoint({"weight": q.float(), "weight_scale_inv": torch.ones(1, 1)})


def test_compiles_dynamic():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    layer = Fp8BlockLinear.from_float(torch.nn.Linear(256, 160, dtype=torch.bfloat16))
    cnt = CompileCounter()
    cl = torch.compile(layer, backend=cnt, fullgraph=True, dynamic=True)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for m in (1, 3, 4, 17):
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            torch.testing.assert_close(cl(x), layer(x), rtol=0, atol=0)
    assert cnt.frame_count == 1
