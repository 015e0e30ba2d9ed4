"""fp8_block ops: per_token_group_quant_fp8, fp8_block_mm and its padded
variants, fp8_block_linear, the scaledmm.fp8_block_mm entry.  Reference math is
float64 (GEMM) or an exact e4m3 encoder written here from the format (quant)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import scaledmm
from scaledmm import backends
from helpers import FP8, opcheck, poison_, rel_err
from scaledmm.ops import fp8_block as ops

DEV = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# --------------------------------------------------------------------------
# independent references
# --------------------------------------------------------------------------


def e4m3_encode_f64(v: np.ndarray) -> np.ndarray:
    """Round float64 values to the nearest e4m3fn value (ties to even), NaN kept.
    Values are already clamped to [-448, 448] by the op's rule."""
    out = np.empty_like(v)
    nan = np.isnan(v)
    a = np.abs(np.where(nan, 0.0, v))
    # exponent of the binade (normal range 2^-6 .. 2^8); subnormal step 2^-9
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.clip(e, -6, 8)
    step = np.exp2(e - 3)
    q = np.round(a / step) * step  # numpy rounds half to even
    out = np.sign(v) * q
    out[nan] = np.nan
    return out


def quant_ref(x: torch.Tensor, g: int, eps: float, ue8m0: bool):
    xf = x.float().numpy().astype(np.float32)
    m, k = xf.shape
    xg = xf.reshape(m, k // g, g)
    amax = np.abs(xg).max(axis=-1) if k else np.zeros((m, 0), np.float32)
    s = (np.maximum(amax, np.float32(eps)) / np.float32(448.0)).astype(np.float32)
    if ue8m0:
        s = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    quot = (xg / s[..., None]).astype(np.float32)
    quot = np.clip(quot, -448, 448)
    q = e4m3_encode_f64(quot.astype(np.float64)).reshape(m, k)
    return q, s


def mm_ref64(a, b, sa, sb, block_size):
    """SPEC formula in float64: sum_j sa[m,j] sb[n//bn,j] sum_{k in j} a b."""
    bn, bk = block_size
    m, k = a.shape
    n = b.shape[0]
    kb = math.ceil(k / bk)
    A = torch.zeros(m, kb * bk, dtype=torch.float64)
    B = torch.zeros(n, kb * bk, dtype=torch.float64)
    A[:, :k] = a.double().cpu()
    B[:, :k] = b.double().cpu()
    part = torch.einsum("mjk,njk->mnj", A.view(m, kb, bk), B.view(n, kb, bk))
    sbx = sb.double().cpu().repeat_interleave(bn, 0)[:n]
    return torch.einsum("mnj,mj,nj->mn", part, sa.double().cpu(), sbx)


def rand_fp8(shape, device="cpu", scale=1.0):
    return (torch.randn(shape, device=device) * scale).clamp(-448, 448).to(FP8)


def make_mm_inputs(m, n, k, device="cpu", col_major=False, block=(128, 128), row_pad=0):
    bn, bk = block
    a_full = rand_fp8((m, k + row_pad), device)
    a = a_full[:, :k]
    b = rand_fp8((n, k), device)
    kb = math.ceil(k / bk)
    sa = torch.rand(m, kb, device=device) + 0.05
    if col_major:
        sa = sa.t().contiguous().t()
    sb = torch.rand(math.ceil(n / bn), kb, device=device) + 0.05
    return a, b, sa, sb


# --------------------------------------------------------------------------
# per_token_group_quant_fp8
# --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEV)
@given(m=st.sampled_from([0, 1, 3, 4, 17, 130]), groups=st.integers(1, 3), g=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       col=st.booleans(), ue8m0=st.booleans(), row_pad=st.sampled_from([0, 64]),
       mag=st.sampled_from([1e-6, 1.0, 1e3]), seed=st.integers(0, 2**31 - 1))
def test_quant_exact(device, m, groups, g, dtype, col, ue8m0, row_pad, mag, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    k = groups * g
    x = (torch.randn(m, k + row_pad) * mag).to(dtype)[:, :k].to(device)
    if m > 2:
        x[1, :g] = 0  # an all-zero group: scale = eps / 448
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, g, 1e-10, col, ue8m0)
    q_ref, s_ref = quant_ref(x.cpu(), g, 1e-10, ue8m0)
    assert q.shape == (m, k) and q.dtype == FP8
    assert s.shape == (m, k // g) and s.dtype == torch.float32
    if col and m > 1:
        assert s.stride() == (1, m)
    else:
        assert s.is_contiguous()
    np.testing.assert_array_equal(s.cpu().numpy(), s_ref)
    np.testing.assert_array_equal(q.cpu().double().numpy(), q_ref)


def test_quant_nan_inf_stay_in_their_group():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    x[2, 200] = float("inf")
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
    assert torch.isnan(s[1, 0]) and torch.isnan(q[1, :128].float()).all()
    assert not torch.isnan(q[1, 128:].float()).any() and not torch.isnan(s[0]).any()
    assert torch.isinf(s[2, 1]) and not torch.isnan(q[2, :128].float()).any()
    assert not torch.isnan(q[0].float()).any()


def test_quant_saturates_and_rounds_to_even():
    # a group whose amax is 448 * s: values map to codes exactly; check ties
    x = torch.zeros(1, 128)
    x[0, 0] = 448.0  # s = 1.0
    x[0, 1] = 17.0   # between 16 and 18 (step 2): tie -> 16 (even mantissa)
    x[0, 2] = 19.0   # tie between 18 and 20 -> 20
    x[0, 3] = -0.0009765625  # 2^-10: half the smallest subnormal (2^-9) -> tie to 0
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x)
    assert s.item() == 1.0
    assert q[0, :4].float().tolist() == [448.0, 16.0, 20.0, -0.0]


@pytest.mark.parametrize(
    "args, arg",
    [
        ((torch.randn(2, 100), 128), "x"),                       # K % group
        ((torch.randn(2, 128).to(FP8), 128), "x"),               # dtype
        ((torch.randn(2, 2, 128), 128), "x"),                    # rank
        ((torch.randn(128, 4).t(), 128), "x"),                   # inner stride
        ((torch.randn(2, 128), 0), "group_size"),
        ((torch.randn(2, 128), 128, -1.0), "eps"),
    ],
)
def test_quant_bad_inputs(args, arg):
    with pytest.raises(ValueError, match=f"per_token_group_quant_fp8: {arg}:"):
        torch.ops.scaledmm.per_token_group_quant_fp8(*args)


def test_quant_opcheck():
    for m, col, ue in [(0, False, False), (1, True, False), (5, True, True), (33, False, True)]:
        x = torch.randn(m, 256, dtype=torch.bfloat16)
        opcheck(torch.ops.scaledmm.per_token_group_quant_fp8.default, (x, 128, 1e-10, col, ue))
    x = torch.randn(4, 384)[:, :256]
    opcheck(torch.ops.scaledmm.per_token_group_quant_fp8.default, (x, 64))


# --------------------------------------------------------------------------
# fp8_block_mm and friends
# --------------------------------------------------------------------------

MM_OPS = ["fp8_block_mm", "padded_fp8_block_mm", "dynamic_padded_fp8_block_mm"]


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("op", MM_OPS)
@given(m=st.sampled_from([0, 1, 3, 4, 5, 17, 64, 129]), n=st.sampled_from([16, 100, 200, 384]),
       k=st.sampled_from([128, 256, 320, 384]), col=st.booleans(), row_pad=st.sampled_from([0, 16]),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       block=st.sampled_from([(128, 128), (64, 128), (128, 64)]), seed=st.integers(0, 2**31 - 1))
def test_mm_matches_float64(device, op, m, n, k, col, row_pad, out_dtype, block, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    a, b, sa, sb = make_mm_inputs(m, n, k, device, col, block, row_pad)
    out = getattr(torch.ops.scaledmm, op)(a, b, sa, sb, list(block), out_dtype)
    ref = mm_ref64(a, b, sa, sb, block)
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    assert not torch.isnan(out).any()
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[out_dtype]
    if device == "cuda":
        # Hopper's FP8 tensor cores add products inside a K-block with a
        # narrower accumulator (~2^-14) before the fp32 promotion
        tol = max(tol, 2e-3)
    if m:
        assert rel_err(out, ref) < tol


@pytest.mark.parametrize("device", DEV)
def test_mm_nan_inf_stay_in_row_and_column(device):
    a, b, sa, sb = make_mm_inputs(6, 48, 256, device)
    a = a.clone()
    b = b.clone()
    a[2, 7] = float("nan")
    b[5, 3] = float("nan")
    out = scaledmm.fp8_block_mm(a, b, sa, sb)
    nan = torch.isnan(out)
    assert nan[2].all() and nan[:, 5].all()
    nan[2] = False
    nan[:, 5] = False
    assert not nan.any()


def test_padded_ops_pad_with_unit_scale_rows():
    a, b, sa, sb = make_mm_inputs(3, 32, 128, col_major=True)
    a_p, s_p = ops.pad_rows(a, sa)
    assert a_p.shape == (4, 128) and s_p.shape == (4, 1)
    assert (a_p[3].float() == 0).all() and s_p[3].item() == 1.0
    a, b, sa, sb = make_mm_inputs(5, 32, 256, col_major=True)
    a_p, s_p = ops.pad_rows(a, sa)
    assert s_p.stride() == (1, 8) and (s_p[5:] == 1).all()
    torch.testing.assert_close(s_p[:5], sa, rtol=0, atol=0)


def test_quantizer_leaves_room_for_padding_and_pad_rows_views_it():
    x = torch.randn(5, 256)
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, True)
    assert q.shape == (5, 256) and q.stride() == (256, 1) and q.untyped_storage().nbytes() >= 8 * 256
    a_p, s_p = ops.pad_rows(q, s)
    assert a_p.shape == (8, 256) and a_p.data_ptr() == q.data_ptr()  # a view: no copy of q
    assert torch.equal(a_p[:5].view(torch.uint8), q.view(torch.uint8))
    assert s_p.stride() == (1, 8) and (s_p[5:] == 1).all() and torch.equal(s_p[:5], s)
    # no spare rows (a tensor of exactly M rows): copied, zero rows added
    tight = q.clone()
    a_p, _ = ops.pad_rows(tight, s)
    assert a_p.data_ptr() != tight.data_ptr() and (a_p[5:].float() == 0).all()
    assert ops.rows_view(tight, 8) is None and ops.rows_view(q, 4) is None


def test_padded_op_reads_the_table_at_the_callers_m():
    """A measured table row for M = 3 (padding included) beats the aligned
    ranking of M = 4: the padded op ranks at 3 and checks at 4."""
    seen = []

    def aligned(a, b, sa, sb, bs, od):
        seen.append(a.shape[0])
        return ops.reference_mm(a, b, sa, sb, bs, od)

    backends.register(backends.Backend(backends.Family.FP8_BLOCK, "t_al", {"fp8_block_mm": aligned},
                                       needs_m_multiple=4,
                                       can_implement=lambda p: (p.m % 4 == 0, "M % 4")))
    rows = {(32, 128): [(2, ["t_al"]), (3, ["reference"]), (8, ["t_al"])]}
    try:
        with backends.override_policy("fp8_block", "cpu", order=["t_al", "reference"], shapes=rows):
            b = torch.randn(32, 128).to(torch.float8_e4m3fn)
            for m, want in ((2, [4]), (3, []), (5, [8])):
                seen.clear()
                x = torch.randn(m, 128)
                q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128, 1e-10, True)
                out = torch.ops.scaledmm.padded_fp8_block_mm(q, b, s, torch.ones(1, 1))
                assert seen == want, (m, seen)
                torch.testing.assert_close(out, ops.reference_mm(q, b, s, torch.ones(1, 1), [128, 128], out.dtype))
    finally:
        backends.unregister("fp8_block", "t_al")


