"""``fp8_scaled_mm`` on Triton (``ops/fp8_triton_mm.py``: the fp8_block GEMM
kernel with per-row / per-column scales, ``ROWCOL``) against a float64
reference of SPEC's ``(a * scale_a) @ (b * scale_b).T + bias``, written here
from the dequantized operands (not the library's reference).

Three groups:

* Interpreter tests (``@interp``): Triton picks interpreter or compiler when
  a kernel is decorated, so they run in a child pytest started with
  ``TRITON_INTERPRET=1`` (:func:`test_interpreter_suite`), on small shapes:
  every scale kind, bias, out dtype, odd M, K and N not multiples of 128,
  strided rows, forced split-K / one-launch / swap-AB / TMA / persistent
  configs, Hypothesis, the op under a forced backend, opcheck.
* Main process, CPU: ``can_implement``, the registry entry, an explicit
  request on a pretend sm90 device, errors; a child compiling the kernel for
  sm90 / sm89 / sm80 with Triton's own compiler (no GPU): MMA, the fp32
  promotion of each K block's sum, no spills.
* GPU (``gpu`` marker, skipped without CUDA): Llama-3-8B sizes against
  float64, split-K one launch == two launches bit for bit, opcheck, and
  ``torch.compile(fullgraph=True, mode="reduce-overhead")`` equal to eager.

The error bound (:func:`bound`) for one output element, with ``p_k = a_k
sa * b_k sb`` and ``u = 2**-24``: the fp8 products are exact in fp32; the
fp32 sum of K of them, the adds of at most K/128 split-K partials and the
multiplies by ``sa * sb`` are at most ``n = K + K/128 + 4`` roundings on a
path, so ``|acc - sum p| <= n u sum|p|`` (Higham's gamma_n, first order);
the bias add is one fp32 rounding; the final conversion to ``out_dtype`` is
within one ulp of the output dtype (the interpreter converts to bf16 by
truncation, a full ulp; the GPU rounds to nearest, half of it), plus the
smallest subnormal for values below the normal range.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton")

import scaledmm  # noqa: E402  (registers the ops)
from helpers import opcheck, poison_, rel_err, run_codegen_child, run_under_interpreter  # noqa: E402
from scaledmm import backends  # noqa: E402
from scaledmm.backends import Family, Problem  # noqa: E402
from scaledmm.ops import fp8 as base  # noqa: E402
from scaledmm.ops import fp8_block as block_base  # noqa: E402
from scaledmm.ops import fp8_block_triton as T  # noqa: E402
from scaledmm.ops import fp8_triton_mm as TM  # noqa: E402
from scaledmm.ops import fp8_triton_quant as Q  # noqa: E402

CHILD_VAR = "SCALEDMM_FP8_TRITON_MM_CHILD"
CHILD = os.environ.get(CHILD_VAR)
FP8 = torch.float8_e4m3fn
OPS = torch.ops.scaledmm

interp = pytest.mark.skipif(CHILD != "interpret", reason="runs in the interpreter child (test_interpreter_suite)")
parent = pytest.mark.skipif(CHILD is not None, reason="main-process test")
# GPU tests run in the main process only (the child would run them on the interpreter)
gpu = pytest.mark.skipif(CHILD is not None or not torch.cuda.is_available(), reason="needs a CUDA device")

KINDS = [(base.TENSOR, base.TENSOR), (base.TOKEN, base.CHANNEL), (base.TENSOR, base.CHANNEL),
         (base.TOKEN, base.TENSOR)]
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
U32 = 2.0 ** -24
# one ulp of the output dtype, relative; and its smallest subnormal
OUT_ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}
OUT_TINY = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -149}


# ----------------------------------------------------------------------------
# Inputs, the float64 reference, the bound
# ----------------------------------------------------------------------------


def scale(kind: str, rows: int, device="cpu", form: int = 0) -> torch.Tensor:
    """A float32 scale of ``kind`` in (0.05, 0.55) (torch's RNG, seeded per
    test by conftest); ``form`` picks among its accepted shapes and layouts
    (0-D / [1] / [1, 1]; strided [M, 1]; [N], [1, N], strided [N])."""
    v = torch.rand(max(rows, 1) * 2) * 0.5 + 0.05
    if kind == base.TENSOR:
        t = (v[0].reshape(()), v[:1], v[:1].reshape(1, 1))[form % 3]
    elif kind == base.TOKEN:
        t = v.reshape(-1, 2)[:rows, :1]  # [M, 1], row stride 2
    else:
        t = (v[:rows], v[:rows].reshape(1, rows), v[::2][:rows])[form % 3]
    return t.to(device)


def operands(m: int, n: int, k: int, kinds, pad: int = 0, device="cpu", form: int = 0):
    """e4m3 ``a [m, k]`` (row stride ``k + pad``), ``b [n, k]`` and scales."""
    a = (torch.randn(m, k + pad, device=device) * 2).to(FP8)[:, :k]
    b = (torch.randn(n, k, device=device) * 2).to(FP8)
    return a, b, scale(kinds[0], m, device, form), scale(kinds[1], n, device, form + 1)


def ref64(a, b, sa, sb, bias=None):
    """float64 ``(a * sa) @ (b * sb).T (+ bias)`` and the dequantized operands.
    ``reshape(-1, 1)`` turns every accepted scale shape into a column that
    broadcasts over the operand's rows ([1, 1] for one element)."""
    A = a.double() * sa.double().reshape(-1, 1)
    B = b.double() * sb.double().reshape(-1, 1)
    out = A @ B.t()
    if bias is not None:
        out = out + bias.double()
    return out, A, B


