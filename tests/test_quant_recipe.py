"""The quantizers round as SPEC.md's recipes say, bit for bit, on every backend.

SPEC ``nvfp4_quant``, per block of 16, in fp32: ``s = e4m3(gs * (amax * (1/6)))``
(nearest even, saturating); codes = e2m1 nearest-even of
``x * (1 / (s * (1 / gs)))`` (0 where ``s == 0``), each ``1/v`` an fp32
reciprocal.  SPEC ``quant_fp8``: ``q = e4m3(clamp(x * (1 / scale), -448, 448))``.
That is the order of the production quantizers (vLLM, TensorRT-LLM,
FlashInfer); the first versions of ours rounded ``gs * amax / 6`` and
``x * gs / s`` / ``x / scale`` instead, which differ at ties.

The model here is written from SPEC's text alone: NumPy float32 arithmetic
(IEEE single precision, one rounding per operation, in SPEC's order) and
e4m3 / e2m1 roundings done as nearest-value searches over the enumerated grids
(ties to the even code).  Nothing of ``ops/`` is used by it.  Compared bit for
bit against it:

* the CPU reference backends (main process);
* the Triton kernels under ``TRITON_INTERPRET=1`` (a child pytest process,
  :func:`test_triton_kernels_in_interpreter`; small shapes);
* on a GPU (``gpu`` marker): the Triton kernels, the torch reference on CUDA
  and the ops as dispatched.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledmm  # noqa: F401  (registers the ops)

from helpers import run_under_interpreter

CHILD_VAR = "SCALEDMM_QUANT_RECIPE_CHILD"
CHILD = os.environ.get(CHILD_VAR) == "1"
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter child (test_triton_kernels_in_interpreter)")
parent = pytest.mark.skipif(CHILD, reason="main-process test")
# the child would run GPU tests on the interpreter
requires_gpu = pytest.mark.skipif(CHILD or not torch.cuda.is_available(), reason="needs a CUDA device")

OPS = torch.ops.scaledmm
F32 = np.float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ----------------------------------------------------------------------------
# The model (NumPy, from SPEC.md's text)
# ----------------------------------------------------------------------------

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: finite non-negative e4m3fn values by bit pattern 0..126 (bias 7, subnormals below 2**-6)
E4M3 = np.array([(b % 8) / 8 * 2.0 ** -6 if b < 8 else (1 + (b % 8) / 8) * 2.0 ** (b // 8 - 7) for b in range(127)])
assert E4M3[-1] == 448.0 and np.all(np.diff(E4M3) > 0)
E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SIXTH = F32(1) / F32(6)  # SPEC's (1/6): the fp32 reciprocal of 6


def nearest_even(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest each ``v`` (float64, 0 <= v <= grid[-1]),
    a tie taking the even index.  Exact: near a tie ``v`` (an fp32 value) and
    the grid points are close, so the float64 differences are exact."""
    hi = np.searchsorted(grid, v)  # first grid value >= v
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = v - grid[lo], grid[hi] - v
    return np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))


def e4m3_bits(v) -> np.ndarray:
    """e4m3fn bit patterns of fp32 values: nearest even, saturating at +-448, NaN -> 0x7F."""
    v = np.asarray(v, dtype=np.float64)
    mag = np.minimum(np.abs(np.nan_to_num(v, nan=0.0)), 448.0)
    bits = nearest_even(mag, E4M3) | (np.signbit(v).astype(np.int64) << 7)
    return np.where(np.isnan(v), 0x7F, bits).astype(np.uint8)


def e4m3_value(bits: np.ndarray) -> np.ndarray:
    mag = np.where((bits & 0x7F) == 0x7F, np.nan, E4M3[np.minimum(bits & 0x7F, 126)])
    return np.where(bits & 0x80, -mag, mag).astype(F32)


