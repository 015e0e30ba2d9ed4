"""Backend ``cuda_gemv`` of nvfp4 (ops/nvfp4_gemv.py, csrc/nvfp4_gemv.cu).

CPU: the decode's exactness (the decoder itself is tested compiled for the
host, tests/test_csrc_host.py), NVRTC compiles of every instance the dispatch
and the benchmark use (sm_90a, no GPU needed), the config predicate, its
place in the sm90 policy and its switch, argument checks.  GPU (skipped without
CUDA): against the float64 reference at M in 1, 3, 8, 16, 17, 29, 32 (every M
bucket), llama8b shapes and an odd N, bias and alpha, poisoned outputs,
strided rows, CUDA graphs, determinism."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import nvfp4_problem as _problem
from helpers import nvrtc_registers, poison_

import scaledmm
from scaledmm import backends, jit
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_gemv as gv

LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
nvrtc = pytest.mark.skipif(not jit.nvrtc_available()[0], reason="NVRTC not available")
requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm90 GPU")


# ----------------------------------------------------------------------------
# The decode's exactness (the decoder itself: tests/test_csrc_host.py, compiled
# for the host from csrc/nvfp4_decode.cuh)
# ----------------------------------------------------------------------------


def test_scaled_products_are_exact_in_fp16():
    """e2m1 * e4m3 * 2^-14 is representable in fp16 for every code and every
    finite e4m3 value (the decode's mul.rn.f16x2 is exact)."""
    e4 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    e4 = e4[torch.isfinite(e4)]
    e2 = nv.e2m1_decode(torch.arange(16, dtype=torch.uint8)).double()
    prod = (e2[:, None] * e4[None, :]) * 2.0 ** -14
    assert torch.equal(prod.half().double(), prod)


# ----------------------------------------------------------------------------
# Config space and NVRTC instances
# ----------------------------------------------------------------------------


U8, BF16, F16 = torch.uint8, torch.bfloat16, torch.float16


def _instances():
    out = {}
    for n, k in LLAMA8B:
        for mb in gv.M_BUCKETS:
            out[(n, k, mb, gv.choose_config(n, k, mb), BF16, None, U8)] = None
            if mb <= gv.MAX_M[True]:
                out[(n, k, mb, gv.choose_config(n, k, mb, w4a16=True), BF16, None, BF16)] = None
    out[(1040, 4096, 8, gv.choose_config(1040, 4096, 8), F16, torch.float32, U8)] = None
    out[(1000, 96, 16, gv.GemvConfig(16, 2, 1, 1), BF16, BF16, U8)] = None
    out[(1000, 96, 8, gv.GemvConfig(64, 1, 1, 1), F16, F16, U8)] = None
    out[(4096, 4096, 16, gv.GemvConfig(64, 4, 8, 1), BF16, None, U8)] = None
    out[(1040, 4096, 16, gv.choose_config(1040, 4096, 16, w4a16=True), F16, BF16, F16)] = None
    out[(1000, 96, 8, gv.GemvConfig(16, 2, 1, 1), BF16, torch.float32, BF16)] = None
    out[(4096, 4096, 8, gv.GemvConfig(16, 4, 1, 2), F16, None, F16)] = None
    out[(1000, 96, 32, gv.GemvConfig(16, 2, 1, 1), F16, F16, U8)] = None  # wide path, partial rows, bias
    out[(1040, 4096, 32, gv.GemvConfig(32, 4, 2, 1), BF16, torch.float32, U8)] = None
    # the shared-memory ring: every M bucket, W4A4 and W4A16, partial rows and units, split K
    out[(4096, 4096, 8, gv.GemvConfig(16, 4, 1, 2, 4), BF16, None, U8)] = None
    out[(1000, 96, 16, gv.GemvConfig(32, 2, 1, 1, 3), F16, F16, U8)] = None
    out[(1000, 96, 32, gv.GemvConfig(16, 2, 1, 1, 3), BF16, BF16, U8)] = None
    out[(1040, 4096, 8, gv.GemvConfig(16, 4, 2, 1, 6), BF16, None, BF16)] = None
    out[(1040, 4096, 16, gv.GemvConfig(32, 4, 2, 1, 4), F16, torch.float32, F16)] = None
    return list(out)


@nvrtc
@pytest.mark.parametrize("n,k,mb,cfg,out_dtype,bias_dtype,act", _instances(),
                         ids=lambda v: v.short() if hasattr(v, "short") else str(v))
def test_instance_compiles_without_spills(n, k, mb, cfg, out_dtype, bias_dtype, act):
    w4a16 = act != U8
    assert gv.config_valid(cfg, n, k, mb, w4a16) == (True, "ok")
    regs = nvrtc_registers(gv.kernel_spec(n, k, mb, cfg, out_dtype, bias_dtype, act))
    assert regs <= cfg.registers(mb, w4a16), f"estimate {cfg.registers(mb, w4a16)} below the real {regs} registers"


def test_decoded_weights_are_exact_in_bf16():
    """The W4A16 bf16 path converts the fp16 products e2m1 * e4m3 * 2^-14 to
    bf16 (cvt through fp32): exact for every code and finite e4m3 scale."""
    e4 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    e4 = e4[torch.isfinite(e4)]
    e2 = nv.e2m1_decode(torch.arange(16, dtype=torch.uint8)).double()
    prod = (e2[:, None] * e4[None, :]) * 2.0 ** -14
    assert torch.equal(prod.half().float().bfloat16().double(), prod)


@nvrtc
def test_kernel_rejects_bad_defines():
    spec = jit.NvrtcKernelSpec(gv.KERNEL, gv.source_path(), arch=gv.ARCH,
                               defines=dict(gv.GemvConfig().defines(64, 48, 8, torch.bfloat16, None)))
    with pytest.raises(jit.CompileError, match="multiple of 32"):
        spec.compile()


@pytest.mark.parametrize("cfg,n,k,mb,why", [
    (gv.GemvConfig(24), 64, 128, 8, "rows"),
    (gv.GemvConfig(split_k=3), 64, 1024, 8, "split_k"),
    (gv.GemvConfig(warps=0), 64, 128, 8, "warps"),
    (gv.GemvConfig(unroll=5), 64, 128, 8, "unroll"),
    (gv.GemvConfig(), 64, 48, 8, "multiple of 32"),
    (gv.GemvConfig(), 0, 128, 8, "N > 0"),
    (gv.GemvConfig(), 64, 128, 4, "m_bucket"),
    (gv.GemvConfig(16, 1, 1, 1), 64, 128, 64, "m_bucket"),
    (gv.GemvConfig(32, 4, 1, 2), 64, 4096, 32, "registers"),
    (gv.GemvConfig(split_k=8), 64, 512, 8, "exceeds"),
    (gv.GemvConfig(64, 16, 1, 4), 64, 4096, 16, "registers"),
    (gv.GemvConfig(16, 4, 1, 1, 1), 64, 4096, 8, "stages"),
    (gv.GemvConfig(16, 4, 1, 1, 9), 64, 4096, 8, "stages"),
    (gv.GemvConfig(16, 16, 1, 2, 8), 64, 4096, 16, "ring of"),
    ("r32", 64, 128, 8, "GemvConfig"),
])
def test_config_predicate_rejects(cfg, n, k, mb, why):
    ok, reason = gv.config_valid(cfg, n, k, mb)
    assert not ok and why in reason


def test_ring_bytes_and_names():
    ring = gv.GemvConfig(16, 4, 1, 2, 4)
    # per stage, unit and thread: two weight rows + one activation fragment of 16 bytes, three scale words
    assert ring.ring_bytes(8) == 4 * 2 * 128 * (16 * 3 + 4 * 3)
    # W4A16 at M <= 16: two fragments of four 16-byte loads, only the weight's two scale words
    assert ring.ring_bytes(16, w4a16=True) == 4 * 2 * 128 * (16 * 10 + 4 * 2)
    assert gv.GemvConfig(16, 4, 1, 2).ring_bytes(8) == 0
    assert ring.short() == "r16w4s1u2p4" and gv.GemvConfig(16, 4, 1, 2).short() == "r16w4s1u2"
    assert ring.defines(64, 128, 8, torch.bfloat16, None)["G_STAGES"] == 4
    assert "G_STAGES" not in gv.GemvConfig(16, 4, 1, 2).defines(64, 128, 8, torch.bfloat16, None)
    ok, why = gv.config_valid(ring, 4096, 4096, 8, quant=True)
    assert not ok and "stages 0" in why
    cands = gv.candidate_configs(28672, 4096, 8)
    assert any(c.stages for c in cands) and any(not c.stages for c in cands)


def test_w4a16_bucket_limit_and_m_buckets():
    ok, reason = gv.config_valid(gv.GemvConfig(16, 1, 1, 1), 64, 128, 32, w4a16=True)
    assert not ok and "W4A16 limit 16" in reason
    assert [gv.m_bucket(m) for m in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]


@pytest.mark.parametrize("n,k", LLAMA8B + [(1040, 4096), (16, 32), (5, 96)])
@pytest.mark.parametrize("mb", gv.M_BUCKETS)
@pytest.mark.parametrize("w4a16", [False, True])
def test_default_and_candidates_are_valid(n, k, mb, w4a16):
    if mb > gv.MAX_M[w4a16]:
        return
    cfgs = gv.candidate_configs(n, k, mb, w4a16=w4a16)
    assert cfgs[0] == gv.choose_config(n, k, mb, w4a16=w4a16)
    assert len(cfgs) == len(set(cfgs)) >= 1
    for cfg in cfgs:
        assert gv.config_valid(cfg, n, k, mb, w4a16) == (True, "ok"), cfg
    cfg = cfgs[0]
    assert cfg.grid(n)[0] * cfg.rows >= n


def test_kernel_spec_validates():
    with pytest.raises(ValueError, match="cfg:"):
        gv.kernel_spec(64, 48, 8, gv.GemvConfig())
    with pytest.raises(ValueError, match="out_dtype:"):
        gv.kernel_spec(64, 128, 8, gv.GemvConfig(16, 1, 1, 1), torch.float32)
    with pytest.raises(ValueError, match="bias_dtype:"):
        gv.kernel_spec(64, 128, 8, gv.GemvConfig(16, 1, 1, 1), torch.bfloat16, torch.int8)


def test_prebuild_hook():
    specs = gv.prebuild_specs("4096:4096, 1040:4096")
    # 2 shapes x 2 outputs x (3 W4A4 buckets + 2 W4A16 buckets)
    assert len({s.key for s in specs}) == len(specs) == 20
    with pytest.raises(ValueError, match="--nvfp4-gemv"):
        gv.prebuild_specs("4096x4096")


# ----------------------------------------------------------------------------
# Backend gating
# ----------------------------------------------------------------------------


def test_registered_and_first_on_sm90_by_default(fake_sm90, monkeypatch):
    assert gv.NAME in backends.names("nvfp4")
    assert backends.priority("nvfp4", torch.device("cuda", 0))[0] == gv.NAME
    var = backends.policy("nvfp4", "sm90").switches[gv.NAME]
    assert var == "SCALEDMM_NVFP4_GEMV"
    monkeypatch.setenv(var, "0")  # read at selection time
    assert gv.NAME not in backends.priority("nvfp4", torch.device("cuda", 0))
    assert backends.select(_problem(1), "nvfp4_mm").name != gv.NAME
    with scaledmm.use_backend("nvfp4", gv.NAME):  # an explicit request still reaches it
        assert backends.select(_problem(1), "nvfp4_mm").name == gv.NAME


def test_first_for_small_m(fake_sm90):
    assert backends.priority("nvfp4", torch.device("cuda", 0))[0] == gv.NAME
    for m in (1, 3, 8, 16, 17, 32):
        assert backends.select(_problem(m), "nvfp4_mm").name == gv.NAME
    assert backends.select(_problem(33), "nvfp4_mm").name != gv.NAME
    assert backends.select(_problem(4, out_dtype=torch.float32), "nvfp4_mm").name != gv.NAME
    assert backends.select(_problem(4, w4a16=True), "nvfp4_w4a16_mm").name == gv.NAME
    assert backends.select(_problem(16, w4a16=True), "nvfp4_w4a16_mm").name == gv.NAME
    assert backends.select(_problem(17, w4a16=True), "nvfp4_w4a16_mm").name != gv.NAME
    assert backends.priority("nvfp4", torch.device("cuda", 0)).count(gv.NAME) == 1


def test_switch_values(fake_sm90, monkeypatch):
    var = backends.policy("nvfp4", "sm90").switches[gv.NAME]
    for value, on in (("1", True), ("0", False), ("", False), ("yes", True), (None, True)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        assert (backends.select(_problem(4), "nvfp4_mm").name == gv.NAME) == on, value


def test_misaligned_operands_go_elsewhere(fake_sm90):
    p = dataclasses.replace(_problem(4), options=_problem(4).options + (("aligned16", False),))
    ok, why = gv.can_implement(p)
    assert not ok and "16-byte aligned" in why
    assert backends.select(p, "nvfp4_mm").name not in (gv.NAME, "cuda_mid")
    with scaledmm.use_backend("nvfp4", gv.NAME), pytest.raises(RuntimeError, match="16-byte aligned"):
        backends.select(p, "nvfp4_mm")


@pytest.mark.parametrize("p,why", [
    (_problem(33), "M <= 32"),
    (_problem(4, k=48), "multiple of 32"),
    (_problem(4, out_dtype=torch.float32), "bf16 or fp16"),
    (_problem(4, w4a16=True, act=torch.float32), "fp16 or bf16 activation"),
    (_problem(4, w4a16=True, stride=4096 + 4), "16 bytes"),
    (_problem(17, w4a16=True), "M <= 16 (W4A16)"),
    (_problem(4, stride=4096 + 16), "16 bytes"),
])
def test_can_implement_says_why(p, why):
    ok, reason = gv.can_implement(p)
    assert not ok and why in reason


def test_can_implement_accepts():
    assert gv.can_implement(_problem(16, n=1040))[0]
    assert gv.can_implement(_problem(1, stride=4096 + 16))[0]  # one row: any stride
    assert gv.can_implement(_problem(0))[0]
    assert not gv.is_supported(torch.device("cpu"))[0]


def test_explicit_request_on_cpu_explains():
    a = torch.zeros(2, 64, dtype=torch.uint8)
    b = torch.zeros(32, 64, dtype=torch.uint8)
    s = torch.zeros(128, 8, dtype=torch.float8_e4m3fn)
    with scaledmm.use_backend("nvfp4", gv.NAME), pytest.raises(RuntimeError, match="CUDA device"):
        torch.ops.scaledmm.nvfp4_mm(a, b, s, s, torch.tensor(1.0))


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


def _operands(m, n, k, device="cuda"):
    x = torch.randn(m, k, device=device) * torch.rand(m, 1, device=device) * 4
    w = torch.randn(n, k, device=device) / k ** 0.5
    gs_x = torch.tensor(448 * 6 / max(float(x.abs().max()), 1e-6), device=device)
    gs_w = torch.tensor(448 * 6 / float(w.abs().max()), device=device)
    qa, sa = torch.ops.scaledmm.nvfp4_quant(x.bfloat16(), gs_x)
    qb, sb = torch.ops.scaledmm.nvfp4_quant(w.bfloat16(), gs_w)
    alpha = (1.0 / (gs_x * gs_w)).float()
    return qa, sa, qb, sb, alpha


def _check(out, qa, sa, qb, sb, alpha, bias=None):
    ref = nv.dequantize(qa, sa).double() @ nv.dequantize(qb, sb).double().t() * float(alpha)
    if bias is not None:
        ref = ref + bias.double()
    absum = nv.dequantize(qa, sa).double().abs() @ nv.dequantize(qb, sb).double().abs().t() * float(alpha)
    eps = 2.0 ** -8 if out.dtype == torch.bfloat16 else 2.0 ** -11
    bound = ref.abs() * eps + absum * 2.0 ** -20 + 1e-30
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all(), "non-finite output (unwritten poison?)"
    assert (err <= bound).all(), f"worst {float((err / bound).max()):.2f}x the bound"


def _run(qa, sa, qb, sb, alpha, out_dtype=torch.bfloat16, bias=None, cfg=None):
    torch.full((qa.shape[0] * qb.shape[0] + 1024,), float("nan"), device="cuda")  # NaN in the allocator
    if cfg is not None:
        out = poison_(nv.mm_output(qa, qb, out_dtype))
        return gv.launch(qa, qb, sa, sb, alpha, bias, out, cfg)
    with scaledmm.use_backend("nvfp4", gv.NAME):
        return torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha, out_dtype, bias)


@requires_sm90
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 29, 32])
@pytest.mark.parametrize("n,k", LLAMA8B + [(1040, 4096), (200, 96)])
def test_gpu_matches_f64(m, n, k):
    qa, sa, qb, sb, alpha = _operands(m, n, k)
    _check(_run(qa, sa, qb, sb, alpha), qa, sa, qb, sb, alpha)


