"""NVFP4 ops: format, swizzled layout, quantizer, W4A4 / W4A16 GEMMs, fakes,
compile, the sm100 backends' argument preparation and gates.

The expectations come from an independent float64 model of SPEC.md written
here (nearest-value search over the e2m1 and e4m3 grids, the swizzle offset
formula element by element), not from the module under test.
"""

from __future__ import annotations

import inspect
import sys
import types
import typing

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import scaledmm  # noqa: F401  (registers the ops)
from scaledmm import backends
from scaledmm.ops import nvfp4 as N

from helpers import requires_cuda
from helpers import opcheck

ops = torch.ops.scaledmm
E4M3 = torch.float8_e4m3fn
HALF = (torch.bfloat16, torch.float16)

# ----------------------------------------------------------------------------
# Independent float64 model of SPEC.md (also imported by test_layers_nvfp4.py)
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


# ----------------------------------------------------------------------------
# Format
# ----------------------------------------------------------------------------


def test_e2m1_table_all_16_codes():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    codes = torch.arange(16, dtype=torch.uint8)
    dec = N.e2m1_decode(codes)
    assert dec.tolist() == expected
    assert torch.signbit(dec).tolist() == [c >= 8 for c in range(16)]
    assert list(N.E2M1_VALUES) == expected
    # every grid value encodes to its own code (0.0 -> 0, -0.0 -> 8)
    assert N.e2m1_encode(torch.tensor(expected)).tolist() == list(range(16))


@pytest.mark.parametrize("value,code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
    (-0.25, 8), (-0.75, 10), (-1.25, 10), (-1.75, 12), (-2.5, 12), (-3.5, 14), (-5.0, 14),
    (0.2500001, 1), (0.7499999, 1), (5.0000005, 7), (4.9999995, 6), (6.0, 7), (-6.0, 15),
])
def test_e2m1_round_to_nearest_even(value, code):
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (values); codes index the grid
    assert N.e2m1_encode(torch.tensor([value], dtype=torch.float32)).item() == code


def test_e2m1_encode_matches_nearest_search():
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    near = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    v = torch.cat([near, -near, (torch.rand(4000) * 12 - 6)]).float().clamp(-6, 6)
    assert torch.equal(N.e2m1_encode(v), ref_e2m1_codes(v))


def test_packing_order():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    q = N.pack_e2m1(codes)
    assert q.shape == (5, 32) and q.dtype == torch.uint8
    assert torch.equal(q & 0xF, codes[:, 0::2])
    assert torch.equal(q >> 4, codes[:, 1::2])
    assert torch.equal(N.unpack_e2m1(q), codes)
    # through the quantizer: block amax 6 and global scale 1 give s = 1, codes = e2m1(x)
    vals = torch.tensor([0.5, -1.0, 6.0, 0.0, 3.0, -0.5, 1.5, -6.0] * 2)
    q, s = ops.nvfp4_quant(vals.reshape(1, 16), torch.tensor(1.0), False)
    assert s.float().item() == 1.0
    assert q[0, :4].tolist() == [0xA << 4 | 0x1, 0x0 << 4 | 0x7, 0x9 << 4 | 0x5, 0xF << 4 | 0x3]


def test_e4m3_saturating_cast():
    t = torch.tensor([0.0, 1e-9, 0.0009, 0.001, 0.3, 447.0, 448.0, 464.0, 480.0, 1e30, float("inf"),
                      -1e30, float("-inf"), float("nan")])
    got = N.e4m3_saturating(t)
    assert got.dtype == E4M3
    exp = ref_e4m3(t)
    g = got.float().double()
    assert torch.equal(g.isnan(), exp.isnan())
    assert torch.equal(g[~exp.isnan()], exp[~exp.isnan()])
    assert g[6:10].tolist() == [448.0, 448.0, 448.0, 448.0]  # saturates, never NaN
    # an independent check over many random magnitudes
    r = torch.exp(torch.empty(5000).uniform_(-25, 8))
    assert torch.equal(N.e4m3_saturating(r).float().double(), ref_e4m3(r))


# ----------------------------------------------------------------------------
# Swizzled layout
# ----------------------------------------------------------------------------

SHAPES_RC = [(1, 1), (3, 5), (128, 4), (129, 7), (200, 12), (256, 9), (300, 17)]


