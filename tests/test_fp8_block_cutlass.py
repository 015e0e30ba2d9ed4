"""CUTLASS sm90 backend of fp8_block (ops/fp8_block_cutlass.py, csrc/fp8_block_cutlass.cu).

CPU: the config space and its one validity predicate, the table, the argument
preparation (strides, scale layouts, copies) on CPU tensors, the ctypes mirror
of the C argument struct, the portable cache key, and one real nvcc build of a
config (skipped without nvcc or the CUTLASS headers).
GPU (sm90 only): every config against a float64 reference on the DeepSeek-V3
shapes, odd M through the padded op, NaN-poisoned outputs, CUDA-graph capture
and replay, opcheck and torch.compile with the backend forced.  Run them with
``SCALEDMM_CACHE_DIR`` pointing at a pre-built cache
(``python -m scaledmm.jit build --fp8-block-cutlass all:bf16,fp16,fp32``), or
each missing library is compiled on first use (about a minute each).
"""

import ctypes
import dataclasses
import math

import pytest
import torch
from hypothesis import given, strategies as st

import scaledmm
from helpers import FP8, opcheck, poison_, rel_err
from scaledmm import backends, jit
from scaledmm.backends import Family, Problem
from scaledmm.ops import fp8_block as base
from scaledmm.ops import fp8_block_cutlass as C

CFG = C.CutlassConfig
DSV3 = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (576, 7168)]

is_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
requires_sm90 = pytest.mark.skipif(not is_sm90, reason="needs an sm90 GPU")
can_build = jit.nvcc_path() is not None and C.cutlass_include_dir() is not None
requires_build = pytest.mark.skipif(not can_build, reason="needs nvcc and the CUTLASS headers")


def problem(m=128, n=256, k=512, out_dtype=torch.bfloat16, block=(128, 128), row_stride=None):
    return Problem(Family.FP8_BLOCK, torch.device("cpu"), m, n, k, FP8, out_dtype,
                   k if row_stride is None else row_stride, (("block_size", block), ("a_scales_col_major", False)))


def rand_fp8(shape, device="cpu"):
    return torch.randn(shape, device=device).clamp(-448, 448).to(FP8)


def inputs(m, n, k, device="cpu", layout="row", row_pad=0, b_scale_pad=False):
    """a [m, k] (optionally a view with row stride k + row_pad), b, a_scales in
    ``layout`` ("row", "col", "rowpad": row-major with a padded row stride), b_scales."""
    a = rand_fp8((m, k + row_pad), device)[:, :k]
    b = rand_fp8((n, k), device)
    kb, nb = k // 128, math.ceil(n / 128)
    sa = torch.rand(m, kb, device=device) + 0.05
    if layout == "col":
        sa = sa.t().contiguous().t()
    elif layout == "rowpad":
        sa = torch.nn.functional.pad(sa, (0, 3))[:, :kb]
    sb = torch.rand(nb, kb, device=device) + 0.05
    if b_scale_pad:
        sb = base.pad_scale_rows(sb, 4)
    return a, b, sa, sb


def ref64(a, b, sa, sb):
    """SPEC formula in float64 (dequantize, matmul) on the operands' device."""
    k = a.shape[1]
    sa64 = sa.double().repeat_interleave(128, 1)[:, :k]
    sb64 = sb.double().repeat_interleave(128, 0)[: b.shape[0]].repeat_interleave(128, 1)[:, :k]
    return (a.double() * sa64) @ (b.double() * sb64).t()


# --------------------------------------------------------------------------
# Config space: one predicate, the table
# --------------------------------------------------------------------------


def test_configs_are_valid_unique_and_table_uses_them():
    names = [c.name for c in C.CONFIGS.values()]
    assert len(set(names)) == len(names) == len(C.CONFIGS)
    for name, cfg in C.CONFIGS.items():
        assert C.config_valid(cfg) == (True, "valid"), name
        assert cfg.build == cfg  # catalogued configs carry default launch knobs
    for row in C.TABLE:
        assert row.config in C.CONFIGS.values()
    assert [r.max_m for r in C.TABLE] == sorted(r.max_m for r in C.TABLE)
    assert C.TABLE[-1].max_m >= 2**31 - 1  # every M has a row