@requires_sm90
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_bias_alpha(out_dtype, bias_dtype):
    qa, sa, qb, sb, alpha = _operands(5, 1040, 2048)
    alpha = alpha * 3.0
    bias = torch.randn(1040, device="cuda").to(bias_dtype)
    _check(_run(qa, sa, qb, sb, alpha, out_dtype, bias), qa, sa, qb, sb, alpha, bias)


@requires_sm90
@pytest.mark.parametrize("mb", gv.M_BUCKETS)
def test_gpu_every_candidate_config(mb):
    n, k = 1040, 4096
    qa, sa, qb, sb, alpha = _operands(mb - 1, n, k)
    for cfg in gv.candidate_configs(n, k, mb)[:24]:
        _check(_run(qa, sa, qb, sb, alpha, cfg=cfg), qa, sa, qb, sb, alpha)


@requires_sm90
@pytest.mark.parametrize("w4a16", [False, True])
@pytest.mark.parametrize("m", [1, 3, 9, 17, 32])
def test_gpu_ring_is_bitwise_the_register_path(m, w4a16):
    """The ring changes only where a batch waits, not the sums: every depth is
    bit for bit the register-batch kernel of the same tiles (partial rows and
    units, split K, strided rows), and within the float64 bound."""
    if m > gv.MAX_M[w4a16]:
        pytest.skip("over the W4A16 limit")
    n, k = 1040, 2080  # 16 full 128-k units and a partial one
    mb = gv.m_bucket(m)
    if w4a16:
        x, qb, sb, alpha = _w4a16_operands(m, n, k)
        wide = torch.zeros(m, k + 64, dtype=x.dtype, device="cuda")
        wide[:, 32:32 + k] = x
        x = wide[:, 32:32 + k]
        run = lambda cfg: _run16(x, qb, sb, alpha, cfg=cfg)  # noqa: E731
    else:
        qa, sa, qb, sb, alpha = _operands(m, n, k)
        run = lambda cfg: _run(qa, sa, qb, sb, alpha, cfg=cfg)  # noqa: E731
    tried = 0
    for base in (gv.GemvConfig(16, 2, 1, 1), gv.GemvConfig(32, 4, 2, 1), gv.GemvConfig(16, 4, 1, 2)):
        want = None
        for stages in (2, 3, 4, 6):
            cfg = dataclasses.replace(base, stages=stages)
            if not (gv.config_valid(cfg, n, k, mb, w4a16)[0] and gv.config_valid(base, n, k, mb, w4a16)[0]):
                continue
            if want is None:
                want = run(base)
                if w4a16:
                    _check16(want, x, qb, sb, alpha)
                else:
                    _check(want, qa, sa, qb, sb, alpha)
            assert torch.equal(run(cfg), want), cfg.short()
            tried += 1
    assert tried >= 6


