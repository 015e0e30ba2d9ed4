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
