"""Backend ``cuda_gemv`` of fp8 / fp8_block (ops/fp8_gemv.py, csrc/fp8_gemv.cu):
``fp8_linear`` and ``fp8_block_linear`` as one launch at M <= 16.

CPU: NVRTC compiles (sm_90a, no GPU needed) of every instance the dispatch
picks for the Llama-3-8B and DeepSeek-V3 shapes in every scale mode, with no
spills and within the config's register estimate; the config predicate and
rule; argument checks; its place in the sm90 policy and its switch.  GPU
(skipped without an sm90 GPU): the codes and scales it computes equal the
quantizers' bit for bit (NaN / Inf rows, static scales, groups); the output
within a float64 bound of the GEMM of those codes; odd N, strided rows, M = 0,
poisoned outputs, every candidate config, CUDA graphs and determinism.

The bound for one output element (``u = 2**-24``): the e4m3 products are
exact in fp32; a path has at most ``K`` adds in the MMAs and the warp /
cluster sums, ``2 K / 128`` more for the per-block scale multiply-adds, and
four for the epilogue's scales and bias, so ``|acc - sum p| <= n u sum|p|``
with ``n = K + 2 K / 128 + 8``; the output rounding adds half an ulp of the
output dtype (``2**-8`` relative for bf16's 7 stored bits).
"""

from __future__ import annotations

import pytest
import torch
from helpers import nvrtc_registers, poison_

import scaledmm
from scaledmm import backends, jit
from scaledmm.backends import Family, Problem
from scaledmm.ops import fp8 as f8
from scaledmm.ops import fp8_block as fb
from scaledmm.ops import fp8_gemv as fg

FP8 = torch.float8_e4m3fn
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LLAMA8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
DSV3 = [(2112, 7168), (24576, 1536), (7168, 18432), (36864, 7168)]
# (ascale, bscale): the three layer formats, static scales
MODES = [("per_token", "channel"), ("per_tensor", "tensor"), ("group", "block"), ("static", "tensor"),
         ("static_token", "channel")]
U32 = 2.0 ** -24
OUT_HALF_ULP = {BF16: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -24}  # relative: 7, 10, 23 stored bits
OUT_TINY = {BF16: 0.0, F16: 2.0 ** -25, F32: 2.0 ** -150}  # half the smallest subnormal
nvrtc = pytest.mark.skipif(not jit.nvrtc_available()[0], reason="NVRTC not available")
requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm90 GPU")


# ----------------------------------------------------------------------------
# Config space and NVRTC instances (CPU)
# ----------------------------------------------------------------------------


def _instances():
    out = {}
    for n, k in LLAMA8B + DSV3:
        for mb in fg.M_BUCKETS:
            cfg = fg.choose_config(n, k, mb)
            for ascale, bscale in MODES[:3]:
                out[(n, k, mb, cfg, ascale, bscale, BF16, BF16, None)] = None
    # the other dtypes and a bias, on one shape
    cfg = fg.choose_config(4096, 4096, 8)
    for in_dt, out_dt, bias in ((F16, F16, F32), (BF16, F32, BF16), (F16, BF16, F16)):
        out[(4096, 4096, 8, cfg, "static_token", "channel", in_dt, out_dt, bias)] = None
        out[(4096, 4096, 8, cfg, "group", "block", in_dt, out_dt, bias)] = None
    return list(out)


@nvrtc
@pytest.mark.parametrize("n,k,mb,cfg,ascale,bscale,in_dt,out_dt,bias", _instances(),
                         ids=lambda v: v.short() if isinstance(v, fg.GemvConfig) else str(v).replace("torch.", ""))
def test_instance_compiles_without_spills(n, k, mb, cfg, ascale, bscale, in_dt, out_dt, bias):
    regs = nvrtc_registers(fg.kernel_spec(n, k, mb, cfg, ascale, bscale, in_dt, out_dt, bias))
    assert regs <= cfg.registers(mb), (regs, cfg.registers(mb))


@nvrtc
def test_every_candidate_of_one_shape_compiles_within_its_estimate():
    """The register estimate is an upper bound over the candidate space (the
    predicate that keeps configs under the limit relies on it).  Spills are
    checked on the configs dispatch uses (above), not on every candidate."""
    import io
    import re

    for mb in fg.M_BUCKETS:
        for cfg in fg.candidate_configs(4096, 4096, mb)[:12]:
            log = io.StringIO()
            fg.kernel_spec(4096, 4096, mb, cfg, "group", "block").compile(logs=log, ptxas_options="-v")
            regs = int(re.search(r"Used (\d+) registers", log.getvalue()).group(1))
            assert regs <= cfg.registers(mb), (cfg, mb, regs)


