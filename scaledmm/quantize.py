"""Model-level quantization: ``quantize_`` swaps a model's ``nn.Linear``
modules for scaledmm layers in place; ``quantize_report(model)`` says what
was swapped and what was left float, and why.

Formats (a string is the default :class:`QuantConfig` of that name):

=============== ============================================ ==================
format          weight / activation                          layer
=============== ============================================ ==================
``fp8_block``   e4m3, 128x128 weight blocks / dynamic 1x128  ``Fp8BlockLinear``
``fp8``         e4m3, per channel / dynamic per token        ``Fp8Linear``
``fp8_tensor``  e4m3, per tensor / dynamic per tensor        ``Fp8Linear``
``nvfp4``       e2m1 + e4m3 per 16 / dynamic NVFP4 (W4A4)    ``NvFp4Linear``
``nvfp4_w4a16`` e2m1 + e4m3 per 16 / bf16, fp16 (W4A16)      ``NvFp4Linear``
=============== ============================================ ==================

The report is kept beside the model (a weak reference, nothing is attached
to it) and rebuilt from its modules when asked for, so it follows later
calls: a linear's entry is its current layer, or the reason the last
``quantize_`` / ``load_quantized`` call gave for leaving it float.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable

import torch
from torch import nn

from scaledmm import validation as V
from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear

__all__ = ["FORMATS", "QuantConfig", "QuantizeReport", "ReportEntry", "quantize_", "quantize_report"]

FORMATS = ("fp8_block", "fp8", "fp8_tensor", "nvfp4", "nvfp4_w4a16")
LAYERS = {"fp8_block": Fp8BlockLinear, "fp8": Fp8Linear, "fp8_tensor": Fp8Linear, "nvfp4": NvFp4Linear,
          "nvfp4_w4a16": NvFp4Linear}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Activation schemes of the fp8 formats: no calibration data here, so dynamic only.
_FP8_ACTIVATIONS = ("dynamic_per_token", "dynamic")
_NVFP4_K = 16  # one e4m3 scale per 16 weights along K


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A quantization format and its options; ``quantize_`` takes one
    wherever it takes a format name.

    Parameters
    ----------
    fmt : str
        One of ``FORMATS``.
    block_size : (int, int)
        ``fp8_block`` only: weight block ``(bn, bk)``.
    activation : str, optional
        ``fp8`` / ``fp8_tensor`` only: ``"dynamic_per_token"`` (the default
        of ``fp8``) or ``"dynamic"`` (one scale per call, the default of
        ``fp8_tensor``).
    out_dtype : torch.dtype, optional
        Output dtype of every swapped layer; default: each Linear's dtype.
    skip : tuple of str
        Module names (last component of the fully qualified name) that the
        default filter leaves float: output heads.

    Examples
    --------
    >>> import scaledmm
    >>> scaledmm.QuantConfig("fp8")
    QuantConfig(fmt='fp8', block_size=(128, 128), activation='dynamic_per_token', out_dtype=None, skip=('lm_head',))
    >>> scaledmm.QuantConfig("fp8", activation="dynamic").activation
    'dynamic'
    """

    fmt: str
    block_size: tuple[int, int] = (128, 128)
    activation: str | None = None
    out_dtype: torch.dtype | None = None
    skip: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        op = "QuantConfig"
        if self.fmt not in FORMATS:
            V.fail(op, "fmt", f"one of {list(FORMATS)}", repr(self.fmt))
        bs = tuple(self.block_size)
        if len(bs) != 2 or not all(isinstance(b, int) and b > 0 for b in bs):
            V.fail(op, "block_size", "two positive ints (bn, bk)", self.block_size)
        object.__setattr__(self, "block_size", bs)
        if self.fmt in ("fp8", "fp8_tensor"):
            act = self.activation or ("dynamic_per_token" if self.fmt == "fp8" else "dynamic")
            if act not in _FP8_ACTIVATIONS:
                V.fail(op, "activation", f"one of {list(_FP8_ACTIVATIONS)} for fmt={self.fmt!r}", repr(act))
            object.__setattr__(self, "activation", act)
        elif self.activation is not None:
            V.fail(op, "activation", f"None for fmt={self.fmt!r} (its activation scheme is fixed)",
                   repr(self.activation))
        if self.out_dtype is not None:
            V.check_out_dtype(op, self.out_dtype)
        if isinstance(self.skip, str):
            V.fail(op, "skip", "a tuple of module names", repr(self.skip))
        object.__setattr__(self, "skip", tuple(self.skip))

    @classmethod
    def of(cls, fmt: "str | QuantConfig") -> "QuantConfig":
        """``fmt`` as a config: a config itself, a format name its default config.

        Examples
        --------
        >>> from scaledmm import QuantConfig
        >>> QuantConfig.of("nvfp4") == QuantConfig("nvfp4")
        True
        """
        if isinstance(fmt, cls):
            return fmt
        if isinstance(fmt, str) and fmt in FORMATS:
            return cls(fmt)
        V.fail("quantize_", "fmt", f"one of {list(FORMATS)} or a QuantConfig", repr(fmt))

    def rejects(self, linear: nn.Linear) -> str | None:
        """Why this format cannot take ``linear`` (None when it can).

        The layers' requirements: ``Fp8BlockLinear`` and ``Fp8Linear`` take
        any N and K (they pad at load time); ``Fp8BlockLinear`` quantizes
        bf16/fp16 activations only; ``NvFp4Linear`` needs K % 16 == 0.

        Examples
        --------
        >>> import torch
        >>> from scaledmm import QuantConfig
        >>> QuantConfig("nvfp4").rejects(torch.nn.Linear(100, 64))
        'K=100 is not a multiple of 16 (nvfp4 scale blocks)'
        """
        w = linear.weight
        if w.dtype not in _FLOAT_DTYPES:
            return f"weight dtype {w.dtype} is not bf16/fp16/fp32"
        if self.fmt == "fp8_block" and w.dtype not in V.HALF_DTYPES:
            return f"fp8_block quantizes bf16/fp16 activations; the Linear is {w.dtype}"
        if self.fmt.startswith("nvfp4") and linear.in_features % _NVFP4_K:
            return f"K={linear.in_features} is not a multiple of {_NVFP4_K} (nvfp4 scale blocks)"
        return None

    def quantize(self, linear: nn.Linear) -> nn.Module:
        """The scaledmm layer for ``linear`` (its weight quantized).

        Examples
        --------
        >>> import torch
        >>> from scaledmm import QuantConfig
        >>> type(QuantConfig("fp8_tensor").quantize(torch.nn.Linear(64, 32))).__name__
        'Fp8Linear'
        """
        out_dtype = self.out_dtype or linear.weight.dtype
        if self.fmt == "fp8_block":
            return Fp8BlockLinear.from_float(linear, block_size=self.block_size, out_dtype=out_dtype)
        if self.fmt in ("fp8", "fp8_tensor"):
            return Fp8Linear.from_float(linear, per_channel=self.fmt == "fp8", activation=self.activation,
                                        out_dtype=out_dtype)
        return NvFp4Linear.from_float(linear, out_dtype=out_dtype, use_w4a16=self.fmt == "nvfp4_w4a16")


