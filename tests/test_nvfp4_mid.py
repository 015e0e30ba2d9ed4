"""Backend ``cuda_mid`` of nvfp4 (ops/nvfp4_mid.py, csrc/nvfp4_mid.cu).

CPU (the shared-memory slot swizzle: tests/test_csrc_host.py, compiled for
the host from the .cu file): NVRTC compiles of the instances dispatch and the
benchmark use (sm_90a, no GPU), the config predicate, the priority list and
gating, argument checks.
GPU (skipped without an sm90 GPU): against the float64 reference at M in 17,
33, 64, 65, 100, 128 and 300 (row slices), llama8b shapes, odd N and a K
with a partial 128-wide unit, bias / alpha / output dtypes, W4A16 (bf16 and
fp16), strided rows, a NaN scale, every candidate config, poisoned outputs,
determinism and CUDA graphs."""

from __future__ import annotations


import pytest
import torch
from helpers import nvfp4_problem as _problem
from helpers import nvrtc_registers, poison_
from nvfp4_helpers import check_f64_bound, cuda_operands

import scaledmm
from scaledmm import backends, jit
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_cublas as dc
from scaledmm.ops import nvfp4_gemv as gv
from scaledmm.ops import nvfp4_mid as md
from scaledmm.ops import nvfp4_wgmma as wg

LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
U8, BF16, F16 = torch.uint8, torch.bfloat16, torch.float16
nvrtc = pytest.mark.skipif(not jit.nvrtc_available()[0], reason="NVRTC not available")
requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm90 GPU")


# ----------------------------------------------------------------------------
# Configs and NVRTC compiles
# ----------------------------------------------------------------------------


def _instances():
    out = {}
    for n, k in LLAMA8B:
        for mb in md.M_BUCKETS:
            out[(n, k, mb, md.choose_config(n, k, mb), BF16, None, U8)] = None
            out[(n, k, mb, md.choose_config(n, k, mb, w4a16=True), BF16, None, BF16)] = None
    out[(1040, 736, 64, md.MidConfig(4, 2, 2, 1), F16, torch.float32, U8)] = None
    out[(1040, 736, 32, md.MidConfig(8, 1, 2, 2), BF16, None, U8)] = None
    out[(200, 96, 32, md.MidConfig(4, 1, 1, 1), BF16, BF16, F16)] = None
    out[(1040, 4096, 64, md.MidConfig(8, 1, 8, 1), F16, F16, BF16)] = None
    out[(4096, 4096, 64, md.MidConfig(8, 2, 4, 1, 3), BF16, None, U8)] = None  # cp.async weight rings
    out[(1040, 736, 64, md.MidConfig(4, 1, 2, 2, 4), F16, torch.float32, U8)] = None
    out[(200, 96, 32, md.MidConfig(4, 1, 1, 1, 2), BF16, BF16, F16)] = None
    return list(out)


@nvrtc
@pytest.mark.parametrize("n,k,mb,cfg,out_dtype,bias_dtype,act", _instances(),
                         ids=lambda v: v.short() if hasattr(v, "short") else str(v))
def test_instance_compiles_without_spills(n, k, mb, cfg, out_dtype, bias_dtype, act):
    w4a16 = act != U8
    assert md.config_valid(cfg, n, k, mb, w4a16) == (True, "ok")
    regs = nvrtc_registers(md.kernel_spec(n, k, mb, cfg, out_dtype, bias_dtype, act))
    assert regs <= cfg.registers(mb, w4a16), f"estimate {cfg.registers(mb, w4a16)} below the real {regs} registers"


@nvrtc
def test_kernel_rejects_bad_defines():
    spec = jit.NvrtcKernelSpec(md.KERNEL, md.source_path(), arch=md.ARCH,
                               defines=md.MidConfig().defines(64, 48, 64, BF16, None))
    with pytest.raises(jit.CompileError, match="multiple of 32"):
        spec.compile()


