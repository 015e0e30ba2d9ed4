"""Layer state (SPEC "Model level"): every layer class saved with safetensors
and loaded into a fresh layer, or a meta-built one (``to_empty`` or
``assign=True``), gives bit-identical outputs; ``.to(dtype)`` / ``.half()``
never convert quantized weights or scales; ``from_checkpoint`` refuses bad
checkpoint dicts with a ``ValueError`` naming the tensor."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear, SkinnyLinear
from scaledmm.layers.parallel import ColumnParallelLinear, RowParallelLinear

from helpers import requires_cuda
from layer_helpers import make_checkpoint

BF16, FP16, E4M3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
M_VALUES = (0, 1, 3, 17)
LAYERS = {"fp8_block": Fp8BlockLinear, "fp8": Fp8Linear, "nvfp4": NvFp4Linear}


# ----------------------------------------------------------------------------
# Cases: how to make a loaded layer, and how to build a fresh one like it
# ----------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    k: int  # the input's last dim
    make: Callable[[torch.Generator], nn.Module]  # a loaded layer (from_float / from_checkpoint)
    build: Callable[..., nn.Module]  # a fresh layer of the same arguments; build(out_dtype=...)
    quantized: bool = True


def _linear(k: int, n: int, bias: bool, gen: torch.Generator) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias, dtype=BF16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * (0.5 + torch.rand(n, 1, generator=gen)))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


def _cases() -> list[Case]:
    cases = []
    for bias in (True, False):
        b = "bias" if bias else "nobias"
        for k, n in ((256, 192), (300, 200)):  # 300: K padded to 384
            cases.append(Case(
                f"fp8_block-{k}x{n}-{b}", k,
                lambda g, k=k, n=n, bias=bias: Fp8BlockLinear.from_float(_linear(k, n, bias, g)),
                lambda k=k, n=n, bias=bias, **kw: Fp8BlockLinear(k, n, bias, **kw)))
        fp8_variants = {"tensor": (False, "dynamic"), "channel-token": (True, "dynamic_per_token"),
                        "channel-static": (True, "static"), "tensor-static": (False, "static")}
        for var, (pc, act) in fp8_variants.items():
            for k, n in ((256, 192), (100, 200)):  # 100 -> 112, 200 -> 208
                scale = {"input_scale": 4.0 / 448} if act == "static" else {}
                cases.append(Case(
                    f"fp8-{var}-{k}x{n}-{b}", k,
                    lambda g, k=k, n=n, bias=bias, pc=pc, act=act, scale=scale: Fp8Linear.from_float(
                        _linear(k, n, bias, g), per_channel=pc, activation=act, **scale),
                    lambda k=k, n=n, bias=bias, pc=pc, act=act, **kw: Fp8Linear(
                        k, n, bias, per_channel=pc, activation=act, **kw)))
        nv_variants = {"w4a4-static": (False, 4.0), "w4a4-dynamic": (False, None),
                       "w4a16-static": (True, 4.0), "w4a16-dynamic": (True, None)}
        for var, (w4a16, amax) in nv_variants.items():
            for k, n in ((256, 192), (80, 200)):  # 80 -> 128, 200 -> 224
                cases.append(Case(
                    f"nvfp4-{var}-{k}x{n}-{b}", k,
                    lambda g, k=k, n=n, bias=bias, w4a16=w4a16, amax=amax: NvFp4Linear.from_float(
                        _linear(k, n, bias, g), input_amax=amax, use_w4a16=w4a16),
                    lambda k=k, n=n, bias=bias, w4a16=w4a16, amax=amax, **kw: NvFp4Linear(
                        k, n, bias, use_w4a16=w4a16, dynamic_input_scale=amax is None, **kw)))
        for k, n in ((256, 64), (100, 50)):
            cases.append(Case(
                f"skinny-{k}x{n}-{b}", k,
                lambda g, k=k, n=n, bias=bias: SkinnyLinear.from_float(_linear(k, n, bias, g)),
                lambda k=k, n=n, bias=bias, **kw: SkinnyLinear(k, n, bias), quantized=False))
        # Parallel wrappers: column shard 1 of 2 (no gather: no process group
        # needed), row parallel at world size 1 (the wrapper holds the bias).
        par = {"fp8_block": ({}, {}), "fp8": ({"per_channel": True, "static": True}, {"per_channel": True,
                                                                                       "activation": "static"}),
               "nvfp4": ({}, {"dynamic_input_scale": True})}
        for fmt, (ck_kw, inner_kw) in par.items():
            cls = LAYERS[fmt]
            k, n = (300, 256) if fmt == "fp8_block" else (80, 200)
            cases.append(Case(
                f"column-{fmt}-{b}", k,
                lambda g, fmt=fmt, k=k, n=n, bias=bias, ck_kw=ck_kw, cls=cls: ColumnParallelLinear.from_checkpoint(
                    cls, make_checkpoint(fmt, n, k, g, bias=bias, **ck_kw), rank=1, world_size=2),
                lambda k=k, n=n, bias=bias, inner_kw=inner_kw, cls=cls, **kw: ColumnParallelLinear(
                    cls(k, n // 2, bias, **inner_kw, **kw), rank=1, world_size=2)))
            if fmt == "fp8_block":  # the sharded K must be whole 128 blocks, even at world size 1
                k, n = 256, 200
            cases.append(Case(
                f"row-{fmt}-{b}", k,
                lambda g, fmt=fmt, k=k, n=n, bias=bias, ck_kw=ck_kw, cls=cls: RowParallelLinear.from_checkpoint(
                    cls, make_checkpoint(fmt, n, k, g, bias=bias, **ck_kw), rank=0, world_size=1),
                lambda k=k, n=n, bias=bias, inner_kw=inner_kw, cls=cls, **kw: RowParallelLinear(
                    cls(k, n, False, **inner_kw, **kw), rank=0, world_size=1, bias=bias)))
    return cases


CASES = _cases()
IDS = [c.name for c in CASES]


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Everything the forward can read: parameters and all buffers (the
    derived, non-persistent ones too)."""
    return dict(chain(module.named_parameters(), module.named_buffers()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def assert_same_tensors(a: dict, b: dict, why: str) -> None:
    assert a.keys() == b.keys(), (why, sorted(a), sorted(b))
    for key in a:
        x, y = a[key], b[key]
        assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), (why, key, x.dtype, y.dtype,
                                                                             x.shape, y.shape, x.device, y.device)
        assert torch.equal(_bits(x), _bits(y)), (why, key)


def save_and_load(layer: nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    path = str(tmp_path / "layer.safetensors")
    save_file(layer.state_dict(), path)  # as a user saves it: no .contiguous()
    return load_file(path)


def assert_same_outputs(a: nn.Module, b: nn.Module, k: int, seed: int, dtype=BF16) -> None:
    for m in M_VALUES:
        x = torch.randn(m, k, dtype=dtype)
        ya, yb = a(x), b(x)
        assert ya.dtype == yb.dtype and ya.shape == yb.shape == (m, ya.shape[-1])
        assert torch.equal(ya, yb), f"M={m}: outputs differ (seed {seed}), max err {(ya - yb).abs().max()}"
    x = torch.randn(2, 3, k, dtype=dtype)  # leading dims
    assert torch.equal(a(x), b(x)), f"3-D input: outputs differ (seed {seed})"


# ----------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------

ROUTES = ("fresh", "fresh_processed", "meta_to_empty", "meta_assign")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_dict_round_trip_is_bit_identical(case, route, tmp_path, _seed):
    gen = torch.Generator().manual_seed(_seed)
    layer = case.make(gen)
    state = save_and_load(layer, tmp_path)
    if route.startswith("fresh"):
        other = case.build()
        if route == "fresh_processed":  # as the issue's example does
            getattr(other, "inner", other).process_weights_after_loading()
        other.load_state_dict(state, strict=True)
    else:
        with torch.device("meta"):
            other = case.build()
        if route == "meta_to_empty":
            other.to_empty(device="cpu")
            other.load_state_dict(state, strict=True)
        else:
            other.load_state_dict(state, strict=True, assign=True)
    # everything the forward reads, derived buffers included, is the original's
    assert_same_tensors(_tensors(layer), _tensors(other), route)
    assert_same_outputs(layer, other, case.k, _seed)
    # loading again (derivation on a loaded layer) changes nothing, allocates nothing
    ptrs = {key: t.data_ptr() for key, t in _tensors(other).items()}
    other.load_state_dict(state, strict=True)
    assert {key: t.data_ptr() for key, t in _tensors(other).items()} == ptrs
    assert_same_outputs(layer, other, case.k, _seed)


def test_issue_14_reproduction():
    a = NvFp4Linear.from_float(torch.nn.Linear(256, 192, dtype=torch.bfloat16), input_amax=4.0)
    b = NvFp4Linear(256, 192)
    b.process_weights_after_loading()
    b.load_state_dict(a.state_dict())  # all keys matched
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    assert torch.equal(a(x), b(x)), (a(x) - b(x)).abs().max()


@pytest.mark.parametrize("case", [c for c in CASES if c.quantized and "-bias" in c.name], ids=lambda c: c.name)
def test_fresh_layer_is_not_ready_until_loaded(case, _seed):
    layer = case.make(torch.Generator().manual_seed(_seed))
    state = layer.state_dict()
    fresh = case.build()
    x = torch.randn(3, case.k, dtype=BF16)
    with pytest.raises(RuntimeError, match="load the tensors first"):
        fresh(x)
    partial = {key: v for key, v in state.items() if not key.endswith("weight")}
    fresh.load_state_dict(partial, strict=False)  # placeholders left: still not ready
    with pytest.raises(RuntimeError, match="load the tensors first"):
        fresh(x)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), layer(x))
    # a partial load into a ready layer keeps it ready
    fresh.load_state_dict(partial, strict=False)
    assert torch.equal(fresh(x), layer(x))


