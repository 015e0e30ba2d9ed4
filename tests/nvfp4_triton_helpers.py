"""SPEC references for the NVFP4 Triton backend tests, written from SPEC.md
independently of ``ops/nvfp4.py``: the quantizer in float32 exactly as SPEC
states it, with the e2m1 rounding done as a nearest-value search in float64
(ties to the even code); the GEMMs in float64 on the decoded operands.  Also
the markers that split the tests between the main process and the
interpreter child."""

from __future__ import annotations

import os

import pytest
import torch

from scaledmm.backends import Family, Problem
from scaledmm.ops import nvfp4_triton as nt
from helpers import poison_, run_under_interpreter

INTERP_CHILD_ENV = "SCALEDMM_NVFP4_INTERP_CHILD"
CHILD = os.environ.get(INTERP_CHILD_ENV) == "1"
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter subprocess (test_interpreter_suite)")
parent = pytest.mark.skipif(CHILD, reason="main-process test")


def run_interpreter_child(test_file: str) -> None:
    """Re-run ``test_file`` under ``TRITON_INTERPRET=1``, where only its
    ``@interp`` tests run."""
    run_under_interpreter(test_file, {INTERP_CHILD_ENV: "1"})

FP8 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ----------------------------------------------------------------------------
# SPEC references
# ----------------------------------------------------------------------------


def swz_offsets(rows: int, cols: int, device="cpu") -> torch.Tensor:
    """SPEC's flat offset of S[r, c] in the swizzled layout, ``[R', C']`` int64."""
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    r = torch.arange(rp, device=device).view(-1, 1)
    c = torch.arange(cp, device=device).view(1, -1)
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle(s: torch.Tensor) -> torch.Tensor:
    rows, cols = s.shape
    off = swz_offsets(rows, cols, s.device)
    flat = torch.zeros(off.numel(), dtype=torch.uint8, device=s.device)
    padded = torch.zeros(off.shape, dtype=torch.uint8, device=s.device)
    padded[:rows, :cols] = s.view(torch.uint8)
    flat[off.flatten()] = padded.flatten()
    return flat.view(off.shape).view(FP8)


def unswizzle(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    off = swz_offsets(rows, cols, s.device)
    return s.view(torch.uint8).flatten()[off.flatten()].view(off.shape)[:rows, :cols].view(FP8)


def e2m1_nearest(v: torch.Tensor) -> torch.Tensor:
    """Code (sign << 3 | index) of the nearest e2m1 value to ``v`` (|v| <= 6),
    a tie going to the even index: a float64 nearest-value search."""
    a = v.double().abs().unsqueeze(-1)
    d = (a - E2M1.to(v.device)).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best)
    even = cand & (torch.arange(8, device=v.device) % 2 == 0)
    idx = torch.where(even.any(-1), even.int().argmax(-1), cand.int().argmax(-1))
    return idx.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def spec_quant(x: torch.Tensor, gs: torch.Tensor, swz: bool):
    """SPEC's recipe: fp32 arithmetic in the order written, s = e4m3(gs * (amax
    * (1/6))) and codes of x * (1 / (s * (1 / gs))) with IEEE reciprocals
    (``torch.reciprocal``, on the GPU too), torch's e4m3 cast (nearest even)
    after clamping (saturation), nearest-even e2m1; on x's device."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 16, 16)
    g = gs.to(x.device).float().reshape(())
    amax = xb.abs().amax(-1)
    sixth = torch.reciprocal(amax.new_full((), 6.0))
    s8 = (g * (amax * sixth)).clamp(max=448.0).to(FP8)
    sf = s8.float().unsqueeze(-1)
    v = (xb * torch.reciprocal(sf * torch.reciprocal(g))).clamp(-6.0, 6.0)
    codes = torch.where(sf == 0, torch.zeros_like(v, dtype=torch.uint8), e2m1_nearest(v)).reshape(m, k)
    q = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return q, (swizzle(s8) if swz else s8)


def decode(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 ``[R, K]`` values of packed codes with swizzled scales, on q's device."""
    rows, k = q.shape[0], 2 * q.shape[1]
    codes = torch.stack((q & 15, q >> 4), -1).reshape(rows, k).long()
    val = E2M1.to(q.device)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    return val * unswizzle(s, rows, k // 16).double().repeat_interleave(16, dim=1)


def ref_mm(xa: torch.Tensor, wb: torch.Tensor, alpha, bias) -> torch.Tensor:
    """float64 ``alpha * xa @ wb.T (+ bias)`` on ``xa``'s device."""
    out = (xa.double() @ wb.to(xa.device).double().t()) * float(alpha)
    if bias is not None:
        out = out + bias.to(out.device).double()
    return out


def quantized(rows: int, k: int, device, scale: float = 1.0, gs: float = 1.0, dtype=torch.float32):
    x = (torch.randn(rows, k) * scale).to(dtype).to(device)
    g = torch.tensor(gs, device=device)
    q, s = spec_quant(x, g, True)
    return q.to(device), s.to(device)


# ----------------------------------------------------------------------------
# Shared by the test files
# ----------------------------------------------------------------------------


def same_bits(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# every kernel variant; the rows_* ones once with one loop step per program
# (fast in the interpreter) and once with several (the prefetch path)
Q = nt.QuantConfig
QCFGS = [nt.DEFAULT_QUANT, Q(32, 8, 8, "rows_fma"), Q(32, 8, 8, "rows_pred")]
QCFGS_STEPS = [Q(16, 8, 1, "rows_fma"), Q(8, 8, 1, "rows_pred"), Q(32, 16, 2, "rows_fma", 2)]


def special_rows():
    """gs = 1: row 0 has amax 6, so s = 1 and every e2m1 midpoint is hit exactly."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5,
                         -3.5, -5.0, -6.0])
    return torch.stack([mids,
                        torch.zeros(16),                                    # s = 0 -> all codes 0
                        torch.full((16,), 1e-30),                           # s underflows to 0
                        torch.tensor([1e30] + [1.0] * 15),                  # saturates at 448
                        torch.tensor([3e-2] + [-1e-2] * 15),                # e4m3 subnormal scale
                        torch.tensor([float("inf")] + [2.0] * 15),
                        torch.tensor([-0.0] * 8 + [1.0] * 8),               # -0 keeps its sign bit
                        torch.tensor([-float("inf")] + [-0.0] * 15),
                        torch.tensor([6.0] + [-1e-30] * 15)])               # tiny negatives: code 8


def poison_mm_output(monkeypatch):
    real = nt.nv.mm_output
    monkeypatch.setattr(nt.nv, "mm_output", lambda a, b, dt: poison_(real(a, b, dt)))


def triton_problem(m, n=4096, k=4096, w4a16=False, device="cpu"):
    return Problem(Family.NVFP4, torch.device(device), m, n, k, torch.bfloat16 if w4a16 else torch.uint8,
                   torch.bfloat16, k, (("bias", False), ("w4a16", w4a16)))
