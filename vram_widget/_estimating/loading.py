"""The memory of a loaded model, numpy-free arithmetic: the weights and buffers resident on the
device once the model is loaded at a dtype (and its Linear weights quantized), before any step.

What "loaded" means follows the real loaders (the tensors each leaves, read by
``_profiling/loading.py``):

- ``model.to(dtype)`` for a plain module: every floating parameter and buffer cast to the
  dtype, the others (integer buffers) as they are; tied parameters once.
- Hugging Face's ``from_pretrained(..., dtype=..., quantization_config=...)``: the model is
  built under the dtype as the default (``local_torch_dtype``, transformers/modeling_utils.py)
  and each checkpoint tensor cast to the dtype the built model holds
  (``convert_and_load_state_dict_in_model``, transformers/core_model_loading.py: ``_dtype =
  empty_param.dtype``), so a buffer the model makes in float32 on purpose (a rotary
  ``inv_freq``) stays float32; ``_keep_in_fp32_modules`` (with fp16) and
  ``_keep_in_fp32_modules_strict`` (fp16 and bf16) stay float32 (``_get_dtype_plan``). With a
  ``BitsAndBytesConfig`` the Linear layers ``replace_with_bnb_linear`` replaces hold
  bitsandbytes' stored layout (:func:`~vram_widget._estimating.quantized.quantized_bytes`),
  and the modules it keeps (``lm_head``, tied weights, ``_keep_in_fp32_modules``) stay in the
  dtype.

On CUDA each tensor is one block of the caching allocator, rounded up to 512 bytes
(``round_size``, allocator.py); reserved is what the allocator holds once the tensors are
allocated one after another with nothing freed between (:func:`~vram_widget._estimating
.allocator.replay`). A real loader also makes temporaries on the device (a weight in the
dtype before bitsandbytes quantizes it, casts), whose freed blocks may stay cached: they are
not in the reserved figure (UNCONFIRMED on a GPU).
"""

from __future__ import annotations

import dataclasses

from .allocator import replay, round_size
from .options import Device, Precision
from .quantized import quantized_tensor_bytes
from .recipe.weights import Weights

# The dtypes a loaded tensor may hold, and their item sizes
ITEMSIZE = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8, "complex128": 16,
}  # fmt: skip

# the dtype the weights are loaded in for each precision: autocast keeps fp32 weights
LOAD_DTYPES = {
    Precision.FP32: "float32",
    Precision.BF16: "bfloat16",
    Precision.FP16: "float16",
    Precision.AMP_BF16: "float32",
    Precision.AMP_FP16: "float32",
}


