"""``python -m benchmarks model``: whole decoder layers and HF ``generate``,
bf16 against every ``scaledmm.quantize_`` format, in the same run.

* **Layers** (this module; ``RESULTS.md`` section ``model-<name>`` per model):
  a decoder layer's projections and elementwise glue, built from a Hugging
  Face config (:class:`DecoderProjections`).  Each format is
  ``scaledmm.quantize_``'d from the same bf16 weights, compiled
  (``torch.compile`` fullgraph, M dynamic, Inductor with
  ``scaledmm.compile.passes()``), checked against a float64 run of the
  unquantized layer, then captured in a CUDA graph and replayed by
  ``timing.measure``: one pass over enough copies of the layer to exceed twice
  the L2, so the weights come from HBM as in a real model.  Inductor's own
  CUDA graphs stay off here: the capture is ours.
* **Generate** (``model_generate.py``; section ``model-generate``): decode
  tokens/s of a full-size Llama-3-8B-shaped random model.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .harness import BASELINE, OURS, Result, rel_err
from .shapes import CPU_M, MODEL_M, Shape, parse_ms
from .timing import TimingConfig, copies_for, measure, synchronize

__all__ = ["FORMATS", "BASE", "MODELS", "DecoderProjections", "ModelShape", "add_arguments", "available",
           "parse_formats", "parse_models", "parse_batches", "projection_shapes", "quantize", "run_layers",
           "layer_markdown", "run_family"]

BASE = "bf16"
FORMATS = ("fp8_block", "fp8", "fp8_tensor", "nvfp4", "nvfp4_w4a16")
OP = "decoder_layer"
QUICK_MODEL_M = (1, 64, 4096)
CPU_MODEL_M = CPU_M[:2]
# Largest accepted relative L2 error of the layer's update (output - input) against
# float64: bf16 rounding; e4m3 (3 mantissa bits) through up to 4 chained GEMMs; e2m1.
TOL = {BASE: 0.03, "fp8_block": 0.2, "fp8": 0.2, "fp8_tensor": 0.2, "nvfp4": 0.5, "nvfp4_w4a16": 0.5}
SEED = 0


# ----------------------------------------------------------------------------
# Configs and the layer module
# ----------------------------------------------------------------------------


def llama_config(**over):
    """Llama-3-8B as a ``transformers.LlamaConfig`` (``over`` replaces fields).

    Examples
    --------
    >>> llama_config(num_hidden_layers=2).num_key_value_heads
    8
    """
    from transformers import LlamaConfig

    kw = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
              rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False)
    kw.update(over)
    return LlamaConfig(**kw)


def dsv3_config(**over):
    """DeepSeek-V3 (its dense layers' MLP width) as a ``transformers.DeepseekV3Config``.

    Examples
    --------
    >>> dsv3_config().kv_lora_rank
    512
    """
    from transformers import DeepseekV3Config

    kw = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=128, q_lora_rank=1536,
              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6)
    kw.update(over)
    return DeepseekV3Config(**kw)


_TINY_LLAMA = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
_TINY_DSV3 = dict(hidden_size=256, intermediate_size=384, num_attention_heads=2, q_lora_rank=128,
                  kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64)

# name -> (description, config builder, usable for generate).  The full-size names
# are also GEMM shape sets (shapes.py) listing the layer's projections.
MODELS: dict[str, tuple[str, Callable, bool]] = {
    "llama8b": ("Llama-3-8B", llama_config, True),
    "dsv3_dense": ("DeepSeek-V3 dense layer", dsv3_config, False),
    "tiny_llama": ("tiny Llama", functools.partial(llama_config, **_TINY_LLAMA), True),
    "tiny_dsv3": ("tiny DeepSeek-V3", functools.partial(dsv3_config, **_TINY_DSV3), False),
}


class RMSNorm(nn.Module):
    """RMSNorm computed in at least float32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(xf.dtype) * xf).to(x.dtype)


