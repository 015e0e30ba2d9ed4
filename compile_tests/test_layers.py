"""Every scaledmm layer (Fp8BlockLinear, Fp8Linear, NvFp4Linear, SkinnyLinear)
under torch.compile(fullgraph=True, dynamic=True) (one compile for every M, no
graph break, compiled == eager), in torch.export, and a model of all four in
Inductor with and without scaledmm.compile.passes()."""

import pytest
import torch

import scaledmm  # noqa: F401  (registers the ops)
import scaledmm.compile as sc
from harness import DEVICES, check_dynamic, graph_targets, inductor_code, one_graph_for_all_m
from helpers import rel_err
from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear, SkinnyLinear

BF16 = torch.bfloat16

# (name, factory(device)): K and N never equal a tested M; the unaligned ones
# exercise load-time weight padding and forward-time activation padding.
LAYERS = {
    "fp8_block": lambda d: Fp8BlockLinear.from_float(torch.nn.Linear(640, 200, dtype=BF16, device=d)),
    "fp8_block_kpad": lambda d: Fp8BlockLinear.from_float(
        torch.nn.Linear(600, 200, bias=False, dtype=BF16, device=d)),
    "fp8_tensor": lambda d: Fp8Linear.from_float(torch.nn.Linear(630, 200, dtype=BF16, device=d)),
    "fp8_channel_token": lambda d: Fp8Linear.from_float(
        torch.nn.Linear(640, 200, dtype=BF16, device=d), per_channel=True, activation="dynamic_per_token"),
    "fp8_static": lambda d: Fp8Linear.from_float(
        torch.nn.Linear(630, 208, bias=False, dtype=BF16, device=d), activation="static", input_scale=4.0 / 448),
    "nvfp4_static": lambda d: NvFp4Linear.from_float(torch.nn.Linear(640, 200, dtype=BF16, device=d),
                                                     input_amax=4.0),
    "nvfp4_dynamic": lambda d: NvFp4Linear.from_float(torch.nn.Linear(608, 200, bias=False, dtype=BF16, device=d)),
    "nvfp4_w4a16": lambda d: NvFp4Linear.from_float(torch.nn.Linear(640, 200, dtype=BF16, device=d),
                                                    use_w4a16=True),
    "skinny": lambda d: SkinnyLinear.from_float(torch.nn.Linear(640, 208, bias=False, dtype=BF16, device=d)),
    "skinny_bias": lambda d: SkinnyLinear.from_float(torch.nn.Linear(640, 208, dtype=BF16, device=d)),
    "skinny_fallback": lambda d: SkinnyLinear.from_float(torch.nn.Linear(640, 200, dtype=BF16, device=d)),
}

# the scaledmm ops each layer's graph must call
LAYER_OPS = {
    "fp8_block": {"scaledmm.fp8_block_linear"},
    "fp8_block_kpad": {"scaledmm.fp8_block_linear"},
    "fp8_tensor": {"scaledmm.fp8_linear"},
    "fp8_channel_token": {"scaledmm.fp8_linear"},
    "fp8_static": {"scaledmm.fp8_linear"},
    "nvfp4_static": {"scaledmm.nvfp4_linear"},
    "nvfp4_dynamic": {"scaledmm.nvfp4_dynamic_linear"},
    "nvfp4_w4a16": {"scaledmm.nvfp4_w4a16_mm"},
    "skinny": {"scaledmm.dsv3_fused_a_gemm"},
    "skinny_bias": {"scaledmm.dsv3_fused_a_gemm"},
    "skinny_fallback": set(),
}


