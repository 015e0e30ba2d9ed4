"""Inductor integration: one post-grad ``CustomGraphPass`` for graphs that use
scaledmm ops.

Use it as::

    model = torch.compile(model, dynamic=True, options=scaledmm.compile.options())

which is ``{"post_grad_custom_post_pass": scaledmm.compile.passes(),
"triton.enable_pdl": True}``.  On sm90 and newer our kernels launch with
programmatic dependent launch (``scaledmm.device.pdl``); ``options()`` also
turns on Inductor's (``triton.enable_pdl``), so its kernels and ours overlap
their launches: 2-5 us a Llama-3-8B layer at decode; ``options(pdl=False)`` leaves it off
(benchmarks/RESULTS.md, "Inductor's PDL by default").

It rewrites, in this order:

1. **Size-predicated conds -> opaque ops.**  ``scaledmm.fp8_block_mm`` and
   ``scaledmm.skinny_linear`` trace to ``torch.cond(M % 4 != 0, padded, direct)``
   and ``torch.cond(M <= 16, fused_a, linear)`` when M is dynamic.  Inductor
   disables CUDA graphs for any graph holding a ``torch.cond``, although these
   predicates depend on sizes alone.  The pass replaces them with
   ``dynamic_padded_fp8_block_mm`` and ``dynamic_skinny_linear``, which make the
   same choice at run time, so Inductor keeps CUDA graphs.
2. **Quantize + GEMM -> one linear op.**  ``per_token_group_quant_fp8``
   (default eps, no ue8m0) whose two outputs only feed one fp8_block GEMM with
   the same group size becomes one ``fp8_block_linear`` on the bf16/fp16 input;
   ``quant_fp8`` whose two outputs only feed one ``fp8_scaled_mm`` (as its
   ``a`` and ``scale_a``) becomes one ``fp8_linear``.  Either may then run as
   one launch (``cuda_gemv`` at decode sizes).
3. **NVFP4 epilogues -> ``nvfp4_mm`` arguments.**  ``nvfp4_mm(...)`` followed by
   a multiply with a one-element tensor and/or an add of an ``[N]`` bias (with
   optional dtype conversions around them) becomes one ``nvfp4_mm`` whose
   ``alpha`` is the product and whose ``bias`` is the bias, rounded once.
4. **Row amax of a fused producer -> amax per 2048 values.**  The
   ``x_amax`` of ``nvfp4_dynamic_linear`` is any 1-D tensor whose maximum is
   the activation's (``NvFp4Linear`` passes the row amax).  When that amax is
   taken of a chain of pointwise ops (a SiLU-mul: no row reduction in it to
   share a kernel with) over rows of K >= 8192, it becomes the amax of every
   2048 consecutive values: Inductor then spreads a decode row over K / 2048
   programs where it gave the row amax two (the H100's Llama-3-8B W4A4
   layer: 1.5 us faster at M = 1 and 8, 5-10 us at M = 64-512;
   benchmarks/RESULTS.md).  The maximum is the rows' maximum.  (Which
   values it is taken of is Inductor's choice, with the rewrite or
   without: a fused producer's float32 values, or the rounded activation;
   with ``emulate_precision_casts`` always the latter, and the output is
   eager's bit for bit.)

5. **FP8 activation quantization -> aten ops in the producer's kernel**
   (off by default, not yet timed on a GPU: ``options(fuse_quant=True)``).
   ``fp8_linear`` with a dynamic per-token scale (``Fp8Linear``'s default)
   or ``fp8_block_linear`` (1 x 128 groups), whose activation is made by a
   pointwise op (the norm's last multiply, a SiLU-mul, the copy after
   attention), becomes the quantization in aten ops (``reference_quant``'s
   arithmetic: amax, ``max(amax, 1e-10) / 448``, ``x * (1 / s)`` per token
   or ``x / s`` per group, clamp, e4m3) and the GEMM op.  Inductor can then
   fuse the quantization into the kernel that makes the activation: one
   launch and one bf16 round trip less per layer.  Layers reading the same
   activation share one quantization.  The per-group form divides every
   value, so it is done only where Inductor's float32 divisions are IEEE
   ones (:func:`numerics`).  The codes are the quantizer's for the
   activation Inductor computes (with ``emulate_precision_casts`` eager's,
   bit for bit; without it, the producer's unrounded float32 values).

Each rewrite checks the exact shape of the pattern and leaves anything else
alone.  ``uuid()`` hashes this file, so the FX graph cache keeps working and is
invalidated when the pass changes.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from scaledmm.ops.fp8 import AMAX_FLOOR
from scaledmm.oplib import FP8_DTYPE, FP8_MAX

__all__ = ["ScaledMMPass", "passes", "options", "numerics"]

_ops = torch.ops.scaledmm
_aten = torch.ops.aten
_prims = torch.ops.prims


def _is(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _set_meta(node: fx.Node) -> None:
    """Fill ``node.meta['val']`` by running the op's fake under the graph's fake mode."""
    from torch._guards import detect_fake_mode

    args = fx.node.map_arg(node.args, _val)
    kwargs = fx.node.map_arg(node.kwargs, _val)
    vals = [v for v in fx.node.map_aggregate((args, kwargs), lambda v: v) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(vals)
    if mode is None:
        return
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


# ----------------------------------------------------------------------------
# 1. conds on sizes -> dynamic ops
# ----------------------------------------------------------------------------


def _single_op(gm: fx.GraphModule) -> fx.Node | None:
    """The one scaledmm call of a cond branch whose output is that call."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    ours = [n for n in calls if str(n.target).startswith("scaledmm.")]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if len(ours) != 1:
        return None
    res = out.args[0]
    res = res[0] if isinstance(res, (tuple, list)) and len(res) == 1 else res
    return ours[0] if res is ours[0] else None


