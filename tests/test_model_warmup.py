"""scaledmm.warmup: each distinct layer configuration runs once per M (and
nothing of the model changes); the report names the backends that ran."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import scaledmm
from helpers import requires_cuda
from scaledmm.layers import Fp8BlockLinear, NvFp4Linear, SkinnyLinear


def _model() -> nn.Module:
    torch.manual_seed(0)
    lin = lambda k, n: nn.Linear(k, n, bias=False, dtype=torch.bfloat16)  # noqa: E731
    return nn.ModuleDict({
        "a": Fp8BlockLinear.from_float(lin(256, 128)),
        "b": Fp8BlockLinear.from_float(lin(256, 128)),  # same configuration as "a"
        "c": Fp8BlockLinear.from_float(lin(128, 256)),
        "d": NvFp4Linear.from_float(lin(128, 64), input_amax=4.0),
        "e": SkinnyLinear.from_float(lin(64, 32)),
        "plain": lin(32, 32),  # not ours: left alone
    })


def test_each_configuration_once_per_m_and_nothing_changes():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    seen = []
    for name, mod in model.items():
        mod.register_forward_hook(lambda m, args, out, name=name: seen.append((name, args[0].shape[0])))
    rng = torch.get_rng_state()
    report = scaledmm.warmup(model, ms=(1, 3, 17, 3))
    assert torch.equal(torch.get_rng_state(), rng)
    assert sorted(seen) == sorted((n, m) for n in ("a", "c", "d", "e") for m in (1, 3, 17))
    assert len(report.entries) == 4 * 3
    shared = [e for e in report.entries if "in_features=256, out_features=128" in e.layer]
    assert {e.modules for e in shared} == {("a", "b")}
    assert {e.m for e in report.entries} == {1, 3, 17}
    pairs = report.backends()
    assert ("fp8_block_linear", "reference") in pairs and ("nvfp4_quant", "reference") in pairs
    assert all(e.calls for e in report.entries if not e.layer.startswith("SkinnyLinear"))
    text = str(report)
    assert "Fp8BlockLinear 256->128 a (+1)" in text and "NvFp4Linear 128->64 d" in text
    assert "fp8_block_linear:reference" in text
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_parallel_wrappers_warm_their_local_layer_without_collectives():
    from scaledmm.layers import Fp8Linear
    from scaledmm.layers.parallel import RowParallelLinear

    t = {"weight": torch.randn(32, 96).to(torch.float8_e4m3fn), "weight_scale": torch.tensor(0.01)}
    wrapper = RowParallelLinear.from_checkpoint(Fp8Linear, t, rank=0, world_size=2)  # K shard 48: all-reduce
    calls = []
    wrapper.register_forward_hook(lambda *a: calls.append("wrapper"))  # would all-reduce (no process group here)
    wrapper.inner.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    report = scaledmm.warmup(nn.Sequential(wrapper), ms=(2,))
    assert calls == [torch.Size([2, 48])]
    assert [e.modules for e in report.entries] == [("0.inner",)]


@pytest.mark.parametrize("ms, match", [((), "ms"), ((0,), "ms"), ((1, -2), "ms"), (4, "ms"), ((True,), "ms")])
def test_bad_ms_name_the_argument(ms, match):
    with pytest.raises(ValueError, match=f"warmup: {match}: expected a non-empty sequence of ints >= 1"):
        scaledmm.warmup(_model(), ms=ms)


def test_bad_dtype_names_the_argument():
    with pytest.raises(ValueError, match="warmup: dtype: expected torch.bfloat16 or torch.float16"):
        scaledmm.warmup(_model(), ms=(1,), dtype=torch.float32)


def test_model_without_our_layers_gives_an_empty_report():
    report = scaledmm.warmup(nn.Linear(8, 8), ms=(1,))
    assert report.entries == () and report.backends() == set()


@pytest.mark.gpu
@requires_cuda
def test_gpu_warmup_then_eager_capture_builds_nothing_inside():
    """After warmup at the M a graph is captured for, capture compiles
    nothing (a build or a Triton compile inside capture would raise) and the
    replay equals the eager call."""
    model = _model().cuda()
    scaledmm.warmup(model, ms=(8,))
    x = {n: torch.randn(8, m.in_features, device="cuda", dtype=torch.bfloat16)
         for n, m in model.items() if n != "plain"}
    layers = [n for n in x]
    eager = {n: model[n](x[n]) for n in layers}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = {n: model[n](x[n]) for n in layers}
    g.replay()
    torch.cuda.synchronize()
    for n in layers:
        assert torch.equal(out[n], eager[n]), n


def test_doctest():
    import doctest

    from scaledmm import model_warmup

    result = doctest.testmod(model_warmup, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
