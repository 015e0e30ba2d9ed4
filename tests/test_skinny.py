"""dsv3_fused_a_gemm (skinny bf16 GEMM), scaledmm.skinny_linear, SkinnyLinear,
the fused_a backend's config space and its NVRTC instantiations.

CPU tests run the reference backend; GPU tests (skipped without CUDA) run the
fused_a kernel on an sm90 device."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import requires_cuda
from helpers import nvrtc_registers, opcheck, poison_
from hypothesis import given, strategies as st

import scaledmm
from scaledmm import jit
from scaledmm.layers import SkinnyLinear
from scaledmm.ops import skinny
from scaledmm.ops import skinny_fused_a as fa

BF16 = torch.bfloat16
OP = torch.ops.scaledmm.dsv3_fused_a_gemm
SHIPPED_SHAPES = sorted(fa.TUNING)  # (N, K)
# For N = 48, K = 1152: a partial 32-row tile, clusters of 4 CTAs splitting 9
# chunks of 128 as 2 / 2 / 2 / 3, a two-stage ring.
PARTIAL_CFG = fa.TmaConfig(32, 4, 128, 2, 4)
# Version 1 on the same shape: clusters of 4 splitting 36 K units 9 / 9 / 9 / 9
# in batches of 2 (a partial last batch), L2 prefetch.
PARTIAL_V1 = fa.RegConfig(32, 4, 4, 2, True)


def _x(m, k, device="cpu", row_stride=None, offset=0):
    """bf16 [m, k]; with ``row_stride``, a view into a wider buffer at ``offset``."""
    if row_stride is None:
        return torch.randn(m, k, device=device).to(BF16)
    buf = torch.randn(max(m, 1), row_stride, device=device).to(BF16)
    return buf[:m, offset:offset + k]


def _w(n, k, device="cpu"):
    return (torch.randn(n, k, device=device) / k ** 0.5).to(BF16)


def assert_close_to_f64(out, x, w):
    """|out - x@w.T| <= 2^-8 |ref| (bf16 rounding) + 2^-16 (|x| @ |w|.T) (fp32 sums)."""
    ref = x.double() @ w.double().t()
    bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().t()) * 2.0 ** -16 + 1e-30
    assert out.shape == ref.shape and out.dtype == BF16
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all(), "non-finite output"
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, worst {float((err / bound).max()):.2f}x the bound"


# ----------------------------------------------------------------------------
# Op on the CPU (reference backend)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("m", [0, 1, 3, 9, 16])
@pytest.mark.parametrize("strided", [False, True])
def test_op_cpu_matches_f64(m, strided):
    n, k = 96, 384
    x = _x(m, k, row_stride=8704 if strided else None, offset=512 if strided else 0)
    w = _w(n, k)
    out = OP(x, w)
    assert out.shape == (m, n)
    assert_close_to_f64(out, x, w)
    assert m == 0 or out.data_ptr() != x.data_ptr()


@given(m=st.integers(0, 16), n16=st.integers(1, 12), k128=st.integers(1, 4), pad8=st.integers(0, 4),
       pdl=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_op_cpu_hypothesis(m, n16, k128, pad8, pdl, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    n, k = 16 * n16, 128 * k128
    x = _x(m, k, row_stride=k + 8 * pad8) if pad8 else _x(m, k)
    w = _w(n, k)
    assert_close_to_f64(OP(x, w, pdl), x, w)


def test_op_nan_stays_in_its_row():
    x, w = _x(4, 256), _w(32, 256)
    x[2, 7] = float("nan")
    out = OP(x, w)
    assert torch.isnan(out[2]).all()
    assert torch.isfinite(out[[0, 1, 3]]).all()


def _bad_cases():
    k, n = 256, 64
    x, w = _x(4, k), _w(n, k)
    wide = _x(4, k + 4, row_stride=None)
    return [
        ("x", dict(x=x.half(), weight=w), "dtype"),
        ("weight", dict(x=x, weight=w.float()), "dtype"),
        ("x", dict(x=x[None], weight=w), "2-D"),
        ("weight", dict(x=x, weight=w[None]), "2-D"),
        ("x", dict(x=_x(17, k), weight=w), "at most 16 rows"),
        ("weight", dict(x=x, weight=_w(24, k)), "multiple of 16"),
        ("x", dict(x=_x(4, 192), weight=_w(n, 192)), "multiple of 128"),
        ("weight", dict(x=x, weight=_w(n, 384)), "K = x.shape[1]"),
        ("x", dict(x=_x(k, 4).t(), weight=w), "unit stride"),
        ("x", dict(x=wide[:, :k], weight=w), "multiple of 8"),
        ("weight", dict(x=x, weight=_w(2 * n, k)[::2]), "contiguous"),
        ("weight", dict(x=_x(4, 2 * k)[:, ::2].contiguous(), weight=_w(n, 2 * k)[:, :k]), "contiguous"),
    ]


@pytest.mark.parametrize("arg,kwargs,what", _bad_cases())
def test_bad_inputs_name_the_argument(arg, kwargs, what):
    with pytest.raises(ValueError, match=rf"dsv3_fused_a_gemm: {arg}: .*{re.escape(what)}"):
        OP(kwargs["x"], kwargs["weight"])
    # the fake implementation rejects the same call while tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(kwargs["x"]), mode.from_tensor(kwargs["weight"])
        with pytest.raises(ValueError, match=rf"dsv3_fused_a_gemm: {arg}:"):
            OP(fx, fw)


def test_strided_single_row_any_stride_ok():
    buf = _x(1, 300)
    x = buf[:, 3:259]  # M == 1: the row stride does not matter
    w = _w(32, 256)
    assert_close_to_f64(OP(x, w), x, w)


def test_device_mix_rejected():
    with pytest.raises(ValueError, match="dsv3_fused_a_gemm: weight: expected device"):
        skinny.check_args(_x(2, 128), _w(16, 128).to("meta"))


@pytest.mark.parametrize("m,strided", [(0, False), (1, False), (5, True), (16, False)])
def test_opcheck(m, strided):
    x = _x(m, 256, row_stride=384 if strided else None, offset=128 if strided else 0)
    opcheck(OP, (x, _w(48, 256)))
    opcheck(OP, (x, _w(48, 256), True))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(_x(7, 256, row_stride=8704, offset=512))
        w = mode.from_tensor(_w(80, 256))
        out = OP(x, w)
    assert out.shape == (7, 80) and out.dtype == BF16 and out.is_contiguous()


def test_static_conditions():
    w = _w(64, 256)
    ok = skinny.static_conditions_hold
    assert ok(_x(40, 256), w)  # M is not a static condition
    assert ok(_x(3, 256, row_stride=8704, offset=512), w)
    assert not ok(_x(3, 256).half(), w)
    assert not ok(_x(3, 256), _w(24, 256))
    assert not ok(_x(3, 192), _w(64, 192))
    assert not ok(_x(3, 260)[:, :256], w)
    assert not ok(_x(3, 256), _w(128, 256)[::2])


@pytest.mark.parametrize("m", [0, 1, 5, 16, 17, 40])
def test_skinny_linear_eager(m):
    x, w = _x(m, 256), _w(64, 256)
    out = scaledmm.skinny_linear(x, w)
    assert out.shape == (m, 64)
    assert_close_to_f64(out, x, w)
    # shapes the kernel cannot take go to F.linear
    for x2, w2 in [(_x(3, 200), _w(64, 200)), (_x(m, 256), _w(24, 256))]:
        assert_close_to_f64(scaledmm.skinny_linear(x2, w2), x2, w2)


def test_skinny_linear_compiles_once_for_every_m():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    w = _w(64, 256)
    fn = torch.compile(scaledmm.skinny_linear, fullgraph=True, dynamic=True, backend=cnt)
    for m in (1, 3, 16, 17, 64):
        x = _x(m, 256)
        torch._dynamo.decorators.mark_unbacked(x, 0)  # M = 1 too, without 0/1 specialization
        out = fn(x, w)
        torch.testing.assert_close(out, scaledmm.skinny_linear(x, w), rtol=0, atol=0)
    assert cnt.frame_count == 1


def test_op_compiles_fullgraph_dynamic():
    torch._dynamo.reset()
    w = _w(32, 128)
    fn = torch.compile(lambda x, w: OP(x, w) * 2, fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (2, 5, 16):
        x = _x(m, 128)
        torch.testing.assert_close(fn(x, w), OP(x, w) * 2, rtol=0, atol=0)


# ----------------------------------------------------------------------------
# SkinnyLinear
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_layer_from_float(bias):
    lin = torch.nn.Linear(256, 48, bias=bias)
    layer = SkinnyLinear.from_float(lin)
    assert layer.weight.dtype == BF16 and layer.weight.is_contiguous()
    x = torch.randn(2, 3, 256, dtype=BF16)
    out = layer(x)
    assert out.shape == (2, 3, 48)
    ref = F.linear(x.float(), lin.weight.to(BF16).float(), None if lin.bias is None else lin.bias.to(BF16).float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    big = torch.randn(40, 256, dtype=BF16)  # M > 16: F.linear
    torch.testing.assert_close(layer(big).float(), F.linear(big.float(), layer.weight.float(),
                               None if layer.bias is None else layer.bias.float()), rtol=2e-2, atol=2e-2)


def test_layer_from_checkpoint_and_processing():
    w = torch.randn(128, 64).t()  # non-contiguous fp32 [64, 128]
    layer = SkinnyLinear.from_checkpoint({"weight": w, "bias": torch.randn(64)})
    assert layer.weight.dtype == BF16 and layer.weight.is_contiguous() and layer.bias.dtype == BF16
    before = layer.weight.data_ptr()
    layer.process_weights_after_loading()  # idempotent: no new copy
    assert layer.weight.data_ptr() == before
    assert (layer.in_features, layer.out_features) == (128, 64)
    with pytest.raises(ValueError, match="SkinnyLinear.from_checkpoint: tensors: expected a 'weight'"):
        SkinnyLinear.from_checkpoint({"w": w})
    with pytest.raises(ValueError, match="SkinnyLinear.from_checkpoint: bias:"):
        SkinnyLinear.from_checkpoint({"weight": w, "bias": torch.randn(3)})


# ----------------------------------------------------------------------------
# fused_a backend: registry, config space, NVRTC instantiations (no GPU needed)
# ----------------------------------------------------------------------------


def test_backend_registered_and_cpu_unsupported():
    assert "fused_a" in scaledmm.backends.names("skinny")
    ok, why = fa.is_supported(torch.device("cpu"))
    assert not ok and "CUDA" in why
    p = skinny.problem(_x(4, 256), _w(64, 256), False)
    assert fa.can_implement(p)[0]
    assert not fa.can_implement(skinny.problem(_x(4, 256)[:, 1:129], _w(64, 128), False))[0]  # misaligned


def test_shipped_configs_valid():
    for table in (fa.TUNING, fa.REG_TUNING):
        for (n, k), row in table.items():
            for mb, cfg in row.items():
                assert fa.config_valid(cfg, n, k, mb) == (True, "ok"), (n, k, mb, cfg)
                pdl = fa.pdl_config(cfg, n, k, mb)
                assert fa.config_valid(pdl, n, k, mb)[0]
    for n in (16, 48, 256, 576, 1536, 2112, 4096, 24576):
        for k in (128, 384, 1536, 7168):
            for mb in fa.M_BUCKETS:
                assert fa.config_valid(fa.default_config(n, k, mb), n, k, mb)[0], (n, k, mb)
                assert all(fa.config_valid(c, n, k, mb)[0] for c in fa.candidate_configs(n, k, mb))
    bad = fa.TmaConfig(rows=64, chunk=2048, stages=16)
    assert not fa.config_valid(bad, 2112, 7168, 16)[0]
    assert "warps" in fa.config_valid(fa.TmaConfig(48, warps=4), 2112, 7168, 16)[1]
    assert not fa.config_valid(fa.RegConfig(rows=64, warps=16, unroll=8), 2112, 7168, 16)[0]
    assert not fa.config_valid(fa.TmaConfig(split_k=8), 2112, 512, 8)[0]  # 2 chunks for 8 ranks
    with pytest.raises(ValueError, match="cfg: expected a valid config"):
        fa.kernel_spec(2112, 7168, 16, bad)


def test_gpu_test_configs_valid():
    """The configs the GPU tests launch are valid for their shapes (caught here, without a GPU)."""
    for cfg in (PARTIAL_CFG, PARTIAL_V1, fa.TmaConfig(16, 8, 128, 3, 2), fa.TmaConfig(48, 2, 192, 2, 3, True),
                fa.RegConfig(16, 2, 8, 1, False), fa.RegConfig(64, 4, 2, 1, True)):
        for mb in fa.M_BUCKETS:
            assert fa.config_valid(cfg, 48, 1152, mb) == (True, "ok"), cfg
    for cfg in (fa.TmaConfig(16, 1, 256, 3, 4, True), fa.TmaConfig(48, 1, 128, 4, 6),
                fa.TmaConfig(64, 1, 256, 2, 2, False, 2)):
        for mb in fa.M_BUCKETS:
            assert fa.config_valid(cfg, 16 * 132 * 4, 512, mb) == (True, "ok"), cfg
    for n, k in ((2048, 7168), (512, 2048), (48, 384), (4096, 1024)):
        for mb in fa.M_BUCKETS:
            for pdl in (False, True):
                assert fa.config_valid(fa.choose_config(n, k, mb, pdl), n, k, mb)[0]


def test_pdl_config_keeps_the_summation_order():
    """A PDL launch only gets a shallower ring (same tiles, chunks, warps: the
    same bits), small enough for two CTAs per SM when two stages allow it."""
    for (n, k), row in fa.TUNING.items():
        for mb, cfg in row.items():
            pdl = fa.pdl_config(cfg, n, k, mb)
            assert dataclasses.replace(pdl, stages=cfg.stages) == cfg
            assert pdl.smem_bytes(n, k, mb) <= fa.SMEM_TWO_PER_SM or pdl.stages == 2
            if fa.KERNEL == "tma":
                assert fa.choose_config(n, k, mb, pdl=True) == pdl
    # the default kernel (version 1): the measured table, PDL on or off alike
    if fa.KERNEL != "tma":
        for (n, k), row in fa.REG_TUNING.items():
            for mb, cfg in row.items():
                assert fa.choose_config(n, k, mb, pdl=True) == fa.choose_config(n, k, mb) == cfg


def _shipped_instantiations():
    out = {}
    for n, k in SHIPPED_SHAPES:
        for mb in fa.M_BUCKETS:
            for pdl in (False, True):
                out[(n, k, mb, fa.choose_config(n, k, mb, pdl))] = None
            out[(n, k, mb, fa.REG_TUNING[(n, k)][mb])] = None
    out[(48, 384, 8, fa.default_config(48, 384, 8))] = None
    out[(4096, 4096, 16, fa.default_config(4096, 4096, 16))] = None
    out[(4096, 4096, 16, fa.RegConfig(32, 4, 4, 2, False))] = None  # clusters + 2 tiles per warp
    out[(48, 1152, 16, PARTIAL_CFG)] = None
    out[(48, 1152, 16, PARTIAL_V1)] = None
    out[(8448, 512, 16, fa.TmaConfig(64, 1, 256, 2, 2, False, 2))] = None  # persistent, 2 subtiles per warp
    return list(out)


@pytest.mark.skipif(not jit.nvrtc_available()[0], reason="NVRTC not available")
@pytest.mark.parametrize("n,k,mb,cfg", _shipped_instantiations(),
                         ids=lambda v: v.short() if hasattr(v, "short") else str(v))
def test_instantiation_compiles_without_spills(n, k, mb, cfg):
    regs = nvrtc_registers(fa.kernel_spec(n, k, mb, cfg))
    if isinstance(cfg, fa.RegConfig):
        assert regs <= cfg.registers(mb), f"estimate {cfg.registers(mb)} below the real {regs} registers"
    else:
        assert regs * cfg.threads() * cfg.ctas_per_sm <= fa.REGS_PER_SM // 2, regs  # room for a PDL neighbour


@pytest.mark.skipif(not jit.nvrtc_available()[0], reason="NVRTC not available")
def test_kernel_checks_the_shared_memory_size():
    """The .cu file static_asserts its layout against the launcher's FA_SMEM_BYTES."""
    cfg = fa.TmaConfig(32, 2, 256, 3, 4)
    defines = dict(cfg.defines(2112, 7168, 16), FA_SMEM_BYTES=cfg.smem_bytes(2112, 7168, 16) + 16)
    spec = jit.NvrtcKernelSpec(cfg.kernel, fa.source_path(cfg.source), arch=fa.ARCH, defines=defines)
    with pytest.raises(jit.CompileError, match="FA_SMEM_BYTES"):
        spec.compile()


