"""fp8_block on a CUDA GPU: every registered backend against the SPEC formula in
float64 over the DeepSeek-V3 shapes, odd M, strided activation rows, both
activation-scale layouts, padded weight-scale rows, unwritten outputs, CUDA
graphs; the Triton quantizer bit for bit against the reference on the device;
fused fp8_block_linear bit for bit against quantize-then-GEMM.  Skips without
CUDA (the CPU side of the Triton kernels is tests/test_fp8_block_triton.py)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import scaledmm
from helpers import FP8, poison_, rel_err, requires_cuda
from scaledmm import backends
from scaledmm.ops import fp8_block as base

pytestmark = requires_cuda

DSV3 = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (576, 7168)]
ODD_M = [1, 3, 5, 17, 65, 66, 67, 1026]
EXTRA = [(256, 640), (200, 384)]  # K/128 % 4 != 0 (cuBLAS v2 path); N % 128 != 0


def _mm_backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    dev = torch.device("cuda")
    return [n for n in backends.names("fp8_block")
            if "fp8_block_mm" in backends.get("fp8_block", n).impls
            and backends.get("fp8_block", n).is_supported(dev)[0]]


def _triton():
    if "triton" not in backends.names("fp8_block"):
        pytest.skip("triton backend not loaded")
    from scaledmm.ops import fp8_block_triton as T

    return T


@functools.lru_cache(maxsize=1)
def weights(n: int, k: int):
    """e4m3 weight, block scales and the dequantized float64 weight (cached: the
    largest is 1 GB in float64, so only one shape at a time)."""
    g = torch.Generator(device="cuda").manual_seed(n * 7919 + k)
    b = (torch.randn(n, k, device="cuda", generator=g) * 2).to(FP8)
    bs = torch.rand(math.ceil(n / 128), math.ceil(k / 128), device="cuda", generator=g) + 0.05
    b64 = b.double() * bs.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return b, bs, b64


def activation(m: int, k: int, col_major: bool):
    full = (torch.randn(m, k + 128, device="cuda") * 2).to(FP8)
    a = full[:, :k]  # strided rows (stride K + 128, a multiple of 16)
    sa = torch.rand(m, math.ceil(k / 128), device="cuda") + 0.05
    if col_major:
        sa = sa.t().contiguous().t()
    return a, sa


def ref64(a, sa, b64):
    k = a.shape[1]
    return (a.double() * sa.double().repeat_interleave(128, 1)[:, :k]) @ b64.t()


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Outputs allocated through the shared shape helper start as NaN; freed
    NaN blocks make the caching allocator hand NaN memory to torch._scaled_mm."""
    real = base.mm_output
    monkeypatch.setattr(base, "mm_output", lambda *a: poison_(real(*a)))
    yield


