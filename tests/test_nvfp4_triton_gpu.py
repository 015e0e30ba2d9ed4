"""GPU tests (``gpu``) of the NVFP4 Triton backend: full llama8b shapes, every
decoder, odd M, split-K, CUDA-graph capture and replay, torch.compile, opcheck.

References (``nvfp4_triton_helpers``) are written from SPEC.md, independently
of ``ops/nvfp4.py``.
"""

from __future__ import annotations


import pytest
import torch

import scaledmm
from scaledmm.ops import nvfp4_triton as nt
from helpers import opcheck, rel_err
from nvfp4_triton_helpers import CHILD, decode, poison_mm_output, ref_mm, same_bits, spec_quant, special_rows

# GPU tests run in the main process only (the interpreter child would run them
# on the interpreter, copying every tensor to the host)
requires_cuda = pytest.mark.skipif(CHILD or not torch.cuda.is_available(), reason="needs a CUDA device")
FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------

LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
GPU_DECODES = ["ptx", "ptx_direct", "triton"]


@requires_cuda
@pytest.mark.parametrize("cfg", nt.QUANT_CANDIDATES, ids=lambda c: c.label())
@pytest.mark.parametrize("m", [1, 3, 17, 130, 1000])
@pytest.mark.parametrize("swz", [True, False])
def test_gpu_quant_exact(cfg, m, swz):
    x = (torch.randn(m, 7168, device="cuda") * 4).to(torch.bfloat16)
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # ties (s = 1)
    gs = torch.tensor(1.0, device="cuda")
    q, s = nt.quant(x, gs, swz, cfg)
    q_ref, s_ref = spec_quant(x.cpu(), gs.cpu(), swz)
    assert same_bits(q.cpu(), q_ref) and same_bits(s.cpu(), s_ref)


