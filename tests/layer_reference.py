"""Float64 models of the quantized layers, written from SPEC.md without the
package's ops, and the error bounds the formats allow.

Only two primitives come from torch: the e4m3 -> float64 cast (decoding a
code) and IEEE fp32 arithmetic where the SPEC fixes an fp32 step."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
U32 = 2.0 ** -24  # fp32 unit roundoff
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e4m3_positive() -> torch.Tensor:
    """Every finite non-negative e4m3 value, in code order (0x00 .. 0x7e)."""
    return torch.arange(0x7F, dtype=torch.uint8).view(E4M3).double()


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 ``v`` to e4m3 (nearest, ties to the even code,
    saturating at 448) and return the float64 value.

    Examples
    --------
    >>> round_e4m3(torch.tensor([0.3, 500.0, -1.0625], dtype=torch.float64)).tolist()
    [0.3125, 448.0, -1.0]
    """
    vals = _e4m3_positive()
    a = v.abs().clamp(max=448.0)
    hi = torch.searchsorted(vals, a.nan_to_num(0.0).contiguous()).clamp(max=len(vals) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    out = torch.where(pick_hi, vals[hi], vals[lo])
    out = torch.where(v.isnan(), v, out)
    return torch.copysign(out, v)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of 4-bit e2m1 codes (bit 3 sign, bits 0-2 magnitude)."""
    mag = E2M1[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/2] -> codes [R, K]: element 2i low nibble, 2i+1 high."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def unswizzle(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Scale [rows, cols] out of the SPEC's swizzled layout, by its offset formula."""
    cp = (cols + 3) // 4 * 4
    r = torch.arange(rows).reshape(-1, 1)
    c = torch.arange(cols).reshape(1, -1)
    off = ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return s.reshape(-1)[off]


def fp8_block_weight(q: torch.Tensor, s: torch.Tensor, n: int, k: int, block=(128, 128)) -> torch.Tensor:
    """float64 [n, k] weight: code * scale of its (n // bn, k // bk) block."""
    bn, bk = block
    w = q[:n, :k].double()
    rows = torch.arange(n) // bn
    cols = torch.arange(k) // bk
    return w * s.double()[rows][:, cols]


def quant_groups_fp8(x64: torch.Tensor, group: int, eps: float = 1e-10) -> torch.Tensor:
    """SPEC per_token_group_quant_fp8, dequantized to float64: s = max(amax, eps) / 448
    in fp32, code = e4m3(clamp(x / s)) with x / s one fp32 division."""
    m, k = x64.shape
    kp = (k + group - 1) // group * group
    xp = torch.nn.functional.pad(x64, (0, kp - k)).reshape(m, kp // group, group)
    s = (torch.clamp(xp.abs().amax(dim=2, keepdim=True), min=eps).float() / 448)
    ratio = (xp.float() / s).double()
    return (round_e4m3(ratio) * s.double()).reshape(m, kp)[:, :k]


def check_within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, out_dtype: torch.dtype):
    """Every element of ``y`` lies in [ref - bound, ref + bound] rounded
    outward to ``out_dtype`` (the final rounding of the output)."""
    o = y.reshape(ref.shape).double().cpu()
    lo = (ref - bound).to(out_dtype).double()
    hi = (ref + bound).to(out_dtype).double()
    ok = (o >= lo) & (o <= hi)
    assert ok.all(), (f"{int((~ok).sum())} of {ok.numel()} outputs outside the bound; first at "
                      f"{(~ok).nonzero()[0].tolist()}: got {o[~ok][0].item()}, want {ref[~ok][0].item()} "
                      f"+- {bound[~ok][0].item()}")


def fp8_block_layer_model(x: torch.Tensor, weight, scale_inv, bias, n: int, block=(128, 128),
                          out_dtype=torch.bfloat16):
    """float64 model of Fp8BlockLinear on [M, K] ``x`` and its bound.

    The activation is quantized as SPEC's per_token_group_quant_fp8 does, so
    the only differences left are fp32 accumulation and the output rounding:
    |acc - exact| <= (K + 2 * K/bk + 2) u32 sum_k |xq_k w_k| (a K-term fp32 sum, one
    scale product and one block add per group); a bias added after rounding the
    product to out_dtype adds eps(out) |acc|."""
    k = x.shape[1]
    x64 = quant_groups_fp8(x.double(), block[1])
    w64 = fp8_block_weight(weight, scale_inv, n, k, block)
    ref = x64 @ w64.t()
    mag = x64.abs() @ w64.abs().t()
    nb = (k + block[1] - 1) // block[1]
    bound = (k + 2 * nb + 2) * U32 * mag
    if bias is not None:
        bound = bound + torch.finfo(out_dtype).eps * ref.abs() + U32 * bias.double().abs()
        ref = ref + bias.double()
    return ref, bound * 1.01 + 1e-300


def quant_fp8_tensor(x64: torch.Tensor, mode: str, input_scale=None, floor: float = 1e-10) -> torch.Tensor:
    """SPEC quant_fp8, dequantized to float64: a static ``input_scale``, or a
    dynamic per-tensor ("dynamic") / per-row ("dynamic_per_token") scale
    max(amax, floor) / 448 in fp32; code = e4m3(clamp(x * (1 / s))), the
    reciprocal and the product each one fp32 rounding."""
    if mode == "static":
        s = input_scale.float().reshape(1, 1)
    elif mode == "dynamic_per_token":
        s = torch.clamp(x64.abs().amax(dim=1, keepdim=True), min=floor).float() / 448
    else:
        amax = x64.abs().amax() if x64.numel() else x64.new_zeros(())
        s = torch.clamp(amax, min=floor).float().reshape(1, 1) / 448
    ratio = (x64.float() * torch.reciprocal(s)).double()
    return round_e4m3(ratio) * s.double()


def fp8_layer_model(x: torch.Tensor, weight, weight_scale, bias, n: int, mode: str, input_scale=None,
                    out_dtype=torch.bfloat16):
    """float64 model of Fp8Linear on [M, K] ``x`` and its bound: the stored
    e4m3 weight times its per-tensor or per-channel scale, the activation
    quantized by the SPEC recipe; the bound is fp32 accumulation,
    (K + 3) u32 sum_k |xq_k w_k| (K-term sum, two scale products), plus a bias
    added after rounding to out_dtype: eps(out) |acc| + u32 |bias|."""
    k = x.shape[1]
    x64 = quant_fp8_tensor(x.double(), mode, input_scale)
    ws = weight_scale.double().reshape(-1)
    w64 = weight[:n, :k].double() * (ws[:n].reshape(n, 1) if ws.numel() > 1 else ws.reshape(1, 1))
    ref = x64 @ w64.t()
    bound = (k + 3) * U32 * (x64.abs() @ w64.abs().t())
    if bias is not None:
        b = bias[:n].double()
        bound = bound + torch.finfo(out_dtype).eps * ref.abs() + U32 * b.abs()
        ref = ref + b
    return ref, bound * 1.01 + 1e-300
