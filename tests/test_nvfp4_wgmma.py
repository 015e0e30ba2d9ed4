"""Backend ``cuda_wgmma`` of nvfp4 (ops/nvfp4_wgmma.py, csrc/nvfp4_wgmma.cu).

CPU: NVRTC compiles of the instances dispatch and the sweep use (sm_90a, no
GPU; no spills, within the register estimate, and no wgmma serialization),
the config predicate, defaults and candidates, argument checks, gating.
GPU (skipped without an sm90 GPU): the decode bit for bit over every code and
every e4m3 scale (identity activation), against the float64 reference at odd
M (17 .. 1023) on llama8b shapes, odd N and K, bias / alpha / output dtypes,
W4A16 (bf16 and fp16), strided rows, a NaN scale, M = 0, every candidate
config of a shape, poisoned outputs, determinism and CUDA graphs."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from helpers import nvfp4_problem as _problem
from helpers import nvrtc_registers, poison_
from nvfp4_helpers import check_f64_bound, cuda_operands

import scaledmm
from scaledmm import backends, jit
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_triton_decode as nd
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
        for m in (64, 512):
            out[(n, k, wg.choose_config(n, k, m), BF16, None, BF16)] = None
    out[(4096, 4096, wg.WgmmaConfig(128, 2, 8, 2), F16, torch.float32, F16)] = None
    out[(1040, 4032, wg.WgmmaConfig(32, 1, 8, 4), BF16, BF16, BF16)] = None
    out[(200, 128, wg.WgmmaConfig(64, 1, 4, 2), F16, F16, F16)] = None
    out[(4096, 4096, wg.WgmmaConfig(128, 1, 6, 2), BF16, None, F16)] = None
    # 256-row activation tiles: one warpgroup, or two with a producer warpgroup (setmaxnreg)
    out[(28672, 4096, wg.WgmmaConfig(256, 1, 4, 1), BF16, None, BF16)] = None
    out[(4096, 4096, wg.WgmmaConfig(256, 1, 6, 2), F16, torch.float32, F16)] = None
    out[(28672, 4096, wg.WgmmaConfig(256, 2, 4, 1, 1), BF16, None, BF16)] = None
    out[(4096, 14336, wg.WgmmaConfig(256, 2, 6, 1, 1), F16, BF16, F16)] = None
    # persistent: the tile loop around the ring
    out[(28672, 4096, wg.WgmmaConfig(256, 2, 4, 1, 1, 1), BF16, None, BF16)] = None
    out[(4096, 14336, wg.WgmmaConfig(128, 2, 6, 1, 0, 1), F16, torch.float32, F16)] = None
    out[(1040, 4032, wg.WgmmaConfig(128, 1, 4, 1, 0, 1), BF16, BF16, BF16)] = None
    return list(out)


@nvrtc
@pytest.mark.parametrize("n,k,cfg,out_dtype,bias_dtype,act", _instances(),
                         ids=lambda v: v.short() if hasattr(v, "short") else str(v))
def test_instance_compiles_without_spills(n, k, cfg, out_dtype, bias_dtype, act):
    assert wg.config_valid(cfg, n, k) == (True, "ok")
    spec = wg.kernel_spec(n, k, cfg, out_dtype, bias_dtype, act)
    regs = nvrtc_registers(spec)  # asserts no spills (with a producer warpgroup: in the consumers' 232)
    if cfg.tile_m == 256 and cfg.warpgroups == 1:  # ptxas spends what the 255 leave it
        assert regs <= cfg.register_limit()
    else:
        assert regs <= cfg.registers(), f"estimate {cfg.registers()} below the real {regs} registers"
    log = io.StringIO()
    spec.compile(logs=log, ptxas_options="-v")
    assert "serialized" not in log.getvalue(), log.getvalue()  # wgmma kept asynchronous


@nvrtc
def test_kernel_rejects_bad_defines():
    spec = jit.NvrtcKernelSpec(wg.KERNEL, wg.source_path(), arch=wg.ARCH,
                               defines=wg.WgmmaConfig().defines(64, 96, BF16, None, BF16))
    with pytest.raises(jit.CompileError, match="multiple of 64"):
        spec.compile()
    # the kernel itself refuses what config_valid refuses: a producer warpgroup with split K
    pwg_split = jit.NvrtcKernelSpec(wg.KERNEL, wg.source_path(), arch=wg.ARCH,
                                    defines=wg.WgmmaConfig(256, 2, 4, 2, 1).defines(4096, 4096, BF16, None, BF16))
    with pytest.raises(jit.CompileError, match="W_PWG 1 needs W_SPLIT 1"):
        pwg_split.compile()


@pytest.mark.parametrize("cfg,n,k,why", [
    (wg.WgmmaConfig(tile_m=48), 64, 128, "tile_m"),
    (wg.WgmmaConfig(warpgroups=3), 64, 128, "warpgroups"),
    (wg.WgmmaConfig(stages=3), 64, 128, "stages"),
    (wg.WgmmaConfig(split_k=8), 64, 4096, "split_k"),
    (wg.WgmmaConfig(split_k=4), 64, 192, "without any"),
    (wg.WgmmaConfig(), 64, 96, "multiple of 64"),
    (wg.WgmmaConfig(), 0, 128, "N > 0"),
    (wg.WgmmaConfig(tile_m=512), 64, 128, "tile_m"),
    (wg.WgmmaConfig(tile_m=256), 64, 128, "registers"),  # two warpgroups need the producer warpgroup
    (wg.WgmmaConfig(tile_m=256, warpgroups=1, producer_wg=1), 64, 128, "two consumer warpgroups"),
    (wg.WgmmaConfig(producer_wg=2), 64, 128, "producer_wg must be 0 or 1"),
    (wg.WgmmaConfig(tile_m=256, split_k=2, producer_wg=1), 64, 4096, "producer_wg needs split_k 1"),
    (wg.WgmmaConfig(split_k=2, persistent=1), 64, 4096, "persistent needs split_k 1"),
    (wg.WgmmaConfig(persistent=2), 64, 128, "persistent must be 0 or 1"),
    ("m128", 64, 128, "WgmmaConfig"),
])
def test_config_predicate_rejects(cfg, n, k, why):
    ok, reason = wg.config_valid(cfg, n, k)
    assert not ok and why in reason


def test_persistent_config_grid():
    """A persistent config launches min(tiles, resident CTAs) along x, the
    same shared memory and threads as one CTA a tile."""
    cfg = wg.WgmmaConfig(256, 2, 4, 1, 1, 1)
    flat = dataclasses.replace(cfg, persistent=0)
    assert wg.config_valid(cfg, 28672, 4096) == (True, "ok") and cfg.short() == "m256g2s4k1pr"
    assert cfg.tiles(28672, 512) == 2 * 224
    assert cfg.grid(28672, 512, 132) == (132, 1, 1) and cfg.grid(200, 3, 132) == (2, 1, 1)
    assert flat.grid(28672, 512, 132) == (2, 224, 1)
    assert (cfg.smem_bytes(), cfg.threads(), cfg.registers()) == (flat.smem_bytes(), flat.threads(), flat.registers())


@pytest.mark.parametrize("n,k", LLAMA8B + [(1040, 4032), (200, 128), (16, 64)])
@pytest.mark.parametrize("m", [1, 17, 64, 100, 512, 4096])
def test_default_and_candidates_are_valid(n, k, m):
    cfgs = wg.candidate_configs(n, k, m)
    assert cfgs[0] == wg.choose_config(n, k, m)
    assert len(cfgs) == len(set(cfgs)) >= 1
    for cfg in cfgs:
        assert wg.config_valid(cfg, n, k) == (True, "ok"), cfg
    grid = cfgs[0].grid(n, m)
    assert grid[0] * cfgs[0].tile_m >= m and grid[1] * cfgs[0].rows() >= n


def test_tuning_table_rows_valid():
    assert wg.TUNING, "the shipped table has rows"
    for (n, k), rows in wg.TUNING.items():
        for max_m, cfg in rows.items():
            assert wg.config_valid(cfg, n, k) == (True, "ok"), (n, k, max_m, cfg)
            assert wg.choose_config(n, k, max_m if max_m < 1 << 30 else 4096) == cfg


def test_kernel_spec_validates():
    with pytest.raises(ValueError, match="cfg:"):
        wg.kernel_spec(64, 96, wg.WgmmaConfig())
    with pytest.raises(ValueError, match="out_dtype:"):
        wg.kernel_spec(64, 128, wg.WgmmaConfig(), torch.float32)
    with pytest.raises(ValueError, match="act_dtype:"):
        wg.kernel_spec(64, 128, wg.WgmmaConfig(), BF16, None, U8)


def test_prebuild_hook():
    specs = wg.prebuild_specs("4096:4096")
    assert len({s.key for s in specs}) == len(specs) >= 4
    with pytest.raises(ValueError, match="--nvfp4-wgmma"):
        wg.prebuild_specs("4096x4096")


# ----------------------------------------------------------------------------
# Backend gating
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("p,why", [
    (_problem(40, k=96), "multiple of 64"),
    (_problem(40, k=48), "multiple of 32"),
    (_problem(40, out_dtype=torch.float32), "bf16 or fp16"),
    (_problem(40, w4a16=True, act=torch.float32), "fp16 or bf16 activation"),
    (_problem(40, w4a16=True, stride=4096 + 4), "16 bytes"),
])
def test_can_implement_says_why(p, why):
    ok, reason = wg.can_implement(p)
    assert not ok and why in reason


def test_can_implement_any_m():
    for m in (1, 17, 1023, 1 << 20):
        assert wg.can_implement(_problem(m))[0]
        assert wg.can_implement(_problem(m, w4a16=True))[0]


def test_switch_takes_it_out(fake_sm90, monkeypatch):
    sm90 = backends.policy("nvfp4", "sm90")
    assert sm90.switches[wg.NAME] == "SCALEDMM_NVFP4_WGMMA"
    assert wg.NAME in backends.priority("nvfp4", torch.device("cuda", 0))
    monkeypatch.setenv("SCALEDMM_NVFP4_WGMMA", "0")
    assert wg.NAME not in backends.priority("nvfp4", torch.device("cuda", 0))
    assert backends.select(_problem(512), "nvfp4_mm").name != wg.NAME


def test_explicit_request_on_cpu_explains():
    a = torch.zeros(40, 64, dtype=U8)
    b = torch.zeros(32, 64, dtype=U8)
    s = torch.zeros(128, 8, dtype=torch.float8_e4m3fn)
    with scaledmm.use_backend("nvfp4", wg.NAME), pytest.raises(RuntimeError, match="CUDA device"):
        torch.ops.scaledmm.nvfp4_mm(a, b, s, s, torch.tensor(1.0))


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


def _run(a, b, sa, sb, alpha, out_dtype=BF16, bias=None, cfg=None):
    torch.full((a.shape[0] * b.shape[0] + 1024,), float("nan"), device="cuda")  # NaN in the allocator
    if cfg is not None:
        x = wg.permute_k(a) if a.dtype != U8 else nd.dequant(a, sa, F16, permute_k=True)
        return wg.launch(x, b, sb, alpha, bias, poison_(nv.mm_output(a, b, out_dtype)), cfg)
    with scaledmm.use_backend("nvfp4", wg.NAME):
        if a.dtype == U8:
            return torch.ops.scaledmm.nvfp4_mm(a, b, sa, sb, alpha, out_dtype, bias)
        return torch.ops.scaledmm.nvfp4_w4a16_mm(a, b, sb, alpha, out_dtype, bias)


@requires_sm90
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_gpu_decode_every_code_and_scale_exact(dtype):
    """Identity activation: out = deq(b).T exactly (every e2m1 code times
    every finite e4m3 scale, subnormal scales and the 0.5 code included, is
    exact in both 16-bit types)."""
    k = 256
    n = 256  # row r: scale byte r in every block (0x7F / 0xFF, the NaNs, replaced by 0x7E / 0xFE)
    codes = torch.arange(k, device="cuda") % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(U8).expand(n, k // 2).contiguous()
    sbytes = torch.arange(n, device="cuda", dtype=torch.int32)
    sbytes = torch.where((sbytes & 0x7F) == 0x7F, sbytes - 1, sbytes).to(U8)
    scales = sbytes[:, None].expand(n, k // 16).contiguous().view(torch.float8_e4m3fn)
    sb = nv.swizzle_block_scales(scales)
    x = torch.eye(k, device="cuda", dtype=dtype)
    one = torch.tensor(1.0, device="cuda")
    out = _run(x, packed, None, sb, one, out_dtype=dtype)
    ref = nv.dequantize(packed, sb).t().to(dtype)  # exact in both types
    assert torch.equal(out, ref), f"{int((out != ref).sum())} decoded values differ"


@requires_sm90
@pytest.mark.parametrize("m", [17, 64, 100, 128, 300, 1023])
@pytest.mark.parametrize("n,k", LLAMA8B[1:3] + [(1040, 4032), (200, 128)])
def test_gpu_w4a4_matches_f64(m, n, k):
    qa, sa, qb, sb, alpha = cuda_operands(m, n, k)
    check_f64_bound(_run(qa, qb, sa, sb, alpha), nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha)


@requires_sm90
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m", [33, 256, 513])
@pytest.mark.parametrize("n,k", [(4096, 14336), (1040, 4032), (200, 128)])
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
@pytest.mark.parametrize("m", [37, 200, 300])
def test_gpu_every_candidate_config(m):
    n, k = 1040, 4032  # N not a multiple of any tile; 63 stages (uneven splits)
    _, _, qb, sb, _ = cuda_operands(1, n, k)
    x = (torch.randn(m, k, device="cuda") * 3).to(BF16)
    alpha = torch.tensor(0.25, device="cuda")
    wd = nv.dequantize(qb, sb)
    for cfg in wg.candidate_configs(n, k, m):
        check_f64_bound(_run(x, qb, None, sb, alpha, cfg=cfg), x, wd, alpha)


@requires_sm90
@pytest.mark.parametrize("w4a16", [False, True])
def test_gpu_persistent_matches_one_cta_per_tile_bitwise(w4a16):
    """Persistent grids, where CTAs take two or more tiles each and the ring
    runs on from one tile to the next (M = 1100, N = 4160: 165-585 tiles),
    write every tile bit for bit as the same config with one CTA a tile does;
    one of them against float64."""
    m, n, k = 1100, 4160, 1024
    qa, sa, qb, sb, alpha = cuda_operands(m, n, k)
    a = (torch.randn(m, k, device="cuda") * 3).to(BF16) if w4a16 else qa
    cfgs = [c for c in wg.candidate_configs(n, k, m) if c.persistent]
    assert len(cfgs) >= 4 and any(c.producer_wg for c in cfgs) and any(c.warpgroups == 1 for c in cfgs)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in cfgs:
        assert cfg.tiles(n, m) > sms
        out = _run(a, qb, sa, sb, alpha, cfg=cfg)
        assert torch.equal(out, _run(a, qb, sa, sb, alpha, cfg=dataclasses.replace(cfg, persistent=0))), cfg.short()
    check_f64_bound(out, a if w4a16 else nv.dequantize(qa, sa), nv.dequantize(qb, sb), alpha)


@requires_sm90
def test_gpu_strided_rows_nan_scale_zero_m():
    m, n, k = 70, 1040, 1024
    qa, sa, qb, sb, alpha = cuda_operands(m, n, k)
    x = torch.randn(m, k + 24, device="cuda", dtype=BF16)[:, 8:8 + k]  # row stride 2096 bytes
    out = _run(x, qb, None, sb, alpha)
    check_f64_bound(out, x, nv.dequantize(qb, sb), alpha)
    s = nv.unswizzle_block_scales(sb, n, k // 16)
    s.view(torch.uint8)[1000, 5] = 0x7F  # e4m3 NaN: weight row 1000 is NaN for every activation row
    out = _run(x, qb, None, nv.swizzle_block_scales(s), alpha)
    assert torch.isnan(out[:, 1000]).all()
    cols = [c for c in range(n) if c != 1000]
    check_f64_bound(out[:, cols], x, nv.dequantize(qb, sb)[cols], alpha)
    assert _run(x[:0], qb, None, sb, alpha).shape == (0, n)
    qa0, sa0 = torch.ops.scaledmm.nvfp4_quant(torch.empty(0, k, dtype=BF16, device="cuda"), alpha)
    assert _run(qa0, qb, sa0, sb, alpha).shape == (0, n)


@requires_sm90
def test_gpu_deterministic_and_cuda_graph():
    qa, sa, qb, sb, alpha = cuda_operands(512, 4096, 4096)
    first = _run(qa, qb, sa, sb, alpha)
    assert torch.equal(first, _run(qa, qb, sa, sb, alpha))
    for cfg in (wg.WgmmaConfig(256, 2, 4, 1, 1), wg.WgmmaConfig(256, 1, 4, 4)):  # split K: the rank-order reduction
        once = _run(qa, qb, sa, sb, alpha, cfg=cfg)
        assert torch.equal(once, _run(qa, qb, sa, sb, alpha, cfg=cfg)), cfg.short()
    qa2, sa2, _, _, _ = cuda_operands(512, 4096, 4096)
    graph = torch.cuda.CUDAGraph()
    with scaledmm.use_backend("nvfp4", wg.NAME):
        torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha)  # build outside the capture
        with torch.cuda.graph(graph):
            captured = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha)
    qa.copy_(qa2)
    sa.copy_(sa2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _run(qa, qb, sa, sb, alpha))
    assert not torch.equal(captured, first)
