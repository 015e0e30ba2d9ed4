"""CUDA graphs (GPU only; skipped without CUDA).

* Every op captured by ``torch.cuda.graph`` in eager mode and replayed with
  fresh inputs copied into the static buffers (outputs poisoned before each
  replay) equals eager.
* A small model (quant + ``scaledmm.fp8_block_mm`` + ``scaledmm.skinny_linear``
  + ``NvFp4Linear``) compiled with ``mode="reduce-overhead", dynamic=True`` and
  ``scaledmm.compile.passes()`` records CUDA graphs (no skip) for aligned and
  unaligned M and equals eager; without the pass (a ``torch.cond`` in the
  graph) Inductor skips CUDA graphs and the result is still right.  It runs
  in a fresh process: the eager tests before it would otherwise have made
  every first call of a kernel path, which is what Inductor's warm-up must
  survive (``test_graph_safety.py`` checks every op x backend that way).
* A compiled (default mode) dynamic model captured by hand with
  ``torch.cuda.graph`` at fixed sizes replays correctly.

Only ``test_every_op_has_a_capture_case`` runs without CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import scaledmm
import scaledmm.compile as sc
from harness import one_graph_for_all_m
from helpers import poison_, rel_err, requires_cuda
from scaledmm.layers import NvFp4Linear
from scaledmm.ops import fp8_block as fb


FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
N, K = 256, 512  # every op's alignment holds (K % 128, N % 32)
RANGE = 448.0 * 6.0


# ----------------------------------------------------------------------------
# eager capture of every op
# ----------------------------------------------------------------------------


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def capture(fn, static_args):
    """Warm ``fn`` up on a side stream (kernels built, autotuned, lazily
    initialized), then capture one call.  Returns the graph and its static outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_args)
    return graph, out


def assert_replay_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype in (FP8, torch.uint8):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    # the same kernels on the same inputs, and every backend reduces in a fixed
    # order: equal, up to one ulp in case a library picks another algorithm
    # inside a capture (stale inputs or unwritten (NaN) outputs are far off)
    scale = want.float().abs().amax().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=2.0 ** -8 * scale + 1e-6)


def check_capture_replay(fn, make_inputs, trials: int = 3) -> None:
    static = make_inputs()
    graph, out = capture(fn, static)
    outs = _flat(out)
    for _ in range(trials):
        fresh = make_inputs()
        for s, f in zip(static, fresh):
            s.copy_(f)
        for o in outs:
            poison_(o)
        graph.replay()
        want = _flat(fn(*fresh))
        torch.cuda.synchronize()
        assert len(outs) == len(want)
        for o, w in zip(outs, want):
            assert_replay_matches(o, w)


def _x(m, k=K, dtype=BF16, row_stride=None):
    buf = torch.randn(m, row_stride or k, dtype=dtype, device="cuda")
    return buf[:, :k]


def _block_weights():
    return fb.quantize_weight(torch.randn(N, K, device="cuda"))


def _fp8_weights():
    w, ws = torch.ops.scaledmm.quant_fp8(torch.randn(N, K, device="cuda"), None, True)
    return w, ws.reshape(-1).contiguous()


def _nvfp4_weights():
    w = torch.randn(N, K, device="cuda")
    gs_w = (RANGE / w.abs().amax()).reshape(1)
    q, s = torch.ops.scaledmm.nvfp4_quant(w, gs_w, True)
    return q, s, 1.0 / gs_w


def _quant_block(m):
    return torch.ops.scaledmm.per_token_group_quant_fp8(_x(m))


