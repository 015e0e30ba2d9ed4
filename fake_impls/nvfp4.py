"""Fake (meta) implementations of the NVFP4 ops: validate like the real op,
allocate through the same shape helpers."""

import torch

from scaledmm.ops import nvfp4 as ops


@torch.library.register_fake("scaledmm::nvfp4_quant")
def _(x, global_scale, swizzle=True):
    return ops.quant_outputs(x, global_scale, swizzle)


@torch.library.register_fake("scaledmm::nvfp4_mm")
def _(a, b, a_scales, b_scales, alpha, out_dtype=torch.bfloat16, bias=None):
    ops.check_mm_args("nvfp4_mm", a, b, a_scales, b_scales, alpha, out_dtype, bias)
    return ops.mm_output(a, b, out_dtype)


@torch.library.register_fake("scaledmm::nvfp4_w4a16_mm")
def _(x, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    ops.check_w4a16_args("nvfp4_w4a16_mm", x, b, b_scales, weight_alpha, out_dtype, bias)
    return ops.mm_output(x, b, out_dtype)


@torch.library.register_fake("scaledmm::nvfp4_linear")
def _(x, b, b_scales, global_scale, alpha, out_dtype=torch.bfloat16, bias=None):
    ops.check_linear_args(x, b, b_scales, global_scale, alpha, out_dtype, bias)
    return ops.mm_output(x, b, out_dtype)


@torch.library.register_fake("scaledmm::nvfp4_dynamic_linear")
def _(x, x_amax, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    ops.check_dynamic_linear_args(x, x_amax, b, b_scales, weight_alpha, out_dtype, bias)
    return ops.mm_output(x, b, out_dtype)


@torch.library.register_fake("scaledmm::swizzle_block_scales")
def _(s):
    return ops.swizzle_output(s)


@torch.library.register_fake("scaledmm::unswizzle_block_scales")
def _(s, rows, cols):
    return ops.unswizzle_output(s, rows, cols)
