"""``load_quantized``: fill a float-built or meta-built model from a
quantized checkpoint, swapping its ``nn.Linear`` modules for scaledmm layers
built straight from the checkpoint tensors (no float copy of a quantized
weight is ever made).

Checkpoint conventions (SPEC "Model level"):

* ``fp8_block``: DeepSeek-V3 / Qwen3-FP8. ``weight`` e4m3 ``[N, K]``,
  ``weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``; config
  ``quant_method: "fp8"``, ``weight_block_size``, ``modules_to_not_convert``.
* ``compressed_tensors_fp8``: ``weight`` e4m3, ``weight_scale`` ``[N, 1]``
  (channel), ``[]`` / ``[1]`` (tensor) or ``[ceil(N/bn), ceil(K/bk)]``
  (block), optional static ``input_scale``; config ``quant_method:
  "compressed-tensors"``, ``config_groups``, ``ignore``.
* ``modelopt_nvfp4``: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` e4m3
  ``[N, K/16]``, ``weight_scale_2`` and ``input_scale`` fp32 scalars; config
  ``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``,
  ``exclude_modules`` / ``ignore`` (or ``hf_quant_config.json``).

Safetensors files are read with plain file reads into tensors of their own
(no memory map), one tensor at a time, so the host holds what the model
keeps plus one tensor in flight.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
from typing import Mapping

import torch
from torch import nn

from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear
from scaledmm.oplib import FP8_DTYPE
from scaledmm.quantize import float_weights_outside_linear, layer_format, linears, record, set_submodule

__all__ = ["CONVENTIONS", "load_quantized"]

CONVENTIONS = ("fp8_block", "compressed_tensors_fp8", "modelopt_nvfp4")
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_OP = "load_quantized"

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)


def _fail(what: str, expected: str, got) -> None:
    raise ValueError(f"{_OP}: {what}: expected {expected}, got {got}")


# ---------------------------------------------------------------------------
# Checkpoint sources: a dict, or a folder of (sharded) safetensors
# ---------------------------------------------------------------------------


class _DictSource:
    def __init__(self, tensors: Mapping):
        for k, v in tensors.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                _fail("checkpoint", "a dict of str -> Tensor", f"entry {k!r}: {type(v).__name__}")
        self._t = tensors
        self.names = set(tensors)
        self.config = None

    def dtype(self, name):
        return self._t[name].dtype

    def shape(self, name):
        return tuple(self._t[name].shape)

    def get(self, name):
        return self._t[name]


class SafetensorsFolder:
    """Tensors of the ``*.safetensors`` files of a folder (through
    ``model.safetensors.index.json`` when there is one), read on demand.

    Examples
    --------
    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> folder = tempfile.mkdtemp()
    >>> save_file({"w": torch.ones(2, 3)}, folder + "/model.safetensors")
    >>> src = SafetensorsFolder(folder)
    >>> sorted(src.names), src.shape("w"), src.get("w").sum().item()
    (['w'], (2, 3), 6.0)
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            _fail("checkpoint", "a folder holding *.safetensors files", repr(path))
        self._where: dict[str, tuple[str, int, dict]] = {}
        for fname in files:
            full = os.path.join(path, fname)
            with open(full, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    self._where[name] = (full, 8 + n, info)
        self.names = set(self._where)
        self.config = _read_config(path)

    def _info(self, name):
        full, base, info = self._where[name]
        if info["dtype"] not in _ST_DTYPES:
            _fail(f"checkpoint tensor {name!r} ({os.path.basename(full)})",
                  f"a dtype among {sorted(_ST_DTYPES)}", info["dtype"])
        return full, base, info

    def dtype(self, name):
        return _ST_DTYPES[self._info(name)[2]["dtype"]]

    def shape(self, name):
        return tuple(self._info(name)[2]["shape"])

    def get(self, name):
        full, base, info = self._info(name)
        dtype, shape = _ST_DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            _fail(f"checkpoint tensor {name!r} ({os.path.basename(full)})",
                  f"{nbytes} bytes for {info['dtype']} {list(shape)}", f"{end - begin}")
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(full, "rb") as f:
            f.seek(base + begin)
            if nbytes and f.readinto(buf.numpy()) != nbytes:
                _fail(f"checkpoint tensor {name!r} ({os.path.basename(full)})", f"{nbytes} bytes", "a short file")
        return buf.view(dtype).reshape(shape)


def _read_config(path: str) -> dict | None:
    """The quantization config of a checkpoint folder (None without one)."""
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            q = json.load(f).get("quantization_config")
        if q is not None:
            return q
    hf_quant = os.path.join(path, "hf_quant_config.json")  # ModelOpt's own export
    if os.path.isfile(hf_quant):
        with open(hf_quant) as f:
            q = json.load(f)
        q = dict(q.get("quantization", q))
        q.setdefault("quant_method", "modelopt")
        return q
    return None


def _open(checkpoint) -> "_DictSource | SafetensorsFolder":
    if isinstance(checkpoint, Mapping):
        return _DictSource(checkpoint)
    if isinstance(checkpoint, (str, os.PathLike)) and os.path.isdir(checkpoint):
        return SafetensorsFolder(os.fspath(checkpoint))
    _fail("checkpoint", "a folder of *.safetensors or a dict of name -> Tensor", repr(checkpoint))


# ---------------------------------------------------------------------------
# Conventions
# ---------------------------------------------------------------------------


def _matches(fqn: str, pattern: str) -> bool:
    """Ignore-list matching: ``re:<regex>`` (compressed-tensors), shell
    wildcards (ModelOpt), else a whole dotted component run of the name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], fqn) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(fqn, pattern)
    return f".{pattern}." in f".{fqn}."


class _Plan:
    """How one convention turns a Linear's checkpoint tensors into a layer."""

    def __init__(self, convention: str, config: dict | None):
        self.convention = convention
        self.config = config or {}
        cfg = self.config
        self.scale_key = "weight_scale_inv" if convention == "fp8_block" else "weight_scale"
        if convention == "fp8_block":
            ignore = cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or []
            bs = cfg.get("weight_block_size", [128, 128])
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
                _fail("quantization_config.weight_block_size", "[bn, bk] (fp8_block checkpoints)", bs)
            self.block_size = (int(bs[0]), int(bs[1]))
            scheme = cfg.get("activation_scheme", "dynamic")
            if scheme != "dynamic":
                _fail("quantization_config.activation_scheme", "'dynamic' (1x128 groups)", repr(scheme))
        elif convention == "compressed_tensors_fp8":
            ignore = cfg.get("ignore") or []
            self.groups = list((cfg.get("config_groups") or {}).values())
        else:
            algo = cfg.get("quant_algo", "NVFP4")
            if algo != "NVFP4":
                _fail("quantization_config.quant_algo", "'NVFP4' (modelopt_nvfp4)", repr(algo))
            ignore = cfg.get("exclude_modules") or cfg.get("ignore") or []
        self.ignore = tuple(ignore)

    def ignored(self, fqn: str) -> bool:
        return any(_matches(fqn, p) for p in self.ignore)

    # -- compressed-tensors scheme of one module ----------------------------

    def _ct_scheme(self, fqn: str, lin: nn.Linear, src) -> tuple[str, str, tuple[int, int] | None]:
        """(weight strategy, activation, block) of a compressed-tensors module."""
        if not self.groups:  # a dict without config: the tensors say it
            static = f"{fqn}.input_scale" in src.names
            per_channel = math.prod(src.shape(f"{fqn}.weight_scale")) != 1
            act = "static" if static else ("dynamic_per_token" if per_channel else "dynamic")
            return ("channel" if per_channel else "tensor"), act, None
        group = next((g for g in self.groups if any(
            t in ("Linear", type(lin).__name__) or _matches(fqn, t) for t in g.get("targets", []))), None)
        if group is None:
            _fail(f"quantization_config.config_groups (module {fqn})", "a group whose targets match it",
                  "none (but the checkpoint holds its weight_scale)")
        w, a = group.get("weights") or {}, group.get("input_activations")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            _fail(f"quantization_config.config_groups weights of {fqn}", "type 'float', num_bits 8 (FP8)",
                  f"type {w.get('type')!r}, num_bits {w.get('num_bits')!r}")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            _fail(f"quantization_config weights.strategy of {fqn}", "'channel', 'tensor' or 'block'",
                  repr(strategy))
        if a is None:
            _fail(f"quantization_config input_activations of {fqn}",
                  "an FP8 activation scheme (weight-only FP8 is not supported)", None)
        dynamic, a_strategy = a.get("dynamic"), a.get("strategy")
        if strategy == "block":
            bs = w.get("block_structure") or [128, 128]
            if not dynamic or a_strategy != "group":
                _fail(f"quantization_config input_activations of {fqn}", "dynamic 'group' for block weights",
                      f"dynamic={dynamic}, strategy={a_strategy!r}")
            return strategy, "dynamic", (int(bs[0]), int(bs[1]))
        acts = {(True, "token"): "dynamic_per_token", (True, "tensor"): "dynamic", (False, "tensor"): "static"}
        if (bool(dynamic), a_strategy) not in acts:
            _fail(f"quantization_config input_activations of {fqn}",
                  "dynamic 'token', dynamic 'tensor' or static 'tensor'", f"dynamic={dynamic}, strategy={a_strategy!r}")
        return strategy, acts[bool(dynamic), a_strategy], None

    # -- building -------------------------------------------------------------

    def build(self, fqn: str, lin: nn.Linear, src, device) -> tuple[nn.Module, list[str]]:
        """The layer for ``fqn`` and the checkpoint names it read."""
        n, k = lin.out_features, lin.in_features
        dt = lin.weight.dtype
        t = _Tensors(src, fqn, device)
        strategy, act, block = "block", None, getattr(self, "block_size", None)
        if self.convention == "compressed_tensors_fp8":
            strategy, act, block = self._ct_scheme(fqn, lin, src)
        if self.convention == "modelopt_nvfp4":
            if k % 16:
                _fail(f"model.{fqn}", "in_features a multiple of 16 (nvfp4 scale blocks)", k)
            tensors = {"weight": t.get("weight", (torch.uint8,), [(n, k // 2)]),
                       "weight_scale": t.get("weight_scale", (FP8_DTYPE,), [(n, k // 16)]),
                       "weight_scale_2": t.get("weight_scale_2", _SCALE_FLOAT, [(), (1,)]),
                       "input_scale": t.get("input_scale", _SCALE_FLOAT, [(), (1,)])}
        elif strategy == "block":
            if dt not in (torch.bfloat16, torch.float16):
                _fail(f"model.{fqn}", "a bf16/fp16 Linear (fp8_block layers quantize bf16/fp16 activations; "
                      "build the model in bf16)", dt)
            bn, bk = block
            tensors = {"weight": t.get("weight", (FP8_DTYPE,), [(n, k)]),
                       "weight_scale_inv": t.get(self.scale_key, (torch.float32,), [(-(-n // bn), -(-k // bk))])}
        else:
            shapes = [(n, 1), (n,)] if strategy == "channel" else [(), (1,)]
            tensors = {"weight": t.get("weight", (FP8_DTYPE,), [(n, k)]),
                       "weight_scale": t.get("weight_scale", _SCALE_FLOAT, shapes)}
            if act == "static":
                tensors["input_scale"] = t.get("input_scale", _SCALE_FLOAT, [(), (1,)])
        if lin.bias is not None:
            tensors["bias"] = t.get("bias", _FLOAT, [(n,)])
        if self.convention == "modelopt_nvfp4":
            layer = NvFp4Linear.from_checkpoint(tensors, out_dtype=dt)
        elif strategy == "block":
            layer = Fp8BlockLinear.from_checkpoint(tensors, block_size=block, out_dtype=dt)
        else:
            layer = Fp8Linear.from_checkpoint(tensors, activation=act, out_dtype=dt)
        return layer, t.used


class _Tensors:
    """Checked reads of one module's checkpoint tensors; names the tensor in errors."""

    def __init__(self, src, fqn: str, device):
        self.src, self.fqn, self.device = src, fqn, device
        self.used: list[str] = []

    def get(self, key: str, dtypes, shapes) -> torch.Tensor:
        name = f"{self.fqn}.{key}"
        if name not in self.src.names:
            _fail(f"checkpoint tensor {name!r}", "present", "missing")
        dtype, shape = self.src.dtype(name), self.src.shape(name)
        if dtype not in dtypes:
            _fail(f"checkpoint tensor {name!r}", "dtype " + " or ".join(map(str, dtypes)), dtype)
        if shape not in [tuple(s) for s in shapes]:
            _fail(f"checkpoint tensor {name!r}", "shape " + " or ".join(str(list(s)) for s in shapes), list(shape))
        self.used.append(name)
        return self.src.get(name).to(self.device)


def _detect(src, convention: str) -> tuple[str, dict | None]:
    """The convention to use and the config it reads."""
    cfg = src.config
    found = None
    if cfg is not None:
        method = cfg.get("quant_method")
        found = {"fp8": "fp8_block", "compressed-tensors": "compressed_tensors_fp8",
                 "modelopt": "modelopt_nvfp4", "modelopt_fp4": "modelopt_nvfp4"}.get(method)
        if found is None:
            _fail("config quantization_config.quant_method", "'fp8', 'compressed-tensors' or 'modelopt'",
                  repr(method))
    if convention == "auto":
        if found is None:  # no config: the tensor names say it
            keys = src.names
            if any(k.endswith(".weight_scale_inv") for k in keys):
                found = "fp8_block"
            elif any(k.endswith(".weight_scale_2") for k in keys):
                found = "modelopt_nvfp4"
            elif any(k.endswith(".weight_scale") for k in keys):
                found = "compressed_tensors_fp8"
            else:
                _fail("checkpoint", f"a quantization config or quantized tensors of one of {list(CONVENTIONS)}",
                      "neither")
        return found, cfg
    if convention not in CONVENTIONS:
        _fail("convention", f"'auto' or one of {list(CONVENTIONS)}", repr(convention))
    if found is not None and found != convention:
        _fail("convention", f"{found!r} (what the checkpoint's quantization_config says)", repr(convention))
    return convention, cfg


# ---------------------------------------------------------------------------
# MoE experts held as fused tensors
# ---------------------------------------------------------------------------

# transformers' fused expert tensors [E, rows, K] and the per-expert Linears
# checkpoints publish (DeepSeek-V3, Qwen3-MoE): gate_up_proj = [gate; up].
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _dequantized(src, plan: _Plan, fqn: str, n: int, k: int) -> tuple[torch.Tensor, list[str]]:
    """Float32 ``[n, k]`` weight of one per-expert Linear of the checkpoint
    (its activation scale, if any, is consumed unused: experts run float)."""
    t = _Tensors(src, fqn, torch.device("cpu"))
    if f"{fqn}.input_scale" in src.names:
        t.used.append(f"{fqn}.input_scale")
    if f"{fqn}.{plan.scale_key}" not in src.names:
        return t.get("weight", _FLOAT, [(n, k)]).float(), t.used
    if plan.convention == "modelopt_nvfp4":
        from scaledmm.ops.nvfp4 import dequantize

        q = t.get("weight", (torch.uint8,), [(n, k // 2)])
        s = t.get("weight_scale", (FP8_DTYPE,), [(n, k // 16)])
        s2 = t.get("weight_scale_2", _SCALE_FLOAT, [(), (1,)])
        return dequantize(q, s, swizzled=False) * s2.float().reshape(()), t.used
    w = t.get("weight", (FP8_DTYPE,), [(n, k)]).float()
    strategy, (bn, bk) = "block", getattr(plan, "block_size", (128, 128))
    if plan.convention == "compressed_tensors_fp8":
        weights = [g.get("weights") or {} for g in plan.groups]
        strategy = weights[0].get("strategy") if weights else None
        bn, bk = (weights[0].get("block_structure") if weights else None) or (128, 128)
    if strategy == "block":
        s = t.get(plan.scale_key, (torch.float32,), [(-(-n // bn), -(-k // bk))])
        return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k], t.used
    s = t.get(plan.scale_key, _SCALE_FLOAT, [(n, 1), (n,), (), (1,)]).float()
    return w * (s.reshape(-1, 1) if s.numel() == n else s.reshape(())), t.used


def _fused_experts(src, plan: _Plan, name: str, like: torch.Tensor):
    """The fused expert tensor ``name`` from per-expert checkpoint tensors
    (``<experts>.<e>.gate_proj.weight`` ...), dequantized to the model's
    float dtype; (None, []) when the checkpoint has none."""
    prefix, _, leaf = name.rpartition(".")
    parts = _FUSED.get(leaf)
    if parts is None or like.dim() != 3 or f"{prefix}.0.{parts[0]}.weight" not in src.names:
        return None, []
    experts, rows, k = like.shape
    rows //= len(parts)
    out = torch.empty(like.shape, dtype=like.dtype)
    used: list[str] = []
    for e in range(experts):
        for i, part in enumerate(parts):
            w, names = _dequantized(src, plan, f"{prefix}.{e}.{part}", rows, k)
            out[e, i * rows:(i + 1) * rows] = w
            used += names
    return out, used


# ---------------------------------------------------------------------------
# load_quantized
# ---------------------------------------------------------------------------


def _float_param(src, name: str, like: torch.Tensor, device) -> torch.Tensor:
    """A checkpoint tensor for a non-quantized parameter or buffer: same
    shape; float tensors take the model's dtype, others must match it."""
    dtype, shape = src.dtype(name), src.shape(name)
    if shape != tuple(like.shape):
        _fail(f"checkpoint tensor {name!r}", f"shape {list(like.shape)} (the model's)", list(shape))
    if dtype != like.dtype and not (dtype in _FLOAT + (torch.float64,) and like.dtype.is_floating_point
                                    and like.dtype not in (FP8_DTYPE, torch.float8_e5m2)):
        _fail(f"checkpoint tensor {name!r}", f"dtype {like.dtype} (the model's)", dtype)
    return src.get(name).to(device=device, dtype=like.dtype)


def _target_device(t: torch.Tensor, device):
    if device is not None:
        return torch.device(device)
    return torch.device("cpu") if t.is_meta else t.device


def _rebuild_meta_buffers(model: nn.Module, device) -> None:
    """Non-persistent buffers left on meta (rotary ``inv_freq`` of a model
    built under ``torch.device('meta')``): a Hugging Face model recomputes
    them with its ``_init_weights``; anything else is an error."""
    init = getattr(model, "_init_weights", None)
    for fqn, mod in model.named_modules():
        metas = [n for n, b in mod._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        if callable(init) and not any(p.is_meta for p in mod.parameters(recurse=False)):
            loaded = {n: b.clone() for n, b in mod._buffers.items() if b is not None and not b.is_meta}
            for n in metas:
                mod._buffers[n] = torch.empty_like(mod._buffers[n], device=_target_device(mod._buffers[n], device))
            with torch.no_grad():
                init(mod)
                for n, b in loaded.items():  # the init must not overwrite what was loaded
                    mod._buffers[n].copy_(b)
    still = [f"{fqn}.{n}" if fqn else n for fqn, mod in model.named_modules()
             for n, b in mod._buffers.items() if b is not None and b.is_meta]
    if still:
        _fail("model buffers", "real tensors or tensors in the checkpoint (build the model with parameters "
              "on meta and buffers real, e.g. accelerate.init_empty_weights())", f"meta buffers {still}")


@torch.no_grad()
def load_quantized(model: nn.Module, checkpoint, *, convention: str = "auto", device=None) -> nn.Module:
    """Swap the model's ``nn.Linear`` modules that the checkpoint quantizes
    for scaledmm layers built from its tensors, and load every other
    parameter and persistent buffer from it; returns ``model``.

    The model may be built with real float weights or on the meta device
    (``with torch.device("meta"): ...`` or ``accelerate.init_empty_weights()``):
    quantized layers are made straight from the checkpoint's codes and
    scales, so no float copy of a quantized weight is ever created.  Every
    meta parameter must be in the checkpoint (a tied parameter under any of
    its names); non-persistent buffers left on meta are recomputed for
    Hugging Face models (rotary ``inv_freq``) and an error otherwise.
    Linears the checkpoint's config ignores (``modules_to_not_convert``,
    ``ignore``, ``exclude_modules``) or stores in float (DeepSeek-V3's
    ``lm_head``) stay ``nn.Linear``; weights that are not ``nn.Linear``
    (fused MoE expert tensors) load as float.  Float checkpoint tensors take
    the model's dtype.  :func:`scaledmm.quantize_report` lists the result.

    Parameters
    ----------
    model : nn.Module
    checkpoint : str, os.PathLike or dict
        A folder of ``*.safetensors`` (sharded through
        ``model.safetensors.index.json`` or not) with its ``config.json``,
        or a dict of name -> Tensor.
    convention : str
        ``"auto"`` (read ``quantization_config`` of ``config.json`` or
        ModelOpt's ``hf_quant_config.json``; a dict: its tensor names),
        ``"fp8_block"``, ``"compressed_tensors_fp8"`` or ``"modelopt_nvfp4"``.
    device : torch.device or str, optional
        Where the model's tensors go (each read from the checkpoint straight
        there); default: where each replaced tensor was, CPU for meta tensors.

    Raises
    ------
    ValueError
        A missing, mis-shaped or wrongly typed tensor (named), an unknown
        convention or an unsupported quantization config.

    Examples
    --------
    >>> import torch, scaledmm
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16))
    >>> ckpt = {"0.weight": torch.randn(128, 256).to(torch.float8_e4m3fn),
    ...         "0.weight_scale_inv": torch.full((1, 2), 0.01)}
    >>> model = scaledmm.load_quantized(model, ckpt)
    >>> type(model[0]).__name__, model(torch.randn(2, 256, dtype=torch.bfloat16)).shape
    ('Fp8BlockLinear', torch.Size([2, 128]))
    """
    if not isinstance(model, nn.Module) or isinstance(model, nn.Linear):
        _fail("model", "an nn.Module holding nn.Linear modules (a bare Linear: use the layers' from_checkpoint)",
              type(model).__name__)
    src = _open(checkpoint)
    name, cfg = _detect(src, convention)
    plan = _Plan(name, cfg)
    target = getattr(model, "_orig_mod", model)
    used: set[str] = set()
    built: dict[int, nn.Module] = {}
    left: dict[str, str] = {}
    for fqn, lin in linears(target):
        if id(lin) in built:
            set_submodule(target, fqn, built[id(lin)])
            continue
        scale = f"{fqn}.{plan.scale_key}"
        if plan.ignored(fqn):
            if scale in src.names:
                _fail(f"checkpoint tensor {scale!r}", f"absent: the config's ignore list {list(plan.ignore)} "
                      f"leaves {fqn} float", "present")
            left[fqn] = "ignored by the checkpoint's config"
            continue
        if scale not in src.names:
            w = f"{fqn}.weight"
            if w in src.names and src.dtype(w) not in _FLOAT:
                _fail(f"checkpoint tensor {scale!r}", f"present ({w} is {src.dtype(w)})", "missing")
            left[fqn] = "float in the checkpoint"
            continue
        layer, names = plan.build(fqn, lin, src, _target_device(lin.weight, device))
        used.update(names)
        built[id(lin)] = layer
        set_submodule(target, fqn, layer)

    # Everything else: parameters (tied ones once) and persistent buffers.
    owners: dict[int, list] = {}
    for mfqn, mod in target.named_modules(remove_duplicate=False):
        if layer_format(mod) is not None:
            continue
        pre = f"{mfqn}." if mfqn else ""
        for kind, table in (("param", mod._parameters), ("buffer", mod._buffers)):
            for pname, t in table.items():
                if t is None or (kind == "buffer" and pname in mod._non_persistent_buffers_set):
                    continue
                owners.setdefault(id(t), []).append((mod, kind, pname, pre + pname, t))
    missing = []
    for entries in owners.values():
        t = entries[0][4]
        found = next((e[3] for e in entries if e[3] in src.names), None)
        if found is not None:
            value = _float_param(src, found, t, _target_device(t, device))
            used.add(found)
        else:
            value, names = _fused_experts(src, plan, entries[0][3], t)
            if value is None:
                if t.is_meta:
                    missing.append(entries[0][3])
                continue
            value = value.to(_target_device(t, device))
            used.update(names)
        if entries[0][1] == "param":
            value = nn.Parameter(value, requires_grad=t.requires_grad and value.is_floating_point())
        for mod, kind, pname, _, _ in entries:
            (mod._parameters if kind == "param" else mod._buffers)[pname] = value
    if missing:
        _fail("checkpoint", "a tensor for every parameter of the model built on meta",
              f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")
    _rebuild_meta_buffers(target, device)
    if device is not None:  # what the checkpoint did not hold (buffers, kept parameters) follows
        target.to(device)

    notes = float_weights_outside_linear(target)
    if (cfg or {}).get("scale_fmt") == "ue8m0":
        notes.append("quantization_config.scale_fmt 'ue8m0': activations are quantized with float32 scales")
    unused = sorted(src.names - used)
    if unused:
        notes.append(f"{len(unused)} checkpoint tensors not used: {unused[:6]}{' ...' if len(unused) > 6 else ''}")
    record(target, left, notes)
    return model

