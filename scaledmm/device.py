"""Device facts the ops consult: SM count, compute capability, and whether
Triton runs in its CPU interpreter.

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

__all__ = ["NUM_SMS_H200", "sm_count", "capability", "interpreting"]

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