@pytest.mark.parametrize("cfg, why", [
    (CFG(128, 256), "registers"),
    (CFG(256, 128), "registers"),
    (CFG(64, 128), "multiple of 128"),                        # cooperative needs 2 x 64 rows
    (CFG(128, 64), "weight side"),                            # weight rows must be whole scale blocks
    (CFG(64, 128, swap_ab=True, sfa_strided=True), "weight side"),
    (CFG(128, 12, swap_ab=True, sfa_strided=True), "multiple of 8"),
    (CFG(128, 16, swap_ab=True), "sfa_strided"),              # TMA scales need >= 32 rows per tile
    (CFG(64, 128, pingpong=True, streamk=True), "stream-K"),
    (CFG(128, 128, cluster_m=2, cluster_n=2), "cluster"),
    (CFG(128, 128, cluster_m=4), "cluster"),
    (CFG(128, 128, stages=1), "stages"),
    (CFG(128, 128, swizzle=3), "swizzle"),
    (CFG(128, 128, raster="diagonal"), "raster"),
    (CFG(128, 128, splits=2), "stream-K"),
    (CFG(128, 128, streamk=True, splits=0), "splits"),
])
def test_invalid_configs_say_why(cfg, why):
    ok, reason = C.config_valid(cfg)
    assert not ok and why in reason


@given(tile_m=st.sampled_from([64, 128, 192, 256]), tile_n=st.sampled_from([8, 16, 24, 32, 64, 96, 128, 256]),
       cm=st.sampled_from([1, 2]), cn=st.sampled_from([1, 2]), pp=st.booleans(), swap=st.booleans(),
       sfs=st.booleans(), sk=st.booleans())
def test_predicate_invariants(tile_m, tile_n, cm, cn, pp, swap, sfs, sk):
    cfg = CFG(tile_m, tile_n, cm, cn, pp, swap, sfs, sk)
    ok, reason = C.config_valid(cfg)
    assert isinstance(reason, str) and reason
    if not ok:
        return
    weight, act = (tile_m, tile_n) if swap else (tile_n, tile_m)
    assert weight % 128 == 0 and act % 8 == 0
    assert 2 * cfg.consumer_rows * tile_n // 128 <= 160
    assert not (sk and pp) and cm * cn <= 2
    assert sfs or act >= 32
    # knobs never change the library, build fields always do
    tuned = dataclasses.replace(cfg, swizzle=4, raster="n")
    assert tuned.build == cfg.build and C.library_spec(tuned).name == C.library_spec(cfg).name
    other = dataclasses.replace(cfg, stages=4)
    assert C.library_spec(other).name != C.library_spec(cfg).name


@pytest.mark.parametrize("p, why", [
    (problem(m=6), "M % 4"),
    (problem(k=320), "K % 128"),
    (problem(n=200), "N % 16"),
    (problem(block=(64, 128)), "block_size"),
    (problem(row_stride=520), "row stride"),
])
def test_problem_predicate_and_backend_reasons(p, why):
    for cfg in C.CONFIGS.values():
        ok, reason = C.config_valid(cfg, p)
        assert not ok and why in reason
    ok, reason = C.can_implement(p)
    assert not ok and why in reason


def test_table_selection_by_m():
    for m in [0, 4, 8, 16, 20, 32, 36, 64, 68, 128, 256, 260, 4096, 1 << 20]:
        p = problem(m=m)
        cfg = C.select_config(p)
        row = next(r for r in C.TABLE if m <= r.max_m)
        assert cfg == row.config and C.config_valid(cfg, p)[0]
        assert C.can_implement(p) == (True, f"config {cfg.name}")
    for dt in (torch.float16, torch.float32):
        assert C.can_implement(problem(out_dtype=dt))[0]


