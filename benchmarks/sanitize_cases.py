"""The child side of ``benchmarks/sanitize.py``: one small odd-shaped
call of each kernel scaledmm ships, checked against a CPU reference.

Each ``case_*`` builds its inputs on the CPU (fixed seed), runs the kernel
twice (the first call compiles), compares the second result with a float64
(or exact) reference and returns ``(ok, message)``; ``CHILD_CASES`` maps case
names to them.  ``python -m benchmarks.sanitize --child CASE`` runs one under
compute-sanitizer.  torch and scaledmm are imported inside the cases only, so
the parent can import this module without them.
"""

from __future__ import annotations

import time
import zlib

PAD = 64  # extra elements per row of strided operands (the last row ends where the allocation ends)

# Shapes (odd where the op allows it).  fp8_block Triton GEMM: any M, N, K.
FP8B_MNK = (17, 200, 1040)  # K: 9 blocks, the last one 16 wide; rows 16-byte aligned (TMA)
FP8B_LINEAR_MNK = (17, 200, 1152)  # fp8_block_linear / group quant: K % 128 == 0
CUTLASS_MNK = (20, 336, 1152)  # CUTLASS and cuBLAS: M % 4 == 0, N % 16 == 0, K % 128 == 0
NVFP4_MNK = (17, 200, 720)  # K % 16 == 0 (45 scale blocks: padded to 48 columns)
W4A16_M = 3
SKINNY_NK = (208, 1152)  # N % 16 == 0, K % 128 == 0, M <= 16
FP8Q_MK = (17, 1000)


# ----------------------------------------------------------------------------
# Child: one case (imports torch and scaledmm)
# ----------------------------------------------------------------------------


class Skip(Exception):
    """The case cannot run here (reason in the message)."""


def fp8_triton_config(variant: str):
    """The explicit MMConfig of each fp8_block Triton GEMM case."""
    from scaledmm.ops.fp8_block_triton import MMConfig

    return {
        "plain": MMConfig(32, 64, num_warps=4, num_stages=3),
        "splitk": MMConfig(32, 64, split_k=4, num_warps=4, num_stages=4),
        "swap": MMConfig(16, 64, split_k=2, swap_ab=True, num_warps=4, num_stages=6),
        "tma": MMConfig(64, 128, num_warps=4, num_stages=3, tma=True),
        "tma_ws": MMConfig(128, 128, num_warps=8, num_stages=4, tma=True, persistent=True, warp_specialize=True),
    }[variant]


CUTLASS_CONFIGS = {"fp8b_cutlass_coop": "coop128x128_c1x2", "fp8b_cutlass_swap": "swap_coop128x32_c1x1_sfs_sk",
                   "fp8b_cutlass_coop_c1x1": "coop128x128_c1x1", "fp8b_cutlass_coop_c2x1": "coop128x128_c2x1",
                   "fp8b_cutlass_pp": "pp64x128_c1x2", "fp8b_cutlass_coop_sk": "coop128x128_c1x2_sk"}


class Ctx:
    """What a case needs: device, a seeded CPU generator, a progress log."""

    def __init__(self, name: str, device: str):
        import torch

        self.name = name
        self.dev = torch.device(device)
        self.gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        self.t0 = time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"  [{self.name} {time.perf_counter() - self.t0:5.1f}s] {msg}", flush=True)

    def randn(self, *shape, dtype=None, scale: float = 1.0):
        import torch

        t = torch.randn(*shape, generator=self.gen) * scale
        return t if dtype is None else t.to(dtype)

    def rand(self, *shape, lo: float = 0.05):
        import torch

        return torch.rand(*shape, generator=self.gen) + lo

    def strided(self, t):
        """``t`` (CPU, 2-D) on the device as rows of a wider buffer: row stride
        K + PAD, the last row ending where the allocation ends."""
        import torch

        m, k = t.shape
        raw = t.view(torch.uint8) if t.element_size() == 1 else t
        buf = raw.new_zeros((m, k + PAD))
        buf[:, PAD:] = raw
        view = buf.to(self.dev)[:, PAD:]
        return view.view(t.dtype) if t.element_size() == 1 else view

    def sync(self) -> None:
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def twice(self, fn):
        """(warm-up result, result): the first call compiles."""
        first = fn()
        self.sync()
        self.log("warm-up call done")
        second = fn()
        self.sync()
        self.log("second call done")
        return first, second


def _bits(t):
    import torch

    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


def same_bits(x, y) -> bool:
    import torch

    xs, ys = (x, y) if isinstance(x, (tuple, list)) else ((x,), (y,))
    return all(a.shape == b.shape and torch.equal(_bits(a), _bits(b)) for a, b in zip(xs, ys))


def close(out, ref, tol: float, first=None) -> tuple[bool, str]:
    """rel. Frobenius error of ``out`` (device) against a float64 CPU ``ref``."""
    o = out.detach().cpu().double()
    finite = bool(o.isfinite().all())
    rel = float((o - ref).norm() / ref.norm().clamp_min(1e-30))
    msg = f"rel err {rel:.2e} (tol {tol:.0e}), finite {finite}"
    if first is not None:
        msg += f", same bits as warm-up {same_bits(first, out)}"
    return finite and rel < tol, msg


def exact(got, want, what: str, allow_frac: float = 0.0) -> tuple[bool, str]:
    """Byte-wise comparison (mismatch count); ``allow_frac`` of bytes may differ."""
    g, w = _bits(got), _bits(want)
    if g.numel() != w.numel():
        return False, f"{what}: {g.numel()} bytes, expected {w.numel()}"
    bad = int((g != w).sum())
    return bad <= allow_frac * w.numel(), f"{what}: {bad}/{w.numel()} bytes differ"


def need(check: tuple[bool, str], what: str) -> None:
    ok, why = check
    if not ok:
        raise Skip(f"{what}: {why}")


