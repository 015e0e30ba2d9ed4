"""Tensor-parallel quantized linears (scaledmm.layers.parallel).

* In process: shard_checkpoint errors and round trip; per-rank layers built
  with explicit rank/world_size simulate the collectives (concatenate / sum).
* Spawned gloo process groups of 2 and 4 CPU ranks: the real layers, with
  all_gather / all_reduce, against the unsharded layer built from the same
  quantized checkpoint.  One spawn per world size runs every case.
"""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch
from hypothesis import given, strategies as st

from scaledmm.layers import Fp8BlockLinear, Fp8Linear, NvFp4Linear
from scaledmm.layers.parallel import ColumnParallelLinear, RowParallelLinear, shard_checkpoint
from layer_helpers import make_checkpoint

U_BF16 = 2.0 ** -8  # unit roundoff of bf16
LAYERS = {"fp8_block": Fp8BlockLinear, "fp8": Fp8Linear, "nvfp4": NvFp4Linear}


# (name, fmt, kind, per-shard size of the sharded dim, size of the other dim,
#  checkpoint kwargs, layer kwargs, wrapper kwargs).  Per-shard N or K and the
#  other dim are mostly not multiples of 16 (fp8_block's sharded dim must be 128).
CASES = [
    ("fp8_block-col-gather", "fp8_block", "col", 128, 200, {}, {}, {"gather_output": True}),
    ("fp8_block-col", "fp8_block", "col", 128, 136, {"bias": False}, {"out_dtype": torch.float16}, {}),
    ("fp8_block-row", "fp8_block", "row", 128, 72, {}, {}, {}),
    ("fp8_block-row-scatter", "fp8_block", "row", 128, 40, {"bias": False}, {}, {"input_is_parallel": False}),
    ("fp8-col-channel-gather", "fp8", "col", 40, 24, {"per_channel": True}, {}, {"gather_output": True}),
    ("fp8-col-static", "fp8", "col", 24, 40, {"static": True}, {}, {}),
    ("fp8-col-token", "fp8", "col", 40, 24, {}, {"activation": "dynamic_per_token"}, {"gather_output": True}),
    ("fp8-row-tensor", "fp8", "row", 24, 40, {}, {}, {}),
    ("fp8-row-channel-token", "fp8", "row", 24, 40, {"per_channel": True},
     {"activation": "dynamic_per_token"}, {"input_is_parallel": False}),
    ("fp8-row-static", "fp8", "row", 40, 24, {"static": True, "per_channel": True}, {}, {}),
    ("nvfp4-col-gather", "nvfp4", "col", 40, 48, {}, {}, {"gather_output": True}),
    ("nvfp4-col-static-w4a16", "nvfp4", "col", 24, 80, {"static": True}, {"use_w4a16": True}, {}),
    ("nvfp4-row-dynamic", "nvfp4", "row", 48, 40, {}, {}, {}),
    ("nvfp4-row-static", "nvfp4", "row", 80, 24, {"static": True}, {}, {"input_is_parallel": False}),
]
CASE_NAMES = [c[0] for c in CASES]
M_VALUES = (0, 1, 3, 17)


def full_shape(kind: str, shard: int, other: int, world: int) -> tuple[int, int]:
    """(N, K) of the whole layer."""
    return (shard * world, other) if kind == "col" else (other, shard * world)


def row_tolerance(partial_abs_sum: torch.Tensor, bias, world: int) -> torch.Tensor:
    """Bound on |row-parallel - unsharded|: the world partials are rounded to
    bf16, summed (world - 1 roundings), the bias added (one) and the unsharded
    result rounded once; each rounding costs <= u * (sum|partials| + |bias|)."""
    scale = partial_abs_sum + (bias.double().abs() if bias is not None else 0.0)
    return (2 * world + 2) * U_BF16 * scale + 1e-6


# ----------------------------------------------------------------------------
# Spawned process groups
# ----------------------------------------------------------------------------