def nvfp4_model(x: np.ndarray, gs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SPEC's ``nvfp4_quant`` of float32 ``x`` [M, K] with fp32 ``gs``:
    codes uint8 [M, K] (sign bit 3 = x's), scale bits uint8 [M, K/16], and a
    bool [M, K] marking blocks whose scaled values include a NaN (codes
    unspecified there)."""
    m, k = x.shape
    xb = x.astype(F32).reshape(m, k // 16, 16)
    gs = F32(gs)
    with np.errstate(all="ignore"):
        amax = np.abs(xb).max(axis=-1)  # NaN propagates
        s_bits = e4m3_bits(gs * (amax * SIXTH))
        s = e4m3_value(s_bits)[..., None]
        y = xb * (F32(1) / (s * (F32(1) / gs)))
    mag = nearest_even(np.minimum(np.abs(np.nan_to_num(y, nan=0.0)), F32(6)).astype(np.float64), E2M1)
    codes = np.where(s == 0, 0, mag | (np.signbit(xb).astype(np.int64) << 3)).astype(np.uint8)
    unspecified = np.broadcast_to(np.isnan(y).any(-1, keepdims=True) & (s != 0), xb.shape)
    return codes.reshape(m, k), s_bits, unspecified.reshape(m, k)


def fp8_model(x: np.ndarray, scale) -> np.ndarray:
    """SPEC's ``quant_fp8`` codes (uint8 bits) of float32 ``x`` with fp32 ``scale``
    (one value, or [M, 1])."""
    with np.errstate(all="ignore"):
        y = np.clip(x.astype(F32) * (F32(1) / np.asarray(scale, dtype=F32)), F32(-448), F32(448))
    return e4m3_bits(y)


def fp8_dynamic_scale(x: np.ndarray, per_token: bool) -> np.ndarray:
    """max(amax, 1e-10) / 448 in fp32: per row (NaN/Inf included), or over the finite values ([1, 1])."""
    ax = np.abs(x.astype(F32))
    if per_token:
        amax = ax.max(axis=1, keepdims=True)
    else:
        amax = np.where(np.isfinite(ax), ax, F32(0)).max(keepdims=True)
    with np.errstate(all="ignore"):
        return np.maximum(amax, F32(1e-10)) / F32(448)


def old_nvfp4_scale_bits(amax, gs) -> np.ndarray:
    """The first recipe's block scale, e4m3(gs * amax / 6): how the tests know a case tells the two apart."""
    return e4m3_bits((F32(gs) * np.asarray(amax, dtype=F32)) / F32(6))


def unswizzle(s: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] of a swizzled scale tensor, by SPEC's offset formula."""
    cp = s.shape[1]
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    off = ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return s.reshape(-1)[off]


def codes_of(q: torch.Tensor) -> np.ndarray:
    """Unpacked codes [M, K] of packed bytes [M, K/2] (element 2i in the low nibble)."""
    b = q.cpu().numpy()
    return np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], 2 * b.shape[1])


# ----------------------------------------------------------------------------
# Implementations under test
# ----------------------------------------------------------------------------


def _nvfp4_impls() -> dict:
    """name -> f(x, gs, swizzle) -> (q, s), for this process."""
    if not CHILD:
        return {"reference": lambda x, gs, swz: OPS.nvfp4_quant(x, gs, swz)}
    from scaledmm.ops import nvfp4_triton as nt
    cfgs = [nt.DEFAULT_QUANT, nt.QuantConfig(32, 8, 8, "rows_pred"), nt.QuantConfig(32, 8, 4),
            nt.QuantConfig(16, 16, 2, "rows_fma", 2)]
    return {f"triton-{c.label()}": functools.partial(nt.quant, cfg=c) for c in cfgs}


