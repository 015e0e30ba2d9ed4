"""scaledmm.load_quantized: the three checkpoint conventions, folders and dicts,
meta-built models, errors naming the tensor, memory (CPU; one GPU test)."""

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import scaledmm
from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear

from checkpoint_helpers import (FP8, calibrate, config_for, dequantize_layer, dequantize_tensors, float_model_from,
                                nvfp4_tensors, quantized_state, write_checkpoint)
from helpers import requires_cuda

SKIP = ("lm_head", "router")  # left float by the checkpoints below
LINEARS = ("layers.0.attn", "layers.0.up", "layers.0.down", "layers.1.attn", "layers.1.up", "layers.1.down")

# (convention, options of quantized_state / config_for, expected layer, from_checkpoint options)
CASES = {
    "fp8_block": ("fp8_block", {}, Fp8BlockLinear, {}),
    "ct_channel": ("compressed_tensors_fp8", {"strategy": "channel"}, Fp8Linear, {"activation": "dynamic_per_token"}),
    "ct_tensor": ("compressed_tensors_fp8", {"strategy": "tensor"}, Fp8Linear, {"activation": "dynamic"}),
    "ct_tensor_static": ("compressed_tensors_fp8", {"strategy": "tensor", "static": True}, Fp8Linear,
                         {"activation": "static"}),
    "modelopt": ("modelopt_nvfp4", {}, NvFp4Linear, {}),
}


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.attn = nn.Linear(256, 256, bias=False, dtype=dtype)
        self.up = nn.Linear(256, 384, bias=True, dtype=dtype)
        self.down = nn.Linear(384, 256, bias=False, dtype=dtype)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.attn(h))))


class Net(nn.Module):
    """Embedding, norm, blocks, a float router, an output head, a persistent
    and a non-persistent buffer (like a rotary ``inv_freq``)."""

    def __init__(self, dtype=torch.bfloat16, tie=False):
        super().__init__()
        self.embed = nn.Embedding(96, 256, dtype=dtype)
        self.layers = nn.ModuleList([Block(dtype) for _ in range(2)])
        self.norm = nn.LayerNorm(256, dtype=dtype)
        self.router = nn.Linear(256, 32, bias=False, dtype=dtype)
        self.lm_head = nn.Linear(256, 96, bias=False, dtype=dtype)
        if tie:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 256, dtype=dtype))
        self.register_buffer("freq", torch.arange(4, dtype=torch.float32), persistent=False)

    def forward(self, ids):
        h = self.embed(ids) * self.gain + self.freq.sum().to(self.gain.dtype)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return self.lm_head(h) + self.router(h).mean(-1, keepdim=True)