@dataclasses.dataclass(frozen=True)
class LoadedTensor:
    """One tensor a loader leaves on the device.

    Attributes
    ----------
    name : str
        Its qualified name (tied parameters once).
    shape : tuple of int
        Its shape; a quantized weight's is the original ``(out, in)``.
    dtype : str
        Its torch dtype's name; ``""`` for a quantized weight (its layout is bitsandbytes').
    buffer : bool
        A buffer (else a parameter).
    storage_bytes : tuple of int
        A quantized weight's storages as the profiling run made them, codes first (torchao's
        ``NF4Tensor``: its inner tensors, made by ``to_nf4`` on a fake tensor); empty where
        its layout is computed (:func:`~vram_widget._estimating.quantized
        .quantized_tensor_bytes`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    buffer: bool = False
    storage_bytes: tuple[int, ...] = ()

    @property
    def quantized(self) -> bool:
        return self.dtype == ""


@dataclasses.dataclass(frozen=True)
class LoadLayout:
    """What one loader leaves: the tensors, in the order they are loaded, and which loader
    (``"from_pretrained"`` or ``"model.to"``) with notes on what was assumed."""

    tensors: tuple[LoadedTensor, ...]
    loader: str
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoadEstimate:
    """The device memory of a loaded model, before any step.

    Attributes
    ----------
    parameter_bytes : int
        The parameters that stay in a float (or integer) dtype, tied ones once.
    quantized_bytes : int
        The quantized weights' codes (4-bit packed, or int8).
    quant_state_bytes : int
        Their scales and quant state (block maxima, nested maxima, code tables; int8's row
        scales).
    buffer_bytes : int
        The buffers.
    rounding_bytes : int
        The CUDA caching allocator's 512-byte rounding of each tensor (0 on the CPU).
    allocated_bytes : int
        All of the above: ``torch.cuda.memory_allocated()`` after the load (on the CPU, the
        allocator's bytes in use).
    reserved_bytes : int
        ``torch.cuda.memory_reserved()`` for the same tensors allocated one after another
        (the CPU: equal to ``allocated_bytes``).
    dtype_bytes : tuple of (str, int)
        Tensor bytes by dtype (``"nf4"`` / ``"fp4"`` / ``"int8"`` for the quantized weights
        with their state), largest first.
    precision, dtype, weights, device, loader : str
        The setting: the precision, the dtype it loads the weights in, the quantization
        (``Weights.describe()``, "" when none), the device and the loader followed.
    notes : tuple of str
        What the figure assumes.

    Examples
    --------
    >>> import torch
    >>> from vram_widget import profile_model
    >>> p = profile_model(torch.nn.Linear(64, 32), input_size=(64,), device="cuda")
    >>> e = p.load_bytes(precision="fp16")
    >>> e.parameter_bytes, e.allocated_bytes  # (64 x 32 + 32) x 2 B; two 512-B blocks
    (4160, 4608)
    """

    parameter_bytes: int
    quantized_bytes: int
    quant_state_bytes: int
    buffer_bytes: int
    rounding_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    dtype_bytes: tuple[tuple[str, int], ...]
    precision: str
    dtype: str
    weights: str
    device: str
    loader: str
    notes: tuple[str, ...] = ()

    @property
    def tensor_bytes(self) -> int:
        """The tensors' own bytes (``allocated_bytes`` less the rounding)."""
        return self.allocated_bytes - self.rounding_bytes

    def summary(self) -> str:
        """One line: what is resident once the model is loaded.

        Examples
        --------
        >>> e = LoadEstimate(2048, 0, 0, 0, 0, 2048, 2048, (("bfloat16", 2048),), "bf16",
        ...                  "bfloat16", "", "cpu", "model.to")
        >>> e.summary()
        'loaded (bf16 weights, model.to): 2.0 KiB allocated (weights 2.0 KiB)'
        """
        weights = f"{self.weights.split(' ')[0]} + " if self.weights else ""
        head = f"loaded ({weights}{self.precision} weights, {self.loader}): "
        body = f"{_size(self.allocated_bytes)} allocated"
        if self.reserved_bytes != self.allocated_bytes:
            body += f", {_size(self.reserved_bytes)} reserved"
        parts = [f"weights {_size(self.parameter_bytes + self.quantized_bytes)}"]
        if self.quant_state_bytes:
            parts.append(f"quant state {_size(self.quant_state_bytes)}")
        if self.buffer_bytes:
            parts.append(f"buffers {_size(self.buffer_bytes)}")
        if self.rounding_bytes:
            parts.append(f"512-B rounding {_size(self.rounding_bytes)}")
        return f"{head}{body} ({', '.join(parts)})"


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def load_estimate(
    layout: LoadLayout, precision: Precision, weights: Weights, device: Device
) -> LoadEstimate:
    """The :class:`LoadEstimate` of a layout on ``device``.

    Examples
    --------
    Two Linear layers (16 x 8 and 4 x 16, with biases) loaded in bf16 by ``model.to``:
    (128 + 16 + 64 + 4) x 2 B = 424 B on the CPU; on CUDA each of the 4 tensors is one
    512-byte block, 2,048 B in one 2 MiB segment:

    >>> t = lambda n, s: LoadedTensor(n, s, "bfloat16")
    >>> layout = LoadLayout((t("0.weight", (16, 8)), t("0.bias", (16,)),
    ...                      t("1.weight", (4, 16)), t("1.bias", (4,))), "model.to")
    >>> cpu = load_estimate(layout, Precision.BF16, Weights(), Device.CPU)
    >>> cpu.allocated_bytes, cpu.reserved_bytes
    (424, 424)
    >>> cuda = load_estimate(layout, Precision.BF16, Weights(), Device.CUDA)
    >>> cuda.allocated_bytes, cuda.rounding_bytes, cuda.reserved_bytes
    (2048, 1624, 2097152)
    """
    params = codes = state = buffers = 0
    by_dtype: dict[str, int] = {}
    allocations: list[int] = []
    itemsize = ITEMSIZE[LOAD_DTYPES[precision]]
    for t in layout.tensors:
        if t.quantized:
            sizes = t.storage_bytes or quantized_tensor_bytes(t.shape, weights, itemsize)
            codes += sizes[0]
            state += sum(sizes[1:])
            assert weights.format is not None
            key = weights.format.value
        else:
            sizes = (_numel(t.shape) * ITEMSIZE[t.dtype],)
            if t.buffer:
                buffers += sizes[0]
            else:
                params += sizes[0]
            key = t.dtype
        by_dtype[key] = by_dtype.get(key, 0) + sum(sizes)
        allocations.extend(sizes)
    tensor_bytes = params + codes + state + buffers
    cuda = device is Device.CUDA
    allocated = sum(round_size(n) for n in allocations if n > 0) if cuda else tensor_bytes
    reserved = replay(allocations, [], iterations=1).reserved_at_end_bytes if cuda else allocated
    return LoadEstimate(
        parameter_bytes=params,
        quantized_bytes=codes,
        quant_state_bytes=state,
        buffer_bytes=buffers,
        rounding_bytes=allocated - tensor_bytes,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        dtype_bytes=tuple(sorted(by_dtype.items(), key=lambda kv: (-kv[1], kv[0]))),
        precision=precision.value,
        dtype=LOAD_DTYPES[precision],
        weights=weights.describe(),
        device=device.value,
        loader=layout.loader,
        notes=layout.notes,
    )
