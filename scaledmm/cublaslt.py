"""cuBLASLt through ctypes: a 16-bit GEMM whose scale ``alpha`` stays on the GPU.

torch's matmuls take ``alpha`` only as a host number, so a scale held in a device
tensor (NVFP4's ``alpha``) costs a host sync or a second pass over an fp32
product.  cuBLASLt reads ``alpha`` and ``beta`` through device pointers and adds
a bias in its epilogue: :func:`gemm_alpha_dev` writes
``(alpha * (x @ w.T) + bias).to(out.dtype)`` in one call, fp32 compute, one
rounding.  The library torch already loaded is opened with :mod:`ctypes`; one
handle per device (made at its first call: make that call outside CUDA-graph
capture), plans cached per :func:`plan_key`; workspace and ``beta`` (a device
zero) are torch allocations of the call, so calls are graph-capturable.

Examples
--------
>>> import torch
>>> from scaledmm import cublaslt
>>> cublaslt.available(torch.device("cpu"))[0]
False
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
from collections import OrderedDict

import torch

from scaledmm.device import interpreting

__all__ = ["LIBRARY_NAMES", "NoAlgorithm", "MatmulAlgo", "HeuristicResult", "PlanCache", "load_library", "library",
           "available", "alignment", "column_major_args", "plan_key", "gemm_alpha_dev"]

# Values read from the CUDA headers (no guesses):
#   cublasLt.h, cublas_api.h: github.com/zspace/system.cuda-12.6, include/ (cuBLAS 12.6.4);
#   library_types.h: the CUDA 13.0 toolkit (/usr/local/cuda-13.0/include/library_types.h).
# cublasStatus_t: SUCCESS 0, NOT_SUPPORTED 15.  cublasComputeType_t: CUBLAS_COMPUTE_32F 68.
# cudaDataType_t: CUDA_R_32F 0, CUDA_R_16F 2, CUDA_R_16BF 14.  cublasOperation_t: OP_N 0, OP_T 1.
# cublasLtPointerMode_t: CUBLASLT_POINTER_MODE_DEVICE = CUBLAS_POINTER_MODE_DEVICE = 1.
# cublasLtMatmulDescAttributes_t: POINTER_MODE 2 (int32), TRANSA 3 (int32), TRANSB 4 (int32),
#   EPILOGUE 7 (uint32), BIAS_POINTER 8 (void *), BIAS_DATA_TYPE 26 (int32).
# cublasLtEpilogue_t: DEFAULT 1, BIAS 4.  cublasLtReductionScheme_t: COMPUTE_TYPE 2.
# cublasLtMatmulPreferenceAttributes_t: MAX_WORKSPACE_BYTES 1 (uint64), REDUCTION_SCHEME_MASK 3
#   (uint32), MIN_ALIGNMENT_A/B/C/D_BYTES 5/6/7/8 (uint32; default 256).
# cublasLtMatmulAlgo_t: {uint64_t data[8]}; cublasLtMatmulHeuristicResult_t: {algo;
#   size_t workspaceSize; cublasStatus_t state; float wavesCount; int reserved[4]}.
STATUS_SUCCESS, STATUS_NOT_SUPPORTED = 0, 15
COMPUTE_32F = 68
DATA_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
OP_N, OP_T = 0, 1
POINTER_MODE_DEVICE = 1
DESC_POINTER_MODE, DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_DATA_TYPE = 2, 3, 4, 7, 8, 26
EPILOGUE_DEFAULT, EPILOGUE_BIAS = 1, 4
REDUCTION_COMPUTE_TYPE = 2  # split-K partial sums kept in fp32: one rounding to a 16-bit output
PREF_MAX_WORKSPACE, PREF_REDUCTION_MASK = 1, 3
PREF_MIN_ALIGNMENT = {"A": 5, "B": 6, "C": 7, "D": 8}

#: Library names tried first (already loaded by torch: found by soname), then the wheels' folders.
LIBRARY_NAMES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")
WHEEL_DIRS = ("cu13/lib", "cublas/lib")  # under each folder of the ``nvidia`` namespace package
MAX_WORKSPACE = 32 << 20
MAX_PLANS = 256
IN_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class NoAlgorithm(RuntimeError):
    """cuBLASLt's heuristic has no algorithm for a problem (unsupported dtypes or alignment)."""