# case name -> the op it exercises (the entries scaledmm.fp8_block_mm and
# scaledmm.skinny_linear are cases of the ops they call)
OP_CASES = {
    "per_token_group_quant_fp8": "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_colmajor_ue8m0_strided": "per_token_group_quant_fp8",
    "fp8_block_mm": "fp8_block_mm",
    "padded_fp8_block_mm": "padded_fp8_block_mm",
    "dynamic_padded_fp8_block_mm_m5": "dynamic_padded_fp8_block_mm",
    "dynamic_padded_fp8_block_mm_m8": "dynamic_padded_fp8_block_mm",
    "entry_fp8_block_mm_m5": "padded_fp8_block_mm",
    "entry_fp8_block_mm_m8": "fp8_block_mm",
    "fp8_block_linear": "fp8_block_linear",
    "quant_fp8_per_tensor": "quant_fp8",
    "quant_fp8_per_token": "quant_fp8",
    "quant_fp8_static": "quant_fp8",
    "fp8_scaled_mm_rowwise_bias": "fp8_scaled_mm",
    "fp8_scaled_mm_tensorwise_fp16": "fp8_scaled_mm",
    "fp8_linear_m1_token_bias": "fp8_linear",
    "fp8_linear_m5_tensor": "fp8_linear",
    "nvfp4_quant": "nvfp4_quant",
    "nvfp4_quant_linear_scales": "nvfp4_quant",
    "swizzle_block_scales": "swizzle_block_scales",
    "unswizzle_block_scales": "unswizzle_block_scales",
    "nvfp4_mm": "nvfp4_mm",
    "nvfp4_w4a16_mm": "nvfp4_w4a16_mm",
    "nvfp4_linear": "nvfp4_linear",
    "nvfp4_dynamic_linear_m1": "nvfp4_dynamic_linear",
    "nvfp4_dynamic_linear_m5_one_amax": "nvfp4_dynamic_linear",
    "dsv3_fused_a_gemm": "dsv3_fused_a_gemm",
    "dsv3_fused_a_gemm_pdl_strided": "dsv3_fused_a_gemm",
    "dynamic_skinny_linear_m5": "dynamic_skinny_linear",
    "dynamic_skinny_linear_m40": "dynamic_skinny_linear",
    "entry_skinny_linear_m5": "dsv3_fused_a_gemm",
    "entry_skinny_linear_m40": "dynamic_skinny_linear",  # F.linear above M = 16
}