@requires_sm90
def test_gpu_ring_with_misaligned_scales_takes_the_register_path():
    """A scale tensor 2 bytes off a 4-byte boundary cannot be copied as whole
    words: the launch drops the ring and the result is unchanged."""
    qa, sa, qb, sb, alpha = _operands(4, 256, 512)
    ring = gv.GemvConfig(16, 2, 1, 1, 3)
    want = _run(qa, sa, qb, sb, alpha, cfg=ring)
    raw = torch.zeros(sb.numel() + 2, dtype=torch.uint8, device="cuda")
    raw[2:] = sb.view(torch.uint8).flatten()
    sb_odd = raw[2:].view(sb.dtype).view(sb.shape)
    assert sb_odd.data_ptr() % 4 == 2
    assert torch.equal(_run(qa, sa, qb, sb_odd, alpha, cfg=ring), want)


@requires_sm90
def test_gpu_zero_m_strided_and_misaligned():
    qa, sa, qb, sb, alpha = _operands(4, 256, 512)
    qa0, sa0 = torch.ops.scaledmm.nvfp4_quant(torch.empty(0, 512, dtype=torch.bfloat16, device="cuda"), alpha)
    assert _run(qa0, sa0, qb, sb, alpha).shape == (0, 256)
    wide = torch.zeros(4, 512, dtype=torch.uint8, device="cuda")
    wide[:, :256] = qa
    _check(_run(wide[:, :256], sa, qb, sb, alpha), qa, sa, qb, sb, alpha)  # row stride 512 bytes
    odd = torch.zeros(4, 257, dtype=torch.uint8, device="cuda")
    odd[:, 1:] = qa
    with backends.record() as calls:  # a row stride of 257 bytes: dispatch picks another backend
        _check(torch.ops.scaledmm.nvfp4_mm(odd[:, 1:], qb, sa, sb, alpha), qa, sa, qb, sb, alpha)
    assert calls[-1][1] != gv.NAME
    shifted = torch.zeros(4, 512 + 16, dtype=torch.uint8, device="cuda")
    shifted[:, 1:257] = qa  # stride 528 bytes (a multiple of 16) but the base is 1 byte off
    with pytest.raises(RuntimeError, match="16-byte aligned"):  # requested: refused with the reason
        _run(shifted[:, 1:257], sa, qb, sb, alpha)
    with backends.record() as calls:  # automatic: the policy's next backend that can run it
        _check(torch.ops.scaledmm.nvfp4_mm(shifted[:, 1:257], qb, sa, sb, alpha), qa, sa, qb, sb, alpha)
    assert calls[-1][1] not in (gv.NAME, "cuda_mid")


