"""``NvFp4Linear``: NVFP4 linear layer (ModelOpt checkpoint convention) on
``torch.ops.scaledmm.nvfp4_linear`` (W4A4, static activation scale:
``nvfp4_quant`` + ``nvfp4_mm`` in one op), ``nvfp4_dynamic_linear`` (W4A4,
the activation's global scale from its per-row amax, computed in the op) or
``nvfp4_w4a16_mm`` (W4A16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaledmm import validation as V
from scaledmm.ops import nvfp4 as ops
from scaledmm.oplib import FP8_DTYPE
from scaledmm.layers._state import QuantizedLinearBase, checkpoint_entries
from scaledmm.layers.rows import as_rows, from_rows

__all__ = ["NvFp4Linear"]

_NAME = "NvFp4Linear"


def _scalar(name: str, t, device=None) -> torch.Tensor:
    """A one-element float32 tensor from a checkpoint scalar (any 1-element shape)."""
    t = torch.as_tensor(t, device=device)
    if not t.dtype.is_floating_point or t.numel() != 1:
        V.fail(_NAME, name, "a floating-point tensor with one element", f"{t.dtype} {tuple(t.shape)}")
    return t.detach().to(torch.float32).reshape(())


def finite_row_amax(x2: torch.Tensor) -> torch.Tensor:
    """float32 ``[M]``: the amax of each row's finite values (NaN and +-Inf
    count as 0, so they cannot change the other rows' scaling).  Under
    torch.compile Inductor fuses this reduction into the kernel that produces
    ``x2`` (a norm, an activation); ``nvfp4_dynamic_linear`` reduces the rows."""
    return x2.float().abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=1)


class NvFp4Linear(QuantizedLinearBase):
    """Linear layer with NVFP4 weights: e2m1 codes, an e4m3 scale per 16
    weights along K, a float32 global scale.

    Parameters follow the NVIDIA ModelOpt checkpoint convention: ``weight``
    (uint8 ``[N, K/2]``, two codes per byte, element 2i in the low nibble),
    ``weight_scale`` (e4m3 ``[N, K/16]``, linear layout), ``weight_scale_2``
    (float32 scalar: the weight decode multiplier, ``amax_w / (448 * 6)``),
    ``input_scale`` (float32 scalar: the activation decode multiplier) and an
    optional ``bias``.

    The layer holds the weight padded to N a multiple of 32 (zero rows) and K
    a multiple of 64 (zero codes, zero scales), which is what the Triton and
    sm100 (cuBLASLt, FlashInfer) backends need, and ``weight_scale``
    swizzled into the ``[round_up(N', 128), round_up(K'/16, 4)]`` layout the
    GEMMs read, from construction on (:meth:`from_checkpoint` lays
    checkpoint tensors out so).  ``state_dict()`` holds these tensors,
    ``weight_scale_2`` and ``input_scale``; the global scales the forward
    uses are derived from the last two after every load, so a fresh (or
    meta-built then ``to_empty``) layer of the same arguments loads a state
    dict exactly.  ``.to(dtype)`` / ``.half()`` keep the codes and scales; a
    float conversion sets ``out_dtype`` (and the bias) to bf16, fp16 or fp32.
    The forward quantizes the activation with ``global_scale = 1 /
    input_scale`` and runs ``nvfp4_mm`` with ``alpha = input_scale *
    weight_scale_2``, both in one ``nvfp4_linear`` call (W4A4), or runs
    ``nvfp4_w4a16_mm`` with ``weight_scale_2``
    (``use_w4a16=True``; bf16/fp16 activations, no activation quantization),
    adds the bias and returns the logical N columns.  It moves no weight
    bytes; it pads only the activation along K when K % 64 != 0.

    With ``dynamic_input_scale=True`` (what :meth:`from_float` gives without
    ``input_amax``, and :meth:`from_checkpoint` without ``input_scale``) the
    activation's global scale is computed per call from the amax of its
    finite values, on the device (no host sync): ``448 * 6 / amax``.  The
    forward reduces each row's amax (fused into the activation's producer
    under torch.compile) and ``nvfp4_dynamic_linear`` takes the rest: the max
    over the rows, the global scale and alpha, inside its quantizer on a GPU.

    Parameters
    ----------
    in_features, out_features : int
        K (a multiple of 16) and N.
    bias : bool
        Whether the layer has a bias (kept in ``out_dtype``).
    device : torch.device, optional
    out_dtype : torch.dtype
        bf16 (default), fp16 or fp32.
    use_w4a16 : bool
        Keep activations in bf16/fp16 and run ``nvfp4_w4a16_mm``.
    dynamic_input_scale : bool
        Per-call activation global scale instead of ``input_scale``.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers import NvFp4Linear
    >>> lin = torch.nn.Linear(80, 40, dtype=torch.bfloat16)
    >>> layer = NvFp4Linear.from_float(lin, input_amax=4.0)
    >>> layer(torch.randn(2, 3, 80, dtype=torch.bfloat16)).shape
    torch.Size([2, 3, 40])
    """

    N_MULTIPLE = 32
    K_MULTIPLE = 64
    _CODE_TENSORS = ("weight", "weight_scale")
    _DERIVED = ("_global_scale", "_alpha", "_weight_alpha")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None,
                 out_dtype: torch.dtype = torch.bfloat16, use_w4a16: bool = False,
                 dynamic_input_scale: bool = False):
        super().__init__()
        if in_features <= 0 or in_features % ops.BLOCK != 0:
            V.fail(_NAME, "in_features", f"a positive multiple of {ops.BLOCK}", in_features)
        if out_features <= 0:
            V.fail(_NAME, "out_features", "a positive int", out_features)
        V.check_out_dtype(_NAME, out_dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.out_dtype = out_dtype
        self.use_w4a16 = bool(use_w4a16)
        self.dynamic_input_scale = bool(dynamic_input_scale)

        def param(t):
            return nn.Parameter(t, requires_grad=False)

        n_pad, k_pad = V.round_up(out_features, self.N_MULTIPLE), V.round_up(in_features, self.K_MULTIPLE)
        self._n_pad, self._k_pad = n_pad, k_pad
        self.weight = param(torch.zeros(n_pad, k_pad // 2, dtype=torch.uint8, device=device))
        self.weight_scale = param(torch.zeros(ops.swizzled_shape(n_pad, k_pad // ops.BLOCK), dtype=FP8_DTYPE,
                                              device=device))
        self.weight_scale_2 = param(torch.ones((), dtype=torch.float32, device=device))
        self.input_scale = param(torch.ones((), dtype=torch.float32, device=device))
        self.bias = param(torch.zeros(n_pad, dtype=out_dtype, device=device)) if bias else None
        # Global scales and constants the forward reads, filled by _derive (not in
        # the state dict: re-derived from weight_scale_2 / input_scale on load).
        for name in self._DERIVED:
            self.register_buffer(name, torch.ones(1, dtype=torch.float32, device=device), persistent=False)
        self._derive()
        self._processed = False

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_float(cls, linear: nn.Linear, *, input_amax: float | torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.bfloat16, use_w4a16: bool = False) -> "NvFp4Linear":
        """Quantize an ``nn.Linear`` (bf16/fp16/fp32) to NVFP4.

        ``weight_scale_2 = amax(|W|) / (448 * 6)``; the weight is quantized
        with ``nvfp4_quant(W, 1 / weight_scale_2)``.  ``input_amax`` (the
        calibrated activation amax) sets ``input_scale = input_amax / (448 *
        6)``; without it the layer scales activations dynamically.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import NvFp4Linear
        >>> NvFp4Linear.from_float(torch.nn.Linear(64, 32)).weight.shape
        torch.Size([32, 32])
        """
        w = linear.weight.detach()
        wf = w.float()
        amax = wf.abs().amax().clamp(min=ops.AMAX_FLOOR)
        scale_2 = amax / ops.RANGE
        q, s = torch.ops.scaledmm.nvfp4_quant(wf, (1.0 / scale_2).reshape(1), False)
        tensors = {"weight": q, "weight_scale": s, "weight_scale_2": scale_2}
        if input_amax is not None:
            tensors["input_scale"] = _scalar("input_amax", input_amax, w.device) / ops.RANGE
        if linear.bias is not None:
            tensors["bias"] = linear.bias.detach()
        return cls.from_checkpoint(tensors, out_dtype=out_dtype, use_w4a16=use_w4a16)

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor], *, out_dtype: torch.dtype = torch.bfloat16,
                        use_w4a16: bool = False, device=None) -> "NvFp4Linear":
        """Load ModelOpt NVFP4 tensors: ``weight``, ``weight_scale``,
        ``weight_scale_2``, ``input_scale`` (optional: dynamic activation
        scaling without it) and ``bias`` (optional).

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import NvFp4Linear
        >>> t = {"weight": torch.zeros(8, 16, dtype=torch.uint8),
        ...      "weight_scale": torch.ones(8, 2).to(torch.float8_e4m3fn),
        ...      "weight_scale_2": torch.tensor(0.01), "input_scale": torch.tensor(0.002)}
        >>> NvFp4Linear.from_checkpoint(t)(torch.randn(3, 32)).shape
        torch.Size([3, 8])
        """
        t = checkpoint_entries(_NAME, tensors, ("weight", "weight_scale", "weight_scale_2"),
                               ("input_scale", "bias"))
        w, ws, bias = t["weight"], t["weight_scale"], t.get("bias")
        V.check_dtype(_NAME, "weight", w, torch.uint8)
        V.check_rank(_NAME, "weight", w, 2)
        n, k = w.shape[0], 2 * w.shape[1]
        V.check_dtype(_NAME, "weight_scale", ws, FP8_DTYPE)
        V.check_shape(_NAME, "weight_scale", ws, (n, k // ops.BLOCK), "[N, K/16] for weight [N, K/2]")
        scale_2 = _scalar("weight_scale_2", t["weight_scale_2"])
        in_scale = _scalar("input_scale", t["input_scale"]) if "input_scale" in t else None
        if bias is not None:
            V.check_dtype(_NAME, "bias", bias, V.FLOAT_OUT_DTYPES)
            V.check_shape(_NAME, "bias", bias, (n,), "N = weight.shape[0]")
        device = w.device if device is None else device
        layer = cls(k, n, bias=bias is not None, device=device, out_dtype=out_dtype, use_w4a16=use_w4a16,
                    dynamic_input_scale=in_scale is None)
        with torch.no_grad():
            layer.weight[:n, : k // 2].copy_(w)
            scales = torch.zeros((layer._n_pad, layer._k_pad // ops.BLOCK), dtype=FP8_DTYPE, device=ws.device)
            scales[:n, : k // ops.BLOCK] = ws
            layer.weight_scale.copy_(ops.swizzle_block_scales(scales))
            layer.weight_scale_2.copy_(scale_2)
            if in_scale is not None:
                layer.input_scale.copy_(in_scale)
            if bias is not None:
                layer.bias[:n].copy_(bias)
        layer.process_weights_after_loading()
        return layer

    def _check_layout(self) -> None:
        op = f"{_NAME}.process_weights_after_loading"
        layout = "the padded, swizzled layout; build from checkpoint tensors with from_checkpoint"
        V.check_dtype(op, "weight", self.weight, torch.uint8)
        V.check_shape(op, "weight", self.weight, (self._n_pad, self._k_pad // 2), layout)
        V.check_dtype(op, "weight_scale", self.weight_scale, FP8_DTYPE)
        V.check_shape(op, "weight_scale", self.weight_scale,
                      ops.swizzled_shape(self._n_pad, self._k_pad // ops.BLOCK), layout)
        for name in ("weight_scale_2", "input_scale"):
            V.check_scalar_like(op, name, getattr(self, name))
        if self.bias is not None:
            V.check_shape(op, "bias", self.bias, (self._n_pad,), layout)

    def _derive(self) -> None:
        """The forward's global scales from ``weight_scale_2`` and ``input_scale``
        (in place, so addresses captured by a CUDA graph stay valid)."""
        scale_2 = self.weight_scale_2.detach().float().reshape(1)
        in_scale = self.input_scale.detach().float().reshape(1)
        values = {"_global_scale": 1.0 / in_scale, "_alpha": in_scale * scale_2, "_weight_alpha": scale_2}
        device = self.weight.device
        for name, value in values.items():
            buf = self._buffers[name]
            if buf.device == device and buf.dtype == torch.float32 and buf.shape == (1,):
                buf.copy_(value)
            else:  # an assign=True load or a meta-built layer's buffers: allocate on the weight's device
                self._buffers[name] = value.to(device=device, dtype=torch.float32, copy=True)

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._processed:
            raise RuntimeError(f"{_NAME}: load the tensors first (from_float, from_checkpoint, load_state_dict "
                               "or process_weights_after_loading)")
        n, k = self.out_features, self.in_features
        if x.shape[-1] != k:
            V.fail(_NAME, "x", f"last dim K = {k}", f"shape {tuple(x.shape)}")
        x2 = as_rows(x)
        if self._k_pad != k:
            x2 = F.pad(x2, (0, self._k_pad - k))
        if self.use_w4a16:
            if x2.dtype not in V.HALF_DTYPES:
                x2 = x2.to(self.out_dtype if self.out_dtype in V.HALF_DTYPES else torch.bfloat16)
            out = torch.ops.scaledmm.nvfp4_w4a16_mm(x2, self.weight, self.weight_scale, self._weight_alpha,
                                                    self.out_dtype, self.bias)
        elif self.dynamic_input_scale:
            out = torch.ops.scaledmm.nvfp4_dynamic_linear(x2, finite_row_amax(x2), self.weight, self.weight_scale,
                                                          self._weight_alpha, self.out_dtype, self.bias)
        else:
            out = torch.ops.scaledmm.nvfp4_linear(x2, self.weight, self.weight_scale, self._global_scale,
                                                  self._alpha, self.out_dtype, self.bias)
        if self._n_pad != n:
            out = out[:, :n]
        return from_rows(out, x)

    def extra_repr(self) -> str:
        mode = "w4a16" if self.use_w4a16 else (
            "w4a4, dynamic activation scale" if self.dynamic_input_scale else "w4a4, static activation scale")
        text = (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=nvfp4 (e2m1, e4m3 scale per 16, fp32 global), "
                f"mode={mode}, out_dtype={self.out_dtype}")
        text += (f", weight=uint8{list(self.weight.shape)} padded to N%{self.N_MULTIPLE}, "
                 f"K%{self.K_MULTIPLE}, weight_scale=swizzled e4m3{list(self.weight_scale.shape)}")
        if not self._processed:
            text += ", not loaded"
        return text