def layer_format(module: nn.Module) -> str | None:
    """The format name of a scaledmm layer (None for any other module).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers import Fp8Linear
    >>> from scaledmm.quantize import layer_format
    >>> layer_format(Fp8Linear.from_float(torch.nn.Linear(32, 16), per_channel=True))
    'fp8'
    """
    if isinstance(module, Fp8BlockLinear):
        return "fp8_block"
    if isinstance(module, Fp8Linear):
        return "fp8" if module.per_channel else "fp8_tensor"
    if isinstance(module, NvFp4Linear):
        return "nvfp4_w4a16" if module.use_w4a16 else "nvfp4"
    return None


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReportEntry:
    """One linear of a model: ``fmt`` is its format when swapped (None when
    left float); ``detail`` the layer's options, or why it was left."""

    fqn: str
    in_features: int
    out_features: int
    fmt: str | None
    detail: str


class QuantizeReport:
    """What ``quantize_`` / ``load_quantized`` swapped and what they left.

    ``print(report)`` gives a table; ``swapped`` / ``left`` the entries;
    ``notes`` float weights outside ``nn.Linear`` (MoE experts held as
    fused parameters, routers) and checkpoint tensors that were not used.
    """

    def __init__(self, entries, notes=()):
        self.entries = tuple(entries)
        self.notes = tuple(notes)

    @property
    def swapped(self) -> tuple[ReportEntry, ...]:
        return tuple(e for e in self.entries if e.fmt is not None)

    @property
    def left(self) -> tuple[ReportEntry, ...]:
        return tuple(e for e in self.entries if e.fmt is None)

    def __getitem__(self, fqn: str) -> ReportEntry:
        for e in self.entries:
            if e.fqn == fqn:
                return e
        raise KeyError(fqn)

    def __str__(self) -> str:
        rows = [(e.fqn, f"{e.in_features} -> {e.out_features}", e.fmt or "left",
                 e.detail) for e in self.entries]
        head = ("module", "K -> N", "format", "detail")
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in (head, *rows)]
        lines.append(f"{len(self.swapped)} swapped, {len(self.left)} left float")
        lines.extend(self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"QuantizeReport({len(self.swapped)} swapped, {len(self.left)} left float)"


# Why each linear was left float (or which format it was given), per model, by
# the last call that saw it.
_LEFT: "weakref.WeakKeyDictionary[nn.Module, dict[str, str]]" = weakref.WeakKeyDictionary()
_FMT: "weakref.WeakKeyDictionary[nn.Module, dict[str, str]]" = weakref.WeakKeyDictionary()
_NOTES: "weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]]" = weakref.WeakKeyDictionary()


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule


def record(model: nn.Module, left: dict[str, str], notes=(), formats: dict[str, str] | None = None) -> None:
    """Remember why ``quantize_`` / ``load_quantized`` left linears float and
    the format names they swapped others to."""
    model = _unwrap(model)
    _LEFT.setdefault(model, {}).update(left)
    _FMT.setdefault(model, {}).update(formats or {})
    _NOTES[model] = tuple(notes)


def _describe(module: nn.Module) -> str:
    if isinstance(module, Fp8BlockLinear):
        return f"Fp8BlockLinear block={module.block_size[0]}x{module.block_size[1]}"
    if isinstance(module, Fp8Linear):
        weight = "per-channel" if module.per_channel else "per-tensor"
        return f"Fp8Linear {weight} weight, activation={module.activation}"
    mode = "w4a16" if module.use_w4a16 else (
        "dynamic activation scale" if module.dynamic_input_scale else "static activation scale")
    return f"NvFp4Linear {mode}"


def float_weights_outside_linear(model: nn.Module) -> list[str]:
    """Modules other than ``nn.Linear`` / ``nn.Embedding`` holding float
    matrices (dim >= 2): they stay float (MoE experts as fused tensors)."""
    out = []
    for fqn, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) or layer_format(mod) is not None:
            continue
        mats = [(n, p) for n, p in mod.named_parameters(recurse=False)
                if p.dim() >= 2 and p.dtype in _FLOAT_DTYPES]
        if mats:
            shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in mats)
            out.append(f"left float (not an nn.Linear): {fqn} ({type(mod).__name__}: {shapes})")
    return out