@pytest.mark.parametrize("cfg,n,k,mb,why", [
    (fg.GemvConfig(64, 4, 1, 1), 4096, 4096, 8, "rows must be 16 or 32"),
    (fg.GemvConfig(16, 4, 3, 1), 4096, 4096, 8, "split_k must be"),
    (fg.GemvConfig(16, 17, 1, 1), 4096, 4096, 8, "warps must be"),
    (fg.GemvConfig(16, 4, 1, 5), 4096, 4096, 8, "unroll must be"),
    (fg.GemvConfig(32, 8, 1, 4), 4096, 4096, 8, "registers per thread"),
    (fg.GemvConfig(16, 4, 1, 1), 4096, 4000, 8, "multiple of 128"),
    (fg.GemvConfig(16, 4, 8, 1), 4096, 512, 8, "exceeds the 4"),
    (fg.GemvConfig(16, 4, 1, 1), 4096, 18432, 16, "split K further"),
    (fg.GemvConfig(16, 4, 1, 1), 4096, 4096, 4, "m_bucket must be"),
    ("r16", 4096, 4096, 8, "expected a GemvConfig"),
])
def test_config_predicate_rejects(cfg, n, k, mb, why):
    ok, reason = fg.config_valid(cfg, n, k, mb)
    assert not ok and why in reason, reason


@pytest.mark.parametrize("n,k", LLAMA8B + DSV3 + [(16, 128), (200, 1152), (1024, 4096)])
@pytest.mark.parametrize("mb", fg.M_BUCKETS)
def test_default_and_candidates_are_valid(n, k, mb):
    cands = fg.candidate_configs(n, k, mb)
    assert cands[0] == fg.choose_config(n, k, mb) and len(set(cands)) == len(cands)
    for cfg in cands:
        assert fg.config_valid(cfg, n, k, mb) == (True, "ok"), cfg


def test_shared_memory_of_a_launch():
    cfg = fg.GemvConfig(16, 8, 2, 1)
    # 4096 / 128 = 32 units, 16 per CTA: 2048 + 8 bytes a row; groups add 16 floats a row
    assert cfg.pitch(4096) == 2056 and cfg.smem(4096, 3, False) == 3 * 2056
    assert cfg.smem(4096, 3, True) == 3 * 2056 + 3 * 16 * 4


def test_kernel_spec_validates():
    cfg = fg.choose_config(4096, 4096, 8)
    with pytest.raises(ValueError, match="ascale, bscale: 1x128 groups go with 128x128 blocks"):
        fg.kernel_spec(4096, 4096, 8, cfg, "group", "channel")
    with pytest.raises(ValueError, match="^ascale: expected one of"):
        fg.kernel_spec(4096, 4096, 8, cfg, "dynamic", "tensor")
    with pytest.raises(ValueError, match="^out_dtype: expected bf16, fp16 or fp32"):
        fg.kernel_spec(4096, 4096, 8, cfg, "per_token", "channel", BF16, torch.float64)
    with pytest.raises(ValueError, match="^cfg: expected a valid config"):
        fg.kernel_spec(4096, 4096, 8, fg.GemvConfig(64, 1, 1, 1), "per_token", "channel")


def test_prebuild_hook():
    specs = fg.prebuild_specs("4096:4096")
    assert len(specs) == len({s.key for s in specs}) == 6  # 2 buckets x 3 layer formats
    with pytest.raises(ValueError):
        fg.prebuild_specs("4096x4096")


# ----------------------------------------------------------------------------
# Selection (CPU, a pretend sm90 device)
# ----------------------------------------------------------------------------


def _linear_problem(m, n=4096, k=4096, mode="per_token", kind_b="channel", in_dtype=BF16, aligned=True,
                    stride=None):
    variant = "rowwise" if mode in ("per_token", "static_token") or kind_b == "channel" else "tensorwise"
    return Problem(Family.FP8, torch.device("cuda", 0), m, n, k, in_dtype, BF16, k if stride is None else stride,
                   (("quant", mode), ("scale_b", kind_b), ("bias_dtype", None), ("aligned16", aligned),
                    ("variant", variant)))


