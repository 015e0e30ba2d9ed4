"""benchmarks/sweep.py (``python -m benchmarks sweep --kernel NAME``) on the CPU:
the Triton kernels run in the interpreter (a child pytest with
``TRITON_INTERPRET=1``), the harness's timing function is replaced by a fake
one (random per config, seed printed), and the CSV goes through
``python -m benchmarks.tune --kernel`` into a tuning file the loader accepts,
whose chosen config is the fastest correct one."""

from __future__ import annotations

import csv
import os
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import harness, sweep, tune  # noqa: E402
from benchmarks.timing import Timing  # noqa: E402
from helpers import run_under_interpreter  # noqa: E402

CHILD = os.environ.get("SCALEDMM_SWEEP_CHILD") == "1"
child = pytest.mark.skipif(not CHILD, reason="runs in the interpreter child (test_sweep_in_interpreter)")


@pytest.mark.skipif(CHILD, reason="main-process test")
def test_sweep_in_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(__file__, {"SCALEDMM_SWEEP_CHILD": "1"})


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="--kernel: expected one of"):
        sweep.sweep("nope", [], [], torch.device("cpu"), None)


def test_kernels_name_tune_kernels():
    from benchmarks import tune_kernel

    for name, spec in sweep.KERNELS.items():
        assert name in tune_kernel.KERNELS
        cls = sweep.config_class(spec)
        assert cls is tune_kernel.KERNELS[name].load()[0]


def _fake_timer(monkeypatch, seed: int) -> dict:
    """Replace the harness's ``measure`` by a random time per config; returns
    ``{(n, k, m, config): us}`` of what it handed out."""
    rng = random.Random(seed)
    given: dict = {}
    real_call = {name: spec.call for name, spec in sweep.KERNELS.items()}

    def tagged(name):
        def call(cfg):
            fn = real_call[name](cfg)

            def run(*args):
                return fn(*args)
            run.cfg = cfg
            return run
        return call

    for name, spec in sweep.KERNELS.items():
        monkeypatch.setitem(sweep.KERNELS, name, spec._replace(call=tagged(name)))

    def measure(fns, device, cfg):
        first = fns[0]
        a = first.args
        key = (a[1].shape[0], None, a[0].shape[0], first.func.cfg)
        us = given.setdefault(key, rng.uniform(1.0, 100.0))
        return Timing(us, us, us, 3, "wall")

    monkeypatch.setattr(harness, "measure", measure)
    return given


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@child
@pytest.mark.parametrize("kernel,shape,ms,limit", [
    ("fp8_block_triton", "256x512", "1,17", 3),
    ("nvfp4_triton", "256x512", "3,20", 2),
])
def test_sweep_csv_tunes_to_fastest(monkeypatch, tmp_path, kernel, shape, ms, limit):
    from benchmarks import tune_kernel
    from scaledmm import kernel_tuning

    seed = random.randrange(2**32)
    print(f"seed {seed}")
    given = _fake_timer(monkeypatch, seed)
    assert sweep.main(["--kernel", kernel, "--device", "cpu", "--shapes", shape, "--m", ms,
                       "--limit", str(limit), "--out", str(tmp_path)]) == 0
    path = tmp_path / f"{kernel}_sweep.csv"
    rows = _rows(path)
    n, k = (int(v) for v in shape.split("x"))
    assert len(rows) == len(given) == limit * len(ms.split(","))
    assert all(r["status"] == "ok" and float(r["error"]) < 1e-2 for r in rows)
    assert {(int(r["n"]), int(r["k"])) for r in rows} == {(n, k)}

    out = tmp_path / f"{kernel}_cpu.json"
    assert tune.main([str(path), "--kernel", kernel, "--arch", "cpu", "--out", str(out)]) == 0
    spec = sweep.KERNELS[kernel]
    cls = sweep.config_class(spec)
    table = kernel_tuning.load(kernel, "cpu", cls, folder=tmp_path)
    bucket = tune_kernel.KERNELS[kernel].load()[1]
    for m in (int(v) for v in ms.split(",")):
        timed = {c: us for (_, _, mm, c), us in given.items() if mm == m}
        fastest = min(timed, key=timed.get)
        key = bucket(m) if bucket else m
        assert table.lookup(n, k, key) == fastest, (seed, m, timed)


