"""scaledmm.quantize_ / QuantConfig / quantize_report on plain nn.Modules (CPU)."""

import copy

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import scaledmm
from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear
from scaledmm.quantize import FORMATS, QuantConfig

from checkpoint_helpers import dequantize_layer

LAYER = {"fp8_block": Fp8BlockLinear, "fp8": Fp8Linear, "fp8_tensor": Fp8Linear, "nvfp4": NvFp4Linear,
         "nvfp4_w4a16": NvFp4Linear}

# Relative Frobenius error of a dequantized weight.  e4m3 rounds to nearest
# with 3 mantissa bits: |error| <= 2^-4 |w| per element (values above the
# subnormal range, i.e. > 2^-6 * scale = amax / 28672: their absolute error is
# below 2^-10 * scale and adds less than 1e-4 here), so the norm error is
# <= 2^-4 of the norm.  nvfp4: the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} x
# block scale (amax/6) has steps of amax/12 .. amax/3 per element; for Gaussian
# blocks that is an RMS error of ~0.1 of the RMS value (plus the e4m3 rounding
# of the block scale, <= 2^-4); 0.15 bounds it.
WEIGHT_BOUND = {"fp8_block": 2**-4 + 1e-4, "fp8": 2**-4 + 1e-4, "fp8_tensor": 2**-4 + 1e-4,
                "nvfp4": 0.15, "nvfp4_w4a16": 0.15}


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.attn = nn.Linear(256, 256, bias=False, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(256, 384, dtype=dtype), nn.GELU(), nn.Linear(384, 256, dtype=dtype))

    def forward(self, h):
        return h + self.mlp(self.attn(h))