@pytest.mark.parametrize("cfg,n,k,mb,why", [
    (md.MidConfig(warps=2), 64, 128, 64, "warps"),
    (md.MidConfig(tiles=3), 64, 128, 64, "tiles"),
    (md.MidConfig(split_k=3), 64, 4096, 64, "split_k"),
    (md.MidConfig(unroll=3), 64, 4096, 64, "unroll"),
    (md.MidConfig(ring=1), 64, 4096, 64, "ring"),
    (md.MidConfig(), 64, 48, 64, "multiple of 32"),
    (md.MidConfig(), 0, 128, 64, "N > 0"),
    (md.MidConfig(), 64, 128, 16, "m_bucket"),
    (md.MidConfig(split_k=8), 64, 512, 64, "pipeline steps"),
    (md.MidConfig(4, 2, 1, 2), 64, 4096, 64, "registers"),
    (md.MidConfig(8, 1, 1, 1), 64, 4096, 128, "m_bucket"),
    ("w8", 64, 128, 64, "MidConfig"),
])
def test_config_predicate_rejects(cfg, n, k, mb, why):
    ok, reason = md.config_valid(cfg, n, k, mb)
    assert not ok and why in reason


@pytest.mark.parametrize("n,k", LLAMA8B + [(1040, 4096), (200, 96), (16, 32)])
@pytest.mark.parametrize("mb", md.M_BUCKETS)
@pytest.mark.parametrize("w4a16", [False, True])
def test_default_and_candidates_are_valid(n, k, mb, w4a16):
    cfgs = md.candidate_configs(n, k, mb, w4a16=w4a16)
    assert cfgs[0] == md.choose_config(n, k, mb, w4a16=w4a16)
    assert len(cfgs) == len(set(cfgs)) >= 1
    for cfg in cfgs:
        assert md.config_valid(cfg, n, k, mb, w4a16) == (True, "ok"), cfg
    grid = cfgs[0].grid(n, 300, mb)
    assert grid[0] * cfgs[0].rows() >= n and grid[2] * mb >= 300


def test_tuning_tables_valid():
    for table, w4a16 in ((md.TUNING, False), (md.TUNING_W4A16, True)):
        for (n, k), per_mb in table.items():
            for mb, cfg in per_mb.items():
                assert md.config_valid(cfg, n, k, mb, w4a16) == (True, "ok"), (n, k, mb, cfg)
                assert md.choose_config(n, k, mb, w4a16=w4a16) == cfg


def test_kernel_spec_validates():
    with pytest.raises(ValueError, match="cfg:"):
        md.kernel_spec(64, 48, 64, md.MidConfig())
    with pytest.raises(ValueError, match="out_dtype:"):
        md.kernel_spec(64, 128, 64, md.MidConfig(4, 1, 1, 1), torch.float32)
    with pytest.raises(ValueError, match="act_dtype:"):
        md.kernel_spec(64, 128, 64, md.MidConfig(4, 1, 1, 1), BF16, None, torch.float32)


def test_prebuild_hook():
    specs = md.prebuild_specs("4096:4096")
    assert len({s.key for s in specs}) == len(specs) == 8  # 2 buckets x 2 outputs x W4A4/W4A16
    with pytest.raises(ValueError, match="--nvfp4-mid"):
        md.prebuild_specs("4096x4096")


# ----------------------------------------------------------------------------
# Backend gating
# ----------------------------------------------------------------------------


def test_priority_and_the_m_ranges(fake_sm90):
    order = [gv.NAME, wg.NAME, md.NAME, "decode_cublas", "triton", "composite", "reference"]
    assert backends.priority("nvfp4", torch.device("cuda", 0)) == order  # the shipped sm90 policy
    for m in (1, 16, 32):
        assert backends.select(_problem(m), "nvfp4_mm").name == gv.NAME
    # the measured rows of 6144x4096: cuda_mid at M = 33-64 (W4A16: 17-32), cuda_wgmma from there
    for m in (33, 64):
        assert backends.select(_problem(m, n=6144), "nvfp4_mm").name == md.NAME
    for m in (65, 100, md.MAX_M, 512):
        assert backends.select(_problem(m, n=6144), "nvfp4_mm").name == wg.NAME
        assert backends.select(_problem(m), "nvfp4_mm").name == wg.NAME  # 4096x4096: from M = 34
    assert backends.select(_problem(40, k=4064), "nvfp4_mm").name == md.NAME  # K % 64 != 0: not cuda_wgmma
    assert backends.select(_problem(100, k=4064), "nvfp4_mm").name == md.NAME
    assert backends.select(_problem(md.MAX_M + 1, k=4064), "nvfp4_mm").name == "decode_cublas"
    assert md.MAX_M + 1 == dc.MIN_M  # no gap between the two backends' M ranges
    assert backends.select(_problem(17, n=6144, w4a16=True), "nvfp4_w4a16_mm").name == md.NAME
    assert backends.select(_problem(17, w4a16=True), "nvfp4_w4a16_mm").name == wg.NAME
    assert backends.select(_problem(40, out_dtype=torch.float32), "nvfp4_mm").name not in (md.NAME, gv.NAME)