class DecoderProjections(nn.Module):
    """A decoder layer's projections and elementwise glue, from an HF config.

    Llama-style configs (GQA): ``qkv_proj`` (fused), ``o_proj``; configs with
    ``kv_lora_rank`` (DeepSeek MLA): ``fused_qkv_a_proj`` (q_a and kv_a with
    the rope part), ``q_a_layernorm``, ``q_b_proj`` (or ``q_proj`` without
    ``q_lora_rank``), ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``.  Both:
    ``gate_up_proj`` (fused) and ``down_proj``.  Attention itself is replaced by
    ``q * v`` in head layout (v broadcast over each query group): it consumes
    every projection's output, costs one elementwise pass and keeps the
    projections' shapes exact; the attention kernel is a separate benchmark.
    Weights are ``N(0, 1/K)``, so activations stay of order one.

    Examples
    --------
    >>> layer = DecoderProjections(MODELS["tiny_llama"][1](), dtype=torch.float32)
    >>> [tuple(m.weight.shape) for m in layer.linears()]
    [(512, 256), (256, 256), (768, 256), (256, 384)]
    >>> layer(torch.randn(3, 256)).shape
    torch.Size([3, 256])
    """

    def __init__(self, config, *, device=None, dtype=torch.bfloat16):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.mla = getattr(config, "kv_lora_rank", None) is not None
        self.input_layernorm = RMSNorm(hidden, eps, **kw)
        if self.mla:
            self.q_lora = config.q_lora_rank
            self.kv_lora, self.rope = config.kv_lora_rank, config.qk_rope_head_dim
            self.nope, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
            q_out = self.heads * (self.nope + self.rope)
            self.fused_qkv_a_proj = nn.Linear(hidden, (self.q_lora or 0) + self.kv_lora + self.rope, bias=False, **kw)
            if self.q_lora:
                self.q_a_layernorm = RMSNorm(self.q_lora, eps, **kw)
                self.q_b_proj = nn.Linear(self.q_lora, q_out, bias=False, **kw)
            else:
                self.q_proj = nn.Linear(hidden, q_out, bias=False, **kw)
            self.kv_a_layernorm = RMSNorm(self.kv_lora, eps, **kw)
            self.kv_b_proj = nn.Linear(self.kv_lora, self.heads * (self.nope + self.v_dim), bias=False, **kw)
            o_in = self.heads * self.v_dim
        else:
            self.kv_heads = config.num_key_value_heads or self.heads
            self.head_dim = getattr(config, "head_dim", None) or hidden // self.heads
            self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
            self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=False, **kw)
            o_in = self.q_size
        self.o_proj = nn.Linear(o_in, hidden, bias=False, **kw)
        self.post_attention_layernorm = RMSNorm(hidden, eps, **kw)
        self.gate_up_proj = nn.Linear(hidden, 2 * config.intermediate_size, bias=False, **kw)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False, **kw)
        with torch.no_grad():
            for lin in self.linears():
                lin.weight.normal_(0.0, lin.in_features ** -0.5)
        self.requires_grad_(False)

    def linears(self) -> list[nn.Linear]:
        """The projections in data-flow order (before quantization)."""
        return [m for m in self.modules() if isinstance(m, nn.Linear)]

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        if not self.mla:
            q, _, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.unflatten(-1, (self.kv_heads, self.heads // self.kv_heads, self.head_dim))
            return (q * v.unflatten(-1, (self.kv_heads, 1, self.head_dim))).flatten(-3)
        a = self.fused_qkv_a_proj(h)
        if self.q_lora:
            q_a, kv_c, _ = a.split([self.q_lora, self.kv_lora, self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            kv_c, _ = a.split([self.kv_lora, self.rope], dim=-1)
            q = self.q_proj(h)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c))
        v = kv.unflatten(-1, (self.heads, self.nope + self.v_dim))[..., self.nope:]
        q = q.unflatten(-1, (self.heads, self.nope + self.rope))[..., :self.v_dim]
        return (q * v).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o_proj(self._attention(x))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


@dataclasses.dataclass(frozen=True, order=True)
class ModelShape(Shape):
    """A layer workload in the ``Result`` records: hidden x hidden, labelled by the model name."""

    name: str = ""

    @property
    def label(self) -> str:
        return self.name


# ----------------------------------------------------------------------------
# Arguments and plumbing
# ----------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The model family's options (an argument group of the CLI)."""
    g = parser.add_argument_group("model family (python -m benchmarks model)")
    g.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: llama8b,dsv3_dense; "
                                    "on the CPU the tiny ones)")
    g.add_argument("--formats", help=f"comma list of quantize_ formats (default: {','.join(FORMATS)}); "
                                     "bf16 is always measured in the same run")
    g.add_argument("--generate", action=argparse.BooleanOptionalAction, default=None,
                   help="also time HF generate (default: on for a full GPU run, off with --quick or on the CPU)")
    g.add_argument("--generate-only", action="store_true", help="time generate only, no layers")
    g.add_argument("--gen-model", default="llama8b", choices=[n for n, v in MODELS.items() if v[2]],
                   help="model for generate (default llama8b: 32 layers, vocab 128256)")
    g.add_argument("--gen-batch", default="1", help="comma list of generate batch sizes (default 1)")
    g.add_argument("--gen-prompt", type=int, default=128, help="prompt tokens (default 128)")
    g.add_argument("--gen-tokens", type=int, default=128, help="new tokens per generate (default 128)")
    g.add_argument("--gen-reps", type=int, default=None, help="timed generate pairs per format (default 5, --quick 3)")
    g.add_argument("--compile", choices=("inductor", "aot_eager", "off"), default=None,
                   help="how layers and the decode step are compiled (default: inductor on a GPU, off on the CPU)")
    g.add_argument("--inductor-pdl", action=argparse.BooleanOptionalAction, default=True,
                   help="Inductor's own kernels with programmatic dependent launch (triton.enable_pdl, as "
                        "scaledmm.compile.options() sets it), for every format and bf16 alike (default on; "
                        "--no-inductor-pdl: off)")
    g.add_argument("--fuse-quant", action="store_true",
                   help="the layers' FP8 activations quantized in the kernel that makes them (scaledmm.compile."
                        "options(fuse_quant=True): the pass's rewrite 5 and IEEE divisions in Inductor's kernels; "
                        "not generate)")


def _parse_list(spec: str, valid: Sequence[str], option: str) -> list[str]:
    out: list[str] = []
    for raw in spec.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        if item not in valid:
            raise ValueError(f"{option}: expected names from {', '.join(valid)}, got {raw.strip()!r}")
        if item not in out:
            out.append(item)
    if not out:
        raise ValueError(f"{option}: expected at least one name, got {spec!r}")
    return out


def parse_formats(spec: str | None) -> list[str]:
    """Formats to compare with bf16 (``bf16`` itself is dropped: always measured).

    Examples
    --------
    >>> parse_formats("nvfp4,bf16,fp8")
    ['nvfp4', 'fp8']
    """
    if spec is None:
        return list(FORMATS)
    return [f for f in _parse_list(spec, (BASE, *FORMATS), "--formats") if f != BASE]


def parse_models(spec: str | None, device: torch.device) -> list[str]:
    """Model names (default: the full-size pair on a GPU, the tiny pair on the CPU).

    Examples
    --------
    >>> parse_models("dsv3_dense", torch.device("cpu"))
    ['dsv3_dense']
    """
    if spec is None:
        return ["llama8b", "dsv3_dense"] if device.type == "cuda" else ["tiny_llama", "tiny_dsv3"]
    return _parse_list(spec, tuple(MODELS), "--models")


def parse_batches(spec: str) -> list[int]:
    """Generate batch sizes from a comma list of positive ints.

    Examples
    --------
    >>> parse_batches("1,8")
    [1, 8]
    """
    out = []
    for raw in spec.split(","):
        item = raw.strip()
        if item and (not item.isdigit() or int(item) < 1):
            raise ValueError(f"--gen-batch: expected positive integers, got {item!r}")
        if item and int(item) not in out:
            out.append(int(item))
    if not out:
        raise ValueError(f"--gen-batch: expected at least one batch size, got {spec!r}")
    return out


def available() -> tuple[bool, str]:
    """Whether ``scaledmm.quantize_`` and ``transformers`` are importable."""
    import scaledmm

    if not callable(getattr(scaledmm, "quantize_", None)):
        return False, "scaledmm.quantize_ is not defined (the model-level API is not in this checkout)"
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return False, f"transformers is not importable ({e})"
    return True, ""


def quantize(module: nn.Module, fmt: str) -> nn.Module:
    """``scaledmm.quantize_(module, fmt)``, with a clear error where it is missing."""
    import scaledmm

    fn = getattr(scaledmm, "quantize_", None)
    if fn is None:
        raise RuntimeError("benchmarks.model needs scaledmm.quantize_(model, fmt) (SPEC.md, 'Model level'); "
                           "this checkout does not define it")
    return fn(module, fmt)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def module_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _unit(fmt: str) -> str:
    return "fp8" if fmt.startswith("fp8") else "bf16"


def backend_names(log) -> str:
    return "+".join(dict.fromkeys(f"{op}:{name}" for op, name, _ in log))


@contextlib.contextmanager
def _dynamo_limits(entries: int):
    """Room for one compiled graph per M: hitting the recompile limit would
    silently fall back to eager and time the wrong thing."""
    import torch._dynamo

    cfg = torch._dynamo.config
    patch = {}
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            patch[name] = max(getattr(cfg, name), entries)
            break
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    with cfg.patch(patch):
        yield


def compiler(mode: str, fuse_quant: bool = False) -> Callable[[nn.Module], Callable]:
    """``mode`` -> a function compiling a module (fullgraph; M dynamic via the
    inputs); ``fuse_quant``: the pass's rewrite 5 (``scaledmm.compile.passes(fuse_quant=True)``)."""
    if mode == "off":
        return lambda m: m
    if mode == "inductor":
        import scaledmm.compile

        kw = dict(backend="inductor",
                  options={"post_grad_custom_post_pass": scaledmm.compile.passes(fuse_quant)})
    else:
        kw = dict(backend=mode)
    # M is marked dynamic on the inputs (see run_layers): one graph per format
    # serves every M > 1, as a serving engine compiles it; M = 1 gets its own.
    return lambda m: torch.compile(m, fullgraph=True, dynamic=None, **kw)


def release(device: torch.device) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------


def projection_shapes(name: str) -> list[tuple[int, int]]:
    """``(N, K)`` of the layer's projections for model ``name`` (built on ``meta``).

    Examples
    --------
    >>> projection_shapes("llama8b")
    [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    """
    layer = DecoderProjections(MODELS[name][1](), device="meta")
    return [(lin.out_features, lin.in_features) for lin in layer.linears()]


def _layer_base(name: str, device: torch.device) -> DecoderProjections:
    torch.manual_seed(SEED)
    return DecoderProjections(MODELS[name][1](), device=device)


def run_layers(names: Sequence[str], formats: Sequence[str], ms: Sequence[int], device: torch.device,
               cfg: TimingConfig, compile_mode: str, log=sys.stderr,
               fuse_quant: bool = False) -> tuple[list[Result], dict]:
    """Check and time every (model, format, M) layer point.

    Returns the results (``provider`` = format, bf16 as the baseline) and
    ``{(model, format): weight bytes}``.
    """
    results: list[Result] = []
    weights: dict[tuple[str, str], int] = {}
    compile_fn = compiler(compile_mode, fuse_quant)
    with torch.no_grad(), _dynamo_limits(len(ms) + 4):
        for name in names:
            base = _layer_base(name, device)
            hidden = base.o_proj.out_features
            shape = ModelShape(hidden, hidden, name)
            flops = 2.0 * sum(lin.in_features * lin.out_features for lin in base.linears())
            x_bytes = {m: m * hidden * 2 for m in ms}
            gen = torch.Generator(device).manual_seed(SEED + 1)
            inputs: dict[int, list[torch.Tensor]] = {m: [] for m in ms}

            def xs(m: int, copies: int) -> list[torch.Tensor]:
                while len(inputs[m]) < copies:  # the same inputs for every format
                    x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16, generator=gen)
                    if m > 1:  # a hint: a guard that specializes M recompiles instead of failing
                        torch._dynamo.maybe_mark_dynamic(x, 0)
                    inputs[m].append(x)
                return inputs[m][:copies]

            ref_mod = copy.deepcopy(base).double()
            refs = {m: ref_mod(xs(m, 1)[0].double()) for m in ms}
            del ref_mod
            for fmt in (BASE, *formats):
                release(device)
                kind = BASELINE if fmt == BASE else OURS
                common = dict(family="model", op=OP, shape=shape, provider=fmt, kind=kind, unit=_unit(fmt))
                try:
                    mod = copy.deepcopy(base)
                    if fmt != BASE:
                        quantize(mod, fmt)
                except Exception as e:
                    note = f"quantize_ failed: {first_line(e)}"
                    results += [Result(m=m, status="error", note=note, flops=flops * m, **common) for m in ms]
                    print(f"[model {name} {fmt}] {note}", file=log, flush=True)
                    continue
                wbytes = weights[(name, fmt)] = module_bytes(mod)
                need = max(copies_for(wbytes + x_bytes[m], cfg) for m in ms)
                mods = [mod] + [copy.deepcopy(mod) for _ in range(need - 1)]
                calls = [compile_fn(m) for m in mods]
                for m in ms:
                    copies = copies_for(wbytes + x_bytes[m], cfg)
                    r = _layer_point(calls[:copies], xs(m, copies), refs[m], fmt, device, cfg,
                                     dict(common, m=m, flops=flops * m, copies=copies,
                                          rotation_bytes=copies * (wbytes + x_bytes[m]),
                                          nbytes=wbytes + 2 * x_bytes[m]))
                    results.append(r)
                    cell = f"{r.timing.median_us:.1f}us" if r.timing else f"{r.status} {r.note}"
                    print(f"[model {name} {fmt} M={m}] {cell} err={r.error:.3g}", file=log, flush=True)
                del calls, mods, mod
            del base, inputs, refs
            release(device)
    return results, weights


