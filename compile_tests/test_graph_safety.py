"""Graph and state safety (SPEC.md): no op keeps memory across calls, and
CUDA graphs holding our ops are right whatever ran before them.

GPU (skipped without CUDA), each case in a fresh process of
``graph_safety_child.py`` with an empty Inductor cache, so that nothing an
earlier test ran can have allocated what the case needs:

* every op x every backend this GPU runs x {dynamic=True, False} x {with
  ``scaledmm.compile.options(pdl=True)`` (the pass and Inductor's PDL), without},
  compiled with Inductor's CUDA
  graphs (``reduce-overhead``), equals eager for every M the backend takes;
* two captured graphs replayed at the same time on two streams equal
  one-after-the-other replays, for every op x backend;
* the reproduction of issue #14 (item 1);
* ``decode_cublas`` on its two-step path (``SCALEDMM_NVFP4_CUBLASLT=0``; the
  default is one cuBLASLt call): its matrix and two-stream cases again.

The processes run ``SCALEDMM_GRAPH_SAFETY_JOBS`` at a time (default: half
the CPU cores, at most 8) unless pytest-xdist spreads the tests itself.

CPU: the case list and input builders; the held-tensor walk finds what an op
would keep (lru_caches, module dicts, closures); and, under the Triton
interpreter, every op on every CPU backend (the split-K paths included)
leaves no tensor in any scaledmm module.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import graph_safety_child as child
import scaledmm
from helpers import requires_cuda

CHILD = os.path.abspath(child.__file__)
ROOT = os.path.dirname(os.path.dirname(CHILD))
CUDA = torch.cuda.is_available()
MATRIX = child.matrix_cases(torch.device("cuda")) if CUDA else []
STREAMS = child.stream_cases(torch.device("cuda")) if CUDA else []
CASE_TIMEOUT = 900  # s; a first CUTLASS / NVRTC build on a cold disk cache included
# a test waits for its process (pytest-timeout's per-test limit of a device run is shorter)
if importlib.util.find_spec("pytest_timeout") is not None:
    long_wait = pytest.mark.timeout(CASE_TIMEOUT + 60)
else:
    def long_wait(f):
        return f


def run_child(argv: tuple[str, ...], env: dict | None = None, timeout: int = CASE_TIMEOUT
              ) -> subprocess.CompletedProcess:
    """``graph_safety_child.py *argv`` in a fresh process with an empty Inductor cache."""
    cache = tempfile.mkdtemp(prefix="scaledmm-graph-safety-")
    full_env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                    TORCHINDUCTOR_AUTOGRAD_CACHE="0", TORCHINDUCTOR_COMPILE_THREADS="1",
                    PYTHONWARNINGS="ignore", **(env or {}))
    try:
        return subprocess.run([sys.executable, CHILD, *argv], env=full_env, cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", f"timed out after {timeout} s\n{e.stderr or ''}")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def report(r: subprocess.CompletedProcess) -> str:
    return f"rc={r.returncode}\n--- stderr ---\n{r.stderr[-8000:]}\n--- stdout ---\n{r.stdout[-2000:]}"


def matrix_argv(case) -> tuple[str, ...]:
    op, backend, dynamic, passes = case
    return ("matrix", op, backend, "--dynamic", str(int(dynamic)), "--passes", str(int(passes)))


def streams_argv(case) -> tuple[str, ...]:
    return ("streams", *case)


ARGV = {"test_compiled_cudagraphs_equal_eager": matrix_argv,
        "test_two_graphs_on_two_streams_equal_sequential": streams_argv,
        "test_issue_14_reproduction": lambda case: ("repro",)}


class Runner:
    """Starts the child process of every selected GPU test of this module at
    once on a pool (in test order); each test waits for its own.  Under
    pytest-xdist each test runs its process itself."""

    def __init__(self, session, path):
        self.futures: dict[tuple, concurrent.futures.Future] = {}
        self.pool = None
        if not CUDA or os.environ.get("PYTEST_XDIST_WORKER"):
            return
        jobs = int(os.environ.get("SCALEDMM_GRAPH_SAFETY_JOBS", "0")) or max(1, min(8, (os.cpu_count() or 2) // 2))
        self.pool = concurrent.futures.ThreadPoolExecutor(jobs)
        for item in session.items:
            make = ARGV.get(getattr(item, "originalname", ""))
            if make is None or item.path != path:
                continue
            argv = make(item.callspec.params.get("case") if hasattr(item, "callspec") else None)
            if argv not in self.futures:
                self.futures[argv] = self.pool.submit(run_child, argv)

    def result(self, argv: tuple[str, ...]) -> subprocess.CompletedProcess:
        fut = self.futures.get(argv)
        return fut.result() if fut is not None else run_child(argv)

    def close(self):
        if self.pool is not None:
            for fut in self.futures.values():
                fut.cancel()
            self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def runner(request):
    r = Runner(request.session, request.path)
    yield r
    r.close()


def _id(case) -> str:
    if len(case) == 4:
        op, backend, dynamic, passes = case
        return f"{op}-{backend}-{'dynamic' if dynamic else 'static'}-{'passes' if passes else 'nopasses'}"
    return "-".join(case)


# ----------------------------------------------------------------------------
# GPU: one fresh process per case
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@long_wait
def test_issue_14_reproduction(runner):
    """The issue's program, in a fresh process: the first compiled call is
    Inductor's warm-up, the first call of the split-K path in the process."""
    r = runner.result(("repro",))
    assert r.returncode == 0, report(r)


