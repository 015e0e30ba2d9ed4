"""``python -m scaledmm.demo``: compile a small DeepSeek-style block built from
scaledmm layers and say what happened.

The block has the four layer kinds: the fused-A skinny projection
(``SkinnyLinear``), an FP8 block-scaled projection (``Fp8BlockLinear``), an FP8
per-channel output projection with N not a multiple of 16 (``Fp8Linear``,
padded once at load), and an NVFP4 MLP (``NvFp4Linear``).  It is compiled with
``torch.compile(fullgraph=True, dynamic=True)`` and run at several batch sizes;
the demo prints the number of compiles, the scaledmm ops and conds in the
compiled graph, the backend each op ran on, and the error against the float
model.  Runs on CPU (reference backends) or on a GPU.

Examples
--------
$ python -m scaledmm.demo --device cpu --batch 1,3,8,17
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F
from torch import nn

import scaledmm
from scaledmm import backends
from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear, SkinnyLinear


class Block(nn.Module):
    """hidden -> fused q/kv-a (skinny) -> q_b (fp8 block) -> o_proj (fp8) ->
    residual -> NVFP4 gated MLP -> residual."""

    def __init__(self, hidden=1024, q_lora=384, kv_lora=192, inter=1536, o_out=1000, dtype=torch.bfloat16):
        super().__init__()
        self.q_lora = q_lora
        self.fused_a = nn.Linear(hidden, q_lora + kv_lora, bias=False, dtype=dtype)
        self.q_b = nn.Linear(q_lora, hidden, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(hidden, o_out, bias=True, dtype=dtype)  # N = 1000: padded at load
        self.o_fix = nn.Linear(o_out, hidden, bias=False, dtype=dtype)  # K = 1000: activation padded
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False, dtype=dtype)
        self.down = nn.Linear(inter, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        a = self.fused_a(x)
        q = self.q_b(F.rms_norm(a[:, : self.q_lora], (self.q_lora,)))
        h = x + self.o_fix(self.o_proj(q))
        g, u = self.gate_up(F.rms_norm(h, (h.shape[-1],))).chunk(2, dim=-1)
        return h + self.down(F.silu(g) * u)


def quantize_block(float_block: Block) -> Block:
    """The same block with every linear replaced by its scaledmm layer."""
    import copy

    q = copy.deepcopy(float_block)
    q.fused_a = SkinnyLinear.from_float(float_block.fused_a)
    q.q_b = Fp8BlockLinear.from_float(float_block.q_b)
    q.o_proj = Fp8Linear.from_float(float_block.o_proj)
    q.o_fix = Fp8Linear.from_float(float_block.o_fix)
    q.gate_up = NvFp4Linear.from_float(float_block.gate_up)
    q.down = NvFp4Linear.from_float(float_block.down)
    return q


def _graph_ops(gm: torch.fx.GraphModule, out: collections.Counter) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name.startswith("scaledmm.") or "cond" in name:
            out[name.split(".default")[0]] += 1
    for sub in gm.children():
        if isinstance(sub, torch.fx.GraphModule):
            _graph_ops(sub, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", default="1,3,8,17,64", help="comma-separated batch sizes (M)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--no-pass", action="store_true", help="compile without scaledmm.compile.passes()")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",")]
    torch.manual_seed(0)

    ref_model = Block().to(dev)
    model = quantize_block(ref_model).to(dev)
    graphs: list[torch.fx.GraphModule] = []

    scaledmm_pass = None if args.no_pass else scaledmm.compile.passes()

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        if args.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            options = {"post_grad_custom_post_pass": scaledmm_pass} if scaledmm_pass else {}
            with torch._inductor.config.patch(options):
                return compile_fx(gm, example_inputs)
        return torch._dynamo.lookup_backend(args.backend)(gm, example_inputs)

    compiled = torch.compile(model, backend=recording_backend, fullgraph=True, dynamic=True)
    print(f"scaledmm {scaledmm.__version__} | torch {torch.__version__} | device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    print(model)
    chosen = collections.Counter()
    rows = []
    # Dynamo specializes M = 0/1 by default; this torch knob keeps one graph for all M.
    with torch.fx.experimental._config.patch(backed_size_oblivious=True), backends.record() as calls:
        for m in batches:
            x = torch.randn(m, 1024, dtype=torch.bfloat16, device=dev)
            t0 = time.perf_counter()
            with torch.no_grad():
                y = compiled(x)
                ref = ref_model(x)
            dt = time.perf_counter() - t0
            err = (y.float() - ref.float()).abs().max().item() if m else 0.0
            rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item() if m else 0.0
            rows.append((m, tuple(y.shape), err, rel, dt))
        for op, name, _ in calls:
            chosen[(op, name)] += 1

    print(f"\ncompiles: {len(graphs)} graph(s) for batch sizes {batches}")
    ops = collections.Counter()
    for g in graphs:
        _graph_ops(g, ops)
    print("ops in the compiled graph (count):")
    for name, c in sorted(ops.items()):
        print(f"  {name:<45} {c}")
    if scaledmm_pass is not None and args.backend == "inductor":
        print(f"scaledmm.compile.passes() rewrites: {scaledmm_pass.stats} "
              "(size conds -> dynamic ops keep CUDA graphs; quant+GEMM -> fused op)")
    print("backends chosen at run time (op -> backend: calls):")
    for (op, name), c in sorted(chosen.items()):
        print(f"  {op:<30} -> {name:<12} {c}")
    print("\n   M  out shape      max|err|   rel err   wall s (incl. compile)")
    for m, shape, err, rel, dt in rows:
        print(f"{m:>4}  {str(shape):<13} {err:>9.4f}  {rel:>8.4f}   {dt:8.3f}")
    worst = max(r[3] for r in rows)
    ok = worst < 0.15  # fp8 + nvfp4 quantization of a 6-linear block
    print(f"\nmax relative error vs the float model: {worst:.4f} ({'OK' if ok else 'TOO LARGE'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
