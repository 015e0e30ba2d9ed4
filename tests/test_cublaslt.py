"""scaledmm.cublaslt: one cuBLASLt GEMM, ``alpha`` read from device memory, bias in the epilogue.

* CPU tests (no GPU, no library needed): ``available`` says why not (CPU, meta, no CUDA,
  interpreter, library missing), the library search and its error, the ctypes struct layouts,
  the row-major -> column-major argument mapping (simulated on strided CPU tensors), the plan
  key and the bounded plan cache, argument checks.
* GPU tests (``@requires_cuda``): against float64 ``alpha * x @ w.T + bias`` for M in 0, 1,
  3, 17, 128, 1023, odd N and K, contiguous and strided rows (x and out slices of wider
  tensors), bf16/fp16 inputs, bf16/fp16/fp32 outputs, with and without bias, poisoned outputs;
  a side stream; CUDA-graph replay with a changed alpha value (alpha is read on the device at
  replay); bit-determinism; N = 0 and K = 0; misaligned operands (correct or NoAlgorithm).

Bounds: fp32 sums of K products, the alpha product and the bias sum each within
``(K + 2) * 2**-23 * sum|terms|``; a 16-bit output adds half an ulp (unit roundoff times
the value, or half the subnormal spacing).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from scaledmm import cublaslt

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
         (torch.float16, torch.float32)]  # what cuBLASLt runs; the mixed 16-bit pairs raise NoAlgorithm


# ----------------------------------------------------------------------------
# CPU: availability, library search, struct layouts
# ----------------------------------------------------------------------------


def test_available_says_why_not(monkeypatch):
    for dev in ("cpu", "meta", torch.device("cpu")):
        ok, why = cublaslt.available(dev)
        assert not ok and "CUDA devices" in why
    monkeypatch.setattr(cublaslt, "interpreting", lambda: True)
    ok, why = cublaslt.available("cuda")
    assert not ok and "TRITON_INTERPRET" in why
    monkeypatch.setattr(cublaslt, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = cublaslt.available(torch.device("cuda", 0))
    assert not ok and "no CUDA device" in why


def test_available_reports_a_missing_library(monkeypatch):
    def missing():
        raise OSError("cuBLASLt library not found (tried libcublasLt.so.13)")

    monkeypatch.setattr(cublaslt, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")
    monkeypatch.setattr(cublaslt, "library", missing)
    ok, why = cublaslt.available("cuda:0")
    assert not ok and "libcublasLt.so.13" in why


def test_load_library_names_what_it_tried(tmp_path):
    fake = tmp_path / "libcublasLt.so.13"
    fake.write_bytes(b"not an ELF file")
    with pytest.raises(OSError, match="cuBLASLt library not found") as info:
        cublaslt.load_library(("libcublasLt.so.999",), dirs=[str(tmp_path), str(tmp_path / "absent")])
    assert "libcublasLt.so.999" in str(info.value) and str(fake) in str(info.value)
    assert cublaslt.LIBRARY_NAMES[0] == "libcublasLt.so.13"


def test_struct_layouts_match_the_header():
    # cublasLt.h: cublasLtMatmulAlgo_t {uint64_t data[8]}; cublasLtMatmulHeuristicResult_t
    # {algo; size_t workspaceSize; cublasStatus_t state; float wavesCount; int reserved[4]}
    assert ctypes.sizeof(cublaslt.MatmulAlgo) == 64
    r = cublaslt.HeuristicResult
    assert ctypes.sizeof(r) == 96
    assert [getattr(r, f).offset for f in ("algo", "workspace_size", "state", "waves_count", "reserved")] == \
        [0, 64, 72, 76, 80]


# ----------------------------------------------------------------------------
# CPU: the column-major mapping, plan keys, the plan cache, argument checks
# ----------------------------------------------------------------------------


def _col_major(t: torch.Tensor, rows: int, cols: int, ld: int) -> torch.Tensor:
    """The ``rows x cols`` column-major matrix (leading dimension ``ld``) at ``t``'s first element."""
    return torch.as_strided(t, (rows, cols), (1, ld), t.storage_offset())


@pytest.mark.parametrize("m,n,k", [(1, 1, 16), (3, 5, 16), (17, 200, 64), (4, 1, 32), (1, 7, 48)])
@pytest.mark.parametrize("strided", [False, True])
def test_column_major_mapping_computes_the_row_major_product(m, n, k, strided):
    """Simulate what cuBLASLt computes with the mapped arguments, on the tensors' own storage."""
    torch.manual_seed(m * 100 + n)
    pad = 24 if strided else 0
    x = torch.randn(m, k + pad, dtype=torch.float64)[:, pad // 3:pad // 3 + k]
    w = torch.randn(n, k + pad, dtype=torch.float64)[:, :k]
    out = torch.full((m, n + pad), float("nan"), dtype=torch.float64)[:, pad:pad + n]
    lds = [cublaslt.plan_key(x, w, None, out)[i] for i in (4, 5, 6)]
    transa, transb, a, b, d = cublaslt.column_major_args(m, n, k, *lds)
    assert (transa, transb) == (cublaslt.OP_T, cublaslt.OP_N)
    op_a = _col_major(w, *a).t() if transa == cublaslt.OP_T else _col_major(w, *a)
    _col_major(out, *d).copy_(op_a @ _col_major(x, *b))
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-12, atol=1e-12)
    assert all(ld >= rows for rows, _, ld in (a, b, d))  # what cuBLASLt requires of a layout


