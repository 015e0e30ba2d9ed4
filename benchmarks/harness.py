"""What is benchmarked and how a point is run: providers, op benches, the
correctness gate and the loop over shapes and M.

An :class:`OpBench` describes one op (input builder, float64 reference,
baselines); the family modules (``benchmarks/fp8_block.py`` ...) define them.
Our providers are not listed anywhere: :func:`providers` enumerates the op's
backends from the ``scaledmm.backends`` registry at run time (each forced with
``scaledmm.use_backend``, plus ``auto``), so a new backend shows up without a
change here.  Every provider is checked against the float64 reference on fresh
random inputs before it is timed; a wrong one is reported and not timed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Callable, Sequence

import torch

from .shapes import Shape
from .timing import Timing, TimingConfig, copies_for, measure, synchronize

__all__ = ["OURS", "BASELINE", "Provider", "OpBench", "Result", "providers", "run_point", "run_bench",
           "rel_err", "mismatch_fraction", "always", "forced"]

OURS = "ours"
BASELINE = "baseline"

Args = tuple
Predicate = Callable[[Args], "tuple[bool, str]"]


def always(args: Args) -> tuple[bool, str]:
    return True, ""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (``||out - ref||`` when ref is 0)."""
    num = (out.double() - ref.double()).norm().item()
    den = ref.double().norm().item()
    return num / den if den > 0 else num


def mismatch_fraction(out: torch.Tensor, ref: torch.Tensor | tuple[torch.Tensor, ...]) -> float:
    """Fraction of elements of ``out`` that match no candidate within 1e-6
    relative.  ``ref`` is one tensor or a tuple of acceptable candidates
    (quantizers: the formula evaluated a few fp32 ulps either side of each
    value, as SPEC.md lets codes differ where fp32 rounding meets a code
    boundary)."""
    if out.numel() == 0:
        return 0.0
    o = out.double()
    close = torch.zeros(o.shape, dtype=torch.bool, device=o.device)
    for c in (ref if isinstance(ref, tuple) else (ref,)):
        close |= (o - c).abs() <= 1e-6 * c.abs()
    return 1.0 - close.double().mean().item()


@dataclasses.dataclass(frozen=True, eq=False)
class Provider:
    """One way of computing a benchmarked op.

    Parameters
    ----------
    name : str
        Column label: a backend name, ``auto``, or a baseline's name.
    kind : str
        ``OURS`` or ``BASELINE`` (results are also reported as ratios to baselines).
    prepare : callable(logical) -> args
        Untimed: one random logical input set -> the call's arguments.
        Providers sharing ``prepare`` share the arguments and the reference.
    call : callable(*args) -> output
        The timed call.
    reference : callable(args) -> Tensor or tuple of Tensor
        float64 result ``call(*args)`` must approximate (a tuple: acceptable
        candidates, for ``error=mismatch_fraction``).
    to_f64 : callable(output) -> Tensor
        The output as float64, comparable with ``reference``.
    unit : str or None
        Math ceiling the rate is compared with (``"bf16"``, ``"fp8"``) or None.
    applies : callable(args) -> (bool, str)
        Whether the provider claims it can compute this problem (``Backend.check``).
    tol : float
        Largest accepted ``error(out, ref)``.
    error : callable(out, ref) -> float
        :func:`rel_err` (default) or :func:`mismatch_fraction`.
    """

    name: str
    kind: str
    prepare: Callable[[Args], Args]
    call: Callable[..., Any]
    reference: Callable[[Args], Any]
    to_f64: Callable[[Any], torch.Tensor]
    unit: str | None
    applies: Predicate = always
    tol: float = 1e-2
    error: Callable[[torch.Tensor, torch.Tensor], float] = rel_err