@requires_sm90
def test_gpu_nan_scale_propagates_to_its_row():
    qa, sa, qb, sb, alpha = _operands(3, 64, 256)
    s = nv.unswizzle_block_scales(sa, 3, 16)
    s.view(torch.uint8)[1, 2] = 0x7F  # e4m3 NaN
    sa = nv.swizzle_block_scales(s)
    out = _run(qa, sa, qb, sb, alpha)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


@requires_sm90
def test_gpu_wide_bucket_strided_rows_and_nan_row():
    """M = 29 (the 32-row bucket, partial last fragment), rows read through
    a stride; a NaN scale in row 20 (third activation fragment) reaches that
    row only."""
    m, n, k = 29, 1040, 1024
    qa, sa, qb, sb, alpha = _operands(m, n, k)
    s = nv.unswizzle_block_scales(sa, m, k // 16)
    s.view(torch.uint8)[20, 5] = 0x7F  # e4m3 NaN
    sa_nan = nv.swizzle_block_scales(s)
    wide = torch.zeros(m, k // 2 + 48, dtype=torch.uint8, device="cuda")
    wide[:, 32:32 + k // 2] = qa
    out = _run(wide[:, 32:32 + k // 2], sa_nan, qb, sb, alpha)  # row stride 560 bytes
    assert torch.isnan(out[20]).all()
    rows = [r for r in range(m) if r != 20]
    _check(out[rows], qa[rows], nv.swizzle_block_scales(s[rows]), qb, sb, alpha)


@requires_sm90
def test_gpu_deterministic_and_cuda_graph():
    qa, sa, qb, sb, alpha = _operands(16, 4096, 4096)
    first = _run(qa, sa, qb, sb, alpha)
    assert torch.equal(first, _run(qa, sa, qb, sb, alpha))
    qa2, sa2, _, _, _ = _operands(16, 4096, 4096)  # the quantizer is another backend's op
    with scaledmm.use_backend("nvfp4", gv.NAME):
        torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha)  # compile + load outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha)
        qa.copy_(qa2)
        sa.copy_(sa2)
        graph.replay()
        torch.cuda.synchronize()
        again = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha)
    assert torch.equal(captured, again)
    assert not torch.equal(captured, first)


def test_tuning_table_valid_and_rule_reproduces_its_m8_tiles():
    for (n, k), per_mb in gv.TUNING.items():
        for mb, cfg in per_mb.items():
            assert gv.config_valid(cfg, n, k, mb) == (True, "ok"), (n, k, mb, cfg)
            assert gv.choose_config(n, k, mb) == cfg
        rule = gv.default_config(n, k, 8)  # the measured warps / unroll vary by shape; tiles and split follow it
        assert (rule.rows, rule.split_k) == (per_mb[8].rows, per_mb[8].split_k), (n, k)
    for (n, k), per_mb in gv.TUNING_W4A16.items():
        for mb, cfg in per_mb.items():
            assert gv.config_valid(cfg, n, k, mb, w4a16=True) == (True, "ok"), (n, k, mb, cfg)
            assert gv.choose_config(n, k, mb, w4a16=True) == cfg


# ----------------------------------------------------------------------------
# GPU: W4A16 (fp16 / bf16 activation)
# ----------------------------------------------------------------------------


def _w4a16_operands(m, n, k, dtype=torch.bfloat16):
    x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4).to(dtype)
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    gs_w = torch.tensor(448 * 6 / float(w.abs().max()), device="cuda")
    qb, sb = torch.ops.scaledmm.nvfp4_quant(w.bfloat16(), gs_w)
    return x, qb, sb, (1.0 / gs_w).float()


def _check16(out, x, qb, sb, alpha, bias=None):
    wd = nv.dequantize(qb, sb).double()
    ref = x.double() @ wd.t() * float(alpha)
    if bias is not None:
        ref = ref + bias.double()
    absum = x.double().abs() @ wd.abs().t() * float(alpha)
    eps = 2.0 ** -8 if out.dtype == torch.bfloat16 else 2.0 ** -11
    bound = ref.abs() * eps + absum * 2.0 ** -20 + 1e-30
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all(), "non-finite output (unwritten poison?)"
    assert (err <= bound).all(), f"worst {float((err / bound).max()):.2f}x the bound"


def _run16(x, qb, sb, alpha, out_dtype=torch.bfloat16, bias=None, cfg=None):
    torch.full((x.shape[0] * qb.shape[0] + 1024,), float("nan"), device="cuda")  # NaN in the allocator
    if cfg is not None:
        out = poison_(nv.mm_output(x, qb, out_dtype))
        return gv.launch(x, qb, sb, sb, alpha, bias, out, cfg)
    with scaledmm.use_backend("nvfp4", gv.NAME):
        return torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, alpha, out_dtype, bias)


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 9, 16])
@pytest.mark.parametrize("n,k", LLAMA8B + [(1040, 4096), (200, 96)])
def test_gpu_w4a16_matches_f64(m, n, k, dtype):
    x, qb, sb, alpha = _w4a16_operands(m, n, k, dtype)
    _check16(_run16(x, qb, sb, alpha), x, qb, sb, alpha)