def test_mm_bad_inputs():
    a, b, sa, sb = make_mm_inputs(4, 32, 256)
    f = torch.ops.scaledmm.fp8_block_mm
    cases = [
        ((a.float(), b, sa, sb), "a"),
        ((a, b.float(), sa, sb), "b"),
        ((a, b[:, :128], sa, sb), "b"),
        ((a, b, sa[:, :1], sb), "a_scales"),
        ((a, b, sa.double(), sb), "a_scales"),
        ((a, b, sa, sb[:, :1]), "b_scales"),
        ((a, b, sa, sb.t().contiguous().t() if sb.shape[0] > 1 else sb.expand(1, 2)[:, :2].t()), "b_scales"),
        ((a[None], b, sa, sb), "a"),
        ((a.t(), b, sa, sb), "a"),
        ((a, b, sa, sb, [128]), "block_size"),
        ((a, b, sa, sb, [128, 128], torch.int32), "out_dtype"),
        ((a, b, sa, sb[::2] if sb.shape[0] > 1 else sb.t()), "b_scales"),
    ]
    for args, arg in cases:
        with pytest.raises(ValueError, match=f"fp8_block_mm: {arg}:"):
            f(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mm_device_mix():
    a, b, sa, sb = make_mm_inputs(4, 32, 256)
    with pytest.raises(ValueError, match="fp8_block_mm: b:.*device"):
        torch.ops.scaledmm.fp8_block_mm(a, b.cuda(), sa, sb)


@pytest.mark.parametrize("op", MM_OPS)
def test_mm_opcheck(op):
    for m, n, k, col, pad in [(0, 32, 128, False, 0), (1, 48, 256, True, 0), (3, 200, 384, True, 16),
                              (8, 64, 320, False, 0)]:
        a, b, sa, sb = make_mm_inputs(m, n, k, col_major=col, row_pad=pad)
        opcheck(getattr(torch.ops.scaledmm, op).default, (a, b, sa, sb, [128, 128], torch.float16))


@pytest.mark.parametrize("op", MM_OPS + ["scaledmm.fp8_block_mm"])
def test_mm_validates_before_reading_shapes(op):
    """A 0-D or 1-D activation, or a short block_size, is a ValueError naming
    the argument and the op called (the op, its fake and the Python entry)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b, sa, sb = make_mm_inputs(4, 32, 128)
    f = scaledmm.fp8_block_mm if op.startswith("scaledmm.") else getattr(torch.ops.scaledmm, op)
    name = op.removeprefix("scaledmm.")
    for bad in (a[0, 0], a[0]):
        with pytest.raises(ValueError, match=f"^{name}: a: expected a 2-D tensor"):
            f(bad, b, sa, sb)
    with pytest.raises(ValueError, match=f"^{name}: block_size: expected two positive ints"):
        f(a, b, sa, sb, [128])
    with FakeTensorMode():
        fa, fb_, fsa, fsb = (torch.empty((), dtype=FP8), torch.empty(32, 128, dtype=FP8), torch.empty(4, 1),
                             torch.empty(1, 1))
        with pytest.raises(ValueError, match=f"^{name}: a: expected a 2-D tensor"):
            f(fa, fb_, fsa, fsb)


class _MaxNumel:
    """Largest tensor any aten op creates inside the block (meta tensors:
    sizes only, nothing allocated)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                rec.max = max([rec.max] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
                return out

        self.max = 0
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


HUGE = 2 ** 30


@pytest.mark.parametrize("block", [(HUGE, HUGE), (HUGE, 128), (1, HUGE), (1, 1)])
def test_reference_math_allocates_nothing_larger_than_its_operands(block):
    """Block scales are expanded only to the operands' [rows, K], whatever the
    block size (a block larger than the matrix used to allocate the whole
    block).  Meta tensors: the old behaviour shows as a size, not an OOM."""
    m, n, k = 3, 5, 200
    kb, nb = math.ceil(k / block[1]), math.ceil(n / block[0])
    meta = dict(device="meta")
    a, b = torch.empty(m, k, dtype=FP8, **meta), torch.empty(n, k, dtype=FP8, **meta)
    sa, sb = torch.empty(m, kb, **meta), torch.empty(nb, kb, **meta)
    with _MaxNumel() as rec:
        out = ops.reference_mm_f32(a, b, sa, sb, block)
    assert out.shape == (m, n) and rec.max <= max(m, n) * k
    with _MaxNumel() as rec:
        q, s = ops.quantize_weight(torch.empty(n, k, **meta), block)
    assert q.shape == (n, k) and s.shape == (nb, kb) and rec.max <= max(n * k, 128 * 256)


@pytest.mark.parametrize("op", MM_OPS)
def test_huge_block_size_runs_as_one_block(op):
    """block_size [2**30, 2**30] on a small problem: one scale per row of a
    (kb = 1) and one for all of b; float64 formula written out here."""
    m, n, k = 3, 5, 200
    a, b = rand_fp8((m, k)), rand_fp8((n, k))
    sa, sb = torch.rand(m, 1) + 0.05, torch.rand(1, 1) + 0.05
    out = getattr(torch.ops.scaledmm, op)(a, b, sa, sb, [HUGE, HUGE], torch.float32)
    want = (a.double() @ b.double().t()) * sa.double() * sb.double()
    assert rel_err(out, want) < 1e-6
    # bn huge, bk = 128 through the fused linear op (K % bk == 0 there)
    x = torch.randn(m, 256, dtype=torch.bfloat16)
    w, ws = rand_fp8((n, 256)), torch.rand(1, 2) + 0.05
    lin = torch.ops.scaledmm.fp8_block_linear(x, w, ws, [HUGE, 128], torch.float32)
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128)
    want = sum((q[:, j * 128:(j + 1) * 128].double() @ w[:, j * 128:(j + 1) * 128].double().t())
               * s[:, j:j + 1].double() * ws[0, j].double() for j in range(2))
    assert rel_err(lin, want) < 1e-6


def test_quantize_weight_block_larger_than_weight_is_one_block():
    w = torch.randn(200, 300)
    q, s = ops.quantize_weight(w, (HUGE, HUGE))
    q_same, s_same = ops.quantize_weight(w, (200, 300))
    assert s.shape == (1, 1) and torch.equal(s, s_same) and torch.equal(q.view(torch.uint8), q_same.view(torch.uint8))
    assert s.item() == pytest.approx(w.abs().max().item() / 448, rel=1e-6)
    for bad in ([128], (0, 128), (128.0, 128), None):
        with pytest.raises(ValueError, match="quantize_weight: block_size"):
            ops.quantize_weight(w, bad)


# --------------------------------------------------------------------------
# fp8_block_linear
# --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEV)
@given(m=st.sampled_from([0, 1, 3, 17]), n=st.sampled_from([64, 200]), k=st.sampled_from([128, 384]),
       bias=st.booleans(), out_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**31 - 1))