def test_prebuild_hook_parses_shapes():
    specs = fa.prebuild_specs("2112:7168, 576:7168")
    assert all(isinstance(s, jit.NvrtcKernelSpec) for s in specs)
    assert len({s.key for s in specs}) == len(specs) and 4 <= len(specs) <= 8
    keys = {s.key for s in specs}
    for n, k in ((2112, 7168), (576, 7168)):
        for mb in fa.M_BUCKETS:
            for pdl in (False, True):
                assert fa.kernel_spec(n, k, mb, fa.choose_config(n, k, mb, pdl)).key in keys
    with pytest.raises(ValueError, match="--skinny"):
        fa.prebuild_specs("2112x7168")


# ----------------------------------------------------------------------------
# GPU: the fused_a kernel
# ----------------------------------------------------------------------------

GPU_SHAPES = [(2112, 7168), (576, 7168), (256, 7168), (1536, 7168), (24576, 1536), (48, 384), (4096, 1024)]


def _fused_a_usable():
    return torch.cuda.is_available() and fa.is_supported(torch.device("cuda"))[0]


requires_fused_a = pytest.mark.skipif(not _fused_a_usable(), reason="needs an sm90 GPU with NVRTC")


@requires_cuda
@requires_fused_a
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_gpu_all_m(n, k, strided):
    w = _w(n, k, "cuda")
    for m in range(1, 17):
        x = _x(m, k, "cuda", row_stride=max(8704, k + 512) if strided else None, offset=512 if strided else 0)
        out = poison_(torch.empty(m, n, dtype=BF16, device="cuda"))
        fa.launch(x, w, out)
        assert_close_to_f64(out, x, w)
        with scaledmm.use_backend("skinny", "fused_a"):
            again = OP(x, w)
        assert torch.equal(again, out), "not deterministic"


