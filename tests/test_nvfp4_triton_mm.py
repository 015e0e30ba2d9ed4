"""The NVFP4 Triton GEMMs (``ops/nvfp4_triton.py``) against float64 references
on the decoded operands (W4A4, W4A16, split-K, pre-decoded weights), and the
backend through the ops: registry, opcheck, compile, fake tensors, errors.

Interpreter tests (``@interp``) run the kernels in Triton's CPU interpreter.
``TRITON_INTERPRET`` must be set before Triton is first imported, and other
test files import Triton in compiled mode, so these tests never run in the
main pytest process: :func:`test_interpreter_suite` re-runs this file in a
subprocess with ``TRITON_INTERPRET=1`` (and ``SCALEDMM_NVFP4_INTERP_CHILD=1``),
where only they run.  Small shapes.

References (``nvfp4_triton_helpers``) are written from SPEC.md, independently
of ``ops/nvfp4.py``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledmm
from scaledmm.backends import Family, Problem
from scaledmm.ops import nvfp4_triton as nt
from scaledmm.ops import nvfp4_triton_decode as nd
from scaledmm.ops import nvfp4_triton_quant as ntq
from helpers import opcheck, poison_, rel_err
from nvfp4_triton_helpers import (
    CHILD, decode, interp, parent, poison_mm_output, Q, QCFGS, QCFGS_STEPS, quantized, ref_mm,
    run_interpreter_child, triton_problem,
)

FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------
# The interpreter subprocess (main process)
# ----------------------------------------------------------------------------


@parent
def test_interpreter_suite():
    run_interpreter_child(__file__)


# ----------------------------------------------------------------------------
# Interpreter: GEMMs
# ----------------------------------------------------------------------------


TT = "triton"
INTERP_CONFIGS = [
    nt.GemmConfig(16, 16, 64, decode=TT),
    nt.GemmConfig(32, 16, 128, split_k=2, decode=TT),
    nt.GemmConfig(16, 32, 64, split_k=3, group_n=2, decode=TT),
]


@interp
@pytest.mark.parametrize("cfg", INTERP_CONFIGS + [nt.GemmConfig(16, 16, 64, decode=TT, predecode_x=True)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("m", [0, 1, 3, 17])
def test_w4a4_exact(monkeypatch, cfg, m):
    poison_mm_output(monkeypatch)
    n, k = 40, 160  # N, K not multiples of the tiles; K % 64 != 0
    qa, sa = quantized(m, k, "cpu", scale=3.0, gs=10.0)
    qb, sb = quantized(n, k, "cpu", scale=0.1, gs=3000.0)
    alpha = torch.tensor(0.37)
    bias = torch.randn(n)
    out = nt.run_mm(qa, qb, sa, sb, alpha, torch.float32, bias, cfg)
    ref = ref_mm(decode(qa, sa), decode(qb, sb), alpha, bias)
    assert out.shape == (m, n) and not out.isnan().any()
    if m:
        assert rel_err(out, ref) < 1e-5


@interp
@pytest.mark.parametrize("cfg", INTERP_CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
def test_w4a16_exact(monkeypatch, cfg, xdtype):
    poison_mm_output(monkeypatch)
    m, n, k = 17, 24, 96
    wide = torch.randn(m, k + 32).to(xdtype)
    x = wide[:, 16:16 + k]  # strided rows
    qb, sb = quantized(n, k, "cpu", scale=0.5, gs=500.0)
    alpha = torch.tensor(1.5)
    out = nt.run_w4a16(x, qb, sb, alpha, torch.float32, None, cfg)
    ref = ref_mm(x.double(), decode(qb, sb), alpha, None)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5


@interp
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [0, 1, 19])
def test_predecode_w_paths(out_dtype, m):
    """predecode_w: transient 16-bit ``alpha * deq(b)`` + F.linear; one extra
    rounding of the scaled weight, so bf16-level agreement with float64."""
    n, k = 40, 160
    cfg = nt.GemmConfig(128, 256, 64, predecode_w=True, decode=TT)
    qa, sa = quantized(m, k, "cpu", scale=3.0, gs=10.0)
    qb, sb = quantized(n, k, "cpu", scale=0.1, gs=3000.0)
    alpha, bias = torch.tensor(3.7e-4), torch.randn(n)  # fp16 outputs stay finite
    out = nt.run_mm(qa, qb, sa, sb, alpha, out_dtype, bias, cfg)
    assert out.shape == (m, n) and out.dtype == out_dtype
    x = torch.randn(m, k).to(out_dtype)
    out16 = nt.run_w4a16(x, qb, sb, alpha, out_dtype, None, cfg)
    assert out16.shape == (m, n) and out16.dtype == out_dtype
    if m:
        assert rel_err(out, ref_mm(decode(qa, sa), decode(qb, sb), alpha, bias)) < 1e-2
        assert rel_err(out16, ref_mm(x.double(), decode(qb, sb), alpha, None)) < 1e-2
    # weight scaling is exact without a factor and a plain product with one
    wd = nd.dequant(qb, sb, torch.float32, alpha)
    assert rel_err(wd, decode(qb, sb) * 3.7e-4) < 1e-6


@interp
@pytest.mark.parametrize("m", [0, 3, 33])
def test_dequant_permute_k_is_the_wgmma_order(m):
    """The W4A4 activation decode of ``cuda_wgmma``: the exact fp16 decode,
    with K in ``nvfp4_wgmma.permute_k``'s order (K = 320: a partial 256-wide
    program tile)."""
    from scaledmm.ops import nvfp4_wgmma as wg

    qa, sa = quantized(m, 320, "cpu", scale=3.0, gs=10.0)
    plain = nd.dequant(qa, sa, torch.float16)
    assert torch.equal(plain.double(), decode(qa, sa))
    assert torch.equal(nd.dequant(qa, sa, torch.float16, permute_k=True), wg.permute_k(plain))
    with pytest.raises(ValueError, match="K % 64"):
        nd.dequant(*quantized(2, 96, "cpu"), torch.float16, permute_k=True)


@interp
@pytest.mark.parametrize("m", [0, 3, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_permute_k16_is_the_wgmma_order(m, dtype):
    """``cuda_wgmma``'s W4A16 activation pass: the same values, K in
    ``permute_k``'s order (checked against torch's view / permute), from
    strided rows; K = 320: a partial program tile."""
    from scaledmm.ops import nvfp4_wgmma as wg

    x = torch.randn(m, 384, dtype=dtype)[:, :320]
    got = nd.permute_k16(x)
    want = x.reshape(m, 5, 4, 2, 2, 4).permute(0, 1, 5, 3, 2, 4).reshape(m, 320)
    assert got.is_contiguous() and torch.equal(got, want) and torch.equal(wg.permute_k(x), want)
    with pytest.raises(ValueError, match="K % 64"):
        nd.permute_k16(torch.zeros(2, 96, dtype=dtype))


def test_predecode_w_only_for_16_bit_outputs():
    cfg = nt.GemmConfig(128, 256, 64, predecode_w=True, decode="triton")
    assert nt.config_ok(cfg, triton_problem(4096))[0]
    p32 = Problem(Family.NVFP4, torch.device("cpu"), 4096, 4096, 4096, torch.uint8, torch.float32, 4096,
                  (("bias", False), ("w4a16", False)))
    assert not nt.config_ok(cfg, p32)[0]
    assert not nt.default_config(p32).predecode_w
    # opt-in only (a transient 16-bit weight copy per call, one more rounding)
    assert nt.default_config(triton_problem(4096)).predecode_w == (os.environ.get("SCALEDMM_NVFP4_PREDECODE_W") == "1")
    assert not nt.config_ok(dataclasses.replace(cfg, predecode_x=True), triton_problem(4096))[0]


def test_split_fills_the_sms():
    p = triton_problem(1)
    cfg = nt.default_config(p)
    tiles = -(-p.n // cfg.block_n)
    assert tiles * cfg.split_k >= nt.CTAS_PER_SM * nt.grid_sms(p.device) or \
        (p.k // cfg.block_k) // (2 * cfg.split_k) < nt.MIN_STEPS_PER_SPLIT


def test_mid_m_defaults_follow_the_measured_rule(monkeypatch):
    monkeypatch.setattr(nt, "grid_sms", lambda device: 132)
    for n, k, split, pre in ((6144, 4096, 4, False), (4096, 4096, 8, False), (28672, 4096, 2, True),
                             (4096, 14336, 8, False)):
        cfg = nt.default_config(triton_problem(64, n, k))
        auto = nt.split_for(cfg, 64, n, k, torch.device("cpu"))
        assert (cfg.split_k, cfg.predecode_x) == (split, pre), (n, cfg)
        assert auto in (2 * split, split)
        assert nt.config_ok(cfg, triton_problem(64, n, k))[0]
    w16 = nt.default_config(triton_problem(64, 6144, 4096, w4a16=True))  # W4A16: the plain rule
    assert w16.split_k == nt.split_for(w16, 64, 6144, 4096, torch.device("cpu")) and not w16.predecode_x
    assert nt.default_config(triton_problem(16, 6144, 4096)).split_k == 8  # other buckets unchanged


def test_quant_configs():
    assert nt.quant_config_ok(nt.DEFAULT_QUANT)[0]
    assert all(nt.quant_config_ok(c)[0] for c in nt.QUANT_CANDIDATES + tuple(QCFGS + QCFGS_STEPS))
    assert {c.variant for c in nt.QUANT_CANDIDATES} == set(ntq.VARIANTS)
    Q = nt.QuantConfig
    bad = [Q(24, 8, 4), Q(32, 8, 4, "nope"), Q(64, 32, 4, "rows_fma"),  # > 32 rows per program
           Q(2, 32, 4, "rows_fma"),                                    # < one loop step (4 rows)
           Q(32, 256, 4, "rows_pred"), Q(32, 4, 1, "rows_fma"), Q(32, 32, 16, "rows_fma"),
           Q(32, 32, 4, "rows_fma", 3), Q(32, 8, 4, prefetch=2)]
    for cfg in bad:
        assert not nt.quant_config_ok(cfg)[0], cfg
    assert Q(32, 32, 4, "rows_fma").rows_per_step() == 4 and len({c.label() for c in nt.QUANT_CANDIDATES}) == \
        len(nt.QUANT_CANDIDATES)


@interp
def test_split_k_counters_are_per_call(monkeypatch):
    """Every split-K launch gets its own zeroed counters, one per output tile,
    and the module keeps none (a buffer kept across calls would land in a
    CUDA-graph pool and be shared by every graph that captured it).  Non-zero
    counters leave the output unwritten, so the reference checks can fail."""
    handed = []
    real = nt.tile_counters

    def spy(device, tiles):
        t = real(device, tiles)
        handed.append((tiles, t.dtype, t.clone()))
        return t

    monkeypatch.setattr(nt, "tile_counters", spy)
    qa, sa = quantized(5, 256, "cpu")
    qb, sb = quantized(40, 256, "cpu", gs=20.0)
    ref = ref_mm(decode(qa, sa), decode(qb, sb), 1.0, None)
    cfgs = (nt.GemmConfig(16, 16, 64, split_k=4, decode=TT), nt.GemmConfig(32, 16, 64, split_k=3, decode=TT))
    for cfg in cfgs:
        for _ in range(2):
            out = nt.run_mm(qa, qb, sa, sb, torch.tensor(1.0), torch.float32, None, cfg)
            assert rel_err(out, ref) < 1e-5
    assert [(n, dt) for n, dt, _ in handed] == [(3, torch.int32)] * 2 + [(2, torch.int32)] * 2
    assert all(not c.any() for _, _, c in handed)
    held = [n for n, v in vars(nt).items() if isinstance(v, torch.Tensor)
            or (isinstance(v, dict) and any(isinstance(x, torch.Tensor) for x in v.values()))]
    assert not held, held
    monkeypatch.setattr(nt, "tile_counters", lambda device, tiles: torch.full((tiles,), 9, dtype=torch.int32))
    out = poison_(torch.empty(5, 40))
    monkeypatch.setattr(nt.nv, "mm_output", lambda *a: out)
    nt.run_mm(qa, qb, sa, sb, torch.tensor(1.0), torch.float32, None, cfgs[0])
    assert out.isnan().all()


@interp
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_mm_half_outputs_and_bias_dtypes(out_dtype):
    m, n, k = 5, 48, 64
    qa, sa = quantized(m, k, "cpu")
    qb, sb = quantized(n, k, "cpu", gs=100.0)
    bias = torch.randn(n).to(out_dtype)
    out = nt.run_mm(qa, qb, sa, sb, torch.tensor(0.01), out_dtype, bias, INTERP_CONFIGS[0])
    ref = ref_mm(decode(qa, sa), decode(qb, sb), 0.01, bias)
    assert out.dtype == out_dtype
    # one rounding to out_dtype (the interpreter truncates bf16: 2 ulps)
    assert ((out.double() - ref).abs() <= 2 * 2.0 ** -7 * ref.abs() + 1e-6).all()


@interp
@settings(max_examples=8)
@given(m=st.integers(1, 20), n=st.integers(1, 40), groups=st.integers(1, 9), w4a16=st.booleans(),
       cfg=st.sampled_from(INTERP_CONFIGS), log_ws=st.integers(-8, 8), seed=st.integers(0, 2**31 - 1))
def test_mm_hypothesis(m, n, groups, w4a16, cfg, log_ws, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    k = 16 * groups
    qb, sb = quantized(n, k, "cpu", scale=2.0 ** log_ws, gs=448 * 6 / 2.0 ** (log_ws + 2))
    alpha = torch.tensor(0.5)
    if w4a16:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        out = nt.run_w4a16(x, qb, sb, alpha, torch.float32, None, cfg)
        ref = ref_mm(x.double(), decode(qb, sb), alpha, None)
    else:
        qa, sa = quantized(m, k, "cpu", scale=3.0, gs=100.0)
        out = nt.run_mm(qa, qb, sa, sb, alpha, torch.float32, None, cfg)
        ref = ref_mm(decode(qa, sa), decode(qb, sb), alpha, None)
    assert rel_err(out, ref) < 1e-5


# ----------------------------------------------------------------------------
# Interpreter: through the ops (registry, opcheck, compile, fake tensors, errors)
# ----------------------------------------------------------------------------


def _op_args(m=3, n=32, k=64, device="cpu"):
    qa, sa = quantized(m, k, device)
    qb, sb = quantized(n, k, device, gs=50.0)
    return qa, qb, sa, sb, torch.tensor(0.25, device=device)


@interp
def test_backend_is_selected_and_supported():
    dev = torch.device("cpu")
    assert nt.is_supported(dev)[0]
    p = Problem(Family.NVFP4, dev, 3, 32, 64, torch.uint8, torch.bfloat16, 64, (("bias", False), ("w4a16", False)))
    assert scaledmm.backends.get("nvfp4", "triton").check(p)[0]
    with scaledmm.use_backend("nvfp4", "triton") as b:
        assert b.name == "triton"
        qa, qb, sa, sb, alpha = _op_args()
        out = torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, alpha, torch.float32)
    assert rel_err(out, ref_mm(decode(qa, sa), decode(qb, sb), alpha, None)) < 1e-5


@interp
def test_ops_opcheck():
    qa, qb, sa, sb, alpha = _op_args()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with scaledmm.use_backend("nvfp4", "triton"):
        opcheck(torch.ops.scaledmm.nvfp4_quant.default, (x, torch.tensor(30.0), True))
        opcheck(torch.ops.scaledmm.nvfp4_quant.default, (x, torch.tensor(30.0), False))
        opcheck(torch.ops.scaledmm.nvfp4_mm.default, (qa, qb, sa, sb, alpha, torch.bfloat16, torch.randn(32)))
        opcheck(torch.ops.scaledmm.nvfp4_w4a16_mm.default, (x, qb, sb, alpha, torch.float16, None))


@interp
def test_ops_compile_dynamic_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    qa, qb, sa, sb, alpha = _op_args(m=5)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    gs = torch.tensor(4.0)

    def f(x, gs, qb, sb, alpha):  # custom ops only: Inductor needs no C++ compiler
        q, s = torch.ops.scaledmm.nvfp4_quant(x, gs)
        return torch.ops.scaledmm.nvfp4_mm(q, qb, s, sb, alpha, torch.float32)

    with scaledmm.use_backend("nvfp4", "triton"):
        eager = f(x, gs, qb, sb, alpha)
        compiled = torch.compile(f, fullgraph=True, dynamic=True)
        for m in (5, 3, 0):
            xm = x[:m].contiguous()
            assert torch.equal(compiled(xm, gs, qb, sb, alpha), f(xm, gs, qb, sb, alpha))
    assert eager.shape == (5, 32)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.empty(7, 64, dtype=torch.bfloat16))
        q, s = torch.ops.scaledmm.nvfp4_quant(fx, mode.from_tensor(alpha))
        assert q.shape == (7, 32) and s.shape == (128, 4) and s.dtype == FP8


@interp
def test_ops_bad_inputs_raise():
    qa, qb, sa, sb, alpha = _op_args()
    with scaledmm.use_backend("nvfp4", "triton"):
        with pytest.raises(ValueError, match="b_scales"):
            torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb[:64], alpha)
        with pytest.raises(ValueError, match="x"):
            torch.ops.scaledmm.nvfp4_quant(torch.randn(2, 24), alpha, True)
        with pytest.raises(ValueError, match="alpha"):
            torch.ops.scaledmm.nvfp4_mm(qa, qb, sa, sb, torch.ones(2))
