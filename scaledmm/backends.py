"""Backend registry: which kernel runs an op on which device.

Every op family (``fp8_block``, ``fp8``, ``nvfp4``, ``skinny``) has a set of
named backends.  A backend declares two predicates:

* ``is_supported(device) -> (bool, reason)``: can it run on this device at all
  (GPU architecture, installed packages, ...)?  The answer is cached per device.
* ``can_implement(problem) -> (bool, reason)``: can it compute this particular
  problem (alignment of M, N, K, dtypes, strides, ...)?

Automatic selection walks the order that the family's selection policy gives
for the device and the problem's shape (fastest measured first) and takes the
first backend for which both hold.  The policy is data, one file per family
and architecture, ``scaledmm/tuning/<family>_<arch>.json`` (see
:mod:`scaledmm.policy`): the order, measured per-shape rows and each
backend's on/off environment switch, read at the first selection.  Users
override the choice with the environment variable
``SCALEDMM_<FAMILY>_BACKEND=<name>`` or with the context manager
:func:`use_backend`.  The override applies to the ops the named
backend implements; the family's other ops (a quantizer when the backend is a
GEMM, say) run as if nothing was requested.  An explicit backend that
implements the op but cannot run the call raises with its reason instead of
silently falling back.

An implementation that declares a keyword-only ``problem`` parameter is
called with the :class:`Problem` it was selected for (:meth:`Backend.run`),
so it need not derive it again from the tensors.

Editing the policy in this process (:func:`set_priority`,
:func:`override_policy`, :func:`policy_snapshot`, ...) lives in
:mod:`scaledmm.policy_edits` and the human-readable :func:`report` in
:mod:`scaledmm.backend_report`; both are re-exported here.

This module is part of the core: it imports no op module.  Op modules call
:func:`register` at import time and nothing else: no module changes the
policy when it is imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import inspect
from typing import Any, Callable, Iterator

import torch

from . import device as _device
from . import env as _env
from . import policy as _policies
from .policy import Policy

__all__ = [
    "Family",
    "Problem",
    "Backend",
    "register",
    "get",
    "names",
    "select",
    "use_backend",
    "priority",
    "policy",
    "override_policy",
    "policy_snapshot",
    "set_priority",
    "arch_key",
    "report",
    "record",
    "set_auto_table",
    "load_auto_table",
    "auto_order",
    "requested",
    "family_ops",
    "invalidate",
    "supported_on",
    "switch_line",
]


class Family(str, enum.Enum):
    """The op families; each one has its own set of backends."""

    FP8_BLOCK = "fp8_block"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    SKINNY = "skinny"

    @property
    def env_var(self) -> str:
        return _env.backend_var(self.value)

    @classmethod
    def parse(cls, family: "Family | str") -> "Family":
        if isinstance(family, Family):
            return family
        try:
            return cls(family)
        except ValueError:
            valid = ", ".join(f.value for f in cls)
            raise ValueError(f"family: expected one of [{valid}], got {family!r}") from None


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a backend needs to know to decide whether it can compute a call.

    Parameters
    ----------
    family : Family
        The op family.
    device : torch.device
        Device of the operands.
    m, n, k : int
        GEMM sizes: activation rows, output columns, reduction length (logical
        elements, not packed bytes).
    in_dtype : torch.dtype
        dtype of the activation operand as given to the op.
    out_dtype : torch.dtype
        Requested output dtype.
    a_row_stride : int
        Row stride of the activation in elements (``k`` when contiguous).
    options : tuple of (str, Any)
        Family-specific facts, e.g. ``("block_size", (128, 128))`` or
        ``("a_scales_col_major", True)``; read with :meth:`opt`.  The option
        ``"variant"`` (a name) selects the policy's ``op:variant`` rows.
    """

    family: Family
    device: torch.device
    m: int
    n: int
    k: int
    in_dtype: torch.dtype
    out_dtype: torch.dtype
    a_row_stride: int = 0
    options: tuple[tuple[str, Any], ...] = ()

    def opt(self, key: str, default: Any = None) -> Any:
        for k, v in self.options:
            if k == key:
                return v
        return default