def _poison_allocator(nbytes: int) -> None:
    if not torch.cuda.is_current_stream_capturing():
        torch.full((max(nbytes // 4, 1),), float("nan"), device="cuda")  # freed at once, NaN stays


def run_backend(name, a, b, sa, bs, out_dtype=torch.bfloat16):
    be = backends.get("fp8_block", name)
    _poison_allocator(a.shape[0] * b.shape[0] * 4)
    with scaledmm.use_backend("fp8_block", name):
        if a.shape[0] % be.needs_m_multiple == 0:
            return torch.ops.scaledmm.fp8_block_mm(a, b, sa, bs, [128, 128], out_dtype)
        return torch.ops.scaledmm.padded_fp8_block_mm(a, b, sa, bs, [128, 128], out_dtype)


def tol(out_dtype):
    return 1e-3 if out_dtype == torch.float32 else 4e-3


@pytest.mark.parametrize("n,k", DSV3 + EXTRA, ids=lambda v: str(v))
@pytest.mark.parametrize("name", _mm_backends())
def test_backend_vs_float64(name, n, k):
    b, bs, b64 = weights(n, k)
    be = backends.get("fp8_block", name)
    for m in ODD_M + [4, 64, 1024]:
        if name == "reference" and m > 67:
            continue
        for col in (False, True):
            a, sa = activation(m, k, col)
            want = ref64(a, sa, b64)
            out_dtypes = [torch.bfloat16]
            if name in ("triton", "reference") and m in (3, 66) and not col:
                out_dtypes += [torch.float32, torch.float16]
            for out_dtype in out_dtypes:
                ok, why = be.can_implement(base.problem(a, b, (128, 128), out_dtype, col,
                                                        m=math.ceil(m / be.needs_m_multiple) * be.needs_m_multiple))
                if not ok:
                    continue
                out = run_backend(name, a, b, sa, bs, out_dtype)
                assert out.shape == (m, n) and out.dtype == out_dtype
                assert not out.isnan().any(), f"{name} M={m}: unwritten (NaN) outputs"
                err = rel_err(out, want)
                assert err < tol(out_dtype), f"{name} M={m} {n}x{k} col={col} {out_dtype}: rel err {err:.2e}"


@pytest.mark.parametrize("name", _mm_backends())
def test_padded_weight_scales_and_nan_rows(name):
    n, k = 4096, 7168
    b, bs, b64 = weights(n, k)
    bs_pad = base.pad_scale_rows(bs, 64)  # row stride 64 > K/128 = 56
    a, sa = activation(68, k, True)
    out = run_backend(name, a, b, sa, bs_pad)
    assert rel_err(out, ref64(a, sa, b64)) < 4e-3
    sa = sa.clone()
    sa[5, 3] = float("nan")
    out = run_backend(name, a, b, sa, bs_pad)
    assert out[5].isnan().all() and not out[torch.arange(68, device="cuda") != 5].isnan().any()


@pytest.mark.parametrize("name", [n for n in _mm_backends() if backends.get("fp8_block", n).needs_m_multiple > 1])
@pytest.mark.parametrize("m", [1, 3, 17, 1023])
def test_padded_op_views_the_quantizers_spare_rows(name, m):
    """An activation from our quantizer has room for round_up(M, 4) rows: the
    padded op hands the aligned-only backend a view (garbage rows past M, whose
    outputs it drops), not a copy; results equal a zero-padded copy's."""
    n, k = 2112, 7168
    b, bs, b64 = weights(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, True)
    assert base.rows_view(q, base.V.round_up(m, 4)) is not None
    seen = []
    impl = backends.get("fp8_block", name).impls["fp8_block_mm"]

    def spy(a, *args):
        seen.append(a.data_ptr())
        return impl(a, *args)

    mp = base.V.round_up(m, 4)
    raw = torch.empty(0, dtype=torch.uint8, device="cuda").set_(q.untyped_storage())
    raw[q.numel():].fill_(0x7F)  # NaN codes in the spare rows: must not leak into rows < M
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setitem(backends.get("fp8_block", name).impls, "fp8_block_mm", spy)
        backends.invalidate()
        out = run_backend(name, q, b, s, bs)
        out_tight = run_backend(name, q.clone(), b, s, bs)
    backends.invalidate()
    assert seen[0] == q.data_ptr() and seen[1] != q.data_ptr() and mp > m
    assert not out.isnan().any()
    assert rel_err(out, ref64(q, s, b64)) < 4e-3
    assert torch.equal(out, out_tight)


@pytest.mark.parametrize("name", _mm_backends())
@pytest.mark.parametrize("m", [1, 3, 4, 64])
def test_cuda_graph_capture(name, m):
    n, k = 2112, 7168
    b, bs, b64 = weights(n, k)
    a, sa = activation(m, k, True)
    be = backends.get("fp8_block", name)
    if not be.can_implement(base.problem(a, b, (128, 128), torch.bfloat16, True,
                                         m=math.ceil(m / be.needs_m_multiple) * be.needs_m_multiple))[0]:
        pytest.skip(f"{name} cannot run this problem")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_backend(name, a, b, sa, bs)  # warm-up: compile, workspaces, handles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_backend(name, a, b, sa, bs)
    a2, sa2 = activation(m, k, True)
    a.copy_(a2)
    sa.copy_(sa2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, ref64(a, sa, b64)) < 4e-3


@pytest.mark.parametrize("m", [0, 1, 3, 17, 1026])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_quant_bit_exact_on_device(m, dtype):
    T = _triton()
    x = (torch.randn(m, 7168 + 64, device="cuda") * 3).to(dtype)[:, :7168]
    if m > 2:
        x[1, 9] = float("nan")
        x[2, 300] = float("inf")
    for col in (False, True):
        for ue8m0 in (False, True):
            q, s = T.per_token_group_quant(x, 128, 1e-10, col, ue8m0)
            q, s = q.cpu(), s.cpu()
            # reference on the CPU: ATen's CUDA `tensor / 448.0` multiplies by
            # fl(1 / 448) (BinaryDivTrueKernel.cu), which is not the SPEC's division
            qr, sr = base.reference_quant(x.cpu(), 128, 1e-10, col, ue8m0)
            qn, rn = q.float().isnan(), qr.float().isnan()
            assert torch.equal(qn, rn) and torch.equal(q.view(torch.uint8)[~rn], qr.view(torch.uint8)[~rn])
            assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(s[~sr.isnan()], sr[~sr.isnan()])
            assert s.stride() == sr.stride()
    q, s = T.per_token_group_quant(x, 128, 1e-10, True, False, tma_aligned=True)
    if m > 1:
        assert s.stride() == (1, math.ceil(m / 4) * 4)


@pytest.mark.parametrize("n,k", [(2112, 7168), (24576, 1536), (576, 7168), (7168, 2048)])
@pytest.mark.parametrize("m", [1, 3, 17, 64, 65, 300])
def test_triton_fused_linear_bit_exact(n, k, m):
    T = _triton()
    b, bs, b64 = weights(n, k)
    x = torch.randn(m, k + 64, device="cuda", dtype=torch.bfloat16)[:, :k]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for cfg in {T.default_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count, True),
                T.MMConfig(16, 64, split_k=4, swap_ab=True)}:
        fused = T.linear(x, b, bs, torch.bfloat16, bias, cfg, fuse=True)
        unfused = T.linear(x, b, bs, torch.bfloat16, bias, cfg, fuse=False)
        q, s = T.per_token_group_quant(x, 128)
        two_step = (T.mm(q, b, s, bs, torch.float32, cfg) + bias.float()).to(torch.bfloat16)
        assert torch.equal(fused, unfused) and torch.equal(fused, two_step), cfg
    ref = base.reference_linear(x, b, bs, (128, 128), torch.float32, bias)
    assert rel_err(fused, ref) < 4e-3
    with scaledmm.use_backend("fp8_block", "triton"):
        op = torch.ops.scaledmm.fp8_block_linear(x, b, bs, [128, 128], torch.bfloat16, bias)
    assert rel_err(op, ref) < 4e-3


def test_triton_precompile_makes_first_call_capturable():
    """After precompile() the first launch needs no compile and no module load,
    so it may happen inside a CUDA-graph capture."""
    T = _triton()
    n, k, m = 576, 7168, 3
    b, bs, b64 = weights(n, k)
    assert T.precompile(n, k, torch.device("cuda"), ms=(m,), fused=(True,)) == 1
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = T.linear(x, b, bs, torch.bfloat16, fuse=True)
    x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, base.reference_linear(x, b, bs, (128, 128), torch.float32)) < 4e-3