@requires_sm90
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_gpu_w4a16_bias_and_candidates(out_dtype, bias_dtype):
    x, qb, sb, alpha = _w4a16_operands(5, 1040, 2048)
    bias = torch.randn(1040, device="cuda").to(bias_dtype)
    _check16(_run16(x, qb, sb, alpha * 3.0, out_dtype, bias), x, qb, sb, alpha * 3.0, bias)
    for cfg in gv.candidate_configs(1040, 2048, 8, w4a16=True)[:12]:
        _check16(_run16(x, qb, sb, alpha, cfg=cfg), x, qb, sb, alpha)


@requires_sm90
def test_gpu_w4a16_strided_misaligned_auto_and_graph():
    x, qb, sb, alpha = _w4a16_operands(8, 4096, 4096)
    wide = torch.zeros(8, 4096 + 1536, dtype=x.dtype, device="cuda")
    wide[:, 512:512 + 4096] = x
    _check16(_run16(wide[:, 512:512 + 4096], qb, sb, alpha), x, qb, sb, alpha)  # row stride 11264 bytes
    odd = torch.zeros(8, 4096 + 1, dtype=x.dtype, device="cuda")
    odd[:, 1:] = x  # 8194-byte rows: the automatic choice is another backend
    with backends.record() as calls:
        _check16(torch.ops.scaledmm.nvfp4_w4a16_mm(odd[:, 1:], qb, sb, alpha), x, qb, sb, alpha)
    assert calls[-1][1] != gv.NAME
    with backends.record() as calls:  # aligned, M <= 16: this backend by default
        first = torch.ops.scaledmm.nvfp4_w4a16_mm(x, qb, sb, alpha)
    assert calls[-1][1] == gv.NAME or not backends.policy("nvfp4", x.device).enabled(gv.NAME)
    assert torch.equal(first, _run16(x, qb, sb, alpha))
    x2, _, _, _ = _w4a16_operands(8, 4096, 4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run16(x, qb, sb, alpha)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _run16(x, qb, sb, alpha))