Predicate = Callable[..., "tuple[bool, str]"]


def _always_supported(device: torch.device) -> tuple[bool, str]:
    return True, "runs anywhere"


def _always_implements(problem: Problem) -> tuple[bool, str]:
    return True, "any problem"


# implementation -> whether it declares a keyword-only ``problem`` (asked once
# per function; per function, not per backend, so a swapped-in impl is asked too)
_TAKES_PROBLEM: dict[Callable[..., Any], bool] = {}


def _takes_problem(fn: Callable[..., Any]) -> bool:
    try:
        param = inspect.signature(fn).parameters.get("problem")
    except (TypeError, ValueError):  # no signature (a builtin)
        return False
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity (lru_cache key)
class Backend:
    """One implementation of an op family.

    Parameters
    ----------
    family : Family
        Family it implements.
    name : str
        Name users pass to ``use_backend`` and the environment variable.
    impls : dict
        Op name (e.g. ``"fp8_block_mm"``) -> callable with the op's signature.
        A backend may implement a subset of the family's ops.  A callable with
        a keyword-only ``problem`` parameter also receives the Problem it was
        selected for (:meth:`run`).
    is_supported : callable(device) -> (bool, str)
    can_implement : callable(problem) -> (bool, str)
    needs_m_multiple : int
        M alignment the backend needs (1 = any M).  The padded ops read it.
    description : str
        One line for :func:`report`.
    """

    family: Family
    name: str
    impls: dict[str, Callable[..., Any]]
    is_supported: Predicate = _always_supported
    can_implement: Predicate = _always_implements
    needs_m_multiple: int = 1
    description: str = ""

    def run(self, op: str, problem: Problem, *args: Any) -> Any:
        """Call the implementation of ``op`` with ``args``; one that declares a
        keyword-only ``problem`` parameter gets ``problem`` (the call's
        Problem, for which this backend was selected).

        Examples
        --------
        >>> import torch, scaledmm
        >>> from scaledmm.backends import Problem, Family, get
        >>> x = torch.randn(2, 128)
        >>> p = Problem(Family.FP8_BLOCK, x.device, 2, 0, 128, x.dtype, torch.float8_e4m3fn, 128)
        >>> q, s = get("fp8_block", "reference").run("per_token_group_quant_fp8", p, x)
        """
        fn = self.impls[op]
        takes = _TAKES_PROBLEM.get(fn)
        if takes is None:
            takes = _takes_problem(fn)
            if len(_TAKES_PROBLEM) < 1024:
                _TAKES_PROBLEM[fn] = takes
        if takes:
            return fn(*args, problem=problem)
        return fn(*args)

    def check(self, problem: Problem) -> tuple[bool, str]:
        ok, why = supported_on(self, problem.device)
        if not ok:
            return False, why
        return self.can_implement(problem)


_REGISTRY: dict[Family, dict[str, Backend]] = {f: {} for f in Family}
_ENV_VARS: dict[Family, str] = {f: f.env_var for f in Family}

_policies.configure(f.value for f in Family)
# Switch variables per family (from the policy files), read at each selection.
_SWITCH_VARS: dict[Family, tuple[str, ...]] = {}