def need_backend(family: str, name: str, problem) -> None:
    from scaledmm import backends

    if name not in backends.names(family):
        raise Skip(f"backend {family}/{name} not registered")
    need(backends.get(family, name).check(problem), f"{family}/{name}")


def _fp8_block_operands(ctx: Ctx, m: int, n: int, k: int):
    from scaledmm.oplib import FP8_DTYPE

    kb, nb = -(-k // 128), -(-n // 128)
    a = ctx.randn(m, k, scale=3.0).clamp(-448, 448).to(FP8_DTYPE)
    b = ctx.randn(n, k, scale=3.0).clamp(-448, 448).to(FP8_DTYPE)
    return a, b, ctx.rand(m, kb), ctx.rand(nb, kb)


def fp8_block_ref(a, b, sa, sb):
    """SPEC formula in float64 (CPU tensors, any K)."""
    m, k = a.shape
    n = b.shape[0]
    sa_e = sa.double().repeat_interleave(128, 1)[:, :k]
    sb_e = sb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (a.float().double() * sa_e) @ (b.float().double() * sb_e).t()


def case_fp8b_tri_mm(ctx: Ctx, variant: str):
    import torch

    from scaledmm.ops import fp8_block_triton as ft

    need(ft.is_supported(ctx.dev), "fp8_block triton")
    m, n, k = FP8B_MNK
    cfg = fp8_triton_config(variant)
    ok, why = ft.config_ok(cfg, m, n, k)
    if not ok:
        raise RuntimeError(f"config {cfg.short()} invalid for {m}x{n}x{k}: {why}")
    a, b, sa, sb = _fp8_block_operands(ctx, m, n, k)
    col = variant in ("swap", "tma")
    sa_d = sa.t().contiguous().to(ctx.dev).t() if col else sa.to(ctx.dev)
    a_d, b_d, sb_d = a.to(ctx.dev), b.to(ctx.dev), sb.to(ctx.dev)
    ctx.log(f"config {cfg.short()}, a_scales {'column' if col else 'row'}-major, TMA usable "
            f"{ft.tma_ok(a_d) and ft.tma_ok(b_d)}")
    first, out = ctx.twice(lambda: ft.mm(a_d, b_d, sa_d, sb_d, torch.bfloat16, config=cfg))
    return close(out, fp8_block_ref(a, b, sa, sb), 1e-2, first)


def case_fp8b_tri_linear(ctx: Ctx):
    import torch

    from scaledmm.ops import fp8_block as base
    from scaledmm.ops import fp8_block_triton as ft

    need(ft.is_supported(ctx.dev), "fp8_block triton")
    m, n, k = FP8B_LINEAR_MNK
    _, b, _, sb = _fp8_block_operands(ctx, m, n, k)
    x = ctx.randn(m, k, dtype=torch.bfloat16, scale=2.0)
    bias = ctx.randn(n, dtype=torch.bfloat16)
    sm90 = ctx.dev.type == "cpu" or ft._capability(ctx.dev) >= (9, 0)
    cfg = ft.default_config(m, n, k, ft._num_sms(ctx.dev), fused=True, sm90=sm90)
    x_d, b_d, sb_d, bias_d = ctx.strided(x), b.to(ctx.dev), sb.to(ctx.dev), bias.to(ctx.dev)
    ctx.log(f"fused config {cfg.short()}, x row stride {x_d.stride(0)}")
    first, out = ctx.twice(lambda: ft.linear(x_d, b_d, sb_d, torch.bfloat16, bias_d, config=cfg, fuse=True))
    q, s = base.reference_quant(x, 128)
    ref = fp8_block_ref(q, b, s, sb) + bias.double()
    return close(out, ref, 1e-2, first)


def case_fp8b_tri_quant(ctx: Ctx, col: bool):
    import torch

    import scaledmm
    from scaledmm.ops import fp8_block as base

    m, _, k = FP8B_LINEAR_MNK
    dtype = torch.float16 if col else torch.bfloat16
    x = ctx.randn(m, k, dtype=dtype, scale=4.0)
    x_d = ctx.strided(x)
    p = scaledmm.backends.Problem(base.FAMILY, ctx.dev, m, 0, k, dtype, torch.float8_e4m3fn, x_d.stride(0),
                                  (("group_size", 128), ("column_major_scales", col), ("scale_ue8m0", col)))
    need_backend("fp8_block", "triton", p)
    with scaledmm.use_backend("fp8_block", "triton"):
        first, (q, s) = ctx.twice(lambda: torch.ops.scaledmm.per_token_group_quant_fp8(x_d, 128, 1e-10, col, col))
    rq, rs = base.reference_quant(x, 128, 1e-10, col, col)
    ok1, m1 = exact(q, rq, "codes", 1e-3)
    ok2, m2 = exact(s, rs, "scales")
    layout = s.stride() == rs.stride() or m <= 1
    return ok1 and ok2 and layout, (f"{m1}; {m2}; scale strides {tuple(s.stride())}; same bits as warm-up "
                                    f"{same_bits(first, (q, s))}")


def case_fp8b_cutlass(ctx: Ctx):
    import torch

    from scaledmm.ops import fp8_block_cutlass as C

    if ctx.dev.type != "cuda":
        raise Skip("needs a CUDA device")
    need(C._is_supported(ctx.dev), "fp8_block cutlass")
    name = CUTLASS_CONFIGS[ctx.name]
    cfg = C.CONFIGS[name]
    spec = C.library_spec(cfg, torch.bfloat16)
    if not spec.cached():
        raise Skip(f"{spec.name} not pre-built in {C.jit.cache_dir()} (a build here would take minutes)")
    try:
        C.load_library(cfg, torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - reported as the skip reason
        raise Skip(f"loading {spec.name} failed: {type(e).__name__}: {e}") from None
    m, n, k = CUTLASS_MNK
    a, b, sa, sb = _fp8_block_operands(ctx, m, n, k)
    col = not cfg.sfa_strided
    a_d = a.to(ctx.dev) if col else ctx.strided(a)
    sa_d = sa.t().contiguous().to(ctx.dev).t() if col else sa.to(ctx.dev)
    b_d, sb_d = b.to(ctx.dev), sb.to(ctx.dev)
    prep = C.prepare(cfg, a_d, b_d, sa_d, sb_d, torch.bfloat16)
    ctx.log(f"config {name}, lda {prep.lda}, a_scales strides {tuple(sa_d.stride())}, copies {list(prep.copies)}")
    first, out = ctx.twice(lambda: C.fp8_block_mm_cutlass(a_d, b_d, sa_d, sb_d, torch.bfloat16, config=name))
    return close(out, fp8_block_ref(a, b, sa, sb), 1e-2, first)


def case_fp8b_cublas(ctx: Ctx):
    import torch

    import scaledmm
    from scaledmm.ops import fp8_block as base

    m, n, k = CUTLASS_MNK
    a, b, sa, sb = _fp8_block_operands(ctx, m, n, k)
    a_d, b_d, sb_d = a.to(ctx.dev), b.to(ctx.dev), sb.to(ctx.dev)
    sa_d = sa.t().contiguous().to(ctx.dev).t()
    need_backend("fp8_block", "cublas", base.problem(a_d, b_d, (128, 128), torch.bfloat16, True))
    path = "v1 torch._scaled_mm" if base._cublas_v1_scales_ok(*sb.shape) else "F.scaled_mm (padded L4 scales)"
    ctx.log(f"cuBLAS path: {path}")
    with scaledmm.use_backend("fp8_block", "cublas"):
        first, out = ctx.twice(lambda: torch.ops.scaledmm.fp8_block_mm(a_d, b_d, sa_d, sb_d, [128, 128],
                                                                        torch.bfloat16))
    ok, msg = close(out, fp8_block_ref(a, b, sa, sb), 1e-2, first)
    return ok, f"{path}: {msg}"


def _nvfp4_quantized(ctx: Ctx, rows: int, k: int):
    """(x, q, s, gs): a bf16 tensor, its NVFP4 codes and swizzled scales (CPU reference)."""
    import torch

    from scaledmm.ops import nvfp4 as nv

    x = ctx.randn(rows, k, dtype=torch.bfloat16, scale=2.0)
    gs = (448.0 * 6.0 / x.float().abs().amax()).reshape(())
    q, s = nv.reference_quant(x, gs)
    return x, q, s, gs


def case_nvfp4_mm(ctx: Ctx):
    import torch

    import scaledmm
    from scaledmm.ops import nvfp4 as nv

    m, n, k = NVFP4_MNK
    _, qa, sa, ga = _nvfp4_quantized(ctx, m, k)
    _, qb, sb, gb = _nvfp4_quantized(ctx, n, k)
    alpha = (1.0 / (ga * gb)).float()
    d = [t.to(ctx.dev) for t in (qa, qb, sa, sb, alpha)]
    need_backend("nvfp4", "triton", nv.mm_problem(d[0], d[1], torch.bfloat16, None))
    from scaledmm.ops import nvfp4_triton as nt

    ctx.log(f"config {nt.default_config(nv.mm_problem(d[0], d[1], torch.bfloat16, None)).label()}")
    with scaledmm.use_backend("nvfp4", "triton"):
        first, out = ctx.twice(lambda: torch.ops.scaledmm.nvfp4_mm(*d))
    ref = (nv.dequantize(qa, sa).double() @ nv.dequantize(qb, sb).double().t()) * float(alpha)
    return close(out, ref, 1e-2, first)


def case_nvfp4_w4a16(ctx: Ctx):
    import torch

    import scaledmm
    from scaledmm.ops import nvfp4 as nv

    _, n, k = NVFP4_MNK
    m = W4A16_M
    x = ctx.randn(m, k, dtype=torch.bfloat16)
    _, qb, sb, gb = _nvfp4_quantized(ctx, n, k)
    walpha = (1.0 / gb).float()
    bias = ctx.randn(n, dtype=torch.bfloat16)
    x_d = ctx.strided(x)
    qb_d, sb_d, wa_d, bias_d = (t.to(ctx.dev) for t in (qb, sb, walpha, bias))
    need_backend("nvfp4", "triton", nv.w4a16_problem(x_d, qb_d, torch.bfloat16, bias_d))
    with scaledmm.use_backend("nvfp4", "triton"):
        first, out = ctx.twice(lambda: torch.ops.scaledmm.nvfp4_w4a16_mm(x_d, qb_d, sb_d, wa_d, torch.bfloat16,
                                                                          bias_d))
    ref = x.double() @ (nv.dequantize(qb, sb).double() * float(walpha)).t() + bias.double()
    return close(out, ref, 1e-2, first)


def case_fp8_gemv(ctx: Ctx, block: bool):
    """cuda_gemv (csrc/fp8_gemv.cu): ``fp8_linear`` through the op (per-token x
    per-channel, M = 5, strided bf16 rows), or ``fp8_block_linear`` through
    the backend entry with K split over a 2-CTA cluster (M = 13: the 16-row
    bucket, fp16 activation, N = 200 with a partial row tile, bf16 bias)."""
    import torch

    import scaledmm
    from scaledmm.ops import fp8 as f8
    from scaledmm.ops import fp8_block as fb
    from scaledmm.ops import fp8_gemv as fg

    _, n, k = FP8B_LINEAR_MNK
    if not block:
        n = 208  # fp8_linear: N % 16 == 0
        x = ctx.randn(5, k, dtype=torch.bfloat16, scale=2.0)
        w, ws = f8.reference_quant(ctx.randn(n, k), None, True)
        x_d, w_d, ws_d = ctx.strided(x), w.to(ctx.dev), ws.reshape(-1).to(ctx.dev)
        need_backend("fp8", "cuda_gemv", f8.linear_problem(x_d, w_d, None, True, f8.CHANNEL, None, torch.bfloat16))
        with scaledmm.use_backend("fp8", "cuda_gemv"):
            first, out = ctx.twice(lambda: torch.ops.scaledmm.fp8_linear(x_d, w_d, ws_d, None, True))
        q, sq = f8.reference_quant(x, None, True)
        ref = (q.double() * sq.double()) @ (w.double() * ws.double().reshape(-1, 1)).t()
        return close(out, ref, 1e-2, first)
    x = ctx.randn(13, k, dtype=torch.float16, scale=2.0)
    w, ws = fb.quantize_weight(ctx.randn(n, k))
    bias = ctx.randn(n, dtype=torch.bfloat16)
    d = [t.to(ctx.dev) for t in (x, w, ws, bias)]
    need_backend("fp8_block", "cuda_gemv", fb.linear_problem(d[0], d[1], (128, 128), torch.bfloat16))
    cfg = fg.GemvConfig(16, 2, 2, 1)
    first, out = ctx.twice(lambda: fg.gemv_block_linear(d[0], d[1], d[2], (128, 128), torch.bfloat16, d[3], cfg=cfg))
    ref = fb.reference_linear(x.float(), w, ws, (128, 128), torch.float32, bias.float()).double()
    return close(out, ref, 1e-2, first)


GEMV_MNK = (5, 200, 736)  # M <= 16, K % 32 == 0 with a partial 128-k unit


def case_nvfp4_gemv(ctx: Ctx, w4a16: bool, rows: int | None = None, backend: str = "cuda_gemv",
                    stages: int = 0):
    """cuda_gemv (csrc/nvfp4_gemv.cu) through the op: W4A4 at M = 5 (or
    ``rows``, read through a row stride: 29 is the 32-row bucket), or W4A16
    with a strided bf16 activation at M = 9 (two activation fragments).
    ``backend="cuda_mid"`` runs csrc/nvfp4_mid.cu the same way; ``stages``:
    the gemv's shared-memory ring of that depth (two warps, one unit a batch)."""
    import torch

    import scaledmm
    from scaledmm.ops import nvfp4 as nv
    from scaledmm.ops import nvfp4_gemv as gv

    def forced(op, args):
        if not stages:
            return op(*args)
        return (gv.gemv_w4a16 if w4a16 else gv.gemv_mm)(*args, cfg=gv.GemvConfig(16, 2, 1, 1, stages))

    m, n, k = GEMV_MNK
    _, qb, sb, gb = _nvfp4_quantized(ctx, n, k)
    qb_d, sb_d = qb.to(ctx.dev), sb.to(ctx.dev)
    if w4a16:
        m = rows or 9
        x = ctx.randn(m, k, dtype=torch.bfloat16)
        walpha = (1.0 / gb).float()
        x_d, wa_d = ctx.strided(x), walpha.to(ctx.dev)
        need_backend("nvfp4", backend, nv.w4a16_problem(x_d, qb_d, torch.bfloat16, None))
        with scaledmm.use_backend("nvfp4", backend):
            first, out = ctx.twice(lambda: forced(torch.ops.scaledmm.nvfp4_w4a16_mm, (x_d, qb_d, sb_d, wa_d)))
        ref = x.double() @ nv.dequantize(qb, sb).double().t() * float(walpha)
        return close(out, ref, 1e-2, first)
    m = rows or m
    _, qa, sa, ga = _nvfp4_quantized(ctx, m, k)
    alpha = (1.0 / (ga * gb)).float()
    d = [t.to(ctx.dev) for t in (qa, qb, sa, sb, alpha)]
    if rows:
        d[0] = ctx.strided(qa)
    need_backend("nvfp4", backend, nv.mm_problem(d[0], d[1], torch.bfloat16, None))
    with scaledmm.use_backend("nvfp4", backend):
        first, out = ctx.twice(lambda: forced(torch.ops.scaledmm.nvfp4_mm, d))
    ref = (nv.dequantize(qa, sa).double() @ nv.dequantize(qb, sb).double().t()) * float(alpha)
    return close(out, ref, 1e-2, first)


def case_nvfp4_gemv_linear(ctx: Ctx):
    """cuda_gemv quantizing in the kernel (``nvfp4_linear``): M = 7 strided
    bf16 rows, a bias; the result must equal the reference quantization's
    GEMM within the usual bound."""
    import torch

    import scaledmm
    from scaledmm.ops import nvfp4 as nv

    _, n, k = GEMV_MNK
    m = 7
    x, qa, sa, ga = _nvfp4_quantized(ctx, m, k)
    _, qb, sb, gb = _nvfp4_quantized(ctx, n, k)
    alpha = (1.0 / (ga * gb)).float()
    bias = ctx.randn(n, dtype=torch.bfloat16)
    x_d = ctx.strided(x)
    qb_d, sb_d, gs_d, alpha_d, bias_d = (t.to(ctx.dev) for t in (qb, sb, ga.float(), alpha, bias))
    need_backend("nvfp4", "cuda_gemv", nv.linear_problem(x_d, qb_d, torch.bfloat16, bias_d))
    with scaledmm.use_backend("nvfp4", "cuda_gemv"):
        first, out = ctx.twice(lambda: torch.ops.scaledmm.nvfp4_linear(x_d, qb_d, sb_d, gs_d, alpha_d,
                                                                       torch.bfloat16, bias_d))
    ref = (nv.dequantize(qa, sa).double() @ nv.dequantize(qb, sb).double().t()) * float(alpha) + bias.double()
    return close(out, ref, 1e-2, first)


def case_nvfp4_wgmma(ctx: Ctx, w4a16: bool, pwg: bool = False, persistent: bool = False):
    """cuda_wgmma (csrc/nvfp4_wgmma.cu: TMA ring, producer warp, wgmma): W4A4
    at M = 100 in two 64-row tiles with K split over a 2-CTA cluster (``pwg``:
    one 256-row tile, two warpgroups fed by a producer warpgroup that gives
    them its registers, K unsplit), or W4A16 with a strided bf16 activation at M = 40 in
    one 32-row-padded tile (N = 200: a partial weight tile; rows past M and N
    arrive as TMA zeros).  ``persistent``: W4A4 at M = 600, N = 2100 in
    128 x 64 tiles (one warpgroup) on a persistent grid: 165 tiles, so some
    CTAs take two, the ring running on between them."""
    import torch

    from scaledmm.ops import nvfp4 as nv
    from scaledmm.ops import nvfp4_triton_decode as nd
    from scaledmm.ops import nvfp4_wgmma as wg

    m, n, k = (40 if w4a16 else 600 if persistent else 100), (2100 if persistent else GEMV_MNK[1]), 768
    _, qb, sb, gb = _nvfp4_quantized(ctx, n, k)
    qb_d, sb_d = qb.to(ctx.dev), sb.to(ctx.dev)
    if w4a16:
        x = ctx.randn(m, k, dtype=torch.bfloat16)
        walpha = (1.0 / gb).float()
        x_d, wa_d = ctx.strided(wg.permute_k(x)), walpha.to(ctx.dev)  # the kernel's K order
        need_backend("nvfp4", "cuda_wgmma", nv.w4a16_problem(x_d, qb_d, torch.bfloat16, None))
        cfg = wg.WgmmaConfig(64, 1, 4, 1)
        first, out = ctx.twice(lambda: wg.launch(x_d, qb_d, sb_d, wa_d, None, nv.mm_output(x_d, qb_d, torch.bfloat16),
                                                 cfg))
        ref = x.double() @ nv.dequantize(qb, sb).double().t() * float(walpha)
        return close(out, ref, 1e-2, first)
    _, qa, sa, ga = _nvfp4_quantized(ctx, m, k)
    alpha = (1.0 / (ga * gb)).float()
    a_d, sa_d, al_d = qa.to(ctx.dev), sa.to(ctx.dev), alpha.to(ctx.dev)
    need_backend("nvfp4", "cuda_wgmma", nv.mm_problem(a_d, qb_d, torch.bfloat16, None))
    cfg = (wg.WgmmaConfig(256, 2, 4, 1, 1) if pwg else wg.WgmmaConfig(128, 1, 4, 1, 0, 1) if persistent
           else wg.WgmmaConfig(64, 2, 4, 2))
    first, out = ctx.twice(lambda: wg.launch(nd.dequant(a_d, sa_d, torch.float16, permute_k=True), qb_d, sb_d, al_d, None,
                                             nv.mm_output(a_d, qb_d, torch.bfloat16), cfg))
    ref = (nv.dequantize(qa, sa).double() @ nv.dequantize(qb, sb).double().t()) * float(alpha)
    return close(out, ref, 1e-2, first)


def case_fp8_wgmma(ctx: Ctx, split: bool, warpgroups: int = 1, pwg: bool = False):
    """cuda_wgmma of fp8 (csrc/fp8_wgmma.cu: TMA ring, producer warp, e4m3
    wgmma): ``fp8_scaled_mm`` per-token x per-channel at M = 100 in two 64-row
    tiles, one warpgroup (the stage's four k32 steps in one group) with K
    split over a 2-CTA cluster, or two warpgroups (two groups of two) without
    a split (``pwg``: one 128 x 128 tile, a producer warpgroup handing its
    registers to two consumer warpgroups); or through the op at M = 5 with
    strided rows, per-tensor scales, an fp32 output and a bf16 bias (one
    16-row tile, one warpgroup, two stages).  N = 208 leaves a partial weight
    tile, K = 1040 a 16-wide tail stage: rows and columns past the tensors
    arrive as TMA zeros."""
    import torch

    import scaledmm
    from scaledmm.ops import fp8 as f8
    from scaledmm.ops import fp8_wgmma as fw

    m, n, k = (100 if split else 5), 208, 1040
    a, sa = f8.reference_quant(ctx.randn(m, k, scale=2.0), None, split)
    b, sb = f8.reference_quant(ctx.randn(n, k), None, split)
    sb = sb.reshape(-1)
    ref = (a.double() * sa.double().reshape(-1, 1)) @ (b.double() * sb.double().reshape(-1, 1)).t()
    if split:
        d = [t.to(ctx.dev) for t in (a, b, sa, sb)]
        need_backend("fp8", "cuda_wgmma", f8.mm_problem(d[0], d[1], f8.TOKEN, f8.CHANNEL, None, torch.bfloat16))
        cfg = (fw.WgmmaConfig(128, 2, 4, 1, 1, 1) if pwg
               else fw.WgmmaConfig(64, warpgroups, 4, 2 if warpgroups == 1 else 1))
        first, out = ctx.twice(lambda: fw.launch(*d, None, f8.mm_output(d[0], d[1], torch.bfloat16), cfg))
        return close(out, ref, 1e-2, first)
    bias = ctx.randn(n, dtype=torch.bfloat16)
    a_d = ctx.strided(a)
    d = [t.to(ctx.dev) for t in (b, sa, sb, bias)]
    need_backend("fp8", "cuda_wgmma", f8.mm_problem(a_d, d[0], f8.TENSOR, f8.TENSOR, d[3], torch.float32))
    cfg = fw.WgmmaConfig(16, 1, 2, 1)
    first, out = ctx.twice(lambda: fw.wgmma_mm(a_d, *d, torch.float32, cfg=cfg))
    return close(out, ref + bias.double(), 1e-2, first)


def case_fp8_wgmma_block(ctx: Ctx, chain: int):
    """cuda_wgmma of fp8_block (csrc/fp8_wgmma.cu with G_BLOCK: the producer
    warp's cp.async scale copies arriving on the stage barrier, block scales
    at each promotion): M = 100 in two 64-row tiles with column-major
    activation scales; ``chain`` 4: one warpgroup, the stage's four k32 steps
    chained, K split over a 2-CTA cluster; ``chain`` 1: two warpgroups, two
    groups of two fresh fragments, row-major scales.  N = 208 leaves a partial
    weight tile and scale block, K = 1040 a 16-wide tail stage."""
    import torch

    from scaledmm.ops import fp8_block as fb
    from scaledmm.ops import fp8_wgmma as fw

    m, n, k = 100, 208, 1040  # K: nine scale groups, the last 16 wide
    fp8 = torch.float8_e4m3fn
    a, b = ctx.randn(m, k, scale=2.0).to(fp8), ctx.randn(n, k, scale=2.0).to(fp8)
    sa, sb = ctx.rand(m, 9), ctx.rand(2, 9)
    ref = fb.reference_mm_f32(a, b, sa, sb, (128, 128)).double()
    a_d, b_d, sb_d = a.to(ctx.dev), b.to(ctx.dev), sb.to(ctx.dev)
    sa_d = sa.to(ctx.dev).t().contiguous().t() if chain != 1 else sa.to(ctx.dev)
    need_backend("fp8_block", "cuda_wgmma", fb.problem(a_d, b_d, (128, 128), torch.bfloat16, chain != 1))
    cfg = {4: fw.WgmmaConfig(64, 1, 4, 2, 4), 1: fw.WgmmaConfig(64, 2, 4, 1, 1)}[chain]
    first, out = ctx.twice(lambda: fw.block_mm(a_d, b_d, sa_d, sb_d, (128, 128), torch.bfloat16, cfg=cfg))
    return close(out, ref, 1e-2, first)


def case_fp8_wgmma_persistent(ctx: Ctx):
    """cuda_wgmma with a persistent grid (``WgmmaConfig.persistent``: the ring
    running on from tile to tile, the producer loading the next tile during
    the epilogue): more tiles than an H100 / H200 holds CTAs, so CTAs take
    two or more.  ``fp8_scaled_mm`` per-token x per-channel at M = 1000, N =
    1040 in 64 x 64 tiles (one warpgroup; 272 tiles).  The last activation
    tile and weight tile run past M and N, K = 1040 ends in a 16-wide stage.
    (The block-scaled form, refused by ``config_valid``, is not
    racecheck-clean: benchmarks/NOTES.md.)"""
    import torch

    from scaledmm.ops import fp8 as f8
    from scaledmm.ops import fp8_wgmma as fw

    m, n, k = 1000, 1040, 1040
    a, sa = f8.reference_quant(ctx.randn(m, k, scale=2.0), None, True)
    b, sb = f8.reference_quant(ctx.randn(n, k), None, True)
    sb = sb.reshape(-1)
    ref = (a.double() * sa.double().reshape(-1, 1)) @ (b.double() * sb.double().reshape(-1, 1)).t()
    d = [t.to(ctx.dev) for t in (a, b, sa, sb)]
    need_backend("fp8", "cuda_wgmma", f8.mm_problem(d[0], d[1], f8.TOKEN, f8.CHANNEL, None, torch.bfloat16))
    cfg = fw.WgmmaConfig(64, 1, 4, 1, 1, 0, 1)
    first, out = ctx.twice(lambda: fw.launch(*d, None, f8.mm_output(d[0], d[1], torch.bfloat16), cfg))
    return close(out, ref, 1e-2, first)


def case_fp8_wgmma_linear(ctx: Ctx, warpgroups: int):
    """cuda_wgmma of fp8_block_linear (csrc/fp8_wgmma.cu with G_QUANT: the
    16-bit activation by TMA into a staging slot, quantized by the consumer
    threads into the swizzled e4m3 slot, an async-proxy fence and a named
    barrier before the stage's MMAs): M = 100 in two 64-row tiles (the second
    partly past M), N = 208 a partial weight tile, K = 1152 nine groups split
    over a 2-CTA cluster; one warpgroup, or two sharing the quantization."""
    import torch

    from scaledmm.ops import fp8_block as fb
    from scaledmm.ops import fp8_wgmma as fw

    m, n, k = 100, 208, 1152
    x = ctx.randn(m, k, scale=2.0).to(torch.bfloat16)
    b = ctx.randn(n, k, scale=2.0).to(torch.float8_e4m3fn)
    sb = ctx.rand(2, 9)
    ref = fb.reference_linear(x, b, sb, (128, 128), torch.float32).double()
    x_d, b_d, sb_d = x.to(ctx.dev), b.to(ctx.dev), sb.to(ctx.dev)
    need(fw.is_supported(x_d.device), "fp8_wgmma block_linear")  # not a registered backend: no problem check
    cfg = fw.WgmmaConfig(64, warpgroups, 3, 2, 4)
    first, out = ctx.twice(lambda: fw.block_linear(x_d, b_d, sb_d, (128, 128), torch.bfloat16, cfg=cfg))
    return close(out, ref, 1e-2, first)


def case_nvfp4_mid_ring(ctx: Ctx):
    """cuda_mid with the cp.async weight ring (``MidConfig.ring``, not in any
    table yet): W4A4 at M = 100 (two 64-row slices), strided, split K in two
    with three pipeline steps per CTA (the ring's prologue and empty groups)."""
    import torch

    from scaledmm.ops import nvfp4 as nv
    from scaledmm.ops import nvfp4_mid as md

    m, n, k = 100, GEMV_MNK[1], GEMV_MNK[2]
    _, qa, sa, ga = _nvfp4_quantized(ctx, m, k)
    _, qb, sb, gb = _nvfp4_quantized(ctx, n, k)
    alpha = (1.0 / (ga * gb)).float()
    need_backend("nvfp4", "cuda_mid", nv.mm_problem(qa.to(ctx.dev), qb.to(ctx.dev), torch.bfloat16, None))
    a_d = ctx.strided(qa)
    d = [t.to(ctx.dev) for t in (qb, sa, sb, alpha)]
    cfg = md.MidConfig(4, 1, 2, 1, 3)
    first, out = ctx.twice(lambda: md.launch(a_d, d[0], d[1], d[2], d[3], None,
                                             nv.mm_output(a_d, d[0], torch.bfloat16), cfg))
    ref = (nv.dequantize(qa, sa).double() @ nv.dequantize(qb, sb).double().t()) * float(alpha)
    return close(out, ref, 1e-2, first)


def case_nvfp4_decode_cublas(ctx: Ctx):
    """decode_cublas (ops/nvfp4_cublas.py), M just above MIN_M, N not a multiple
    of 128, with bias: Triton decodes, then cuBLAS fp32-out mm + the Triton
    epilogue, or one cuBLASLt call (the case's SCALEDMM_NVFP4_CUBLASLT)."""
    import torch

    import scaledmm
    from scaledmm.ops import nvfp4 as nv
    from scaledmm.ops import nvfp4_cublas as dc

    m, n, k = dc.MIN_M + 2, 200, 736
    _, qa, sa, ga = _nvfp4_quantized(ctx, m, k)
    _, qb, sb, gb = _nvfp4_quantized(ctx, n, k)
    alpha = (1.0 / (ga * gb)).float()
    bias = ctx.randn(n)
    d = [t.to(ctx.dev) for t in (qa, qb, sa, sb, alpha)]
    bias_d = bias.to(ctx.dev)
    need_backend("nvfp4", dc.NAME, nv.mm_problem(d[0], d[1], torch.bfloat16, bias_d))
    with scaledmm.use_backend("nvfp4", dc.NAME):
        first, out = ctx.twice(lambda: torch.ops.scaledmm.nvfp4_mm(*d, torch.bfloat16, bias_d))
    ref = (nv.dequantize(qa, sa).double() @ nv.dequantize(qb, sb).double().t()) * float(alpha) + bias.double()
    return close(out, ref, 1e-2, first)


def case_nvfp4_quant(ctx: Ctx):
    import torch

    import scaledmm
    from scaledmm.ops import nvfp4 as nv

    m, _, k = NVFP4_MNK
    x = ctx.randn(m, k, dtype=torch.bfloat16, scale=3.0)
    gs = (448.0 * 6.0 / x.float().abs().amax()).reshape(()).float()
    x_d, gs_d = ctx.strided(x), gs.to(ctx.dev)
    need_backend("nvfp4", "triton", nv.quant_problem(x_d, True))
    with scaledmm.use_backend("nvfp4", "triton"):
        first, (q, s) = ctx.twice(lambda: torch.ops.scaledmm.nvfp4_quant(x_d, gs_d, True))
    rq, rs = nv.reference_quant(x, gs, True)
    ok1, m1 = exact(q, rq, "codes", 1e-3)
    ok2, m2 = exact(s, rs, "swizzled scales (pad included)")
    return ok1 and ok2, f"{m1}; {m2}; same bits as warm-up {same_bits(first, (q, s))}"


def case_fp8_quant(ctx: Ctx):
    import importlib

    import torch

    import scaledmm
    from scaledmm import backends
    from scaledmm.ops import fp8

    try:
        importlib.import_module("scaledmm.ops.fp8_triton_quant")
    except ModuleNotFoundError as e:
        if e.name and e.name.endswith("fp8_triton_quant"):
            raise Skip("ops/fp8_triton_quant.py is not there yet") from None
        raise
    names = [nm for nm in backends.names("fp8") if "quant_fp8" in backends.get("fp8", nm).impls
             and backends.get("fp8", nm).impls["quant_fp8"] is not fp8.reference_quant]
    if not names:
        raise Skip("no fp8 backend registers a quant_fp8 kernel")
    name = "triton" if "triton" in names else names[0]
    m, k = FP8Q_MK
    x = ctx.randn(m, k, dtype=torch.bfloat16, scale=3.0)
    x_d = ctx.strided(x)
    static = torch.tensor([0.02])
    modes = {"per_token": (None, True), "per_tensor": (None, False), "static": (static, False)}
    msgs, ok_all, ran = [], True, 0
    for mode, (scale, per_token) in modes.items():
        p = backends.Problem(fp8.FAMILY, ctx.dev, m, 0, k, x.dtype, torch.float8_e4m3fn, x_d.stride(0),
                             (("quant", mode),))
        ok, why = backends.get("fp8", name).check(p)
        if not ok:
            msgs.append(f"{mode}: not implemented ({why})")
            continue
        s_d = None if scale is None else scale.to(ctx.dev)
        with scaledmm.use_backend("fp8", name):
            first, (q, s) = ctx.twice(lambda: torch.ops.scaledmm.quant_fp8(x_d, s_d, per_token))
        rq, rs = fp8.reference_quant(x, scale, per_token)
        srel = float(((s.cpu().double() - rs.double()).abs() / rs.double().abs()).max())
        okq, mq = exact(q, rq, "codes", 1e-2)
        ok_all &= okq and srel <= 1e-6
        ran += 1
        msgs.append(f"{mode}: {mq}, scale rel diff {srel:.1e}, same bits {same_bits(first, (q, s))}")
    if not ran:
        raise Skip(f"backend fp8/{name}: " + "; ".join(msgs))
    return ok_all, f"backend {name}: " + "; ".join(msgs)


def case_skinny(ctx: Ctx, kernel: str):
    import torch

    import scaledmm
    from scaledmm.device import sm_count
    from scaledmm.ops import skinny
    from scaledmm.ops import skinny_fused_a as fa

    n, k = SKINNY_NK
    m = 3 if kernel == "reg" else 9
    x = ctx.randn(m, k, dtype=torch.bfloat16)
    w = ctx.randn(n, k, dtype=torch.bfloat16, scale=k ** -0.5)
    x_d, w_d = ctx.strided(x), w.to(ctx.dev)
    need_backend("skinny", "fused_a", skinny.problem(x_d, w_d, False))
    if fa.KERNEL != kernel:  # read at import: one skinny case per process
        raise RuntimeError(f"SCALEDMM_SKINNY_KERNEL gave {fa.KERNEL!r} at import, this case needs {kernel!r}")
    sms = sm_count(ctx.dev)
    cfgs = [fa.choose_config(n, k, m, pdl, sms) for pdl in (False, True)]
    ctx.log(f"configs {cfgs[0].short()} / PDL {cfgs[1].short()}, x row stride {x_d.stride(0)}")
    with scaledmm.use_backend("skinny", "fused_a"):
        first, out = ctx.twice(lambda: torch.ops.scaledmm.dsv3_fused_a_gemm(x_d, w_d))
        pdl = torch.ops.scaledmm.dsv3_fused_a_gemm(x_d, w_d, True)
        ctx.sync()
        ctx.log("PDL call done")
    ref = x.double() @ w.double().t()
    ok, msg = close(out, ref, 8e-3, first)
    ok_p, msg_p = close(pdl, ref, 8e-3)
    return ok and ok_p, f"{msg}; PDL: {msg_p}, same bits as without {same_bits(pdl, out)}"


CHILD_CASES = {
    **{f"fp8b_tri_mm_{v}": (lambda ctx, v=v: case_fp8b_tri_mm(ctx, v))
       for v in ("plain", "splitk", "swap", "tma", "tma_ws")},
    "fp8b_tri_linear_fused": case_fp8b_tri_linear,
    "fp8b_tri_quant_row": lambda ctx: case_fp8b_tri_quant(ctx, False),
    "fp8b_tri_quant_col": lambda ctx: case_fp8b_tri_quant(ctx, True),
    "fp8b_cutlass_coop": case_fp8b_cutlass,
    "fp8b_cutlass_swap": case_fp8b_cutlass,
    "fp8b_cutlass_coop_c1x1": case_fp8b_cutlass,
    "fp8b_cutlass_coop_c2x1": case_fp8b_cutlass,
    "fp8b_cutlass_pp": case_fp8b_cutlass,
    "fp8b_cutlass_coop_sk": case_fp8b_cutlass,
    "fp8b_cublas": case_fp8b_cublas,
    "nvfp4_tri_mm": case_nvfp4_mm,
    "nvfp4_tri_w4a16": case_nvfp4_w4a16,
    "nvfp4_tri_quant": case_nvfp4_quant,
    "fp8_gemv_token": lambda ctx: case_fp8_gemv(ctx, False),
    "fp8_gemv_block_split": lambda ctx: case_fp8_gemv(ctx, True),
    "nvfp4_gemv_w4a4": lambda ctx: case_nvfp4_gemv(ctx, False),
    "nvfp4_gemv_w4a16": lambda ctx: case_nvfp4_gemv(ctx, True),
    "nvfp4_gemv_wide": lambda ctx: case_nvfp4_gemv(ctx, False, 29),
    "nvfp4_gemv_ring": lambda ctx: case_nvfp4_gemv(ctx, False, stages=3),
    "nvfp4_gemv_ring_w4a16": lambda ctx: case_nvfp4_gemv(ctx, True, stages=4),
    "nvfp4_gemv_linear": case_nvfp4_gemv_linear,
    "nvfp4_mid_w4a4": lambda ctx: case_nvfp4_gemv(ctx, False, 100, "cuda_mid"),
    "nvfp4_mid_w4a16": lambda ctx: case_nvfp4_gemv(ctx, True, 40, "cuda_mid"),
    "nvfp4_mid_ring": case_nvfp4_mid_ring,
    "nvfp4_wgmma_w4a4": lambda ctx: case_nvfp4_wgmma(ctx, False),
    "nvfp4_wgmma_w4a16": lambda ctx: case_nvfp4_wgmma(ctx, True),
    "nvfp4_wgmma_pwg": lambda ctx: case_nvfp4_wgmma(ctx, False, True),
    "nvfp4_wgmma_persistent": lambda ctx: case_nvfp4_wgmma(ctx, False, persistent=True),
    "nvfp4_decode_cublas": case_nvfp4_decode_cublas,
    "nvfp4_decode_cublaslt": case_nvfp4_decode_cublas,
    "fp8_wgmma_split": lambda ctx: case_fp8_wgmma(ctx, True),
    "fp8_wgmma_tensor": lambda ctx: case_fp8_wgmma(ctx, False),
    "fp8_wgmma_two_wg": lambda ctx: case_fp8_wgmma(ctx, True, 2),
    "fp8_wgmma_block_chain": lambda ctx: case_fp8_wgmma_block(ctx, 4),
    "fp8_wgmma_block_two_wg": lambda ctx: case_fp8_wgmma_block(ctx, 1),
    "fp8_wgmma_pwg": lambda ctx: case_fp8_wgmma(ctx, True, 2, pwg=True),
    "fp8_wgmma_persistent": case_fp8_wgmma_persistent,
    "fp8_wgmma_linear": lambda ctx: case_fp8_wgmma_linear(ctx, 1),
    "fp8_wgmma_linear_two_wg": lambda ctx: case_fp8_wgmma_linear(ctx, 2),
    "fp8_tri_quant": case_fp8_quant,
    "skinny_v1": lambda ctx: case_skinny(ctx, "reg"),
    "skinny_v2": lambda ctx: case_skinny(ctx, "tma"),
}
