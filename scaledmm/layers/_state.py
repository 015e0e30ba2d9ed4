"""State handling shared by the quantized layers.

A quantized layer keeps its tensors in the form its forward reads (padded,
swizzled), allocated in that form at construction; ``state_dict()`` holds
them as they are, and state derived from them (layouts, precomputed global
scales) is re-derived whenever the tensors may have changed: after
``load_state_dict`` and after ``_apply`` (``.to()``, ``.cuda()``,
``to_empty()``, ``.half()``, ...).  ``_apply`` moves the quantized tensors
but never converts their dtype; a float conversion changes only the output
dtype (and the bias, which is held in it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from scaledmm import validation as V

__all__ = ["QuantizedLinearBase", "checkpoint_entries"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _apply_to_bits(fn, t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` without a dtype change: ``fn`` sees the bits as integers,
    which ``Module.to(dtype)`` / ``.half()`` / ``.float()`` leave alone,
    while device moves, ``to_empty`` and ``share_memory_`` act as usual."""
    as_int = _INT_OF_SIZE[t.element_size()]
    out = fn(t.view(as_int))
    if out.dtype == as_int:
        return out.view(t.dtype)
    return t.to(device=out.device)  # a cast of integers too (Module.type): keep the dtype, follow the device


def checkpoint_entries(op: str, tensors, required, optional=()) -> dict[str, torch.Tensor]:
    """The ``required`` and present ``optional`` entries of a checkpoint dict,
    checked: a mapping, every required key present, every entry a Tensor, all
    on one device.  Raises ``ValueError`` naming the entry.

    Examples
    --------
    >>> import torch
    >>> from scaledmm.layers._state import checkpoint_entries
    >>> sorted(checkpoint_entries("op", {"weight": torch.ones(2)}, ("weight",), ("bias",)))
    ['weight']
    """
    if not isinstance(tensors, Mapping):
        V.fail(op, "tensors", "a dict of name -> Tensor", type(tensors).__name__)
    out = {}
    for key in required:
        if key not in tensors:
            V.fail(op, "tensors", f"a {key!r} entry", f"keys {sorted(tensors)}")
    for key in (*required, *optional):
        if key in tensors:
            t = tensors[key]
            if not isinstance(t, torch.Tensor):
                V.fail(op, key, "a Tensor (leave the key out when there is none)",
                       "None" if t is None else type(t).__name__)
            out[key] = t
    if out:
        V.check_same_device(op, **out)
    return out


class QuantizedLinearBase(nn.Module):
    """What the quantized linears share: dtype-stable ``_apply`` and
    re-derivation after ``load_state_dict``.

    Subclasses allocate every tensor in its forward layout in ``__init__``,
    set ``out_dtype`` and ``_processed = False``, and define
    ``_check_layout()`` (``ValueError`` when a tensor's shape or dtype is not
    the layout's) and ``_derive()`` (idempotent: recompute derived state from
    the state-dict tensors, in place when it already has its layout).
    """

    _OUT_DTYPES: tuple[torch.dtype, ...] = V.FLOAT_OUT_DTYPES
    # Tensors holding codes (fp8, packed e2m1, e4m3 block scales): a state dict
    # entry of another dtype is refused instead of being cast into codes.
    _CODE_TENSORS: tuple[str, ...] = ("weight",)

    def _check_layout(self) -> None:
        raise NotImplementedError

    def _derive(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Check the tensors' layout, re-derive what the forward precomputes
        from them and mark the layer ready.  Idempotent: on a ready layer it
        allocates nothing.  ``from_float``, ``from_checkpoint`` and
        ``load_state_dict`` call it; call it yourself after writing the
        tensors in place by other means.

        Examples
        --------
        >>> import torch
        >>> from scaledmm.layers import NvFp4Linear
        >>> a = NvFp4Linear.from_float(torch.nn.Linear(64, 32), input_amax=4.0)
        >>> b = NvFp4Linear(64, 32)
        >>> with torch.no_grad():  # tensors written in place, in the layer's layout
        ...     for name, t in a.state_dict().items():
        ...         _ = getattr(b, name).copy_(t)
        >>> b.process_weights_after_loading()
        >>> x = torch.randn(2, 64)
        >>> torch.equal(a(x), b(x))
        True
        """
        self._check_layout()
        self._derive()
        self._processed = True

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        name = type(self).__name__
        for key in self._CODE_TENSORS:
            given, held = state_dict.get(prefix + key), getattr(self, key)
            if isinstance(given, torch.Tensor) and held is not None and given.dtype != held.dtype:
                error_msgs.append(f"{name}: {prefix + key}: expected dtype {held.dtype} (codes are never "
                                  f"converted), got {given.dtype}")
                return
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if len(error_msgs) > errors:  # load_state_dict raises; the layer stays as ready as it was
            return
        own = [k for k, t in (*self._parameters.items(), *self._buffers.items())
               if t is not None and k not in self._non_persistent_buffers_set]
        ready = self._processed
        try:
            self.process_weights_after_loading()
        except ValueError as e:
            error_msgs.append(str(e))
            return
        # Ready once every tensor has been loaded (now or before): a partial load
        # (strict=False) does not make a fresh layer's placeholders usable.
        self._processed = ready or all(prefix + k in state_dict for k in own)

    def _apply(self, fn, recurse=True):
        own = {id(t) for t in (*self._parameters.values(), *self._buffers.values()) if t is not None}
        super()._apply(lambda t: _apply_to_bits(fn, t) if id(t) in own else fn(t), recurse)
        # A float conversion is recognized by what it does to a float tensor.
        want = fn(torch.empty(0, dtype=self.out_dtype, device=self.weight.device)).dtype
        if want in self._OUT_DTYPES:
            self.out_dtype = want
        with torch.no_grad():
            bias = getattr(self, "bias", None)
            if bias is not None and bias.dtype != self.out_dtype:
                bias.data = bias.data.to(self.out_dtype)
            self._derive()
        return self
