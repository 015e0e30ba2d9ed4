"""How one provider is timed at one problem size.

Method (``/work/.library/device/METHOD.md``):

* The caller hands over one closure per *input copy*: several weight and
  activation sets whose total exceeds the L2 cache (:func:`copies_for`), so
  consecutive calls find their operands cold, as a real model's layers do.
* Warm-up first (JIT compilation, autotuning, handle creation, clocks).
* On a GPU, device time through CUDA events.  A call shorter than
  ``graph_below_us`` is timed as CUDA-graph replay of one pass over the copies
  (launch gaps shrink to what a graph-captured model sees); longer calls get a
  pair of events each.  A provider that cannot be captured falls back to events,
  and the note says why.
* On the CPU, wall-clock time around each call (smoke runs only).
* Statistics: median with the 20th and 80th percentiles of the per-call times.
* A warm-up of a second or more (``--sustain``) also reads the SM clock after
  it and after the timed reps (NVML, else ``nvidia-smi``) into the note: the
  clock a sustained load settles at is what moves large-M figures.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import time
from typing import Callable, Sequence

import torch

__all__ = ["TimingConfig", "Timing", "copies_for", "measure", "percentile", "sm_clock_mhz", "synchronize"]


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    """Knobs of :func:`measure` and of the L2 rotation.

    Parameters
    ----------
    budget_s : float
        Target timed work per provider and point (the rep count follows).
    warmup_s : float
        Extra warm-up time after one pass over all copies.
    min_reps, max_reps : int
        Bounds on the number of samples.
    graph_below_us : float
        Calls estimated shorter than this are timed by CUDA-graph replay.
    rotate_bytes : int
        Inputs of all copies together should exceed this (twice the L2 size).
    max_copies : int
        Cap on input copies (a problem of a few KB cannot fill the L2 sensibly).
    """

    budget_s: float
    warmup_s: float
    min_reps: int
    max_reps: int
    graph_below_us: float
    rotate_bytes: int
    max_copies: int

    @classmethod
    def for_device(cls, device: torch.device, quick: bool = False) -> "TimingConfig":
        """Defaults for ``device``; ``quick`` trades precision for run time.

        Examples
        --------
        >>> TimingConfig.for_device(torch.device("cpu"), quick=True).min_reps
        3
        """
        if device.type != "cuda":
            return cls(budget_s=0.02 if quick else 0.05, warmup_s=0.0, min_reps=3, max_reps=20,
                       graph_below_us=0.0, rotate_bytes=0, max_copies=2)
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20) or (60 << 20)
        return cls(budget_s=0.015 if quick else 0.1, warmup_s=0.0 if quick else 0.03,
                   min_reps=5 if quick else 10, max_reps=50 if quick else 300,
                   graph_below_us=20000.0, rotate_bytes=2 * l2, max_copies=128)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call time statistics in microseconds."""

    median_us: float
    p20_us: float
    p80_us: float
    reps: int
    mode: str  # "graph", "events" or "wall"
    note: str = ""