def test_backend_registered_and_refuses_cpu():
    be = backends.get("fp8_block", "cutlass")
    assert be.needs_m_multiple == 4 and "fp8_block_mm" in be.impls
    assert be.is_supported(torch.device("cpu")) == (False, "needs a CUDA device")
    a, b, sa, sb = inputs(4, 128, 256)
    with scaledmm.use_backend("fp8_block", "cutlass"), pytest.raises(RuntimeError, match="needs a CUDA device"):
        torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(b=torch.zeros(128, 256)), "b"),
    (dict(a_scales=torch.ones(4, 3)), "a_scales"),
    (dict(b_scales=torch.ones(2, 2).t()), "b_scales"),
    (dict(out_dtype=torch.int32), "out_dtype"),
])
def test_public_function_bad_inputs(kwargs, arg):
    a, b, sa, sb = inputs(4, 128, 256)
    args = dict(a=a, b=b, a_scales=sa, b_scales=sb)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"fp8_block_mm_cutlass: {arg}:"):
        C.fp8_block_mm_cutlass(**args)


# --------------------------------------------------------------------------
# Argument preparation (CPU tensors, no launch)
# --------------------------------------------------------------------------

MMAJOR = C.CONFIGS["coop128x128_c1x2"]
STRIDED = C.CONFIGS["swap_coop128x32_c1x1_sfs_sk"]


def _read_as_kernel(t, rows, cols, s_rows, s_cols):
    """The [rows, cols] matrix the kernel reads from t's storage with the given strides."""
    return torch.as_strided(t, (rows, cols), (s_rows, s_cols), t.storage_offset())


@given(m=st.sampled_from([4, 8, 12, 64, 132]), kb=st.integers(1, 5), nb=st.integers(1, 3),
       layout=st.sampled_from(["row", "col", "rowpad"]), row_pad=st.sampled_from([0, 16, 128]),
       b_scale_pad=st.booleans(), cfg=st.sampled_from(list(C.CONFIGS.values())),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 2**31 - 1))
