"""quantize_ / load_quantized on tiny random Hugging Face models (Llama,
Qwen3, DeepSeek-V3) on CPU: logits against the float model, torch.compile,
generate() with a static cache."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

import scaledmm  # noqa: E402
from scaledmm.quantize import FORMATS  # noqa: E402

from checkpoint_helpers import (calibrate, config_for, dequantized_copy, float_model_from,  # noqa: E402
                                quantized_state, tiny_model, write_checkpoint)
from helpers import requires_cuda  # noqa: E402

FAMILIES = ("llama", "qwen3", "deepseek_v3")

# Error bounds for logits, relative Frobenius norm.  Per quantized GEMM the
# RMS relative error of an operand is eps: e4m3 rounds to nearest with 3
# mantissa bits, an error uniform within 2^-4 of the value: 2^-4 / sqrt(3) ~
# 0.036; NVFP4's e2m1 grid times an e4m3 block scale: ~ 0.1 for Gaussian data;
# an unquantized bf16 operand: 2^-8.  Errors of G GEMMs in sequence (4 per
# Llama / Qwen3 layer: q|k|v -> o, gate|up -> down; 5 per DeepSeek-V3 layer:
# q_a -> q_b -> o, kv_a -> kv_b, gate|up -> down) add in quadrature, so logits
# are off by ~ sqrt(G) * eps; the bounds take twice that.  (a) against the
# float model holding the dequantized weights only the activation error
# counts; (b) against the original float model both operands' do.
EPS_ACT = {"fp8_block": 0.036, "fp8": 0.036, "fp8_tensor": 0.036, "nvfp4": 0.1, "nvfp4_w4a16": 2**-8}
EPS_W = {"fp8_block": 0.036, "fp8": 0.036, "fp8_tensor": 0.036, "nvfp4": 0.1, "nvfp4_w4a16": 0.1}
GEMMS_PER_LAYER = {"llama": 4, "qwen3": 4, "deepseek_v3": 5}
CONVENTION_FMT = {"fp8_block": "fp8_block", "compressed_tensors_fp8": "fp8", "modelopt_nvfp4": "nvfp4"}


def bounds(family, fmt, layers):
    g = (GEMMS_PER_LAYER[family] * layers) ** 0.5
    return 2 * g * EPS_ACT[fmt], 2 * g * (EPS_ACT[fmt] ** 2 + EPS_W[fmt] ** 2) ** 0.5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def greedy(tokens):
    """Greedy decoding of exactly ``tokens`` tokens (EOS held back) with a static cache."""
    return dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, cache_implementation="static",
                pad_token_id=0)


def n_linears(model):
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_hf_model_logits(family, fmt):
    fm = tiny_model(family)
    qm = scaledmm.quantize_(copy.deepcopy(fm), fmt)
    report = scaledmm.quantize_report(qm)
    assert report["lm_head"].fmt is None and report["lm_head"].detail == "lm_head (output head)"
    assert len(report.swapped) == n_linears(fm) - 1 and len(report.left) == 1
    if family == "deepseek_v3":  # fused expert tensors are not nn.Linear: they stay float, and say so
        assert any("model.layers.1.mlp.experts (DeepseekV3Experts" in n for n in report.notes), report.notes
    assert qm.dtype == torch.bfloat16
    ids = torch.randint(0, fm.config.vocab_size, (2, 9))
    with torch.no_grad():
        out, ref, deq = qm(ids).logits, fm(ids).logits, dequantized_copy(fm, qm)(ids).logits
    b_deq, b_float = bounds(family, fmt, 2)
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
    assert rel(out, deq) < b_deq, (rel(out, deq), b_deq)
    assert rel(out, ref) < b_float, (rel(out, ref), b_float)


@pytest.mark.parametrize("family, convention, static", [
    ("llama", "compressed_tensors_fp8", False), ("qwen3", "fp8_block", False),
    ("deepseek_v3", "fp8_block", False), ("llama", "modelopt_nvfp4", True), ("qwen3", "compressed_tensors_fp8", True),
    ("deepseek_v3", "modelopt_nvfp4", True), ("deepseek_v3", "compressed_tensors_fp8", False),
])
def test_load_quantized_into_a_meta_built_hf_model(tmp_path, family, convention, static):
    from transformers import AutoConfig, AutoModelForCausalLM

    fm = tiny_model(family)
    ids = torch.randint(0, fm.config.vocab_size, (2, 9))
    opts = {"strategy": "tensor", "static": True} if static and convention != "modelopt_nvfp4" else {}
    state = quantized_state(fm, convention, input_amax=calibrate(fm, ids), **opts)
    if family == "deepseek_v3":  # experts published per expert, as DeepSeek-V3 does
        assert "model.layers.1.mlp.experts.1.down_proj.weight" in state
    path = write_checkpoint(str(tmp_path / "ckpt"), state, config_for(convention, **opts),
                            extra_config=fm.config.to_dict())
    with torch.device("meta"):  # parameters and buffers on meta, config from the checkpoint
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16).eval()
    scaledmm.load_quantized(model, path)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert torch.equal(model.model.rotary_emb.inv_freq, fm.model.rotary_emb.inv_freq)  # recomputed
    report = scaledmm.quantize_report(model)
    assert len(report.swapped) == n_linears(fm) - 1 and report["lm_head"].fmt is None
    assert not any("not used" in n for n in report.notes), report.notes
    ref = float_model_from(fm, state)  # the float model the checkpoint encodes
    if family == "deepseek_v3":  # fused float experts, dequantized from the per-expert tensors
        for name in ("gate_up_proj", "down_proj"):
            got, want = (getattr(m.model.layers[1].mlp.experts, name) for m in (model, ref))
            torch.testing.assert_close(got, want, rtol=2**-8, atol=0)
    with torch.no_grad():
        out, want = model(ids).logits, ref(ids).logits
    fmt = CONVENTION_FMT[convention]
    assert rel(out, want) < bounds(family, fmt, 2)[0], rel(out, want)
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), **greedy(3))
    assert gen.shape == (2, 12) and torch.equal(gen[:, :9], ids)


# One format per family for the compiled runs (each costs an Inductor compile).
COMPILED = {"llama": "fp8_block", "qwen3": "nvfp4", "deepseek_v3": "fp8"}


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_generate_costs_no_accuracy(family):
    from transformers import CompileConfig

    fmt = COMPILED[family]
    fm = tiny_model(family, layers=1)
    qm = scaledmm.quantize_(copy.deepcopy(fm), fmt)
    ids = torch.randint(0, fm.config.vocab_size, (2, 5))
    kw = dict(attention_mask=torch.ones_like(ids), **greedy(4), output_logits=True, return_dict_in_generate=True)
    eager = qm.generate(**kw, input_ids=ids, disable_compile=True)
    assert not hasattr(qm, "_compiled_call")
    # Prefill runs eager, every decode step through one Inductor graph of the whole model.
    cc = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    cc._compile_all_devices = True  # transformers compiles on CUDA only unless told
    compiled = qm.generate(**kw, input_ids=ids, compile_config=cc)
    assert hasattr(qm, "_compiled_call")
    b_float = bounds(family, fmt, 1)[1]
    # Inductor computes the bf16 glue in fp32, so compiled and eager differ by more
    # than rounding once quantizers see those inputs: each is held to the float model
    # (teacher-forced on its own tokens) with the same bound.
    for run in (eager, compiled):
        assert run.sequences.shape == (2, 9) and torch.equal(run.sequences[:, :5], ids)
        _teacher_forced_check(fm, run, 5, b_float)


def _teacher_forced_check(fm, run, prompt, bound):
    seq = run.sequences
    with torch.no_grad():
        ref = fm(seq).logits[:, prompt - 1:seq.shape[1] - 1]
    got = torch.stack(run.logits, dim=1)
    assert rel(got, ref) < bound, (rel(got, ref), bound)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_block", "fp8", "nvfp4", "nvfp4_w4a16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_generate_with_transformers_compile(family, fmt):
    fm = tiny_model(family).cuda()
    qm = scaledmm.quantize_(copy.deepcopy(fm), fmt)
    ids = torch.randint(0, fm.config.vocab_size, (2, 5), device="cuda")
    # On CUDA, a static cache makes transformers compile every decode step
    # (its default CompileConfig: reduce-overhead, i.e. CUDA graphs).
    run = qm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy(6), output_logits=True,
                      return_dict_in_generate=True)
    assert hasattr(qm, "_compiled_call")
    _teacher_forced_check(fm, run, 5, bounds(family, fmt, 2)[1])


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_gpu_load_quantized_straight_to_the_device(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    fm = tiny_model(family)
    state = quantized_state(fm, "fp8_block")
    path = write_checkpoint(str(tmp_path / "ckpt"), state, config_for("fp8_block"), extra_config=fm.config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16).eval()
    scaledmm.load_quantized(model, path, device="cuda")
    assert all(t.is_cuda for t in (*model.parameters(), *model.buffers()))
    ref = float_model_from(fm, state).cuda()
    ids = torch.randint(0, fm.config.vocab_size, (2, 5), device="cuda")
    run = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy(6), output_logits=True,
                         return_dict_in_generate=True)
    _teacher_forced_check(ref, run, 5, bounds(family, "fp8_block", 2)[0])
