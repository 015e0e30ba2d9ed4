"""Shared test helpers: opcheck over all default utils, poisoning, error norms."""

from __future__ import annotations

import contextlib

import torch

FP8 = torch.float8_e4m3fn
_BYTE_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float4_e2m1fn_x2", torch.float8_e4m3fn)}


@contextlib.contextmanager
def _fp8_compare_shim():
    """torch's schema checker compares tensors with ``torch.allclose``, which
    has no CPU kernel for float8 (torch 2.11-2.13).  Compare those bit for bit
    instead (NaN patterns included): stricter than allclose, same intent."""
    orig = torch.allclose

    def allclose(a, b, *args, **kwargs):
        if isinstance(a, torch.Tensor) and a.dtype in _BYTE_DTYPES:
            return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return orig(a, b, *args, **kwargs)

    torch.allclose = allclose
    try:
        yield
    finally:
        torch.allclose = orig


def opcheck(op, args, kwargs=None):
    """``torch.library.opcheck`` with all its default test utils."""
    with _fp8_compare_shim():
        torch.library.opcheck(op, args, kwargs)


def check_rejected_alike(call, args: dict, op: str, arg: str) -> None:
    """``call(args)`` raises ``ValueError("<op>: <arg>: expected ...")``, and
    the same call on FakeTensors (the fake impl) raises the same message."""
    import pytest
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(ValueError, match=rf"^{op}: {arg}: expected") as real:
        call(args)
    mode = FakeTensorMode()
    fake = {key: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for key, v in args.items()}
    with mode, pytest.raises(ValueError) as from_fake:
        call(fake)
    assert str(from_fake.value) == str(real.value)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floating) or 0xFF bytes so unwritten elements show."""
    if t.dtype.is_floating_point and t.dtype.itemsize >= 2:
        return t.fill_(float("nan"))
    t.view(torch.uint8).fill_(0xFF)
    return t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if any NaN in out), on ``ref``'s
    device (a full-size GPU output stays on the GPU)."""
    out = out.to(device=ref.device, dtype=torch.float64)
    ref = ref.double()
    denom = ref.norm().item()
    num = (out - ref).norm().item()
    return num / denom if denom > 0 else num


def devices():
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs.append("cuda")
    return devs


import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class OfflineDriver:
    """What ``JITFunction.warmup`` asks of a Triton driver, for compiling to a
    GPU target on a machine without one (nothing runs):
    ``triton.runtime.driver.set_active(OfflineDriver(90))``."""

    def __init__(self, cap: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", cap, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def cubin_usage(kernel) -> str:
    """``REG:n STACK:n SHARED:n LOCAL:n`` of a compiled Triton kernel (cuobjdump
    from the Triton wheel)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", out).group(0)


def nvfp4_problem(m, n=4096, k=4096, out_dtype=torch.bfloat16, w4a16=False, stride=None, act=None):
    """A ``nvfp4_mm`` (or, ``w4a16``, ``nvfp4_w4a16_mm``) dispatch problem on
    ``cuda:0`` (no GPU needed): activation dtype ``act`` (uint8 / bf16 by
    default), row stride ``stride`` elements (K by default)."""
    from scaledmm.backends import Family, Problem

    act = act if act is not None else torch.bfloat16 if w4a16 else torch.uint8
    return Problem(Family.NVFP4, torch.device("cuda", 0), m, n, k, act, out_dtype,
                   k if stride is None else stride, (("bias", False), ("w4a16", w4a16)))


def run_under_interpreter(test_file: str, env: dict[str, str], drop: tuple[str, ...] = ()) -> None:
    """Run ``test_file`` in a child pytest with ``TRITON_INTERPRET=1`` and ``env``
    (without the variables in ``drop``); assert it passed and ran tests."""
    import os
    import subprocess
    import sys

    child_env = dict(os.environ, TRITON_INTERPRET="1", **env)
    for name in drop:
        child_env.pop(name, None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.abspath(test_file)], cwd=root, env=child_env, capture_output=True, text=True,
                       timeout=900)
    tail = r.stdout[-6000:] + "\n" + r.stderr[-3000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail


def run_codegen_child(test_file: str, env: dict[str, str]) -> None:
    """Run ``test_file`` as a script with ``env`` and without ``TRITON_INTERPRET``
    (Triton's own compiler, no GPU needed); assert it printed ``codegen ok``."""
    import os
    import subprocess
    import sys

    child_env = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    child_env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.abspath(test_file)], env=child_env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "codegen ok" in r.stdout, (r.stdout[-6000:] + r.stderr[-3000:])


def nvrtc_registers(spec) -> int:
    """Compile a ``scaledmm.jit.NvrtcKernelSpec`` with ``ptxas -v``; assert it
    gave a cubin with no spill stores; return its registers per thread."""
    import io
    import re

    log = io.StringIO()
    cubin = spec.compile(logs=log, ptxas_options="-v")
    assert cubin[:4] == b"\x7fELF"
    text = log.getvalue()
    assert re.search(r"\b0 bytes spill stores", text), text
    return int(re.search(r"Used (\d+) registers", text).group(1))