def _layer_point(calls, xs, ref: torch.Tensor, fmt: str, device: torch.device, cfg: TimingConfig,
                 base: dict) -> Result:
    from scaledmm import backends

    try:
        with backends.record() as log:
            out = calls[0](xs[0])
        synchronize(device)
    except Exception as e:
        return Result(status="error", note=first_line(e), **base)
    base["backend"] = backend_names(log)
    if out.shape != ref.shape:
        return Result(status="wrong", note=f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}", **base)
    x0 = xs[0].double()
    err = rel_err(out.double() - x0, ref - x0) if bool(torch.isfinite(out).all()) else math.nan
    if not err <= TOL[fmt]:
        why = "non-finite output" if math.isnan(err) else f"rel_err of the update {err:.3g} > tol {TOL[fmt]:g}"
        return Result(status="wrong", error=err, note=why, **base)
    del out
    try:
        timing = measure([functools.partial(c, x) for c, x in zip(calls, xs)], device, cfg)
    except Exception as e:
        return Result(status="error", error=err, note=f"timing failed: {first_line(e)}", **base)
    return Result(status="ok", error=err, timing=timing, note=timing.note, **base)


def _cell(r: Result | None, base: Result | None) -> str:
    if r is None:
        return ""
    if r.timing is None:
        return {"wrong": "WRONG", "error": "ERROR"}.get(r.status, r.status)
    t = r.timing
    text = f"{t.median_us:.1f} [{t.p20_us:.1f}-{t.p80_us:.1f}]"
    if r.kind != BASELINE and base is not None and base.timing is not None:
        text += f" **{base.timing.median_us / t.median_us:.2f}x**"
    return text