def _block_problem(m, n=4096, k=4096, block=(128, 128), aligned=True):
    return Problem(Family.FP8_BLOCK, torch.device("cuda", 0), m, n, k, BF16, BF16, k,
                   (("block_size", block), ("a_scales_col_major", False), ("aligned16", aligned)))


@pytest.mark.parametrize("p,why", [
    (_linear_problem(17), "needs M <= 16"),
    (_linear_problem(4, k=4000), "multiple of 128"),
    (_linear_problem(4, in_dtype=F32), "bf16 or fp16 activation"),
    (_linear_problem(4, aligned=False), "16-byte aligned"),
    (_linear_problem(4, stride=4100), "multiple of 16 bytes"),
    (_block_problem(4, block=(128, 64)), "needs block_size (128, 128)"),
    (_linear_problem(16, k=131072), "split K further"),
])
def test_can_implement_says_why(p, why):
    ok, reason = fg.can_implement(p)
    assert not ok and why in reason, reason


def test_can_implement_accepts():
    for m in (1, 8, 9, 16):
        assert fg.can_implement(_linear_problem(m))[0]
        assert fg.can_implement(_block_problem(m, 2112, 7168))[0]
    assert fg.can_implement(_linear_problem(1, stride=4100))[0]  # one row: its stride is never used


def test_first_at_decode_sizes_on_sm90(fake_sm90, monkeypatch):
    """Where the shipped sm90 rows put it (scaledmm/tuning/fp8_sm90.json,
    fp8_block_sm90.json: where the H200 measured it ahead)."""
    monkeypatch.delenv("SCALEDMM_FP8_GEMV", raising=False)
    tensorwise = {"mode": "per_tensor", "kind_b": "tensor"}
    # row-wise: op sweep rows; quantize + cuda_wgmma is ahead everywhere but the down projection at M = 1
    assert backends.select(_linear_problem(1, 4096, 14336), "fp8_linear").name == NAME
    assert backends.select(_linear_problem(2, 4096, 14336), "fp8_linear").name == "composite"
    for m in (1, 2, 4):
        assert backends.select(_linear_problem(m), "fp8_linear").name == "composite"
    assert backends.select(_linear_problem(1, 28672, **tensorwise), "fp8_linear").name == NAME
    assert backends.select(_linear_problem(2, 28672, **tensorwise), "fp8_linear").name == "composite"
    for m in (8, 64):
        assert backends.select(_linear_problem(m), "fp8_linear").name == "composite"
    # block: quantize + cuda_wgmma is ahead but on DeepSeek-V3's kv_a projection at M = 1
    assert backends.select(_block_problem(1, 576, 7168), "fp8_block_linear").name == NAME
    assert backends.select(_block_problem(2, 576, 7168), "fp8_block_linear").name == "composite"
    for n in (28672, 6144, 4096):
        assert backends.select(_block_problem(1, n), "fp8_block_linear").name == "composite"
    assert backends.select(_linear_problem(1, 4096, 14336, aligned=False), "fp8_linear").name == "composite"
    monkeypatch.setenv("SCALEDMM_FP8_GEMV", "0")
    assert backends.select(_linear_problem(1, 4096, 14336), "fp8_linear").name == "composite"
    assert backends.select(_block_problem(1, 576, 7168), "fp8_block_linear").name != NAME


NAME = fg.NAME


def test_explicit_request_on_cpu_explains():
    x = torch.randn(2, 256, dtype=BF16)
    w, ws = f8.reference_quant(torch.randn(32, 256), per_token=True)
    with scaledmm.use_backend("fp8", "cuda_gemv"), pytest.raises(RuntimeError, match="needs a CUDA device"):
        torch.ops.scaledmm.fp8_linear(x, w, ws.reshape(-1), None, True)


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


def _weight(n, k, bscale, gen, device="cuda"):
    w = torch.randn(n, k, generator=gen, device=device) * 0.05
    if bscale == "block":
        return fb.quantize_weight(w)
    q, s = f8.reference_quant(w, None, bscale == "channel")
    return q, (s.reshape(-1) if bscale == "channel" else s)


def _activation(m, k, gen, dtype=BF16, stride=None):
    x = torch.randn(m, k if stride is None else stride, generator=gen, device="cuda") * 3
    x[:, ::37] *= 40.0  # outliers: the scales are set by a few large values
    return x.to(dtype)[:, :k]