@pytest.mark.parametrize("rows,cols", SHAPES_RC)
def test_swizzle_offset_formula(rows, cols):
    s = torch.arange(1, rows * cols + 1, dtype=torch.float32).reshape(rows, cols)
    z = N.swizzle_block_scales(s)
    off, cp = swizzle_offsets(rows, cols)
    rp = (rows + 127) // 128 * 128
    assert z.shape == (rp, cp) and z.is_contiguous()
    flat = z.reshape(-1)
    assert torch.equal(flat[off.reshape(-1)], s.reshape(-1))
    hit = torch.zeros(rp * cp, dtype=torch.bool)
    hit[off.reshape(-1)] = True
    assert (flat[~hit] == 0).all(), "padding must be zeros"
    assert int(hit.sum()) == rows * cols


@pytest.mark.parametrize("rows,cols", SHAPES_RC)
def test_swizzle_roundtrip_e4m3(rows, cols):
    s = torch.randint(0, 0x7F, (rows, cols), dtype=torch.uint8).view(E4M3)
    z = N.swizzle_block_scales(s)
    assert z.dtype == E4M3
    back = N.unswizzle_block_scales(z, rows, cols)
    assert back.shape == (rows, cols) and torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(ref_unswizzle(z.view(torch.uint8), rows, cols), s.view(torch.uint8))
    # ops versions agree and return new tensors
    z2 = ops.swizzle_block_scales(s)
    assert torch.equal(z2.view(torch.uint8), z.view(torch.uint8))
    b2 = ops.unswizzle_block_scales(z2, rows, cols)
    assert torch.equal(b2.view(torch.uint8), s.view(torch.uint8))
    assert b2.data_ptr() != z2.data_ptr()


def test_swizzle_empty_rows():
    s = torch.zeros(0, 3, dtype=E4M3)
    z = N.swizzle_block_scales(s)
    assert z.shape == (0, 4)
    assert N.unswizzle_block_scales(z, 0, 3).shape == (0, 3)


# ----------------------------------------------------------------------------
# Quantizer
# ----------------------------------------------------------------------------


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


QUANT_M = [0, 1, 3, 17, 129]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("swizzle", [True, False])
def test_quant_matches_spec(dtype, swizzle):
    for m in QUANT_M:
        for k in (16, 48, 208):
            x = (torch.randn(m, k) * 3).to(dtype)
            gs = gs_for(x)
            q, s = ops.nvfp4_quant(x, gs, swizzle)
            check_quant(x, gs, q, s, swizzle)


def test_quant_strided_rows_and_scale_shapes():
    base = torch.randn(7, 112, dtype=torch.bfloat16)
    x = base[:, :80]  # row stride 112
    gs = gs_for(x)
    q, s = ops.nvfp4_quant(x, gs.reshape(1, 1), True)  # any one-element shape
    check_quant(x, gs, q, s, True)
    q2, s2 = ops.nvfp4_quant(x.contiguous(), gs, True)
    assert torch.equal(q, q2) and torch.equal(s.view(torch.uint8), s2.view(torch.uint8))


def test_quant_special_values():
    x = torch.randn(6, 64)
    x[1, 3] = float("nan")
    x[2, 20] = float("inf")
    x[3, :16] = 0.0
    x[4, 16:32] = 1e-30
    x[5, 40] = -1e30
    gs = torch.tensor(10.0)
    q, s = ops.nvfp4_quant(x, gs, False)
    check_quant(x, gs, q, s, False)
    sf = s.float()
    assert sf[1, 0].isnan() and not sf[1, 1:].isnan().any()  # only the NaN's block
    assert sf[2, 1] == 448.0 and ref_unpack(q)[2, 20] == 7  # Inf saturates
    assert sf[3, 0] == 0 and (ref_unpack(q)[3, :16] == 0).all()  # zero block: s = 0, codes 0
    assert sf[4, 1] == 0 and (ref_unpack(q)[4, 16:32] == 0).all()  # underflows to s = 0
    assert sf[5, 2] == 448.0 and ref_unpack(q)[5, 40] == 15


def test_quant_dequant_error_bounds():
    x = torch.randn(33, 272) * torch.exp(torch.randn(33, 1))
    gs = gs_for(x)
    q, s = ops.nvfp4_quant(x, gs, True)
    s_lin = N.unswizzle_block_scales(s, 33, 17).float().repeat_interleave(16, dim=1)
    v = ref_scaled(x, gs, s_lin[:, ::16]).clamp(-6, 6)  # the scaled value the code approximates
    vq = N.e2m1_decode(N.unpack_e2m1(q))
    half_gap = torch.where(v.abs() <= 2, 0.25, torch.where(v.abs() <= 4, 0.5, 1.0))
    assert ((vq - v).abs() <= half_gap).all()
    deq = N.dequantize(q, s, gs)
    assert torch.allclose(deq, vq * s_lin / gs, rtol=1e-6, atol=0)
    # scale rounding keeps x / (s / gs) <= 6 * (1 + 2^-4), so clamping costs < 0.375 step
    assert ((deq - x).abs() <= s_lin / gs * 1.0 + 1e-30).all()
    rel = ((deq - x).norm() / x.norm()).item()
    assert rel < 0.12, rel


