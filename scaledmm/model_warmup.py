"""Build every kernel a model will run before it serves: ``warmup(model, ms)``.

The first call of a kernel compiles it: Triton in seconds, an NVRTC kernel in
about a second, a CUDA library of CUTLASS in 40-60 s (then cached on disk,
see README "Kernels built at run time").  Inside a request that is a stall;
inside an eager ``torch.cuda.graph`` capture it is an error.  ``warmup`` runs
each distinct scaledmm layer of ``model`` once per batch size in ``ms``, on
random activations, so that every backend automatic selection picks at those
M has been built and loaded; its report says which backend each op took.

Layers are told apart by class, configuration (``extra_repr``) and device, so
a 32-layer model warms each projection shape once.  Tensor-parallel wrappers
are skipped and their local layers warmed (no collective runs).  Nothing of
the model changes (forward under ``no_grad``, no state written), nor torch's
global random state (the activations come from a generator of its own).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import nn

from scaledmm import backends
from scaledmm import validation as V
from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear, SkinnyLinear

__all__ = ["DEFAULT_MS", "WarmupEntry", "WarmupReport", "warmup"]

# One M per region where selection tends to change on sm90 (decode, the
# middle, large batches), aligned and not: pass the batch sizes you serve.
DEFAULT_MS = (1, 3, 8, 16, 17, 32, 64, 128, 256, 512, 1024, 4096)
LAYERS = (Fp8BlockLinear, Fp8Linear, NvFp4Linear, SkinnyLinear)


@dataclasses.dataclass(frozen=True)
class WarmupEntry:
    """One layer configuration at one M: the ``(op, backend)`` pairs it ran
    (none where the layer called no scaledmm op, e.g. a skinny layer's
    ``F.linear`` fallback) and the modules (qualified names) that share the
    configuration (``layer``: class and ``extra_repr``)."""

    layer: str
    m: int
    calls: tuple[tuple[str, str], ...]
    modules: tuple[str, ...]

    @property
    def label(self) -> str:
        """The class, K -> N and the first module, as the report prints them."""
        cls, _, config = self.layer.partition("(")
        fields = dict(f.split("=", 1) for f in config.split(", ") if "=" in f)
        more = f" (+{len(self.modules) - 1})" if len(self.modules) > 1 else ""
        return f"{cls} {fields.get('in_features', '?')}->{fields.get('out_features', '?')} {self.modules[0]}{more}"


class WarmupReport:
    """What :func:`warmup` ran; ``print(report)`` gives a table."""

    def __init__(self, entries: Sequence[WarmupEntry]):
        self.entries = tuple(entries)

    def backends(self) -> set[tuple[str, str]]:
        """Every ``(op, backend)`` pair that ran."""
        return {c for e in self.entries for c in e.calls}

    def __str__(self) -> str:
        rows = [(e.label, str(e.m), ", ".join(f"{op}:{name}" for op, name in e.calls) or "-")
                for e in self.entries]
        head = ("layer (K->N, module)", "M", "op:backend")
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(2)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:2], widths)) + "  " + r[2] for r in (head, *rows))

    def __repr__(self) -> str:
        return f"WarmupReport({len(self.entries)} layer x M runs, {len(self.backends())} op:backend pairs)"


def _activation_dtype(layer: nn.Module, dtype: torch.dtype) -> torch.dtype:
    # SkinnyLinear multiplies in its weight's dtype; the quantized layers take ``dtype``.
    w = getattr(layer, "weight", None)
    if isinstance(layer, SkinnyLinear) and w is not None and w.dtype in (torch.bfloat16, torch.float16):
        return w.dtype
    return dtype


@torch.no_grad()
def warmup(model: nn.Module, ms: Sequence[int] = DEFAULT_MS, *, dtype: torch.dtype = torch.bfloat16
           ) -> WarmupReport:
    """Run each distinct scaledmm layer of ``model`` once per M in ``ms`` so
    that every kernel those calls select is compiled and loaded now.

    Parameters
    ----------
    model : nn.Module
        Any module holding scaledmm layers (after ``quantize_`` /
        ``load_quantized``), on the device it will serve on.
    ms : sequence of int
        Batch sizes (tokens per call) to warm, each >= 1: the ones you serve.
    dtype : torch.dtype
        Activation dtype (bf16 or fp16).

    Returns
    -------
    WarmupReport
        Per layer configuration and M, the ``(op, backend)`` pairs that ran.

    Examples
    --------
    >>> import torch, scaledmm
    >>> model = torch.nn.Sequential(torch.nn.Linear(256, 128, dtype=torch.bfloat16))
    >>> _ = scaledmm.quantize_(model, "fp8_block")
    >>> report = scaledmm.warmup(model, ms=(1, 3))
    >>> sorted(report.backends())
    [('fp8_block_linear', 'reference')]
    """
    if isinstance(ms, int) or not ms or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1
                                                for m in ms):
        V.fail("warmup", "ms", "a non-empty sequence of ints >= 1", ms)
    if dtype not in (torch.bfloat16, torch.float16):
        V.fail("warmup", "dtype", "torch.bfloat16 or torch.float16", dtype)
    groups: dict[tuple, tuple[nn.Module, list[str]]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LAYERS):
            device = next(iter([*mod.parameters(recurse=False), *mod.buffers(recurse=False)])).device
            key = (type(mod), mod.extra_repr(), device)
            groups.setdefault(key, (mod, []))[1].append(name)
    entries = []
    for (cls, config, device), (layer, names) in groups.items():
        x_dtype = _activation_dtype(layer, dtype)
        gen = None if device.type == "meta" else torch.Generator(device).manual_seed(0)  # not the global RNG
        for m in dict.fromkeys(ms):
            x = torch.randn(m, layer.in_features, device=device, dtype=x_dtype, generator=gen)
            with backends.record() as log:
                layer(x)
            calls = tuple(dict.fromkeys((op, backend) for op, backend, _ in log))
            entries.append(WarmupEntry(f"{cls.__name__}({config})", m, calls, tuple(names)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a kernel that failed to load or launch fails here
    return WarmupReport(entries)