def _static_scale(ascale, m, gen):
    if ascale == "static":
        return torch.rand(1, generator=gen, device="cuda") * 0.05 + 0.01
    if ascale == "static_token":
        return torch.rand(m, 1, generator=gen, device="cuda") * 0.05 + 0.01
    return None


def _ref_quant(x, ascale, scale_x):
    if ascale == "group":
        return fb.reference_quant(x, 128)
    q, s = f8.reference_quant(x, scale_x, ascale in ("per_token", "static_token"))
    return q, s


def _same_codes(a, b):
    """Bytes equal, or both e4m3 NaN (the NaN encodings may differ in sign)."""
    av, bv = a.view(torch.uint8), b.view(torch.uint8)
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return bool(((av == bv) | nan).all())


def _ref64(q, s, ascale, w, ws, bscale, bias):
    m, k = q.shape
    n = w.shape[0]
    A = q.double()
    if ascale == "group":
        A = A * s.double().repeat_interleave(128, dim=1)[:, :k]
    else:
        A = A * s.double().reshape(-1, 1)
    B = w.double()
    if bscale == "block":
        B = B * ws.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    else:
        B = B * ws.double().reshape(-1, 1)
    ref = A @ B.t()
    if bias is not None:
        ref = ref + bias.double()
    return ref, A, B


def _check_out(out, ref, A, B, out_dtype, k):
    acc_err = (k + 2 * (k // 128) + 8) * U32 * (A.abs() @ B.abs().t())
    lim = acc_err + OUT_HALF_ULP[out_dtype] * (ref.abs() + acc_err) + OUT_TINY[out_dtype]
    err = (out.double() - ref).abs()
    ok = (err <= lim) | (torch.isnan(ref) & torch.isnan(out.double()))
    assert ok.all(), (f"{(~ok).sum().item()} of {ok.numel()} off; worst err/bound among them "
                      f"{(err / lim)[~ok].nan_to_num(float('inf')).max().item():.3g}")


def _run_case(m, n, k, ascale, bscale, seed, in_dtype=BF16, out_dtype=BF16, bias_dtype=None, stride=None, cfg=None,
              nan_rows=()):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w, ws = _weight(n, k, bscale, gen)
    x = _activation(m, k, gen, in_dtype, stride)
    for r, v in nan_rows:
        x[r, 5] = v
    scale_x = _static_scale(ascale, m, gen)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen, device="cuda").to(bias_dtype)
    q, s, out = fg.quantize_and_linear(x, w, ws, ascale, bscale, scale_x, bias, out_dtype, cfg)
    rq, rs = _ref_quant(x, ascale, scale_x)
    assert _same_codes(q, rq), f"codes differ at {(q.view(torch.uint8) != rq.view(torch.uint8)).sum().item()}"
    s = (s[:1] if ascale in ("per_tensor", "static") else s).reshape(rs.shape)
    assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s.nan_to_num(), rs.nan_to_num()), (s, rs)
    ref, A, B = _ref64(rq, rs, ascale, w, ws, bscale, bias)
    _check_out(out, ref, A, B, out_dtype, k)
    return x, w, ws, scale_x, bias, out


@requires_sm90
@pytest.mark.parametrize("ascale,bscale", MODES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (208, 1152)])
def test_gpu_codes_bit_exact_and_output_within_bound(m, n, k, ascale, bscale):
    _run_case(m, n, k, ascale, bscale, seed=m * 1000 + n + k)


