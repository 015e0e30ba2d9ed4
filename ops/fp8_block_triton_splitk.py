"""Split-K reduction of the fp8_block Triton GEMM (``ops/fp8_block_triton.py``).

* ``_splitk_reduce_kernel``: the second launch of the two-launch split-K path:
  sums the ``[split, M, N]`` fp32 partials in split order (+ bias), one
  rounding to the output dtype.
* ``_tile_counters``: the per-tile counters of ``MMConfig.one_launch``, where
  the last program of each output tile does that sum inside ``_mm_kernel``
  (same order, same rounding: bit-identical) and resets its counter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8_block_triton_quant  # noqa: F401 - patches the interpreter before any kernel runs

__all__ = ["COUNTER_SLOTS", "COUNTER_REGIONS"]


@triton.jit(do_not_specialize=["M", "split_k"])
def _splitk_reduce_kernel(ws, c, bias, M, N, stride_cm, split_k, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
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


# One-launch split-K tile counters.  Every launch leaves its counters at 0, so
# one zeroed buffer per device serves all launches: each stream gets its own
# region of it on first sight (host bookkeeping only, so a capture on a new
# stream needs no allocation and no memset); launches on one stream never
# overlap.  A CUDA graph uses the region of the stream it was captured on:
# do not replay it concurrently with other work of that stream.  Without the
# device buffer (a first call inside a capture), with more tiles than a region
# holds or more streams than regions, a call gets fresh zeros (a memset).
COUNTER_SLOTS = 4096  # tiles per region (N = 32768 at M = 64 in 16x64 tiles: 2048)
COUNTER_REGIONS = 64  # 1 MB per device
_COUNTERS: dict = {}  # device -> int32 [COUNTER_REGIONS, COUNTER_SLOTS]
_REGION_OF: dict = {}  # (device, stream handle) -> region index


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for ``tiles`` output tiles, left at 0 by the kernel."""
    if tiles <= COUNTER_SLOTS:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        buf = _COUNTERS.get(device)
        if buf is None and not capturing:
            buf = _COUNTERS[device] = torch.zeros(COUNTER_REGIONS, COUNTER_SLOTS, dtype=torch.int32, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        region = _REGION_OF.setdefault((device, stream), len(_REGION_OF))
        if buf is not None and region < COUNTER_REGIONS:
            return buf[region]
    return torch.zeros(tiles, dtype=torch.int32, device=device)