# ----------------------------------------------------------------------------
# Loading errors
# ----------------------------------------------------------------------------


def test_load_state_dict_refuses_the_checkpoint_layout_and_converted_codes():
    lin = _linear(100, 200, True, torch.Generator().manual_seed(0))
    layer = Fp8Linear.from_float(lin, per_channel=True)
    logical = layer.checkpoint_tensors()
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        Fp8Linear(100, 200, per_channel=True).load_state_dict(logical)
    # codes cast to another dtype (what .half() did before) are refused, not cast back
    state = dict(layer.state_dict(), weight=layer.weight.to(FP16))
    with pytest.raises(RuntimeError, match=r"weight: expected dtype torch.float8_e4m3fn \(codes are never"):
        Fp8Linear(100, 200, per_channel=True).load_state_dict(state)
    nv = NvFp4Linear.from_float(_linear(64, 32, False, torch.Generator().manual_seed(1)))
    state = dict(nv.state_dict(), weight_scale=nv.weight_scale.float())
    with pytest.raises(RuntimeError, match=r"weight_scale: expected dtype torch.float8_e4m3fn"):
        NvFp4Linear(64, 32, False).load_state_dict(state)
    # tensors replaced by the checkpoint layout behind the layer's back
    fresh = NvFp4Linear(64, 32, False)
    fresh.weight_scale = nn.Parameter(torch.zeros(32, 4, dtype=E4M3), requires_grad=False)
    with pytest.raises(ValueError, match=r"^NvFp4Linear.process_weights_after_loading: weight_scale: expected shape "
                                         r"\(128, 4\) \(the padded, swizzled layout"):
        fresh.process_weights_after_loading()
    blk = Fp8BlockLinear(300, 64)
    blk.weight = nn.Parameter(torch.zeros(64, 300, dtype=E4M3), requires_grad=False)
    with pytest.raises(ValueError, match=r"^Fp8BlockLinear.process_weights_after_loading: weight: expected shape"):
        blk.process_weights_after_loading()


