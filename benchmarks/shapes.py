"""Problem sizes: named shape sets, the default M sweep and their parsers.

A GEMM shape is the weight's ``N x K`` (``out_features x in_features``); the
activation has M rows, swept separately.  Shapes are given on the command line
as a comma list mixing set names and explicit shapes, written ``NxK`` or
``K->N`` (the fused-A convention, input width first)::

    --shapes dsv3
    --shapes 4096x7168,7168->2112,llama8b
    --m 1,4,16
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Shape", "SHAPE_SETS", "DEFAULT_M", "QUICK_M", "CPU_M", "MODEL_M", "parse_shapes", "parse_ms"]


@dataclasses.dataclass(frozen=True, order=True)
class Shape:
    """A weight shape ``[N, K]``; ``n == 0`` for ops without a weight (quantizers)."""

    n: int
    k: int

    @property
    def label(self) -> str:
        return f"K{self.k}" if self.n == 0 else f"{self.n}x{self.k}"


def _nk(*pairs: tuple[int, int]) -> tuple[Shape, ...]:
    return tuple(Shape(n, k) for n, k in pairs)


SHAPE_SETS: dict[str, tuple[Shape, ...]] = {
    # DeepSeek-V3 linear layers (N x K), plus the 576-wide kv_a projection.
    "dsv3": _nk((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168),
                (7168, 2048), (576, 7168)),
    # DeepSeek-V3 dense decoder layer: fused q_a/kv_a, q_b, kv_b, o_proj, fused gate/up, down_proj.
    "dsv3_dense": _nk((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (36864, 7168), (7168, 18432)),
    # Llama-3-8B: fused qkv, o_proj, fused gate/up, down_proj.
    "llama8b": _nk((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
    # Llama-3-8B as Hugging Face runs it: q/k/v and gate/up unfused (q and o 4096x4096).
    "llama8b_hf": _nk((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)),
    # DeepSeek-V3 fused-A style skinny projections, K -> N.
    "fused_a": _nk((2112, 7168), (1536, 7168), (576, 7168), (256, 7168), (24576, 1536)),
    # Small enough for a CPU smoke run of every family (N, K multiples of 128).
    "tiny": _nk((256, 512), (384, 256)),
}

DEFAULT_M: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 17, 32, 64, 128, 256, 1023, 1024, 4095, 4096, 8192)
QUICK_M: tuple[int, ...] = (1, 3, 16, 128, 4096)
CPU_M: tuple[int, ...] = (1, 3, 4, 17)
# The model family (whole decoder layers): decode batch sizes up to a prefill chunk.
MODEL_M: tuple[int, ...] = (1, 8, 64, 512, 4096)

_NXK = re.compile(r"^(\d+)x(\d+)$")
_K_TO_N = re.compile(r"^(\d+)->(\d+)$")


def parse_shapes(spec: str) -> list[Shape]:
    """Shapes from a comma list of set names, ``NxK`` and ``K->N`` items.

    Order is kept and duplicates dropped.  Bad items raise ``ValueError``
    naming ``--shapes``.

    Examples
    --------
    >>> [s.label for s in parse_shapes("4096x7168,7168->2112")]
    ['4096x7168', '2112x7168']
    >>> len(parse_shapes("dsv3"))
    7
    """
    out: list[Shape] = []
    for raw in spec.split(","):
        item = raw.strip().lower().replace(" ", "")
        if not item:
            continue
        if item in SHAPE_SETS:
            found = list(SHAPE_SETS[item])
        elif m := _NXK.match(item):
            found = [Shape(int(m[1]), int(m[2]))]
        elif m := _K_TO_N.match(item):
            found = [Shape(int(m[2]), int(m[1]))]
        else:
            sets = ", ".join(SHAPE_SETS)
            raise ValueError(f"--shapes: expected a set name ({sets}), NxK or K->N, got {raw.strip()!r}")
        for s in found:
            if s.n <= 0 or s.k <= 0:
                raise ValueError(f"--shapes: expected positive N and K, got {raw.strip()!r}")
            if s not in out:
                out.append(s)
    if not out:
        raise ValueError(f"--shapes: expected at least one shape, got {spec!r}")
    return out


def parse_ms(spec: str) -> list[int]:
    """M values from a comma list of non-negative ints (order kept, duplicates dropped).

    Examples
    --------
    >>> parse_ms("1,4,16,4")
    [1, 4, 16]
    """
    out: list[int] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        if not item.isdigit():
            raise ValueError(f"--m: expected non-negative integers, got {item!r}")
        if int(item) not in out:
            out.append(int(item))
    if not out:
        raise ValueError(f"--m: expected at least one M, got {spec!r}")
    return out
