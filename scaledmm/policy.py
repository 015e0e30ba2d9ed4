"""Selection policy as data: which backend automatic selection tries first.

One JSON file per op family and architecture, ``scaledmm/tuning/<family>_<arch>.json``
(package data), holds everything automatic selection needs beyond the
backends' own predicates::

    {
      "family": "nvfp4",                  # the file name's family
      "arch": "sm90",                     # the file name's arch: "cpu", "sm80", "sm90", ..., "cuda"
      "order": ["cuda_gemv", "triton", "reference"],   # tried first to last
      "switches": {"cuda_gemv": "SCALEDMM_NVFP4_GEMV"}, # optional: env var per backend
      "shapes": {"4096x7168": [[256, ["triton", "cublas"]], [2147483647, ["cublas"]]]},  # optional
      "op_shapes": {"fp8_block_linear": {"4096x7168": [[2147483647, ["composite"]]]}},  # optional
      "source": "...", "notes": "..."     # optional free text (provenance, why this order)
    }

* ``order``: measured fastest first.  Names that are not registered (an
  optional package missing) are skipped.
* ``switches``: a backend whose variable is ``"0"`` or empty is left out of
  automatic selection (order and shape rows); unset or any other value keeps
  it.  Read at selection time.  An explicit request (``use_backend``,
  ``SCALEDMM_<FAMILY>_BACKEND``) still reaches a switched-off backend.
* ``shapes``: per weight shape ``NxK``, rows ``[max_m, [names]]`` in
  ascending ``max_m``; the first row with ``M <= max_m`` is tried first, then
  the rest of ``order``.  The key ``"*"`` holds the rows of every shape
  without rows of its own (a model's shapes need not be the ones swept).
  Written by ``python -m benchmarks.tune`` (``"*"``: ``--any-shape``).
* ``op_shapes``: rows of the same form for one op of the family, used for
  that op instead of ``shapes`` (a family's ops need not share a winner:
  ``fp8_block_linear`` runs on ``triton`` or ``composite``, its GEMM on any
  backend).  A key ``"op:variant"`` holds rows for one variant of the op's
  problems, the one the op declares (``fp8_scaled_mm`` declares ``rowwise``
  or ``tensorwise`` from its scale shapes: cuBLAS has a fast per-tensor and a
  slow row-wise kernel, so the two need different winners); it is read
  before the op's plain rows.  Written by ``python -m benchmarks.tune --op OP
  [--variant V] --op-rows``.

A device uses the file of its own arch (``sm90``), else the file of its
architecture family (``sm86`` and ``sm89`` use ``sm80``, ``sm103`` uses
``sm100``), else ``cuda`` (any GPU); a CPU (or other non-CUDA device) uses
``cpu``; with no file at all, ``["reference"]``.

The files are read once, at the first selection (not at import), and
validated; a malformed one raises :class:`PolicyError` naming the file.

This module is part of the core and imports nothing from scaledmm.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import re
import threading
from typing import Any, Iterable, Mapping

from . import env as _env
from .env import switched_on  # noqa: F401 - the switch rule, re-exported

__all__ = ["Policy", "PolicyError", "parse", "load", "table", "resolve", "switch_vars", "switched_on"]

Rows = tuple[tuple[int, tuple[str, ...]], ...]

_KEYS = {"family", "arch", "order", "switches", "shapes", "op_shapes", "source", "notes"}
_OP = re.compile(r"^[a-z][a-z0-9_]*(:[a-z][a-z0-9_]*)?$")
_ARCH = re.compile(r"^(cpu|cuda|sm\d+|[a-z][a-z0-9]*)$")
_SHAPE = re.compile(r"^(\d+)x(\d+)$")
ANY_SHAPE = (0, 0)  # the "*" key: N and K of a real shape are positive


class PolicyError(ValueError):
    """A policy file (or an in-process change) that does not follow the format."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """The selection policy of one family on one architecture.

    Parameters
    ----------
    family, arch : str
        ``"nvfp4"``, ``"sm90"``, ...
    order : tuple of str
        Backend names, tried first to last.
    shapes : mapping
        ``(n, k) -> ((max_m, names), ...)``, ascending ``max_m``; the key
        ``ANY_SHAPE`` (``(0, 0)``, ``"*"`` in a file) serves shapes without rows.
    op_shapes : mapping
        ``op -> {(n, k) -> rows}``: rows for that op instead of ``shapes``.
    switches : mapping
        Backend name -> environment variable that switches it off (``"0"``
        or empty) in automatic selection.
    source : str
        Where the policy came from (a file name, or what changed it).
    """

    family: str
    arch: str
    order: tuple[str, ...]
    shapes: Mapping[tuple[int, int], Rows] = dataclasses.field(default_factory=dict)
    switches: Mapping[str, str] = dataclasses.field(default_factory=dict)
    source: str = ""
    op_shapes: Mapping[str, Mapping[tuple[int, int], Rows]] = dataclasses.field(default_factory=dict)

    def enabled(self, name: str, environ: Mapping[str, str] | None = None) -> bool:
        """False when ``name``'s switch variable is ``"0"`` or empty in
        ``environ`` (default: the process environment, read now)."""
        var = self.switches.get(name)
        return var is None or _env.switch_on(var, environ)

    def auto_order(self, n: int, k: int, m: int, environ: Mapping[str, str] | None = None,
                   op: str | None = None, variant: str | None = None) -> list[str]:
        """Names tried for an ``M x K`` activation and an ``N x K`` weight
        (the rows of ``op:variant`` when the policy has them, else ``op``'s
        own, else the family's; at each of these levels the shape's own rows,
        else the level's ``"*"`` rows), switched-off backends left out.

        Examples
        --------
        >>> p = Policy("fp8_block", "sm90", ("cublas", "triton"), {(64, 128): ((16, ("triton",)),)},
        ...            op_shapes={"fp8_block_linear": {(64, 128): ((2**31 - 1, ("cublas",)),)}})
        >>> p.auto_order(64, 128, 4), p.auto_order(64, 128, 17), p.auto_order(64, 128, 4, op="fp8_block_linear")
        (['triton', 'cublas'], ['cublas', 'triton'], ['cublas', 'triton'])
        >>> p.auto_order(64, 128, 4, op="fp8_block_linear", variant="other")  # no rows of its own
        ['cublas', 'triton']
        >>> q = Policy("fp8", "sm90", ("cublas", "triton"), {(0, 0): ((32, ("triton",)),)})
        >>> q.auto_order(4096, 4096, 8), q.auto_order(4096, 4096, 64)  # "*": any shape
        (['triton', 'cublas'], ['cublas', 'triton'])
        """
        base = [b for b in self.order if self.enabled(b, environ)]
        levels = [self.op_shapes.get(f"{op}:{variant}", {}) if op is not None and variant is not None else {},
                  self.op_shapes.get(op, {}) if op is not None else {}, self.shapes]
        rows = next((r for lv in levels for r in (lv.get((n, k)) or lv.get(ANY_SHAPE),) if r), ())
        for max_m, names in rows:
            if m <= max_m:
                first = [b for b in names if self.enabled(b, environ)]
                return first + [b for b in base if b not in first]
        return base


def _fail(where: str, field: str, expected: str, got: Any) -> None:
    raise PolicyError(f"{where}: {field}: expected {expected}, got {got!r}")


def _names(where: str, field: str, value: Any) -> tuple[str, ...]:
    if (not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value)
            or len(set(value)) != len(value)):
        _fail(where, field, "a non-empty list of distinct backend names", value)
    return tuple(value)


def parse(data: Any, where: str, family: str | None = None, arch: str | None = None,
          strict: bool = True) -> Policy:
    """Validate one policy document (``where`` names it in errors) and return
    it; ``family`` / ``arch``: what the file name says they must be.
    ``strict`` (files): switches and shape rows name only backends of
    ``order`` (a typo fails here rather than being skipped at selection).

    Examples
    --------
    >>> parse({"family": "fp8", "arch": "cpu", "order": ["reference"]}, "fp8_cpu.json").order
    ('reference',)
    >>> parse({"family": "fp8", "arch": "cpu", "order": []}, "x.json")
    Traceback (most recent call last):
    ...
    scaledmm.policy.PolicyError: x.json: order: expected a non-empty list of distinct backend names, got []
    """
    if not isinstance(data, dict):
        _fail(where, "document", "a JSON object", type(data).__name__)
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        _fail(where, "keys", f"only {sorted(_KEYS)}", unknown)
    for key in ("family", "arch", "order"):
        if key not in data:
            _fail(where, key, "a value (required)", None)
    fam, arc = data["family"], data["arch"]
    if not isinstance(fam, str) or (family is not None and fam != family):
        _fail(where, "family", repr(family) if family else "a family name", fam)
    if not isinstance(arc, str) or not _ARCH.match(arc) or (arch is not None and arc != arch):
        _fail(where, "arch", repr(arch) if arch else "'cpu', 'cuda' or 'smXY'", arc)
    order = _names(where, "order", data["order"])
    switches = data.get("switches", {})
    if not isinstance(switches, dict):
        _fail(where, "switches", "an object {backend: env var}", switches)
    for name, var in switches.items():
        if strict and name not in order:
            _fail(where, f"switches[{name!r}]", f"a backend of order {list(order)}", name)
        if not _env.is_switch_var(var):
            _fail(where, f"switches[{name!r}]", f"an env var name like {_env.NVFP4_GEMV!r}", var)
    shapes = _shape_rows(where, "shapes", data.get("shapes", {}), order, strict)
    op_shapes_in = data.get("op_shapes", {})
    if not isinstance(op_shapes_in, dict):
        _fail(where, "op_shapes", 'an object {op: {"NxK": rows}}', op_shapes_in)
    op_shapes = {}
    for op, rows_in in op_shapes_in.items():
        if not isinstance(op, str) or not _OP.match(op):
            _fail(where, f"op_shapes key {op!r}", "an op name like 'fp8_block_linear' or "
                  "'fp8_scaled_mm:rowwise'", op)
        op_shapes[op] = _shape_rows(where, f"op_shapes[{op!r}]", rows_in, order, strict)
    for key in ("source", "notes"):
        if not isinstance(data.get(key, ""), str):
            _fail(where, key, "a string", data[key])
    return Policy(fam, arc, order, shapes, dict(switches), where, op_shapes)


def _shape_rows(where: str, name: str, shapes_in: Any, order: tuple[str, ...],
                strict: bool) -> dict[tuple[int, int], Rows]:
    """``{"NxK": [[max_m, [names]], ...]}`` validated into ``{(n, k): rows}``."""
    if not isinstance(shapes_in, dict):
        _fail(where, name, 'an object {"NxK": rows}', shapes_in)
    shapes: dict[tuple[int, int], Rows] = {}
    for shape, rows in shapes_in.items():
        match = _SHAPE.match(shape.lower()) if isinstance(shape, str) and shape != "*" else None
        if shape != "*" and (match is None or not int(match[1]) or not int(match[2])):
            _fail(where, f"{name} key {shape!r}", "'NxK' with positive N and K, or '*'", shape)
        field = f"{name}[{shape!r}]"
        if not isinstance(rows, list) or not rows:
            _fail(where, field, "a non-empty list of [max_m, [names]] rows", rows)
        parsed: list[tuple[int, tuple[str, ...]]] = []
        for row in rows:
            if (not isinstance(row, list) or len(row) != 2 or not isinstance(row[0], int)
                    or isinstance(row[0], bool) or row[0] < 0):
                _fail(where, field, "rows [max_m >= 0, [names]]", row)
            names = _names(where, f"{field} row {row[0]}", row[1])
            stray = [b for b in names if b not in order]
            if strict and stray:
                _fail(where, f"{field} row {row[0]}", f"backends of order {list(order)}", stray)
            if parsed and row[0] <= parsed[-1][0]:
                _fail(where, field, "rows in strictly ascending max_m", [r[0] for r in rows])
            parsed.append((row[0], names))
        shapes[ANY_SHAPE if match is None else (int(match[1]), int(match[2]))] = tuple(parsed)
    return shapes


def _shape_json(shapes: Mapping[tuple[int, int], Rows]) -> dict[str, list]:
    return {"*" if (n, k) == ANY_SHAPE else f"{n}x{k}": [[mm, list(names)] for mm, names in rows]
            for (n, k), rows in shapes.items()}


def load(families: Iterable[str], folder: Any = None) -> dict[str, dict[str, Policy]]:
    """Every ``<family>_<arch>.json`` of ``folder`` (default: the package's
    ``tuning`` folder), validated: ``{family: {arch: Policy}}``.  A file
    whose family is not in ``families`` raises :class:`PolicyError`.

    Examples
    --------
    >>> load(["fp8_block", "fp8", "nvfp4", "skinny"])["fp8"]["cpu"].order
    ('reference',)
    """
    shipped = folder is None
    folder = importlib.resources.files("scaledmm") / "tuning" if shipped else folder
    known = list(families)
    out: dict[str, dict[str, Policy]] = {f: {} for f in known}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        where = f"scaledmm/tuning/{entry.name}" if shipped else str(entry)
        stem = entry.name[: -len(".json")]
        family, _, arch = stem.rpartition("_")
        if family not in out:
            _fail(where, "file name", f"<family>_<arch>.json with a family of {known}", entry.name)
        try:
            data = json.loads(entry.read_text())
        except json.JSONDecodeError as e:
            raise PolicyError(f"{where}: not valid JSON: {e}") from None
        out[family][arch] = parse(data, where, family, arch)
    return out


_LOCK = threading.Lock()
_TABLE: dict[str, dict[str, Policy]] | None = None  # live: the files plus in-process changes
_FAMILIES: tuple[str, ...] = ()


def configure(families: Iterable[str]) -> None:
    """The family names files may use (the registry calls this once).

    Examples
    --------
    >>> configure(["fp8_block", "fp8", "nvfp4", "skinny"])
    """
    global _FAMILIES
    _FAMILIES = tuple(families)


def table(family: str) -> dict[str, Policy]:
    """The live ``{arch: Policy}`` of ``family`` (files read at the first call).

    Examples
    --------
    >>> import scaledmm
    >>> sorted(table("skinny"))
    ['cpu', 'cuda']
    """
    global _TABLE
    if _TABLE is None:
        with _LOCK:
            if _TABLE is None:
                _TABLE = load(_FAMILIES)
    return _TABLE[family]


def resolve(family: str, key: str, gpu: bool | None = None) -> Policy:
    """The policy a device with arch ``key`` uses (see the module docstring);
    ``gpu``: whether that device is a GPU (default: ``key`` is ``"cuda"`` or
    ``"smXY"``).

    Examples
    --------
    >>> import scaledmm
    >>> resolve("nvfp4", "sm89", gpu=True).source
    'scaledmm/tuning/nvfp4_sm80.json'
    >>> resolve("fp8", "cpu").source
    'scaledmm/tuning/fp8_cpu.json'
    """
    if gpu is None:
        gpu = key == "cuda" or key.startswith("sm")
    entries = table(family)
    chain = (key, key[:-1] + "0", "cuda") if gpu else (key, "cpu")
    for arch in chain:
        if arch in entries:
            return entries[arch]
    return Policy(family, key, ("reference",), source="no policy file: reference only")


def switch_vars(family: str) -> tuple[str, ...]:
    """Every switch variable of ``family``'s policies, sorted.

    Examples
    --------
    >>> import scaledmm
    >>> switch_vars("nvfp4")
    ('SCALEDMM_NVFP4_DECODE_CUBLAS', 'SCALEDMM_NVFP4_GEMV', 'SCALEDMM_NVFP4_MID')
    """
    return tuple(sorted({v for p in table(family).values() for v in p.switches.values()}))


def replace(family: str, arch: str, base: Policy, **fields: Any) -> Policy:
    """Install ``base`` with ``fields`` replaced as the live policy of
    ``family`` on ``arch``, validated like a file (switches and rows may
    name backends the new order lacks); returns it.
    :mod:`scaledmm.policy_edits` calls this and clears the registry's caches.

    Examples
    --------
    >>> import scaledmm
    >>> saved = snapshot()
    >>> replace("fp8", "cpu", resolve("fp8", "cpu", False), order=["reference"]).source
    'fp8_cpu (set in process)'
    >>> restore(saved)
    """
    data = {"family": family, "arch": arch, "order": list(base.order),
            "switches": dict(base.switches), "shapes": _shape_json(base.shapes),
            "op_shapes": {op: _shape_json(rows) for op, rows in base.op_shapes.items()}}
    data.update(fields)
    new = parse(data, f"{family}_{arch} (set in process)", family, arch, strict=False)
    table(family)[arch] = new
    return new


def snapshot() -> dict[str, dict[str, Policy]]:
    """A copy of the live table, for :func:`restore`.

    Examples
    --------
    >>> import scaledmm
    >>> restore(snapshot())
    """
    for f in _FAMILIES:
        table(f)
    return {f: dict(entries) for f, entries in (_TABLE or {}).items()}


def restore(saved: dict[str, dict[str, Policy]]) -> None:
    """Put back what :func:`snapshot` returned
    (``scaledmm.backends.policy_snapshot`` also clears the registry's caches).

    Examples
    --------
    >>> import scaledmm
    >>> restore(snapshot())
    """
    for f, entries in saved.items():
        live = table(f)
        live.clear()
        live.update(entries)