@child
def test_wrong_config_is_not_chosen(monkeypatch, tmp_path):
    """A config whose output is wrong gets status ``wrong``, is never timed
    and never chosen."""
    from scaledmm import kernel_tuning
    from scaledmm.ops import fp8_block_triton as ft

    given = _fake_timer(monkeypatch, 0)
    spec = sweep.KERNELS["fp8_block_triton"]
    bad: list = []

    def call(cfg):
        fn = spec.call(cfg)
        if bad and cfg != bad[0]:
            return fn
        bad.append(cfg)

        def wrong(*args):
            return fn(*args) * 2
        wrong.cfg = cfg
        return wrong

    monkeypatch.setitem(sweep.KERNELS, "fp8_block_triton", spec._replace(call=call))
    assert sweep.main(["--kernel", "fp8_block_triton", "--device", "cpu", "--shapes", "256x512", "--m", "2",
                       "--limit", "3", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "fp8_block_triton_sweep.csv")
    assert [r["status"] for r in rows] == ["wrong", "ok", "ok"]
    assert rows[0]["median_us"] == "nan"
    assert len(given) == 2  # the wrong config was never timed
    out = tmp_path / "fp8_block_triton_cpu.json"
    assert tune.main([str(tmp_path / "fp8_block_triton_sweep.csv"), "--kernel", "fp8_block_triton",
                      "--arch", "cpu", "--out", str(out)]) == 0
    chosen = kernel_tuning.load("fp8_block_triton", "cpu", ft.MMConfig, folder=tmp_path).lookup(256, 512, 16)
    assert chosen != bad[0]
    assert chosen == min((c for (_, _, _, c) in given), key=lambda c: given[(256, None, 2, c)])


@pytest.mark.skipif(CHILD, reason="main-process test")
def test_prebuild_compiles_exactly_what_the_calls_would_load(cache, monkeypatch):
    """Each candidate's call runs under jit.recording(): the NVRTC kernel it
    would load is recorded (nothing loads or launches), then built into the
    cache ``jobs`` at a time; a call that fails before loading any kernel is
    counted, not fatal."""
    from scaledmm import jit
    from scaledmm.ops import nvfp4_gemv as gv

    if not jit.nvrtc_available()[0]:
        pytest.skip("NVRTC not available")
    n, k = 256, 512
    cfgs = gv.candidate_configs(n, k, 8)[:3]

    def spec_of(cfg):
        return gv.kernel_spec(n, k, 8, cfg, torch.bfloat16, None, torch.uint8)

    def call(cfg):
        def run(*args):
            if cfg == "refused":
                raise ValueError("refused before any kernel")
            spec_of(cfg).kernel()
            raise AssertionError("recording lets no load through")
        return run

    fake = sweep.SweepKernel("nvfp4", "nvfp4_mm", f"{gv.__name__}.GemvConfig", lambda args, device: [*cfgs, "refused"],
                             call, lambda device: (True, ""), "tiny", (1,), nvrtc=True)
    monkeypatch.setitem(sweep.KERNELS, "fake_nvrtc", fake)
    assert not any(spec_of(c).cached() for c in cfgs)
    log = []
    got = sweep.prebuild("fake_nvrtc", [sweep.Shape(n, k)], [1, 3], torch.device("cpu"), jobs=2,
                         log=type("L", (), {"write": lambda self, s: log.append(s), "flush": lambda self: None})())
    assert got == (3, 0, 2)  # the same three kernels at both M; the refused config at each point
    assert all(spec_of(c).cached() for c in cfgs)
    assert "prebuilt 3 kernels" in "".join(log)
    with jit.recording() as specs:  # recording is per block, and blocks do not nest
        with pytest.raises(RuntimeError, match="already recording"):
            with jit.recording():
                pass
    assert specs == []