def _map_to_outer(inner: fx.Node, branch: fx.GraphModule, operands) -> tuple[tuple, dict] | None:
    placeholders = [n for n in branch.graph.nodes if n.op == "placeholder"]
    index = {p: i for i, p in enumerate(placeholders)}
    ok = True

    def outer(a):
        nonlocal ok
        if isinstance(a, fx.Node):
            if a not in index:
                ok = False
                return a
            return operands[index[a]]
        return a

    args = fx.node.map_arg(inner.args, outer)
    kwargs = fx.node.map_arg(inner.kwargs, outer)
    return (args, kwargs) if ok else None


def _pred_is(pred: Any, kind: str) -> bool:
    if kind == "align":  # (M % 4) != 0
        return (_is(pred, operator.ne) and pred.args[1] == 0 and _is(pred.args[0], operator.mod)
                and pred.args[0].args[1] == 4)
    if kind == "skinny":  # M <= 16
        return _is(pred, operator.le) and pred.args[1] == 16
    return False


def _replace_cond(graph: fx.Graph, cond: fx.Node, target, args, kwargs) -> None:
    with graph.inserting_before(cond):
        new = graph.call_function(target, args, kwargs)
    _set_meta(new)
    for user in list(cond.users):
        if _is(user, operator.getitem) and user.args[1] == 0:
            user.replace_all_uses_with(new)
            graph.erase_node(user)
    if not cond.users:
        graph.erase_node(cond)