@contextlib.contextmanager
def params_on_meta():
    """Build modules with parameters on meta and buffers real (what
    ``accelerate.init_empty_weights()`` does), without accelerate."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, param)
        if param is not None and not param.is_meta:  # a tied (already meta) parameter stays itself
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _float_net(dtype=torch.bfloat16, tie=False):
    net = Net(dtype, tie)
    with torch.no_grad():  # unit-gain weights: every layer moves the output
        for p in net.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    return net


def _checkpoint(tmp_path, case, net=None, shards=2):
    conv, opts, _, _ = CASES[case]
    net = net or _float_net()
    amax = calibrate(net, torch.randint(0, 96, (4, 16)))
    state = quantized_state(net, conv, skip=SKIP, input_amax=amax, **opts)
    cfg = config_for(conv, skip=("lm_head",), **opts)  # the router is float in the checkpoint, not listed
    return net, state, write_checkpoint(str(tmp_path / case), state, cfg, shards=shards)


def _module_tensors(state, fqn):
    return {k[len(fqn) + 1:]: v for k, v in state.items() if k.rpartition(".")[0] == fqn}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Output error against the float model holding the checkpoint's dequantized
# weights: only activation quantization differs.  Per GEMM, e4m3 rounding of
# the activation has an RMS relative error of 2^-4 / sqrt(3) ~ 0.036, NVFP4's
# e2m1 grid ~ 0.1 (see test_quantize.WEIGHT_BOUND); errors of the G = 6
# quantized GEMMs add in quadrature, so sqrt(6) * eps, doubled for margin.
ACT_BOUND = {Fp8BlockLinear: 2 * 6**0.5 * 0.036, Fp8Linear: 2 * 6**0.5 * 0.036, NvFp4Linear: 2 * 6**0.5 * 0.1}


@pytest.mark.parametrize("case", list(CASES))
def test_meta_model_is_filled_with_the_checkpoints_layers(tmp_path, case):
    conv, _, cls, opts = CASES[case]
    net, state, path = _checkpoint(tmp_path, case)
    with params_on_meta():
        model = Net()
    assert all(p.is_meta for p in model.parameters())
    assert scaledmm.load_quantized(model, path) is model
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    for fqn in LINEARS:
        layer = model.get_submodule(fqn)
        assert type(layer) is cls, fqn
        tensors = _module_tensors(state, fqn)
        if cls is NvFp4Linear:
            ref = cls.from_checkpoint(tensors, out_dtype=torch.bfloat16)
        else:
            ref = cls.from_checkpoint(tensors, out_dtype=torch.bfloat16, **opts)
        x = torch.randn(5, layer.in_features, dtype=torch.bfloat16)
        assert torch.equal(layer(x), ref(x)), fqn  # the same layer, same options
        w = dequantize_tensors(tensors, layer.out_features, layer.in_features)
        assert torch.equal(dequantize_layer(layer), w), fqn
    for name in ("embed.weight", "norm.weight", "norm.bias", "router.weight", "lm_head.weight", "gain",
                 "layers.0.up.bias"):
        got = model.get_parameter(name) if "gain" not in name else model.gain
        if name == "layers.0.up.bias":
            got = got[:384]  # padded bias of the fp8 layers
        assert torch.equal(got, state[name]), name
    assert torch.equal(model.freq, torch.arange(4, dtype=torch.float32))
    report = scaledmm.quantize_report(model)
    assert report["router"].detail == "float in the checkpoint" and report["lm_head"].fmt is None
    assert {e.fqn for e in report.swapped} == set(LINEARS)
    ids = torch.randint(0, 96, (3, 7))
    with torch.no_grad():
        out, ref = model(ids), float_model_from(net, state)(ids)
    assert _rel(out, ref) < ACT_BOUND[cls], case


def test_folder_layouts_and_dicts_load_the_same_model(tmp_path):
    net, state, sharded = _checkpoint(tmp_path, "ct_channel", shards=3)
    single = write_checkpoint(str(tmp_path / "single"), state, config_for("compressed_tensors_fp8"), shards=1)
    assert not os.path.exists(os.path.join(single, "model.safetensors.index.json"))
    ids = torch.randint(0, 96, (2, 9))
    outs = []
    for ckpt in (sharded, single, state):
        with params_on_meta():
            model = Net()
        with torch.no_grad():
            outs.append(scaledmm.load_quantized(model, ckpt)(ids))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_float_built_model_is_swapped_and_overwritten(tmp_path):
    net, state, path = _checkpoint(tmp_path, "fp8_block")
    model = _float_net()  # other random weights
    scaledmm.load_quantized(model, path, convention="fp8_block")
    assert type(model.layers[1].down) is Fp8BlockLinear
    assert torch.equal(model.embed.weight, state["embed.weight"])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])


def test_tied_parameters_load_once_under_either_name():
    net = _float_net(tie=True)
    state = quantized_state(net, "fp8_block", skip=SKIP)
    del state["lm_head.weight"]  # saved once, under the embedding's name
    with params_on_meta():
        model = Net(tie=True)
    scaledmm.load_quantized(model, state)
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.lm_head.weight, state["embed.weight"])


def test_buffers_of_a_model_built_under_the_meta_device():
    net = _float_net()
    state = quantized_state(net, "fp8_block", skip=SKIP)
    with torch.device("meta"):
        model = Net()
    # the persistent buffer comes from the checkpoint; the non-persistent one cannot
    with pytest.raises(ValueError, match=r"meta buffers \['freq'\]"):
        scaledmm.load_quantized(model, state)
    assert torch.equal(model.gain, state["gain"])


@pytest.mark.parametrize("convention, config, layer", [
    ("fp8_block", {"modules_to_not_convert": ["router", "layers.1.up"]}, Fp8BlockLinear),
    ("compressed_tensors_fp8", {"ignore": ["lm_head", "re:.*router$", "re:layers\\.1\\.up$"]}, Fp8Linear),
    ("modelopt_nvfp4", {"exclude_modules": ["lm_head", "router", "layers.*.up"]}, NvFp4Linear),
])
def test_ignore_lists_leave_modules_float(tmp_path, convention, config, layer):
    net = _float_net()
    skip = SKIP + (("layers.1.up",) if convention != "modelopt_nvfp4" else ("layers.0.up", "layers.1.up"))
    state = quantized_state(net, convention, skip=skip)
    cfg = {**config_for(convention), **config}
    path = write_checkpoint(str(tmp_path / "c"), state, cfg)
    with params_on_meta():
        model = Net()
    scaledmm.load_quantized(model, path)
    report = scaledmm.quantize_report(model)
    for fqn in skip:
        assert type(model.get_submodule(fqn)) is nn.Linear, fqn
        if fqn != "lm_head" or convention != "fp8_block":
            assert report[fqn].detail == "ignored by the checkpoint's config", fqn
        assert torch.equal(model.get_submodule(fqn).weight, state[f"{fqn}.weight"])
    assert type(model.layers[0].attn) is layer
    # a module the config ignores must not come quantized
    bad = dict(quantized_state(net, convention, skip=SKIP))
    path = write_checkpoint(str(tmp_path / "bad"), bad, cfg)
    with params_on_meta():
        model = Net()
    with pytest.raises(ValueError, match=r"'layers\.\d\.up\.weight_scale.*expected absent"):
        scaledmm.load_quantized(model, path)


def test_convention_detection(tmp_path):
    net, state, path = _checkpoint(tmp_path, "modelopt")
    with params_on_meta():
        model = Net()
    with pytest.raises(ValueError, match=r"convention: expected 'modelopt_nvfp4'.*got 'fp8_block'"):
        scaledmm.load_quantized(model, path, convention="fp8_block")
    with pytest.raises(ValueError, match=r"convention: expected 'auto' or one of \['fp8_block', "
                                         r"'compressed_tensors_fp8', 'modelopt_nvfp4'\], got 'nvfp4'"):
        scaledmm.load_quantized(model, state, convention="nvfp4")
    with pytest.raises(ValueError, match="checkpoint: expected a quantization config or quantized tensors"):
        scaledmm.load_quantized(model, {"embed.weight": state["embed.weight"]})
    with pytest.raises(ValueError, match="checkpoint: expected a folder"):
        scaledmm.load_quantized(model, str(tmp_path / "nowhere"))
    gptq = write_checkpoint(str(tmp_path / "gptq"), state, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method.*got 'gptq'"):
        scaledmm.load_quantized(model, gptq)
    # ModelOpt's own hf_quant_config.json when config.json has no quantization_config
    own = write_checkpoint(str(tmp_path / "own"), state, None)
    with open(os.path.join(own, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "router"]}}, f)
    scaledmm.load_quantized(model, own)
    assert type(model.layers[0].up) is NvFp4Linear
    assert scaledmm.quantize_report(model)["router"].detail == "ignored by the checkpoint's config"


def _broken(state, case):
    s = dict(state)
    if case == "missing_scale":
        del s["layers.0.attn.weight_scale_inv"]
    elif case == "scale_shape":
        s["layers.1.up.weight_scale_inv"] = torch.ones(2, 3)
    elif case == "scale_dtype":
        s["layers.1.up.weight_scale_inv"] = s["layers.1.up.weight_scale_inv"].to(torch.bfloat16)
    elif case == "weight_dtype":
        s["layers.0.down.weight"] = s["layers.0.down.weight"].to(torch.bfloat16)
    elif case == "weight_shape":
        s["layers.0.down.weight"] = s["layers.0.down.weight"][:, :256].contiguous()
    elif case == "missing_weight":
        del s["layers.1.attn.weight"]
    elif case == "missing_bias":
        del s["layers.0.up.bias"]
    elif case == "missing_norm":
        del s["norm.weight"]
    elif case == "embed_shape":
        s["embed.weight"] = s["embed.weight"][:90]
    elif case == "embed_dtype":
        s["embed.weight"] = s["embed.weight"].to(FP8)
    return s


@pytest.mark.parametrize("case, name", [
    ("missing_scale", r"'layers\.0\.attn\.weight_scale_inv': expected present .*, got missing"),
    ("scale_shape", r"'layers\.1\.up\.weight_scale_inv': expected shape \[3, 2\], got \[2, 3\]"),
    ("scale_dtype", r"'layers\.1\.up\.weight_scale_inv': expected dtype torch.float32, got torch.bfloat16"),
    ("weight_dtype", r"'layers\.0\.down\.weight': expected dtype torch.float8_e4m3fn, got torch.bfloat16"),
    ("weight_shape", r"'layers\.0\.down\.weight': expected shape \[256, 384\], got \[256, 256\]"),
    ("missing_weight", r"'layers\.1\.attn\.weight': expected present, got missing"),
    ("missing_bias", r"'layers\.0\.up\.bias': expected present, got missing"),
    ("missing_norm", r"missing \['norm\.weight'\]"),
    ("embed_shape", r"'embed\.weight': expected shape \[96, 256\]"),
    ("embed_dtype", r"'embed\.weight': expected dtype torch.bfloat16"),
])
def test_bad_tensors_raise_naming_them(case, name):
    state = _broken(quantized_state(_float_net(), "fp8_block", skip=SKIP), case)
    with params_on_meta():
        model = Net()
    with pytest.raises(ValueError, match=name):
        scaledmm.load_quantized(model, state)


@pytest.mark.parametrize("case, key", [("modelopt", "input_scale"), ("modelopt", "weight_scale_2"),
                                       ("ct_tensor_static", "input_scale"), ("ct_channel", "weight_scale")])
def test_convention_tensors_are_required(tmp_path, case, key):
    _, state, _ = _checkpoint(tmp_path, case)
    conv = CASES[case][0]
    state = dict(state)
    del state[f"layers.0.down.{key}"]
    path = write_checkpoint(str(tmp_path / "broken"), state, config_for(conv, **CASES[case][1]))
    with params_on_meta():
        model = Net()
    with pytest.raises(ValueError, match=rf"'layers\.0\.down\.{key}'"):
        scaledmm.load_quantized(model, path)


def test_compressed_tensors_block_strategy(tmp_path):
    net = _float_net()
    state = quantized_state(net, "fp8_block", skip=SKIP)
    state = {k.replace("weight_scale_inv", "weight_scale"): v for k, v in state.items()}
    cfg = config_for("compressed_tensors_fp8")
    group = cfg["config_groups"]["group_0"]
    group["weights"].update(strategy="block", block_structure=[128, 128])
    group["input_activations"].update(strategy="group", group_size=128, dynamic=True)
    path = write_checkpoint(str(tmp_path / "blk"), state, cfg)
    with params_on_meta():
        model = Net()
    scaledmm.load_quantized(model, path)
    layer = model.layers[1].down
    assert type(layer) is Fp8BlockLinear
    w = dequantize_tensors(_module_tensors(state, "layers.1.down"), 256, 384, block=(128, 128))
    assert torch.equal(dequantize_layer(layer), w)


def test_safetensors_reader_matches_the_library(tmp_path):
    from safetensors import safe_open

    from scaledmm.checkpoint import SafetensorsFolder

    tensors = {"bf16": torch.randn(3, 5, dtype=torch.bfloat16), "f16": torch.randn(7, dtype=torch.float16),
               "f32": torch.randn(2, 2, 2), "f64": torch.randn(4, dtype=torch.float64),
               "e4m3": torch.randn(9, 16).to(FP8), "e5m2": torch.randn(3).to(torch.float8_e5m2),
               "u8": torch.randint(0, 255, (33,), dtype=torch.uint8), "i64": torch.arange(-3, 5),
               "bool": torch.rand(6) > 0.5, "scalar": torch.tensor(0.125), "empty": torch.empty(0, 4)}
    path = write_checkpoint(str(tmp_path / "r"), tensors, None, shards=2)
    src = SafetensorsFolder(path)
    assert src.names == set(tensors)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    for name, t in tensors.items():
        with safe_open(os.path.join(path, index[name]), "pt") as f:
            ref = f.get_tensor(name)
        got = src.get(name)
        assert got.dtype == ref.dtype == t.dtype and got.shape == ref.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name
        assert src.dtype(name) == t.dtype and src.shape(name) == tuple(t.shape)


class _Created(TorchDispatchMode):
    """Records dtype and element count of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((t.dtype, t.numel(), str(func)))
        return out


