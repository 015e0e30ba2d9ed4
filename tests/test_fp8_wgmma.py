"""Backend ``cuda_wgmma`` of fp8 (ops/fp8_wgmma.py, csrc/fp8_wgmma.cu):
``fp8_scaled_mm`` on TMA + e4m3 wgmma.

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

Two checks of the arithmetic.  Exact: integer-valued operands (|v| <= 8)
and power-of-two scales make every partial sum an integer below 2**24, which
any fp32 accumulation order and the tensor core's own sum keep exactly, so
the output equals the float64 reference rounded once, bit for bit (a dropped,
repeated or misplaced product shows).  Bounded, on random data with
outliers, per element (``u = 2**-24``, ``S = sum_k |p_k|``): each k32 MMA
writes a fresh fragment added to the fp32 accumulator, so a path has at most
``K + K / 16 + 8`` fp32 roundings (MMA adds, fragment adds, split-K rank adds,
the epilogue's two scale multiplies and bias add): ``(K + K / 16 + 8) u S``;
inside one k32 MMA the e4m3 tensor core adds the products with fewer bits
than fp32 (the sm90 FP8 MMA's limited accumulation precision: measured up to
``2**-12 S`` on the H200 at K = 144 and 16), which the bound takes as
``2**-10 S``; the output rounding adds half an ulp of the output dtype.
"""

from __future__ import annotations

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
MMA_REL = 2.0 ** -10  # the e4m3 tensor core's own k32 sum (module docstring)
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
            out[(n, k, fw.choose_config(n, k, m), BF16, None)] = None
    out[(4096, 4096, fw.WgmmaConfig(128, 1, 8, 4), F32, BF16)] = None
    out[(208, 4112, fw.WgmmaConfig(16, 1, 2, 2), F16, F32)] = None
    out[(1040, 144, fw.WgmmaConfig(32, 2, 8, 1), BF16, F16)] = None
    return list(out)


@nvrtc
@pytest.mark.parametrize("n,k,cfg,out_dtype,bias_dtype", _instances(),
                         ids=lambda v: v.short() if hasattr(v, "short") else str(v).replace("torch.", ""))
def test_instance_compiles_without_spills(n, k, cfg, out_dtype, bias_dtype):
    assert fw.config_valid(cfg, n, k) == (True, "ok")
    spec = fw.kernel_spec(n, k, cfg, out_dtype, bias_dtype)
    regs = nvrtc_registers(spec)
    assert regs <= cfg.registers(), f"estimate {cfg.registers()} below the real {regs} registers"
    log = io.StringIO()
    spec.compile(logs=log, ptxas_options="-v")
    assert "serialized" not in log.getvalue(), log.getvalue()  # wgmma kept asynchronous


@nvrtc
def test_every_tile_shape_within_its_estimate():
    """The estimate bounds ptxas' count over the space's extremes (the
    predicate that keeps configs under the per-quadrant limit relies on it)."""
    for cfg in (fw.WgmmaConfig(64, 2, 8, 4), fw.WgmmaConfig(128, 1, 8, 4), fw.WgmmaConfig(32, 2, 8, 4),
                fw.WgmmaConfig(16, 2, 8, 4)):
        regs = nvrtc_registers(fw.kernel_spec(4096, 4096, cfg, F32, F32))
        assert regs <= min(cfg.registers(), fw.REG_LIMIT[cfg.warpgroups]), (cfg, regs)


@nvrtc
def test_kernel_rejects_bad_defines():
    spec = jit.NvrtcKernelSpec(fw.KERNEL, fw.source_path(), arch=fw.ARCH,
                               defines=fw.WgmmaConfig().defines(64, 72, BF16, None))
    with pytest.raises(jit.CompileError, match="multiple of 16"):
        spec.compile()


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
    ("m64", 64, 128, "WgmmaConfig"),
])
def test_config_predicate(cfg, n, k, why):
    ok, reason = fw.config_valid(cfg, n, k)
    assert why in reason and ok == (why == "ok"), reason


@pytest.mark.parametrize("n,k", LLAMA8B + [(1040, 4112), (208, 144), (16, 16)])
@pytest.mark.parametrize("m", [1, 8, 17, 64, 100, 256, 4096])
def test_default_and_candidates_are_valid(n, k, m):
    cfgs = fw.candidate_configs(n, k, m)
    assert cfgs[0] == fw.choose_config(n, k, m)
    assert len(cfgs) == len(set(cfgs)) >= 2
    for cfg in cfgs:
        assert fw.config_valid(cfg, n, k) == (True, "ok"), cfg
    grid = cfgs[0].grid(n, m)
    assert grid[0] * cfgs[0].tile_m >= m and grid[1] * cfgs[0].rows() >= n


