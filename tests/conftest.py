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
