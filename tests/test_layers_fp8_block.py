"""Fp8BlockLinear: accuracy vs the float layer, checkpoint round trip, load-time layout."""

import pytest
import torch

from helpers import rel_err
from layer_reference import check_within, fp8_block_layer_model, fp8_block_weight
from scaledmm.layers import Fp8BlockLinear
from scaledmm.ops import fp8_block as ops

DEV = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("k,n", [(256, 192), (300, 200), (128, 17)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float_layer(device, k, n, bias):
    lin = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16, device=device)
    with torch.no_grad():  # magnitudes that differ per 128 x 128 block, so a wrong block scale shows
        g = torch.Generator().manual_seed(k + n)
        f = 2.0 ** torch.randint(-3, 4, ((n + 127) // 128, (k + 127) // 128), generator=g)
        lin.weight.mul_(f.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k].to(lin.weight))
    layer = Fp8BlockLinear.from_float(lin)
    for shape in [(0, k), (1, k), (3, k), (2, 5, k)]:
        x = torch.randn(*shape, dtype=torch.bfloat16, device=device)
        y = layer(x)
        assert y.shape == (*shape[:-1], n) and y.dtype == torch.bfloat16
        if x.numel():
            # two e4m3 roundings (weight, activation): ~3.5% RMS; a wrong scale
            # or block index gives O(100%)
            assert rel_err(y, lin(x)) < (0.06 if y.numel() >= 512 else 0.12)
    # against a float64 model of the stored codes and scales (tests/layer_reference.py):
    # the activation quantized by the SPEC recipe, so only fp32 accumulation and output
    # rounding are left; on a GPU a kernel may round an activation code differently
    gen = torch.Generator().manual_seed(k * 1000 + n)
    for m in (0, 1, 3, 17):
        x = (torch.randn(m, k, generator=gen) * 10.0 ** torch.randint(-2, 2, (m, 1), generator=gen))
        x = x.to(torch.bfloat16).to(device)
        y = layer(x)
        ref, bound = fp8_block_layer_model(x.cpu(), layer.weight.cpu(), layer.weight_scale_inv.cpu(),
                                           None if layer.bias is None else layer.bias.cpu(), n)
        if device != "cpu":  # one e4m3 step (2^-3 relative) on any activation element
            bound = bound + 2.0 ** -3 * (x.cpu().double().abs() @ fp8_block_weight(
                layer.weight.cpu(), layer.weight_scale_inv.cpu(), n, k).abs().t())
        check_within(y, ref, bound, torch.bfloat16)


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
