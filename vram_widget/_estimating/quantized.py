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

torchao's weight-only tensor subclasses, as ``quantize_`` makes them:

- ``int8-torchao`` (``Int8Tensor.from_hp`` with ``PerRow()``,
  torchao/quantization/quantize_/workflows/int8/int8_tensor.py): ``qdata``, the n int8
  values; ``scale``, one float32 per output row (``scale_dtype=torch.float32``); and
  ``zero_point``, one int8 per row (symmetric: zeros, kept all the same).
- ``int4-torchao`` on the CPU (``Int4OpaqueTensor.from_hp``,
  torchao/prototype/quantization/int4/int4_opaque_tensor.py): ``qdata``, torch's
  ``_convert_weight_to_int4pack_for_cpu`` packing, two values a byte, ``out x in / 2``
  uint8; ``scale_and_zero``, ``in / group_size x out x 2`` in the weight's own dtype
  (``pack_tinygemm_scales_and_zeros``).
- ``nf4-torchao`` (``NF4Tensor.from_tensor``,
  torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py), n values in
  b = n / block_size blocks, their b scalers in s = b / scaler_block_size blocks:
  ``quantized_data``, two 4-bit codes a byte, n / 2 uint8; ``quantized_scalers``, b int8;
  ``quantization_factor``, s values in the weight's dtype, except that for s = 1 the
  ``quantization_factor[:, 0]`` of the ``(s, scaler_block_size)`` tensor it is cut from
  is already contiguous (a one-element dimension's stride does not count), so
  ``.contiguous()`` keeps the whole ``scaler_block_size`` values' storage;
  ``scaler_mean``, one value; ``nf4``, the 16-value lookup table (both in the weight's dtype).
"""

from __future__ import annotations

import dataclasses

from .options import Device, Mode
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


def quantized_bytes(
    shape: tuple[int, ...], weights: Weights, itemsize: int = _F32
) -> QuantizedBytes:
    """What bitsandbytes (or torchao) stores for a weight of ``shape`` (``(out, in)``) in
    ``weights``' format; ``itemsize``: the bytes of one value of the weight's own dtype
    (torchao's int4 keeps its scales and zeros in it).

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

    torchao's int8: the values, a float32 scale and an int8 zero point per row (4,096 x 5 B);
    its int4 in bf16, groups of 128: half a byte a value, and 32 x 4,096 (scale, zero) pairs
    of 2 B each:

    >>> quantized_bytes((4096, 4096), Weights("int8-torchao")).total_bytes
    16797696
    >>> b = quantized_bytes((4096, 4096), Weights("int4-torchao"), itemsize=2)
    >>> b.codes_bytes, b.scales_bytes
    (8388608, 524288)

    torchao's NF4Tensor in bf16: 8,388,608 B of codes, 262,144 int8 scalers (blocks of 64),
    1,024 quantization factors (2,048 B), the mean (2 B) and the 16-value table (32 B):

    >>> b = quantized_bytes((4096, 4096), Weights("nf4-torchao"), itemsize=2)
    >>> b.codes_bytes, b.scales_bytes, b.state_bytes
    (8388608, 262144, 2082)
    """
    n = 1
    for d in shape:
        n *= int(d)
    out = int(shape[0])
    if weights.format is WeightFormat.INT8_TORCHAO:
        return QuantizedBytes(n, _F32 * out, out)  # qdata, scale (f32), zero_point (int8)
    if weights.format is WeightFormat.INT4_TORCHAO:
        groups = int(shape[-1]) // weights.group_size
        return QuantizedBytes(n // 2, groups * out * 2 * itemsize, 0)
    if weights.format is WeightFormat.NF4_TORCHAO:
        blocks = n // weights.blocksize
        factors = blocks // weights.scaler_blocksize
        if factors == 1:  # the (1, scaler_block_size) tensor's storage is kept
            factors = weights.scaler_blocksize
        return QuantizedBytes(n // 2, blocks, itemsize * (factors + 1 + _CODE_4BIT))
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


def quantized_tensor_bytes(
    shape: tuple[int, ...], weights: Weights, itemsize: int = _F32
) -> tuple[int, ...]:
    """The bytes of each tensor bitsandbytes stores for a weight of ``shape``, codes first:
    each its own storage (one allocation; the 4-bit code table and the nested 8-bit map are
    copies per weight, ``quantize_4bit``: ``code.to(A.device)``, ``quantize_blockwise``:
    ``code.to(A.device, copy=True)``). Their sum is :func:`quantized_bytes`' total.

    Examples
    --------
    nf4 with double quantization, 40 x 96: 1,920 B of codes, 60 uint8 maxima, the 16-value
    float32 code, the float32 offset, one nested float32 maximum and the 256-value map:

    >>> quantized_tensor_bytes((40, 96), Weights("nf4", double_quant=True))
    (1920, 60, 64, 4, 4, 1024)
    >>> quantized_tensor_bytes((40, 96), Weights("int8"))  # codes, one float32 scale a row
    (3840, 160)
    """
    b = quantized_bytes(shape, weights, itemsize)
    if weights.format is WeightFormat.INT8:
        return (b.codes_bytes, b.scales_bytes)
    if weights.format is WeightFormat.INT8_TORCHAO:  # Int8Tensor: qdata, scale, zero_point
        return (b.codes_bytes, b.scales_bytes, b.state_bytes)
    if weights.format is WeightFormat.INT4_TORCHAO:  # Int4OpaqueTensor: qdata, scale_and_zero
        return (b.codes_bytes, b.scales_bytes)
    if weights.format is WeightFormat.NF4_TORCHAO:
        raise ValueError("quantized_tensor_bytes: 'nf4-torchao' is laid out by torchtune")
    code = _F32 * _CODE_4BIT
    if not weights.double_quant:
        return (b.codes_bytes, b.scales_bytes, code)
    nested = b.state_bytes - _F32 * (_CODE_4BIT + _DYNAMIC_MAP + 1)
    return (b.codes_bytes, b.scales_bytes, code, _F32, nested, _F32 * _DYNAMIC_MAP)


def check_quantized(
    weights: Weights, mode: Mode, lora_rank: int | None, gpus: int, *, estimating: bool = True
) -> None:
    """Refuse, before any profiling, the steps with quantized weights that are not
    estimated (``estimating``) or measured: int8 training, a 4-bit training step without
    LoRA adapters, more than one GPU. Generation is estimated on every format: its decode
    steps run on the quantized copy, as inference does.

    Examples
    --------
    >>> check_quantized(Weights("int8"), Mode.TRAIN, None, 1)
    Traceback (most recent call last):
    ...
    ValueError: weights='int8' is for inference: ...
    """
    fmt = weights.format
    assert fmt is not None
    nf4_torchao = fmt is WeightFormat.NF4_TORCHAO
    if weights.torchao and not nf4_torchao and mode is Mode.TRAIN:
        raise ValueError(
            f"weights={fmt.value!r} is for inference: torchao's weight-only configs "
            "(Int8WeightOnlyConfig, Int4WeightOnlyConfig) are post-training quantization; "
            "quantize_ makes each weight a frozen tensor subclass (nn.Parameter(..., "
            "requires_grad=False), torchao/quantization/quant_api.py) whose linear has no "
            "weight gradient, and torchao trains through QAT or float8 training instead. "
            "Use mode='inference', or weights='nf4' or 'nf4-torchao' with lora_rank=... "
            "(QLoRA)"
        )
    if fmt is WeightFormat.INT8 and mode is Mode.TRAIN:
        raise ValueError(
            "weights='int8' is for inference: LLM.int8 weights are frozen int8 codes "
            "(bitsandbytes' Int8Params, has_fp16_weights=False) that take no gradient, and "
            "training with them is through LoRA adapters only (PEFT's lora.Linear8bitLt), "
            "which is not estimated yet; use mode='inference', or weights='nf4' with "
            "lora_rank=... (QLoRA)"
        )
    if mode is Mode.TRAIN and lora_rank is None and nf4_torchao:
        raise ValueError(
            "weights='nf4-torchao' in training needs lora_rank=...: torchtune's QLoRA "
            "freezes the NF4 base weights (FrozenNF4Linear, LoRALinear(quantize_base=True)) "
            "and trains LoRA adapters on them (lora_rank=8, ...), or use mode='inference'"
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


def check_weights_device(weights: Weights, device: Device | str) -> None:
    """Refuse, before any profiling, a torchao format on a device it is not estimated on:
    ``int4-torchao`` is torchao's CPU format (``Int4OpaqueTensor``, whose ``from_hp``
    asserts a CPU tensor). torchao 0.18's ``Int4WeightOnlyConfig`` packs for CUDA through
    mslk's kernels (``"plain"``, ``"preshuffled"``) or tinygemm (``"tile_packed_to_4d"``,
    compute capability 8.0+), and for XPU / NPU (``"plain_int32"``)
    (torchao/quantization/quantize_/workflows/int4/): none of them runs on the CPU, and
    their layouts are built by GPU kernels, which the CPU profile cannot run.

    Examples
    --------
    >>> check_weights_device(Weights("int4-torchao"), "cpu")
    >>> check_weights_device(Weights("int4-torchao"), "cuda")
    Traceback (most recent call last):
    ...
    ValueError: weights='int4-torchao' is estimated on device='cpu' only: ...
    """
    if weights.format is WeightFormat.INT4_TORCHAO and str(device) != Device.CPU.value:
        raise ValueError(
            "weights='int4-torchao' is estimated on device='cpu' only: there torchao packs "
            "int4 as Int4OpaqueTensor (PrototypeInt4WeightOnlyConfig, torch's "
            "_weight_int4pack_mm_for_cpu). On CUDA, torchao 0.18's Int4WeightOnlyConfig "
            "packs with int4_packing_format 'plain' or 'preshuffled' (mslk kernels) or "
            "'tile_packed_to_4d' (tinygemm, compute capability 8.0+), layouts made by GPU "
            f"kernels that a profile cannot build (device={str(device)!r}). Use "
            "device='cpu', or weights='int8-torchao', estimated on both"
        )


def int8_outlier_note(weights: Weights) -> str:
    """What an int8 estimate with an outlier threshold assumes ("" without one).

    LLM.int8's forward (``MatMul8bitLt``, bitsandbytes/autograd/_functions.py) quantizes its
    fp16 input row-wise; with ``threshold > 0`` the kernel first takes the mask of the values
    at or above it (``int8_vectorwise_quant``: ``outliers = A.abs() >= threshold``, held
    through the quantization) and, where ``outliers.any()``, the columns holding one
    (``outlier_cols``) are zeroed in the codes and multiplied apart in fp16
    (``int8_mixed_scaled_mm``: ``subA = A[:, outlier_cols]``, the weight's columns
    dequantized, ``output.addmm(subA, subB)``). The mask is estimated exactly; the split
    depends on the activations' values, which fake tensors do not have.

    Examples
    --------
    >>> int8_outlier_note(Weights("int8", int8_threshold=0.0))
    ''
    """
    if weights.format is not WeightFormat.INT8 or weights.int8_threshold <= 0:
        return ""
    return (
        f"weights='int8' with llm_int8_threshold={weights.int8_threshold}: estimated for "
        "inputs with no value at or above the threshold (no outlier column; the threshold's "
        "mask is counted). Each outlier column adds LLM.int8's fp16 split of it "
        "(int8_mixed_scaled_mm: the input's and the weight's columns in fp16 and a second "
        "output), which depends on the activations' values: where every column is one, "
        "at most the sum over the int8 layers of int8_outlier_bound_bytes(rows, in, out) "
        "more (vram_widget._estimating.quantized)"
    )


def int8_outlier_bound_bytes(rows: int, in_features: int, out_features: int) -> int:
    """The most one ``Linear8bitLt`` forward with an outlier threshold adds to the
    no-outlier step where every input column holds an outlier, for an input of ``rows``
    rows: the sum of every allocation the split makes (each freed within the forward but
    ``outlier_cols``, which the layer's state keeps as ``state.idx``), n = rows x in:

    - ``int8_vectorwise_quant`` (bitsandbytes/backends/default/ops.py): the columns'
      ``any`` (in bytes) and ``argwhere`` (8 x in), ``A[outliers]`` (its int64 indices,
      16 n, and fp16 values, 2 n) and their clone (2 n), the zeroing and the restore
      through the mask (16 n of indices each), the codes' columns zeroed (``out_row[:,
      outlier_cols] = 0``: at most 16 n of indices);
    - ``int8_mixed_scaled_mm``: ``A[:, outlier_cols]`` (2 n), the weight's int8 columns
      (out x in), dequantized in float32 (``A * stats * (1 / 127)``: two of 4 x out x in)
      and cast to fp16 (2 x out x in), and the output's ``addmm`` (2 x rows x out).

    Examples
    --------
    >>> int8_outlier_bound_bytes(1, 784, 512)  # 9 x 784 + 70 x 784 + 11 x 512 x 784 + 1,024
    4478448
    """
    n = rows * in_features
    weight = out_features * in_features
    return 9 * in_features + (16 * 4 + 2 * 3) * n + 11 * weight + 2 * rows * out_features