@requires_cuda
@pytest.mark.parametrize("cfg", [c for c in nt.QUANT_CANDIDATES if c.variant != "split8"], ids=lambda c: c.label())
def test_gpu_quant_special_values_and_dtypes(cfg):
    x = special_rows()
    xs = torch.cat([x, -x, x * 1e-3, x * 7.0], 1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for g in (1.0, 0.37, 3000.0):
            q, s = nt.quant(xs.to(dtype).cuda(), torch.tensor(g, device="cuda"), False, cfg)
            qr, sr = spec_quant(xs.to(dtype), torch.tensor(g), False)
            ok = ~torch.isnan(sr.float()).repeat_interleave(8, 1)
            assert same_bits(s.cpu(), sr) and torch.equal(q.cpu()[ok], qr[ok]), (dtype, g)


def _gpu_case(m, n, k, seed=0):
    """Quantized operands (the op module's reference quantizer, on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qa, sa = nt.nv.reference_quant(torch.randn(m, k, generator=g, device="cuda") * 2,
                                   torch.tensor(300.0, device="cuda"), True)
    qb, sb = nt.nv.reference_quant(torch.randn(n, k, generator=g, device="cuda") * 0.02,
                                   torch.tensor(40000.0, device="cuda"), True)
    return qa, sa, qb, sb


@requires_cuda
@pytest.mark.parametrize("n,k", LLAMA8B)
@pytest.mark.parametrize("m", [1, 16, 17, 130])
def test_gpu_w4a4_default_config(monkeypatch, n, k, m):
    poison_mm_output(monkeypatch)
    qa, sa, qb, sb = _gpu_case(m, n, k)
    alpha = torch.tensor(1 / (300.0 * 40000.0), device="cuda")
    bias = torch.randn(n, device="cuda")
    with scaledmm.use_backend("nvfp4", "triton"):
        out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha, torch.float32, bias)
    ref = ref_mm(decode(qa, sa), decode(qb, sb), alpha.item(), bias)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5


@requires_cuda
@pytest.mark.parametrize("decode_mode", GPU_DECODES)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_gpu_w4a16_decoders(decode_mode, xdtype, m):
    n, k = 1000, 1536
    _, _, qb, sb = _gpu_case(1, n, k, seed=m)
    # tiny block scales too: products land in the fp16 / bf16 subnormal range
    sb_tiny = sb.view(torch.uint8).clone()
    sb_tiny[:64] = (sb_tiny[:64] % 8)  # e4m3 subnormal scales
    sb_tiny = sb_tiny.view(FP8)
    x = torch.randn(m, k, device="cuda").to(xdtype)
    for scales in (sb, sb_tiny):
        ref = ref_mm(x.double(), decode(qb, scales), 2.0, None)
        for cfg in (nt.GemmConfig(64, 16, 256, decode=decode_mode, num_stages=4),
                    nt.GemmConfig(128, 64, 64, split_k=2, decode=decode_mode, num_warps=8),
                    nt.GemmConfig(64, 32, 128, split_k=3, decode=decode_mode)):
            out = nt.run_w4a16(x, qb, scales, torch.tensor(2.0, device="cuda"), torch.float32, None, cfg)
            assert rel_err(out, ref) < 1e-5, (cfg.label(), rel_err(out, ref))


@requires_cuda
@pytest.mark.parametrize("cfg", [nt.GemmConfig(64, 16, 256, num_stages=4),
                                 nt.GemmConfig(128, 128, 64, num_warps=8),
                                 nt.GemmConfig(128, 256, 64, num_warps=8, predecode_x=True),
                                 nt.GemmConfig(64, 16, 128, split_k=4),
                                 nt.GemmConfig(64, 32, 128, decode="triton")], ids=lambda c: c.label())
@pytest.mark.parametrize("m", [1, 3, 129, 1000])
def test_gpu_w4a4_configs(cfg, m):
    n, k = 520, 2080  # N % 64 != 0, K % 64 != 0
    qa, sa, qb, sb = _gpu_case(m, n, k, seed=m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = nt.run_mm(qa, qb, sa, sb, torch.tensor(1e-4, device="cuda"), torch.float32, bias, cfg)
    ref = ref_mm(decode(qa, sa), decode(qb, sb), 1e-4, bias)
    assert rel_err(out, ref) < 1e-5


@requires_cuda
def test_gpu_strided_and_zero_rows():
    n, k = 256, 512
    qa, sa, qb, sb = _gpu_case(7, n, k)
    wide = torch.zeros(7, k // 2 + 64, dtype=torch.uint8, device="cuda")
    wide[:, 32:32 + k // 2] = qa
    alpha = torch.tensor(1.0, device="cuda")
    with scaledmm.use_backend("nvfp4", "triton"):
        out = torch.ops.scaledmm.nvfp4_mm(wide[:, 32:32 + k // 2], qb, sa, sb, alpha, torch.float32)
        empty = torch.ops.scaledmm.nvfp4_mm(qa[:0], qb, sa[:0], sb, alpha, torch.float32)
    assert empty.shape == (0, n)
    assert rel_err(out, ref_mm(decode(qa, sa), decode(qb, sb), 1.0, None)) < 1e-5


@requires_cuda
def test_gpu_cuda_graph_capture_and_replay():
    n, k = 4096, 4096
    qa, sa, qb, sb = _gpu_case(16, n, k)
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    gs = torch.tensor(100.0, device="cuda")
    alpha = torch.tensor(1e-3, device="cuda")

    def step():
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gs)
        return (torch.ops.scaledmm.nvfp4_mm(q, qb, s, sb, alpha),
                torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, alpha))

    with scaledmm.use_backend("nvfp4", "triton"):
        eager = step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        again = step()
    for a, b in zip(captured, again):
        assert torch.equal(a, b)
    assert not torch.equal(captured[0], eager[0])


@requires_cuda
def test_gpu_ops_opcheck_and_compile():
    qa, sa, qb, sb = _gpu_case(5, 256, 256)
    alpha = torch.tensor(0.5, device="cuda")
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    with scaledmm.use_backend("nvfp4", "triton"):
        opcheck(torch.ops.scaledmm.nvfp4_quant.default, (x, torch.tensor(9.0, device="cuda"), True))
        opcheck(torch.ops.scaledmm.nvfp4_mm.default, (qa, qb, sa, sb, alpha, torch.bfloat16, None))
        opcheck(torch.ops.scaledmm.nvfp4_w4a16_mm.default, (x, qb, sb, alpha, torch.float16, None))
        f = torch.compile(lambda x: torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, alpha), fullgraph=True,
                          dynamic=True)
        for m in (5, 1, 3):
            assert torch.equal(f(x[:m]), torch.ops.scaledmm.nvfp4_w4a16_mm(x[:m], qb, sb, alpha))