@requires_cuda
@requires_fused_a
@pytest.mark.parametrize("mb", fa.M_BUCKETS)
def test_gpu_every_candidate_config(mb):
    n, k = 576, 7168
    w = _w(n, k, "cuda")
    m = mb - 1
    x = _x(m, k, "cuda")
    for cfg in fa.candidate_configs(n, k, mb, limit=64) + [fa.RegConfig(32, 4, 4, 2, False)]:
        out = poison_(torch.empty(m, n, dtype=BF16, device="cuda"))
        fa.launch(x, w, out, cfg=cfg)
        assert_close_to_f64(out, x, w)


@requires_cuda
@requires_fused_a
@pytest.mark.parametrize("cfg", [PARTIAL_CFG, PARTIAL_V1, fa.TmaConfig(16, 8, 128, 3, 2),
                                 fa.TmaConfig(48, 2, 192, 2, 3, True), fa.RegConfig(16, 2, 8, 1, False),
                                 fa.RegConfig(64, 4, 2, 1, True)],
                         ids=lambda c: c.short())
def test_gpu_partial_tiles_and_batches(cfg):
    n, k = 48, 1152
    w = _w(n, k, "cuda")
    for m in range(1, 17):
        x = _x(m, k, "cuda", row_stride=k + 64, offset=16)
        out = poison_(torch.empty(m, n, dtype=BF16, device="cuda"))
        fa.launch(x, w, out, m % 2 == 0, cfg)
        assert_close_to_f64(out, x, w)


