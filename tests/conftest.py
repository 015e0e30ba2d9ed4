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


def pytest_collection_modifyitems(config, items):
    """``SCALEDMM_TESTS=gpu`` keeps the tests that exercise a GPU (for short
    device runs: the CPU tests run in CI): drops CPU-parametrized cases and the
    CPU-only suites (Triton interpreter, NVRTC/nvcc compile checks, CLI smoke)."""
    if os.environ.get("SCALEDMM_TESTS") != "gpu":
        return
    cpu_only_files = ("test_benchmarks.py", "test_jit.py", "test_skinny_tma_model.py")
    keep, drop = [], []
    for item in items:
        nid = item.nodeid
        params = nid[nid.find("["):] if "[" in nid else ""
        cpu_param = any(t in params for t in ("[cpu", "-cpu", "cpu-", "cpu]"))
        if cpu_param or nid.split("::")[0].endswith(cpu_only_files) or "interpreter" in nid:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