def bound(A, B, ref, out_dtype, k: int):
    """Elementwise error bound (module docstring)."""
    acc_err = (k + k // 128 + 4) * U32 * (A.abs() @ B.abs().t())
    pre = ref.abs() + acc_err
    bias_err = U32 * pre
    return acc_err + bias_err + OUT_ULP[out_dtype] * (pre + bias_err) + OUT_TINY[out_dtype]


def check(out, a, b, sa, sb, bias, out_dtype):
    m, k = a.shape
    n = b.shape[0]
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous(), (out.shape, out.dtype)
    ref, A, B = ref64(a, b, sa, sb, bias)
    err = (out.double() - ref).abs()
    lim = bound(A, B, ref, out_dtype, k)
    ok = err <= lim  # NaN (an unwritten, poisoned element) fails
    assert ok.all(), (f"{(~ok).sum().item()} of {ok.numel()} elements off; worst err/bound "
                      f"{(err / lim).nan_to_num(float('inf')).max().item():.3g}")


# ============================================================================
# Main process: the children, registry and checks (CPU)
# ============================================================================


@parent
def test_interpreter_suite():
    run_under_interpreter(__file__, {CHILD_VAR: "interpret"})


@parent
def test_sm90_sm89_sm80_codegen():
    """Triton's compiler (no GPU) on the ROWCOL kernel at Llama sizes."""
    run_codegen_child(__file__, {CHILD_VAR: "codegen"})


def _codegen_main() -> None:
    from triton.runtime import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    from helpers import OfflineDriver
    from helpers import cubin_usage as usage
    from scaledmm.ops import fp8_block_triton_quant as ft

    def build(cfg, m, n, k, widen, soft, bias):
        a = torch.empty(m, k, dtype=FP8)
        b = torch.empty(n, k, dtype=FP8)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        sa, sb = torch.empty(m, 1), torch.empty(n, 1)
        a_arg = TensorDescriptor.from_tensor(a, [cfg.block_m, 128]) if cfg.tma else ft.bytes_view(a, widen)
        b_arg = TensorDescriptor.from_tensor(b, [cfg.block_n, 128]) if cfg.tma else ft.bytes_view(b, widen)
        return T.mm_kernel.warmup(
            a_arg, b_arg, out, out, sa, sb, out, torch.empty(8, dtype=torch.int32), m, n, k, cfg.split_k,
            a.stride(0), b.stride(0), out.stride(0), sa.stride(0), 0, sb.stride(0), 0, 1e-10,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128, GROUP_M=cfg.group_m, SPLIT=cfg.split_k > 1,
            ONE_LAUNCH=cfg.one_launch, SWAP_AB=cfg.swap_ab, QUANT_A=False, HAS_BIAS=bias, A_TMA=cfg.tma,
            B_TMA=cfg.tma, EVEN_K=True, PERSISTENT=cfg.persistent, WARP_SPEC=cfg.warp_specialize, SOFT_CVT=soft,
            WIDEN=widen, INTERPRET=False, ROWCOL=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            grid=(1,))

    failures = []
    for cap in (90, 89, 80):
        driver.set_active(OfflineDriver(cap))
        T.mm_kernel.device_caches.clear()  # binders remember the target per device id
        soft, widen = cap < 90, cap < 89
        shapes = ((1, 6144, 4096), (8, 4096, 14336), (64, 6144, 4096), (512, 4096, 14336))
        for m, n, k in shapes if cap == 90 else shapes[::3]:
            cfg = T.default_config(m, n, k, 132, False, cap >= 90)
            kern = build(cfg, m, n, k, widen, soft, True)
            ptx, res = kern.asm["ptx"], usage(kern)
            line = f"sm{cap} M={m:<4} {n}x{k} {cfg.short():<20} {res}"
            print(line)
            want = [("no spills", " STACK:0 " in res + " " and "LOCAL:0" in res)]
            if cap == 90:
                want.append(("wgmma", "wgmma.mma_async" in ptx and "e4m3" in ptx))
                # without split-K and bias the only fp32 adds are the K blocks' MMA sums
                # added to the accumulator: none would mean one reduced-precision sum over all K
                plain = build(dataclasses.replace(cfg, split_k=1, one_launch=False), m, n, k, widen, soft, False)
                want.append(("fp32 add per K block", "add.f32" in plain.asm["ptx"]))
            else:
                want.append(("mma.sync", "mma.sync" in ptx))
            if cfg.tma and cap == 90:
                want.append(("TMA", "cp.async.bulk.tensor" in ptx))
            failures += [f"{line}: missing {what}" for what, ok in want if not ok]
    T.mm_kernel.device_caches.clear()
    print("\n".join(failures) if failures else "codegen ok")


if __name__ == "__main__" and CHILD == "codegen":
    _codegen_main()


def mm_problem(kind_a=base.TOKEN, kind_b=base.CHANNEL, in_dtype=FP8, out_dtype=torch.bfloat16, device="cpu"):
    return Problem(Family.FP8, torch.device(device), 3, 48, 144, in_dtype, out_dtype, 160,
                   (("scale_a", kind_a), ("scale_b", kind_b), ("bias_dtype", None), ("b_aligned", False)))


@parent
def test_can_implement_and_registry_entry():
    for ka, kb in KINDS:
        for dt in OUT_DTYPES:
            assert TM.can_implement(mm_problem(ka, kb, out_dtype=dt))[0]
            assert Q.can_implement(mm_problem(ka, kb, out_dtype=dt))[0]  # the backend's predicate
    for bad in (mm_problem(base.CHANNEL, base.CHANNEL), mm_problem(base.TOKEN, base.TOKEN),
                mm_problem(in_dtype=torch.bfloat16), mm_problem(out_dtype=torch.int32)):
        ok, why = Q.can_implement(bad)
        assert not ok and why
    # a real problem as the op builds it (odd row stride, unaligned weight view)
    a = torch.empty(3, 160, dtype=FP8)[:, :144]
    b = torch.empty(48 * 144 + 1, dtype=FP8)[1:].view(48, 144)
    p = base.mm_problem(a, b, base.TOKEN, base.CHANNEL, torch.empty(48), torch.float16)
    assert Q.can_implement(p)[0]
    # quant_fp8 problems answer as before
    pq = Problem(Family.FP8, torch.device("cpu"), 4, 0, 64, torch.bfloat16, FP8, 64, (("quant", "per_token"),))
    assert Q.can_implement(pq) == (True, "per_token: any M, K, row stride")
    entry = backends.get("fp8", "triton")
    assert set(entry.impls) == {"quant_fp8", "fp8_scaled_mm"} and entry.impls["fp8_scaled_mm"] is TM.mm
    assert "fp8_scaled_mm" in entry.description


@parent
def test_explicit_request_reaches_triton_on_sm90():
    from benchmarks import selections

    with selections.simulated("sm90") as dev:
        with scaledmm.use_backend(Family.FP8, "triton"):
            assert backends.select(mm_problem(device=dev), "fp8_scaled_mm").name == "triton"


@parent
def test_errors_name_the_argument():
    a, b, sa, sb = operands(3, 48, 144, KINDS[1])
    with pytest.raises(ValueError, match="fp8_scaled_mm: config: expected"):
        TM.mm(a, b, sa, sb, config=T.MMConfig(16, 16, split_k=9))  # 2 K blocks
    with pytest.raises(ValueError, match="fp8_scaled_mm: scale_a: expected"):
        TM.mm(a, b, torch.ones(3, 2), sb)
    with pytest.raises(ValueError, match="fp8_scaled_mm: a: expected"):
        TM.mm(a[:, :136], b[:, :136].contiguous(), sa, sb)  # K = 136: not a multiple of 16


# ============================================================================
# Interpreter child: TRITON_INTERPRET=1 was set before triton was imported
# ============================================================================

if CHILD == "interpret":
    from scaledmm.device import interpreting

    pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
    assert interpreting(), "child must import triton with TRITON_INTERPRET=1"

    @pytest.fixture(autouse=True)
    def poisoned_outputs(monkeypatch):
        """The kernel's output starts as NaN, so an element it does not write
        fails the bound."""
        real = block_base.mm_output
        monkeypatch.setattr(block_base, "mm_output", lambda *args: poison_(real(*args)))


def bias_of(dtype, n, device="cpu"):
    return None if dtype is None else torch.randn(n, device=device).to(dtype)


@interp
@pytest.mark.parametrize("kinds", KINDS, ids=lambda k: "x".join(k))
@pytest.mark.parametrize("bias", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_scale_kinds_bias_out_dtypes(kinds, bias, out_dtype):
    for m, pad, form in ((1, 0, 0), (3, 16, 1), (17, 5, 2)):  # N, K multiples of 16, not of 128
        a, b, sa, sb = operands(m, 48, 144, kinds, pad, form=form)
        bv = bias_of(bias, 48)
        check(TM.mm(a, b, sa, sb, bv, out_dtype), a, b, sa, sb, bv, out_dtype)


@interp
def test_bound_is_not_vacuous():
    """A 3% change of one channel scale, or a dropped bias, fails the check."""
    a, b, sa, sb = operands(5, 32, 272, KINDS[1])
    bias = bias_of(torch.bfloat16, 32)
    out = TM.mm(a, b, sa, sb, bias, torch.bfloat16)
    check(out, a, b, sa, sb, bias, torch.bfloat16)
    off = sb.reshape(-1).clone()
    off[7] *= 1.03
    with pytest.raises(AssertionError):
        check(out, a, b, sa, off, bias, torch.bfloat16)
    with pytest.raises(AssertionError):
        check(out, a, b, sa, sb, None, torch.bfloat16)


@interp
@pytest.mark.parametrize("m", [0, 3])
def test_empty_m_n_k(m):
    """M = 0 or N = 0: an empty output of the right shape and dtype; K = 0:
    the empty sum is 0, so the output is the bias rounded once (or zeros)."""
    for n, k in ((48, 144), (0, 144), (48, 0)):
        a, b, sa, sb = operands(m, n, k, KINDS[1])
        for out_dtype in OUT_DTYPES:
            bias = bias_of(torch.bfloat16, n)
            out = TM.mm(a, b, sa, sb, bias, out_dtype)
            assert out.shape == (m, n) and out.dtype == out_dtype
            if k == 0:
                assert torch.equal(out, bias.float().expand(m, n).to(out_dtype))
                assert TM.mm(a, b, sa, sb, None, out_dtype).eq(0).all()
            else:
                check(out, a, b, sa, sb, bias, out_dtype)


SPLIT_CONFIGS = [
    T.MMConfig(16, 16, split_k=2, num_stages=1),
    T.MMConfig(16, 16, split_k=2, num_stages=1, one_launch=True),
    T.MMConfig(16, 32, split_k=3, swap_ab=True, num_stages=1),
    T.MMConfig(16, 32, split_k=3, swap_ab=True, num_stages=1, one_launch=True),  # uneven: an empty split
    T.MMConfig(32, 16, split_k=4, num_stages=1, one_launch=True),
]
PLAIN_CONFIGS = [
    T.MMConfig(16, 16, num_stages=1),
    T.MMConfig(16, 64, swap_ab=True, num_stages=1),
    T.MMConfig(16, 256, num_stages=1),
    T.MMConfig(32, 32, num_stages=1, tma=True),
    T.MMConfig(16, 16, num_stages=1, tma=True, persistent=True),
]


@interp
@pytest.mark.parametrize("cfg", SPLIT_CONFIGS + PLAIN_CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("m", [1, 17])
def test_forced_configs(cfg, m):
    """Split-K (two launches and one), swap-AB, BLOCK_N > 128, TMA, the
    persistent grid; K = 400 leaves 4 K blocks, the last one partial."""
    k = 400
    assert T.config_ok(cfg, m, 48, k)[0]
    for kinds in (KINDS[1], KINDS[3]):
        a, b, sa, sb = operands(m, 48, k, kinds, pad=16)
        bias = bias_of(torch.float32, 48)
        check(TM.mm(a, b, sa, sb, bias, torch.float32, config=cfg), a, b, sa, sb, bias, torch.float32)


@interp
@pytest.mark.parametrize("m", [1, 17])
def test_one_launch_equals_two_launches_bitwise(m):
    a, b, sa, sb = operands(m, 48, 400, KINDS[1])
    bias = bias_of(torch.bfloat16, 48)
    for cfg in (SPLIT_CONFIGS[0], SPLIT_CONFIGS[2]):
        two = TM.mm(a, b, sa, sb, bias, torch.float32, config=cfg)
        one = TM.mm(a, b, sa, sb, bias, torch.float32, config=dataclasses.replace(cfg, one_launch=True))
        assert torch.equal(one, two)


@interp
@pytest.mark.parametrize("swap_ab", [False, True])
def test_sm80_widened_operands_through_the_kernel(swap_ab):
    """WIDEN (sm80: e4m3 bytes widened to fp16 holding value * 2**-8, the
    2**16 folded into the row scale after the K loop), launched directly:
    the launcher picks it only on an sm80 device."""
    import triton

    from scaledmm.ops import fp8_block_triton_quant as ft

    m, n, k, bm, bn = 5, 48, 272, 16, 16
    a, b, sa, sb = operands(m, n, k, KINDS[1], pad=16)
    sa2, sb2 = sa.reshape(m, 1), sb.reshape(n, 1)
    out = poison_(torch.empty(m, n))
    T.mm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn), 1)](
        ft.bytes_view(a, True), ft.bytes_view(b, True), out, out, sa2, sb2, out, out, m, n, k, 1,
        a.stride(0), b.stride(0), out.stride(0), sa2.stride(0), 0, sb2.stride(0), 0, 1e-10,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, SPLIT=False, ONE_LAUNCH=False, SWAP_AB=swap_ab,
        QUANT_A=False, HAS_BIAS=False, A_TMA=False, B_TMA=False, EVEN_K=False, PERSISTENT=False, WARP_SPEC=False,
        SOFT_CVT=True, WIDEN=True, INTERPRET=True, ROWCOL=True, num_warps=4, num_stages=1)
    check(out, a, b, sa, sb, None, torch.float32)