def copies_for(set_bytes: int, cfg: TimingConfig) -> int:
    """Number of input copies whose total exceeds ``cfg.rotate_bytes`` (at
    least 2 on a GPU, at most ``cfg.max_copies``).

    Examples
    --------
    >>> cfg = TimingConfig(0.1, 0.0, 3, 10, 100.0, 120 << 20, 128)
    >>> copies_for(16 << 20, cfg), copies_for(1 << 30, cfg), copies_for(1, cfg)
    (8, 2, 128)
    """
    if cfg.rotate_bytes <= 0:
        return max(1, min(2, cfg.max_copies))
    need = math.ceil(cfg.rotate_bytes / max(1, set_bytes))
    return max(2, min(need, cfg.max_copies))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0..100) of ``values``.

    Examples
    --------
    >>> percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50), percentile([1.0, 2.0], 20)
    (3.0, 1.2)
    """
    v = sorted(values)
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(samples_us: list[float], mode: str, note: str = "") -> Timing:
    return Timing(percentile(samples_us, 50), percentile(samples_us, 20), percentile(samples_us, 80),
                  len(samples_us), mode, note)


def _reps(cfg: TimingConfig, seconds_per_sample: float) -> int:
    want = int(cfg.budget_s / max(seconds_per_sample, 1e-9))
    return max(cfg.min_reps, min(cfg.max_reps, want))


def sm_clock_mhz(device: torch.device) -> int | None:
    """The SM clock of a CUDA ``device`` over the driver's last sample period
    (NVML through torch, else ``nvidia-smi``), or None where neither answers.

    Examples
    --------
    >>> sm_clock_mhz(torch.device("cpu")) is None
    True
    """
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # pynvml missing: ask nvidia-smi by the device's UUID
        pass
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        query = ["nvidia-smi", "-i", f"GPU-{uuid}", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=10)
        return int(out.stdout.strip().splitlines()[0])
    except Exception:
        return None


def _clock_note(after_warmup: int | None, after_timing: int | None) -> str:
    """The note of a sustained measurement's clocks.

    Examples
    --------
    >>> _clock_note(1830, 1755), _clock_note(None, None)
    ('SM clock 1830 MHz after the warm-up, 1755 after timing', '')
    """
    if after_warmup is None and after_timing is None:
        return ""
    return f"SM clock {after_warmup} MHz after the warm-up, {after_timing} after timing"


def _one_pass(fns: Sequence[Callable[[], object]]) -> None:
    for f in fns:
        f()


def measure(fns: Sequence[Callable[[], object]], device: torch.device, cfg: TimingConfig) -> Timing:
    """Time calls rotating over ``fns`` (one closure per input copy).

    Returns per-call statistics; see the module docstring for the method.
    """
    if device.type != "cuda":
        return _measure_wall(fns, cfg)
    # Warm-up: one pass, then more passes for warmup_s (synchronized, so the
    # host cannot queue up far more device work than warmup_s).
    _one_pass(fns)
    torch.cuda.synchronize(device)
    t_end = time.perf_counter() + cfg.warmup_s
    while time.perf_counter() < t_end:
        _one_pass(fns)
        torch.cuda.synchronize(device)
    if cfg.warmup_s >= 1.0:
        clock0 = sm_clock_mhz(device)
        t = _measure_timed(fns, device, cfg)
        clocks = _clock_note(clock0, sm_clock_mhz(device))
        return dataclasses.replace(t, note="; ".join(n for n in (t.note, clocks) if n))
    return _measure_timed(fns, device, cfg)


def _measure_timed(fns: Sequence[Callable[[], object]], device: torch.device, cfg: TimingConfig) -> Timing:
    """The timed part of :func:`measure` (after its warm-up)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _one_pass(fns)
    end.record()
    end.synchronize()
    per_call_s = start.elapsed_time(end) * 1e-3 / len(fns)
    note = ""
    if per_call_s * 1e6 < cfg.graph_below_us:
        try:
            return _measure_graph(fns, device, cfg, per_call_s)
        except Exception as e:  # not capturable: time it with events instead
            why = (str(e).strip().splitlines() or [""])[0][:120]
            note = f"graph capture failed ({type(e).__name__}: {why}); timed with events"
            try:
                torch.cuda.synchronize(device)
            except Exception:
                pass
    return _measure_events(fns, device, cfg, per_call_s, note)


def _measure_graph(fns, device, cfg: TimingConfig, per_call_s: float) -> Timing:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        _one_pass(fns)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _one_pass(fns)
    graph.replay()
    reps = _reps(cfg, per_call_s * len(fns))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda.synchronize(device)
    for s, e in events:
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize(device)
    samples = [s.elapsed_time(e) * 1e3 / len(fns) for s, e in events]
    del graph
    return _stats(samples, "graph")


def _measure_events(fns, device, cfg: TimingConfig, per_call_s: float, note: str) -> Timing:
    reps = _reps(cfg, per_call_s)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda.synchronize(device)
    for i, (s, e) in enumerate(events):
        s.record()
        fns[i % len(fns)]()
        e.record()
    torch.cuda.synchronize(device)
    return _stats([s.elapsed_time(e) * 1e3 for s, e in events], "events", note)


def _measure_wall(fns, cfg: TimingConfig) -> Timing:
    _one_pass(fns)
    t0 = time.perf_counter()
    _one_pass(fns)
    per_call_s = (time.perf_counter() - t0) / len(fns)
    samples = []
    for i in range(_reps(cfg, per_call_s)):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _stats(samples, "wall")