# Live use_backend blocks, innermost last: (family, name, entry).  Each block
# removes its own entry (by identity) on exit, so blocks may end in any order
# (ExitStack, generators, manual __enter__/__exit__) without disturbing others.
_OVERRIDE: contextvars.ContextVar[tuple[tuple[Family, str, object], ...]] = contextvars.ContextVar(
    "scaledmm_backend_override", default=()
)


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend in the registry.

    Examples
    --------
    >>> from scaledmm import backends
    >>> b = backends.Backend(backends.Family.FP8, "mine", impls={})
    >>> _ = backends.register(b); "mine" in backends.names("fp8")
    True
    >>> backends.unregister("fp8", "mine")
    """
    _REGISTRY[backend.family][backend.name] = backend
    invalidate()
    return backend


def unregister(family: Family | str, name: str) -> None:
    """Remove a backend (tests use this to plant a broken provider)."""
    _REGISTRY[Family.parse(family)].pop(name, None)
    invalidate()


def names(family: Family | str) -> list[str]:
    """Registered backend names of a family, in registration order.

    Examples
    --------
    >>> import scaledmm
    >>> "reference" in scaledmm.backends.names("fp8_block")
    True
    """
    return list(_REGISTRY[Family.parse(family)])


def get(family: Family | str, name: str) -> Backend:
    """The backend ``name`` of ``family``; raises listing the valid names.

    Examples
    --------
    >>> import scaledmm
    >>> scaledmm.backends.get("fp8_block", "reference").name
    'reference'
    """
    fam = Family.parse(family)
    try:
        return _REGISTRY[fam][name]
    except KeyError:
        valid = ", ".join(_REGISTRY[fam]) or "<none registered>"
        raise ValueError(
            f"backend: expected one of [{valid}] for family {fam.value!r}, got {name!r}"
        ) from None


@functools.lru_cache(maxsize=None)
def supported_on(backend: Backend, device: torch.device) -> tuple[bool, str]:
    """``backend.is_supported(device)``, cached per (backend, device); a probe
    that raises counts as unsupported.  Selection and :func:`report` ask it,
    so patching it simulates a device (tests, ``benchmarks.selections``).

    Examples
    --------
    >>> supported_on(get("fp8", "reference"), torch.device("cpu"))[0]
    True
    """
    try:
        return backend.is_supported(device)
    except Exception as e:  # a probe must never take the op down
        return False, f"support probe failed: {type(e).__name__}: {e}"


@functools.lru_cache(maxsize=None)
def arch_key(device: torch.device) -> str:
    """Priority-table key of a device: ``"cpu"``, ``"sm90"``, ``"sm100"``, ...

    Examples
    --------
    >>> import torch, scaledmm
    >>> scaledmm.backends.arch_key(torch.device("cpu"))
    'cpu'
    """
    if device.type != "cuda":
        return device.type
    major, minor = _device.capability(device)
    return f"sm{major}{minor}"


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def policy(family: Family | str, device: torch.device | str) -> Policy:
    """The selection policy automatic selection uses for ``family`` on
    ``device`` (``"cpu"``, ``"cuda:0"``, a ``torch.device``) or on an
    architecture key (``"sm90"``, ``"cuda"``): the order, the measured
    per-shape rows and the switches, and the file they came from.

    Examples
    --------
    >>> import scaledmm
    >>> p = scaledmm.backends.policy("nvfp4", "sm90")
    >>> p.order[0], p.switches["cuda_gemv"], p.source
    ('cuda_gemv', 'SCALEDMM_NVFP4_GEMV', 'scaledmm/tuning/nvfp4_sm90.json')
    """
    fam = Family.parse(family)
    if isinstance(device, str) and device.startswith("sm") and device[2:].isdigit():
        return _policies.resolve(fam.value, device)
    dev = _device_key(torch.device(device))
    return _policies.resolve(fam.value, arch_key(dev), gpu=dev.type == "cuda")


def priority(family: Family | str, device: torch.device | str) -> list[str]:
    """Backend names tried by automatic selection on ``device`` for a shape
    without measured rows, first first (switched-off backends left out).

    Examples
    --------
    >>> import scaledmm
    >>> scaledmm.backends.priority("nvfp4", "cpu")
    ['composite', 'reference']
    """
    pol = policy(family, device)
    return [b for b in pol.order if pol.enabled(b)]


def auto_order(problem: Problem, table_m: int | None = None, op: str | None = None) -> list[str]:
    """The order automatic selection tries for ``problem``: the policy's
    measured row for the shape (the rows of ``op`` and the problem's
    ``variant`` option, else ``op``'s own, else the family's; read at
    ``table_m`` or ``problem.m``), then the policy's order; switched-off
    backends left out."""
    pol = policy(problem.family, problem.device)
    return pol.auto_order(problem.n, problem.k, problem.m if table_m is None else table_m, op=op,
                          variant=problem.opt("variant"))


def _switch_values(fam: Family) -> tuple[str | None, ...]:
    """The current values of ``fam``'s switch variables (part of the
    selection cache key, so a changed switch takes effect at once)."""
    names = _SWITCH_VARS.get(fam)
    if names is None:
        names = _SWITCH_VARS[fam] = _policies.switch_vars(fam.value)
    return tuple([_env.raw(v) for v in names]) if names else ()


def _request(fam: Family) -> tuple[str | None, str | None]:
    """``(name, source)`` of the explicit request for ``fam``: the innermost
    live :func:`use_backend` block, else the environment variable.  ``name``
    is None for automatic selection (``"auto"`` or nothing set); ``source`` is
    ``"use_backend"``, the variable's name, or None."""
    for f, name, _ in reversed(_OVERRIDE.get()):
        if f is fam:
            return (None if name == "auto" else name), "use_backend"
    var = _ENV_VARS[fam]
    raw = _env.raw(var)  # the per-call path: no os.environ.get
    if raw is None:
        return None, None
    name = _env.text(raw).strip()
    if not name or name == "auto":
        return None, None
    return name, var


