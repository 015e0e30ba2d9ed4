"""``Fp8BlockLinear``: DeepSeek-V3-style FP8 linear (128x128 weight blocks,
1x128 dynamic activation groups) on ``torch.ops.scaledmm.fp8_block_linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaledmm import validation as V
from scaledmm.ops import fp8_block as ops
from scaledmm.oplib import FP8_DTYPE
from scaledmm.layers._state import QuantizedLinearBase, checkpoint_entries
from scaledmm.layers.rows import as_rows, from_rows

__all__ = ["Fp8BlockLinear"]


class Fp8BlockLinear(QuantizedLinearBase):
    """Linear layer with an e4m3 weight scaled per ``bn x bk`` block.

    Parameters are held in the DeepSeek-V3 checkpoint convention: ``weight``
    (e4m3 ``[N, Kp]``, K padded with zero codes to ``Kp = round_up(K, bk)``),
    ``weight_scale_inv`` (fp32 ``[ceil(N/bn), ceil(K/bk)]``, the multiplier
    that decodes the codes, rows strided by a multiple of 4) and an optional
    ``bias``.  The forward quantizes the activation per token and
    ``bk``-group and runs the block GEMM, in one op (``fp8_block_linear``).

    The layer is built in that layout, so ``state_dict()`` /
    ``load_state_dict`` round-trip it exactly (a fresh, or meta-built then
    ``to_empty``, layer of the same arguments loads it; the state dict's
    tensors are dense, ready for safetensors).  ``.to(dtype)`` / ``.half()`` keep the weight and scales;
    a float conversion to bf16 or fp16 sets ``out_dtype`` (and the bias) to
    it, other dtypes leave the layer as it is.

    Parameters
    ----------
    in_features, out_features : int
        K and N.
    bias : bool
        Whether the layer has a bias (kept in ``out_dtype``).
    block_size : (int, int)
        ``(bn, bk)``; (128, 128) for DeepSeek-V3.
    out_dtype : torch.dtype
        bf16 (default) or fp16.
    device : torch.device, optional

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers import Fp8BlockLinear
    >>> lin = torch.nn.Linear(256, 192, dtype=torch.bfloat16)
    >>> layer = Fp8BlockLinear.from_float(lin)
    >>> layer(torch.randn(3, 256, dtype=torch.bfloat16)).shape
    torch.Size([3, 192])
    """

    _OUT_DTYPES = V.HALF_DTYPES

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 block_size=(128, 128), out_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        V.check_out_dtype("Fp8BlockLinear", out_dtype, V.HALF_DTYPES)
        self.in_features = in_features
        self.out_features = out_features
        self.block_size = (int(block_size[0]), int(block_size[1]))
        self.out_dtype = out_dtype
        bn, bk = self.block_size
        kp = V.round_up(in_features, bk)
        # K % bk != 0: zero weight codes up to Kp; the forward pads the activation.
        self._k_pad = kp - in_features
        self.weight = nn.Parameter(torch.zeros(out_features, kp, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        scales = torch.ones(V.ceil_div(out_features, bn), V.ceil_div(in_features, bk), dtype=torch.float32,
                            device=device)
        self.weight_scale_inv = nn.Parameter(ops.pad_scale_rows(scales, 4), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=out_dtype, device=device), requires_grad=False)
                     if bias else None)
        self._processed = False

    @classmethod
    def from_float(cls, linear: nn.Linear, *, block_size=(128, 128),
                   out_dtype: torch.dtype | None = None) -> "Fp8BlockLinear":
        """Quantize an ``nn.Linear`` (bf16/fp16/fp32) per weight block.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import Fp8BlockLinear
        >>> Fp8BlockLinear.from_float(torch.nn.Linear(128, 64)).weight.dtype
        torch.float8_e4m3fn
        """
        w = linear.weight.detach()
        if out_dtype is None:
            out_dtype = w.dtype if w.dtype in V.HALF_DTYPES else torch.bfloat16
        q, s = ops.quantize_weight(w, block_size)
        tensors = {"weight": q, "weight_scale_inv": s}
        if linear.bias is not None:
            tensors["bias"] = linear.bias.detach()
        return cls.from_checkpoint(tensors, block_size=block_size, out_dtype=out_dtype)

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor], *, block_size=(128, 128),
                        out_dtype: torch.dtype = torch.bfloat16) -> "Fp8BlockLinear":
        """Load DeepSeek-V3 FP8 tensors: ``weight`` (e4m3 ``[N, K]``),
        ``weight_scale_inv`` (fp32 ``[ceil(N/bn), ceil(K/bk)]``), optional ``bias``.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import Fp8BlockLinear
        >>> w = torch.randn(64, 128).to(torch.float8_e4m3fn)
        >>> layer = Fp8BlockLinear.from_checkpoint({"weight": w, "weight_scale_inv": torch.ones(1, 1)})
        >>> layer.out_features
        64
        """
        op = "Fp8BlockLinear.from_checkpoint"
        t = checkpoint_entries(op, tensors, ("weight", "weight_scale_inv"), ("bias",))
        w, s, bias = t["weight"], t["weight_scale_inv"], t.get("bias")
        V.check_dtype(op, "weight", w, FP8_DTYPE)
        V.check_rank(op, "weight", w, 2)
        n, k = w.shape
        bn, bk = int(block_size[0]), int(block_size[1])
        V.check_dtype(op, "weight_scale_inv", s, torch.float32)
        V.check_shape(op, "weight_scale_inv", s, (V.ceil_div(n, bn), V.ceil_div(k, bk)), "ceil(N/bn), ceil(K/bk)")
        if bias is not None:
            V.check_dtype(op, "bias", bias, V.FLOAT_OUT_DTYPES)
            V.check_shape(op, "bias", bias, (n,), "N = weight.shape[0]")
        layer = cls(k, n, bias is not None, block_size=block_size, out_dtype=out_dtype, device=w.device)
        with torch.no_grad():
            layer.weight.view(torch.uint8)[:, :k].copy_(w.view(torch.uint8))
            layer.weight_scale_inv.copy_(s)
            if bias is not None:
                layer.bias.copy_(bias)
        layer.process_weights_after_loading()
        return layer

    def _check_layout(self) -> None:
        op = "Fp8BlockLinear.process_weights_after_loading"
        bn, bk = self.block_size
        n, k = self.out_features, self.in_features
        V.check_dtype(op, "weight", self.weight, FP8_DTYPE)
        V.check_shape(op, "weight", self.weight, (n, k + self._k_pad), "N, round_up(K, bk): the padded layout")
        V.check_dtype(op, "weight_scale_inv", self.weight_scale_inv, torch.float32)
        V.check_shape(op, "weight_scale_inv", self.weight_scale_inv, (V.ceil_div(n, bn), V.ceil_div(k, bk)),
                      "ceil(N/bn), ceil(K/bk)")
        if self.bias is not None:
            V.check_shape(op, "bias", self.bias, (n,))

    def _derive(self) -> None:
        # Weight contiguous; scale rows strided by a multiple of 4 (what
        # cuBLASLt reads; the other backends read any row stride).  Copies
        # (.to(device), to_empty, assign=True loads) may have made them dense.
        if not self.weight.is_contiguous():
            self.weight.data = self.weight.data.contiguous()
        s = self.weight_scale_inv.data
        if not (s.stride(1) == 1 and s.stride(0) % 4 == 0):
            self.weight_scale_inv.data = ops.pad_scale_rows(s.contiguous(), 4)
        if self.bias is not None and not self.bias.is_contiguous():
            self.bias.data = self.bias.data.contiguous()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # The padded row stride of the scales is a kernel detail; saved dense
        # (safetensors stores only dense tensors), re-strided on load.
        key = prefix + "weight_scale_inv"
        if not keep_vars and key in destination:
            destination[key] = destination[key].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._processed:
            raise RuntimeError("Fp8BlockLinear: load the tensors first (from_float, from_checkpoint, "
                               "load_state_dict or process_weights_after_loading)")
        x2 = as_rows(x)
        if self._k_pad:
            x2 = F.pad(x2, (0, self._k_pad))
        out = torch.ops.scaledmm.fp8_block_linear(
            x2, self.weight, self.weight_scale_inv, list(self.block_size), self.out_dtype, self.bias)
        return from_rows(out, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, block_size={self.block_size}, out_dtype={self.out_dtype}, "
                f"k_pad={self._k_pad}")