def layer_markdown(results: Sequence[Result], name: str, weights: dict) -> str:
    """One model's layer table: median µs [p20-p80] per format and M, and the
    ratio bf16 time / format time (above 1: faster than bf16)."""
    rs = [r for r in results if r.shape.label == name]
    if not rs:
        return ""
    fmts = list(dict.fromkeys(r.provider for r in rs))
    ms = sorted({r.m for r in rs})
    idx = {(r.provider, r.m): r for r in rs}
    shapes = ", ".join(f"{n}x{k}" for n, k in projection_shapes(name))
    mode = next((r.timing.mode for r in rs if r.timing), "")
    how = {"graph": "CUDA-graph replay", "events": "CUDA events", "wall": "wall clock, CPU smoke run"}.get(mode, mode)
    out = [f"### {MODELS[name][0]} decoder layer ({name}), projections N x K: {shapes}\n",
           f"Median µs per layer call [p20-p80] ({how}); **ratio** = bf16 time / format time "
           "(above 1: faster than bf16).\n"]
    out.append("| M | " + " | ".join(fmts) + " |")
    out.append("|" + "---|" * (len(fmts) + 1))
    for m in ms:
        out.append(f"| {m} | " + " | ".join(_cell(idx.get((f, m)), idx.get((BASE, m))) for f in fmts) + " |")
    out.append("\n| format | weights MB | rel. error of the update, max over M | backends (largest M) |")
    out.append("|---|---|---|---|")
    for f in fmts:
        errs = [r.error for r in rs if r.provider == f and not math.isnan(r.error)]
        last = next((r for r in reversed(rs) if r.provider == f and r.backend), None)
        wb = weights.get((name, f))
        out.append(f"| {f} | {'' if wb is None else f'{wb / 1e6:.1f}'} | "
                   f"{f'{max(errs):.3g}' if errs else ''} | {last.backend if last else ''} |")
    notes = [f"- {r.provider} M={r.m}: {r.status.upper()}: {r.note}" for r in rs if r.status != "ok" or r.note]
    if notes:
        out += ["\nNot timed or noted:\n", *notes]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# The CLI entry (called by benchmarks/__main__.py)