def lower_size_conds(gm: fx.GraphModule) -> int:
    """Rewrite our size-predicated ``torch.cond`` nodes into dynamic ops."""
    graph = gm.graph
    count = 0
    for cond in list(graph.nodes):
        if not _is(cond, torch.ops.higher_order.cond):
            continue
        pred, t_attr, f_attr, operands = cond.args[:4]
        if not (t_attr.op == "get_attr" and f_attr.op == "get_attr"):
            continue
        t_gm, f_gm = getattr(gm, t_attr.target), getattr(gm, f_attr.target)
        t_op = _single_op(t_gm)
        f_op = _single_op(f_gm)
        if (_pred_is(pred, "align") and t_op is not None and f_op is not None
                and t_op.target == _ops.padded_fp8_block_mm.default
                and f_op.target == _ops.fp8_block_mm.default):
            mapped = _map_to_outer(f_op, f_gm, operands)
            if mapped is None:
                continue
            _replace_cond(graph, cond, _ops.dynamic_padded_fp8_block_mm.default, *mapped)
            count += 1
        elif (_pred_is(pred, "skinny") and t_op is not None
              and t_op.target == _ops.dsv3_fused_a_gemm.default and f_op is None):
            mapped = _map_to_outer(t_op, t_gm, operands)
            if mapped is None:
                continue
            args, kwargs = mapped
            _replace_cond(graph, cond, _ops.dynamic_skinny_linear.default, args[:2], {})
            count += 1
    if count:
        graph.eliminate_dead_code()
        for name, mod in list(gm.named_children()):
            if isinstance(mod, fx.GraphModule) and not any(
                    n.op == "get_attr" and n.target == name for n in graph.nodes):
                delattr(gm, name)
    return count


# ----------------------------------------------------------------------------
# 2. quantize -> GEMM  ==>  fp8_block_linear / fp8_linear
# ----------------------------------------------------------------------------

