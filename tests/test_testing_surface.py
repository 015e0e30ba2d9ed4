"""Tests reach scaledmm internals only through the testing surface.

docs/ARCHITECTURE.md ("Testing surface") lists what tests may use beyond the public API; all
of it has public names. This test finds every remaining use of an underscore-prefixed name of
a package module or object in ``tests/`` and ``compile_tests/`` and fails when there are more
than ``ALLOWED`` of them, so the count can only go down. Lower ``ALLOWED`` when you remove some.
"""
import ast
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("scaledmm", "ops", "fake_impls", "benchmarks")
# A ratchet: the number of private accesses left; only ever lower it.
# Left: tests/test_skinny.py ``fa._source`` (ops/skinny_fused_a.py).
ALLOWED = 0


def _is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_package(module):
    return module is not None and module.split(".")[0] in PACKAGES


def _package_private_names():
    """Underscore names the package defines (functions, classes, variables, ``self._x``)."""
    names = set()
    for root in PACKAGES:
        for path in (ROOT / root).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and getattr(node.value, "id", None) in ("self", "cls")
                ):
                    names.add(node.attr)
    # torch's own private attributes (``Tensor._version``) are not ours to hide.
    return {
        n
        for n in names
        if _is_private(n) and not hasattr(torch.Tensor, n) and not hasattr(torch.nn.Module, n)
    }


def _module_string(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _shown(path):
    try:
        return path.relative_to(ROOT)
    except ValueError:
        return path


def _offenders_in(path, package_private):
    tree = ast.parse(path.read_text(), str(path))
    aliases, foreign = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound = a.asname or a.name.split(".")[0]
                (aliases if _is_package(a.name) else foreign).add(bound)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                bound = a.asname or a.name
                (aliases if _is_package(node.module) else foreign).add(bound)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func, args = node.value.func, node.value.args
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "importorskip") and args and _is_package(
                _module_string(args[0])
            ):
                aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    local = {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))
    }
    found = []
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.ImportFrom) and _is_package(node.module):
            hit = next((a.name for a in node.names if _is_private(a.name)), None)
            hit = f"from {node.module} import {hit}" if hit else None
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = root = node.value
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            root = getattr(root, "id", None)
            if isinstance(base, ast.Name) and base.id in aliases:
                hit = f"{base.id}.{node.attr}"
            elif node.attr in package_private and root not in foreign | local | {"self", "cls"}:
                hit = f"{ast.unparse(base)}.{node.attr}"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("setattr", "delattr", "getattr", "hasattr"):
                target = _module_string(node.args[0])
                if target and _is_package(target) and _is_private(target.rsplit(".", 1)[-1]):
                    hit = f'{fname}("{target}")'
                elif (
                    len(node.args) > 1
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in aliases
                    and _is_private(_module_string(node.args[1]) or "x")
                ):
                    hit = f'{fname}({node.args[0].id}, "{node.args[1].value}")'
        if hit:
            found.append(f"{_shown(path)}:{node.lineno}: {hit}")
    return found


def private_accesses():
    """Every private access to a package name in tests/ and compile_tests/, one line each.

    Examples
    --------
    >>> lines = private_accesses()  # ["tests/test_x.py:12: T._name", ...]
    """
    package_private = _package_private_names()
    found = []
    for folder in ("tests", "compile_tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() != pathlib.Path(__file__).resolve():
                found += _offenders_in(path, package_private)
    return found


def test_private_accesses_do_not_grow():
    found = private_accesses()
    assert len(found) <= ALLOWED, (
        f"{len(found)} private accesses to scaledmm internals (allowed {ALLOWED}); use the "
        "testing surface in docs/ARCHITECTURE.md or make the name public:\n" + "\n".join(found)
    )


def test_scanner_finds_a_private_access(tmp_path):
    sample = tmp_path / "t.py"
    sample.write_text(
        "import ops.fp8_block_triton as T\n"
        "from scaledmm import backends\n"
        "from scaledmm.backends import _hidden\n"
        "x = T._INTERPRET\n"
        "backends._invalidate()\n"
        "mp.setattr(T, '_sm_count', 1)\n"
        "y = T.public\n"
        "z = T.__name__\n"
    )
    found = _offenders_in(sample, set())
    sample_hits = sorted(line.split(": ", 1)[1] for line in found)
    assert sample_hits == sorted(
        [
            "from scaledmm.backends import _hidden",
            "T._INTERPRET",
            "backends._invalidate",
            'setattr(T, "_sm_count")',
        ]
    )