@requires_cuda
@requires_fused_a
@pytest.mark.parametrize("cfg", [fa.TmaConfig(16, 1, 256, 3, 4, True), fa.TmaConfig(48, 1, 128, 4, 6),
                                 fa.TmaConfig(64, 1, 256, 2, 2, False, 2)], ids=lambda c: c.short())
def test_gpu_persistent_tiles(cfg):
    """More tiles than CTAs: each CTA loops over tiles (persistent grid)."""
    n, k = 16 * 132 * 4, 512
    w = _w(n, k, "cuda")
    for m in (1, 8, 13):
        x = _x(m, k, "cuda", row_stride=768, offset=128)
        out = poison_(torch.empty(m, n, dtype=BF16, device="cuda"))
        fa.launch(x, w, out, m == 8, cfg)
        assert_close_to_f64(out, x, w)


@requires_cuda
@requires_fused_a
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_reads_the_previous_output(graph):
    """A PDL launch starts early (its producer streams the weight before
    griddepcontrol.wait) but must read x only after the previous kernel, which
    writes that x, has finished."""
    w1, w2 = _w(2048, 7168, "cuda"), _w(512, 2048, "cuda")
    x = _x(9, 7168, "cuda")

    def chain():
        h = OP(x, w1, True)
        return h, OP(h, w2, True)

    h, y = chain()
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            h, y = chain()
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(BF16))
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(h, OP(x, w1, False))
    assert torch.equal(y, OP(h, w2, False))