def _run_case(case, rank: int, world: int, seed: int) -> None:
    import torch.distributed as dist
    name, fmt, kind, shard, other, ck_kw, layer_kw, wrap_kw = case
    gen = torch.Generator().manual_seed(seed + CASE_NAMES.index(name))
    n, k = full_shape(kind, shard, other, world)
    tensors = make_checkpoint(fmt, n, k, gen, **ck_kw)
    full = LAYERS[fmt].from_checkpoint({key: v.clone() for key, v in tensors.items()}, **layer_kw)
    wrapper = ColumnParallelLinear if kind == "col" else RowParallelLinear
    layer = wrapper.from_checkpoint(LAYERS[fmt], tensors, **layer_kw, **wrap_kw)
    assert (layer.rank, layer.world_size) == (rank, world)
    for m in M_VALUES:
        lead = (2, m) if m == 3 else (m,)  # one 3-D input
        x = (torch.randn(*lead, k, generator=gen) * 2).to(torch.bfloat16)
        if m == 17:
            x[5, : k // 3] *= 30  # an outlier row on part of K only: dynamic scales must be global
        ref = full(x)
        if kind == "col":
            if wrap_kw.get("gather_output"):
                out = layer(x)
                assert out.shape == ref.shape, (out.shape, ref.shape)
                assert torch.equal(out, ref), f"M={m}: gathered output differs from the unsharded layer"
            else:
                out = layer(x)
                want = ref[..., rank * shard:(rank + 1) * shard]
                assert torch.equal(out, want), f"M={m}: column shard differs from the unsharded layer"
        else:
            x_in = x if not layer.input_is_parallel else x[..., rank * shard:(rank + 1) * shard].contiguous()
            out = layer(x_in)
            assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
            assert out.numel() == 0 or out.data_ptr() != x_in.data_ptr()
            local = x[..., rank * shard:(rank + 1) * shard].reshape(-1, shard)
            part = layer.local_product(local).double().abs()
            dist.all_reduce(part)
            tol = row_tolerance(part, layer.bias, world).reshape(ref.shape)
            err = (out.double() - ref.double()).abs()
            assert torch.isfinite(out).all()
            bad = err > tol
            assert not bad.any(), f"M={m}: {int(bad.sum())} elements past the bound, max err {err.max()}"


def _worker(rank: int, world: int, store: str, seed: int, out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    try:
        for case in CASES:
            try:
                _run_case(case, rank, world, seed)
                results[case[0]] = "ok"
            except Exception:  # report every case; the parent asserts
                results[case[0]] = traceback.format_exc(limit=4)
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def spawned(request, tmp_path_factory):
    import torch.multiprocessing as mp
    world = request.param
    seed = int.from_bytes(os.urandom(3), "little")
    out_dir = str(tmp_path_factory.mktemp(f"tp{world}"))
    # rendezvous through a file the test owns: no port to race other processes for
    store = os.path.join(out_dir, "rendezvous")
    mp.spawn(_worker, args=(world, store, seed, out_dir), nprocs=world, join=True)
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return world, seed, results


@pytest.mark.parametrize("case", CASE_NAMES)
def test_sharded_equals_unsharded(spawned, case):
    world, seed, results = spawned
    for rank, res in enumerate(results):
        assert res.get(case) == "ok", f"world {world}, rank {rank}, seed {seed}:\n{res.get(case)}"


# ----------------------------------------------------------------------------
# In process: errors
# ----------------------------------------------------------------------------

ERROR_CASES = [
    # (fmt, N, K, world, dim, kwargs, argument named, fragments of the message)
    ("fp8_block", 384, 256, 2, 0, {}, "weight", ["N / world_size a multiple of 128", "= 192"]),
    ("fp8_block", 256, 384, 2, 1, {}, "weight", ["K / world_size a multiple of 128", "= 192"]),
    ("fp8_block", 256, 256, 4, 0, {}, "weight", ["multiple of 128", "= 64"]),
    ("fp8_block", 384, 256, 3, 1, {}, "weight", ["K divisible by world_size = 3", "K = 256"]),
    ("fp8", 30, 48, 4, 0, {}, "weight", ["N divisible by world_size = 4", "N = 30"]),
    ("fp8", 32, 30, 4, 1, {}, "weight", ["K divisible by world_size = 4", "K = 30"]),
    ("nvfp4", 32, 96, 4, 1, {}, "weight", ["K / world_size a multiple of 16", "= 24", "scale block"]),
    ("nvfp4", 30, 64, 4, 0, {}, "weight", ["N divisible by world_size = 4"]),
    ("fp8", 32, 32, 2, 2, {}, "dim", ["0 (shard N"]),
    ("fp8", 32, 32, 2, 0, {"rank": 2}, "rank", ["[0, 2)"]),
    ("fp8", 32, 32, 0, 0, {"rank": 0}, "world_size", ["positive int"]),
    ("fp8x", 32, 32, 2, 0, {}, "fmt", ["'fp8_block'"]),
]


@pytest.mark.parametrize("fmt,n,k,world,dim,kw,arg,frags", ERROR_CASES)
def test_shard_errors(fmt, n, k, world, dim, kw, arg, frags):
    t = make_checkpoint(fmt if fmt in LAYERS else "fp8", n, k, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError) as e:
        shard_checkpoint(t, fmt, kw.get("rank", 0), world, dim)
    msg = str(e.value)
    assert msg.startswith(f"shard_checkpoint: {arg}: expected"), msg
    for frag in frags:
        assert frag in msg, (frag, msg)


def test_nvfp4_k_shard_of_16_is_valid():
    t = make_checkpoint("nvfp4", 32, 64, torch.Generator().manual_seed(2))
    shard = shard_checkpoint(t, "nvfp4", 3, 4, 1)
    assert shard["weight"].shape == (32, 8) and shard["weight_scale"].shape == (32, 1)


def test_missing_key_and_bad_layer_class():
    t = make_checkpoint("fp8", 32, 32, torch.Generator().manual_seed(3))
    del t["weight_scale"]
    with pytest.raises(ValueError, match=r"shard_checkpoint: tensors: expected a 'weight_scale' entry"):
        shard_checkpoint(t, "fp8", 0, 2, 0)
    with pytest.raises(ValueError, match=r"layer_cls: expected a subclass"):
        ColumnParallelLinear.from_checkpoint(torch.nn.Linear, {}, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"RowParallelLinear: group: expected an initialized"):
        RowParallelLinear.from_checkpoint(Fp8Linear, t)


def test_wrapper_input_errors():
    t = make_checkpoint("fp8_block", 64, 256, torch.Generator().manual_seed(4))
    layer = RowParallelLinear.from_checkpoint(Fp8BlockLinear, t, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"RowParallelLinear: x: expected last dim K / world_size = 128"):
        layer(torch.randn(3, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"RowParallelLinear: inner: expected a layer without bias"):
        RowParallelLinear(Fp8BlockLinear.from_checkpoint(t), rank=0, world_size=2)


# ----------------------------------------------------------------------------
# In process: round trip and simulated collectives over random shapes
# ----------------------------------------------------------------------------


@st.composite
def layouts(draw):
    fmt = draw(st.sampled_from(sorted(LAYERS)))
    world = draw(st.sampled_from([1, 2, 3, 4]))
    dim = draw(st.sampled_from([0, 1]))
    if fmt == "fp8_block":
        sharded = 128 * world * draw(st.integers(1, 2))
        other = draw(st.integers(1, 300))
    elif fmt == "nvfp4":
        sharded = (16 if dim == 1 else 1) * world * draw(st.integers(1, 6))
        other = draw(st.integers(1, 100)) if dim == 1 else 16 * draw(st.integers(1, 6))
    else:
        sharded = world * draw(st.integers(1, 40))
        other = draw(st.integers(1, 100))
    n, k = (sharded, other) if dim == 0 else (other, sharded)
    return fmt, world, dim, n, k, draw(st.booleans()), draw(st.integers(0, 2 ** 31 - 1))


@given(layouts())
def test_shard_round_trip(layout):
    fmt, world, dim, n, k, per_channel, seed = layout
    t = make_checkpoint(fmt, n, k, torch.Generator().manual_seed(seed), per_channel=per_channel, static=True)
    shards = [shard_checkpoint(t, fmt, r, world, dim) for r in range(world)]
    sharded_keys = {"weight", "weight_scale_inv"} | ({"weight_scale"} if fmt == "nvfp4" else set())
    if fmt == "fp8" and per_channel and dim == 0:
        sharded_keys.add("weight_scale")
    if dim == 0:
        sharded_keys.add("bias")
    for key, full in t.items():
        parts = [s[key] for s in shards]
        for p in parts:
            assert p.is_contiguous() and p.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        if key in sharded_keys:
            cat_dim = 0 if dim == 0 or full.dim() == 1 else 1
            got = torch.cat([p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for p in parts], cat_dim)
            want = full.view(torch.uint8) if full.dtype == torch.float8_e4m3fn else full
            assert torch.equal(got, want), key
        else:
            for p in parts:
                assert torch.equal(p, full), key


@given(layouts(), st.sampled_from(M_VALUES))
def test_simulated_collectives(layout, m):
    """Per-rank layers (explicit rank/world, no process group): concatenated
    column outputs equal the unsharded layer; summed row partials (static
    activation scales, so no amax exchange is needed) are within the bound."""
    fmt, world, dim, n, k, per_channel, seed = layout
    gen = torch.Generator().manual_seed(seed)
    t = make_checkpoint(fmt, n, k, gen, per_channel=per_channel, static=True)
    kw = {"activation": "static"} if fmt == "fp8" else {}
    full = LAYERS[fmt].from_checkpoint(dict(t), **kw)
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
    ref = full(x)
    if dim == 0:
        outs = [ColumnParallelLinear.from_checkpoint(LAYERS[fmt], t, rank=r, world_size=world, **kw)(x)
                for r in range(world)]
        assert torch.equal(torch.cat(outs, -1), ref)
    else:
        ks = k // world
        layers = [RowParallelLinear.from_checkpoint(LAYERS[fmt], t, rank=r, world_size=world, **kw)
                  for r in range(world)]
        parts = [layer.local_product(x[:, r * ks:(r + 1) * ks]) for r, layer in enumerate(layers)]
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        out = out + layers[0].bias
        tol = row_tolerance(sum(p.double().abs() for p in parts), layers[0].bias, world)
        assert ((out.double() - ref.double()).abs() <= tol).all()


def test_per_shard_padding_and_swizzle():
    """Each rank's layer pads and swizzles its own shard (not the whole layer's layout)."""
    gen = torch.Generator().manual_seed(5)
    t = make_checkpoint("nvfp4", 80, 96, gen)  # column shards of N = 40 over 2 ranks
    inner = ColumnParallelLinear.from_checkpoint(NvFp4Linear, t, rank=1, world_size=2).inner
    assert inner.out_features == 40 and tuple(inner.weight.shape) == (64, 64)  # N -> 32k, K 96 -> 128
    assert tuple(inner.weight_scale.shape) == (128, 8)  # swizzled [round_up(64, 128), round_up(8, 4)]
    t = make_checkpoint("nvfp4", 40, 96, gen)  # row shards of K = 48 over 2 ranks
    inner = RowParallelLinear.from_checkpoint(NvFp4Linear, t, rank=0, world_size=2).inner
    assert inner.in_features == 48 and tuple(inner.weight.shape) == (64, 32)  # K 48 -> 64
    t = make_checkpoint("fp8", 80, 48, gen, per_channel=True)
    inner = ColumnParallelLinear.from_checkpoint(Fp8Linear, t, rank=1, world_size=2).inner
    assert tuple(inner.weight.shape) == (48, 48) and inner.weight_scale.shape == (48,)
    assert torch.equal(inner.weight_scale[:40], t["weight_scale"][40:].float())
    assert torch.equal(inner.weight_scale[40:], torch.ones(8))
    t = make_checkpoint("fp8_block", 72, 256, gen)
    inner = RowParallelLinear.from_checkpoint(Fp8BlockLinear, t, rank=1, world_size=2).inner
    assert inner.in_features == 128 and torch.equal(inner.weight_scale_inv[:, :1], t["weight_scale_inv"][:, 1:])
