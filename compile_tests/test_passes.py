"""scaledmm.compile.passes(): each rewrite shows in the post-grad graph, leaves
results unchanged, and keeps the FX graph cache working."""

import pytest
import torch

import scaledmm
import scaledmm.compile as sc
from harness import RecordingPass, inductor_code, inductor_compile, one_graph_for_all_m
from scaledmm.ops import fp8_block as fb


class BlockModel(torch.nn.Module):
    def __init__(self, n=200, k=640):
        super().__init__()
        w, ws = fb.quantize_weight(torch.randn(n, k))
        self.register_buffer("w", w)
        self.register_buffer("ws", ws)

    def forward(self, x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
        return scaledmm.fp8_block_mm(q, self.w, s, self.ws)


def test_uuid_is_stable():
    assert sc.passes().uuid() == sc.passes().uuid()
    assert isinstance(sc.passes().uuid(), (str, bytes))
    # every switch is in the uuid: graphs compiled with and without a rewrite are cached apart
    uuids = {sc.ScaledMMPass(**{k: v}).uuid() for k in ("chunk_amax", "fp8_quant", "fp8_block_quant")
             for v in (False, True)}
    assert len(uuids) == 4 and sc.passes().uuid() == sc.ScaledMMPass(fp8_quant=False, fp8_block_quant=False).uuid()


def test_options_carry_the_pass_and_pdl_unless_turned_off():
    import torch._inductor.config as inductor_config

    opts = sc.options()
    numerics = list(sc.numerics())
    assert numerics == (["eager_numerics.division_rounding"] if hasattr(inductor_config, "eager_numerics") else
                        ["emulate_divison_rounding"] if hasattr(inductor_config, "emulate_divison_rounding") else [])
    assert list(opts) == ["post_grad_custom_post_pass", "triton.enable_pdl"]
    assert opts["post_grad_custom_post_pass"].uuid() == sc.passes().uuid()
    assert opts["triton.enable_pdl"] is True and sc.options(pdl=True)["triton.enable_pdl"] is True
    assert list(sc.options(pdl=False)) == ["post_grad_custom_post_pass"]
    fused = sc.options(fuse_quant=True)
    assert list(fused) == ["post_grad_custom_post_pass", *numerics, "triton.enable_pdl"]
    assert fused["post_grad_custom_post_pass"].uuid() == sc.ScaledMMPass(fp8_quant=True, fp8_block_quant=True).uuid()
    # torch.compile takes them as they are, and the PDL switch holds for that compile only
    before = inductor_config.triton.enable_pdl
    torch._dynamo.reset()
    m = BlockModel()
    x = torch.randn(3, 640, dtype=torch.bfloat16)
    cm = torch.compile(m, fullgraph=True, options=sc.options(pdl=True))
    with torch.no_grad():
        torch.testing.assert_close(cm(x), torch.compile(m, fullgraph=True, options=sc.options(pdl=False))(x),
                                   rtol=0, atol=0)
    assert inductor_config.triton.enable_pdl == before


def test_fp8_block_cond_lowered_and_quant_fused():
    m = BlockModel()
    p = sc.passes()
    x = torch.randn(3, 640, dtype=torch.bfloat16)
    code = inductor_code(m, (x,), post_grad_custom_post_pass=p)
    assert p.stats["size_conds"] == 1 and p.stats["quant_gemm"] == 1
    assert "torch.ops.scaledmm.fp8_block_linear.default" in code
    assert "cond" not in code and "per_token_group_quant_fp8" not in code
    # without the pass: the cond and both branches are in the code
    code0 = inductor_code(m, (x,))
    assert "padded_fp8_block_mm" in code0 and "per_token_group_quant_fp8" in code0


def test_results_unchanged_across_m():
    m = BlockModel()
    torch._dynamo.reset()
    cm = torch.compile(m, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": sc.passes()})
    with one_graph_for_all_m():
        for mm in (1, 3, 4, 17, 64, 0):
            x = torch.randn(mm, 640, dtype=torch.bfloat16)
            # the fused op skips the M padding of the eager path: fp32 sums may
            # round differently (another summation order), by one bf16 ulp
            torch.testing.assert_close(cm(x), m(x))


def test_pass_leaves_other_graphs_alone():
    p = sc.passes()

    def f(x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, False, True)  # ue8m0: not fusable
        return q.float() * s.repeat_interleave(128, 1)

    x = torch.randn(5, 256, dtype=torch.bfloat16)
    code = inductor_code(f, (x,), post_grad_custom_post_pass=p)
    assert p.stats == {"size_conds": 0, "quant_gemm": 0, "nvfp4_epilogue": 0, "nvfp4_amax": 0, "fp8_quant": 0,
                       "fp8_block_quant": 0}
    assert "per_token_group_quant_fp8" in code


class OpaqueBlockModel(BlockModel):
    """quant -> dynamic_padded GEMM: no cond (torch 2.11-2.13 never cache a
    graph holding a torch.cond: 'Can't cache HigherOrderOperator: cond')."""

    def forward(self, x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
        return torch.ops.scaledmm.dynamic_padded_fp8_block_mm(q, self.w, s, self.ws)


def test_fx_graph_cache_hits_with_the_pass():
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    m = OpaqueBlockModel()
    counters.clear()
    x = torch.randn(5, 640, dtype=torch.bfloat16)
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            cm = torch.compile(m, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": sc.passes()})
            cm(x)
        assert counters["inductor"]["fxgraph_cache_miss"] >= 1
        assert counters["inductor"]["fxgraph_cache_hit"] >= 1
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    p = sc.passes()
    code = inductor_code(m, (x,), post_grad_custom_post_pass=p)
    assert p.stats["quant_gemm"] == 1 and "fp8_block_linear" in code


def test_skinny_cond_lowered_to_dynamic_op():
    w = torch.randn(64, 256, dtype=torch.bfloat16)

    def f(x):
        return scaledmm.skinny_linear(x, w)

    p = sc.passes()
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    code = inductor_code(f, (x,), post_grad_custom_post_pass=p)
    assert p.stats["size_conds"] == 1
    assert "torch.ops.scaledmm.dynamic_skinny_linear.default" in code and "cond" not in code
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": sc.passes()})
    with one_graph_for_all_m():
        for m in (1, 5, 16, 17, 40, 0):
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            torch.testing.assert_close(cf(x), f(x))
    ref = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.ops.scaledmm.dynamic_skinny_linear(ref, w),
                               torch.ops.scaledmm.dsv3_fused_a_gemm(ref, w), rtol=0, atol=0)
    from helpers import opcheck

    for m in (0, 3, 20):
        opcheck(torch.ops.scaledmm.dynamic_skinny_linear.default, (torch.randn(m, 256, dtype=torch.bfloat16), w))


# ----------------------------------------------------------------------------
# pass (c): nvfp4_mm(...) * alpha (+ bias) folded into nvfp4_mm's arguments
# ----------------------------------------------------------------------------

NV_N, NV_K = 200, 640


class NvFp4Epilogue(torch.nn.Module):
    """quantize -> nvfp4_mm -> an epilogue chosen by ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        w = torch.randn(NV_N, NV_K)
        gs_w = (448.0 * 6.0 / w.abs().amax()).reshape(1)
        qw, sw = torch.ops.scaledmm.nvfp4_quant(w, gs_w, True)
        gs = torch.tensor([448.0 * 6.0 / 4.0])
        self.register_buffer("qw", qw)
        self.register_buffer("sw", sw)
        self.register_buffer("gs", gs)
        self.register_buffer("a0", 1.0 / (gs * gs_w))
        self.register_buffer("scale", torch.tensor(0.37))  # 0-D: bf16 * scale stays bf16
        self.register_buffer("scale1", torch.tensor([1.7]))  # [1]: bf16 * scale1 is fp32
        self.register_buffer("bias", torch.randn(NV_N, dtype=torch.bfloat16))
        self.register_buffer("bias32", torch.randn(NV_N))
        self.register_buffer("b0", torch.randn(NV_N, dtype=torch.bfloat16))
        self.register_buffer("col", torch.rand(NV_N) + 0.5)

    def mm(self, x, out_dtype=torch.bfloat16, bias=None):
        q, s = torch.ops.scaledmm.nvfp4_quant(x, self.gs, True)
        return torch.ops.scaledmm.nvfp4_mm(q, self.qw, s, self.sw, self.a0, out_dtype, bias)

    def forward(self, x):
        k = self.kind
        if k == "mul":
            return self.mm(x) * self.scale
        if k == "scale_mul_promoting":
            return self.scale1 * self.mm(x)
        if k == "mul_mul_bias":
            return self.mm(x) * self.scale * self.scale1 + self.bias32
        if k == "f32_mul_bias_cast":
            return (self.mm(x, torch.float32) * self.scale + self.bias).to(torch.bfloat16)
        if k == "bias":
            return self.bias + self.mm(x)
        if k == "mul_vector":  # a per-column scale is not an alpha
            return self.mm(x) * self.col
        if k == "bias_then_mul":  # the bias folds, the mul (it would scale the bias) stays
            return (self.mm(x) + self.bias) * self.scale
        if k == "has_bias_add_mul":  # the mm has a bias already: nothing folds
            return (self.mm(x, bias=self.b0) + self.bias) * self.scale
        raise AssertionError(k)


# kind -> (folds, alpha folded, bias folded, output dtype)
EPILOGUES = {
    "mul": (1, True, False, torch.bfloat16),
    "scale_mul_promoting": (1, True, False, torch.float32),
    "mul_mul_bias": (1, True, True, torch.float32),
    "f32_mul_bias_cast": (1, True, True, torch.bfloat16),
    "bias": (1, False, True, torch.bfloat16),
    "mul_vector": (0, False, False, torch.float32),
    "bias_then_mul": (1, False, True, torch.bfloat16),
    "has_bias_add_mul": (0, False, False, torch.bfloat16),
}


def _exact_epilogue(model, x):
    """The float64 value of ``model(x)`` from the GEMM's float32 result (no
    rounding after it), and the magnitude each rounding is relative to
    (|terms| summed)."""
    y = model.mm(x, torch.float32).double()
    s, s1 = float(model.scale), float(model.scale1)
    bias, bias32, b0 = model.bias.double(), model.bias32.double(), model.b0.double()
    terms = {
        "mul": ([y * s], 1.0),
        "scale_mul_promoting": ([y * s1], 1.0),
        "mul_mul_bias": ([y * s * s1, bias32], 1.0),
        "f32_mul_bias_cast": ([y * s, bias], 1.0),
        "bias": ([y, bias], 1.0),
        "mul_vector": ([y * model.col.double()], 1.0),
        "bias_then_mul": ([y, bias], s),
        "has_bias_add_mul": ([y, b0, bias], s),
    }[model.kind]
    parts, outer = terms
    exact = sum(parts) * outer
    mag = sum(p.abs() for p in parts) * abs(outer)
    return exact, mag


@pytest.mark.parametrize("kind", list(EPILOGUES))
def test_nvfp4_epilogue_folding(kind):
    folds, alpha_folded, bias_folded, out_dtype = EPILOGUES[kind]
    model = NvFp4Epilogue(kind)
    rec = RecordingPass(sc.passes())
    cm, code = inductor_compile(model, (torch.randn(3, NV_K, dtype=torch.bfloat16),),
                                post_grad_custom_post_pass=rec)
    assert rec.stats["nvfp4_epilogue"] == folds
    (mm,) = rec.find("scaledmm.nvfp4_mm")
    calls = [line for line in code.splitlines() if "torch.ops.scaledmm.nvfp4_mm.default(" in line]
    assert len(calls) == 1
    # the rewrite as Inductor emits it: alpha becomes a product, bias an argument
    assert (mm["args"][4] == "aten.mul.Tensor") == alpha_folded, mm
    has_bias = len(mm["args"]) > 6 and mm["args"][6] is not None
    assert has_bias == (bias_folded or kind == "has_bias_add_mul"), mm
    assert calls[0].rstrip().endswith("None)") == (not has_bias), calls[0]
    if folds and kind not in ("bias_then_mul",):
        assert mm["users"] == ["output"], mm  # nothing left after the GEMM
        assert mm["args"][5] == out_dtype and str(out_dtype) in calls[0], calls[0]
    else:
        assert mm["users"] != ["output"], mm  # the epilogue left alone, fully or in part
    with one_graph_for_all_m():
        for m in (3, 1, 17, 64, 0):
            x = torch.randn(m, NV_K, dtype=torch.bfloat16)
            got, want = cm(x), model(x)
            assert got.shape == want.shape == (m, NV_N) and got.dtype == want.dtype == out_dtype
            exact, mag = _exact_epilogue(model, x)
            # eager rounds after the GEMM and after each epilogue op (<= 3
            # roundings, each <= 2^-8 relative in bf16); the compiled chain at most as often
            for out in (got, want):
                assert ((out.double() - exact).abs() <= 3 * 2.0 ** -8 * mag + 1e-30).all()
            if mm["users"] == ["output"]:
                # fully folded: one rounding of the float32 epilogue, to out_dtype
                u = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -24
                assert ((got.double() - exact).abs() <= u * exact.abs() + 2.0 ** -20 * mag).all()


def test_fp8_block_cond_without_quant_lowers_to_the_padded_op():
    """Pre-quantized operands (nothing to fuse): the lowered cond must stay an
    op that pads M for an aligned-M backend.  Lowered to plain fp8_block_mm,
    M = 3 would reach a backend that needs M % 4 == 0."""
    from scaledmm import backends

    w, ws = fb.quantize_weight(torch.randn(200, 640))

    def f(q, s):
        return scaledmm.fp8_block_mm(q, w, s, ws)

    def quant(m):
        return torch.ops.scaledmm.per_token_group_quant_fp8(torch.randn(m, 640, dtype=torch.bfloat16))

    rec = RecordingPass(sc.passes())
    cf, code = inductor_compile(f, quant(3), post_grad_custom_post_pass=rec)
    assert rec.stats["size_conds"] == 1 and rec.stats["quant_gemm"] == 0
    ours = [n["target"] for n in rec.nodes if n["target"].startswith("scaledmm.")]
    assert ours == ["scaledmm.dynamic_padded_fp8_block_mm"], ours
    assert "cond" not in code

    seen = []

    def aligned_only(p):
        return (p.m % 4 == 0, f"needs M % 4 == 0, got M={p.m}")

    def mm(a, b, sa, sb, block_size, out_dtype):
        seen.append(a.shape[0])
        return fb.reference_mm_f32(a, b, sa, sb, block_size).to(out_dtype)

    backends.register(backends.Backend(fb.FAMILY, "t_aligned4", impls={"fp8_block_mm": mm},
                                       can_implement=aligned_only, needs_m_multiple=4))
    try:
        with scaledmm.use_backend("fp8_block", "t_aligned4"), one_graph_for_all_m():
            for m in (3, 1, 17, 4, 0):
                q, s = quant(m)
                want = fb.reference_mm_f32(q, w, s, ws, (128, 128)).to(torch.bfloat16)
                torch.testing.assert_close(cf(q, s), want)
    finally:
        backends.unregister(fb.FAMILY, "t_aligned4")
    assert seen and all(r % 4 == 0 for r in seen), seen


class Fp8Model(torch.nn.Module):
    """quant_fp8 -> fp8_scaled_mm, the two ops a user may call for a per-channel layer."""

    def __init__(self, n=208, k=640, per_token=True, static=False):
        super().__init__()
        from scaledmm.ops import fp8 as f8

        w, ws = f8.reference_quant(torch.randn(n, k), None, True)
        self.register_buffer("w", w)
        self.register_buffer("ws", ws.reshape(-1).contiguous())
        self.register_buffer("bias", torch.randn(n, dtype=torch.bfloat16))
        self.register_buffer("scale", torch.full((1,), 0.02) if static else None)
        self.per_token = per_token

    def forward(self, x):
        q, s = torch.ops.scaledmm.quant_fp8(x, self.scale, self.per_token)
        return torch.ops.scaledmm.fp8_scaled_mm(q, self.w, s, self.ws, self.bias)


@pytest.mark.parametrize("per_token,static", [(True, False), (False, False), (False, True)])
def test_fp8_quant_and_scaled_mm_fused_into_fp8_linear(per_token, static):
    m = Fp8Model(per_token=per_token, static=static)
    p = sc.passes()
    x = torch.randn(3, 640, dtype=torch.bfloat16)
    code = inductor_code(m, (x,), post_grad_custom_post_pass=p)
    assert p.stats["quant_gemm"] == 1
    assert "torch.ops.scaledmm.fp8_linear.default" in code
    assert "quant_fp8" not in code and "fp8_scaled_mm" not in code
    torch._dynamo.reset()
    cm = torch.compile(m, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": sc.passes()})
    with one_graph_for_all_m():
        for mm in (1, 3, 17, 64, 0):
            x = torch.randn(mm, 640, dtype=torch.bfloat16)
            assert torch.equal(cm(x), m(x))  # CPU: fp8_linear runs its two ops (composite)


def test_fp8_pair_not_fused_when_the_codes_are_read_elsewhere():
    m = Fp8Model()
    p = sc.passes()

    def f(x):
        q, s = torch.ops.scaledmm.quant_fp8(x, None, True)
        return torch.ops.scaledmm.fp8_scaled_mm(q, m.w, s, m.ws), q.float().sum()

    code = inductor_code(f, (torch.randn(3, 640, dtype=torch.bfloat16),), post_grad_custom_post_pass=p)
    assert p.stats["quant_gemm"] == 0 and "fp8_linear" not in code


# ----------------------------------------------------------------------------
# pass (d): the row amax of a pointwise producer, taken per 2048 values
# ----------------------------------------------------------------------------


class AmaxProducer(torch.nn.Module):
    """A producer chosen by ``kind`` feeding W4A4 ``NvFp4Linear`` layers with a dynamic input scale."""

    def __init__(self, kind, k):
        super().__init__()
        from scaledmm.layers.nvfp4 import NvFp4Linear

        self.kind, self.k = kind, k
        self.lin = NvFp4Linear.from_float(torch.nn.Linear(k, 48, bias=False, dtype=torch.bfloat16))
        self.lin2 = NvFp4Linear.from_float(torch.nn.Linear(k, 40, bias=False, dtype=torch.bfloat16))
        self.norm = torch.nn.RMSNorm(k, dtype=torch.bfloat16)
        torch.nn.init.uniform_(self.norm.weight, 0.5, 1.5)
        # rows of a static width K, as a model's projections give them (a dynamic input width would make K
        # symbolic), from products alone: every compile rounds them alike (no exp, no sums, no FMA)
        self.register_buffer("g", torch.randn(2, k, dtype=torch.bfloat16))

    def forward(self, x):
        if self.kind == "rmsnorm":
            return self.lin(self.norm(x[:, 0, None] * self.g[0]))
        a = torch.relu(x[:, 0, None] * self.g[0]) * (x[:, 1, None] * self.g[1])
        if self.kind == "two_readers":
            return self.lin(a), self.lin2(a)
        return self.lin(a)


# kind, K -> partial-amax rewrites (two_readers: one if Inductor's CSE has merged the layers' identical amaxes)
AMAX_CASES = {("act_mul", 8192): 1, ("act_mul", 10240): 1, ("two_readers", 8192): (1, 2),
              ("rmsnorm", 8192): 0, ("act_mul", 4096): 0, ("act_mul", 9216): 0}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("kind,k", list(AMAX_CASES))
def test_nvfp4_amax_per_chunk_after_pointwise_producers(kind, k, device):
    # an inference graph (nvfp4_dynamic_linear has no backward)
    model = AmaxProducer(kind, k).requires_grad_(False).to(device)
    width = 2  # the producers read columns 0 and 1
    rec = RecordingPass(sc.passes())
    # bf16 intermediates rounded as in eager, so that every compile's amax sees the bf16 activation
    exact = {"emulate_precision_casts": True}
    cm, _ = inductor_compile(model, (torch.randn(3, width, dtype=torch.bfloat16, device=device),),
                             post_grad_custom_post_pass=rec, **exact)
    want = AMAX_CASES[(kind, k)]
    assert rec.stats["nvfp4_amax"] in (want if isinstance(want, tuple) else (want,))
    amaxes = rec.find("aten.amax")
    chunked = [a for a in amaxes if a["args"][0] == "aten.view"]
    assert len(chunked) == rec.stats["nvfp4_amax"] and all(a["args"][1] == [2] for a in chunked), amaxes
    if not want:
        return
    # the graph without the rewrite, and eager, give the same bits: the maximum of the parts is the row maximum
    rec0 = RecordingPass(sc.ScaledMMPass(chunk_amax=False))
    cm0, _ = inductor_compile(model, (torch.randn(3, width, dtype=torch.bfloat16, device=device),),
                              post_grad_custom_post_pass=rec0, **exact)
    assert rec0.stats["nvfp4_amax"] == 0
    with one_graph_for_all_m():
        for m in (0, 1, 3, 17, 300):
            x = torch.randn(m, width, dtype=torch.bfloat16) * torch.logspace(-3, 3, m).reshape(m, 1).bfloat16()
            x = x.to(device)
            if m == 17:
                x[4, 0] = float("inf")  # non-finite values count as 0 in a row's amax, chunked or not
                x[9, 1] = float("nan")
            got, ref, eager = cm(x), cm0(x), model(x)
            for g, r, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, ref, eager))):
                assert g.shape[0] == m
                torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)
                torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------
# pass (e): per-token FP8 quantization in the producer's kernel
# ----------------------------------------------------------------------------


class QuantProducer(torch.nn.Module):
    """Two FP8 layers (``lin``, ``lin2``) behind the producers a decoder layer has."""

    def __init__(self, kind, lin, lin2):
        super().__init__()
        k = lin.in_features
        self.kind, self.lin, self.lin2 = kind, lin, lin2
        self.norm = torch.nn.RMSNorm(k, dtype=torch.bfloat16)
        torch.nn.init.uniform_(self.norm.weight, 0.5, 1.5)
        # rows of a static width from products alone (no exp: every compile and eager round them alike)
        self.register_buffer("g", torch.randn(2, k, dtype=torch.bfloat16))

    def forward(self, x):
        h = x[:, 0, None] * self.g[0]
        if self.kind == "rmsnorm":
            return self.lin(self.norm(h))
        if self.kind == "two_readers":  # q / k / v as separate layers: one quantization
            a = self.norm(h)
            return self.lin(a), self.lin2(a)
        if self.kind == "transpose":  # attention's [H, S, D] output, copied to [S, H * D]
            k = self.g.shape[1]
            heads = (h.view(-1, 4, k // 4).transpose(0, 1) * self.g[1].view(4, 1, k // 4))
            return self.lin(heads.transpose(0, 1).reshape(-1, k))
        return self.lin(torch.relu(h) * (x[:, 1, None] * self.g[1]))


def token_layers(kind, k=256):
    from scaledmm.layers.fp8 import Fp8Linear

    def layer(n, activation="dynamic_per_token"):
        return Fp8Linear.from_float(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16), per_channel=True,
                                    activation=activation)

    return layer(48, "dynamic" if kind == "per_tensor" else "dynamic_per_token"), layer(40)


def assert_same_quantized_layers(cm, cm0, model, device, vs_eager):
    """``cm`` (the rewrite) gives ``cm0``'s bits (without it), and eager's
    where ``vs_eager``, for every M: rows from 1e-12 (below the amax floor's
    reach) to 1e6; at M = 17 an Inf row, a NaN row (non-finite scales in that
    row alone) and an all-zero row (the floor)."""
    with one_graph_for_all_m():
        for m in (0, 1, 3, 17, 300):
            x = torch.randn(m, 2, dtype=torch.bfloat16) * torch.logspace(-12, 6, m).reshape(m, 1).bfloat16()
            x = x.to(device)
            if m == 17:
                x[4, 0] = float("inf")
                x[9, 1] = float("nan")
                x[11] = 0
            got, ref, eager = cm(x), cm0(x), model(x)
            for g, r, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, ref, eager))):
                assert g.shape[0] == m
                torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)
                if vs_eager:
                    torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


# kind -> rewrites
TOKEN_QUANT_CASES = {"rmsnorm": 1, "act_mul": 1, "two_readers": 2, "transpose": 1, "per_tensor": 0}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("kind", list(TOKEN_QUANT_CASES))
def test_fp8_token_quant_in_the_producer_kernel(kind, device):
    model = QuantProducer(kind, *token_layers(kind)).requires_grad_(False).to(device)
    width = 2  # the producers read columns 0 and 1
    rec = RecordingPass(sc.ScaledMMPass(fp8_quant=True))
    # bf16 intermediates rounded as in eager: the fused quantizer then sees eager's activation
    exact = {"emulate_precision_casts": True}
    cm, code = inductor_compile(model, (torch.randn(3, width, dtype=torch.bfloat16, device=device),),
                                post_grad_custom_post_pass=rec, **exact)
    want = TOKEN_QUANT_CASES[kind]
    assert rec.stats["fp8_quant"] == want
    assert len(rec.find("scaledmm.fp8_scaled_mm")) == want
    assert len(rec.find("scaledmm.fp8_linear")) == (0 if want else 1)
    if want:
        assert "quant_fp8" not in code and len(rec.find("aten.amax")) == 1  # two readers share one
    rec0 = RecordingPass(sc.passes())  # off by default
    cm0, _ = inductor_compile(model, (torch.randn(3, width, dtype=torch.bfloat16, device=device),),
                              post_grad_custom_post_pass=rec0, **exact)
    assert rec0.stats["fp8_quant"] == 0
    # a compiled norm sums in its own order: eager's bits only behind the other producers
    assert_same_quantized_layers(cm, cm0, model, device, vs_eager=kind not in ("rmsnorm", "two_readers"))


def test_fp8_token_quant_left_alone_for_a_graph_input():
    from scaledmm.layers.fp8 import Fp8Linear

    lin = Fp8Linear.from_float(torch.nn.Linear(256, 48, bias=False, dtype=torch.bfloat16), per_channel=True,
                               activation="dynamic_per_token").requires_grad_(False)
    rec = RecordingPass(sc.ScaledMMPass(fp8_quant=True))
    code = inductor_code(lin, (torch.randn(3, 256, dtype=torch.bfloat16),), post_grad_custom_post_pass=rec)
    assert rec.stats["fp8_quant"] == 0 and "fp8_linear" in code


def test_fp8_token_scale_divisions_in_float64_round_as_float32_ones():
    # the rewrite computes s = max(amax, 1e-10) / 448 and 1 / s in float64 (Inductor may lower a float32
    # division to an approximate one, or a constant divisor to a multiply by its reciprocal): rounded once
    # to float32 they must be the IEEE float32 quotients, including via the reciprocal of 448
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0x2edbe6ff, 0x7f800000, (1 << 22,), generator=g, dtype=torch.int64)  # 1e-10 .. max
    c = bits.to(torch.int32).view(torch.float32)
    s = c / torch.tensor(448.0)
    assert torch.equal((c.double() / 448.0).float(), s)
    assert torch.equal((c.double() * (1.0 / 448.0)).float(), s)
    assert torch.equal((1.0 / s.double()).float(), torch.reciprocal(s))


def group_layers(kind, k=512):
    from scaledmm.layers.fp8_block import Fp8BlockLinear

    return (Fp8BlockLinear.from_float(torch.nn.Linear(k, 256, bias=kind == "bias", dtype=torch.bfloat16)),
            Fp8BlockLinear.from_float(torch.nn.Linear(k, 128, bias=False, dtype=torch.bfloat16)))


GROUP_QUANT_CASES = {"rmsnorm": 1, "act_mul": 1, "two_readers": 2, "transpose": 1, "bias": 1}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("kind", list(GROUP_QUANT_CASES))
def test_fp8_group_quant_in_the_producer_kernel(kind, device):
    if not sc.numerics():
        pytest.skip("this torch has no Inductor option for IEEE float32 divisions")
    model = QuantProducer(kind, *group_layers(kind)).requires_grad_(False).to(device)
    exact = {"emulate_precision_casts": True, **sc.numerics()}
    rec = RecordingPass(sc.ScaledMMPass(fp8_block_quant=True))
    cm, code = inductor_compile(model, (torch.randn(3, 2, dtype=torch.bfloat16, device=device),),
                                post_grad_custom_post_pass=rec, **exact)
    want = GROUP_QUANT_CASES[kind]
    assert rec.stats["fp8_block_quant"] == want
    assert "fp8_block_linear" not in code and "per_token_group_quant_fp8" not in code
    assert len(rec.find("scaledmm.dynamic_padded_fp8_block_mm")) == want
    assert len(rec.find("aten.amax")) == 1  # two readers share one quantization
    # without IEEE divisions in Inductor's kernels, the op stays whole
    rec1 = RecordingPass(sc.ScaledMMPass(fp8_block_quant=True))
    inductor_compile(model, (torch.randn(3, 2, dtype=torch.bfloat16, device=device),),
                     post_grad_custom_post_pass=rec1, emulate_precision_casts=True,
                     **{k: False for k in sc.numerics()})
    assert rec1.stats["fp8_block_quant"] == 0 and len(rec1.find("scaledmm.fp8_block_linear")) == want
    rec0 = RecordingPass(sc.passes())  # off by default
    cm0, _ = inductor_compile(model, (torch.randn(3, 2, dtype=torch.bfloat16, device=device),),
                              post_grad_custom_post_pass=rec0, **exact)
    assert_same_quantized_layers(cm, cm0, model, device, vs_eager=kind not in ("rmsnorm", "two_readers"))