# ----------------------------------------------------------------------------
# .to(dtype) / .half() / .float() / device moves
# ----------------------------------------------------------------------------


def _out_dtype(layer):
    return (layer.inner if hasattr(layer, "inner") else layer).out_dtype


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dtype_conversions_keep_quantized_tensors(case, _seed):
    layer = case.make(torch.Generator().manual_seed(_seed))
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    before = {k: t.dtype for k, t in _tensors(layer).items()}
    x = torch.randn(5, case.k, dtype=BF16)
    ref = layer(x)
    assert ref.dtype == BF16

    assert layer.to(torch.bfloat16) is layer
    assert {k: t.dtype for k, t in _tensors(layer).items()} == before
    assert torch.equal(layer(x), ref)

    layer.half()
    after = {k: t.dtype for k, t in _tensors(layer).items()}
    x16 = torch.randn(5, case.k, dtype=FP16)
    if not case.quantized:  # SkinnyLinear is a float layer: it converts like nn.Linear
        assert set(after.values()) == {FP16}
        want = F.linear(x16, state["weight"].half())
        if "bias" in state:
            want = want + state["bias"].half()
        assert torch.equal(layer(x16), want)
        return
    for key, dtype in before.items():
        assert after[key] == (FP16 if key.endswith("bias") else dtype), key
    assert _out_dtype(layer) == FP16
    # the same as a layer built for fp16 output and loaded with the state
    twin = case.build(out_dtype=FP16)
    twin.load_state_dict(state)
    out = layer(x16)
    assert out.dtype == FP16 and torch.equal(out, twin(x16)), f"seed {_seed}"

    layer.float()
    fp32_ok = not isinstance(getattr(layer, "inner", layer), Fp8BlockLinear)  # bf16 / fp16 output only
    want = torch.float32 if fp32_ok else FP16
    assert _out_dtype(layer) == want
    for key, dtype in before.items():
        assert _tensors(layer)[key].dtype == (want if key.endswith("bias") else dtype), key
    assert layer(x).dtype == want

    layer.to(BF16)
    assert {k: t.dtype for k, t in _tensors(layer).items()} == before
    assert _out_dtype(layer) == BF16


