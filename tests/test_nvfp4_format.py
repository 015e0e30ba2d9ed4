"""NVFP4 format: the e2m1 codes, packing, the e4m3 scale cast and the swizzled
scale layout, against the float64 model in ``nvfp4_helpers``."""

from __future__ import annotations

import pytest
import torch

import scaledmm  # noqa: F401  (registers the ops)
from scaledmm.ops import nvfp4 as N

from nvfp4_helpers import ref_e2m1_codes, ref_e4m3, ref_unswizzle, swizzle_offsets

ops = torch.ops.scaledmm
E4M3 = torch.float8_e4m3fn


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
