"""``Fp8BlockLinear``: DeepSeek-V3-style FP8 linear (128x128 weight blocks,
1x128 dynamic activation groups) on ``torch.ops.scaledmm.fp8_block_linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaledmm import validation as V
from scaledmm.ops import fp8_block as ops
from scaledmm.oplib import FP8_DTYPE
from scaledmm.layers.rows import as_rows, from_rows

__all__ = ["Fp8BlockLinear"]


class Fp8BlockLinear(nn.Module):
    """Linear layer with an e4m3 weight scaled per ``bn x bk`` block.

    Parameters are held in the DeepSeek-V3 checkpoint convention: ``weight``
    (e4m3 ``[N, K]``), ``weight_scale_inv`` (fp32 ``[ceil(N/bn), ceil(K/bk)]``,
    the multiplier that decodes the codes) and an optional ``bias``.  The
    forward quantizes the activation per token and ``bk``-group and runs the
    block GEMM, in one op (``fp8_block_linear``).

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

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 block_size=(128, 128), out_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        V.check_out_dtype("Fp8BlockLinear", out_dtype, V.HALF_DTYPES)
        self.in_features = in_features
        self.out_features = out_features
        self.block_size = (int(block_size[0]), int(block_size[1]))
        self.out_dtype = out_dtype
        bn, bk = self.block_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(V.ceil_div(out_features, bn), V.ceil_div(in_features, bk), dtype=torch.float32,
                       device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=out_dtype, device=device), requires_grad=False)
                     if bias else None)
        self._k_pad = 0

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
        for key in ("weight", "weight_scale_inv"):
            if key not in tensors:
                V.fail(op, "tensors", f"a {key!r} entry", sorted(tensors))
        w, s = tensors["weight"], tensors["weight_scale_inv"]
        V.check_dtype(op, "weight", w, FP8_DTYPE)
        V.check_rank(op, "weight", w, 2)
        n, k = w.shape
        bias = tensors.get("bias")
        layer = cls(k, n, bias is not None, block_size=block_size, out_dtype=out_dtype, device=w.device)
        bn, bk = layer.block_size
        V.check_shape(op, "weight_scale_inv", s, (V.ceil_div(n, bn), V.ceil_div(k, bk)), "ceil(N/bn), ceil(K/bk)")
        V.check_dtype(op, "weight_scale_inv", s, torch.float32)
        layer.weight.data = w.contiguous()
        layer.weight_scale_inv.data = s.contiguous()
        if bias is not None:
            V.check_shape(op, "bias", bias, (n,))
            layer.bias.data = bias.to(out_dtype).contiguous()
        layer.process_weights_after_loading()
        return layer

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Lay out weight and scales once for every fp8_block backend.

        The weight is made contiguous, padded along K with zero codes to a
        multiple of bk when K % bk != 0 (the activation is padded in forward
        then, a copy of ``M x pad`` bytes), and the scale rows are stored with a
        stride padded to a multiple of 4 (what cuBLASLt reads; the others read
        any row stride).  Idempotent.
        """
        bn, bk = self.block_size
        w = self.weight.data
        k = self.in_features
        kp = V.round_up(k, bk)
        if w.shape[1] != kp:
            w = F.pad(w.view(torch.uint8), (0, kp - k)).view(FP8_DTYPE)
        self.weight.data = w.contiguous()
        self._k_pad = kp - k
        s = self.weight_scale_inv.data
        if not (s.stride(1) == 1 and s.stride(0) % 4 == 0):
            s = ops.pad_scale_rows(s.contiguous(), 4)
        self.weight_scale_inv.data = s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
