"""Shared checks of the compile suite: compile once for every M, no graph
breaks, eager == compiled, and graph inspection helpers."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.custom_graph_pass import CustomGraphPass

M_VALUES = (1, 3, 4, 17, 64, 1000, 0)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@contextlib.contextmanager
def one_graph_for_all_m():
    """Dynamo specializes sizes 0 and 1 unless torch's size-oblivious mode is on;
    with it, M = 0 and M = 1 share the graph of every other M (our decision:
    no M specializes)."""
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        yield


def check_dynamic(fn: Callable, make_inputs: Callable[[int], tuple], ms: Iterable[int] = M_VALUES,
                  backend: str = "aot_eager", exact: bool = True, atol: float = 0.0, rtol: float = 0.0):
    """Compile ``fn`` with fullgraph=True, dynamic=True; run it for every M;
    assert compiled == eager, exactly one compile, and no graph break.
    Returns the compile counter (its ``graphs`` hold the Dynamo graphs)."""
    torch._dynamo.reset()
    ms = list(ms)
    explain = torch._dynamo.explain(fn)(*make_inputs(ms[0]))
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    cnt = CompileCounterWithBackend(backend)
    cfn = torch.compile(fn, backend=cnt, fullgraph=True, dynamic=True)
    with one_graph_for_all_m():
        for m in ms:
            args = make_inputs(m)
            got = cfn(*args)
            want = fn(*args)
            _assert_same(got, want, atol if not exact else 0.0, rtol if not exact else 0.0)
    assert cnt.frame_count == 1, f"{cnt.frame_count} compiles for M in {ms}"
    return cnt


def _assert_same(got, want, atol, rtol):
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w, atol, rtol)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype in (torch.float8_e4m3fn, torch.uint8):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True)


def graph_targets(gm: torch.fx.GraphModule) -> list[str]:
    """Names of every call_function target in ``gm`` and its subgraphs
    (overload ``.default`` dropped: ``scaledmm.fp8_block_mm``)."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            names.append(str(node.target).removesuffix(".default"))
    for sub in gm.children():
        if isinstance(sub, torch.fx.GraphModule):
            names += graph_targets(sub)
    return names


def cond_branches(gm: torch.fx.GraphModule) -> list[tuple[list[str], list[str]]]:
    """``(true branch targets, false branch targets)`` of every ``torch.cond``
    in ``gm`` (and its subgraphs), in graph order."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.cond:
            t_attr, f_attr = node.args[1], node.args[2]
            out.append((graph_targets(getattr(gm, t_attr.target)), graph_targets(getattr(gm, f_attr.target))))
    for sub in gm.children():
        if isinstance(sub, torch.fx.GraphModule):
            out += cond_branches(sub)
    return out


def dynamo_graph(fn: Callable, args: tuple, dynamic: bool) -> torch.fx.GraphModule:
    """The Dynamo (pre-AOT) graph of ``fn``."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    assert len(graphs) == 1
    return graphs[0]


def inductor_code(fn: Callable, args: tuple, **options) -> str:
    """The Python wrapper code Inductor generates for ``fn(*args)``."""
    return inductor_compile(fn, args, **options)[1]


def inductor_compile(fn: Callable, args: tuple, **options) -> tuple[Callable, str]:
    """``fn`` compiled by Inductor (fullgraph, dynamic) and run on ``args``
    once: the compiled function (call it again inside ``one_graph_for_all_m()``
    to reuse the graph for any M) and the wrapper code it generated."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    torch._dynamo.reset()
    cfn = torch.compile(fn, fullgraph=True, dynamic=True, options=options or None)
    with one_graph_for_all_m(), fresh_cache():  # a cache hit would skip the passes
        _, code = run_and_get_code(cfn, *args)
    return cfn, "\n".join(code)


def op_name(target) -> str:
    """``scaledmm.nvfp4_mm`` for ``torch.ops.scaledmm.nvfp4_mm.default``."""
    return str(target).removesuffix(".default")


class RecordingPass(CustomGraphPass):
    """A post-grad pass that runs ``inner`` (e.g. ``scaledmm.compile.passes()``)
    and then records the resulting graph: ``nodes`` holds, for every
    call_function node, ``{"target", "args", "users"}`` (argument nodes and
    users by target name, ``"placeholder"`` / ``"output"`` for those)."""

    def __init__(self, inner: CustomGraphPass | None = None):
        self.inner = inner
        self.nodes: list[dict] = []

    @staticmethod
    def _describe(a):
        if isinstance(a, torch.fx.Node):
            return op_name(a.target) if a.op == "call_function" else a.op
        if isinstance(a, (list, tuple)):
            return type(a)(RecordingPass._describe(x) for x in a)
        return a

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)
        self.nodes = [{"target": op_name(n.target), "args": [self._describe(a) for a in n.args],
                       "users": [self._describe(u) for u in n.users]}
                      for n in graph.nodes if n.op == "call_function"]

    def find(self, target: str) -> list[dict]:
        return [n for n in self.nodes if n["target"] == target]

    @property
    def stats(self) -> dict:
        return getattr(self.inner, "stats", {})

    def uuid(self):
        return self.inner.uuid() if self.inner is not None else "scaledmm-compile-tests-recording"
