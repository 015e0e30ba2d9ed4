"""Tests of ``scaledmm.layers.Fp8Linear``: accuracy against the float model
within the FP8 error bound, load-time padding (forward moves no weight bytes),
checkpoint loading, compile, and the GPU path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from scaledmm.layers import Fp8Linear
from scaledmm.ops import fp8 as F8

from helpers import requires_cuda
from helpers import FP8
from layer_reference import check_within, fp8_layer_model

OPS = torch.ops.scaledmm
U = 2.0 ** -24
ACTS = ("dynamic", "dynamic_per_token", "static")


def make_linear(k, n, dtype, bias, gen, device="cpu"):
    lin = nn.Linear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 10.0 ** torch.randint(-2, 2, (n, 1), generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin.to(device)


def make_layer(lin, per_channel, activation, x):
    kw = {}
    if activation == "static":  # calibrated on x, with headroom: no saturation
        amax = x.float().abs().max().item() if x.numel() else 1.0
        kw["input_scale"] = max(amax, 1e-6) * 1.5 / 448
    return Fp8Linear.from_float(lin, per_channel=per_channel, activation=activation, **kw)


def _quant_err(v64: torch.Tensor, s64: torch.Tensor) -> torch.Tensor:
    """Bound on |e4m3 code * s - v| for |v| <= 448 s: half a step, relative
    2^-4 for normal codes, absolute 2^-10 s for subnormal ones."""
    return torch.maximum(v64.abs() * 2.0 ** -4, s64 * 2.0 ** -10) * (1 + 2.0 ** -20)


def assert_within_fp8_bound(y, x, lin, layer):
    """``y`` is within the error that quantizing x and W to e4m3 (with the
    layer's scales), float32 accumulation and one rounding can cause,
    around the float64 value of the float model."""
    k, n = lin.in_features, lin.out_features
    x64 = x.reshape(-1, k).double()
    w64 = lin.weight.detach().double()
    ref = x64 @ w64.t()
    if lin.bias is not None:
        ref = ref + lin.bias.detach().double()
    ws = layer.weight_scale.detach().double().cpu()
    sw = ws[:n].reshape(n, 1) if layer.per_channel else ws.reshape(1, 1)
    if layer.activation == "static":
        sx = layer.input_scale.detach().double().cpu().reshape(1, 1)
    elif layer.activation == "dynamic_per_token":
        sx = torch.clamp(x64.abs().amax(dim=1, keepdim=True), min=F8.AMAX_FLOOR) / 448
    else:
        amax = x64.abs().amax() if x64.numel() else x64.new_zeros(())
        sx = torch.clamp(amax, min=F8.AMAX_FLOOR).reshape(1, 1) / 448
    ex, ew = _quant_err(x64, sx), _quant_err(w64, sw)
    quant = ex @ w64.abs().t() + x64.abs() @ ew.t() + ex @ ew.t()
    accum = (k + 3) * U * ((x64.abs() + ex) @ (w64.abs() + ew).t())
    bias_r = 2 * U * (lin.bias.detach().double().abs() if lin.bias is not None else 0)
    bound = (quant + accum + bias_r) * 1.01 + 2.0 ** -140
    out_dtype = layer.out_dtype
    o = y.reshape(-1, n).double().cpu()
    lo = (ref - bound).to(out_dtype).double()
    hi = (ref + bound).to(out_dtype).double()
    ok = (o >= lo) & (o <= hi)
    assert ok.all(), f"{(~ok).sum()} outputs outside the FP8 bound; first {(~ok).nonzero()[0].tolist()}"


# ----------------------------------------------------------------------------
# Numerics
# ----------------------------------------------------------------------------


@given(k=st.one_of(st.sampled_from([1, 16, 48, 100, 257]), st.integers(1, 300)),
       n=st.one_of(st.sampled_from([1, 16, 50, 80, 129]), st.integers(1, 200)),
       m=st.one_of(st.sampled_from([0, 1, 3, 4, 17]), st.integers(0, 300)),
       lead=st.sampled_from([(), (2,)]), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       per_channel=st.booleans(), activation=st.sampled_from(ACTS), bias=st.booleans(),
       seed=st.integers(0, 2 ** 31 - 1))
def test_matches_float_model_within_fp8_bound(k, n, m, lead, dtype, per_channel, activation, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    lin = make_linear(k, n, dtype, bias, gen)
    x = (torch.randn(*lead, m, k, generator=gen) * 10.0 ** torch.randint(-2, 3, (*lead, m, 1), generator=gen)).to(dtype)
    layer = make_layer(lin, per_channel, activation, x)
    y = layer(x)
    assert y.shape == (*lead, m, n) and y.dtype == dtype
    assert_within_fp8_bound(y, x, lin, layer)
    # and a float64 model of the stored codes and scales with the activation quantized
    # by the SPEC recipe: only fp32 accumulation and output rounding are left
    ref, bound = fp8_layer_model(x.reshape(-1, k), layer.weight.detach(), layer.weight_scale.detach(),
                                 None if layer.bias is None else layer.bias.detach(), n, activation,
                                 layer.input_scale.detach() if activation == "static" else None, dtype)
    check_within(y, ref, bound, dtype)


def test_nan_row_stays_in_its_row():
    gen = torch.Generator().manual_seed(0)
    lin = make_linear(100, 50, torch.bfloat16, True, gen)
    for act in ("dynamic", "dynamic_per_token"):
        layer = Fp8Linear.from_float(lin, activation=act)
        x = torch.randn(5, 100, dtype=torch.bfloat16)
        x[2, 7] = float("nan")
        x[3, 1] = float("inf")
        y = layer(x)
        nan_rows = torch.isnan(y).any(dim=1).nonzero().flatten().tolist()
        assert 2 in nan_rows and set(nan_rows) <= {2, 3}
        assert torch.isfinite(y[[0, 1, 4]]).all()


# ----------------------------------------------------------------------------
# Load-time padding: forward moves no weight bytes
# ----------------------------------------------------------------------------


class OpLog(TorchDispatchMode):
    """Records every top-level op (custom ops are one entry: their insides
    run below the mode)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.calls.append((func, ins, outs))
        return out


@pytest.mark.parametrize("per_channel,activation", [(False, "dynamic"), (True, "dynamic_per_token"),
                                                    (True, "static")])
def test_forward_moves_no_weight_bytes(per_channel, activation):
    gen = torch.Generator().manual_seed(1)
    lin = make_linear(300, 200, torch.bfloat16, True, gen)  # K % 16 != 0, N % 16 != 0
    x = torch.randn(3, 300, dtype=torch.bfloat16)
    layer = make_layer(lin, per_channel, activation, x)
    w = layer.weight
    assert tuple(w.shape) == (208, 304) and w.is_contiguous()
    ptr, version = w.data_ptr(), w._version
    params = {name: (p.data_ptr(), p._version) for name, p in layer.named_parameters()}
    with OpLog() as log:
        y = layer(x)
    assert y.shape == (3, 200)
    assert (w.data_ptr(), w._version) == (ptr, version) and layer.weight is w
    assert {name: (p.data_ptr(), p._version) for name, p in layer.named_parameters()} == params
    w_storage = w.untyped_storage().data_ptr()
    mm_calls = 0
    for func, ins, outs in log.calls:
        reads_w = any(t.untyped_storage().data_ptr() == w_storage for t in ins)
        if func is OPS.fp8_linear.default:
            mm_calls += 1
            assert ins[1].data_ptr() == ptr and ins[1].shape == w.shape  # the weight, in place
        else:
            assert not reads_w, f"{func} reads the weight"
        for t in outs:
            assert t.untyped_storage().nbytes() < w.untyped_storage().nbytes(), f"{func} allocates {tuple(t.shape)}"
    assert mm_calls == 1
    names = [str(f) for f, _, _ in log.calls]
    assert any("constant_pad_nd" in s for s in names)  # the activation pad along K


def test_padding_layout_and_idempotent():
    gen = torch.Generator().manual_seed(2)
    lin = make_linear(100, 50, torch.float16, True, gen)
    layer = Fp8Linear.from_float(lin, per_channel=True)
    assert layer.weight.shape == (64, 112) and layer.weight_scale.shape == (64,) and layer.bias.shape == (64,)
    wb = layer.weight.view(torch.uint8)
    assert (wb[50:] == 0).all() and (wb[:, 100:] == 0).all()
    assert (layer.weight_scale[50:] == 1.0).all() and (layer.bias[50:] == 0).all()
    assert layer.bias.dtype == torch.float16
    snap = {n: (p.data_ptr(), p._version) for n, p in layer.named_parameters()}
    layer.process_weights_after_loading()
    assert {n: (p.data_ptr(), p._version) for n, p in layer.named_parameters()} == snap
    aligned = Fp8Linear.from_float(make_linear(64, 32, torch.bfloat16, False, gen))
    assert aligned.weight.shape == (32, 64) and aligned.weight_scale.shape == (1,)
    r = repr(layer)
    assert "in_features=100" in r and "out_features=50" in r and "[64, 112]" in r and "per-channel" in r


def test_m0_and_bad_forward_inputs():
    gen = torch.Generator().manual_seed(3)
    layer = Fp8Linear.from_float(make_linear(40, 24, torch.bfloat16, True, gen))
    assert layer(torch.zeros(0, 40, dtype=torch.bfloat16)).shape == (0, 24)
    assert layer(torch.zeros(2, 0, 40, dtype=torch.bfloat16)).shape == (2, 0, 24)
    with pytest.raises(ValueError, match="^Fp8Linear: x: expected"):
        layer(torch.zeros(3, 41, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^fp8_linear: x: expected"):
        layer(torch.zeros(3, 40, dtype=torch.int32))
    fresh = Fp8Linear(40, 24)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        fresh(torch.zeros(3, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^Fp8Linear: activation: expected"):
        Fp8Linear(40, 24, activation="per_block")
    with pytest.raises(ValueError, match="^Fp8Linear: out_dtype: expected"):
        Fp8Linear(40, 24, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="^Fp8Linear.from_float: input_scale: expected"):
        Fp8Linear.from_float(make_linear(40, 24, torch.bfloat16, True, gen), activation="static")


# ----------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------


def _checkpoint(n, k, per_channel, static, bias, gen):
    t = {"weight": (torch.randn(n, k, generator=gen) * 100).to(FP8),
         "weight_scale": torch.rand((n,) if per_channel else (), generator=gen) + 0.01}
    if static:
        t["input_scale"] = torch.rand((), generator=gen) + 0.01
    if bias:
        t["bias"] = torch.randn(n, generator=gen).to(torch.bfloat16)
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("per_channel,static,bias", [(False, False, False), (True, True, True),
                                                     (False, True, True), (True, False, False)])
@pytest.mark.parametrize("n,k", [(50, 100), (32, 48)])
def test_checkpoint_round_trip(per_channel, static, bias, n, k):
    gen = torch.Generator().manual_seed(4)
    t = _checkpoint(n, k, per_channel, static, bias, gen)
    layer = Fp8Linear.from_checkpoint(t)
    assert layer.activation == ("static" if static else "dynamic") and layer.per_channel == per_channel
    back = layer.checkpoint_tensors()
    assert set(back) == set(t) and all(_same(back[key], t[key]) for key in t)
    assert all(back[key].data_ptr() != p.data_ptr() for key, p in layer.named_parameters() if key in back)
    # the module's own state_dict route: __init__ + load_state_dict (the padded
    # layout); checkpoint tensors go through from_checkpoint
    other = Fp8Linear(k, n, bias, per_channel=per_channel, activation=layer.activation)
    other.load_state_dict(layer.state_dict())
    x = torch.randn(4, k, dtype=torch.bfloat16)
    assert torch.equal(other(x), layer(x))
    if (n, k) != (layer.padded_out_features, layer.padded_in_features):
        with pytest.raises(RuntimeError, match="size mismatch"):
            Fp8Linear(k, n, bias, per_channel=per_channel, activation=layer.activation).load_state_dict(t)
    again = Fp8Linear.from_checkpoint(back)
    assert torch.equal(again(x), layer(x))


def test_checkpoint_scale_shapes_and_dtypes():
    gen = torch.Generator().manual_seed(5)
    t = _checkpoint(50, 100, True, False, True, gen)
    x = torch.randn(3, 100, dtype=torch.bfloat16)
    want = Fp8Linear.from_checkpoint(t)(x)
    for ws in (t["weight_scale"].reshape(50, 1), t["weight_scale"].reshape(50, 1).bfloat16().float()):
        got = Fp8Linear.from_checkpoint({**t, "weight_scale": ws})(x)
        if ws.dtype == torch.float32 and torch.equal(ws.reshape(-1), t["weight_scale"]):
            assert torch.equal(got, want)
    bf = Fp8Linear.from_checkpoint({**t, "weight_scale": t["weight_scale"].bfloat16()})
    assert bf.weight_scale.dtype == torch.float32
    t1 = _checkpoint(50, 100, False, True, False, gen)
    for shape in ((), (1,), (1, 1)):
        layer = Fp8Linear.from_checkpoint({**t1, "weight_scale": t1["weight_scale"].reshape(shape),
                                           "input_scale": t1["input_scale"].reshape(shape)})
        assert not layer.per_channel and layer.activation == "static"
        assert torch.equal(layer(x), Fp8Linear.from_checkpoint(t1)(x))
    dyn = Fp8Linear.from_checkpoint(t1, activation="dynamic")  # a static scale may be ignored on request
    assert dyn.input_scale is None and "input_scale" not in dyn.checkpoint_tensors()


BAD_CKPT = [
    ("tensors", lambda t: {**t, "weight_scale_inv": t["weight_scale"]}),
    ("tensors", lambda t: {k: v for k, v in t.items() if k != "weight_scale"}),
    ("weight_scale", lambda t: {**t, "weight_scale": None}),
    ("bias", lambda t: {**t, "bias": None}),
    ("input_scale", lambda t: {**t, "input_scale": t["input_scale"].to("meta")}),
    ("weight", lambda t: {**t, "weight": t["weight"].float()}),
    ("weight", lambda t: {**t, "weight": t["weight"].reshape(-1)}),
    ("weight_scale", lambda t: {**t, "weight_scale": torch.ones(49)}),
    ("weight_scale", lambda t: {**t, "weight_scale": torch.ones(50, 2)}),
    ("weight_scale", lambda t: {**t, "weight_scale": torch.ones(50, dtype=torch.int32)}),
    ("input_scale", lambda t: {**t, "input_scale": torch.ones(2)}),
    ("bias", lambda t: {**t, "bias": torch.ones(51)}),
    ("bias", lambda t: {**t, "bias": torch.ones(50, dtype=torch.int64)}),
]


@pytest.mark.parametrize("arg,edit", BAD_CKPT, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_CKPT)])
def test_checkpoint_bad_tensors(arg, edit):
    t = _checkpoint(50, 100, True, True, True, torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=f"^Fp8Linear.from_checkpoint: {arg}: expected"):
        Fp8Linear.from_checkpoint(edit(t))


def test_checkpoint_static_needs_input_scale():
    t = _checkpoint(50, 100, False, False, False, torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="^Fp8Linear.from_checkpoint: input_scale: expected"):
        Fp8Linear.from_checkpoint(t, activation="static")


# ----------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------


def test_compile_fullgraph_dynamic_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(8)
    layer = Fp8Linear.from_float(make_linear(100, 50, torch.bfloat16, True, gen), per_channel=True)
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=cnt)
    for m in (3, 17, 64, 5, 300):
        x = torch.randn(2, m, 100, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), layer(x))
    assert cnt.frame_count == 1
    x = torch.randn(2, 1, 100, dtype=torch.bfloat16)
    assert torch.equal(compiled(x), layer(x))


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("per_channel,activation", [(False, "dynamic"), (True, "dynamic_per_token"),
                                                    (False, "static"), (True, "dynamic")])
def test_cuda_layer_within_bound_and_no_weight_sized_alloc(per_channel, activation):
    gen = torch.Generator().manual_seed(9)
    k, n = 2100, 1500  # both % 16 != 0
    lin = make_linear(k, n, torch.bfloat16, True, gen)
    for m in (1, 3, 17, 256):
        x = (torch.randn(m, k, generator=gen)).to(torch.bfloat16)
        layer = make_layer(lin, per_channel, activation, x).cuda()
        xc = x.cuda()
        layer(xc)  # warm-up (cuBLAS workspace, handles)
        torch.cuda.synchronize()
        ptr, version = layer.weight.data_ptr(), layer.weight._version
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = layer(xc)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if m <= 17:  # activation temporaries stay far below the weight's 3 MB
            assert peak < layer.weight.numel() // 4, f"forward allocated {peak} bytes"
        assert (layer.weight.data_ptr(), layer.weight._version) == (ptr, version)
        assert_within_fp8_bound(y.cpu(), x, lin, layer)


@requires_cuda
def test_cuda_graph_capture_and_compile():
    gen = torch.Generator().manual_seed(10)
    layer = Fp8Linear.from_float(make_linear(1000, 700, torch.bfloat16, True, gen), per_channel=True).cuda()
    x = torch.randn(5, 1000, dtype=torch.bfloat16, device="cuda")
    want = layer(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for m in (5, 33, 2):
        xm = torch.randn(m, 1000, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(compiled(xm), layer(xm))
