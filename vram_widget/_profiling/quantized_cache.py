"""transformers' quantized KV cache (``QuantizedCache`` with optimum-quanto) on fake tensors:
optimum-quanto's 4- and 2-bit packing made as it is made on real tensors.

- Packing. ``WeightQBitsTensor.__init__`` (optimum/quanto/tensor/weights/qbits.py) packs the
  codes into bytes only where ``type(data) is torch.Tensor``, so a ``FakeTensor``'s codes
  would stay one per byte (two or four times the real bytes). Inside
  :func:`quanto_on_fake`, a fake tensor's codes are packed by the same
  ``PackedTensor.pack`` (``pack_weights``: the ``zeros`` of the packed shape and each shifted
  slice OR-ed into it), so the fake run allocates what the real one does.
- Unpacking. On the CPU ``quanto::unpack`` is optimum-quanto's C++ extension
  (optimum/quanto/library/extensions/cpp/unpack.cpp, registered for ``"CPU"`` in its
  ``__init__.py``), which builds every masked and shifted piece in one C++ expression: the
  temporaries of ``t & mask`` live until ``torch::cat`` returns. The Python ``"default"``
  kernel a fake tensor reaches (optimum/quanto/library/unpack.py) frees each masked piece
  once it is shifted. Inside :func:`quanto_on_fake`, a fake tensor is unpacked in the C++
  kernel's order, with its temporaries held as long.

Both replacements apply to fake tensors only; a real tensor takes optimum-quanto's own code.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from .fake import FakeTensor

# transformers' QuantizedCache defaults (transformers/cache_utils.py, QuantizedLayer.__init__:
# nbits=4, axis_key=0, axis_value=0, q_group_size=64, residual_length=128) and the bits the
# quanto backend takes (QuantoQuantizedLayer.__init__: "has to be one of [`2`, `4`]")
QUANTO_BITS = (2, 4)


def require_quanto() -> Any:
    """optimum-quanto's tensor classes, or an ImportError naming the install."""
    try:
        from optimum.quanto.tensor.packed import PackedTensor
        from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor
    except ImportError:
        raise ImportError(
            "kv_cache='quantized' is transformers' QuantizedCache with the quanto backend, "
            "which needs optimum-quanto: pip install optimum-quanto"
        ) from None
    return PackedTensor, WeightQBitsTensor


def _unpack_as_cpp(data: torch.Tensor, bits: int) -> torch.Tensor:
    """``quanto::unpack`` in the order of optimum-quanto's C++ CPU kernel (unpack.cpp):
    every ``t & mask`` and each shift made before the ``cat``, all held until it returns."""
    if bits == 4:
        pieces = [data & 0x0F, data & 0xF0]
        shifted = [pieces[0], pieces[1].__rshift__(4)]
    else:
        pieces = [data & 0x03, data & 0x0C]
        shifted = [pieces[0], pieces[1].__rshift__(2)]
        pieces.append(data & 0x30)
        shifted.append(pieces[2].__rshift__(4))
        pieces.append(data & 0xC0)
        shifted.append(pieces[3].__rshift__(6))
    out = torch.cat(shifted, 0)
    del pieces, shifted
    return out


@contextlib.contextmanager
def quanto_on_fake() -> Iterator[None]:
    """optimum-quanto's packing and unpacking of fake tensors as on real ones (module
    docstring); restored after, whatever happens."""
    packed_cls, weight_cls = require_quanto()
    init = weight_cls.__init__
    unpack = packed_cls.unpack

    def packed_init(self, qtype, axis, group_size, size, stride, data, scale, shift, *rest):
        if isinstance(data, FakeTensor):
            data = packed_cls.pack(data, qtype.bits)
        init(self, qtype, axis, group_size, size, stride, data, scale, shift, *rest)

    def cpp_unpack(self):
        if not isinstance(self._data, FakeTensor):
            return unpack(self)
        # PackedTensor.unpack: the unpacked rows cut to the tensor's first dimension
        return _unpack_as_cpp(self._data, self._bits)[: self.shape[0]]

    weight_cls.__init__ = packed_init
    packed_cls.unpack = cpp_unpack
    try:
        yield
    finally:
        weight_cls.__init__ = init
        packed_cls.unpack = unpack


def check_full_attention(model: Any) -> None:
    """Refuse, by name, a model whose layers are not all full attention: transformers'
    ``QuantizedCache.__init__`` (transformers/cache_utils.py) raises "`QuantizedCache` is only
    supported for models with only full attention layers" for any other layer type, as its
    ``get_layer_types_and_kwargs(config)`` reads them (a ``sliding_window`` makes
    ``"sliding_attention"`` layers). Models that transformers' version cannot type pass."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # an older transformers: its QuantizedCache says so when run
        return
    config: Any = getattr(model, "config", None)
    try:
        layer_types, _kwargs = get_layer_types_and_kwargs(config)
    except (AttributeError, TypeError, ValueError):  # no decoder config to type
        return
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        raise ValueError(
            f"kv_cache='quantized' is transformers' QuantizedCache, which takes models whose "
            f"layers all have full attention (QuantizedCache.__init__, transformers/"
            f"cache_utils.py); {type(model).__name__} has {', '.join(other)} layers "
            "(config.layer_types, or its sliding_window): leave kv_cache=None for it"
        )


@contextlib.contextmanager
def asking_kv_cache(model: Any, cache_config: dict[str, object]) -> Iterator[None]:
    """``model``'s generation config asking for transformers' ``QuantizedCache`` with
    ``cache_config`` (``cache_implementation="quantized"``, as generate reads it) for the
    block; the model's own config restored after, whatever happens."""
    require_quanto()
    before = getattr(model, "generation_config", None)
    if before is None or not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"kv_cache='quantized' is the KV cache of generate(): {type(model).__name__} "
            "has no generate() and generation_config"
        )
    check_full_attention(model)
    config = copy.deepcopy(before)
    config.cache_implementation = "quantized"
    config.cache_config = dict(cache_config)
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = before