def test_shipped_policy_and_switch(fake_sm90, monkeypatch):
    sm90 = backends.policy("nvfp4", "sm90")
    assert sm90.order.index(md.NAME) > sm90.order.index(gv.NAME)
    assert md.NAME not in backends.policy("nvfp4", "sm80").order
    var = sm90.switches[md.NAME]
    assert var == "SCALEDMM_NVFP4_MID"
    monkeypatch.setenv(var, "0")  # read at selection time: the next backend takes its M range
    assert md.NAME not in backends.priority("nvfp4", torch.device("cuda", 0))
    assert backends.select(_problem(64), "nvfp4_mm").name == wg.NAME
    assert backends.select(_problem(16), "nvfp4_mm").name == gv.NAME
    monkeypatch.setenv(sm90.switches[wg.NAME], "0")
    assert backends.select(_problem(64), "nvfp4_mm").name == "triton"
    monkeypatch.setenv(sm90.switches[gv.NAME], "0")  # all three off: triton below 128
    assert backends.select(_problem(16), "nvfp4_mm").name == "triton"
    monkeypatch.delenv(var)
    assert backends.select(_problem(16), "nvfp4_mm").name == md.NAME  # cuda_gemv off: cuda_mid first


@pytest.mark.parametrize("p,why", [
    (_problem(md.MAX_M + 1), f"M <= {md.MAX_M}"),
    (_problem(40, k=48), "multiple of 32"),
    (_problem(40, out_dtype=torch.float32), "bf16 or fp16"),
    (_problem(40, w4a16=True, act=torch.float32), "fp16 or bf16 activation"),
    (_problem(40, w4a16=True, stride=4096 + 4), "16 bytes"),
    (_problem(40, stride=4096 + 16), "16 bytes"),
])
def test_can_implement_says_why(p, why):
    ok, reason = md.can_implement(p)
    assert not ok and why in reason


def test_explicit_request_on_cpu_explains():
    a = torch.zeros(40, 64, dtype=U8)
    b = torch.zeros(32, 64, dtype=U8)
    s = torch.zeros(128, 8, dtype=torch.float8_e4m3fn)
    with scaledmm.use_backend("nvfp4", md.NAME), pytest.raises(RuntimeError, match="CUDA device"):
        torch.ops.scaledmm.nvfp4_mm(a, b, s, s, torch.tensor(1.0))


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


def _run(a, b, sa, sb, alpha, out_dtype=BF16, bias=None, cfg=None):
    torch.full((a.shape[0] * b.shape[0] + 1024,), float("nan"), device="cuda")  # NaN in the allocator
    if cfg is not None:
        out = poison_(nv.mm_output(a, b, out_dtype))
        return md.launch(a, b, sa, sb, alpha, bias, out, cfg)
    op = torch.ops.scaledmm.nvfp4_mm if a.dtype == U8 else torch.ops.scaledmm.nvfp4_w4a16_mm
    with scaledmm.use_backend("nvfp4", md.NAME):
        if a.dtype == U8:
            return op(a, b, sa, sb, alpha, out_dtype, bias)
        return op(a, b, sb, alpha, out_dtype, bias)


@requires_sm90
@pytest.mark.parametrize("m", [17, 33, 64, 65, 100, 128, 300])
@pytest.mark.parametrize("n,k", LLAMA8B + [(1040, 736), (200, 96)])
def test_gpu_w4a4_matches_f64(m, n, k):
    qa, sa, qb, sb, alpha = cuda_operands(m, n, k)
    cfg = md.choose_config(n, k, md.m_bucket(m)) if m > md.MAX_M else None  # row slices: the launcher itself
    check_f64_bound(_run(qa, qb, sa, sb, alpha, cfg=cfg), nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha)


@requires_sm90
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m", [17, 64, 100])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1040, 736), (200, 96)])
def test_gpu_w4a16_matches_f64(m, n, k, dtype):
    _, _, qb, sb, _ = cuda_operands(1, n, k)
    x = (torch.randn(m, k, device="cuda") * 3).to(dtype)
    check_f64_bound(_run(x, qb, None, sb, torch.tensor(0.5, device="cuda")), x, nv.dequantize(qb, sb), 0.5)


