"""NvFp4Linear: ModelOpt checkpoint loading, load-time padding/swizzling,
forward numerics against a float64 model, W4A16, dynamic activation scale,
torch.compile, bad checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import scaledmm  # noqa: F401
from scaledmm.layers import NvFp4Linear

import layer_reference as lr
from helpers import requires_cuda
from nvfp4_helpers import check_gemm, ref_decode_codes, ref_quant, ref_unpack, ref_unswizzle

E4M3 = torch.float8_e4m3fn
SCALE_VALUES = torch.tensor([0.0078125, 0.25, 0.5, 0.75, 1.0, 1.5, 3.0, 10.0, 448.0])


def modelopt_checkpoint(n: int, k: int, bias: bool = True, input_scale: float | None = 0.004,
                        device="cpu"):
    """A ModelOpt-style NVFP4 state dict built by hand, and its float64 weight."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    weight = codes[:, 0::2] | (codes[:, 1::2] << 4)  # element 2i low nibble, 2i+1 high
    scales = SCALE_VALUES[torch.randint(0, len(SCALE_VALUES), (n, k // 16))]
    t = {
        "weight": weight,
        "weight_scale": scales.to(E4M3),
        "weight_scale_2": torch.tensor(0.0025),
        "input_scale": torch.tensor(input_scale if input_scale is not None else 1.0),
    }
    if input_scale is None:
        del t["input_scale"]
    if bias:
        t["bias"] = torch.randn(n, dtype=torch.bfloat16)
    w64 = ref_decode_codes(codes) * scales.double().repeat_interleave(16, dim=1)  # without weight_scale_2
    return {key: v.to(device) for key, v in t.items()}, w64


def expected_w4a4(x2: torch.Tensor, t: dict, w64: torch.Tensor, gs: torch.Tensor):
    """float64 model of the layer: quantize x with gs (SPEC rule), decode, GEMM."""
    codes, s = ref_quant(x2.cpu(), gs.cpu())
    xq = ref_decode_codes(codes) * s.double().repeat_interleave(16, dim=1)
    alpha = float((1.0 / gs.cpu().float()) * t["weight_scale_2"].cpu().float()) if "input_scale" not in t else \
        float(t["input_scale"].cpu().float() * t["weight_scale_2"].cpu().float())
    ref = alpha * (xq @ w64.t())
    bound = abs(alpha) * (xq.abs() @ w64.abs().t())
    if "bias" in t:
        ref = ref + t["bias"].double().cpu()
    nan_rows = s.isnan().any(dim=1)
    return ref, bound, nan_rows


@pytest.mark.parametrize("n,k,bias", [(40, 80, True), (64, 128, False), (33, 208, True)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_from_checkpoint_w4a4_matches_float64(n, k, bias, out_dtype):
    t, w64 = modelopt_checkpoint(n, k, bias)
    layer = NvFp4Linear.from_checkpoint(t, out_dtype=out_dtype)
    assert layer.weight.shape == ((n + 31) // 32 * 32, (k + 63) // 64 * 32)
    gs = 1.0 / t["input_scale"].float()
    for lead in [(0,), (1,), (3,), (17,), (2, 5)]:
        x = torch.randn(*lead, k, dtype=torch.bfloat16) * 0.3
        out = layer(x)
        assert out.shape == (*lead, n) and out.dtype == out_dtype
        ref, bound, nan_rows = expected_w4a4(x.reshape(-1, k), t, w64, gs)
        check_gemm(out.reshape(-1, n), ref, bound, k, out_dtype, nan_rows)


@pytest.mark.parametrize("n,k", [(40, 80), (64, 128)])
def test_from_checkpoint_w4a16_matches_float64(n, k):
    t, w64 = modelopt_checkpoint(n, k, bias=True)
    layer = NvFp4Linear.from_checkpoint(t, use_w4a16=True, out_dtype=torch.float16)
    for m in (0, 1, 3, 17):
        x = torch.randn(m, k, dtype=torch.float16)
        out = layer(x)
        ws2 = float(t["weight_scale_2"])
        ref = ws2 * (x.double() @ w64.t()) + t["bias"].double()
        check_gemm(out, ref, ws2 * (x.double().abs() @ w64.abs().t()), k, torch.float16)
    # fp32 activations are cast to the half output dtype first
    x = torch.randn(3, k)
    assert torch.equal(layer(x), layer(x.half()))


def test_dynamic_input_scale_without_input_scale():
    n, k = 40, 80
    t, w64 = modelopt_checkpoint(n, k, bias=False, input_scale=None)
    layer = NvFp4Linear.from_checkpoint(t)
    assert layer.dynamic_input_scale
    x = torch.randn(6, k) * 50
    x[2, 5] = float("nan")
    x[4, 7] = float("inf")
    out = layer(x)
    finite = x.abs().nan_to_num(nan=0.0, posinf=0.0)
    gs = (448 * 6 / finite.amax()).float()
    ref, bound, nan_rows = expected_w4a4(x, t, w64, gs)
    assert nan_rows.tolist() == [False, False, True, False, False, False]
    check_gemm(out, ref, bound, k, torch.bfloat16, nan_rows)
    assert layer(x[:0]).shape == (0, n)
    assert (layer(torch.zeros(2, k)) == 0).all()  # all-zero input: zero scales, not inf * 0


def test_nan_stays_in_its_row_static_scale():
    t, w64 = modelopt_checkpoint(32, 64)
    layer = NvFp4Linear.from_checkpoint(t)
    x = torch.randn(5, 64) * 0.3
    x[3, 10] = float("nan")
    out = layer(x)
    assert out[3].isnan().all()
    assert torch.isfinite(out[[0, 1, 2, 4]]).all()


@pytest.mark.parametrize("use_w4a16", [False, True])
@pytest.mark.parametrize("input_amax", [None, 3.0])
def test_from_float(use_w4a16, input_amax):
    n, k = 40, 80
    lin = torch.nn.Linear(k, n, dtype=torch.bfloat16)
    layer = NvFp4Linear.from_float(lin, input_amax=input_amax, use_w4a16=use_w4a16)
    # the stored codes and scales are SPEC's quantization of the weight with 1 / weight_scale_2
    w = lin.weight.detach().float()
    ws2 = layer.weight_scale_2.detach()
    assert torch.allclose(ws2, w.abs().amax() / 2688, rtol=1e-6)
    codes, s = ref_quant(w, 1.0 / ws2)
    n_pad, k_pad = layer.weight.shape[0], 2 * layer.weight.shape[1]
    assert torch.equal(ref_unpack(layer.weight.detach())[:n, :k], codes)
    assert (ref_unpack(layer.weight.detach())[n:] == 0).all() and (ref_unpack(layer.weight.detach())[:, k:] == 0).all()
    s_lin = ref_unswizzle(layer.weight_scale.detach().float(), n_pad, k_pad // 16)
    assert torch.equal(s_lin[:n, : k // 16], s)
    assert (s_lin[n:] == 0).all() and (s_lin[:, k // 16:] == 0).all()
    # forward against a float64 model of the stored codes and scales, decoded and
    # unswizzled by tests/layer_reference.py (the SPEC table and offset formula)
    w64 = (lr.decode_e2m1(lr.unpack_e2m1(layer.weight.detach()))[:n, :k]
           * lr.unswizzle(layer.weight_scale.detach().view(torch.uint8), n, k // 16).view(E4M3).double()
           .repeat_interleave(16, dim=1))
    t = {"weight_scale_2": ws2, "bias": layer.bias.detach()[:n]}
    if layer.input_scale is not None and not layer.dynamic_input_scale:
        t["input_scale"] = layer.input_scale.detach()
    gen = torch.Generator().manual_seed(40 + int(use_w4a16))
    for m in (0, 1, 3, 17):
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
        out = layer(x)
        if use_w4a16:
            X = x.double()
            ref = float(ws2) * (X @ w64.t()) + t["bias"].double()
            check_gemm(out, ref, float(ws2) * (X.abs() @ w64.abs().t()), k, torch.bfloat16)
        else:
            amax = x.float().abs().amax() if m else torch.tensor(1.0)
            gs = 1.0 / t["input_scale"].float() if "input_scale" in t else (448 * 6 / amax).float()
            ref, bound, nan_rows = expected_w4a4(x, t, w64, gs)
            check_gemm(out, ref, bound, k, torch.bfloat16, nan_rows)
    # zero weights quantize to zeros (no inf global scale)
    zero = torch.nn.Linear(k, n, bias=False)
    torch.nn.init.zeros_(zero.weight)
    assert (NvFp4Linear.from_float(zero, input_amax=input_amax)(torch.randn(2, k)) == 0).all()
    # and the layer approximates the float linear
    x = torch.randn(4, 7, k, dtype=torch.bfloat16).clamp(-3, 3)
    out = layer(x).float()
    ref = lin(x).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < (0.12 if use_w4a16 else 0.2), rel


def test_process_is_idempotent_and_state_dict_names():
    t, _ = modelopt_checkpoint(40, 80)
    layer = NvFp4Linear.from_checkpoint(t)
    ptrs = [p.data_ptr() for p in (layer.weight, layer.weight_scale, layer.bias)]
    x = torch.randn(3, 80)
    before = layer(x)
    layer.process_weights_after_loading()
    assert [p.data_ptr() for p in (layer.weight, layer.weight_scale, layer.bias)] == ptrs
    assert torch.equal(layer(x), before)
    assert set(layer.state_dict()) == {"weight", "weight_scale", "weight_scale_2", "input_scale", "bias"}
    assert layer.weight_scale.shape == (128, 8) and layer.weight_scale.dtype == E4M3
    assert layer.bias.shape == (64,) and (layer.bias[40:] == 0).all()


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("use_w4a16", [False, True])
def test_forward_reads_weights_in_place(use_w4a16):
    t, _ = modelopt_checkpoint(40, 80)
    layer = NvFp4Linear.from_checkpoint(t, use_w4a16=use_w4a16)
    owned = {layer.weight.data_ptr(), layer.weight_scale.data_ptr()}
    with _Recorder() as rec:
        layer(torch.randn(3, 80, dtype=torch.bfloat16))
    gemm = "nvfp4_w4a16_mm" if use_w4a16 else "nvfp4_linear"
    touching = [str(f) for f, args in rec.calls
                if any(isinstance(a, torch.Tensor) and a.data_ptr() in owned for a in args)]
    assert touching == [f"scaledmm.{gemm}.default"], touching


def test_compile_dynamic_matches_eager_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    t, _ = modelopt_checkpoint(40, 80)
    static = NvFp4Linear.from_checkpoint(t)
    del t["input_scale"]
    dynamic = NvFp4Linear.from_checkpoint(t)

    def f(x):
        return static(x), dynamic(x)

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, backend=cnt, fullgraph=True, dynamic=True)
    for m in (2, 3, 17, 40):
        x = torch.randn(m, 80, dtype=torch.bfloat16)
        for got, exp in zip(cf(x), f(x)):
            assert got.shape == exp.shape == (m, 40)
            assert torch.equal(got, exp)
    assert cnt.frame_count == 1


def test_bad_checkpoints_and_inputs():
    t, _ = modelopt_checkpoint(32, 64)
    cases = [
        ("tensors", {k: v for k, v in t.items() if k != "weight_scale"}),
        ("input_scale", dict(t, input_scale=None)),
        ("bias", dict(t, bias=t["bias"].to("meta"))),
        ("weight", dict(t, weight=t["weight"].to(torch.int32))),
        ("weight", dict(t, weight=t["weight"].reshape(-1))),
        ("weight_scale", dict(t, weight_scale=t["weight_scale"][:, :2])),
        ("weight_scale", dict(t, weight_scale=t["weight_scale"].float())),
        ("weight_scale_2", dict(t, weight_scale_2=torch.ones(2))),
        ("input_scale", dict(t, input_scale=torch.tensor(1, dtype=torch.int32))),
        ("bias", dict(t, bias=torch.zeros(31))),
    ]
    for arg, bad in cases:
        with pytest.raises(ValueError, match=rf"NvFp4Linear: {arg}: expected"):
            NvFp4Linear.from_checkpoint(bad)
    with pytest.raises(ValueError, match="in_features"):
        NvFp4Linear(72, 16)
    with pytest.raises(ValueError, match="out_dtype"):
        NvFp4Linear(64, 16, out_dtype=torch.int8)
    layer = NvFp4Linear.from_checkpoint(t)
    with pytest.raises(ValueError, match="NvFp4Linear: x: expected"):
        layer(torch.randn(3, 48))
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        NvFp4Linear(64, 16)(torch.randn(2, 64))


def test_extra_repr():
    t, _ = modelopt_checkpoint(40, 80)
    text = repr(NvFp4Linear.from_checkpoint(t))
    for part in ("in_features=80", "out_features=40", "nvfp4", "static activation scale",
                 "uint8[64, 64]", "swizzled e4m3[128, 8]"):
        assert part in text, text
    assert "w4a16" in repr(NvFp4Linear.from_checkpoint(t, use_w4a16=True))
    assert "not loaded" in repr(NvFp4Linear(64, 16))


@requires_cuda
@pytest.mark.parametrize("use_w4a16", [False, True])
def test_cuda_layer_matches_float64(use_w4a16):
    n, k = 200, 336
    t, w64 = modelopt_checkpoint(n, k, device="cuda")
    layer = NvFp4Linear.from_checkpoint(t, use_w4a16=use_w4a16)
    gs = 1.0 / t["input_scale"].float()
    for m in (1, 3, 17, 129):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 0.3
        out = layer(x)
        if use_w4a16:
            ws2 = float(t["weight_scale_2"])
            X = x.double().cpu()
            ref = ws2 * (X @ w64.t()) + t["bias"].double().cpu()
            check_gemm(out, ref, ws2 * (X.abs() @ w64.abs().t()), k, torch.bfloat16)
        else:
            ref, bound, nan_rows = expected_w4a4(x, t, w64, gs)
            check_gemm(out, ref, bound, k, torch.bfloat16, nan_rows)
    cf = torch.compile(layer, fullgraph=True, dynamic=True)
    for m in (2, 5, 33):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(cf(x), layer(x))
