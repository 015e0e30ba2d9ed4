"""Tensor-parallel quantized linears on ``torch.distributed``.

Each rank slices the *checkpoint* tensors of a quantized linear (weights and
their scales, in the published conventions) and builds the ordinary layer
from its shard, so per-shard padding and scale swizzling come from the
layer's own ``process_weights_after_loading``:

* ``fp8_block`` (:class:`~scaledmm.layers.Fp8BlockLinear`, DeepSeek-V3):
  ``weight`` e4m3 ``[N, K]``, ``weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]``,
  ``bias``.  The sharded dim must split into whole ``bn`` (or ``bk``) blocks.
* ``fp8`` (:class:`~scaledmm.layers.Fp8Linear`): ``weight`` e4m3 ``[N, K]``,
  ``weight_scale`` (one element: replicated; ``[N]`` / ``[N, 1]``: sharded
  with N, replicated when K is sharded), ``input_scale`` (replicated), ``bias``.
* ``nvfp4`` (:class:`~scaledmm.layers.NvFp4Linear`, ModelOpt): ``weight``
  uint8 ``[N, K/2]``, ``weight_scale`` e4m3 ``[N, K/16]`` (linear layout),
  ``weight_scale_2`` and ``input_scale`` (replicated), ``bias``.  A K shard
  must hold whole 16-element scale blocks.

:class:`ColumnParallelLinear` shards N (out features) and can all-gather the
output; :class:`RowParallelLinear` shards K (in features), sums the partial
outputs with an all-reduce and adds the bias once, on the reduced result.
Dynamic activation scales that depend on the whole row or tensor (FP8
per-tensor / per-token, NVFP4 global scale) are made global with an
all-reduce(MAX) of the local amax, so every rank quantizes its slice of the
activation exactly as the unsharded layer would.  All communication goes
through ``torch.distributed`` on the given process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scaledmm import validation as V
from scaledmm.layers.fp8 import Fp8Linear
from scaledmm.layers.fp8_block import Fp8BlockLinear
from scaledmm.layers.nvfp4 import NvFp4Linear, finite_row_amax
from scaledmm.layers._state import checkpoint_entries
from scaledmm.layers.rows import as_rows

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_checkpoint", "format_of", "FORMATS"]

# Checkpoint format name -> layer class (the registry entry of each format).
FORMATS: dict[str, type[nn.Module]] = {"fp8_block": Fp8BlockLinear, "fp8": Fp8Linear, "nvfp4": NvFp4Linear}
COLUMN, ROW = 0, 1  # the ``dim`` of shard_checkpoint: 0 shards N (out), 1 shards K (in)
_NVFP4_BLOCK = 16


def format_of(layer_cls: type) -> str:
    """The checkpoint format name of a quantized layer class.

    Examples
    --------
    >>> from scaledmm.layers import Fp8Linear
    >>> from scaledmm.layers.parallel import format_of
    >>> format_of(Fp8Linear)
    'fp8'
    """
    for name, cls in FORMATS.items():
        if isinstance(layer_cls, type) and issubclass(layer_cls, cls):
            return name
    V.fail("parallel", "layer_cls", f"a subclass of one of {[c.__name__ for c in FORMATS.values()]}", layer_cls)


# ----------------------------------------------------------------------------
# Checkpoint sharding (pure slicing; no communication)
# ----------------------------------------------------------------------------

_OP = "shard_checkpoint"


def _need(tensors: dict, *keys: str) -> None:
    for key in keys:
        if key not in tensors:
            V.fail(_OP, "tensors", f"a {key!r} entry", f"keys {sorted(tensors)}")


def _split(arg: str, what: str, size: int, world: int, multiple: int, why: str) -> int:
    """The shard size of ``size`` over ``world`` ranks, or a ValueError."""
    if size % world != 0:
        V.fail(_OP, arg, f"{what} divisible by world_size = {world}", f"{what} = {size}")
    shard = size // world
    if shard % multiple != 0:
        V.fail(_OP, arg, f"{what} / world_size a multiple of {multiple} ({why}; {what} = {size}, "
               f"world_size = {world})", f"{what} / world_size = {shard}")
    return shard


def _take(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """A contiguous copy of ``t.narrow(dim, start, length)`` (never a view of the checkpoint)."""
    return t.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _shard_fp8_block(tensors, rank, world, dim, block_size):
    _need(tensors, "weight", "weight_scale_inv")
    w, s = tensors["weight"], tensors["weight_scale_inv"]
    V.check_rank(_OP, "weight", w, 2)
    V.check_rank(_OP, "weight_scale_inv", s, 2)
    n, k = w.shape
    bn, bk = int(block_size[0]), int(block_size[1])
    V.check_shape(_OP, "weight_scale_inv", s, (V.ceil_div(n, bn), V.ceil_div(k, bk)), "ceil(N/bn), ceil(K/bk)")
    out = {}
    if dim == COLUMN:
        ns = _split("weight", "N", n, world, bn, f"a {bn}x{bk} scale block must not straddle two ranks")
        out["weight"] = _take(w, 0, rank * ns, ns)
        out["weight_scale_inv"] = _take(s, 0, rank * ns // bn, ns // bn)
        if "bias" in tensors:
            out["bias"] = _take(tensors["bias"], 0, rank * ns, ns)
    else:
        ks = _split("weight", "K", k, world, bk, f"a {bn}x{bk} scale block must not straddle two ranks")
        out["weight"] = _take(w, 1, rank * ks, ks)
        out["weight_scale_inv"] = _take(s, 1, rank * ks // bk, ks // bk)
        if "bias" in tensors:
            out["bias"] = _copy(tensors["bias"])
    return out


def _shard_fp8(tensors, rank, world, dim):
    _need(tensors, "weight", "weight_scale")
    w, ws = tensors["weight"], tensors["weight_scale"]
    V.check_rank(_OP, "weight", w, 2)
    n, k = w.shape
    per_channel = ws.numel() != 1
    if per_channel and tuple(ws.shape) not in ((n,), (n, 1)):
        V.fail(_OP, "weight_scale", f"one element (per-tensor) or shape ({n},) / ({n}, 1) (per-channel)",
               f"shape {tuple(ws.shape)}")
    out = {}
    if dim == COLUMN:
        ns = _split("weight", "N", n, world, 1, "")
        out["weight"] = _take(w, 0, rank * ns, ns)
        out["weight_scale"] = _take(ws, 0, rank * ns, ns) if per_channel else _copy(ws)
        if "bias" in tensors:
            out["bias"] = _take(tensors["bias"], 0, rank * ns, ns)
    else:
        ks = _split("weight", "K", k, world, 1, "")
        out["weight"] = _take(w, 1, rank * ks, ks)
        out["weight_scale"] = _copy(ws)  # per-tensor or per-N: the same on every K shard
        if "bias" in tensors:
            out["bias"] = _copy(tensors["bias"])
    if "input_scale" in tensors:
        out["input_scale"] = _copy(tensors["input_scale"])
    return out


def _shard_nvfp4(tensors, rank, world, dim):
    _need(tensors, "weight", "weight_scale", "weight_scale_2")
    w, ws = tensors["weight"], tensors["weight_scale"]
    V.check_rank(_OP, "weight", w, 2)
    n, k = w.shape[0], 2 * w.shape[1]
    V.check_shape(_OP, "weight_scale", ws, (n, k // _NVFP4_BLOCK), "[N, K/16] for weight [N, K/2]")
    out = {}
    if dim == COLUMN:
        ns = _split("weight", "N", n, world, 1, "")
        out["weight"] = _take(w, 0, rank * ns, ns)
        out["weight_scale"] = _take(ws, 0, rank * ns, ns)
        if "bias" in tensors:
            out["bias"] = _take(tensors["bias"], 0, rank * ns, ns)
    else:
        # 16 codes per scale = 8 packed bytes: a 16-multiple K shard keeps whole
        # scale blocks and an even (whole-byte) number of codes on each rank.
        ks = _split("weight", "K", k, world, _NVFP4_BLOCK,
                    "a 16-element NVFP4 scale block (8 packed bytes) must not straddle two ranks")
        out["weight"] = _take(w, 1, rank * ks // 2, ks // 2)
        out["weight_scale"] = _take(ws, 1, rank * ks // _NVFP4_BLOCK, ks // _NVFP4_BLOCK)
        if "bias" in tensors:
            out["bias"] = _copy(tensors["bias"])
    for key in ("weight_scale_2", "input_scale"):
        if key in tensors:
            out[key] = _copy(tensors[key])
    return out


def shard_checkpoint(tensors: dict[str, torch.Tensor], fmt: str, rank: int, world_size: int, dim: int, *,
                     block_size=(128, 128)) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of a quantized linear's checkpoint tensors.

    Parameters
    ----------
    tensors : dict
        The whole layer's checkpoint tensors in the format's convention (see
        the module docstring).
    fmt : str
        ``"fp8_block"``, ``"fp8"`` or ``"nvfp4"``.
    rank, world_size : int
        This rank and the number of ranks.
    dim : int
        0: shard N (column parallel; weight rows, their scales and the bias).
        1: shard K (row parallel; weight columns and their scales; the bias
        and per-N scales are returned whole: the caller adds the bias once,
        after the reduction).
    block_size : (int, int)
        ``(bn, bk)`` of ``fp8_block``.

    Returns
    -------
    dict
        New contiguous tensors (never views of ``tensors``), ready for
        ``layer_cls.from_checkpoint``.

    Raises
    ------
    ValueError
        When the sharded dim does not divide by ``world_size`` or a shard
        would split a scale block (``fp8_block``: N/world or K/world not a
        multiple of bn/bk; ``nvfp4`` K sharding: K/world not a multiple of 16).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers.parallel import shard_checkpoint
    >>> t = {"weight": torch.zeros(256, 384).to(torch.float8_e4m3fn), "weight_scale_inv": torch.ones(2, 3)}
    >>> {k: tuple(v.shape) for k, v in shard_checkpoint(t, "fp8_block", 1, 2, 0).items()}
    {'weight': (128, 384), 'weight_scale_inv': (1, 3)}
    """
    if fmt not in FORMATS:
        V.fail(_OP, "fmt", f"one of {list(FORMATS)}", repr(fmt))
    if not isinstance(world_size, int) or world_size < 1:
        V.fail(_OP, "world_size", "a positive int", world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        V.fail(_OP, "rank", f"an int in [0, {world_size})", rank)
    if dim not in (COLUMN, ROW):
        V.fail(_OP, "dim", "0 (shard N, column parallel) or 1 (shard K, row parallel)", dim)
    if not isinstance(tensors, dict):
        V.fail(_OP, "tensors", "a dict of checkpoint tensors", type(tensors).__name__)
    checkpoint_entries(_OP, tensors, (), tuple(tensors))  # every entry a Tensor, one device
    if fmt == "fp8_block":
        return _shard_fp8_block(tensors, rank, world_size, dim, block_size)
    if fmt == "fp8":
        return _shard_fp8(tensors, rank, world_size, dim)
    return _shard_nvfp4(tensors, rank, world_size, dim)


# ----------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------


def _rank_world(name: str, group, rank, world_size) -> tuple[int, int]:
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else None
    if world_size is None:
        world_size = dist.get_world_size(group) if dist.is_initialized() else None
    if rank is None or world_size is None:
        V.fail(name, "group", "an initialized torch.distributed process group (or explicit rank and world_size)",
               "torch.distributed not initialized")
    return int(rank), int(world_size)


class _ParallelLinear(nn.Module):
    """Holds the per-rank quantized layer (``inner``) and the process group.

    The state dict is the inner layer's (``inner.*``, its own padded layout)
    and, for :class:`RowParallelLinear`, the whole ``bias``: a wrapper built
    around a fresh (or meta-built then ``to_empty``) inner layer of the same
    arguments loads it exactly.  ``.to(dtype)`` / ``.half()`` act as on the
    inner layer; the wrapper's bias follows the inner ``out_dtype``.
    """

    _DIM = COLUMN

    def __init__(self, inner: nn.Module, *, rank: int, world_size: int, group=None):
        super().__init__()
        self.inner = inner
        self.fmt = format_of(type(inner))
        self.rank, self.world_size, self.group = rank, world_size, group

    @classmethod
    def _build(cls, layer_cls, tensors, group, rank, world_size, layer_kwargs):
        fmt = format_of(layer_cls)
        rank, world_size = _rank_world(cls.__name__, group, rank, world_size)
        shard = shard_checkpoint(tensors, fmt, rank, world_size, cls._DIM,
                                 block_size=layer_kwargs.get("block_size", (128, 128)))
        bias = shard.pop("bias", None) if cls._DIM == ROW else None
        inner = layer_cls.from_checkpoint(shard, **layer_kwargs)
        return inner, bias, rank, world_size

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        bias = getattr(self, "bias", None)
        if bias is not None and bias.dtype != self.inner.out_dtype:
            with torch.no_grad():
                bias.data = bias.data.to(self.inner.out_dtype)
        return self

    def extra_repr(self) -> str:
        return f"format={self.fmt}, rank={self.rank}, world_size={self.world_size}"


class ColumnParallelLinear(_ParallelLinear):
    """Quantized linear with N (out features) split over the ranks.

    Rank r holds rows ``[r * N/world, (r+1) * N/world)`` of the weight, their
    scales and bias; its output is that slice of the columns.  With
    ``gather_output`` the slices are all-gathered into the full ``[..., N]``.

    Parameters
    ----------
    inner : nn.Module
        This rank's ``Fp8BlockLinear`` / ``Fp8Linear`` / ``NvFp4Linear``
        built from its shard (use :meth:`from_checkpoint`).
    rank, world_size : int
    group : ProcessGroup, optional
        Default: the world group.
    gather_output : bool
        All-gather the column slices (``all_gather_into_tensor``).

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers import Fp8Linear
    >>> from scaledmm.layers.parallel import ColumnParallelLinear
    >>> w = torch.randn(80, 48).to(torch.float8_e4m3fn)
    >>> t = {"weight": w, "weight_scale": torch.tensor(0.01)}
    >>> layer = ColumnParallelLinear.from_checkpoint(Fp8Linear, t, rank=1, world_size=2)
    >>> layer(torch.randn(3, 48)).shape  # no gather: this rank's 40 columns
    torch.Size([3, 40])
    """

    _DIM = COLUMN

    def __init__(self, inner: nn.Module, *, rank: int, world_size: int, group=None, gather_output: bool = False):
        super().__init__(inner, rank=rank, world_size=world_size, group=group)
        self.gather_output = bool(gather_output)
        self.in_features = inner.in_features
        self.out_features = inner.out_features * world_size

    @classmethod
    def from_checkpoint(cls, layer_cls: type, tensors: dict[str, torch.Tensor], *, group=None,
                        rank: int | None = None, world_size: int | None = None, gather_output: bool = False,
                        **layer_kwargs) -> "ColumnParallelLinear":
        """Slice the whole layer's checkpoint for this rank and build its layer.

        ``rank`` and ``world_size`` default to the group's; ``layer_kwargs``
        go to ``layer_cls.from_checkpoint`` (``out_dtype``, ``block_size``,
        ``activation``, ``use_w4a16``, ...).
        """
        inner, _, rank, world_size = cls._build(layer_cls, tensors, group, rank, world_size, layer_kwargs)
        return cls(inner, rank=rank, world_size=world_size, group=group, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if not self.gather_output or self.world_size == 1:
            return out
        rows = as_rows(out).contiguous()
        m, ns = rows.shape
        buf = rows.new_empty((self.world_size * m, ns))
        _all_gather(buf, rows, self.group)
        full = buf.view(self.world_size, m, ns).permute(1, 0, 2).reshape(m, self.world_size * ns)
        return full.reshape(*x.shape[:-1], self.world_size * ns)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gather_output={self.gather_output}"


class RowParallelLinear(_ParallelLinear):
    """Quantized linear with K (in features) split over the ranks.

    Rank r holds columns ``[r * K/world, (r+1) * K/world)`` of the weight and
    their scales (per-tensor and per-N scales replicated).  The input is this
    rank's K slice (``input_is_parallel=True``, e.g. the output of a
    :class:`ColumnParallelLinear` without gather) or the full activation,
    which is then sliced locally.  Partial outputs (in the layer's
    ``out_dtype``) are summed with ``all_reduce``; the bias is added once,
    to the reduced result.

    Parameters
    ----------
    inner : nn.Module
        This rank's quantized layer, built without bias (use :meth:`from_checkpoint`).
    bias : Tensor or bool, optional
        The whole ``[N]`` bias; ``True``: a zero ``[N]`` bias (a fresh layer
        that ``load_state_dict`` fills).
    rank, world_size : int
    group : ProcessGroup, optional
    input_is_parallel : bool

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers import Fp8BlockLinear
    >>> from scaledmm.layers.parallel import RowParallelLinear
    >>> t = {"weight": torch.randn(64, 256).to(torch.float8_e4m3fn), "weight_scale_inv": torch.ones(1, 2)}
    >>> layer = RowParallelLinear.from_checkpoint(Fp8BlockLinear, t, rank=0, world_size=2)
    >>> layer.inner.in_features
    128
    """

    _DIM = ROW

    def __init__(self, inner: nn.Module, *, rank: int, world_size: int, group=None, bias=None,
                 input_is_parallel: bool = True):
        super().__init__(inner, rank=rank, world_size=world_size, group=group)
        if getattr(inner, "bias", None) is not None:
            V.fail(type(self).__name__, "inner", "a layer without bias (the bias is added once, after the "
                   "all-reduce: pass it as bias=)", "a layer with a bias")
        self.input_is_parallel = bool(input_is_parallel)
        self.in_features = inner.in_features * world_size
        self.out_features = inner.out_features
        if isinstance(bias, bool):
            bias = inner.weight.new_zeros(self.out_features, dtype=inner.out_dtype) if bias else None
        if bias is not None:
            V.check_dtype(type(self).__name__, "bias", bias, V.FLOAT_OUT_DTYPES)
            V.check_shape(type(self).__name__, "bias", bias, (self.out_features,))
            bias = nn.Parameter(bias.detach().to(inner.out_dtype).contiguous(), requires_grad=False)
        self.bias = bias

    @classmethod
    def from_checkpoint(cls, layer_cls: type, tensors: dict[str, torch.Tensor], *, group=None,
                        rank: int | None = None, world_size: int | None = None, input_is_parallel: bool = True,
                        **layer_kwargs) -> "RowParallelLinear":
        """Slice the whole layer's checkpoint for this rank and build its layer
        (without bias; the wrapper keeps the bias).  Arguments as
        :meth:`ColumnParallelLinear.from_checkpoint`."""
        inner, bias, rank, world_size = cls._build(layer_cls, tensors, group, rank, world_size, layer_kwargs)
        return cls(inner, rank=rank, world_size=world_size, group=group, bias=bias,
                   input_is_parallel=input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        ks = self.inner.in_features
        if not self.input_is_parallel:
            if x.dim() < 1 or x.shape[-1] != self.in_features:
                V.fail(name, "x", f"last dim K = {self.in_features} (input_is_parallel=False)", tuple(x.shape))
            x = x.narrow(-1, self.rank * ks, ks).contiguous()  # the scatter: a local slice
        elif x.dim() < 1 or x.shape[-1] != ks:
            V.fail(name, "x", f"last dim K / world_size = {ks} (input_is_parallel=True)", tuple(x.shape))
        x2 = as_rows(x)
        out = self.local_product(x2).contiguous()
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    # -- the local partial product, with activation scales made global --------

    def _global_max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def local_product(self, x2: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce and the bias:
        ``x2`` (rows, this rank's ``K / world_size`` columns) times the weight
        shard, with dynamic activation scales taken over the whole K.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import Fp8BlockLinear
        >>> t = {"weight": torch.randn(64, 256).to(torch.float8_e4m3fn), "weight_scale_inv": torch.ones(1, 2)}
        >>> layer = RowParallelLinear.from_checkpoint(Fp8BlockLinear, t, rank=0, world_size=2)
        >>> layer.local_product(torch.randn(3, 128, dtype=torch.bfloat16)).shape
        torch.Size([3, 64])
        """
        inner = self.inner
        if not inner._processed:  # the dynamic paths below bypass inner.forward's check
            raise RuntimeError(f"{type(inner).__name__}: load the tensors first (from_checkpoint, "
                               "load_state_dict or process_weights_after_loading)")
        if isinstance(inner, Fp8Linear) and inner.activation != "static":
            return self._fp8_dynamic(x2)
        if isinstance(inner, NvFp4Linear) and inner.dynamic_input_scale and not inner.use_w4a16:
            return self._nvfp4_dynamic(x2)
        # Static scales, W4A16 and 1 x bk groups inside the shard: the local
        # quantization is already the unsharded one.
        return inner(x2)

    def _fp8_dynamic(self, x2: torch.Tensor) -> torch.Tensor:
        # Mirrors Fp8Linear.forward and reference_quant's dynamic scales, with
        # the amax taken over the whole K (all ranks).
        from scaledmm.ops import fp8 as fp8_ops
        inner = self.inner
        if inner.padded_in_features != inner.in_features:
            x2 = F.pad(x2, (0, inner.padded_in_features - inner.in_features))
        ax = x2.float().abs()
        if inner.activation == "dynamic_per_token":
            amax = self._global_max(ax.amax(dim=1, keepdim=True))
            scale = torch.clamp(amax, min=fp8_ops.AMAX_FLOOR) / amax.new_full((), fp8_ops.FP8_MAX)
            per_token = True
        else:
            finite = torch.where(torch.isfinite(ax), ax, 0.0).reshape(-1)
            amax = self._global_max(F.pad(finite, (0, 1)).amax().reshape(1))
            scale = torch.clamp(amax, min=fp8_ops.AMAX_FLOOR) / amax.new_full((), fp8_ops.FP8_MAX)
            per_token = False
        out = torch.ops.scaledmm.fp8_linear(x2, inner.weight, inner.weight_scale, scale, per_token, None,
                                            inner.out_dtype)
        return out[:, :inner.out_features]

    def _nvfp4_dynamic(self, x2: torch.Tensor) -> torch.Tensor:
        # NvFp4Linear's dynamic forward with the amax over all ranks (the op
        # floors it): every rank quantizes with the same global scale.
        inner = self.inner
        if inner._k_pad != inner.in_features:
            x2 = F.pad(x2, (0, inner._k_pad - inner.in_features))
        amax = self._global_max(F.pad(finite_row_amax(x2), (0, 1)).amax().reshape(1))  # 0 for M = 0
        out = torch.ops.scaledmm.nvfp4_dynamic_linear(x2, amax, inner.weight, inner.weight_scale,
                                                      inner._weight_alpha, inner.out_dtype, None)
        return out[:, :inner.out_features]

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", input_is_parallel={self.input_is_parallel}, "
                f"bias={self.bias is not None}")


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out = cat(inp of every rank)`` along dim 0 (torch >= 2.12 renamed the call)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)
