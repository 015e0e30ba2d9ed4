"""Device facts the ops consult: SM count, compute capability, whether
Triton runs in its CPU interpreter, and whether our kernels launch with
programmatic dependent launch (PDL).

``sm_count`` is cached per device index (fixed for a process).
``capability`` is not cached here: tests stand in for a GPU by patching
``torch.cuda.get_device_capability``, and callers that need speed cache
their own derived keys.

Examples
--------
>>> import torch
>>> from scaledmm import device
>>> device.sm_count(torch.device("cpu"), cpu=4), device.capability("cpu")
(4, (0, 0))
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from scaledmm import env

__all__ = ["NUM_SMS_H200", "sm_count", "capability", "interpreting", "pdl", "pdl_capable", "triton_pdl"]

#: SMs of an H200 (sm90): the SM count the measured tuning tables assume.
NUM_SMS_H200 = 132


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device | str | int, cpu: int | None = None) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (a device, its name, or
    its index); for any other device, ``cpu`` (the grid size the interpreter
    should see), and without it a ValueError.

    Examples
    --------
    >>> import torch
    >>> sm_count(torch.device("cpu"), cpu=8)
    8
    """
    if isinstance(device, int):
        return _cuda_sm_count(device)
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type == "cuda":
        return _cuda_sm_count(_index(dev))
    if cpu is None:
        raise ValueError(f"device: expected a CUDA device (or a cpu= fallback), got {dev}")
    return cpu


def capability(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA device (None: the
    current one); ``(0, 0)`` for any other device.

    Examples
    --------
    >>> capability("meta")
    (0, 0)
    """
    if isinstance(device, (str, torch.device)):
        dev = device if isinstance(device, torch.device) else torch.device(device)
        if dev.type != "cuda":
            return (0, 0)
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter: Triton's own
    reading of ``TRITON_INTERPRET`` when Triton is loaded (Triton picks
    interpreter or compiler as a kernel is decorated), else the variable set
    to anything but empty or ``0``.  Read now; not cached.

    Examples
    --------
    >>> isinstance(interpreting(), bool)
    True
    """
    triton = sys.modules.get("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def pdl_capable(index: int) -> bool:
    """Whether CUDA device ``index`` has programmatic dependent launch
    (sm90 or newer); cached per index (tests patch it to stand in for one).

    Examples
    --------
    >>> pdl_capable(0)  # an H200  # doctest: +SKIP
    True
    """
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether our kernels launch on ``device`` with programmatic dependent
    launch (PDL): a CUDA device of sm90 or newer, Triton not interpreting,
    and ``SCALEDMM_PDL`` not switched off.

    A kernel launched so may start while the previous kernel on the stream
    finishes; each of ours waits for it (``griddepcontrol.wait``) before any
    global read or write, then lets the next kernel launch (so a kernel
    after ours never starts before ours has waited).  Either way the results
    are the same bits.  The decode passes in front of ``cuda_wgmma`` do not
    use it: chained early launches there cost time (benchmarks/NOTES.md).

    Examples
    --------
    >>> import torch
    >>> pdl(torch.device("cpu"))
    False
    """
    if device.type != "cuda" or not env.pdl() or interpreting():
        return False
    return pdl_capable(_index(device))


def triton_pdl(device: torch.device) -> dict:
    """Launch keywords of a Triton kernel with a ``PDL: tl.constexpr``
    parameter: ``PDL`` (the kernel then calls ``gdc_wait`` before its loads
    and ``gdc_launch_dependents`` after it) and Triton's ``launch_pdl``.

    Examples
    --------
    >>> import torch
    >>> triton_pdl(torch.device("cpu"))
    {'PDL': False}
    """
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}