def test_plan_key_tells_problems_apart():
    x, w, out = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16), \
        torch.zeros(8, 32)
    wide = torch.zeros(8, 128, dtype=torch.bfloat16)
    key = cublaslt.plan_key(x, w, None, out)
    assert cublaslt.plan_key(x.clone(), w.clone(), None, out.clone())[:10] == key[:10]  # alignments may differ
    others = [cublaslt.plan_key(wide[:, :64], w, None, out),  # row stride
              cublaslt.plan_key(wide[:, 8:72], w, None, out),  # row stride and alignment
              cublaslt.plan_key(x, w, torch.zeros(32), out),  # bias
              cublaslt.plan_key(x, w, torch.zeros(32, dtype=torch.bfloat16), out),  # bias dtype
              cublaslt.plan_key(x, w, None, out.bfloat16()),  # output dtype
              cublaslt.plan_key(x[:7], w, None, out[:7])]  # M
    assert len({key, *others}) == 1 + len(others)
    lone = torch.zeros(64, dtype=torch.bfloat16).as_strided((1, 64), (0, 1))  # one row, row stride 0
    assert cublaslt.plan_key(lone, w, None, out[:1])[4] == 64  # ld >= K all the same


def test_plan_cache_is_bounded_lru_and_closes():
    closed, built = [], []

    class Plan:
        def __init__(self, key):
            self.key = key
            built.append(key)

        def close(self):
            closed.append(self.key)

    cache = cublaslt.PlanCache(2)
    a = cache.get("a", lambda: Plan("a"))
    cache.get("b", lambda: Plan("b"))
    assert cache.get("a", lambda: Plan("a2")) is a  # cached: not rebuilt, now most recent
    cache.get("c", lambda: Plan("c"))  # pushes out the least recent: b
    assert closed == ["b"] and built == ["a", "b", "c"]
    assert set(cache.items) == {"a", "c"}


def _cpu_args(m=4, n=8, k=16, dtype=torch.bfloat16):
    return (torch.zeros(m, k, dtype=dtype), torch.zeros(n, k, dtype=dtype), torch.tensor(1.0), None,
            torch.zeros(m, n, dtype=torch.bfloat16))


@pytest.mark.parametrize("change,match", [
    (lambda a: (a[0].float(),) + a[1:], "bf16 or fp16"),
    (lambda a: (a[0], a[1].half()) + a[2:], "bf16 or fp16"),
    (lambda a: a[:4] + (a[4].to(torch.int32),), "bf16 or fp16"),
    (lambda a: (a[0][:, :8],) + a[1:], r"x \[M, K\]"),
    (lambda a: a[:4] + (a[4][:3],), r"out \[M, N\]"),
    (lambda a: a[:2] + (torch.tensor(1.0, dtype=torch.bfloat16),) + a[3:], "alpha"),
    (lambda a: a[:2] + (torch.ones(2),) + a[3:], "alpha"),
    (lambda a: a[:3] + (torch.zeros(7),) + a[4:], "bias"),
    (lambda a: a[:3] + (torch.zeros(16)[::2],) + a[4:], "bias"),
    (lambda a: (a[0].t().contiguous().t(),) + a[1:], "unit column strides"),
    (lambda a: a, "one CUDA device"),
])
def test_argument_checks(change, match):
    with pytest.raises(ValueError, match=match):
        cublaslt.gemm_alpha_dev(*change(_cpu_args()))


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


def check(out, x, w, alpha, bias=None):
    """``out`` against float64 ``alpha * x @ w.T (+ bias)`` within fp32 accumulation error
    plus half an ulp of ``out.dtype``; every element written (finite)."""
    xd, wd, a = x.double(), w.double(), float(alpha)
    ref, absum = a * (xd @ wd.t()), abs(a) * (xd.abs() @ wd.abs().t())
    if bias is not None:
        ref, absum = ref + bias.double(), absum + bias.double().abs()
    acc_err = absum * (x.shape[1] + 2) * 2.0 ** -23
    u = UNIT[out.dtype]
    bound = acc_err + u * (ref.abs() + acc_err) + torch.finfo(out.dtype).tiny * u
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output (an unwritten poisoned element?)"
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"worst {float((err / bound).max()):.2f}x the bound"