# ----------------------------------------------------------------------------


def describe(device: torch.device) -> str:
    ok, why = available()
    lines = [f"model: {'usable' if ok else 'SKIPPED: ' + why}",
             f"  models: {', '.join(f'{n} ({v[0]})' for n, v in MODELS.items())}",
             f"  formats: {BASE} (baseline), {', '.join(FORMATS)}"]
    return "\n".join(lines)


def _header(title: str, env: dict, ceil, cfg: TimingConfig, quick: bool, method: str) -> str:
    from .report import header

    lines = [ln for ln in header(title, env, ceil, cfg, quick).splitlines() if not ln.startswith("- method:")]
    return "\n".join(lines).rstrip() + f"\n- method: {method}\n"


def _write(args, out_dir: Path, section: str, body: str) -> None:
    from .report import update_results_file

    print(body, flush=True)
    (out_dir / f"{section}.md").write_text(body)
    if args.write_results:
        update_results_file(Path(args.results_file), section, body)


def run_family(args, device: torch.device, cfg: TimingConfig, env: dict, ceil, out_dir: Path) -> int:
    """Run the parts ``args`` ask for; write markdown, CSV, plots and the
    ``RESULTS.md`` sections (``model-<name>`` per model, ``model-generate``).
    ``--inductor-pdl`` (and ``--fuse-quant``'s division option) holds for the run only."""
    import torch._inductor.config as inductor_config

    import scaledmm.compile

    pdl = args.inductor_pdl and device.type == "cuda"
    # as scaledmm.compile.options(pdl, fuse_quant) sets them, for every format and bf16 alike
    numerics = scaledmm.compile.numerics() if args.fuse_quant else {}
    with inductor_config.patch({"triton.enable_pdl": pdl, **numerics}):
        return _run_family(args, device, cfg, env, ceil, out_dir, pdl)