@pytest.mark.parametrize("case", [c for c in CASES if c.quantized and "-bias" in c.name], ids=lambda c: c.name)
def test_device_moves_keep_dtypes(case, _seed):
    layer = case.make(torch.Generator().manual_seed(_seed))
    before = {k: (t.dtype, t.shape) for k, t in _tensors(layer).items()}
    x = torch.randn(3, case.k, dtype=BF16)
    ref = layer(x)
    layer.to("meta", torch.float16)  # a device move with a dtype: only the device (and out_dtype) change
    assert all(t.device.type == "meta" for t in _tensors(layer).values())
    assert {k: (t.dtype, t.shape) for k, t in _tensors(layer).items()} == {
        k: (FP16 if k.endswith("bias") else d, s) for k, (d, s) in before.items()}
    layer.to_empty(device="cpu")
    layer.to(BF16)
    layer.load_state_dict(case.make(torch.Generator().manual_seed(_seed)).state_dict())
    assert torch.equal(layer(x), ref)


def test_fp8_block_scale_rows_keep_their_padded_stride():
    layer = Fp8BlockLinear.from_float(_linear(300, 200, True, torch.Generator().manual_seed(2)))
    assert layer.weight_scale_inv.stride() == (4, 1)  # [2, 3] scales, rows padded to 4
    with torch.device("meta"):
        other = Fp8BlockLinear(300, 200)
    other.load_state_dict({k: v.contiguous() for k, v in layer.state_dict().items()}, assign=True)
    assert other.weight_scale_inv.stride() == (4, 1) and other.weight_scale_inv.device.type == "cpu"
    layer.to("meta")
    assert layer.weight_scale_inv.stride() == (4, 1)


# ----------------------------------------------------------------------------
# from_checkpoint errors
# ----------------------------------------------------------------------------


def _checkpoint(fmt: str, gen) -> dict[str, torch.Tensor]:
    if fmt == "skinny":
        return {"weight": torch.randn(64, 128, generator=gen), "bias": torch.randn(64, generator=gen)}
    return make_checkpoint(fmt, 128 if fmt == "fp8_block" else 48, 256 if fmt == "fp8_block" else 64, gen,
                           static=True)


FROM_CHECKPOINT = {
    "fp8_block": (Fp8BlockLinear.from_checkpoint, "Fp8BlockLinear.from_checkpoint"),
    "fp8": (Fp8Linear.from_checkpoint, "Fp8Linear.from_checkpoint"),
    "nvfp4": (NvFp4Linear.from_checkpoint, "NvFp4Linear"),
    "skinny": (SkinnyLinear.from_checkpoint, "SkinnyLinear.from_checkpoint"),
}
REQUIRED = {"fp8_block": ("weight", "weight_scale_inv"), "fp8": ("weight", "weight_scale"),
            "nvfp4": ("weight", "weight_scale", "weight_scale_2"), "skinny": ("weight",)}
# (fmt, key, bad value from the good one)
BAD_VALUES = [
    ("fp8_block", "weight", lambda t: t.float()),
    ("fp8_block", "weight_scale_inv", lambda t: t.half()),
    ("fp8_block", "weight_scale_inv", lambda t: t[:, :1]),
    ("fp8_block", "bias", lambda t: t[:-1]),
    ("fp8_block", "bias", lambda t: t.to(torch.int32)),
    ("fp8", "weight", lambda t: t.view(torch.uint8)),
    ("fp8", "weight_scale", lambda t: torch.ones(3)),
    ("fp8", "input_scale", lambda t: t.to(torch.int32)),
    ("fp8", "bias", lambda t: t[:-1]),
    ("nvfp4", "weight", lambda t: t.view(E4M3)),
    ("nvfp4", "weight_scale", lambda t: t.float()),
    ("nvfp4", "weight_scale", lambda t: t[:-1]),
    ("nvfp4", "weight_scale_2", lambda t: t.reshape(1).expand(2)),
    ("nvfp4", "input_scale", lambda t: t.to(torch.int32)),
    ("nvfp4", "bias", lambda t: t.to(torch.int64)),
    ("skinny", "weight", lambda t: t.to(torch.int32)),
    ("skinny", "weight", lambda t: t.reshape(-1)),
    ("skinny", "bias", lambda t: t[:3]),
]


