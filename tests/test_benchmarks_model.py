"""The model family of the benchmark CLI (``python -m benchmarks model``) on the
CPU: the layer module built from HF configs (shapes, glue math), quantize_ on it
for every format, the correctness gate, the CSV / markdown / RESULTS.md
sections, the generate part on a tiny Llama, and the option parsing."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledmm

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import __main__ as cli  # noqa: E402
from benchmarks import model, model_generate, report, shapes  # noqa: E402
from benchmarks.timing import TimingConfig  # noqa: E402
from helpers import requires_cuda  # noqa: E402

SMOKE = ["model", "--device", "cpu", "--quick", "--no-plots"]


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _tiny(name: str, dtype=torch.float64) -> model.DecoderProjections:
    return model.DecoderProjections(model.MODELS[name][1](), dtype=dtype)


# ----------------------------------------------------------------------------
# The layer module
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama8b", "dsv3_dense"])
def test_projections_are_the_issue_shapes(name):
    # Built from the HF config on meta: the projections are exactly the GEMM shape set.
    assert model.projection_shapes(name) == [(s.n, s.k) for s in shapes.SHAPE_SETS[name]]


def test_hf_config_fields_are_read():
    cfg = model.MODELS["llama8b"][1]()
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.num_hidden_layers) == (4096, 14336, 32, 8, 128, 128256, 32)
    # An MLA config without q_lora_rank gets a plain q_proj (DeepSeek-V2-Lite style).
    lite = model.DecoderProjections(model.dsv3_config(q_lora_rank=None, hidden_size=256, intermediate_size=128,
                                                      num_attention_heads=2, kv_lora_rank=128), device="meta")
    assert lite.q_proj.weight.shape == (2 * (128 + 64), 256) and not hasattr(lite, "q_b_proj")
    assert lite.fused_qkv_a_proj.weight.shape == (128 + 64, 256)


def _rms(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _by_hand(layer: model.DecoderProjections, cfg, x: torch.Tensor) -> torch.Tensor:
    """The glue written out from the config, with the layer's weights."""
    eps, heads = cfg.rms_norm_eps, cfg.num_attention_heads
    m = x.shape[0]
    h = _rms(x, eps)
    if layer.mla:
        a = h @ layer.fused_qkv_a_proj.weight.t()
        q_a, kv_c = a[:, :cfg.q_lora_rank], a[:, cfg.q_lora_rank:cfg.q_lora_rank + cfg.kv_lora_rank]
        nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = (_rms(q_a, eps) @ layer.q_b_proj.weight.t()).reshape(m, heads, nope + rope)
        kv = (_rms(kv_c, eps) @ layer.kv_b_proj.weight.t()).reshape(m, heads, nope + vd)
        attn = (q[..., :vd] * kv[..., nope:]).reshape(m, heads * vd)
    else:
        qkv = h @ layer.qkv_proj.weight.t()
        hd, kvh = cfg.head_dim, cfg.num_key_value_heads
        q = qkv[:, :heads * hd].reshape(m, heads, hd)
        v = qkv[:, (heads + kvh) * hd:].reshape(m, kvh, hd).repeat_interleave(heads // kvh, dim=1)
        attn = (q * v).reshape(m, heads * hd)
    x = x + attn @ layer.o_proj.weight.t()
    gate, up = (_rms(x, eps) @ layer.gate_up_proj.weight.t()).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ layer.down_proj.weight.t()


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["tiny_llama", "tiny_dsv3"]), st.sampled_from([0, 1, 3, 17]), st.integers(0, 2**31 - 1))
def test_layer_glue_matches_the_config_written_out(name, m, seed):
    torch.manual_seed(seed)
    cfg = model.MODELS[name][1]()
    layer = model.DecoderProjections(cfg, dtype=torch.float64)
    x = torch.randn(m, cfg.hidden_size, dtype=torch.float64)
    got = layer(x)
    assert got.shape == (m, cfg.hidden_size)
    torch.testing.assert_close(got, _by_hand(layer, cfg, x), rtol=1e-12, atol=1e-12)
    # Weights are N(0, 1/K): the update is of the input's order, not vanishing or exploding.
    if m >= 3:
        ratio = ((got - x).norm() / x.norm()).item()
        assert 0.1 < ratio < 10


@pytest.mark.parametrize("fmt", model.FORMATS)
def test_quantize_swaps_every_projection_and_stays_close(fmt):
    base = _tiny("tiny_dsv3", torch.bfloat16)
    ref = _tiny("tiny_dsv3")
    ref.load_state_dict(base.state_dict())
    layer = scaledmm.quantize_(base, fmt)
    assert not [n for n, mod in layer.named_modules() if type(mod) is nn.Linear], "a projection stayed float"
    x = torch.randn(17, 256, dtype=torch.bfloat16)
    out = layer(x)
    want = ref(x.double())
    err = ((out.double() - want).norm() / (want - x.double()).norm()).item()
    assert 1e-3 < err <= model.TOL[fmt]  # quantized for real (not bf16), and within the gate's bound


# ----------------------------------------------------------------------------
# The CLI
# ----------------------------------------------------------------------------