class Toy(nn.Module):
    """Nested names (ModuleList, Sequential), an odd K, an output head."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dtype) for _ in range(2)])
        self.side = nn.Linear(100, 256, dtype=dtype)  # K = 100: not a multiple of 16
        self.lm_head = nn.Linear(256, 64, bias=False, dtype=dtype)

    def forward(self, x, y):
        h = x + self.side(y)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(h)


def _inputs(dtype=torch.bfloat16, m=3):
    return torch.randn(m, 5, 256, dtype=dtype), torch.randn(m, 5, 100, dtype=dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_swaps_accepted_linears_with_the_layers_from_float(fmt):
    model = Toy()
    orig = copy.deepcopy(model)
    assert scaledmm.quantize_(model, fmt) is model
    config = QuantConfig.of(fmt)
    for fqn, lin in orig.named_modules():
        if not isinstance(lin, nn.Linear):
            continue
        new = model.get_submodule(fqn)
        if fqn == "lm_head" or (fmt.startswith("nvfp4") and fqn == "side"):
            assert new is not None and type(new) is nn.Linear and torch.equal(new.weight, lin.weight), fqn
            continue
        assert type(new) is LAYER[fmt], fqn
        # exactly the layer the format's from_float builds, on fresh rows (M = 0, 1, 17 too)
        for m in (0, 1, 17):
            x = torch.randn(m, lin.in_features, dtype=torch.bfloat16)
            assert torch.equal(new(x), config.quantize(lin)(x)), (fqn, m)
        assert _rel(dequantize_layer(new), lin.weight) <= WEIGHT_BOUND[fmt], fqn
    report = scaledmm.quantize_report(model)
    assert report["lm_head"].fmt is None and report["lm_head"].detail == "lm_head (output head)"
    side = report["side"]
    if fmt.startswith("nvfp4"):
        assert side.fmt is None and side.detail == "K=100 is not a multiple of 16 (nvfp4 scale blocks)"
    else:
        assert side.fmt == fmt
    assert len(report.swapped) == 6 + (not fmt.startswith("nvfp4"))
    x, y = _inputs()
    out = model(x, y)
    assert out.shape == (3, 5, 64) and out.dtype == torch.bfloat16 and out.isfinite().all()


def test_unknown_format_lists_the_formats_and_changes_nothing():
    model = Toy()
    for bad in ("int4", "FP8", None, 8):
        with pytest.raises(ValueError, match="fmt") as info:
            scaledmm.quantize_(model, bad)
        assert all(f"'{f}'" in str(info.value) for f in FORMATS), str(info.value)
    assert not any(type(m) in LAYER.values() for m in model.modules())
    with pytest.raises(ValueError, match="fmt"):
        QuantConfig("int8")


@pytest.mark.parametrize("kwargs, arg", [
    (dict(fmt="fp8", activation="static"), "activation"),
    (dict(fmt="nvfp4", activation="dynamic"), "activation"),
    (dict(fmt="fp8_block", block_size=(128,)), "block_size"),
    (dict(fmt="fp8_block", block_size=(0, 128)), "block_size"),
    (dict(fmt="fp8", out_dtype=torch.int8), "out_dtype"),
    (dict(fmt="fp8", skip="lm_head"), "skip"),
])
def test_quant_config_rejects_bad_options(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        QuantConfig(**kwargs)


def test_quant_config_options_reach_the_layers():
    lin = nn.Linear(256, 192, dtype=torch.bfloat16)
    assert QuantConfig("fp8").quantize(lin).activation == "dynamic_per_token"
    assert QuantConfig("fp8_tensor").quantize(lin).activation == "dynamic"
    layer = QuantConfig("fp8", activation="dynamic").quantize(lin)
    assert layer.per_channel and layer.activation == "dynamic"
    assert QuantConfig("fp8_block", block_size=(64, 128)).quantize(lin).block_size == (64, 128)
    assert QuantConfig("nvfp4", out_dtype=torch.float32).quantize(lin).out_dtype == torch.float32
    assert QuantConfig("nvfp4_w4a16").quantize(lin).use_w4a16
    # skip: names left by the default filter
    model = scaledmm.quantize_(Toy(), QuantConfig("fp8", skip=("attn", "lm_head")))
    assert type(model.blocks[0].attn) is nn.Linear and type(model.lm_head) is nn.Linear
    assert type(model.blocks[0].mlp[0]) is Fp8Linear


def test_filter_fn_replaces_the_name_rule_and_sees_every_linear_once():
    model = Toy()
    seen = []

    def want(module, fqn):
        seen.append((type(module), fqn))
        return fqn == "lm_head" or ".mlp." in fqn

    scaledmm.quantize_(model, "fp8_tensor", filter_fn=want)
    names = [n for n, m in Toy().named_modules() if isinstance(m, nn.Linear)]
    assert sorted(seen) == sorted((nn.Linear, n) for n in names)
    assert type(model.lm_head) is Fp8Linear and type(model.blocks[1].mlp[2]) is Fp8Linear
    report = scaledmm.quantize_report(model)
    assert report["blocks.0.attn"].detail == "filtered" and report["side"].detail == "filtered"
    with pytest.raises(ValueError, match="filter_fn"):
        scaledmm.quantize_(Toy(), "fp8", filter_fn="mlp")


def test_report_prints_a_table_with_reasons():
    model = Toy()
    model.blocks[1].attn = nn.Linear(256, 256, bias=False, dtype=torch.float32)  # fp8_block takes bf16/fp16 only
    scaledmm.quantize_(model, "fp8_block", filter_fn=lambda m, fqn: fqn != "side")
    report = scaledmm.quantize_report(model)
    assert report["blocks.1.attn"].detail == "fp8_block quantizes bf16/fp16 activations; the Linear is torch.float32"
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split() == ["module", "K", "->", "N", "format", "detail"]
    assert any(line.split()[:5] == ["blocks.0.mlp.0", "256", "->", "384", "fp8_block"] for line in lines)
    assert any(line.split()[:5] == ["side", "100", "->", "256", "left"] and line.endswith("filtered")
               for line in lines)
    assert lines[-1] == "6 swapped, 2 left float"
    assert len(report.entries) == 8 and {e.fqn for e in report.left} == {"side", "blocks.1.attn"}
    # a second call: the report follows the model's modules, reasons the latest call's
    scaledmm.quantize_(model, "fp8", filter_fn=lambda m, fqn: fqn == "side")
    report = scaledmm.quantize_report(model)
    assert report["side"].fmt == "fp8" and report["blocks.0.attn"].fmt == "fp8_block"
    assert report["blocks.1.attn"].fmt is None and report["blocks.1.attn"].detail == "filtered"
    # unknown model: every Linear "not quantized"
    assert {e.detail for e in scaledmm.quantize_report(Toy()).entries} == {"not quantized"}
    # the compiled wrapper reports its module
    assert str(scaledmm.quantize_report(torch.compile(model))) == str(report)


def test_a_module_under_two_names_is_swapped_once():
    model = Toy()
    model.blocks[1].attn = model.blocks[0].attn  # shared
    scaledmm.quantize_(model, "fp8")
    assert model.blocks[0].attn is model.blocks[1].attn and type(model.blocks[0].attn) is Fp8Linear
    report = scaledmm.quantize_report(model)
    assert report["blocks.0.attn"].fmt == "fp8"


def test_meta_weights_and_bare_linears_raise():
    with torch.device("meta"):
        model = Toy()
    with pytest.raises(ValueError, match=r"model\.blocks\.0\.attn\.weight.*load_quantized"):
        scaledmm.quantize_(model, "fp8")
    with pytest.raises(ValueError, match="model"):
        scaledmm.quantize_(nn.Linear(32, 32), "fp8")
    with pytest.raises(ValueError, match="model"):
        scaledmm.quantize_("not a module", "fp8")


def test_fp32_and_fp16_models():
    for dtype in (torch.float32, torch.float16):
        model = scaledmm.quantize_(Toy(dtype), "fp8")
        x, y = _inputs(dtype)
        out = model(x, y)
        assert out.dtype == dtype and out.isfinite().all()
        assert model.blocks[0].attn.out_dtype == dtype


@given(k=st.integers(1, 300), n=st.integers(1, 300), m=st.sampled_from([0, 1, 3, 17]),
       fmt=st.sampled_from(FORMATS), bias=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**31 - 1))
def test_any_shape_is_swapped_or_left_with_its_reason(k, n, m, fmt, bias, dtype, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    lin = nn.Linear(k, n, bias=bias, dtype=dtype)
    model = scaledmm.quantize_(nn.Sequential(copy.deepcopy(lin)), fmt)
    entry = scaledmm.quantize_report(model)["0"]
    if fmt.startswith("nvfp4") and k % 16:
        assert type(model[0]) is nn.Linear and entry.fmt is None and f"K={k}" in entry.detail
        return
    assert type(model[0]) is LAYER[fmt] and entry.fmt == fmt
    x = torch.randn(m, k, dtype=dtype)
    out = model(x)
    assert out.shape == (m, n) and torch.equal(out, QuantConfig(fmt).quantize(lin)(x))
