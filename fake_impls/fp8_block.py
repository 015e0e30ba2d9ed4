"""Fake (meta) implementations of the fp8_block ops: validate like the real
op, allocate through the same shape helpers."""

import torch

from scaledmm.ops import fp8_block as ops


@torch.library.register_fake("scaledmm::per_token_group_quant_fp8")
def _(x, group_size=128, eps=1e-10, column_major_scales=False, scale_ue8m0=False):
    return ops.quant_outputs(x, group_size, eps, column_major_scales, scale_ue8m0)


def _mm(op):
    def fake(a, b, a_scales, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16):
        ops.check_mm_args(op, a, b, a_scales, b_scales, block_size, out_dtype)
        return ops.mm_output(a, b, out_dtype)

    return fake


for _op in ("fp8_block_mm", "padded_fp8_block_mm", "dynamic_padded_fp8_block_mm"):
    torch.library.register_fake(f"scaledmm::{_op}")(_mm(_op))


@torch.library.register_fake("scaledmm::fp8_block_linear")
def _(x, b, b_scales, block_size=(128, 128), out_dtype=torch.bfloat16, bias=None):
    ops.check_linear_args(x, b, b_scales, block_size, out_dtype, bias)
    return ops.mm_output(x, b, out_dtype)