@requires_cuda
@requires_fused_a
def test_gpu_pdl_equal_and_nan_rows():
    n, k = 2112, 7168
    w = _w(n, k, "cuda")
    for m in (1, 9, 16):
        x = _x(m, k, "cuda")
        a = OP(x, w, False)
        b = OP(x, w, True)
        assert torch.equal(a, b)
    x = _x(5, k, "cuda")
    x[3, 100] = float("inf")
    out = OP(x, w)
    assert torch.isfinite(out[[0, 1, 2, 4]]).all() and not torch.isfinite(out[3]).all()


@requires_cuda
@requires_fused_a
@pytest.mark.parametrize("m", [1, 8, 9, 16])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_cuda_graph(m, pdl):
    n, k = 2112, 7168
    w = _w(n, k, "cuda")
    x = _x(m, k, "cuda", row_stride=8704, offset=512)
    OP(x, w, pdl)  # build and load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = OP(x, w, pdl)
        out2 = OP(x, w, pdl)
    for _ in range(2):
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(BF16))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_close_to_f64(out, x, w)
        assert torch.equal(out, out2)


@requires_cuda
@requires_fused_a
def test_gpu_misaligned_falls_back_and_m0():
    w = _w(256, 7168, "cuda")
    x = _x(1, 7169, "cuda")[:, 1:]  # 2-byte offset: vector loads impossible
    assert_close_to_f64(OP(x, w), x, w)
    assert OP(_x(0, 7168, "cuda"), w).shape == (0, 256)