@pytest.mark.parametrize("case", ["fp8_block", "ct_channel", "modelopt"])
def test_no_float_copy_of_a_quantized_weight_is_ever_made(tmp_path, case):
    _, state, path = _checkpoint(tmp_path, case)
    with params_on_meta():
        model = Net()
    with _Created() as mode:
        scaledmm.load_quantized(model, path)
    # The smallest quantized weight has 256 * 256 elements; every float tensor of
    # the model (embedding, head: 96 * 256) is smaller.  So no float tensor that
    # large may appear while loading.
    floats = [(d, n, f) for d, n, f in mode.seen if d.is_floating_point and d.itemsize >= 2]
    assert floats and max(n for _, n, _ in floats) < 256 * 256, max(floats, key=lambda x: x[1])
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    float_bytes = sum(t.numel() * t.element_size() for t in (*_float_net().parameters(), *Net().buffers()))
    assert held < (0.6 if case != "modelopt" else 0.4) * float_bytes, (held, float_bytes)


_RSS_CHILD = textwrap.dedent("""
    import json, sys, torch, scaledmm
    from torch import nn

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 4096, bias=False, dtype=torch.bfloat16) for _ in range(16)])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    scaledmm.load_quantized(model, sys.argv[1])
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak": status("VmHWM") - before, "held": held}))
""")


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs /proc/self/clear_refs")
def test_peak_host_memory_stays_near_the_quantized_size(tmp_path):
    # 16 x [4096, 2048]: 268 MB in bf16, 134 MB as fp8 (+ 32 KB of scales)
    state = {}
    for i in range(16):
        codes = torch.randint(0, 0x7E, (4096, 2048), dtype=torch.uint8)  # finite e4m3 codes
        state[f"{i}.weight"] = codes.view(FP8)
        state[f"{i}.weight_scale_inv"] = torch.full((32, 16), 1e-3)
    path = write_checkpoint(str(tmp_path / "big"), state, config_for("fp8_block"), shards=4)
    del state
    # glibc keeps freed heap blocks resident (its mmap threshold adapts upward), so
    # the child's RSS would count released buffers as held; a fixed threshold makes
    # every large tensor its own mapping, returned on free, and RSS = live bytes.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, path], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    float_bytes = 16 * 4096 * 2048 * 2
    # what the model keeps plus a layer in flight (its read buffer), plus allocator slack
    assert res["peak"] < res["held"] + 4096 * 2048 * 2 + 16 * 2**20, res
    assert res["peak"] < 0.6 * float_bytes, res


@requires_cuda
@pytest.mark.gpu
def test_gpu_peak_memory_stays_near_the_quantized_size(tmp_path):
    state = {}
    for i in range(8):
        state.update({f"{i}.{k}": v for k, v in nvfp4_tensors(torch.randn(4096, 2048), 4.0).items()})
    path = write_checkpoint(str(tmp_path / "gpu"), state, config_for("modelopt_nvfp4", skip=()))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 4096, bias=False, dtype=torch.bfloat16) for _ in range(8)])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    scaledmm.load_quantized(model, path, device="cuda")
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    peak = torch.cuda.max_memory_allocated() - base
    assert all(p.is_cuda for p in model.parameters())
    # kept tensors plus one layer in flight (the read copy and the padded swizzled copies)
    assert peak < held + 3 * (4096 * 1024 + 4096 * 128) + 2**20, (peak, held)
    x = torch.randn(3, 2048, dtype=torch.bfloat16, device="cuda")
    assert all(layer(x).isfinite().all() for layer in model)