HYP_CONFIGS = [None, SPLIT_CONFIGS[1], SPLIT_CONFIGS[2], PLAIN_CONFIGS[1], PLAIN_CONFIGS[3]]


@interp
@settings(max_examples=20)
@given(m=st.integers(0, 20), n16=st.integers(1, 5), k16=st.integers(1, 20), pad=st.sampled_from([0, 3, 16]),
       kinds=st.sampled_from(KINDS), form=st.integers(0, 2),
       bias=st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32]),
       out_dtype=st.sampled_from(OUT_DTYPES), cfg=st.sampled_from(HYP_CONFIGS), seed=st.integers(0, 2**31 - 1))
def test_hypothesis_shapes_kinds_configs(m, n16, k16, pad, kinds, form, bias, out_dtype, cfg, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    n, k = 16 * n16, 16 * k16
    if cfg is not None and not T.config_ok(cfg, max(m, 1), n, k)[0]:
        cfg = None  # e.g. more splits than K blocks
    a, b, sa, sb = operands(m, n, k, kinds, pad, form=form)
    bv = bias_of(bias, n)
    check(TM.mm(a, b, sa, sb, bv, out_dtype, config=cfg), a, b, sa, sb, bv, out_dtype)


@interp
def test_op_under_forced_backend_record_and_opcheck():
    sets = []
    for m, kinds, bias, dt in ((3, KINDS[0], None, torch.bfloat16), (17, KINDS[1], torch.bfloat16, torch.float16),
                               (1, KINDS[2], torch.float32, torch.float32), (5, KINDS[3], None, torch.bfloat16)):
        a, b, sa, sb = operands(m, 32, 144, kinds, pad=16)
        sets.append((a, b, sa, sb, bias_of(bias, 32), dt))
    with scaledmm.use_backend(Family.FP8, "triton"), backends.record() as calls:
        for args in sets:
            out = OPS.fp8_scaled_mm(*args)
            check(out, *args)
            assert torch.equal(out, TM.mm(*args))  # the op ran this launcher (same default config)
        opcheck(OPS.fp8_scaled_mm.default, sets[1])
    assert calls and {name for op, name, _ in calls if op == "fp8_scaled_mm"} == {"triton"}


@interp
def test_compile_fullgraph_aot_eager():
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, sa, sb, bias: OPS.fp8_scaled_mm(a, b, sa, sb, bias, torch.bfloat16),
                       fullgraph=True, backend="aot_eager")
    with scaledmm.use_backend(Family.FP8, "triton"):
        for m in (3, 17):
            a, b, sa, sb = operands(m, 32, 144, KINDS[1])
            bias = bias_of(torch.bfloat16, 32)
            assert torch.equal(fn(a, b, sa, sb, bias), TM.mm(a, b, sa, sb, bias))


