"""In-process edits to the selection policy, for tests, tools and experiments.

The shipped policy is data (``scaledmm/tuning/<family>_<arch>.json``, see
:mod:`scaledmm.policy`); these functions change the live copy in this
process only and clear the registry's cached selections, so the next op sees
the change.  :func:`override_policy` and :func:`policy_snapshot` undo their
changes on exit.  No module calls them at import.

Everything here is re-exported by :mod:`scaledmm.backends`
(``scaledmm.backends.set_priority``, ...), which is where callers reach it.

This module is part of the core: it imports only the registry and the policy.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

from . import backends as _registry
from . import policy as _policies
from .policy import Policy

__all__ = ["arch_priority", "set_priority", "set_auto_table", "load_auto_table", "override_policy",
           "policy_snapshot"]


def arch_priority(family: _registry.Family | str, arch: str) -> list[str]:
    """:func:`~scaledmm.backends.priority` on a device of architecture
    ``arch`` (``"sm90"``, ``"cuda"``, ``"cpu"``).

    Examples
    --------
    >>> import scaledmm
    >>> scaledmm.backends.arch_priority("fp8", "cpu")
    ['reference']
    """
    pol = _policies.resolve(_registry.Family.parse(family).value, arch)
    return [b for b in pol.order if pol.enabled(b)]


def _entry(family: str, arch: str) -> Policy:
    """The live policy stored for ``arch``, else the one ``arch`` resolves to."""
    return _policies.table(family).get(arch) or _policies.resolve(family, arch)


def _shape_rows(table: dict) -> dict[str, list]:
    """``{(n, k) or "*": [(max_m, names), ...]}`` in the policy file's form."""
    return {shape if shape == "*" else f"{int(shape[0])}x{int(shape[1])}":
            sorted([int(mm), list(names)] for mm, names in rows) for shape, rows in table.items()}


def set_priority(family: _registry.Family | str, arch: str, order: list[str]) -> None:
    """Replace the order of ``family``'s policy for ``arch`` in this process
    (tests, experiments; the shipped order lives in the policy file).  No
    module calls this at import.

    Examples
    --------
    >>> import scaledmm
    >>> with scaledmm.backends.policy_snapshot():
    ...     scaledmm.backends.set_priority("fp8", "cpu", ["reference"])
    """
    fam = _registry.Family.parse(family).value
    _policies.replace(fam, arch, _entry(fam, arch), order=list(order))
    _registry.invalidate()


def set_auto_table(family: _registry.Family | str, arch: str, table: dict) -> None:
    """Replace the measured per-shape rows of ``family``'s policy for
    ``arch`` in this process (as :func:`set_priority`).

    ``table`` maps ``(n, k)`` to ``[(max_m, [backend names]), ...]``: for a
    problem of that shape the first entry with ``m <= max_m`` gives the order
    automatic selection tries (then the rest of the policy's order).  Shapes
    or M beyond the table use the order alone.

    Examples
    --------
    >>> import scaledmm
    >>> with scaledmm.backends.policy_snapshot():
    ...     scaledmm.backends.set_auto_table("fp8", "sm00", {(64, 128): [(16, ["reference"])]})
    """
    fam = _registry.Family.parse(family).value
    _policies.replace(fam, arch, _entry(fam, arch), shapes=_shape_rows(table))
    _registry.invalidate()


def load_auto_table(family: _registry.Family | str, path) -> None:
    """Install the per-shape rows of a ``{"arch": ..., "shapes": {"NxK":
    [[max_m, [names]], ...]}}`` JSON file (``python -m benchmarks.tune``
    output) with :func:`set_auto_table`, to try a new measurement without
    editing the policy file.

    Examples
    --------
    >>> import scaledmm
    >>> scaledmm.backends.load_auto_table("fp8_block", "fp8_block_sm90.json")  # doctest: +SKIP
    """
    with open(path) as f:
        data = json.load(f)
    table = {}
    for shape, rows in data["shapes"].items():
        n, k = (int(v) for v in shape.lower().split("x"))
        table[(n, k)] = [(int(mm), list(order)) for mm, order in rows]
    set_auto_table(family, data["arch"], table)


@contextlib.contextmanager
def override_policy(family: _registry.Family | str, arch: str, *, order: list[str] | None = None,
                    shapes: dict | None = None, switches: dict | None = None,
                    op_shapes: dict | None = None) -> Iterator[Policy]:
    """Inside the block, ``family``'s policy for ``arch`` has the given
    ``order``, ``shapes`` (``{(n, k): [(max_m, [names]), ...]}``),
    ``op_shapes`` (``{op: shapes}``) and / or ``switches`` (``{backend: env
    var}``); the previous policy comes back on exit.  For tests and
    experiments.

    Examples
    --------
    >>> import scaledmm
    >>> with scaledmm.backends.override_policy("fp8", "cpu", order=["reference"]) as p:
    ...     p.order
    ('reference',)
    """
    fam = _registry.Family.parse(family).value
    live = _policies.table(fam)
    had, old = arch in live, live.get(arch)
    fields: dict[str, Any] = {}
    if order is not None:
        fields["order"] = list(order)
    if switches is not None:
        fields["switches"] = dict(switches)
    if shapes is not None:
        fields["shapes"] = _shape_rows(shapes)
    if op_shapes is not None:
        fields["op_shapes"] = {op: _shape_rows(rows) for op, rows in op_shapes.items()}
    new = _policies.replace(fam, arch, _entry(fam, arch), **fields)
    _registry.invalidate()
    try:
        yield new
    finally:
        if had:
            live[arch] = old
        else:
            live.pop(arch, None)
        _registry.invalidate()


@contextlib.contextmanager
def policy_snapshot() -> Iterator[None]:
    """Every policy change made inside the block (:func:`set_priority`,
    :func:`set_auto_table`, ...) is undone on exit.  For tests.

    Examples
    --------
    >>> import scaledmm
    >>> with scaledmm.backends.policy_snapshot():
    ...     scaledmm.backends.set_priority("skinny", "cpu", ["reference"])
    """
    saved = _policies.snapshot()
    try:
        yield
    finally:
        _policies.restore(saved)
        _registry.invalidate()
