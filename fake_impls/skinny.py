"""Fake (meta) implementation of dsv3_fused_a_gemm: validate like the real op,
allocate through the same shape helper."""

import torch

from scaledmm.ops import skinny as ops


@torch.library.register_fake("scaledmm::dsv3_fused_a_gemm")
def _(x, weight, enable_pdl=False):
    ops.check_args(x, weight, enable_pdl)
    return ops.output(x, weight)


@torch.library.register_fake("scaledmm::dynamic_skinny_linear")
def _(x, weight):
    ops.check_linear_args(x, weight)
    return ops.linear_output(x, weight)