class MatmulAlgo(ctypes.Structure):
    """``cublasLtMatmulAlgo_t`` (64 bytes)."""
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t`` (96 bytes)."""
    _fields_ = [("algo", MatmulAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_P = ctypes.c_void_p
_PP = ctypes.POINTER(_P)
_SIGNATURES = {
    "cublasLtCreate": [_PP],
    "cublasLtMatmulDescCreate": [_PP, ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescSetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatmulDescDestroy": [_P],
    "cublasLtMatrixLayoutCreate": [_PP, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
    "cublasLtMatrixLayoutDestroy": [_P],
    "cublasLtMatmulPreferenceCreate": [_PP],
    "cublasLtMatmulPreferenceSetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatmulPreferenceDestroy": [_P],
    "cublasLtMatmulAlgoGetHeuristic": [_P] * 7 + [ctypes.c_int, ctypes.POINTER(HeuristicResult),
                                                  ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmul": [_P] * 12 + [ctypes.POINTER(MatmulAlgo), _P, ctypes.c_size_t, _P],
}


class PlanCache:
    """A bounded LRU dict: ``get(key, build)`` returns the key's value or
    builds it; a value pushed out has its ``close()`` called.

    Examples
    --------
    >>> class V:
    ...     def close(self): print("closed")
    >>> c = PlanCache(1); a = c.get("a", V); a is c.get("a", V)
    True
    >>> _ = c.get("b", V)
    closed
    """

    def __init__(self, size: int = MAX_PLANS):
        self.size, self.items = size, OrderedDict()

    def get(self, key, build):
        item = self.items.get(key)
        if item is not None:
            self.items.move_to_end(key)
            return item
        item = self.items[key] = build()
        while len(self.items) > self.size:
            self.items.popitem(last=False)[1].close()
        return item


def _wheel_dirs() -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return [os.path.join(r, d) for r in roots for d in WHEEL_DIRS if os.path.isdir(os.path.join(r, d))]


def load_library(names=LIBRARY_NAMES, dirs=None) -> ctypes.CDLL:
    """Open libcublasLt: each of ``names``, then ``libcublasLt.so*`` in
    ``dirs`` (default: those of the ``nvidia`` pip wheels); OSError naming what was tried.

    Examples
    --------
    >>> load_library(("libcublasLt.so.999",), dirs=[])
    Traceback (most recent call last):
    OSError: cuBLASLt library not found (tried libcublasLt.so.999)
    """
    tried = []
    paths = list(names) + [p for d in (_wheel_dirs() if dirs is None else dirs)
                           for p in sorted(glob.glob(os.path.join(d, "libcublasLt.so*")), reverse=True)]
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            tried.append(path)
            continue
        for fn, args in _SIGNATURES.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, ctypes.c_int
        if hasattr(lib, "cublasLtGetStatusString"):
            lib.cublasLtGetStatusString.argtypes, lib.cublasLtGetStatusString.restype = [ctypes.c_int], ctypes.c_char_p
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], ctypes.c_size_t
        return lib
    raise OSError(f"cuBLASLt library not found (tried {', '.join(tried)})")


_LOCK = threading.Lock()
_STATE: dict = {}  # "lib": CDLL or the OSError of the first try; "handles": {device index: handle}
_PLANS = PlanCache()


def library() -> ctypes.CDLL:
    """The process's libcublasLt, opened once (a failure is remembered and re-raised).

    Examples
    --------
    >>> library().cublasLtGetVersion() >= 120000  # doctest: +SKIP
    True
    """
    with _LOCK:
        if "lib" not in _STATE:
            try:
                _STATE["lib"] = load_library()
            except OSError as e:
                _STATE["lib"] = e
        lib = _STATE["lib"]
    if isinstance(lib, OSError):
        raise lib
    return lib


def available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether :func:`gemm_alpha_dev` can run on ``device`` (default CUDA):
    a CUDA device, Triton not interpreting, libcublasLt loaded; and why not.

    Examples
    --------
    >>> available("meta")
    (False, 'cuBLASLt runs on CUDA devices, got meta')
    """
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        return False, f"cuBLASLt runs on CUDA devices, got {dev.type}"
    if interpreting():
        return False, "the Triton interpreter is on (TRITON_INTERPRET=1)"
    if torch.version.cuda is None or not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    try:
        lib = library()
    except OSError as e:
        return False, str(e)
    if "version" not in _STATE:
        _STATE["version"] = int(lib.cublasLtGetVersion())
    return True, f"cuBLASLt {_STATE['version']}"