@pytest.mark.gpu
@requires_cuda
@long_wait
@pytest.mark.parametrize("case", STREAMS, ids=_id)
def test_two_graphs_on_two_streams_equal_sequential(runner, case):
    """Two captures on different inputs, replayed together on two streams 50
    times (outputs poisoned before each replay): the bits of sequential replays."""
    r = runner.result(streams_argv(case))
    assert r.returncode == 0, report(r)


@pytest.mark.gpu
@requires_cuda
@long_wait
@pytest.mark.parametrize("case", MATRIX, ids=_id)
def test_compiled_cudagraphs_equal_eager(runner, case):
    """reduce-overhead (Inductor CUDA graphs), M = 3, 1, 4, 17, 64, 130, 0
    (those the backend takes), each three times: equal to eager, made after."""
    r = runner.result(matrix_argv(case))
    assert r.returncode == 0, report(r)


TWO_STEP_ENV = {"SCALEDMM_NVFP4_CUBLASLT": "0"}
DECODE_CUBLAS_CASES = [c for c in MATRIX + STREAMS if c[1] == "decode_cublas"]


@pytest.mark.gpu
@requires_cuda
@long_wait
@pytest.mark.parametrize("case", DECODE_CUBLAS_CASES, ids=_id)
def test_decode_cublas_two_step_is_graph_safe(case):
    """The matrix and the other tests run ``decode_cublas`` as one cuBLASLt
    call (handle and plans made in the first call, a warm-up outside capture
    under reduce-overhead; workspace per call).  Its other path, cuBLAS's
    fp32 GEMM then a Triton epilogue: the same matrix and two-stream checks,
    in a fresh process with the switch off."""
    r = run_child(matrix_argv(case) if len(case) == 4 else streams_argv(case), env=TWO_STEP_ENV)
    assert r.returncode == 0, report(r)


# ----------------------------------------------------------------------------
# CPU: case list, inputs, the held-tensor walk
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cpu_weights():
    return child.Weights(torch.device("cpu"))


