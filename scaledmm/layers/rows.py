"""Flattening of leading dims for the layers, without guards on M.

``x.reshape(-1, K)`` of a 2-D input that is a strided view (a sliced output of
the previous layer) makes Dynamo guard on ``M == 1`` and recompile; 2-D inputs
are therefore passed through untouched and only N-D inputs are reshaped.
"""

from __future__ import annotations

import torch


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x[..., K]`` as ``[M, K]`` rows (the input itself when already 2-D)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def from_rows(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` rows back to ``like``'s leading dims (``out`` itself for 2-D)."""
    return out if like.dim() == 2 else out.reshape(*like.shape[:-1], out.shape[-1])