def _run_family(args, device: torch.device, cfg: TimingConfig, env: dict, ceil, out_dir: Path, pdl: bool) -> int:
    import shutil

    if args.shapes or args.providers:
        raise SystemExit("--shapes/--providers: not used by the model family; use --models/--formats")
    try:
        formats = parse_formats(args.formats)
        names = parse_models(args.models, device)
        batches = parse_batches(args.gen_batch)
    except ValueError as e:
        raise SystemExit(str(e))
    ok, why = available()
    if not ok:
        body = f"## model\n\nFamily notes:\n\n- model: SKIPPED: {why}\n"
        print(f"model: skipped: {why}", file=sys.stderr)
        print(body, flush=True)
        (out_dir / "model.md").write_text(body)
        return 0
    compile_mode = args.compile or ("inductor" if device.type == "cuda" else "off")
    gen_on = args.generate_only or (args.generate if args.generate is not None
                                    else device.type == "cuda" and not args.quick)
    if not args.generate_only:
        ms = (parse_ms(args.m) if args.m else
              list(QUICK_MODEL_M if args.quick else MODEL_M) if device.type == "cuda" else list(CPU_MODEL_M))
        results, weights = run_layers(names, formats, ms, device, cfg, compile_mode, fuse_quant=args.fuse_quant)
        method = ("layers not compiled (--compile off)" if compile_mode == "off" else
                  f"each layer compiled ({compile_mode}, fullgraph, M dynamic"
                  + ((", post-grad pass scaledmm.compile.passes(fuse_quant=True), IEEE divisions" if args.fuse_quant
                      else ", post-grad pass scaledmm.compile.passes()") if compile_mode == "inductor" else "")
                  + (", Inductor PDL (triton.enable_pdl))" if pdl else ")"))
        method += (", checked against a float64 run of the unquantized layer (relative L2 error of "
                   "output - input), then timed: ")
        method += (f"CUDA-graph replay of one pass over enough layer copies to exceed {cfg.rotate_bytes >> 20} MiB "
                   f"(cold L2), CUDA events, median of {cfg.min_reps}-{cfg.max_reps} replays"
                   if device.type == "cuda" else "wall clock (CPU smoke run: not GPU performance)")
        if results:
            from .report import write_csv

            write_csv(out_dir / "model.csv", results, ceil)
            if not args.no_plots:
                from .plots import plot

                print(plot(results, ceil, out_dir)[1], file=sys.stderr)
        for name in names:
            body = _header(f"model: {MODELS[name][0]} decoder layer", env, ceil, cfg, args.quick, method)
            _write(args, out_dir, f"model-{name}", body + "\n" + layer_markdown(results, name, weights))
    if gen_on:
        from .model_generate import gen_markdown, run_generate, write_gen_csv

        reps = args.gen_reps or (3 if args.quick else 5)
        gres = run_generate(formats, device, model_name=args.gen_model, batches=batches, prompt=args.gen_prompt,
                            new_tokens=args.gen_tokens, reps=reps, compile_mode=compile_mode)
        write_gen_csv(out_dir / "model_generate.csv", gres)
        method = ("HF generate, greedy, static cache reused across calls, decode step "
                  + ("not compiled (--compile off)" if compile_mode == "off" else f"compiled ({compile_mode}"
                     + (", fullgraph, CUDA graphs, post-grad pass scaledmm.compile.passes()"
                        + (", Inductor PDL)" if pdl else ")") if compile_mode == "inductor" else ", fullgraph)"))
                  + f"; decode ms/step = (t(prompt + {args.gen_tokens} tokens) - t(prompt + 1 token)) / "
                  f"{args.gen_tokens - 1}, wall clock around synchronized calls, median of {reps} pairs after two "
                  "warm-up generates; GPU ms/step: the same difference of one pair under torch.profiler (CUDA "
                  "activity), summed kernel/memcpy/memset time; a fresh model per format from the same seed")
        body = _header("model: generate", env, ceil, cfg, args.quick, method)
        # A run over some formats gets its own section, so runs split by format keep each other's.
        section = "model-generate" + ("" if set(formats) == set(FORMATS) else "-" + "-".join(formats))
        _write(args, out_dir, section, body + "\n" + gen_markdown(gres))
    if args.write_results:
        shutil.copyfile(args.results_file, out_dir / "RESULTS.md")
    return 0