@requires_sm90
@pytest.mark.parametrize("n,k", LLAMA8B + DSV3 + [(200, 1152)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_model_shapes(m, n, k):
    for ascale, bscale in MODES[:3]:
        if bscale != "block" and n % 16:
            continue
        _run_case(m, n, k, ascale, bscale, seed=7 * m + n)


@requires_sm90
@pytest.mark.parametrize("in_dtype,out_dtype,bias_dtype", [(F16, F16, F32), (BF16, F32, BF16), (F16, BF16, F16)])
@pytest.mark.parametrize("ascale,bscale", MODES)
def test_gpu_dtypes_and_bias(in_dtype, out_dtype, bias_dtype, ascale, bscale):
    _run_case(5, 4096, 4096, ascale, bscale, seed=11, in_dtype=in_dtype, out_dtype=out_dtype, bias_dtype=bias_dtype)


@requires_sm90
@pytest.mark.parametrize("ascale,bscale", MODES[:3])
def test_gpu_nan_and_inf_rows(ascale, bscale):
    """A NaN in a row makes that row's (or group's) scale NaN and its output
    NaN; an Inf saturates; a per-tensor amax skips both, so the other rows are
    unaffected (the quantizers' rules)."""
    x, *_ , out = _run_case(4, 4096, 4096, ascale, bscale, seed=3,
                            nan_rows=((1, float("nan")), (2, float("inf"))))
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all() and torch.isfinite(out[3]).all()


@requires_sm90
@pytest.mark.parametrize("ascale,bscale", MODES[:3])
def test_gpu_strided_rows_and_m0(ascale, bscale):
    _run_case(7, 4096, 4096, ascale, bscale, seed=5, stride=4096 + 64)
    w, ws = _weight(4096, 4096, bscale, torch.Generator(device="cuda").manual_seed(1))
    x = torch.zeros(0, 4096, device="cuda", dtype=BF16)
    if bscale == "block":
        out = fg.gemv_block_linear(x, w, ws)
    else:
        out = fg.gemv_linear(x, w, ws, None, ascale == "per_token")
    assert out.shape == (0, 4096)


@requires_sm90
@pytest.mark.parametrize("mb", fg.M_BUCKETS)
def test_gpu_every_candidate_config(mb):
    m = 7 if mb == 8 else 13
    for cfg in fg.candidate_configs(6144, 4096, mb)[:16]:
        _run_case(m, 6144, 4096, "group", "block", seed=cfg.warps * 100 + cfg.rows, cfg=cfg)
    for cfg in fg.candidate_configs(4096, 14336, mb)[:8]:
        _run_case(m, 4096, 14336, "per_token", "channel", seed=cfg.split_k, cfg=cfg)


@requires_sm90
def test_gpu_ops_select_it_and_write_every_element():
    """Through the ops (automatic selection at M = 1, on shapes whose shipped
    rows pick it): every output element is written (a poisoned buffer in the
    allocator would show as NaN)."""
    from scaledmm import policy

    shipped = policy.resolve("fp8_block", "sm90")
    picked = [nk for nk in shipped.op_shapes["fp8_block_linear"]
              if nk != policy.ANY_SHAPE and shipped.auto_order(*nk, 1, op="fp8_block_linear")[0] == "cuda_gemv"]
    assert picked, "no shipped fp8_block_linear row runs cuda_gemv at M = 1"
    gen = torch.Generator(device="cuda").manual_seed(9)
    w, ws = _weight(4096, 14336, "channel", gen)
    wb, wbs = _weight(*picked[0], "block", gen)
    x, xb = _activation(1, 14336, gen), _activation(1, picked[0][1], gen)
    poison_(torch.empty(6144 * 4, device="cuda", dtype=torch.uint8))
    with backends.record() as log:
        out = torch.ops.scaledmm.fp8_linear(x, w, ws, None, True)
        outb = torch.ops.scaledmm.fp8_block_linear(xb, wb, wbs)
    assert ("fp8_linear", "cuda_gemv") in [(op, name) for op, name, _ in log]
    assert ("fp8_block_linear", "cuda_gemv") in [(op, name) for op, name, _ in log]
    assert torch.isfinite(out).all() and torch.isfinite(outb).all()
    with scaledmm.use_backend("fp8", "composite"):
        ref = torch.ops.scaledmm.fp8_linear(x, w, ws, None, True)
    assert (out.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


@requires_sm90
def test_gpu_deterministic_and_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(4)
    w, ws = _weight(4096, 14336, "block", gen)
    x = _activation(5, 14336, gen)
    eager = fg.gemv_block_linear(x, w, ws)
    assert torch.equal(fg.gemv_block_linear(x, w, ws), eager)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fg.gemv_block_linear(x, w, ws)  # compile and load outside the capture
        with torch.cuda.graph(g, stream=s):
            out = fg.gemv_block_linear(x, w, ws)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(_activation(5, 14336, gen))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fg.gemv_block_linear(x, w, ws))


@requires_sm90
@pytest.mark.parametrize("fmt", ["fp8", "fp8_tensor", "fp8_block"])
def test_gpu_layer_compiled_with_cuda_graphs_equals_eager(fmt):
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(12)
    lin = torch.nn.Linear(4096, 6144, bias=True, device="cuda", dtype=BF16)
    model = scaledmm.quantize_(torch.nn.Sequential(lin), fmt)
    x = _activation(4, 4096, gen)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        out = compiled(x)
    assert torch.equal(out, eager)