def requested(family: Family | str) -> str | None:
    """The explicitly requested backend name (innermost :func:`use_backend`
    block, then the environment variable), or None for automatic selection.

    The name is not validated here (an unknown name from the environment
    raises when an op of the family selects).

    Examples
    --------
    >>> import scaledmm
    >>> with scaledmm.use_backend("fp8", "reference"):
    ...     scaledmm.backends.requested("fp8")
    'reference'
    """
    return _request(Family.parse(family))[0]


@contextlib.contextmanager
def use_backend(family: Family | str, name: str) -> Iterator[Backend | None]:
    """Force ``family`` to run on backend ``name`` inside the ``with`` block.

    The request applies to the ops that backend implements; the family's other
    ops run as if nothing was requested (forcing a GEMM-only backend leaves the
    quantizer and the fused linear op running).  An op the backend implements
    but cannot run for the given call raises ``RuntimeError`` with the reason:
    an explicit request never silently falls back.  ``name="auto"`` restores
    automatic selection inside the block (also masking the environment
    variable ``SCALEDMM_<FAMILY>_BACKEND``).  The innermost live block of a
    family wins; blocks may be exited in any order, each one removing only its
    own request.  The choice is read when an op runs (eagerly, or inside a
    compiled graph at run time).

    Raises ``ValueError`` listing the valid names for an unknown ``name``.

    Examples
    --------
    >>> import torch, scaledmm
    >>> with scaledmm.use_backend("fp8_block", "reference"):
    ...     pass
    """
    fam = Family.parse(family)
    backend = None if name == "auto" else get(fam, name)  # validates the name now
    entry = (fam, name, object())
    _OVERRIDE.set(_OVERRIDE.get() + (entry,))
    try:
        yield backend
    finally:
        _OVERRIDE.set(tuple(e for e in _OVERRIDE.get() if e is not entry))


_RECORDERS: list[list[tuple[str, str, Problem]]] = []


@contextlib.contextmanager
def record() -> Iterator[list[tuple[str, str, Problem]]]:
    """Collect ``(op, backend name, problem)`` for every selection made inside
    the block (eager calls and compiled graphs alike), for debugging and demos.

    Examples
    --------
    >>> import torch, scaledmm
    >>> with scaledmm.backends.record() as calls:
    ...     _ = torch.ops.scaledmm.per_token_group_quant_fp8(torch.randn(2, 128))
    >>> calls[0][:2]
    ('per_token_group_quant_fp8', 'reference')
    """
    log: list[tuple[str, str, Problem]] = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)


# Selections already made, keyed by (problem, op, explicit request, table M,
# switch values): a hit skips the policy walk on the per-call path.  Cleared
# whenever the registry or a policy changes, and when it grows past a bound.
_SELECTIONS: dict[tuple, Backend] = {}
_SELECTIONS_MAX = 4096


def invalidate() -> None:
    """Forget cached selections, support probes and switch values.

    The registry and policy functions call it themselves; a test that
    patches what they cannot see (a probe, an environment variable read
    by a switch) calls it too.

    Examples
    --------
    >>> invalidate()
    """
    supported_on.cache_clear()
    _SELECTIONS.clear()
    _SWITCH_VARS.clear()


