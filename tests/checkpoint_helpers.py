"""Test helpers for the model-level API: small quantizers that write
checkpoints in the three conventions (written here, independently of
scaledmm's ops), their dequantizers, a dequantizer of scaledmm layers, a
sharded safetensors writer and tiny Hugging Face configs."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

# ---------------------------------------------------------------------------
# Quantizers: float weight [N, K] -> checkpoint tensors of one convention
# ---------------------------------------------------------------------------


def fp8_block_tensors(w: torch.Tensor, block=(128, 128)) -> dict[str, torch.Tensor]:
    """DeepSeek-V3: e4m3 codes, fp32 ``weight_scale_inv`` per bn x bk block (amax / 448)."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    wf = torch.zeros(nb * bn, kb * bk, dtype=torch.float64)
    wf[:n, :k] = w.double()
    blocks = wf.reshape(nb, bn, kb, bk)
    s = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    q = (blocks / s[:, None, :, None]).reshape(nb * bn, kb * bk)[:n, :k].float().to(FP8)
    return {"weight": q, "weight_scale_inv": s.float()}


def fp8_channel_tensors(w: torch.Tensor, per_channel=True, input_amax=None) -> dict[str, torch.Tensor]:
    """compressed-tensors: e4m3 codes, ``weight_scale`` [N, 1] (channel) or [1] (tensor)."""
    wd = w.double()
    s = (wd.abs().amax(dim=1, keepdim=True) if per_channel else wd.abs().amax().reshape(1)) / 448
    s = s.clamp(min=1e-12)
    out = {"weight": (wd / s).float().to(FP8), "weight_scale": s.float()}
    if input_amax is not None:
        out["input_scale"] = torch.tensor([input_amax / 448], dtype=torch.float32)
    return out


