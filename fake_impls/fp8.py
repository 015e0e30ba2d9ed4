"""Fake (meta) implementations of the fp8 ops: validate like the real op,
allocate through the same shape helpers."""

import torch

from scaledmm.ops import fp8 as ops


@torch.library.register_fake("scaledmm::quant_fp8")
def _(x, scale=None, per_token=False):
    return ops.quant_outputs(x, scale, per_token)


@torch.library.register_fake("scaledmm::fp8_scaled_mm")
def _(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    ops.check_mm_args("fp8_scaled_mm", a, b, scale_a, scale_b, bias, out_dtype)
    return ops.mm_output(a, b, out_dtype)


@torch.library.register_fake("scaledmm::fp8_linear")
def _(x, b, scale_b, scale_x=None, per_token=False, bias=None, out_dtype=torch.bfloat16):
    ops.check_linear_args(x, b, scale_b, scale_x, per_token, bias, out_dtype)
    return torch.empty((x.shape[0], b.shape[0]), dtype=out_dtype, device=x.device)