def test_linear_equals_quant_then_mm(device, m, n, k, bias, out_dtype, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w, ws = ops.quantize_weight(torch.randn(n, k, device=device))
    bvec = torch.randn(n, device=device, dtype=out_dtype) if bias else None
    out = torch.ops.scaledmm.fp8_block_linear(x, w, ws, [128, 128], out_dtype, bvec)
    q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128)
    ref = mm_ref64(q, w, s, ws, (128, 128))
    if bias:
        ref = ref + bvec.double().cpu()
    assert out.shape == (m, n) and out.dtype == out_dtype
    # bias added in fp32 before the one rounding: bit-equal to the fp32 path
    # on the CPU; on a GPU the fused kernel accumulates in another order
    exact = torch.ops.scaledmm.fp8_block_mm(q, w, s, ws, [128, 128], torch.float32)
    if bias:
        exact = exact + bvec.float()
    tol = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=1.6e-2, atol=2e-3)
    torch.testing.assert_close(out, exact.to(out_dtype), **tol)
    if m:
        assert rel_err(out, ref) < 8e-3


def test_linear_bad_inputs_and_opcheck():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w, ws = ops.quantize_weight(torch.randn(64, 256))
    f = torch.ops.scaledmm.fp8_block_linear
    for args, arg in [((x.float(), w, ws), "x"), ((x[:, :200], w, ws), "b"),
                      ((x, w, ws, [128, 128], torch.bfloat16, torch.randn(63)), "bias")]:
        with pytest.raises(ValueError, match=f"fp8_block_linear: {arg}:"):
            f(*args)
    for m, bias in [(0, None), (3, torch.randn(64, dtype=torch.bfloat16)), (9, None)]:
        xx = torch.randn(m, 256, dtype=torch.bfloat16)
        opcheck(f.default, (xx, w, ws, [128, 128], torch.bfloat16, bias))