def _fp8_impls() -> dict:
    """name -> f(x, scale, per_token) -> (q, scale), for this process."""
    if not CHILD:
        return {"reference": lambda x, s, pt: OPS.quant_fp8(x, s, pt)}
    from scaledmm.ops import fp8_triton_quant as Q
    cfgs = [None, Q.QuantConfig(2, 16, 1)]  # default tiles; many tiles / K chunks per row
    return {f"triton-{c.label() if c else 'default'}": functools.partial(Q.quant, config=c) for c in cfgs}


NVFP4_IMPLS = _nvfp4_impls()
FP8_IMPLS = _fp8_impls()


def check_nvfp4(quant, x: torch.Tensor, gs: float, swizzle: bool, device="cpu") -> None:
    """``quant``'s codes and block scales equal the model's, bit for bit."""
    m, k = x.shape
    codes, s_bits, unspecified = nvfp4_model(x.float().numpy(), gs)
    q, s = quant(x.to(device), torch.tensor(gs, dtype=torch.float32, device=device), swizzle)
    s = s.cpu().view(torch.uint8).numpy()
    s = unswizzle(s, m, k // 16) if swizzle else s
    nan = (s_bits & 0x7F) == 0x7F
    assert np.array_equal((s & 0x7F) == 0x7F, nan), "NaN block scales"
    bad = (s != s_bits) & ~nan
    assert not bad.any(), (f"{int(bad.sum())} block scales differ, first at {np.argwhere(bad)[0]}: "
                           f"{s[bad][0]} vs {s_bits[bad][0]}")
    got = codes_of(q)
    bad = (got != codes) & ~unspecified
    assert not bad.any(), (f"{int(bad.sum())} codes differ, first at {np.argwhere(bad)[0]}: "
                           f"{got[bad][0]} vs {codes[bad][0]}")


def check_fp8(quant, x: torch.Tensor, scale, per_token: bool, device="cpu") -> None:
    """``quant``'s codes and returned scale equal the model's (NaN codes: NaN of either sign)."""
    xf = x.float().numpy()
    s_model = fp8_dynamic_scale(xf, per_token) if scale is None else scale.numpy()
    want = fp8_model(xf, s_model)
    q, s = quant(x.to(device), None if scale is None else scale.to(device), per_token)
    np.testing.assert_array_equal(s.cpu().numpy().reshape(-1), np.asarray(s_model, F32).reshape(-1))
    got = q.cpu().view(torch.uint8).numpy()
    nan = (want & 0x7F) == 0x7F
    assert np.array_equal((got & 0x7F) == 0x7F, nan), "NaN codes"
    bad = (got != want) & ~nan
    assert not bad.any(), f"{int(bad.sum())} codes differ, first at {np.argwhere(bad)[0]}"


# ----------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------

ISSUE_AMAX, ISSUE_GS = 1.734375, 581.189208984375  # scale 160 in SPEC's order, 176 in the first one's


def issue_block() -> np.ndarray:
    """The issue's block (amax 1.734375; negatives, +-0, fractions of it), then a block of 0.5s."""
    a = F32(ISSUE_AMAX)
    return np.array([[a, -a / 2, a / 3, 0.0, -0.0, a / 4, a / 5, -a / 6, a / 7, a / 8, a / 9, a / 10,
                      a / 11, a / 12, a / 13, -a] + [0.5] * 16], dtype=F32)


def nvfp4_midpoint_rows() -> np.ndarray:
    """gs = 1: for every e4m3 scale s > 0, a block of amax 6 s (scale s) holding
    x = T * s, T / r (r = SPEC's reciprocal of s) and their fp32 neighbours, for
    each e2m1 midpoint T: the values where the two recipes' codes can part."""
    rows = []
    for bits in range(1, 127):
        s = F32(E4M3[bits])
        r = F32(1) / s  # SPEC's 1 / (s * (1 / gs)) at gs = 1
        vals = []
        for t in E2M1_MIDS:
            for base in (F32(t) * s, F32(t) / r):
                vals += [base, np.nextafter(base, F32(0)), np.nextafter(base, F32(np.inf))]
        vals = np.array(vals, dtype=F32) * np.where(np.arange(len(vals)) % 2 == 0, F32(1), F32(-1))
        blocks = [np.concatenate([[F32(6) * s], vals[i:i + 15]]) for i in range(0, len(vals), 15)]
        rows.append(np.concatenate([np.pad(b, (0, 16 - len(b))) for b in blocks]))
    return np.stack(rows).astype(F32)


def old_nvfp4_codes(x: np.ndarray, gs) -> np.ndarray:
    """Magnitude codes of the first recipe, e2m1(x * gs / s), with SPEC's scales
    (to find the values where the code orders differ)."""
    m, k = x.shape
    xb = x.reshape(m, k // 16, 16)
    s = e4m3_value(e4m3_bits(F32(gs) * (np.abs(xb).max(-1) * SIXTH)))[..., None]
    with np.errstate(all="ignore"):
        y = (xb * F32(gs)) / s
    return nearest_even(np.minimum(np.abs(np.nan_to_num(y)), 6.0).astype(np.float64), E2M1).reshape(m, k)


def fp8_midpoints(s) -> np.ndarray:
    """x near every e4m3 midpoint times ``s`` (fp32 products and neighbours),
    |x / s| < 448, alternating signs."""
    mids = (E4M3[1:] + E4M3[:-1]) / 2
    base = (mids * np.float64(s)).astype(F32)
    x = np.concatenate([base, np.nextafter(base, F32(0)), np.nextafter(base, F32(np.inf))])
    x = x[np.abs(x.astype(np.float64) / np.float64(s)) < 448]
    return x * np.where(np.arange(len(x)) % 2 == 0, F32(1), F32(-1))


def old_fp8_codes(x, s) -> np.ndarray:
    with np.errstate(all="ignore"):
        return e4m3_bits(np.clip(x.astype(F32) / np.asarray(s, dtype=F32), F32(-448), F32(448)))


STATIC_SCALES = (0.37, 0.1, 3.0, 0.011, 1.7)


def fp8_cases():
    """(name, x [M, K] float32, static scale or None, per_token), each with
    elements where x / s and x * (1 / s) round to different codes."""
    s = F32(0.37)
    x = fp8_midpoints(s)
    yield "static_tensor", x.reshape(1, -1), torch.tensor(s), False
    rows = [fp8_midpoints(F32(v)) for v in STATIC_SCALES]
    k = min(len(r) for r in rows)
    xt = np.stack([r[:k] for r in rows])
    yield "static_token", xt, torch.tensor(np.array(STATIC_SCALES, F32).reshape(-1, 1)), True
    # dynamic: the amax A sets s = A / 448; the other values sit at midpoints of that s
    dyn = []
    for a in (F32(100.0), F32(3.3), F32(0.07), F32(448.0 * 0.37)):
        sd = a / F32(448)
        v = fp8_midpoints(sd)
        v = v[np.abs(v) < a][:k - 1]
        dyn.append(np.concatenate([[a], v, np.zeros(k - 1 - len(v), F32)]))
    xd = np.stack(dyn).astype(F32)
    yield "dynamic_token", xd, None, True
    yield "dynamic_tensor", xd, None, False


# ----------------------------------------------------------------------------
# Self-checks of the cases: each tells the old order from SPEC's
# ----------------------------------------------------------------------------


@parent
def test_model_issue_example_parts_the_recipes():
    amax, gs = F32(ISSUE_AMAX), F32(ISSUE_GS)
    assert gs * (amax * SIXTH) == F32(168.0)  # a tie between e4m3 160 and 176: even, 160
    assert e4m3_value(e4m3_bits(gs * (amax * SIXTH))) == 160.0
    assert e4m3_value(old_nvfp4_scale_bits(amax, gs)) == 176.0
    _, s_bits, _ = nvfp4_model(issue_block(), gs)
    assert e4m3_value(s_bits)[0, 0] == 160.0


@parent
def test_model_cases_part_the_recipes():
    x = nvfp4_midpoint_rows()
    codes, _, _ = nvfp4_model(x, 1.0)
    assert ((codes & 7) != old_nvfp4_codes(x, 1.0)).sum() >= 20
    for name, xc, scale, per_token in fp8_cases():
        s = fp8_dynamic_scale(xc, per_token) if scale is None else scale.numpy()
        assert (fp8_model(xc, s) != old_fp8_codes(xc, s)).sum() >= 3, name


@parent
def test_model_roundings_on_the_grids():
    """Spot values of the two roundings (ties to even, saturation, signs, NaN)."""
    assert list(e4m3_bits([0.0, -0.0, 2.0 ** -10, 3 * 2.0 ** -10, 168.0, 184.0, 460.0, 1e30, -1e30])) == \
        [0, 0x80, 0, 2, 0x72, 0x74, 0x7E, 0x7E, 0xFE]
    assert e4m3_bits([np.nan])[0] == 0x7F
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    assert list(nearest_even(v, E2M1)) == [0, 2, 2, 4, 4, 6, 6, 7]


# ----------------------------------------------------------------------------
# nvfp4_quant
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", sorted(NVFP4_IMPLS))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("swizzle", [False, True])
def test_nvfp4_issue_example(impl, dtype, swizzle):
    x = torch.from_numpy(issue_block()).to(DTYPES[dtype])
    check_nvfp4(NVFP4_IMPLS[impl], x, ISSUE_GS, swizzle)
    q, s = NVFP4_IMPLS[impl](x, torch.tensor(ISSUE_GS), False)
    assert s[0, 0].float().item() == 160.0


@pytest.mark.parametrize("impl", sorted(NVFP4_IMPLS))
def test_nvfp4_every_scale_at_every_midpoint(impl):
    check_nvfp4(NVFP4_IMPLS[impl], torch.from_numpy(nvfp4_midpoint_rows()), 1.0, False)


@pytest.mark.parametrize("impl", sorted(NVFP4_IMPLS))
def test_nvfp4_nan_poisons_only_its_block(impl):
    x = torch.from_numpy(issue_block()).repeat(3, 1)
    x[1, 5] = float("nan")
    check_nvfp4(NVFP4_IMPLS[impl], x, ISSUE_GS, False)
    _, s = NVFP4_IMPLS[impl](x, torch.tensor(ISSUE_GS), False)
    assert s[1, 0].float().isnan() and not s.float()[[0, 2]].isnan().any() and not s[1, 1].float().isnan()


BLOCK_KINDS = ("random", "ties", "zeros", "small_scale", "saturate", "subnormal", "one_hot", "inf")


def make_block(kind: str, gs, rng: np.random.Generator) -> np.ndarray:
    """16 fp32 values of one kind; ``gs`` is the global scale they will meet.
    Most kinds aim the block scale gs * amax / 6 at a range: normal e4m3
    (2**-6 .. 448), small (subnormal e4m3 or underflow to 0) or saturating."""
    sign = np.where(rng.random(16) < 0.5, F32(-1), F32(1))
    lo, hi = {"small_scale": (-12, -6), "saturate": (9, 40)}.get(kind, (-6, 8.8))
    amax = F32(6 * 2.0 ** rng.uniform(lo, hi) / np.float64(gs))
    if kind == "zeros":
        return sign * F32(0)  # amax 0: scale 0, codes 0 (-0.0 too)
    if kind == "subnormal":
        return sign * rng.integers(0, 1 << 23, 16).astype(np.uint32).view(F32)  # fp32 subnormals
    if kind == "one_hot":
        x = sign * F32(0)
        x[rng.integers(16)] = amax * sign[0]
        return x
    if kind == "inf":
        x = (sign * amax * rng.random(16)).astype(F32)
        x[rng.integers(16)] = np.inf * sign[1]
        return x
    if kind == "ties" and np.isfinite(amax):
        s = e4m3_value(e4m3_bits(F32(gs) * (amax * SIXTH)))
        if s > 0:
            r = F32(1) / (s * (F32(1) / F32(gs)))
            t = rng.choice(E2M1_MIDS, 15).astype(F32) / r  # y = x * r lands on a midpoint, or next to it
            x = np.nextafter(t, np.where(rng.random(15) < 0.5, F32(0), F32(np.inf)))
            x = np.where(rng.random(15) < 0.5, t, x)
            return np.concatenate([[amax], np.minimum(x, amax)]).astype(F32) * sign
    x = (sign * amax * rng.random(16)).astype(F32)
    x[rng.integers(16)] = amax * sign[2]
    x[rng.random(16) < 0.1] = F32(-0.0)
    return x


@st.composite
def nvfp4_case(draw):
    """(x [M, 16 G] torch, gs): blocks of random kinds, one global scale."""
    dtype = DTYPES[draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"]))]  # fp32 keeps exact ties
    gs = draw(st.one_of(st.just(ISSUE_GS), st.just(1.0), st.floats(2.0 ** -20, 2.0 ** 20, width=32)))
    m, g = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(BLOCK_KINDS), min_size=m * g, max_size=m * g))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    x = np.stack([make_block(kind, gs, rng) for kind in kinds]).reshape(m, 16 * g)
    return torch.from_numpy(x).to(dtype), gs, draw(st.booleans())


@pytest.mark.parametrize("impl", sorted(NVFP4_IMPLS))
@settings(max_examples=15 if CHILD else 60)
@given(case=nvfp4_case())
def test_nvfp4_hypothesis_blocks(impl, case):
    x, gs, swizzle = case
    check_nvfp4(NVFP4_IMPLS[impl], x, gs, swizzle)


# ----------------------------------------------------------------------------
# quant_fp8
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", sorted(FP8_IMPLS))
@pytest.mark.parametrize("case", ["static_tensor", "static_token", "dynamic_token", "dynamic_tensor"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_reciprocal_order(impl, case, dtype):
    """Values where x / s and x * (1 / s) round apart (float32: all of them
    as built; bf16: those that survive the cast)."""
    name, x, scale, per_token = next(c for c in fp8_cases() if c[0] == case)
    check_fp8(FP8_IMPLS[impl], torch.from_numpy(x).to(DTYPES[dtype]), scale, per_token)


@pytest.mark.parametrize("impl", sorted(FP8_IMPLS))
@settings(max_examples=15 if CHILD else 40)
@given(m=st.integers(1, 5), k=st.integers(1, 70), mode=st.sampled_from(["static", "token", "tensor", "static_token"]),
       log_s=st.floats(-12, 12), seed=st.integers(0, 2 ** 32 - 1), dtype=st.sampled_from(sorted(DTYPES)))
def test_fp8_hypothesis(impl, m, k, mode, log_s, seed, dtype):
    rng = np.random.default_rng(seed)
    s = F32(2.0 ** log_s)
    pool = np.concatenate([fp8_midpoints(s), (rng.standard_normal(64) * 300 * s).astype(F32),
                           np.array([0.0, -0.0, np.inf, -np.inf, 1e30, s * F32(1e-40)], F32)])
    x = torch.from_numpy(rng.choice(pool, (m, k)).astype(F32)).to(DTYPES[dtype])
    if mode == "static":
        check_fp8(FP8_IMPLS[impl], x, torch.tensor([s]), False)
    elif mode == "static_token":
        check_fp8(FP8_IMPLS[impl], x, torch.from_numpy(s * rng.uniform(0.5, 2, (m, 1)).astype(F32)), True)
    else:
        check_fp8(FP8_IMPLS[impl], x, None, mode == "token")


# ----------------------------------------------------------------------------
# The Triton kernels in the interpreter (child process)
# ----------------------------------------------------------------------------


@parent
def test_triton_kernels_in_interpreter():
    run_under_interpreter(__file__, {CHILD_VAR: "1", "PYTHONWARNINGS": "ignore"})


@interp
def test_child_runs_the_triton_kernels():
    assert all(name.startswith("triton-") for name in list(NVFP4_IMPLS) + list(FP8_IMPLS))


# ----------------------------------------------------------------------------
# GPU: the Triton kernels, the torch reference on CUDA, the dispatched ops
# ----------------------------------------------------------------------------


def _gpu_nvfp4_impls() -> dict:
    from scaledmm.ops import nvfp4 as nv
    from scaledmm.ops import nvfp4_triton as nt
    impls = {f"triton-{c.label()}": functools.partial(nt.quant, cfg=c) for c in nt.QUANT_CANDIDATES}
    impls["reference-cuda"] = nv.reference_quant
    impls["op"] = lambda x, gs, swz: OPS.nvfp4_quant(x, gs, swz)
    return impls


def _gpu_fp8_impls() -> dict:
    from scaledmm.ops import fp8 as f8
    from scaledmm.ops import fp8_triton_quant as Q
    return {"triton": Q.quant, "reference-cuda": f8.reference_quant,
            "op": lambda x, s, pt: OPS.quant_fp8(x, s, pt)}


def _gpu_nvfp4_input(dtype: torch.dtype, m: int) -> tuple[torch.Tensor, float]:
    """Random rows of varied magnitude (K = 2048), the issue's block and the
    midpoint rows; gs = 448 * 6 / amax in fp32, as a layer computes it."""
    x = torch.randn(m, 2048) * torch.exp(torch.randn(m, 1) * 2)
    x = torch.cat([x[:, :256], torch.from_numpy(issue_block()).repeat(m, 8)], 1) if m > 1 else x
    x = x.to(dtype)
    amax = F32(x.float().abs().max().item())
    return x, float(F32(2688) / amax)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("m", [1, 17, 300])
@pytest.mark.gpu
@requires_gpu
def test_gpu_nvfp4_matches_model(dtype, swizzle, m, _seed):
    x, gs = _gpu_nvfp4_input(DTYPES[dtype], m)
    mids = torch.from_numpy(nvfp4_midpoint_rows())
    for name, impl in _gpu_nvfp4_impls().items():
        try:
            check_nvfp4(impl, x, gs, swizzle, "cuda")
            check_nvfp4(impl, mids, 1.0, swizzle, "cuda")
            check_nvfp4(impl, torch.from_numpy(issue_block()).to(DTYPES[dtype]), ISSUE_GS, swizzle, "cuda")
        except AssertionError as e:
            raise AssertionError(f"{name} (seed {_seed}): {e}") from None


@pytest.mark.gpu
@requires_gpu
@settings(max_examples=25)
@given(case=nvfp4_case())
def test_gpu_nvfp4_hypothesis_blocks(case):
    x, gs, swizzle = case
    for name, impl in _gpu_nvfp4_impls().items():
        try:
            check_nvfp4(impl, x, gs, swizzle, "cuda")
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_fp8_matches_model(dtype, _seed):
    big = torch.randn(300, 4096) * torch.exp(torch.randn(300, 1) * 2)
    for name, impl in _gpu_fp8_impls().items():
        try:
            for case, x, scale, per_token in fp8_cases():
                check_fp8(impl, torch.from_numpy(x).to(DTYPES[dtype]), scale, per_token, "cuda")
            xb = big.to(DTYPES[dtype])
            for scale, per_token in ((torch.tensor([0.37]), False), (torch.rand(300, 1) + 0.01, True),
                                     (None, False), (None, True)):
                check_fp8(impl, xb, scale, per_token, "cuda")
        except AssertionError as e:
            raise AssertionError(f"{name} (seed {_seed}): {e}") from None