def test_prepare_layouts(m, kb, nb, layout, row_pad, b_scale_pad, cfg, out_dtype, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    n, k = nb * 128 - 16 * (nb > 1), kb * 128
    a, b, sa, sb = inputs(m, n, k, layout=layout, row_pad=row_pad, b_scale_pad=b_scale_pad)
    prep = C.prepare(cfg, a, b, sa, sb, out_dtype)
    # operands: read in place (aligned views), strides as given
    assert prep.a.data_ptr() == a.data_ptr() and prep.lda == k + row_pad
    assert prep.b.data_ptr() == b.data_ptr() and prep.sbn == (sb.stride(0) if sb.shape[0] > 1 else kb)
    assert torch.equal(_read_as_kernel(prep.b_scales, sb.shape[0], kb, prep.sbn, 1), sb)
    # activation scales: what the kernel reads equals the caller's values
    read = _read_as_kernel(prep.a_scales, m, kb, prep.sam, prep.sak)
    assert torch.equal(read, sa)
    col = sa.stride(0) == 1
    if cfg.sfa_strided:
        assert not prep.copies and prep.a_scales.data_ptr() == sa.data_ptr()
    else:  # TMA: unit stride along M, 16-byte aligned columns
        assert prep.sam == 1 and prep.sak % 4 == 0 and prep.sak >= m
        assert prep.a_scales.data_ptr() % 16 == 0
        copied = any(c.startswith("a_scales") for c in prep.copies)
        assert copied == (not col), prep.copies
        if not copied:
            assert prep.a_scales.data_ptr() == sa.data_ptr()
    # output: fresh, contiguous, right dtype; ldd = N
    assert prep.out.shape == (m, n) and prep.out.dtype == out_dtype and prep.out.is_contiguous()
    assert prep.ldd == n
    # the struct carries exactly these values
    args = prep.args(device_index=3, sm_count=132, stream=0x1234)
    assert (args.abi_version, args.device, args.sm_count, args.m, args.n, args.k) == (C.ABI_VERSION, 3, 132, m, n, k)
    assert (args.a, args.b, args.a_scales, args.b_scales, args.out) == (
        prep.a.data_ptr(), prep.b.data_ptr(), prep.a_scales.data_ptr(), prep.b_scales.data_ptr(), prep.out.data_ptr())
    assert (args.lda, args.ldd, args.sam, args.sak, args.sbn) == (prep.lda, prep.ldd, prep.sam, prep.sak, prep.sbn)
    assert args.stream == 0x1234 and not args.workspace and args.workspace_bytes == 0


def test_prepare_copies_misaligned_activation():
    buf = rand_fp8((8, 256 + 16))
    a = buf[:, 8:8 + 256]  # 8-byte offset: TMA needs 16-byte aligned addresses
    _, b, sa, sb = inputs(8, 128, 256, layout="col")
    assert a.data_ptr() % 16 == 8
    prep = C.prepare(MMAJOR, a, b, sa, sb, torch.bfloat16)
    assert prep.a.data_ptr() % 16 == 0 and torch.equal(prep.a.view(torch.uint8), a.view(torch.uint8))
    assert prep.lda == 256 and prep.copies and prep.copies[0].startswith("a:")


def test_prepare_single_scale_column():
    a, b, sa, sb = inputs(8, 128, 128)  # K / 128 == 1: row- and column-major coincide
    prep = C.prepare(MMAJOR, a, b, sa, sb, torch.bfloat16)
    assert prep.sam == 1 and prep.sak == 8 and not prep.copies


def test_launch_knobs_reach_the_struct():
    cfg = dataclasses.replace(C.CONFIGS["coop128x128_c1x2_sk"], swizzle=8, raster="m", splits=3,
                              decomposition="splitk")
    assert C.config_valid(cfg)[0]
    a, b, sa, sb = inputs(4, 128, 256, layout="col")
    args = C.prepare(cfg, a, b, sa, sb, torch.bfloat16).args(0, 132, 0)
    assert (args.swizzle, args.raster, args.splits, args.decomposition) == (8, 1, 3, 2)


# --------------------------------------------------------------------------
# Build: cache key, one real nvcc build, the C ABI without a GPU
# --------------------------------------------------------------------------


def test_cache_key_ignores_the_header_path(tmp_path, monkeypatch):
    inc = C.cutlass_include_dir()
    if inc is None:
        pytest.skip("CUTLASS headers not installed")
    spec = C.library_spec(MMAJOR)
    assert "-DSMM_CLUSTER_N=2" in " ".join(spec.command("/tmp/x.so"))
    link = tmp_path / "elsewhere" / "include"
    link.parent.mkdir()
    link.symlink_to(inc)
    monkeypatch.setenv(C.ENV_CUTLASS_INCLUDE, str(link))
    moved = C.library_spec(MMAJOR)
    assert moved.include_dirs == (str(link),) and moved.include_dirs != spec.include_dirs
    assert moved.key == spec.key
    monkeypatch.setenv(C.ENV_CUTLASS_INCLUDE, str(tmp_path))  # no headers there; and none installed:
    monkeypatch.setattr(C.importlib.util, "find_spec", lambda name: None)
    C.cutlass_include.cache_clear()
    absent = C.library_spec(MMAJOR)
    assert absent.include_dirs == () and C.cutlass_include_dir() is None
    assert C.cutlass_version() == C.PINNED_CUTLASS_VERSION == C.header_version(inc)
    assert absent.key == spec.key  # pre-built libraries are found without the headers
    monkeypatch.setattr(jit, "nvcc_path", lambda: None)
    assert C.nvcc_release(None) == C.PINNED_NVCC_RELEASE
    assert C.library_spec(MMAJOR).key == spec.key  # ... and without nvcc
    C.cutlass_include.cache_clear()
    assert C.library_spec(MMAJOR, torch.float16).key != spec.key
    assert C.library_spec(C.CONFIGS["coop128x128_c1x1"]).key != spec.key


def test_prebuild_hook_lists_specs():
    assert "fp8-block-cutlass" in jit.PREBUILD
    specs_for = jit.PREBUILD["fp8-block-cutlass"][0]
    table = specs_for("table")
    assert {s.name for s in table} == {C.library_spec(r.config).name for r in C.TABLE}
    assert len(specs_for("all:bf16,fp16")) == 2 * len(C.CONFIGS)
    assert [s.name for s in specs_for("coop128x128_c1x2:fp32")] == ["fp8_block_cutlass_coop128x128_c1x2_fp32"]


@requires_build
@pytest.mark.slow
def test_nvcc_build_and_abi(tmp_path, monkeypatch):
    """One full nvcc build of a config into an empty cache (about a minute on 2
    cores), then the C ABI functions that need no GPU."""
    monkeypatch.setenv(jit.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(jit.ENV_NO_BUILD, raising=False)
    cfg = C.CONFIGS["swap_coop128x16_c1x1_sfs_sk"]  # swap A/B, strided scales, stream-K: most code paths
    spec = C.library_spec(cfg, torch.float16)
    assert not spec.cached()
    path = spec.build()
    assert spec.cached() and path.stat().st_size > 100_000
    lib = C.CutlassLibrary(ctypes.CDLL(str(path)), spec.name)  # checks ABI version and struct layout
    assert lib.args_layout() == C.args_layout()
    desc = dict(kv.split("=") for kv in lib.describe().split())
    assert desc["tile"] == "128x16x128" and desc["schedule"] == "cooperative" and desc["swap_ab"] == "1"
    assert desc["sfa"] == "strided" and desc["scheduler"] == "streamk" and desc["out"] == "fp16"
    assert int(desc["stages"]) >= 2 and int(desc["smem"]) <= 232448
    # argument errors come back as codes + messages, before any CUDA call
    err = ctypes.create_string_buffer(256)
    args = C.Args()
    args.abi_version = C.ABI_VERSION + 1
    assert lib.cdll.smm_run(ctypes.byref(args), err, 256) == 1 and b"ABI" in err.value
    args.abi_version = C.ABI_VERSION
    assert lib.cdll.smm_workspace_size(ctypes.byref(args), err, 256) == -1 and b"M, N, K > 0" in err.value


# --------------------------------------------------------------------------
# GPU (sm90)
# --------------------------------------------------------------------------

ALIGNED_M = [4, 8, 64, 128, 1024, 4096]


@requires_sm90
@pytest.mark.parametrize("n, k", DSV3)
@pytest.mark.parametrize("m", ALIGNED_M)
def test_every_config_matches_float64(m, n, k):
    a, b, sa, sb = inputs(m, n, k, "cuda", layout="col" if m % 8 == 0 else "row")
    ref = ref64(a, b, sa, sb)
    for cfg in C.CONFIGS.values():
        prep = C.prepare(cfg, a, b, sa, sb, torch.bfloat16)
        poison_(prep.out)
        out = C.launch(prep, C.load_library(cfg))
        assert not torch.isnan(out).any(), cfg.name
        assert rel_err(out, ref) < 8e-3, cfg.name


@requires_sm90
@pytest.mark.parametrize("cfg", list(C.CONFIGS.values()), ids=lambda c: c.name)
@given(m=st.sampled_from([4, 12, 16, 36, 68, 132, 260]), n=st.sampled_from([16, 144, 400, 1024]),
       kb=st.integers(1, 6), layout=st.sampled_from(["row", "col", "rowpad"]), row_pad=st.sampled_from([0, 48]),
       b_scale_pad=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_configs_odd_shapes_and_layouts(cfg, m, n, kb, layout, row_pad, b_scale_pad, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis: a failure replays and shrinks
    a, b, sa, sb = inputs(m, n, kb * 128, "cuda", layout, row_pad, b_scale_pad)
    prep = C.prepare(cfg, a, b, sa, sb, torch.bfloat16)
    poison_(prep.out)
    out = C.launch(prep, C.load_library(cfg))
    assert not torch.isnan(out).any()
    assert rel_err(out, ref64(a, b, sa, sb)) < 8e-3


@requires_sm90
# fp32 out: the FP8 WGMMA accumulates each 128-deep block with fewer than fp32's
# mantissa bits (measured 1.3e-4 relative on the H200), so 5e-4 and not 1e-5.
@pytest.mark.parametrize("out_dtype, tol", [(torch.float16, 2e-3), (torch.float32, 5e-4)])
@pytest.mark.parametrize("name", ["coop128x128_c1x2", "swap_coop128x32_c1x1_sfs_sk"])
def test_out_dtypes(name, out_dtype, tol):
    a, b, sa, sb = inputs(64, 576, 1024, "cuda")
    out = C.fp8_block_mm_cutlass(a, b, sa, sb, out_dtype, name)
    assert out.dtype == out_dtype and rel_err(out, ref64(a, b, sa, sb)) < tol


@requires_sm90
@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 17, 1023])
def test_odd_m_through_padded_op(m):
    a, b, sa, sb = inputs(m, 2112, 7168, "cuda", layout="col" if m > 1 else "row")
    with scaledmm.use_backend("fp8_block", "cutlass"), backends.record() as rec:
        out = torch.ops.scaledmm.padded_fp8_block_mm(a, b, sa, sb)
        dyn = torch.ops.scaledmm.dynamic_padded_fp8_block_mm(a, b, sa, sb)
    assert [name for _, name, _ in rec] == ["cutlass", "cutlass"]
    assert out.shape == (m, 2112) and torch.equal(out, dyn)
    if m:
        assert rel_err(out, ref64(a, b, sa, sb)) < 8e-3


@requires_sm90
def test_direct_op_rejects_unaligned_m_when_forced():
    a, b, sa, sb = inputs(6, 256, 256, "cuda")
    with scaledmm.use_backend("fp8_block", "cutlass"), pytest.raises(RuntimeError, match="M % 4"):
        torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)


@requires_sm90
@pytest.mark.parametrize("m", [64, 512])  # swap A/B + stream-K; TMA configs
def test_nan_stays_in_its_row(m):
    a, b, sa, sb = inputs(m, 4096, 7168, "cuda")
    a = a.clone()
    a[5, 100] = float("nan")
    with scaledmm.use_backend("fp8_block", "cutlass"), backends.record() as rec:
        out = torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)
    assert rec[0][1] == "cutlass"
    nan = torch.isnan(out)
    assert nan[5].all() and not nan[:5].any() and not nan[6:].any()