# ============================================================================
# GPU (main process)
# ============================================================================

LLAMA = [(6144, 4096), (4096, 14336)]  # Llama-3-8B qkv_proj, down_proj


def check_gpu(out, a, b, sa, sb, bias, out_dtype, tol):
    """Row-wise and overall relative error against float64 (on the GPU).
    ``tol``: the output dtype's rounding (2**-9 relative for bf16, RNE) plus
    the fp32 sums of the K blocks' MMA partials (sm90's fp8 MMA accumulates
    a 128-wide block with reduced precision, far below 2**-9)."""
    m, n = a.shape[0], b.shape[0]
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    ref, _, _ = ref64(a, b, sa, sb, bias)
    assert torch.isfinite(out).all()
    row = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert row.max().item() < tol, f"worst row {row.argmax().item()}: rel err {row.max().item():.2e}"
    assert rel_err(out, ref) < tol


GPU_TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3, torch.float32: 1e-3}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("nk", LLAMA, ids=lambda nk: f"{nk[0]}x{nk[1]}")
@pytest.mark.parametrize("m", [1, 8, 64, 512])
@pytest.mark.parametrize("kinds", KINDS, ids=lambda k: "x".join(k))
def test_cuda_llama_shapes_vs_float64(nk, m, kinds):
    n, k = nk
    a, b, sa, sb = operands(m, n, k, kinds, 16, device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for bv, dt in ((None, torch.bfloat16), (bias, torch.bfloat16), (bias, torch.float32)):
        out = TM.mm(a, b, sa, sb, bv, dt)
        check_gpu(out, a, b, sa, sb, bv, dt, GPU_TOL[dt])
    with scaledmm.use_backend(Family.FP8, "triton"), backends.record() as calls:
        assert torch.equal(OPS.fp8_scaled_mm(a, b, sa, sb, bias), TM.mm(a, b, sa, sb, bias))
    assert [(op, name) for op, name, _ in calls] == [("fp8_scaled_mm", "triton")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 3, 17, 100])