def select(problem: Problem, op: str, table_m: int | None = None) -> Backend:
    """The backend that runs ``op`` for ``problem`` (see :func:`_select`):
    the requested backend (:func:`use_backend`, ``SCALEDMM_<FAMILY>_BACKEND``)
    when it implements ``op``, else automatic selection.

    ``table_m``: the M at which the measured auto table is read, when it
    differs from ``problem.m`` (the padded ops check backends against the
    padded M but rank them at the caller's M, where the table holds the
    measured cost of padding).

    Examples
    --------
    >>> import torch, scaledmm
    >>> from scaledmm.backends import Problem, Family, select
    >>> p = Problem(Family.FP8_BLOCK, torch.device("cpu"), 3, 256, 256,
    ...             torch.float8_e4m3fn, torch.bfloat16)
    >>> select(p, "fp8_block_mm").name
    'reference'
    """
    name, source = _request(problem.family)
    key = (problem, op, name, table_m, _switch_values(problem.family))
    try:
        backend = _SELECTIONS.get(key)
    except TypeError:  # an unhashable option value: no caching
        key, backend = None, None
    if backend is None:
        backend = _select(problem, op, name, table_m, source)
        if key is not None:
            if len(_SELECTIONS) >= _SELECTIONS_MAX:
                _SELECTIONS.clear()
            _SELECTIONS[key] = backend
    if _RECORDERS:
        for log in _RECORDERS:
            log.append((op, backend.name, problem))
    return backend


def _unknown_name(fam: Family, name: str, source: str | None) -> str:
    valid = ", ".join(_REGISTRY[fam]) or "<none registered>"
    where = source or "backend"
    return f"{where}: expected one of [{valid}] or 'auto' for family {fam.value!r}, got {name!r}"


def _select(problem: Problem, op: str, name: str | None, table_m: int | None = None,
            source: str | None = None) -> Backend:
    """The backend that runs ``op`` for ``problem``.

    An explicit request ``name`` (from ``source``: :func:`use_backend` or the
    environment variable) applies when that backend implements ``op``: it is
    returned, or ``RuntimeError`` raised with its reason when it cannot run
    the problem.  Ops the requested backend does not implement, and calls
    without a request, take the first backend of :func:`auto_order` that
    supports the device, implements ``op`` and can implement the problem.  An
    unknown ``name`` raises ``ValueError`` naming ``source`` and listing the
    valid names.
    """
    fam = problem.family
    if name is not None:
        backend = _REGISTRY[fam].get(name)
        if backend is None:
            raise ValueError(_unknown_name(fam, name, source))
        if op in backend.impls:
            ok, why = backend.check(problem)
            if not ok:
                raise RuntimeError(f"backend {fam.value}/{name} was requested but cannot run: {why}")
            return backend
    reasons = []
    for cand in auto_order(problem, table_m, op):
        backend = _REGISTRY[fam].get(cand)
        if backend is None or op not in backend.impls:
            continue
        ok, why = backend.check(problem)
        if ok:
            return backend
        reasons.append(f"{cand}: {why}")
    raise RuntimeError(
        f"no {fam.value} backend can run {op} for {problem}: " + "; ".join(reasons)
    )


def family_ops(family: Family | str) -> list[str]:
    """Op names implemented by some registered backend of ``family``.

    Examples
    --------
    >>> import scaledmm
    >>> scaledmm.backends.family_ops("fp8")
    ['fp8_linear', 'fp8_scaled_mm', 'quant_fp8']
    """
    fam = Family.parse(family)
    return sorted({op for b in _REGISTRY[fam].values() for op in b.impls})


# The policy-editing hooks and the report are concepts of their own, in their
# own modules; they read this module's state through it, so they are imported
# last (a cycle that this order makes safe) and re-exported here.
from .policy_edits import (  # noqa: E402
    arch_priority, load_auto_table, override_policy, policy_snapshot, set_auto_table, set_priority,
)
from .backend_report import report, switch_line  # noqa: E402
