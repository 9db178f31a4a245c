"""Quantized base weights (bitsandbytes), numpy only: what each format stores per weight
matrix, and which steps are refused before any profiling.

The stored layout of one ``out x in`` weight of n = out * in values
(bitsandbytes/functional.py, ``quantize_4bit`` and ``quantize_blockwise``;
bitsandbytes/nn/modules.py, ``Params4bit`` and ``Int8Params``):

- 4-bit (nf4 / fp4), blocks of ``blocksize`` (b = ceil(n / blocksize) blocks): the codes
  packed two per byte, ``ceil(n / 2)`` bytes (in ``quant_storage``: the same bytes, rounded
  up to its item size); the block maxima, b float32; the 16-entry float32 code of the
  format. With double quantization the maxima are stored as b uint8 codes of the dynamic
  8-bit map in blocks of 256, with ceil(b / 256) float32 nested maxima, the map's own 256
  float32 values (a copy per weight: ``code.to(A.device, copy=True)``) and one float32 offset.
- int8 (LLM.int8): the n int8 codes and one float32 scale per output row (``SCB``).
"""

from __future__ import annotations

import dataclasses

from .options import Mode
from .recipe.weights import WeightFormat, Weights

# float32 item size; the 4-bit formats' 16-value code; the dynamic 8-bit map's 256 values
# (bitsandbytes/functional.py: get_4bit_type, create_dynamic_map), the nested block size
_F32 = 4
_CODE_4BIT = 16
_DYNAMIC_MAP = 256
_NESTED_BLOCK = 256
_ITEMSIZE = {"uint8": 1, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class QuantizedBytes:
    """The bytes bitsandbytes stores for one quantized weight.

    Attributes
    ----------
    codes_bytes : int
        The packed 4-bit codes or the int8 codes.
    scales_bytes : int
        Block maxima (4-bit: float32, or uint8 with double quantization) or row scales.
    state_bytes : int
        The rest of the quant state: the 4-bit code table, and with double quantization
        the nested maxima, the 8-bit map and the offset.
    """

    codes_bytes: int
    scales_bytes: int
    state_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.codes_bytes + self.scales_bytes + self.state_bytes


def quantized_bytes(shape: tuple[int, ...], weights: Weights) -> QuantizedBytes:
    """What bitsandbytes stores for a weight of ``shape`` (``(out, in)``) in ``weights``'
    format.

    Examples
    --------
    A 4096 x 4096 nf4 weight with double quantization: 16,777,216 values, 8,388,608 B of
    codes; 262,144 blocks of 64 -> 262,144 uint8 maxima; 1,024 nested float32 maxima
    (4,096 B) + the 256-value map (1,024 B) + the offset (4 B) + the 16-value code (64 B):

    >>> b = quantized_bytes((4096, 4096), Weights("nf4", double_quant=True))
    >>> b.codes_bytes, b.scales_bytes, b.state_bytes
    (8388608, 262144, 5188)

    int8: one byte per value and one float32 scale per row:

    >>> quantized_bytes((4096, 4096), Weights("int8")).total_bytes
    16793600
    """
    n = 1
    for d in shape:
        n *= int(d)
    if weights.format is WeightFormat.INT8:
        return QuantizedBytes(n, _F32 * int(shape[0]), 0)
    if weights.format is None:
        raise ValueError("quantized_bytes needs a quantized format (weights='nf4', ...)")
    item = _ITEMSIZE[weights.quant_storage]
    packed = -(-n // 2)
    codes = -(-packed // item) * item
    blocks = -(-n // weights.blocksize)
    if not weights.double_quant:
        return QuantizedBytes(codes, _F32 * blocks, _F32 * _CODE_4BIT)
    nested = -(-blocks // _NESTED_BLOCK)
    state = _F32 * (_CODE_4BIT + nested + _DYNAMIC_MAP + 1)
    return QuantizedBytes(codes, blocks, state)


def check_quantized(
    weights: Weights, mode: Mode, lora_rank: int | None, gpus: int, *, estimating: bool = True
) -> None:
    """Refuse, before any profiling, the steps with quantized weights that are not
    estimated (``estimating``) or measured: int8 training, a 4-bit training step without
    LoRA adapters, more than one GPU; and int8 at its outlier threshold in an estimate.

    Examples
    --------
    >>> check_quantized(Weights("int8"), Mode.TRAIN, None, 1)
    Traceback (most recent call last):
    ...
    ValueError: weights='int8' is for inference: ...
    """
    fmt = weights.format
    assert fmt is not None
    if fmt is WeightFormat.INT8 and mode is Mode.TRAIN:
        raise ValueError(
            "weights='int8' is for inference: LLM.int8 weights are frozen int8 codes "
            "(bitsandbytes' Int8Params, has_fp16_weights=False) that take no gradient, and "
            "training with them is through LoRA adapters only (PEFT's lora.Linear8bitLt), "
            "which is not estimated yet; use mode='inference', or weights='nf4' with "
            "lora_rank=... (QLoRA)"
        )
    if fmt is WeightFormat.INT8 and estimating and weights.int8_threshold > 0:
        raise ValueError(
            f"weights='int8' with its outlier threshold {weights.int8_threshold} is not "
            "estimated: LLM.int8's forward splits out the input columns above the threshold "
            "(llm_int8_threshold, BitsAndBytesConfig's default 6.0), so its temporaries "
            "depend on the activations' values, which fake tensors do not have. "
            "Weights('int8', int8_threshold=0.0) (no outlier split) is estimated; "
            "measure(model, inputs, mode='inference', weights='int8') measures the default"
        )
    if mode is Mode.TRAIN and lora_rank is None:
        raise ValueError(
            f"weights={fmt.value!r} in training needs lora_rank=...: the quantized weights "
            "are frozen (replace_with_bnb_linear makes them requires_grad=False) and "
            "transformers' Trainer refuses to fine-tune a purely quantized model; QLoRA "
            "trains LoRA adapters on them (lora_rank=8, ...), or use mode='inference'"
        )
    if gpus > 1:
        raise ValueError(f"weights={fmt.value!r} is estimated on one GPU (gpus=1) for now")