def quantize_report(model: nn.Module) -> QuantizeReport:
    """What the model's linears are now: each scaledmm layer with its format,
    each ``nn.Linear`` left float with the reason ``quantize_`` or
    ``load_quantized`` gave (``"not quantized"`` for one neither saw).

    Examples
    --------
    >>> import torch, scaledmm
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))
    >>> _ = scaledmm.quantize_(model, "fp8", filter_fn=lambda m, fqn: fqn == "0")
    >>> print(scaledmm.quantize_report(model))  # doctest: +NORMALIZE_WHITESPACE
    module  K -> N    format  detail
    0       64 -> 64  fp8     Fp8Linear per-channel weight, activation=dynamic_per_token
    1       64 -> 10  left    filtered
    1 swapped, 1 left float
    """
    model = _unwrap(model)
    left, formats = _LEFT.get(model, {}), _FMT.get(model, {})
    entries = []
    for fqn, mod in model.named_modules():
        fmt = layer_format(mod)
        if fmt is not None:  # the name it was swapped under (an fp8 layer of N = 1 is per-tensor too)
            fmt = formats.get(fqn, fmt) if LAYERS.get(formats.get(fqn)) is type(mod) else fmt
            entries.append(ReportEntry(fqn, mod.in_features, mod.out_features, fmt, _describe(mod)))
        elif isinstance(mod, nn.Linear):
            entries.append(ReportEntry(fqn, mod.in_features, mod.out_features, None,
                                       left.get(fqn, "not quantized")))
    return QuantizeReport(entries, _NOTES.get(model, ()))