def op_cases():
    """case name -> ``(fn, make_inputs)``: ``make_inputs()`` gives fresh
    activation tensors (copied into the captured ones); weights are constants
    of ``fn``."""
    ops = torch.ops.scaledmm
    w, ws = _block_weights()
    bias = torch.randn(N, dtype=BF16, device="cuda")
    w8, ws8 = _fp8_weights()
    ws8_tensor = ws8[:1].clone().reshape(())
    static_scale = torch.tensor([0.02], device="cuda")
    qw, sw, alpha_w = _nvfp4_weights()
    gs = torch.tensor([RANGE / 4.0], device="cuda")
    alpha = alpha_w / gs
    wb = torch.randn(N, K, dtype=BF16, device="cuda") / K ** 0.5
    cases = {
        # fp8_block
        "per_token_group_quant_fp8": (lambda x: ops.per_token_group_quant_fp8(x), lambda: (_x(5),)),
        "per_token_group_quant_fp8_colmajor_ue8m0_strided": (
            lambda x: ops.per_token_group_quant_fp8(x, 128, 1e-10, True, True), lambda: (_x(8, row_stride=K + 128),)),
        "fp8_block_mm": (lambda q, s: ops.fp8_block_mm(q, w, s, ws), lambda: _quant_block(8)),
        "padded_fp8_block_mm": (lambda q, s: ops.padded_fp8_block_mm(q, w, s, ws), lambda: _quant_block(5)),
        "fp8_block_linear": (lambda x: ops.fp8_block_linear(x, w, ws, [128, 128], BF16, bias), lambda: (_x(5),)),
        # fp8
        "quant_fp8_per_tensor": (lambda x: ops.quant_fp8(x), lambda: (_x(5),)),
        "quant_fp8_per_token": (lambda x: ops.quant_fp8(x, None, True), lambda: (_x(5),)),
        "quant_fp8_static": (lambda x: ops.quant_fp8(x, static_scale), lambda: (_x(5),)),
        "fp8_scaled_mm_rowwise_bias": (lambda q, s: ops.fp8_scaled_mm(q, w8, s, ws8, bias),
                                       lambda: ops.quant_fp8(_x(5), None, True)),
        "fp8_scaled_mm_tensorwise_fp16": (lambda q, s: ops.fp8_scaled_mm(q, w8, s, ws8_tensor, None, torch.float16),
                                          lambda: ops.quant_fp8(_x(8))),
        # one launch at M = 1 on sm90 (cuda_gemv), composite above
        "fp8_linear_m1_token_bias": (lambda x: ops.fp8_linear(x, w8, ws8, None, True, bias), lambda: (_x(1),)),
        "fp8_linear_m5_tensor": (lambda x: ops.fp8_linear(x, w8, ws8_tensor), lambda: (_x(5),)),
        # nvfp4
        "nvfp4_quant": (lambda x: ops.nvfp4_quant(x, gs, True), lambda: (_x(5),)),
        "nvfp4_quant_linear_scales": (lambda x: ops.nvfp4_quant(x, gs, False), lambda: (_x(5),)),
        "swizzle_block_scales": (lambda s: ops.swizzle_block_scales(s),
                                 lambda: (ops.nvfp4_quant(_x(5), gs, False)[1],)),
        "unswizzle_block_scales": (lambda s: ops.unswizzle_block_scales(s, 5, K // 16),
                                   lambda: (ops.nvfp4_quant(_x(5), gs, True)[1],)),
        "nvfp4_mm": (lambda q, s: ops.nvfp4_mm(q, qw, s, sw, alpha, BF16, bias),
                     lambda: ops.nvfp4_quant(_x(5), gs, True)),
        "nvfp4_w4a16_mm": (lambda x: ops.nvfp4_w4a16_mm(x, qw, sw, alpha_w, BF16, bias), lambda: (_x(5),)),
        "nvfp4_linear": (lambda x: ops.nvfp4_linear(x, qw, sw, gs, alpha, BF16, bias), lambda: (_x(1),)),
        # the scales computed in the op on every replay: per-row amax, then one all-rows amax
        "nvfp4_dynamic_linear_m1": (
            lambda x: ops.nvfp4_dynamic_linear(x, x.float().abs().amax(dim=1), qw, sw, alpha_w, BF16, bias),
            lambda: (_x(1),)),
        "nvfp4_dynamic_linear_m5_one_amax": (
            lambda x: ops.nvfp4_dynamic_linear(x, x.float().abs().amax().reshape(1), qw, sw, alpha_w, BF16, None),
            lambda: (_x(5),)),
        # skinny
        "dsv3_fused_a_gemm": (lambda x: ops.dsv3_fused_a_gemm(x, wb), lambda: (_x(5),)),
        "dsv3_fused_a_gemm_pdl_strided": (lambda x: ops.dsv3_fused_a_gemm(x, wb, True),
                                          lambda: (_x(16, row_stride=K + 64),)),
    }
    for m in (5, 8):
        cases[f"dynamic_padded_fp8_block_mm_m{m}"] = (
            lambda q, s: ops.dynamic_padded_fp8_block_mm(q, w, s, ws), lambda m=m: _quant_block(m))
        cases[f"entry_fp8_block_mm_m{m}"] = (
            lambda q, s: scaledmm.fp8_block_mm(q, w, s, ws), lambda m=m: _quant_block(m))
    for m in (5, 40):
        cases[f"dynamic_skinny_linear_m{m}"] = (lambda x: ops.dynamic_skinny_linear(x, wb), lambda m=m: (_x(m),))
        cases[f"entry_skinny_linear_m{m}"] = (lambda x: scaledmm.skinny_linear(x, wb), lambda m=m: (_x(m),))
    return cases


def test_every_op_has_a_capture_case():
    """Runs without CUDA too: the case list names every op of the namespace."""
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("scaledmm::")}
    assert set(OP_CASES.values()) == registered


@pytest.fixture(scope="module")
def cases():
    built = op_cases()
    assert sorted(built) == sorted(OP_CASES)
    return built


@requires_cuda
@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_capture_and_replay(cases, name):
    fn, make_inputs = cases[name]
    check_capture_replay(fn, make_inputs)


# ----------------------------------------------------------------------------
# compiled models
# ----------------------------------------------------------------------------