def test_cuda_odd_m_strides_and_every_candidate(m):
    """Odd M, rows not 16-byte aligned (pad 3), every config the fp8_block
    sweep times for this size; one launch == two launches bit for bit."""
    n, k = 4096, 4096
    for pad in (3, 16):
        a, b, sa, sb = operands(m, n, k, KINDS[1], pad, device="cuda")
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for cfg in T.candidate_configs(m, n, k):
            out = TM.mm(a, b, sa, sb, bias, torch.bfloat16, config=cfg)
            check_gpu(out, a, b, sa, sb, bias, torch.bfloat16, GPU_TOL[torch.bfloat16])
            if cfg.split_k > 1:
                other = dataclasses.replace(cfg, one_launch=not cfg.one_launch)
                assert torch.equal(out, TM.mm(a, b, sa, sb, bias, torch.bfloat16, config=other)), cfg.short()


@pytest.mark.gpu
@gpu
def test_cuda_opcheck_under_forced_backend():
    sets = []
    for m, kinds, dt in ((1, KINDS[1], torch.bfloat16), (17, KINDS[0], torch.float16), (64, KINDS[3], torch.float32)):
        a, b, sa, sb = operands(m, 256, 512, kinds, 16, device="cuda")
        sets.append((a, b, sa, sb, torch.randn(256, device="cuda").to(torch.bfloat16), dt))
    with scaledmm.use_backend(Family.FP8, "triton"), backends.record() as calls:
        for args in sets:
            opcheck(OPS.fp8_scaled_mm.default, args)
    assert {name for op, name, _ in calls if op == "fp8_scaled_mm"} == {"triton"}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 64])
def test_cuda_compile_cuda_graphs_equals_eager(m):
    """``mode="reduce-overhead"``: the op is recorded into a CUDA graph (its
    split-K workspace and one-launch counters come from the graph's pool) and
    replayed on new inputs copied into the same buffers; each replay equals
    the eager call bit for bit (same kernel, same config, fixed split order)."""
    n, k = 6144, 4096
    a, b, sa, sb = operands(m, n, k, KINDS[1], 16, device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    torch._dynamo.reset()
    fn = torch.compile(lambda a, sa: OPS.fp8_scaled_mm(a, b, sa, sb, bias, torch.bfloat16),
                       fullgraph=True, mode="reduce-overhead")
    with scaledmm.use_backend(Family.FP8, "triton"), backends.record() as calls:
        for step in range(4):  # warm-up, record, replays
            fresh, _, fresh_sa, _ = operands(m, n, k, KINDS[1], 16, device="cuda")
            a.copy_(fresh)
            sa.copy_(fresh_sa)
            got = fn(a, sa).clone()  # the graph's output buffer is reused by the next replay
            want = TM.mm(a, b, sa, sb, bias, torch.bfloat16)
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"step {step}"
    assert {name for op, name, _ in calls if op == "fp8_scaled_mm"} == {"triton"}