def nvfp4_tensors(w: torch.Tensor, input_amax: float) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4: packed e2m1 codes (low nibble first), e4m3 scale per 16,
    fp32 ``weight_scale_2`` = amax / (448 * 6), ``input_scale`` likewise."""
    n, k = w.shape
    wd = w.double()
    s2 = wd.abs().amax().clamp(min=1e-12) / (448 * 6)
    blocks = wd.reshape(n, k // 16, 16)
    bs = (blocks.abs().amax(dim=-1) / 6 / s2).float().clamp(max=448).to(FP8)
    denom = bs.double() * s2
    v = blocks / torch.where(denom == 0, torch.ones_like(denom), denom)[..., None]
    mag = (v.abs()[..., None] - E2M1.double()).abs().argmin(dim=-1)  # nearest grid point
    codes = (mag | ((v < 0).long() << 3)).reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {"weight": packed, "weight_scale": bs, "weight_scale_2": s2.float().reshape(()),
            "input_scale": torch.tensor(input_amax / (448 * 6), dtype=torch.float32)}


# ---------------------------------------------------------------------------
# Dequantizers
# ---------------------------------------------------------------------------


def dequantize_tensors(t: dict[str, torch.Tensor], n: int, k: int, block=None) -> torch.Tensor:
    """Float64 weight [N, K] that checkpoint tensors encode (``block``: the
    block size of a block-scaled ``weight_scale``; ``weight_scale_inv`` is
    always block-scaled, 128 x 128 unless given)."""
    if "weight_scale_inv" in t or block is not None:
        bn, bk = block or (128, 128)
        s = t.get("weight_scale_inv", t.get("weight_scale")).double()
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return t["weight"].double() * full
    if t["weight"].dtype == FP8:
        s = t["weight_scale"].double()
        return t["weight"].double() * (s.reshape(n, 1) if s.numel() == n and n > 1 else s.reshape(()))
    packed = t["weight"]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n, k).long()
    vals = E2M1.double()[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    scale = t["weight_scale"].double().repeat_interleave(16, 1) * t["weight_scale_2"].double()
    return vals * scale


def dequantize_layer(layer: nn.Module) -> torch.Tensor:
    """Float64 [N, K] weight a scaledmm layer holds (through public attributes and ops)."""
    from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear

    n, k = layer.out_features, layer.in_features
    if isinstance(layer, Fp8BlockLinear):
        bn, bk = layer.block_size
        s = layer.weight_scale_inv.double()
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return layer.weight[:n, :k].double() * full
    if isinstance(layer, Fp8Linear):
        s = layer.weight_scale.double().reshape(-1)
        s = s[:n, None] if layer.per_channel else s[0]
        return layer.weight[:n, :k].double() * s
    assert isinstance(layer, NvFp4Linear)
    kp = layer.weight.shape[1] * 2
    s = torch.ops.scaledmm.unswizzle_block_scales(layer.weight_scale, layer.weight.shape[0], kp // 16)
    t = {"weight": layer.weight[:n, : k // 2], "weight_scale": s[:n, : k // 16],
         "weight_scale_2": layer.weight_scale_2.reshape(())}
    return dequantize_tensors(t, n, k)


@torch.no_grad()
def dequantized_copy(float_model: nn.Module, quantized: nn.Module) -> nn.Module:
    """``float_model`` with the weight of every Linear that ``quantized``
    swapped replaced by the dequantized weight (activations stay float)."""
    import copy

    from scaledmm.quantize import layer_format

    out = copy.deepcopy(float_model)
    for fqn, mod in quantized.named_modules():
        if layer_format(mod) is not None:
            lin = out.get_submodule(fqn)
            lin.weight.copy_(dequantize_layer(mod).to(lin.weight.dtype))
    return out


def dequantized_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float64 state dict a quantized checkpoint encodes, per-expert
    Linears fused back into transformers' ``gate_up_proj`` / ``down_proj``."""
    scale_keys = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
    out = {}
    for name, v in state.items():
        mod, _, leaf = name.rpartition(".")
        if leaf in scale_keys:
            continue
        if leaf == "weight" and any(f"{mod}.{s}" in state for s in scale_keys[:2]):
            k = v.shape[1] * (2 if v.dtype == torch.uint8 else 1)
            t = {s: state[f"{mod}.{s}"] for s in ("weight", *scale_keys) if f"{mod}.{s}" in state}
            v = dequantize_tensors(t, v.shape[0], k)
        out[name] = v
    for name in [k for k in out if k.endswith(".0.gate_proj.weight") and ".experts." in k]:
        prefix = name[: -len(".0.gate_proj.weight")]
        experts = sum(1 for k in out if k.startswith(prefix + ".") and k.endswith(".gate_proj.weight"))
        pop = lambda e, p: out.pop(f"{prefix}.{e}.{p}.weight")  # noqa: E731
        ups = [(pop(e, "gate_proj"), pop(e, "up_proj"), pop(e, "down_proj")) for e in range(experts)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(g_u[:2]) for g_u in ups])
        out[f"{prefix}.down_proj"] = torch.stack([g_u[2] for g_u in ups])
    return out


def float_model_from(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of the float ``model`` holding the weights a quantized checkpoint encodes."""
    import copy

    ref = copy.deepcopy(model)
    deq = dequantized_state(state)
    own = ref.state_dict()
    assert set(own) <= set(deq), sorted(set(own) - set(deq))
    ref.load_state_dict({k: deq[k].to(own[k].dtype) for k in own})
    return ref


# ---------------------------------------------------------------------------
# Checkpoint folders
# ---------------------------------------------------------------------------


def write_checkpoint(path: str, tensors: dict[str, torch.Tensor], quantization_config: dict | None,
                     shards: int = 2, extra_config: dict | None = None) -> str:
    """Sharded safetensors + ``model.safetensors.index.json`` + ``config.json``
    (as published checkpoints have them); ``shards=1``: one file, no index."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({k: tensors[k].contiguous() for k in part}, os.path.join(path, fname))
            weight_map.update({k: fname for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    config = dict(extra_config or {})
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


# The quantization_config blocks as the published checkpoints spell them.
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def compressed_tensors_config(strategy: str, dynamic: bool, ignore=("lm_head",)) -> dict:
    act_strategy = "token" if dynamic and strategy == "channel" else "tensor"
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                        "dynamic": False, "group_size": None, "block_structure": None},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": act_strategy,
                                  "dynamic": dynamic, "group_size": None},
            "output_activations": None}},
        "ignore": list(ignore), "kv_cache_scheme": None}