def _check(status: int, fn: str) -> None:
    if status != STATUS_SUCCESS:
        lib = _STATE.get("lib")
        text = getattr(lib, "cublasLtGetStatusString", None)
        name = f" ({text(status).decode()})" if text is not None else ""
        raise RuntimeError(f"{fn} failed: cublasStatus_t {status}{name}")


def _set(lib, fn: str, obj, attr: int, value) -> None:
    _check(getattr(lib, fn)(obj, attr, ctypes.addressof(value), ctypes.sizeof(value)), fn)


def alignment(t: torch.Tensor) -> int:
    """The largest power of two (at most 256) dividing ``t``'s address in bytes.

    Examples
    --------
    >>> x = torch.zeros(64); alignment(x) >= 16, alignment(x[1:]), alignment(x[2:])
    (True, 4, 8)
    """
    ptr = t.data_ptr()
    return 256 if ptr == 0 else min(256, ptr & -ptr)


def column_major_args(m: int, n: int, k: int, ldx: int, ldw: int, ldo: int):
    """cuBLASLt's column-major reading of row-major ``out[m, n] = x[m, k] @ w[n, k].T``:
    it computes ``out.T`` (``n x m``, ld ``ldo``) = ``op(A) @ B`` with A = ``w``
    read as ``k x n`` (ld ``ldw``, op T) and B = ``x`` read as ``k x m`` (ld
    ``ldx``, op N).  Returns ``(transa, transb, A, B, D)``, layouts as ``(rows, cols, ld)``.

    Examples
    --------
    >>> column_major_args(3, 5, 16, 16, 24, 8)
    (1, 0, (16, 5, 24), (16, 3, 16), (5, 3, 8))
    """
    return OP_T, OP_N, (k, n, ldw), (k, m, ldx), (n, m, ldo)


def _ld(t: torch.Tensor, rows: int) -> int:
    return t.stride(0) if t.shape[0] > 1 else max(t.stride(0), rows, 1)