@dataclasses.dataclass(frozen=True, eq=False)
class OpBench:
    """One op to benchmark: inputs, reference, registry link and baselines.

    Parameters
    ----------
    family : str
        Benchmark family (the CLI name and module), e.g. ``"quant"``.
    op : str
        ``torch.ops.scaledmm.<op>``.
    registry : str
        ``scaledmm.backends`` family whose backends implement ``op``.
    make_inputs : callable(m, shape, device) -> logical
        Fresh random logical inputs (e.g. bf16 activation and weight).
    prepare, reference, to_f64, unit, tol, error
        As in :class:`Provider`, for our providers (the op's arguments).
    problem : callable(args) -> scaledmm.backends.Problem
        The problem the op builds for these arguments (for ``Backend.check``).
    flops : callable(m, shape) -> float
        Useful floating-point operations (0 for quantizers).
    baselines : callable(device) -> list[Provider]
        Providers we compare with.
    default_shapes : str
        Shape spec used when ``--shapes`` is not given (GPU runs).
    default_m : tuple of int or None
        M sweep when ``--m`` is not given (None: the common default).
    valid : callable(args) -> (bool, str)
        Conditions of the op itself (e.g. M <= 16); our providers are n/a outside.
    requires : tuple of str
        Further ``torch.ops.scaledmm`` ops the bench calls.
    uses_weight : bool
        False for ops on the activation alone (quantizers): only K of a shape counts.
    baseline_notes : callable(device) -> list of str
        Lines for the family notes on optional baselines (what is called, or
        why one is not available).
    """

    family: str
    op: str
    registry: str
    make_inputs: Callable[[int, Shape, torch.device], Args]
    prepare: Callable[[Args], Args]
    reference: Callable[[Args], torch.Tensor]
    to_f64: Callable[[Any], torch.Tensor]
    problem: Callable[[Args], Any]
    flops: Callable[[int, Shape], float]
    baselines: Callable[[torch.device], list[Provider]]
    default_shapes: str
    unit: str | None = None
    default_m: tuple[int, ...] | None = None
    valid: Predicate = always
    tol: float = 1e-2
    error: Callable[[torch.Tensor, torch.Tensor], float] = rel_err
    requires: tuple[str, ...] = ()
    uses_weight: bool = True
    baseline_notes: Callable[[torch.device], list[str]] = lambda device: []

    def available(self) -> tuple[bool, str]:
        """Whether the op (and what it needs) is defined in this checkout."""
        for name in (self.op, *self.requires):
            if not hasattr(torch.ops.scaledmm, name):
                return False, f"torch.ops.scaledmm.{name} is not defined (op not written yet?)"
        return True, ""


@dataclasses.dataclass(frozen=True)
class Result:
    """One provider at one point.  ``status``: ok, wrong, n/a or error."""

    family: str
    op: str
    shape: Shape
    m: int
    provider: str
    kind: str
    unit: str | None
    status: str
    backend: str = ""  # backend(s) the registry selected during the checked call
    error: float = math.nan
    timing: Timing | None = None
    copies: int = 0
    rotation_bytes: int = 0
    flops: float = 0.0
    nbytes: int = 0
    note: str = ""


# ----------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------


def forced(op: Callable[..., Any], family: str, name: str) -> Callable[..., Any]:
    """``op`` run inside ``scaledmm.use_backend(family, name)`` (``"auto"``:
    automatic selection, also masking the environment variable)."""
    import scaledmm

    def call(*args):
        with scaledmm.use_backend(family, name):
            return op(*args)

    return call


def _both(p: Predicate, q: Callable[[Args], "tuple[bool, str]"]) -> Predicate:
    def pred(args: Args) -> tuple[bool, str]:
        ok, why = p(args)
        return (ok, why) if not ok else q(args)

    return pred


def providers(bench: OpBench, device: torch.device) -> tuple[list[Provider], list[str]]:
    """``auto``, every registered backend of ``bench.op`` usable on ``device``
    (forced one at a time), then the baselines.  Also returns one line per
    backend left out, with its reason."""
    from scaledmm import backends

    op = getattr(torch.ops.scaledmm, bench.op)

    def ours(name: str, applies: Predicate) -> Provider:
        return Provider(name, OURS, bench.prepare, forced(op, bench.registry, name), bench.reference,
                        bench.to_f64, bench.unit, applies, bench.tol, bench.error)

    out = [ours("auto", bench.valid)]
    skipped = []
    for name in backends.names(bench.registry):
        backend = backends.get(bench.registry, name)
        if bench.op not in backend.impls:
            continue
        try:
            ok, why = backend.is_supported(device)
        except Exception as e:
            ok, why = False, f"support probe failed: {type(e).__name__}: {e}"
        if not ok:
            skipped.append(f"{name}: {why}")
            continue

        def check(args: Args, backend=backend) -> tuple[bool, str]:
            return backend.check(bench.problem(args))

        out.append(ours(name, _both(bench.valid, check)))
    return out + list(bench.baselines(device)), skipped


# ----------------------------------------------------------------------------
# One point: correctness gate, then timing
# ----------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(x) for x in obj)
    return 0


def _poison_allocator(device: torch.device, nbytes: int) -> None:
    """Best effort: leave NaN bytes (0xFF) in the block the caching allocator
    will hand to the next output of about this size, so an output the kernel
    does not fully write shows up as non-finite."""
    if device.type == "cuda" and nbytes > 0:
        torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0xFF)


