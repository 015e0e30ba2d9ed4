"""Checkpoints of whole quantized layers for the layer tests."""

from __future__ import annotations

import torch

import scaledmm  # noqa: F401  (registers torch.ops.scaledmm)
from scaledmm.ops import fp8_block as fp8_block_ops


def make_checkpoint(fmt: str, n: int, k: int, gen: torch.Generator, *, bias=True, per_channel=False,
                    static=False) -> dict[str, torch.Tensor]:
    """A whole layer's quantized checkpoint (``fmt`` is "fp8_block", "fp8" or
    "nvfp4") of an ``n`` x ``k`` weight, deterministic in ``gen`` so that
    every rank of a process group builds the same one.

    Examples
    --------
    >>> t = make_checkpoint("fp8", 32, 64, torch.Generator().manual_seed(0))
    >>> sorted(t)
    ['bias', 'weight', 'weight_scale']
    """
    w = torch.randn(n, k, generator=gen) * (0.5 + torch.rand(n, 1, generator=gen))
    if fmt == "fp8_block":
        q, s = fp8_block_ops.quantize_weight(w, (128, 128))
        t = {"weight": q, "weight_scale_inv": s}
    elif fmt == "fp8":
        q, s = torch.ops.scaledmm.quant_fp8(w, None, per_channel)
        t = {"weight": q, "weight_scale": s.reshape(-1) if per_channel else s.reshape(())}
        if static:
            t["input_scale"] = torch.tensor(3.0 / 448)
    else:
        scale_2 = w.abs().amax() / (448 * 6)
        q, s = torch.ops.scaledmm.nvfp4_quant(w, (1.0 / scale_2).reshape(1), False)
        t = {"weight": q, "weight_scale": s, "weight_scale_2": scale_2}
        if static:
            t["input_scale"] = torch.tensor(3.0 / (448 * 6))
    if bias:
        t["bias"] = torch.randn(n, generator=gen).to(torch.bfloat16)
    return t