@requires_sm90
@pytest.mark.parametrize("out_dtype", [BF16, F16])
@pytest.mark.parametrize("bias_dtype", [torch.float32, BF16, F16])
def test_gpu_bias_alpha(out_dtype, bias_dtype):
    qa, sa, qb, sb, alpha = cuda_operands(40, 1040, 2048)
    bias = torch.randn(1040, device="cuda").to(bias_dtype)
    out = _run(qa, qb, sa, sb, alpha * 3.0, out_dtype, bias)
    check_f64_bound(out, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha * 3.0, bias)


@requires_sm90
@pytest.mark.parametrize("mb", md.M_BUCKETS)
@pytest.mark.parametrize("w4a16", [False, True])
@pytest.mark.parametrize("ring", [False, True])
def test_gpu_every_candidate_config(mb, w4a16, ring):
    n, k = 1040, 4064  # a partial 128-wide unit, N not a multiple of any tile
    m = mb - 5 if mb < 64 else 2 * mb + 3  # the widest bucket: three row slices
    qa, sa, qb, sb, alpha = cuda_operands(m, n, k)
    x = (torch.randn(m, k, device="cuda") * 3).to(BF16)
    for cfg in [c for c in md.candidate_configs(n, k, mb, w4a16=w4a16) if bool(c.ring) == ring]:
        if w4a16:
            check_f64_bound(_run(x, qb, None, sb, alpha, cfg=cfg), x, nv.dequantize(qb, sb), alpha)
        else:
            check_f64_bound(_run(qa, qb, sa, sb, alpha, cfg=cfg), nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha)


@requires_sm90
def test_gpu_strided_rows_nan_scale_zero_m_and_misaligned():
    m, n, k = 70, 1040, 1024
    qa, sa, qb, sb, alpha = cuda_operands(m, n, k)
    s = nv.unswizzle_block_scales(sa, m, k // 16)
    s.view(torch.uint8)[66, 3] = 0x7F  # e4m3 NaN in the second row slice of 64
    wide = torch.zeros(m, k // 2 + 48, dtype=U8, device="cuda")
    wide[:, 16:16 + k // 2] = qa
    out = _run(wide[:, 16:16 + k // 2], qb, nv.swizzle_block_scales(s), sb, alpha)  # row stride 560 bytes
    assert torch.isnan(out[66]).all()
    rows = [r for r in range(m) if r != 66]
    check_f64_bound(out[rows], nv.dequantize(qa, sa)[rows], nv.dequantize(qb, sb), alpha)
    qa0, sa0 = torch.ops.scaledmm.nvfp4_quant(torch.empty(0, k, dtype=BF16, device="cuda"), alpha)
    assert _run(qa0, qb, sa0, sb, alpha).shape == (0, n)
    shifted = torch.zeros(m, k // 2 + 16, dtype=U8, device="cuda")
    shifted[:, 1:1 + k // 2] = qa  # base one byte off: refused when requested, another backend in auto
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        _run(shifted[:, 1:1 + k // 2], qb, sa, sb, alpha)
    with backends.record() as calls:
        out = torch.ops.scaledmm.nvfp4_mm(shifted[:, 1:1 + k // 2], qb, sa, sb, alpha)
    assert calls[-1][1] not in (gv.NAME, md.NAME)
    check_f64_bound(out, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha)


@requires_sm90
def test_gpu_deterministic_auto_and_cuda_graph():
    qa, sa, qb, sb, alpha = cuda_operands(64, 4096, 4096)
    first = _run(qa, qb, sa, sb, alpha)
    assert torch.equal(first, _run(qa, qb, sa, sb, alpha))
    with backends.record() as calls:
        auto = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha)
    # whichever backend the tables pick here (cuda_mid or cuda_wgmma): deterministic, exact,
    # and the same bits as the forced call when it is this kernel
    assert torch.equal(auto, torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha))
    check_f64_bound(auto, nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha)
    if calls[-1][1] == md.NAME:
        assert torch.equal(auto, first)
    qa2, sa2, _, _, _ = cuda_operands(64, 4096, 4096)
    graph = torch.cuda.CUDAGraph()
    with scaledmm.use_backend("nvfp4", md.NAME):
        with torch.cuda.graph(graph):
            captured = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha)
    qa.copy_(qa2)
    sa.copy_(sa2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _run(qa, qb, sa, sb, alpha))
    assert not torch.equal(captured, first)