# --------------------------------------------------------------------------
# the Python entry
# --------------------------------------------------------------------------


def test_entry_eager_picks_padded_op_for_unaligned_m():
    calls = []
    a, b, sa, sb = make_mm_inputs(3, 32, 128)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        scaledmm.fp8_block_mm(a, b, sa, sb)
    assert any("padded_fp8_block_mm" in c for c in calls)
    calls.clear()
    a, b, sa, sb = make_mm_inputs(4, 32, 128)
    with Log():
        scaledmm.fp8_block_mm(a, b, sa, sb)
    assert any(c.startswith("scaledmm.fp8_block_mm") for c in calls)
    assert not any("padded" in c for c in calls)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(7, 384, dtype=FP8)
        b = torch.empty(200, 384, dtype=FP8)
        sa = torch.empty(3, 7).t()
        sb = torch.empty(2, 3)
        for op in MM_OPS:
            out = getattr(torch.ops.scaledmm, op)(a, b, sa, sb, [128, 128], torch.float16)
            assert out.shape == (7, 200) and out.dtype == torch.float16
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(torch.empty(7, 384), 128, 1e-10, True)
        assert q.shape == (7, 384) and s.shape == (7, 3) and s.stride() == (1, 7)
        with pytest.raises(ValueError, match="b_scales"):
            torch.ops.scaledmm.fp8_block_mm(a, b, sa, torch.empty(1, 3))


