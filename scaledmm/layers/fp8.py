"""``Fp8Linear``: FP8 (e4m3) linear layer with per-tensor or per-channel
weight scales and a static or dynamic activation scale, on
``torch.ops.scaledmm.fp8_linear`` (``quant_fp8`` + ``fp8_scaled_mm`` in one op,
one launch at small M).

``fp8_scaled_mm`` needs K and N to be multiples of 16.  The layer pads the
weight once, at load time (``process_weights_after_loading``), so that its
forward never copies a weight byte: it pads only the activation along K (when
K % 16 != 0) and returns a view of the first N output columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaledmm import validation as V
from scaledmm.ops import fp8 as ops
from scaledmm.oplib import FP8_DTYPE
from scaledmm.layers._state import QuantizedLinearBase, checkpoint_entries
from scaledmm.layers.rows import as_rows, from_rows

__all__ = ["Fp8Linear", "ACTIVATIONS"]

# How the activation scale is found: "dynamic" (per tensor, each call),
# "dynamic_per_token" (one scale per row, each call), "static" (the
# checkpoint's ``input_scale``).
ACTIVATIONS = ("dynamic", "dynamic_per_token", "static")
CHECKPOINT_KEYS = ("weight", "weight_scale", "input_scale", "bias")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # checkpoints store either; held as float32


class Fp8Linear(QuantizedLinearBase):
    """Linear layer with an e4m3 weight and float32 scales.

    Checkpoints follow the usual FP8 convention: ``weight`` (e4m3 ``[N,
    K]``), ``weight_scale`` (float32, one element for per-tensor or ``[N]``
    for per-channel scales; the multiplier that decodes the codes),
    ``input_scale`` (float32 one element, static activations only) and an
    optional ``bias`` (held in ``out_dtype``, so cuBLAS fuses it).

    The layer holds them padded, in the layout the GEMM reads, from
    construction on: the weight is ``[Np, Kp]`` (N, K rounded up to
    multiples of 16, zero codes), per-channel scales are ``[Np]`` (padded
    with 1.0), per-tensor scales and ``input_scale`` ``[1]`` and the bias
    ``[Np]`` (zeros).  :meth:`from_checkpoint` lays checkpoint tensors out
    so; :meth:`checkpoint_tensors` gives back the logical ones.
    ``state_dict()`` holds the padded tensors, so a fresh (or meta-built
    then ``to_empty``) layer of the same arguments loads it exactly.
    ``.to(dtype)`` / ``.half()`` keep the weight and scales; a float
    conversion sets ``out_dtype`` (and the bias) to bf16, fp16 or fp32.

    Parameters
    ----------
    in_features, out_features : int
        K and N (logical sizes).
    bias : bool
        Whether the layer has a bias.
    device : torch.device, optional
    out_dtype : torch.dtype
        bf16 (default), fp16 or fp32.
    per_channel : bool
        One weight scale per output channel instead of one per tensor.
    activation : str
        ``"dynamic"`` (per-tensor scale computed each call, default),
        ``"dynamic_per_token"`` or ``"static"`` (``input_scale``).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers import Fp8Linear
    >>> lin = torch.nn.Linear(100, 50, dtype=torch.bfloat16)
    >>> layer = Fp8Linear.from_float(lin, per_channel=True)
    >>> layer(torch.randn(2, 3, 100, dtype=torch.bfloat16)).shape
    torch.Size([2, 3, 50])
    >>> tuple(layer.weight.shape)  # padded once at load time
    (64, 112)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None,
                 out_dtype: torch.dtype = torch.bfloat16, per_channel: bool = False,
                 activation: str = "dynamic"):
        super().__init__()
        op = "Fp8Linear"
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or v <= 0:
                V.fail(op, name, "a positive int", v)
        V.check_out_dtype(op, out_dtype)
        if activation not in ACTIVATIONS:
            V.fail(op, "activation", f"one of {list(ACTIVATIONS)}", repr(activation))
        self.in_features = in_features
        self.out_features = out_features
        self.padded_in_features = V.round_up(in_features, ops.ALIGN_K)
        self.padded_out_features = V.round_up(out_features, ops.ALIGN_N)
        self.out_dtype = out_dtype
        self.per_channel = bool(per_channel)
        self.activation = activation
        np_, kp = self.padded_out_features, self.padded_in_features

        def param(t):
            return nn.Parameter(t, requires_grad=False)

        self.weight = param(torch.zeros(np_, kp, dtype=FP8_DTYPE, device=device))  # e4m3 0x00 == +0.0
        self.weight_scale = param(torch.ones(np_ if per_channel else 1, dtype=torch.float32, device=device))
        if activation == "static":
            self.input_scale = param(torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.register_parameter("input_scale", None)
        if bias:
            self.bias = param(torch.zeros(np_, dtype=out_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self._processed = False

    # ------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------

    @classmethod
    def from_float(cls, linear: nn.Linear, *, per_channel: bool = False, activation: str = "dynamic",
                   input_scale: float | torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> "Fp8Linear":
        """Quantize an ``nn.Linear`` (bf16/fp16/fp32) to e4m3.

        Weight scales are ``amax / 448`` per tensor or per output channel.
        ``activation="static"`` needs ``input_scale`` (e.g. calibrated
        ``amax(x) / 448``).  ``out_dtype`` defaults to the linear's dtype.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import Fp8Linear
        >>> lin = torch.nn.Linear(64, 32)
        >>> layer = Fp8Linear.from_float(lin, activation="static", input_scale=4.0 / 448)
        >>> layer.weight.dtype, layer.out_dtype
        (torch.float8_e4m3fn, torch.float32)
        """
        op = "Fp8Linear.from_float"
        w = linear.weight.detach()
        V.check_dtype(op, "linear.weight", w, V.ACT_DTYPES)
        if out_dtype is None:
            out_dtype = w.dtype
        q, s = torch.ops.scaledmm.quant_fp8(w.contiguous(), None, bool(per_channel))
        tensors = {"weight": q, "weight_scale": s.reshape(-1) if per_channel else s.reshape(())}
        if activation == "static":
            if input_scale is None:
                V.fail(op, "input_scale", "a positive float or one-element tensor for activation='static'", None)
            tensors["input_scale"] = torch.as_tensor(input_scale, dtype=torch.float32, device=w.device).reshape(())
        elif input_scale is not None:
            V.fail(op, "input_scale", f"None for activation={activation!r} (only 'static' reads it)", input_scale)
        if linear.bias is not None:
            tensors["bias"] = linear.bias.detach()
        return cls.from_checkpoint(tensors, activation=activation, out_dtype=out_dtype)

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor], *, activation: str | None = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> "Fp8Linear":
        """Load FP8 checkpoint tensors and lay them out for the GEMM.

        ``tensors``: ``weight`` (e4m3 ``[N, K]``), ``weight_scale`` (one
        element: per-tensor; ``[N]`` or ``[N, 1]``: per-channel), optional
        ``input_scale`` (one element) and ``bias`` (``[N]``).  Scales may be
        float32, bf16 or fp16 (held as float32).  ``activation`` defaults to
        ``"static"`` when ``input_scale`` is present, else ``"dynamic"``.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import Fp8Linear
        >>> w = torch.randn(24, 40).to(torch.float8_e4m3fn)
        >>> layer = Fp8Linear.from_checkpoint({"weight": w, "weight_scale": torch.full((24, 1), 0.01)})
        >>> layer.per_channel, layer.activation, tuple(layer.weight.shape)
        (True, 'dynamic', (32, 48))
        """
        op = "Fp8Linear.from_checkpoint"
        t = checkpoint_entries(op, tensors, ("weight", "weight_scale"), ("input_scale", "bias"))
        unknown = sorted(set(tensors) - set(CHECKPOINT_KEYS))
        if unknown:
            V.fail(op, "tensors", f"keys among {list(CHECKPOINT_KEYS)}", f"unknown keys {unknown}")
        w, ws = t["weight"], t["weight_scale"]
        V.check_dtype(op, "weight", w, FP8_DTYPE)
        V.check_rank(op, "weight", w, 2)
        n, k = w.shape
        V.check_dtype(op, "weight_scale", ws, _SCALE_DTYPES)
        if ws.dim() <= 2 and ws.numel() == 1:
            per_channel = False
        elif tuple(ws.shape) in ((n,), (n, 1)):
            per_channel = True
        else:
            V.fail(op, "weight_scale", f"one element (per-tensor) or shape ({n},) / ({n}, 1) (per-channel)",
                   f"shape {tuple(ws.shape)}")
        in_s = t.get("input_scale")
        if in_s is not None:
            V.check_dtype(op, "input_scale", in_s, _SCALE_DTYPES)
            if in_s.numel() != 1:
                V.fail(op, "input_scale", "a one-element tensor", f"shape {tuple(in_s.shape)}")
        if activation is None:
            activation = "static" if in_s is not None else "dynamic"
        if activation == "static" and in_s is None:
            V.fail(op, "input_scale", "a one-element tensor for activation='static'", "no 'input_scale' entry")
        bias = t.get("bias")
        if bias is not None:
            V.check_dtype(op, "bias", bias, V.FLOAT_OUT_DTYPES)
            V.check_shape(op, "bias", bias, (n,), "N = weight.shape[0]")
        layer = cls(k, n, bias is not None, device=w.device, out_dtype=out_dtype, per_channel=per_channel,
                    activation=activation)
        with torch.no_grad():
            layer.weight.view(torch.uint8)[:n, :k].copy_(w.view(torch.uint8))
            layer.weight_scale[:n if per_channel else 1].copy_(ws.reshape(-1))
            if activation == "static":
                layer.input_scale.copy_(in_s.reshape(1))
            if bias is not None:
                layer.bias[:n].copy_(bias)
        layer.process_weights_after_loading()
        return layer

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The logical (unpadded) tensors in the checkpoint convention:
        ``weight`` ``[N, K]``, ``weight_scale`` 0-D or ``[N]``,
        ``input_scale`` 0-D (static only), ``bias`` ``[N]``; new tensors.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import Fp8Linear
        >>> layer = Fp8Linear.from_float(torch.nn.Linear(20, 10))
        >>> {k: tuple(v.shape) for k, v in layer.checkpoint_tensors().items()}
        {'weight': (10, 20), 'weight_scale': (), 'bias': (10,)}
        """
        n, k = self.out_features, self.in_features
        out = {"weight": self.weight.detach()[:n, :k].clone(memory_format=torch.contiguous_format)}
        ws = self.weight_scale.detach()
        out["weight_scale"] = ws.reshape(-1)[:n].clone() if self.per_channel else ws.reshape(()).clone()
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale.detach().reshape(()).clone()
        if self.bias is not None:
            out["bias"] = self.bias.detach()[:n].clone()
        return out

    def _check_layout(self) -> None:
        op = "Fp8Linear.process_weights_after_loading"
        np_, kp = self.padded_out_features, self.padded_in_features
        layout = "the padded layout; build from checkpoint tensors with from_checkpoint"
        V.check_dtype(op, "weight", self.weight, FP8_DTYPE)
        V.check_shape(op, "weight", self.weight, (np_, kp), f"Np, Kp: {layout}")
        V.check_dtype(op, "weight_scale", self.weight_scale, torch.float32)
        V.check_shape(op, "weight_scale", self.weight_scale, (np_ if self.per_channel else 1,), layout)
        if self.input_scale is not None:
            V.check_dtype(op, "input_scale", self.input_scale, torch.float32)
            V.check_shape(op, "input_scale", self.input_scale, (1,), layout)
        if self.bias is not None:
            V.check_shape(op, "bias", self.bias, (np_,), layout)

    def _derive(self) -> None:
        # Nothing is precomputed; the GEMM reads contiguous operands.
        for p in (self.weight, self.weight_scale, self.input_scale, self.bias):
            if p is not None and not p.is_contiguous():
                p.data = p.data.contiguous()

    # ------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._processed:
            raise RuntimeError("Fp8Linear: load the tensors first (from_float, from_checkpoint, "
                               "load_state_dict or process_weights_after_loading)")
        k, n = self.in_features, self.out_features
        if x.dim() < 1 or x.shape[-1] != k:
            V.fail("Fp8Linear", "x", f"last dim of size {k} (in_features)", f"shape {tuple(x.shape)}")
        x2 = as_rows(x)
        if self.padded_in_features != k:  # activation only: M x (Kp - K) zeros
            x2 = F.pad(x2, (0, self.padded_in_features - k))
        static = self.activation == "static"
        out = torch.ops.scaledmm.fp8_linear(x2, self.weight, self.weight_scale, self.input_scale if static else None,
                                            self.activation == "dynamic_per_token", self.bias, self.out_dtype)
        if self.padded_out_features != n:
            out = out[:, :n]
        return from_rows(out, x)

    def extra_repr(self) -> str:
        scales = "per-channel" if self.per_channel else "per-tensor"
        layout = f"weight=e4m3[{self.padded_out_features}, {self.padded_in_features}] (padded to 16)"
        if not self._processed:
            layout += ", not loaded"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight_scale={scales}, activation={self.activation}, "
                f"out_dtype={self.out_dtype}, {layout}")