def test_kernel_spec_rejects_activation_dtype():
    with pytest.raises(ValueError, match="act_dtype:"):
        gv.kernel_spec(64, 128, 8, gv.GemvConfig(16, 1, 1, 1), torch.bfloat16, None, torch.float32)


# ----------------------------------------------------------------------------
# nvfp4_linear: the instantiation that quantizes the activation (G_QUANT)
# ----------------------------------------------------------------------------


def _linear_problem(m: int, k: int = 4096, dtype=torch.bfloat16, n: int = 4096):
    """The ``nvfp4_linear`` problem ``nv.linear_problem`` builds, on ``cuda:0``
    (no GPU needed)."""
    x = torch.zeros(m, k, dtype=dtype, device="meta")
    b = torch.zeros(n, k // 2, dtype=torch.uint8, device="meta")
    p = nv.linear_problem(x, b, torch.bfloat16, None)
    return dataclasses.replace(p, device=torch.device("cuda", 0),
                               options=tuple((key, True if key == "aligned16" else v) for key, v in p.options))


@nvrtc
@pytest.mark.parametrize("n,k,mb,in_dtype,out_dtype,bias_dtype", [
    (4096, 4096, 8, torch.bfloat16, torch.bfloat16, None),
    (28672, 4096, 8, torch.bfloat16, torch.bfloat16, None),
    (4096, 14336, 8, torch.float16, torch.float16, torch.float32),
    (200, 736, 8, torch.bfloat16, torch.bfloat16, torch.bfloat16),
])
def test_linear_instance_compiles_without_spills(n, k, mb, in_dtype, out_dtype, bias_dtype):
    cfg = gv.choose_linear_config(n, k, mb)
    assert gv.config_valid(cfg, n, k, mb, quant=True) == (True, "ok")
    spec = gv.kernel_spec(n, k, mb, cfg, out_dtype, bias_dtype, in_dtype, True)
    defines = {key: int(v) for key, v in dict(spec.defines).items()}
    assert defines["G_QUANT"] == 1 and defines["G_ACT"] == 0 and defines["G_IN_F16"] == int(in_dtype == torch.float16)
    regs = nvrtc_registers(spec)
    assert regs <= cfg.registers(mb, quant=True), f"estimate {cfg.registers(mb, quant=True)} below the real {regs}"


def test_linear_config_predicate_and_spec_refuse():
    cfg = gv.GemvConfig(16, 8, 1, 2)
    assert gv.config_valid(cfg, 4096, 4096, 8, quant=True) == (True, "ok")
    assert "nvfp4_linear limit" in gv.config_valid(cfg, 4096, 4096, 16, quant=True)[1]
    assert "excludes w4a16" in gv.config_valid(cfg, 4096, 4096, 8, True, True)[1]
    assert "shared memory" in gv.config_valid(cfg, 4096, 65536, 8, quant=True)[1]
    assert gv.config_valid(dataclasses.replace(cfg, split_k=2), 4096, 65536, 8, quant=True)[0]
    # split K until the quantized rows fit
    assert gv.choose_linear_config(4096, 65536, 8).split_k >= 2
    with pytest.raises(ValueError, match="act_dtype"):
        gv.kernel_spec(4096, 4096, 8, cfg, torch.bfloat16, None, torch.uint8, True)
    # 8 rows of 4096: codes (32 units of 64 bytes + 64 of pitch) and scales (8 per unit)
    assert gv.quant_smem(4096, 8, 1) == 8 * (32 * 64 + 64 + 32 * 8)
    assert gv.quant_smem(4096, 1, 4) == 8 * 64 + 64 + 8 * 8
    assert gv.quant_smem(736, 1, 1) == 6 * 64 + 64 + 6 * 8  # a partial unit counts whole


@pytest.mark.parametrize("p,why", [
    (_linear_problem(9), "M <= 8 (nvfp4_linear)"),
    (_linear_problem(4, dtype=torch.float32), "fp16 or bf16 activation"),
    (_linear_problem(4, k=1 << 20), "shared memory"),
    (_linear_problem(4, k=48), "multiple of 32"),
])
def test_linear_can_implement_says_why(p, why):
    ok, reason = gv.can_implement_linear(p)
    assert not ok and why in reason, reason


def test_linear_is_not_a_registered_backend(fake_sm90):
    """The one-launch kernel lost to the composite (benchmarks/NOTES.md): the
    op runs as its two ops, and forcing cuda_gemv still reaches its GEMM."""
    assert gv.can_implement_linear(_linear_problem(8))[0] and gv.can_implement_linear(_linear_problem(8, k=65536))[0]
    assert gv.can_implement_linear(_linear_problem(1, dtype=torch.float16))[0]
    assert "nvfp4_linear" not in backends.get("nvfp4", gv.NAME).impls
    assert backends.select(_linear_problem(1), "nvfp4_linear").name == "composite"


def test_gemv_linear_refuses_what_it_cannot_run():
    x = torch.zeros(9, 64, dtype=torch.bfloat16)
    b = torch.zeros(32, 32, dtype=torch.uint8)
    s = torch.zeros(128, 4, dtype=torch.float8_e4m3fn)
    one = torch.ones(())
    with pytest.raises(ValueError, match="CUDA device"):  # on a GPU: "M <= 8" (test_nvfp4_linear.py)
        gv.gemv_linear(x, b, s, one, one)
    with pytest.raises(ValueError, match="b_scales"):
        gv.gemv_linear(x[:2], b, s[:, :2], one, one)
