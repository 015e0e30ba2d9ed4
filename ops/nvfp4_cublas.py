"""Backend ``decode_cublas`` of the ``nvfp4`` family: exact NVFP4 GEMMs for
large M, the weight decoded to 16 bits, the multiply on cuBLAS(Lt) (SPEC.md "NVFP4").

At large M the fused Triton kernel (``ops/nvfp4_triton.py``) serializes the
in-register decode with the tensor-core MMAs.  This backend separates them:

1. decode: ``wd = deq(b)`` to 16 bits with the Triton backend's
   :func:`~scaledmm.ops.nvfp4_triton_decode.dequant` (W4A4: ``xd = deq(a)`` too).
   Exact: every ``e2m1 * e4m3`` product has at most 6 significant bits in
   ``[2**-10, 2688]``.  No ``alpha`` is folded in (that would round);
2. multiply and epilogue, ``out = (alpha * (xd @ wd.T) (+ bias)).to(out_dtype)``
   with exact products, fp32 sums and one rounding (the fused kernel's
   semantics), on CUDA in ONE cuBLASLt call
   (:func:`scaledmm.cublaslt.gemm_alpha_dev`: ``alpha`` read from device
   memory, the bias added in cuBLASLt's epilogue, the output written
   directly), unless ``SCALEDMM_NVFP4_CUBLASLT=0`` (on by default: the
   faster path on the H200's Llama-3-8B layer at M = 4096).  Otherwise,
   and where that path cannot run (the CPU under the Triton interpreter,
   libcublasLt missing, cuBLASLt without
   an algorithm for the dtypes/alignment: e.g. a bias whose dtype is not the
   16-bit output's, or W4A16 with an output of the other 16-bit type), in
   two steps: ``acc = xd @ wd.T`` in fp32 (``aten::mm.dtype`` on CUDA: cuBLAS with fp32 output;
   on the CPU an fp32 matmul of the same exact values), then one Triton
   epilogue kernel ``out = (alpha * acc (+ bias)).to(out_dtype)``.

Transient memory is bounded: N is processed in chunks so that the 16-bit
weight chunk stays within :data:`CHUNK_BYTES`; on the two-step path M is
chunked as well when one weight chunk's fp32 accumulator would not fit.  Each
chunk writes ``out[m0:m1, n0:n1]`` through the output's row stride.  Shapes
alone choose the chunks: no host sync, CUDA-graph capturable (make one call
before capturing: it creates the cuBLASLt handle and plan), M = 0 and N = 0
return an empty output.

Automatic selection: the sm90 and sm80 selection policies
(``scaledmm/tuning/nvfp4_sm90.json``, ``nvfp4_sm80.json``) place the backend
after ``cuda_gemv`` / ``cuda_mid`` and before ``triton``; it takes
M >= :data:`MIN_M` (and M = 0), smaller M falls through to the others.  The
policies' switch ``SCALEDMM_NVFP4_DECODE_CUBLAS=0`` takes it out of
automatic selection; ``use_backend("nvfp4", "decode_cublas")`` always
reaches it.

Read top to bottom: capability checks, chunk plan, epilogue kernel and
launcher, the GEMMs (backend entry points), backend registration.

Examples
--------
>>> from scaledmm.ops import nvfp4_cublas as dc
>>> dc.chunk_rows(4096, 28672, 4096)  # (weight rows, activation rows) per chunk
(16384, 4096)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scaledmm import backends, cublaslt, env
from scaledmm.backends import Backend, Family, Problem
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_triton as nt
from scaledmm.ops import nvfp4_triton_decode as nd

FAMILY = Family.NVFP4
NAME = "decode_cublas"
#: Smallest M automatic selection sends here: the weight decode costs ~12-75
#: us (H200, llama8b shapes), so the fused Triton kernel still wins the large
#: shapes at M = 64; from M = 128 this path wins all four.  Numbers:
#: benchmarks/NOTES.md, "Provenance of tuned numbers".
MIN_M = 128
#: Bound on each transient buffer: the 16-bit weight chunk and (two-step
#: path only) the fp32 accumulator chunk (the activation decode of W4A4 is
#: M x K x 2 bytes, the size of a bf16 activation).
CHUNK_BYTES = 256 << 20
#: 16-bit type of the decoded W4A4 operands (both exact; bf16 keeps cuBLAS off
#: any fp16-accumulation setting), except fp16 for an fp16 output on the
#: cuBLASLt path (its 16-bit outputs take operands of their own type; fp32
#: compute there).  W4A16 decodes to the activation's dtype.
W4A4_DTYPE = torch.bfloat16
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OPS = ("nvfp4_mm", "nvfp4_w4a16_mm")

# ----------------------------------------------------------------------------
# 1. Capability checks
# ----------------------------------------------------------------------------


def has_mm_dtype() -> bool:
    """Whether this torch has ``aten::mm.dtype`` (fp32 output of 16-bit GEMMs, torch >= 2.8).

    Examples
    --------
    >>> isinstance(has_mm_dtype(), bool)
    True
    """
    return hasattr(torch.ops.aten.mm, "dtype")


def is_supported(device: torch.device) -> tuple[bool, str]:
    """Where the Triton decode runs (sm80+ GPUs; the CPU only under
    ``TRITON_INTERPRET=1``), with ``aten::mm.dtype`` on CUDA (torch >= 2.8).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.ops.nvfp4_cublas import is_supported
    >>> is_supported(torch.device("meta"))[0]
    False
    """
    ok, why = nt.is_supported(device)
    if not ok:
        return False, why
    if device.type == "cuda" and not has_mm_dtype():
        return False, f"needs aten::mm.dtype (fp32 output of 16-bit cuBLAS GEMMs, torch >= 2.8), torch {torch.__version__}"
    if uses_cublaslt(device):
        return True, "Triton exact decode to 16 bits + one cuBLASLt GEMM (device alpha, bias epilogue)"
    where = "fp32 matmul (interpreter)" if device.type == "cpu" else "cuBLAS mm with fp32 output"
    return True, f"Triton exact decode to 16 bits + {where} + Triton epilogue"


def uses_cublaslt(device: torch.device) -> bool:
    """Whether the multiply and epilogue run as one cuBLASLt call on ``device``:
    a CUDA device where :func:`scaledmm.cublaslt.available` holds and
    ``SCALEDMM_NVFP4_CUBLASLT`` is on (:func:`scaledmm.env.nvfp4_cublaslt`,
    read at every call; default on).

    Examples
    --------
    >>> import torch
    >>> uses_cublaslt(torch.device("cpu"))
    False
    """
    return device.type == "cuda" and env.nvfp4_cublaslt() and cublaslt.available(device)[0]


def can_implement(p: Problem) -> tuple[bool, str]:
    """The two GEMMs with M >= MIN_M (or M = 0: nothing to compute), any N,
    K % 16 == 0, bf16/fp16/fp32 output; W4A16 activations bf16/fp16."""
    w4a16 = p.opt("w4a16")
    if w4a16 is None:
        return False, "implements nvfp4_mm and nvfp4_w4a16_mm only"
    if p.k % nv.BLOCK != 0 or p.k <= 0:
        return False, f"needs K a positive multiple of {nv.BLOCK}, got K={p.k}"
    if p.out_dtype not in OUT_DTYPES:
        return False, f"writes bf16/fp16/fp32, got out_dtype={p.out_dtype}"
    if w4a16 and p.in_dtype not in (torch.bfloat16, torch.float16):
        return False, f"W4A16 takes bf16/fp16 activations, got {p.in_dtype}"
    if 0 < p.m < MIN_M:
        return False, f"needs M >= {MIN_M} (a full weight decode per call does not pay off below), got M={p.m}"
    return True, f"M >= {MIN_M}, K % 16 == 0"


# ----------------------------------------------------------------------------
# 2. Chunk plan
# ----------------------------------------------------------------------------


def chunk_rows(m: int, n: int, k: int, bound: int | None = None, fp32_acc: bool = True) -> tuple[int, int]:
    """``(n_rows, m_rows)``: weight rows and activation rows per chunk.

    ``n_rows`` is a multiple of 128 (a chunk of the swizzled block scales is
    then a contiguous row range of them) unless one chunk holds all N rows;
    it keeps the 16-bit weight chunk (``n_rows * k * 2`` bytes) and, with
    ``fp32_acc`` (the two-step path), the fp32 accumulator (``min(m, m_rows)
    * n_rows * 4``) within ``bound`` (:data:`CHUNK_BYTES`), never below 128
    rows.  ``m_rows`` is ``m`` unless even a 128-row accumulator of all M rows
    exceeds the bound (never without ``fp32_acc``: one cuBLASLt call writes
    the output directly).

    Examples
    --------
    >>> chunk_rows(4096, 4096, 4096)
    (4096, 4096)
    >>> chunk_rows(17, 1000, 64, bound=128 * 64 * 2)
    (128, 17)
    >>> chunk_rows(1 << 20, 4096, 4096), chunk_rows(1 << 20, 4096, 4096, fp32_acc=False)
    ((128, 524288), (4096, 1048576))
    """
    bound = CHUNK_BYTES if bound is None else bound
    m, n, k = max(m, 1), max(n, 1), max(k, 1)
    rows = min(bound // (2 * k), bound // (4 * m)) if fp32_acc else bound // (2 * k)
    rows = max(nv.SCALE_ROWS, rows - rows % nv.SCALE_ROWS)
    if rows >= n:
        rows = n
    return rows, min(m, acc_rows(m, rows, bound) if fp32_acc else m)


def acc_rows(m: int, n_rows: int, bound: int | None = None) -> int:
    """Activation rows per chunk of the two-step path for a weight chunk of
    ``n_rows`` rows: ``m`` unless its fp32 accumulator exceeds ``bound``.

    Examples
    --------
    >>> acc_rows(4096, 4096), acc_rows(1 << 20, 128)
    (4096, 524288)
    """
    bound = CHUNK_BYTES if bound is None else bound
    return max(1, bound // (4 * n_rows)) if 4 * m * n_rows > bound else m


# ----------------------------------------------------------------------------
# 3. Epilogue kernel: out = (alpha * acc (+ bias)).to(out dtype)
# ----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])  # one compile serves every M
def _epilogue_kernel(acc_ptr, out_ptr, bias_ptr, alpha_ptr, M, N, stride_am, stride_om,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rows = rm.to(tl.int64)[:, None]
    acc = tl.load(acc_ptr + rows * stride_am + rn[None, :], mask=mask, other=0.0)
    out = acc * tl.load(alpha_ptr).to(tl.float32)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


EPILOGUE_ELEMS = 4096  # elements per program (32 per thread at 4 warps)


def epilogue(acc: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Write ``(alpha * acc (+ bias)).to(out.dtype)`` into ``out`` (fp32
    arithmetic, one rounding).  ``acc``: fp32 ``[M, N]`` with unit column
    stride; ``out``: ``[M, N]`` with unit column stride (a column range of a
    wider output is fine); ``bias``: ``[N]`` or None; ``alpha``: one fp32
    element.  Returns ``out``."""
    m, n = acc.shape
    if m == 0 or n == 0:
        return out
    block_n = min(256, max(16, triton.next_power_of_2(n)))
    block_m = EPILOGUE_ELEMS // block_n
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _epilogue_kernel[grid](acc, out, bias if bias is not None else acc, alpha, m, n, acc.stride(0), out.stride(0),
                           HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return out


# ----------------------------------------------------------------------------
# 4. The GEMMs (backend entry points)
# ----------------------------------------------------------------------------


def mm_f32(x16: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """fp32 ``x16 @ wd.T`` of 16-bit operands: cuBLAS with fp32 output on
    CUDA; an fp32 matmul elsewhere (the products are exact in fp32 as well)."""
    if x16.device.type == "cuda":
        return torch.mm(x16, wd.t(), out_dtype=torch.float32)
    return x16.float() @ wd.float().t()


def _two_step(x16: torch.Tensor, wd: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor, m_rows: int) -> None:
    """fp32 ``x16 @ wd.T`` then the Triton epilogue into ``out``, ``m_rows`` rows at a time."""
    for m0 in range(0, x16.shape[0], m_rows):
        m1 = min(x16.shape[0], m0 + m_rows)
        epilogue(mm_f32(x16[m0:m1], wd), alpha, bias, out[m0:m1])


def _decode_mm(x16: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, alpha: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """``(alpha * (x16 @ deq(b).T) (+ bias)).to(out_dtype)``, chunked: one
    cuBLASLt call per weight chunk where :func:`uses_cublaslt`, else two steps."""
    m, n, k = x16.shape[0], b.shape[0], x16.shape[1]
    out = nv.mm_output(x16, b, out_dtype)
    if m == 0 or n == 0:
        return out
    lt = uses_cublaslt(x16.device)
    n_rows, m_rows = chunk_rows(m, n, k, fp32_acc=not lt)
    for n0 in range(0, n, n_rows):
        n1 = min(n, n0 + n_rows)
        s_rows = nv.swizzled_shape(n1 - n0, 1)[0]  # n0 is a multiple of 128: a contiguous block
        wd = nd.dequant(b[n0:n1], b_scales[n0:n0 + s_rows], x16.dtype)
        chunk_bias = None if bias is None else bias[n0:n1]
        if lt:
            try:
                cublaslt.gemm_alpha_dev(x16, wd, alpha, chunk_bias, out[:, n0:n1])
            except cublaslt.NoAlgorithm:  # remembered per shape: later calls come here at once
                _two_step(x16, wd, alpha, chunk_bias, out[:, n0:n1], acc_rows(m, n1 - n0))
        else:
            _two_step(x16, wd, alpha, chunk_bias, out[:, n0:n1], m_rows)
        del wd
    return out


def mm(a, b, a_scales, b_scales, alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_mm`` decoded to 16 bits: ``alpha * (deq(a) @ deq(b).T) (+ bias)``,
    exact products, fp32 sums, one rounding.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
    >>> w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                           # doctest: +SKIP
    >>> qa, sa = torch.ops.scaledmm.nvfp4_quant(x, one)                  # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(w, one)                  # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "decode_cublas"):             # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, one)
    """
    if a.shape[0] == 0 or b.shape[0] == 0:
        return nv.mm_output(a, b, out_dtype)
    fp16 = out_dtype == torch.float16 and uses_cublaslt(a.device)  # cuBLASLt: 16-bit out = operand dtype
    xd = nd.dequant(a, a_scales, torch.float16 if fp16 else W4A4_DTYPE)
    return _decode_mm(xd, b, b_scales, alpha, out_dtype, bias)


def w4a16_mm(x, b, b_scales, weight_alpha, out_dtype=torch.bfloat16, bias=None):
    """``nvfp4_w4a16_mm`` decoded to 16 bits: ``x @ (weight_alpha * deq(b)).T (+ bias)``
    with ``deq(b)`` exact in ``x.dtype``, fp32 sums, one rounding.

    Examples
    --------
    >>> import torch, scaledmm
    >>> x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
    >>> one = torch.tensor(1.0, device="cuda")                           # doctest: +SKIP
    >>> qb, sb = torch.ops.scaledmm.nvfp4_quant(x[:64].contiguous(), one)  # doctest: +SKIP
    >>> with scaledmm.use_backend("nvfp4", "decode_cublas"):             # doctest: +SKIP
    ...     out = torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, one)
    """
    return _decode_mm(x, b, b_scales, weight_alpha, out_dtype, bias)


# ----------------------------------------------------------------------------
# 5. Backend registration (its place in automatic selection: scaledmm/tuning/nvfp4_*.json)
# ----------------------------------------------------------------------------


backends.register(Backend(
    FAMILY, NAME,
    impls={"nvfp4_mm": mm, "nvfp4_w4a16_mm": w4a16_mm},
    is_supported=is_supported,
    can_implement=can_implement,
    description=(f"exact 16-bit decode (Triton) + one cuBLASLt GEMM (device alpha, bias epilogue; fallback: "
                 f"cuBLAS fp32-output mm + Triton epilogue), M >= {MIN_M} (sm80+)"),
))