def test_layers_csv_markdown_and_results_sections(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n<!-- BEGIN fp8 -->\nkeep me\n<!-- END fp8 -->\n")
    args = [*SMOKE, "--models", "tiny_llama,tiny_dsv3", "--formats", "fp8_block,nvfp4_w4a16", "--m", "1,3",
            "--out", str(tmp_path / "out"), "--write-results", "--results-file", str(results)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    with open(tmp_path / "out" / "model.csv") as f:
        assert next(csv.reader(f)) == report.FIELDS + ["vs_bf16"]
    rows = _rows(tmp_path / "out" / "model.csv")
    assert len(rows) == 2 * 3 * 2  # models x formats x M
    assert {(r["shape"], r["provider"], r["m"]) for r in rows} == {
        (n, f, m) for n in ("tiny_llama", "tiny_dsv3") for f in ("bf16", "fp8_block", "nvfp4_w4a16")
        for m in ("1", "3")}
    for r in rows:
        assert r["status"] == "ok" and r["op"] == "decoder_layer" and r["n"] == r["k"] == "256", r
        assert float(r["error"]) <= model.TOL[r["provider"]] and r["mode"] == "wall"
        assert 0 < float(r["p20_us"]) <= float(r["median_us"]) <= float(r["p80_us"])
        assert float(r["flops"]) > 0 and float(r["vs_bf16"]) > 0
        assert r["kind"] == ("baseline" if r["provider"] == "bf16" else "ours")
        if r["provider"] == "bf16":
            assert float(r["vs_bf16"]) == 1.0 and r["backend"] == ""
        else:
            assert "reference" in r["backend"]  # the registry's CPU choice, recorded during the check
    text = results.read_text()
    assert "keep me" in text
    for name in ("tiny_llama", "tiny_dsv3"):
        assert text.count(f"<!-- BEGIN model-{name} -->") == 1
        assert (tmp_path / "out" / f"model-{name}.md").read_text().strip() in out
    assert "| M | bf16 | fp8_block | nvfp4_w4a16 |" in text and "projections N x K: 512x256" in text
    assert (tmp_path / "out" / "RESULTS.md").read_text() == text
    assert not (tmp_path / "out" / "model_generate.csv").exists()  # --quick: no generate


def test_wrong_format_is_reported_not_timed(tmp_path, capsys, monkeypatch):
    real = model.quantize

    def broken(module, fmt):
        real(module, fmt)
        if fmt == "fp8":  # a layer off by 1.5x: a planted wrong result
            down = module.down_proj.forward
            module.down_proj.forward = lambda x: down(x) * 1.5
        return module

    monkeypatch.setattr(model, "quantize", broken)
    assert cli.main([*SMOKE, "--models", "tiny_llama", "--formats", "fp8,fp8_tensor", "--m", "3",
                     "--out", str(tmp_path)]) == 0
    rows = {r["provider"]: r for r in _rows(tmp_path / "model.csv")}
    assert rows["fp8"]["status"] == "wrong" and rows["fp8"]["median_us"] == "" and rows["fp8"]["reps"] == ""
    assert float(rows["fp8"]["error"]) > model.TOL["fp8"]
    assert rows["fp8_tensor"]["status"] == "ok" and rows["bf16"]["status"] == "ok"
    assert "fp8 M=3: WRONG: rel_err of the update" in capsys.readouterr().out


def test_missing_quantize_skips_with_a_message(tmp_path, capsys, monkeypatch):
    monkeypatch.delattr(scaledmm, "quantize_")
    assert cli.main([*SMOKE, "--out", str(tmp_path)]) == 0
    assert "SKIPPED: scaledmm.quantize_ is not defined" in capsys.readouterr().out
    assert not (tmp_path / "model.csv").exists()
    with pytest.raises(RuntimeError, match="scaledmm.quantize_"):
        model.quantize(nn.Linear(16, 16), "fp8")


def test_generate_on_a_tiny_llama(tmp_path, capsys):
    assert cli.main([*SMOKE, "--generate-only", "--gen-model", "tiny_llama", "--gen-prompt", "8",
                     "--gen-tokens", "3", "--gen-reps", "1", "--gen-batch", "2", "--formats", "fp8",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {r["format"]: r for r in _rows(tmp_path / "model_generate.csv")}
    assert set(rows) == {"bf16", "fp8"}
    for r in rows.values():
        assert r["status"] == "ok" and r["batch"] == "2" and r["new_tokens"] == "3", r
        assert float(r["tokens_per_s"]) > 0 and float(r["decode_ms"]) >= 0 and float(r["prefill_ms"]) > 0
    assert float(rows["bf16"]["logits_rel_err"]) == 0.0 and float(rows["bf16"]["vs_bf16"]) == 1.0
    assert 1e-3 < float(rows["fp8"]["logits_rel_err"]) < 0.3
    assert float(rows["fp8"]["weights_gb"]) < float(rows["bf16"]["weights_gb"])
    assert all(r["gpu_ms_per_step"] == "" and r["vs_bf16_gpu"] == "" for r in rows.values())  # no GPU here
    assert "| GPU ms/step | GPU vs bf16 |" in out
    # A run over some formats writes its own section name.
    assert (tmp_path / "model-generate-fp8.md").read_text().strip() in out
    assert not (tmp_path / "model.csv").exists()


def test_compiled_layer_traces_as_one_graph():
    from torch._dynamo.utils import counters

    cpu = torch.device("cpu")
    counters.clear()
    results, _ = model.run_layers(["tiny_llama"], ["fp8_block"], [3], cpu, TimingConfig.for_device(cpu, True),
                                  "aot_eager")
    assert [(r.provider, r.status) for r in results] == [("bf16", "ok"), ("fp8_block", "ok")], results
    assert counters["stats"]["unique_graphs"] >= 2  # fullgraph: one graph per format, no breaks


def test_layers_with_the_quantization_in_the_producers_pass_the_error_gate():
    import scaledmm.compile
    from torch._inductor import config as inductor_config

    cpu = torch.device("cpu")
    with inductor_config.patch(scaledmm.compile.numerics()):
        results, _ = model.run_layers(["tiny_llama"], ["fp8", "fp8_block"], [3], cpu,
                                      TimingConfig.for_device(cpu, True), "inductor", fuse_quant=True)
    assert [(r.provider, r.status) for r in results] == [("bf16", "ok"), ("fp8", "ok"), ("fp8_block", "ok")], results


def test_model_options_parse():
    args = cli.build_parser().parse_args(["model", "--quick"])
    assert args.family == "model" and args.generate is None and args.formats is None and args.compile is None
    assert args.inductor_pdl is True and args.fuse_quant is False
    assert cli.build_parser().parse_args(["model", "--fuse-quant"]).fuse_quant is True
    assert cli.build_parser().parse_args(["model", "--no-inductor-pdl"]).inductor_pdl is False
    args = cli.build_parser().parse_args(["model", "--no-generate", "--formats", "nvfp4", "--gen-batch", "1,8"])
    assert args.generate is False and model.parse_batches(args.gen_batch) == [1, 8]
    assert model.parse_formats(None) == list(model.FORMATS)
    assert model.parse_formats("bf16, nvfp4 ,nvfp4") == ["nvfp4"]
    assert model.parse_models(None, torch.device("cpu")) == ["tiny_llama", "tiny_dsv3"]
    assert model.parse_models(None, torch.device("cuda")) == ["llama8b", "dsv3_dense"]
    with pytest.raises(ValueError, match="--formats"):
        model.parse_formats("fp4")
    with pytest.raises(ValueError, match="--models"):
        model.parse_models("llama70b", torch.device("cpu"))
    with pytest.raises(ValueError, match="--gen-batch"):
        model.parse_batches("0")
    with pytest.raises(SystemExit):
        cli.main(["model", "--device", "cpu", "--shapes", "llama8b"])
    assert "model" not in cli.FAMILIES  # not part of 'all'


def test_update_error_is_relative_to_the_update():
    # The gate compares output - input: a residual cannot hide a wrong layer.
    x = torch.randn(4, 8, dtype=torch.float64)
    ref = x + 1e-3 * torch.randn(4, 8, dtype=torch.float64)
    wrong = x + 2 * (ref - x)
    assert model.rel_err(wrong - x, ref - x) == pytest.approx(1.0)
    assert model.rel_err(wrong, ref) < 1e-2 and math.isfinite(model.rel_err(wrong, ref))


# ----------------------------------------------------------------------------
# On a GPU: Inductor with our passes, our CUDA-graph capture, generate with CUDA graphs
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fmt", model.FORMATS)
def test_gpu_layer_compiles_and_replays_from_a_cuda_graph(fmt):
    cuda = torch.device("cuda")
    results, weights = model.run_layers(["tiny_dsv3"], [fmt], [1, 8], cuda, TimingConfig.for_device(cuda, True),
                                        "inductor")
    assert [(r.provider, r.m) for r in results] == [("bf16", 1), ("bf16", 8), (fmt, 1), (fmt, 8)]
    for r in results:
        assert r.status == "ok" and r.timing.mode == "graph" and not r.note, r  # captured, not the fallback
        assert r.error <= model.TOL[r.provider] and r.copies >= 2 and r.rotation_bytes >= 2 * weights[
            ("tiny_dsv3", r.provider)]
    assert weights[("tiny_dsv3", fmt)] < weights[("tiny_dsv3", "bf16")]


@pytest.mark.gpu
@requires_cuda
def test_gpu_generate_decodes_from_cuda_graphs():
    res = model_generate.run_generate(["fp8_block"], torch.device("cuda"), model_name="tiny_llama", batches=[1],
                                       prompt=8, new_tokens=4, reps=1, compile_mode="inductor")
    assert [r.fmt for r in res] == ["bf16", "fp8_block"]
    for r in res:
        # no note: transformers compiled the decode step and Inductor kept its CUDA graphs
        assert r.status == "ok" and r.note == "" and r.tokens_per_s > 0, r
        assert 0 < r.gpu_step_us < r.decode.median_us, r  # the GPU part of a step, inside its wall time
        assert "fp8_block" not in r.fmt or "fp8_block_linear" in r.backend