def test_compile_dynamic_one_compile():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    cnt = CompileCounter()
    w, ws = ops.quantize_weight(torch.randn(200, 256))  # no size 1 anywhere: no duck sizing with M

    def f(x):
        q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128)
        return scaledmm.fp8_block_mm(q, w, s, ws)

    cf = torch.compile(f, backend=cnt, fullgraph=True, dynamic=True)
    # without this torch knob, Dynamo specializes M = 0 and M = 1
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for m in (1, 3, 4, 17, 64, 0):
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            torch.testing.assert_close(cf(x), f(x), rtol=0, atol=0)
    assert cnt.frame_count == 1


@pytest.mark.parametrize("n", [16, 128])  # N <= 128: one scale column, the v1 scale layout fits any K/128
def test_cublas_gate_needs_k_multiple_of_128(n):
    # cuBLASLt's 1x128 / 128x128 recipe has no partial K block; K = 192 or 320
    # (multiples of 64, not of 128) must go to another backend.
    from scaledmm.backends import Problem

    b = backends.get("fp8_block", "cublas")

    def gate(k):
        return b.can_implement(Problem(ops.FAMILY, torch.device("cuda"), 4, n, k, FP8, torch.bfloat16, k,
                                       (("block_size", (128, 128)), ("a_scales_col_major", True))))

    for k in (192, 320, 64, 448):
        ok, why = gate(k)
        assert not ok and "K % 128" in why and f"K={k}" in why, (k, why)
    for k in range(16, 1025, 16):
        assert gate(k)[0] == (k % 128 == 0), (k, gate(k))