def _block_gemms():
    return (_ops.fp8_block_mm.default, _ops.padded_fp8_block_mm.default,
            _ops.dynamic_padded_fp8_block_mm.default)


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _only_pair(quant: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """``(q, s, consumer)`` when both outputs of ``quant`` are read once, by
    the same node; else None."""
    getters = list(quant.users)
    if len(getters) != 2 or not all(_is(g, operator.getitem) for g in getters):
        return None
    q = next((g for g in getters if g.args[1] == 0), None)
    s = next((g for g in getters if g.args[1] == 1), None)
    if q is None or s is None or len(q.users) != 1 or len(s.users) != 1:
        return None
    user = next(iter(q.users))
    return (q, s, user) if user is next(iter(s.users)) else None


def fuse_quant_into_gemm(graph: fx.Graph) -> int:
    count = 0
    for quant in list(graph.nodes):
        if not _is(quant, _ops.per_token_group_quant_fp8.default):
            continue
        x = quant.args[0] if quant.args else quant.kwargs["x"]
        group = _arg(quant, 1, "group_size", 128)
        eps = _arg(quant, 2, "eps", 1e-10)
        ue8m0 = _arg(quant, 4, "scale_ue8m0", False)
        xv = _val(x)
        if ue8m0 or eps != 1e-10 or xv is None or xv.dtype not in (torch.bfloat16, torch.float16):
            continue
        pair = _only_pair(quant)
        if pair is None:
            continue
        q, s, gemm = pair
        if not _is(gemm, *_block_gemms()):
            continue
        if len(gemm.args) < 4 or gemm.args[0] is not q or gemm.args[2] is not s:
            continue
        block = list(_arg(gemm, 4, "block_size", [128, 128]))
        out_dtype = _arg(gemm, 5, "out_dtype", torch.bfloat16)
        if len(block) != 2 or block[1] != group or out_dtype not in (torch.bfloat16, torch.float16):
            continue
        with graph.inserting_before(gemm):
            new = graph.call_function(_ops.fp8_block_linear.default,
                                      (x, gemm.args[1], gemm.args[3], block, out_dtype, None))
        _set_meta(new)
        gemm.replace_all_uses_with(new)
        for n in (gemm, q, s, quant):
            graph.erase_node(n)
        count += 1
    return count


def fuse_quant_into_scaled_mm(graph: fx.Graph) -> int:
    """``quant_fp8(x, scale, per_token)`` -> ``fp8_scaled_mm(q, b, s, scale_b,
    bias, out_dtype)``  ==>  ``fp8_linear(x, b, scale_b, scale, per_token,
    bias, out_dtype)``."""
    count = 0
    for quant in list(graph.nodes):
        if not _is(quant, _ops.quant_fp8.default):
            continue
        pair = _only_pair(quant)
        if pair is None:
            continue
        q, s, mm = pair
        if not _is(mm, _ops.fp8_scaled_mm.default) or len(mm.args) < 4:
            continue
        if mm.args[0] is not q or mm.args[2] is not s or q in mm.args[1:] or s in (mm.args[1], mm.args[3]):
            continue
        x = quant.args[0] if quant.args else quant.kwargs["x"]
        scale = _arg(quant, 1, "scale", None)
        per_token = _arg(quant, 2, "per_token", False)
        bias = _arg(mm, 4, "bias", None)
        out_dtype = _arg(mm, 5, "out_dtype", torch.bfloat16)
        with graph.inserting_before(mm):
            new = graph.call_function(_ops.fp8_linear.default,
                                      (x, mm.args[1], mm.args[3], scale, per_token, bias, out_dtype))
        _set_meta(new)
        mm.replace_all_uses_with(new)
        for n in (mm, q, s, quant):
            graph.erase_node(n)
        count += 1
    return count


# ----------------------------------------------------------------------------
# 3. nvfp4_mm(...) [* alpha] [+ bias]  ==>  nvfp4_mm(alpha', bias')
# ----------------------------------------------------------------------------

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _is_convert(n: fx.Node) -> bool:
    return _is(n, torch.ops.prims.convert_element_type.default, _aten._to_copy.default)


def _other(user: fx.Node, node: fx.Node) -> Any:
    return user.args[1] if user.args[0] is node else user.args[0]


def fold_nvfp4_epilogue(graph: fx.Graph) -> int:
    """Fold ``* alpha`` (one-element fp32 tensors) and then ``+ bias`` ([N]),
    with dtype conversions between them, into the ``nvfp4_mm`` that feeds
    them.  The fused op rounds once, to the dtype of the chain's last node: the
    result equals the unfused chain up to the roundings it removes."""
    count = 0
    for mm in list(graph.nodes):
        if not _is(mm, _ops.nvfp4_mm.default):
            continue
        args = list(mm.args) + [None] * (7 - len(mm.args))
        a, b, sa, sb, alpha = args[:5]
        bias = mm.kwargs.get("bias", args[6])
        mv = _val(mm)
        if mv is None or mv.dim() != 2:
            continue
        alphas: list[Any] = []
        new_bias, node, last = bias, mm, None
        while len(node.users) == 1:
            user = next(iter(node.users))
            uv = _val(user)
            if not isinstance(uv, torch.Tensor) or uv.shape != mv.shape or uv.dtype not in _FLOATS:
                break
            if _is_convert(user):
                node = last = user
                if uv.dtype != torch.float32:
                    break  # a narrowing conversion is the one rounding we keep
                continue
            other = _other(user, node)
            ov = _val(other)
            if (_is(user, _aten.mul.Tensor) and new_bias is None and isinstance(ov, torch.Tensor)
                    and ov.numel() == 1 and ov.dtype == torch.float32):
                alphas.append(other)
                node = last = user
                continue
            if (_is(user, _aten.add.Tensor) and new_bias is None and isinstance(ov, torch.Tensor)
                    and tuple(ov.shape) == (mv.shape[1],) and ov.dtype in _FLOATS and len(user.args) == 2
                    and "alpha" not in user.kwargs):
                new_bias = other
                node = last = user
                continue
            break
        if last is None or (not alphas and new_bias is bias):
            continue
        with graph.inserting_before(last):
            new_alpha = alpha
            for f in alphas:
                new_alpha = graph.call_function(_aten.mul.Tensor, (new_alpha, f))
                _set_meta(new_alpha)
            new = graph.call_function(_ops.nvfp4_mm.default,
                                      (a, b, sa, sb, new_alpha, _val(last).dtype, new_bias))
        _set_meta(new)
        last.replace_all_uses_with(new)
        graph.eliminate_dead_code()
        count += 1
    return count


# ----------------------------------------------------------------------------
# 4. nvfp4_dynamic_linear(x, amax(pointwise(...), [1]))  ==>  amax per chunk
# ----------------------------------------------------------------------------

#: Values per partial maximum.  Rows shorter than ``_AMAX_MIN_K`` keep their
#: row amax: only the 14336-wide SiLU-mul row has been measured (rows after a
#: norm keep it whatever their width: the norm's kernel takes it for free).
_AMAX_CHUNK = 2048
_AMAX_MIN_K = 8192


def _pointwise_chain(node: fx.Node, limit: int = 64) -> bool:
    """True when ``node`` is computed by pointwise ops and views from
    materialized tensors (graph inputs, extern kernels, custom ops), with no
    reduction among them: Inductor fuses such a chain into the kernel that
    reduces its result, so the reduction's shape decides that kernel's grid."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        tags = getattr(n.target, "tags", ())
        if torch.Tag.reduction in tags or len(seen) > limit:
            return False
        if torch.Tag.pointwise in tags or getattr(n.target, "is_view", False):
            todo.extend(n.all_input_nodes)
    return True


def chunk_nvfp4_amax(graph: fx.Graph) -> int:
    """Rewrite 4 (module docstring).  Every user of the amax must be an
    ``nvfp4_dynamic_linear`` reading it as ``x_amax``: any other reader wants
    the ``[M]`` row values."""
    count = 0
    for amax in list(graph.nodes):
        if not (_is(amax, _aten.amax.default) and len(amax.args) >= 2 and list(amax.args[1]) in ([1], [-1])
                and not (amax.args[2:3] and amax.args[2]) and not amax.kwargs.get("keepdim", False)):
            continue
        src = amax.args[0]
        sv = _val(src)
        if (not isinstance(sv, torch.Tensor) or sv.dim() != 2 or not isinstance(sv.shape[1], int)
                or sv.shape[1] < _AMAX_MIN_K or sv.shape[1] % _AMAX_CHUNK or not sv.is_contiguous()
                or src.op != "call_function" or torch.Tag.pointwise not in getattr(src.target, "tags", ())):
            continue
        if not amax.users or not all(_is(u, _ops.nvfp4_dynamic_linear.default) and u.args[1] is amax
                                     and amax not in (u.args[0], *u.args[2:], *u.kwargs.values())
                                     for u in amax.users):
            continue
        if not _pointwise_chain(src):
            continue
        m, k = sv.shape
        p = k // _AMAX_CHUNK
        with graph.inserting_before(amax):
            rows, n = m, m * p
            if not isinstance(m, int):  # a dynamic row count: graph values
                rows = graph.call_function(_aten.sym_size.int, (src, 0))
                rows.meta["val"] = m
                n = graph.call_function(operator.mul, (rows, p))
                n.meta["val"] = m * p
            # [M, K / C, C] reduced over its last dim, then flattened: a view of [M, K] as [M * K / C, C]
            # would index it modulo M * K, which Inductor cannot lower for a graph compiled at M = 0
            parts = graph.call_function(_aten.view.default, (src, [rows, p, _AMAX_CHUNK]))
            _set_meta(parts)
            red = graph.call_function(_aten.amax.default, (parts, [2]))
            _set_meta(red)
            new = graph.call_function(_aten.view.default, (red, [n]))
            _set_meta(new)
        amax.replace_all_uses_with(new)
        graph.erase_node(amax)
        count += 1
    return count


# ----------------------------------------------------------------------------
# 5. fp8_linear / fp8_block_linear(pointwise(...))  ==>  the quantization in aten ops, then the GEMM
# ----------------------------------------------------------------------------


def _made_by_pointwise(node: Any) -> bool:
    """True when ``node`` is the output of a pointwise op, through views:
    Inductor computes it in a kernel of its own, which can take the
    quantization in."""
    def call(n: Any) -> bool:
        return isinstance(n, fx.Node) and n.op == "call_function"

    while call(node) and getattr(node.target, "is_view", False) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return call(node) and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    _set_meta(node)
    return node


def _token_quant(graph: fx.Graph, x: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``quant_fp8(x, None, per_token=True)`` as aten ops (``reference_quant``'s
    arithmetic).  The two divisions are done in float64 and rounded once to
    float32: Inductor may lower a float32 division to an approximate one
    (Triton's ``div.full``; a constant divisor becomes a multiply by its
    reciprocal), while the float64 quotient of these operands is never an
    exact float32 tie, so it rounds to the IEEE float32 quotient."""
    f32, f64 = torch.float32, torch.float64
    xf = _call(graph, _prims.convert_element_type.default, x, f32)
    amax = _call(graph, _aten.amax.default, _call(graph, _aten.abs.default, xf), [1], True)
    floor = _call(graph, _aten.clamp_min.default, amax, AMAX_FLOOR)
    s64 = _call(graph, _aten.div.Tensor, _call(graph, _prims.convert_element_type.default, floor, f64), FP8_MAX)
    s = _call(graph, _prims.convert_element_type.default, s64, f32)
    inv = _call(graph, _prims.convert_element_type.default,
                _call(graph, _aten.reciprocal.default, _call(graph, _prims.convert_element_type.default, s, f64)),
                f32)
    y = _call(graph, _aten.clamp_max.default,
              _call(graph, _aten.clamp_min.default, _call(graph, _aten.mul.Tensor, xf, inv), -FP8_MAX), FP8_MAX)
    return _call(graph, _prims.convert_element_type.default, y, FP8_DTYPE), s


def quantize_fp8_in_producer(graph: fx.Graph) -> int:
    """Rewrite 5 for ``fp8_linear`` (module docstring)."""
    count = 0
    done: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
    for node in list(graph.nodes):
        if not _is(node, _ops.fp8_linear.default):
            continue
        x = node.args[0] if node.args else node.kwargs["x"]
        if _arg(node, 3, "scale_x", None) is not None or not _arg(node, 4, "per_token", False):
            continue
        xv = _val(x)
        if (not isinstance(xv, torch.Tensor) or xv.dim() != 2 or xv.dtype not in (torch.bfloat16, torch.float16)
                or not isinstance(xv.shape[1], int) or xv.shape[1] == 0 or not _made_by_pointwise(x)):
            continue
        b, scale_b = node.args[1], node.args[2]
        with graph.inserting_before(node):
            if x not in done:
                done[x] = _token_quant(graph, x)
            q, s = done[x]
            mm = graph.call_function(_ops.fp8_scaled_mm.default, (q, b, s, scale_b, _arg(node, 5, "bias", None),
                                                                  _arg(node, 6, "out_dtype", torch.bfloat16)))
            _set_meta(mm)
        node.replace_all_uses_with(mm)
        graph.erase_node(node)
        count += 1
    return count


def _division_rounding_key() -> str | None:
    """The Inductor option that makes its float32 divisions IEEE ones
    (``div_rn`` in Triton) in this torch, or None."""
    from torch._inductor import config

    if hasattr(getattr(config, "eager_numerics", None), "division_rounding"):
        return "eager_numerics.division_rounding"
    return "emulate_divison_rounding" if hasattr(config, "emulate_divison_rounding") else None


def _division_rounding() -> bool:
    from torch._inductor import config

    key = _division_rounding_key()
    if key is None:
        return False
    for part in key.split("."):
        config = getattr(config, part)
    return bool(config)


def _group_quant(graph: fx.Graph, x: fx.Node, group: int) -> tuple[fx.Node, fx.Node]:
    """``per_token_group_quant_fp8(x, group, 1e-10, column_major_scales=True)``
    as aten ops (``reference_quant``'s arithmetic; ``x / s`` needs IEEE
    float32 divisions, the scale's constant divisor is taken in float64 as in
    :func:`_token_quant`)."""
    f32, f64 = torch.float32, torch.float64
    m, k = _val(x).shape
    rows = m
    if not isinstance(m, int):  # a dynamic row count: a graph value
        rows = graph.call_function(_aten.sym_size.int, (x, 0))
        rows.meta["val"] = m
    xg = _call(graph, _aten.view.default, _call(graph, _prims.convert_element_type.default, x, f32),
               [rows, k // group, group])
    amax = _call(graph, _aten.amax.default, _call(graph, _aten.abs.default, xg), [2], True)
    floor = _call(graph, _aten.clamp_min.default, amax, 1e-10)  # fp8_block_linear's eps
    s64 = _call(graph, _aten.div.Tensor, _call(graph, _prims.convert_element_type.default, floor, f64), FP8_MAX)
    s = _call(graph, _prims.convert_element_type.default, s64, f32)
    y = _call(graph, _aten.clamp_max.default,
              _call(graph, _aten.clamp_min.default, _call(graph, _aten.div.Tensor, xg, s), -FP8_MAX), FP8_MAX)
    q = _call(graph, _aten.view.default, _call(graph, _prims.convert_element_type.default, y, FP8_DTYPE), [rows, k])
    # column-major [M, K / group], the layout the composite passes (cuBLAS and CUTLASS read it)
    st = _call(graph, _aten.permute.default, _call(graph, _aten.view.default, s, [rows, k // group]), [1, 0])
    s_col = _call(graph, _aten.permute.default, _call(graph, _aten.clone.default, st), [1, 0])
    return q, s_col


def quantize_fp8_block_in_producer(graph: fx.Graph) -> int:
    """Rewrite 5 for ``fp8_block_linear`` (module docstring); only where
    Inductor's float32 divisions are IEEE ones (``x / s`` per element)."""
    if not _division_rounding():
        return 0
    count = 0
    done: dict[tuple[fx.Node, int], tuple[fx.Node, fx.Node]] = {}
    for node in list(graph.nodes):
        if not _is(node, _ops.fp8_block_linear.default):
            continue
        x, b, b_scales = node.args[:3]
        block = list(_arg(node, 3, "block_size", [128, 128]))
        out_dtype = _arg(node, 4, "out_dtype", torch.bfloat16)
        bias = _arg(node, 5, "bias", None)
        xv = _val(x)
        if (len(block) != 2 or not isinstance(xv, torch.Tensor) or xv.dim() != 2
                or xv.dtype not in (torch.bfloat16, torch.float16) or not isinstance(xv.shape[1], int)
                or xv.shape[1] == 0 or xv.shape[1] % block[1] or not _made_by_pointwise(x)):
            continue
        with graph.inserting_before(node):
            if (x, block[1]) not in done:
                done[(x, block[1])] = _group_quant(graph, x, block[1])
            q, s = done[(x, block[1])]
            mm_dtype = out_dtype if bias is None else torch.float32
            out = _call(graph, _ops.dynamic_padded_fp8_block_mm.default, q, b, s, b_scales, block, mm_dtype)
            if bias is not None:  # as the composite: + bias in float32, one rounding
                out = _call(graph, _prims.convert_element_type.default,
                            _call(graph, _aten.add.Tensor, out,
                                  _call(graph, _prims.convert_element_type.default, bias, torch.float32)),
                            out_dtype)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    return count


# ----------------------------------------------------------------------------
# the pass
# ----------------------------------------------------------------------------


class ScaledMMPass(CustomGraphPass):
    """The scaledmm post-grad pass (see the module docstring).

    ``stats`` counts the rewrites done by the last call, per kind.
    ``chunk_amax=False`` leaves rewrite 4 out (the same bits, another kernel
    split); ``fp8_quant=True`` / ``fp8_block_quant=True`` turn rewrite 5 on
    for per-token / per-group FP8 activations.  Every switch is part of
    :meth:`uuid`.

    Examples
    --------
    >>> import torch, scaledmm
    >>> p = scaledmm.compile.ScaledMMPass(chunk_amax=False)
    >>> p.uuid() != scaledmm.compile.ScaledMMPass().uuid()
    True
    >>> q = scaledmm.compile.ScaledMMPass(fp8_quant=True, fp8_block_quant=True)
    >>> f = torch.compile(lambda x: x + 1, options={"post_grad_custom_post_pass": q, **scaledmm.compile.numerics()})
    """

    def __init__(self, chunk_amax: bool = True, fp8_quant: bool = False, fp8_block_quant: bool = False) -> None:
        self.chunk_amax = bool(chunk_amax)
        self.fp8_quant = bool(fp8_quant)
        self.fp8_block_quant = bool(fp8_block_quant)
        self.stats: dict[str, int] = {}

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        self.stats = {
            "size_conds": lower_size_conds(gm) if gm is not None else 0,
            "quant_gemm": fuse_quant_into_gemm(graph) + fuse_quant_into_scaled_mm(graph),
            "nvfp4_epilogue": fold_nvfp4_epilogue(graph),
            "nvfp4_amax": chunk_nvfp4_amax(graph) if self.chunk_amax else 0,
            "fp8_quant": quantize_fp8_in_producer(graph) if self.fp8_quant else 0,
            "fp8_block_quant": quantize_fp8_block_in_producer(graph) if self.fp8_block_quant else 0,
        }
        graph.lint()

    def uuid(self) -> Any:
        return (get_hash_for_files((__file__,)) + (b"" if self.chunk_amax else b"/no-amax-chunks")
                + (b"/fp8-quant" if self.fp8_quant else b"") + (b"/fp8-block-quant" if self.fp8_block_quant else b""))


def passes(fuse_quant: bool = False) -> ScaledMMPass:
    """The scaledmm Inductor pass, for ``options={"post_grad_custom_post_pass": ...}``.
    ``fuse_quant`` turns rewrite 5 on (FP8 activations quantized in their
    producer's kernel; the fp8_block form also needs :func:`numerics`).

    Examples
    --------
    >>> import torch, scaledmm
    >>> p = scaledmm.compile.passes()
    >>> p.uuid() == scaledmm.compile.passes().uuid()
    True
    >>> f = torch.compile(lambda x: x + 1, options={"post_grad_custom_post_pass": p})
    """
    return ScaledMMPass(fp8_quant=fuse_quant, fp8_block_quant=fuse_quant)


def options(pdl: bool = True, fuse_quant: bool = False) -> dict[str, Any]:
    """``torch.compile`` options for models that use scaledmm ops: the pass
    (:func:`passes`) and, with ``pdl`` (the default), Inductor's programmatic
    dependent launch (``triton.enable_pdl``; ignored below sm90), so that
    Inductor's kernels and ours overlap their launches.  ``fuse_quant``
    turns rewrite 5 on, with IEEE float32 divisions in Inductor's kernels
    (:func:`numerics`: eager's rounding everywhere in the graph).

    On the H200's Llama-3-8B layer (``benchmarks model``, every format and
    bf16 compiled alike, one run each way) it saves 2-5 us a layer at M = 1
    and 8 in every format (FP8 per-channel 82.5 -> 77.7 us at M = 1, NVFP4
    W4A16 68.3 -> 63.5) and changes M = 64 by -4..+1 us; at M = 512 and
    4096 it moves the layer by -5%..+7% by format (fp8_block loses 4% at
    M = 512 and 6% at 4096, with wide spreads there; benchmarks/RESULTS.md,
    "Inductor's PDL by default").  Pass
    ``pdl=False`` for a graph that only ever runs large batches.

    Examples
    --------
    >>> import torch, scaledmm
    >>> sorted(scaledmm.compile.options())
    ['post_grad_custom_post_pass', 'triton.enable_pdl']
    >>> sorted(scaledmm.compile.options(pdl=False, fuse_quant=True))  # torch 2.13
    ['eager_numerics.division_rounding', 'post_grad_custom_post_pass']
    >>> f = torch.compile(lambda x: x + 1, options=scaledmm.compile.options())
    """
    opts: dict[str, Any] = {"post_grad_custom_post_pass": passes(fuse_quant), **(numerics() if fuse_quant else {})}
    if pdl:
        opts["triton.enable_pdl"] = True
    return opts


def numerics() -> dict[str, Any]:
    """The Inductor option, where this torch has one, that rounds its float32
    divisions as IEEE ones (``eager_numerics.division_rounding``; torch 2.10:
    ``emulate_divison_rounding``): rewrite 5 quantizes fp8_block activations
    (``x / s``) in Inductor's kernels only with it.  Part of
    ``options(fuse_quant=True)``.

    Examples
    --------
    >>> import scaledmm
    >>> list(scaledmm.compile.numerics().values()) in ([], [True])
    True
    """
    key = _division_rounding_key()
    return {key: True} if key else {}