def _operands(m, n, k, in_dtype, out_dtype, strided, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pad, at = (40, 8) if strided else (0, 0)  # slices 16-byte aligned (32 for fp32 out), row strides + 40
    x = torch.randn(m, k + pad, device="cuda", generator=g).to(in_dtype)[:, at:at + k]
    w = (torch.randn(n, k, device="cuda", generator=g) / max(k, 1) ** 0.5).to(in_dtype)
    out = torch.full((m, n + pad), float("nan"), device="cuda", dtype=out_dtype)[:, at:at + n]
    return x, w, out


@requires_cuda
def test_gpu_available():
    ok, why = cublaslt.available(torch.device("cuda", 0))
    assert ok and "cuBLASLt" in why, why


@requires_cuda
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
@pytest.mark.parametrize("in_dtype,out_dtype", PAIRS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n,k", [(200, 64), (1040, 4032), (200, 4032)])
@pytest.mark.parametrize("m", [0, 1, 3, 17, 128, 1023])
def test_gpu_matches_float64(m, n, k, in_dtype, out_dtype, strided):
    x, w, out = _operands(m, n, k, in_dtype, out_dtype, strided, seed=m + n + k)
    alpha = torch.tensor(0.37 if m % 2 else 2.0 ** -7, device="cuda")
    assert cublaslt.gemm_alpha_dev(x, w, alpha, None, out) is out
    check(out, x, w, alpha)
    for bias_dtype in (torch.bfloat16, torch.float16, torch.float32):
        bias = torch.randn(n, device="cuda").to(bias_dtype)
        out.fill_(float("nan"))
        if bias_dtype != out_dtype and out_dtype != torch.float32 and m > 0:  # bias of D's type (cublasLt.h)
            with pytest.raises(cublaslt.NoAlgorithm, match="bias"):
                cublaslt.gemm_alpha_dev(x, w, alpha, bias, out)
            continue
        cublaslt.gemm_alpha_dev(x, w, alpha, bias, out)
        check(out, x, w, alpha, bias)


@requires_cuda
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_gpu_mixed_16_bit_types_say_no_algorithm(in_dtype, out_dtype):
    x, w, out = _operands(64, 200, 64, in_dtype, out_dtype, False)
    with pytest.raises(cublaslt.NoAlgorithm, match="no algorithm"):
        cublaslt.gemm_alpha_dev(x, w, torch.tensor(1.0, device="cuda"), None, out)


@requires_cuda
def test_gpu_side_stream_and_bit_determinism():
    x, w, out = _operands(1023, 1040, 4032, torch.bfloat16, torch.bfloat16, True)
    alpha, bias = torch.tensor(0.37, device="cuda"), torch.randn(1040, device="cuda").bfloat16()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cublaslt.gemm_alpha_dev(x, w, alpha, bias, out)
        again = cublaslt.gemm_alpha_dev(x, w, alpha, bias, torch.full_like(out, float("nan")))
    s.synchronize()
    check(out, x, w, alpha, bias)
    assert torch.equal(out, again)


@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_graph_replay_reads_alpha_on_the_device(out_dtype):
    x, w, out = _operands(300, 1040, 4032, torch.bfloat16, out_dtype, True)
    alpha, bias = torch.tensor(0.37, device="cuda"), torch.randn(1040, device="cuda").to(out_dtype)
    cublaslt.gemm_alpha_dev(x, w, alpha, bias, out)  # warm-up: handle and plan outside capture
    check(out, x, w, alpha, bias)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cublaslt.gemm_alpha_dev(x, w, alpha, bias, out)
    for value in (2.0 ** -7, -3.5):
        out.fill_(float("nan"))
        alpha.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, w, torch.tensor(value), bias)


@requires_cuda
def test_gpu_empty_shapes():
    alpha = torch.tensor(0.5, device="cuda")
    x, w, out = _operands(17, 0, 64, torch.bfloat16, torch.bfloat16, False)
    assert cublaslt.gemm_alpha_dev(x, w, alpha, None, out).shape == (17, 0)
    x, w, out = _operands(0, 40, 64, torch.bfloat16, torch.float32, False)
    assert cublaslt.gemm_alpha_dev(x, w, alpha, None, out).shape == (0, 40)
    x, w, out = _operands(5, 40, 0, torch.bfloat16, torch.float32, False)
    bias = torch.randn(40, device="cuda")
    assert torch.equal(cublaslt.gemm_alpha_dev(x, w, alpha, bias, out), bias.expand(5, 40))
    assert torch.equal(cublaslt.gemm_alpha_dev(x, w, alpha, None, out), torch.zeros(5, 40, device="cuda"))


@requires_cuda
@pytest.mark.parametrize("offset", [1, 3])
def test_gpu_misaligned_is_right_or_says_no_algorithm(offset):
    """2-byte aligned operands and odd row strides: cuBLASLt's heuristic is told the
    alignment; it either finds a kernel that computes the right thing or we raise NoAlgorithm."""
    m, n, k = 33, 72, 64
    wide = torch.randn(m, k + 7, device="cuda").bfloat16()
    x = wide[:, offset:offset + k]
    w = (torch.randn(n, k, device="cuda") / 8).bfloat16()
    out = torch.full((m, n + 5), float("nan"), device="cuda", dtype=torch.bfloat16)[:, offset:offset + n]
    alpha = torch.tensor(0.37, device="cuda")
    try:
        cublaslt.gemm_alpha_dev(x, w, alpha, None, out)
    except cublaslt.NoAlgorithm as e:
        assert "no algorithm" in str(e)
        return
    check(out, x, w, alpha)
