"""Op definition helpers shared by every module in ``scaledmm.ops``.

An op is defined once from its SPEC.md schema; its CPU and CUDA kernels are
the same Python function, which validates the arguments, builds a
:class:`~scaledmm.backends.Problem` and runs the backend the registry selects
(``reference`` on the CPU).  The fake (meta) implementation lives in
``scaledmm.fake_impls`` and allocates through the same shape helper as the op.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import backends

NAMESPACE = "scaledmm"

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

# Backend-only defaults shared by the ops; "ScalarType ...=15" is bf16 in the
# schema language (the parser only takes the enum's number).
BF16_ENUM = 15

_TAGS = (torch.Tag.pt2_compliant_tag,)


def define(name: str, schema: str, impl: Callable[..., Any]) -> torch._ops.OpOverloadPacket:
    """Define ``scaledmm::<name>`` with ``schema`` and register ``impl`` as its
    CPU and CUDA kernel.  Returns ``torch.ops.scaledmm.<name>``."""
    qualname = f"{NAMESPACE}::{name}"
    torch.library.define(qualname, schema, tags=_TAGS)
    torch.library.impl(qualname, "CPU")(impl)
    torch.library.impl(qualname, "CUDA")(impl)
    return getattr(getattr(torch.ops, NAMESPACE), name)


def run(problem: backends.Problem, op: str, *args: Any) -> Any:
    """Run ``op`` on the backend the registry selects for ``problem``; an
    implementation that takes a keyword-only ``problem`` receives it
    (:meth:`~scaledmm.backends.Backend.run`)."""
    return backends.select(problem, op).run(op, problem, *args)
