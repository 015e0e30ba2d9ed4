"""scaledmm.env and scaledmm.device: one home for environment variables and
device facts.

* Source scan: outside ``scaledmm/env.py`` no code string of the package
  (``ops/``, ``scaledmm/``, ``fake_impls/``; docstrings and comments may name
  a variable) contains ``SCALEDMM_``, and nothing else reads ``os.environ``
  for one; every variable the package, its policy files or the README name is
  known to ``env`` and listed in the README.
* Each accessor's rule against a table of values (unset, empty, spaces, case).
* Device facts: the CPU fallback and error of ``sm_count``, an uncached
  ``capability`` (tests patch ``torch.cuda.get_device_capability``), and
  ``interpreting`` with and without Triton loaded.
* The doctests of both modules.
"""

from __future__ import annotations

import ast
import doctest
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import scaledmm
from scaledmm import backends, device, env, policy

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("ops", "scaledmm", "fake_impls")
ENV_FILE = ROOT / "scaledmm" / "env.py"
NAME = re.compile(r"SCALEDMM_[A-Z0-9_]*[A-Z0-9]")


def _sources() -> list[Path]:
    files = sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 20, files  # the scan really saw the package
    return files


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants of ``tree`` that are not docstrings."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_scaledmm_strings_only_in_env_module():
    offenders = []
    for path in _sources():
        if path.resolve() == ENV_FILE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in _code_strings(tree):
            if "SCALEDMM_" in node.value:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "SCALEDMM_* named outside scaledmm/env.py:\n" + "\n".join(offenders)


def test_no_environ_read_of_scaledmm_variables_outside_env():
    # os.environ / getenv with a name built or passed from elsewhere: the only
    # remaining environment reads must be of non-SCALEDMM variables.
    read = re.compile(r"(os\.environ(\.get)?\s*[\[(]|os\.getenv\s*\()\s*([^\])]*)")
    offenders = []
    for path in _sources():
        if path.resolve() == ENV_FILE:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = None if line.lstrip().startswith((">>>", "...")) else read.search(line)  # doctests: examples
            if m and not re.match(r"\s*[\"'](TRITON_|CUDA_|PATH|HOME)", m.group(3)):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "environment read outside scaledmm/env.py:\n" + "\n".join(offenders)


def _known() -> set[str]:
    return set(env.VARIABLES) | {f.env_var for f in backends.Family}


def test_every_named_variable_is_known_and_in_readme():
    named = set()
    for path in _sources():
        named |= set(NAME.findall(path.read_text()))
    for path in sorted((ROOT / "scaledmm" / "tuning").glob("*.json")):
        named |= set(json.loads(path.read_text()).get("switches", {}).values())
    named.discard("SCALEDMM_NO_SUCH_VARIABLE")  # env.py's doctest
    unknown = named - _known()
    assert not unknown, f"variables without an accessor in scaledmm/env.py: {sorted(unknown)}"
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    missing = sorted(v for v in _known() if f"`{v}`" not in section)
    assert not missing, f"README 'Environment variables' lacks {missing}"


def test_backend_var_matches_family():
    for fam in backends.Family:
        assert fam.env_var == env.backend_var(fam.value) == f"SCALEDMM_{fam.value.upper()}_BACKEND"


@pytest.mark.parametrize("value, no_build", [
    (None, False), ("", False), ("0", False), ("false", False), (" No ", False), ("FALSE", False),
    ("1", True), ("yes", True), ("true", True), ("2", True), (" 1 ", True),
])
def test_jit_no_build_rule(monkeypatch, value, no_build):
    if value is None:
        monkeypatch.delenv(env.JIT_NO_BUILD, raising=False)
    else:
        monkeypatch.setenv(env.JIT_NO_BUILD, value)
    assert env.jit_no_build() is no_build
    assert scaledmm.jit.core.no_build() is no_build  # the JIT reads it through env


@pytest.mark.parametrize("value", [None, "", "0", "1", "true", " 1", "yes"])
def test_flag_rules(monkeypatch, value):
    def put(var):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)

    put(env.NVFP4_PREDECODE_W)
    assert env.nvfp4_predecode_w() is (value == "1")


@pytest.mark.parametrize("value", [None, "", "0", "1", "off", "auto"])
def test_switch_rule(monkeypatch, value):
    var = env.NVFP4_GEMV
    if value is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, value)
    on = value not in ("", "0")
    assert env.switched_on(value) is on and env.switch_on(var) is on
    assert env.switch_on(var, {var: "0"}) is False and env.switch_on(var, {}) is True
    p = policy.Policy("nvfp4", "sm90", ("cuda_gemv", "triton"), switches={"cuda_gemv": var})
    assert p.enabled("cuda_gemv") is on  # read now, not at import
    assert p.auto_order(8, 16, 1) == (["cuda_gemv", "triton"] if on else ["triton"])
    assert policy.switched_on is env.switched_on