def plan_key(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """What a cached plan depends on: device, M, N, K, the three leading
    dimensions, dtypes, the bias dtype (None: no bias) and pointer alignments.

    Examples
    --------
    >>> x, w, out = torch.zeros(3, 16), torch.zeros(5, 16), torch.zeros(3, 5)
    >>> plan_key(x, w, None, out)[:7]
    (None, 3, 5, 16, 16, 16, 5)
    """
    (m, k), n = x.shape, w.shape[0]
    return (out.device.index, m, n, k, _ld(x, k), _ld(w, k), _ld(out, n), x.dtype, out.dtype,
            None if bias is None else bias.dtype, alignment(x), alignment(w), alignment(out),
            None if bias is None else alignment(bias))


class _Plan:
    """Descriptor, layouts and the heuristic's algorithm of one :func:`plan_key`."""

    def __init__(self, lib, handle, key, bias_ptr):
        self.lib, self.desc, self.layouts, self.error = lib, _P(), [], None
        _, m, n, k, ldx, ldw, ldo, dt_in, dt_out, dt_bias, al_x, al_w, al_out, _ = key
        try:
            _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, DATA_TYPES[torch.float32]),
                   "cublasLtMatmulDescCreate")
            transa, transb, a, b, d = column_major_args(m, n, k, ldx, ldw, ldo)
            desc_attrs = [(DESC_POINTER_MODE, ctypes.c_int32(POINTER_MODE_DEVICE)),
                          (DESC_TRANSA, ctypes.c_int32(transa)), (DESC_TRANSB, ctypes.c_int32(transb)),
                          (DESC_EPILOGUE, ctypes.c_uint32(EPILOGUE_DEFAULT if dt_bias is None else EPILOGUE_BIAS))]
            if dt_bias is not None:  # the heuristic reads the bias pointer's alignment
                desc_attrs += [(DESC_BIAS_DATA_TYPE, ctypes.c_int32(DATA_TYPES[dt_bias])),
                               (DESC_BIAS_POINTER, _P(bias_ptr))]
            for attr, value in desc_attrs:
                _set(lib, "cublasLtMatmulDescSetAttribute", self.desc, attr, value)
            for dtype, (rows, cols, ld) in ((dt_in, a), (dt_in, b), (dt_out, d)):
                self.layouts.append(_P())
                _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.layouts[-1]), DATA_TYPES[dtype], rows, cols,
                                                      ld), "cublasLtMatrixLayoutCreate")
            self.algo, self.workspace = self._heuristic(handle, al_w, al_x, al_out)
        except BaseException:
            self.close()
            raise

    def _heuristic(self, handle, al_a, al_b, al_d):
        lib, pref = self.lib, _P()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            attrs = [(PREF_MAX_WORKSPACE, ctypes.c_uint64(MAX_WORKSPACE)),
                     (PREF_REDUCTION_MASK, ctypes.c_uint32(REDUCTION_COMPUTE_TYPE))]
            attrs += [(PREF_MIN_ALIGNMENT[n], ctypes.c_uint32(v)) for n, v in
                      (("A", al_a), ("B", al_b), ("C", al_d), ("D", al_d))]
            for attr, value in attrs:
                _set(lib, "cublasLtMatmulPreferenceSetAttribute", pref, attr, value)
            result, count = HeuristicResult(), ctypes.c_int(0)
            a, b, d = self.layouts
            status = lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, a, b, d, d, pref, 1, ctypes.byref(result),
                                                        ctypes.byref(count))
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if status == STATUS_NOT_SUPPORTED or (status == STATUS_SUCCESS and (count.value < 1 or result.state)):
            self.error = f"status {status}, {count.value} algorithms"
            return None, 0
        _check(status, "cublasLtMatmulAlgoGetHeuristic")
        return result.algo, int(result.workspace_size)

    def close(self) -> None:
        for layout in self.layouts:
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        if self.desc:
            self.lib.cublasLtMatmulDescDestroy(self.desc)
        self.layouts, self.desc = [], _P()


def _check_args(x, w, alpha, bias, out) -> None:
    """ValueError naming what was expected (a per-call path: messages are formatted only on failure)."""
    def bad(why: str):
        raise ValueError(f"gemm_alpha_dev: {why}")

    if x.dim() != 2 or w.dim() != 2 or tuple(out.shape) != (x.shape[0], w.shape[0]) or x.shape[1] != w.shape[1]:
        bad(f"expected x [M, K], w [N, K], out [M, N], got {[tuple(t.shape) for t in (x, w, out)]}")
    if x.dtype not in IN_DTYPES or w.dtype != x.dtype or out.dtype not in OUT_DTYPES:
        bad(f"expected x, w both bf16 or fp16, out bf16/fp16/fp32, got {x.dtype}, {w.dtype}, {out.dtype}")
    if alpha.dtype != torch.float32 or alpha.numel() != 1:
        bad(f"alpha: expected one fp32 element, got {alpha.dtype} {tuple(alpha.shape)}")
    if bias is not None and (bias.dtype not in OUT_DTYPES or tuple(bias.shape) != (w.shape[0],)
                             or bias.shape[0] > 1 and bias.stride(0) != 1):
        bad(f"bias: expected a packed [N] vector of bf16/fp16/fp32, got {bias.dtype} {tuple(bias.shape)} "
            f"stride {bias.stride()}")
    if any(t.shape[1] > 1 and t.stride(1) != 1 for t in (x, w, out)):
        bad(f"expected unit column strides, got {[t.stride() for t in (x, w, out)]}")
    if out.shape[0] > 1 and out.stride(0) < out.shape[1]:
        bad(f"out: rows overlap (row stride {out.stride(0)}, {out.shape[1]} columns)")
    tensors = (x, w, alpha, out) + (() if bias is None else (bias,))
    if out.device.type != "cuda" or any(t.device != out.device for t in tensors):
        bad(f"expected every tensor on one CUDA device, got {[str(t.device) for t in tensors]}")


