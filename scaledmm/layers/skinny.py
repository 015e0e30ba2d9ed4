"""``SkinnyLinear``: a bf16 linear for few tokens (decode), on
``scaledmm.skinny_linear`` (the fused-A kernel when M <= 16, else ``F.linear``)."""

from __future__ import annotations

import torch
from torch import nn

from scaledmm import validation as V
from scaledmm.dispatch import skinny_linear
from scaledmm.layers._state import checkpoint_entries
from scaledmm.layers.rows import as_rows, from_rows

__all__ = ["SkinnyLinear"]


class SkinnyLinear(nn.Module):
    """Linear layer with a bf16 ``[N, K]`` weight, tuned for M <= 16 rows.

    ``forward(x) = scaledmm.skinny_linear(x, weight) (+ bias)``: the fused-A
    kernel (``torch.ops.scaledmm.dsv3_fused_a_gemm``) when M <= 16 and the
    shape suits it (N % 16 == 0, K % 128 == 0), else ``F.linear``.  The bias,
    if any, is added after the GEMM in bf16.  Leading dimensions of ``x`` are
    flattened into M.

    The weight is not quantized, so the layer follows the float module
    convention: ``state_dict()`` holds ``weight`` and ``bias`` as the
    forward reads them, and ``.half()`` / ``.float()`` / ``.to(dtype)``
    convert them like ``nn.Linear``'s (the forward is then ``F.linear``: the
    fused-A kernel reads bf16 only).

    Parameters
    ----------
    in_features, out_features : int
        K and N.
    bias : bool
        Whether the layer has a bias (bf16).
    device : torch.device, optional

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers import SkinnyLinear
    >>> layer = SkinnyLinear.from_float(torch.nn.Linear(256, 64, bias=False))
    >>> layer(torch.randn(2, 256, dtype=torch.bfloat16)).shape
    torch.Size([2, 64])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.bfloat16, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=torch.bfloat16, device=device),
                                  requires_grad=False) if bias else None)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "SkinnyLinear":
        """Copy an ``nn.Linear`` (any float dtype) into a bf16 ``SkinnyLinear``.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import SkinnyLinear
        >>> SkinnyLinear.from_float(torch.nn.Linear(128, 32)).weight.dtype
        torch.bfloat16
        """
        tensors = {"weight": linear.weight.detach()}
        if linear.bias is not None:
            tensors["bias"] = linear.bias.detach()
        return cls.from_checkpoint(tensors)

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor]) -> "SkinnyLinear":
        """Load ``{"weight": [N, K], "bias": [N] (optional)}`` (converted to bf16).

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import SkinnyLinear
        >>> SkinnyLinear.from_checkpoint({"weight": torch.zeros(32, 128)}).out_features
        32
        """
        op = "SkinnyLinear.from_checkpoint"
        t = checkpoint_entries(op, tensors, ("weight",), ("bias",))
        w, bias = t["weight"], t.get("bias")
        V.check_dtype(op, "weight", w, V.ACT_DTYPES)
        V.check_rank(op, "weight", w, 2)
        n, k = w.shape
        if bias is not None:
            V.check_dtype(op, "bias", bias, V.ACT_DTYPES)
            V.check_shape(op, "bias", bias, (n,))
        layer = cls(k, n, bias is not None, device=w.device)
        with torch.no_grad():  # into the layer's contiguous bf16 tensors
            layer.weight.copy_(w)
            if bias is not None:
                layer.bias.copy_(bias)
        layer.process_weights_after_loading()
        return layer

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Make the weight (and bias) contiguous, once (their dtype stays: bf16
        unless converted with ``.to(dtype)``).  Idempotent."""
        for p in (self.weight, self.bias):
            if p is not None and not p.is_contiguous():
                p.data = p.data.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = skinny_linear(as_rows(x), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return from_rows(out, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
