"""An independent float64 model of the NVFP4 format of SPEC.md (nearest-value
search over the e2m1 and e4m3 grids, the swizzle offset formula element by
element), and the GEMM checks built on it, shared by the NVFP4 tests."""

from __future__ import annotations

import torch

import scaledmm  # noqa: F401  (registers the ops)

ops = torch.ops.scaledmm
E4M3 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------
# Independent float64 model of SPEC.md
# ----------------------------------------------------------------------------

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e4m3_positive_values() -> torch.Tensor:
    """All finite non-negative e4m3fn values by bit pattern 0..126 (bias 7)."""
    vals = []
    for bits in range(127):
        e, m = bits >> 3, bits & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


E4M3_POS = _e4m3_positive_values()
assert E4M3_POS[-1] == 448.0


def _nearest_even(values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid value (ties to the even index) of each value."""
    d = (values.unsqueeze(-1) - grid).abs()
    best = d == d.min(dim=-1, keepdim=True).values
    even = (torch.arange(grid.numel()) % 2 == 0).to(torch.float64)
    return (best.to(torch.float64) * (1.0 + even)).argmax(dim=-1)


def ref_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Codes of float values already clamped to [-6, 6] (sign = signbit)."""
    v64 = v.double()
    idx = _nearest_even(v64.abs().nan_to_num(0.0), GRID)
    return (idx + 8 * torch.signbit(v64).long()).to(torch.uint8)


def ref_e4m3(t: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even float -> e4m3 value (float64); NaN stays NaN."""
    t64 = t.double()
    mag = t64.abs().clamp(max=448.0)
    val = E4M3_POS[_nearest_even(mag.nan_to_num(0.0), E4M3_POS)]
    val = torch.where(t64 < 0, -val, val)
    return torch.where(t64.isnan(), t64, val)


def ref_scaled(x: torch.Tensor, gs: float | torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """SPEC's scaled values x * (1 / (s * (1 / gs))) in fp32 (IEEE reciprocals),
    ``s`` the linear block scales [M, K/16]."""
    gs32 = torch.as_tensor(gs, dtype=torch.float32).reshape(()).cpu()
    r = torch.reciprocal(s.float() * torch.reciprocal(gs32))
    return x.float() * r.repeat_interleave(16, dim=1)


def ref_quant(x: torch.Tensor, gs: float | torch.Tensor):
    """SPEC quantizer: codes [M, K] (uint8), linear scales [M, K/16] (float32).

    The fp32 operations are formed in SPEC's order (s = e4m3(gs * (amax *
    (1/6))), codes of x * (1 / (s * (1 / gs)))); the roundings to e4m3 and
    e2m1 are this file's own nearest-value searches."""
    m, k = x.shape
    gs32 = torch.as_tensor(gs, dtype=torch.float32).reshape(())
    xb = x.float().reshape(m, k // 16, 16)
    amax = xb.abs().amax(dim=-1)
    sixth = torch.tensor(1.0) / torch.tensor(6.0)  # fp32 reciprocal of 6
    s = ref_e4m3(gs32 * (amax * sixth)).float()
    v = ref_scaled(x, gs32, s).reshape(m, k // 16, 16).clamp(-6.0, 6.0)
    codes = torch.where(s.unsqueeze(-1) == 0, torch.zeros((), dtype=torch.uint8), ref_e2m1_codes(v))
    return codes.reshape(m, k), s


def swizzle_offsets(rows: int, cols: int) -> tuple[torch.Tensor, int]:
    """SPEC's flat offset of S[r, c] for every (r, c), and C'."""
    cp = (cols + 3) // 4 * 4
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    off = ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return off, cp


def ref_unswizzle(s_swz: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    off, _ = swizzle_offsets(rows, cols)
    return s_swz.reshape(-1)[off.reshape(-1)].reshape(rows, cols)


def ref_decode_codes(codes: torch.Tensor) -> torch.Tensor:
    mag = GRID[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def ref_unpack(q: torch.Tensor) -> torch.Tensor:
    lo = (q & 0xF).long()
    hi = (q >> 4).long()
    return torch.stack([lo, hi], dim=-1).reshape(q.shape[0], 2 * q.shape[1]).to(torch.uint8)


def deq64(q: torch.Tensor, s_swz: torch.Tensor) -> torch.Tensor:
    """float64 [R, K] of packed codes and swizzled e4m3 scales."""
    rows, k = q.shape[0], 2 * q.shape[1]
    s = ref_unswizzle(s_swz.cpu(), rows, k // 16).double()
    return ref_decode_codes(ref_unpack(q.cpu())) * s.repeat_interleave(16, dim=1)


def _tol_for(dtype):
    return {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -22}[dtype]


def check_gemm(out, ref64, bound, k, out_dtype, nan_rows=None):
    out = out.detach().cpu().double()
    assert out.shape == ref64.shape
    if nan_rows is None:
        nan_rows = torch.zeros(out.shape[0], dtype=torch.bool)
    assert out[nan_rows].isnan().all(), "rows with a NaN block scale must be all NaN"
    ok = ~nan_rows
    o, r, b = out[ok], ref64[ok], bound[ok]
    assert not o.isnan().any(), "rows without a NaN block scale must not be NaN"
    tol = _tol_for(out_dtype) * r.abs() + 2 * k * 2.0 ** -24 * b + 1e-30
    fmax = torch.finfo(out_dtype).max
    over = r.abs() - tol > fmax  # IEEE overflow: must be +-inf
    assert torch.equal(o[over], torch.where(r[over] > 0, torch.inf, -torch.inf)), "overflow must give inf"
    inside = r.abs() + tol <= fmax
    assert torch.isfinite(o[inside]).all(), "results in range must be finite"
    excess = ((o - r).abs() - tol)[inside]
    assert not (excess > 0).any(), f"{int((excess > 0).sum())} elements off, max excess {excess.max().item()}"


def gs_for(x: torch.Tensor, mult: float = 1.0) -> torch.Tensor:
    """The usual quantize multiplier 448*6/amax over the finite values."""
    xf = x.float()
    amax = xf.abs().masked_fill(~torch.isfinite(xf), 0).max() if xf.numel() else torch.tensor(0.0)
    amax = float(amax)
    return torch.tensor(448 * 6 / amax * mult if amax > 0 else 1.0, dtype=torch.float32)


def quantized(rows: int, k: int, device="cpu", dtype=torch.float32, scale: float = 1.0):
    """Random NVFP4 operand: (x, q, s_swizzled, gs)."""
    x = (torch.randn(rows, k) * scale).to(dtype).to(device)
    gs = gs_for(x).to(device)
    q, s = ops.nvfp4_quant(x, gs, True)
    return x, q, s, gs


def mm_ref64(a, b, sa, sb, alpha, bias=None, B=None):
    """float64 ``alpha * deq(a) @ deq(b).T + bias`` and the accumulation bound
    (``B``: ``deq64(b, sb)`` when already computed)."""
    A = deq64(a, sa)
    B = deq64(b, sb) if B is None else B
    al = float(alpha.reshape(()))
    ref = al * (A @ B.t())
    bound = abs(al) * (A.abs() @ B.abs().t())
    if bias is not None:
        ref = ref + bias.double().cpu()
    return ref, bound


def check_quant(x, gs, q, s, swizzle):
    """q, s from any backend vs the model: scales and codes bit-exact (every
    backend takes IEEE reciprocals, on the GPU too)."""
    m, k = x.shape
    codes_ref, s_ref = ref_quant(x.cpu(), gs.cpu())
    q, s = q.cpu(), s.cpu()
    assert q.shape == (m, k // 2) and q.dtype == torch.uint8
    assert s.dtype == E4M3
    if swizzle:
        assert s.shape == ((m + 127) // 128 * 128, (k // 16 + 3) // 4 * 4)
        hit = torch.zeros(s.numel(), dtype=torch.bool)
        off, _ = swizzle_offsets(m, k // 16)
        hit[off.reshape(-1)] = True
        assert (s.view(torch.uint8).reshape(-1)[~hit] == 0).all(), "swizzle padding must be zeros"
        s_lin = ref_unswizzle(s.float(), m, k // 16)
    else:
        assert s.shape == (m, k // 16)
        s_lin = s.float()
    assert torch.equal(s_lin.isnan(), s_ref.isnan())
    fin = ~s_ref.isnan()
    assert torch.equal(s_lin[fin], s_ref[fin]), "block scales differ"
    codes = ref_unpack(q)
    # codes are unspecified in blocks with a NaN scaled value: a NaN scale, or
    # 0 * inf where an extreme gs makes the reciprocal overflow
    nan_y = ref_scaled(x.cpu(), gs.cpu(), s_ref).isnan().reshape(m, k // 16, 16).any(-1)
    valid = (~nan_y).repeat_interleave(16, dim=1)
    diff = (codes != codes_ref) & valid
    assert not diff.any(), f"{int(diff.sum())} codes differ from SPEC's rule"


# ----------------------------------------------------------------------------
# GPU operands and the float64 bound of the CUDA kernels' tests
# ----------------------------------------------------------------------------


def cuda_operands(m: int, n: int, k: int):
    """``(qa, sa, qb, sb, alpha)`` on the GPU: an activation with row scales
    spread over [0, 4) and a weight of unit-ish rows, each quantized with its
    own global scale; alpha undoes both."""
    x = torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    gs_x = torch.tensor(448 * 6 / max(float(x.abs().max()), 1e-6), device="cuda")
    gs_w = torch.tensor(448 * 6 / float(w.abs().max()), device="cuda")
    qa, sa = ops.nvfp4_quant(x.bfloat16(), gs_x)
    qb, sb = ops.nvfp4_quant(w.bfloat16(), gs_w)
    return qa, sa, qb, sb, (1.0 / (gs_x * gs_w)).float()


def check_f64_bound(out, xd, wd, alpha, bias=None):
    """``out`` against float64 ``alpha * xd @ wd.T (+ bias)`` within one output
    rounding (half an ulp: relative, or below the smallest normal the
    subnormal spacing's half, e.g. a tiny bias on a zero row in fp16) plus
    fp32 summation."""
    ref = xd.double() @ wd.double().t() * float(alpha)
    if bias is not None:
        ref = ref + bias.double()
    absum = xd.double().abs() @ wd.double().abs().t() * float(alpha)
    eps = 2.0 ** -8 if out.dtype == torch.bfloat16 else 2.0 ** -11
    subnormal = torch.finfo(out.dtype).smallest_normal * eps  # 2^-25 in fp16
    bound = ref.abs() * eps + absum * 2.0 ** -20 + subnormal + 1e-30
    assert torch.isfinite(out).all(), "non-finite output (unwritten poison?)"
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"worst {float((err / bound).max()):.2f}x the bound"


#: ``(m, n, k, x_dtype, out_dtype, bias_dtype, pad)`` of the linear ops'
#: opcheck cases: M = 0 / 1 / 3 / 17, every activation and output dtype, a
#: bias of each kind, strided rows.
LINEAR_OPCHECK_CASES = [
    (0, 40, 96, torch.bfloat16, torch.bfloat16, None, 0),
    (1, 200, 736, torch.float16, torch.float16, torch.bfloat16, 0),
    (3, 24, 64, torch.float32, torch.float32, torch.float32, 16),
    (17, 200, 736, torch.bfloat16, torch.bfloat16, torch.float32, 24),
]
