"""The human-readable report of what can run on this machine, and why not.

:func:`report` prints, per device and op family, the automatic order, the
policy file it comes from, the state of its switches, what an explicit
request does, and every backend with its support verdict.  It reads the
registry through :mod:`scaledmm.backends` at call time, so a patched
``backends.arch_key`` or ``backends.supported_on`` (a simulated device) shows
in the report.

Everything here is re-exported by :mod:`scaledmm.backends`
(``scaledmm.backends.report()``, ...), which is where callers reach it.

This module is part of the core: it imports only the registry, the policy
and the environment accessors.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from . import backends as _registry
from . import env as _env
from . import policy as _policies
from .policy import Policy

__all__ = ["report", "switch_line"]


def _request_line(fam: _registry.Family) -> str:
    """What the explicit request of ``fam`` does, for :func:`report`."""
    # the request with its source (use_backend or the variable), which requested() drops
    name, source = _registry._request(fam)
    var = fam.env_var
    if source is None:
        return "no request: every op auto-selected"
    if name is None:
        masked = (_env.get(var) or "").strip()
        extra = f" (masks {var}={masked!r})" if masked and masked != "auto" else ""
        return f"use_backend({fam.value!r}, 'auto'){extra}: every op auto-selected"
    registered = _registry.names(fam)
    if name not in registered:
        valid = ", ".join(registered) or "<none registered>"
        return (f"INVALID {source}={name!r}: not a backend of {fam.value} (valid: {valid}, auto); "
                f"every {fam.value} op raises ValueError until it is fixed")
    backend = _registry.get(fam, name)
    ops = _registry.family_ops(fam)
    forced = [o for o in ops if o in backend.impls]
    auto = [o for o in ops if o not in backend.impls]
    line = f"forced to {name!r} by {source} for {', '.join(forced) or '<no op>'}"
    if auto:
        line += f"; auto-selected for {', '.join(auto)}"
    return line


def switch_line(pol: Policy) -> str:
    """The policy's switches and their state, as :func:`report` prints them.

    Examples
    --------
    >>> import scaledmm
    >>> scaledmm.backends.switch_line(scaledmm.backends.policy("fp8_block", "cpu"))  # no switches
    ''
    """
    if not pol.switches:
        return ""
    parts = []
    for name, var in pol.switches.items():
        value = _env.get(var)
        state = "on" if pol.enabled(name) else "OFF"
        parts.append(f"{name} {state} ({var}={'unset' if value is None else repr(value)})")
    return "; switches: " + ", ".join(parts)


def report(file: Any = None) -> str:
    """Print, for this machine, every backend and why it is or is not usable,
    per family the automatic order, the policy file it comes from and the
    state of its switches, and what an explicit request (``use_backend`` or
    ``SCALEDMM_<FAMILY>_BACKEND``) does: the ops it forces, the ops left to
    automatic selection, or an invalid name and the variable that holds it.
    Never raises for a bad request.

    Returns the text as well.

    Examples
    --------
    >>> import scaledmm
    >>> text = scaledmm.backends.report(file=None)  # doctest: +SKIP
    """
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    out = io.StringIO()
    for dev in devices:
        label = str(dev)
        if dev.type == "cuda":
            label += f" ({torch.cuda.get_device_name(dev)}, {_registry.arch_key(dev)})"
        out.write(f"== {label}\n")
        for fam in _registry.Family:
            try:
                pol = _registry.policy(fam, dev)
            except _policies.PolicyError as e:
                out.write(f"  {fam.value}: POLICY ERROR {e}\n")
                continue
            order = [b for b in pol.order if pol.enabled(b)]
            out.write(f"  {fam.value}: auto order {order} ({pol.source}{switch_line(pol)}); "
                      f"{_request_line(fam)}\n")
            for name in _registry.names(fam):
                backend = _registry.get(fam, name)
                ok, why = _registry.supported_on(backend, dev)
                mark = "yes" if ok else "no "
                ops = ",".join(sorted(backend.impls))
                out.write(f"    [{mark}] {name:<20} {why}  (ops: {ops})\n")
    text = out.getvalue()
    print(text, end="", file=file)
    return text