def _cannot_run(e: BaseException) -> bool:
    # scaledmm.backends.select's message when a forced backend declines.
    return isinstance(e, RuntimeError) and "was requested but" in str(e)


def run_point(bench: OpBench, shape: Shape, m: int, provs: Sequence[Provider], device: torch.device,
              cfg: TimingConfig) -> list[Result]:
    """Check and time every provider at (shape, m).  Providers that share a
    ``prepare`` share input copies and the float64 reference."""
    results: dict[int, Result] = {}
    logical: list[Args] = []

    def logical_set(i: int) -> Args:
        while len(logical) <= i:
            logical.append(bench.make_inputs(m, shape, device))
        return logical[i]

    groups: dict[Callable, list[tuple[int, Provider]]] = {}
    for idx, p in enumerate(provs):
        groups.setdefault(p.prepare, []).append((idx, p))
    flops = bench.flops(m, shape)
    for prepare, members in groups.items():
        base = dict(family=bench.family, op=bench.op, shape=shape, m=m, flops=flops)
        try:
            args0 = prepare(logical_set(0))
            set_bytes = _nbytes(args0)
            copies = copies_for(set_bytes, cfg)
            args_list = [args0] + [prepare(logical_set(i)) for i in range(1, copies)]
            ref = members[0][1].reference(args0)
        except Exception as e:  # inputs or reference could not be built: nothing to time
            for idx, p in members:
                results[idx] = Result(provider=p.name, kind=p.kind, unit=p.unit, status="error",
                                      note=f"inputs/reference failed: {_first_line(e)}", **base)
            continue
        base.update(copies=copies, rotation_bytes=set_bytes * copies)
        for idx, p in members:
            results[idx] = _check_and_time(p, args_list, ref, device, cfg,
                                           dict(base, provider=p.name, kind=p.kind, unit=p.unit))
        del args_list, args0, ref
    return [results[i] for i in range(len(provs))]


def _check_and_time(p: Provider, args_list: list[Args], ref: torch.Tensor, device: torch.device,
                    cfg: TimingConfig, base: dict) -> Result:
    args0 = args_list[0]
    try:
        ok, why = p.applies(args0)
    except Exception as e:
        ok, why = False, f"check failed: {_first_line(e)}"
    if not ok:
        return Result(status="n/a", note=why, **base)
    want = (ref[0] if isinstance(ref, tuple) else ref).shape  # a tuple lists candidates
    _poison_allocator(device, math.prod(want) * 2)
    from scaledmm import backends

    try:
        with backends.record() as calls:  # which backend(s) the call selected
            out = p.call(*args0)
        synchronize(device)
        got = p.to_f64(out)
    except Exception as e:
        status = "n/a" if p.kind == BASELINE or _cannot_run(e) else "error"
        return Result(status=status, note=_first_line(e), **base)
    base["backend"] = "+".join(dict.fromkeys(name for _, name, _ in calls))
    nbytes = _nbytes(args0) + _nbytes(out)
    base["nbytes"] = nbytes
    if got.shape != want:
        return Result(status="wrong", note=f"output shape {tuple(got.shape)}, expected {tuple(want)}", **base)
    finite = bool(torch.isfinite(got).all())
    err = p.error(got, ref) if finite else math.nan
    if not finite or not err <= p.tol:
        why = "non-finite output" if not finite else f"{p.error.__name__} {err:.3g} > tol {p.tol:g}"
        return Result(status="wrong", error=err, note=why, **base)
    del out, got
    fns = [functools.partial(p.call, *a) for a in args_list]
    try:
        timing = measure(fns, device, cfg)
    except Exception as e:
        return Result(status="error", error=err, note=f"timing failed: {_first_line(e)}", **base)
    return Result(status="ok", error=err, timing=timing, note=timing.note, **base)


def run_bench(bench: OpBench, shapes: Sequence[Shape], ms: Sequence[int], provs: Sequence[Provider],
              device: torch.device, cfg: TimingConfig, log=sys.stderr) -> list[Result]:
    """Every (shape, m) point of ``bench``, with a progress line per point."""
    results: list[Result] = []
    for shape in shapes:
        for m in ms:
            point = run_point(bench, shape, m, provs, device, cfg)
            results.extend(point)
            cells = ", ".join(
                f"{r.provider} {r.timing.median_us:.1f}us" if r.timing else f"{r.provider} {r.status}"
                for r in point)
            print(f"[{bench.op} {shape.label} M={m}] {cells}", file=log, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results
