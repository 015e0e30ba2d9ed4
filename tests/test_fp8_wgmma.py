"""Backend ``cuda_wgmma`` of fp8 and fp8_block (ops/fp8_wgmma.py,
csrc/fp8_wgmma.cu): ``fp8_scaled_mm`` and ``fp8_block_mm`` on TMA + e4m3
wgmma.

CPU: NVRTC compiles (sm_90a, no GPU) of the instances dispatch and the sweep
use, with no spills, within the register estimate and with no wgmma
serialization; the config predicate, defaults and candidates; argument
checks, gating, the switch.  GPU (skipped without an sm90 GPU): against a
float64 bound at odd M (1 .. 1023) on llama8b shapes and odd N / K (a K tail
that is not a multiple of the 128-wide stage), every scale kind and scale
layout, output and bias dtypes, every candidate config of a shape, strided
and misaligned activation rows, NaN rows, M = 0, poisoned outputs,
determinism, CUDA graphs, opcheck and ``torch.compile`` with
``reduce-overhead``.

Two checks of the arithmetic.  Exact: integer-valued operands (|v| <= 8,
or 4 where four k32 steps chain in the tensor core: a stage's sum stays
below 2**11) and power-of-two scales make every partial sum an integer below
2**24, which any fp32 accumulation order and the tensor core's own sum keep
exactly, so the output equals the float64 reference rounded once, bit for
bit (a dropped, repeated or misplaced product or scale shows).  Bounded, on random data with
outliers, per element (``u = 2**-24``, ``S = sum_k |p_k|``): each k32 MMA
writes a fresh fragment added to the fp32 accumulator, so a path has at most
``K + K / 16 + 8`` fp32 roundings (MMA adds, fragment adds, split-K rank adds,
the epilogue's two scale multiplies and bias add): ``(K + K / 16 + 8) u S``;
inside one k32 MMA the e4m3 tensor core adds the products with fewer bits
than fp32 (the sm90 FP8 MMA's limited accumulation precision: measured up to
``2**-12 S`` on the H200 at K = 144 and 16), which the bound takes as
``2**-10 S``, and ``2**-9 S`` where a stage's four steps chain in the tensor
core (``chain`` 4: four such sums, one promotion); the output rounding adds
half an ulp of the output dtype.  The block-scaled kernel is held to the same
bound with ``S`` over the scaled products.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from helpers import nvrtc_registers, opcheck, poison_

import scaledmm
from scaledmm import backends, jit
from scaledmm.backends import Family, Problem
from scaledmm.ops import fp8 as f8
from scaledmm.ops import fp8_wgmma as fw

FP8 = torch.float8_e4m3fn
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
KINDS = [(f8.TOKEN, f8.CHANNEL), (f8.TENSOR, f8.TENSOR), (f8.TENSOR, f8.CHANNEL), (f8.TOKEN, f8.TENSOR)]
U32 = 2.0 ** -24
OUT_HALF_ULP = {BF16: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -24}
OUT_TINY = {BF16: 0.0, F16: 2.0 ** -25, F32: 2.0 ** -150}
MMA_REL = {1: 2.0 ** -10, 4: 2.0 ** -9}  # the tensor core's own sums, by chain (module docstring)
DSV3 = [(2112, 7168), (24576, 1536), (7168, 2048), (4096, 7168)]
NAME = fw.NAME
OPS = torch.ops.scaledmm
nvrtc = pytest.mark.skipif(not jit.nvrtc_available()[0], reason="NVRTC not available")
requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm90 GPU")


# ----------------------------------------------------------------------------
# Configs and NVRTC compiles (CPU)
# ----------------------------------------------------------------------------


def _instances():
    out = {}
    for n, k in LLAMA8B:
        for m in (8, 32, 64, 256):
            out[(n, k, fw.choose_config(n, k, m), BF16, None, False, None)] = None
            out[(n, k, fw.choose_config(n, k, m, block=True), BF16, None, True, None)] = None
    for n, k in DSV3:
        for m in (8, 64):
            out[(n, k, fw.choose_config(n, k, m, block=True), BF16, None, True, None)] = None
    out[(4096, 4096, fw.WgmmaConfig(128, 1, 8, 4), F32, BF16, False, None)] = None
    out[(4096, 4096, fw.WgmmaConfig(128, 2, 4, 1, 4), F32, BF16, False, None)] = None
    out[(208, 4112, fw.WgmmaConfig(16, 1, 2, 2), F16, F32, False, None)] = None
    out[(1040, 144, fw.WgmmaConfig(32, 2, 8, 1), BF16, F16, False, None)] = None
    out[(1040, 1040, fw.WgmmaConfig(64, 2, 8, 2, 1), F32, None, True, None)] = None
    out[(1040, 1040, fw.WgmmaConfig(128, 1, 4, 2, 4), F16, None, True, None)] = None
    # a producer warpgroup that hands registers to the consumers: the large-M tile
    out[(7168, 16384, fw.WgmmaConfig(128, 2, 6, 1, 4, 1), BF16, None, False, None)] = None
    out[(4096, 4096, fw.WgmmaConfig(128, 2, 4, 1, 1, 1), F32, BF16, False, None)] = None
    # persistent: the tile loop around the ring
    out[(7168, 16384, fw.WgmmaConfig(128, 1, 6, 1, 4, 0, 1), BF16, None, False, None)] = None
    out[(1040, 1040, fw.WgmmaConfig(64, 1, 8, 1, 4, 0, 1), F16, F32, False, None)] = None
    out[(4096, 4096, fw.WgmmaConfig(128, 2, 4, 1, 1, 1, 1), F32, BF16, False, None)] = None
    out[(208, 4112, fw.WgmmaConfig(64, 2, 6, 1, 1, 0, 1), BF16, F32, False, None)] = None
    for n, k in LLAMA8B + DSV3:
        for m in (1, 16, 64, 128):
            out[(n, k, fw.choose_config(n, k, m, block=True, quant=True), BF16, None, True, BF16)] = None
    out[(1040, 1152, fw.WgmmaConfig(64, 2, 4, 2, 1), F32, F32, True, F16)] = None
    out[(1040, 1152, fw.WgmmaConfig(128, 1, 3, 2, 4), F16, BF16, True, BF16)] = None
    out[(1040, 1152, fw.WgmmaConfig(16, 2, 8, 1, 4), BF16, F16, True, F16)] = None
    return list(out)


@nvrtc
@pytest.mark.parametrize("n,k,cfg,out_dtype,bias_dtype,block,in_dtype", _instances(),
                         ids=lambda v: v.short() if hasattr(v, "short") else str(v).replace("torch.", ""))
def test_instance_compiles_without_spills(n, k, cfg, out_dtype, bias_dtype, block, in_dtype):
    """in_dtype: the kernel that quantizes that activation itself (block_linear)."""
    quant = in_dtype is not None
    assert fw.config_valid(cfg, n, k, block, quant) == (True, "ok")
    spec = fw.kernel_spec(n, k, cfg, out_dtype, bias_dtype, block, in_dtype)
    regs = nvrtc_registers(spec)
    est = cfg.registers(block, quant)
    if cfg.producer_wg:  # ptxas reports the launch's 168; no spills (checked) means the consumers fit theirs
        assert regs == fw.REG_LIMIT[2] and est <= cfg.register_limit(), (regs, est)
    else:
        assert regs <= est, f"estimate {est} below the real {regs} registers"
    log = io.StringIO()
    spec.compile(logs=log, ptxas_options="-v")
    assert "serialized" not in log.getvalue(), log.getvalue()  # wgmma kept asynchronous


@nvrtc
@pytest.mark.parametrize("block", [False, True])
def test_every_tile_shape_within_its_estimate(block):
    """The estimate bounds ptxas' count over the space's extremes (the
    predicate that keeps configs under the per-quadrant limit relies on it)."""
    cfgs = [fw.WgmmaConfig(t, g, 8, 4 if not p else 1, c, p) for t in fw.TILES for g in (1, 2) for c in (1, 4)
            for p in (0, 1)]
    cfgs = [c for c in cfgs if fw.config_valid(c, 4096, 4096, block)[0]]
    assert len(cfgs) >= 10 and any(c.producer_wg for c in cfgs) != block
    for cfg in cfgs:
        regs = nvrtc_registers(fw.kernel_spec(4096, 4096, cfg, F32, None if block else F32, block))
        if cfg.producer_wg:  # ptxas reports the launch's 168; no spills (checked) means the consumers fit 232
            assert regs == fw.REG_LIMIT[2], (cfg, regs)
        else:
            assert regs <= min(cfg.registers(block), cfg.register_limit()), (cfg, regs)


@nvrtc
def test_kernel_rejects_bad_defines():
    spec = jit.NvrtcKernelSpec(fw.KERNEL, fw.source_path(), arch=fw.ARCH,
                               defines=fw.WgmmaConfig().defines(64, 72, BF16, None))
    with pytest.raises(jit.CompileError, match="multiple of 16"):
        spec.compile()
    # the kernel itself refuses what config_valid refuses: a producer warpgroup with split K
    pwg_split = jit.NvrtcKernelSpec(fw.KERNEL, fw.source_path(), arch=fw.ARCH,
                                    defines=fw.WgmmaConfig(128, 2, 4, 2, 1, 1).defines(4096, 4096, BF16, None))
    with pytest.raises(jit.CompileError, match="G_PWG 1 needs G_SPLIT 1"):
        pwg_split.compile()


@pytest.mark.parametrize("cfg,n,k,why", [
    (fw.WgmmaConfig(tile_m=48), 64, 128, "tile_m"),
    (fw.WgmmaConfig(warpgroups=3), 64, 128, "warpgroups"),
    (fw.WgmmaConfig(stages=1), 64, 128, "stages"),
    (fw.WgmmaConfig(stages=9), 64, 128, "stages"),
    (fw.WgmmaConfig(split_k=8), 64, 4096, "split_k"),
    (fw.WgmmaConfig(split_k=4), 64, 384, "without any"),
    (fw.WgmmaConfig(), 64, 72, "multiple of 16"),
    (fw.WgmmaConfig(), 0, 128, "N > 0"),
    (fw.WgmmaConfig(tile_m=128, warpgroups=2), 64, 128, "registers"),
    (fw.WgmmaConfig(tile_m=128, warpgroups=1, stages=8, split_k=1), 64, 128, "ok"),
    (fw.WgmmaConfig(chain=2), 64, 128, "chain"),
    (fw.WgmmaConfig(tile_m=128, warpgroups=2, chain=4), 64, 128, "ok"),
    (fw.WgmmaConfig(tile_m=128, warpgroups=2, producer_wg=1), 64, 128, "ok"),
    (fw.WgmmaConfig(tile_m=128, warpgroups=1, producer_wg=1), 64, 128, "two consumer warpgroups"),
    (fw.WgmmaConfig(tile_m=128, warpgroups=2, split_k=2, producer_wg=1), 64, 4096, "producer_wg needs split_k 1"),
    (fw.WgmmaConfig(producer_wg=2), 64, 128, "producer_wg must be 0 or 1"),
    (fw.WgmmaConfig(persistent=1), 64, 128, "ok"),
    (fw.WgmmaConfig(split_k=2, persistent=1), 64, 4096, "persistent needs split_k 1"),
    (fw.WgmmaConfig(persistent=2), 64, 128, "persistent must be 0 or 1"),
    ("m64", 64, 128, "WgmmaConfig"),
])
def test_config_predicate(cfg, n, k, why):
    ok, reason = fw.config_valid(cfg, n, k)
    assert why in reason and ok == (why == "ok"), reason


@pytest.mark.parametrize("cfg,why", [
    (fw.WgmmaConfig(tile_m=128, warpgroups=2, chain=4), "registers"),  # + the stage's 32 scales
    (fw.WgmmaConfig(tile_m=64, warpgroups=2, chain=1), "ok"),
    (fw.WgmmaConfig(tile_m=128, warpgroups=1, chain=4), "ok"),
    # the cp.async scale copies under a producer warpgroup or a persistent grid: racecheck reports
    # them (benchmarks/NOTES.md)
    (fw.WgmmaConfig(tile_m=128, warpgroups=2, chain=4, producer_wg=1), "per-tensor / row / column scales"),
    (fw.WgmmaConfig(128, 1, 4, 1, 4, 0, 1), "per-tensor / row / column scales"),
])
def test_block_config_predicate(cfg, why):
    ok, reason = fw.config_valid(cfg, 7168, 16384, block=True)
    assert why in reason and ok == (why == "ok"), reason
    assert fw.config_valid(cfg, 7168, 16384)[0]  # the same config without block scales fits


def test_persistent_config_grid_smem_registers(monkeypatch):
    """A persistent config launches min(tiles, resident CTAs) along x; the
    block-scaled and quantizing kernels have no persistent form (the first
    not sanitizer-clean yet), so a measured persistent row falls back there."""
    cfg = fw.WgmmaConfig(128, 1, 4, 1, 4, 0, 1)
    assert cfg.short() == "m128g1s4k1c4r" and fw.config_valid(cfg, 7168, 16384) == (True, "ok")
    assert cfg.tiles(7168, 4096) == 32 * 112
    assert cfg.grid(7168, 4096, 132) == (132, 1, 1)
    assert cfg.grid(200, 3, 132) == (4, 1, 1)
    flat = dataclasses.replace(cfg, persistent=0)
    assert flat.grid(7168, 4096, 132) == (32, 112, 1)
    assert cfg.smem_bytes(16384) == flat.smem_bytes(16384)
    for quant in (False, True):
        ok, why = fw.config_valid(cfg, 7168, 16384, block=True, quant=quant)
        assert not ok and ("does not quantize" if quant else "block scales") in why
    fw.choose_config.cache_clear()
    monkeypatch.setattr(fw, "tuned", lambda *a: cfg)  # a measured persistent row
    try:
        assert fw.choose_config(7168, 16384, 4096) == cfg
        for quant in (False, True):
            other = fw.choose_config(7168, 16384, 4096, block=True, quant=quant)
            assert not other.persistent and fw.config_valid(other, 7168, 16384, True, quant)[0]
    finally:
        fw.choose_config.cache_clear()


def test_producer_warpgroup_is_not_for_the_block_scaled_kernels(monkeypatch):
    pwg = fw.WgmmaConfig(128, 2, 4, 1, 4, 1)
    ok, why = fw.config_valid(pwg, 7168, 16384, block=True, quant=True)
    assert not ok and "does not quantize" in why
    ok, why = fw.config_valid(pwg, 7168, 16384, block=True)
    assert not ok and "per-tensor / row / column scales" in why
    fw.choose_config.cache_clear()
    monkeypatch.setattr(fw, "tuned", lambda *a: pwg)  # a row with a producer warpgroup
    try:
        assert not fw.choose_config(7168, 16384, 256, block=True).producer_wg
        quant = fw.choose_config(7168, 16384, 256, block=True, quant=True)
        assert not quant.producer_wg and fw.config_valid(quant, 7168, 16384, True, True)[0]
    finally:
        fw.choose_config.cache_clear()


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("n,k", LLAMA8B + DSV3[:2] + [(1040, 4112), (208, 144), (16, 16)])
@pytest.mark.parametrize("m", [1, 8, 17, 64, 100, 256, 4096])
def test_default_and_candidates_are_valid(n, k, m, block):
    cfgs = fw.candidate_configs(n, k, m, block=block)
    assert cfgs[0] == fw.choose_config(n, k, m, block=block)
    assert len(cfgs) == len(set(cfgs)) >= 2
    assert {c.chain for c in cfgs} == {1, 4}
    for cfg in cfgs:
        assert fw.config_valid(cfg, n, k, block) == (True, "ok"), cfg
    grid = cfgs[0].grid(n, m)
    assert grid[0] * cfgs[0].tile_m >= m and grid[1] * cfgs[0].rows() >= n


@pytest.mark.parametrize("block", [False, True])
def test_tuning_table_rows_valid(block):
    """Every shipped row is a valid config and what dispatch uses at its M."""
    from scaledmm import kernel_tuning

    rows = kernel_tuning.load("fp8_wgmma_block" if block else "fp8_wgmma", "sm90", fw.WgmmaConfig).by_shape()
    for (n, k), by_m in rows.items():
        for max_m, cfg in by_m.items():
            assert fw.config_valid(cfg, n, k, block) == (True, "ok"), (n, k, max_m, cfg)
            assert fw.tuned(n, k, min(max_m, 4096), block) == cfg
            assert fw.choose_config(n, k, min(max_m, 4096), block=block) == cfg


def test_kernel_spec_validates():
    with pytest.raises(ValueError, match="cfg:"):
        fw.kernel_spec(64, 72, fw.WgmmaConfig())
    with pytest.raises(ValueError, match="out_dtype:"):
        fw.kernel_spec(64, 128, fw.WgmmaConfig(), FP8)
    with pytest.raises(ValueError, match="bias_dtype:"):
        fw.kernel_spec(64, 128, fw.WgmmaConfig(), BF16, torch.int32)
    with pytest.raises(ValueError, match="bias_dtype:"):
        fw.kernel_spec(64, 128, fw.WgmmaConfig(), BF16, F32, block=True)
    with pytest.raises(ValueError, match=r"\(block\)"):
        fw.kernel_spec(64, 128, fw.WgmmaConfig(128, 2, chain=4), block=True)
    assert ("G_BLOCK", "1") in fw.kernel_spec(64, 128, fw.WgmmaConfig(64, 1, chain=4), block=True).defines


def test_prebuild_hook():
    for block, flag in ((False, "--fp8-wgmma"), (True, "--fp8-wgmma-block")):
        specs = fw.prebuild_specs("4096:4096", block)
        assert len({s.key for s in specs}) == len(specs) >= 3
        assert {dict(s.defines)["G_BLOCK"] for s in specs} == {str(int(block))}
        with pytest.raises(ValueError, match=flag):
            fw.prebuild_specs("4096x4096", block)


# ----------------------------------------------------------------------------
# Backend gating and selection (CPU)
# ----------------------------------------------------------------------------


def _problem(m, n=4096, k=4096, kinds=(f8.TOKEN, f8.CHANNEL), in_dtype=FP8, out_dtype=BF16, bias_dtype=None,
             b_aligned=True, stride=None):
    variant = "tensorwise" if kinds == (f8.TENSOR, f8.TENSOR) else "rowwise"
    return Problem(Family.FP8, torch.device("cuda", 0), m, n, k, in_dtype, out_dtype, k if stride is None else stride,
                   (("scale_a", kinds[0]), ("scale_b", kinds[1]), ("bias_dtype", bias_dtype),
                    ("b_aligned", b_aligned), ("variant", variant)))


@pytest.mark.parametrize("p,why", [
    (_problem(64, in_dtype=BF16), "e4m3 operands"),
    (_problem(64, out_dtype=torch.int32), "bf16, fp16 or fp32"),
    (_problem(64, bias_dtype=torch.int32), "bias"),
    (_problem(64, b_aligned=False), "16-byte aligned"),
    (_problem(64, k=72), "multiple of 16"),
])
def test_can_implement_says_why(p, why):
    ok, reason = fw.can_implement(p)
    assert not ok and why in reason, reason


def test_can_implement_any_m_stride_and_kinds():
    for m in (1, 3, 17, 1023, 1 << 20):
        for kinds in KINDS:
            assert fw.can_implement(_problem(m, kinds=kinds))[0]
    assert fw.can_implement(_problem(64, stride=4099))[0]  # rows copied to 16-byte alignment
    assert fw.can_implement(_problem(64, k=4112, out_dtype=F32, bias_dtype=F16))[0]


def test_switch_takes_it_out(fake_sm90, monkeypatch):
    sm90 = backends.policy("fp8", "sm90")
    assert sm90.switches[NAME] == "SCALEDMM_FP8_WGMMA"
    monkeypatch.delenv("SCALEDMM_FP8_WGMMA", raising=False)
    assert NAME in backends.priority("fp8", torch.device("cuda", 0))
    monkeypatch.setenv("SCALEDMM_FP8_WGMMA", "0")
    assert NAME not in backends.priority("fp8", torch.device("cuda", 0))
    assert backends.select(_problem(64), "fp8_scaled_mm").name != NAME


def test_where_the_shipped_rows_put_it(fake_sm90, monkeypatch):
    """scaledmm/tuning/fp8_sm90.json (the H200 op sweeps): row-wise and
    per-tensor scales on the llama8b shapes and unswept ones take it at small
    M, cuBLAS at large M (per-tensor: cuBLAS's per-tensor kernel from M = 32,
    and on 28672x4096)."""
    monkeypatch.delenv("SCALEDMM_FP8_WGMMA", raising=False)
    for n, k in LLAMA8B + [(1024, 4096)]:  # the fp8 rows are per op (op_shapes): the fixture keeps them
        assert backends.select(_problem(8, n, k), "fp8_scaled_mm").name == NAME, (n, k)
        assert backends.select(_problem(512, n, k), "fp8_scaled_mm").name == "cublas", (n, k)
    assert backends.select(_problem(64, 4096, 14336), "fp8_scaled_mm").name == NAME
    tensor = (f8.TENSOR, f8.TENSOR)
    assert backends.select(_problem(8, kinds=tensor), "fp8_scaled_mm").name == NAME
    assert backends.select(_problem(64, kinds=tensor), "fp8_scaled_mm").name == "cublas"
    assert backends.select(_problem(8, 28672, kinds=tensor), "fp8_scaled_mm").name == "cublas"


def test_explicit_request_on_cpu_explains():
    a = torch.zeros(4, 64).to(FP8)
    b = torch.zeros(32, 64).to(FP8)
    one = torch.ones(1)
    with scaledmm.use_backend("fp8", NAME), pytest.raises(RuntimeError, match="CUDA device"):
        OPS.fp8_scaled_mm(a, b, one, one)


def _block_problem(m, n=2112, k=7168, block=(128, 128), in_dtype=FP8, out_dtype=BF16):
    return Problem(Family.FP8_BLOCK, torch.device("cuda", 0), m, n, k, in_dtype, out_dtype, k,
                   (("block_size", block), ("a_scales_col_major", True)))


@pytest.mark.parametrize("p,why", [
    (_block_problem(8, in_dtype=BF16), "e4m3 operands"),
    (_block_problem(8, out_dtype=torch.int32), "bf16, fp16 or fp32"),
    (_block_problem(8, block=(1, 128)), "(128, 128)"),
    (_block_problem(8, k=7176), "multiple of 16"),
])
def test_block_can_implement_says_why(p, why):
    ok, reason = fw.block_can_implement(p)
    assert not ok and why in reason, reason


def test_block_any_m_and_switch(fake_sm90, monkeypatch):
    for m in (1, 3, 17, 1023, 1 << 20):
        assert fw.block_can_implement(_block_problem(m))[0]
    assert fw.block_can_implement(_block_problem(5, 208, 1040, out_dtype=F32))[0]
    assert backends.policy("fp8_block", "sm90").switches[NAME] == "SCALEDMM_FP8_WGMMA"
    monkeypatch.delenv("SCALEDMM_FP8_WGMMA", raising=False)
    assert NAME in backends.priority("fp8_block", torch.device("cuda", 0))
    monkeypatch.setenv("SCALEDMM_FP8_WGMMA", "0")
    assert NAME not in backends.priority("fp8_block", torch.device("cuda", 0))
    assert backends.select(_block_problem(8), "fp8_block_mm").name != NAME


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


def _scale(kind, rows, form=0):
    """A float32 scale of ``kind`` in (0.05, 0.55), one of its accepted
    shapes / layouts by ``form``: 0-d / [1] / [1, 1]; [M, 1] with row stride 2;
    [N], [1, N], every other element of a [2N]."""
    v = torch.rand(max(rows, 1) * 2, device="cuda") * 0.5 + 0.05
    if kind == f8.TENSOR:
        return (v[0].reshape(()), v[:1], v[:1].reshape(1, 1))[form % 3]
    if kind == f8.TOKEN:
        return v.reshape(-1, 2)[:rows, :1]
    return (v[:rows], v[:rows].reshape(1, rows), v[::2][:rows])[form % 3]


def _operands(m, n, k, kinds=KINDS[0], pad=0, form=0):
    a = (torch.randn(m, k + pad, device="cuda") * 2).to(FP8)[:, :k]
    a[:, ::37] = (torch.randn(m, len(range(0, k, 37)), device="cuda") * 200).clamp(-448, 448).to(FP8)  # outliers
    b = (torch.randn(n, k, device="cuda") * 2).to(FP8)
    return a, b, _scale(kinds[0], m, form), _scale(kinds[1], n, form + 1)


def _check(out, a, b, sa, sb, bias, out_dtype, chain=None):
    """Against float64 within the module docstring's bound; ``chain`` of the
    config that ran (default: the one dispatch chooses)."""
    m, k = a.shape
    n = b.shape[0]
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    chain = chain or fw.choose_config(n, k, max(m, 1)).chain
    A = a.double() * sa.double().reshape(-1, 1)
    B = b.double() * sb.double().reshape(-1, 1)
    ref = A @ B.t()
    if bias is not None:
        ref = ref + bias.double()
    acc_err = ((k + k // 16 + 8) * U32 + MMA_REL[chain]) * (A.abs() @ B.abs().t())
    lim = acc_err + OUT_HALF_ULP[out_dtype] * (ref.abs() + acc_err) + OUT_TINY[out_dtype]
    err = (out.double() - ref).abs()
    ok = (err <= lim) | (torch.isnan(ref) & torch.isnan(out.double()))
    assert ok.all(), (f"{(~ok).sum().item()} of {ok.numel()} off; worst err/bound among them "
                      f"{(err / lim)[~ok].nan_to_num(float('inf')).max().item():.3g}")


def _run(a, b, sa, sb, bias=None, out_dtype=BF16, cfg=None):
    torch.full((a.shape[0] * b.shape[0] + 1024,), float("nan"), device="cuda")  # NaN in the allocator
    if cfg is not None:
        return fw.launch(a, b, sa, sb, bias, poison_(f8.mm_output(a, b, out_dtype)), cfg)
    with scaledmm.use_backend("fp8", NAME), backends.record() as calls:
        out = OPS.fp8_scaled_mm(a, b, sa, sb, bias, out_dtype)
    assert [name for op, name, _ in calls if op == "fp8_scaled_mm"] == [NAME]
    return out


@requires_sm90
@pytest.mark.parametrize("m", [1, 3, 8, 17, 64, 100, 256, 1023])
@pytest.mark.parametrize("n,k", LLAMA8B[1:])
def test_gpu_llama_shapes_match_f64(m, n, k):
    a, b, sa, sb = _operands(m, n, k)
    _check(_run(a, b, sa, sb), a, b, sa, sb, None, BF16)


def _integer_operands(m, n, k, kinds, top=8):
    """Integer-valued e4m3 operands in [-top, top] and power-of-two scales of
    ``kinds`` (2**-3 .. 2**3): every partial sum is an exact integer times a
    power of two."""
    a = torch.randint(-top, top + 1, (m, k), device="cuda").float().to(FP8)
    b = torch.randint(-top, top + 1, (n, k), device="cuda").float().to(FP8)

    def pow2(rows, kind):
        e = torch.randint(-3, 4, (max(rows, 1),), device="cuda").float().exp2()
        return e[:1] if kind == f8.TENSOR else (e.reshape(-1, 1) if kind == f8.TOKEN else e)

    return a, b, pow2(m, kinds[0]), pow2(n, kinds[1])


@requires_sm90
@pytest.mark.parametrize("m", [1, 17, 100])
@pytest.mark.parametrize("kinds", KINDS[:2], ids=lambda v: "x".join(v))
def test_gpu_integer_operands_bit_exact_every_config(m, kinds):
    n, k = 1040, 4112
    bias = torch.randint(-50, 51, (n,), device="cuda").to(BF16)
    sets = {}
    for chain, top in ((1, 8), (4, 4)):
        a, b, sa, sb = _integer_operands(m, n, k, kinds, top)
        exact = (a.double() * sa.double().reshape(-1, 1)) @ (b.double() * sb.double().reshape(-1, 1)).t()
        sets[chain] = (a, b, sa, sb, exact + bias.double())
    cfgs = fw.candidate_configs(n, k, m)
    assert {c.chain for c in cfgs} == {1, 4}
    for cfg in cfgs:
        a, b, sa, sb, exact = sets[cfg.chain]
        for out_dtype in (F32, BF16):
            out = _run(a, b, sa, sb, bias, out_dtype, cfg=cfg)
            assert torch.equal(out, exact.to(out_dtype)), (cfg.short(), out_dtype)


@requires_sm90
@pytest.mark.parametrize("kinds", KINDS, ids=lambda v: "x".join(v))
@pytest.mark.parametrize("form", [0, 1, 2])
@pytest.mark.parametrize("m,n,k", [(5, 208, 4112), (40, 1040, 144), (130, 64, 16)])
def test_gpu_scale_kinds_layouts_odd_shapes(kinds, form, m, n, k):
    """Every scale kind in each accepted layout; N not a multiple of the
    64-row tile, K tails of 16 and 16 + 128."""
    a, b, sa, sb = _operands(m, n, k, kinds, form=form)
    _check(_run(a, b, sa, sb), a, b, sa, sb, None, BF16)


@requires_sm90
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32])
@pytest.mark.parametrize("bias_dtype", [None, F32, BF16, F16])
def test_gpu_out_and_bias_dtypes(out_dtype, bias_dtype):
    a, b, sa, sb = _operands(37, 1040, 2048, KINDS[0])
    bias = None if bias_dtype is None else (torch.randn(1040, device="cuda") * 4).to(bias_dtype)
    _check(_run(a, b, sa, sb, bias, out_dtype), a, b, sa, sb, bias, out_dtype)


@requires_sm90
@pytest.mark.parametrize("m", [8, 37, 200])
def test_gpu_every_candidate_config(m):
    n, k = 1040, 4112  # N not a multiple of any tile; 33 stages with a 16-wide tail (uneven splits)
    a, b, sa, sb = _operands(m, n, k)
    for cfg in fw.candidate_configs(n, k, m):
        _check(_run(a, b, sa, sb, cfg=cfg), a, b, sa, sb, None, BF16, cfg.chain)


@requires_sm90
def test_gpu_strided_misaligned_rows_nan_rows_zero_m():
    m, n, k = 70, 1040, 1024
    for pad in (16, 3):  # row stride 1040 (TMA reads in place) and 1027 bytes (copied first)
        a, b, sa, sb = _operands(m, n, k, pad=pad)
        _check(_run(a, b, sa, sb), a, b, sa, sb, None, BF16)
    a, b, sa, sb = _operands(1, n, k, pad=3)  # one row: its stride is never used
    _check(_run(a, b, sa, sb), a, b, sa, sb, None, BF16)
    a, b, sa, sb = _operands(m, n, k)
    a[5, 7] = float("nan")
    out = _run(a, b, sa, sb)
    assert torch.isnan(out[5]).all()
    rows = [r for r in range(m) if r != 5]
    _check(out[rows], a[rows], b, sa[rows], sb, None, BF16)
    assert _run(a[:0], b, sa[:0], sb).shape == (0, n)


@requires_sm90
def test_gpu_deterministic_and_cuda_graph():
    a, b, sa, sb = _operands(64, 4096, 4096)
    for cfg in (fw.WgmmaConfig(32, 2, 4, 4), fw.WgmmaConfig(64, 1, 4, 4, 4),
                fw.WgmmaConfig(128, 2, 4, 2, 4)):  # split K: the rank-order reduction
        first = _run(a, b, sa, sb, cfg=cfg)
        assert torch.equal(first, _run(a, b, sa, sb, cfg=cfg)), cfg.short()
    a2, _, sa2, _ = _operands(64, 4096, 4096)
    graph = torch.cuda.CUDAGraph()
    with scaledmm.use_backend("fp8", NAME):
        OPS.fp8_scaled_mm(a, b, sa, sb)  # build outside the capture
        with torch.cuda.graph(graph):
            captured = OPS.fp8_scaled_mm(a, b, sa, sb)
    a.copy_(a2)
    sa.copy_(sa2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _run(a, b, sa, sb))
    assert not torch.equal(captured, first)
    _check(captured, a, b, sa, sb, None, BF16)


@requires_sm90
def test_gpu_opcheck_and_compile_reduce_overhead():
    sets = []
    for m, kinds, dt in ((1, KINDS[0], BF16), (17, KINDS[1], F16), (64, KINDS[3], F32)):
        a, b, sa, sb = _operands(m, 256, 512, kinds)
        sets.append((a, b, sa, sb, torch.randn(256, device="cuda").to(BF16), dt))
    with scaledmm.use_backend("fp8", NAME), backends.record() as calls:
        for args in sets:
            opcheck(OPS.fp8_scaled_mm.default, args)
    assert {name for op, name, _ in calls if op == "fp8_scaled_mm"} == {NAME}

    n, k = 6144, 4096
    a, b, sa, sb = _operands(64, n, k)
    _replays_equal_eager("fp8", lambda a, sa: OPS.fp8_scaled_mm(a, b, sa, sb, None, BF16),
                         lambda a, sa: fw.wgmma_mm(a, b, sa, sb), a, sa, lambda: _operands(64, n, k))


def _replays_equal_eager(family, op, eager, a, sa, fresh_inputs):
    """``op(a, sa)`` compiled with ``reduce-overhead`` on this backend equals
    the eager kernel bit for bit at warm-up, recording and two replays, with
    fresh activations copied into ``a`` / ``sa`` before each step."""
    torch._dynamo.reset()
    fn = torch.compile(op, fullgraph=True, mode="reduce-overhead")
    with scaledmm.use_backend(family, NAME):
        for step in range(4):  # warm-up, record, replays
            fresh, _, fresh_sa, _ = fresh_inputs()
            a.copy_(fresh)
            sa.copy_(fresh_sa)
            got = fn(a, sa).clone()
            want = eager(a, sa)
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"step {step}"


# ----------------------------------------------------------------------------
# GPU: the block-scaled kernel (fp8_block_mm)
# ----------------------------------------------------------------------------


def _expand(sa, sb, m, n, k):
    """The block scales per element: [M, K] and [N, K] in float64."""
    sa_e = sa.double().repeat_interleave(128, dim=1)[:, :k]
    sb_e = sb.double().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
    return sa_e, sb_e


def _block_ref(a, b, sa, sb):
    """float64 ``sum_k a sa b sb`` and ``S = sum_k |a sa b sb|``."""
    m, k = a.shape
    sa_e, sb_e = _expand(sa, sb, m, b.shape[0], k)
    A, B = a.double() * sa_e, b.double() * sb_e
    return A @ B.t(), A.abs() @ B.abs().t()


def _block_run(a, b, sa, sb, out_dtype=BF16, cfg=None):
    torch.full((a.shape[0] * b.shape[0] + 1024,), float("nan"), device="cuda")  # NaN in the allocator
    if cfg is not None:
        return fw.block_mm(a, b, sa, sb, (128, 128), out_dtype, cfg=cfg)
    with scaledmm.use_backend("fp8_block", NAME), backends.record() as calls:
        out = OPS.fp8_block_mm(a, b, sa, sb, [128, 128], out_dtype)
    assert [name for op, name, _ in calls if op == "fp8_block_mm"] == [NAME]
    return out


def _block_check(out, a, b, sa, sb, out_dtype=BF16, chain=None):
    m, k = a.shape
    n = b.shape[0]
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    chain = chain or fw.choose_config(n, k, max(m, 1), block=True).chain
    ref, s = _block_ref(a, b, sa, sb)
    acc_err = ((k + k // 16 + 8) * U32 + MMA_REL[chain]) * s
    lim = acc_err + OUT_HALF_ULP[out_dtype] * (ref.abs() + acc_err) + OUT_TINY[out_dtype]
    err = (out.double() - ref).abs()
    ok = (err <= lim) | (torch.isnan(ref) & torch.isnan(out.double()))
    assert ok.all(), (f"{(~ok).sum().item()} of {ok.numel()} off; worst err/bound among them "
                      f"{(err / lim)[~ok].nan_to_num(float('inf')).max().item():.3g}")


def _col_major(s):
    return s.t().contiguous().t()


@requires_sm90
@pytest.mark.parametrize("m,col", [(1, True), (17, False), (100, True)])
def test_gpu_block_integer_operands_bit_exact_every_config(m, col):
    """Integer operands, power-of-two block scales (2**-1 .. 2**1 each): every
    candidate config equals the float64 product bit for bit.  N = 1040: a
    partial weight tile and scale block; K = 4112: 33 stages, the last 16 wide
    (its scale group too), uneven splits."""
    n, k = 1040, 4112
    kb = -(-k // 128)
    sa = torch.randint(-1, 2, (m, kb), device="cuda").float().exp2()
    sb = torch.randint(-1, 2, (-(-n // 128), kb), device="cuda").float().exp2()
    sa = _col_major(sa) if col else sa
    sets = {}
    for chain, top in ((1, 8), (4, 4)):
        a = torch.randint(-top, top + 1, (m, k), device="cuda").float().to(FP8)
        b = torch.randint(-top, top + 1, (n, k), device="cuda").float().to(FP8)
        sets[chain] = (a, b, _block_ref(a, b, sa, sb)[0])
    cfgs = fw.candidate_configs(n, k, m, block=True)
    assert {c.chain for c in cfgs} == {1, 4}
    for cfg in cfgs:
        a, b, exact = sets[cfg.chain]
        out = _block_run(a, b, sa, sb, F32, cfg=cfg)
        assert torch.equal(out, exact.float()), cfg.short()
    a, b, exact = sets[cfgs[0].chain]
    assert torch.equal(_block_run(a, b, sa, sb, BF16), exact.to(BF16))


def _block_operands(m, n, k, col=True):
    """The quantizers' outputs: x with outliers by per_token_group_quant_fp8,
    the weight by quantize_weight (128 x 128 blocks)."""
    from scaledmm.ops.fp8_block import quantize_weight

    x = torch.randn(m, k, device="cuda", dtype=BF16) * 2
    x[:, ::37] *= 100
    a, sa = OPS.per_token_group_quant_fp8(x, 128, 1e-10, col)
    b, sb = quantize_weight(torch.randn(n, k, device="cuda"))
    return a, b, sa, sb


@requires_sm90
@pytest.mark.parametrize("m", [1, 3, 8, 64, 100, 256, 1023])
@pytest.mark.parametrize("n,k", DSV3 + LLAMA8B[:1])
def test_gpu_block_shapes_match_f64(m, n, k):
    a, b, sa, sb = _block_operands(m, n, k, col=m % 2 == 1)
    _block_check(_block_run(a, b, sa, sb), a, b, sa, sb)


@requires_sm90
@pytest.mark.parametrize("m", [8, 37, 200])
def test_gpu_block_every_candidate_config(m):
    n, k = 1040, 4096
    a, b, sa, sb = _block_operands(m, n, k)
    for cfg in fw.candidate_configs(n, k, m, block=True):
        _block_check(_block_run(a, b, sa, sb, cfg=cfg), a, b, sa, sb, BF16, cfg.chain)


@requires_sm90
def test_gpu_persistent_matches_one_cta_per_tile_bitwise():
    """Persistent grids, where CTAs take two or more tiles each and the ring
    runs on from one tile to the next (M = 1023, N = 4160: 264-1040 tiles,
    K = 1152 nine stages),
    write every tile bit for bit as the same config with one CTA a tile does;
    one of them against float64.  (The block-scaled kernel offers none.)"""
    m, n, k = 1023, 4160, 1152
    assert not any(c.persistent for c in fw.candidate_configs(n, k, m, block=True))
    a, b, sa, sb = _operands(m, n, k)
    run = lambda cfg: _run(a, b, sa, sb, cfg=cfg)  # noqa: E731
    cfgs = [c for c in fw.candidate_configs(n, k, m) if c.persistent]
    assert len(cfgs) >= 8 and any(c.producer_wg for c in cfgs) and any(c.warpgroups == 1 for c in cfgs)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in cfgs:
        assert cfg.tiles(n, m) > sms
        out = run(cfg)
        assert torch.equal(out, run(dataclasses.replace(cfg, persistent=0))), cfg.short()
    _check(out, a, b, sa, sb, None, BF16, cfgs[-1].chain)


@requires_sm90
@pytest.mark.parametrize("out_dtype", [F16, F32])
def test_gpu_block_out_dtypes_strided_nan_zero_m(out_dtype):
    m, n, k = 70, 1040, 1024
    a, b, sa, sb = _block_operands(m, n, k)
    _block_check(_block_run(a, b, sa, sb, out_dtype), a, b, sa, sb, out_dtype)
    for pad in (16, 3):  # row stride 1040 (TMA reads in place) and 1027 bytes (copied first)
        wide = torch.zeros(m, k + pad, device="cuda").to(FP8)
        wide[:, :k] = a
        _block_check(_block_run(wide[:, :k], b, sa, sb), wide[:, :k], b, sa, sb)
    a[5, 7] = float("nan")
    out = _block_run(a, b, sa, sb)
    assert torch.isnan(out[5]).all()
    rows = [r for r in range(m) if r != 5]
    _block_check(out[rows], a[rows], b, sa[rows], sb)
    assert _block_run(a[:0], b, sa[:0], sb).shape == (0, n)


@requires_sm90
def test_gpu_block_deterministic_graph_opcheck_compile():
    n, k = 2112, 7168
    a, b, sa, sb = _block_operands(64, n, k)
    cfg = fw.WgmmaConfig(32, 1, 4, 4, 4)  # split K over four ranks
    first = _block_run(a, b, sa, sb, cfg=cfg)
    assert torch.equal(first, _block_run(a, b, sa, sb, cfg=cfg))
    with scaledmm.use_backend("fp8_block", NAME), backends.record() as calls:
        for m, dt in ((1, BF16), (17, F16), (64, F32)):
            x, y, sx, sy = _block_operands(m, 256, 512, col=m != 17)
            opcheck(OPS.fp8_block_mm.default, (x, y, sx, sy, [128, 128], dt))
    assert {name for op, name, _ in calls if op == "fp8_block_mm"} == {NAME}

    graph = torch.cuda.CUDAGraph()
    with scaledmm.use_backend("fp8_block", NAME):
        OPS.fp8_block_mm(a, b, sa, sb)  # build outside the capture
        with torch.cuda.graph(graph):
            captured = OPS.fp8_block_mm(a, b, sa, sb)
    a2, _, sa2, _ = _block_operands(64, n, k)
    a.copy_(a2)
    sa.copy_(sa2)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, first)
    _block_check(captured, a, b, sa, sb)

    _replays_equal_eager("fp8_block", lambda a, sa: OPS.fp8_block_mm(a, b, sa, sb),
                         lambda a, sa: fw.block_mm(a, b, sa, sb), a, sa, lambda: _block_operands(64, n, k))


# ----------------------------------------------------------------------------
# fp8_block_linear: the activation quantized in the kernel (G_QUANT)
# ----------------------------------------------------------------------------


def test_linear_configs_fit_with_the_staging_rows():
    """The quantizing kernel takes the block table's config with as many
    stages as its 16-bit staging rows leave room for, never more, and
    refuses K that is not whole 128-groups."""
    for n, k in LLAMA8B + DSV3:
        for m in (1, 8, 16, 32, 64, 128, 256, 4096):
            block, quant = fw.choose_config(n, k, m, block=True), fw.choose_config(n, k, m, block=True, quant=True)
            assert fw.config_valid(quant, n, k, True, True) == (True, "ok"), (n, k, m, quant)
            assert dataclasses.replace(quant, stages=block.stages) == block and quant.stages <= block.stages
            more = dataclasses.replace(quant, stages=quant.stages + 1)
            assert quant.stages == block.stages or not fw.config_valid(more, n, k, True, True)[0]
            assert all(fw.config_valid(c, n, k, True, True)[0] for c in fw.candidate_configs(n, k, m, block=True,
                                                                                            quant=True))
    assert fw.WgmmaConfig(64, 1, 8, 1, 4).smem_bytes(4096, True, True) > fw.SMEM_MAX
    assert "K % 128 == 0" in fw.config_valid(fw.WgmmaConfig(16, 1, 4, 1, 4), 256, 4112, True, True)[1]
    with pytest.raises(ValueError, match="in_dtype"):
        fw.kernel_spec(256, 256, fw.WgmmaConfig(16, 1, 4, 1, 4), BF16, None, False, BF16)
    with pytest.raises(ValueError, match="bias_dtype"):
        fw.kernel_spec(256, 256, fw.WgmmaConfig(16, 1, 4, 1, 4), BF16, BF16, True, None)


def _linear_operands(m, n, k, dtype=BF16, outliers=True):
    from scaledmm.ops.fp8_block import quantize_weight

    x = torch.randn(m, k, device="cuda", dtype=dtype) * 2
    if outliers:
        x[:, ::37] *= 100
    b, sb = quantize_weight(torch.randn(n, k, device="cuda"))
    return x, b, sb


def _composite(x, b, sb, cfg, out_dtype=BF16, bias=None):
    """per_token_group_quant_fp8, then the block kernel with the same config:
    what the quantizing kernel must equal bit for bit."""
    a, sa = OPS.per_token_group_quant_fp8(x, 128, 1e-10, True)
    if bias is None:
        return fw.block_mm(a, b, sa, sb, (128, 128), out_dtype, cfg=cfg)
    return (fw.block_mm(a, b, sa, sb, (128, 128), F32, cfg=cfg) + bias.float()).to(out_dtype)


def _linear_run(x, b, sb, cfg, out_dtype=BF16, bias=None):
    torch.full((x.shape[0] * b.shape[0] + 1024,), float("nan"), device="cuda")  # NaN in the allocator
    return fw.block_linear(x, b, sb, (128, 128), out_dtype, bias, cfg=cfg)


@requires_sm90
@pytest.mark.parametrize("m,k,dtype", [(1, 4096, BF16), (17, 1152, F16), (100, 4096, BF16), (256, 1152, BF16)])
def test_gpu_linear_equals_quantize_then_gemm_every_config(m, k, dtype):
    """Every candidate config: the in-kernel 1 x 128 quantization gives
    per_token_group_quant_fp8's codes and scales, so the output is the
    composite's with the same config bit for bit (fp32 out: no rounding hides
    a difference); N = 1040: a partial weight tile; K = 1152: 9 stages,
    uneven splits.  The composite itself is float64-checked above."""
    n = 1040
    x, b, sb = _linear_operands(m, n, k, dtype)
    cfgs = fw.candidate_configs(n, k, m, block=True, quant=True)
    assert len(cfgs) >= 8
    for cfg in cfgs:
        got = _linear_run(x, b, sb, cfg, F32)
        assert torch.equal(got, _composite(x, b, sb, cfg, F32)), cfg.short()


@requires_sm90
@pytest.mark.parametrize("out_dtype,bias_dtype", [(BF16, None), (BF16, BF16), (F16, F32), (F32, F16)])
def test_gpu_linear_bias_out_dtypes_strided_nan_zero_m(out_dtype, bias_dtype):
    m, n, k = 37, 1040, 2048
    cfg = fw.choose_config(n, k, m, block=True, quant=True)
    x, b, sb = _linear_operands(m, n, k)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda", dtype=bias_dtype)
    assert torch.equal(_linear_run(x, b, sb, cfg, out_dtype, bias), _composite(x, b, sb, cfg, out_dtype, bias))
    for pad in (8, 3):  # row stride 4112 bytes (TMA reads in place) and 4102 (copied first)
        wide = torch.randn(m, k + pad, device="cuda", dtype=BF16)
        wide[:, :k] = x
        assert torch.equal(_linear_run(wide[:, :k], b, sb, cfg, out_dtype, bias),
                           _composite(x, b, sb, cfg, out_dtype, bias)), pad
    x[5, 700] = float("nan")
    x[9, 3] = float("inf")
    got = _linear_run(x, b, sb, cfg, out_dtype, bias)
    assert torch.isnan(got[5]).all() and torch.isnan(got[9]).all()  # an Inf makes its group's scale Inf
    rows = [r for r in range(m) if r not in (5, 9)]
    assert torch.equal(got[rows], _composite(x, b, sb, cfg, out_dtype, bias)[rows])
    assert _linear_run(x[:0], b, sb, cfg, out_dtype, bias).shape == (0, n)


@requires_sm90
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("n,k", LLAMA8B[:2] + DSV3[:1])
def test_gpu_linear_chosen_config_matches_f64_and_the_composite(m, n, k):
    """The config it chooses: bit for bit the composite, and the composite
    within the float64 bound."""
    x, b, sb = _linear_operands(m, n, k)
    got = fw.block_linear(x, b, sb)
    cfg = fw.choose_config(n, k, m, block=True, quant=True)
    assert torch.equal(got, _composite(x, b, sb, cfg))
    a, sa = OPS.per_token_group_quant_fp8(x, 128, 1e-10, True)
    _block_check(fw.block_mm(a, b, sa, sb, (128, 128), BF16, cfg=cfg), a, b, sa, sb, BF16, cfg.chain)


@requires_sm90
def test_gpu_linear_deterministic_and_cuda_graph():
    n, k = 2112, 7168
    x, b, sb = _linear_operands(64, n, k)
    cfg = fw.WgmmaConfig(32, 1, 4, 4, 4)  # split K over four ranks
    first = _linear_run(x, b, sb, cfg)
    assert torch.equal(first, _linear_run(x, b, sb, cfg))
    graph = torch.cuda.CUDAGraph()
    fw.block_linear(x, b, sb)  # build outside the capture
    with torch.cuda.graph(graph):
        captured = fw.block_linear(x, b, sb)
    x.copy_(_linear_operands(64, n, k)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _composite(x, b, sb, fw.choose_config(n, k, 64, block=True, quant=True)))


def test_linear_validates_and_is_not_a_registered_backend():
    """block_linear checks fp8_block_linear's arguments before any launch;
    it is no backend of the op (slower than the composite where measured:
    a family-wide request of cuda_wgmma keeps fp8_block_linear on the
    composite)."""
    x = torch.randn(2, 256, dtype=BF16)
    b = torch.zeros(128, 256).to(FP8)
    with pytest.raises(ValueError, match="x"):
        fw.block_linear(torch.randn(2, 200, dtype=BF16), torch.zeros(128, 200).to(FP8), torch.ones(1, 2))
    with pytest.raises(ValueError, match="block_size"):
        fw.block_linear(x, b, torch.ones(128, 2), (1, 128))
    assert "fp8_block_linear" not in backends.get("fp8_block", NAME).impls
    assert "fp8_block_mm" in backends.get("fp8_block", NAME).impls