def _edits():
    out = []
    for fmt in FROM_CHECKPOINT:
        keys = {"fp8_block": ("weight", "weight_scale_inv", "bias"), "fp8": ("weight", "weight_scale",
                "input_scale", "bias"), "nvfp4": ("weight", "weight_scale", "weight_scale_2", "input_scale",
                "bias"), "skinny": ("weight", "bias")}[fmt]
        for key in keys:
            out.append((fmt, key, "none", key, lambda t, key=key: {**t, key: None}))
            if key != "weight":  # moved off the weight's device
                out.append((fmt, key, "device", key, lambda t, key=key: {**t, key: t[key].to("meta")}))
        for key in REQUIRED[fmt]:
            out.append((fmt, key, "missing", "tensors", lambda t, key=key: {k: v for k, v in t.items() if k != key}))
        # the weight moved: the next tensor is named, as not on the weight's device
        out.append((fmt, "weight", "device", (*REQUIRED[fmt], "bias")[1],
                    lambda t: {**t, "weight": t["weight"].to("meta")}))
    for i, (fmt, key, bad) in enumerate(BAD_VALUES):
        out.append((fmt, key, f"value{i}", key, lambda t, key=key, bad=bad: {**t, key: bad(t[key])}))
    return out


EDITS = _edits()


@pytest.mark.parametrize("fmt,key,what,arg,edit", EDITS, ids=[f"{e[0]}-{e[1]}-{e[2]}" for e in EDITS])
def test_from_checkpoint_errors_name_the_tensor(fmt, key, what, arg, edit, _seed):
    good = _checkpoint(fmt, torch.Generator().manual_seed(_seed))
    fn, op = FROM_CHECKPOINT[fmt]
    fn(dict(good))  # the unedited checkpoint loads
    with pytest.raises(ValueError) as e:
        fn(edit(good))
    msg = str(e.value)
    assert msg.startswith(f"{op}: {arg}: expected"), msg
    assert key in msg and ", got " in msg, msg
    if what == "device":
        assert "meta" in msg and "cpu" in msg, msg
    if what == "none":
        assert msg.endswith("got None"), msg


@pytest.mark.parametrize("wrapper", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("fmt", sorted(LAYERS))
def test_parallel_from_checkpoint_errors_name_the_tensor(wrapper, fmt, _seed):
    good = _checkpoint(fmt, torch.Generator().manual_seed(_seed))
    for key in good:
        for bad, got in ((None, "got None"), (good[key].to("meta"), "got meta")):
            if key == "weight" and bad is not None:
                continue
            with pytest.raises(ValueError, match=rf"^shard_checkpoint: {key}: expected .*{got}") as e:
                wrapper.from_checkpoint(LAYERS[fmt], {**good, key: bad}, rank=0, world_size=1)
            assert key in str(e.value)
    # a wrong dtype surfaces from the layer's from_checkpoint, naming the tensor
    with pytest.raises(ValueError, match=r": weight: expected dtype"):
        wrapper.from_checkpoint(LAYERS[fmt], {**good, "weight": good["weight"].view(torch.int8)}, rank=0,
                                world_size=1)


# ----------------------------------------------------------------------------
# GPU: device moves and meta-built layers on CUDA
# ----------------------------------------------------------------------------


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if "-bias" in c.name], ids=lambda c: c.name)
def test_cuda_move_and_meta_load(case, _seed):
    layer = case.make(torch.Generator().manual_seed(_seed))
    before = {k: (t.dtype, t.shape) for k, t in _tensors(layer).items()}
    state = layer.state_dict()
    layer.cuda()
    assert all(t.is_cuda for t in _tensors(layer).values())
    assert {k: (t.dtype, t.shape) for k, t in _tensors(layer).items()} == before
    inner = getattr(layer, "inner", layer)
    if isinstance(inner, Fp8BlockLinear):  # cuBLASLt's row stride, restored after the copy
        assert inner.weight_scale_inv.stride(0) % 4 == 0
    with torch.device("meta"):
        other = case.build()
    other.to_empty(device="cuda")
    other.load_state_dict(state)
    for m in M_VALUES:
        x = torch.randn(m, case.k, dtype=BF16, device="cuda")
        assert torch.equal(layer(x), other(x)), f"M={m} (seed {_seed})"