def act(m, k, device):
    return torch.randn(m, k, dtype=BF16, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_dynamic(device, name):
    layer = LAYERS[name](device)
    k = layer.in_features
    cnt = check_dynamic(layer, lambda m: (act(m, k, device),))
    ours = {t for t in graph_targets(cnt.graphs[0]) if t.startswith("scaledmm.")}
    assert ours == LAYER_OPS[name]


def test_any_m_one_graph_per_layer():
    """Hypothesis draws (layer, M); each layer is compiled once, on its first
    M, and every later M runs the same graph and equals eager."""
    from hypothesis import given, settings, strategies as st
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    names = ["fp8_block_kpad", "fp8_channel_token", "fp8_static", "nvfp4_static", "skinny_bias", "skinny_fallback"]
    compiled = {}

    @settings(max_examples=30, deadline=None, derandomize=False)
    @given(name=st.sampled_from(names), m=st.integers(0, 300), seed=st.integers(0, 2**31 - 1))
    def check(name, m, seed):
        torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
        if name not in compiled:
            layer = LAYERS[name]("cpu")
            cnt = CompileCounterWithBackend("aot_eager")
            compiled[name] = (layer, cnt, torch.compile(layer, backend=cnt, fullgraph=True, dynamic=True))
        layer, cnt, cfn = compiled[name]
        x = act(m, layer.in_features, "cpu")
        with one_graph_for_all_m():
            got = cfn(x)
        torch.testing.assert_close(got, layer(x), rtol=0, atol=0)
        assert cnt.frame_count == 1, (name, m)

    check()


@pytest.mark.parametrize("name", ["fp8_block_kpad", "fp8_tensor", "nvfp4_dynamic", "skinny_bias"])
def test_layer_dynamic_leading_dims(name):
    """[B, T, K] inputs: the leading dims flatten into M without a recompile.
    (T = 0 is left out: torch gives an empty [3, 0, K] tensor the strides of
    [3, 1, K], which fails the contiguity guard of every other T.)"""
    layer = LAYERS[name]("cpu")
    k = layer.in_features
    check_dynamic(layer, lambda m: (torch.randn(3, m, k, dtype=BF16),), ms=(5, 1, 2, 7, 16))


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_export_dynamic_batch(name):
    layer = LAYERS[name]("cpu")
    k = layer.in_features
    batch = torch.export.Dim("batch", min=0, max=4096)
    ep = torch.export.export(layer, (act(5, k, "cpu"),), dynamic_shapes=({0: batch},))
    assert {t for t in graph_targets(ep.graph_module) if t.startswith("scaledmm.")} >= LAYER_OPS[name]
    run = ep.module()
    for m in (0, 1, 3, 4, 17, 64):
        x = act(m, k, "cpu")
        torch.testing.assert_close(run(x), layer(x), rtol=0, atol=0)


class AllLayers(torch.nn.Module):
    """skinny (fused q/kv-a) -> fp8 block -> NVFP4 -> fp8 (padded N), with residuals."""

    def __init__(self, hidden=640, device="cpu"):
        super().__init__()

        def lin(k, n, bias=False):
            return torch.nn.Linear(k, n, bias=bias, dtype=BF16, device=device)

        floats = (lin(hidden, 384), lin(384, hidden), lin(hidden, hidden, True), lin(hidden, 200, True))
        self.a = SkinnyLinear.from_float(floats[0])
        self.b = Fp8BlockLinear.from_float(floats[1])
        self.c = NvFp4Linear.from_float(floats[2])
        self.d = Fp8Linear.from_float(floats[3], per_channel=True)
        self.float_layers = tuple(f.double() for f in floats)  # a tuple: not submodules

    def forward(self, x):
        h = x + self.b(self.a(x))
        h = h + self.c(torch.relu(h))
        return self.d(h)

    def float64_forward(self, x):
        a, b, c, d = self.float_layers
        x = x.double()
        h = x + b(a(x))
        h = h + c(torch.relu(h))
        return d(h)


def test_all_layers_inductor_with_and_without_pass():
    model = AllLayers()
    x = act(3, 640, "cpu")
    p = sc.passes()
    code = inductor_code(model, (x,), post_grad_custom_post_pass=p)
    assert p.stats["size_conds"] == 1  # skinny_linear's cond -> dynamic_skinny_linear
    for op in ("dynamic_skinny_linear", "fp8_block_linear", "fp8_linear", "nvfp4_dynamic_linear"):
        assert f"torch.ops.scaledmm.{op}.default" in code, op
    code0 = inductor_code(model, (x,))
    assert "torch.ops.scaledmm.dsv3_fused_a_gemm.default" in code0
    assert "torch.ops.scaledmm.dynamic_skinny_linear" not in code0

    torch._dynamo.reset()
    cm = torch.compile(model, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": sc.passes()})
    with one_graph_for_all_m():
        for m in (3, 1, 16, 17, 64, 0):
            x = act(m, 640, "cpu")
            got, want = cm(x), model(x)
            assert got.shape == want.shape == (m, 200) and got.dtype == want.dtype
            if m == 0:
                continue
            # Inductor fuses the bf16 adds between our ops (h stays fp32, one
            # rounding fewer), which moves some activations across an fp8 / fp4
            # code boundary: compiled and eager then differ by about one
            # quantization step (2-3 %).  Both must be as close to the float64
            # model as quantization allows.
            ref = model.float64_forward(x)
            err_eager, err_compiled = rel_err(want, ref), rel_err(got, ref)
            assert err_eager < 0.1 and err_compiled < 1.2 * err_eager, (err_eager, err_compiled)
            assert rel_err(got, want) < 0.06