def _shapes(op: str, m: int, n: int, k: int) -> tuple[list, list]:
    """(input shapes, output shapes) the contract gives ``op`` at M = ``m``."""
    r128, c4 = -(-m // 128) * 128, -(-(k // 16) // 4) * 4
    x = [(m, k)]
    if op in ("fp8_block_mm", "padded_fp8_block_mm", "dynamic_padded_fp8_block_mm", "scaledmm.fp8_block_mm"):
        return [(m, k), (m, k // 128)], [(m, n)]
    if op == "fp8_scaled_mm":
        return [(m, k), (m, 1)], [(m, n)]
    if op == "nvfp4_mm":
        return [(m, k // 2), (r128, c4)], [(m, n)]
    if op == "per_token_group_quant_fp8":
        return x, [(m, k), (m, k // 128)] * 2
    if op == "quant_fp8":
        return x, [(m, k), (1,), (m, k), (m, 1), (m, k), (1,)]
    if op == "nvfp4_quant":
        return x, [(m, k // 2), (r128, c4), (m, k // 2), (m, k // 16)]
    return x, [(m, n)]


def test_cases_cover_every_op_and_inputs_have_the_right_shapes():
    """Every op has a case (its reference backend at least); inputs and
    reference outputs have the shapes of the op's contract at every M."""
    cpu = torch.device("cpu")
    cases = child.cases(cpu)
    assert {op for op, _ in cases} == set(child.OPS)
    # the CPU runs no other backend outside the interpreter (the fused linear ops' composites: their two ops, on
    # the reference)
    assert all(b == "reference" or (op, b) in (("fp8_linear", "composite"), ("nvfp4_linear", "composite"),
                                                ("nvfp4_dynamic_linear", "composite"))
               for op, b in cases)
    assert len(child.matrix_cases(cpu)) == 4 * len(cases)
    w = _cpu_weights()
    n, k = child.shape(cpu)
    for op in child.OPS:
        ms = child.runnable_ms(op, "reference", w)
        assert ms == [m for m in child.MS if child.op_accepts(op, m)], (op, ms)
        for m in ms:
            args = child.inputs(op, m, w, seed=m)
            with torch.no_grad(), scaledmm.use_backend(child.OPS[op].family, "reference"):
                out = child.flat(child.call(op, w, *args))
            want_in, want_out = _shapes(op, m, n, k)
            assert [tuple(a.shape) for a in args] == want_in, (op, m)
            assert [tuple(t.shape) for t in out] == want_out, (op, m)
            assert not any(t.float().isnan().any() for t in out), (op, m)
    for m in child.MS:  # different calls get different activations
        a, b = (child.inputs("nvfp4_w4a16_mm", m, w, seed=s)[0] for s in (1, 2))
        assert m == 0 or not torch.equal(a, b)


def test_gpu_backends_are_planned_on_the_m_they_take():
    """What the GPU matrix runs per backend (``can_implement`` only, planned
    on the CPU): aligned-only backends skip unaligned M, size-limited ones
    the large M; the padded entries take every M on any backend."""
    w = _cpu_weights()

    def plan(op, backend):
        return child.runnable_ms(op, backend, w, device_checked=False)

    every = list(child.MS)
    assert plan("fp8_block_mm", "cublas") == [4, 64, 0]
    for op in ("padded_fp8_block_mm", "dynamic_padded_fp8_block_mm", "scaledmm.fp8_block_mm"):
        assert plan(op, "cublas") == every, op
    assert plan("fp8_block_mm", "triton") == every
    assert plan("nvfp4_mm", "cuda_gemv") == [3, 1, 4, 17, 0]
    assert plan("nvfp4_w4a16_mm", "cuda_gemv") == [3, 1, 4, 0]
    assert plan("nvfp4_mm", "cuda_mid") == [3, 1, 4, 17, 64, 0]
    assert plan("nvfp4_mm", "decode_cublas") == [130, 0]
    assert plan("nvfp4_mm", "cuda_wgmma") == every  # TMA zero-fills the rows past M: any M
    assert plan("nvfp4_w4a16_mm", "cuda_wgmma") == every
    assert plan("dsv3_fused_a_gemm", "fused_a") == [3, 1, 4, 0]
    assert plan("scaledmm.skinny_linear", "fused_a") == every
    gpu_cases = child.cases(torch.device("cuda"), device_checked=False)
    assert ("nvfp4_dynamic_linear", "triton") in gpu_cases  # its quantizer computes the scales
    assert plan("nvfp4_dynamic_linear", "triton") == every
    for op, backend in (("fp8_block_mm", "cutlass"), ("nvfp4_mm", "triton"), ("fp8_block_linear", "composite"),
                        ("quant_fp8", "triton"), ("dsv3_fused_a_gemm", "fused_a")):
        assert (op, backend) in gpu_cases
    assert ("fp8_scaled_mm", "triton") in gpu_cases  # the fp8_block kernel with row/column scales
    for op in ("fp8_linear", "fp8_block_linear"):  # quantize + GEMM in one launch, M <= 16
        assert (op, "cuda_gemv") in gpu_cases
        assert plan(op, "cuda_gemv") == [3, 1, 4, 0], op
    assert plan("fp8_scaled_mm", "triton") == every
    assert ("fp8_scaled_mm", "cuda_wgmma") in gpu_cases
    assert plan("fp8_scaled_mm", "cuda_wgmma") == every  # TMA zero-fills rows past M; unaligned rows copied
    assert ("fp8_block_mm", "cuda_wgmma") in gpu_cases
    assert plan("fp8_block_mm", "cuda_wgmma") == every  # the block-scaled variant: any M as well


def test_held_walk_finds_what_an_op_could_keep(monkeypatch):
    """The walk reaches tensors in a module dict, an lru_cache (bounded or
    not), a closure, a partial and a scaledmm object's attributes."""
    import functools as ft

    from scaledmm.backends import Family, Problem
    from scaledmm.ops import fp8_block_triton_splitk as S

    before = child.held_tensors()
    t = [torch.zeros(i + 1) for i in range(6)]

    @ft.lru_cache(maxsize=None)
    def cached(n):
        return t[0]

    @ft.lru_cache(maxsize=8)
    def bounded(n):
        return (n, t[1])

    def make():
        kept = {"buf": t[2]}
        return lambda: kept

    closure = make()
    for f in (cached, bounded, closure):
        f.__module__ = S.__name__
    cached(1)
    bounded(2)
    problem = Problem(Family.FP8, torch.device("cpu"), 1, 1, 1, torch.float32, torch.float32, 1, (("t", t[4]),))
    planted = {"_planted_cache": cached, "_planted_bounded": bounded, "_planted_closure": closure,
               "_planted_dict": {"cuda:0": [t[3]]}, "_planted_problem": problem,
               "_planted_partial": ft.partial(torch.add, t[5])}
    for name, value in planted.items():
        monkeypatch.setattr(S, name, value, raising=False)
    held = {i: p for i, p in child.held_tensors().items() if i not in before}
    assert set(held) == {id(x) for x in t}, ([i for i, x in enumerate(t) if id(x) not in held], held)
    assert all(any(name in path for path in held.values()) for name in planted), held
    assert child.held_tensors("cuda") == {}
    for name in planted:
        monkeypatch.delattr(S, name)
    assert set(child.held_tensors()) == set(before)


def _interpreted(argv):
    return run_child(argv, env={"TRITON_INTERPRET": "1"}, timeout=1800)


def test_no_op_keeps_tensors_across_calls():
    """Under the Triton interpreter: every op on every backend the CPU runs
    (fp8_block one-launch split-K and the nvfp4 split-K among them), every M;
    the registry refuses exactly the M the GPU matrix would skip; afterwards
    no scaledmm module holds a tensor."""
    r = _interpreted(("held",))
    assert r.returncode == 0 and "ok" in r.stdout, report(r)


def test_held_check_fails_on_a_process_wide_counter_cache():
    """The check above catches the pattern it is for: with the one-launch
    counters cached per process again, the child fails naming the cache."""
    r = _interpreted(("held", "--only", "fp8_block_mm:triton", "--plant"))
    assert r.returncode == 1 and "fp8_block_triton_splitk.COUNTERS" in r.stderr, report(r)
