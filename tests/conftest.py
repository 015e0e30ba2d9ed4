import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("SCALEDMM_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)
settings.load_profile("default")

from helpers import requires_cuda  # noqa: E402,F401  (tests import it from helpers)


@pytest.fixture
def fake_sm90(monkeypatch):
    """Automatic nvfp4 selection as on an sm90 device with NVRTC (no GPU
    needed), the shipped policy without its per-shape rows and with every
    switch on; policy changes made by the test are undone afterwards."""
    from scaledmm import backends, jit

    monkeypatch.setattr(backends, "arch_key", lambda d: "sm90" if d.type == "cuda" else d.type)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(jit, "nvrtc_available", lambda: (True, "stub"))
    monkeypatch.setattr(jit, "_driver", lambda: None)
    monkeypatch.delenv("SCALEDMM_NVFP4_BACKEND", raising=False)
    for var in backends.policy("nvfp4", "sm90").switches.values():
        monkeypatch.delenv(var, raising=False)
    with backends.policy_snapshot():
        for fam in backends.Family:
            backends.set_auto_table(fam, "sm90", {})
        yield


@pytest.fixture(autouse=True)
def _seed():
    # fresh random inputs every run, but reproducible within a run when a test fails
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    yield seed


def _gpu_case(item) -> bool:
    """A test that exercises the GPU: a "cuda" parameter, or a skip-without-GPU marker."""
    nid = item.nodeid
    params = nid[nid.find("["):] if "[" in nid else ""
    if "cuda" in params:
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", "")).lower()
        if any(w in reason for w in ("cuda", "gpu", "sm90", "device")):
            return True
    return "cuda" in item.name.lower() or "gpu" in nid.lower() or "cudagraph" in nid.lower()


def pytest_collection_modifyitems(config, items):
    """``SCALEDMM_TESTS=gpu`` keeps only the tests that exercise a GPU (short
    device runs; the CPU tests run in CI)."""
    if os.environ.get("SCALEDMM_TESTS") != "gpu":
        return
    keep = [i for i in items if _gpu_case(i)]
    drop = [i for i in items if not _gpu_case(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