# ----------------------------------------------------------------------------
# GEMMs
# ----------------------------------------------------------------------------

MM_M = [0, 1, 3, 17, 129]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_nvfp4_mm_vs_float64(out_dtype, with_bias):
    n, k = 40, 208
    _, b, sb, gb = quantized(n, k)
    for m in MM_M:
        _, a, sa, ga = quantized(m, k, scale=4.0)
        alpha = (1 / ga) * (1 / gb)
        bias = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
        out = ops.nvfp4_mm(a, b, sa, sb, alpha, out_dtype, bias)
        assert out.dtype == out_dtype and out.shape == (m, n)
        ref, bound = mm_ref64(a, b, sa, sb, alpha, bias)
        check_gemm(out, ref, bound, k, out_dtype)


def test_nvfp4_mm_strided_a_and_alpha_shapes():
    m, n, k = 9, 24, 80
    _, b, sb, gb = quantized(n, k)
    x = torch.randn(m, k)
    q, sa = ops.nvfp4_quant(x, gs_for(x), True)
    wide = torch.zeros(m, 64, dtype=torch.uint8)
    wide[:, :40] = q
    a = wide[:, :40]  # row stride 64 bytes
    for alpha in (torch.tensor(0.37), torch.tensor([0.37]), torch.tensor([[0.37]])):
        out = ops.nvfp4_mm(a, b, sa, sb, alpha, torch.float32)
        ref, bound = mm_ref64(a, b, sa, sb, alpha)
        check_gemm(out, ref, bound, k, torch.float32)
        assert torch.equal(out, ops.nvfp4_mm(q, b, sa, sb, alpha, torch.float32))


@pytest.mark.parametrize("xdtype", HALF)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w4a16_vs_float64(xdtype, out_dtype):
    n, k = 24, 144
    _, b, sb, gb = quantized(n, k)
    walpha = 1 / gb
    for m in MM_M:
        x = torch.randn(m, k).to(xdtype)
        bias = torch.randn(n) if m % 2 else None
        out = ops.nvfp4_w4a16_mm(x, b, sb, walpha, out_dtype, bias)
        assert out.dtype == out_dtype and out.shape == (m, n)
        B = deq64(b, sb)
        X = x.double()
        ref = float(walpha) * (X @ B.t()) + (bias.double() if bias is not None else 0)
        bound = float(walpha) * (X.abs() @ B.abs().t())
        check_gemm(out, ref, bound, k, out_dtype)


def test_nan_scale_poisons_only_its_row():
    m, n, k = 6, 16, 64
    _, b, sb, gb = quantized(n, k)
    x = torch.randn(m, k)
    x[2, 33] = float("nan")
    x[4, 0] = float("inf")
    gs = gs_for(x)
    a, sa = ops.nvfp4_quant(x, gs, True)
    out = ops.nvfp4_mm(a, b, sa, sb, (1 / gs) * (1 / gb), torch.bfloat16)
    ref, bound = mm_ref64(a, b, sa, sb, (1 / gs) * (1 / gb))
    nan_rows = torch.zeros(m, dtype=torch.bool)
    nan_rows[2] = True
    check_gemm(out, ref, bound, k, torch.bfloat16, nan_rows)


# ----------------------------------------------------------------------------
# Hypothesis: shapes, strides, values
# ----------------------------------------------------------------------------

K_VALUES = [16, 48, 80, 112, 144, 208, 272, 336]  # multiples of 16, mostly not powers of two


@st.composite
def quant_case(draw):
    m = draw(st.one_of(st.sampled_from([0, 1, 3, 17, 129]), st.integers(0, 300)))
    k = draw(st.sampled_from(K_VALUES))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    kind = draw(st.sampled_from(["normal", "zeros", "tiny", "huge", "nan", "inf", "mixed"]))
    pad = draw(st.sampled_from([0, 0, 16, 40]))
    mult = draw(st.sampled_from([1.0, 1.0, 1e3, 1e-3]))
    return m, k, dtype, kind, pad, mult