def modelopt_config(exclude=("lm_head",)) -> dict:
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "kv_cache_quant_algo": None, "exclude_modules": list(exclude)}


@torch.no_grad()
def calibrate(model: nn.Module, *inputs) -> dict[str, float]:
    """amax of each Linear's input over one forward (static activation scales)."""
    amax, hooks = {}, []
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, fqn=fqn: amax.__setitem__(fqn, max(amax.get(fqn, 0.0), args[0].abs().max().item()))))
    model(*inputs)
    for h in hooks:
        h.remove()
    return amax


def quantized_state(model: nn.Module, convention: str, *, skip=("lm_head",), input_amax=None,
                    strategy="channel", static=False) -> dict[str, torch.Tensor]:
    """The model's state dict with every Linear not named in ``skip`` replaced
    by the convention's tensors (a checkpoint as a quantizer would publish it).
    ``input_amax``: fqn -> calibrated activation amax (static scales), 8.0 for
    modules it lacks."""
    input_amax = input_amax or {}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not any(fqn == s or fqn.endswith("." + s) for s in skip):
            weights[fqn] = state.pop(f"{fqn}.weight")
    for name in [k for k in state if k.endswith(".experts.gate_up_proj")]:
        # fused experts [E, 2I, H] / [E, H, I] -> per-expert Linears, as DeepSeek-V3 publishes them
        prefix = name[: -len(".gate_up_proj")]
        gate_up, down = state.pop(name), state.pop(f"{prefix}.down_proj")
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            weights[f"{prefix}.{e}.gate_proj"] = gate_up[e, :half]
            weights[f"{prefix}.{e}.up_proj"] = gate_up[e, half:]
            weights[f"{prefix}.{e}.down_proj"] = down[e]
    for fqn, w in weights.items():
        if convention == "fp8_block":
            t = fp8_block_tensors(w)
        elif convention == "compressed_tensors_fp8":
            t = fp8_channel_tensors(w, per_channel=strategy == "channel",
                                    input_amax=input_amax.get(fqn, 8.0) if static else None)
        else:
            t = nvfp4_tensors(w, input_amax.get(fqn, 8.0))
        state.update({f"{fqn}.{k}": v for k, v in t.items()})
    return state


def config_for(convention: str, *, strategy="channel", static=False, skip=("lm_head",)) -> dict:
    if convention == "fp8_block":
        return dict(FP8_BLOCK_CONFIG)
    if convention == "compressed_tensors_fp8":
        return compressed_tensors_config(strategy, not static, ignore=skip)
    return modelopt_config(exclude=skip)


# ---------------------------------------------------------------------------
# Tiny Hugging Face models (hidden 256: a multiple of the 128 weight blocks)
# ---------------------------------------------------------------------------


def tiny_config(family: str, layers: int = 2):
    import transformers as tf

    common = dict(vocab_size=384, hidden_size=256, intermediate_size=384, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **common)
    if family == "qwen3":
        return tf.Qwen3Config(num_key_value_heads=2, head_dim=64, **common)
    if family == "deepseek_v3":
        # layer 0 dense (nn.Linear MLP), later layers MoE (experts as fused tensors); every
        # token routed to every expert, so a quantization error cannot flip a discrete routing choice
        return tf.DeepseekV3Config(num_key_value_heads=4, moe_intermediate_size=128, first_k_dense_replace=1,
                                   n_routed_experts=2, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                                   topk_group=1, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                                   qk_rope_head_dim=32, v_head_dim=64, **common)
    raise ValueError(family)


def tiny_model(family: str, layers: int = 2, dtype=torch.bfloat16, device=None):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, layers)
    if device == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():  # unit-scale weights so every layer moves the residual stream
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1 / p.shape[-1] ** 0.5)
    return model
