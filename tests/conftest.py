import os
import re
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
    monkeypatch.setattr(jit, "cuda_driver", lambda: None)
    monkeypatch.delenv("SCALEDMM_NVFP4_BACKEND", raising=False)
    for var in backends.policy("nvfp4", "sm90").switches.values():
        monkeypatch.delenv(var, raising=False)
    with backends.policy_snapshot():
        for fam in backends.Family:
            backends.set_auto_table(fam, "sm90", {})
        yield


_SEED = pytest.StashKey[int]()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty JIT cache folder for this test (builds allowed)."""
    from scaledmm import jit

    d = tmp_path / "cache"
    monkeypatch.setenv(jit.ENV_CACHE_DIR, str(d))
    monkeypatch.delenv(jit.ENV_NO_BUILD, raising=False)
    return d


@pytest.fixture(autouse=True)
def _seed(request):
    """Seed torch's global RNG afresh for every test (fresh random inputs each
    run); the seed is reported with a failure and replayed by setting
    ``SCALEDMM_TEST_SEED``."""
    env = os.environ.get("SCALEDMM_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    request.node.stash[_SEED] = seed
    torch.manual_seed(seed)
    yield seed


# errors after which the CUDA context is unusable for the rest of the process
_STICKY_CUDA = re.compile(r"CUDA error|CUDA_ERROR_(ILLEGAL_ADDRESS|MISALIGNED_ADDRESS|ASSERT|ILLEGAL_INSTRUCTION"
                          r"|LAUNCH_FAILED|HARDWARE_STACK_ERROR)")


def _sticky_cuda_error(excinfo) -> bool:
    text = str(excinfo.value)
    return bool(_STICKY_CUDA.search(text)) and "out of memory" not in text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Report the seed of a failing test; after a sticky CUDA error end this
    process (an xdist worker is replaced, and the crash is reported against
    this test) rather than let every later test fail in the dead context."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    seed = item.stash.get(_SEED, None)
    if seed is not None:
        rep.sections.append(("seed", f"seed={seed} (replay: SCALEDMM_TEST_SEED={seed} pytest '{item.nodeid}')"))
    log = os.environ.get("SCALEDMM_FAILURE_LOG")
    if log:  # written as failures happen: a run killed by a time limit still shows why
        with open(log, "a") as f:
            f.write(f"\n==== {rep.nodeid} ({call.when}, seed={seed})\n{rep.longreprtext[-6000:]}\n")
    if (call.when == "call" and call.excinfo is not None and torch.cuda.is_initialized()
            and _sticky_cuda_error(call.excinfo)):
        msg = f"sticky CUDA error in {item.nodeid}: {str(call.excinfo.value).splitlines()[0]}"
        if os.environ.get("PYTEST_XDIST_WORKER"):
            print(f"\n{msg}; ending worker {os.environ['PYTEST_XDIST_WORKER']}", file=sys.stderr, flush=True)
            os._exit(3)
        item.session.shouldstop = f"{msg}; later tests in this process could not run"


# A skip-without-GPU marker: its reason says a CUDA device or a GPU is needed.
_GPU_SKIP_REASON = re.compile(r"\b(cuda device|gpu)\b", re.IGNORECASE)


def _needs_gpu(item) -> bool:
    """Parametrized on a CUDA device, or skipped without a GPU."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "cuda" in callspec.id:
        return True
    return any(_GPU_SKIP_REASON.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark every GPU test ``gpu`` (so ``-m gpu`` / ``-m "not gpu"`` select by
    it); ``SCALEDMM_TESTS=gpu`` keeps only those (short device runs; the CPU
    tests run in CI)."""
    for item in items:
        if item.get_closest_marker("gpu") is None and _needs_gpu(item):
            item.add_marker(pytest.mark.gpu)
    if os.environ.get("SCALEDMM_TESTS") != "gpu":
        return
    keep = [i for i in items if i.get_closest_marker("gpu") is not None]
    drop = [i for i in items if i.get_closest_marker("gpu") is None]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