def make_values(m, k, dtype, kind, pad):
    big = {torch.float16: 6e4, torch.bfloat16: 1e37, torch.float32: 1e37}[dtype]
    tiny = {torch.float16: 1e-7, torch.bfloat16: 1e-37, torch.float32: 1e-37}[dtype]
    x = torch.randn(m, k + pad)
    if kind == "zeros":
        x.zero_()
    elif kind == "tiny":
        x *= tiny
    elif kind == "huge":
        x = x.clamp(-1, 1) * big
    elif kind == "mixed" and m:
        x *= torch.exp(torch.randn(m, 1) * 6).clamp(max=1e4)
    if kind in ("nan", "inf", "mixed") and m:
        rows = torch.randint(0, m, (max(1, m // 4),))
        cols = torch.randint(0, k, rows.shape)
        val = {"nan": float("nan"), "inf": float("inf"), "mixed": float("-inf")}[kind]
        x[rows, cols] = val
    x = x.to(dtype)
    return x[:, :k]  # row stride k + pad


@given(quant_case())
def test_hypothesis_quant_and_gemm(case):
    m, k, dtype, kind, pad, mult = case
    x = make_values(m, k, dtype, kind, pad)
    gs = gs_for(x, mult)
    for swizzle in (False, True):  # the swizzled (q, s) feed the GEMM below
        q, s = ops.nvfp4_quant(x, gs, swizzle)
        check_quant(x, gs, q, s, swizzle)
    # W4A4 GEMM on the quantized activation: NaN blocks poison exactly their rows
    n = 16
    _, b, sb, gb = quantized(n, k)
    alpha = (1 / gs) * (1 / gb)
    out = ops.nvfp4_mm(q, b, s, sb, alpha, torch.float32)
    ref, bound = mm_ref64(q, b, s, sb, alpha)
    nan_rows = ref_quant(x, gs)[1].isnan().any(dim=1)
    check_gemm(out, ref, bound, k, torch.float32, nan_rows)


@given(st.integers(0, 300), st.sampled_from(K_VALUES), st.sampled_from([1, 8, 17, 32]),
       st.sampled_from(HALF), st.booleans())
def test_hypothesis_w4a16(m, k, n, xdtype, with_bias):
    _, b, sb, gb = quantized(n, k)
    x = torch.randn(m, k).to(xdtype)
    bias = torch.randn(n) if with_bias else None
    out = ops.nvfp4_w4a16_mm(x, b, sb, 1 / gb, torch.float32, bias)
    B = deq64(b, sb)
    ref = float(1 / gb) * (x.double() @ B.t()) + (bias.double() if with_bias else 0)
    check_gemm(out, ref, float(1 / gb) * (x.double().abs() @ B.abs().t()), k, torch.float32)


# ----------------------------------------------------------------------------
# Bad inputs: ValueError naming the argument
# ----------------------------------------------------------------------------


def _mm_args(m=5, n=16, k=64):
    _, a, sa, ga = quantized(m, k)
    _, b, sb, gb = quantized(n, k)
    return dict(a=a, b=b, a_scales=sa, b_scales=sb, alpha=(1 / ga) * (1 / gb))


def _bad_cases():
    x = torch.randn(5, 64)
    gs = torch.tensor(1.0)
    mm = _mm_args()
    w = dict(x=torch.randn(5, 64, dtype=torch.bfloat16), b=mm["b"], b_scales=mm["b_scales"],
             weight_alpha=torch.tensor(1.0))

    def q(**kw):
        args = dict(x=x, global_scale=gs)
        args.update(kw)
        return lambda: ops.nvfp4_quant(args["x"], args["global_scale"], True)

    def g(**kw):
        args = dict(mm, out_dtype=torch.bfloat16, bias=None)
        args.update(kw)
        return lambda: ops.nvfp4_mm(args["a"], args["b"], args["a_scales"], args["b_scales"], args["alpha"],
                                    args["out_dtype"], args["bias"])

    def h(**kw):
        args = dict(w, out_dtype=torch.bfloat16, bias=None)
        args.update(kw)
        return lambda: ops.nvfp4_w4a16_mm(args["x"], args["b"], args["b_scales"], args["weight_alpha"],
                                          args["out_dtype"], args["bias"])

    lin = N.unswizzle_block_scales(mm["a_scales"], 5, 4)
    return [
        ("x", q(x=x.to(torch.int32))),
        ("x", q(x=torch.randn(2, 5, 64))),
        ("x", q(x=torch.randn(5, 24))),
        ("x", q(x=torch.randn(5, 0))),
        ("x", q(x=torch.randn(64, 5).t())),
        ("global_scale", q(global_scale=torch.tensor(1.0, dtype=torch.float64))),
        ("global_scale", q(global_scale=torch.ones(2))),
        ("global_scale", q(global_scale=torch.tensor(1.0, device="meta"))),
        ("a", g(a=mm["a"].view(E4M3))),
        ("a", g(a=torch.zeros(5, 12, dtype=torch.uint8))),
        ("a", g(a=torch.zeros(64, 5, dtype=torch.uint8).t())),
        ("b", g(b=torch.zeros(32, 16, dtype=torch.uint8).t())),
        ("b", g(b=torch.zeros(16, 24, dtype=torch.uint8))),
        ("a_scales", g(a_scales=lin)),
        ("a_scales", g(a_scales=mm["a_scales"].float())),
        ("b_scales", g(b_scales=torch.zeros(256, 4, dtype=E4M3))),
        ("b_scales", g(b_scales=torch.zeros(4, 128, dtype=E4M3).t())),
        ("alpha", g(alpha=torch.ones(2))),
        ("alpha", g(alpha=torch.tensor(1, dtype=torch.int32))),
        ("out_dtype", g(out_dtype=torch.int32)),
        ("bias", g(bias=torch.zeros(15))),
        ("bias", g(bias=torch.zeros(16, dtype=torch.int64))),
        ("bias", g(bias=torch.zeros(16, device="meta"))),
        ("x", h(x=torch.randn(5, 64))),
        ("b", h(x=torch.randn(5, 80, dtype=torch.bfloat16))),
        ("b_scales", h(b_scales=N.unswizzle_block_scales(mm["b_scales"], 16, 4))),
        ("weight_alpha", h(weight_alpha=torch.ones(3))),
        ("out_dtype", h(out_dtype=torch.float64)),
        ("s", lambda: ops.swizzle_block_scales(torch.zeros(4, dtype=E4M3))),
        ("s", lambda: ops.unswizzle_block_scales(torch.zeros(128, 4, dtype=E4M3), 5, 8)),
        ("s", lambda: ops.unswizzle_block_scales(torch.zeros(4, 128, dtype=E4M3).t(), 5, 4)),
        ("rows", lambda: N.unswizzle_block_scales(torch.zeros(128, 4, dtype=E4M3), -1, 4)),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_inputs_name_the_argument(i):
    arg, fn = _bad_cases()[i]
    with pytest.raises(ValueError, match=rf": {arg}: expected"):
        fn()


# ----------------------------------------------------------------------------
# opcheck, FakeTensor, torch.compile
# ----------------------------------------------------------------------------


def _opcheck_sets():
    sets = []
    for m, k, n, dtype in [(0, 32, 16, torch.bfloat16), (1, 48, 8, torch.float16), (17, 80, 40, torch.float32),
                           (130, 16, 3, torch.bfloat16)]:
        x = torch.randn(m, k).to(dtype)
        gs = gs_for(x)
        sets.append((ops.nvfp4_quant.default, (x, gs), {"swizzle": True}))
        sets.append((ops.nvfp4_quant.default, (x, gs.reshape(1), False), {}))
        a, sa = ops.nvfp4_quant(x, gs, True)
        _, b, sb, gb = quantized(n, k)
        alpha = (1 / gs) * (1 / gb)
        bias = torch.randn(n, dtype=torch.bfloat16)
        sets.append((ops.nvfp4_mm.default, (a, b, sa, sb, alpha), {}))
        sets.append((ops.nvfp4_mm.default, (a, b, sa, sb, alpha.reshape(1), torch.float32, bias), {}))
        xh = x.to(torch.float16)
        sets.append((ops.nvfp4_w4a16_mm.default, (xh, b, sb, 1 / gb), {"bias": bias}))
        sets.append((ops.nvfp4_w4a16_mm.default, (xh, b, sb, (1 / gb).reshape(1), torch.float16), {}))
        sets.append((ops.swizzle_block_scales.default, (N.unswizzle_block_scales(sa, m, k // 16),), {}))
        sets.append((ops.unswizzle_block_scales.default, (sa, m, k // 16), {}))
    return sets


def test_opcheck_every_op():
    seen = set()
    for op, args, kwargs in _opcheck_sets():
        opcheck(op, args, kwargs)
        seen.add(op.name())
    assert seen == {"scaledmm::nvfp4_quant", "scaledmm::nvfp4_mm", "scaledmm::nvfp4_w4a16_mm",
                    "scaledmm::swizzle_block_scales", "scaledmm::unswizzle_block_scales"}


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for m in (0, 1, 3, 129, 300):
            x = torch.empty(m, 80, dtype=torch.bfloat16)
            gs = torch.empty(())
            q, s = ops.nvfp4_quant(x, gs)
            assert q.shape == (m, 40) and q.dtype == torch.uint8
            assert s.shape == ((m + 127) // 128 * 128, 8) and s.dtype == E4M3
            q2, s2 = ops.nvfp4_quant(x, gs, False)
            assert s2.shape == (m, 5)
            b = torch.empty(24, 40, dtype=torch.uint8)
            sb = torch.empty(128, 8, dtype=E4M3)
            out = ops.nvfp4_mm(q, b, s, sb, gs, torch.float16)
            assert out.shape == (m, 24) and out.dtype == torch.float16
            out = ops.nvfp4_w4a16_mm(x, b, sb, gs)
            assert out.shape == (m, 24) and out.dtype == torch.bfloat16
            assert ops.unswizzle_block_scales(s, m, 5).shape == (m, 5)
            assert ops.swizzle_block_scales(s2).shape == s.shape
        with pytest.raises(ValueError, match="a_scales"):
            ops.nvfp4_mm(q, b, s2, sb, gs)


def test_compile_dynamic_one_graph_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    n, k = 24, 80
    _, b, sb, gb = quantized(n, k)
    bias = torch.randn(n, dtype=torch.bfloat16)

    def f(x, gs):
        q, s = ops.nvfp4_quant(x, gs)
        y = ops.nvfp4_mm(q, b, s, sb, (1 / gs) * (1 / gb), torch.bfloat16, bias)
        z = ops.nvfp4_w4a16_mm(x, b, sb, 1 / gb, torch.float32)
        lin = ops.unswizzle_block_scales(s, x.shape[0], k // 16)
        return y.float() + 1.0, z, ops.swizzle_block_scales(lin)

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, backend=cnt, fullgraph=True, dynamic=True)
    for m in (2, 3, 17, 40):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        gs = gs_for(x)
        for got, exp in zip(cf(x, gs), f(x, gs)):
            assert got.shape == exp.shape and got.dtype == exp.dtype
            assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3 else got,
                               exp.view(torch.uint8) if exp.dtype == E4M3 else exp)
    assert cnt.frame_count == 1, f"recompiled: {cnt.frame_count} compiles"


# ----------------------------------------------------------------------------
# Registry, sm100 backends (argument preparation and gates, on CPU)
# ----------------------------------------------------------------------------


def test_backends_registered_with_op_signatures():
    names = backends.names("nvfp4")
    assert {"reference", "torch", "flashinfer_cutedsl"} <= set(names)
    schema_args = {
        "nvfp4_quant": ["x", "global_scale", "swizzle"],
        "nvfp4_mm": ["a", "b", "a_scales", "b_scales", "alpha", "out_dtype", "bias"],
        "nvfp4_w4a16_mm": ["x", "b", "b_scales", "weight_alpha", "out_dtype", "bias"],
    }
    for op_name, args in schema_args.items():
        assert [a.name for a in getattr(ops, op_name).default._schema.arguments] == args
    for name in ("reference", "torch", "flashinfer_cutedsl"):
        for op_name, impl in backends.get("nvfp4", name).impls.items():
            params = list(inspect.signature(impl).parameters)
            assert len(params) == len(schema_args[op_name]), (name, op_name, params)
    assert set(backends.get("nvfp4", "reference").impls) == set(schema_args)
    assert backends.priority("nvfp4", "cpu") == ["reference"]


@pytest.mark.skipif(N.FP4_DTYPE is None, reason="torch without float4_e2m1fn_x2")
@pytest.mark.parametrize("m,pad", [(0, 0), (1, 0), (3, 16), (130, 0)])
def test_torch_backend_args_are_views(m, pad):
    n, k = 48, 96
    base = torch.randint(0, 256, (m, k // 2 + pad), dtype=torch.uint8)
    a = base[:, : k // 2]
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    sa = torch.zeros(N.swizzled_shape(m, k // 16), dtype=E4M3)
    sb = torch.zeros(N.swizzled_shape(n, k // 16), dtype=E4M3)
    args, kwargs = N.torch_backend_args(a, b, sa, sb)
    a4, b4, s_a, s_b = args
    assert kwargs == {"out_dtype": torch.float32}
    assert a4.dtype == torch.float4_e2m1fn_x2 and a4.shape == (m, k // 2) and a4.stride() == a.stride()
    assert b4.dtype == torch.float4_e2m1fn_x2 and b4.shape == (k // 2, n) and b4.stride() == (1, k // 2)
    assert s_a.dtype == E4M3 and s_a.dim() == 1 and s_a.numel() == sa.numel()
    assert s_b.dtype == E4M3 and s_b.dim() == 1 and s_b.numel() == sb.numel()
    for view, src in ((a4, a), (b4, b), (s_a, sa), (s_b, sb)):
        assert view.data_ptr() == src.data_ptr(), "argument preparation must not copy"
    # torch's own shape/layout checks for _scaled_mm (the meta kernel applies the CUDA rules)
    metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (a, b, sa, sb)]
    margs, mkw = N.torch_backend_args(*metas)
    out = torch._scaled_mm(*margs, **mkw)
    assert out.shape == (m, n) and out.dtype == torch.float32
    with pytest.raises(RuntimeError):  # the same check rejects scales of the wrong size
        torch._scaled_mm(margs[0], margs[1], margs[2], margs[3][:-4], **mkw)


def _fake_scaled_mm(a4, b4, scale_a, scale_b, out_dtype=None):
    """What cuBLASLt computes for the NVFP4 recipe, from torch's argument layout."""
    a = a4.view(torch.uint8)
    b = b4.t().view(torch.uint8)
    k16 = 2 * a.shape[1] // 16
    sa = scale_a.view(N.swizzled_shape(a.shape[0], k16))
    sb = scale_b.view(N.swizzled_shape(b.shape[0], k16))
    return (N.dequantize(a, sa) @ N.dequantize(b, sb).t()).to(out_dtype)


@pytest.mark.skipif(N.FP4_DTYPE is None, reason="torch without float4_e2m1fn_x2")
def test_torch_backend_epilogue_with_emulated_scaled_mm(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm)
    m, n, k = 5, 32, 64
    _, a, sa, ga = quantized(m, k)
    _, b, sb, gb = quantized(n, k)
    alpha = (1 / ga) * (1 / gb)
    bias = torch.randn(n, dtype=torch.bfloat16)
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = N.torch_mm(a, b, sa, sb, alpha, out_dtype, bias)
        exp = N.reference_mm(a, b, sa, sb, alpha, out_dtype, bias)
        assert got.dtype == out_dtype and torch.equal(got, exp)


def test_torch_backend_gate_reasons(monkeypatch):
    be = backends.get("nvfp4", "torch")
    ok, why = be.is_supported(torch.device("cpu"))
    assert not ok and "CUDA device" in why
    if N.FP4_DTYPE is None:
        return
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    for cap, want in (((9, 0), False), ((8, 9), False), ((10, 0), True), ((10, 3), True), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        ok, why = be.is_supported(cuda)
        assert ok == want, (cap, why)
        if not ok:
            assert f"sm{cap[0]}{cap[1]}" in why
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    ok, why = be.is_supported(cuda)
    assert not ok and "12.8" in why
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not be.is_supported(cuda)[0]


def _problem(m=8, n=32, k=64, stride=None, out_dtype=torch.bfloat16, w4a16=False):
    return backends.Problem(backends.Family.NVFP4, torch.device("cuda", 0), m, n, k,
                            torch.bfloat16 if w4a16 else torch.uint8, out_dtype,
                            k if stride is None else stride, (("bias", False), ("w4a16", w4a16)))


@pytest.mark.parametrize("name", ["torch", "flashinfer_cutedsl"])
def test_sm100_backends_can_implement(name):
    ci = backends.get("nvfp4", name).can_implement
    assert ci(_problem())[0]
    assert ci(_problem(m=0))[0] and ci(_problem(m=3))[0]
    ok, why = ci(_problem(k=48))
    assert not ok and "K % 32" in why
    ok, why = ci(_problem(n=24))
    assert not ok and "N % 16" in why
    ok, why = ci(_problem(w4a16=True))
    assert not ok and "W4A4" in why
    ok, why = ci(_problem(stride=80))
    assert not ok and "stride" in why
    if name == "flashinfer_cutedsl":
        ok, why = ci(_problem(out_dtype=torch.float32))
        assert not ok and "out_dtype" in why
    else:
        assert ci(_problem(out_dtype=torch.float32))[0] and ci(_problem(stride=128))[0]


def _fake_flashinfer(with_cute_dsl=True, calls=None):
    mod = types.ModuleType("flashinfer")
    lit = typing.Literal["cudnn", "trtllm", "cutlass", "cute-dsl", "auto"] if with_cute_dsl else \
        typing.Literal["cudnn", "trtllm", "cutlass", "auto"]

    def mm_fp4(a, b, a_descale, b_descale, alpha=None, out_dtype=torch.bfloat16, out=None,
               block_size=16, use_8x4_sf_layout=False, backend: lit = "auto", use_nvfp4=True):
        # FlashInfer's documented layout: b is (K/2, N) column-major, b_descale
        # the transposed swizzled (N', K/16') scales; alpha a one-element fp32.
        assert b.stride(0) == 1 and b_descale.stride(0) == 1 and alpha.numel() == 1
        if calls is not None:
            calls.append(backend)
        acc = N.dequantize(a, a_descale) @ N.dequantize(b.t(), b_descale.t()).t()
        return (acc * alpha).to(out_dtype)

    mm_fp4.__annotations__["backend"] = lit
    mod.mm_fp4 = mm_fp4
    return mod


def test_flashinfer_gate_reasons(monkeypatch):
    be = backends.get("nvfp4", "flashinfer_cutedsl")
    try:
        import flashinfer  # noqa: F401
        has_flashinfer = True
    except Exception:
        has_flashinfer = False
    ok, why = be.is_supported(torch.device("cpu"))
    assert not ok
    if not has_flashinfer:
        assert "flashinfer is not installed" in why
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(with_cute_dsl=False))
    ok, why = be.is_supported(torch.device("cpu"))
    assert not ok and "cute-dsl" in why
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    ok, why = be.is_supported(torch.device("cpu"))
    assert not ok and "CUDA device" in why
    cuda = torch.device("cuda", 0)
    for cap, want in (((9, 0), False), ((12, 0), False), ((10, 0), True), ((10, 3), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        ok, why = be.is_supported(cuda)
        assert ok == want, (cap, why)
        if not ok:
            assert f"sm{cap[0]}{cap[1]}" in why


def test_flashinfer_backend_call_with_emulated_mm_fp4(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(calls=calls))
    m, n, k = 5, 32, 64
    _, a, sa, ga = quantized(m, k)
    _, b, sb, gb = quantized(n, k)
    alpha = (1 / ga) * (1 / gb)
    bias = torch.randn(n, dtype=torch.bfloat16)
    got = N.flashinfer_cutedsl_mm(a, b, sa, sb, alpha, torch.bfloat16, bias)
    exp = N.reference_mm(a, b, sa, sb, alpha, torch.float32)
    assert calls == ["cute-dsl"]
    assert torch.equal(got, (exp.bfloat16().float() + bias.float()).bfloat16())
    assert N.flashinfer_cutedsl_mm(a[:0], b, sa[:0], sb, alpha, torch.float16, None).shape == (0, n)


# ----------------------------------------------------------------------------
# GPU: the same numerics with the auto-selected backend
# ----------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("swizzle", [True, False])
def test_cuda_quant_matches_spec(dtype, swizzle):
    for m in (0, 1, 3, 17, 129, 300):
        for k in (64, 208, 4096):
            x = (torch.randn(m, k, device="cuda") * 3).to(dtype)
            if m > 2:
                x[1, 5] = float("nan")
                x[2, 7] = float("inf")
            gs = gs_for(x).cuda()
            q, s = ops.nvfp4_quant(x, gs, swizzle)
            assert q.is_cuda and s.is_cuda
            check_quant(x, gs, q, s, swizzle)


@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_mm_and_w4a16_vs_float64(out_dtype):
    for n, k, ms in ((96, 256, (0, 1, 3, 17, 129, 300)), (40, 208, (1, 5, 130)), (4096, 4096, (1, 17, 129))):
        _, b, sb, gb = quantized(n, k, device="cuda")
        B = deq64(b, sb)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x, a, sa, ga = quantized(m, k, device="cuda", dtype=torch.bfloat16, scale=2.0)
            if m > 2:
                x[1, 3] = float("nan")
                a, sa = ops.nvfp4_quant(x, ga, True)
            alpha = (1 / ga) * (1 / gb)
            out = ops.nvfp4_mm(a, b, sa, sb, alpha, out_dtype, bias)
            ref, bound = mm_ref64(a, b, sa, sb, alpha.cpu(), bias, B)
            nan_rows = torch.zeros(m, dtype=torch.bool)
            if m > 2:
                nan_rows[1] = True
            check_gemm(out, ref, bound, k, out_dtype, nan_rows)
            xh = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = ops.nvfp4_w4a16_mm(xh, b, sb, 1 / gb, out_dtype, bias)
            X = xh.double().cpu()
            wa = float(1 / gb)
            check_gemm(out, wa * (X @ B.t()) + bias.double().cpu(), wa * (X.abs() @ B.abs().t()), k, out_dtype)


@requires_cuda
def test_cuda_graph_capture_and_replay():
    n, k = 256, 512
    _, b, sb, gb = quantized(n, k, device="cuda")
    x = torch.randn(7, k, device="cuda", dtype=torch.bfloat16)
    gs = gs_for(x).cuda()
    alpha = (1 / gs) * (1 / gb)

    def f():
        q, s = ops.nvfp4_quant(x, gs)
        return ops.nvfp4_mm(q, b, s, sb, alpha, torch.bfloat16)

    f()  # warm up (compilation, autotuning) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f()
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, f())