def test_tuning_table_rows_valid():
    """Every shipped row is a valid config and what dispatch uses at its M."""
    from scaledmm import kernel_tuning

    rows = kernel_tuning.load("fp8_wgmma", "sm90", fw.WgmmaConfig).by_shape()
    for (n, k), by_m in rows.items():
        for max_m, cfg in by_m.items():
            assert fw.config_valid(cfg, n, k) == (True, "ok"), (n, k, max_m, cfg)
            assert fw.tuned(n, k, min(max_m, 4096)) == cfg
            assert fw.choose_config(n, k, min(max_m, 4096)) == cfg


def test_kernel_spec_validates():
    with pytest.raises(ValueError, match="cfg:"):
        fw.kernel_spec(64, 72, fw.WgmmaConfig())
    with pytest.raises(ValueError, match="out_dtype:"):
        fw.kernel_spec(64, 128, fw.WgmmaConfig(), FP8)
    with pytest.raises(ValueError, match="bias_dtype:"):
        fw.kernel_spec(64, 128, fw.WgmmaConfig(), BF16, torch.int32)


def test_prebuild_hook():
    specs = fw.prebuild_specs("4096:4096")
    assert len({s.key for s in specs}) == len(specs) >= 3
    with pytest.raises(ValueError, match="--fp8-wgmma"):
        fw.prebuild_specs("4096x4096")


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


def _check(out, a, b, sa, sb, bias, out_dtype):
    m, k = a.shape
    n = b.shape[0]
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    A = a.double() * sa.double().reshape(-1, 1)
    B = b.double() * sb.double().reshape(-1, 1)
    ref = A @ B.t()
    if bias is not None:
        ref = ref + bias.double()
    acc_err = ((k + k // 16 + 8) * U32 + MMA_REL) * (A.abs() @ B.abs().t())
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


def _integer_operands(m, n, k, kinds):
    """Integer-valued e4m3 operands in [-8, 8] and power-of-two scales of
    ``kinds`` (2**-3 .. 2**3): every partial sum is an exact integer times a
    power of two."""
    a = torch.randint(-8, 9, (m, k), device="cuda").float().to(FP8)
    b = torch.randint(-8, 9, (n, k), device="cuda").float().to(FP8)

    def pow2(rows, kind):
        e = torch.randint(-3, 4, (max(rows, 1),), device="cuda").float().exp2()
        return e[:1] if kind == f8.TENSOR else (e.reshape(-1, 1) if kind == f8.TOKEN else e)

    return a, b, pow2(m, kinds[0]), pow2(n, kinds[1])


@requires_sm90
@pytest.mark.parametrize("m", [1, 17, 100])
@pytest.mark.parametrize("kinds", KINDS[:2], ids=lambda v: "x".join(v))
def test_gpu_integer_operands_bit_exact_every_config(m, kinds):
    n, k = 1040, 4112
    a, b, sa, sb = _integer_operands(m, n, k, kinds)
    bias = torch.randint(-50, 51, (n,), device="cuda").to(BF16)
    exact = (a.double() * sa.double().reshape(-1, 1)) @ (b.double() * sb.double().reshape(-1, 1)).t() + bias.double()
    for cfg in fw.candidate_configs(n, k, m):
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
        _check(_run(a, b, sa, sb, cfg=cfg), a, b, sa, sb, None, BF16)


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
    cfg = fw.WgmmaConfig(32, 2, 4, 4)  # split K: the rank-order reduction
    first = _run(a, b, sa, sb, cfg=cfg)
    assert torch.equal(first, _run(a, b, sa, sb, cfg=cfg))
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
    torch._dynamo.reset()
    fn = torch.compile(lambda a, sa: OPS.fp8_scaled_mm(a, b, sa, sb, None, BF16), fullgraph=True,
                       mode="reduce-overhead")
    with scaledmm.use_backend("fp8", NAME):
        for step in range(4):  # warm-up, record, replays
            fresh, _, fresh_sa, _ = _operands(64, n, k)
            a.copy_(fresh)
            sa.copy_(fresh_sa)
            got = fn(a, sa).clone()
            want = fw.wgmma_mm(a, b, sa, sb)
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"step {step}"