def gemm_alpha_dev(x: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor) -> torch.Tensor:
    """Write ``(alpha * (x @ w.T) + bias).to(out.dtype)`` into ``out`` with one
    cuBLASLt call: fp32 products and sums, fp32 ``alpha`` read from device
    memory when the kernel runs, bias added in fp32, one rounding.

    ``x``: ``[M, K]``, ``w``: ``[N, K]`` (both bf16 or both fp16), ``out``:
    ``[M, N]`` bf16/fp16/fp32, each with unit column stride and any row stride
    (``out`` may be a column range of a wider tensor); ``bias``: ``[N]`` or
    None; ``alpha``: one fp32 element.  Raises :class:`NoAlgorithm` when
    cuBLASLt has none for these dtypes and alignments: a 16-bit ``out`` takes
    inputs and bias of its own dtype (an fp32 ``out`` takes either input
    dtype and any bias, widened exactly).  Returns ``out``.

    Examples
    --------
    >>> x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
    >>> w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> out = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> gemm_alpha_dev(x, w, torch.tensor(0.5, device="cuda"), None, out)  # doctest: +SKIP
    """
    _check_args(x, w, alpha, bias, out)
    (m, k), n = x.shape, w.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    if bias is not None and bias.dtype != out.dtype:  # cuBLASLt's bias has D's type (cublasLt.h)
        if out.dtype != torch.float32:
            raise NoAlgorithm(f"cuBLASLt's bias epilogue takes the output's dtype {out.dtype}, got {bias.dtype}")
        bias = bias.float()  # exact
    x = x if m == 1 or x.stride(0) >= k else x.contiguous()  # rows may not overlap
    w = w if n == 1 or w.stride(0) >= k else w.contiguous()
    lib, key = library(), plan_key(x, w, bias, out)
    beta = torch.zeros((), dtype=torch.float32, device=out.device)
    with _LOCK, torch.cuda.device(out.device):
        handles = _STATE.setdefault("handles", {})
        if key[0] not in handles:
            handle = _P()
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            handles[key[0]] = handle
        handle = handles[key[0]]
        plan = _PLANS.get(key, lambda: _Plan(lib, handle, key, None if bias is None else bias.data_ptr()))
        if plan.error is not None:
            raise NoAlgorithm(f"cuBLASLt has no algorithm for x {tuple(x.shape)} {x.dtype} (row stride "
                              f"{key[4]}, {key[10]}-byte aligned), w {tuple(w.shape)} (row stride {key[5]}), "
                              f"out {out.dtype} (row stride {key[6]}), bias {key[9]}: {plan.error}")
        if bias is not None:
            _set(lib, "cublasLtMatmulDescSetAttribute", plan.desc, DESC_BIAS_POINTER, _P(bias.data_ptr()))
        ws = torch.empty(plan.workspace, dtype=torch.uint8, device=out.device) if plan.workspace else None
        a, b, d = plan.layouts
        _check(lib.cublasLtMatmul(handle, plan.desc, alpha.data_ptr(), w.data_ptr(), a, x.data_ptr(), b,
                                  beta.data_ptr(), out.data_ptr(), d, out.data_ptr(), d, ctypes.byref(plan.algo),
                                  None if ws is None else ws.data_ptr(), plan.workspace,
                                  torch.cuda.current_stream(out.device).cuda_stream), "cublasLtMatmul")
    return out