# ---------------------------------------------------------------------------
# quantize_
# ---------------------------------------------------------------------------


def set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    """Replace the submodule at ``fqn`` through its parent's ``setattr``."""
    parent_name, _, attr = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``(fqn, nn.Linear)``, a shared module once per name it has."""
    return [(fqn, m) for fqn, m in model.named_modules(remove_duplicate=False) if isinstance(m, nn.Linear)]


@torch.no_grad()
def quantize_(model: nn.Module, fmt: "str | QuantConfig", *,
              filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Swap, in place, the model's ``nn.Linear`` modules for scaledmm layers,
    quantizing their weights; returns ``model``.

    A Linear is swapped when ``filter_fn(module, fqn)`` is true (default:
    its name is not in ``QuantConfig.skip``, i.e. output heads named
    ``lm_head`` stay float) and the format takes its shape and dtype
    (:meth:`QuantConfig.rejects`).  The others stay ``nn.Linear``;
    :func:`quantize_report` lists both, with the reason each one was left.
    A module reachable under several names is swapped once (all names see
    the same layer).  Weights must be real tensors (for a meta-built model
    use :func:`scaledmm.load_quantized`).

    Parameters
    ----------
    model : nn.Module
        Any module, Hugging Face ``transformers`` models included.
    fmt : str or QuantConfig
        ``"fp8_block"``, ``"fp8"``, ``"fp8_tensor"``, ``"nvfp4"``,
        ``"nvfp4_w4a16"`` or a :class:`QuantConfig`.
    filter_fn : callable, optional
        ``filter_fn(module, fqn) -> bool``; replaces the default name filter.

    Examples
    --------
    >>> import torch, scaledmm
    >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256, dtype=torch.bfloat16), torch.nn.ReLU())
    >>> model = scaledmm.quantize_(model, "fp8_block")
    >>> type(model[0]).__name__
    'Fp8BlockLinear'
    >>> model(torch.randn(3, 256, dtype=torch.bfloat16)).shape
    torch.Size([3, 256])
    """
    config = QuantConfig.of(fmt)
    if not isinstance(model, nn.Module):
        V.fail("quantize_", "model", "an nn.Module", type(model).__name__)
    if filter_fn is not None and not callable(filter_fn):
        V.fail("quantize_", "filter_fn", "a callable (module, fqn) -> bool or None", type(filter_fn).__name__)
    target = _unwrap(model)
    if isinstance(target, nn.Linear):
        V.fail("quantize_", "model", "a module holding nn.Linear modules (a bare nn.Linear has no parent to "
               "swap it in; use QuantConfig(fmt).quantize(linear))", "an nn.Linear")
    swapped: dict[int, nn.Module] = {}
    left: dict[str, str] = {}
    formats: dict[str, str] = {}
    for fqn, lin in linears(target):
        if id(lin) in swapped:
            set_submodule(target, fqn, swapped[id(lin)])
            formats[fqn] = config.fmt
            continue
        if filter_fn is not None:
            if not filter_fn(lin, fqn):
                left[fqn] = "filtered"
                continue
        elif fqn.rpartition(".")[2] in config.skip:
            left[fqn] = f"{fqn.rpartition('.')[2]} (output head)"
            continue
        reason = config.rejects(lin)
        if reason is not None:
            left[fqn] = reason
            continue
        if lin.weight.is_meta:
            V.fail("quantize_", f"model.{fqn}.weight", "a real tensor to quantize (a meta-built model is "
                   "filled from a quantized checkpoint by scaledmm.load_quantized)", "a meta tensor")
        layer = config.quantize(lin)
        swapped[id(lin)] = layer
        formats[fqn] = config.fmt
        set_submodule(target, fqn, layer)
    record(target, left, float_weights_outside_linear(target), formats)
    return model