class SmallModel(torch.nn.Module):
    """quant -> scaledmm.fp8_block_mm -> scaledmm.skinny_linear -> NvFp4Linear."""

    def __init__(self):
        super().__init__()
        w, ws = fb.quantize_weight(torch.randn(384, K, device="cuda"))
        self.register_buffer("w", w)
        self.register_buffer("ws", ws)
        self.register_buffer("skinny_w", torch.randn(256, 384, dtype=BF16, device="cuda") / 384 ** 0.5)
        self.nv = NvFp4Linear.from_float(torch.nn.Linear(256, 320, dtype=BF16, device="cuda"), input_amax=8.0)

    def forward(self, x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
        h = scaledmm.fp8_block_mm(q, self.w, s, self.ws)
        a = scaledmm.skinny_linear(h, self.skinny_w)
        return self.nv(a)


ALIGNED_AND_NOT = (4, 5, 1, 17, 64)


def _check_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any()
    if want.numel():
        # fp8 / fp4 quantization between the GEMMs turns a one-ulp difference
        # (another summation order, the fused quant+GEMM) into a code step now and then
        assert rel_err(got, want) < 3e-2, rel_err(got, want)


FRESH = os.environ.get("SCALEDMM_CUDAGRAPHS_FRESH") == "1"


def rerun_in_fresh_process(request) -> None:
    """Run this test alone in a new process with an empty Inductor cache and
    assert that it passed there."""
    cache = tempfile.mkdtemp(prefix="scaledmm-cudagraphs-")
    env = dict(os.environ, SCALEDMM_CUDAGRAPHS_FRESH="1", TORCHINDUCTOR_CACHE_DIR=cache,
               TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    env.pop("PYTEST_XDIST_WORKER", None)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                            request.node.nodeid], cwd=str(request.config.rootpath), env=env,
                           capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-8000:] + r.stderr[-4000:]


def _long_wait(f):
    return pytest.mark.timeout(960)(f) if importlib.util.find_spec("pytest_timeout") else f


@requires_cuda
@_long_wait
@pytest.mark.parametrize("with_pass", [True, False])
def test_reduce_overhead_records_cuda_graphs(with_pass, request):
    if not FRESH:
        rerun_in_fresh_process(request)
        return
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    model = SmallModel()
    p = sc.passes()
    # mode="reduce-overhead" is options={"triton.cudagraphs": True}; torch.compile
    # refuses mode and options together, and the pass goes in through options.
    options = {"triton.cudagraphs": True}
    if with_pass:
        options["post_grad_custom_post_pass"] = p
    torch._dynamo.reset()
    counters.clear()
    cm = torch.compile(model, fullgraph=True, dynamic=True, options=options)
    with torch.no_grad(), one_graph_for_all_m(), fresh_cache():  # a cache hit would skip the pass
        for m in ALIGNED_AND_NOT:
            for _ in range(3):  # warm-up run, recording run, replay
                x = torch.randn(m, K, dtype=BF16, device="cuda")
                torch.compiler.cudagraph_mark_step_begin()
                got = cm(x).clone()
                _check_close(got, model(x))
    skips = counters["inductor"]["cudagraph_skips"]
    if with_pass:
        assert p.stats["size_conds"] == 2 and p.stats["quant_gemm"] == 1, p.stats
        assert skips == 0, "Inductor skipped CUDA graphs with scaledmm.compile.passes()"
        from torch._inductor import cudagraph_trees

        mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        assert mgr is not None
        roots = getattr(mgr, "roots", None)
        if roots is not None:  # one recorded graph per distinct M
            assert sum(len(v) for v in roots.values()) >= 1
    else:
        assert skips >= 1, "expected Inductor to skip CUDA graphs for a graph holding torch.cond"


@requires_cuda
@pytest.mark.parametrize("with_pass", [True, False])
def test_compiled_model_captured_by_hand(with_pass):
    model = SmallModel()
    options = {"post_grad_custom_post_pass": sc.passes()} if with_pass else {}
    torch._dynamo.reset()
    cm = torch.compile(model, fullgraph=True, dynamic=True, options=options)
    graphs = {}
    with torch.no_grad():
        for m in (5, 8, 17):
            static = torch.randn(m, K, dtype=BF16, device="cuda")
            graphs[m] = (static, *capture(cm, (static,)))
        for _ in range(2):
            for m, (static, graph, out) in graphs.items():
                x = torch.randn(m, K, dtype=BF16, device="cuda")
                static.copy_(x)
                poison_(out)
                graph.replay()
                torch.cuda.synchronize()
                _check_close(out, model(x))
