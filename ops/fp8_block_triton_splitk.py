"""Split-K reduction of the fp8_block Triton GEMM (``ops/fp8_block_triton.py``).

* ``splitk_reduce_kernel``: the second launch of the two-launch split-K path:
  sums the ``[split, M, N]`` fp32 partials in split order (+ bias), one
  rounding to the output dtype.
* ``tile_counters``: the per-tile counters of ``MMConfig.one_launch``, where
  the last program of each output tile does that sum inside ``mm_kernel``
  (same order, same rounding: bit-identical).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8_block_triton_quant  # noqa: F401 - patches the interpreter before any kernel runs


@triton.jit(do_not_specialize=["M", "split_k"])
def splitk_reduce_kernel(ws, c, bias, M, N, stride_cm, split_k, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = M.to(tl.int64) * N
    mask = offs < total
    rows = offs // N
    cols = offs % N
    acc = tl.load(ws + offs, mask=mask, other=0.0)
    for s in range(1, split_k):  # fixed order: deterministic
        acc += tl.load(ws + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(c + rows * stride_cm + cols, acc.to(c.dtype.element_ty), mask=mask)


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, for one one-launch call.

    Fresh per call (a memset; a memset node under CUDA-graph capture), never
    cached: memory an op kept would come from a CUDA-graph pool when its first
    call is Inductor's warm-up, and a cached buffer would be shared by every
    graph that captured it, racing when two of them replay at once."""
    return torch.zeros(tiles, dtype=torch.int32, device=device)