def test_switch_names_validated_through_env():
    assert env.is_switch_var("SCALEDMM_X1") and not env.is_switch_var("scaledmm_x")
    assert not env.is_switch_var(None) and not env.is_switch_var("SCALEDMM_a")
    with pytest.raises(policy.PolicyError, match="switches"):
        policy.parse({"family": "nvfp4", "arch": "sm90", "order": ["triton"],
                      "switches": {"triton": "NVFP4_TRITON"}}, "t.json")


@pytest.mark.parametrize("value", [None, "", "/tmp/a b", "x"])
def test_text_accessors(monkeypatch, value):
    pairs = [(env.CACHE_DIR, env.cache_dir), (env.NVCC, env.nvcc), (env.CUTLASS_INCLUDE, env.cutlass_include)]
    for var, _ in pairs:
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert env.cache_dir() == (value or None)  # empty means unset
    assert env.nvcc() == value and env.cutlass_include() == value
    if value is None:
        monkeypatch.delenv(env.NVFP4_TRITON_DECODE, raising=False)
        monkeypatch.delenv(env.SKINNY_KERNEL, raising=False)
        assert env.nvfp4_triton_decode("ptx") == "ptx" and env.skinny_kernel() == "reg"
    else:
        monkeypatch.setenv(env.NVFP4_TRITON_DECODE, value)
        monkeypatch.setenv(env.SKINNY_KERNEL, value)
        assert env.nvfp4_triton_decode("ptx") == value and env.skinny_kernel() == value


@pytest.mark.parametrize("value", [None, "", "triton", " cublas ", "näme"])
def test_raw_read_and_backend_request(monkeypatch, value):
    var = backends.Family.FP8.env_var
    if value is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, value)
    assert env.text(env.raw(var)) == value == env.get(var)
    want = None if value is None or value.strip() in ("", "auto") else value.strip()
    assert backends.requested("fp8") == want


def test_sm_count():
    assert device.sm_count(torch.device("cpu"), cpu=4) == 4 and device.sm_count("meta", cpu=8) == 8
    with pytest.raises(ValueError, match="device: expected a CUDA device.*got cpu"):
        device.sm_count("cpu")
    if torch.cuda.is_available():
        want = torch.cuda.get_device_properties(0).multi_processor_count
        assert device.sm_count(0) == device.sm_count(torch.device("cuda", 0)) == want


def test_capability_reads_torch_each_call(monkeypatch):
    assert device.capability("cpu") == (0, 0) and device.capability(torch.device("meta")) == (0, 0)
    for cap in ((9, 0), (8, 9), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert device.capability(torch.device("cuda", 0)) == cap
        assert device.capability() == cap


@pytest.mark.parametrize("value, want", [(None, False), ("", False), ("0", False), ("1", True)])
def test_interpreting(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    monkeypatch.setitem(sys.modules, "triton", None)  # Triton not loaded: the variable
    assert device.interpreting() is want
    monkeypatch.undo()
    triton = pytest.importorskip("triton")
    if hasattr(triton, "knobs"):
        with monkeypatch.context() as m:
            if value is None:
                m.delenv("TRITON_INTERPRET", raising=False)
            else:
                m.setenv("TRITON_INTERPRET", value)
            assert device.interpreting() is bool(triton.knobs.runtime.interpret) is want


def test_ops_use_device_facts():
    from scaledmm.ops import nvfp4_gemv, nvfp4_mid, nvfp4_triton, skinny_fused_a

    assert nvfp4_triton.interpreting is device.interpreting
    assert nvfp4_gemv.NUM_SMS_H200 == nvfp4_mid.NUM_SMS_H200 == skinny_fused_a.NUM_SMS_H200 == device.NUM_SMS_H200
    for mod in (nvfp4_gemv, skinny_fused_a):
        assert not hasattr(mod, "num_sms")  # one SM-count helper: scaledmm.device.sm_count
    assert nvfp4_triton.grid_sms(torch.device("cpu")) == 8


@pytest.mark.parametrize("mod", [env, device], ids=["env", "device"])
def test_doctests(mod):
    saved = dict(os.environ)
    try:
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize("cap,var,interp,want", [
    ((9, 0), None, False, True), ((10, 0), "1", False, True), ((9, 0), "0", False, False),
    ((9, 0), "", False, False), ((8, 9), None, False, False), ((9, 0), None, True, False),
])
def test_pdl_by_capability_switch_and_interpreter(monkeypatch, cap, var, interp, want):
    """Our launches use PDL on sm90+ CUDA devices unless SCALEDMM_PDL is off or
    Triton interprets; the Triton launch keywords follow (no GPU needed)."""
    monkeypatch.setattr(device, "pdl_capable", lambda index, c=cap: c[0] >= 9)
    monkeypatch.setattr(device, "interpreting", lambda: interp)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    if var is None:
        monkeypatch.delenv(env.PDL, raising=False)
    else:
        monkeypatch.setenv(env.PDL, var)
    cuda = torch.device("cuda", 0)
    assert device.pdl(cuda) is want
    assert device.triton_pdl(cuda) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})
    assert device.pdl(torch.device("cpu")) is False and device.triton_pdl(torch.device("cpu")) == {"PDL": False}
    assert device.pdl(torch.device("cuda")) is want  # no index: the current device