@requires_sm90
@pytest.mark.parametrize("m", [8, 512])  # swap A/B + stream-K workspace; TMA scales + layout copy
def test_cuda_graph_capture_and_replay(m):
    a, b, sa, sb = inputs(m, 7168, 2048, "cuda", layout="row")
    with scaledmm.use_backend("fp8_block", "cutlass"):
        torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)  # warm-up: build, load the kernel
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.scaledmm.fp8_block_mm(a, b, sa, sb)
    for _ in range(2):  # fresh values in the captured buffers
        a.copy_(rand_fp8(a.shape, "cuda"))
        sa.copy_(torch.rand_like(sa) + 0.05)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref64(a, b, sa, sb)) < 8e-3


@requires_sm90
def test_opcheck_and_compile_with_cutlass():
    with scaledmm.use_backend("fp8_block", "cutlass"):
        for m, layout in [(0, "row"), (4, "col"), (68, "row")]:
            a, b, sa, sb = inputs(m, 256, 512, "cuda", layout)
            opcheck(torch.ops.scaledmm.fp8_block_mm.default, (a, b, sa, sb, [128, 128], torch.bfloat16))
        a, b, sa, sb = inputs(3, 256, 512, "cuda")
        opcheck(torch.ops.scaledmm.padded_fp8_block_mm.default, (a, b, sa, sb, [128, 128], torch.bfloat16))

        f = torch.compile(scaledmm.fp8_block_mm, fullgraph=True, dynamic=True)
        for m in (8, 12, 5, 64):
            a, b, sa, sb = inputs(m, 256, 512, "cuda")
            out = f(a, b, sa, sb)
            assert out.shape == (m, 256) and rel_err(out, ref64(a, b, sa, sb)) < 8e-3
