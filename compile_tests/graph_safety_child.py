"""Graph and state safety cases (SPEC.md "Graph and state safety"), one case
per fresh process.  ``compile_tests/test_graph_safety.py`` enumerates the
cases with :func:`matrix_cases` / :func:`stream_cases` and starts one process
per case; each exits 0 when its case holds, else prints why on stderr and
exits 1.

Modes (``python compile_tests/graph_safety_child.py MODE ...``):

* ``matrix OP BACKEND --dynamic 0|1 --passes 0|1``: ``OP`` compiled with
  ``torch.compile(fullgraph=True, options={"triton.cudagraphs": True}
  [+ scaledmm.compile.passes()])`` (what ``mode="reduce-overhead"`` sets),
  the family forced to ``BACKEND`` with ``scaledmm.use_backend``, called three
  times (warm-up, recording, replay) for every M of :data:`MS` that the
  backend can run, with fresh inputs each call; every output must equal the
  eager call on the same inputs, made only afterwards (nothing of the op runs
  in the process before Inductor's warm-up), and no scaledmm module may hold a
  tensor at the end.
* ``streams OP BACKEND``: two ``torch.cuda.CUDAGraph`` captures of ``OP`` on
  different inputs, replayed at the same time on two streams many times, must
  give the bits of one-after-the-other replays.
* ``repro``: the reproduction of issue #14, as written there, then more M.
* ``held [--only OP:BACKEND] [--plant]``: CPU, under ``TRITON_INTERPRET=1``:
  every op on every backend the CPU runs, for every M of :data:`CPU_MS`; the
  M the registry refuses must be the ones :func:`runnable_ms` predicts; then
  no scaledmm module may hold a tensor that was not there at import.
  ``--plant`` first puts back a process-wide counter cache (the pattern this
  check exists for) so that the check must fail.

The parent gives each process an empty Inductor cache; run by hand, the
process makes one itself (see the top of ``__main__``).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before torch reads its configuration
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="scaledmm-graph-safety-"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import contextvars  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import types  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import torch  # noqa: E402

import scaledmm  # noqa: E402
from scaledmm import backends  # noqa: E402
from scaledmm.backends import Family, Problem  # noqa: E402
from scaledmm.device import interpreting  # noqa: E402
from scaledmm.ops import fp8 as f8  # noqa: E402
from scaledmm.ops import fp8_block as fb  # noqa: E402
from scaledmm.ops import nvfp4 as nv  # noqa: E402
from scaledmm.ops import skinny  # noqa: E402

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
MS = (3, 1, 4, 17, 64, 130, 0)  # first call M = 3 as in the issue; unaligned, aligned, >= 128 (decode_cublas)
CPU_MS = (3, 1, 4, 17, 130, 0)
NVFP4_RANGE = 448.0 * 6.0
# Backends that call a library (cuBLAS) for the GEMM: it may pick another
# algorithm inside a capture, so their GEMM outputs are compared within a
# rounding step; our own kernels and every quantizer are compared bit for bit.
LIBRARY_BACKENDS = {"reference", "cublas", "decode_cublas", "composite", "torch", "flashinfer_cutedsl"}


class Op(NamedTuple):
    """One op of the matrix: its family, the registry op its backends
    implement, and whether its output is a GEMM's (else a quantizer's)."""

    family: Family
    impl: str
    gemm: bool


OPS: dict[str, Op] = {
    "per_token_group_quant_fp8": Op(Family.FP8_BLOCK, "per_token_group_quant_fp8", False),
    "fp8_block_mm": Op(Family.FP8_BLOCK, "fp8_block_mm", True),
    "padded_fp8_block_mm": Op(Family.FP8_BLOCK, "fp8_block_mm", True),
    "dynamic_padded_fp8_block_mm": Op(Family.FP8_BLOCK, "fp8_block_mm", True),
    "fp8_block_linear": Op(Family.FP8_BLOCK, "fp8_block_linear", True),
    "scaledmm.fp8_block_mm": Op(Family.FP8_BLOCK, "fp8_block_mm", True),
    "quant_fp8": Op(Family.FP8, "quant_fp8", False),
    "fp8_scaled_mm": Op(Family.FP8, "fp8_scaled_mm", True),
    "fp8_linear": Op(Family.FP8, "fp8_linear", True),
    "nvfp4_quant": Op(Family.NVFP4, "nvfp4_quant", False),
    "nvfp4_mm": Op(Family.NVFP4, "nvfp4_mm", True),
    "nvfp4_w4a16_mm": Op(Family.NVFP4, "nvfp4_w4a16_mm", True),
    "nvfp4_linear": Op(Family.NVFP4, "nvfp4_linear", True),
    "nvfp4_dynamic_linear": Op(Family.NVFP4, "nvfp4_dynamic_linear", True),
    "dsv3_fused_a_gemm": Op(Family.SKINNY, "dsv3_fused_a_gemm", True),
    "scaledmm.skinny_linear": Op(Family.SKINNY, "dsv3_fused_a_gemm", True),
}


def shape(device: torch.device) -> tuple[int, int]:
    """``(N, K)``.  K = 1024 gives the small-M Triton GEMMs split-K on both
    devices (fp8_block: one-launch at M <= 16); N = 128 keeps the CPU's
    interpreter grids below its 4 (fp8) / 8 (nvfp4) pretend SMs."""
    return (512, 1024) if device.type == "cuda" else (128, 1024)


# ----------------------------------------------------------------------------
# Weights, inputs, calls
# ----------------------------------------------------------------------------


class Weights(torch.nn.Module):
    """Every constant operand, as buffers (a compiled model's static inputs)."""

    def __init__(self, device: torch.device, seed: int = 0):
        super().__init__()
        n, k = shape(device)
        gen = torch.Generator().manual_seed(seed)

        def randn(*size):
            return torch.randn(*size, generator=gen).to(device)

        w_block, ws_block = fb.quantize_weight(randn(n, k))
        w8, ws8 = f8.reference_quant(randn(n, k), None, True)
        w4 = randn(n, k)
        gs_w = (NVFP4_RANGE / w4.abs().amax()).reshape(1)
        qw, sw = nv.reference_quant(w4, gs_w, True)
        gs = torch.full((1,), NVFP4_RANGE / 4.0, device=device)
        consts = {
            "w_block": w_block, "ws_block": ws_block, "bias": randn(n).to(BF16),
            "w8": w8, "ws8": ws8.reshape(-1).contiguous(), "static_scale": torch.full((1,), 0.02, device=device),
            "qw": qw, "sw": sw, "gs": gs, "alpha": (1.0 / gs_w) / gs, "alpha_w": 1.0 / gs_w,
            "wb": (randn(n, k) / k ** 0.5).to(BF16),
        }
        for name, t in consts.items():
            self.register_buffer(name, t)


class CaseModule(torch.nn.Module):
    """``call(op, weights, *inputs)`` as a module, for torch.compile."""

    def __init__(self, op: str, weights: Weights):
        super().__init__()
        self.op, self.w = op, weights

    def forward(self, *inputs):
        return call(self.op, self.w, *inputs)


def activation(m: int, k: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * 2).to(device=device, dtype=BF16)


def inputs(op: str, m: int, w: Weights, seed: int) -> tuple[torch.Tensor, ...]:
    """Fresh activations of ``op`` for M = ``m``, made with the reference
    functions (plain torch; no op or backend runs)."""
    dev = w.bias.device
    x = activation(m, shape(dev)[1], dev, seed)
    if op in ("fp8_block_mm", "padded_fp8_block_mm", "dynamic_padded_fp8_block_mm", "scaledmm.fp8_block_mm"):
        return fb.reference_quant(x)
    if op == "fp8_scaled_mm":
        return f8.reference_quant(x, None, True)
    if op == "nvfp4_mm":
        return nv.reference_quant(x, w.gs, True)
    return (x,)


def call(op: str, w, *a):
    """The op on activations ``a`` with the constants of ``w``."""
    ops = torch.ops.scaledmm
    if op == "per_token_group_quant_fp8":
        return (*ops.per_token_group_quant_fp8(a[0], 128, 1e-10, False, False),
                *ops.per_token_group_quant_fp8(a[0], 128, 1e-10, True, True))
    if op == "fp8_block_mm":
        return ops.fp8_block_mm(a[0], w.w_block, a[1], w.ws_block)
    if op == "padded_fp8_block_mm":
        return ops.padded_fp8_block_mm(a[0], w.w_block, a[1], w.ws_block)
    if op == "dynamic_padded_fp8_block_mm":
        return ops.dynamic_padded_fp8_block_mm(a[0], w.w_block, a[1], w.ws_block)
    if op == "scaledmm.fp8_block_mm":
        return scaledmm.fp8_block_mm(a[0], w.w_block, a[1], w.ws_block)
    if op == "fp8_block_linear":
        return ops.fp8_block_linear(a[0], w.w_block, w.ws_block, [128, 128], BF16, w.bias)
    if op == "quant_fp8":
        return (*ops.quant_fp8(a[0]), *ops.quant_fp8(a[0], None, True), *ops.quant_fp8(a[0], w.static_scale))
    if op == "fp8_scaled_mm":
        return ops.fp8_scaled_mm(a[0], w.w8, a[1], w.ws8, w.bias)
    if op == "fp8_linear":
        return ops.fp8_linear(a[0], w.w8, w.ws8, None, True, w.bias)
    if op == "nvfp4_quant":
        return (*ops.nvfp4_quant(a[0], w.gs, True), *ops.nvfp4_quant(a[0], w.gs, False))
    if op == "nvfp4_mm":
        return ops.nvfp4_mm(a[0], w.qw, a[1], w.sw, w.alpha, BF16, w.bias)
    if op == "nvfp4_w4a16_mm":
        return ops.nvfp4_w4a16_mm(a[0], w.qw, w.sw, w.alpha_w, BF16, w.bias)
    if op == "nvfp4_linear":
        return ops.nvfp4_linear(a[0], w.qw, w.sw, w.gs, w.alpha, BF16, w.bias)
    if op == "nvfp4_dynamic_linear":  # the per-row amax reduced in the graph, as NvFp4Linear does
        return ops.nvfp4_dynamic_linear(a[0], a[0].float().abs().amax(dim=1), w.qw, w.sw, w.alpha_w, BF16, w.bias)
    if op == "dsv3_fused_a_gemm":
        return ops.dsv3_fused_a_gemm(a[0], w.wb)
    if op == "scaledmm.skinny_linear":
        return scaledmm.skinny_linear(a[0], w.wb)
    raise ValueError(f"op: expected one of {sorted(OPS)}, got {op!r}")


def flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


# ----------------------------------------------------------------------------
# Which backend runs which M
# ----------------------------------------------------------------------------


def backend_problems(op: str, w: Weights, a: tuple[torch.Tensor, ...]) -> list[tuple[Problem, str]]:
    """The ``(problem, registry op)`` selections ``op`` makes on ``a`` (built
    as the op modules build them; ``held`` checks the prediction against the
    registry's answers)."""
    x = a[0]
    m, k = x.shape
    bs = (128, 128)
    if op == "per_token_group_quant_fp8":
        return [(Problem(Family.FP8_BLOCK, x.device, m, 0, k, x.dtype, FP8, x.stride(0),
                         (("group_size", 128), ("column_major_scales", col), ("scale_ue8m0", col))), op)
                for col in (False, True)]
    if op == "fp8_block_mm":
        return [(fb.problem(x, w.w_block, bs, BF16, False), "fp8_block_mm")]
    if op in ("padded_fp8_block_mm", "dynamic_padded_fp8_block_mm", "scaledmm.fp8_block_mm"):
        mp = -(-m // fb.ALIGN_M) * fb.ALIGN_M  # aligned M: the direct op, the same problem
        return [(fb.problem(x, w.w_block, bs, BF16, False, m=mp), "fp8_block_mm")]
    if op == "fp8_block_linear":
        return [(fb.linear_problem(x, w.w_block, bs, BF16), op)]
    if op == "quant_fp8":
        return [(Problem(Family.FP8, x.device, m, 0, k, x.dtype, FP8, x.stride(0), (("quant", mode),)), op)
                for mode in ("per_tensor", "per_token", "static")]
    if op == "fp8_scaled_mm":
        kinds = (f8.scale_a_kind(op, a[1], m), f8.scale_b_kind(op, w.ws8, w.w8.shape[0]))
        return [(f8.mm_problem(x, w.w8, *kinds, w.bias, BF16), op)]
    if op == "fp8_linear":
        return [(f8.linear_problem(x, w.w8, None, True, f8.CHANNEL, w.bias, BF16), op)]
    if op == "nvfp4_quant":
        return [(nv.quant_problem(x, swz), op) for swz in (True, False)]
    if op == "nvfp4_mm":
        return [(nv.mm_problem(x, w.qw, BF16, w.bias), op)]
    if op == "nvfp4_w4a16_mm":
        return [(nv.w4a16_problem(x, w.qw, BF16, w.bias), op)]
    if op in ("nvfp4_linear", "nvfp4_dynamic_linear"):
        return [(nv.linear_problem(x, w.qw, BF16, w.bias), op)]
    if op in ("dsv3_fused_a_gemm", "scaledmm.skinny_linear"):
        # M = 0 returns before selecting; skinny_linear above 16 rows is F.linear
        return [(skinny.problem(x, w.wb, False), "dsv3_fused_a_gemm")] if 1 <= m <= skinny.MAX_M else []
    raise ValueError(f"op: expected one of {sorted(OPS)}, got {op!r}")


def op_accepts(op: str, m: int) -> bool:
    """M the op itself takes (dsv3_fused_a_gemm: at most 16 rows)."""
    return m <= skinny.MAX_M if op == "dsv3_fused_a_gemm" else True


def runnable_ms(op: str, backend: str, w: Weights, ms=MS, device_checked: bool = True) -> list[int]:
    """The M of ``ms`` for which every selection of ``op`` can take
    ``backend`` (``backend.check``; ``device_checked=False``: its
    ``can_implement`` alone, to plan a GPU's cases on the CPU)."""
    b = backends.get(OPS[op].family, backend)
    out = []
    for m in ms:
        if not op_accepts(op, m):
            continue
        probs = backend_problems(op, w, inputs(op, m, w, seed=0))
        if all((b.check(p) if device_checked else b.can_implement(p))[0] for p, _ in probs):
            out.append(m)
    return out


def cases(device: torch.device, device_checked: bool = True) -> list[tuple[str, str]]:
    """``(op, backend)`` for every op and every registered backend of its
    family that implements it and supports ``device``."""
    found = []
    for op, spec in OPS.items():
        for name in backends.names(spec.family):
            b = backends.get(spec.family, name)
            if spec.impl not in b.impls:
                continue
            if device_checked and not b.is_supported(device)[0]:
                continue
            found.append((op, name))
    return found


def matrix_cases(device: torch.device) -> list[tuple[str, str, bool, bool]]:
    """``(op, backend, dynamic, passes)`` for every case of :func:`cases`."""
    return [(op, b, dyn, ps) for op, b in cases(device) for dyn in (True, False) for ps in (True, False)]


def stream_cases(device: torch.device) -> list[tuple[str, str]]:
    return cases(device)


# ----------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def exact(op: str, backend: str, m: int) -> bool:
    """GEMM outputs compared bit for bit (see LIBRARY_BACKENDS)."""
    if op == "scaledmm.skinny_linear" and m > skinny.MAX_M:
        return False  # F.linear: cuBLAS
    return backend not in LIBRARY_BACKENDS


def mismatch(got: list[torch.Tensor], want: list[torch.Tensor], bitwise: bool) -> str | None:
    """Why ``got`` differs from ``want``, or None."""
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {i}: {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
        if bitwise or w.dtype in (FP8, torch.uint8):
            if not torch.equal(_bytes(g), _bytes(w)):
                diff = (_bytes(g) != _bytes(w)).sum().item()
                return f"output {i} ({w.dtype}): {diff} of {_bytes(w).numel()} bytes differ"
        elif w.numel():
            scale = w.float().abs().amax().item()
            try:
                torch.testing.assert_close(g.float(), w.float(), rtol=2.0 ** -7, atol=2.0 ** -8 * scale + 1e-6,
                                           equal_nan=True)
            except AssertionError as e:
                return f"output {i}: {e}"
    return None


def poison_(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point and t.element_size() >= 2:
        t.fill_(float("nan"))
    elif t.numel():
        t.view(torch.uint8).fill_(0xFF)


# ----------------------------------------------------------------------------
# Tensors held by the package
# ----------------------------------------------------------------------------


def _ours(module: Any) -> bool:
    return isinstance(module, str) and (module == "scaledmm" or module.startswith("scaledmm."))


def _children(obj: Any, root: bool):
    """``(child, label)`` pairs the walk follows from ``obj``: containers,
    lru_cache entries, closures and defaults of scaledmm functions,
    attributes of scaledmm classes and their instances, context variables.
    Other libraries' objects (torch, triton) are not entered."""
    if isinstance(obj, types.ModuleType):
        return
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield key, f"{{key {key!r}}}"
            yield value, f".{key}" if root else f"[{key!r}]"
    elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        for i, value in enumerate(list(obj)):
            yield value, f"[{i}]"
    elif isinstance(obj, functools._lru_cache_wrapper):
        for ref in gc.get_referents(obj):  # the cache (results, and keys) and the wrapped function
            yield ref, "<lru_cache>"
    elif type(obj).__name__ == "_lru_list_elem":
        for ref in gc.get_referents(obj):
            yield ref, ""
    elif isinstance(obj, functools.partial):
        yield obj.func, ".func"
        yield obj.args, ".args"
        yield obj.keywords, ".keywords"
    elif isinstance(obj, types.FunctionType):
        if _ours(obj.__module__):
            for cell in obj.__closure__ or ():
                try:
                    yield cell.cell_contents, f"<closure {obj.__qualname__}>"
                except ValueError:  # an empty cell
                    pass
            yield obj.__defaults__ or (), f"<defaults {obj.__qualname__}>"
            yield obj.__kwdefaults__ or {}, f"<kwdefaults {obj.__qualname__}>"
            yield obj.__dict__, f"<attrs {obj.__qualname__}>"
    elif isinstance(obj, (types.MethodType, staticmethod, classmethod)):
        yield obj.__func__, ".__func__"
        if isinstance(obj, types.MethodType):
            yield obj.__self__, ".__self__"
    elif isinstance(obj, contextvars.ContextVar):
        yield obj.get(None), "<value>"
    elif isinstance(obj, type):
        if _ours(obj.__module__):
            yield dict(vars(obj)), f"<class {obj.__qualname__}>"
    elif _ours(type(obj).__module__):
        if hasattr(obj, "__dict__"):
            yield dict(vars(obj)), ""
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                yield getattr(obj, name), f".{name}"


def held_tensors(device_type: str | None = None) -> dict[int, str]:
    """``{id: path}`` of every tensor (on ``device_type``, default any)
    reachable from the globals of the imported scaledmm modules: what an op
    kept past its call lives there (module dicts, lru_caches, closures)."""
    found: dict[int, str] = {}
    seen: set[int] = set()
    alive = []  # the walk makes temporaries (attribute dicts): keep them, or ids repeat
    stack = [(vars(mod), name, True) for name, mod in sorted(sys.modules.items())
             if _ours(name) and mod is not None]
    while stack:
        obj, path, root = stack.pop()
        if id(obj) in seen or path.count("[") + path.count(".") > 40:
            continue
        seen.add(id(obj))
        alive.append(obj)
        if isinstance(obj, torch.Tensor):
            if device_type is None or obj.device.type == device_type:
                found[id(obj)] = path
            continue
        stack.extend((child, path + label, False) for child, label in _children(obj, root))
    return found


# ----------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------


class CaseFailed(Exception):
    pass


def _recompile_limit(n: int) -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, n)


def run_matrix(op: str, backend: str, dynamic: bool, passes: bool, device: torch.device, ms=MS) -> str:
    """Mode ``matrix`` (module docstring); raises CaseFailed."""
    from torch._dynamo.utils import counters

    import scaledmm.compile as sc

    w = Weights(device)
    run_ms = runnable_ms(op, backend, w, ms)
    if not run_ms:
        raise CaseFailed(f"{op} on {backend}: no M of {ms} can run")
    calls = {(m, i): inputs(op, m, w, seed=1000 * m + i) for m in run_ms for i in range(3)}
    options: dict[str, Any] = {"triton.cudagraphs": True}
    if passes:  # the pass with Inductor's PDL as well (ours is on by default): the most overlap
        options.update(sc.options(pdl=True))
    _recompile_limit(64)
    counters.clear()
    compiled = torch.compile(CaseModule(op, w), fullgraph=True, dynamic=dynamic, options=options)
    family = OPS[op].family
    got = {}
    # The compiled calls come first: the first call of every kernel path in
    # this process is Inductor's warm-up, inside its CUDA-graph pool.
    with torch.no_grad(), scaledmm.use_backend(family, backend):
        for m in run_ms:
            for i in range(3):  # warm-up, recording, replay
                torch.compiler.cudagraph_mark_step_begin()
                got[(m, i)] = [t.clone() for t in flat(compiled(*calls[(m, i)]))]
    if device.type == "cuda":
        torch.cuda.synchronize()
    errors = []
    with torch.no_grad(), scaledmm.use_backend(family, backend):
        for (m, i), args in calls.items():
            bad = mismatch(got[(m, i)], flat(call(op, w, *args)), exact(op, backend, m) or not OPS[op].gemm)
            if bad:
                errors.append(f"M={m} call {i}: {bad}")
    skips = counters["inductor"]["cudagraph_skips"]
    cond_left = op in ("scaledmm.fp8_block_mm", "scaledmm.skinny_linear") and dynamic and not passes
    if device.type == "cuda":
        if cond_left and skips == 0:
            errors.append("expected Inductor to skip CUDA graphs for the torch.cond left without the pass")
        if not cond_left and skips:
            errors.append(f"Inductor skipped CUDA graphs {skips} time(s)")
    held = held_tensors(device.type)
    if held:
        errors.append(f"scaledmm modules hold {len(held)} tensor(s): {sorted(held.values())}")
    if errors:
        raise CaseFailed(f"{op} on {backend} (dynamic={dynamic}, passes={passes}), M {run_ms}:\n  "
                         + "\n  ".join(errors))
    return f"ok: M {run_ms}, {len(calls)} calls, cudagraph skips {skips}"


def run_streams(op: str, backend: str, device: torch.device, iters: int = 50) -> str:
    """Mode ``streams`` (module docstring); raises CaseFailed."""
    w = Weights(device)
    run_ms = [m for m in runnable_ms(op, backend, w) if m > 0]
    if not run_ms:
        raise CaseFailed(f"{op} on {backend}: no M of {MS} can run")
    cur = torch.cuda.current_stream()
    errors = []
    with torch.no_grad(), scaledmm.use_backend(OPS[op].family, backend):
        for m in run_ms:
            pair = [inputs(op, m, w, seed=1000 * m + i) for i in range(2)]
            side = torch.cuda.Stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):  # kernels built and loaded outside the capture
                for args in pair:
                    call(op, w, *args)
            cur.wait_stream(side)
            graphs, outs = [], []
            for args in pair:
                # torch 2.11 keeps one cuBLAS workspace per (handle, stream), so
                # graphs captured on one stream share it and race in it when
                # replayed at once, whatever the op (pytorch/pytorch#193402).
                # Emptying that cache before each capture gives each graph its
                # own: what this checks is the state of our ops.
                clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
                if clear is not None:
                    clear()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    outs.append(flat(call(op, w, *args)))
                graphs.append(g)
            for g, out in zip(graphs, outs):  # one after the other
                for t in out:
                    poison_(t)
                g.replay()
            torch.cuda.synchronize()
            refs = [[t.clone() for t in out] for out in outs]
            for args, ref in zip(pair, refs):
                bad = mismatch(ref, flat(call(op, w, *args)), exact(op, backend, m) or not OPS[op].gemm)
                if bad:
                    errors.append(f"M={m} replay vs eager: {bad}")
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]
            diff = torch.zeros((), dtype=torch.int64, device=device)
            for _ in range(iters):
                for s in streams:
                    s.wait_stream(cur)
                for s, g, out in zip(streams, graphs, outs):
                    with torch.cuda.stream(s):
                        for t in out:
                            poison_(t)
                        g.replay()
                for s in streams:
                    cur.wait_stream(s)
                for out, ref in zip(outs, refs):
                    for t, r in zip(out, ref):
                        diff += (_bytes(t) != _bytes(r)).sum()
            torch.cuda.synchronize()
            if diff.item():
                errors.append(f"M={m}: {diff.item()} bytes differ over {iters} concurrent replays")
            del graphs, outs
    if errors:
        raise CaseFailed(f"{op} on {backend}, two graphs on two streams:\n  " + "\n  ".join(errors))
    return f"ok: M {run_ms}, {iters} concurrent replays each"


def run_repro() -> str:
    """Mode ``repro``: issue #14, item 1, as reported (a fresh process on the
    H200), then more M; raises CaseFailed (or the error of the issue)."""
    import torch, scaledmm, scaledmm.compile as C  # noqa: E401, F811
    k, n = 1024, 512
    b = (torch.randn(n, k, device='cuda') / 8).to(torch.float8_e4m3fn)
    sb = torch.rand(n // 128, k // 128, device='cuda') + 0.5

    def f(x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, False, False)
        return scaledmm.fp8_block_mm(q, b, s, sb)

    cf = torch.compile(f, fullgraph=True, dynamic=True,
                       options={'triton.cudagraphs': True, 'post_grad_custom_post_pass': C.passes()})
    cf(torch.randn(3, k, device='cuda', dtype=torch.bfloat16))
    # then every M three times (recording, replays), compared after all compiled calls
    xs = [torch.randn(m, k, device="cuda", dtype=BF16) for m in (3, 1, 4, 17, 64) for _ in range(3)]
    got = []
    for x in xs:
        torch.compiler.cudagraph_mark_step_begin()
        got.append(cf(x).clone())
    errors = [f"M={x.shape[0]}: {bad}" for x, g in zip(xs, got)
              if (bad := mismatch([g], [f(x)], bitwise=False))]  # the pass fuses quant + GEMM
    if errors:
        raise CaseFailed("issue #14 reproduction:\n  " + "\n  ".join(errors))
    return f"ok: {len(xs) + 1} compiled calls"


def _plant_counter_cache() -> None:
    """The pattern the held check is for: a process-wide counter buffer."""
    from scaledmm.ops import fp8_block_triton as T
    from scaledmm.ops import fp8_block_triton_splitk as S

    S.COUNTERS = {}

    def cached(device, tiles):
        buf = S.COUNTERS.setdefault(device, torch.zeros(4096, dtype=torch.int32, device=device))
        return buf[:tiles]

    cached.__module__ = S.__name__
    T.tile_counters = S.tile_counters = cached


def _spy(module, name: str, calls: collections.Counter, key: str) -> None:
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls[key] += 1
        return real(*args, **kwargs)

    setattr(module, name, spy)


def run_held(only: list[str], plant: bool) -> str:
    """CPU under the interpreter: see the module docstring."""
    from scaledmm.ops import fp8_block_triton as T
    from scaledmm.ops import nvfp4_triton as nt

    if not interpreting():
        raise CaseFailed("held: run with TRITON_INTERPRET=1 (set before triton is imported)")
    cpu = torch.device("cpu")
    w = Weights(cpu)
    if plant:
        _plant_counter_cache()
    baseline = held_tensors()
    split_k = collections.Counter()
    _spy(T, "tile_counters", split_k, "fp8_block one-launch")
    _spy(nt, "tile_counters", split_k, "nvfp4 split-K")
    todo = [c for c in cases(cpu) if not only or f"{c[0]}:{c[1]}" in only]
    errors = []
    with torch.no_grad():
        for op, backend in todo:
            predicted = runnable_ms(op, backend, w, CPU_MS)
            for m in CPU_MS:
                if not op_accepts(op, m):
                    continue
                args = inputs(op, m, w, seed=m)
                try:
                    with scaledmm.use_backend(OPS[op].family, backend):
                        out = flat(call(op, w, *args))
                    ran = True
                except RuntimeError as e:
                    if "was requested but cannot run" not in str(e):
                        raise
                    ran = False
                if ran != (m in predicted):
                    errors.append(f"{op} on {backend}, M={m}: ran={ran}, runnable_ms says {m in predicted}")
                if not ran:
                    continue
                with scaledmm.use_backend(OPS[op].family, "reference"):
                    ref = flat(call(op, w, *args))
                if [(t.shape, t.dtype, t.stride()) for t in out] != [(t.shape, t.dtype, t.stride()) for t in ref]:
                    errors.append(f"{op} on {backend}, M={m}: outputs {[(t.shape, t.dtype) for t in out]}, "
                                  f"reference {[(t.shape, t.dtype) for t in ref]}")
                elif OPS[op].gemm and m and not torch.allclose(out[0].float(), ref[0].float(), rtol=2e-2,
                                                               atol=2e-2 * ref[0].float().abs().amax().item()):
                    errors.append(f"{op} on {backend}, M={m}: far from the reference backend")
    if not only:
        missing = {"fp8_block one-launch", "nvfp4 split-K"} - set(split_k)
        if missing:
            errors.append(f"the sweep never reached {sorted(missing)}: the held check below proves nothing there")
    gc.collect()
    held = {i: p for i, p in held_tensors().items() if i not in baseline}
    if held:
        errors.append(f"scaledmm modules hold {len(held)} tensor(s) after the calls: {sorted(held.values())}")
    if errors:
        raise CaseFailed("held:\n  " + "\n  ".join(errors))
    return f"ok: {len(todo)} op x backend cases, split-K calls {dict(split_k)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["matrix", "streams", "repro", "held"])
    ap.add_argument("op", nargs="?")
    ap.add_argument("backend", nargs="?")
    ap.add_argument("--dynamic", type=int, choices=[0, 1], default=1)
    ap.add_argument("--passes", type=int, choices=[0, 1], default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", action="append", default=[], help="held: OP:BACKEND (repeatable)")
    ap.add_argument("--plant", action="store_true", help="held: put back a process-wide counter cache first")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    try:
        if args.mode == "matrix":
            msg = run_matrix(args.op, args.backend, bool(args.dynamic), bool(args.passes), device)
        elif args.mode == "streams":
            msg = run_streams(args.op, args.backend, device, args.iters)
        elif args.mode == "repro":
            msg = run_repro()
        else:
            msg = run_held(args.only, args.plant)
    except CaseFailed as e:
        print(f"FAILED {' '.join(sys.argv[1:])}\n{e}", file=sys.stderr)
        return 1
    print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
